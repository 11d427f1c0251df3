"""The C step recorder (``_fastrecord``) against the Python one: the same records and counters.

Both recorders get the same random sequence of calls (steps opened and closed explicitly or by
auto mode, phases entered and left, phase time added, auto mode's watchers and sampling stride
changed, the buffer drained or left to fill, a clock that raises, a device timer, a kernel
source that raises) and must end every call in the same observable state.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters import _cext, _recorder
from stepwatch.exporters._recorder import FAST_RECORDER, StepRecorder, SystemClock
from stepwatch.exporters._sampling import PhaseSampler

pytestmark = pytest.mark.skipif(
    FAST_RECORDER is None, reason="the C extension _fastrecord is not built"
)
_fastrecord = _cext.fastrecord

# More valid names than the C recorder's phase slots (PHASE_SLOTS, 4): the rest go to its dict.
PHASES = ["data", "forward", "x" * 65, "compute", "loss", "io", "eval"]


@contextlib.contextmanager
def _python_calls(package: str = "") -> Iterator[list[str]]:
    """The names of the Python functions called meanwhile, from files under ``package``
    (this helper's own frames, and contextlib's, not counted)."""
    calls: list[str] = []
    own = {__file__, contextlib.__file__}

    def tracer(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package) and name not in own:
            calls.append(frame.f_code.co_name)

    sys.setprofile(tracer)
    try:
        yield calls
    finally:
        sys.setprofile(None)


class _Clock:
    def __init__(self) -> None:
        self.now_ns = 1_000
        self.broken = False

    def monotonic_ns(self) -> int:
        if self.broken:
            raise RuntimeError("clock exploded")
        return self.now_ns

    def time_ns(self) -> int:
        return 0


class _DeviceTimer:
    """Marks are integers counting up; what DeviceTimer offers the recorder."""

    def __init__(self) -> None:
        self.marks = 0
        self.broken = False

    def mark(self) -> int:
        if self.broken:
            raise RuntimeError("no device")
        self.marks += 1
        return self.marks

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(end - start)


class _Source:
    """Records the step ends it is told of; answers ``answer`` (step ends to skip, or not)."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.fail = False
        self.answer: Any = None

    def on_step_end(self, index: int) -> Any:
        self.ends.append(index)
        if self.fail:
            raise RuntimeError("source failed")
        return self.answer


def _pair(cls: type[StepRecorder], device: bool, buffer_steps: int) -> dict[str, Any]:
    clock, source = _Clock(), _Source()
    recorder = cls(
        clock=clock,
        device_timer=_DeviceTimer() if device else None,  # type: ignore[arg-type]
        kernel_source=source,  # type: ignore[arg-type]
        buffer_steps=buffer_steps,
        log=RateLimitedLog(logging.getLogger("test-fastrecord"), 0.0),
    )
    return {"recorder": recorder, "clock": clock, "source": source}


def _state(side: dict[str, Any]) -> dict[str, Any]:
    recorder = side["recorder"]
    phases = dict(recorder._phases_ns)  # the open step's, with what the C recorder keeps in
    for name, ns in getattr(recorder, "_phase_slots", {}).items():  # its slots (PHASE_SLOTS)
        phases[name] = phases.get(name, 0) + ns
    return {
        "buffer": list(recorder.buffer),
        "steps_recorded": recorder.steps_recorded,
        "buffer_dropped": recorder.buffer_dropped,
        "misuse": recorder.misuse_count,
        "depth": recorder.step_depth,
        "sampled": recorder.sampled,
        "explicit": recorder.explicit_steps,
        "auto_open": recorder._auto_step_open,
        "index": recorder.step_index,
        "start": recorder.step_start_ns,
        "phases": phases,
        "sampled_phases": dict(recorder._sampled_ns),
        "device_phases": {k: list(v) for k, v in recorder._device_phases.items()},
        "device_sampled": recorder._device_sampled,
        "step_start_mark": recorder._step_start_mark,
        "boundary": recorder._boundary,
        "marks": None if recorder.device_timer is None else recorder.device_timer.marks,
        "contexts": {k: c._depth for k, c in recorder.phase_contexts.items()},
        "open_phase": recorder.open_phase(),
        "source": list(side["source"].ends),
        "source_skip": recorder._kernel_skip,
    }


