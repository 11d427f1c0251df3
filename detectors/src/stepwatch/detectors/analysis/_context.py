"""What the rules read: a frame, its derived arrays and the cross-rank flags, with helpers.

:class:`Basis` is everything derived from the frame alone (the cross-rank tests read it);
:class:`Context` adds the tests' :class:`Metrics` and the helpers rules describe a finding
with (mean effect of a metric, the phase or kernel class that moved, host and stage groups).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

import numpy as np
import numpy.typing as npt

from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._groups import (
    PeerGroups,
    baseline_windows,
    coordinate_groups,
    infer_groups,
)
from stepwatch.detectors.analysis._split import Split, split
from stepwatch.detectors.frame._frame import (
    COMMUNICATION_CATEGORY,
    COMPUTE_CATEGORY,
    WAIT_HOLDING_PHASE,
    JobFrame,
)
from stepwatch.detectors.stats._stats import BoolArray, FloatArray, nanmedian, safe_log

#: Compute kernels this much slower than the peers' are never called normal, flagged or not.
SLOW_KERNELS = 1.2
#: Share of a pipeline stage's ranks a finding must hold to be about the whole stage.
STAGE_FILLED = 0.9


@dataclasses.dataclass(frozen=True, eq=False)
class Basis:
    """A frame with the arrays every cross-rank test and rule derives from it.

    Attributes:
        frame: the job's windows.
        config: the thresholds.
        present: ``(W, R)`` the rank finished a step in the window.
        compute_s: ``(W, R)`` compute-kernel time per step.
        reference: the ranks that estimate the cross-rank centre and scale (``None``: all).
        dtype: float dtype of the log-times (float32 for very large jobs).
        major_classes: compute kernel classes (indices) tested one by one.
        minor_classes: the long tail of compute classes, tested pooled.
        step_median: ``(W,)`` median step time of the ranks reporting.
        overlap_waiting: series that hold the wait for peers (:func:`_overlap_waiting`).
        baseline: ``(W,)`` the first windows, which define the job's structure.
        groups: the peer groups (pipeline stages, or groups inferred from the baseline).
        split: each rank's step split into its own work and its waiting (:mod:`._split`).
    """

    frame: JobFrame
    config: DetectorConfig
    present: BoolArray
    compute_s: FloatArray
    reference: npt.NDArray[np.intp] | None
    dtype: type
    major_classes: list[int]
    minor_classes: list[int]
    step_median: FloatArray
    overlap_waiting: frozenset[str]
    baseline: BoolArray
    groups: PeerGroups
    split: Split

    @classmethod
    def of(cls, frame: JobFrame, config: DetectorConfig) -> Basis:
        """Derive the arrays from ``frame`` (one pass each)."""
        present = frame.present
        compute_s = frame.category_s(COMPUTE_CATEGORY)
        # Large jobs: centre and scale from ~reference_ranks ranks picked by a hash of the
        # rank id (deterministic, and it follows the ranks if they are reordered).
        reference: npt.NDArray[np.intp] | None = None
        dtype: type = np.float64
        if frame.n_ranks > 2 * config.reference_ranks:
            dtype = np.float32  # half the memory traffic; log-times need no more
            hashed = (frame.ranks.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)
            cut = np.uint64(2**32 * config.reference_ranks // frame.n_ranks)
            reference = np.flatnonzero(hashed < cut)
        # Compute classes holding >= major_share of compute time are tested one by one;
        # the long tail is pooled (and named by L3 when the pool moves).
        compute_total = float(np.nansum(compute_s))
        class_totals = np.nansum(frame.kernel_s, axis=(0, 1))
        major_classes: list[int] = []
        minor_classes: list[int] = []
        for index, category in enumerate(frame.kernel_categories):
            if category != COMPUTE_CATEGORY:
                continue
            share = float(class_totals[index]) / max(compute_total, 1e-300)
            target = major_classes if share >= config.major_share else minor_classes
            target.append(index)
        with np.errstate(invalid="ignore"):
            step_median = nanmedian(np.where(present, frame.step_s, np.nan), axis=1)[:, 0]
        overlap_waiting = _overlap_waiting(frame, present)
        # Each rank's first window holds its warm-up steps: not the structure.
        settled = present & (np.cumsum(present, axis=0) > 1)
        baseline = baseline_windows(settled)
        groups = coordinate_groups(frame.pp_ranks, frame.dp_ranks)
        if groups is None:
            profile = _profile(frame, compute_s, overlap_waiting, settled)
            groups = infer_groups(profile, baseline, dp_ranks=frame.dp_ranks)
        nested = f"phase:{COMMUNICATION_CATEGORY}" in overlap_waiting
        parts = split(
            frame,
            present=present,
            nested=nested,
            held=held_wait_phase(frame),
            groups=groups,
            baseline=baseline,
        )
        return cls(
            frame=frame,
            config=config,
            present=present,
            compute_s=compute_s,
            reference=reference,
            dtype=dtype,
            major_classes=major_classes,
            minor_classes=minor_classes,
            step_median=step_median,
            overlap_waiting=overlap_waiting,
            baseline=baseline,
            groups=groups,
            split=parts,
        )

    @property
    def job_step_s(self) -> float:
        """The job's median step time over all windows (0 when no rank reported)."""
        if not np.isfinite(self.step_median).any():
            return 0.0
        return float(np.nanmedian(self.step_median))

    def peers(self, values: FloatArray) -> FloatArray:
        """The reference ranks' columns of ``(W, R)`` values (all ranks for ordinary jobs)."""
        return values if self.reference is None else values[:, self.reference]


