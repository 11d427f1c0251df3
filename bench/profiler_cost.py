"""What always-on CPU kernel collection with torch.profiler costs.

Run: ``.venv/bin/python bench/profiler_cost.py [--rounds N]``. Prints

1. µs per event of each way to read a finished profile: ``kineto_results.events()`` with the
   ``_KinetoEvent`` accessors (what :class:`TorchProfilerSource` uses), ``prof.events()``
   (FunctionEvent post-processing) and ``key_averages()``; plus the profiler's own stop cost
   per event and its start cost;
2. the overhead of :class:`TorchProfilerSource` on a small real training step (an MLP with
   SGD, one thread), A/B interleaved: blocks without and with the source alternate and the
   median of per-round ratios is reported, for several fixed duty cycles and the default
   adaptive one (whose decision is printed: period, measured cost per cycle), both in process
   CPU time (all threads, robust against other processes on a shared machine) and in wall
   time. A background thread drains the source every 0.5 s, as the export thread would.

``--drain-only`` prints a third part alone: what the export thread's drain of one 5-step cycle
costs per op, stage by stage, the way before the twenty-second round of issue 15 and now side by
side on the same profile (interleaved repetitions, the median of each on the thread's CPU
clock): reading it (every accessor asked, ``read_kineto_ops_checked``, against the ones a CPU
profile needs, ``read_kineto_ops``), the self-time pass (``self_time_events_python`` against
the C pass of ``self_time_events``) and the summariser's ``add_step``, which is unchanged.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time

import torch

from stepwatch.exporters.kernels import TorchProfilerSource
from stepwatch.exporters.kernels._summary import (
    KernelSummariser,
    self_time_events,
    self_time_events_python,
)
from stepwatch.exporters.kernels._torch_backend import read_kineto_ops, read_kineto_ops_checked


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, optimizer, torch.randn(128, 512), torch.randint(0, 10, (128,))


def _step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def read_paths(steps: int = 50) -> None:
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, x, y = _model()
    for _ in range(10):
        _step(model, optimizer, x, y)
    rows = []
    for label in ("events", "function_events", "key_averages"):
        prof = profile(activities=[ProfilerActivity.CPU])
        started = time.perf_counter_ns()
        prof.start()
        start_ns = time.perf_counter_ns() - started
        for _ in range(steps):
            _step(model, optimizer, x, y)
        started = time.perf_counter_ns()
        prof.stop()
        stop_ns = time.perf_counter_ns() - started
        results = prof.profiler.kineto_results
        count = len(results.events())
        started = time.perf_counter_ns()
        if label == "events":
            read_kineto_ops(results)
        elif label == "function_events":
            prof.events()
        else:
            prof.key_averages()
        read_ns = time.perf_counter_ns() - started
        rows.append((label, count, read_ns / 1e3 / count, stop_ns / 1e3 / count, start_ns / 1e3))
    print(f"profile of {steps} steps; read path µs/event, profiler stop µs/event, start µs")
    for label, count, read_us, stop_us, start_us in rows:
        print(
            f"  {label:<16} {count:>6} events  read {read_us:7.2f} µs/event  "
            f"stop {stop_us:5.2f} µs/event  start {start_us:7.0f} µs"
        )


def drain_stages(cycle_steps: int = 5, repeats: int = 30) -> None:
    """One cycle's drain on the export thread, per op: before and now, side by side."""
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, x, y = _model()
    for _ in range(10):
        _step(model, optimizer, x, y)
    prof = profile(activities=[ProfilerActivity.CPU])
    prof.start()
    for _ in range(cycle_steps):
        _step(model, optimizer, x, y)
    prof.stop()
    results = prof.profiler.kineto_results
    ops = read_kineto_ops(results)
    if ops != read_kineto_ops_checked(results):
        raise SystemExit("the two readers disagree")
    start, end = min(op.start_ns for op in ops), max(op.end_ns for op in ops) + 1
    own, top = self_time_events(ops)

    def add_step() -> None:
        KernelSummariser().add_step(own, start_ns=start, end_ns=end, busy=top)

    stages = {
        "read, every accessor": lambda: read_kineto_ops_checked(results),
        "read, the ones needed": lambda: read_kineto_ops(results),
        "self time, Python": lambda: self_time_events_python(ops),
        "self time, C": lambda: self_time_events(ops),
        "summariser add_step": add_step,
    }
    times: dict[str, list[int]] = {label: [] for label in stages}
    for _ in range(repeats):
        for label, stage in stages.items():
            started = time.thread_time_ns()
            stage()
            times[label].append(time.thread_time_ns() - started)
    per_op = {label: statistics.median(t) / len(ops) / 1e3 for label, t in times.items()}
    print(f"drain of one {cycle_steps}-step cycle, {len(ops)} ops (µs an op, thread CPU):")
    for label, value in per_op.items():
        print(f"  {label:<24} {value:6.3f}")
    before = per_op["read, every accessor"] + per_op["self time, Python"]
    now = per_op["read, the ones needed"] + per_op["self time, C"]
    summary = per_op["summariser add_step"]
    print(
        f"  a cycle's drain: {(before + summary) * len(ops) / 1e3:.2f} ms before, "
        f"{(now + summary) * len(ops) / 1e3:.2f} ms now "
        f"({(now + summary) / (before + summary):.2f}x)"
    )


