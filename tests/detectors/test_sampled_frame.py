"""Phase times from sampled steps (``frame._sampled``): what they rest on and pair with."""

from __future__ import annotations

import numpy as np
import pytest

from stepwatch.core import _schema
from stepwatch.core._influx import QuerySeries
from stepwatch.detectors.frame import _sampled
from stepwatch.detectors.frame._frame import frame_from_series

MIN = _sampled.MIN_TIMED_STEPS


def _pool(
    phase_total: list[float],
    steps: list[float],
    timed: list[float],
    timed_total: list[float],
    stood_for: list[float] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank, one phase; ``stood_for`` defaults to ``steps`` (no weight carried)."""
    column = np.array(steps, dtype=float)[:, None]
    phase, step, rests_on = _sampled.pool(
        np.array(phase_total, dtype=float)[:, None, None],
        column,
        np.array(timed, dtype=float)[:, None],
        column if stood_for is None else np.array(stood_for, dtype=float)[:, None],
        np.array(timed_total, dtype=float)[:, None],
    )
    return phase[:, 0, 0], step[:, 0], rests_on[:, 0]


def test_a_window_with_every_step_timed_stands_alone() -> None:
    phase, step, rests_on = _pool([0.2, 0.4], [10, 10], [10, 10], [1.0, 2.0])
    assert phase == pytest.approx([0.02, 0.04])
    assert step == pytest.approx([0.1, 0.2])
    assert rests_on.tolist() == [10, 10]


def test_a_thin_window_takes_the_windows_before_it_until_enough_steps_were_timed() -> None:
    timed = [MIN, MIN // 2, MIN // 2, 2]
    phase_total = [1.0, 2.0, 3.0, 4.0]
    steps = [50.0] * 4
    timed_total = [5.0, 6.0, 7.0, 8.0]
    phase, step, rests_on = _pool(phase_total, steps, timed, timed_total)
    assert rests_on.tolist() == [MIN, MIN + MIN // 2, MIN, MIN + 2]
    assert phase[0] == pytest.approx(1.0 / 50)
    assert phase[1] == pytest.approx(3.0 / 100)  # windows 0-1
    assert phase[2] == pytest.approx(5.0 / 100)  # windows 1-2: enough, no further back
    assert phase[3] == pytest.approx(9.0 / 150)  # windows 1-3
    # The step time they pair with: the sampled steps' (weighted) mean over the same span.
    assert step[3] == pytest.approx(21.0 / 150)


def test_pooling_stops_at_the_frame_start_and_after_max_windows() -> None:
    n = _sampled.MAX_POOLED_WINDOWS + 3
    phase, step, rests_on = _pool([1.0] * n, [10.0] * n, [1.0] * n, [0.5] * n)
    assert rests_on[0] == 1  # the frame's first window: what there is
    assert rests_on.max() == _sampled.MAX_POOLED_WINDOWS  # never further back than that
    assert phase == pytest.approx([0.1] * n)
    assert step == pytest.approx([0.05] * n)


def test_a_silent_window_is_nan_and_a_window_with_no_timed_step_borrows() -> None:
    # The third window's steps were not timed: the exporter hands them to the next sampled
    # step (no sampled-step point, nothing stood for); it borrows the first window's.
    phase, step, rests_on = _pool(
        [1.0, 0.0, 0.0], [10.0, 0.0, 10.0], [MIN, 0, 0], [2.0, 0, 0], [10.0, 0, 0]
    )
    assert np.isnan(phase[1]) and np.isnan(step[1]) and np.isnan(rests_on[1])
    assert phase[2] == pytest.approx(1.0 / 20) and step[2] == pytest.approx(2.0 / 10)
    assert rests_on[2] == MIN


def _series(name: str, rank: int, columns: list[str], rows: list[list[float]]) -> QuerySeries:
    tags = {_schema.RANK: str(rank), _schema.HOST_NAME: "h"}
    if name == _schema.PHASE_DURATION:
        tags[_schema.PHASE] = "communication"
    return QuerySeries(name=name, tags=tags, columns=["time", *columns], values=rows)


def test_the_frame_reads_the_sampled_steps_and_pairs_phases_with_them() -> None:
    # Rank 0 every step timed (no sampled-step points); rank 1 sampled from its second
    # window on: 4 of 40 steps timed per window, longer steps on exactly those.
    second = 10**9
    results = []
    for rank in (0, 1):
        step_rows = [[(w + 1) * second, 40 * 0.01, 40, 0.012] for w in range(4)]
        results.append(_series(_schema.STEP_DURATION, rank, ["sum", "count", "max"], step_rows))
        wait = 0.004 if rank == 0 else 0.006
        phase_rows = [[(w + 1) * second, 40 * wait, 40, 0.01, 0.001] for w in range(4)]
        results.append(
            _series(_schema.PHASE_DURATION, rank, ["sum", "count", "max", "min"], phase_rows)
        )
    # Rank 1's sampled steps: 4 per window from the second, each standing for 10 steps,
    # 0.012 s long (longer than the window's mean step: their wait was long).
    results.append(
        _series(
            _schema.SAMPLED_STEP_DURATION,
            1,
            ["sum", "count"],
            [[(w + 1) * second, 40 * 0.012, 40] for w in range(1, 4)],
        )
    )
    results.append(
        _series(
            _schema.SAMPLED_STEPS,
            1,
            ["counter"],
            [[(w + 1) * second, MIN // 2] for w in range(1, 4)],
        )
    )
    frame = frame_from_series("j", results, origin_unix_nano=1, n_bins=4, window_s=1.0)
    assert frame.phase_steps is not None and frame.phase_step_s is not None
    assert frame.phase_steps[:, 0].tolist() == [40, 40, 40, 40]
    # Rank 1: its first window fully timed (before its first sampled point); then half of
    # MIN per window, pooled with the window before.
    assert frame.phase_steps[:, 1].tolist() == [40, 40 + MIN // 2, MIN, MIN]
    assert frame.phase_step_s[:, 0] == pytest.approx([0.01] * 4)
    assert frame.phase_step_s[1, 1] == pytest.approx((0.4 + 0.48) / 80)
    assert frame.phase_step_s[3, 1] == pytest.approx(0.012)
    assert frame.phase_step[:, 0] == pytest.approx(frame.step_s[:, 0])
    # The time outside the wait, from the same steps: 6 ms on rank 1's sampled steps.
    outside = frame.phase_step - frame.phase_s[:, :, 0]
    assert outside[3, 1] == pytest.approx(0.006)
    assert outside[3, 0] == pytest.approx(0.006)


def test_a_frame_without_sampled_points_is_unchanged() -> None:
    results = [
        _series(_schema.STEP_DURATION, 0, ["sum", "count", "max"], [[10**9, 0.5, 50, 0.02]]),
        _series(
            _schema.PHASE_DURATION, 0, ["sum", "count", "max", "min"], [[10**9, 0.1, 50, 0.01, 0]]
        ),
    ]
    frame = frame_from_series("j", results, origin_unix_nano=1, n_bins=1, window_s=1.0)
    assert frame.phase_steps is None and frame.phase_step_s is None
    assert frame.phase_step is frame.step_s
    assert frame.phase_s[0, 0, 0] == pytest.approx(0.1 / 50)


def test_a_window_with_no_timed_step_within_reach_is_unknown_not_zero() -> None:
    # A frame that starts inside a run of windows whose steps were all handed on.
    phase, step, rests_on = _pool(
        [0.0, 0.0, 1.0], [10.0, 10.0, 10.0], [0, 0, MIN], [0, 0, 2.0], [0, 0, 30.0]
    )
    assert np.isnan(phase[:2]).all() and np.isnan(step[:2]).all()
    assert rests_on[:2].tolist() == [0, 0]
    assert phase[2] == pytest.approx(0.1) and step[2] == pytest.approx(2.0 / 30)
