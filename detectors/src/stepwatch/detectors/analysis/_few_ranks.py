"""Jobs of 2 or 3 ranks: whose own work carries a job-wide step shift, and who waits for it.

The cross-rank tests need ``config.min_ranks`` ranks to estimate the peers' centre and spread;
below that, a straggler moves every rank's step and used to come out as a ``job_regression``
"on every rank". Two ranks still say who waited for whom, as ARGUS reads arrival order: in
synchronous training the step shift ``S`` is the same on every rank, and it is spent where
each rank spends it. The straggler spends it in its own phase (its forward, its data); the
others spend it waiting in the collective (``communication``). Seen on an H100: rank 1's
forward 1.39 -> 9.20 ms and its wait 4.57 -> 4.82 ms, rank 0's forward 1.42 -> 1.78 ms and
its wait 4.66 -> 11.30 ms, for a step shift of 6.5 ms.

:func:`localise` compares each rank with its own level before the shift (medians of the
windows before and after, the two windows around the onset left out), so no peer spread is
needed. A phase names ranks ``A`` when each of them grew by at least half the shift in it and
waited no longer, while every other rank grew by at most a quarter of ``A``'s least growth in
it and waited at least half the shift longer. Anything else (every rank slower in the same
phase, no wait phase, too few windows) stays a job-wide finding.
"""

from __future__ import annotations

import numpy as np

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import Description
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY, COMPUTE_CATEGORY
from stepwatch.detectors.stats._stats import FloatArray

#: A blamed rank's own phase grew by at least this share of the job's step shift ...
OWN_SHARE = 0.5
#: ... and each other rank's wait grew by at least this share of it ...
WAIT_SHARE = 0.5
#: ... while their own time in that phase grew by at most this fraction of the blamed ones'.
OTHERS_FRACTION = 0.25


def _levels(values: FloatArray, before: slice, after: slice) -> tuple[FloatArray, FloatArray]:
    """Per-rank (and per-column) medians over the windows before and after."""
    with np.errstate(all="ignore"):
        return np.nanmedian(values[before], axis=0), np.nanmedian(values[after], axis=0)


def localise(context: Context, first: int) -> Description | None:
    """The ranks and phase a step shift from window ``first`` on belongs to, in a job with
    fewer ranks than the cross-rank tests need; ``None`` when it is job-wide or unclear."""
    frame = context.frame
    if not 2 <= frame.n_ranks < context.config.min_ranks:
        return None
    if COMMUNICATION_CATEGORY not in frame.phases:
        return None
    settled = int(np.argmax(context.present.any(axis=1))) + 1  # past the warm-up window
    before, after = slice(settled, first), slice(first + 2, frame.n_windows)
    if first - settled < 2 or frame.n_windows - first - 2 < 2:
        return None
    present = context.present[:, :, None]
    phase_s = np.where(present, frame.phase_s, np.nan)
    steps = np.where(context.present, frame.step_s, np.nan)
    step_before, step_after = _levels(steps, before, after)
    shift = float(np.nanmedian(step_after - step_before))
    if not shift > 0:
        return None
    low, high = _levels(phase_s, before, after)
    growth = high - low  # (R, P)
    wait = growth[:, frame.phases.index(COMMUNICATION_CATEGORY)]
    for index, phase in enumerate(frame.phases):
        if phase == COMMUNICATION_CATEGORY:
            continue
        own = growth[:, index]
        blamed = np.flatnonzero((own >= OWN_SHARE * shift) & ~(wait >= WAIT_SHARE * shift))
        others = np.setdiff1d(np.arange(frame.n_ranks), blamed)
        if not (blamed.size and others.size) or not np.isfinite(own).all():
            continue
        if (own[others] > OTHERS_FRACTION * own[blamed].min()).any():
            continue
        if not (wait[others] >= WAIT_SHARE * shift).all():
            continue
        return _describe(context, first, blamed, others, phase, float(own[blamed].min()), shift)
    return None


def _describe(
    context: Context,
    first: int,
    blamed: np.ndarray,
    others: np.ndarray,
    phase: str,
    growth_s: float,
    shift_s: float,
) -> Description:
    frame = context.frame
    indices = tuple(int(i) for i in blamed)
    settled = int(np.argmax(context.present.any(axis=1))) + 1
    before, after = slice(settled, first), slice(first + 2, frame.n_windows)
    low, high = _levels(frame.phase_s[:, :, frame.phases.index(phase)], before, after)
    ratio = float(np.nanmin(high[blamed] / low[blamed])) if (low[blamed] > 0).all() else 1.0
    kernel_class = _grown_compute_class(context, blamed, before, after, growth_s)
    kind = (
        "dataloader_stall"
        if phase == "data"
        else ("compute_straggler" if kernel_class else "masked_straggler")
    )
    step_before = float(np.nanmedian(context.step_median[before]))
    slowdown = 1.0 + shift_s / step_before if step_before > 0 else None
    detail = f" ({kernel_class})" if kernel_class else ""
    waits = "waits" if others.size == 1 else "wait"
    summary = (
        f"{context.rank_text(indices)} {phase} {ratio:.2f}x its own level since "
        f"{context.since(first)}{detail}; {context.rank_text(list(others))} {waits} for it in "
        f"{COMMUNICATION_CATEGORY} ({frame.n_ranks}-rank job: compared with itself, not peers)"
    )
    return Description(kind, summary, ratio, phase, kernel_class, indices, (), slowdown)


def _grown_compute_class(
    context: Context, blamed: np.ndarray, before: slice, after: slice, growth_s: float
) -> str | None:
    """The compute kernel class whose time on the blamed ranks grew most, when it grew by at
    least half the phase's growth (kernels explain it: a compute straggler); else ``None``."""
    frame = context.frame
    columns = [i for i, c in enumerate(frame.kernel_categories) if c == COMPUTE_CATEGORY]
    if not columns:
        return None
    kernel = np.where(context.present[:, :, None], frame.kernel_s[:, :, columns], np.nan)
    low, high = _levels(kernel, before, after)
    grown = np.nan_to_num(np.nanmin(high[blamed] - low[blamed], axis=0), nan=0.0)
    best = int(np.argmax(grown))
    if grown[best] < 0.5 * growth_s:
        return None
    return frame.kernel_classes[columns[best]]