def _apply(side: dict[str, Any], op: tuple[Any, ...]) -> None:
    recorder, clock = side["recorder"], side["clock"]
    kind = op[0]
    if kind == "begin":
        now = clock.now_ns if op[2] else None
        recorder.begin_step(explicit=op[1], now_ns=now) if op[2] else recorder.begin_step(
            explicit=op[1]
        )
    elif kind == "end":
        now = clock.now_ns if op[2] else None
        recorder.end_step(explicit=op[1], now_ns=now) if op[2] else recorder.end_step(
            explicit=op[1]
        )
    elif kind in ("step_enter", "step_exit"):
        context = recorder.step_context
        context.__enter__() if kind == "step_enter" else context.__exit__(None, None, None)
    elif kind in ("phase_enter", "phase_exit"):
        name = PHASES[op[1]]
        context = recorder.phase_contexts.get(name) or recorder.new_phase_context(name)
        context.__enter__() if kind == "phase_enter" else context.__exit__(None, None, None)
    elif kind == "add":
        recorder.add_phase_ns(PHASES[op[1]], op[2])
    elif kind == "add_sampled":
        recorder.add_sampled_phase_ns(PHASES[op[1]], op[2])
    elif kind == "watchers":
        recorder.watchers = op[1]
    elif kind == "stride":
        recorder.sampler = PhaseSampler(op[1])
    elif kind == "tick":
        clock.now_ns += op[1]
    elif kind == "break":
        clock.broken = op[1]
    elif kind == "source_fails":
        side["source"].fail = op[1]
    elif kind == "source_answers":
        side["source"].answer = op[1]
    elif kind == "drain":
        recorder.buffer.clear()
    elif kind == "add_device":
        recorder.add_device_phase(PHASES[op[1]], op[2], op[2] + 1)
    elif kind == "add_sampled_device":
        recorder.add_sampled_device_phase(PHASES[op[1]], op[2], op[2] + 1)
    elif kind == "mark_fails" and recorder.device_timer is not None:
        recorder.device_timer.broken = op[1]


_OPS = st.one_of(
    st.tuples(st.sampled_from(["begin", "end"]), st.booleans(), st.booleans()),
    st.tuples(st.sampled_from(["step_enter", "step_exit"])),
    st.tuples(st.sampled_from(["phase_enter", "phase_exit"]), st.integers(0, len(PHASES) - 1)),
    st.tuples(
        st.sampled_from(["add", "add_sampled"]),
        st.integers(0, len(PHASES) - 1),
        st.integers(0, 10**12),
    ),
    st.tuples(st.just("watchers"), st.integers(0, 2)),
    st.tuples(st.just("stride"), st.sampled_from([1, 2, 8, 1 << 62])),
    st.tuples(st.just("tick"), st.integers(0, 10**9)),
    st.tuples(st.sampled_from(["break", "source_fails", "mark_fails"]), st.booleans()),
    st.tuples(st.just("drain")),
    # What on_step_end returns: step ends to skip, or values that mean none (or all of them).
    st.tuples(st.just("source_answers"), st.sampled_from([None, 0, 1, 3, -2, True, 2.0, 10**30])),
    st.tuples(
        st.sampled_from(["add_device", "add_sampled_device"]),
        st.integers(0, len(PHASES) - 1),
        st.integers(-5, 5),
    ),
)


@settings(max_examples=500, deadline=None)
@given(ops=st.lists(_OPS, max_size=60), device=st.booleans(), buffer_steps=st.integers(1, 6))
def test_c_recorder_matches_python(ops: list[tuple[Any, ...]], device: bool, buffer_steps: int):
    assert FAST_RECORDER is not None
    python, fast = (
        _pair(StepRecorder, device, buffer_steps),
        _pair(FAST_RECORDER, device, buffer_steps),
    )
    assert _state(python) == _state(fast)
    for position, op in enumerate(ops):
        _apply(python, op)
        _apply(fast, op)
        assert _state(python) == _state(fast), f"after {ops[: position + 1]}"


@pytest.mark.parametrize(
    ("then", "shared"),
    [
        ([("begin", False, True)], True),  # an auto step from the same instant: its end mark
        ([("begin", True, True)], False),  # the loop's own step: a mark of its own
        ([("tick", 5), ("begin", False, True)], False),  # a later instant
        ([("begin", False, False)], False),  # no instant given
        # no new mark needed: a device that cannot mark now does not matter
        ([("mark_fails", True), ("begin", False, True), ("mark_fails", False)], True),
    ],
)
def test_an_auto_step_starts_at_the_last_ones_end_mark_only_from_that_instant(
    then: list[tuple[Any, ...]], shared: bool
) -> None:
    """One instant, one device mark (one CUDA event fewer a step): both recorders alike."""
    assert FAST_RECORDER is not None
    for cls in (StepRecorder, FAST_RECORDER):
        side = _pair(cls, True, 4)
        for op in [("begin", False, True), ("end", False, True), *then, ("end", False, True)]:
            _apply(side, op)
        first, second = (record[4] for record in side["recorder"].buffer)
        assert (second[0] == first[1]) is shared, cls
        assert side["recorder"].misuse_count == 0


