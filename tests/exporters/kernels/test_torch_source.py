"""The torch.profiler CPU source: duty cycle, step attribution, never raising."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from stepwatch._errors import ConfigError
from stepwatch.exporters.kernels import OpRecord, TorchProfilerSource


class ScriptedBackend:
    """A real :class:`ProfilerBackend` that replays scripted ops per cycle."""

    def __init__(self, cycles: Sequence[Sequence[OpRecord]]) -> None:
        self.cycles = list(cycles)
        self.starts = 0
        self.stops = 0
        self.running = False

    def start(self) -> None:
        assert not self.running
        self.running = True
        self.starts += 1

    def stop(self) -> Callable[[], Sequence[OpRecord]]:
        assert self.running
        self.running = False
        self.stops += 1
        ops = self.cycles.pop(0) if self.cycles else []
        return lambda: ops


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns


def test_duty_cycle_starts_and_stops_on_step_boundaries() -> None:
    backend = ScriptedBackend([])
    clock = FakeClock()
    source = TorchProfilerSource(active_steps=2, period_steps=5, backend=backend, clock_ns=clock)
    running = []
    for step in range(12):
        clock.now_ns += 1000
        source.on_step_end(step)
        running.append(backend.running)
    # Cycles begin after steps 0, 5, 10 and cover two steps each.
    assert running == [True, True, False, False, False, True, True, False, False, False, True, True]
    assert backend.starts == 3 and backend.stops == 2


def test_ops_are_attributed_to_steps_by_self_time() -> None:
    clock = FakeClock()
    ops = [
        # step 1 (1000, 2000]: linear wraps addmm; relu alone.
        OpRecord("aten::linear", 1100, 1500, 7),
        OpRecord("aten::addmm", 1150, 1450, 7),
        OpRecord("aten::relu", 1600, 1700, 7),
        # step 2 (2000, 3000]
        OpRecord("aten::mm", 2100, 2900, 7),
    ]
    backend = ScriptedBackend([ops])
    source = TorchProfilerSource(active_steps=2, period_steps=2, backend=backend, clock_ns=clock)
    for step, now in enumerate((1000, 2000, 3000)):
        clock.now_ns = now
        source.on_step_end(step)
    window = source.drain()
    gemm = sorted(window.durations_s[("gemm", "compute")])
    assert gemm == pytest.approx([100e-9, 300e-9, 800e-9], abs=1e-9)  # linear self, addmm, mm
    assert window.durations_s[("relu", "compute")] == pytest.approx([100e-9], abs=1e-9)
    # Idle per step: step 1 busy 400 + 100 of 1000; step 2 busy 800 of 1000.
    assert window.idle_durations_s == pytest.approx((500e-9, 200e-9), abs=1e-9)
    assert source.drain().durations_s == {}


def test_backend_failure_disables_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(ScriptedBackend):
        def start(self) -> None:
            raise RuntimeError("profiler already running")

    source = TorchProfilerSource(active_steps=1, period_steps=1, backend=Broken([]))
    with caplog.at_level(logging.ERROR):
        for step in range(5):
            source.on_step_end(step)
    assert sum("kernel collection disabled" in r.message for r in caplog.records) == 1
    assert source.drain().durations_s == {}


def test_slow_export_thread_drops_old_cycles() -> None:
    backend = ScriptedBackend([[OpRecord("aten::mm", 1, 2, 0)]] * 10)
    source = TorchProfilerSource(
        active_steps=1, period_steps=1, backend=backend, max_pending_cycles=2
    )
    for step in range(8):
        source.on_step_end(step)
    assert source.dropped_cycles == 5
    source.close()
    assert not backend.running


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"active_steps": 0}, "active_steps"),
        ({"active_steps": 5, "period_steps": 4}, "period_steps"),
        ({"max_pending_cycles": 0}, "max_pending_cycles"),
    ],
)
def test_config_errors(kwargs: dict[str, int], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TorchProfilerSource(backend=ScriptedBackend([]), **kwargs)


def test_real_torch_profiler_on_a_training_loop() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
    source = TorchProfilerSource(active_steps=3, period_steps=4)
    windows = []

    def export_thread() -> None:
        windows.append(source.drain())

    for step in range(8):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        source.on_step_end(step)
    thread = threading.Thread(target=export_thread)
    thread.start()
    thread.join()
    source.close()
    (window,) = windows
    classes = {name for name, _ in window.durations_s}
    assert {"gemm", "relu"} <= classes
    # Steps 1-3 and 5-7 profiled (two cycles of three steps): one idle value per step.
    assert len(window.idle_durations_s) == 6
    forward_gemms = len(window.durations_s[("gemm", "compute")])
    assert forward_gemms >= 6 * 2  # at least two linear layers per profiled step


def test_step_monitor_exports_cpu_kernels() -> None:
    """The source plugs into StepMonitor: kernel histograms ride in the step windows."""
    from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

    from stepwatch import _schema
    from stepwatch.exporters import StepMonitor

    class Recording:
        def __init__(self) -> None:
            self.windows: list[MetricsData] = []

        def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000) -> Any:
            self.windows.append(metrics_data)
            return MetricExportResult.SUCCESS

        def shutdown(self, timeout_millis: float = 30_000) -> None:
            pass

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    x = torch.randn(4, 8)
    exporter = Recording()
    source = TorchProfilerSource(active_steps=2, period_steps=2)
    monitor = StepMonitor(
        job_id="j",
        rank=0,
        world_size=1,
        host_name="h",
        exporter=exporter,
        kernel_source=source,
        start=False,
    )
    for _ in range(5):
        with monitor.step():
            model(x).sum().backward()
    monitor.export_now()
    monitor.close()
    names = {
        metric.name: metric
        for window in exporter.windows
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
    }
    assert _schema.KERNEL_DURATION in names
    classes = {
        point.attributes[_schema.KERNEL_CLASS]
        for point in names[_schema.KERNEL_DURATION].data.data_points
    }
    assert "gemm" in classes
