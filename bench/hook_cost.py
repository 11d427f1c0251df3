"""Training-thread cost of the auto-mode hooks, per step, by elimination (single process, CPU).

A small MLP (so that the hooks' cost is visible against the step) trains with SGD, first as a
plain ``nn.Module`` and then wrapped in ``DistributedDataParallel`` over a 1-rank gloo group
(rendezvous on a free loopback port). One model per kind; every arm installs its hooks on it
for one block of steps and removes them afterwards, and in each round every arm runs one block,
in a seeded random order, so drift and neighbours on the machine hit all arms alike.

Arms (``plain`` is the reference; the others are reported as the difference to it):

- ``all``: what ``monitor.instrument(model, optimizer)`` installs by default, with the monitor
  recording the steps (its buffer is drained between blocks, outside the timing);
- ``all_unsampled``: the same when no step is sampled for phase timing (``phase_sampling``:
  what an unsampled step costs); ``all_unsampled@base`` with ``--baseline-rev``'s ``_auto.py``;
  ``all_unsampled_kept``: the same with the timing subclass kept on every step, as before the
  recorder swapped the model's own class in for untimed steps (and as with gradients
  accumulating, ``_forward._ClassSwap.keep_timed``);
- ``all@REV`` (``--baseline-rev REV``): the same with ``_auto.py`` as of git ``REV``
  (the state before an optimisation), so that before and after are measured in one run;
- ``all-X``: ``all`` without component ``X`` (the cost of ``X`` in context is ``all - all-X``);
- ``X``: component ``X`` alone (``fwd``: the forward timed by the class swap, including the
  mark of the backward start; ``opt_pre``, ``opt_post``, ``last_grad``: DDP only);
- ``fwd_hooks``: the forward timed by module hooks instead (instrument's fallback, and what
  it did before the class swap), with the mark of the backward start;
- mechanism probes with no stepwatch code: ``noop_fwd_pre`` / ``noop_fwd_post`` (an empty
  module hook: the price of leaving ``nn.Module._call_impl``'s fast path),
  ``noop_global_fwd_pre`` (an empty global module pre-hook: every submodule leaves it),
  ``noop_forward_wrap`` (``forward`` replaced on the instance by a wrapper reading the clock
  twice: no hook, fast path kept),
  ``noop_opt_pre`` / ``noop_opt_post`` (an empty optimizer hook), ``noop_tensor_hook`` (an
  empty forward hook that puts an empty ``Tensor.register_hook`` on the output),
  ``noop_node_prehook`` (the same with ``output.grad_fn.register_prehook``) and
  ``noop_hook_dict`` (the same registered as ``instrument`` does: a plain hook dict put on the
  output and its node, without ``register_hook``'s OrderedDict and RemovableHandle).

Figures per arm: process CPU time per step (``time.process_time_ns`` over the block: every
thread, gloo's included) and the median wall time per step of the block; each is the median
over rounds of the per-round difference to ``plain``, with a 95 % bootstrap CI (resampling
rounds), in µs and as a share of a 20 ms step (issue 15: the goal is 0.1 % of it for everything).

``--hidden N`` uses bench/overhead.py's MLP N wide (``--batch``, default 64) instead of the
64-64-8 one: the hooks cost more there (cache misses, docs/exporters.md), but a ~10 ms step's
noise on a shared VM is far larger than the hooks; ``bench/hook_callgrind.py`` counts
instructions instead.

Usage: ``.venv/bin/python bench/hook_cost.py [--rounds 60] [--block 40] [--kind both]
[--arms all,plain,...] [--baseline-rev HEAD] [--hidden 0] [--batch 64]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

REFERENCE_STEP_US = 20_000.0
COMPONENTS = ("fwd", "opt_pre", "opt_post", "last_grad")


class NullExporter:
    """Accepts every window and keeps nothing."""

    def export(self, metrics_data: Any, timeout_millis: float = 10_000) -> Any:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        return MetricExportResult.SUCCESS

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        return None


def _noop_pre(module: Any, args: Any) -> None:
    return None


def _noop_post(module: Any, args: Any, output: Any) -> None:
    return None


def _noop_opt(optimizer: Any, args: Any, kwargs: Any) -> None:
    return None


def _noop_grad(grad: Any) -> None:
    return None


def _noop_node(grad_outputs: Any) -> None:
    return None


def _tensor_hook_post(module: Any, args: Any, output: Any) -> None:
    output.register_hook(_noop_grad)


def _node_prehook_post(module: Any, args: Any, output: Any) -> None:
    output.grad_fn.register_prehook(_noop_node)


def _hook_dict_post(module: Any, args: Any, output: Any) -> None:
    from stepwatch.exporters.auto._forward import HookDict

    hooks = HookDict()
    hooks[-1] = _noop_grad
    output._backward_hooks = hooks
    output.grad_fn._register_hook_dict(output)


_AUTO_PATH = "exporters/src/stepwatch/exporters/auto/_auto.py"


def _load_auto_at(rev: str) -> ModuleType:
    """``_auto.py`` as of git ``rev``, imported as a separate module.

    The revision must hook a monitor through its ``StepRecorder`` (``install_hooks``), as the
    monitor here does: from the layout renovation on.
    """
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:{_AUTO_PATH}"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = ModuleType("stepwatch_baseline_auto")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{rev}:{_AUTO_PATH}", "exec"), module.__dict__)
    return module


def _install(auto: ModuleType, recorder: Any, model: Any, optimizer: Any) -> Any:
    """What ``monitor.instrument(model, optimizer)`` installs, with ``auto``'s hooks."""
    return auto.install_hooks(
        recorder,
        model,
        optimizer,
        comm_hook=None,
        comm_state=None,
        time_communication=True,
        collective_timing=False,
    )


