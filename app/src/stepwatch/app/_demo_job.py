"""The demo training job: a real multi-process PyTorch DDP run (CPU, gloo), instrumented.

Each rank is a separate process started by :func:`launch`. Faults are real effects inside the
job, so what stepwatch diagnoses is what a real straggler, link or stall does to DDP:

- ``straggler``: extra compute (matrix multiplies) in one rank's forward pass from a step on;
- ``link``: a delay inside one rank's DDP communication hook, before its allreduce;
- ``jit``: one long host-side stall on one rank at one step (like a JIT recompile);
- ``stall``: one rank stops for 3 s once *between* phases (a checkpoint write, a GC pause):
  its own phases look normal, its peers wait in their next all-reduce;
- ``dataloader``: a slow data loader on one rank from a step on;
- ``regression``: every rank does extra compute from a step on (job-wide slowdown);
- ``hang``: one rank blocks forever inside its data phase from a step on (a data loader that
  never returns); the others wait in their all-reduce until the job is killed;
- ``freeze``: one rank's whole process stops (``SIGSTOP``, its export thread too) inside its
  forward pass at a step; the others wait in their all-reduce until the job is killed;
- ``eval``: every rank runs an evaluation pass of ``EVAL_S`` seconds at a step (a long but
  normal step on every rank: not a hang).

:func:`start` runs a job in its own session (process group) so that a hung one can be killed
whole, ranks and launcher together, with :meth:`DemoJobProcess.kill`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from stepwatch.app._ranks import join_gloo, run_ranks
from stepwatch.core._errors import ConfigError

FAULT_KINDS = (
    "none",
    "straggler",
    "link",
    "jit",
    "stall",
    "dataloader",
    "regression",
    "hang",
    "freeze",
    "eval",
)
#: Faults on ``fault_rank`` alone (the others are job-wide).
RANK_FAULTS = ("straggler", "link", "jit", "stall", "dataloader", "hang", "freeze")
#: Faults after which the job never finishes: it must be killed (:meth:`DemoJobProcess.kill`).
HANG_FAULTS = ("hang", "freeze")
#: How the demo's loop is timed (``DemoJobConfig.instrumentation``).
INSTRUMENTATIONS = ("auto", "hand")
#: The default demo: steps, the step its fault starts, and the profiler's period (steps).
DEMO_STEPS = 600
DEMO_FAULT_STEP = 240
DEMO_KERNEL_PERIOD_STEPS = 25
#: The fault of ``stepwatch demo`` without ``--fault``: the story it tells.
DEMO_FAULT = "straggler"
#: Faults whose demo collects no kernel timings unless asked (``--kernels``): the job never
#: ends and what matters is the hang, not kernel histograms. (``link`` was here too: the CPU
#: profiler charges the delay in rank 2's DDP comm hook to the ``AccumulateGrad`` op that
#: runs the hook, which read as compute until that op's category became ``other``.)
NO_KERNELS_BY_DEFAULT = ("hang", "freeze")


def kernels_by_default(fault: str) -> bool:
    """Whether ``stepwatch demo --fault FAULT`` collects kernel timings unless told."""
    return fault not in NO_KERNELS_BY_DEFAULT


#: How long the ``stall`` fault stops its rank between phases.
STALL_S = 3.0
#: How long the ``eval`` fault's evaluation pass lasts on every rank (longer than the default
#: hang threshold of 10 s).
EVAL_S = 15.0

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DemoJobConfig:
    """What one demo run does. ``fault_rank`` is ignored for job-wide faults.

    The defaults are the ``stepwatch demo`` CLI's: a 600-step job (~25 s on a 2-core host)
    exporting a window every 0.25 s gives the detectors ~40 analysis windows of 0.5 s (see
    ``export_window_s``), healthy for the first 240 steps and faulty after.
    ``kernel_period_steps``: with ``collect_kernels``, one profiler cycle of 5 steps every
    this many steps (a fixed duty cycle: 20 % of the steps at 25, so that a short demo has
    kernel data in most windows; the always-on default spaces cycles by its overhead
    budget, every few thousand steps). ``None``: that default (``TorchProfilerSource()``,
    for runs long enough to show it: ``bench/demo_faults.py --kernel-period default``).
    ``onset_file``: where the faulty rank writes the wall time (Unix ns) at which a ``hang``
    or ``freeze`` begins (to time how fast it is found).
    ``phase_sampling``: ``StepMonitor``'s (``"auto"``, its default; 1: every step's phases).
    ``instrumentation``: ``"auto"`` (``monitor.instrument(ddp, optimizer)``: forward,
    backward, optimizer and the collective wait as ``communication``) or ``"hand"``: the
    README's loop, ``data``, ``forward``, ``backward`` and ``optimizer`` timed with
    ``monitor.phase()`` and no ``communication`` phase (DDP's all-reduce runs inside
    ``backward``).
    """

    job_id: str
    world_size: int = 4
    steps: int = DEMO_STEPS
    fault: str = "none"
    fault_rank: int = 2
    fault_step: int = DEMO_FAULT_STEP
    fault_factor: float = 2.0
    endpoint: str = "http://127.0.0.1:4318"
    protocol: str = "http/protobuf"
    batch_size: int = 32
    hidden: int = 256
    export_interval_s: float = 0.25
    collect_kernels: bool = False
    kernel_period_steps: int | None = DEMO_KERNEL_PERIOD_STEPS
    onset_file: str | None = None
    phase_sampling: int | str = "auto"
    instrumentation: str = "auto"

    def __post_init__(self) -> None:
        if self.instrumentation not in INSTRUMENTATIONS:
            raise ConfigError(
                f"instrumentation: {self.instrumentation!r} is not one of {INSTRUMENTATIONS}"
            )
        if self.fault not in FAULT_KINDS:
            raise ConfigError(f"fault: {self.fault!r} is not one of {FAULT_KINDS}")
        if self.world_size < 2:
            raise ConfigError(
                f"world_size: a DDP demo needs at least 2 ranks, got {self.world_size}"
            )
        if not 0 <= self.fault_rank < self.world_size:
            raise ConfigError(
                f"fault_rank: {self.fault_rank} is not a rank of a {self.world_size}-rank job"
            )
        if self.steps < 1:
            raise ConfigError(f"steps: must be positive, got {self.steps}")
        if self.kernel_period_steps is not None and self.kernel_period_steps < 5:
            raise ConfigError(
                "kernel_period_steps: must be at least 5 (one 5-step cycle), "
                f"got {self.kernel_period_steps}"
            )
        if self.fault_factor <= 1.0:
            raise ConfigError(f"fault_factor: must exceed 1.0, got {self.fault_factor}")


def launch(config: DemoJobConfig, *, timeout_s: float = 600.0) -> None:
    """Run the job: ``world_size`` processes, gloo over loopback; returns when all finish.

    Raises:
        StepwatchError: a rank failed or the job did not finish within ``timeout_s``.
    """
    run_ranks(
        _rank_main,
        (config,),
        world_size=config.world_size,
        timeout_s=timeout_s,
        what="demo job",
    )


class DemoJobProcess:
    """A demo job running in its own session: the launcher and its ranks, one process group.

    Attributes:
        config: what it runs.
        process: the launcher (its process group id is its pid).
    """

    def __init__(self, config: DemoJobConfig, process: subprocess.Popen[bytes]) -> None:
        self.config = config
        self.process = process

    def wait(self, timeout_s: float) -> int | None:
        """The launcher's exit status, or None if it still runs after ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kill the whole job (launcher and ranks, stopped ones too) and reap the launcher."""
        with contextlib.suppress(ProcessLookupError):  # already gone, every process of it
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def __enter__(self) -> DemoJobProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


