"""A seeded simulator of a synchronous data/tensor/pipeline-parallel training job.

It produces per-step, per-rank timings with the structure real jobs have and injects the
faults of the diagnosis taxonomy, with a ground truth that includes each fault's cost. The
same run can be analysed in memory (:meth:`SimulatedJob.frame`) or, window by window as
each rank's exporter saw it (:meth:`SimulatedJob.observed`), replayed by the app through
the real exporter and bridge code into InfluxDB or over OTLP (``stepwatch simulate``).

What real jobs have and the model has (the timing itself is :mod:`._timeline`):

* a gradient all-reduce every rank waits in, 1F1B pipelines paced by their slowest stage;
* per-kernel noise, a static rank-to-rank spread, hosts of 8 ranks;
* sequence-length noise: each data-parallel replica's work varies from step to step (its
  ranks process the same micro-batches), so the slowest replica keeps changing;
* stage-dependent work (``stage_work``: real first and last stages hold the embedding and
  the loss head);
* GC pauses and checkpoint writes *between* phases (``gc_rate``, ``checkpoint_every``).

Each fault's ground-truth cost is the same job simulated without it (the same draws:
:attr:`TruthFault.slowdown`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from stepwatch.core._errors import ConfigError
from stepwatch.detectors.simulation._faults import Draws, Effect, apply_fault, fault_truth
from stepwatch.detectors.simulation._job import SimulatedJob
from stepwatch.detectors.simulation._timeline import Parts, Timings, timeline
from stepwatch.detectors.simulation._topology import Topology, host_of
from stepwatch.detectors.simulation._truth import Fault, Truth

DEFAULT_START_UNIX_NANO = 1_795_291_200_000_000_000  # 2026-11-21T20:00:00Z, window-aligned

# (class, category, phase, seconds per step, executions per step)
_BASE_KERNELS: tuple[tuple[str, str, str, float, int], ...] = (
    ("gemm", "compute", "fwdbwd", 0.30, 4),
    ("flash_attention", "compute", "fwdbwd", 0.12, 2),
    ("layernorm", "compute", "fwdbwd", 0.03, 2),
    ("elementwise", "memory", "fwdbwd", 0.05, 2),
    ("memcpy", "memory", "fwdbwd", 0.02, 1),
    ("adam", "compute", "optimizer", 0.04, 1),
    ("other", "other", "other", 0.01, 1),
    ("nccl_allreduce", "communication", "communication", 0.15, 1),
)
_SENDRECV = ("nccl_sendrecv", "communication", "fwdbwd", 0.02, 2)
_PHASES = ("data", "forward", "backward", "optimizer", "communication", "other")


def simulate(
    world_size: int,
    *,
    steps: int,
    topology: Topology | None = None,
    faults: Sequence[Fault] = (),
    seed: int = 0,
    job: str = "sim",
    steps_per_window: int = 5,
    step_s: float = 1.0,
    start_unix_nano: int = DEFAULT_START_UNIX_NANO,
    kernel_classes: int = 8,
    sequence_noise: float = 0.05,
    microbatches: int = 8,
    stage_work: Sequence[float] | None = None,
    gc_rate: float = 0.0,
    checkpoint_every: int = 0,
    communication_phase: bool = True,
    device_metrics: bool = True,
) -> SimulatedJob:
    """Simulate ``steps`` steps of a job of ``world_size`` ranks.

    Args:
        world_size: number of ranks.
        steps: number of training steps.
        topology: ``DP x TP x PP``; ``world_size x 1 x 1`` when omitted.
        faults: faults to inject.
        seed: seed of every random draw.
        job: the job id.
        steps_per_window: steps per export window; the window is ``steps_per_window *
            step_s`` seconds long on the simulated clock.
        step_s: nominal step time (the whole model is scaled so a healthy step takes about
            this long).
        start_unix_nano: start of the first window (align it on the window length).
        kernel_classes: number of kernel classes (at least the 8 built-in ones; extra
            small compute classes ``k08``, ``k09``, ... are added up to this count).
        sequence_noise: log-sd of each replica's per-step work (sequence lengths; the
            replica's ranks share it).
        microbatches: micro-batches per step (1F1B pipeline).
        stage_work: forward and backward work of each pipeline stage, relative (``pp``
            values; ``None``: every stage alike). Structure, not a fault.
        gc_rate: probability per rank and step of a short pause between phases (a GC
            pause of about 3% of a step, exponential).
        checkpoint_every: every so many steps every rank pauses 30% of a step between
            phases (a checkpoint write; 0: never).
        communication_phase: record the all-reduce (its wait and transfer) as its own
            phase ``communication``, as stepwatch's exporter does; ``False``: inside
            ``backward``, as producers that time ``loss.backward()`` record it (Lightning
            and HF timers, a hand-written ``with phase("backward")``, a device timer).
        device_metrics: report kernel times, device idle and the SM clock; ``False``: a
            producer of step and phase times only (the stock OpenTelemetry SDK, framework
            timers).

    Raises:
        ConfigError: inconsistent arguments (named).
    """
    topology = topology or Topology(world_size)
    _check(
        world_size,
        topology,
        steps=steps,
        steps_per_window=steps_per_window,
        microbatches=microbatches,
        stage_work=stage_work,
        gc_rate=gc_rate,
        faults=faults,
    )
    rng = np.random.default_rng(seed)
    classes = _Classes.of(topology, kernel_classes, scale=step_s / 0.85)
    shape = (steps, world_size)
    ranks = np.arange(world_size)
    hosts = tuple(host_of(int(rank)) for rank in ranks)
    pp_ranks = ranks // (topology.dp * topology.tp)
    draws = _draw(
        rng,
        classes,
        topology,
        shape,
        pp_ranks=pp_ranks,
        step_s=step_s,
        sequence_noise=sequence_noise,
        stage_work=stage_work,
        gc_rate=gc_rate,
        checkpoint_every=checkpoint_every,
    )
    # Each fault draws from its own generator: removing one leaves the others' draws alone.
    effects = [
        apply_fault(draws, fault, np.random.default_rng([seed, index]))
        for index, fault in enumerate(faults)
    ]
    actual = draws.parts
    for effect in effects:
        actual = effect.apply(actual)
    timings = timeline(actual, topology, microbatches=microbatches)
    truths = [
        fault_truth(
            fault,
            effect,
            timings.job_step(actual),
            _step_without(draws, effects, index, microbatches),
            hosts=hosts,
            start_unix_nano=start_unix_nano,
            steps_per_window=steps_per_window,
            step_s=step_s,
        )
        for index, (fault, effect) in enumerate(zip(faults, effects, strict=True))
    ]
    if not device_metrics:  # a kernel class the producer does not report cannot be named
        truths = [dataclasses.replace(item, kernel_class=None) for item in truths]
    kernel = draws.kernel
    kernel[..., classes.allreduce] = timings.communication
    if "nccl_sendrecv" in classes.names:
        kernel[..., classes.names.index("nccl_sendrecv")] += timings.p2p_wait
    n_windows = -(-steps // steps_per_window)
    jitter = rng.uniform(-0.2, 0.2, size=(n_windows, world_size)) * steps_per_window * step_s
    truth = Truth(
        job=job,
        world_size=world_size,
        topology=str(topology),
        seed=seed,
        window_s=steps_per_window * step_s,
        steps_per_window=steps_per_window,
        start_unix_nano=start_unix_nano,
        end_unix_nano=start_unix_nano + n_windows * round(steps_per_window * step_s * 1e9),
        faults=tuple(truths),
    )
    phase_names, phases = _phases(timings, communication_phase=communication_phase)
    return SimulatedJob(
        truth=truth,
        topology=topology,
        hosts=hosts,
        pp_ranks=pp_ranks,
        kernel_classes=classes.names,
        kernel_categories=classes.categories,
        kernel_calls=classes.calls,
        phases=phase_names,
        step_s=timings.step,
        phase_s=phases,
        kernel_s=kernel,
        idle_s=timings.idle,
        sm_clock_hz=draws.clock,
        alive=actual.alive,
        export_jitter_s=jitter,
        device_metrics=device_metrics,
    )


def _check(
    world_size: int,
    topology: Topology,
    *,
    steps: int,
    steps_per_window: int,
    microbatches: int,
    stage_work: Sequence[float] | None,
    gc_rate: float,
    faults: Sequence[Fault],
) -> None:
    """Raise :class:`ConfigError` naming the first inconsistent argument of :func:`simulate`."""
    if topology.world_size != world_size:
        raise ConfigError(f"topology: {topology} has {topology.world_size} ranks, not {world_size}")
    for name, value in (
        ("steps", steps),
        ("steps_per_window", steps_per_window),
        ("microbatches", microbatches),
    ):
        if value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")
    if stage_work is not None and (
        len(stage_work) != topology.pp or min(stage_work, default=1.0) <= 0
    ):
        raise ConfigError(f"stage_work: need {topology.pp} positive values, got {stage_work}")
    if not 0.0 <= gc_rate <= 1.0:
        raise ConfigError(f"gc_rate: must be in [0, 1], got {gc_rate}")
    for fault in faults:
        for rank in fault.ranks:
            if not 0 <= rank < world_size:
                raise ConfigError(f"fault: rank {rank} outside 0..{world_size - 1}")


@dataclasses.dataclass(frozen=True)
class _Classes:
    """The simulated kernel classes: names, categories, where they run, time and calls."""

    names: tuple[str, ...]
    categories: tuple[str, ...]
    placement: tuple[str, ...]
    base: np.ndarray  # seconds per step, scaled to the nominal step
    calls: tuple[int, ...]
    scale: float

    @classmethod
    def of(cls, topology: Topology, kernel_classes: int, *, scale: float) -> _Classes:
        specs = list(_BASE_KERNELS)
        if topology.pp > 1:
            specs.append(_SENDRECV)
        for index in range(len(specs), kernel_classes):
            specs.append((f"k{index:02d}", "compute", "fwdbwd", 0.002, 1))
        return cls(
            names=tuple(spec[0] for spec in specs),
            categories=tuple(spec[1] for spec in specs),
            placement=tuple(spec[2] for spec in specs),
            base=np.array([spec[3] for spec in specs]) * scale,
            calls=tuple(spec[4] for spec in specs),
            scale=scale,
        )

    @property
    def allreduce(self) -> int:
        return self.names.index("nccl_allreduce")


def _draw(
    rng: np.random.Generator,
    classes: _Classes,
    topology: Topology,
    shape: tuple[int, int],
    *,
    pp_ranks: np.ndarray,
    step_s: float,
    sequence_noise: float,
    stage_work: Sequence[float] | None,
    gc_rate: float,
    checkpoint_every: int,
) -> Draws:
    """The healthy job's random draws (in this order: the seed's stream depends on it)."""
    steps, world_size = shape
    scale = classes.scale
    replicas = (np.arange(world_size) // topology.tp) % topology.dp
    fwdbwd = np.array([p == "fwdbwd" for p in classes.placement])
    compute = np.array([c == "compute" for c in classes.categories])
    static = np.exp(rng.normal(0.0, 0.005, size=world_size))
    # Sequence lengths: one draw per step and replica, shared by the replica's ranks.
    sequence = np.exp(rng.normal(0.0, sequence_noise, size=(steps, topology.dp)))[:, replicas]
    kernel = classes.base * np.exp(rng.normal(0.0, 0.02, size=(*shape, len(classes.names))))
    structure = np.ones(world_size)
    if stage_work is not None:
        structure = np.asarray(stage_work, dtype=np.float64)[pp_ranks]
    work_factor = sequence * structure[None, :]
    kernel *= np.where(fwdbwd, 1.0, 0.0) * work_factor[..., None] + np.where(fwdbwd, 0.0, 1.0)
    kernel *= np.where(compute, 1.0, 0.0) * static[None, :, None] + np.where(compute, 0.0, 1.0)
    kernel[..., classes.allreduce] = 0.0  # wait + transfer, filled in by the timeline
    gap = 0.03 * scale * np.exp(rng.normal(0.0, 0.1, size=shape))
    data = 0.03 * scale * np.exp(rng.normal(0.0, 0.1, size=shape))
    transfer = classes.base[classes.allreduce] * np.exp(rng.normal(0.0, 0.03, size=shape))
    clock = 1.41e9 * np.exp(rng.normal(0.0, 0.002, size=shape))
    pause = np.zeros(shape)
    if gc_rate > 0:
        struck = rng.random(shape) < gc_rate
        pause = pause + np.where(struck, rng.exponential(0.03 * step_s, size=shape), 0.0)
    if checkpoint_every > 0:
        pause[checkpoint_every - 1 :: checkpoint_every] += 0.3 * step_s
    return Draws(
        classes=tuple(zip(classes.names, classes.categories, classes.placement, strict=True)),
        kernel=kernel,
        parts=Parts(
            data=data,
            work=kernel[..., fwdbwd].sum(axis=2),
            gap=gap,
            optimizer=kernel[..., classes.names.index("adam")] + 0.005 * scale,
            other=kernel[..., classes.names.index("other")],
            transfer=transfer,
            extra_bubble=np.zeros(shape),
            pause=pause,
            alive=np.ones(shape, dtype=bool),
        ),
        clock=clock,
        sequence=sequence,
        topology=topology,
        step_s=step_s,
        fwdbwd_nominal=float(classes.base[fwdbwd].sum()) + 0.03 * scale,
    )


def _without(draws: Draws, effects: Sequence[Effect], index: int) -> Parts:
    """The job's parts with every fault but ``index`` applied, and its counterfactual."""
    without = draws.parts
    for other, other_effect in enumerate(effects):
        if other != index:
            without = other_effect.apply(without)
    counterfactual = effects[index].counterfactual
    return without if counterfactual is None else counterfactual(without)


def _step_without(
    draws: Draws, effects: Sequence[Effect], index: int, microbatches: int
) -> np.ndarray:
    """The job's step times without fault ``index`` (its ground-truth counterfactual)."""
    without = _without(draws, effects, index)
    return timeline(without, draws.topology, microbatches=microbatches).job_step(without)


def _phases(timings: Timings, *, communication_phase: bool) -> tuple[tuple[str, ...], np.ndarray]:
    """The phase names and their ``(steps, ranks, phases)`` times, as the producer records."""
    columns = {
        "data": timings.data,
        "forward": timings.forward,
        "backward": timings.backward,
        "optimizer": timings.optimizer,
        "communication": timings.communication,
        "other": timings.other,
    }
    if not communication_phase:  # the all-reduce inside the backward timer
        columns["backward"] = columns["backward"] + columns.pop("communication")
    phase_names = tuple(name for name in _PHASES if name in columns)
    return phase_names, np.stack([columns[name] for name in phase_names], axis=-1)
