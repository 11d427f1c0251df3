"""A simulated run: per-step timings of every rank, its ground truth, and two views of it.

:meth:`SimulatedJob.frame` is the job as the InfluxDB reader would build it (no InfluxDB);
:meth:`SimulatedJob.observed` is what one rank's exporter saw in one export window, which
the app replays through the real exporter and bridge code (``stepwatch simulate``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from stepwatch.detectors.frame import JobFrame
from stepwatch.detectors.simulation._topology import RANKS_PER_HOST, Topology
from stepwatch.detectors.simulation._truth import Truth
from stepwatch.detectors.stats._stats import FloatArray


class StepTiming(NamedTuple):
    """One step of one rank, as its step monitor measured it."""

    step_index: int
    duration_s: float
    phases_s: dict[str, float]


class RankPlacement(NamedTuple):
    """Where a rank sits (the resource attributes its exporter reports)."""

    rank: int
    host_name: str
    local_rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int


@dataclasses.dataclass(frozen=True)
class RankWindow:
    """What one rank's exporter saw in one export window.

    Attributes:
        rank: the rank.
        start_unix_nano: window start (``end_unix_nano`` minus the window length).
        end_unix_nano: when the rank exported the window (with the rank's jitter).
        steps: the steps the rank completed in the window, in order.
        kernel_durations_s: every kernel execution's duration by ``(class, category)``.
        idle_durations_s: device idle time of each step.
        sm_clock_hz: mean SM clock over the window's steps (an NVML gauge in real jobs).
    """

    rank: int
    start_unix_nano: int
    end_unix_nano: int
    steps: tuple[StepTiming, ...]
    kernel_durations_s: dict[tuple[str, str], list[float]]
    idle_durations_s: list[float]
    sm_clock_hz: float


@dataclasses.dataclass(frozen=True, eq=False)
class SimulatedJob:
    """Per-step timings of every rank plus the ground truth.

    Arrays are ``(steps, ranks[, ...])``; ``alive`` is False after a rank stopped reporting.
    ``device_metrics`` False: its producer reports no kernel times, device idle or SM clock
    (the arrays are still simulated; the frame and the exporters' view leave them out).
    """

    truth: Truth
    topology: Topology
    hosts: tuple[str, ...]
    pp_ranks: np.ndarray
    kernel_classes: tuple[str, ...]
    kernel_categories: tuple[str, ...]
    kernel_calls: tuple[int, ...]
    phases: tuple[str, ...]
    step_s: FloatArray
    phase_s: FloatArray
    kernel_s: FloatArray
    idle_s: FloatArray
    sm_clock_hz: FloatArray
    alive: np.ndarray
    export_jitter_s: FloatArray
    device_metrics: bool = True

    @property
    def job_id(self) -> str:
        return self.truth.job

    @property
    def world_size(self) -> int:
        return self.truth.world_size

    @property
    def rank_ids(self) -> tuple[int, ...]:
        return tuple(range(self.truth.world_size))

    @property
    def n_steps(self) -> int:
        return int(self.step_s.shape[0])

    @property
    def n_windows(self) -> int:
        return -(-self.n_steps // self.truth.steps_per_window)

    def window_end_unix_nano(self, window: int, rank: int) -> int:
        """When rank's export of ``window`` happened: mid analysis window, with jitter."""
        window_ns = round(self.truth.window_s * 1e9)
        jitter_ns = round(float(self.export_jitter_s[window, rank]) * 1e9)
        return self.truth.start_unix_nano + window * window_ns + window_ns // 2 + jitter_ns

    def placement(self, rank: int) -> RankPlacement:
        """Host and parallel coordinates of ``rank`` (8 ranks per host)."""
        topology = self.topology
        return RankPlacement(
            rank=rank,
            host_name=self.hosts[rank],
            local_rank=rank % RANKS_PER_HOST,
            dp_rank=(rank // topology.tp) % topology.dp,
            tp_rank=rank % topology.tp,
            pp_rank=topology.pp_rank(rank),
        )

    def observed(self, window: int, rank: int) -> RankWindow | None:
        """What ``rank`` exported for ``window`` (None: it completed no step in it)."""
        per = self.truth.steps_per_window
        first = window * per
        steps = [s for s in range(first, min(first + per, self.n_steps)) if self.alive[s, rank]]
        if not steps:
            return None
        timings = []
        durations: dict[tuple[str, str], list[float]] = {}
        device = self.device_metrics
        for step in steps:
            timings.append(
                StepTiming(
                    step_index=step,
                    duration_s=float(self.step_s[step, rank]),
                    phases_s={
                        name: float(self.phase_s[step, rank, p])
                        for p, name in enumerate(self.phases)
                        if self.phase_s[step, rank, p] > 0
                    },
                )
            )
            for k, name in enumerate(self.kernel_classes if device else ()):
                calls = self.kernel_calls[k]
                each = float(self.kernel_s[step, rank, k]) / calls
                if each > 0:
                    durations.setdefault((name, self.kernel_categories[k]), []).extend(
                        [each] * calls
                    )
        end = self.window_end_unix_nano(window, rank)
        return RankWindow(
            rank=rank,
            start_unix_nano=end - round(self.truth.window_s * 1e9),
            end_unix_nano=end,
            steps=tuple(timings),
            kernel_durations_s=durations,
            idle_durations_s=[float(self.idle_s[step, rank]) for step in steps] if device else [],
            sm_clock_hz=float(self.sm_clock_hz[steps, rank].mean()),
        )

    def frame(self) -> JobFrame:
        """The job as the InfluxDB reader would build it, without InfluxDB."""
        per = self.truth.steps_per_window
        n_windows = self.n_windows
        pad = n_windows * per - self.n_steps

        def windows(values: FloatArray) -> FloatArray:
            if pad:
                filler = np.full((pad, *values.shape[1:]), np.nan)
                values = np.concatenate([values, filler])
            return values.reshape(n_windows, per, *values.shape[1:])

        alive = windows(np.where(self.alive, 1.0, np.nan))
        count = np.nansum(alive, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            inverse = np.where(count > 0, 1.0 / np.maximum(count, 1.0), np.nan)

        def mean(values: FloatArray) -> FloatArray:
            masked = windows(values) * (alive if values.ndim == 2 else alive[..., None])
            return np.asarray(np.nansum(masked, axis=1)) * (
                inverse if values.ndim == 2 else inverse[..., None]
            )

        def peak(values: FloatArray, *, lowest: bool = False) -> FloatArray:
            masked = windows(values) * (alive if values.ndim == 2 else alive[..., None])
            sign = -1.0 if lowest else 1.0
            result = sign * np.max(np.where(np.isnan(masked), -np.inf, sign * masked), axis=1)
            return np.where(np.isinf(result), np.nan, result)

        window_ns = round(self.truth.window_s * 1e9)
        n_ranks = len(self.hosts)
        device = self.device_metrics
        no_values = np.full((n_windows, n_ranks), np.nan)
        return JobFrame(
            job=self.truth.job,
            window_s=self.truth.window_s,
            window_end_unix_nano=self.truth.start_unix_nano
            + window_ns * np.arange(1, n_windows + 1, dtype=np.int64),
            ranks=np.arange(self.truth.world_size, dtype=np.int64),
            hosts=self.hosts,
            pp_ranks=self.pp_ranks.copy() if self.topology.pp > 1 else np.full(len(self.hosts), 0),
            step_count=count,
            step_s=mean(self.step_s),
            step_max_s=peak(self.step_s),
            phases=self.phases,
            phase_s=mean(self.phase_s),
            phase_max_s=peak(self.phase_s),
            kernel_classes=self.kernel_classes if device else (),
            kernel_categories=self.kernel_categories if device else (),
            kernel_s=mean(self.kernel_s) if device else np.zeros((n_windows, n_ranks, 0)),
            idle_s=mean(self.idle_s) if device else no_values,
            idle_max_s=peak(self.idle_s) if device else no_values.copy(),
            sm_clock_hz=mean(self.sm_clock_hz) if device else None,
            dp_ranks=np.array([self.placement(r).dp_rank for r in range(len(self.hosts))]),
            tp_ranks=np.array([self.placement(r).tp_rank for r in range(len(self.hosts))]),
            phase_min_s=peak(self.phase_s, lowest=True),
        )
