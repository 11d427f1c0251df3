"""``gpu_health``: a rank's SM clock below its peers' (throttling), precedence 10."""

from __future__ import annotations

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeGroup,
    EpisodeRule,
    Kind,
    Signature,
)
from stepwatch.detectors.frame._frame import COMPUTE_CATEGORY


def _describe(context: Context, group: EpisodeGroup) -> Description:
    indices, first, last = group.indices, group.first, group.last
    # The clock metric is the clock period: its ratio above 1 is a clock below the peers'.
    ratio = context.ratio("clock", indices, first, last)
    compute = context.ratio(f"category:{COMPUTE_CATEGORY}", indices, first, last)
    summary = (
        f"{context.who(indices)} SM clock {1 / ratio:.2f}x {context.peer_noun} (throttled), "
        f"compute kernels {compute:.2f}x since {context.since(first)}"
    )
    return Description(RULE.kind, summary, ratio, indices=indices)


KIND = Kind(
    name="gpu_health",
    shows="one rank's SM clock below its peers' (throttling)",
    localised="ranks",
    late_arrival=True,
    paced=True,
    own_work=True,
    role="culprit",
    simulated=7,
)


RULE = EpisodeRule(
    declared=KIND,
    signatures=(Signature(10, lambda flagged: "clock" in flagged, "`clock`"),),
    describe=_describe,
)
