"""``dataloader_stall``: a rank's ``data`` phase slower than its peers' (precedence 30)."""

from __future__ import annotations

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeGroup,
    EpisodeRule,
    Flagged,
    Kind,
    Signature,
)


def _describe(context: Context, group: EpisodeGroup) -> Description:
    ratio = context.ratio("phase:data", group.indices, group.first, group.last)
    summary = (
        f"{context.who(group.indices)} data loading {ratio:.2f}x {context.peer_noun} "
        f"since {context.since(group.first)}"
    )
    return Description(RULE.kind, summary, ratio, "data", indices=group.indices)


def _data_leads(flagged: Flagged) -> bool:
    """``data`` flagged, in at least as many windows as any other phase: a rank whose
    forward is slow in every window and whose data loading blipped once (descheduled
    on a busy host) is not a data-loading problem."""
    data = flagged.get("phase:data", 0)
    others = (
        n for name, n in flagged.items() if name.startswith("phase:") and name != "phase:data"
    )
    return data > 0 and data >= max(others, default=0)


KIND = Kind(
    name="dataloader_stall",
    shows="one rank's data phase slower than its peers'",
    localised="ranks, `data`",
    late_arrival=True,
    paced=True,
    role="culprit",
    simulated=5,
)


RULE = EpisodeRule(
    declared=KIND,
    signatures=(
        Signature(30, _data_leads, "`phase:data`, in at least as many windows as any other phase"),
    ),
    describe=_describe,
)
