"""Training-thread cost of a timed and of an untimed step, arms alternating every step (CPU DDP).

``bench/overhead.py`` gives the whole (a fully instrumented step against a plain one, with
auto's sampling mixing timed and untimed steps); this bench splits it. One DDP replica
(``--ranks`` processes, gloo over loopback; bench/overhead.py's MLP, ``--hidden`` wide) trains
with three arms taking turns every step, in a random order per round (seeded, the same on
every rank):

- ``plain``: no stepwatch hook (``overhead.HookSwitch`` off), no ``monitor.step()``;
- ``untimed``: ``monitor.step()``, a ``data`` phase and auto mode installed, the step not
  sampled for phase timing (what most steps cost with ``phase_sampling="auto"``);
- ``timed``: the same, the step's phases timed (one step in ``stride``).

Each step's training-thread CPU time (``time.thread_time_ns``) is compared with the plain
step of its round. Printed per rank: the mean difference of each arm with a 95 % bootstrap
CI over rounds, the median difference, and what ``auto`` pays per step on average at this
step time with the default 10 s windows, ``(timed + (stride - 1) * untimed) / stride``, as a
share of the step. ``--profiler`` attaches a ``TorchProfilerSource`` (the defaults) and sets
apart the rounds one of its cycles covered (its cost is its budget, reported separately by
bench/overhead.py).

Each difference is also given as a 10 % trimmed mean (the mean of the rounds' differences
without their lowest and highest tenth), with its own bootstrap CI. At 1024 wide the
step-to-step differences have heavy tails (σ ~400 µs; a step now and then pays a page-fault
burst or a stolen time slice in either arm), which the plain mean carries into its CI: the
trimmed estimate halves the CI there (an A/A arm reads 0 ± 9 µs instead of ± 20). It assumes
the tails are noise common to the arms; a cost stepwatch paid only now and then (a collection,
say) would be in the mean and not in the trimmed estimate, so read both.

``--aa`` adds a fourth arm, ``plain-again``, a second plain step compared like the others: the
bench's noise floor, which should read zero within its CI. At 1024 wide on this project's VM
the CIs are ±10–13 µs even over 10,000 rounds; at ``--hidden 256 --batch 64`` (~0.74 ms
steps) ±1 µs over 20,000 (docs/history/exporters.md, "One budget off the training step").

Run: ``.venv/bin/python bench/step_split.py [--ranks 1] [--rounds 2000] [--hidden 1024]
[--batch 96] [--profiler] [--aa]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = ("plain", "untimed", "timed")
TRIM = 0.1  # the trimmed estimate leaves out this share of each tail of the differences


def _rank(rank: int, port: int, options: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import time

    import hook_cost
    import overhead
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters._sampling import PhaseSampler, ideal_stride, sample_interval
    from stepwatch.exporters.kernels import TorchProfilerSource

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=options["ranks"]
    )
    model = DistributedDataParallel(overhead.mlp(options["hidden"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    source = TorchProfilerSource() if options["profiler"] else None
    monitor = StepMonitor(
        job_id="step-split",
        rank=rank,
        world_size=options["ranks"],
        exporter=hook_cost.NullExporter(),
        health=False,
        kernel_source=source,
    )
    monitor.instrument(model, optimizer)
    recorder = monitor._recorder
    samplers = {"timed": PhaseSampler(1), "untimed": PhaseSampler(1 << 62)}
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(rank)
    batch = options["batch"]

    def step(arm: str) -> None:
        chosen = monitor if not arm.startswith("plain") else None
        overhead.train_step(chosen, model, optimizer, loss_fn, generator, batch)

    for _ in range(options["warmup"]):  # the profiler's warm-up and probe cycles included
        step("timed")
    switch = overhead.HookSwitch(model, optimizer)
    switch.set(False)
    order = random.Random(options["seed"])
    arms_run = ARMS + (("plain-again",) if options["aa"] else ())
    cpu_ns: dict[str, list[int]] = {arm: [] for arm in arms_run}
    step_ns: list[int] = []
    kept = 0
    for _ in range(options["rounds"]):
        arms = list(arms_run)
        order.shuffle(arms)
        profiled = source is not None and source._running is not None
        measured: dict[str, int] = {}
        for arm in arms:
            if not arm.startswith("plain"):
                switch.set(True)
                recorder.sampler = samplers[arm]
            started, wall = time.thread_time_ns(), time.perf_counter_ns()
            step(arm)
            measured[arm] = time.thread_time_ns() - started
            if arm == "plain":
                step_ns.append(time.perf_counter_ns() - wall)
            elif not arm.startswith("plain"):
                switch.set(False)
        profiled = profiled or (source is not None and source._running is not None)
        if profiled:  # a profiling cycle covered the round: its cost is the profiler's
            continue
        kept += 1
        for arm in arms_run:
            cpu_ns[arm].append(measured[arm])
    monitor.close(timeout_s=1.0)
    _report(rank, cpu_ns, step_ns, kept, options, ideal_stride, sample_interval)


def _trimmed_mean(values: list[float]) -> float:
    """The mean of ``values`` without their lowest and highest tenth (:data:`TRIM`)."""
    ordered = sorted(values)
    cut = int(len(ordered) * TRIM)
    return statistics.fmean(ordered[cut : len(ordered) - cut])


def _interval(values: list[float]) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of bootstrap ``values``."""
    ordered = sorted(values)
    return ordered[int(len(ordered) * 0.025)], ordered[int(len(ordered) * 0.975) - 1]


