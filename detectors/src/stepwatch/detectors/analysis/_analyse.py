"""Progressive diagnosis of one job's :class:`JobFrame`: L1 job level, L2 ranks, L3 kernels.

* L1 — the job's median step, phase, category and kernel-class times per window → change
  points (:func:`change_points`). An upward shift no rank-level finding explains is a
  ``job_regression``.
* L2 — every rank against its peers, per metric (step, phases, kernel categories, device
  idle, burstiness, SM clock) at several time scales (:func:`cross_rank_outliers`), BH FDR
  across ranks, a minimum effect in seconds and persistence across windows.
* L3 — the kernel class that moved (each compute class's share of the rank's compute time:
  the share cancels the rank's own sequence-length noise) and the link group (ranks sharing
  ``host.name``, pipeline stages via ``stepwatch.pp_rank``).

The episodes of each rank are classified by their signature; the blame for a masked
straggler goes to the rank whose host-side compute grew, never to the peers that wait.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TypeVar

import numpy as np

from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._errors import ConfigError
from stepwatch.detectors.frame._frame import (
    COMMUNICATION_CATEGORY,
    COMPUTE_CATEGORY,
    COMPUTE_PHASES,
    JobFrame,
)
from stepwatch.detectors.stats._stats import (
    BoolArray,
    FloatArray,
    change_points,
    multiscale_outliers,
    nanmedian,
    persistent,
    safe_log,
    sustained_outliers,
)

_ArrayT = TypeVar("_ArrayT", FloatArray, BoolArray)

#: Metric name of the pooled small compute kernel classes.
MINOR_CLASSES = "(minor classes)"
#: Host-side phases that never contain waiting for peers (one-off stalls show there).
STALL_PHASES = ("data", "forward", "optimizer")


@dataclasses.dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the diagnosis engine (defaults tuned for "never cry wolf").

    Attributes:
        fdr_q: Benjamini–Hochberg rate per (window, metric) family of ranks. Tiny on
            purpose: a day holds ~10⁵ families, and a false page costs more than a late one.
        scales: trailing windows averaged before the cross-rank test (1 = react fast to big
            slowdowns; 30 = find a 5% one).
        persistence_windows: consecutive flagged windows needed at a scale.
        min_step_fraction: smallest excess time reported, as a fraction of the job's median
            step time.
        min_shift: smallest relative job-level shift (L1).
        change_alpha: significance of the L1 CUSUM test.
        min_scale: floor of the robust scale (log units).
        gap_windows: flag-free windows that end an episode.
        missing_windows: consecutive silent windows before ``rank_missing``.
        burst_min_ratio: smallest longest-step / mean-step excess over peers for a stall.
        sustained_windows: consecutive windows in which a rank, tested alone in each window
            at level ``(fdr_q / ranks)^(1 / sustained_windows)``, must be slower than its
            peers to be flagged without reaching ``fdr_q`` in any one window (small jobs:
            the MAD of a few ranks cannot give a tiny p-value; persistence can).
        sustained_min_ratio: smallest ratio to the peers' median in each of those windows.
        stall_min_steps: smallest one-off stall, in job median steps: the longest single
            occurrence of a host-side phase (``data``, ``forward``, ``optimizer``) above
            the peers' longest one in the same window. Peers that wait for a stalled rank
            in a collective show the stall in their step and communication time too, so
            only phases that cannot contain waiting localise it.
        stall_min_ratio: smallest ratio of that longest occurrence to the peers' one.
        clock_min_drop: smallest relative SM clock drop for ``gpu_health``.
        min_ranks: fewest ranks for cross-rank tests.
        major_share: compute classes below this share of compute time are tested pooled.
        reference_ranks: above twice this many ranks, the cross-rank centre and scale are
            estimated from about this many ranks (chosen by a hash of the rank id).
        workers: threads testing disjoint blocks of metrics (results do not depend on it).
    """

    fdr_q: float = 1e-6
    scales: tuple[int, ...] = (1, 3, 10, 30)
    persistence_windows: int = 2
    min_step_fraction: float = 0.005
    min_shift: float = 0.03
    change_alpha: float = 1e-3
    min_scale: float = 0.0005
    gap_windows: int = 6
    missing_windows: int = 3
    burst_min_ratio: float = 1.2
    sustained_windows: int = 6
    sustained_min_ratio: float = 1.5
    stall_min_steps: float = 20.0
    stall_min_ratio: float = 10.0
    clock_min_drop: float = 0.03
    min_ranks: int = 4
    major_share: float = 0.01
    reference_ranks: int = 2048
    workers: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.fdr_q < 1:
            raise ConfigError(f"fdr_q: must be in (0, 1), got {self.fdr_q}")
        if not self.scales or min(self.scales) < 1:
            raise ConfigError(f"scales: need positive window counts, got {self.scales}")
        if self.persistence_windows < 1:
            raise ConfigError("persistence_windows: must be >= 1")
        if self.missing_windows < 1:
            raise ConfigError("missing_windows: must be >= 1")
        if self.sustained_windows < 2 or self.sustained_min_ratio <= 1:
            raise ConfigError("sustained_windows/sustained_min_ratio: need >= 2 and > 1")
        if self.stall_min_steps <= 0 or self.stall_min_ratio <= 1:
            raise ConfigError("stall_min_steps/stall_min_ratio: need > 0 and > 1")


