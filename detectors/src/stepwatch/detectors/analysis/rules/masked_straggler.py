"""``masked_straggler``: a rank whose host-side compute is slow while its kernels are normal.

Its peers wait for it in the collective, so their communication time grows and its own
shrinks: the blame goes to the rank whose compute-phase wall time or device idle grew
(precedence 50), never to the waiters. A job that records no communication phase holds
the wait in backward (:func:`~.._context.held_wait_phase`): there the peers are the long
ones and the straggler the shortest, so backward is no evidence against a rank. Any other
phase flagged alone is one too (70). On whole pipeline stages the same signature is a
``pipeline_bubble``. From a single step (a profiler trace, ``late:<collective>`` flags): the
ranks that reached a collective last, by their short wait in it (:mod:`.._arrival`), with
what their lateness cost the step.
"""

from __future__ import annotations

import warnings

import numpy as np

from stepwatch.detectors.analysis._arrival import collectives
from stepwatch.detectors.analysis._context import Context, held_wait_phase
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeGroup,
    EpisodeRule,
    Kind,
    Signature,
)
from stepwatch.detectors.analysis._split import COMMUNICATION as COMMUNICATION_EVIDENCE
from stepwatch.detectors.analysis._split import UNTIMED as UNTIMED_EVIDENCE
from stepwatch.detectors.analysis.rules import pipeline_bubble
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY, COMPUTE_PHASES

_HOST_SIDE = frozenset({"idle", *(f"phase:{phase}" for phase in COMPUTE_PHASES)})


def _straggler(context: Context, group: EpisodeGroup) -> Description:
    indices, first, last = group.indices, group.first, group.last
    phase = context.top_phase(indices, group.span, (*COMPUTE_PHASES, "other"))
    ratio = context.ratio(f"phase:{phase}", indices, first, last)
    wait_name = f"phase:{COMMUNICATION_CATEGORY}"
    held = held_wait_phase(context.frame)
    if wait_name in context.metrics.names:
        wait = context.ratio(wait_name, indices, first, last)
        wait_text = f"its collective wait {wait:.2f}x {context.peer_noun} (they wait for it)"
    elif held is not None and held != phase:
        # No communication phase: the wait is inside ``held``, where the rank is shortest.
        shrunk = _held_ratio(context, held, group)
        wait_text = (
            f"its {held} (which holds the collective) {shrunk:.2f}x {context.peer_noun} "
            "(they wait for it there)"
        )
    elif context.split.evidence == UNTIMED_EVIDENCE:
        wait_text = "its peers wait for it in time no phase covers (their waits are untimed)"
    else:
        wait_text = "its peers wait for it in the collective"
    kernels = context.kernel_words(group.indices, group.span)
    summary = (
        f"{context.who(indices)} {phase} {ratio:.2f}x {context.peer_noun} {kernels}; "
        f"{wait_text} since {context.since(first)}"
    )
    replica = _one_replica(context, indices)
    if replica is not None and context.split.evidence != COMMUNICATION_EVIDENCE:
        summary = (
            f"{context.rank_text(indices)} (dp {replica}, stages "
            f"{','.join(str(int(context.frame.pp_ranks[i])) for i in indices)}) {phase} "
            f"{ratio:.2f}x their stages {kernels} since {context.since(first)}: one of them "
            "is slow and the others wait for it inside their phases; without a "
            "communication phase the data cannot tell which"
        )
    return Description(RULE.kind, summary, ratio, phase, indices=indices)


def _one_replica(context: Context, indices: tuple[int, ...]) -> int | None:
    """The data-parallel replica of ``indices`` when they are stages of one replica."""
    groups = context.groups
    if len(indices) < 2 or not groups.replicas_known:
        return None
    replicas = {int(groups.dp_ranks[i]) for i in indices}
    stages = {int(groups.stages[i]) for i in indices}
    return replicas.pop() if len(replicas) == 1 and len(stages) == len(indices) else None


def _held_ratio(context: Context, held: str, group: EpisodeGroup) -> float:
    """The ranks' time in ``held`` over their peers' (median over the group's windows)."""
    values = context.frame.phase(held)
    if values is None:
        return 1.0
    block = np.where(context.present, values, np.nan)[group.span]
    mine = np.zeros(block.shape[1], dtype=bool)
    mine[list(group.indices)] = True
    with warnings.catch_warnings():  # windows where one side is silent stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        ratio = np.nanmedian(block[:, mine], axis=1) / np.nanmedian(block[:, ~mine], axis=1)
    usable = ratio[np.isfinite(ratio)]
    return float(np.median(usable)) if usable.size else 1.0


def _late(context: Context, group: EpisodeGroup) -> Description | None:
    """The ranks that reached a collective last in a single step, and what it cost."""
    found = [
        c
        for c in collectives(context.frame, context.step_median, min_ranks=context.config.min_ranks)
        if group.first <= c.window <= group.last and c.late[list(group.indices)].any()
    ]
    if not found:
        return None
    parts: list[str] = []
    saving = 0.0
    for item in found:
        late = [int(i) for i in np.flatnonzero(item.late)]
        first = np.flatnonzero(~item.late & np.isfinite(item.wait_s))
        longest = [int(i) for i in first[np.argsort(-item.wait_s[first])][:2]]
        parts.append(
            f"{context.rank_text(late)} reached {item.name} last (waited "
            f"{1e3 * float(np.nanmax(item.wait_s[late])):.2f} ms in it, its peers "
            f"{1e3 * item.peers_median_s:.2f} ms; {context.rank_text(longest)} waited "
            f"longest, up to {1e3 * float(np.nanmax(item.wait_s[longest])):.2f} ms)"
        )
        saving += item.saving_s()
    step = float(np.nanmedian(context.step_median[group.span]))
    slowdown = step / max(step - saving, 0.05 * step) if step > 0 else 1.0
    indices = tuple(sorted({int(i) for c in found for i in np.flatnonzero(c.late)}))
    summary = (
        "; ".join(parts) + f": the others waited for them, {1e3 * saving:.2f} ms of a "
        f"{1e3 * step:.2f} ms step, since {context.since(group.first)}"
    )
    kernel_class = found[0].name if len({c.name for c in found}) == 1 else None
    return Description(
        RULE.kind, summary, slowdown, None, kernel_class, indices=indices, slowdown=slowdown
    )


def _describe(context: Context, group: EpisodeGroup) -> Description:
    if any(name.startswith("late:") for name in context.flagged(group)):
        late = _late(context, group)
        if late is not None:
            return late
    stage = context.stage_group(group.indices)
    if stage is not None:  # whole pipeline stages: the stage is the bubble
        return pipeline_bubble.RULE.describe(context, group.with_indices(stage))
    return _straggler(context, group)


KIND = Kind(
    name="masked_straggler",
    shows=(
        "one rank's host-side compute slower while its kernels are normal; its peers wait for it"
    ),
    localised="the culprit, phase (never the waiters)",
    late_arrival=True,
    paced=True,
    own_work=True,
    role="waiter",
    narrows_replicas=True,
    narrows_neighbours=True,
    simulated=1,
)


RULE = EpisodeRule(
    declared=KIND,
    signatures=(
        Signature(
            50,
            lambda flagged: (
                not _HOST_SIDE.isdisjoint(flagged)
                or any(name.startswith("late:") for name in flagged)
            ),
            "`idle`, a compute phase or `late:*`",
        ),
        Signature(
            70, lambda flagged: any(name.startswith("phase:") for name in flagged), "any phase"
        ),
    ),
    describe=_describe,
)