def _system_clock_recorder() -> StepRecorder:
    assert FAST_RECORDER is not None
    return FAST_RECORDER(
        clock=SystemClock(),
        device_timer=None,
        kernel_source=None,
        buffer_steps=8,
        log=RateLimitedLog(logging.getLogger("test-fastrecord"), 0.0),
    )


def test_the_c_recorder_runs_the_hot_path_in_c():
    """The monitor's contexts and the step boundary are the C ones (no Python frame)."""
    recorder = _system_clock_recorder()
    assert type(recorder.step_context).__module__ == "stepwatch.exporters._fastrecord"
    assert type(recorder.new_phase_context("data")).__module__ == "stepwatch.exporters._fastrecord"
    assert type(recorder).begin_step is not StepRecorder.begin_step
    with _python_calls() as calls, recorder.step_context, recorder.phase_contexts["data"]:
        pass
    assert calls == [], calls  # no Python function ran (the system clock is C too)
    assert len(recorder.buffer) == 1


def test_a_device_timed_step_runs_in_c_too():
    """With a device timer the step boundary stays in C (issue 15: on an H100 the Python one
    was most of what device timing cost): the records are the Python path's, marks included."""
    assert FAST_RECORDER is not None

    class _CTimer:  # a mark() that is C itself, so any Python frame would be the recorder's
        def __init__(self) -> None:
            self.mark = itertools.count(1).__next__

    recorder = FAST_RECORDER(
        clock=SystemClock(),
        device_timer=_CTimer(),  # type: ignore[arg-type]
        kernel_source=None,
        buffer_steps=8,
        log=RateLimitedLog(logging.getLogger("test-fastrecord"), 0.0),
    )
    recorder.watchers = 1
    with _python_calls() as calls:
        for _ in range(3):
            recorder.begin_step(explicit=False)
            recorder.end_step(explicit=False)
    assert calls == [], calls
    assert [record[4][:2] for record in recorder.buffer] == [(1, 2), (3, 4), (5, 6)]
    assert all(record[4][2] == {} and record[4][3] is None for record in recorder.buffer)


def test_the_c_clock_is_perf_counter_ns():
    """With the system clock the C code reads CLOCK_MONOTONIC itself: the same clock as
    ``time.perf_counter_ns`` (auto mode's hooks subtract one from the other)."""
    recorder = _system_clock_recorder()
    for _ in range(200):
        before = time.perf_counter_ns()
        recorder.begin_step(explicit=True)
        after = time.perf_counter_ns()
        recorder.end_step(explicit=True)
        assert before <= recorder.step_start_ns <= after
    starts = [record[1] for record in recorder.buffer]
    ends = [record[2] for record in recorder.buffer]
    assert all(a <= b for a, b in zip(starts, ends, strict=True))


def test_a_monitor_uses_the_c_recorder_unless_told_not_to():
    from stepwatch.exporters import StepMonitor

    monitor = StepMonitor(job_id="j", rank=0, world_size=1, start=False, health=False)
    try:
        assert type(monitor._recorder) is FAST_RECORDER
        with _python_calls() as calls:
            for _ in range(2):
                with monitor.step(), monitor.phase("data"), monitor.phase("forward"):
                    pass
        # The first use of a phase name makes its context (Python); nothing else is Python.
        assert calls == ["new_phase_context", "new_phase_context"]
        with monitor.phase(["not", "a", "name"]):  # type: ignore[arg-type]
            pass
        assert monitor.stats.misuse == 1
        assert [sorted(record[3]) for record in monitor._recorder.buffer] == [
            ["data", "forward"],
            ["data", "forward"],
        ]
    finally:
        monitor.close(timeout_s=0.1)
    script = (
        "from stepwatch.exporters import _recorder, StepMonitor\n"
        "m = StepMonitor(job_id='j', rank=0, world_size=1, start=False, health=False)\n"
        "with m.step():\n"
        "    with m.phase('data'):\n"
        "        pass\n"
        "print(_recorder.FAST_RECORDER, type(m._recorder).__name__, len(m._recorder.buffer))\n"
    )
    environment = {**os.environ, "STEPWATCH_EXPORTERS_NO_C": "1"}
    environment.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["None", "StepRecorder", "1"], done.stderr


