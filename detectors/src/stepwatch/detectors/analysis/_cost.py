"""What a finding costs the job: the what-if slowdown of its step time.

``slowdown`` = the job's time over the finding's windows / the time it would have taken if
the finding's ranks had behaved like their peer group. Synchronous training is paced by its
slowest member: every rank waits in the gradient all-reduce for the last arrival, and in a
pipeline every stage of a replica waits for the slowest stage (1F1B). So what a late rank
costs is its lead over the *next* slowest replica, not over the median:

* **Late arrival** (stragglers, masked stragglers, data-loader stalls, GPU health, stalls):
  per window, ``lead`` = the time a rank spends before its final collective (step minus its
  wait in it); the saving is how far the finding's replicas lead every other replica
  (``max lead of theirs - max lead of the others``, never negative). A replica is the ranks
  of one ``stepwatch.dp_rank`` (they wait for each other inside the pipeline), or the rank
  itself when coordinates are missing.
* **Slow transfer** (link degradation flagged on step or communication time): the ranks'
  step excess over their peers' median step: the job moves at the pace of its slowest rank.
* **Wait inside another phase** (no communication phase or kernels: the all-reduce is inside
  ``backward``, :func:`~._context.held_wait_phase`): the lead is the time outside that
  phase; a straggler's own excess inside it hides behind the others' wait, so for the
  compute kinds what the straggler's own time in it grew over its history is added where
  it arrives last (:func:`_held_growth`).
* **A whole pipeline stage** (a bubble on every replica): the stage's ranks against the
  next slowest rank outside the stage.
* **No one left to compare with** (every rank, or no collective reported): the job's step
  over the finding's windows against its step in the frame's windows outside every finding
  (``temporal``), when there are at least 3.

Rules that measure their own cost (``stage_imbalance``, ``workload_imbalance``,
``job_regression``, single-step late arrivals) put it in ``Description.slowdown``. Kinds
with no cost model here and none from their rule (``rank_missing``, ``hang``: a silent rank
has no step time to compare) keep ``slowdown = 1.0`` and their rule's severity, and are never
filtered by cost.

The saving is estimated from window means. The next slowest replica changes from step to
step, so its expected lead is the others' mean lead plus the job's usual loss to rotating
arrival, measured in the windows before the finding (mean wait minus the shortest
collective); with no such windows, the largest window mean among the others, which is
lower, so a small straggler present from the start comes out slightly expensive.

References:
    Lin et al. (2025), Understanding Stragglers in Large Model Training Using What-if
    Analysis, OSDI'25: slowdown = actual / ideal step time, the ideal simulated with the
    straggling workers' operations replaced by their peers' typical duration.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import numpy as np

from stepwatch.detectors.analysis._context import Context, held_wait_phase
from stepwatch.detectors.analysis._crossrank import OUTSIDE, outside_gap_s
from stepwatch.detectors.analysis._rule import Kind, Verdict
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY
from stepwatch.detectors.frame._sampled import MIN_TIMED_STEPS
from stepwatch.detectors.stats._stats import FloatArray, nanmedian

#: Fewest clean windows for the temporal estimate.
MIN_CLEAN_WINDOWS = 3


def wait_s(context: Context) -> FloatArray | None:
    """``(W, R)`` time in the final collective per step (communication phase, else the
    communication kernels), ``None`` when the job reports neither."""
    frame = context.frame
    communication = frame.phase(COMMUNICATION_CATEGORY)
    if communication is not None and np.isfinite(communication).any():
        return communication
    kernels = frame.category_s(COMMUNICATION_CATEGORY)
    return kernels if np.isfinite(kernels).any() else None


def _wait_phase(context: Context) -> int | None:
    """The index of the phase :func:`lead_s` takes the wait from (communication, else the
    phase that holds the collective), ``None`` when it is the communication kernels'."""
    frame = context.frame
    communication = frame.phase(COMMUNICATION_CATEGORY)
    if communication is not None and np.isfinite(communication).any():
        return frame.phases.index(COMMUNICATION_CATEGORY)
    held = held_wait_phase(frame)
    if held is not None and wait_s(context) is None:
        return frame.phases.index(held)
    return None


