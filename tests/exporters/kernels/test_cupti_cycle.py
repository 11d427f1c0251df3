"""CUPTI on a duty cycle (``CuptiSource(period_steps=...)``), on recorded CUPTI records.

The records are the DLRM trace's (Kineto writes CUPTI's kernel, memcpy and memset records into
its trace), one recorded step repeated on a simulated clock. :class:`CycledCupti` behaves as
CUPTI does where it matters here: it records only what is launched while its activity kinds
are on, delivers only finished records and only when flushed, and once a detach is asked for it
takes no call until a CUDA API exit has finalized it (any call would attach CUPTI again, and a
call racing ``cuptiFinalize`` can crash a process).
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.exporters.kernels import (
    ActivityRecord,
    CuptiPythonBackend,
    CuptiSource,
    KernelEvent,
    KernelSummariser,
)
from stepwatch.exporters.kernels._cupti_cycle import split_cycle, steps_to_skip
from tests.exporters.kernels.test_cupti_source import recorded_activity

STEP_NS = 50_000_000


class CycledCupti:
    """A CUPTI backend on a simulated clock that checks the rules a duty cycle must keep."""

    def __init__(self, records: Sequence[ActivityRecord], *, detachable: bool = True) -> None:
        self.pending = sorted(records, key=lambda record: record.end_ns)
        self.now_ns = 0
        self.on_since: int | None = None  # the kinds are on since then
        self.on_spans: list[tuple[int, int]] = []
        self.on_records: Callable[[Sequence[ActivityRecord]], None] | None = None
        self.detach_pending: Callable[[float | None], None] | None = None
        self.detachable = detachable
        self.calls: list[str] = []
        self.flush_threads: set[str] = set()

    def _call(self, name: str) -> None:
        assert self.detach_pending is None, f"CUPTI {name} while a detach is pending"
        self.calls.append(name)

    def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
        self._call("enable")
        self.on_records = on_records
        self.on_since = self.now_ns

    def disable(self) -> None:
        self._call("disable")
        if self.on_since is not None:
            self.on_spans.append((self.on_since, self.now_ns))
        self.on_since = None

    def timestamp_ns(self) -> int:
        self._call("timestamp")
        return self.now_ns

    def _recorded(self, record: ActivityRecord) -> bool:
        spans = [*self.on_spans, *([(self.on_since, 1 << 62)] if self.on_since is not None else [])]
        return any(begin <= record.start_ns < end for begin, end in spans)

    def _deliver(self) -> None:
        done = [record for record in self.pending if record.end_ns <= self.now_ns]
        self.pending = [record for record in self.pending if record.end_ns > self.now_ns]
        if self.on_records is not None:
            self.on_records([record for record in done if self._recorded(record)])

    def flush(self) -> None:
        self._call("flush")
        self.flush_threads.add(threading.current_thread().name)
        self._deliver()

    def detach(self, on_detached: Callable[[float | None], None]) -> None:
        self.disable()
        if not self.detachable:
            raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")
        self.detach_pending = on_detached

    def api_exit(self) -> None:
        """The next CUDA driver or runtime API call returns: a pending detach happens here."""
        if self.detach_pending is not None:
            callback, self.detach_pending = self.detach_pending, None
            self._deliver()
            self.calls.append("finalize")
            callback(0.004)


def _repeated_steps(path: Path, steps: int) -> tuple[list[ActivityRecord], list[tuple[int, int]]]:
    """The recorded step's records repeated ``steps`` times, one step every ``STEP_NS``."""
    records, ((_, start, end),) = recorded_activity(path)
    inside = [r for r in records if start < r.start_ns <= end]
    assert end - start < STEP_NS
    out: list[ActivityRecord] = []
    for step in range(steps):
        shift = STEP_NS * step + 1_000_000 - start
        out.extend(r._replace(start_ns=r.start_ns + shift, end_ns=r.end_ns + shift) for r in inside)
    spans = [(STEP_NS * step, STEP_NS * (step + 1)) for step in range(steps)]
    return out, spans


