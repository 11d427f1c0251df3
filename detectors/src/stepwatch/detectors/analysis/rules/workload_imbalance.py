"""``workload_imbalance``: time lost to ranks finishing at different times, no rank to blame.

A job rule, after the rank rules. With synchronous collectives a rank's time in the
collective is the transfer plus the wait for the last arrival, so per window the mean over
ranks of that time, minus the shortest collective seen (the histograms' ``min``: the rank
that arrived last waited for no one), is the time every step loses to ranks arriving at
different times. The part a rank finding already explains (a persistent straggler's lead)
is taken out; what is left is imbalance that moves from rank to rank (sequence lengths,
data skew), reported when the slowest rank keeps changing and it costs at least
``config.imbalance_min_slowdown``. Localisation: no rank; the compute phase whose time
varies most across ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._cost import heaviest_group, imbalance_lost_s, lead_s, pacing
from stepwatch.detectors.analysis._rule import Description, JobRule, Kind, Verdict, severity_of
from stepwatch.detectors.analysis._split import COMMUNICATION
from stepwatch.detectors.frame._frame import COMPUTE_PHASES
from stepwatch.detectors.stats._stats import FloatArray

#: The slowest replica may be the slowest in at most this share of the windows.
MAX_SAME_SLOWEST = 0.5
#: Windows averaged before a window counts as imbalanced.
TRAILING_WINDOWS = 3
#: Share of the time lost the spread of the ranks' own work must reach. Window means spread
#: less than single steps (about 1/sqrt(steps per window)) and a pipeline amplifies a
#: replica's extra work: a rotating imbalance of work gives 0.25-0.45 in the simulator;
#: CPU ranks descheduled in turn on a starved host wait as long with 0.02 (real runs).
MIN_WORK_SHARE = 0.15


def _find(context: Context, earlier: Sequence[Verdict]) -> list[Verdict]:
    lost = imbalance_lost_s(context, earlier)
    config = context.config
    if lost is None or context.frame.n_windows < TRAILING_WINDOWS:
        return []
    paced = pacing(context)
    if paced is not None and not any(v.description.kind == "stage_imbalance" for v in earlier):
        # The stage rule left the pipeline's structure to this loss (the replicas' pace
        # varies more than the heaviest stage stands out): the ideal balances both.
        lost = lost + np.nan_to_num(paced.stage_s(heaviest_group(paced)))
    step = context.step_median
    with np.errstate(invalid="ignore", divide="ignore"):
        # A median, not a mean: one window's spike (a stall everyone waits for) is not a
        # lasting imbalance.
        share = _trailing_median(lost / step)
        bar = 1.0 - 1.0 / config.min_slowdown_for(RULE.kind)
        windows = np.flatnonzero(share >= bar)
    verdicts = []
    for run in np.split(windows, np.flatnonzero(np.diff(windows) > config.gap_windows) + 1):
        if run.size < TRAILING_WINDOWS:
            continue
        detected, last = int(run[0]), int(run[-1])
        first = max(0, detected - TRAILING_WINDOWS + 1)
        span = slice(first, last + 1)
        if not (_rotates(context, span) and _work_explains(context, span, lost)):
            continue
        typical_step = float(np.nanmedian(step[span]))
        typical_lost = float(np.nanmedian(lost[span]))
        slowdown = typical_step / max(typical_step - typical_lost, 0.05 * typical_step)
        description = _describe(context, span, typical_lost, slowdown)
        verdicts.append(
            Verdict(
                description=description,
                first=first,
                last=last,
                detected=detected,
                open=last >= context.frame.n_windows - 1 - config.gap_windows,
                severity=severity_of(slowdown),
                score=float(np.nanmedian(share[run])),
            )
        )
    return verdicts


def _trailing_median(values: FloatArray) -> FloatArray:
    """Median of each window and the ``TRAILING_WINDOWS - 1`` before it (NaN-ignoring)."""
    result = np.full(values.shape, np.nan)
    for index in range(values.shape[0]):
        span = values[max(0, index - TRAILING_WINDOWS + 1) : index + 1]
        if np.isfinite(span).any():
            result[index] = np.nanmedian(span)
    return result


def _rotates(context: Context, span: slice) -> bool:
    """No replica is the slowest (largest lead) in more than ``MAX_SAME_SLOWEST`` of the
    windows: the imbalance moves, it is not a straggler."""
    lead = lead_s(context)[span]
    replicas = context.groups.replicas
    usable = np.isfinite(lead).any(axis=1)
    if usable.sum() < TRAILING_WINDOWS:
        return False
    slowest = replicas[
        np.nanargmax(np.where(np.isfinite(lead[usable]), lead[usable], -np.inf), axis=1)
    ]
    counts = np.bincount(slowest)
    return bool(counts.max() <= MAX_SAME_SLOWEST * slowest.size)


def _work_explains(context: Context, span: slice, lost: FloatArray) -> bool:
    """The ranks' own work differs enough to explain the wait: within a group, the most
    loaded rank's work exceeds the mean by ``MIN_WORK_SHARE`` of the time lost. Waiting
    that the work does not explain (a starved host descheduling ranks in turn, a noisy
    network) is not a workload imbalance."""
    work = context.work_s()[span]
    groups = context.groups
    spreads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for group in range(groups.n_groups):
            members = work[:, groups.members(group)]
            spreads.append(np.nanmax(members, axis=1) - np.nanmean(members, axis=1))
        spread = np.nanmean(np.stack(spreads, axis=1), axis=1)
        needed = float(np.nanmedian(lost[span]))
        return bool(np.nanmedian(spread) >= MIN_WORK_SHARE * needed)


def _describe(context: Context, span: slice, lost: float, slowdown: float) -> Description:
    frame = context.frame
    phase, spread = None, 0.0
    for name in COMPUTE_PHASES:
        values = frame.phase(name)
        if values is None or f"phase:{name}" in context.overlap_waiting:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            varies = float(np.nanmedian(np.nanstd(values[span], axis=1)))
        if varies > spread:
            phase, spread = name, varies
    step = float(np.nanmedian(context.step_median[span]))
    where = f"; {phase} varies most across ranks" if phase else ""
    summary = (
        f"ranks finish at different times and the slowest keeps changing (sequence "
        f"lengths, data skew): every step waits {1e3 * lost:.1f} ms "
        f"({100 * lost / step:.0f}% of its step) for the last arrival{where}, since "
        f"{context.since(span.start)}"
    )
    if context.groups.n_groups > 1 and context.split.evidence != COMMUNICATION:
        summary += (
            "; without a communication phase the stages' waits lie inside their phases: "
            "the work that varies is seen in part, and the loss is a lower bound"
        )
    return Description(RULE.kind, summary, slowdown, phase, slowdown=slowdown)


KIND = Kind(
    name="workload_imbalance",
    shows=(
        "time lost to ranks finishing at different times while the slowest keeps "
        "changing; no rank is blamed"
    ),
    localised="no rank; the phase that varies most",
    raise_bar="imbalance_min_slowdown",
    simulated=10,
)


RULE = JobRule(declared=KIND, order=60, find=_find)
