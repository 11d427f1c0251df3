"""A seeded simulator of a synchronous data/tensor/pipeline-parallel training job.

It produces per-step, per-rank timings with the structure real jobs have (a gradient
all-reduce every rank waits in, 1F1B pipeline bubbles, per-kernel noise, a static rank-to-rank
spread, sequence-length noise that moves from rank to rank every step, hosts of 8 ranks) and
injects the faults of the diagnosis taxonomy, with a ground truth. The same run can be
analysed in memory (:meth:`SimulatedJob.frame`) or, window by window as each rank's exporter
saw it (:meth:`SimulatedJob.observed`), replayed by the app through the real exporter and
bridge code into InfluxDB or over OTLP (``stepwatch simulate``).

Model per step (seconds, before noise): forward/backward kernels split 1:2, host launch gaps,
data loading (device idle), pipeline bubble ``(pp-1)/(m+pp-1)`` of the compute (device idle),
arrival at the all-reduce = data + forward + backward, every rank waits for the last arrival
(NCCL kernels spin, so the wait counts as communication kernel time), then the transfer over
the rank's own link and the optimizer. Simplification: a degraded link's extra transfer time
is charged to the ranks behind that link only, and steps do not carry delays into the next.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stepwatch.core._errors import ConfigError
from stepwatch.detectors.simulation._job import SimulatedJob
from stepwatch.detectors.simulation._topology import RANKS_PER_HOST, Topology, host_of
from stepwatch.detectors.simulation._truth import Fault, Truth, TruthFault

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
#: Kinds whose fault names a kernel class (default ``gemm``).
_KERNEL_KINDS = ("compute_straggler", "job_regression")


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
        sequence_noise: log-sd of the per-step, per-rank compute noise (sequence lengths).
        microbatches: micro-batches per step (pipeline bubble fraction).

    Raises:
        ConfigError: inconsistent arguments (named).
    """
    topology = topology or Topology(world_size)
    if topology.world_size != world_size:
        raise ConfigError(f"topology: {topology} has {topology.world_size} ranks, not {world_size}")
    if steps < 1:
        raise ConfigError(f"steps: must be >= 1, got {steps}")
    if steps_per_window < 1:
        raise ConfigError(f"steps_per_window: must be >= 1, got {steps_per_window}")
    for fault in faults:
        for rank in fault.ranks:
            if not 0 <= rank < world_size:
                raise ConfigError(f"fault: rank {rank} outside 0..{world_size - 1}")
    rng = np.random.default_rng(seed)
    specs = list(_BASE_KERNELS)
    if topology.pp > 1:
        specs.append(_SENDRECV)
    for index in range(len(specs), kernel_classes):
        specs.append((f"k{index:02d}", "compute", "fwdbwd", 0.002, 1))
    scale = step_s / 0.85
    names = tuple(spec[0] for spec in specs)
    categories = tuple(spec[1] for spec in specs)
    placement = [spec[2] for spec in specs]
    base = np.array([spec[3] for spec in specs]) * scale
    calls = tuple(spec[4] for spec in specs)
    n_kernels = len(specs)
    shape = (steps, world_size)
    ranks = np.arange(world_size)
    hosts = tuple(host_of(int(rank)) for rank in ranks)
    host_index = ranks // RANKS_PER_HOST
    pp_ranks = ranks // (topology.dp * topology.tp)

    fwdbwd = np.array([p == "fwdbwd" for p in placement])
    compute = np.array([c == "compute" for c in categories])
    static = np.exp(rng.normal(0.0, 0.005, size=world_size))
    sequence = np.exp(rng.normal(0.0, sequence_noise, size=shape))
    kernel = base * np.exp(rng.normal(0.0, 0.02, size=(*shape, n_kernels)))
    kernel *= np.where(fwdbwd, 1.0, 0.0) * sequence[..., None] + np.where(fwdbwd, 0.0, 1.0)
    kernel *= np.where(compute, 1.0, 0.0) * static[None, :, None] + np.where(compute, 0.0, 1.0)
    allreduce = names.index("nccl_allreduce")
    kernel[..., allreduce] = 0.0  # wait + transfer, filled in below
    host_gap = 0.03 * scale * np.exp(rng.normal(0.0, 0.1, size=shape))
    data = 0.03 * scale * np.exp(rng.normal(0.0, 0.1, size=shape))
    transfer = base[allreduce] * np.exp(rng.normal(0.0, 0.03, size=shape))
    clock = 1.41e9 * np.exp(rng.normal(0.0, 0.002, size=shape))
    extra_bubble = np.zeros(shape)
    alive = np.ones(shape, dtype=bool)
    step_index = np.arange(steps)[:, None]
    window_ns = round(steps_per_window * step_s * 1e9)
    truths: list[TruthFault] = []
    fwdbwd_nominal = float(base[fwdbwd].sum()) + 0.03 * scale

    for fault in faults:
        stop = fault.end_step if fault.end_step is not None else steps
        onset_step = fault.start_step
        when = (step_index >= fault.start_step) & (step_index < stop)
        rank_mask = np.zeros(world_size, dtype=bool)
        rank_mask[list(fault.ranks)] = True
        if fault.kind == "job_regression" or not fault.ranks:
            rank_mask[:] = True
        kernel_class = None
        phase = None
        hit = when & rank_mask[None, :]
        if fault.kind in _KERNEL_KINDS:
            kernel_class = fault.kernel_class or "gemm"
            if kernel_class not in names:
                raise ConfigError(f"fault: unknown kernel class {kernel_class!r}")
            kernel[..., names.index(kernel_class)] *= np.where(hit, fault.severity, 1.0)
            phase = "backward"
        elif fault.kind == "gpu_health":
            kernel[..., compute] *= np.where(hit, fault.severity, 1.0)[..., None]
            clock = clock / np.where(hit, fault.severity, 1.0)
        elif fault.kind == "masked_straggler":
            host_gap = host_gap + np.where(hit, (fault.severity - 1.0) * fwdbwd_nominal, 0.0)
            phase = "backward"
        elif fault.kind == "dataloader_stall":
            data = data + np.where(hit, (fault.severity - 1.0) * step_s, 0.0)
            phase = "data"
        elif fault.kind == "jit_stall":
            stalls = hit & (rng.random(shape) < 0.1)
            host_gap = host_gap + np.where(stalls, 10.0 * (fault.severity - 1.0) * step_s, 0.0)
            phase = "forward"
            stalled_steps = np.flatnonzero(stalls.any(axis=1))
            if stalled_steps.size:  # random stalls: the slowdown begins with the first one
                onset_step = int(stalled_steps[0])
        elif fault.kind == "pipeline_bubble":
            extra_bubble = extra_bubble + np.where(
                hit, (fault.severity - 1.0) * fwdbwd_nominal, 0.0
            )
        elif fault.kind == "link_degradation":
            degraded = np.isin(host_index, host_index[rank_mask])
            rank_mask = degraded
            hit = when & rank_mask[None, :]
            transfer = transfer * np.where(hit, fault.severity, 1.0)
        elif fault.kind == "rank_missing":
            alive &= ~hit
        fault_ranks = tuple(int(r) for r in np.flatnonzero(rank_mask))
        if fault.kind == "job_regression":
            fault_ranks = ()
        truths.append(
            TruthFault(
                kind=fault.kind,
                ranks=fault_ranks,
                hosts=tuple(sorted({hosts[r] for r in fault_ranks}))
                if fault.kind == "link_degradation"
                else (),
                phase=phase,
                kernel_class=kernel_class,
                severity=fault.severity,
                start_unix_nano=start_unix_nano
                + (onset_step // steps_per_window) * window_ns
                + (onset_step % steps_per_window) * round(step_s * 1e9),
                end_unix_nano=None
                if fault.end_step is None
                else start_unix_nano + fault.end_step * round(step_s * 1e9),
            )
        )

    fwd_share = np.where(fwdbwd, 1.0 / 3.0, 0.0)
    bwd_share = np.where(fwdbwd, 2.0 / 3.0, 0.0)
    forward_kernels = kernel @ fwd_share
    backward_kernels = kernel @ bwd_share
    bubble_fraction = (topology.pp - 1) / (microbatches + topology.pp - 1)
    bubble = bubble_fraction * (forward_kernels + backward_kernels) + extra_bubble
    forward = forward_kernels + bubble / 3.0 + host_gap / 3.0
    backward = backward_kernels + 2.0 * bubble / 3.0 + 2.0 * host_gap / 3.0
    arrival = data + forward + backward
    last_arrival = np.max(np.where(alive, arrival, -np.inf), axis=1, keepdims=True)
    last_arrival = np.where(np.isfinite(last_arrival), last_arrival, arrival)
    communication = (last_arrival - arrival) + transfer
    kernel[..., allreduce] = communication
    optimizer = kernel[..., names.index("adam")] + 0.005 * scale
    other = kernel[..., names.index("other")]
    step = arrival + communication + optimizer + other
    idle = data + bubble + host_gap
    phases = np.stack([data, forward, backward, optimizer, communication, other], axis=-1)
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
        end_unix_nano=start_unix_nano + n_windows * window_ns,
        faults=tuple(truths),
    )
    return SimulatedJob(
        truth=truth,
        topology=topology,
        hosts=hosts,
        pp_ranks=pp_ranks,
        kernel_classes=names,
        kernel_categories=categories,
        kernel_calls=calls,
        phases=_PHASES,
        step_s=step,
        phase_s=phases,
        kernel_s=kernel,
        idle_s=idle,
        sm_clock_hz=clock,
        alive=alive,
        export_jitter_s=jitter,
    )
