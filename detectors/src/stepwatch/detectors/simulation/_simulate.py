"""A seeded simulator of a synchronous data/tensor/pipeline-parallel training job.

It produces per-step, per-rank timings with the structure real jobs have (a gradient
all-reduce every rank waits in, 1F1B pipeline bubbles, per-kernel noise, a static rank-to-rank
spread, sequence-length noise that moves from rank to rank every step, hosts of 8 ranks) and
injects the faults of the diagnosis taxonomy, with a ground truth. The same run can be
analysed in memory (:meth:`SimulatedJob.frame`), written to InfluxDB in exactly the stored
layout (exporters' ``WindowBuilder`` → ``otel_bridge.convert_request``), or sent over OTLP.

Model per step (seconds, before noise): forward/backward kernels split 1:2, host launch gaps,
data loading (device idle), pipeline bubble ``(pp-1)/(m+pp-1)`` of the compute (device idle),
arrival at the all-reduce = data + forward + backward, every rank waits for the last arrival
(NCCL kernels spin, so the wait counts as communication kernel time), then the transfer over
the rank's own link and the optimizer. Simplification: a degraded link's extra transfer time
is charged to the ranks behind that link only, and steps do not carry delays into the next.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stepwatch.core._diagnosis import format_time, parse_time
from stepwatch.core._errors import ConfigError, StepwatchError
from stepwatch.core._schema import DIAGNOSIS_KINDS
from stepwatch.detectors.frame._frame import JobFrame
from stepwatch.detectors.stats._stats import FloatArray

RANKS_PER_HOST = 8
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
_FAULT_RE = re.compile(
    r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<ranks>[^:]*))?(?::(?P<sev>[^:]+))?$"
)

#: Kinds whose fault names a kernel class (default ``gemm``).
_KERNEL_KINDS = ("compute_straggler", "job_regression")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Parallel layout ``DP x TP x PP``; rank = ``pp*(dp*tp) + dp_i*tp + tp_i``."""

    dp: int
    tp: int = 1
    pp: int = 1

    @classmethod
    def parse(cls, text: str) -> Topology:
        parts = text.lower().split("x")
        try:
            numbers = [int(part) for part in parts]
        except ValueError as exc:
            raise ConfigError(f"topology: {text!r} is not DPxTPxPP") from exc
        if not 1 <= len(numbers) <= 3 or min(numbers) < 1:
            raise ConfigError(f"topology: {text!r} is not DPxTPxPP with positive sizes")
        numbers += [1] * (3 - len(numbers))
        return cls(numbers[0], numbers[1], numbers[2])

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp * self.tp)

    def __str__(self) -> str:
        return f"{self.dp}x{self.tp}x{self.pp}"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: ``KIND@STEP:RANKS[:SEVERITY]``.

    Severity is the slowdown factor of the affected component (1.3 = 30% slower): the kernel
    class (stragglers, regressions), the host-side compute time (masked straggler), the link
    (link degradation), the pipeline bubble, the mean step (data-loader and JIT stalls), the
    SM clock (GPU health, inverse). Ignored for ``rank_missing``.
    """

    kind: str
    start_step: int
    ranks: tuple[int, ...] = ()
    severity: float = 1.3
    end_step: int | None = None
    kernel_class: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in DIAGNOSIS_KINDS:
            raise ConfigError(f"fault: kind {self.kind!r} is not one of {DIAGNOSIS_KINDS}")
        if self.severity <= 1.0 and self.kind != "rank_missing":
            raise ConfigError(f"fault: severity must be > 1, got {self.severity}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Parse ``KIND@STEP:RANKS[:SEVERITY]``; RANKS like ``3``, ``3,5``, ``8-15``, ``all``;
        SEVERITY like ``1.3``, ``30%``, ``3x``."""
        match = _FAULT_RE.match(text.strip())
        if match is None:
            raise ConfigError(f"fault: {text!r} is not KIND@STEP:RANKS[:SEVERITY]")
        ranks: list[int] = []
        for item in (match["ranks"] or "").split(","):
            item = item.strip()
            if not item or item == "all":
                continue
            if "-" in item:
                low, high = item.split("-", 1)
                ranks.extend(range(int(low), int(high) + 1))
            elif item.isdigit():
                ranks.append(int(item))
            else:
                raise ConfigError(f"fault: bad rank list in {text!r}")
        severity = 1.3
        if match["sev"]:
            severity = _parse_severity(match["sev"], text)
        return cls(
            kind=match["kind"], start_step=int(match["step"]), ranks=tuple(ranks), severity=severity
        )


def _parse_severity(text: str, context: str) -> float:
    try:
        if text.endswith("%"):
            return 1.0 + float(text[:-1]) / 100.0
        if text.endswith("x"):
            return float(text[:-1])
        return float(text)
    except ValueError as exc:
        raise ConfigError(f"fault: bad severity in {context!r}") from exc