@dataclasses.dataclass(frozen=True)
class Finding:
    """A diagnosis plus when the engine could first have raised it.

    Attributes:
        diagnosis: the SCHEMA.md record.
        detected_unix_nano: end of the window at which the flags were first confirmed
            (flags only use past windows, so an incremental run raises it then).
        last_seen_unix_nano: end of the last window showing the condition.
    """

    diagnosis: Diagnosis
    detected_unix_nano: int
    last_seen_unix_nano: int


@dataclasses.dataclass(frozen=True)
class _Metrics:
    """Stacked log-metrics ``(W, R, M)`` with per-metric effect thresholds."""

    names: tuple[str, ...]
    flags: BoolArray  # (W, R, M) flagged (any scale, persistent)
    effect: FloatArray  # (W, R, M) single-window log effect vs peers
    z: FloatArray  # (W, R, M) max z over scales where flagged


@dataclasses.dataclass
class _Episode:
    rank_index: int
    first: int
    last: int
    detected: int
    metrics: dict[str, int]


#: Derived metric: step time minus time in the collective (see ``_metric_arrays``).
ARRIVAL = "arrival"


def _format_ranks(ranks: Sequence[int]) -> str:
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


def _clock(time_unix_nano: int) -> str:
    return datetime.fromtimestamp(time_unix_nano / 1e9, tz=UTC).strftime("%H:%M:%S")


def _severity(ratio: float) -> str:
    if ratio >= 1.2:
        return "critical"
    if ratio >= 1.05:
        return "warning"
    return "info"