# The launcher process of start(): the module imported under its own name (not as __main__),
# so the ranks it spawns unpickle the same functions and classes.
_LAUNCHER = (
    "import json, sys\n"
    "from stepwatch.app._demo_job import DemoJobConfig, launch\n"
    "launch(DemoJobConfig(**json.loads(sys.argv[1])), timeout_s=3600.0)\n"
)


def start(config: DemoJobConfig) -> DemoJobProcess:
    """Run :func:`launch` for ``config`` in a new session, without waiting for it."""
    process = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, json.dumps(dataclasses.asdict(config))],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    return DemoJobProcess(config, process)


def _mark_onset(config: DemoJobConfig) -> None:
    if config.onset_file is not None:
        with open(config.onset_file, "w") as onset:
            onset.write(str(time.time_ns()))


def _rank_main(rank: int, config: DemoJobConfig, master_port: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    join_gloo(rank, config.world_size, master_port, seed=1234)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import StepMonitor

    try:
        model = _demo_model(config.hidden)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        faulty = config.fault in RANK_FAULTS and rank == config.fault_rank
        monitor = StepMonitor(
            job_id=config.job_id,
            rank=rank,
            world_size=config.world_size,
            host_name=demo_host(rank),
            local_rank=rank % 2,
            endpoint=config.endpoint,
            protocol=config.protocol,
            export_interval_s=config.export_interval_s,
            kernel_source=_kernel_source(config),
            phase_sampling=config.phase_sampling,
        )
        # One line instruments forward, backward, optimizer and communication. The link
        # fault is a delay inside one rank's comm hook (passed in: DDP accepts a single one),
        # which times that rank's collectives one by one; the others then do the same
        # (collective_timing) so every rank measures communication alike.
        hand = config.instrumentation == "hand"
        if not hand:
            monitor.instrument(
                ddp,
                optimizer,
                comm_hook=_slow_comm_hook(config) if config.fault == "link" and faulty else None,
                collective_timing=config.fault == "link",
            )
        elif config.fault == "link" and faulty:
            ddp.register_comm_hook(None, _slow_comm_hook(config))
        timed = monitor.phase if hand else _untimed
        for step in range(config.steps):
            active = step >= config.fault_step
            at_fault = step == config.fault_step
            model.stall_s = 1.5 if config.fault == "jit" and faulty and at_fault else 0.0
            model.freeze = config if config.fault == "freeze" and faulty and at_fault else None
            model.extra_factor = (
                config.fault_factor
                if (config.fault == "straggler" and faulty and active)
                or (config.fault == "regression" and active)
                else 0.0
            )
            with monitor.step():
                with monitor.phase("data"):
                    inputs = torch.randn(config.batch_size, 64)
                    targets = torch.randint(0, 10, (config.batch_size,))
                    if config.fault == "dataloader" and faulty and active:
                        time.sleep(0.004 * config.fault_factor)
                    if config.fault == "hang" and faulty and active:
                        _mark_onset(config)
                        threading.Event().wait()  # never returns: the job must be killed
                if config.fault == "eval" and at_fault:
                    _evaluate(monitor, ddp, config)
                with timed("forward"):
                    output = ddp(inputs)
                    loss = loss_fn(output, targets)
                optimizer.zero_grad(set_to_none=True)
                with timed("backward"):
                    loss.backward()
                with timed("optimizer"):
                    optimizer.step()
                if config.fault == "stall" and faulty and step == config.fault_step:
                    time.sleep(STALL_S)  # outside every phase: a checkpoint write, a GC pause
        monitor.close()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _untimed(name: str) -> Iterator[None]:
    """No phase of the loop's own: auto mode times it (``monitor.instrument``)."""
    del name
    yield


def _demo_model(hidden: int) -> Any:
    """A small MLP whose forward can carry a fault: extra compute or a one-off stall."""
    import torch

    class DemoModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(
                torch.nn.Linear(64, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, 10),
            )
            self.burner = torch.randn(hidden, hidden)
            self.extra_factor = 0.0
            self.stall_s = 0.0
            self.freeze: DemoJobConfig | None = None

        def forward(self, inputs: Any) -> Any:
            if self.freeze is not None:
                _mark_onset(self.freeze)
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops, exporter too
            if self.stall_s:
                time.sleep(self.stall_s)  # a host-side stall (JIT recompile): nothing runs
            if self.extra_factor:
                _burn(self.burner, factor=self.extra_factor)  # a compute straggler
            return self.layers(inputs)

    return DemoModel()


def _evaluate(monitor: Any, model: Any, config: DemoJobConfig) -> None:
    """An evaluation pass of ``EVAL_S`` on every rank: forward passes, no gradients, no
    collective (a long but normal step)."""
    import torch

    deadline = time.monotonic() + EVAL_S
    with monitor.phase("eval"), torch.no_grad():
        while time.monotonic() < deadline:
            model.module(torch.randn(config.batch_size, 64))
            time.sleep(0.01)


def demo_host(rank: int) -> str:
    """Two ranks per simulated node so host-level localisation has something to group."""
    return f"{socket.gethostname()}-node{rank // 2}"


def _burn(matrix: Any, *, factor: float) -> None:
    """Extra compute proportional to ``factor`` (a compute straggler)."""
    repeats = max(1, round(8 * (factor - 1.0)))
    for _ in range(repeats):
        matrix = (matrix @ matrix).clamp_(-1.0, 1.0)


def _slow_comm_hook(config: DemoJobConfig) -> Any:
    """A DDP comm hook that delays this rank's allreduce from the fault step on (a slow link)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    delay_s = 0.004 * config.fault_factor  # 8 ms at the default factor: a badly degraded link
    calls = [0]

    def slow_allreduce(process_group: Any, bucket: Any) -> Any:
        calls[0] += 1
        if calls[0] > config.fault_step:  # one bucket per step for the demo's small model
            time.sleep(delay_s)
        return allreduce_hook(process_group, bucket)

    return slow_allreduce


def _kernel_source(config: DemoJobConfig) -> Any:
    if not config.collect_kernels:
        return None
    try:
        from stepwatch.exporters.kernels import TorchProfilerSource
    except ImportError:
        logger.warning("kernel collection requested but stepwatch.exporters.kernels is missing")
        return None
    # A fixed duty cycle (5 profiled steps per period): the demo is a few hundred steps,
    # shorter than the period the default 0.1 % overhead budget would choose, and it is there
    # to show the op histograms.
    if config.kernel_period_steps is None:
        return TorchProfilerSource()  # the always-on default: cycles spaced by its budget
    return TorchProfilerSource(active_steps=5, period_steps=config.kernel_period_steps)
