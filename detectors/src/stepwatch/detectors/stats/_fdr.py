"""False discovery rate control: Benjamini–Hochberg, and the tail test of
:func:`~stepwatch.detectors.stats._stats.multiscale_outliers` (one-sided Student-t p-values
and their rejections, computed on the candidate cells only: at 10,000 ranks x 50 classes x
1 h, evaluating every cell was most of the L2 time). One step-up, :func:`_bh_sorted`, serves
both."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from stepwatch.core._errors import ConfigError

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def benjamini_hochberg(p_values: FloatArray, *, q: float) -> BoolArray:
    """Benjamini–Hochberg step-up rejections, one family per row.

    Args:
        p_values: ``(families, tests)``; NaN means "no test" and is neither counted in ``m``
            nor rejected.
        q: false discovery rate.

    Returns:
        Boolean rejections of the same shape; equal to
        ``statsmodels.stats.multitest.multipletests(p, alpha=q, method="fdr_bh")[0]`` on each
        row's non-NaN entries (a test pins this).

    Notes:
        Only p-values ``<= q`` can ever be rejected, so only those are sorted: the cost is
        linear in the number of tests when few are small, which is the normal case.

    References:
        Benjamini, Y. and Hochberg, Y. (1995). Controlling the false discovery rate. JRSS B 57.
    """
    if not 0 < q < 1:
        raise ConfigError(f"q: must be in (0, 1), got {q}")
    p = np.asarray(p_values, dtype=np.float64)
    if p.ndim != 2:
        raise ConfigError(f"p_values: need a 2-D array, got shape {p.shape}")
    tested = np.isfinite(p)
    with np.errstate(invalid="ignore"):
        cells = np.flatnonzero(tested & (p <= q))
    reject = np.zeros(p.shape, dtype=bool)
    if cells.size:
        family = cells // p.shape[1]
        counts = tested.sum(axis=1)
        reject.reshape(-1)[_bh_sorted(cells, family, p.reshape(-1)[cells], counts, q)] = True
    return reject


def tail_test(
    z: FloatArray,
    dof: FloatArray,
    enough: BoolArray,
    fdr_q: float,
    *,
    exact_p_values: bool,
) -> tuple[FloatArray, BoolArray]:
    """One-sided p-values of ``z`` and their BH rejections, one family per window and metric.

    Args:
        z: ``(W, R, ...)`` robust z-scores (NaN: no test).
        dof: ``(W, 1, ...)`` Student-t degrees of freedom.
        enough: ``(W, 1, ...)`` the window has enough ranks to test.
        fdr_q: BH false discovery rate.
        exact_p_values: compute the p-value of every cell, not only of the candidates.

    Returns:
        ``p_value`` (NaN where untested; see :func:`multiscale_outliers` for the cells it
        holds 1.0 at when not exact) and ``reject``, both shaped like ``z``.

    Notes:
        The t tail is never lighter than the normal one, so only cells whose normal
        p-value is already ``<= fdr_q`` can be rejected: the (slow) t CDF is evaluated for
        those alone, and BH sorts only those (the same step-up as
        :func:`benjamini_hochberg`, on the candidates). Without exact p-values the normal CDF
        itself is evaluated only above a z well below its ``fdr_q`` quantile (half a unit: far more
        than any rounding of a monotone CDF), which is a cheap comparison per cell.
    """
    from scipy.special import ndtr, ndtri, stdtr

    if not 0 < fdr_q < 1:
        raise ConfigError(f"q: must be in (0, 1), got {fdr_q}")
    tested = np.isfinite(z)
    tested &= enough
    if exact_p_values:
        with np.errstate(invalid="ignore"):
            p_value = ndtr(-z)
        candidates = np.flatnonzero(tested & (p_value <= fdr_q))
        candidate_p = p_value.ravel()[candidates]
        p_value = np.where(tested, p_value, np.nan)
    else:
        p_type = np.result_type(z.dtype, np.float32).type
        p_value = np.where(tested, p_type(1.0), p_type(np.nan))
        near = float(-ndtri(fdr_q)) - 0.5
        with np.errstate(invalid="ignore"):
            nearby = np.flatnonzero(tested & (z >= near))
        nearby_p = ndtr(-z.ravel()[nearby])
        keep = nearby_p <= fdr_q
        candidates, candidate_p = nearby[keep], nearby_p[keep]
    # Flat index -> (window, rank, trailing metric index); a family is a window and metric.
    n_ranks = z.shape[1]
    trailing = z[0, 0].size if z.shape[0] and n_ranks else 1
    family = (candidates // (n_ranks * trailing)) * trailing + candidates % trailing
    if candidates.size:
        candidate_p[...] = stdtr(dof.ravel()[family], -z.ravel()[candidates])
    flat_p = p_value.reshape(-1)  # p_value is a fresh contiguous array: a view
    flat_p[candidates] = candidate_p
    reject = np.zeros(z.shape, dtype=bool)
    small = candidate_p <= fdr_q
    if small.any():
        counts = tested.sum(axis=1).ravel()  # m of each family
        reject.reshape(-1)[
            _bh_sorted(candidates[small], family[small], candidate_p[small], counts, fdr_q)
        ] = True
    return p_value, reject


def _bh_sorted(
    cells: npt.NDArray[np.intp],
    family: npt.NDArray[np.intp],
    p_values: FloatArray,
    counts: npt.NDArray[np.intp],
    q: float,
) -> npt.NDArray[np.intp]:
    """The rejected ``cells`` of :func:`benjamini_hochberg`, given only its p-values ``<= q``.

    ``cells`` ascend within each family (rank order), ``counts`` is each family's ``m``.
    """
    # By family, then p-value, ties by rank: the stable argsort of each row.
    order = np.lexsort((cells, p_values, family))
    family, p_sorted = family[order], p_values[order]
    starts = np.flatnonzero(np.r_[True, family[1:] != family[:-1]])
    sizes = np.diff(np.r_[starts, family.size])
    position = np.arange(family.size) - np.repeat(starts, sizes) + 1
    thresholds = q * position / counts[family]
    # Step-up: everything up to the last p-value under its threshold is rejected.
    last = np.zeros(counts.size, dtype=np.intp)
    np.maximum.at(last, family, np.where(p_sorted <= thresholds, position, 0))
    rejected: npt.NDArray[np.intp] = cells[order][position <= last[family]]
    return rejected
