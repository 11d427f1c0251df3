"""Every fault of ``stepwatch demo`` through the real pipeline, and what the detectors say.

Run: ``.venv/bin/python bench/demo_faults.py [--faults straggler,link,...] [--clean-runs 2]
[--no-kernels] [--no-story] [--phase-sampling 16] [--kernel-period N|default] [--steps N]
[--export-interval S]``

``--kernel-period default --steps 40000 --export-interval 10`` runs the jobs as a user's job
runs by default: the op histograms' own budgeted duty cycle and 10 s windows (minutes a run).

``--phase-sampling N`` times phases on 1 step in N in every row (the demo's own default is
``auto``: 1 in 8 at its ~9 ms steps and 0.25 s windows): the detectors on sparse samples.

First (unless ``--no-story``) the default story exactly as typed: ``stepwatch demo`` in a
subprocess (its own managed influxd), timed: wall time, CPU time of it and its children, and
the host's load average before it (the machine may be shared), with the finding, cost and
report path it printed. Then each row is one real 4-rank DDP job (separate processes, gloo on
loopback, StepMonitor → OTLP/HTTP → the bridge → a managed influxd) with the CLI's defaults
(600 steps, fault from step 240, kernel timings 5 steps in 25),
diagnosed exactly as the demo CLI does (:func:`stepwatch.app._demo.write_outputs` over the
job's range ±1 s). Prints: fault, expected finding, diagnosed kinds/ranks/hosts, the top
finding's cost, correct (the expected finding and nothing else; for ``none``, no finding at
all) and the wall time of the run.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from stepwatch.app._demo import run_demo_job, write_outputs
from stepwatch.app._demo_job import DemoJobConfig, kernels_by_default
from stepwatch.app._stack import LocalStack
from stepwatch.core import ManagedInfluxDB
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.detectors.frame import job_time_range

FAULT_RANK = 2
FAULT_HOST_SUFFIX = f"-node{FAULT_RANK // 2}"
EXPECTED = {
    "straggler": "compute_/masked_straggler rank 2 forward",
    "link": f"link_degradation rank 2 / host *{FAULT_HOST_SUFFIX}",
    "jit": "jit_stall rank 2",
    "dataloader": "dataloader_stall rank 2 data",
    "regression": "job_regression",
    "none": "nothing",
}


def _expected(fault: str, diagnosis: Diagnosis) -> bool:
    ranks = set(diagnosis.ranks)
    if fault == "straggler":
        return (
            diagnosis.kind in ("compute_straggler", "masked_straggler")
            and ranks == {FAULT_RANK}
            and diagnosis.phase == "forward"
        )
    if fault == "link":
        return diagnosis.kind == "link_degradation" and (
            FAULT_RANK in ranks or any(h.endswith(FAULT_HOST_SUFFIX) for h in diagnosis.hosts)
        )
    if fault == "jit":
        return diagnosis.kind == "jit_stall" and ranks == {FAULT_RANK}
    if fault == "dataloader":
        return (
            diagnosis.kind == "dataloader_stall"
            and ranks == {FAULT_RANK}
            and diagnosis.phase == "data"
        )
    if fault == "regression":
        return diagnosis.kind == "job_regression"
    return False


def correct(fault: str, diagnoses: Sequence[Diagnosis]) -> bool:
    """The expected finding and nothing else (``none``: no finding at all)."""
    if fault == "none":
        return not diagnoses
    return bool(diagnoses) and all(_expected(fault, d) for d in diagnoses)


def describe(diagnosis: Diagnosis) -> str:
    where = ",".join(str(r) for r in diagnosis.ranks)
    hosts = ",".join(h.rsplit("-", 1)[-1] for h in diagnosis.hosts)
    parts = [diagnosis.kind]
    if where:
        parts.append(f"r{where}")
    if hosts:
        parts.append(f"h{hosts}")
    if diagnosis.phase:
        parts.append(diagnosis.phase)
    return " ".join(parts)


def story(work: Path) -> None:
    """``stepwatch demo`` as a user runs it: wall and CPU time, and what it concluded."""
    load = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from stepwatch.app._cli import main; sys.exit(main())",
            "demo",
            "--data-dir",
            str(work / "story"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    wall_s = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(
        f"stepwatch demo (default story): exit {done.returncode}, wall {wall_s:.1f} s, "
        f"CPU {cpu_s:.1f} s (user+sys, all its processes; {os.cpu_count()} cores), "
        f"load average before {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )
    shown = r"^(?:training finished|finding:|cost:|verdict:|report:).*$"
    for line in re.findall(shown, done.stdout, flags=re.MULTILINE):
        print(f"  {line}")
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:], sep="\n")
    sys.stdout.flush()


def run_one(
    server: ManagedInfluxDB,
    work: Path,
    fault: str,
    *,
    kernels: bool,
    phase_sampling: int | str = "auto",
    kernel_period: int | None = 25,
    steps: int = 600,
    export_interval_s: float = 0.25,
) -> tuple[list[Diagnosis], float]:
    started = time.monotonic()
    name = f"{fault}-{uuid.uuid4().hex[:6]}"
    with LocalStack(work / name, influx_url=server.url, database=f"demo_{name}") as stack:
        if stack.client is None:
            raise RuntimeError("the stack has no InfluxDB client")
        config = DemoJobConfig(
            job_id=f"demo-{name}",
            fault=fault,
            fault_rank=FAULT_RANK,
            endpoint=stack.otlp_http_endpoint,
            collect_kernels=kernels,
            phase_sampling=phase_sampling,
            kernel_period_steps=kernel_period,
            steps=steps,
            fault_step=steps * 2 // 5,
            export_interval_s=export_interval_s,
        )
        run_demo_job(stack.client, config, progress=lambda _: None)
        time_range = job_time_range(stack.client, config.job_id)
        if time_range is None:
            raise RuntimeError(f"job {config.job_id} left no data")
        diagnoses, _ = write_outputs(
            stack.client,
            config.job_id,
            out_dir=work,
            start_unix_nano=time_range[0] - 1_000_000_000,
            end_unix_nano=time_range[1] + 1_000_000_000,
        )
    return list(diagnoses), time.monotonic() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--faults",
        default="straggler,link,jit,dataloader,regression",
        help="comma-separated faults (default: every injected fault)",
    )
    parser.add_argument("--clean-runs", type=int, default=2, help="runs with --fault none")
    parser.add_argument(
        "--kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="collect kernel timings (default: as the CLI does for each fault)",
    )
    parser.add_argument(
        "--story",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first time `stepwatch demo` itself (default on)",
    )
    parser.add_argument(
        "--kernel-period",
        default="25",
        help="op histograms on 5 steps in every N (the demo's 25), or 'default': the "
        "always-on TorchProfilerSource() with its overhead budget (needs long runs: --steps)",
    )
    parser.add_argument("--steps", type=int, default=600, help="steps per run (the demo's 600)")
    parser.add_argument(
        "--export-interval", type=float, default=0.25, help="seconds a window (the demo's 0.25)"
    )
    parser.add_argument(
        "--phase-sampling",
        default="auto",
        help="StepMonitor's phase_sampling for every row: auto (the default) or 1 in N",
    )
    args = parser.parse_args(argv)
    sampling: int | str = "auto" if args.phase_sampling == "auto" else int(args.phase_sampling)
    period = None if args.kernel_period == "default" else int(args.kernel_period)
    faults = [f for f in args.faults.split(",") if f] + ["none"] * args.clean_runs
    rows: list[tuple[str, str, str, bool, float]] = []
    with tempfile.TemporaryDirectory() as directory:
        if args.story:
            story(Path(directory))
        print(
            "kernel timings: "
            + ("as the CLI" if args.kernels is None else "on" if args.kernels else "off")
            + f"; phase sampling: {sampling}; op histograms: "
            + ("the default budget" if period is None else f"5 steps in {period}")
            + f"; {args.steps} steps, fault from {args.steps * 2 // 5}, "
            + f"{args.export_interval:g} s windows"
        )
        print(
            f"{'fault':<11} {'expected':<44} {'diagnosed':<44} {'cost':>5} {'ok':<3} {'run s':>6}"
        )
        with ManagedInfluxDB(Path(directory) / "influxdb") as server:
            for fault in faults:
                kernels = kernels_by_default(fault) if args.kernels is None else args.kernels
                diagnoses, elapsed_s = run_one(
                    server,
                    Path(directory),
                    fault,
                    kernels=kernels,
                    phase_sampling=sampling,
                    kernel_period=period,
                    steps=args.steps,
                    export_interval_s=args.export_interval,
                )
                found = "; ".join(describe(d) for d in diagnoses) or "-"
                cost = f"{max(d.slowdown for d in diagnoses):.2f}x" if diagnoses else "-"
                ok = correct(fault, diagnoses)
                rows.append((fault, EXPECTED[fault], found, ok, elapsed_s))
                print(
                    f"{fault:<11} {EXPECTED[fault]:<44} {found:<44} {cost:>5} "
                    f"{'yes' if ok else 'NO':<3} {elapsed_s:>6.1f}",
                    flush=True,
                )
    faulty = [row for row in rows if row[0] != "none"]
    clean = [row for row in rows if row[0] == "none"]
    print(
        f"faults diagnosed right: {sum(r[3] for r in faulty)}/{len(faulty)}; "
        f"clean runs without a finding: {sum(r[3] for r in clean)}/{len(clean)}; "
        f"total {sum(r[4] for r in rows):.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
