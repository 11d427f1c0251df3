"""Progressive diagnosis of one job's :class:`JobFrame`: L1 job level, L2 ranks, L3 kernels.

* L1 — the job's median step, phase, category and kernel-class times per window → change
  points (:func:`change_points`). An upward shift no rank-level finding explains is a
  ``job_regression``.
* L2 — every rank against its peers, per metric (step, phases, kernel categories, device
  idle, burstiness, SM clock) at several time scales (:func:`cross_rank_outliers`), BH FDR
  across ranks, a minimum effect in seconds and persistence across windows.
* L3 — the kernel class that moved (each compute class's share of the rank's compute time:
  the share cancels the rank's own sequence-length noise) and the link group (ranks sharing
  ``host.name``, pipeline stages via ``stepwatch.pp_rank``).

The engine runs L2 (:mod:`._crossrank`, every rank against its peer group:
:mod:`._groups`), cuts each rank's flags into episodes (:mod:`._episodes`), lets the episode
rules of :mod:`.rules` name and describe them, drops the ranks of a pipeline that only waited
for a culprit of their replica, then runs the job rules (``rank_missing``,
``stage_imbalance``, ``workload_imbalance``, L1's ``job_regression``); every rule's
:class:`Verdict` becomes a :class:`Finding` here, with its cost (:mod:`._cost`), the severity
of that cost, and only when it costs the job enough. The blame for a masked straggler goes
to the rank whose host-side compute grew, never to the peers that wait.
"""

from __future__ import annotations

import dataclasses

from stepwatch.core._diagnosis import Diagnosis
from stepwatch.detectors.analysis import rules
from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._context import Basis, Context
from stepwatch.detectors.analysis._cost import estimate
from stepwatch.detectors.analysis._crossrank import flag_metrics
from stepwatch.detectors.analysis._episodes import (
    drop_waiters,
    find_episodes,
    merge_episodes,
    narrow_to_late,
)
from stepwatch.detectors.analysis._rule import (
    Kind,
    Verdict,
    raise_bar,
    severity_for,
    severity_of,
)
from stepwatch.detectors.frame._frame import JobFrame

