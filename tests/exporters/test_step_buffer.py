"""The C recorder's step buffer (``_fastrecord.StepBuffer``, issue 15, cold memory): a deque of
``StepRecord`` tuples to the export thread, filled by a host-timed step's end as plain C slots
whose tuple, ints, folded wait and empty phase dict are made when the step is first read."""

from __future__ import annotations

import collections
import gc
import logging
import random
import weakref
from typing import Any

import pytest

from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters._recorder import FAST_RECORDER, UNSAMPLED, StepRecorder, SystemClock
from stepwatch.exporters._sampling import PhaseSampler

pytestmark = pytest.mark.skipif(FAST_RECORDER is None, reason="_fastrecord is not built")


def _buffer() -> Any:
    from stepwatch.exporters import _fastrecord

    return _fastrecord.StepBuffer()


def _recorder(cls: Any = None, buffer_steps: int = 1000) -> Any:
    return (cls or FAST_RECORDER)(
        clock=SystemClock(),
        device_timer=None,
        kernel_source=None,
        buffer_steps=buffer_steps,
        log=RateLimitedLog(logging.getLogger("test-step-buffer"), 0.0),
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_buffer_answers_as_a_deque_through_growth_and_wrap_around(seed: int) -> None:
    rng = random.Random(seed)
    reference: collections.deque[Any] = collections.deque()
    buffer = _buffer()
    counter = 0
    for _ in range(3000):
        action = rng.random()
        if action < 0.55:
            counter += 1
            record = (counter, counter * 10, counter * 10 + 5, {"data": counter}, None, None)
            reference.append(record)
            buffer.append(record)
        elif action < 0.85 and reference:
            assert buffer.popleft() is reference.popleft()
        elif action < 0.9:
            index = rng.randrange(-len(reference) - 2, len(reference) + 2)
            if -len(reference) <= index < len(reference):
                assert buffer[index] is reference[index]
            else:
                with pytest.raises(IndexError):
                    buffer[index]
        elif action < 0.995:
            assert list(buffer) == list(reference)
        else:
            buffer.clear()
            reference.clear()
        assert len(buffer) == len(reference) and bool(buffer) == bool(reference)
    with pytest.raises(IndexError):
        _buffer().popleft()
    with pytest.raises(TypeError):
        type(buffer)([1])


def test_a_backlog_past_the_kept_size_is_freed_and_the_buffer_still_works() -> None:
    buffer = _buffer()
    for index in range(70_000):
        buffer.append((index,))
    assert buffer[-1] == (69_999,) and len(buffer) == 70_000
    for index in range(70_000):
        assert buffer.popleft() == (index,)
    assert not buffer
    buffer.append(("again",))
    assert list(buffer) == [("again",)]


def test_the_buffer_is_traversed_by_the_garbage_collector() -> None:
    class Token:
        pass

    buffer = _buffer()
    token = Token()
    buffer.append((buffer, token))  # a cycle only the buffer's record closes
    alive = weakref.ref(token)
    del buffer, token
    gc.collect()
    assert alive() is None


def _steps(recorder: Any, plan: list[dict[str, Any]]) -> list[Any]:
    """Run ``plan``'s steps on ``recorder`` at given instants; each step's phases (explicit),
    exposed wait (C only: the pre-gate's field) and whether auto mode times it."""
    for number, step in enumerate(plan):
        recorder.sampler = PhaseSampler(1 if step.get("timed") else 1 << 62)
        recorder.begin_step(explicit=True, now_ns=1000 * number)
        for name, ns in step.get("phases", {}).items():
            recorder.add_phase_ns(name, ns)
        for name, ns in step.get("auto", {}).items():
            recorder.add_sampled_phase_ns(name, ns)
        if step.get("wait"):
            if hasattr(recorder, "_wait_ns"):
                recorder._wait_ns += step["wait"]
            else:
                recorder.add_phase_ns("communication", step["wait"])
        recorder.end_step(explicit=True, now_ns=1000 * number + 400 + number)
    return list(recorder.buffer)


PLAN: list[dict[str, Any]] = [
    {},  # nothing: an empty phase dict
    {"wait": 70},  # the wait alone: {"communication": 70}
    {"phases": {"data": 5, "communication": 3}, "wait": 9},  # the wait added to a phase
    {"phases": {"data": 6}, "timed": True, "auto": {"forward": 11, "backward": 22}},
    {"timed": True},  # a timed step with no auto phase: its own empty dict
    {"phases": {"data": 7}},
]


@pytest.mark.parametrize("watched", [False, True])
def test_compact_steps_read_as_the_python_recorder_writes_them(watched: bool) -> None:
    fast, slow = _recorder(), _recorder(StepRecorder)
    assert type(fast.buffer).__name__ == "StepBuffer" and type(slow.buffer) is collections.deque
    fast.watchers = slow.watchers = int(watched)
    records = _steps(fast, PLAN)
    assert records == _steps(slow, PLAN)
    assert records[1][3] == {"communication": 70} and records[2][3]["communication"] == 12
    if watched:
        assert records[0][5] is UNSAMPLED and records[3][5] == {"forward": 11, "backward": 22}
        assert records[4][5] == {} and records[4][5] is not records[3][5]
    else:
        assert all(record[5] is None for record in records)
    # Each record is made once: the same objects however often read, the wait folded once.
    assert fast.buffer[2] is fast.buffer[2] and fast.buffer[2][3]["communication"] == 12
    assert fast.buffer.popleft() is records[0] and fast.buffer[1] is records[2]
    assert fast._wait_ns == 0
    dicts = [record[3] for record in records] + [fast._phases_ns]
    assert len({id(phases) for phases in dicts}) == len(dicts)  # no dict shared


def test_an_empty_phase_dict_stays_with_the_recorder_and_a_full_one_is_handed_over() -> None:
    recorder = _recorder()
    kept = recorder._phases_ns
    _steps(recorder, [{}, {}])
    assert recorder._phases_ns is kept and kept == {}
    _steps(recorder, [{"phases": {"data": 1}}])
    assert recorder._phases_ns is not kept and recorder.buffer[-1][3] is kept
    assert kept == {"data": 1}


def test_a_full_buffer_drops_the_step_as_before() -> None:
    recorder = _recorder(buffer_steps=3)
    records = _steps(recorder, [{"wait": 5}] * 5)
    assert len(records) == 3 and recorder.buffer_dropped == 2
    assert [record[0] for record in records] == [0, 1, 2] and recorder.steps_recorded == 5
    assert all(record[3] == {"communication": 5} for record in records)
    assert recorder._wait_ns == 0  # a dropped step's wait is not carried into the next one
