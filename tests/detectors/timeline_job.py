"""A job given step by step, exported by each rank at its own instants (a ReplayJob).

Producers other than stepwatch close each rank's window on its own timer: the
OpenTelemetry SDKs' periodic readers start when each rank's process does, so one rank's
window may end up to a whole export interval after another's, and a window that straddles a
change in step time holds a different share of slow steps on each rank.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import numpy.typing as npt

from stepwatch.detectors.simulation import RankPlacement, RankWindow, StepTiming

START_UNIX_NANO = 1_795_291_200_000_000_000


@dataclasses.dataclass(frozen=True, eq=False)
class TimelineJob:
    """``step_s`` ``(S, R)`` and ``phase_s`` ``(S, R, P)`` of a synchronous job; rank r
    exports every ``interval_s`` at ``offset_s[r]`` past the interval's start."""

    job_id: str
    step_s: npt.NDArray[np.float64]
    phases: tuple[str, ...]
    phase_s: npt.NDArray[np.float64]
    interval_s: float
    offset_s: tuple[float, ...]

    @property
    def world_size(self) -> int:
        return int(self.step_s.shape[1])

    @property
    def rank_ids(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    @property
    def _ends(self) -> npt.NDArray[np.float64]:
        """``(S,)`` when each step ends (every rank leaves the collective together)."""
        return np.cumsum(self.step_s.max(axis=1))

    @property
    def n_windows(self) -> int:
        return math.ceil(float(self._ends[-1]) / self.interval_s) + 1

    def placement(self, rank: int) -> RankPlacement:
        return RankPlacement(rank, f"node-{rank // 2}", rank % 2, rank, 0, 0)

    def observed(self, window: int, rank: int) -> RankWindow | None:
        start = (window - 1) * self.interval_s + self.offset_s[rank]
        end = start + self.interval_s
        ends = self._ends
        steps = np.flatnonzero((ends > start) & (ends <= end))
        if steps.size == 0:
            return None
        timings = tuple(
            StepTiming(
                step_index=int(s),
                duration_s=float(self.step_s[s, rank]),
                phases_s={p: float(self.phase_s[s, rank, i]) for i, p in enumerate(self.phases)},
            )
            for s in steps
        )
        return RankWindow(
            rank=rank,
            start_unix_nano=START_UNIX_NANO + round(max(start, 0.0) * 1e9),
            end_unix_nano=START_UNIX_NANO + round(end * 1e9),
            steps=timings,
            kernel_durations_s={},
            idle_durations_s=[],
            sm_clock_hz=math.nan,
        )


def masked_straggler(
    *,
    steps: int,
    ranks: int = 4,
    slow_rank: int = 2,
    slow_from: int,
    factor: float = 1.6,
    seed: int = 0,
) -> tuple[npt.NDArray[np.float64], tuple[str, ...], npt.NDArray[np.float64]]:
    """Steps and phases (data, forward, backward, optimizer, communication) of a synchronous
    data-parallel job whose ``slow_rank``'s forward is ``factor`` slower from ``slow_from``:
    its peers wait for it in the collective."""
    rng = np.random.default_rng(seed)
    shape = (steps, ranks)
    data = 0.004 * np.exp(rng.normal(0, 0.05, shape))
    forward = 0.018 * np.exp(rng.normal(0, 0.05, shape))
    forward[slow_from:, slow_rank] *= factor
    backward = 0.030 * np.exp(rng.normal(0, 0.05, shape))
    optimizer = 0.004 * np.exp(rng.normal(0, 0.05, shape))
    transfer = 0.004 * np.exp(rng.normal(0, 0.05, (steps, 1)))
    lead = data + forward + backward
    communication = lead.max(axis=1, keepdims=True) - lead + transfer
    step = lead + communication + optimizer
    phase_s = np.stack([data, forward, backward, optimizer, communication], axis=2)
    return step, ("data", "forward", "backward", "optimizer", "communication"), phase_s


def in_layout(
    phases: tuple[str, ...], phase_s: npt.NDArray[np.float64], layout: str
) -> tuple[tuple[str, ...], npt.NDArray[np.float64]]:
    """The phases as a producer timing the job in ``layout`` records them: ``auto`` as
    given; ``no-communication`` with the collective inside ``backward`` (the README's loop
    under DDP); ``steps`` none."""
    if layout == "steps":
        return (), phase_s[:, :, :0]
    if layout == "no-communication":
        index = phases.index("communication")
        kept = [i for i in range(len(phases)) if i != index]
        folded = phase_s[:, :, kept].copy()
        folded[:, :, [phases[i] for i in kept].index("backward")] += phase_s[:, :, index]
        return tuple(phases[i] for i in kept), folded
    return phases, phase_s
