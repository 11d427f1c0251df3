"""``link_degradation``: step completion or communication slower with normal compute.

Signature (precedence 60): step, communication phase or kernels, or ``arrival`` (time
outside the collective: the rank that reaches it late waits least in it) flagged, and no
compute or host-side phase. With step times alone, the episode is a ``slow_rank``.
Localisation: the hosts with at least half their ranks flagged, and all their ranks; the
communication kernel class when the job has only one.
"""

from __future__ import annotations

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._crossrank import ARRIVAL
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeGroup,
    EpisodeRule,
    Kind,
    Signature,
)
from stepwatch.detectors.analysis._split import STEPS
from stepwatch.detectors.analysis.rules import slow_rank
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY

_LINK = frozenset(
    {"step", ARRIVAL, f"phase:{COMMUNICATION_CATEGORY}", f"category:{COMMUNICATION_CATEGORY}"}
)


def _describe(context: Context, group: EpisodeGroup) -> Description:
    if context.split.evidence == STEPS:  # step times alone: "slower", never "link"
        return slow_rank.RULE.describe(context, group)
    indices, hosts = context.host_group(group.indices)
    # Arrival tells when the ranks are late to the collective (the step holds the wait for
    # peers, or the time outside the collective grew more than the step).
    first, last = group.first, group.last
    step = context.ratio("step", indices, first, last) if "step" in context.metrics.names else 0
    arrival = (
        context.ratio(ARRIVAL, indices, first, last) if ARRIVAL in context.metrics.names else 0
    )
    late = arrival > step
    ratio = max(arrival, step, 1.0)
    communication = context.communication_classes()
    what = "reaches the collective late: time outside it" if late else "collective completion"
    summary = (
        f"host {','.join(hosts)} ({context.rank_text(indices)}) {what} {ratio:.2f}x "
        f"{context.peer_noun} with normal compute since {context.since(first)}"
    )
    kernel_class = communication[0] if len(communication) == 1 else None
    return Description(
        RULE.kind,
        summary,
        ratio,
        phase=COMMUNICATION_CATEGORY,
        kernel_class=kernel_class,
        indices=tuple(indices),
        hosts=hosts,
    )


KIND = Kind(
    name="link_degradation",
    shows=(
        "ranks late into, or slow through, their collectives with normal compute; named by host"
    ),
    localised="hosts at least half flagged, their ranks",
    late_arrival=True,
    paced=True,
    role="waiter",
    narrows_replicas=True,
    simulated=2,
)


RULE = EpisodeRule(
    declared=KIND,
    signatures=(
        Signature(
            60,
            lambda flagged: not _LINK.isdisjoint(flagged),
            "`step`, `arrival`, `phase:communication` or `category:communication`",
        ),
    ),
    describe=_describe,
)
