"""``rank_missing``: ranks that stopped reporting while most ranks still report.

A job rule: a rank silent for ``config.missing_windows`` consecutive windows after it was
first seen, in windows where at least half the ranks report. Ranks that fell silent in the
same window (and came back in the same one, or not at all) are one finding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import Description, JobRule, Kind, Verdict


def _find(context: Context, earlier: Sequence[Verdict]) -> list[Verdict]:
    del earlier  # a silent rank is a finding whatever else was found
    frame = context.frame
    present = context.present
    reporting = present.sum(axis=1) * 2 >= max(frame.n_ranks, 1)
    seen = np.maximum.accumulate(present, axis=0)
    absent = seen & ~present & reporting[:, None]
    by_start: dict[tuple[int, int | None], list[int]] = {}
    for rank_index in np.flatnonzero(absent.any(axis=0)):
        windows = np.flatnonzero(absent[:, rank_index])
        breaks = np.flatnonzero(np.diff(windows) > 1)
        for run in np.split(windows, breaks + 1):
            if run.size < context.config.missing_windows:
                continue
            first, last = int(run[0]), int(run[-1])
            came_back = last + 1 < frame.n_windows and bool(present[last + 1, rank_index])
            key = (first, last if came_back else None)
            by_start.setdefault(key, []).append(int(rank_index))
    verdicts = []
    for (first, until), indices in sorted(by_start.items(), key=lambda item: item[0][0]):
        summary = (
            f"{context.rank_text(indices)} stopped reporting at {context.since(first)} "
            "(the others still report)"
        )
        hosts = tuple(sorted({frame.hosts[i] for i in indices if frame.hosts[i]}))
        description = Description(RULE.kind, summary, 1.0, indices=tuple(indices), hosts=hosts)
        verdicts.append(
            Verdict(
                description=description,
                first=first,
                last=frame.n_windows - 1 if until is None else until,
                detected=first + context.config.missing_windows - 1,
                open=until is None,
                severity="critical",
                score=float(len(indices)),
            )
        )
    return verdicts


KIND = Kind(
    name="rank_missing",
    shows="a rank that stopped reporting while the others still do",
    localised="ranks",
    simulated=8,
)


RULE = JobRule(declared=KIND, order=10, find=_find)