class StandInDevice:
    """A device timer whose marks cost what a C call costs (``itertools.count``): auto mode's
    device-timed path (``DeviceAutoState``, marks at each phase's ends) on a CPU, for
    instruction counts (``STEPWATCH_BENCH_DEVICE=1``); a CUDA event's own cost is measured on
    a GPU (``bench/gpu_check.py --parts marks``)."""

    def __init__(self) -> None:
        import itertools

        self.mark = itertools.count(1).__next__

    def ready(self, mark: Any) -> bool:
        return True

    def elapsed_s(self, start: Any, end: Any) -> float:
        return (end - start) * 1e-6


def _device_mode() -> bool:
    """Whether the bench's monitor times phases on :class:`StandInDevice`."""
    return os.environ.get("STEPWATCH_BENCH_DEVICE", "") == "1"


class Bench:
    """One model and optimizer; installs an arm's hooks, times blocks of steps."""

    def __init__(
        self, kind: str, baseline: ModuleType | None, hidden: int = 0, batch: int = 64
    ) -> None:
        import torch

        from stepwatch.exporters import StepMonitor

        torch.manual_seed(0)
        model: Any
        if hidden:  # bench/overhead.py's model
            model = torch.nn.Sequential(
                torch.nn.Linear(128, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, 10),
            )
        else:
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
            )
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        self.kind = kind
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.monitor = StepMonitor(
            job_id="hook-cost",
            rank=0,
            world_size=1,
            exporter=NullExporter(),
            health=False,
            device_timer=StandInDevice() if _device_mode() else "cpu",
            start=False,
        )
        self.baseline = baseline
        self.explicit = False
        generator = torch.Generator().manual_seed(1)
        shape = (batch, 128) if hidden else (16, 64)
        self.inputs = [torch.randn(*shape, generator=generator) for _ in range(8)]

    def arms(self) -> list[str]:
        components = [c for c in COMPONENTS if c != "last_grad" or self.kind == "ddp"]
        names = ["plain", "all", "all_unsampled", "all_unsampled_kept"]
        if self.baseline is not None:
            names += ["all@base", "all_unsampled@base"]
        names += [f"all-{c}" for c in components]
        names += components
        names += ["fwd_hooks"]
        names += ["noop_fwd_pre", "noop_fwd_post", "noop_opt_pre", "noop_opt_post"]
        names += ["noop_tensor_hook", "noop_node_prehook", "noop_hook_dict"]
        names += ["noop_global_fwd_pre"]
        names += ["noop_forward_wrap"]
        return names

    @contextlib.contextmanager
    def installed(self, arm: str) -> Iterator[None]:
        """``arm``'s hooks; a ``+step`` suffix also marks each step with ``monitor.step()``
        and its input with ``monitor.phase("data")``, as bench/overhead.py's loop does."""
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.explicit = arm.endswith("+step")
        arm = arm.removesuffix("+step")

        from stepwatch.exporters._sampling import PhaseSampler
        from stepwatch.exporters.auto import _auto

        if _device_mode():  # its install_hooks picks DeviceAutoState for a device timer
            from stepwatch.exporters.auto import _auto_device as _auto  # type: ignore[no-redef]

        model, optimizer, monitor = self.model, self.optimizer, self.monitor
        handles: list[Any] = []
        instrumentation: Any = None
        recorder = monitor._recorder
        sampler = recorder.sampler
        if arm in ("all", "all@base"):  # every step timed, whatever "auto" would pick
            recorder.sampler = PhaseSampler(1)
        if arm == "all":
            instrumentation = _install(_auto, recorder, model, optimizer)
        elif arm in ("all_unsampled", "all_unsampled@base", "all_unsampled_kept"):
            # What a step whose phases are not timed costs (_sampling): no step is sampled.
            recorder.sampler = PhaseSampler(1 << 62)
            auto = self.baseline if arm.endswith("@base") else _auto
            if auto is None:
                raise RuntimeError("no baseline")
            instrumentation = _install(auto, recorder, model, optimizer)
            if arm == "all_unsampled_kept" and instrumentation._state.class_swap is not None:
                instrumentation._state.class_swap.keep_timed()
        elif arm == "all@base":
            if self.baseline is None:
                raise RuntimeError("no baseline")
            instrumentation = _install(self.baseline, recorder, model, optimizer)
        elif arm == "fwd_hooks":
            state = _auto._AutoState(recorder)
            handles = [
                model.register_forward_pre_hook(state.forward_pre),
                model.register_forward_hook(state.forward_post, always_call=True),
            ]
        elif arm.startswith("all-") or arm in COMPONENTS:
            state = _auto._AutoState(recorder)
            wanted = set(COMPONENTS) - {arm[4:]} if arm.startswith("all-") else {arm}
            handles = _install_components(state, model, optimizer, wanted)
        elif arm != "plain":
            noop: dict[str, Callable[[], Any]] = {
                "noop_fwd_pre": lambda: model.register_forward_pre_hook(_noop_pre),
                "noop_fwd_post": lambda: model.register_forward_hook(_noop_post),
                "noop_opt_pre": lambda: optimizer.register_step_pre_hook(_noop_opt),
                "noop_opt_post": lambda: optimizer.register_step_post_hook(_noop_opt),
                "noop_tensor_hook": lambda: model.register_forward_hook(_tensor_hook_post),
                "noop_node_prehook": lambda: model.register_forward_hook(_node_prehook_post),
                "noop_hook_dict": lambda: model.register_forward_hook(_hook_dict_post),
            }
            if arm == "noop_global_fwd_pre":
                handles = [register_module_forward_pre_hook(_noop_pre)]
            elif arm == "noop_forward_wrap":
                handles = [_ForwardWrap(model)]
            else:
                handles = [noop[arm]()]
        try:
            yield
        finally:
            recorder.sampler = sampler
            recorder.sampled = True
            if instrumentation is not None:
                instrumentation.remove()
            for handle in handles:
                handle.remove()
            # Close any auto step left open so that arms start alike.
            recorder.step_depth = 0
            recorder._auto_step_open = False
            recorder.explicit_steps = False
            self.explicit = False
            monitor.export_now()

    def run_block(self, steps: int) -> tuple[float, float]:
        """(CPU µs per step, median wall µs per step) of ``steps`` steps."""
        model, optimizer, inputs, monitor = self.model, self.optimizer, self.inputs, self.monitor
        clock = time.perf_counter_ns
        walls = []
        cpu_start = time.process_time_ns()
        for index in range(steps):
            start = clock()
            if self.explicit:
                with monitor.step():
                    with monitor.phase("data"):
                        batch = inputs[index % len(inputs)]
                    loss = model(batch).pow(2).mean()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
            else:
                loss = model(inputs[index % len(inputs)]).pow(2).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            walls.append(clock() - start)
        cpu_ns = time.process_time_ns() - cpu_start
        return cpu_ns / steps / 1e3, statistics.median(walls) / 1e3


