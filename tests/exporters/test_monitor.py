"""StepMonitor: whole-step windows, exact bounds, a hot path that never raises, counted failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import (
    ExponentialHistogram,
    Gauge,
    MetricExportResult,
    MetricsData,
)

from stepwatch.core import ConfigError, _schema
from stepwatch.exporters import InMemoryExporter, KernelWindow, StepMonitor

WALL_ANCHOR_NS = 1_795_000_000_000_000_000


class FakeClock:
    """A Clock whose monotonic time moves only when told to."""

    def __init__(self) -> None:
        self.now_ns = 5_000_000_000

    def monotonic_ns(self) -> int:
        return self.now_ns

    def time_ns(self) -> int:
        return WALL_ANCHOR_NS

    def advance(self, seconds: float) -> None:
        self.now_ns += round(seconds * 1e9)


class BrokenClock(FakeClock):
    """A Clock that starts raising once ``broken`` is set."""

    broken = False

    def monotonic_ns(self) -> int:
        if self.broken:
            raise RuntimeError("clock exploded")
        return super().monotonic_ns()


class RaisingExporter:
    """An Exporter whose every export raises."""

    def __init__(self) -> None:
        self.calls = 0

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        self.calls += 1
        raise ConnectionError("bridge down")

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        raise RuntimeError("shutdown failed too")


class FailingExporter(InMemoryExporter):
    """An Exporter returning FAILURE (what the SDK exporters do when the receiver is down)."""

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        return MetricExportResult.FAILURE


class ListKernelSource:
    """A KernelSource fed by the test."""

    def __init__(self) -> None:
        self.step_ends: list[int] = []
        self.pending: dict[tuple[str, str], list[float]] = {}
        self.closed = False

    def on_step_end(self, step_index: int) -> None:
        self.step_ends.append(step_index)
        self.pending.setdefault(("gemm", "compute"), []).append(0.001)

    def drain(self) -> KernelWindow:
        window = KernelWindow(durations_s=self.pending, idle_durations_s=[0.0001])
        self.pending = {}
        return window

    def close(self) -> None:
        self.closed = True


def _monitor(clock: FakeClock, exporter: Any, **options: Any) -> StepMonitor:
    return StepMonitor(
        job_id="run-42",
        rank=1,
        world_size=2,
        host_name="node-0",
        exporter=exporter,
        clock=clock,
        start=False,
        **options,
    )


def _metrics(window: MetricsData) -> dict[str, Any]:
    return {m.name: m.data for m in window.resource_metrics[0].scope_metrics[0].metrics}


def _steps(monitor: StepMonitor, clock: FakeClock, count: int, *, step_s: float = 0.010) -> None:
    for _ in range(count):
        with monitor.step():
            with monitor.phase("forward"):
                clock.advance(step_s * 0.4)
            with monitor.phase("backward"):
                clock.advance(step_s * 0.6)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_window_holds_whole_steps_with_exact_bounds(clock: FakeClock) -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(clock, exporter)
    start_offset_ns = clock.now_ns - 5_000_000_000  # the clock was read at construction
    clock.advance(1.0)
    _steps(monitor, clock, 3)
    with monitor.step():  # unfinished at export time: belongs to the next window
        clock.advance(0.005)
        assert monitor.export_now()
        clock.advance(0.005)
    clock.advance(0.5)
    _steps(monitor, clock, 1)
    assert monitor.export_now()
    clock.advance(0.25)
    assert monitor.export_now()  # no step finished: the window says where the rank is
    first, second, progress_only = exporter.exported
    assert set(_metrics(progress_only)) == {_schema.STEP_CURRENT, _schema.STEP_ELAPSED}
    assert _metrics(progress_only)[_schema.STEP_ELAPSED].data_points[0].value == pytest.approx(0.25)
    first_metrics = _metrics(first)
    step_point = first_metrics[_schema.STEP_DURATION].data_points[0]
    assert step_point.count == 3
    assert step_point.start_time_unix_nano == WALL_ANCHOR_NS + start_offset_ns + 1_000_000_000
    assert step_point.time_unix_nano == step_point.start_time_unix_nano + 30_000_000
    assert step_point.sum == pytest.approx(0.030)
    assert first_metrics[_schema.STEP_LAST].data_points[0].value == 2
    phases = {
        p.attributes[_schema.PHASE]: p for p in first_metrics[_schema.PHASE_DURATION].data_points
    }
    assert phases["forward"].count == 3
    assert phases["forward"].sum == pytest.approx(0.012)
    assert phases["backward"].sum == pytest.approx(0.018)

    second_metrics = _metrics(second)
    second_steps = second_metrics[_schema.STEP_DURATION].data_points[0]
    assert second_steps.count == 2
    assert second_steps.start_time_unix_nano == step_point.time_unix_nano
    assert second_metrics[_schema.STEP_LAST].data_points[0].value == 4
    stats = monitor.stats
    assert (stats.steps_recorded, stats.steps_exported, stats.windows_exported) == (5, 5, 3)
    assert (stats.steps_dropped, stats.export_failures, stats.misuse) == (0, 0, 0)
    monitor.close()


def test_phase_outside_a_step_counts_for_the_next_step(clock: FakeClock) -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(clock, exporter)
    with monitor.phase("data"):
        clock.advance(0.002)
    with monitor.step(), monitor.phase("my_custom_phase"), monitor.phase("my_custom_phase"):
        clock.advance(0.003)
    monitor.close()
    (window,) = exporter.exported
    phases = {
        p.attributes[_schema.PHASE]: p.sum
        for p in _metrics(window)[_schema.PHASE_DURATION].data_points
    }
    assert phases == pytest.approx({"data": 0.002, "my_custom_phase": 0.003})


def test_misuse_never_raises_and_is_counted(clock: FakeClock) -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(clock, exporter)
    bad_names: list[Any] = [None, "", "x" * 65, 3, b"forward"]
    for name in bad_names:
        with monitor.phase(name):
            clock.advance(0.001)
    monitor.step().__exit__(None, None, None)  # exit without enter
    with monitor.step():
        with monitor.step():  # nested
            clock.advance(0.001)
        clock.advance(0.001)
    for index in range(300):  # more distinct phases than the cap
        with monitor.phase(f"p{index}"):
            pass
    with pytest.raises(KeyError), monitor.step():  # the user's own error propagates untouched
        raise KeyError("user code")
    monitor.close()
    stats = monitor.stats
    assert stats.misuse == len(bad_names) + 1 + 1 + (300 - 256)
    assert stats.steps_recorded == 2
    assert stats.steps_exported == 2
    window = exporter.exported[-1]
    assert _metrics(window)[_schema.STEP_DURATION].data_points[0].count == 2


def test_a_raising_clock_does_not_reach_the_training_loop() -> None:
    clock = BrokenClock()
    monitor = _monitor(clock, InMemoryExporter())
    clock.broken = True
    with monitor.step(), monitor.phase("forward"):
        pass
    clock.broken = False
    monitor.close()
    assert monitor.stats.misuse >= 2


def test_raising_exporter_is_counted_and_steps_dropped(clock: FakeClock) -> None:
    exporter = RaisingExporter()
    monitor = _monitor(clock, exporter)
    _steps(monitor, clock, 4)
    assert not monitor.export_now()
    _steps(monitor, clock, 2)
    monitor.close()  # flush fails too; shutdown raises; close still returns
    stats = monitor.stats
    assert exporter.calls == 2
    assert (stats.export_failures, stats.steps_dropped, stats.steps_exported) == (2, 6, 0)


def test_failing_exporter_is_counted(clock: FakeClock) -> None:
    monitor = _monitor(clock, FailingExporter())
    _steps(monitor, clock, 3)
    monitor.close()
    assert monitor.stats.export_failures == 1
    assert monitor.stats.steps_dropped == 3


def test_full_buffer_drops_and_counts_steps(clock: FakeClock) -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(clock, exporter, buffer_steps=5)
    _steps(monitor, clock, 8)
    monitor.close()
    stats = monitor.stats
    assert (stats.steps_recorded, stats.steps_exported, stats.steps_dropped) == (8, 5, 3)


@pytest.mark.parametrize(("interval_s", "held"), [(0.25, 4096), (1.0, 4096), (2.5, 3 * 4096)])
def test_default_buffer_holds_4096_steps_per_second_of_interval(
    clock: FakeClock, interval_s: float, held: int
) -> None:
    # The default 10 s interval must not drop the steps of a fast loop (2.5 ms steps: 4,000
    # a window) that the former 1 s default kept.
    monitor = _monitor(clock, InMemoryExporter(), export_interval_s=interval_s)
    for _ in range(held + 2):
        with monitor.step():
            clock.advance(0.001)
    stats = monitor.stats
    monitor.close()
    assert (stats.steps_recorded, stats.steps_queued) == (held + 2, held)
    assert stats.steps_dropped_by_reason["buffer_full"] == stats.steps_dropped == 2


def test_kernel_source_is_told_of_steps_and_drained_into_the_window(clock: FakeClock) -> None:
    exporter = InMemoryExporter()
    source = ListKernelSource()
    monitor = _monitor(clock, exporter, kernel_source=source)
    _steps(monitor, clock, 3)
    monitor.close()
    assert source.step_ends == [0, 1, 2]
    assert source.closed
    metrics = _metrics(exporter.exported[0])
    kernels = metrics[_schema.KERNEL_DURATION]
    assert isinstance(kernels, ExponentialHistogram)
    assert kernels.data_points[0].count == 3
    assert metrics[_schema.DEVICE_IDLE_DURATION].data_points[0].count == 1


class StartRaisingKernelSource(ListKernelSource):
    """A KernelSource whose ``on_monitor_start`` raises (a user's source, a broken CUPTI)."""

    def on_monitor_start(self) -> None:
        raise RuntimeError("source would not start")


def test_a_kernel_source_whose_start_raises_is_left_out_and_steps_continue(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = InMemoryExporter()
    source = StartRaisingKernelSource()
    with caplog.at_level("WARNING", logger="stepwatch.exporters"):
        monitor = _monitor(clock, exporter, kernel_source=source)  # does not raise
    started = [r for r in caplog.records if "on_monitor_start" in r.getMessage()]
    assert len(started) == 1
    assert started[0].exc_info is not None and "would not start" in str(started[0].exc_info[1])
    assert source.closed  # released, and never asked again
    _steps(monitor, clock, 3)
    assert monitor.export_now()
    monitor.close()
    assert source.step_ends == []
    assert monitor.stats.steps_recorded == 3
    metrics = _metrics(exporter.exported[0])
    assert metrics[_schema.STEP_DURATION].data_points[0].count == 3
    assert _schema.KERNEL_DURATION not in metrics


def test_close_is_idempotent_and_steps_after_close_do_not_raise(clock: FakeClock) -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(clock, exporter)
    monitor.close()
    monitor.close()
    _steps(monitor, clock, 2)
    assert monitor.stats.steps_recorded == 2


def test_background_thread_exports_every_interval() -> None:
    exporter = InMemoryExporter()
    with StepMonitor(
        job_id="j", rank=0, world_size=1, exporter=exporter, export_interval_s=0.02
    ) as monitor:
        with monitor.step():
            pass
        deadline = time.monotonic() + 10.0
        while not exporter.exported and time.monotonic() < deadline:
            time.sleep(0.01)
        with monitor.step():
            pass
    assert monitor.stats.steps_exported == 2
    assert len(exporter.exported) == 2
    last = _metrics(exporter.exported[-1])[_schema.STEP_LAST]
    assert isinstance(last, Gauge)
    assert last.data_points[0].value == 1


def test_export_interval_from_argument_then_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def make(**options: Any) -> StepMonitor:
        monitor = StepMonitor(
            job_id="j", rank=0, world_size=1, exporter=InMemoryExporter(), start=False, **options
        )
        monitor.close()
        return monitor

    monkeypatch.delenv("OTEL_METRIC_EXPORT_INTERVAL", raising=False)
    assert make().export_interval_s == 10.0
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "250")
    assert make().export_interval_s == 0.25
    assert make(export_interval_s=2.0).export_interval_s == 2.0
    # A bad variable is treated as unset with a warning naming it (OTel specification).
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "soon")
    assert make().export_interval_s == 10.0
    assert any("OTEL_METRIC_EXPORT_INTERVAL" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="export_interval_s"):
        make(export_interval_s=0)
    with pytest.raises(ConfigError, match="buffer_steps"):
        make(export_interval_s=1.0, buffer_steps=0)


