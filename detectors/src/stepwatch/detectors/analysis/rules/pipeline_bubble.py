"""``pipeline_bubble``: whole pipeline stages whose devices sit idle longer than their peers.

No signature of its own: a ``masked_straggler`` episode that fills whole stages
(``stepwatch.pp_rank``) is described here, blaming every rank of those stages.
"""

from __future__ import annotations

import numpy as np

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import Description, EpisodeGroup, EpisodeRule, Kind
from stepwatch.detectors.frame._frame import COMPUTE_PHASES


def _describe(context: Context, group: EpisodeGroup) -> Description:
    indices = group.indices
    stages = sorted({int(context.frame.pp_ranks[i]) for i in indices})
    # Device idle where the job reports it, else the phase the stage lost most time in.
    what, name = "device idle", "idle"
    if not np.isfinite(context.frame.idle_s[group.span][:, list(indices)]).any():
        phase = context.top_phase(indices, group.span, COMPUTE_PHASES)
        what, name = phase, f"phase:{phase}"
    ratio = context.ratio(name, indices, group.first, group.last)
    summary = (
        f"pipeline stage {','.join(str(s) for s in stages)} ({context.rank_text(indices)}) "
        f"{what} {ratio:.2f}x peers since {context.since(group.first)}"
    )
    return Description(RULE.kind, summary, ratio, indices=indices)


KIND = Kind(
    name="pipeline_bubble",
    shows="whole pipeline stages idle or slow against their peers",
    localised="the stages' ranks",
    late_arrival=True,
    paced=True,
    role="waiter",
    simulated=3,
)


RULE = EpisodeRule(declared=KIND, signatures=(), describe=_describe)
