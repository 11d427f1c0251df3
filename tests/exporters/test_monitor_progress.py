"""Where a rank is, even when no step finishes: the progress gauges of a window without steps."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import Gauge, MetricsData

from stepwatch.core import _schema
from stepwatch.exporters import InMemoryExporter
from stepwatch.exporters._recorder import StepRecorder
from stepwatch.exporters.auto._auto import _AutoState
from tests.exporters.test_monitor import WALL_ANCHOR_NS, FakeClock, _monitor


def _gauges(window: MetricsData) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Gauge name → (value, attributes) of its one point; histograms left out."""
    found = {}
    for metric in window.resource_metrics[0].scope_metrics[0].metrics:
        if isinstance(metric.data, Gauge):
            (point,) = metric.data.data_points
            found[metric.name] = (point.value, dict(point.attributes))
    return found


def test_a_rank_stuck_in_a_phase_says_where_and_for_how_long() -> None:
    clock, exporter = FakeClock(), InMemoryExporter()
    monitor = _monitor(clock, exporter)
    for _ in range(3):
        with monitor.step():
            clock.advance(0.010)
    assert monitor.export_now()
    with monitor.step():
        clock.advance(0.002)
        with monitor.phase("data"):  # the loader never returns (yet)
            clock.advance(12.0)
            assert monitor.export_now()
            gauges = _gauges(exporter.exported[-1])
    assert gauges[_schema.STEP_CURRENT] == (3, {})
    assert gauges[_schema.STEP_ELAPSED][0] == pytest.approx(12.002)
    assert gauges[_schema.STEP_ELAPSED][1] == {_schema.PHASE: "data"}
    assert gauges[_schema.PHASE_ELAPSED] == (pytest.approx(12.0), {_schema.PHASE: "data"})
    # The window holds no step: no step histogram, no step.last.
    window = exporter.exported[-1].resource_metrics[0].scope_metrics[0].metrics
    assert {m.name for m in window} == {
        _schema.STEP_CURRENT,
        _schema.STEP_ELAPSED,
        _schema.PHASE_ELAPSED,
    }
    point = window[0].data.data_points[0]
    assert point.time_unix_nano == WALL_ANCHOR_NS + 12_032_000_000
    monitor.close()


def test_nested_phases_report_the_inner_one_and_none_between_phases() -> None:
    clock, exporter = FakeClock(), InMemoryExporter()
    monitor = _monitor(clock, exporter)
    with monitor.step():
        with monitor.phase("optimizer"):
            clock.advance(1.0)
            with monitor.phase("checkpoint"):
                clock.advance(2.0)
                monitor.export_now()
                inner = _gauges(exporter.exported[-1])
        clock.advance(4.0)
        monitor.export_now()  # inside the step, outside every phase
        between = _gauges(exporter.exported[-1])
    assert inner[_schema.PHASE_ELAPSED] == (pytest.approx(2.0), {_schema.PHASE: "checkpoint"})
    assert between[_schema.STEP_ELAPSED] == (pytest.approx(7.0), {})
    assert _schema.PHASE_ELAPSED not in between
    monitor.close()


def test_windows_with_steps_carry_no_progress_gauges_but_the_first() -> None:
    clock, exporter = FakeClock(), InMemoryExporter()
    monitor = _monitor(clock, exporter)
    for _ in range(2):
        with monitor.step():
            clock.advance(0.01)
        monitor.export_now()
    first, second = (_gauges(window) for window in exporter.exported)
    # The first says the monitor reports progress (a job that never stalls still shows it).
    assert first[_schema.STEP_CURRENT] == (1, {})
    assert first[_schema.STEP_ELAPSED] == (0.0, {})
    assert set(second) == {_schema.STEP_LAST}
    monitor.close()


def test_the_last_window_says_the_monitor_closed() -> None:
    clock, exporter = FakeClock(), InMemoryExporter()
    monitor = _monitor(clock, exporter)
    with monitor.step():
        clock.advance(0.01)
    monitor.export_now()
    clock.advance(1.0)
    monitor.close()
    last = _gauges(exporter.exported[-1])
    assert last[_schema.MONITOR_CLOSED] == (1, {})
    assert last[_schema.STEP_ELAPSED][0] == pytest.approx(1.0)
    assert all(_schema.MONITOR_CLOSED not in _gauges(w) for w in exporter.exported[:-1])


def test_the_closed_marker_rides_with_the_last_steps() -> None:
    clock, exporter = FakeClock(), InMemoryExporter()
    monitor = _monitor(clock, exporter)
    with monitor.step():
        clock.advance(0.01)
    monitor.close()
    (window,) = exporter.exported
    assert _gauges(window)[_schema.MONITOR_CLOSED] == (1, {})


def test_auto_mode_phase_is_the_latest_open_one() -> None:
    pytest.importorskip("torch")
    clock = FakeClock()
    state = _AutoState(_recorder(clock))
    assert state.open_phase() is None
    state.data_start_ns = 10
    assert state.open_phase() == ("data", 10)
    state.data_start_ns = None
    state.forward_depth, state.forward_start_ns = 1, 20
    assert state.open_phase() == ("forward", 20)
    state.forward_depth = 0
    state.in_backward, state.backward_start_ns = True, 30
    assert state.open_phase() == ("backward", 30)
    # The last gradient is ready: DDP waits for its allreduce inside loss.backward().
    state.gradient_stamp.ns = 40
    assert state.open_phase() == ("communication", 40)
    state.in_backward, state.gradient_stamp.ns = False, 0
    # Timed collectives: two issued, one completed → still in communication since the second.
    state.comm_starts_ns.extend([50, 55])
    state.comm_ends_ns.append(53)
    assert state.open_phase() == ("communication", 55)
    state.comm_ends_ns.append(60)
    assert state.open_phase() is None
    state.optimizer_start_ns = 70
    assert state.open_phase() == ("optimizer", 70)
    state.enabled = False
    assert state.open_phase() is None


def _recorder(clock: FakeClock) -> StepRecorder:
    import logging

    from stepwatch.core._ratelog import RateLimitedLog

    return StepRecorder(
        clock=clock,
        device_timer=None,
        kernel_source=None,
        buffer_steps=16,
        log=RateLimitedLog(logging.getLogger("test"), 60.0),
    )


def test_auto_mode_phase_reaches_the_window() -> None:
    torch = pytest.importorskip("torch")
    clock, exporter = FakeClock(), InMemoryExporter()
    monitor = _monitor(clock, exporter)
    seen: list[dict[str, Any]] = []

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def forward(self, inputs: Any) -> Any:
            clock.advance(3.0)  # a forward that hangs: the export thread looks meanwhile
            monitor.export_now()
            seen.append(_gauges(exporter.exported[-1]))
            return self.layer(inputs)

    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert seen[0][_schema.PHASE_ELAPSED] == (pytest.approx(3.0), {_schema.PHASE: "forward"})
    monitor.close()