@pytest.fixture
def stepwatch_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level("CRITICAL", logger="stepwatch.exporters")
    caplog.set_level("CRITICAL", logger="opentelemetry")
    yield caplog


def test_hot_path_is_cheap(clock: FakeClock, stepwatch_logs: pytest.LogCaptureFixture) -> None:
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, exporter=InMemoryExporter(), buffer_steps=100_000
    )
    steps = 5000
    timings = []
    for _ in range(steps):
        started = time.perf_counter_ns()
        with monitor.step():
            with monitor.phase("data"):
                pass
            with monitor.phase("forward"):
                pass
            with monitor.phase("backward"):
                pass
            with monitor.phase("optimizer"):
                pass
        timings.append(time.perf_counter_ns() - started)
    monitor.close()
    timings.sort()
    median_us = timings[len(timings) // 2] / 1000
    # A step with four phases costs a few microseconds; 100 µs leaves room for a loaded CI box.
    assert median_us < 100.0
    assert monitor.stats.steps_recorded == steps


def test_threads_do_not_leak(clock: FakeClock) -> None:
    before = threading.active_count()
    monitor = StepMonitor(job_id="j", rank=0, world_size=1, exporter=InMemoryExporter())
    monitor.close()
    deadline = time.monotonic() + 5.0
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


class FakeDeviceTimer:
    """A DeviceTimer whose marks are device timestamps in ms; the device has run up to `done`."""

    def __init__(self) -> None:
        self.device_ms = 0.0
        self.done_ms = 0.0

    def mark(self) -> float:
        return self.device_ms

    def ready(self, mark: float) -> bool:
        return mark <= self.done_ms

    def elapsed_s(self, start: float, end: float) -> float:
        return (end - start) / 1000.0


def test_device_timer_gives_durations_and_holds_unfinished_steps(clock: FakeClock) -> None:
    exporter = InMemoryExporter()
    device = FakeDeviceTimer()
    monitor = _monitor(clock, exporter, device_timer=device)
    for _ in range(3):
        with monitor.step():
            with monitor.phase("forward"):
                device.device_ms += 4.0  # the device spends 4 ms, the host almost nothing
                clock.advance(0.0001)
            device.device_ms += 1.0
    device.done_ms = 5.0  # only the first step has finished on the device
    assert monitor.export_now()
    assert monitor.export_now()  # nothing new has finished: only where the rank is
    device.done_ms = 15.0
    monitor.close()
    first, progress_only, second = exporter.exported
    assert _schema.STEP_DURATION not in _metrics(progress_only)
    assert _metrics(progress_only)[_schema.STEP_CURRENT].data_points[0].value == 3
    first_steps = _metrics(first)[_schema.STEP_DURATION].data_points[0]
    assert first_steps.count == 1
    assert first_steps.sum == pytest.approx(0.005)
    second_metrics = _metrics(second)
    assert second_metrics[_schema.STEP_DURATION].data_points[0].count == 2
    forward = second_metrics[_schema.PHASE_DURATION].data_points[0]
    assert forward.sum == pytest.approx(0.008)


def test_device_timer_names() -> None:
    def make(device_timer: Any) -> StepMonitor:
        monitor = StepMonitor(
            job_id="j",
            rank=0,
            world_size=1,
            exporter=InMemoryExporter(),
            device_timer=device_timer,
            start=False,
        )
        monitor.close()
        return monitor

    make("cpu")
    make(None)
    make("auto")  # no CUDA on this machine (or torch not imported): the host clock
    with pytest.raises(ConfigError, match="device_timer"):
        make("tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            make("cuda")


def test_an_unclosed_monitor_flushes_at_interpreter_exit() -> None:
    import subprocess
    import sys

    code = (
        "import atexit\n"
        "from stepwatch.exporters import InMemoryExporter, StepMonitor\n"
        "exporter = InMemoryExporter()\n"
        "atexit.register(lambda: print('windows', len(exporter.exported)))\n"
        "monitor = StepMonitor(job_id='j', rank=0, world_size=1, exporter=exporter,\n"
        "                      export_interval_s=3600)\n"
        "with monitor.step():\n"
        "    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "windows 1"