def _held_growth(
    context: Context, indices: Sequence[int], span: slice, busy: Sequence[slice]
) -> FloatArray | None:
    """``(windows,)`` how much the ranks' time in the phase that holds the wait grew over
    their own time in it before ``span`` (clean windows, as :func:`_usual_spread`), at
    least 0; ``None`` when the job reports its wait, or without enough clean windows.

    A rank whose own work grew both outside that phase and inside it (a slow host slows
    forward and backward alike) leads its peers only by the part outside: the part inside
    hides behind their wait, which grew as much. Once it arrives last it waits for no
    one, so what its time in the phase grew by is its own work, less the little it used
    to wait (a lower bound).
    """
    frame = context.frame
    held = held_wait_phase(frame)
    values = None if held is None or wait_s(context) is not None else frame.phase(held)
    if values is None or span.start - 1 < MIN_CLEAN_WINDOWS:
        return None
    clean = np.zeros(frame.n_windows, dtype=bool)
    clean[1 : span.start] = True
    for other in busy:
        if other != span:
            clean[other] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mine = np.nanmedian(np.where(context.present, values, np.nan)[:, list(indices)], axis=1)
    if np.isfinite(mine[clean]).sum() < MIN_CLEAN_WINDOWS:
        return None
    before = float(np.nanmedian(mine[clean]))
    return np.where(np.isfinite(mine[span]), np.clip(mine[span] - before, 0.0, None), 0.0)


def lead_s(context: Context) -> FloatArray:
    """``(W, R)`` time a rank spends before its final wait per step (:mod:`._split`)."""
    return context.split.lead_s


@dataclasses.dataclass(frozen=True)
class Pacing:
    """What paces a pipelined job, per window, from the ranks' own work
    (:meth:`~._context.Context.work_s`: compute kernels, else the phases that hold no wait).

    Each replica (``stepwatch.dp_rank``) runs its stages as one pipeline, paced by its
    slowest stage's work (a stage's wall time also holds its waits for the others); the
    replicas then wait for the slowest replica. The what-if ideal of
    Lin et al. (OSDI'25) gives every operation the mean duration of its kind: every rank
    does the mean work, stages and replicas alike.

    Attributes:
        latest: ``(W,)`` the slowest replica's pace: the largest work of its ranks.
        group_mean: ``(W, G)`` the mean work of each peer group (stage).
        mean: ``(W,)`` the mean work over every rank.
    """

    latest: FloatArray
    group_mean: FloatArray
    mean: FloatArray

    def stage_s(self, group: int) -> FloatArray:
        """``(W,)`` what ``group`` being heavier than the mean rank costs each step."""
        return np.clip(self.group_mean[:, group] - self.mean, 0.0, None)

    def rotation_s(self, group: int) -> FloatArray:
        """``(W,)`` how far the slowest replica's pace lies above ``group``'s mean: the
        imbalance between replicas beyond that group's structure."""
        return np.clip(self.latest - self.group_mean[:, group], 0.0, None)

    def rotation_dominates(self, span: slice) -> bool:
        """Over ``span``, the replicas' pace varies from step to step more than the heaviest
        stage stands out.

        With variable sequence lengths, every replica's work changes from step to step and
        the slowest replica keeps changing; the stage holding the most token-dependent work
        is heavier on average too. When the slowest replica's lead over that stage's mean
        exceeds the stage's own excess over the mean rank, moving layers is not what the
        job lacks: the loss is a workload imbalance, that structure included.
        """
        heavy = heaviest_group(self)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            stage = float(np.nanmedian(self.stage_s(heavy)[span]))
            rotation = float(np.nanmedian(self.rotation_s(heavy)[span]))
        return rotation > stage


def pacing(context: Context) -> Pacing | None:
    """The job's :class:`Pacing`, ``None`` unless its ranks form two or more peer groups."""
    groups = context.groups
    if groups.n_groups < 2:
        return None
    lead = context.work_s()
    replicas = groups.replicas
    with warnings.catch_warnings():  # windows where a side is silent stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        paces = np.stack(
            [np.nanmax(lead[:, replicas == r], axis=1) for r in np.unique(replicas)], axis=1
        )
        group_mean = np.stack(
            [np.nanmean(lead[:, groups.members(g)], axis=1) for g in range(groups.n_groups)],
            axis=1,
        )
        return Pacing(
            latest=np.nanmax(paces, axis=1),
            group_mean=group_mean,
            mean=np.nanmean(lead, axis=1),
        )


def steps_per_window(context: Context) -> FloatArray:
    """``(W,)`` median steps per window over the ranks reporting (0 where none)."""
    counts = np.where(context.present, context.frame.step_count, np.nan)
    median = nanmedian(counts, axis=1)[:, 0]
    return np.where(np.isfinite(median), median, 0.0)