def _run(
    source: CuptiSource,
    backend: CycledCupti,
    spans: list[tuple[int, int]],
    *,
    drain_every: int = 50,
    api_exits: bool = True,
) -> tuple[list[Any], list[int]]:
    """Drive the source as the step recorder does (skipped step ends are not reported), its
    clock the backend's (steps of ``STEP_NS``)."""
    source._clock = lambda: backend.now_ns / 1e9  # type: ignore[method-assign]
    windows, told = [], []
    skip = 0
    for step, (begin, end) in enumerate(spans):
        backend.now_ns = begin + 10
        if api_exits:
            backend.api_exit()  # the step's first kernel launch
        backend.now_ns = end
        if skip:
            skip -= 1
        else:
            told.append(step)
            answer = source.on_step_end(step)
            skip = answer if isinstance(answer, int) and answer > 0 else 0
        if (step + 1) % drain_every == 0:
            windows.append(source.drain())
    backend.now_ns = spans[-1][1] + 10**9
    if api_exits:
        backend.api_exit()
    windows.append(source.drain())
    return windows, told


def _recorded_steps(period: int, active: int, steps: int) -> list[int]:
    cycles = [k for k in range(steps) if (k + 1) % period == 0 and k + active + 2 < steps]
    return [k + 2 + offset for k in cycles for offset in range(active)]


@pytest.mark.parametrize("detach", ["disable", "finalize"])
def test_a_cycle_records_exactly_its_steps(dlrm_rank0: Path, detach: str) -> None:
    records, spans = _repeated_steps(dlrm_rank0, 300)
    backend = CycledCupti(records)
    # A budget the stand-in's 4 ms finalize fits at this period (the grid's stretch: below).
    source = CuptiSource(
        backend=backend, period_steps=64, active_steps=5, detach=detach, overhead_budget=0.01
    )
    source.on_monitor_start()
    assert backend.calls == []  # nothing until the first cycle
    windows, told = _run(source, backend, spans)

    wanted = _recorded_steps(64, 5, 300)
    assert wanted == [65, 66, 67, 68, 69, 129, 130, 131, 132, 133, 193, 194, 195, 196, 197, 257,
                      258, 259, 260, 261]  # fmt: skip
    # Steps are the same on every rank: a cycle is switched on where (step + 1) % 64 == 0.
    reference = KernelSummariser()
    for step in wanted:
        begin, end = spans[step]
        events = [
            KernelEvent(r.name, r.start_ns, r.end_ns - r.start_ns, r.device_id)
            for r in sorted(records, key=lambda record: record.start_ns)
            if begin < r.start_ns <= end
        ]
        reference.add_step(events, start_ns=begin, end_ns=end)
    want = reference.drain()
    got_durations: dict[tuple[str, str], list[float]] = {}
    got_idle: list[float] = []
    for window in windows:
        for key, values in window.durations_s.items():
            got_durations.setdefault(key, []).extend(values)
        got_idle.extend(window.idle_durations_s)
    assert {k: sorted(v) for k, v in got_durations.items()} == {
        k: sorted(v) for k, v in want.durations_s.items()
    }
    assert got_idle == list(want.idle_durations_s) and len(got_idle) == 20
    # Window by window: the cycles finished in a window, one idle value per recorded step.
    assert [len(window.idle_durations_s) for window in windows] == [0, 5, 5, 5, 0, 5, 0]
    # The recorder is told 8 step ends per cycle (switch on, warm-up, 5 recorded, switch off).
    assert len(told) == 4 * 8 + 1 and told[:9] == [0, 63, 64, 65, 66, 67, 68, 69, 70]
    duty = source.duty_cycle
    assert duty is not None
    assert (duty.cycles, duty.skipped_cycles, duty.fallbacks, duty.attached) == (4, 0, 0, False)
    assert (duty.period_steps, duty.stride) == (64, 1)  # switches that cost nothing
    assert duty.attach_s is not None and duty.detach_s is not None
    if detach == "finalize":
        assert duty.finalize_s == 0.004
        assert "flush" not in backend.calls  # records come in at the finalize, nowhere else
        assert backend.calls.count("finalize") == 4
    else:
        assert duty.finalize_s is None
        assert backend.flush_threads == {threading.current_thread().name}
    source.close()


