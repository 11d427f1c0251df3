"""What stepwatch costs off the training step, on a real 2-rank CPU DDP job with the defaults.

Off the step means the op histograms' profiler cycles (``TorchProfilerSource``, charged to its
``overhead_budget``, 0.04 % by default since the twenty-second round of issue 15, 0.05 %
before) and the export work (each window built, encoded and POSTed on the export thread, and
that thread's looks at the step count between windows). Since
the sixteenth round of issue 15 the two share one budget: the monitor measures its export work
on the thread's CPU clock and charges it to the source (``share_budget=True``, the default), so
the cycles get what the export leaves.

Both ranks train the same job side by side, the defaults a user gets (auto mode with phase
sampling, communication timing, op histograms, one window every 10 s, OTLP/HTTP to a loopback
receiver), except that rank 1's source keeps the budget to itself (``share_budget=False``,
as before). Per rank it prints the export thread's CPU clock over the measured span, what
each export cost (the first, which pays one-time set-up, apart), the profiler's own charged
cost, the export work charged to the budget, and the sum as a share of training time, against
the budget.

Usage: ``.venv/bin/python bench/offstep_cost.py [--steps 7000] [--hidden 1024] [--batch 128]``
(``--batch 128`` gives ~17-20 ms steps on this project's 2-core VM; a run shorter than a few
minutes is dominated by the profiler's warm-up and probe cycles and the first export).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rank(rank: int, options: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import overhead
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.kernels import TorchProfilerSource

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{options['dir']}/store", rank=rank, world_size=2
    )
    model = DistributedDataParallel(overhead.mlp(options["hidden"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    source = TorchProfilerSource(share_budget=rank == 0)
    monitor = StepMonitor(
        job_id="offstep-cost",
        rank=rank,
        world_size=2,
        endpoint=options["endpoint"],
        kernel_source=source,
    )
    exports: list[float] = []
    export_locked = monitor._export_locked

    def timed_export(timeout_s: float | None, *, final: bool) -> bool:
        started = time.thread_time()
        try:
            return export_locked(timeout_s, final=final)
        finally:
            exports.append(time.thread_time() - started)

    monitor._export_locked = timed_export  # type: ignore[method-assign]
    starts: list[int] = []  # the step count at each full cycle's start (the grid: the same)
    start_cycle = source._start_cycle

    def counted_start(now: int) -> None:
        start_cycle(now)
        running = source._running
        if running is not None and running.active_steps == source._active_steps:
            starts.append((source._last_index or 0) + 1)

    source._start_cycle = counted_start  # type: ignore[method-assign]
    thread = monitor._thread
    assert thread is not None and thread.ident is not None
    export_clock = time.pthread_getcpuclockid(thread.ident)
    monitor.instrument(model, optimizer)
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(rank)
    for _ in range(options["warmup"]):
        overhead.train_step(monitor, model, optimizer, loss_fn, generator, options["batch"])
    export_started = time.clock_gettime(export_clock)
    started, steps = time.perf_counter(), options["steps"]
    for _ in range(steps):  # a count, not a time: DDP's ranks must run the same steps
        overhead.train_step(monitor, model, optimizer, loss_fn, generator, options["batch"])
    wall = time.perf_counter() - started
    export_cpu = time.clock_gettime(export_clock) - export_started
    duty = source.duty_cycle
    monitor.close()
    stats = monitor.stats
    result = {
        "rank": rank,
        "share_budget": rank == 0,
        "steps": steps,
        "wall_s": wall,
        "export_thread_cpu_s": export_cpu,
        "exports_s": exports,
        "export_cpu_s": stats.export_cpu_s,
        "duty": duty._asdict(),
        "starts": starts,
    }
    Path(options["dir"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7000, help="measured steps (~2 min)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    import overhead
    import torch.multiprocessing as mp

    receiver = overhead.Receiver()
    with tempfile.TemporaryDirectory() as folder:
        options = {**vars(args), "dir": folder, "endpoint": receiver.url}
        mp.spawn(_rank, args=(options,), nprocs=2)  # type: ignore[no-untyped-call]
        results = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(2)]
    receiver.stop()
    load = os.getloadavg()[0]
    print(f"2-rank CPU DDP, {args.hidden} wide, batch {args.batch}; load average {load:.1f}")
    for result in results:
        duty, wall = result["duty"], result["wall_s"]
        step_ms = wall / result["steps"] * 1e3
        exports = result["exports_s"]
        steady = statistics.median(exports[1:]) if len(exports) > 1 else float("nan")
        profiler = duty["spent_s"] / wall * 100
        shared = duty["shared_spent_s"] / wall * 100
        export_thread = result["export_thread_cpu_s"] / wall * 100
        # The export thread's clock holds the profiler's drains too: counted once.
        in_all = profiler + export_thread - duty["drain_spent_s"] / wall * 100
        print(
            f"rank {result['rank']} (share_budget={result['share_budget']}): "
            f"{result['steps']} steps of {step_ms:.1f} ms in {wall:.0f} s; export thread CPU "
            f"{result['export_thread_cpu_s'] * 1e3:.1f} ms = {export_thread:.4f} % of the time; "
            f"{len(exports)} exports: first {exports[0] * 1e3:.2f} ms, then median "
            f"{steady * 1e3:.2f} ms; profiler: {duty['cycles']} cycles, period "
            f"{duty['period_steps']} steps, charged {duty['spent_s'] * 1e3:.1f} ms = "
            f"{profiler:.4f} %; export work charged to the budget "
            f"{duty['shared_spent_s'] * 1e3:.1f} ms = {shared:.4f} %; off the step in all "
            f"(profiler + export thread) {in_all:.4f} % "
            f"(budget {duty['overhead_budget'] * 100:.3f} %); full cycles started after steps "
            f"{result['starts']}"
        )
    # In a synchronous job a rank's profiled steps hold the other up too: what the job pays
    # for is the steps where either rank profiles (twenty-second round: the same steps, where
    # both ranks share a grid; here rank 1 keeps the budget to itself, so its grid may be finer).
    first, second = (set(r["starts"]) for r in results)
    print(
        f"full cycles: rank 0 {len(first)}, rank 1 {len(second)}, starting on the same step "
        f"{len(first & second)}; steps either rank profiled in a full cycle: "
        f"{len(first | second)} cycles' worth"
    )


if __name__ == "__main__":
    main()
