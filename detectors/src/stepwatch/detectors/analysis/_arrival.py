"""Who arrived late to a collective, from a single step (profiler traces).

A synchronous collective completes when its last rank arrives, so every rank's time in it
is the transfer plus its wait for that rank: the rank that arrived last waits least, and
the ranks that arrived first wait longest. A recorded trace often holds one profiled step
per rank, too little for the cross-rank statistics (which need windows to estimate noise
and persistence); what one step does show is *order*: per collective kernel class, the
ranks whose time in it is a fraction of their peers' arrived late, and the others waited
for them. Used only on frames too short for the statistics (fewer than
``config.sustained_windows`` windows with ``config.min_ranks`` ranks reporting).

Cost: had the late ranks arrived with the latest of the others, the collective would have
started that much earlier: ``saving = (shortest wait among the others) - (shortest wait
among the late ones)``, summed over the collectives of the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY, JobFrame
from stepwatch.detectors.stats._stats import BoolArray, FloatArray, nanmedian

#: A late rank waits at most this fraction of its peers' median time in the collective.
LATE_FRACTION = 1.0 / 3.0
#: ... and arrives later than the median rank by at least this fraction of the step.
MIN_LATENESS_STEP = 0.02


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective kernel class in one window: every rank's time in it."""

    name: str
    window: int
    wait_s: FloatArray  # (R,), NaN where silent
    late: BoolArray  # (R,)

    @property
    def peers_median_s(self) -> float:
        return float(np.nanmedian(self.wait_s[~self.late]))

    def saving_s(self) -> float:
        """Seconds the step would save had the late ranks arrived with the others."""
        if not self.late.any() or self.late.all():
            return 0.0
        others = self.wait_s[~self.late]
        return max(0.0, float(np.nanmin(others) - np.nanmin(self.wait_s[self.late])))


def is_short(present: BoolArray, *, min_ranks: int, windows: int) -> bool:
    """Too few windows with enough ranks for the cross-rank statistics."""
    return int((present.sum(axis=1) >= min_ranks).sum()) < windows


def collectives(frame: JobFrame, step_median: FloatArray, *, min_ranks: int) -> list[Collective]:
    """Every (collective kernel class, window) in which some ranks arrived late."""
    found = []
    present = frame.present
    for column, category in enumerate(frame.kernel_categories):
        if category != COMMUNICATION_CATEGORY:
            continue
        name = frame.kernel_classes[column]
        wait = np.where(present, frame.kernel_s[:, :, column], np.nan)
        for window in np.flatnonzero(np.isfinite(wait).sum(axis=1) >= min_ranks):
            row = wait[window]
            median = float(nanmedian(row[None, :], axis=1)[0, 0])
            step = float(step_median[window])
            if not (median > 0 and np.isfinite(step) and step > 0):
                continue
            with np.errstate(invalid="ignore"):
                late = (row <= LATE_FRACTION * median) & (median - row >= MIN_LATENESS_STEP * step)
            if late.any() and late.sum() * 2 < np.isfinite(row).sum():
                found.append(Collective(name, int(window), row, late))
    return found


def late_flags(
    found: list[Collective], present: BoolArray
) -> tuple[list[str], BoolArray, FloatArray]:
    """``late:<class>`` flags ``(W, R, C)`` and log ratios (peers' median wait / own) of
    the :func:`collectives` found."""
    classes = sorted({c.name for c in found})
    shape = (present.shape[0], present.shape[1], len(classes))
    flags = np.zeros(shape, dtype=bool)
    effect = np.full(shape, np.nan)
    for item in found:
        column = classes.index(item.name)
        flags[item.window, :, column] = item.late
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = item.peers_median_s / item.wait_s
        effect[item.window, :, column] = np.where(ratio > 0, np.log(ratio), np.nan)
    return [f"late:{name}" for name in classes], flags, effect