@dataclasses.dataclass(frozen=True)
class TruthFault:
    """A fault as the detectors should report it.

    ``start_unix_nano`` is when the injected effect begins: the fault's step, except for
    ``jit_stall``, whose stalls strike random steps from then on, where it is the first stall
    (nothing is observable before it, so detection latency counts from there).
    """

    kind: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    phase: str | None
    kernel_class: str | None
    severity: float
    start_unix_nano: int
    end_unix_nano: int | None


@dataclasses.dataclass(frozen=True)
class Truth:
    """Ground truth of a simulated job (``--truth truth.json``)."""

    job: str
    world_size: int
    topology: str
    seed: int
    window_s: float
    steps_per_window: int
    start_unix_nano: int
    end_unix_nano: int
    faults: tuple[TruthFault, ...]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "world_size": self.world_size,
            "topology": self.topology,
            "seed": self.seed,
            "window_s": self.window_s,
            "steps_per_window": self.steps_per_window,
            "start": format_time(self.start_unix_nano),
            "end": format_time(self.end_unix_nano),
            "start_unix_nano": self.start_unix_nano,
            "end_unix_nano": self.end_unix_nano,
            "faults": [
                {
                    "kind": fault.kind,
                    "ranks": list(fault.ranks),
                    "hosts": list(fault.hosts),
                    "phase": fault.phase,
                    "kernel_class": fault.kernel_class,
                    "severity": fault.severity,
                    "start": format_time(fault.start_unix_nano),
                    "start_unix_nano": fault.start_unix_nano,
                    "end_unix_nano": fault.end_unix_nano,
                }
                for fault in self.faults
            ],
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Truth:
        try:
            return cls(
                job=str(data["job"]),
                world_size=int(data["world_size"]),
                topology=str(data["topology"]),
                seed=int(data["seed"]),
                window_s=float(data["window_s"]),
                steps_per_window=int(data["steps_per_window"]),
                start_unix_nano=int(data.get("start_unix_nano") or parse_time(data["start"])),
                end_unix_nano=int(data.get("end_unix_nano") or parse_time(data["end"])),
                faults=tuple(
                    TruthFault(
                        kind=str(item["kind"]),
                        ranks=tuple(int(r) for r in item.get("ranks") or ()),
                        hosts=tuple(str(h) for h in item.get("hosts") or ()),
                        phase=item.get("phase"),
                        kernel_class=item.get("kernel_class"),
                        severity=float(item["severity"]),
                        start_unix_nano=int(item["start_unix_nano"]),
                        end_unix_nano=None
                        if item.get("end_unix_nano") is None
                        else int(item["end_unix_nano"]),
                    )
                    for item in data.get("faults", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"truth: not a stepwatch ground-truth document ({exc})") from exc

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Truth:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"truth: cannot read {path}: {exc}") from exc
        return cls.from_json_dict(data)


def host_of(rank: int) -> str:
    """Host name of a simulated rank (8 ranks per host)."""
    return f"node-{rank // RANKS_PER_HOST:04d}"


@dataclasses.dataclass(frozen=True, eq=False)
class SimulatedJob:
    """Per-step timings of every rank plus the ground truth.

    Arrays are ``(steps, ranks[, ...])``; ``alive`` is False after a rank stopped reporting.
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

        def peak(values: FloatArray) -> FloatArray:
            masked = windows(values) * (alive if values.ndim == 2 else alive[..., None])
            result = np.max(np.where(np.isnan(masked), -np.inf, masked), axis=1)
            return np.where(np.isinf(result), np.nan, result)

        window_ns = round(self.truth.window_s * 1e9)
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
            kernel_classes=self.kernel_classes,
            kernel_categories=self.kernel_categories,
            kernel_s=mean(self.kernel_s),
            idle_s=mean(self.idle_s),
            idle_max_s=peak(self.idle_s),
            sm_clock_hz=mean(self.sm_clock_hz),
        )


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


def _metrics_for_window(job: SimulatedJob, builders: list[Any], window: int) -> list[Any]:
    """Feed one window of every rank into its WindowBuilder; the built MetricsData list."""
    from stepwatch.exporters._window import KernelWindow

    per = job.truth.steps_per_window
    first = window * per
    last = min(first + per, job.n_steps)
    built = []
    for rank, builder in enumerate(builders):
        steps = [s for s in range(first, last) if job.alive[s, rank]]
        if not steps:
            continue
        durations: dict[tuple[str, str], list[float]] = {}
        for s in steps:
            builder.add_step(
                step_index=s,
                duration_s=float(job.step_s[s, rank]),
                phases_s={
                    name: float(job.phase_s[s, rank, p])
                    for p, name in enumerate(job.phases)
                    if job.phase_s[s, rank, p] > 0
                },
            )
            for k, name in enumerate(job.kernel_classes):
                calls = job.kernel_calls[k]
                each = float(job.kernel_s[s, rank, k]) / calls
                if each > 0:
                    durations.setdefault((name, job.kernel_categories[k]), []).extend(
                        [each] * calls
                    )
        builder.add_kernels(
            KernelWindow(
                durations_s=durations,
                idle_durations_s=[float(job.idle_s[s, rank]) for s in steps],
            )
        )
        end = job.window_end_unix_nano(window, rank)
        start = end - round(job.truth.window_s * 1e9)
        data = builder.build(start_unix_nano=start, end_unix_nano=end)
        if data is not None:
            built.append(data)
    return built


def _builders(job: SimulatedJob) -> list[Any]:
    from stepwatch.exporters._window import WindowBuilder, build_resource

    topology = job.topology
    builders = []
    for rank in range(job.truth.world_size):
        resource = build_resource(
            job_id=job.truth.job,
            rank=rank,
            world_size=job.truth.world_size,
            host_name=job.hosts[rank],
            local_rank=rank % RANKS_PER_HOST,
            dp_rank=(rank // topology.tp) % topology.dp,
            tp_rank=rank % topology.tp,
            pp_rank=topology.pp_rank(rank),
        )
        builders.append(WindowBuilder(resource))
    return builders


def _clock_lines(job: SimulatedJob, window: int) -> list[str]:
    """SM clock gauges as the bridge stores an OTLP gauge (field ``gauge``)."""
    from stepwatch.core import _schema
    from stepwatch.core._lineproto import encode_point

    per = job.truth.steps_per_window
    first, last = window * per, min(window * per + per, job.n_steps)
    lines = []
    for rank in range(job.truth.world_size):
        alive = job.alive[first:last, rank]
        if not alive.any():
            continue
        value = float(job.sm_clock_hz[first:last, rank][alive].mean())
        tags = {
            _schema.JOB_ID: job.truth.job,
            _schema.RANK: str(rank),
            _schema.WORLD_SIZE: str(job.truth.world_size),
            _schema.HOST_NAME: job.hosts[rank],
            _schema.HW_TYPE: "gpu",
            _schema.HW_ID: str(rank % RANKS_PER_HOST),
        }
        lines.append(
            encode_point(
                _schema.GPU_SM_CLOCK, tags, {"gauge": value}, job.window_end_unix_nano(window, rank)
            )
        )
    return lines


def iter_line_batches(job: SimulatedJob) -> Iterator[list[str]]:
    """Line protocol per window, produced by the real exporter and bridge code paths."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (
        encode_metrics,
    )
    from opentelemetry.sdk.metrics.export import MetricsData

    from stepwatch.otel_bridge import convert_request

    builders = _builders(job)
    for window in range(job.n_windows):
        built = _metrics_for_window(job, builders, window)
        lines: list[str] = []
        if built:
            merged = MetricsData(
                resource_metrics=[rm for data in built for rm in data.resource_metrics]
            )
            conversion = convert_request(encode_metrics(merged))
            lines.extend(conversion.lines)
        lines.extend(_clock_lines(job, window))
        yield lines