class _ForwardWrap:
    """Probe: the model's ``forward`` replaced on the instance by a timing wrapper.

    No module hook, so ``nn.Module._call_impl`` keeps its fast path; what a wrapper would cost.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        original = model.forward
        clock = time.perf_counter_ns
        self.elapsed_ns = 0

        def forward(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            output = original(*args, **kwargs)
            self.elapsed_ns += clock() - start
            return output

        model.forward = forward

    def remove(self) -> None:
        del self.model.forward


def _install_components(state: Any, model: Any, optimizer: Any, wanted: set[str]) -> list[Any]:
    handles = []
    if "fwd" in wanted:
        from stepwatch.exporters.auto._forward import time_forward

        handles.append(time_forward(state, model))
    if "opt_pre" in wanted:
        handles.append(optimizer.register_step_pre_hook(state.optimizer_pre))
    if "opt_post" in wanted:
        handles.append(optimizer.register_step_post_hook(state.optimizer_post))
    if "last_grad" in wanted and hasattr(model, "process_group"):
        first = next(p for p in model.parameters() if p.requires_grad)
        handles.append(first.register_post_accumulate_grad_hook(state.gradient_stamp))
    return handles


def _bootstrap_median_ci(values: list[float], rng: random.Random) -> tuple[float, float]:
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    return medians[50], medians[1949]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_rank_ddp(hidden: int, batch: int, job_id: str) -> tuple[Any, Any, Any, Any, Any]:
    """A 1-rank gloo DDP job of bench/overhead.py's MLP, one thread, auto mode installed on a
    monitor exporting nowhere, 50 steps run: (monitor, model, optimizer, loss_fn, generator)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import overhead
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import StepMonitor

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    model = DistributedDataParallel(overhead.mlp(hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    monitor = StepMonitor(
        job_id=job_id, rank=0, world_size=1, exporter=NullExporter(), health=False
    )
    monitor.instrument(model, optimizer)
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        overhead.train_step(monitor, model, optimizer, loss_fn, generator, batch)
    return monitor, model, optimizer, loss_fn, generator


def measure(kind: str, arms_filter: list[str] | None, args: argparse.Namespace) -> None:
    baseline = _load_auto_at(args.baseline_rev) if args.baseline_rev else None
    bench = Bench(kind, baseline, args.hidden, args.batch)
    arms = bench.arms()
    if arms_filter:
        arms = [a for a in arms if a in arms_filter or a == "plain"]
    rng = random.Random(args.seed)
    for arm in arms:  # warm-up: first calls, allocator, caches
        with bench.installed(arm):
            bench.run_block(args.block)
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    wall: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(args.rounds):
        order = arms[:]
        rng.shuffle(order)
        for arm in order:
            with bench.installed(arm):
                bench.run_block(3)  # re-warm after (un)installing
                cpu_us, wall_us = bench.run_block(args.block)
            cpu[arm].append(cpu_us)
            wall[arm].append(wall_us)
    plain_cpu = statistics.median(cpu["plain"])
    plain_wall = statistics.median(wall["plain"])
    print(
        f"\n== {kind}: {args.rounds} rounds x {args.block} steps per arm; plain step "
        f"CPU {plain_cpu:.1f} µs, wall {plain_wall:.1f} µs (median)"
    )
    print(
        f"{'arm':<20}{'CPU µs/step [95% CI]':>28}{'wall µs/step [95% CI]':>28}"
        f"{'CPU % of 20 ms':>16}"
    )
    ci_rng = random.Random(args.seed + 1)
    for arm in arms:
        if arm == "plain":
            continue
        d_cpu = [a - b for a, b in zip(cpu[arm], cpu["plain"], strict=True)]
        d_wall = [a - b for a, b in zip(wall[arm], wall["plain"], strict=True)]
        c_lo, c_hi = _bootstrap_median_ci(d_cpu, ci_rng)
        w_lo, w_hi = _bootstrap_median_ci(d_wall, ci_rng)
        c_med, w_med = statistics.median(d_cpu), statistics.median(d_wall)
        print(
            f"{arm:<20}{c_med:>9.1f} [{c_lo:>7.1f}, {c_hi:>7.1f}]"
            f"{w_med:>9.1f} [{w_lo:>7.1f}, {w_hi:>7.1f}]"
            f"{100 * c_med / REFERENCE_STEP_US:>15.3f}%"
        )
    if "all@base" in arms and "all" in arms:
        d_cpu = [a - b for a, b in zip(cpu["all"], cpu["all@base"], strict=True)]
        d_wall = [a - b for a, b in zip(wall["all"], wall["all@base"], strict=True)]
        c_lo, c_hi = _bootstrap_median_ci(d_cpu, ci_rng)
        w_lo, w_hi = _bootstrap_median_ci(d_wall, ci_rng)
        print(
            f"{'all - all@base':<20}{statistics.median(d_cpu):>9.1f} [{c_lo:>7.1f}, {c_hi:>7.1f}]"
            f"{statistics.median(d_wall):>9.1f} [{w_lo:>7.1f}, {w_hi:>7.1f}]  (paired per round)"
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=40)
    parser.add_argument("--kind", choices=("plain", "ddp", "both"), default="both")
    parser.add_argument("--arms", default="", help="comma-separated arm names (default: all)")
    parser.add_argument("--baseline-rev", default="", help="git rev of _auto.py for all@base")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hidden", type=int, default=0, help="bench/overhead.py's MLP this wide (0: 64-64-8)"
    )
    parser.add_argument("--batch", type=int, default=64, help="batch with --hidden")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    arms_filter = [a for a in args.arms.split(",") if a] or None
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f} (1 min)")
    kinds = ("plain", "ddp") if args.kind == "both" else (args.kind,)
    for kind in kinds:
        if kind != "ddp":
            measure(kind, arms_filter, args)
            continue
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
        try:
            measure(kind, arms_filter, args)
        finally:
            dist.destroy_process_group()
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the end")


if __name__ == "__main__":
    main()