def overhead(rounds: int, block_steps: int) -> None:
    model, optimizer, x, y = _model()
    for _ in range(50):
        _step(model, optimizer, x, y)

    def block(source: TorchProfilerSource | None, first_step: int) -> tuple[float, float]:
        started, started_cpu = time.perf_counter(), time.process_time()
        for index in range(first_step, first_step + block_steps):
            _step(model, optimizer, x, y)
            if source is not None:
                source.on_step_end(index)
        return (
            (time.perf_counter() - started) / block_steps,
            (time.process_time() - started_cpu) / block_steps,
        )

    schedules: tuple[tuple[int, int | None], ...] = (
        (50, 50),
        (5, 50),
        (5, 100),
        (5, 200),
        (5, 400),
        (5, None),  # the default: adaptive, 0.1 % budget
    )
    for active, period in schedules:
        source = TorchProfilerSource(active_steps=active, period_steps=period)
        stop = threading.Event()
        drained = [0]

        def drain_loop(
            source: TorchProfilerSource = source,
            stop: threading.Event = stop,
            drained: list[int] = drained,
        ) -> None:
            while not stop.wait(0.5):
                window = source.drain()
                drained[0] += sum(len(v) for v in window.durations_s.values())

        thread = threading.Thread(target=drain_loop, daemon=True)
        thread.start()
        ratios, cpu_ratios, base_times = [], [], []
        step = 0
        for _ in range(rounds):
            base, base_cpu = block(None, step)
            step += block_steps
            with_source, with_source_cpu = block(source, step)
            step += block_steps
            ratios.append(with_source / base)
            cpu_ratios.append(with_source_cpu / base_cpu)
            base_times.append(base)
        stop.set()
        thread.join()
        source.close()
        drained[0] += sum(len(v) for v in source.drain().durations_s.values())
        median = statistics.median(ratios)
        cpu_median = statistics.median(cpu_ratios)
        low, _, high = statistics.quantiles(cpu_ratios, n=4)
        step_ms = statistics.median(base_times) * 1e3
        label = f"{period:>4}" if period is not None else "auto"
        print(
            f"  active {active:>3} / period {label}: step {step_ms:6.2f} ms, overhead "
            f"CPU {100 * (cpu_median - 1):+6.2f} % (IQR {100 * (low - 1):+.1f}.."
            f"{100 * (high - 1):+.1f} %), wall {100 * (median - 1):+6.2f} % "
            f"(medians of {rounds} A/B rounds), "
            f"{drained[0]} ops summarised"
        )
        duty = source.duty_cycle
        if duty.adaptive and duty.cycle_cost_s is not None and duty.baseline_step_s:
            total_s = rounds * block_steps * duty.baseline_step_s
            print(
                f"    adaptive: {duty.cycles} cycles (the first a 1-step probe), period "
                f"{duty.period_steps} steps, predicted cost/cycle {duty.cycle_cost_s * 1e3:.2f} ms "
                f"(last: training thread {duty.training_cost_s or 0.0:.4f} s, export thread "
                f"{duty.drain_cost_s or 0.0:.4f} s), expected "
                f"{100 * (duty.expected_overhead or 0.0):.3f} % of step time; charged "
                f"{duty.spent_s * 1e3:.1f} ms = {100 * duty.spent_s / total_s:.2f} % of the "
                f"instrumented blocks (the probe's cost is repaid over the next period)"
            )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block-steps", type=int, default=200)
    parser.add_argument("--drain-only", action="store_true", help="the drain's stages alone")
    args = parser.parse_args(argv[1:])
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 intra-op thread", flush=True)
    drain_stages()
    if args.drain_only:
        return 0
    read_paths()
    print(f"overhead of TorchProfilerSource ({args.block_steps}-step blocks, A/B interleaved):")
    overhead(args.rounds, args.block_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
