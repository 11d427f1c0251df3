"""The export thread's CPU between exports: its looks at the step count in C vs in Python.

Between two windows (10 s by default) the export thread looks at the step count once a second,
to export early when a rank stalls (``_cadence``). In Python each look takes the GIL; since
the sixteenth round of issue 15 the looks run in C without it (``_fastrecord.ExportWaiter``)
and the thread takes the GIL only to export. This bench runs a training loop with a default
monitor (10 s windows, an in-memory exporter) in separate processes, the two
arms alternating (``c``: the default; ``python``: ``_cadence.WAITER`` set to None), and prints
the export thread's CPU clock per second of each, from its first export on (which pays
one-time set-up), for two loops:

- ``gil``: a pure-Python loop that never releases the GIL (~1 ms steps), the worst case;
- ``torch``: a small CPU matmul loop (torch ops hold the GIL too, between them it is released
  only briefly).

Usage: ``.venv/bin/python bench/export_looks.py [--seconds 30] [--rounds 3]`` (each run also
waits ~10 s for its first export)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _arm(arm: str, loop: str, seconds: float) -> None:
    from stepwatch.exporters import InMemoryExporter, StepMonitor
    from stepwatch.exporters.monitor import _cadence

    if arm == "python":
        _cadence.WAITER = None
    exporter = InMemoryExporter()
    monitor = StepMonitor(job_id="looks", rank=0, world_size=1, exporter=exporter)
    thread = monitor._thread
    assert thread is not None and thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)
    if loop == "torch":
        import torch

        torch.set_num_threads(1)
        weights = torch.randn(512, 512)

        def work() -> None:
            value = weights
            for _ in range(10):
                value = torch.tanh(value @ weights)

    else:

        def work() -> None:
            sum(i * i for i in range(40_000))

    while not exporter.exported:  # the first export pays one-time set-up: not measured
        with monitor.step():
            work()
    started_cpu, started = time.clock_gettime(clock), time.monotonic()
    steps = 0
    while time.monotonic() - started < seconds:
        with monitor.step():
            work()
        steps += 1
    wall = time.monotonic() - started
    cpu = time.clock_gettime(clock) - started_cpu
    monitor.close()
    print(json.dumps({"cpu_ms_per_s": cpu * 1e3 / wall, "step_ms": wall / steps * 1e3}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arm", choices=("c", "python"), help=argparse.SUPPRESS)
    parser.add_argument("--loop", choices=("gil", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        _arm(args.arm, args.loop, args.seconds)
        return
    for loop in ("gil", "torch"):
        results: dict[str, list[dict[str, float]]] = {"c": [], "python": []}
        for _ in range(args.rounds):
            for arm in ("c", "python"):
                command = [sys.executable, __file__, "--arm", arm, "--loop", loop]
                command += ["--seconds", str(args.seconds)]
                output = subprocess.run(command, capture_output=True, text=True, check=True)
                results[arm].append(json.loads(output.stdout.strip().splitlines()[-1]))
        c, python = (statistics.median(r["cpu_ms_per_s"] for r in results[a]) for a in results)
        step_ms = statistics.median(r["step_ms"] for r in results["c"])
        print(
            f"{loop} loop (~{step_ms:.1f} ms steps, {args.rounds} runs an arm of "
            f"{args.seconds:.0f} s, alternating): export thread {c:.3f} ms of CPU a second "
            f"with the looks in C ({c / 10:.4f} % of a core), {python:.3f} ms in Python "
            f"({python / 10:.4f} %): {python / c:.1f}x"
        )


if __name__ == "__main__":
    main()