def ratio_of(step: FloatArray, saving: FloatArray, weight: FloatArray) -> float:
    """``sum(w * step) / sum(w * (step - saving))`` over windows where both are known."""
    usable = np.isfinite(step) & np.isfinite(saving) & (weight > 0) & (step > 0)
    if not usable.any():
        return 1.0
    total = float(np.sum(weight[usable] * step[usable]))
    saved = float(np.sum(weight[usable] * np.clip(saving[usable], 0.0, None)))
    saved = min(saved, 0.95 * total)
    return max(1.0, total / (total - saved)) if total > 0 else 1.0


def late_saving(
    context: Context, indices: Sequence[int], span: slice, *, busy: Sequence[slice] = ()
) -> FloatArray | None:
    """``(windows,)`` seconds per step the job would save if ``indices`` kept pace with the
    next slowest replica; when every replica holds one of them (a whole pipeline stage),
    with the next slowest rank outside them (``None``: they are every rank)."""
    replicas = context.groups.replicas
    mine = np.isin(replicas, replicas[list(indices)])
    if mine.all():  # every replica holds one (a whole stage): the ranks against the others
        mine = np.zeros(replicas.shape[0], dtype=bool)
        mine[list(indices)] = True
    if mine.all() or not mine.any():
        return None
    lead = lead_s(context)[span]
    with warnings.catch_warnings():  # windows where one side is silent stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        theirs = np.nanmax(np.where(mine[None, :], lead, np.nan), axis=1)
        others = np.nanmax(np.where(mine[None, :], np.nan, lead), axis=1)
        # The next slowest rank changes from step to step: the largest *window mean*
        # among the others is below the mean of the per-step maxima. Before the finding,
        # that gap is the job's usual loss to rotating arrival (mean wait minus the
        # shortest collective): the others' mean lead plus it is the expected latest.
        # Likewise for the finding's own ranks when they are many (a whole stage).
        usual = _usual_spread(context, span.start, busy)
        if usual is not None:
            expected = np.nanmean(np.where(mine[None, :], np.nan, lead), axis=1) + usual
            others = np.fmax(others, expected)
            if mine.sum() > 1:  # the latest of a few: the spread shrinks with their count
                scale = _expected_max(int(mine.sum())) / _expected_max(mine.size)
                own = np.nanmean(np.where(mine[None, :], lead, np.nan), axis=1) + usual * scale
                theirs = np.fmax(theirs, own)
    return np.where(np.isfinite(theirs) & np.isfinite(others), theirs - others, np.nan)


def _expected_max(count: int) -> float:
    """About the expected largest of ``count`` standard normal draws (its median)."""
    from scipy.special import ndtri

    return float(ndtri(1.0 - 0.5 / max(count, 2)))


def _usual_spread(context: Context, before: int, busy: Sequence[slice]) -> float | None:
    """Median loss to rotating arrival over the windows before ``before`` outside every
    ``busy`` span (not the first window, warm-up); ``None`` with fewer than
    :data:`MIN_CLEAN_WINDOWS` of them, or when the waits cannot be arrival spread.

    Waits measure arrival spread only while the collective's own time is steady (NCCL on
    a network). When it is not (gloo on a starved CPU, where the all-reduce itself takes
    anywhere from 1 to 15 ms), the waits exceed anything the spread of the ranks' window
    means allows, more than ``2 sqrt(steps per window)`` times it, or more than ``R - 1``
    times the ranks' mean time outside the collective (what R arrivals can lose at most),
    and are not used.
    """
    lost = imbalance_lost_s(context, ())
    if lost is None or before - 1 < MIN_CLEAN_WINDOWS:
        return None
    clean = np.zeros(lost.shape[0], dtype=bool)
    clean[1:before] = True
    for other in busy:
        clean[other] = False
    window = lost[clean]
    if np.isfinite(window).sum() < MIN_CLEAN_WINDOWS:
        return None
    usual = float(np.nanmedian(window))
    lead = lead_s(context)[clean]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        spread = float(np.nanmedian(np.nanmax(lead, axis=1) - np.nanmean(lead, axis=1)))
        steps = float(np.nanmedian(_wait_steps(context)[clean]))
        # Of R ranks' times outside the collective (>= 0), the latest exceeds their mean by
        # at most (R - 1) times that mean, in every step and so in every window's means: a
        # larger "loss" is the collective's own time varying (gloo on a busy CPU: 1-15 ms),
        # not arrival spread.
        ranks = np.isfinite(lead).sum(axis=1)
        most = float(np.nanmedian((ranks - 1) * np.nanmean(lead, axis=1)))
    if _wait_sampled(context) and not steps >= MIN_TIMED_STEPS:
        return None  # sampled: the spread of a few timed steps' means is their noise
    if not (spread > 0 and usual <= 2.0 * math.sqrt(max(steps, 1.0)) * spread):
        return None
    if not usual <= most:
        return None
    return usual


