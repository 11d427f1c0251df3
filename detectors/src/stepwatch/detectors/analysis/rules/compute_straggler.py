"""``compute_straggler``: a rank whose compute kernels are slower than its peers'.

Signature: the compute category or a compute class's share of compute time flagged
(precedence 40), and the catch-all for flags no other rule claims (90). Localisation: the
ranks, the compute phase they lose most time in, and the kernel class whose share of their
compute time grew (L3).
"""

from __future__ import annotations

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeGroup,
    EpisodeRule,
    Kind,
    Signature,
)
from stepwatch.detectors.frame._frame import COMPUTE_CATEGORY, COMPUTE_PHASES


def _describe(context: Context, group: EpisodeGroup) -> Description:
    indices, first, last = group.indices, group.first, group.last
    phase = context.top_phase(indices, group.span, COMPUTE_PHASES)
    kernel_class, kernel_ratio = context.top_share(indices, first, last)
    # The kernels' own time when the job reports it (a phase's wall time also holds waits).
    name = f"category:{COMPUTE_CATEGORY}"
    measure = name if name in context.metrics.names else f"phase:{phase}"
    ratio = context.ratio(measure, indices, first, last)
    detail = f" ({kernel_class} {kernel_ratio:.2f}x)" if kernel_class else ""
    summary = (
        f"{context.who(indices)} {phase} compute {ratio:.2f}x {context.peer_noun}{detail} "
        f"since {context.since(first)}"
    )
    return Description(RULE.kind, summary, ratio, phase, kernel_class, indices=indices)


KIND = Kind(
    name="compute_straggler",
    shows="one rank's compute kernels slower than its peers'",
    localised="ranks, phase, kernel class",
    late_arrival=True,
    paced=True,
    own_work=True,
    role="culprit",
    narrows_neighbours=True,
    simulated=0,
)


RULE = EpisodeRule(
    declared=KIND,
    signatures=(
        Signature(
            40,
            lambda flagged: (
                f"category:{COMPUTE_CATEGORY}" in flagged
                or any(name.startswith("share:") for name in flagged)
            ),
            "`category:compute` or a class's `share:*`",
        ),
        # nothing more specific: the kernels are slow
        Signature(90, lambda flagged: True, "anything else"),
    ),
    describe=_describe,
)