class _Analysis:
    """One pass over a frame; methods share the derived arrays."""

    def __init__(self, frame: JobFrame, config: DetectorConfig) -> None:
        self.frame = frame
        self.config = config
        self.present = frame.present
        self.compute_s = frame.category_s(COMPUTE_CATEGORY)
        # Large jobs: centre and scale from ~reference_ranks ranks picked by a hash of the
        # rank id (deterministic, and it follows the ranks if they are reordered).
        self.reference: np.ndarray | None = None
        self.dtype: type = np.float64
        if frame.n_ranks > 2 * config.reference_ranks:
            self.dtype = np.float32  # half the memory traffic; log-times need no more
            hashed = (frame.ranks.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)
            cut = np.uint64(2**32 * config.reference_ranks // frame.n_ranks)
            self.reference = np.flatnonzero(hashed < cut)
        # Compute classes holding >= major_share of compute time are tested one by one;
        # the long tail is pooled (and named by L3 when the pool moves).
        compute_total = float(np.nansum(self.compute_s))
        class_totals = np.nansum(frame.kernel_s, axis=(0, 1))
        self.major_classes: list[int] = []
        self.minor_classes: list[int] = []
        for index, category in enumerate(frame.kernel_categories):
            if category != COMPUTE_CATEGORY:
                continue
            share = float(class_totals[index]) / max(compute_total, 1e-300)
            target = self.major_classes if share >= config.major_share else self.minor_classes
            target.append(index)
        with np.errstate(invalid="ignore"):
            self.step_median = nanmedian(np.where(self.present, frame.step_s, np.nan), axis=1)[:, 0]
        self.overlap_waiting = self._overlap_waiting()

    # ---- L2: cross-rank tests ------------------------------------------------------------
    def _metric_arrays(self) -> tuple[list[str], list[FloatArray], list[str]]:
        frame = self.frame
        names: list[str] = ["step", "idle"]
        values: list[FloatArray] = [frame.step_s, frame.idle_s]
        kinds: list[str] = ["time", "time"]
        for index, phase in enumerate(frame.phases):
            names.append(f"phase:{phase}")
            values.append(np.asarray(frame.phase_s[:, :, index]))
            kinds.append("time")
        if COMMUNICATION_CATEGORY in frame.phases:
            # Time outside the collective: the rank that reaches the collective last spends
            # the most time outside it and waits least in it (arrival order, ARGUS). Unlike
            # step or communication time, waiting for a late peer does not inflate it.
            index = frame.phases.index(COMMUNICATION_CATEGORY)
            names.append(ARRIVAL)
            values.append(np.asarray(frame.step_s - frame.phase_s[:, :, index]))
            kinds.append("time")
        if self.overlap_waiting:  # the waiters are the long ones there: no blame from them
            keep = [i for i, name in enumerate(names) if name not in self.overlap_waiting]
            names = [names[i] for i in keep]
            values = [values[i] for i in keep]
            kinds = [kinds[i] for i in keep]
        for category in sorted(set(frame.kernel_categories)):
            names.append(f"category:{category}")
            values.append(frame.category_s(category))
            kinds.append("time")
        with np.errstate(invalid="ignore", divide="ignore"):
            names.append("burst:step")
            values.append(frame.step_max_s / frame.step_s)
            kinds.append("burst")
            names.append("burst:idle")
            values.append(frame.idle_max_s / frame.idle_s)
            kinds.append("burst")
            compute = self.compute_s
            for index in self.major_classes:
                names.append(f"share:{frame.kernel_classes[index]}")
                values.append(np.asarray(frame.kernel_s[:, :, index]) / compute)
                kinds.append("share")
            if self.minor_classes:
                names.append(f"share:{MINOR_CLASSES}")
                minor = np.asarray(frame.kernel_s[:, :, self.minor_classes].sum(axis=2))
                values.append(minor / compute)
                kinds.append("share")
            if frame.sm_clock_hz is not None:
                names.append("clock")
                values.append(1.0 / frame.sm_clock_hz)
                kinds.append("clock")
        return names, values, kinds

    def _thresholds(
        self, kinds: Sequence[str], values: Sequence[FloatArray], names: Sequence[str]
    ) -> FloatArray:
        """``(W, M)`` smallest log effect worth reporting per window and metric."""
        config = self.config
        frame = self.frame
        columns = []
        for kind, value in zip(kinds, values, strict=True):
            if kind == "burst":
                columns.append(np.full(frame.n_windows, math.log(config.burst_min_ratio)))
                continue
            if kind == "clock":
                columns.append(np.full(frame.n_windows, math.log1p(config.clock_min_drop)))
                continue
            if kind == "share":
                value = value * self.compute_s  # the class's own time per step
            median = nanmedian(np.where(self.present, value, np.nan), axis=1)[:, 0]
            with np.errstate(invalid="ignore", divide="ignore"):
                columns.append(np.log1p(config.min_step_fraction * self.step_median / median))
        result = np.stack(columns, axis=1)
        return np.where(np.isfinite(result), result, np.inf)

    def metrics(self) -> _Metrics:
        names, values, kinds = self._metric_arrays()
        thresholds = self._thresholds(kinds, values, names)
        frame = self.frame
        # One-off stalls take the last columns (filled here, not tested across scales).
        stall_names, stall_flags, stall_effect = self._stalls()
        tested = len(names)
        shape = (frame.n_windows, frame.n_ranks, tested + len(stall_names))
        flags = np.zeros(shape, dtype=bool)
        effect: FloatArray = np.full(shape, np.nan, dtype=self.dtype)
        zmax = np.zeros(shape)
        if stall_names:
            flags[:, :, tested:] = stall_flags
            effect[:, :, tested:] = stall_effect
            zmax[:, :, tested:] = np.where(stall_flags, np.nan_to_num(stall_effect), 0.0)
        # Gate for every scale: the last few windows must still show the effect, so a long
        # trailing mean cannot keep a finding open after the condition cleared.
        gate_scale = min(3, max(self.config.scales))
        scales = [
            scale
            for scale in sorted({1, gate_scale, *self.config.scales})
            if scale == 1 or scale <= frame.n_windows
        ]

        def test_block(start: int, stop: int) -> None:
            block = np.stack(values[start:stop], axis=2)
            logs = safe_log(block, dtype=self.dtype)  # silent ranks are NaN already
            del block
            limit = thresholds[:, None, start:stop]
            tests = multiscale_outliers(
                logs,
                metric="block",
                scales=scales,
                fdr_q=self.config.fdr_q,
                min_scale=self.config.min_scale,
                min_ranks=self.config.min_ranks,
                reference=self.reference,
            )
            recent = tests[gate_scale].log_effect
            for scale, test in tests.items():
                if scale not in self.config.scales:
                    continue
                # The last windows must still show at least half of the long-run excess.
                current = recent >= np.maximum(limit, 0.5 * test.log_effect)
                hit = test.reject & (test.log_effect >= limit) & current
                hit = persistent(hit, windows=self.config.persistence_windows)
                flags[:, :, start:stop] |= hit
                target = zmax[:, :, start:stop]
                np.fmax(target, test.z, out=target, where=hit)
                if scale == 1:
                    effect[:, :, start:stop] = test.log_effect
            single = tests[1]
            hit = sustained_outliers(
                single,
                windows=self.config.sustained_windows,
                q=self.config.fdr_q,
                min_log_effect=np.maximum(limit, math.log(self.config.sustained_min_ratio)),
            )
            flags[:, :, start:stop] |= hit
            target = zmax[:, :, start:stop]
            np.fmax(target, single.z, out=target, where=hit)

        # Disjoint metric blocks on worker threads: numpy releases the GIL in the heavy
        # kernels (partition, cumsum, ufuncs), so a big job uses every core it is given.
        workers = max(1, min(self.config.workers, len(names)))
        size = -(-len(names) // workers)
        blocks = [(start, min(start + size, len(names))) for start in range(0, len(names), size)]
        if len(blocks) == 1:
            test_block(*blocks[0])
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=len(blocks)) as pool:
                for future in [pool.submit(test_block, *block) for block in blocks]:
                    future.result()
        return _Metrics(names=(*names, *stall_names), flags=flags, effect=effect, z=zmax)

    def _stalls(self) -> tuple[list[str], BoolArray, FloatArray]:
        """One-off host-side stalls: ``stall:<phase>`` flags and log ratios ``(W, R, S)``.

        A single window suffices (a stall is one event): the rank's longest occurrence of
        the phase must exceed the peers' median longest occurrence by ``stall_min_steps``
        job median steps and by a factor ``stall_min_ratio``.

        The peers' baseline comes from the same window when at least ``min_ranks`` ranks
        report in it, which keeps a stall every rank shares (a job-wide pause) from flagging
        anyone. Otherwise it pools the windows on either side: a long stall holds every
        rank in the next collective, so no rank finishes a step for a while and the
        stalled step can land in a window that few peers report in.
        """
        frame = self.frame
        config = self.config
        phases = [p for p in STALL_PHASES if p in frame.phases]
        step = float(np.nanmedian(self.step_median)) if np.isfinite(self.step_median).any() else 0
        shape = (frame.n_windows, frame.n_ranks, len(phases))
        flags = np.zeros(shape, dtype=bool)
        effect = np.full(shape, np.nan)
        if not phases or step <= 0:
            return [], flags, effect
        for column, phase in enumerate(phases):
            longest = np.where(
                self.present, frame.phase_max_s[:, :, frame.phases.index(phase)], np.nan
            )
            reported = np.isfinite(longest)
            peers = self._peers(longest)
            before, after = _shifted(peers, 1), _shifted(peers, -1)
            pooled = nanmedian(np.concatenate([before, peers, after], axis=1), axis=1)
            around = (reported | _shifted(reported, 1) | _shifted(reported, -1)).sum(axis=1)
            same = nanmedian(peers, axis=1)
            enough_same = reported.sum(axis=1, keepdims=True) >= config.min_ranks
            peer = np.where(enough_same, same, pooled)
            enough = enough_same | (around[:, None] >= config.min_ranks)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = longest / peer
                hit = (
                    (longest - peer >= config.stall_min_steps * step)
                    & (ratio >= config.stall_min_ratio)
                    & enough
                )
                effect[:, :, column] = np.where(
                    np.isfinite(ratio) & (ratio > 0), np.log(ratio), np.nan
                )
            flags[:, :, column] = hit
        return [f"stall:{phase}" for phase in phases], flags, effect

    def episodes(self, metrics: _Metrics) -> list[_Episode]:
        any_flag: BoolArray = np.asarray(metrics.flags.any(axis=2))
        episodes: list[_Episode] = []
        for rank_index in np.flatnonzero(any_flag.any(axis=0)):
            windows = np.flatnonzero(any_flag[:, rank_index])
            breaks = np.flatnonzero(np.diff(windows) > self.config.gap_windows)
            for run in np.split(windows, breaks + 1):
                first_flag, last = int(run[0]), int(run[-1])
                counts = metrics.flags[first_flag : last + 1, rank_index, :].sum(axis=0)
                flagged = {metrics.names[m]: int(counts[m]) for m in np.flatnonzero(counts)}
                episodes.append(
                    _Episode(
                        rank_index=int(rank_index),
                        first=self._onset(metrics, int(rank_index), first_flag),
                        last=last,
                        detected=first_flag,
                        metrics=flagged,
                    )
                )
        return episodes

    def _onset(self, metrics: _Metrics, rank_index: int, first_flag: int) -> int:
        """Walk back from the first flag while the single-window effect stays large."""
        hit = np.flatnonzero(metrics.flags[first_flag, rank_index, :])
        metric = int(hit[np.argmax(metrics.z[first_flag, rank_index, hit])])
        series = metrics.effect[:, rank_index, metric]
        lookback = max(self.config.scales) + self.config.persistence_windows
        level = np.nanmedian(series[first_flag : min(first_flag + 5, series.size)])
        if not np.isfinite(level) or level <= 0:
            return first_flag
        onset = first_flag
        for index in range(first_flag - 1, max(-1, first_flag - lookback), -1):
            value = series[index]
            if not np.isfinite(value) or value < 0.5 * level:
                break
            onset = index
        return onset

    # ---- classification ------------------------------------------------------------------
    @staticmethod
    def classify(episode: _Episode) -> str:
        flagged = episode.metrics
        if "clock" in flagged:
            return "gpu_health"
        if any(name.startswith(("burst:", "stall:")) for name in flagged):
            return "jit_stall"
        if "phase:data" in flagged:
            return "dataloader_stall"
        if f"category:{COMPUTE_CATEGORY}" in flagged or any(
            name.startswith("share:") for name in flagged
        ):
            return "compute_straggler"
        host_side = {"idle", *(f"phase:{p}" for p in COMPUTE_PHASES)}
        if host_side & set(flagged):
            return "masked_straggler"
        link = {
            "step",
            ARRIVAL,
            f"phase:{COMMUNICATION_CATEGORY}",
            f"category:{COMMUNICATION_CATEGORY}",
        }
        if link & set(flagged):
            return "link_degradation"
        if any(name.startswith("phase:") for name in flagged):
            return "masked_straggler"
        return "compute_straggler"

    def _mean_effect(
        self, metrics: _Metrics, name: str, rank_indices: Sequence[int], first: int, last: int
    ) -> float:
        if name not in metrics.names:
            return 0.0
        m = metrics.names.index(name)
        block = metrics.effect[first : last + 1, rank_indices, m]
        if not np.isfinite(block).any():
            return 0.0
        return float(np.nanmedian(block))

    def _peers(self, values: FloatArray) -> FloatArray:
        """The reference ranks' columns (all ranks for ordinary jobs)."""
        return values if self.reference is None else values[:, self.reference]

    def _excess_s(
        self, metrics: _Metrics, name: str, values: FloatArray, ranks: Sequence[int], span: slice
    ) -> float:
        effect = self._mean_effect(metrics, name, ranks, span.start, span.stop - 1)
        peer = nanmedian(self._peers(values[span]), axis=1)
        base = float(np.nanmedian(peer)) if np.isfinite(peer).any() else 0.0
        return base * math.expm1(effect)

    def findings(self, metrics: _Metrics) -> list[Finding]:
        groups: dict[str, list[_Episode]] = {}
        for episode in self.episodes(metrics):
            groups.setdefault(self.classify(episode), []).append(episode)
        results: list[Finding] = []
        for kind, episodes in groups.items():
            episodes.sort(key=lambda e: e.first)
            merged: list[list[_Episode]] = []
            for episode in episodes:
                if merged and episode.first <= max(e.last for e in merged[-1]) + 1:
                    merged[-1].append(episode)
                else:
                    merged.append([episode])
            for group in merged:
                results.append(self._finding(kind, group, metrics))
        results.extend(self._missing())
        results.extend(self._job_level(results))
        return sorted(results, key=lambda f: (f.diagnosis.start_unix_nano, f.diagnosis.kind))

    def _finding(self, kind: str, group: list[_Episode], metrics: _Metrics) -> Finding:
        frame = self.frame
        first = min(e.first for e in group)
        last = max(e.last for e in group)
        detected = min(e.detected for e in group)
        indices = sorted({e.rank_index for e in group})
        hosts: tuple[str, ...] = ()
        span = slice(first, last + 1)
        if kind == "link_degradation":
            indices, hosts = self._host_group(indices)
        elif kind in ("masked_straggler", "compute_straggler"):
            stage = self._stage_group(indices)
            if stage is not None and kind == "masked_straggler":
                kind, indices = "pipeline_bubble", stage
        ranks = [int(frame.ranks[i]) for i in indices]
        rank_text = _format_ranks(ranks)
        since = _clock(frame.window_start_unix_nano(first))
        phase: str | None = None
        kernel_class: str | None = None
        if kind == "compute_straggler":
            phase = self._top_phase(metrics, indices, span, COMPUTE_PHASES)
            kernel_class, kernel_ratio = self._top_share(metrics, indices, first, last)
            ratio = math.exp(self._mean_effect(metrics, f"phase:{phase}", indices, first, last))
            detail = f" ({kernel_class} {kernel_ratio:.2f}x)" if kernel_class else ""
            summary = f"{rank_text} {phase} compute {ratio:.2f}x peers{detail} since {since}"
        elif kind == "masked_straggler":
            phase = self._top_phase(metrics, indices, span, (*COMPUTE_PHASES, "other"))
            ratio = math.exp(self._mean_effect(metrics, f"phase:{phase}", indices, first, last))
            wait_name = f"phase:{COMMUNICATION_CATEGORY}"
            wait = math.exp(self._mean_effect(metrics, wait_name, indices, first, last))
            wait_text = (
                f"its collective wait {wait:.2f}x peers (peers wait for it)"
                if wait_name in metrics.names
                else "its peers wait for it in the collective"
            )
            summary = (
                f"{rank_text} {phase} {ratio:.2f}x peers with normal kernels; {wait_text} "
                f"since {since}"
            )
        elif kind == "pipeline_bubble":
            stages = sorted({int(frame.pp_ranks[i]) for i in indices})
            ratio = math.exp(self._mean_effect(metrics, "idle", indices, first, last))
            stage_text = ",".join(str(s) for s in stages)
            summary = (
                f"pipeline stage {stage_text} ({rank_text}) device idle {ratio:.2f}x peers "
                f"since {since}"
            )
        elif kind == "link_degradation":
            late = ARRIVAL in metrics.names and "step" not in metrics.names
            ratio = math.exp(
                self._mean_effect(metrics, ARRIVAL if late else "step", indices, first, last)
            )
            comm = [
                name
                for name, category in zip(
                    frame.kernel_classes, frame.kernel_categories, strict=True
                )
                if category == COMMUNICATION_CATEGORY
            ]
            kernel_class = comm[0] if len(comm) == 1 else None
            phase = COMMUNICATION_CATEGORY
            what = (
                "reaches the collective late: time outside it"
                if late
                else ("collective completion")
            )
            summary = (
                f"host {','.join(hosts)} ({rank_text}) {what} {ratio:.2f}x peers "
                f"with normal compute since {since}"
            )
        elif kind == "dataloader_stall":
            phase = "data"
            ratio = math.exp(self._mean_effect(metrics, "phase:data", indices, first, last))
            summary = f"{rank_text} data loading {ratio:.2f}x peers since {since}"
        elif kind == "jit_stall":
            ratio = math.exp(
                max(
                    self._mean_effect(metrics, "burst:step", indices, first, last),
                    self._mean_effect(metrics, "burst:idle", indices, first, last),
                )
            )
            phase = self._top_phase(metrics, indices, span, COMPUTE_PHASES)
            stalls = self._stall_ratios(metrics, indices, first, last)
            if stalls:  # a one-off stall localised to a host-side phase
                phase, stall_ratio = max(stalls.items(), key=lambda item: item[1])
                ratio = max(ratio, stall_ratio)
            summary = (
                f"{rank_text} host-side stalls with the device idle: longest step {ratio:.2f}x "
                f"its peers' since {since}"
            )
        else:  # gpu_health
            ratio = math.exp(self._mean_effect(metrics, "clock", indices, first, last))
            compute = math.exp(
                self._mean_effect(metrics, f"category:{COMPUTE_CATEGORY}", indices, first, last)
            )
            summary = (
                f"{rank_text} SM clock {1 / ratio:.2f}x peers (throttled), compute kernels "
                f"{compute:.2f}x since {since}"
            )
        score = float(np.max(metrics.z[first : last + 1][:, indices, :]) if indices else 0.0)
        if not math.isfinite(score):
            score = 0.0
        open_ = last >= frame.n_windows - 1 - self.config.gap_windows
        diagnosis = Diagnosis(
            job=frame.job,
            kind=kind,
            ranks=tuple(ranks),
            hosts=hosts,
            phase=phase,
            kernel_class=kernel_class,
            start_unix_nano=frame.window_start_unix_nano(first),
            end_unix_nano=None if open_ else int(frame.window_end_unix_nano[last]),
            severity=_severity(max(ratio, 1.0 / ratio) if ratio > 0 else 1.0),
            score=min(score, 99.0),
            summary=summary,
        )
        return Finding(
            diagnosis=diagnosis,
            detected_unix_nano=int(frame.window_end_unix_nano[detected]),
            last_seen_unix_nano=int(frame.window_end_unix_nano[last]),
        )

    def _stall_ratios(
        self, metrics: _Metrics, indices: list[int], first: int, last: int
    ) -> dict[str, float]:
        """Flagged stall phases → longest occurrence / peers' longest (largest in the span)."""
        ratios: dict[str, float] = {}
        for m, name in enumerate(metrics.names):
            if not name.startswith("stall:"):
                continue
            hit = metrics.flags[first : last + 1, indices, m]
            if hit.any():
                ratios[name.split(":", 1)[1]] = math.exp(
                    float(np.nanmax(metrics.effect[first : last + 1, indices, m][hit]))
                )
        return ratios

    def _host_group(self, indices: list[int]) -> tuple[list[int], tuple[str, ...]]:
        hosts = self.frame.hosts
        flagged: dict[str, int] = {}
        for i in indices:
            flagged[hosts[i]] = flagged.get(hosts[i], 0) + 1
        size = {host: hosts.count(host) for host in flagged}
        chosen = sorted(h for h, n in flagged.items() if h and n * 2 >= size[h])
        if not chosen:
            return indices, tuple(sorted({hosts[i] for i in indices if hosts[i]}))
        group = [i for i, host in enumerate(hosts) if host in chosen]
        return group, tuple(chosen)

    def _stage_group(self, indices: list[int]) -> list[int] | None:
        pp = self.frame.pp_ranks
        if len(set(pp.tolist()) - {-1}) < 2:
            return None
        stages = {int(pp[i]) for i in indices}
        if -1 in stages:
            return None
        members = [i for i in range(pp.size) if int(pp[i]) in stages]
        if len(members) < 2 * len(stages) or len(indices) * 2 < len(members):
            return None
        return members

    def _top_phase(
        self, metrics: _Metrics, indices: list[int], span: slice, phases: Sequence[str]
    ) -> str:
        best, best_excess = phases[0], -math.inf
        for phase in phases:
            values = self.frame.phase(phase)
            if values is None:
                continue
            excess = self._excess_s(metrics, f"phase:{phase}", values, indices, span)
            if excess > best_excess:
                best, best_excess = phase, excess
        return best

    def _top_share(
        self, metrics: _Metrics, indices: list[int], first: int, last: int
    ) -> tuple[str | None, float]:
        """L3: the compute class whose share of the ranks' compute time grew most vs peers.

        Returns the class and its kernel-time ratio to peers (``None`` when no class grew).
        """
        del metrics
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

    # ---- rank_missing --------------------------------------------------------------------
    def _missing(self) -> list[Finding]:
        frame = self.frame
        present = self.present
        reporting = present.sum(axis=1) * 2 >= max(frame.n_ranks, 1)
        seen = np.maximum.accumulate(present, axis=0)
        absent = seen & ~present & reporting[:, None]
        by_start: dict[tuple[int, int | None], list[int]] = {}
        for rank_index in np.flatnonzero(absent.any(axis=0)):
            column = absent[:, rank_index]
            windows = np.flatnonzero(column)
            breaks = np.flatnonzero(np.diff(windows) > 1)
            for run in np.split(windows, breaks + 1):
                if run.size < self.config.missing_windows:
                    continue
                first, last = int(run[0]), int(run[-1])
                came_back = last + 1 < frame.n_windows and bool(present[last + 1, rank_index])
                key = (first, last if came_back else None)
                by_start.setdefault(key, []).append(int(rank_index))
        results = []
        for (first, until), indices in sorted(by_start.items(), key=lambda item: item[0][0]):
            ranks = [int(frame.ranks[i]) for i in indices]
            since = _clock(frame.window_start_unix_nano(first))
            diagnosis = Diagnosis(
                job=frame.job,
                kind="rank_missing",
                ranks=tuple(ranks),
                hosts=tuple(sorted({frame.hosts[i] for i in indices if frame.hosts[i]})),
                start_unix_nano=frame.window_start_unix_nano(first),
                end_unix_nano=None if until is None else int(frame.window_end_unix_nano[until]),
                severity="critical",
                score=float(len(ranks)),
                summary=f"{_format_ranks(ranks)} stopped reporting at {since} "
                "(the others still report)",
            )
            confirm = first + self.config.missing_windows - 1
            results.append(
                Finding(
                    diagnosis=diagnosis,
                    detected_unix_nano=int(frame.window_end_unix_nano[confirm]),
                    last_seen_unix_nano=int(
                        frame.window_end_unix_nano[frame.n_windows - 1 if until is None else until]
                    ),
                )
            )
        return results

    # ---- L1: job level -------------------------------------------------------------------
    def _job_series(self) -> dict[str, FloatArray]:
        frame = self.frame
        # Each rank's first window holds its warm-up steps (lazy initialisation, allocator
        # and cache warm-up): slower for a reason no later window shares, it would pass for
        # a level shift or, in a short job, swamp the test of one.
        present = self.present & (np.cumsum(self.present, axis=0) > 1)

        def median(values: FloatArray) -> FloatArray:
            return nanmedian(np.where(present, values, np.nan), axis=1)[:, 0]

        series = {"step": median(frame.step_s)}
        for index, phase in enumerate(frame.phases):
            series[f"phase:{phase}"] = median(np.asarray(frame.phase_s[:, :, index]))
        # The long tail of small classes cannot move the job by a visible amount.
        keep = [i for i in range(len(frame.kernel_classes)) if i not in self.minor_classes]
        if frame.n_ranks and keep:
            kernel = np.asarray(frame.kernel_s[:, :, keep])
            medians = nanmedian(np.where(present[:, :, None], kernel, np.nan), axis=1)[:, 0, :]
            for column, index in enumerate(keep):
                series[f"kernel:{frame.kernel_classes[index]}"] = medians[:, column]
        return series

    def _waiting_series(self) -> set[str]:
        """Job-level series that hold waiting in collectives (not evidence on their own).

        Communication phases and kernels always, plus :meth:`_overlap_waiting`: a host
        slowed by other work slows its collectives and with them those series, which is
        not a regression of the job's code.
        """
        frame = self.frame
        waiting = {f"phase:{COMMUNICATION_CATEGORY}"} | {
            f"kernel:{name}"
            for name, category in zip(frame.kernel_classes, frame.kernel_categories, strict=True)
            if category == COMMUNICATION_CATEGORY
        }
        return waiting | self.overlap_waiting

    def _overlap_waiting(self) -> set[str]:
        """Series that hold the wait for peers when the phases overlap the communication.

        The phases overlap when their sum exceeds the step by more than 10% (DDP runs its
        allreduce inside ``loss.backward()``; on CPU/gloo the backward phase holds the
        whole wait). Then the step, the communication phase and every phase at least as
        long as the communication (only such a phase can hold it) measure waiting for the
        slowest rank as much as the rank's own work: the ranks that wait are the long
        ones there, so they are neither cross-rank evidence nor job-level evidence.
        """
        frame = self.frame
        communication = frame.phase(COMMUNICATION_CATEGORY)
        if communication is None or not self.present.any():
            return set()
        with np.errstate(invalid="ignore"):
            phase_sum = float(np.nanmedian(np.nansum(frame.phase_s, axis=2)[self.present]))
            step = float(np.nanmedian(frame.step_s[self.present]))
            overlap = float(np.nanmedian(communication[self.present]))
        if not (math.isfinite(step) and phase_sum > 1.1 * step and math.isfinite(overlap)):
            return set()
        waiting = {"step", f"phase:{COMMUNICATION_CATEGORY}"}
        for phase in frame.phases:
            values = frame.phase(phase)
            if phase == COMMUNICATION_CATEGORY or values is None:
                continue
            if float(np.nanmedian(values[self.present])) >= overlap:
                waiting.add(f"phase:{phase}")
        return waiting

    def _job_level(self, rank_findings: Sequence[Finding]) -> list[Finding]:
        frame = self.frame
        config = self.config
        if frame.n_windows < 6:
            return []
        step = float(np.nanmedian(self.step_median)) if np.isfinite(self.step_median).any() else 0
        if step <= 0:
            return []
        window_ns = round(frame.window_s * 1e9)
        explained = [
            (
                (f.diagnosis.start_unix_nano - int(frame.window_end_unix_nano[0])) // window_ns,
                (f.last_seen_unix_nano - int(frame.window_end_unix_nano[0])) // window_ns,
            )
            for f in rank_findings
        ]
        candidates: list[tuple[int, str, float, float]] = []  # (index, series, excess_s, ratio)
        for name, series in self._job_series().items():
            for point in change_points(
                series, min_shift=config.min_shift, alpha=config.change_alpha
            ):
                excess = point.after - point.before
                if point.ratio < 1 or excess < config.min_step_fraction * step:
                    continue
                if any(low - 6 <= point.index <= high + 1 for low, high in explained):
                    continue
                candidates.append((point.index, name, excess, point.ratio))
        if not candidates:
            return []
        candidates.sort()
        groups: list[list[tuple[int, str, float, float]]] = []
        for candidate in candidates:
            if groups and candidate[0] - groups[-1][0][0] <= 3:
                groups[-1].append(candidate)
            else:
                groups.append([candidate])
        results = []
        waiting = self._waiting_series()
        for group in groups:
            if all(c[1] in waiting for c in group):
                # Collective time is mostly waiting for the last rank: its median is an
                # extreme-value statistic, too jumpy to call a job regression on its own.
                continue
            index = min(c[0] for c in group)
            phases = [c for c in group if c[1].startswith("phase:")]
            kernels = [c for c in group if c[1].startswith("kernel:")]
            steps = [c for c in group if c[1] == "step"]
            phase = max(phases, key=lambda c: c[2])[1].split(":", 1)[1] if phases else None
            top_kernel = max(kernels, key=lambda c: c[2]) if kernels else None
            kernel_class = top_kernel[1].split(":", 1)[1] if top_kernel else None
            ratio = steps[0][3] if steps else max(c[3] for c in group)
            since = _clock(frame.window_start_unix_nano(index))
            detail = []
            if phase:
                detail.append(f"{phase} moved most")
            if top_kernel:
                detail.append(f"{kernel_class} {top_kernel[3]:.2f}x")
            head = f"job step time {ratio:.2f}x" if steps else "job slower"
            diagnosis = Diagnosis(
                job=frame.job,
                kind="job_regression",
                phase=phase,
                kernel_class=kernel_class,
                start_unix_nano=frame.window_start_unix_nano(index),
                end_unix_nano=None,
                severity=_severity(ratio),
                score=float(max(c[3] for c in group)),
                summary=f"{head} since {since} on every rank"
                + (f" ({', '.join(detail)})" if detail else ""),
            )
            confirm = min(index + 2, frame.n_windows - 1)
            results.append(
                Finding(
                    diagnosis=diagnosis,
                    detected_unix_nano=int(frame.window_end_unix_nano[confirm]),
                    last_seen_unix_nano=int(frame.window_end_unix_nano[-1]),
                )
            )
        return results


def analyse(frame: JobFrame, *, config: DetectorConfig | None = None) -> list[Finding]:
    """Run L1, L2 and L3 on a frame and classify; the findings sorted by start.

    Args:
        frame: the job's windows (:func:`read_frame` or ``SimulatedJob.frame()``).
        config: thresholds; :class:`DetectorConfig` defaults when omitted.

    Notes:
        Needs at least ``config.min_ranks`` ranks for cross-rank tests (fewer: only job-level
        change points and ``rank_missing``) and 6 windows for job-level change points.
        Silent ranks (NaN) are left out of every test and reported as ``rank_missing`` once
        silent for ``config.missing_windows`` windows while most ranks still report.

    References:
        Tukey, J. W. (1977). Exploratory Data Analysis (median/MAD). Benjamini and Hochberg
        (1995). ARGUS/PerfTracker-style differential observability: compare ranks with
        their peers and with their own history; blame compute time and arrival order.
    """
    config = config or DetectorConfig()
    if frame.n_windows == 0 or frame.n_ranks == 0:
        return []
    analysis = _Analysis(frame, config)
    return analysis.findings(analysis.metrics())


def diagnose(frame: JobFrame, *, config: DetectorConfig | None = None) -> list[Diagnosis]:
    """The diagnoses of :func:`analyse`."""
    return [finding.diagnosis for finding in analyse(frame, config=config)]


def _shifted(values: _ArrayT, by: int) -> _ArrayT:
    """``values`` moved ``by`` windows later along axis 0 (``-by``: earlier), padded.

    NaN padding for floats, ``False`` for booleans.
    """
    out = np.full_like(values, False if values.dtype == bool else np.nan)
    if by > 0:
        out[by:] = values[:-by]
    elif by < 0:
        out[:by] = values[-by:]
    else:
        out[:] = values
    return out