def _wait_sampled(context: Context) -> bool:
    """Whether the waits of :func:`lead_s` rest on a sample of steps."""
    index = _wait_phase(context)
    frame = context.frame
    timed = frame.phase_steps if index is None else frame.phase_rests_on(index)
    return timed is not None and not (
        frame.phase_every_step is not None
        and index is not None
        and bool(frame.phase_every_step[:, :, index][context.present].all())
    )


def _wait_steps(context: Context) -> FloatArray:
    """``(W,)`` median over the ranks of the steps their window means of phase times rest
    on: the steps per window, or the timed steps of sampled phases (the leads' spread is
    then the sample's)."""
    index = _wait_phase(context)
    timed = context.frame.phase_steps if index is None else context.frame.phase_rests_on(index)
    if timed is None:
        return steps_per_window(context)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        median = np.nanmedian(np.where(context.present, timed, np.nan), axis=1)
    return np.where(np.isfinite(median), median, steps_per_window(context))


def _paused_s(
    context: Context, indices: Sequence[int], span: slice, busy: Sequence[slice]
) -> FloatArray | None:
    """``(windows,)`` seconds per step the stalls of ``indices`` cost in the windows they
    were flagged in: the longest stall beyond the job's usual rotating loss, over the
    window's steps. A stall between phases is its time outside the phases; one inside
    them, with the device idle (``burst:idle``), its longest idle beyond the others'."""
    names = context.metrics.names
    lengths: list[FloatArray] = []
    mine = list(indices)
    if f"stall:{OUTSIDE}" in names:
        gap = outside_gap_s(context)
        flagged = context.metrics.flags[span][:, mine, names.index(f"stall:{OUTSIDE}")]
        if gap is not None and flagged.any():
            lengths.append(np.where(flagged, gap[span][:, mine], np.nan))
    if "burst:idle" in names:
        flagged = context.metrics.flags[span][:, mine, names.index("burst:idle")]
        idle = np.where(context.present, context.frame.idle_max_s, np.nan)[span]
        if flagged.any() and np.isfinite(idle).any():
            typical = nanmedian(idle, axis=1)
            lengths.append(np.where(flagged, idle[:, mine] - typical, np.nan))
    if not lengths:
        return None
    usual = _usual_spread(context, span.start, busy) or 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        longest = np.nanmax(np.concatenate(lengths, axis=1), axis=1)
    steps = np.maximum(steps_per_window(context)[span], 1.0)
    return np.where(np.isfinite(longest), np.clip(longest - usual, 0.0, None) / steps, 0.0)


def _one_pipeline(context: Context, indices: Sequence[int]) -> bool:
    """Whether ``indices`` are some stages of the job's only pipeline replica."""
    groups = context.groups
    replicas = set(groups.replicas.tolist())
    return (
        bool(indices)
        and groups.source == "coordinates"
        and groups.replicas_known
        and len(replicas) == 1
        and len(indices) < groups.replicas.shape[0]
    )


def step_excess(context: Context, indices: Sequence[int], span: slice) -> FloatArray:
    """``(windows,)`` the ranks' median step above their peers' median step."""
    step = np.where(context.present, context.frame.step_s, np.nan)[span]
    mine = np.zeros(step.shape[1], dtype=bool)
    mine[list(indices)] = True
    if mine.all():  # no peers to be above
        return np.zeros(step.shape[0])
    with np.errstate(invalid="ignore"):
        theirs = nanmedian(step[:, mine], axis=1)[:, 0]
        others = nanmedian(step[:, ~mine], axis=1)[:, 0]
    return theirs - others


def temporal_slowdown(context: Context, span: slice, busy: Sequence[slice]) -> float | None:
    """The job's step over ``span`` against its median step outside every ``busy`` span."""
    step = context.step_median
    clean = np.isfinite(step)
    clean[0] = False  # warm-up
    for other in busy:
        clean[other] = False
    if clean.sum() < MIN_CLEAN_WINDOWS:
        return None
    baseline = float(np.median(step[clean]))
    during = step[span]
    weight = steps_per_window(context)[span]
    usable = np.isfinite(during) & (weight > 0)
    if not usable.any() or baseline <= 0:
        return None
    mean = float(np.sum(during[usable] * weight[usable]) / np.sum(weight[usable]))
    return max(1.0, mean / baseline)