def test_the_pure_python_recorder_stays_selectable(monkeypatch):
    monkeypatch.setattr(_recorder, "FAST_RECORDER", None)
    side = _pair(StepRecorder, False, 8)
    assert type(_recorder.new_recorder(**_kwargs(side))) is StepRecorder


def _kwargs(side: dict[str, Any]) -> dict[str, Any]:
    recorder = side["recorder"]
    return {
        "clock": side["clock"],
        "device_timer": None,
        "kernel_source": None,
        "buffer_steps": 4,
        "log": recorder._log,
    }


def test_an_unsampled_auto_step_enters_only_the_hooks_themselves():
    """With the C recorder, a step whose phases are not timed (explicit steps, auto mode
    installed, nothing sampled) enters no Python frame of stepwatch's: not the recorder, the
    step, the phase, the forward wrapper or the optimizer hooks (C gates)."""
    torch = pytest.importorskip("torch")
    from pathlib import Path

    from stepwatch.exporters import StepMonitor

    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, start=False, health=False, phase_sampling=1 << 40
    )
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    package = str(Path(_recorder.__file__).parent)
    try:
        data = torch.randn(8, 4)

        def step() -> None:
            with monitor.step(), monitor.phase("data"):
                model(data).sum().backward()
                optimizer.step()
                optimizer.zero_grad()

        step()
        step()
        with _python_calls(package) as entered:
            step()
            step()
        assert monitor._recorder.sampled is False
        assert entered == []
        assert len(monitor._recorder.buffer) == 4
    finally:
        instrumentation.remove()
        monitor.close(timeout_s=0.1)


class _CostlyStart:
    """A profiler backend whose start takes 50 ms and that records nothing: each cycle costs
    enough that the default budget spaces cycles out to the ceiling (10,000 steps)."""

    def start(self) -> None:
        time.sleep(0.05)

    def stop(self) -> Any:
        return list


def test_between_profiler_cycles_a_step_enters_no_python_frame():
    """Op histograms on (``TorchProfilerSource``): past its warm-up and probe cycles the source
    asks not to be told of the steps before its next cycle, so a step (explicit, with a phase)
    enters no Python frame of stepwatch's, the source's included."""
    from pathlib import Path

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.kernels import TorchProfilerSource

    source = TorchProfilerSource(backend=_CostlyStart())
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, start=False, health=False, kernel_source=source
    )
    package = str(Path(_recorder.__file__).parent)
    try:
        for _ in range(150):  # the warm-up cycle after 50 steps, the probe after 100
            with monitor.step(), monitor.phase("data"):
                time.sleep(0.001)  # steps of ~1 ms: a scheduling hiccup is no pause
        duty = source.duty_cycle
        assert duty.cycles == 2 and duty.interrupted_cycles == 0 and duty.cycle_cost_s
        with _python_calls(package) as entered:
            for _ in range(20):
                with monitor.step(), monitor.phase("data"):
                    pass
        assert entered == []
        assert monitor._recorder._kernel_skip > 1000
        assert monitor._recorder.steps_recorded == 170
    finally:
        monitor.close(timeout_s=0.1)