def test_a_detach_not_yet_done_skips_the_next_cycle(dlrm_rank0: Path) -> None:
    # No CUDA call since the detach was asked for (the recorder's thread drives none here):
    # no CUPTI call may be made, so the next cycle is skipped, then taken once it is done.
    records, spans = _repeated_steps(dlrm_rank0, 140)
    backend = CycledCupti(records)
    source = CuptiSource(backend=backend, period_steps=32, active_steps=3, detach="finalize")
    windows, _ = _run(source, backend, spans[:70], api_exits=False)
    duty = source.duty_cycle
    assert duty is not None and (duty.cycles, duty.skipped_cycles) == (1, 1)
    assert all(window.idle_durations_s == () for window in windows)  # not in before finalize
    backend.api_exit()
    assert len(source.drain().idle_durations_s) == 3


def test_where_finalize_is_refused_the_kinds_are_disabled(
    dlrm_rank0: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records, spans = _repeated_steps(dlrm_rank0, 140)
    backend = CycledCupti(records, detachable=False)
    source = CuptiSource(backend=backend, period_steps=64, active_steps=5, detach="finalize")
    with caplog.at_level(logging.WARNING):
        windows, _ = _run(source, backend, spans)
    duty = source.duty_cycle
    assert duty is not None and (duty.cycles, duty.fallbacks) == (2, 2)
    assert sum(len(window.idle_durations_s) for window in windows) == 10
    assert backend.on_since is None  # off between cycles all the same
    assert "disabled instead" in caplog.text
    assert source.active


def test_a_cupti_that_cannot_start_costs_no_step(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(CycledCupti):
        def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    source = CuptiSource(backend=Broken([]), period_steps=16, active_steps=2)
    with caplog.at_level(logging.WARNING):
        assert source.on_step_end(0) == 14  # skip to step 15, where the cycle would start
        assert source.on_step_end(15) == 1 << 62  # it failed: never told again
    assert not source.active
    assert source.drain().durations_s == {}
    assert sum("CUPTI enable failed" in r.message for r in caplog.records) == 1


def test_steps_to_skip_and_split() -> None:
    assert [steps_to_skip(step, 8) for step in (0, 6, 7, 8, 14, 15)] == [6, None, 7, 6, None, 7]
    from stepwatch.exporters.kernels._cupti_records import ActivityColumns

    columns = ActivityColumns(list("abcde"), [5, 10, 11, 20, 21], [6, 12, 13, 25, 30], [0] * 5)
    taken, later = split_cycle(columns, 10, 20)
    assert (taken.names, later.names) == (["c", "d"], ["e"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"period_steps": 7, "active_steps": 5},
        {"period_steps": 64, "active_steps": 0},
        {"period_steps": 64, "detach": "unload"},
    ],
)
def test_options_out_of_range(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        CuptiSource(backend=CycledCupti([]), **kwargs)


def test_finalize_needs_a_backend_that_detaches() -> None:
    class NoDetach:
        def enable(self, on_records: Any) -> None: ...
        def flush(self) -> None: ...
        def timestamp_ns(self) -> int:
            return 0

        def disable(self) -> None: ...

    with pytest.raises(ConfigError, match="detach"):
        CuptiSource(backend=NoDetach(), period_steps=64, detach="finalize")
    assert CuptiSource(backend=NoDetach(), period_steps=64).duty_cycle is not None


def test_the_monitor_honours_the_skips_and_windows_hold_the_cycles(dlrm_rank0: Path) -> None:
    # Through a real StepMonitor (C recorder where built): between cycles the source is not
    # told of steps, and each exported window's idle histogram counts its recorded steps.
    from stepwatch.exporters import InMemoryExporter, StepMonitor

    class Clock:
        now_ns = 0

        def monotonic_ns(self) -> int:
            return self.now_ns

        def time_ns(self) -> int:
            return self.now_ns

    records, spans = _repeated_steps(dlrm_rank0, 200)
    backend = CycledCupti(records)
    told: list[int] = []
    source = CuptiSource(backend=backend, period_steps=32, active_steps=4)
    real_end = source.on_step_end

    def counting(step: int) -> int | None:
        told.append(step)
        return real_end(step)

    source.on_step_end = counting  # type: ignore[method-assign]
    clock = Clock()
    source._clock = lambda: clock.now_ns / 1e9  # type: ignore[method-assign]
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="cycle", rank=0, world_size=1, exporter=exporter, kernel_source=source,
        clock=clock, start=False,
    )  # fmt: skip
    idle_counts = []
    for step, (begin, end) in enumerate(spans):
        clock.now_ns = backend.now_ns = begin + 10
        with monitor.step():
            clock.now_ns = backend.now_ns = end
        if (step + 1) % 40 == 0:
            backend.now_ns = end + STEP_NS // 2  # the step's kernels are done
            assert monitor.export_now()
            window = exporter.exported[-1].resource_metrics[0].scope_metrics[0].metrics
            by_name = {metric.name: metric.data for metric in window}
            idle = by_name.get(_schema.DEVICE_IDLE_DURATION)
            idle_counts.append(sum(p.count for p in idle.data_points) if idle else 0)
    monitor.close()
    assert told[:8] == [0, 31, 32, 33, 34, 35, 36, 37] and len(told) == 1 + 6 * 7
    assert idle_counts == [4, 4, 4, 4, 8]  # cycles off at 37, 69, 101, 133; 165 and 197


def test_the_real_backend_finalizes_once_at_an_api_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuptiPythonBackend.detach on a stand-in ``cupti`` module: the order of its calls, one
    finalize whatever the threads, and a callback that never raises into a CUDA call."""
    calls: list[Any] = []
    state: dict[str, Any] = {}

    class Kind(int):
        pass

    kinds = types.SimpleNamespace(
        CONCURRENT_KERNEL=Kind(10), KERNEL=Kind(3), MEMCPY=Kind(1), MEMCPY2=Kind(22),
        MEMSET=Kind(2),
    )  # fmt: skip

    def subscribe(callback: Callable[..., None], _userdata: Any) -> int:
        state["callback"] = callback
        calls.append("subscribe")
        return 77

    def finalize() -> None:
        calls.append("finalize")
        if state.get("refuse"):
            raise RuntimeError("CUPTI_ERROR_UNKNOWN")

    fake = types.SimpleNamespace(
        ActivityKind=kinds,
        ApiCallbackSite=types.SimpleNamespace(API_ENTER=0, API_EXIT=1),
        CallbackDomain=types.SimpleNamespace(DRIVER_API=1, RUNTIME_API=2),
        activity_register_callbacks=lambda *_: calls.append("register"),
        activity_enable=lambda kind: calls.append(("enable", int(kind))),
        activity_disable=lambda kind: calls.append(("disable", int(kind))),
        activity_flush_all=lambda _forced: calls.append("flush"),
        get_timestamp=lambda: 5,
        subscribe=subscribe,
        enable_domain=lambda on, handle, domain: calls.append(("domain", on, handle, domain)),
        unsubscribe=lambda handle: calls.append(("unsubscribe", handle)),
        finalize=finalize,
    )
    module = types.ModuleType("cupti")
    module.cupti = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupti", module)

    backend = CuptiPythonBackend()
    done: list[float | None] = []
    backend.enable(lambda _records: None)
    backend.disable()
    backend.enable(lambda _records: None)  # registered once per CUPTI load
    assert calls.count("register") == 1
    calls.clear()
    backend.detach(done.append)
    assert calls == [("disable", 10), ("disable", 1), ("disable", 22), ("disable", 2),
                     "subscribe", ("domain", 1, 77, 2), ("domain", 1, 77, 1)]  # fmt: skip
    calls.clear()
    enter, leave = types.SimpleNamespace(callback_site=0), types.SimpleNamespace(callback_site=1)
    state["callback"](None, 2, 211, enter)
    state["callback"](None, 2, 211, object())  # no callback site: not an exit
    assert calls == [] and done == []
    threads = [
        threading.Thread(target=state["callback"], args=(None, 1, 307, leave)) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == ["flush", ("unsubscribe", 77), "finalize"]
    assert len(done) == 1 and done[0] is not None and done[0] >= 0
    backend.enable(lambda _records: None)  # attached again: registered anew
    assert calls.count("register") == 1

    # A finalize that fails: reported as None, and the CUDA call it rode on never sees it.
    state["refuse"] = True
    backend.detach(done.append)
    state["callback"](None, 2, 211, leave)
    assert done[-1] is None

    # A subscription refused (another tool holds CUPTI): the kinds are off and detach raises.
    def refused(*_: Any) -> int:
        raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")

    fake.subscribe = refused
    backend.enable(lambda _records: None)
    calls.clear()
    with pytest.raises(RuntimeError, match="SUBSCRIBERS"):
        backend.detach(done.append)
    assert [call[0] for call in calls] == ["disable"] * 4


@pytest.mark.parametrize(("attach_s", "stride"), [(0.0001, 1), (0.02, 64), (0.5, 2048)])
def test_switches_that_cost_more_than_the_budget_stretch_the_grid(
    dlrm_rank0: Path, attach_s: float, stride: int
) -> None:
    # Kineto saw the first concurrent-kernel enable take seconds (instrumentation made when a
    # module loads); a re-attach after a finalize may pay it again. At 20 steps a second and
    # the 0.04 % budget, a cycle's switches may cost 0.04 % of the steps between cycles:
    # 0.1 ms fits in 16 steps (0.8 s), 20 ms needs 64 x 16 steps (50 s), 0.5 s 2048 x 16.
    records, spans = _repeated_steps(dlrm_rank0, 40)

    class SlowAttach(CycledCupti):
        def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
            super().enable(on_records)
            self.now_ns += int(attach_s * 1e9)

    backend = SlowAttach(records)
    source = CuptiSource(backend=backend, period_steps=16, active_steps=3)
    _run(source, backend, spans)
    duty = source.duty_cycle
    assert duty is not None and duty.cycles == (2 if stride == 1 else 1)
    assert duty.attach_s == pytest.approx(attach_s)
    assert (duty.stride, duty.period_steps) == (stride, 16 * stride)
    # The next cycle waits for the stretched grid: the source says so at its switch-off.
    backend2 = SlowAttach(records)
    again = CuptiSource(backend=backend2, period_steps=16, active_steps=3)
    again._clock = lambda: backend2.now_ns / 1e9  # type: ignore[method-assign]
    skips = []
    for step, (_, end) in enumerate(spans[:22]):
        backend2.now_ns = end
        skips.append(again.on_step_end(step))
    assert skips[20] == steps_to_skip(20, 16 * stride)


@pytest.mark.parametrize("detach", ["disable", "finalize"])
def test_closing_inside_a_cycle_switches_cupti_off(dlrm_rank0: Path, detach: str) -> None:
    records, spans = _repeated_steps(dlrm_rank0, 20)
    backend = CycledCupti(records)
    source = CuptiSource(backend=backend, period_steps=8, active_steps=2, detach=detach)
    source._clock = lambda: backend.now_ns / 1e9  # type: ignore[method-assign]
    for step in (0, 7, 8, 9):  # switched on at 7, warm-up 8, one step recorded
        backend.now_ns = spans[step][1]
        source.on_step_end(step)
    assert backend.on_since is not None
    source.close()
    assert backend.on_since is None and backend.calls[-1] == "disable"
    assert source.on_step_end(10) == 1 << 62  # closed: never told again
    duty = source.duty_cycle
    assert duty is not None and not duty.attached and duty.cycles == 0


def test_closing_while_a_finalize_is_pending_makes_no_cupti_call(dlrm_rank0: Path) -> None:
    records, spans = _repeated_steps(dlrm_rank0, 20)
    backend = CycledCupti(records)
    source = CuptiSource(backend=backend, period_steps=8, active_steps=2, detach="finalize")
    source._clock = lambda: backend.now_ns / 1e9  # type: ignore[method-assign]
    for step in range(12):  # the cycle: on at 7, recorded 9 and 10, off at 11
        backend.now_ns = spans[step][1]
        source.on_step_end(step)
    assert backend.detach_pending is not None
    source.close()  # the stand-in asserts on any call while the detach is pending
    source.drain()
    backend.api_exit()
    assert len(source.drain().idle_durations_s) == 2
