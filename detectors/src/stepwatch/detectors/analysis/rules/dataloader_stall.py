"""``dataloader_stall``: a rank's ``data`` phase slower than its peers' (precedence 30)."""

from __future__ import annotations

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import Description, EpisodeGroup, EpisodeRule, Signature


def _describe(context: Context, group: EpisodeGroup) -> Description:
    ratio = context.ratio("phase:data", group.indices, group.first, group.last)
    summary = (
        f"{context.who(group.indices)} data loading {ratio:.2f}x {context.peer_noun} "
        f"since {context.since(group.first)}"
    )
    return Description(RULE.kind, summary, ratio, "data", indices=group.indices)


RULE = EpisodeRule(
    kind="dataloader_stall",
    signatures=(Signature(30, lambda flagged: "phase:data" in flagged),),
    describe=_describe,
)
