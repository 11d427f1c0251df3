"""The statistics behind every detector, vectorised over windows × ranks.

Everything here works on log-times: a rank that is 1.3x slower than its peers is ``log 1.3``
above them whatever the absolute scale, so multiplying every time by a constant leaves every
verdict unchanged, and permuting ranks permutes it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from stepwatch.core._errors import ConfigError
from stepwatch.detectors.stats._fdr import tail_test

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: Scale factor making the MAD a consistent estimator of a normal standard deviation.
MAD_TO_SD = 1.482602218505602
#: Asymptotic efficiency of the MAD relative to the standard deviation under normality.
MAD_EFFICIENCY = 0.37
#: Trailing windows whose median MAD floors the pooled scale (a jump in noise counts at once).
RECENT_WINDOWS = 3
#: Fewest ranks reporting for that floor (a few ranks' MAD is too noisy to floor anything).
RECENT_MIN_RANKS = 8


@dataclasses.dataclass(frozen=True)
class OutlierTest:
    """Result of a cross-rank robust outlier test of one metric at one time scale.

    Attributes:
        metric: name of the metric tested (``phase:backward``, ``share:gemm``, ...).
        scale_windows: number of trailing windows averaged before testing.
        z: ``(windows, ranks)`` robust z-score (NaN where the rank has no data).
        p_value: one-sided (slower) p-value under a normal null.
        reject: Benjamini–Hochberg rejections per window (``False`` where NaN).
        log_effect: rank's trailing mean log-time minus the peers' median (log ratio).
        dof: Student-t degrees of freedom of the pooled scale, broadcastable to ``z``
            (``None``: a normal reference).
    """

    metric: str
    scale_windows: int
    z: FloatArray
    p_value: FloatArray
    reject: BoolArray
    log_effect: FloatArray
    dof: FloatArray | None = None


@dataclasses.dataclass(frozen=True)
class ChangePoint:
    """A level shift in a job-level series.

    Attributes:
        index: first window of the new level.
        before: median of the series before ``index``.
        after: median of the series from ``index`` on (to the next change point).
        ratio: ``after / before``.
        p_value: CUSUM-of-OLS-residuals stability test of the segment that was split (or the
            split's Bonferroni-corrected t-test when smaller, doubled, for short segments).
        since: the earliest window the new level may have begun: ``index``, or, after NaN
            windows (a sampling source's kernel times: one window in several), the window
            after the last finite one before it.
    """

    index: int
    before: float
    after: float
    ratio: float
    p_value: float
    since: int = -1

    def __post_init__(self) -> None:
        if self.since < 0:
            object.__setattr__(self, "since", self.index)


def nanmedian(values: FloatArray, *, axis: int) -> FloatArray:
    """Median ignoring NaN, keeping dims; fast path when there is no NaN.

    All-NaN slices give NaN without a warning. With NaN present, one ``np.partition`` at the
    few order statistics needed (NaN moved to the end as +inf) replaces numpy's per-slice
    ``nanmedian`` loop, which is ~100x slower on windows x 10,000 ranks.
    """
    missing = np.isnan(values)
    if not missing.any():
        return np.median(values, axis=axis, keepdims=True)
    counts = np.sum(~missing, axis=axis, keepdims=True)
    lows = np.maximum((counts - 1) // 2, 0)
    highs = counts // 2
    needed = np.unique(np.concatenate([lows.ravel(), highs.ravel()]))
    if needed.size > 64:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmedian(values, axis=axis, keepdims=True)
    needed = needed[needed < values.shape[axis]]
    ordered = np.partition(np.where(missing, np.inf, values), needed, axis=axis)
    low = np.take_along_axis(ordered, np.minimum(lows, values.shape[axis] - 1), axis=axis)
    high = np.take_along_axis(ordered, np.minimum(highs, values.shape[axis] - 1), axis=axis)
    with np.errstate(invalid="ignore"):
        result = (low + high) / 2.0
    return np.where(counts > 0, result, np.nan)


def safe_log(values: FloatArray, *, dtype: type = np.float64) -> FloatArray:
    """Natural log where positive and finite, NaN elsewhere (zero time has no ratio)."""
    values = np.asarray(values, dtype=dtype)
    result: FloatArray = np.full(values.shape, np.nan, dtype=dtype)
    ok = np.isfinite(values) & (values > 0)
    np.log(values, out=result, where=ok)
    return result


def rolling_nanmean(values: FloatArray, window: int) -> FloatArray:
    """Trailing mean over ``window`` rows (axis 0), ignoring NaN.

    Row ``w`` averages rows ``max(0, w - window + 1) .. w``: only past data, so a flag at
    window ``w`` is exactly what an incremental detector would have raised at ``w``. NaN
    when every value in the span is NaN.
    """
    if window < 1:
        raise ConfigError(f"window: must be >= 1, got {window}")
    if window == 1:
        return values.copy()
    valid = np.isfinite(values)
    filled = np.where(valid, values, 0.0)
    sums = np.cumsum(filled, axis=0)
    counts = np.cumsum(valid, axis=0, dtype=np.int64)
    if values.shape[0] > window:
        sums[window:] = sums[window:] - sums[:-window].copy()
        counts[window:] = counts[window:] - counts[:-window].copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums / counts
    mean[counts == 0] = np.nan
    return mean


def cross_rank_outliers(
    log_values: FloatArray,
    *,
    metric: str,
    scale_windows: int = 1,
    fdr_q: float = 1e-6,
    min_scale: float = 0.0005,
    min_ranks: int = 4,
    pool_windows: int = 30,
    reference: npt.NDArray[np.intp] | None = None,
) -> OutlierTest:
    """Robust cross-rank test: which ranks are slower than their peers, window by window.

    Args:
        log_values: ``(windows, ranks)`` log-times (NaN = no data), or ``(windows, ranks,
            metrics)`` to test several metrics at once (one BH family per window and metric).
        metric: name carried into the result.
        scale_windows: trailing windows averaged per rank before comparing (persistence:
            transient noise that moves from rank to rank averages out, a lasting slowdown
            does not).
        fdr_q: Benjamini–Hochberg false discovery rate per window.
        min_scale: floor of the robust scale, in log units, so identical ranks (MAD 0) do
            not turn rounding noise into infinite z.
        min_ranks: windows with fewer ranks reporting are not tested.
        pool_windows: trailing windows whose robust scales are pooled.
        reference: indices of the ranks that estimate the centre and the scale (all ranks
            when ``None``). For tens of thousands of ranks a few thousand chosen by rank id
            (so the choice moves with the ranks when they are permuted) estimate the median
            and MAD to within a few percent at a fraction of the cost.

    Returns:
        The :class:`OutlierTest`.

    Notes:
        Statistic: per window, each rank's log-time minus the cross-rank median (removes
        anything common to the job, such as a job-wide slowdown or the absolute scale),
        averaged over the trailing ``scale_windows`` windows, then centred again on the
        cross-rank median and divided by ``1.4826 * MAD`` across ranks (a robust standard
        deviation that a few outliers cannot inflate), the per-window MADs pooled by their
        median over ``pool_windows`` trailing windows, never below their median over the
        last ``RECENT_WINDOWS`` (a jump in noise is not read as outliers while the pool
        lags). One-sided p-values from a Student-t with ``0.37 (n - 1)`` degrees of freedom
        per independent window pooled (n ranks reporting; 0.37 is the MAD's efficiency),
        which tends to the normal for thousands of ranks; BH across the ranks of each
        window. Assumptions: ranks of one job run the same code (within their peer group)
        so their log-times are exchangeable under the null; roughly normal noise in log
        space after averaging. Edge cases: fewer than ``min_ranks`` ranks → nothing
        rejected; NaN (missing rank) → no test; more than half the ranks slow → the median
        moves and the test sees the *fast* ranks as normal (that is a job-level change, see
        :func:`change_points`).

    References:
        Rousseeuw, P. J. and Croux, C. (1993). Alternatives to the median absolute
        deviation. JASA 88. Benjamini and Hochberg (1995), JRSS B 57.
    """
    return multiscale_outliers(
        log_values,
        metric=metric,
        scales=(scale_windows,),
        fdr_q=fdr_q,
        min_scale=min_scale,
        min_ranks=min_ranks,
        pool_windows=pool_windows,
        reference=reference,
    )[scale_windows]


def multiscale_outliers(
    log_values: FloatArray,
    *,
    metric: str,
    scales: Sequence[int],
    fdr_q: float = 1e-6,
    min_scale: float = 0.0005,
    min_ranks: int = 4,
    pool_windows: int = 30,
    reference: npt.NDArray[np.intp] | None = None,
    exact_p_values: bool = True,
) -> dict[int, OutlierTest]:
    """:func:`cross_rank_outliers` at several scales, sharing the per-window centring.

    float32 input stays float32 (half the memory traffic for very large jobs).
    ``exact_p_values=False`` skips the normal CDF on every cell: ``p_value`` is then
    exact wherever the normal tail is ``<= fdr_q`` (every cell BH can reject) and 1.0 at
    the other tested cells (NaN where untested, as always); ``z``, ``reject``,
    ``log_effect`` and ``dof`` are the same either way.
    """
    values = np.asarray(log_values)
    if not np.issubdtype(values.dtype, np.floating):
        values = values.astype(np.float64)
    reference_values = values if reference is None else values[:, reference]
    residual = values - nanmedian(reference_values, axis=1)
    valid = np.isfinite(residual)
    reporting = np.expand_dims(valid.sum(axis=1), 1)
    enough = reporting >= min_ranks
    sums = np.cumsum(np.where(valid, residual, 0.0), axis=0)
    counts = np.cumsum(valid, axis=0, dtype=np.int32)
    results: dict[int, OutlierTest] = {}
    for scale_windows in scales:
        if scale_windows < 1:
            raise ConfigError(f"scale_windows: must be >= 1, got {scale_windows}")
        rolled = _trailing_mean(residual, sums, counts, scale_windows)
        if reference is None:
            deviation = rolled - nanmedian(rolled, axis=1)
            window_mad = MAD_TO_SD * nanmedian(np.abs(deviation), axis=1)
        else:  # centre and scale from a fixed subset of ranks (large jobs)
            deviation = rolled - nanmedian(rolled[:, reference], axis=1)
            window_mad = MAD_TO_SD * nanmedian(np.abs(deviation[:, reference]), axis=1)
        # The noise level of a job changes slowly: pool the per-window MADs over the
        # trailing ``pool_windows`` windows (median of MADs), steadying small jobs' scale.
        pooled, pooled_count = _trailing_median(window_mad, pool_windows)
        # ... but never below the last few windows' level: when the noise jumps (a new
        # data mix, variable sequence lengths) the long pool lags by half its length, and
        # every rank the new noise touches would read as an outlier meanwhile.
        # With a handful of ranks one window's MAD is itself noise (and a straggler moves
        # it): the floor needs enough ranks to be an estimate.
        recent, _ = _trailing_median(window_mad, RECENT_WINDOWS)
        pooled = np.where(reporting >= RECENT_MIN_RANKS, np.fmax(pooled, recent), pooled)
        scale = np.where(np.isfinite(pooled), np.maximum(pooled, min_scale), np.nan)
        z = deviation / scale.astype(deviation.dtype)
        # The MAD is a noisy scale with few ranks: a Student-t reference with the pooled
        # MAD's effective degrees of freedom (37% efficiency; overlapping trailing means
        # count once per ``scale_windows``) keeps small jobs from crying wolf.
        independent = np.maximum(pooled_count / scale_windows, 1.0)
        dof = np.maximum(MAD_EFFICIENCY * (reporting - 1) * independent, 1.0)
        p_value, reject = tail_test(z, dof, enough, fdr_q, exact_p_values=exact_p_values)
        results[scale_windows] = OutlierTest(
            metric=metric,
            scale_windows=scale_windows,
            z=z,
            p_value=p_value,
            reject=reject,
            log_effect=deviation,
            dof=dof,
        )
    return results


def sustained_outliers(
    test: OutlierTest,
    *,
    windows: int,
    q: float,
    min_log_effect: FloatArray | float,
    misses: int = 1,
) -> BoolArray:
    """Ranks slower than their peers in ``windows`` of ``windows + misses`` running windows.

    Args:
        test: a single-window (``scale_windows=1``) :class:`OutlierTest`.
        windows: windows required (``k``) among the last ``m = k + misses``.
        q: error rate per window and metric for the whole run of ``m`` windows.
        min_log_effect: smallest log ratio to the peers' median in every window that counts,
            broadcastable to ``test.z``.
        misses: windows of the run that may fail (``0``: ``k`` consecutive windows).

    Returns:
        ``True`` at ``w`` when the rank passed at ``w`` and in at least ``k`` of the windows
        ``w - m + 1 .. w``.

    Notes:
        A small job (a handful of ranks, a few dozen windows) cannot reach a tiny ``q`` in
        any one window: the MAD of four ranks pooled over a few windows leaves a Student-t
        with few degrees of freedom. Persistence is the evidence instead: each window at
        one-sided level ``alpha = (q / n)^(1 / k)`` (n ranks reporting; Student-t critical
        value with the test's degrees of freedom) gives, for windows independent under the
        null, at most ``q`` per run start that any rank passes ``k`` in a row. Noise that
        stays on one rank for several windows (a busy core) breaks that independence, hence
        ``min_log_effect`` and a ``k`` well above the length of such bursts.

        A burst of load elsewhere on the host can equally hide a real straggler for one
        window and break its run (seen on shared 2-core machines: a 1.3x straggler missed
        in about a quarter of runs). ``misses`` lets that many windows of the run fail; the
        per-window level is then the ``alpha`` with ``P(Binomial(m, alpha) >= k) = q / n``,
        i.e. ``betaincinv(k, m - k + 1, q / n)`` (with no misses, ``(q / n)^(1 / k)``
        again), so the error rate per run stays ``q``.

    References:
        Bonferroni correction over ranks; the binomial tail of independent per-window tests
        (the regularised incomplete beta function).
    """
    from scipy.special import betaincinv, stdtrit

    if windows < 1:
        raise ConfigError(f"windows: must be >= 1, got {windows}")
    if misses < 0:
        raise ConfigError(f"misses: must be >= 0, got {misses}")
    if not 0 < q < 1:
        raise ConfigError(f"q: must be in (0, 1), got {q}")
    tested = np.isfinite(test.p_value)
    reporting = np.maximum(tested.sum(axis=1, keepdims=True), 1)
    span = windows + misses
    alpha = np.asarray(betaincinv(windows, span - windows + 1, q / reporting), dtype=np.float64)
    dof = np.inf if test.dof is None else test.dof
    critical = np.where(
        np.isinf(dof), _ndtri_upper(alpha), stdtrit(np.minimum(dof, 1e9), 1 - alpha)
    )
    with np.errstate(invalid="ignore"):
        passed = np.greater_equal(test.z, critical)
        passed &= tested
        passed &= test.log_effect >= min_log_effect
    if misses == 0:
        return persistent(passed, windows=windows)
    # Passes among the last ``span`` windows, counted at the passing cells only (few):
    # the same count as a running sum over the window axis, without a full integer array.
    cells = np.unravel_index(np.flatnonzero(passed), passed.shape)  # np.nonzero, faster
    count = np.zeros(cells[0].size, dtype=np.int64)
    for lag in range(span):
        earlier = cells[0] >= lag
        count[earlier] += passed[(cells[0][earlier] - lag, *(i[earlier] for i in cells[1:]))]
    result = np.zeros_like(passed)
    result[tuple(index[count >= windows] for index in cells)] = True
    return result


def _ndtri_upper(alpha: FloatArray | float) -> FloatArray:
    """Upper-tail standard normal quantile: ``z`` with ``P(Z > z) = alpha``."""
    from scipy.special import ndtri

    return np.asarray(-ndtri(alpha), dtype=np.float64)


def _trailing_mean(
    values: FloatArray, sums: FloatArray, counts: npt.NDArray[np.int32], window: int
) -> FloatArray:
    """Trailing NaN-ignoring mean from precomputed cumulative sums (see rolling_nanmean)."""
    if window == 1:
        return values
    span_sums = np.empty_like(sums)
    span_counts = np.empty_like(counts)
    head = min(window, values.shape[0])
    span_sums[:head] = sums[:head]
    span_counts[:head] = counts[:head]
    np.subtract(sums[head:], sums[: sums.shape[0] - head], out=span_sums[head:])
    np.subtract(counts[head:], counts[: counts.shape[0] - head], out=span_counts[head:])
    # A span without data is NaN already: its cumulative sums only added exact zeros, so
    # its sum is exactly 0 and 0 / 0 is NaN.
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.divide(span_sums, span_counts, out=span_sums)
    return mean.astype(values.dtype, copy=False)


def _trailing_median(values: FloatArray, window: int) -> tuple[FloatArray, FloatArray]:
    """Median over the trailing ``window`` rows (axis 0) ignoring NaN, and the count used."""
    result = np.full(values.shape, np.nan)
    counts = np.zeros(values.shape)
    for index in range(values.shape[0]):
        span = values[max(0, index - window + 1) : index + 1]
        counts[index] = np.isfinite(span).sum(axis=0)
        result[index] = nanmedian(span, axis=0)[0]
    return result, counts


def persistent(flags: BoolArray, *, windows: int) -> BoolArray:
    """``True`` at ``w`` when ``flags`` held at ``w`` and the ``windows - 1`` windows before."""
    if windows <= 1:
        return flags.copy()
    # A run of ``windows`` ending at ``w``: ``flags`` at ``w`` and at each of the
    # ``windows - 1`` windows before (none before the first window).
    result = flags.copy()
    result[: windows - 1] = False
    for lag in range(1, min(windows, flags.shape[0])):
        result[lag:] &= flags[:-lag]
    return result


def _best_split(values: FloatArray, min_segment: int) -> tuple[int, float]:
    """Index maximising the two-sample mean-shift statistic (standardised CUSUM)."""
    n = values.size
    cumulative = np.cumsum(values - values.mean())
    k = np.arange(1, n)
    weight = np.sqrt(n / (k * (n - k)))
    statistic = np.abs(cumulative[:-1]) * weight
    statistic[: min_segment - 1] = -1.0
    statistic[n - min_segment :] = -1.0
    best = int(np.argmax(statistic))
    return best + 1, float(statistic[best])


#: Below this many windows the CUSUM test's asymptotic null cannot reach small alphas (its
#: statistic is at most ``sqrt(n) / 2``); a split t-test backs it up.
SMALL_SEGMENT = 30


def _split_t_p_value(segment: FloatArray, split: int, min_segment: int) -> float:
    """Two-sample t-test of the two sides of ``split``, Bonferroni over the candidate splits.

    The pooled-variance test: Welch's with three windows on one side is anti-conservative.
    """
    from scipy.stats import ttest_ind

    before, after = segment[:split], segment[split:]
    if np.ptp(before) == 0 and np.ptp(after) == 0:
        return 1.0  # no spread on either side: the t statistic is undefined
    result = ttest_ind(before, after)
    candidates = max(1, segment.size - 2 * min_segment + 1)
    p_value = float(result.pvalue)
    return min(1.0, p_value * candidates) if math.isfinite(p_value) else 1.0


def change_points(
    series: FloatArray,
    *,
    min_shift: float = 0.03,
    alpha: float = 1e-3,
    min_segment: int = 3,
    max_points: int = 4,
) -> list[ChangePoint]:
    """Level shifts of a positive series (e.g. the job's median step time per window).

    Args:
        series: ``(windows,)`` positive values; NaN windows are skipped.
        min_shift: smallest relative shift reported (``|after/before - 1|``), so that
            statistically significant but operationally meaningless wiggles never alarm.
        alpha: significance of the CUSUM stability test of each split segment.
        min_segment: fewest windows on each side of a change.
        max_points: most change points returned (binary segmentation depth).

    Returns:
        Change points sorted by index.

    Notes:
        Binary segmentation on the log series: the split maximising the standardised CUSUM
        is kept when ``statsmodels.stats.diagnostic.breaks_cusumolsresid`` rejects parameter
        stability of the segment at ``alpha`` *and* the segment medians differ by at least
        ``min_shift``; both halves are then searched again. The CUSUM statistic of ``n``
        points is at most ``sqrt(n) / 2``, so below ``SMALL_SEGMENT`` (30) windows it can
        never reach a small ``alpha`` however large the shift (a short job); there a
        two-sample t-test of the two sides, Bonferroni-corrected over the candidate splits,
        may reject instead (the smaller p-value of the two tests, doubled). Assumes
        independent noise between windows. Fewer than ``2 * min_segment`` finite windows →
        no change point.

    References:
        Ploberger, W. and Krämer, W. (1992). The CUSUM test with OLS residuals.
        Econometrica 60. Scott, A. J. and Knott, M. (1974). A cluster analysis method for
        grouping means in the analysis of variance. Biometrics 30.
    """
    from statsmodels.stats.diagnostic import breaks_cusumolsresid

    values = safe_log(np.asarray(series, dtype=np.float64))
    finite_index = np.flatnonzero(np.isfinite(values))
    if finite_index.size < 2 * min_segment:
        return []
    compact = values[finite_index]
    found: list[ChangePoint] = []
    segments = [(0, compact.size)]
    while segments and len(found) < max_points:
        start, stop = segments.pop(0)
        segment = compact[start:stop]
        if segment.size < 2 * min_segment or np.ptp(segment) == 0:
            continue
        split, _ = _best_split(segment, min_segment)
        before = float(np.median(segment[:split]))
        after = float(np.median(segment[split:]))
        ratio = math.exp(after - before)
        if abs(ratio - 1) < min_shift:
            continue
        _, p_value, _ = breaks_cusumolsresid(segment - segment.mean(), ddof=1)
        if segment.size < SMALL_SEGMENT:  # two tests: Bonferroni over them as well
            p_value = min(1.0, 2.0 * min(p_value, _split_t_p_value(segment, split, min_segment)))
        if not p_value < alpha:
            continue
        found.append(
            ChangePoint(
                index=int(finite_index[start + split]),
                before=math.exp(before),
                after=math.exp(after),
                ratio=ratio,
                p_value=float(p_value),
                since=int(finite_index[start + split - 1]) + 1,
            )
        )
        segments.extend([(start, start + split), (start + split, stop)])
    return sorted(found, key=lambda point: point.index)
