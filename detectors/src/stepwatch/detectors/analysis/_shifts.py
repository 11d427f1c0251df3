"""Level shifts of job-level series, and how ``job_regression`` groups them into episodes.

A shift is a change point (:func:`~stepwatch.detectors.stats.change_points`) of one job-level
series: the step, a phase or a kernel class per window. Shifts of one cause land within a
few windows of each other and make one finding.

A series with windows of no values (kernel times from a sampling source, one window in
several) shows its shift at the first window that holds values after it, up to the gap's
length late. Its ``since`` (``ChangePoint.since``) is the earliest window the shift may have
begun. Grouped on its window alone, such a shift made findings of its own. At one window in 8
a real job regression (`regression-sampled-kernels-512`) gave two findings: the step's, and
"job slower (gemm 15.35x)". Or it chained onto an unrelated earlier shift: a small
communication shift 4 windows early took the kernel shift, and the step's made a second
finding. So dense shifts are grouped first, and a late-seen shift joins the group nearest its
window within its span.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stepwatch.detectors.stats._stats import FloatArray

GROUP_WINDOWS = 3
"""Shifts within this many windows of a group's first one are one episode."""
MIN_SEGMENT = 3
"""Fewest windows on each side of a change point (``change_points``' ``min_segment``)."""


class Shift(NamedTuple):
    """One level shift of a job-level series."""

    window: int  # first window of the new level (where it is seen)
    series: str  # "step", "phase:<name>" or "kernel:<class>"
    excess_s: float
    ratio: float
    since: int  # the earliest window it may have begun (``window`` in a series with no gaps)
    thin: int = 0  # > 0: not a tested change point, a ratio over this many windows after


def thin_shift(
    name: str, series: FloatArray, index: int, *, min_ratio: float, min_excess: float
) -> Shift | None:
    """A sparse series' move at another series' shift (``index``), where it is too sparse
    for a change-point test of its own: the median of its windows from ``index`` on over
    the median of those before, when both sides hold a window and either holds fewer than
    :data:`MIN_SEGMENT`.

    At one window in 16 with kernel times, a simulated job regression left 2 or 3 such
    windows after its shift: the step's shift was found and its kernel class never named
    (11 of 11 job regressions at 1 in 16). The class that moved most is then said with the
    number of windows it rests on.
    """
    finite = np.isfinite(series)
    before = series[:index][finite[:index]]
    after = series[index:][finite[index:]]
    if not before.size or not after.size or min(before.size, after.size) >= MIN_SEGMENT:
        return None
    low, high = float(np.median(before)), float(np.median(after))
    if low <= 0 or high / low < min_ratio or high - low < min_excess:
        return None
    return Shift(index, name, high - low, high / low, index, thin=int(after.size))


def group_shifts(shifts: list[Shift]) -> list[list[Shift]]:
    """Episodes of shifts, in order of their first window (see the module)."""
    groups: list[list[Shift]] = []
    for shift in sorted(s for s in shifts if s.since >= s.window):
        if groups and shift.window - groups[-1][0].window <= GROUP_WINDOWS:
            groups[-1].append(shift)
        else:
            groups.append([shift])
    for shift in sorted(s for s in shifts if s.since < s.window):
        near = [
            group
            for group in groups
            if shift.since - GROUP_WINDOWS <= group[0].window <= shift.window + GROUP_WINDOWS
        ]
        if near:
            min(near, key=lambda group: abs(group[0].window - shift.window)).append(shift)
        else:
            groups.append([shift])
    return sorted(groups, key=lambda group: min(s.window for s in group))
