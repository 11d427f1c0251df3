"""The export thread's schedule: regular windows, and an early one when a rank stops stepping."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stepwatch.core import _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters.monitor._cadence import ExportCadence


def _drive(cadence: ExportCadence, steps_at: Any, until_s: float) -> list[tuple[float, str]]:
    """Run the schedule on a fake clock; ``steps_at(t)`` is (steps finished, steps pending)."""
    now, exports = 0.0, []
    while now < until_s:
        now += cadence.wait_s(now) or 1e-9
        steps, pending = steps_at(now)
        regular = now >= cadence.next_tick_s - 1e-3
        if cadence.due(now, steps, pending=pending):
            exports.append((round(now, 3), "regular" if regular else "early"))
    return exports


def test_a_steady_rank_exports_once_an_interval() -> None:
    cadence = ExportCadence(10.0, 0.0)
    exports = _drive(cadence, lambda t: (int(t / 0.02), 3), 45.0)
    assert exports == [(10.0, "regular"), (20.0, "regular"), (30.0, "regular"), (40.0, "regular")]
    assert cadence.early_exports == 0


def test_a_stalled_rank_sends_its_steps_then_where_it_is_then_waits_for_the_tick() -> None:
    # 20 ms steps until t = 13.5 s, then none: at 2 s without a step (4 steps are 80 ms), the
    # steps finished since the 10 s window; a probe later, a window of where the rank is.
    def steps_at(t: float) -> tuple[int, int]:
        done = int(min(t, 13.5) / 0.02)
        return done, (done if t < 16.5 else 0)  # the early export at 16 s drains them

    exports = _drive(ExportCadence(10.0, 0.0), steps_at, 31.0)
    assert exports == [
        (10.0, "regular"),
        (16.0, "early"),  # its last 175 steps
        (17.0, "early"),  # where it is
        (20.0, "regular"),
        (30.0, "regular"),
    ]


def test_the_stall_threshold_follows_the_usual_step() -> None:
    # 5 s steps (the first one's time, from the start, is the first estimate): no early window
    # inside a step (4 steps are 20 s), one after 20 s without a step.
    def steps_at(t: float) -> tuple[int, int]:
        return int(min(t, 25.0) / 5.0), 0

    exports = _drive(ExportCadence(60.0, 0.0), steps_at, 50.0)
    assert exports == [(45.0, "early")]


@pytest.mark.parametrize("interval_s", [1.0, 0.25])
def test_short_intervals_have_no_probe(interval_s: float) -> None:
    cadence = ExportCadence(interval_s, 0.0)
    exports = _drive(cadence, lambda t: (int(min(t, 0.5) / 0.01), 0), 4.0)
    assert [kind for _, kind in exports] == ["regular"] * round(4.0 / interval_s)


def test_no_early_window_before_the_first_step() -> None:
    exports = _drive(ExportCadence(10.0, 0.0), lambda t: (0, 0), 25.0)
    assert exports == [(10.0, "regular"), (20.0, "regular")]


def test_a_real_monitor_says_where_a_stalled_rank_is_within_seconds() -> None:
    # 10 s windows (the default); the loop stops inside its data phase after ~1 s of steps.
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="stall",
        rank=0,
        world_size=1,
        exporter=exporter,
        export_interval_s=10.0,
        health=False,
    )
    release = threading.Event()
    started = time.monotonic()
    try:
        for _ in range(50):
            with monitor.step(), monitor.phase("forward"):
                time.sleep(0.02)
        stalled_at = time.monotonic()
        with monitor.step(), monitor.phase("data"):
            deadline = stalled_at + 8.0
            while time.monotonic() < deadline and len(exporter.exported) < 2:
                time.sleep(0.05)
            seen_s = time.monotonic() - stalled_at
            release.set()
    finally:
        monitor.close()
    assert time.monotonic() - started < 15.0
    windows = exporter.exported
    first, second = (
        {m.name: m for m in w.resource_metrics[0].scope_metrics[0].metrics} for w in windows[:2]
    )
    assert first[_schema.STEP_DURATION].data.data_points[0].count == 50  # the steps before it
    elapsed = second[_schema.STEP_ELAPSED].data.data_points[0]
    assert elapsed.attributes[_schema.PHASE] == "data"  # then where it is
    assert 2.0 <= seen_s < 5.0 and elapsed.value >= 2.0
