"""``hang``: no rank finished a step for longer than the job's own steps allow; who holds it.

Reads where each rank is (:class:`~stepwatch.detectors.frame.JobProgress`, the progress gauges
a rank sends while no step finishes), not finished steps: a hung job finishes none.
:func:`find_hangs` decides; the detector service's probe calls it every few seconds, and
:data:`RULE` gives the engine the same verdict for a :class:`~stepwatch.detectors.frame.
ProgressFrame`. The cases, thresholds and cost are in docs/diagnosis.md ("Hangs").

References:
    Dong et al. (2024), C4 (non-communication hangs localised in seconds); ARGUS's arrival
    order (the collective waits for whoever arrives last).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime

import numpy as np

from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._context import Context, _format_ranks
from stepwatch.detectors.analysis._rule import Description, JobRule, Kind, Verdict
from stepwatch.detectors.frame._progress import (
    COMMUNICATION,
    PROGRESS_LOOKBACK_S,
    JobProgress,
    ProgressFrame,
    RankProgress,
)


@dataclasses.dataclass(frozen=True)
class Hang:
    """Who holds a hang (no ranks: job-wide), since the job's last progress (Unix ns), cost."""

    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    phase: str | None
    onset_unix_nano: int
    stalled_s: float
    threshold_s: float
    usual_step_s: float
    summary: str

    @property
    def slowdown(self) -> float:
        """``1 + stalled / usual step``: how much longer the step in progress already is."""
        return 1.0 + self.stalled_s / self.usual_step_s

    @property
    def score(self) -> float:
        """The stalled time in thresholds (at least 1), capped at 99."""
        return min(self.stalled_s / self.threshold_s, 99.0)


def find_hangs(progress: JobProgress, *, hang_steps: float, hang_min_s: float) -> list[Hang]:
    """The hang the job is in now, if any (docs/diagnosis.md, "Hangs")."""
    live, usual, now = progress.live, progress.usual_step_s, progress.now_unix_nano
    if not live or usual is None:
        return []  # every monitor closed (the job ended), or no step finished yet
    last_report = max(r.last_report_unix_nano for r in live)
    onset = max(r.last_progress_unix_nano for r in live)
    threshold = max(hang_min_s, hang_steps * usual)  # no progress for this long: a hang
    stalled = (now - onset) / 1e9
    if stalled < threshold or (now - last_report) / 1e9 > PROGRESS_LOOKBACK_S:
        return []
    silent = progress.silent(min_s=threshold / 2.0)
    waiting = [r for r in live if r not in silent and progress.waits(r)]
    stuck = [r for r in live if r not in silent and not progress.waits(r)]
    wait = progress.wait_phase
    where_wait = wait if wait == COMMUNICATION else f"{wait} (which holds the collective)"
    closed = [r for r in progress.ranks if r.closed]
    since = f"no step finished since {_clock(onset)} (usual step {usual * 1e3:.0f} ms)"

    def hang(ranks: Sequence[RankProgress], phase: str | None, what: str) -> list[Hang]:
        hosts = tuple(sorted({r.host for r in ranks if r.host}))
        ids = tuple(sorted(r.rank for r in ranks))
        return [Hang(ids, hosts, phase, onset, stalled, threshold, usual, f"{what}; {since}")]

    if len(silent) == len(live):
        stalled_before = (last_report - onset) / 1e9 >= threshold / 2.0
        if closed or stalled_before or not any(r.speaks_progress for r in live):
            return []  # ended: exits, killed once stalled, or a producer that never says
        what = f"every rank stopped reporting at {_clock(last_report)} without closing"
        return hang((), None, what + " (frozen, cut off from the collector, or killed)")
    if not waiting or len(stuck) + len(silent) > len(waiting):
        return []  # most ranks busy outside their wait: a long step, not a hang
    waits = f"{_names(waiting)} wait in {where_wait}"
    if stuck or silent:
        phases = {r.phase for r in stuck} or {r.phase for r in silent if r.phase}
        phase = next(iter(phases)) if len(phases) == 1 else None
        named = sorted(p for p in phases if p)
        where = f"in {', '.join(named)}" if named else "outside any phase"
        parts = [f"{_names(stuck)} stuck {where}{_step(stuck)}"] if stuck else []
        if silent:
            seen = _clock(max(r.last_report_unix_nano for r in silent))
            last = _step(silent).replace(" at", ", last seen at")
            parts.append(f"{_names(silent)} silent since {seen}{last}")
        return hang([*stuck, *silent], phase, f"{' and '.join(parts)} while {waits}")
    if closed:
        return hang(closed, None, f"{_names(closed)} exited (closed its monitor) while {waits}")
    group, how = progress.lagging(waiting, min_gap_s=max(1.0, 2.0 * usual))
    what = f"every rank waits in {where_wait}{_step(waiting)}"
    if group:
        hosts = ", ".join(sorted({r.host for r in group}))
        what += f": {_names(group)} ({hosts}) {how}"
    return hang(group, wait, what)


def _names(ranks: Sequence[RankProgress]) -> str:
    return _format_ranks([r.rank for r in ranks])


def _step(ranks: Sequence[RankProgress]) -> str:
    steps = {r.step for r in ranks if r.step is not None}
    return f" at step {steps.pop()}" if len(steps) == 1 else ""


def _clock(unix_nano: int) -> str:
    return datetime.fromtimestamp(unix_nano / 1e9, tz=UTC).strftime("%H:%M:%S")


def _find(context: Context, earlier: Sequence[Verdict]) -> list[Verdict]:
    del earlier  # a hang is a finding whatever else was found before it
    frame, config = context.frame, context.config
    if not isinstance(frame, ProgressFrame) or frame.progress is None:
        return []
    ends, last = frame.window_end_unix_nano, frame.n_windows - 1
    columns = {int(rank): index for index, rank in enumerate(frame.ranks)}
    hangs = find_hangs(frame.progress, hang_steps=config.hang_steps, hang_min_s=config.hang_min_s)
    verdicts = []
    for hang in hangs:
        first = min(int(np.searchsorted(ends, hang.onset_unix_nano)), last)
        confirmed = int(np.searchsorted(ends, hang.onset_unix_nano + hang.threshold_s * 1e9))
        description = Description(
            kind=KIND.name,
            summary=hang.summary,
            ratio=hang.slowdown,
            slowdown=hang.slowdown,  # measured here: 1 + stalled time / usual step
            phase=hang.phase,
            indices=tuple(columns[r] for r in hang.ranks if r in columns),
            hosts=hang.hosts,
        )
        detected = min(max(confirmed, first), last)
        verdicts.append(Verdict(description, first, last, detected, True, "critical", hang.score))
    return verdicts


KIND = Kind(
    name="hang",
    shows="no progress: a rank stuck or silent while its peers wait, or the whole job",
    localised="the stuck or silent ranks and their phase, or the job",
)


def _probe(progress: JobProgress, config: DetectorConfig) -> list[Hang]:
    return find_hangs(progress, hang_steps=config.hang_steps, hang_min_s=config.hang_min_s)


RULE = JobRule(declared=KIND, order=95, find=_find, probe=_probe)
