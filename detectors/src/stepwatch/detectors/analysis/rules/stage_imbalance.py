"""``stage_imbalance``: one pipeline stage does more work than the others on every replica.

A job rule. A pipeline is paced by its slowest stage, so a stage holding more layers than
the others slows the whole job on healthy hardware: a partitioning problem, not a straggler
(the cross-rank tests compare ranks within their stage, so its ranks are never blamed).
The work of a rank is its compute and memory kernel time per step (else its phases that
hold no waiting). The heaviest group (stage, or structural group inferred without
coordinates) must be the heaviest in most windows and, with ``stepwatch.dp_rank``, on every
replica. Cost: the pipeline's step if the layers were re-partitioned so that every stage
did the mean work of the stages (``saving = its work - the stages' mean``, the what-if
ideal of Lin et al., OSDI'25; the 1F1B fill and drain, about one micro-batch of it, are
ignored: without the micro-batch count the estimate is high by at most ``1/m``). Not
raised when the replicas' pace varies more than the stage stands out (variable sequence
lengths): ``workload_imbalance`` then reports the loss. Raised from
``config.structure_min_slowdown``, a warning from ``config.structure_warning_slowdown``: the
cost is an upper bound (whole layers move; balanced stages wait on each other more), and a
healthy pipeline's loss head or embedding costs a few % by it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._cost import pacing, ratio_of, steps_per_window
from stepwatch.detectors.analysis._rule import Description, JobRule, Kind, Verdict, severity_for
from stepwatch.detectors.analysis._split import COMMUNICATION, UNTIMED
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY, COMPUTE_PHASES
from stepwatch.detectors.stats._stats import FloatArray, nanmedian

#: Share of windows in which the stage must be the heaviest.
MIN_HEAVIEST_SHARE = 0.8


def _find(context: Context, earlier: Sequence[Verdict]) -> list[Verdict]:
    del earlier
    groups = context.groups
    frame = context.frame
    if groups.n_groups < 2 or not _work_measured(context):
        return []
    work = context.work_s()
    per_group = np.stack(
        [nanmedian(work[:, groups.members(g)], axis=1)[:, 0] for g in range(groups.n_groups)],
        axis=1,
    )  # (W, G)
    reported = np.isfinite(per_group).all(axis=1)
    if reported.sum() < 3:
        return []
    typical = np.median(per_group[reported], axis=0)
    order = np.argsort(typical)
    heavy, second = int(order[-1]), int(order[-2])
    heaviest = np.argmax(np.where(np.isfinite(per_group), per_group, -np.inf), axis=1)
    if np.mean(heaviest[reported] == heavy) < MIN_HEAVIEST_SHARE:
        return []
    if not _on_every_replica(context, work, heavy, second):
        return []
    windows = np.flatnonzero(reported)
    first, last = int(windows[0]), int(windows[-1])
    span = slice(first, last + 1)
    paced = pacing(context)
    if paced is not None and paced.rotation_dominates(span):
        return []  # workload_imbalance reports the loss, this structure included
    if not _paces(context, work, heavy, span):
        return []
    # Re-partitioned, every stage would do the mean work of the stages.
    saving = per_group[span, heavy] - np.mean(per_group[span], axis=1)
    slowdown = ratio_of(context.step_median[span], saving, steps_per_window(context)[span])
    if slowdown < context.config.min_slowdown_for(RULE.kind):
        return []
    description = _describe(context, heavy, second, typical, slowdown)
    return [
        Verdict(
            description=description,
            first=first,
            last=last,
            detected=int(windows[min(2, windows.size - 1)]),
            open=last >= frame.n_windows - 1 - context.config.gap_windows,
            severity=severity_for(context.config, KIND, slowdown),
            score=float(typical[heavy] / typical[second]),
        )
    ]


#: The other stages' waits must exceed the heavy stage's by at least this share of its extra
#: work: the stage paces its pipeline only if the others wait for it.
PACED_SHARE = 0.5


def _paces(context: Context, work: FloatArray, heavy: int, span: slice) -> bool:
    """Whether the heavy stage paces its pipeline: the other stages wait longer than it by
    at least :data:`PACED_SHARE` of its extra work (their point-to-point waits for it; in
    communication kernels where the job reports them, else in its communication phase).
    Stages that all wait alike are paced by something else (a shared host's CPU, the
    network), and moving layers would not help. ``True`` when the job times no wait."""
    frame = context.frame
    wait: FloatArray | None = frame.category_s(COMMUNICATION_CATEGORY)
    if wait is None or not np.isfinite(wait).any():
        wait = frame.phase(COMMUNICATION_CATEGORY)
    if (wait is None or not np.isfinite(wait).any()) and context.split.evidence == UNTIMED:
        wait = context.split.untimed_s  # the stages wait for each other in no phase
    if wait is None or not np.isfinite(wait[span]).any():
        return True
    groups = context.groups
    mine = groups.members(heavy)
    others = np.flatnonzero(groups.labels != heavy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        extra = np.nanmedian(work[span][:, mine]) - np.nanmedian(work[span][:, others])
        waited = np.nanmedian(wait[span][:, others]) - np.nanmedian(wait[span][:, mine])
    return bool(extra > 0 and waited >= PACED_SHARE * extra)


def _work_measured(context: Context) -> bool:
    """Whether the data measures the ranks' work apart from their waits: compute kernels,
    phases beside a timed communication phase, or a pipeline's phases that leave its waits
    untimed (:func:`~.._context.held_wait_phase`). Step times alone, or phases that hold
    the waits for the other stages, cannot show partitioning."""
    kernels = any(c in ("compute", "memory") for c in context.frame.kernel_categories)
    untimed = context.split.evidence == UNTIMED and context.groups.source == "coordinates"
    return kernels or untimed or context.split.evidence == COMMUNICATION


def _on_every_replica(context: Context, work: FloatArray, heavy: int, second: int) -> bool:
    """The heavy group outweighs the next one within every replica (or, without
    data-parallel coordinates, on nearly all its ranks)."""
    groups = context.groups
    typical = nanmedian(work, axis=0)[0]  # (R,)
    labels = groups.labels
    if groups.replicas_known and len(set(groups.replicas.tolist())) >= 2:
        for replica in set(groups.replicas.tolist()):
            inside = groups.replicas == replica
            mine = typical[inside & (labels == heavy)]
            theirs = typical[inside & (labels == second)]
            if mine.size and theirs.size and not np.nanmin(mine) > np.nanmax(theirs):
                return False
        return True
    mine = typical[labels == heavy]
    level = float(np.nanmedian(typical[labels == second]))
    return bool(np.mean(mine > level) >= MIN_HEAVIEST_SHARE)


def _describe(
    context: Context, heavy: int, second: int, typical: FloatArray, slowdown: float
) -> Description:
    groups = context.groups
    indices = tuple(int(i) for i in groups.members(heavy))
    others = groups.members(second)
    ratio = float(typical[heavy] / typical[second])
    phase = _top_phase(context, indices, others)
    kernel_class, kernel_ratio = context.top_class_between(indices, others)
    detail = f" ({kernel_class} {kernel_ratio:.2f}x)" if kernel_class else ""
    name = groups.names[heavy].removeprefix("stage ").removeprefix("group ")
    if groups.source == "coordinates":
        what, why = "pipeline stage", "uneven partitioning, not slow hardware"
    else:  # a group inferred from the data: the ranks are not known to be a stage
        what = "structural group"
        why = (
            "a structure of the job from its start (a pipeline stage's partitioning if these "
            "ranks are one: report stepwatch.pp_rank to tell)"
        )
    summary = (
        f"{what} {name} ({context.rank_text(indices)}) does {ratio:.2f}x the work of the "
        f"next heaviest, {groups.names[second]}, on every replica{detail}: {why}, since "
        f"{context.since(0)}"
    )
    return Description(
        RULE.kind, summary, ratio, phase, kernel_class, indices=indices, slowdown=slowdown
    )


def _top_phase(context: Context, mine: Sequence[int], others: np.ndarray) -> str | None:
    """The compute phase the heavy ranks spend most seconds above the others in."""
    frame = context.frame
    best, best_excess = None, 0.0
    for phase in COMPUTE_PHASES:
        values = frame.phase(phase)
        if values is None:
            continue
        excess = float(np.nanmedian(values[:, list(mine)]) - np.nanmedian(values[:, others]))
        if excess > best_excess:
            best, best_excess = phase, excess
    return best


KIND = Kind(
    name="stage_imbalance",
    shows=(
        "one pipeline stage slower than the others on every replica: partitioning, not hardware"
    ),
    localised="the stage, its ranks, phase, kernel class",
    raise_bar="structure_min_slowdown",
    warning_bar="structure_warning_slowdown",
    simulated=9,
)


RULE = JobRule(declared=KIND, order=50, find=_find)