def _profile(
    frame: JobFrame, compute_s: FloatArray, waiting: frozenset[str], settled: BoolArray
) -> FloatArray:
    """``(W, R, M)`` log-times that show what work a rank does: its phases that cannot
    hold waiting for peers, and its compute kernels (NaN outside ``settled``)."""
    columns = [
        frame.phase_s[:, :, index]
        for index, phase in enumerate(frame.phases)
        if phase != COMMUNICATION_CATEGORY and f"phase:{phase}" not in waiting
    ]
    if np.isfinite(compute_s).any():
        columns.append(compute_s)
    if not columns:
        columns.append(frame.step_s)
    stacked = np.stack(columns, axis=2)
    return safe_log(np.where(settled[:, :, None], stacked, np.nan))


#: Time in no phase, as a share of the step, from which a pipeline without a communication
#: phase is taken to wait outside its phases rather than inside ``backward``.
UNTIMED_WAIT_SHARE = 0.1


def held_wait_phase(frame: JobFrame) -> str | None:
    """The phase that holds the collective wait when the job records no communication
    phase (:data:`WAIT_HOLDING_PHASE`, when the job records it), else ``None``.

    ``None`` too for a pipeline (several ``stepwatch.pp_rank`` stages) whose typical step
    spends :data:`UNTIMED_WAIT_SHARE` or more of its time in no phase: its point-to-point
    waits are untimed (Megatron-style op timers without the send/recv timers: a stage idles
    for its neighbours between its ops), and ``backward`` is the rank's own work. A loop
    whose ``backward`` holds the collective (the README's, DDP or FSDP) leaves only its own
    Python between phases; a data-parallel job keeps ``backward`` as the holder whatever
    else it leaves untimed."""
    if COMMUNICATION_CATEGORY in frame.phases or WAIT_HOLDING_PHASE not in frame.phases:
        return None
    if len(set(frame.pp_ranks.tolist()) - {-1}) < 2:
        return WAIT_HOLDING_PHASE
    step = frame.phase_step
    with np.errstate(invalid="ignore", divide="ignore"):
        share = (step - np.nansum(frame.phase_s, axis=2)) / step
    share = share[np.isfinite(share) & (step > 0)]
    if share.size and float(np.median(share)) >= UNTIMED_WAIT_SHARE:
        return None
    return WAIT_HOLDING_PHASE


def _overlap_waiting(frame: JobFrame, present: BoolArray) -> frozenset[str]:
    """Series that hold the wait for peers when the phases overlap the communication.

    The phases overlap when their sum exceeds the step by more than 10% (DDP runs its
    allreduce inside ``loss.backward()``; on CPU/gloo the backward phase holds the
    whole wait). Then the step, the communication phase and every phase at least as
    long as the communication (only such a phase can hold it) measure waiting for the
    slowest rank as much as the rank's own work: the ranks that wait are the long
    ones there, so they are neither cross-rank evidence nor job-level evidence.

    Without a communication phase the wait is inside :func:`held_wait_phase` (the
    producer times ``loss.backward()`` and the all-reduce with it): that phase holds
    it. The step does not: every rank leaves the collective together, so a rank whose
    step is longer than its peers' lost the time in or after the collective.
    """
    held = held_wait_phase(frame)
    if held is not None:
        return frozenset({f"phase:{held}"})
    communication = frame.phase(COMMUNICATION_CATEGORY)
    if communication is None or not present.any():
        return frozenset()
    with np.errstate(invalid="ignore"):
        phase_sum = float(np.nanmedian(np.nansum(frame.phase_s, axis=2)[present]))
        step = float(np.nanmedian(frame.phase_step[present]))
        overlap = float(np.nanmedian(communication[present]))
    if not (math.isfinite(step) and phase_sum > 1.1 * step and math.isfinite(overlap)):
        return frozenset()
    waiting = {"step", f"phase:{COMMUNICATION_CATEGORY}"}
    for phase in frame.phases:
        values = frame.phase(phase)
        if phase == COMMUNICATION_CATEGORY or values is None:
            continue
        if float(np.nanmedian(values[present])) >= overlap:
            waiting.add(f"phase:{phase}")
    return frozenset(waiting)