def write_direct(job: SimulatedJob, client: Any, *, batch_lines: int = 20_000) -> int:
    """Write the job into InfluxDB through WindowBuilder → convert_request; returns points."""
    pending: list[str] = []
    written = 0
    for lines in iter_line_batches(job):
        pending.extend(lines)
        if len(pending) >= batch_lines:
            client.write_lines(pending)
            written += len(pending)
            pending = []
    if pending:
        client.write_lines(pending)
        written += len(pending)
    return written


def send_otlp(job: SimulatedJob, endpoint: str, *, timeout_s: float = 10.0) -> int:
    """Send the job over OTLP/HTTP like real ranks do (one export per rank window).

    SM clock gauges are not sent (they come from the NVML exporter in real jobs).
    """
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/metrics"):
        url += "/v1/metrics"
    exporter = OTLPMetricExporter(endpoint=url, timeout=timeout_s)
    builders = _builders(job)
    sent = 0
    try:
        for window in range(job.n_windows):
            for data in _metrics_for_window(job, builders, window):
                if exporter.export(data) is not MetricExportResult.SUCCESS:
                    raise StepwatchError(f"OTLP export to {url} failed (see the log)")
                sent += 1
    finally:
        exporter.shutdown()
    return sent


def fault_summary(fault: TruthFault) -> str:
    """One line describing a truth fault (CLI output)."""
    where = ",".join(str(r) for r in fault.ranks[:8]) or "all ranks"
    if len(fault.ranks) > 8:
        where += ",..."
    return (
        f"{fault.kind} x{fault.severity:.2f} on {where} from {format_time(fault.start_unix_nano)}"
    )


def severity_label(severity: float) -> str:
    return f"{(severity - 1) * 100:.0f}%" if severity < 2 else f"{severity:.1f}x"
