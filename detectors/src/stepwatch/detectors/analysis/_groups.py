"""Peer groups: a rank is compared only with the ranks that do the same work.

Ranks of different pipeline stages run different layers: the first holds the embedding, the
last the loss head, a badly partitioned one more layers. Their times differ by design, so a
rank is tested against its own stage (same ``stepwatch.pp_rank`` across data-parallel
replicas). Without coordinates, groups are inferred from the data: ranks whose profile
differs from the others' consistently *and from the first windows on* are a structural
group, not outliers (:func:`infer_groups`).

A group's structural offset (its typical log-time above the job's, per metric, in the
frame's first windows) is taken out of every rank's log-times before the cross-rank tests
(:meth:`PeerGroups.centre`): a rank is then an outlier only against its group, and a whole
group that changes *later* (a pipeline bubble that grows) still stands out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from stepwatch.detectors.stats._stats import BoolArray, FloatArray, nanmedian

#: First windows that define the structure (each rank's first window, warm-up, left out).
BASELINE_WINDOWS = 10
#: Smallest structural difference between inferred groups (log): 5%.
MIN_GROUP_SHIFT = math.log(1.05)
#: A split must separate the groups in this share of the baseline windows ...
MIN_CONSISTENT_SHARE = 0.8
#: ... with at most this share of ranks on the wrong side in each of them.
MAX_MIXED_SHARE = 0.05
#: The gap between groups must exceed this many robust sds of the ranks within them.
MIN_GAP_SDS = 8.0


@dataclasses.dataclass(frozen=True, eq=False)
class PeerGroups:
    """Which ranks are peers, and the coordinates that name them.

    Attributes:
        labels: ``(R,)`` group index of each rank.
        names: name of each group (``stage 2``, ``group 1``); ``("all",)`` for one group.
        source: ``coordinates`` (``stepwatch.pp_rank``), ``inferred`` or ``none``.
        replicas: ``(R,)`` the data-parallel replica of each rank (``stepwatch.dp_rank``;
            each rank its own replica when unknown): a replica's ranks wait for each other.
        stages: ``(R,)`` pipeline stage, -1 when unknown.
        dp_ranks: ``(R,)`` data-parallel rank, -1 when unknown.
    """

    labels: npt.NDArray[np.intp]
    names: tuple[str, ...]
    source: str
    replicas: npt.NDArray[np.intp]
    stages: npt.NDArray[np.intp]
    dp_ranks: npt.NDArray[np.intp]

    @property
    def n_groups(self) -> int:
        return len(self.names)

    def members(self, group: int) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self.labels == group)

    @property
    def replicas_known(self) -> bool:
        """Every rank's data-parallel replica is known (``stepwatch.dp_rank``)."""
        return bool((self.dp_ranks >= 0).all())

    @property
    def noun(self) -> str:
        """What a rank is compared with: ``its stage``, ``its group`` or ``peers``."""
        return {"coordinates": "its stage", "inferred": "its group"}.get(self.source, "peers")

    def where(self, indices: Sequence[int]) -> str:
        """`` (stage 0, dp 0)`` for one rank, `` (stage 0)`` for ranks of one group, else ``""``."""
        if not len(indices) or self.source == "none":
            return ""
        groups = {int(self.labels[i]) for i in indices}
        if len(groups) != 1:
            return ""
        (group,) = groups
        parts = [self.names[group]]
        dps = {int(self.dp_ranks[i]) for i in indices}
        if len(dps) == 1 and -1 not in dps:
            parts.append(f"dp {dps.pop()}")
        return f" ({', '.join(parts)})"

    def offsets(self, baseline_logs: FloatArray) -> FloatArray:
        """``(G, M)`` each group's structural offset from ``(B, R, M)`` baseline log-times.

        The median over the baseline windows of the group's median minus the job's median
        (0 where unknown).
        """
        overall = nanmedian(baseline_logs, axis=1)
        result = np.zeros((self.n_groups, baseline_logs.shape[2]), dtype=baseline_logs.dtype)
        for group in range(self.n_groups):
            members = self.members(group)
            if members.size == 0 or baseline_logs.shape[0] == 0:
                continue
            inside = nanmedian(baseline_logs[:, members], axis=1) - overall
            offset = nanmedian(inside, axis=0)[0, 0]
            result[group] = np.where(np.isfinite(offset), offset, 0.0)
        return result

    def centre(self, logs: FloatArray, baseline: BoolArray) -> FloatArray:
        """``(W, R, M)`` log-times with each group's structural offset taken out."""
        if self.n_groups < 2 or not baseline.any():
            return logs
        offsets = self.offsets(logs[baseline])
        return logs - offsets[self.labels][None, :, :]


def baseline_windows(present: BoolArray) -> BoolArray:
    """``(W,)`` the first :data:`BASELINE_WINDOWS` windows in which most ranks report."""
    reporting = present.sum(axis=1) * 2 >= max(present.shape[1], 1)
    chosen = np.zeros(present.shape[0], dtype=bool)
    chosen[np.flatnonzero(reporting)[:BASELINE_WINDOWS]] = True
    return chosen


