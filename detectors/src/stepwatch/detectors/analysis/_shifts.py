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

GROUP_WINDOWS = 3
"""Shifts within this many windows of a group's first one are one episode."""


class Shift(NamedTuple):
    """One level shift of a job-level series."""

    window: int  # first window of the new level (where it is seen)
    series: str  # "step", "phase:<name>" or "kernel:<class>"
    excess_s: float
    ratio: float
    since: int  # the earliest window it may have begun (``window`` in a series with no gaps)


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