class EpisodeGroupLike(Protocol):
    """Ranks and windows (an :class:`~._rule.EpisodeGroup`)."""

    @property
    def indices(self) -> tuple[int, ...]: ...

    @property
    def first(self) -> int: ...

    @property
    def last(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Metrics:
    """The cross-rank tests' verdicts, stacked ``(W, R, M)``.

    Attributes:
        names: metric names, the last axis (``step``, ``phase:data``, ``share:gemm``, ...).
        flags: flagged at some scale, persistent (or a one-off ``stall:`` in one window).
        effect: single-window log effect against the peers.
        z: largest robust z over the scales where flagged (0 elsewhere).
    """

    names: tuple[str, ...]
    flags: BoolArray
    effect: FloatArray
    z: FloatArray


@dataclasses.dataclass(frozen=True, eq=False)
class Context(Basis):
    """A :class:`Basis` with the cross-rank :class:`Metrics`: what every rule reads.

    Rank arguments are rank *indices* (columns of the frame), windows are window indices;
    ``first``/``last`` bound a finding inclusively.
    """

    metrics: Metrics

    @classmethod
    def with_metrics(cls, basis: Basis, metrics: Metrics) -> Context:
        """``basis`` with the flags of its cross-rank tests."""
        fields = {field.name: getattr(basis, field.name) for field in dataclasses.fields(basis)}
        return cls(**fields, metrics=metrics)

    # ---- text ----------------------------------------------------------------------------
    def rank_ids(self, indices: Sequence[int]) -> list[int]:
        """Global rank ids of rank indices."""
        return [int(self.frame.ranks[i]) for i in indices]

    def rank_text(self, indices: Sequence[int]) -> str:
        """``rank 5`` or ``ranks 0-3,8``: the summaries' name for the ranks."""
        return _format_ranks(self.rank_ids(indices))

    def who(self, indices: Sequence[int]) -> str:
        """``rank 0 (stage 0, dp 0)``: the ranks and, when they share one, their group."""
        return f"{self.rank_text(indices)}{self.groups.where(indices)}"

    @property
    def peer_noun(self) -> str:
        """What a rank is compared with: ``its stage``, ``its group`` or ``peers``."""
        return self.groups.noun

    def since(self, window: int) -> str:
        """Start of ``window`` as UTC ``HH:MM:SS`` (the summaries' "since")."""
        unix_nano = self.frame.window_start_unix_nano(window)
        return datetime.fromtimestamp(unix_nano / 1e9, tz=UTC).strftime("%H:%M:%S")

    # ---- effects -------------------------------------------------------------------------
    def mean_effect(self, name: str, indices: Sequence[int], first: int, last: int) -> float:
        """Median single-window log effect of metric ``name`` (0 when not tested or NaN)."""
        metrics = self.metrics
        if name not in metrics.names:
            return 0.0
        m = metrics.names.index(name)
        block = metrics.effect[first : last + 1, indices, m]
        if not np.isfinite(block).any():
            return 0.0
        return float(np.nanmedian(block))

    def ratio(self, name: str, indices: Sequence[int], first: int, last: int) -> float:
        """:meth:`mean_effect` as a ratio to the peers."""
        return math.exp(self.mean_effect(name, indices, first, last))

    def excess_s(self, name: str, values: FloatArray, indices: Sequence[int], span: slice) -> float:
        """Seconds per step the ranks spend above their peers in ``values`` over ``span``."""
        effect = self.mean_effect(name, indices, span.start, span.stop - 1)
        peer = nanmedian(self.peers(values[span]), axis=1)
        base = float(np.nanmedian(peer)) if np.isfinite(peer).any() else 0.0
        return base * math.expm1(effect)

    def top_phase(self, indices: Sequence[int], span: slice, phases: Sequence[str]) -> str:
        """The phase in which the ranks spend the most seconds above their peers."""
        best, best_excess = phases[0], -math.inf
        for phase in phases:
            values = self.frame.phase(phase)
            if values is None:
                continue
            excess = self.excess_s(f"phase:{phase}", values, indices, span)
            if excess > best_excess:
                best, best_excess = phase, excess
        return best

    def top_share(self, indices: Sequence[int], first: int, last: int) -> tuple[str | None, float]:
        """L3: the compute class whose share of the ranks' compute time grew most vs peers.

        Returns the class and its kernel-time ratio to peers (``None`` when no class grew).
        """
        frame = self.frame
        classes = [*self.major_classes, *self.minor_classes]
        if not classes or not indices:
            return None, 1.0
        span = slice(first, last + 1)
        peers = np.arange(frame.n_ranks) if self.reference is None else self.reference
        mine = np.asarray(indices)

        def log_times(columns: np.ndarray, *, share: bool) -> FloatArray:
            kernel = np.asarray(frame.kernel_s[span][:, columns][:, :, classes])
            if share:  # silent ranks are NaN already
                with np.errstate(invalid="ignore", divide="ignore"):
                    kernel = kernel / self.compute_s[span][:, columns][:, :, None]
            return safe_log(kernel)

        peer_share = nanmedian(log_times(peers, share=True), axis=1)
        per_rank = nanmedian(log_times(mine, share=True) - peer_share, axis=0)[0]
        effect = nanmedian(per_rank, axis=0)[0]
        effect = np.where(np.isfinite(effect), effect, -np.inf)
        best = int(np.argmax(effect))
        if not effect[best] > 0:
            return None, 1.0
        peer_time = nanmedian(log_times(peers, share=False)[:, :, best], axis=1)
        own_time = log_times(mine, share=False)[:, :, best]
        ratio = math.exp(float(np.nanmedian(own_time - peer_time)))
        return frame.kernel_classes[classes[best]], ratio

    def kernel_words(self, indices: Sequence[int], span: slice) -> str:
        """What the ranks' kernels say over ``span``: normal, not recorded, or slow in too
        few windows for the cross-rank tests to flag.

        A sampling kernel source (the op histograms' duty cycle) records one window in
        several: a finding may hold none of them, or too few to flag anything. Its kernels
        are then not known to be normal, and the summary says what was seen.
        """
        frame = self.frame
        if not frame.kernel_classes:
            return "(no kernel times)"
        seen = int(np.isfinite(frame.kernel_s[span][:, list(indices)]).any(axis=(1, 2)).sum())
        if seen == 0:
            return "(its kernels were not recorded in these windows)"
        ratio = self.ratio(f"category:{COMPUTE_CATEGORY}", indices, span.start, span.stop - 1)
        if ratio >= SLOW_KERNELS:
            windows = "window" if seen == 1 else "windows"
            return (
                f"(its compute kernels {ratio:.2f}x {self.peer_noun} in the {seen} {windows} "
                "that recorded them: too few to confirm)"
            )
        return "with normal kernels"

    def work_s(self) -> FloatArray:
        """``(W, R)`` each rank's own work per step: its compute and memory kernel time,
        else its phases that hold no waiting for peers (NaN where silent)."""
        frame = self.frame
        kernels = [i for i, c in enumerate(frame.kernel_categories) if c in ("compute", "memory")]
        if kernels:
            work = frame.kernel_s[:, :, kernels].sum(axis=2)
        else:
            own = [
                i
                for i, p in enumerate(frame.phases)
                if p != COMMUNICATION_CATEGORY and f"phase:{p}" not in self.overlap_waiting
            ]
            work = frame.phase_s[:, :, own].sum(axis=2) if own else frame.step_s
        with np.errstate(invalid="ignore"):
            return np.where(self.present & (work > 0), work, np.nan)

    def top_class_between(
        self, mine: Sequence[int], others: Sequence[int] | np.ndarray
    ) -> tuple[str | None, float]:
        """The compute kernel class in which ``mine`` spend the most seconds above
        ``others`` (medians over the frame), and its ratio (``None``: none above)."""
        frame = self.frame
        classes = [*self.major_classes, *self.minor_classes]
        if not classes or not len(mine) or not len(others):
            return None, 1.0
        kernel = frame.kernel_s[:, :, classes]
        own = nanmedian(nanmedian(kernel[:, list(mine)], axis=1)[:, 0], axis=0)[0]
        theirs = nanmedian(nanmedian(kernel[:, list(others)], axis=1)[:, 0], axis=0)[0]
        with np.errstate(invalid="ignore"):
            excess = np.where(np.isfinite(own - theirs), own - theirs, -np.inf)
        best = int(np.argmax(excess))
        if not excess[best] > 0 or not theirs[best] > 0:
            return None, 1.0
        return frame.kernel_classes[classes[best]], float(own[best] / theirs[best])

    def stall_ratios(
        self, indices: Sequence[int], first: int, last: int, *, prefix: str = "stall:"
    ) -> dict[str, float]:
        """Flagged ``stall:`` phases → longest occurrence / peers' longest (largest in span);
        with ``prefix="burst:"``, the burstiness metrics' largest flagged ratio."""
        metrics = self.metrics
        ratios: dict[str, float] = {}
        for m, name in enumerate(metrics.names):
            if not name.startswith(prefix):
                continue
            hit = metrics.flags[first : last + 1, indices, m]
            if hit.any():
                ratios[name.split(":", 1)[-1]] = math.exp(
                    float(np.nanmax(metrics.effect[first : last + 1, indices, m][hit]))
                )
        return ratios

    def flagged(self, group: EpisodeGroupLike) -> set[str]:
        """The metrics flagged on the group's ranks in its windows."""
        return set(self.flagged_counts(group))

    def flagged_counts(self, group: EpisodeGroupLike) -> dict[str, int]:
        """The metrics flagged on the group's ranks, and in how many of its windows."""
        block = self.metrics.flags[group.first : group.last + 1][:, list(group.indices), :]
        counts = block.any(axis=1).sum(axis=0)
        return {self.metrics.names[m]: int(counts[m]) for m in np.flatnonzero(counts)}

    def score(self, indices: Sequence[int], first: int, last: int) -> float:
        """Strongest robust z of the ranks' flags over the windows, capped at 99."""
        z = float(np.max(self.metrics.z[first : last + 1][:, indices, :]) if indices else 0.0)
        return min(z if math.isfinite(z) else 0.0, 99.0)

    # ---- groups --------------------------------------------------------------------------
    def host_group(self, indices: Sequence[int]) -> tuple[list[int], tuple[str, ...]]:
        """Every rank of the hosts at least half flagged, and those hosts.

        Falls back to the ranks themselves (and their hosts) when no host qualifies.
        """
        hosts = self.frame.hosts
        flagged: dict[str, int] = {}
        for i in indices:
            flagged[hosts[i]] = flagged.get(hosts[i], 0) + 1
        size = {host: hosts.count(host) for host in flagged}
        chosen = sorted(h for h, n in flagged.items() if h and n * 2 >= size[h])
        if not chosen:
            return list(indices), tuple(sorted({hosts[i] for i in indices if hosts[i]}))
        group = [i for i, host in enumerate(hosts) if host in chosen]
        return group, tuple(chosen)

    def stage_group(self, indices: Sequence[int]) -> list[int] | None:
        """Every rank of the pipeline stages the ranks fill, else ``None``.

        The ranks fill a stage when they hold all of its ranks but a tenth (a stage of a
        few replicas: all of them). One slow worker is never a whole stage. ``None`` also
        without two known stages, or when a rank's stage is unknown.
        """
        pp = self.frame.pp_ranks
        if len(set(pp.tolist()) - {-1}) < 2:
            return None
        stages = {int(pp[i]) for i in indices}
        if -1 in stages:
            return None
        members = [i for i in range(pp.size) if int(pp[i]) in stages]
        if len(members) < 2 * len(stages) or len(indices) < STAGE_FILLED * len(members):
            return None
        return members

    def communication_classes(self) -> list[str]:
        """The frame's kernel classes in the communication category."""
        frame = self.frame
        return [
            name
            for name, category in zip(frame.kernel_classes, frame.kernel_categories, strict=True)
            if category == COMMUNICATION_CATEGORY
        ]


def _format_ranks(ranks: Sequence[int]) -> str:
    """``rank 5`` or ``ranks 0-3,8`` (ranges joined, cut at 60 characters)."""
    if not ranks:
        return ""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = previous = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    noun = "rank" if len(ordered) == 1 else "ranks"
    text = ",".join(parts)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{noun} {text}"
