"""The seeded scenario suite the detectors are scored on (``bench/score_suite.py``).

Every fault kind at severities from 5% to 3x on jobs of 8 to 4,096 ranks, plus clean runs.
Scenario ``i`` is a pure function of ``(i, seed)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stepwatch.core._schema import DIAGNOSIS_KINDS
from stepwatch.detectors.simulation._job import SimulatedJob
from stepwatch.detectors.simulation._simulate import simulate
from stepwatch.detectors.simulation._topology import Topology
from stepwatch.detectors.simulation._truth import Fault

FAULT_KINDS = DIAGNOSIS_KINDS
SEVERITIES = (1.05, 1.1, 1.2, 1.5, 2.0, 3.0)
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 1024, 4096)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One simulated job of the suite."""

    index: int
    kind: str | None  # None = clean run
    world_size: int
    topology: Topology
    severity: float
    seed: int
    steps: int = 400
    onset_step: int = 200
    steps_per_window: int = 5

    @property
    def name(self) -> str:
        what = self.kind or "clean"
        return f"{self.index:03d}-{what}-{self.world_size}r-{self.severity:g}"

    def faults(self) -> list[Fault]:
        if self.kind is None:
            return []
        rng = np.random.default_rng(self.seed + 7919)
        world = self.world_size
        if self.kind == "pipeline_bubble":
            stage_size = self.topology.dp * self.topology.tp
            stage = int(rng.integers(0, self.topology.pp))
            ranks = tuple(range(stage * stage_size, (stage + 1) * stage_size))
        elif self.kind == "job_regression":
            ranks = ()
        elif self.kind == "dataloader_stall" and world >= 64:
            ranks = tuple(sorted(int(r) for r in rng.choice(world, size=2, replace=False)))
        else:
            ranks = (int(rng.integers(0, world)),)
        kernel = None
        if self.kind in ("compute_straggler", "job_regression"):
            kernel = ("gemm", "flash_attention")[self.index % 2]
        severity = 1.0 if self.kind == "rank_missing" else self.severity
        return [
            Fault(
                kind=self.kind,
                start_step=self.onset_step,
                ranks=ranks,
                severity=severity,
                kernel_class=kernel,
            )
        ]

    def simulate(self) -> SimulatedJob:
        return simulate(
            self.world_size,
            steps=self.steps,
            topology=self.topology,
            faults=self.faults(),
            seed=self.seed,
            job=f"suite-{self.name}",
            steps_per_window=self.steps_per_window,
        )


def _topology(world: int, kind: str | None, index: int) -> Topology:
    if kind == "pipeline_bubble" or (index % 3 == 0 and world >= 32):
        pp = 4
        tp = 2 if world >= 32 else 1
        return Topology(world // (pp * tp), tp, pp)
    return Topology(world)


def suite(count: int = 228, *, seed: int = 2026, max_world_size: int = 4096) -> list[Scenario]:
    """``count`` scenarios: fault kinds round-robin with one clean run in every 8."""
    scenarios = []
    kind_index = 0
    for index in range(count):
        kind: str | None
        if index % 8 == 7:
            kind = None
        else:
            kind = FAULT_KINDS[kind_index % len(FAULT_KINDS)]
            kind_index += 1
        sizes = [w for w in WORLD_SIZES if w <= max_world_size]
        if kind == "link_degradation":
            sizes = [w for w in sizes if w >= 32] or [32]
        world = sizes[(index * 5 + index // 8) % len(sizes)]
        severity = SEVERITIES[(index // len(FAULT_KINDS)) % len(SEVERITIES)]
        scenarios.append(
            Scenario(
                index=index,
                kind=kind,
                world_size=world,
                topology=_topology(world, kind, index),
                severity=severity,
                seed=seed * 1000 + index,
            )
        )
    return scenarios
