"""What an untimed step's C paths keep in their own structs so as not to touch cold objects
(issue 15, seventeenth round): ``phase(name)``'s last names and contexts, the recorder's one
forward swap, and the optimizer gates' count and wait (tests/exporters/test_optimizer_gate.py).
Each must give exactly what the dicts and tuples they stand in for give."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest

from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._recorder import FAST_RECORDER, SystemClock
from stepwatch.exporters._sampling import PhaseSampler

pytestmark = pytest.mark.skipif(FAST_RECORDER is None, reason="_fastrecord is not built")


def _monitor() -> StepMonitor:
    return StepMonitor(
        job_id="cold",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        start=False,
        health=False,
    )


def test_phase_gives_each_name_its_own_context_past_the_cache() -> None:
    monitor = _monitor()
    names = [f"phase-{i}" for i in range(7)]  # more names than the lookup keeps
    first = {name: monitor.phase(name) for name in names}
    assert len({id(context) for context in first.values()}) == len(names)
    for _ in range(3):
        for name in reversed(names):
            assert monitor.phase(name) is first[name]
            # An equal string that is another object finds the same context.
            assert monitor.phase("".join(list(name))) is first[name]
    with monitor.step():
        for name in names[:5]:
            with monitor.phase(name):
                pass
    recorded = monitor._recorder.buffer[-1][3]
    assert sorted(recorded) == sorted(names[:5])
    monitor.close(timeout_s=1.0)


def test_phase_lookup_releases_what_it_keeps() -> None:
    monitor = _monitor()
    with monitor.step(), monitor.phase("data"):
        pass
    assert monitor.phase("data") is monitor.phase("data")  # from the cache now
    # A cycle only the cache closes: recorder -> lookup -> (cache) context -> recorder.
    monitor._recorder.lookup = monitor.phase
    monitor._recorder.phase_contexts.clear()
    recorder = weakref.ref(monitor._recorder)
    monitor.close(timeout_s=1.0)
    del monitor
    gc.collect()
    assert recorder() is None  # the cache's references are collectable


def test_phase_lookup_is_still_checked_for_names_it_has_not_seen() -> None:
    monitor = _monitor()
    assert monitor.phase("") is monitor.phase("")  # an unusable name: the null context
    with monitor.step(), monitor.phase(""):
        pass
    assert monitor.stats.misuse  # counted, as before
    monitor.close(timeout_s=1.0)


class _Untimed:
    pass


class _Timed(_Untimed):
    pass


def _recorder() -> Any:
    assert FAST_RECORDER is not None
    recorder = FAST_RECORDER(
        clock=SystemClock(),
        device_timer=None,
        kernel_source=None,
        buffer_steps=64,
        log=RateLimitedLog(logging.getLogger("test-cold"), 0.0),
    )
    recorder.watchers = 1
    return recorder


def _step(recorder: Any, stride: int) -> None:
    recorder.sampler = PhaseSampler(stride)
    recorder.begin_step(explicit=True)
    recorder.end_step(explicit=True)


def test_the_recorder_swaps_one_model_and_follows_a_changed_tuple() -> None:
    recorder = _recorder()
    first, second = _Untimed(), _Untimed()
    recorder.forward_swaps = ((first, _Untimed, _Timed),)
    _step(recorder, 1)  # timed
    assert type(first) is _Timed and type(second) is _Untimed
    _step(recorder, 1 << 40)  # untimed (step 1 is not a multiple of the hash's stride)
    assert type(first) is _Untimed
    # A second instrumented model: a new tuple, both follow.
    recorder.forward_swaps = ((first, _Untimed, _Timed), (second, _Untimed, _Timed))
    _step(recorder, 1)
    assert type(first) is _Timed and type(second) is _Timed
    # The first removed: a new one-entry tuple; the first is no longer touched.
    recorder.forward_swaps = ((second, _Untimed, _Timed),)
    _step(recorder, 1 << 40)
    assert type(second) is _Untimed and type(first) is _Timed
    # Kept timed on every step (gradients accumulate, _ClassSwap.keep_timed): the entry names
    # the timed class twice and the model has it.
    recorder.forward_swaps = ((second, _Timed, _Timed),)
    object.__setattr__(second, "__class__", _Timed)
    _step(recorder, 1 << 40)
    assert type(second) is _Timed
    recorder.forward_swaps = ()
    _step(recorder, 1)
    assert type(second) is _Timed  # nothing to swap


def test_a_class_someone_else_set_is_left_alone() -> None:
    recorder = _recorder()

    class Other(_Untimed):
        pass

    model = _Untimed()
    recorder.forward_swaps = ((model, _Untimed, _Timed),)
    _step(recorder, 1)
    object.__setattr__(model, "__class__", Other)
    _step(recorder, 1 << 40)
    _step(recorder, 1)
    assert type(model) is Other


def test_the_recorder_reads_a_changed_stride_at_the_next_step() -> None:
    recorder = _recorder()
    sampler = PhaseSampler(1)
    recorder.sampler = sampler
    timed: list[bool] = []
    for stride in (1, 1 << 40, 1, 1 << 40):
        sampler.stride = stride  # the export thread adapting it, on the same sampler
        recorder.begin_step(explicit=True)
        timed.append(bool(recorder.sampled))
        recorder.end_step(explicit=True)
    assert timed == [True, False, True, False]
    other = PhaseSampler(1)  # another sampler with another stride
    sampler.stride = 1 << 40
    recorder.sampler = other
    recorder.begin_step(explicit=True)
    assert recorder.sampled
    recorder.end_step(explicit=True)
    recorder.sampler = sampler
    recorder.begin_step(explicit=True)
    assert not recorder.sampled  # back to the first: its stride is read again
    recorder.end_step(explicit=True)


def test_the_c_and_python_samplers_pick_the_same_steps() -> None:
    recorder = _recorder()
    sampler = PhaseSampler(4)
    recorder.sampler = sampler
    picked = []
    for index in range(64):
        if index == 32:
            sampler.stride = 8
        recorder.begin_step(explicit=True)
        picked.append((bool(recorder.sampled), sampler.sampled(index)))
        recorder.end_step(explicit=True)
    assert all(c == python for c, python in picked)
    assert sum(c for c, _ in picked[:32]) >= 4 and sum(c for c, _ in picked[32:]) < 16