def estimate(
    context: Context,
    declared: Kind,
    indices: Sequence[int],
    span: slice,
    *,
    busy: Sequence[slice] = (),
) -> float | None:
    """The what-if slowdown of a finding of kind ``declared`` on ``indices`` over ``span``.

    Returns ``None`` when the kind has no cost model here (not ``late_arrival``).
    """
    if not declared.late_arrival:
        return None
    kind = declared.name
    step = context.step_median
    if kind == "jit_stall":  # a stall outside phases is paid in the peers' next step
        span = slice(span.start, min(span.stop + 1, step.shape[0]))
    weight = steps_per_window(context)[span]
    costs = [1.0]
    saving = late_saving(context, indices, span, busy=busy) if indices else None
    if saving is not None and kind == "jit_stall":
        # Stalls strike some steps of a rank: what they cost is its lead beyond its usual
        # one (a rank that is also a straggler leads every window; that is the other
        # finding's cost).
        usual = late_saving(context, indices, slice(0, step.shape[0]))
        if usual is not None and np.isfinite(usual).any():
            saving = saving - max(0.0, float(np.nanmedian(usual)))
        # A rank that finished fewer steps than its peers in a window (it stopped in it) has
        # its stall in fewer steps: per step of the job, it is diluted by their ratio.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            own = np.nanmax(context.frame.step_count[span][:, list(indices)], axis=1)
        saving = saving * np.clip(own / np.maximum(weight, 1.0), 0.0, 1.0)
        # A window mean dilutes one stalled step among the window's steps and compares it
        # with the others' *mean* latest arrival: a stall between phases is better costed by
        # its own length beyond the others' usual spread, once per window it struck.
        paused = _paused_s(context, indices, span, busy)
        if paused is not None:
            saving = np.fmax(saving, paused)
    if saving is not None and declared.own_work:
        grown = _held_growth(context, indices, span, busy)
        if grown is not None:  # only where they are the last to arrive (they wait for none)
            saving = saving + np.where(saving > 0, grown, 0.0)
    if saving is not None:
        costs.append(ratio_of(step[span], saving, weight))
    if kind == "link_degradation" and indices:  # the job moves at its slowest rank's pace
        excess = step_excess(context, indices, span)
        costs.append(ratio_of(step[span] + np.clip(excess, 0.0, None), excess, weight))
    if saving is None or (_one_pipeline(context, indices) and kind != "jit_stall"):
        # No other replica to pace against (a pipeline of one replica: its stages' fill and
        # drain carry a slow stage's whole excess, which the lead over the next stage
        # misses): the job's step over the finding against its step before it.
        temporal = temporal_slowdown(context, span, busy)
        if temporal is not None:
            costs.append(temporal)
    cost = max(costs)
    return cost if math.isfinite(cost) else 1.0


def imbalance_lost_s(context: Context, earlier: Sequence[Verdict]) -> FloatArray | None:
    """``(W,)`` seconds per step lost to ranks arriving at different times that none of the
    ``earlier`` rank findings explains (``None`` without collective times).

    With peer groups (pipeline stages), from the ranks' leads instead
    (:func:`_rotation_lost_s`): their waits hold the stages' structure too.

    With synchronous collectives a rank's time in the collective is the transfer plus its
    wait for the last arrival: the mean over ranks of that time minus the shortest
    collective of the window (the histograms' ``min``, else the shortest mean: the rank
    that arrived last waited for no one) is what every step loses to the spread of
    arrivals. A rank finding's lead (:func:`late_saving`) is its share of it.
    """
    paced = pacing(context)
    if paced is not None:
        return _rotation_lost_s(context, paced, earlier)
    waits = _waits(context)
    if waits is None:
        return None
    wait, shortest = waits
    # The ranks a finding names are explained: their own collective time (a slow link's
    # transfer) is theirs, and what the others wait for them is their finding's lead.
    others = wait.copy()
    for verdict in earlier:
        if verdict.description.indices:
            others[verdict.first : verdict.last + 1, list(verdict.description.indices)] = np.nan
    with warnings.catch_warnings():  # all-NaN windows (no rank reported) stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        lost = np.nanmean(others, axis=1) - np.nanmin(shortest, axis=1)
    for verdict in earlier:
        if not verdict.description.indices:
            continue
        span = slice(verdict.first, verdict.last + 1)
        saving = late_saving(context, verdict.description.indices, span)
        if saving is not None:
            lost[span] -= np.clip(np.nan_to_num(saving), 0.0, None)
    return np.asarray(np.clip(lost, 0.0, None), dtype=np.float64)


