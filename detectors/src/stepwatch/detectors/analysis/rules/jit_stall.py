"""``jit_stall``: host-side stalls with the device idle on some steps of a rank.

Signature (precedence 20): burstiness (longest step or idle / mean) or a one-off
``stall:<phase>`` flagged, in at least half as many windows as any phase, kernel or clock.
Localisation: the ranks and the host-side phase that stalled
(the stalled phase when a one-off stall was seen, else the compute phase that grew most).
The masked form, ``stall:outside``: a rank that stopped *between* phases while its peers
waited in their collective; no phase (the time is in none), never the waiters.
"""

from __future__ import annotations

import numpy as np

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._crossrank import ARRIVAL, OUTSIDE
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeGroup,
    EpisodeRule,
    Flagged,
    Kind,
    Signature,
)
from stepwatch.detectors.frame._frame import COMPUTE_PHASES


def _describe(context: Context, group: EpisodeGroup) -> Description:
    indices, first, last = group.indices, group.first, group.last
    # Stalls strike some steps: the evidence is the burstiest window where it was flagged.
    ratio = max(context.stall_ratios(indices, first, last, prefix="burst:").values(), default=1.0)
    phase: str | None = context.top_phase(indices, group.span, COMPUTE_PHASES)
    stalls = context.stall_ratios(indices, first, last)
    who = f"{context.rank_text(indices)}{context.groups.where(indices)}"
    if OUTSIDE in stalls:  # the masked form: stopped between phases, the peers waited
        longest = float(np.nanmax(context.frame.step_max_s[group.span][:, list(indices)]))
        summary = (
            f"{who} stopped outside every phase (a GC pause, checkpoint write or compile "
            f"between phases): longest step {longest:.2f} s while its own phases stayed "
            f"normal; the other ranks waited for it in their collective, since "
            f"{context.since(first)}"
        )
        return Description(RULE.kind, summary, stalls[OUTSIDE], None, indices=indices)
    if stalls:  # a one-off stall localised to a host-side phase
        phase, stall_ratio = max(stalls.items(), key=lambda item: item[1])
        ratio = max(ratio, stall_ratio)
    elif ratio == 1.0 and _late_once(context.flagged_counts(group)):
        late = max(context.stall_ratios(indices, first, last, prefix=ARRIVAL).values())
        summary = (
            f"{who} reached the collective late in one window (its time before it "
            f"{late:.2f}x {context.groups.noun}) with its timed phases normal: a pause on "
            f"a step whose phases were not timed, since {context.since(first)}"
        )
        return Description(RULE.kind, summary, late, None, indices=indices)
    summary = (
        f"{who} host-side stalls with the device idle: longest step "
        f"{ratio:.2f}x {context.groups.noun} since {context.since(first)}"
    )
    return Description(RULE.kind, summary, ratio, phase, indices=indices)


_OUTSIDE = f"stall:{OUTSIDE}"


def _stopped(context: Context, group: EpisodeGroup) -> EpisodeGroup:
    """A masked stall kept to the ranks that stopped between phases themselves, over their
    own windows. Its waiters burst in the same windows (their longest step holds the wait,
    in their collective), and with each rank's windows ending at its own exports a waiter's
    long step can land in a window where its stage's replica shows none: a burst beside the
    stall, never blamed. A group that shows no stall between phases is kept whole."""
    if _OUTSIDE not in context.metrics.names:
        return group
    column = context.metrics.names.index(_OUTSIDE)
    hit = context.metrics.flags[group.first : group.last + 1, list(group.indices), column]
    stopped_at = np.flatnonzero(np.any(hit, axis=0))
    if stopped_at.size == 0:
        return group
    return group.narrowed([group.indices[int(k)] for k in stopped_at])


_STALL_METRICS = ("burst:", "stall:")


#: What a rank's work is slow in (a phase, its kernels, its clock); lateness itself (step,
#: arrival) is what every stall also shows.
_WORK_METRICS = ("phase:", "category:", "share:", "clock")


def _stalls_lead(flagged: Flagged) -> bool:
    """A burst or stall flagged, in at least half as many windows as any phase, kernel or
    clock metric. A rank whose forward is slow in every window (a straggler) and that also
    paused once is a straggler: with phases sampled, a hiccup inside an untimed phase reads
    as a stall between phases, and the demo's forward straggler was once named a 1.02x
    stall instead."""
    stalls = max((n for name, n in flagged.items() if name.startswith(_STALL_METRICS)), default=0)
    work = (n for name, n in flagged.items() if name.startswith(_WORK_METRICS))
    return stalls > 0 and 2 * stalls >= max(work, default=0)


#: Windows a rank may be late in (its time before the collective alone flagged) and still be
#: a one-off: a pause on a step whose phases were not timed (sampled phases), not a link.
LATE_ONCE_WINDOWS = 2


def _late_once(flagged: Flagged) -> bool:
    """Only the time before the collective flagged, in at most :data:`LATE_ONCE_WINDOWS`."""
    return flagged.keys() == {ARRIVAL} and flagged[ARRIVAL] <= LATE_ONCE_WINDOWS


KIND = Kind(
    name="jit_stall",
    shows=(
        "host-side stalls on some steps of a rank (JIT, GC, a checkpoint), inside a phase "
        "or between phases"
    ),
    localised="ranks, phase (none between phases)",
    late_arrival=True,
    role="culprit",
    narrows_replicas=True,
    simulated=4,
)


RULE = EpisodeRule(
    declared=KIND,
    signatures=(
        Signature(
            20,
            _stalls_lead,
            "`burst:*` or `stall:*`, in at least half as many windows as any phase, kernel or "
            "clock metric",
        ),
        Signature(55, _late_once, "only `arrival`, in 1 or 2 windows"),
    ),
    describe=_describe,
    narrow=_stopped,
)
