"""Statistical routines: seeded unit tests and hypothesis properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from statsmodels.stats.multitest import multipletests

from stepwatch.core import ConfigError
from stepwatch.detectors import benjamini_hochberg, change_points, cross_rank_outliers
from stepwatch.detectors.stats._stats import persistent, rolling_nanmean, safe_log


def _job(seed: int, *, windows: int = 40, ranks: int = 64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 0.02, size=(windows, ranks))


@pytest.mark.parametrize("seed", range(5))
def test_bh_matches_statsmodels(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = rng.uniform(size=(6, 200)) ** rng.uniform(1, 8, size=(6, 1))
    p[2, :5] = np.nan
    ours = benjamini_hochberg(p, q=0.05)
    for row in range(p.shape[0]):
        valid = np.isfinite(p[row])
        expected = multipletests(p[row, valid], alpha=0.05, method="fdr_bh")[0]
        assert np.array_equal(ours[row, valid], expected)
        assert not ours[row, ~valid].any()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=60),
    st.sampled_from([0.001, 0.05, 0.2]),
)
def test_bh_property_matches_statsmodels(values: list[float], q: float) -> None:
    p = np.array([values])
    expected = multipletests(p[0], alpha=q, method="fdr_bh")[0]
    assert np.array_equal(benjamini_hochberg(p, q=q)[0], expected)


def test_bh_rejects_bad_q() -> None:
    with pytest.raises(ConfigError, match="q"):
        benjamini_hochberg(np.zeros((1, 3)), q=0.0)


def test_rolling_nanmean_is_trailing_and_ignores_nan() -> None:
    values = np.array([[1.0], [np.nan], [3.0], [5.0]])
    result = rolling_nanmean(values, 2)
    assert result[:, 0].tolist() == [1.0, 1.0, 3.0, 4.0]
    with pytest.raises(ConfigError, match="window"):
        rolling_nanmean(values, 0)


def test_persistent_needs_consecutive_windows() -> None:
    flags = np.array([[True], [False], [True], [True], [True]])
    assert persistent(flags, windows=2)[:, 0].tolist() == [False, False, False, True, True]


def test_outlier_found_and_clean_ranks_not() -> None:
    values = _job(1)
    values[20:, 17] += np.log(1.10)  # rank 17 10% slower from window 20
    test = cross_rank_outliers(values, metric="m", scale_windows=3)
    assert test.reject[25:, 17].all()
    others = np.delete(test.reject, 17, axis=1)
    assert not others.any()
    assert not test.reject[:20].any()
    assert test.log_effect[30, 17] == pytest.approx(np.log(1.10), abs=0.035)


@pytest.mark.parametrize("seed", range(8))
def test_no_false_rejections_on_noise(seed: int) -> None:
    values = _job(100 + seed, ranks=512)
    for scale in (1, 3, 10):
        assert not cross_rank_outliers(values, metric="m", scale_windows=scale).reject.any()


def test_too_few_ranks_and_nan_are_not_tested() -> None:
    values = _job(2, ranks=3)
    values[:, 0] += 1.0
    assert not cross_rank_outliers(values, metric="m").reject.any()
    values = _job(3, ranks=32)
    values[:, 5] = np.nan
    test = cross_rank_outliers(values, metric="m")
    assert np.isnan(test.p_value[:, 5]).all()
    assert not test.reject[:, 5].any()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), factor=st.floats(0.01, 100.0))
def test_outliers_permute_with_ranks_and_ignore_scale(seed: int, factor: float) -> None:
    rng = np.random.default_rng(seed)
    values = np.exp(rng.normal(0.0, 0.03, size=(20, 48)))
    victim = int(rng.integers(0, 48))
    values[8:, victim] *= 1.25
    logs = safe_log(values)
    base = cross_rank_outliers(logs, metric="m", scale_windows=3)
    order = rng.permutation(48)
    permuted = cross_rank_outliers(logs[:, order], metric="m", scale_windows=3)
    assert np.array_equal(permuted.reject, base.reject[:, order])
    scaled = cross_rank_outliers(safe_log(values * factor), metric="m", scale_windows=3)
    assert np.array_equal(scaled.reject, base.reject)
    assert base.reject[12:, victim].all()


def test_change_point_found_with_location_and_ratio() -> None:
    rng = np.random.default_rng(7)
    series = np.exp(rng.normal(0.0, 0.01, size=60))
    series[35:] *= 1.08
    points = change_points(series)
    assert len(points) == 1
    assert points[0].index == 35
    assert points[0].ratio == pytest.approx(1.08, abs=0.01)
    assert points[0].p_value < 1e-3
    assert points[0].since == 35
    # One window in 6 kept (a sampling source's kernel times): the shift is seen at the first
    # kept window after it, and may have begun right after the last one before it.
    sparse = np.full(60, np.nan)
    sparse[::6] = series[::6]
    (point,) = change_points(sparse)
    assert (point.index, point.since) == (36, 31)


@pytest.mark.parametrize("seed", range(10))
def test_no_change_point_on_noise(seed: int) -> None:
    rng = np.random.default_rng(seed)
    assert change_points(np.exp(rng.normal(0.0, 0.01, size=80))) == []


def test_change_point_below_min_shift_is_ignored_and_short_series() -> None:
    rng = np.random.default_rng(3)
    series = np.exp(rng.normal(0.0, 0.001, size=60))
    series[30:] *= 1.01  # significant, but below the 3% minimum shift
    assert change_points(series) == []
    assert change_points(np.array([1.0, 2.0, np.nan])) == []


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), factor=st.floats(0.001, 1000.0))
def test_change_points_ignore_scale(seed: int, factor: float) -> None:
    rng = np.random.default_rng(seed)
    series = np.exp(rng.normal(0.0, 0.01, size=50))
    series[20:] *= 1.2
    base = change_points(series)
    scaled = change_points(series * factor)
    assert [p.index for p in scaled] == [p.index for p in base] == [20]


def test_a_burst_that_hides_a_straggler_for_one_window_does_not_break_its_run() -> None:
    """Load elsewhere on the host hides the slow rank in one window: one miss is allowed."""
    from stepwatch.detectors.stats._stats import multiscale_outliers, sustained_outliers

    rng = np.random.default_rng(3)
    logs = rng.normal(0.0, 0.05, size=(14, 4))
    logs[4:, 2] += 0.7  # rank 2 ~2x slower from window 4 on ...
    logs[7, 2] -= 0.7  # ... except window 7, where a burst slowed everyone alike
    test = multiscale_outliers(logs, metric="m", scales=(1,))[1]
    strict = sustained_outliers(test, windows=6, q=1e-6, min_log_effect=np.log(1.5), misses=0)
    tolerant = sustained_outliers(test, windows=6, q=1e-6, min_log_effect=np.log(1.5))
    # consecutive runs: 4-6 (3 windows) and 8-13 (6 windows) -> found only at 13
    assert np.flatnonzero(strict[:, 2]).tolist() == [13]
    # 6 of the last 7 windows: found at window 10 already (4, 5, 6, 8, 9, 10)
    assert np.flatnonzero(tolerant[:, 2]).tolist() == [10, 11, 12, 13]
    assert not tolerant[:, [0, 1, 3]].any()


@pytest.mark.parametrize("misses", [0, 1, 2])
def test_the_run_level_holds_with_misses(misses: int) -> None:
    """Per-window level from the binomial tail: runs of pure noise pass at about ``q``."""
    from stepwatch.detectors.stats._stats import OutlierTest, sustained_outliers

    windows, ranks, q = 4, 8, 0.05
    rng = np.random.default_rng(misses)
    z = rng.standard_normal((20_000, ranks))
    test = OutlierTest(
        metric="m",
        scale_windows=1,
        z=z,
        p_value=np.full_like(z, 0.5),
        reject=np.zeros_like(z, dtype=bool),
        log_effect=np.ones_like(z),
        dof=None,
    )
    flags = sustained_outliers(test, windows=windows, q=q, min_log_effect=0.0, misses=misses)
    # a new run starts where the rank was not flagged in the window before
    starts = flags[1:] & ~flags[:-1]
    rate = starts.sum() / starts.shape[0]
    assert 0.2 * q < rate < 1.5 * q, rate


def _noisy_block(seed: int, dtype: type) -> np.ndarray:
    """``(W, R, M)`` log-times with outliers, silent ranks, a silent window and ties."""
    rng = np.random.default_rng(seed)
    logs = rng.normal(0.0, 0.02, size=(30, 48, 3)).astype(dtype)
    logs[10:, 5, 0] += 0.3  # a straggler
    logs[4, 7:12, 1] += rng.uniform(0.05, 0.2, size=5).astype(dtype)  # a one-window burst
    logs[:, 9, 2] = np.nan  # a silent rank
    logs[20, :, :] = np.nan  # a window nobody reports in
    logs[15, 20:24, 2] = logs[15, 19, 2] + 0.25  # tied outliers
    return logs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_candidate_p_values_give_the_same_test(seed: int, dtype: type) -> None:
    from stepwatch.detectors.stats._stats import multiscale_outliers

    logs = _noisy_block(seed, dtype)
    for reference in (None, np.arange(0, 48, 2)):
        kwargs = dict(metric="m", scales=(1, 3), fdr_q=1e-3, reference=reference)
        exact = multiscale_outliers(logs, **kwargs)  # type: ignore[arg-type]
        fast = multiscale_outliers(logs, exact_p_values=False, **kwargs)  # type: ignore[arg-type]
        for scale, test in exact.items():
            other = fast[scale]
            assert test.reject.any()
            for name in ("z", "reject", "log_effect", "dof"):
                assert np.array_equal(getattr(test, name), getattr(other, name), equal_nan=True)
            # Exact wherever BH could reject, 1.0 at the other tested cells.
            assert np.array_equal(np.isnan(test.p_value), np.isnan(other.p_value))
            differs = np.isfinite(test.p_value) & (test.p_value != other.p_value)
            assert differs.any()
            assert (other.p_value[differs] == 1.0).all()
            assert (test.p_value[differs] > 1e-3).all()
            # The rejections on the candidates alone are BH's on every p-value.
            families = np.moveaxis(test.p_value, 1, -1).reshape(-1, logs.shape[1])
            expected = benjamini_hochberg(families, q=1e-3).reshape(30, 3, 48)
            assert np.array_equal(test.reject, np.moveaxis(expected, -1, 1))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.booleans(), min_size=1, max_size=12),
    st.integers(min_value=1, max_value=5),
)
def test_persistent_is_a_run_length(column: list[bool], windows: int) -> None:
    run, expected = 0, []
    for flag in column:
        run = run + 1 if flag else 0
        expected.append(run >= windows)
    flags = np.array(column)[:, None]
    assert persistent(flags, windows=windows)[:, 0].tolist() == expected
