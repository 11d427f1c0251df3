"""The diagnosis engine's thresholds, validated when built."""

from __future__ import annotations

import dataclasses

from stepwatch.core._errors import ConfigError


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
        sustained_windows: windows, of the last ``sustained_windows + 1`` (one may fail),
            in which a rank tested alone in each window (level from the binomial tail;
            ``stats._stats.sustained_outliers``) must be slower than its
            peers to be flagged without reaching ``fdr_q`` in any one window (small jobs:
            the MAD of a few ranks cannot give a tiny p-value; persistence can).
        sustained_min_ratio: smallest ratio to the peers' median in each of those windows.
        stall_min_steps: smallest one-off stall, in job median steps: the longest single
            occurrence of a host-side phase (``data``, ``forward``, ``optimizer``) above
            the peers' longest one in the same window. Peers that wait for a stalled rank
            in a collective show the stall in their step and communication time too, so
            only phases that cannot contain waiting localise it.
        stall_min_ratio: smallest ratio of that longest occurrence to the peers' one.
        stall_outside_min_steps: smallest stall *outside* every phase, in job median steps.
            Lower than ``stall_min_steps``: the phases account for a step, so a gap between
            them that the peers demonstrably waited for in their collective (required as
            well) is a stall whatever its length; its cost decides whether it is raised.
        clock_min_drop: smallest relative SM clock drop for ``gpu_health``.
        min_ranks: fewest ranks for cross-rank tests.
        major_share: compute classes below this share of compute time are tested pooled.
        reference_ranks: above twice this many ranks, the cross-rank centre and scale are
            estimated from about this many ranks (chosen by a hash of the rank id).
        workers: threads testing disjoint blocks of metrics (results do not depend on it).
        hang_steps: ``hang``: no progress for this many usual steps ...
        hang_min_s: ... and for at least this many seconds (``rules/hang.py``).
        min_slowdown: smallest cost (what-if slowdown of the job's step) a finding needs to
            be raised at all; kinds without a cost model (``rank_missing``, ``hang``) are
            always raised.
        structure_min_slowdown: the same for ``stage_imbalance``: healthy pipelines are
            unbalanced by design (embedding, loss head: a few % of a step), and moving
            layers pays only from about this much.
        structure_warning_slowdown: a ``stage_imbalance`` costing less is ``info``, not a
            warning. Its cost is the ideal re-partitioning (every stage the stages' mean
            work, the waits unchanged), an upper bound: whole layers move, and balanced
            stages wait on each other more. On the real pipeline job (tests/data/
            real_pipeline) a loss head one block in six heavier was costed 1.05-1.08x and
            spreading it evenly saved 1.02-1.03x measured; a stage twice the others' was
            costed 1.24-1.39x and an even partition saved 1.10-1.16x.
        imbalance_min_slowdown: the same for ``workload_imbalance``: ranks finishing at
            different times cost every synchronous job some of its step (kernel and
            sequence-length jitter grow the expected latest arrival like the square root of
            the log of the rank count: ~8% at 4,096 ranks with 3% jitter); it is raised
            when it costs more than that.
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
    stall_outside_min_steps: float = 0.25
    clock_min_drop: float = 0.03
    min_ranks: int = 4
    major_share: float = 0.01
    reference_ranks: int = 2048
    workers: int = 2
    hang_steps: float = 10.0
    hang_min_s: float = 10.0
    min_slowdown: float = 1.02
    structure_min_slowdown: float = 1.05
    structure_warning_slowdown: float = 1.10
    imbalance_min_slowdown: float = 1.2

    def min_slowdown_for(self, kind: str) -> float:
        """The smallest cost at which a finding of ``kind`` is raised (its rule module
        declares which field holds its bar: ``Kind.raise_bar``)."""
        from stepwatch.detectors.analysis import rules  # the rules import this module

        return max(self.min_slowdown, float(getattr(self, rules.registry().kind(kind).raise_bar)))

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
        if not (self.hang_steps > 0 and self.hang_min_s >= 0):
            raise ConfigError("hang_steps/hang_min_s: need > 0 and >= 0")
        for name in ("min_slowdown", "structure_min_slowdown", "imbalance_min_slowdown"):
            if not getattr(self, name) >= 1.0:
                raise ConfigError(f"{name}: must be >= 1.0, got {getattr(self, name)}")
        if not self.structure_warning_slowdown >= self.structure_min_slowdown:
            raise ConfigError(
                "structure_warning_slowdown: must be >= structure_min_slowdown, got "
                f"{self.structure_warning_slowdown}"
            )
