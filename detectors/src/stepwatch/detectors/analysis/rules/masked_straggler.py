"""``masked_straggler``: a rank whose host-side compute is slow while its kernels are normal.

Its peers wait for it in the collective, so their communication time grows and its own
shrinks: the blame goes to the rank whose compute-phase wall time or device idle grew
(precedence 50), never to the waiters. Any other phase flagged alone is one too (70). On
whole pipeline stages the same signature is a ``pipeline_bubble``.
"""

from __future__ import annotations

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import Description, EpisodeGroup, EpisodeRule, Signature
from stepwatch.detectors.analysis.rules import pipeline_bubble
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY, COMPUTE_PHASES

_HOST_SIDE = frozenset({"idle", *(f"phase:{phase}" for phase in COMPUTE_PHASES)})


def _straggler(context: Context, group: EpisodeGroup) -> Description:
    indices, first, last = group.indices, group.first, group.last
    phase = context.top_phase(indices, group.span, (*COMPUTE_PHASES, "other"))
    ratio = context.ratio(f"phase:{phase}", indices, first, last)
    wait_name = f"phase:{COMMUNICATION_CATEGORY}"
    wait = context.ratio(wait_name, indices, first, last)
    wait_text = (
        f"its collective wait {wait:.2f}x peers (peers wait for it)"
        if wait_name in context.metrics.names
        else "its peers wait for it in the collective"
    )
    summary = (
        f"{context.rank_text(indices)} {phase} {ratio:.2f}x peers with normal kernels; "
        f"{wait_text} since {context.since(first)}"
    )
    return Description(RULE.kind, summary, ratio, phase, indices=indices)


def _describe(context: Context, group: EpisodeGroup) -> Description:
    stage = context.stage_group(group.indices)
    if stage is not None:  # whole pipeline stages: the stage is the bubble
        return pipeline_bubble.RULE.describe(context, group.with_indices(stage))
    return _straggler(context, group)


RULE = EpisodeRule(
    kind="masked_straggler",
    signatures=(
        Signature(50, lambda flagged: not _HOST_SIDE.isdisjoint(flagged)),
        Signature(70, lambda flagged: any(name.startswith("phase:") for name in flagged)),
    ),
    describe=_describe,
)
