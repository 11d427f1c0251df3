"""The seeded scenario suite the detectors are scored on (``bench/score_suite.py``).

Every simulated fault kind at severities from 5% to 3x on jobs of 8 to 4,096 ranks, plus
clean runs, plus the three jobs of issue 11 (:func:`issue_scenarios`). Every job, clean or
not, has what real jobs have: sequence-length noise, GC pauses and checkpoint writes between
phases, and on pipelines heavier first and last stages (embedding, loss head). Scenario
``i`` is a pure function of ``(i, seed)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stepwatch.detectors.simulation._job import SimulatedJob
from stepwatch.detectors.simulation._simulate import simulate
from stepwatch.detectors.simulation._topology import Topology
from stepwatch.detectors.simulation._truth import OUTSIDE, SIMULATED_KINDS, Fault

FAULT_KINDS = SIMULATED_KINDS
#: Who records the job, and the fault kinds its data can tell apart:
#:
#: * ``stepwatch``: stepwatch's exporter: the all-reduce is its own phase
#:   ``communication``, kernel times, device idle and the SM clock (every kind);
#: * ``backward-timer``: the all-reduce and the wait in it inside ``backward`` (a device
#:   timer over ``loss.backward()``), kernel times still reported;
#: * ``phase-timer``: step and phase times only, the all-reduce inside ``backward`` (the
#:   stock OpenTelemetry SDK with Lightning or HF timers, or a hand-written
#:   ``with phase("backward")``). Without kernel times a slow device (``compute_straggler``,
#:   ``gpu_health``) looks like a slow host (``masked_straggler``), without device idle
#:   short stalls *inside* forward look like a slow forward (``masked_straggler``; its
#:   ``jit_stall`` scenarios stall between phases), and the stages of a pipeline wait for a
#:   slow one inside forward and backward alike: those are left out of its scores. (A
#:   slow link is found by the step of the ranks that finish the transfer late; a rank
#:   that only *reaches* the collective late from inside backward, or a slow backward,
#:   holds every rank in backward alike and is a job-level change.)
PRODUCERS: dict[str, tuple[str, ...]] = {
    "stepwatch": FAULT_KINDS,
    "backward-timer": (
        "masked_straggler",
        "compute_straggler",
        "gpu_health",
        "dataloader_stall",
        "jit_stall",
        "link_degradation",
        "rank_missing",
        "job_regression",
    ),
    "phase-timer": (
        "masked_straggler",
        "dataloader_stall",
        "jit_stall",
        "link_degradation",
        "rank_missing",
        "job_regression",
    ),
}
SEVERITIES = (1.05, 1.1, 1.2, 1.5, 2.0, 3.0)
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 1024, 4096)
#: Structure of a healthy pipeline: the first stage holds the embedding, the last the
#: loss head (~7% more work, as in issue 11's Megatron job).
FIRST_STAGE_WORK = 1.05
LAST_STAGE_WORK = 1.07


def stage_work(pp: int) -> tuple[float, ...] | None:
    """The healthy structure of a ``pp``-stage pipeline (``None`` without one)."""
    if pp < 2:
        return None
    return (FIRST_STAGE_WORK, *([1.0] * (pp - 2)), LAST_STAGE_WORK)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One simulated job of the suite.

    Attributes:
        producer: what records the job (:data:`PRODUCERS`).
        faults_given: faults to inject instead of the one drawn from ``kind`` (issue
            scenarios).
        title: what the scenario reproduces (issue scenarios).
    """

    index: int
    kind: str | None  # None = clean run
    world_size: int
    topology: Topology
    severity: float
    seed: int
    steps: int = 400
    onset_step: int = 200
    steps_per_window: int = 5
    sequence_noise: float = 0.03
    gc_rate: float = 0.01
    checkpoint_every: int = 100
    faults_given: tuple[Fault, ...] | None = None
    title: str = ""
    producer: str = "stepwatch"

    @property
    def name(self) -> str:
        if self.title:
            return f"{self.index:03d}-{self.title}"
        what = self.kind or "clean"
        by = "" if self.producer == "stepwatch" else f"-{self.producer}"
        return f"{self.index:03d}-{what}-{self.world_size}r-{self.severity:g}{by}"

    def faults(self) -> list[Fault]:
        if self.faults_given is not None:
            return list(self.faults_given)
        if self.kind is None:
            return []
        rng = np.random.default_rng(self.seed + 7919)
        world = self.world_size
        stage_size = self.topology.dp * self.topology.tp
        onset = self.onset_step
        phase = None
        if self.kind in ("pipeline_bubble", "stage_imbalance"):
            stage = int(rng.integers(0, self.topology.pp))
            ranks = tuple(range(stage * stage_size, (stage + 1) * stage_size))
            if self.kind == "stage_imbalance":
                onset = 0  # partitioning is there from the first step
        elif self.kind in ("job_regression", "workload_imbalance"):
            ranks = ()
        elif self.kind == "dataloader_stall" and world >= 64:
            ranks = tuple(sorted(int(r) for r in rng.choice(world, size=2, replace=False)))
        else:
            ranks = (int(rng.integers(0, world)),)
        if self.kind == "jit_stall" and (self.index % 2 or self.producer == "phase-timer"):
            phase = OUTSIDE  # the masked form: a stall between phases
        kernel = None
        if self.kind in ("compute_straggler", "job_regression"):
            kernel = ("gemm", "flash_attention")[self.index % 2]
        severity = 1.0 if self.kind == "rank_missing" else self.severity
        return [
            Fault(
                kind=self.kind,
                start_step=onset,
                ranks=ranks,
                severity=severity,
                kernel_class=kernel,
                phase=phase,
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
            sequence_noise=self.sequence_noise,
            stage_work=stage_work(self.topology.pp),
            gc_rate=self.gc_rate,
            checkpoint_every=self.checkpoint_every,
            communication_phase=self.producer == "stepwatch",
            device_metrics=self.producer != "phase-timer",
        )


def _topology(world: int, kind: str | None, index: int) -> Topology:
    pipeline = kind in ("pipeline_bubble", "stage_imbalance")
    if pipeline or (index % 3 == 0 and world >= 32):
        pp = 4
        tp = 2 if world >= 32 else 1
        return Topology(world // (pp * tp), tp, pp)
    return Topology(world)


def suite(count: int = 228, *, seed: int = 2026, max_world_size: int = 4096) -> list[Scenario]:
    """``count`` scenarios: fault kinds round-robin with one clean run in every 8, then the
    issue's three jobs (:func:`issue_scenarios`)."""
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
    return [*scenarios, *issue_scenarios(start=count, seed=seed)]


def issue_scenarios(*, start: int = 0, seed: int = 2026) -> list[Scenario]:
    """The three jobs issue 11 reports stepwatch got wrong, as seeded scenarios.

    1. 64 ranks, dp 4 x pp 4 x tp 4: one worker (dp 0, stage 0: ranks 0-3) computes ~2.5x
       slower than the other workers of its stage (gemm 3.2x), from the first step; the
       last stage does 7% more work by design. The job's step is ~2x what it would be.
    2. 8 ranks, dp 2 x pp 4: the last stage holds more layers (1.35x the forward and
       backward work of the others) on both replicas; the job loses ~18%.
    3. 128 ranks, dp 32 x tp 2 x pp 2: variable sequence lengths (each replica's work
       spread with log-sd log 1.37); the slowest replica changes every step; the
       imbalance costs ~1.5x.
    """
    seed = seed * 1000 + 900
    worker = Fault("compute_straggler", 0, (0, 1, 2, 3), 3.2, kernel_class="gemm")
    jobs = [
        (64, Topology(4, 4, 4), worker, "issue11-64r-dp4pp4tp4-worker"),
        (8, Topology(2, 1, 4), Fault("stage_imbalance", 0, (6, 7), 1.35),
         "issue11-8r-dp2pp4-last-stage"),
        (128, Topology(32, 2, 2), Fault("workload_imbalance", 0, (), 1.37),
         "issue11-128r-dp32pp2-sequences"),
    ]  # fmt: skip
    return [
        Scenario(
            index=start + offset,
            kind=fault.kind,
            world_size=world,
            topology=topology,
            severity=fault.severity,
            seed=seed,
            steps=300,
            faults_given=(fault,),
            title=title,
        )
        for offset, (world, topology, fault, title) in enumerate(jobs)
    ]


def producer_scenarios(
    count: int = 64, *, start: int = 0, seed: int = 2026, max_world_size: int = 4096
) -> list[Scenario]:
    """``count`` scenarios recorded without a communication phase: the producers other than
    stepwatch (:data:`PRODUCERS`) in turn, their kinds round-robin, one clean run in every 4;
    ``phase-timer`` jobs are data-parallel only (see :data:`PRODUCERS`).
    """
    scenarios = []
    producers = [name for name in PRODUCERS if name != "stepwatch"]
    turns = dict.fromkeys(producers, 0)
    sizes = [w for w in WORLD_SIZES if w <= max_world_size]
    for offset in range(count):
        producer = producers[offset % len(producers)]
        kinds = PRODUCERS[producer]
        turn = turns[producer]
        turns[producer] += 1
        kind: str | None = None if turn % 4 == 3 else kinds[(turn - turn // 4) % len(kinds)]
        choices = sizes
        if kind == "link_degradation":
            choices = [w for w in sizes if w >= 32] or [32]
        world = choices[(offset * 3 + offset // 7) % len(choices)]
        index = start + offset
        # Phase times alone cannot single out a stage of a pipeline (its stages wait for
        # each other inside forward and backward alike): those are data-parallel jobs.
        topology = _topology(world, kind, index) if producer != "phase-timer" else Topology(world)
        scenarios.append(
            Scenario(
                index=index,
                kind=kind,
                world_size=world,
                topology=topology,
                severity=SEVERITIES[(offset // 5) % len(SEVERITIES)],
                seed=seed * 1000 + 500 + offset,
                producer=producer,
            )
        )
    return scenarios