# The package façade and stepwatch.detectors import these names from here.
__all__ = ["DetectorConfig", "Finding", "analyse", "diagnose"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """A diagnosis plus when the engine could first have raised it.

    Attributes:
        diagnosis: the docs/schema.md record.
        detected_unix_nano: end of the window at which the flags were first confirmed
            (flags only use past windows, so an incremental run raises it then).
        last_seen_unix_nano: end of the last window showing the condition.
        evidence: what the finding rests on, as a ratio: its ranks against their peers in
            the metric the rule names (a rank finding), or the job's own shift or loss.
    """

    diagnosis: Diagnosis
    detected_unix_nano: int
    last_seen_unix_nano: int
    evidence: float = 1.0


def analyse(frame: JobFrame, *, config: DetectorConfig | None = None) -> list[Finding]:
    """Run L1, L2 and L3 on a frame, classify, and cost every finding.

    Args:
        frame: the job's windows (:func:`read_frame` or ``SimulatedJob.frame()``).
        config: thresholds; :class:`DetectorConfig` defaults when omitted.

    Returns:
        The findings, most expensive first (their ``slowdown``), then by start and kind.
        Each carries its cost; findings that cost the job less than
        ``config.min_slowdown_for(kind)`` are not raised.

    Notes:
        Needs at least ``config.min_ranks`` ranks for cross-rank tests (fewer: only job-level
        change points and ``rank_missing``) and 6 windows for job-level change points.
        Silent ranks (NaN) are left out of every test and reported as ``rank_missing`` once
        silent for ``config.missing_windows`` windows while most ranks still report.

    References:
        Tukey, J. W. (1977). Exploratory Data Analysis (median/MAD). Benjamini and Hochberg
        (1995). ARGUS/PerfTracker-style differential observability: compare ranks with
        their peers and with their own history; blame compute time and arrival order.
    """
    config = config or DetectorConfig()
    if frame.n_windows == 0 or frame.n_ranks == 0:
        return []
    basis = Basis.of(frame, config)
    context = Context.with_metrics(basis, flag_metrics(basis))
    registry = rules.registry()
    verdicts: list[Verdict] = []
    for rule, merged in merge_episodes(find_episodes(context.metrics, config), registry):
        group = narrow_to_late(context, rule.declared, merged)
        if rule.narrow is not None:
            group = rule.narrow(context, group)
        description = rule.describe(context, group)
        verdicts.append(
            Verdict(
                description=description,
                first=group.first,
                last=group.last,
                detected=group.detected,
                open=group.last >= frame.n_windows - 1 - config.gap_windows,
                severity=severity_of(description.ratio),
                score=context.score(description.indices, group.first, group.last),
            )
        )
    verdicts = drop_waiters(context, verdicts, registry)
    # A rank finding too cheap to raise explains nothing: the job rules see the others only
    # (a noisy rank's unraised 1.01x episode once hid a 1.87x job regression that began
    # beside it, on a recorded real run).
    spans = [slice(v.first, v.last + 1) for v in verdicts]
    raised = [
        v
        for v in verdicts
        if _costed(context, registry.kind(v.description.kind), v, spans) is not None
    ]
    for job_rule in registry.job_rules:
        found = job_rule.find(context, tuple(raised))
        verdicts.extend(found)
        raised.extend(found)
    busy = [slice(v.first, v.last + 1) for v in verdicts]
    findings = []
    for verdict in verdicts:
        costed = _costed(context, registry.kind(verdict.description.kind), verdict, busy)
        if costed is not None:
            findings.append(_finding(context, costed))
    return sorted(
        findings,
        key=lambda f: (-f.diagnosis.slowdown, f.diagnosis.start_unix_nano, f.diagnosis.kind),
    )


#: A rank finding's evidence (its ratio to its peers) must differ from 1 by at least this
#: much: a finding whose own evidence reads 1.00x shows nothing, whatever its cost says.
MIN_EVIDENCE = 1.03


def _costed(
    context: Context, declared: Kind, verdict: Verdict, busy: list[slice]
) -> Verdict | None:
    """The verdict with its cost and the severity of that cost; ``None`` below the bar.

    A rank finding the cost model prices is raised only when its evidence shows the anomaly
    (its ratio to its peers at least :data:`MIN_EVIDENCE` away from 1) and, for
    ``paced`` kinds, costs at most that ratio: a rank that takes r times its peers'
    time in what paces the job cannot slow the job by more than r. A verdict whose rule
    measured no cost and whose kind has no cost model keeps its severity and a cost of 1.0
    (unknown), and is always raised.
    """
    what = verdict.description
    slowdown = what.slowdown
    if slowdown is None:
        span = slice(verdict.first, verdict.last + 1)
        slowdown = estimate(context, declared, what.indices, span, busy=busy)
    if slowdown is None:
        return verdict
    slowdown = max(1.0, float(slowdown))
    if what.indices and what.slowdown is None:  # a rank finding the cost model priced
        evidence = max(what.ratio, 1.0 / what.ratio) if what.ratio > 0 else 1.0
        if evidence < MIN_EVIDENCE:
            return None
        if declared.paced:
            slowdown = min(slowdown, evidence)
    if slowdown < raise_bar(context.config, declared):
        return None
    summary = with_cost(what.summary, slowdown)
    return dataclasses.replace(
        verdict,
        description=dataclasses.replace(what, summary=summary, slowdown=slowdown),
        severity=severity_for(context.config, declared, slowdown),
    )


def with_cost(summary: str, slowdown: float) -> str:
    """A finding's summary followed by its cost in words (every costed finding says it)."""
    return f"{summary}; costs the job ~{slowdown:.2f}x step time"


def _finding(context: Context, verdict: Verdict) -> Finding:
    """The :class:`Finding` of a rule's verdict: window indices become times."""
    frame = context.frame
    what = verdict.description
    ends = frame.window_end_unix_nano
    diagnosis = Diagnosis(
        job=frame.job,
        kind=what.kind,
        ranks=tuple(context.rank_ids(what.indices)),
        hosts=what.hosts,
        phase=what.phase,
        kernel_class=what.kernel_class,
        start_unix_nano=frame.window_start_unix_nano(verdict.first),
        end_unix_nano=None if verdict.open else int(ends[verdict.last]),
        severity=verdict.severity,
        score=verdict.score,
        summary=what.summary,
        slowdown=1.0 if what.slowdown is None else what.slowdown,
    )
    return Finding(
        diagnosis=diagnosis,
        detected_unix_nano=int(ends[verdict.detected]),
        last_seen_unix_nano=int(ends[verdict.last]),
        evidence=what.ratio,
    )


def diagnose(frame: JobFrame, *, config: DetectorConfig | None = None) -> list[Diagnosis]:
    """The diagnoses of :func:`analyse`."""
    return [finding.diagnosis for finding in analyse(frame, config=config)]
