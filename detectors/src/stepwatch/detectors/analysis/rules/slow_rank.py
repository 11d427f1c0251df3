"""``slow_rank``: a rank whose steps are slower than its peers', from step times alone.

No signature of its own: when a producer sends step times and nothing else (no phases, no
kernels), the episodes other rules would name from the step (``link_degradation``'s
"completion", a straggler) are described here. Such data cannot tell compute from
communication or partitioning, so the finding claims none of them: the ranks, their step
against their peers', and what that costs the job (at most that ratio: a job paced by a
rank r times slower than its peers loses at most r).
"""

from __future__ import annotations

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import Description, EpisodeGroup, EpisodeRule, Kind


def _describe(context: Context, group: EpisodeGroup) -> Description:
    indices = group.indices
    ratio = context.ratio("step", indices, group.first, group.last)
    summary = (
        f"{context.who(indices)} steps {ratio:.2f}x {context.peer_noun} since "
        f"{context.since(group.first)}; the data holds step times alone: whether compute, "
        "communication or partitioning is slow cannot be told"
    )
    return Description(RULE.kind, summary, ratio, indices=indices)


KIND = Kind(
    name="slow_rank",
    shows=(
        "a rank slower than its peers in data that holds step times alone: what it was "
        "slow in is not in the data"
    ),
    localised="ranks",
    late_arrival=True,
    paced=True,
    role="culprit",
)


RULE = EpisodeRule(declared=KIND, signatures=(), describe=_describe)
