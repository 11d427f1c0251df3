"""The loop's own phases in the C recorder's slots (issue 15, cold memory; ``stepbuffer.h``).

A host-timed ``monitor.phase()`` adds its time to one of four slots of plain nanoseconds in the
recorder, and the step's end copies the used slots into its buffer entry; the export thread
adds them to the record's phases. No int, no dict and no allocation on the training thread for
them. Records are the same as before: more names than slots go to the phase dict, a buffer put
in place meanwhile or a step ended by the Python path gets them all.
"""

from __future__ import annotations

import logging
import sys

import pytest

from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters import _cext
from stepwatch.exporters._recorder import FAST_RECORDER, StepRecorder

pytestmark = pytest.mark.skipif(FAST_RECORDER is None, reason="_fastrecord is not built")
_fastrecord = _cext.fastrecord


class _Clock:
    def __init__(self) -> None:
        self.now_ns = 1_000

    def monotonic_ns(self) -> int:
        return self.now_ns

    def time_ns(self) -> int:
        return 0


def _recorder(cls: type[StepRecorder], clock: _Clock, buffer_steps: int = 64) -> StepRecorder:
    return cls(
        clock=clock,
        device_timer=None,
        kernel_source=None,
        buffer_steps=buffer_steps,
        log=RateLimitedLog(logging.getLogger("test-phase-slots"), 0.0),
    )


def _steps(recorder: StepRecorder, clock: _Clock, names: list[str], steps: int) -> None:
    """``steps`` steps, each phase ``names[i]`` lasting ``10 * (i + 1)`` ns (twice for the
    first name: a phase entered twice in a step adds up)."""
    contexts = recorder.phase_contexts
    for _ in range(steps):
        with recorder.step_context:
            for _i, name in enumerate([names[0], *names]):
                context = contexts.get(name) or recorder.new_phase_context(name)
                with context:
                    clock.now_ns += 10 * (names.index(name) + 1)


@pytest.mark.parametrize("count", [1, 4, 6])
def test_records_match_the_python_recorder_with_more_names_than_slots(count: int) -> None:
    names = ["data", "forward", "backward", "optimizer", "io", "eval"][:count]
    records = []
    for cls in (StepRecorder, FAST_RECORDER):
        clock = _Clock()
        recorder = _recorder(cls, clock)
        _steps(recorder, clock, names, 3)
        records.append(list(recorder.buffer))
    python, fast = records
    assert fast == python
    assert fast[0][3] == {name: 10 * (i + 1) * (2 if i == 0 else 1) for i, name in enumerate(names)}


def test_the_slots_are_the_recorders_until_the_step_ends() -> None:
    clock = _Clock()
    recorder = _recorder(FAST_RECORDER, clock)
    data = recorder.new_phase_context("data")
    with recorder.step_context:
        with data:
            clock.now_ns += 7
        assert recorder._phase_slots == {"data": 7} and recorder._phases_ns == {}
    assert recorder._phase_slots == {}
    assert recorder.buffer[0][3] == {"data": 7}


def test_a_buffer_put_in_place_gets_the_slots_time() -> None:
    clock = _Clock()
    recorder = _recorder(FAST_RECORDER, clock)
    _steps(recorder, clock, ["data", "forward"], 1)
    first = recorder.buffer
    recorder.buffer = _fastrecord.StepBuffer()  # someone else's buffer from now on
    _steps(recorder, clock, ["data", "forward"], 2)
    assert [record[3] for record in first] == [{"data": 20, "forward": 20}]
    assert [record[3] for record in recorder.buffer] == [{"data": 20, "forward": 20}] * 2


def test_a_step_the_python_path_ends_keeps_the_slots_time() -> None:
    """A full buffer: the step goes the Python way (counted as dropped), and the next step,
    buffered again, starts with empty slots."""
    clock = _Clock()
    recorder = _recorder(FAST_RECORDER, clock, buffer_steps=1)
    _steps(recorder, clock, ["data"], 2)
    assert recorder.buffer_dropped == 1 and recorder._phase_slots == {}
    assert recorder._phases_ns == {}
    recorder.buffer.popleft()
    _steps(recorder, clock, ["data"], 1)
    assert [record[3] for record in recorder.buffer] == [{"data": 20}]


def test_a_step_with_its_phases_allocates_nothing_on_the_training_thread() -> None:
    recorder = _recorder(FAST_RECORDER, _Clock(), buffer_steps=4096)
    contexts = [recorder.new_phase_context(name) for name in ("data", "forward", "step")]
    context = recorder.step_context
    for _ in range(64):  # the ring's first slots, the contexts' first use
        with context, contexts[0], contexts[1], contexts[2]:
            pass
    before = sys.getallocatedblocks()
    for _ in range(512):
        with context, contexts[0], contexts[1], contexts[2]:
            pass
    grown = sys.getallocatedblocks() - before
    assert grown < 16, grown  # with the slots switched off: 1,022 (a dict a step)
    assert len(recorder.buffer) == 576
    assert recorder.buffer[-1][3] == {"data": 0, "forward": 0, "step": 0}