def coordinate_groups(pp_ranks: np.ndarray, dp_ranks: np.ndarray | None) -> PeerGroups | None:
    """Groups by pipeline stage when at least two stages are known, else ``None``."""
    n_ranks = pp_ranks.shape[0]
    dp = np.full(n_ranks, -1) if dp_ranks is None else np.asarray(dp_ranks)
    stages = sorted(set(pp_ranks.tolist()) - {-1})
    if len(stages) < 2:
        return None
    index = {stage: i for i, stage in enumerate(stages)}
    unknown = len(stages)
    labels = np.array([index.get(int(s), unknown) for s in pp_ranks], dtype=np.intp)
    names = [f"stage {s}" for s in stages]
    if (labels == unknown).any():
        names.append("stage unknown")
    return PeerGroups(
        labels=labels,
        names=tuple(names),
        source="coordinates",
        replicas=_replicas(dp),
        stages=np.asarray(pp_ranks, dtype=np.intp),
        dp_ranks=np.asarray(dp, dtype=np.intp),
    )


def _replicas(dp: np.ndarray) -> npt.NDArray[np.intp]:
    """Replica of each rank: its dp rank when every rank has one, else the rank itself."""
    if (dp >= 0).all():
        return np.asarray(dp, dtype=np.intp)
    return np.arange(dp.shape[0], dtype=np.intp)


def single_group(n_ranks: int, dp_ranks: np.ndarray | None) -> PeerGroups:
    dp = np.full(n_ranks, -1) if dp_ranks is None else np.asarray(dp_ranks)
    return PeerGroups(
        labels=np.zeros(n_ranks, dtype=np.intp),
        names=("all",),
        source="none",
        replicas=_replicas(dp),
        stages=np.full(n_ranks, -1, dtype=np.intp),
        dp_ranks=np.asarray(dp, dtype=np.intp),
    )


def infer_groups(
    logs: FloatArray, baseline: BoolArray, *, dp_ranks: np.ndarray | None = None
) -> PeerGroups:
    """Structural groups from ``(W, R, M)`` log profiles (phases, compute kernels).

    Divisive: a group of at least 4 ranks splits at the widest gap of one metric's
    per-rank baseline medians when the gap is at least :data:`MIN_GROUP_SHIFT` and
    :data:`MIN_GAP_SDS` robust sds of the ranks on either side, both sides keep at least
    two ranks (a structure repeats on every replica; a lone rank that differs is an
    outlier, even from the first step), and the split holds window by window in the
    baseline (:data:`MIN_CONSISTENT_SHARE` of the windows, :data:`MAX_MIXED_SHARE` of the
    ranks at most on the wrong side).

    Notes:
        A fault present from the frame's first windows on two or more ranks cannot be told
        from structure without coordinates: report ``stepwatch.pp_rank`` to avoid it.
    """
    n_ranks = logs.shape[1]
    rows = np.flatnonzero(baseline)
    if rows.size < 3 or n_ranks < 4:
        return single_group(n_ranks, dp_ranks)
    window = logs[rows]
    medians = nanmedian(window, axis=0)[0]  # (R, M)
    pending = [np.arange(n_ranks)]
    groups: list[np.ndarray] = []
    while pending:
        members = pending.pop()
        split = _best_split(window[:, members], medians[members]) if members.size >= 4 else None
        if split is None or len(groups) + len(pending) >= 15:
            groups.append(members)
            continue
        upper = members[split]
        lower = members[~split]
        pending.extend([lower, upper])
    if len(groups) < 2:
        return single_group(n_ranks, dp_ranks)
    # Name groups by their smallest rank index so names follow the ranks.
    groups.sort(key=lambda members: int(members.min()))
    labels = np.zeros(n_ranks, dtype=np.intp)
    for index, members in enumerate(groups):
        labels[members] = index
    base = single_group(n_ranks, dp_ranks)
    return dataclasses.replace(
        base,
        labels=labels,
        names=tuple(f"group {i}" for i in range(len(groups))),
        source="inferred",
    )


def _best_split(window: FloatArray, medians: FloatArray) -> BoolArray | None:
    """The members above the widest consistent gap of any metric, or ``None``."""
    best: tuple[float, BoolArray] | None = None
    n = medians.shape[0]
    for metric in range(medians.shape[1]):
        values = medians[:, metric]
        if not np.isfinite(values).all():
            continue
        order = np.argsort(values)
        ordered = values[order]
        gaps = np.diff(ordered)
        gaps[:1] = -np.inf  # at least two ranks on each side
        gaps[n - 2 :] = -np.inf
        cut = int(np.argmax(gaps))
        gap = float(gaps[cut])
        if not gap >= MIN_GROUP_SHIFT:
            continue
        lower, upper = ordered[: cut + 1], ordered[cut + 1 :]
        spread = max(_robust_sd(lower), _robust_sd(upper), 1e-3)
        if gap < MIN_GAP_SDS * spread:
            continue
        above = np.zeros(n, dtype=bool)
        above[order[cut + 1 :]] = True
        if not _consistent(window[:, :, metric], above, (ordered[cut] + ordered[cut + 1]) / 2):
            continue
        if best is None or gap > best[0]:
            best = (gap, above)
    return None if best is None else best[1]


def _robust_sd(values: FloatArray) -> float:
    if values.size < 2:
        return 0.0
    return float(1.4826 * np.median(np.abs(values - np.median(values))))


def _consistent(values: FloatArray, above: BoolArray, threshold: float) -> bool:
    """The split holds in most baseline windows (few ranks on the wrong side)."""
    with np.errstate(invalid="ignore"):
        wrong = np.where(above, values < threshold, values > threshold)
    reported = np.isfinite(values)
    counts = reported.sum(axis=1)
    usable = counts >= 4
    if not usable.any():
        return False
    mixed = wrong.sum(axis=1) / np.maximum(counts, 1)
    return float(np.mean(mixed[usable] <= MAX_MIXED_SHARE)) >= MIN_CONSISTENT_SHARE
