"""Device back ends are a registry: a vendor declared once is found by "auto", and none is fine.

A fake vendor is declared here, in the test, the way a real one is declared in
``device/_backends.py`` (its name, its probe, how it is made): ``device_timer="auto"`` and
``health=None`` find it with no other edit. With no back end present the monitor times on the
host clock and sends no health readings, without raising.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from stepwatch.core import ConfigError, _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters.device import _backends
from stepwatch.exporters.device._backends import HealthBackend, TimerBackend

VENDOR_METRIC = "vendor.gpu.busy"


class VendorTimer:
    """A vendor's device timer: every step it times took 0.25 s on the device."""

    def __init__(self) -> None:
        self.marks = 0

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def ready(self, mark: Any) -> bool:
        return True

    def elapsed_s(self, start: Any, end: Any) -> float:
        return 0.25


class VendorHealth:
    """A vendor's health source: one gauge a window."""

    def __init__(self, resource: Any) -> None:
        self.resource = resource
        self.samples = 0

    def sample(self) -> None:
        self.samples += 1

    def build(self, *, start_unix_nano: int, end_unix_nano: int) -> Any:
        from opentelemetry.sdk.metrics.export import (
            Gauge,
            Metric,
            MetricsData,
            NumberDataPoint,
            ResourceMetrics,
            ScopeMetrics,
        )
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        point = NumberDataPoint(
            attributes={},
            start_time_unix_nano=start_unix_nano,
            time_unix_nano=end_unix_nano,
            value=0.5,
        )
        metric = Metric(name=VENDOR_METRIC, description="", unit="1", data=Gauge([point]))
        scope = ScopeMetrics(scope=InstrumentationScope("vendor"), metrics=[metric], schema_url="")
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(resource=self.resource, scope_metrics=[scope], schema_url="")
            ]
        )


def _absent_timer() -> None:
    return None


def _refuse_timer() -> Any:
    raise ConfigError("device_timer='absent' needs its device; none is here")


def _absent_health(resource: Any) -> None:
    return None


def _raising_probe(*args: Any) -> None:
    raise RuntimeError("the vendor's driver is broken")


ABSENT_TIMER = TimerBackend("absent", _absent_timer, _refuse_timer)
ABSENT_HEALTH = HealthBackend("absent", _absent_health, VendorHealth)


def _window(monitor: StepMonitor, exporter: InMemoryExporter) -> dict[str, Any]:
    """Two steps, one export: the window's metrics by name."""
    for _ in range(2):
        with monitor.step(), monitor.phase("forward"):
            pass
    assert monitor.export_now(timeout_s=5)
    monitor.close()
    (resource_metrics,) = exporter.exported[0].resource_metrics  # the steps; then the closing one
    return {
        metric.name: metric.data
        for scope in resource_metrics.scope_metrics
        for metric in scope.metrics
    }


def _monitor(exporter: InMemoryExporter, **options: Any) -> StepMonitor:
    return StepMonitor(job_id="j", rank=0, world_size=1, exporter=exporter, start=False, **options)


def test_auto_finds_a_vendor_declared_once(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = VendorTimer()
    vendor_timer = TimerBackend("vendor", lambda: timer, lambda: timer)
    vendor_health = HealthBackend("vendor", VendorHealth, VendorHealth)
    # Asked in turn: the absent back end first, the vendor's next.
    monkeypatch.setattr(_backends, "TIMERS", (ABSENT_TIMER, vendor_timer))
    monkeypatch.setattr(_backends, "HEALTH", (ABSENT_HEALTH, vendor_health))
    exporter = InMemoryExporter()
    metrics = _window(_monitor(exporter, device_timer="auto", health=None), exporter)
    (steps,) = metrics[_schema.STEP_DURATION].data_points
    assert steps.count == 2 and steps.sum == pytest.approx(0.5)  # the vendor's device time
    assert timer.marks > 0
    assert VENDOR_METRIC in metrics  # the vendor's health rides in the window


def test_a_vendor_is_also_named(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = VendorTimer()
    monkeypatch.setattr(
        _backends, "TIMERS", (ABSENT_TIMER, TimerBackend("vendor", _absent_timer, lambda: timer))
    )
    exporter = InMemoryExporter()
    metrics = _window(_monitor(exporter, device_timer="vendor", health=False), exporter)
    assert metrics[_schema.STEP_DURATION].data_points[0].sum == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="needs its device"):
        _monitor(InMemoryExporter(), device_timer="absent")
    with pytest.raises(ConfigError, match="'auto', 'absent', 'vendor', 'cpu'"):
        _monitor(InMemoryExporter(), device_timer="tpu")


def test_with_no_back_end_present_the_monitor_runs_on_the_host_clock_without_health(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_backends, "TIMERS", (ABSENT_TIMER,))
    monkeypatch.setattr(_backends, "HEALTH", (ABSENT_HEALTH,))
    exporter = InMemoryExporter()
    monitor = _monitor(exporter, device_timer="auto", health=None)
    assert _backends.resolve_device_timer("auto") is None
    metrics = _window(monitor, exporter)
    assert metrics[_schema.STEP_DURATION].data_points[0].count == 2
    assert not any(name.startswith(("hw.", "stepwatch.gpu.", "vendor.")) for name in metrics)


def test_a_probe_that_raises_is_absent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        _backends, "TIMERS", (TimerBackend("broken", _raising_probe, _refuse_timer),)
    )
    monkeypatch.setattr(
        _backends, "HEALTH", (HealthBackend("broken", _raising_probe, VendorHealth),)
    )
    exporter = InMemoryExporter()
    with caplog.at_level(logging.WARNING, logger="stepwatch.exporters"):
        monitor = _monitor(exporter, device_timer="auto", health=None)
    assert [record.getMessage() for record in caplog.records] == [
        "device back end 'broken': its probe raised; taken as absent"
    ] * 2
    assert _window(monitor, exporter)[_schema.STEP_DURATION].data_points[0].count == 2


def test_health_true_without_a_present_back_end_makes_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # health=True: on even where no probe answers (NVML's sampler then logs once, goes quiet).
    monkeypatch.setattr(_backends, "HEALTH", (ABSENT_HEALTH,))
    resource = object()
    made = _backends.resolve_health(True, resource)  # type: ignore[arg-type]
    assert isinstance(made, VendorHealth) and made.resource is resource
    assert _backends.resolve_health(False, resource) is None  # type: ignore[arg-type]