def _report(
    rank: int,
    cpu_ns: dict[str, list[int]],
    step_ns: list[int],
    kept: int,
    options: dict[str, Any],
    ideal_stride: Any,
    sample_interval: Any,
) -> None:
    plain = cpu_ns["plain"]
    step_s = statistics.median(step_ns) / 1e9
    stride = ideal_stride(step_s, sample_interval(10.0))
    compared = [arm for arm in ("plain-again", "untimed", "timed") if arm in cpu_ns]
    diffs = {
        arm: [(a - b) / 1e3 for a, b in zip(cpu_ns[arm], plain, strict=True)] for arm in compared
    }
    rng = random.Random(options["seed"] + rank)
    rounds = len(plain)
    lines = [
        f"rank {rank}: {kept} of {options['rounds']} rounds kept (the rest covered by a "
        f"profiling cycle); plain step {step_s * 1e3:.1f} ms wall, "
        f"{statistics.median(plain) / 1e6:.1f} ms training-thread CPU",
    ]
    for label, estimate in (("mean", statistics.fmean), ("trimmed", _trimmed_mean)):
        boot: dict[str, list[float]] = {arm: [] for arm in [*compared, "auto"]}
        for _ in range(1000 if label == "mean" else 300):
            picks = [rng.randrange(rounds) for _ in range(rounds)]
            values = {arm: estimate([diffs[arm][i] for i in picks]) for arm in compared}
            for arm in compared:
                boot[arm].append(values[arm])
            boot["auto"].append((values["timed"] + (stride - 1) * values["untimed"]) / stride)
        ci = {arm: _interval(values) for arm, values in boot.items()}
        value = {arm: estimate(diffs[arm]) for arm in compared}
        for arm in compared:
            low, high = ci[arm]
            median = f"; median {statistics.median(diffs[arm]):+.1f}" if label == "mean" else ""
            lines.append(
                f"rank {rank}: {label:<7} {arm:<11} {value[arm]:+7.1f} µs/step "
                f"(95% CI {low:+.1f} .. {high:+.1f}{median})"
            )
        auto = (value["timed"] + (stride - 1) * value["untimed"]) / stride
        low, high = ci["auto"]
        lines.append(
            f"rank {rank}: {label:<7} auto at this step (1 in {stride} timed, 10 s windows): "
            f"{auto:+.1f} µs/step (95% CI {low:+.1f} .. {high:+.1f}) = "
            f"{auto / (step_s * 1e6) * 100:.3f} % of the step"
        )
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--profiler", action="store_true")
    parser.add_argument(
        "--aa", action="store_true", help="a second plain arm: the bench's noise floor (A/A)"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    import hook_cost

    options = vars(args)
    port = hook_cost._free_port()
    if args.ranks == 1:
        _rank(0, port, options)
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(port, options), nprocs=args.ranks)


if __name__ == "__main__":
    main()