_NS = st.integers(0, 10**13)
_RECORD = st.tuples(
    st.integers(0, 10**6),
    _NS,
    _NS,
    st.dictionaries(st.sampled_from(["data", "forward", "compute"]), _NS, max_size=3),
    st.none(),
    st.sampled_from(["none", "unsampled", "sampled"]),
    st.dictionaries(st.sampled_from(["forward", "backward"]), _NS, max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(_RECORD, max_size=40), carry=st.integers(0, 50), device_row=st.booleans())
def test_c_window_values_match_python(rows: list[tuple[Any, ...]], carry: int, device_row: bool):
    """The export thread's pass in C gives the Python pass's floats, phases and weights; a
    batch with a device-marked step is left to Python whole."""
    records: list[Any] = []
    for index, start, end, phases, _, kind, auto in rows:
        last = None if kind == "none" else _recorder.UNSAMPLED if kind == "unsampled" else auto
        records.append((index, start, end, phases, None, last))
    if device_row and records:
        first = records[0]
        records[0] = (*first[:4], (1, 3, {}), first[5])
    timer = _DeviceTimer()
    fast = _recorder.window_values(records, timer, 7, carry)  # type: ignore[arg-type]
    assert (_recorder._fast_host_values(records, carry) is None) == (device_row and bool(records))
    original = _recorder.FAST_RECORDER
    try:
        _recorder.FAST_RECORDER = None
        python = _recorder.window_values(records, timer, 7, carry)  # type: ignore[arg-type]
    finally:
        _recorder.FAST_RECORDER = original
    assert fast == python
    assert repr(fast) == repr(python)  # the same floats, bit for bit (and the same order)


def test_the_python_paths_pass_the_monitor_suite_without_the_c_extensions():
    """Where the extensions are not built (no compiler), the Python code runs: the monitor,
    sampling and histogram tests pass with the C paths turned off."""
    from pathlib import Path

    here = Path(__file__).parent
    check = (
        "from stepwatch.exporters import _histogram, _recorder\n"
        "assert _recorder.FAST_RECORDER is None and _histogram._fasthist is None\n"
    )
    environment = {**os.environ, "STEPWATCH_EXPORTERS_NO_C": "1"}
    assert subprocess.run([sys.executable, "-c", check], env=environment).returncode == 0
    modules = ["test_monitor.py", "test_sampling.py", "test_histogram.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
        + [str(here / module) for module in modules],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


class _Event:
    """Shaped like ``torch.Event``: made, then recorded (no stream: the current one)."""

    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).made += 1
        self.args, self.kwargs, self.recorded = args, kwargs, 0

    def record(self) -> None:
        self.recorded += 1


def test_the_event_marker_makes_records_and_returns_an_event_without_a_python_frame():
    marker = _fastrecord.EventMarker(functools.partial(_Event, "cuda", enable_timing=True))
    with _python_calls() as calls:  # frames of this file (the stand-in event) not counted
        first, second = marker(), marker()
    assert (first.args, first.kwargs, first.recorded) == (("cuda",), {"enable_timing": True}, 1)
    assert second is not first and second.recorded == 1
    with pytest.raises(TypeError):
        marker(1)

    class Refused(_Event):
        def record(self) -> None:
            raise RuntimeError("no CUDA")

    with pytest.raises(RuntimeError, match="no CUDA"):
        _fastrecord.EventMarker(Refused)()
    assert calls == []


def test_the_mark_stamp_takes_a_mark_and_the_time_and_never_raises():
    class Timer:
        def __init__(self) -> None:
            self.mark = itertools.count(7).__next__

    stamp = _fastrecord.MarkStamp(Timer())
    assert (stamp.ns, stamp.mark) == (0, None)
    before = time.perf_counter_ns()
    stamp("any", grad=None)  # autograd calls it with the parameter
    assert before <= stamp.ns <= time.perf_counter_ns() and stamp.mark == 7
    stamp.ns = 0  # what the optimizer pre-hook does once the wait is recorded
    stamp()
    assert stamp.ns > 0 and stamp.mark == 8

    class Broken:
        def mark(self) -> Any:
            raise RuntimeError("no device")

    broken = _fastrecord.MarkStamp(Broken())
    before = time.perf_counter_ns()
    broken(None)
    assert broken.mark is None and broken.ns >= before  # the wait keeps its host time


@pytest.mark.parametrize("python", [True, False], ids=["python", "c"])
@pytest.mark.parametrize(
    ("answer", "told"),
    [
        (2, [0, 3, 6, 9]),  # two step ends skipped after each one told
        (0, list(range(10))),
        (None, list(range(10))),
        (-1, list(range(10))),
        (True, list(range(10))),  # not an int: bool, float and the like mean none skipped
        (2.0, list(range(10))),
        (10**30, [0]),  # more than the counter holds: never told again
    ],
)
def test_a_kernel_source_is_told_only_the_step_ends_it_asked_for(
    python: bool, answer: Any, told: list[int]
):
    """``on_step_end`` may answer how many of the following step ends it need not see."""
    assert FAST_RECORDER is not None
    side = _pair(StepRecorder if python else FAST_RECORDER, False, 64)
    side["source"].answer = answer
    recorder = side["recorder"]
    for _ in range(10):
        recorder.begin_step(explicit=True)
        recorder.end_step(explicit=True)
    assert side["source"].ends == told
    assert [record[0] for record in recorder.buffer] == list(range(10))  # every step recorded
