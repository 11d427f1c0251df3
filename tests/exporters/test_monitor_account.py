"""The exporter's own account (issue 17, item 5): counters that add up; a close() that returns.

Every step and window is delivered, dropped with a reason, or still queued; ``close()``
returns within its timeout (2 s by default) even against an endpoint that accepts connections
and never answers, and afterwards the counters say every window was lost and why.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from stepwatch.exporters import InMemoryExporter, MonitorStats, StepMonitor


def _adds_up(stats: MonitorStats) -> None:
    assert stats.steps_recorded == stats.steps_exported + stats.steps_dropped + stats.steps_queued
    assert stats.steps_dropped == sum(stats.steps_dropped_by_reason.values())
    assert stats.windows_built == (
        stats.windows_exported + stats.windows_dropped + stats.windows_in_flight
    )
    assert stats.windows_dropped == sum(stats.windows_dropped_by_reason.values())


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An endpoint that accepts TCP connections (the kernel's backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


def _train(monitor: StepMonitor, steps: int, *, step_s: float = 0.005) -> None:
    for _ in range(steps):
        with monitor.step(), monitor.phase("forward"):
            time.sleep(step_s)


def _closed_against(black_hole: str) -> tuple[StepMonitor, float]:
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, endpoint=black_hole, export_interval_s=0.1, health=False
    )
    _train(monitor, 100)  # the first window is stuck on the wire with a 10 s deadline
    started = time.monotonic()
    monitor.close()
    return monitor, time.monotonic() - started


def test_close_returns_within_its_default_timeout_against_a_black_hole(black_hole: str) -> None:
    _, took = _closed_against(black_hole)
    assert took <= 2.0 + 0.1, took  # the default timeout, plus scheduling slack


def test_after_close_against_a_black_hole_every_loss_is_counted(black_hole: str) -> None:
    monitor, _ = _closed_against(black_hole)
    stats = monitor.stats
    # What issue 17 saw: 0 dropped and 0 failures although every window was lost.
    assert stats.steps_recorded == 100
    assert stats.steps_exported == 0 and stats.windows_exported == 0
    assert stats.steps_dropped == 100
    assert stats.export_failures >= 1
    _adds_up(stats)
    assert stats.steps_queued == 0
    assert stats.windows_dropped == stats.windows_built == stats.export_failures
    assert stats.windows_dropped_by_reason["closed"] >= 1  # cut short by close()


def test_close_honours_a_shorter_timeout(black_hole: str) -> None:
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, endpoint=black_hole, export_interval_s=0.05, health=False
    )
    _train(monitor, 20)
    started = time.monotonic()
    monitor.close(timeout_s=0.5)
    assert time.monotonic() - started <= 0.6
    _adds_up(monitor.stats)
    assert monitor.stats.steps_dropped == 20


def test_a_refusing_endpoint_drops_with_reason_export_failed() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed once the block ends: connections refused
    monitor = StepMonitor(
        job_id="j",
        rank=0,
        world_size=1,
        endpoint=f"http://127.0.0.1:{port}",
        export_interval_s=0.05,
        timeout_s=0.2,
        health=False,
    )
    _train(monitor, 60)
    monitor.close()
    stats = monitor.stats
    _adds_up(stats)
    assert stats.steps_exported == 0 and stats.steps_dropped == 60
    assert stats.windows_dropped_by_reason["export_failed"] >= 1


def test_a_full_buffer_drops_with_reason_buffer_full() -> None:
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, exporter=exporter, buffer_steps=4, start=False
    )
    _train(monitor, 10, step_s=0.0)
    stats = monitor.stats
    _adds_up(stats)
    assert stats.steps_dropped_by_reason["buffer_full"] == 6 and stats.steps_queued == 4
    monitor.close()
    stats = monitor.stats
    _adds_up(stats)
    assert (stats.steps_exported, stats.steps_dropped, stats.steps_queued) == (4, 6, 0)


class StuckExporter:
    """An injected exporter that blocks until released and ignores shutdown (the worst case)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        self.release.wait(30.0)
        return MetricExportResult.SUCCESS

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        return None


def test_a_window_still_in_flight_after_close_is_counted_as_queued() -> None:
    exporter = StuckExporter()
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, exporter=exporter, export_interval_s=0.05
    )
    _train(monitor, 10)
    deadline = time.monotonic() + 10.0
    while monitor.stats.windows_in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    monitor.close(timeout_s=0.5)
    assert time.monotonic() - started <= 0.6
    stats = monitor.stats
    _adds_up(stats)
    assert stats.windows_in_flight == 1 and stats.steps_queued > 0
    exporter.release.set()  # it does get through in the end: the account follows
    deadline = time.monotonic() + 10.0
    while monitor.stats.windows_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = monitor.stats
    _adds_up(stats)
    assert stats.steps_recorded == stats.steps_exported + stats.steps_dropped