def heaviest_group(paced: Pacing) -> int:
    """The peer group with the largest typical work (the stage that paces the replicas)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        typical = np.nanmedian(paced.group_mean, axis=0)
    return int(np.argmax(np.where(np.isfinite(typical), typical, -np.inf)))


def _rotation_lost_s(context: Context, paced: Pacing, earlier: Sequence[Verdict]) -> FloatArray:
    """``(W,)`` the slowest replica's pace above the heaviest stage's mean, less what the
    ``earlier`` rank findings explain.

    From window means (:meth:`Pacing.rotation_s`), the largest replica's pace is below the
    mean of each step's largest when the slowest replica changes within a window. Each
    stage's waits in its collectives see every step's (their mean less the shortest
    collective of the stage, as without groups; the waits for the other stages are alike
    within a stage and cancel): their median over the stages is used instead where it is
    larger, and where the spread of the work allows it (at most ``2 sqrt(steps per
    window)`` times the means' loss), in windows where it does when it does in at least
    :data:`PLAUSIBLE_SHARE` of them.
    """
    lost = paced.rotation_s(heaviest_group(paced)).copy()
    waited = _stage_waits_lost_s(context)
    if waited is not None:
        steps = np.maximum(steps_per_window(context), 1.0)
        known = np.isfinite(waited) & np.isfinite(lost)
        plausible = known & (waited <= 2.0 * np.sqrt(steps) * lost)
        # The waits are the stages' collectives only where most windows bear them out: a
        # point-to-point wait on a starved CPU varies far more than any work does.
        if known.any() and plausible.sum() >= PLAUSIBLE_SHARE * known.sum():
            lost = np.where(plausible, np.fmax(lost, waited), lost)
    for verdict in earlier:
        if not verdict.description.indices or verdict.description.kind == "stage_imbalance":
            continue
        span = slice(verdict.first, verdict.last + 1)
        saving = late_saving(context, verdict.description.indices, span)
        if saving is not None:
            lost[span] -= np.clip(np.nan_to_num(saving), 0.0, None)
    return np.asarray(np.clip(np.nan_to_num(lost, nan=0.0), 0.0, None), dtype=np.float64)


#: Share of the windows whose stage waits the work's spread must bear out for the waits to
#: measure rotating imbalance at all.
PLAUSIBLE_SHARE = 0.5


def _stage_waits_lost_s(context: Context) -> FloatArray | None:
    """``(W,)`` median over the peer groups of their ranks' mean wait less the group's
    shortest collective (``None`` without collective times)."""
    waits = _waits(context)
    if waits is None:
        return None
    wait, shortest = waits
    groups = context.groups
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        per_group = np.stack(
            [
                np.nanmean(wait[:, members], axis=1) - np.nanmin(shortest[:, members], axis=1)
                for members in (groups.members(g) for g in range(groups.n_groups))
            ],
            axis=1,
        )
        return np.asarray(np.nanmedian(per_group, axis=1), dtype=np.float64)


def _waits(context: Context) -> tuple[FloatArray, FloatArray] | None:
    """``(W, R)`` each rank's time in its collectives per step and its shortest single
    collective (the histograms' ``min``, else the same mean), NaN where silent; ``None``
    without collective times."""
    wait = wait_s(context)
    if wait is None:
        return None
    frame = context.frame
    wait = np.where(context.present, wait, np.nan)
    shortest = wait
    if COMMUNICATION_CATEGORY in frame.phases and frame.phase_min_s is not None:
        column = frame.phases.index(COMMUNICATION_CATEGORY)
        low = frame.phase_min_s[:, :, column]
        # The histograms' min is one collective of a step only when the phase is timed once
        # a step; timed per operation (each point-to-point wait) it is one operation.
        if frame.phase_occurrences is not None:
            once = frame.phase_occurrences[:, :, column] <= ONCE_A_STEP
            low = np.where(once, low, wait)
        shortest = np.where(context.present, low, np.nan)
    return wait, shortest


#: A phase timed at most this many times a step on average is timed once a step.
ONCE_A_STEP = 1.5
