"""Record real DDP runs with real faults as line protocol, for the detectors' regression tests.

Run: ``.venv/bin/python scripts/record_real_runs.py [--faults none,straggler,stall,...]``

Each run is the demo job (``stepwatch.app._demo_job``): real PyTorch DDP ranks (CPU, gloo on
loopback), instrumented by ``StepMonitor`` in auto mode, exporting OTLP/HTTP through the bridge
into a managed influxd. After the run, every point of the job is read back with InfluxQL and
written, exactly as stored, to ``tests/data/real_runs/<name>.lp.gz`` (field types from
``SHOW FIELD KEYS``), with ``<name>.json`` describing the run. The tests load the files into a
fresh database and diagnose them through ``read_frame`` like any live job: the detectors are
checked on what a real job on this kind of machine does, not on the simulator.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from stepwatch.app._demo import run_demo_job
from stepwatch.app._demo_job import STALL_S, DemoJobConfig
from stepwatch.app._stack import LocalStack
from stepwatch.core import InfluxClient, ManagedInfluxDB
from stepwatch.core._influx import quote_ident, quote_literal
from stepwatch.core._lineproto import encode_point
from stepwatch.core._schema import JOB_ID

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "real_runs"
DEFAULT_FAULTS = "none,straggler,stall,jit,dataloader,link,regression"


def dump_job(client: InfluxClient, job: str) -> Iterator[str]:
    """Every stored point of ``job`` as line protocol, in time order per series."""
    where = f"{quote_ident(JOB_ID)} = {quote_literal(job)}"
    for series in client.query("SHOW MEASUREMENTS"):
        for (measurement,) in series.values:
            types = {
                row[0]: row[1]
                for item in client.query(f"SHOW FIELD KEYS FROM {quote_ident(measurement)}")
                for row in item.values
            }
            for item in client.query(
                f"SELECT * FROM {quote_ident(measurement)} WHERE {where} GROUP BY *"
            ):
                tags = {k: v for k, v in (item.tags or {}).items() if v != ""}
                for row in item.records():
                    fields: dict[str, float | int | str | bool] = {}
                    for key, value in row.items():
                        if key == "time" or key in tags or value is None:
                            continue
                        kind = types.get(key)
                        if kind == "integer":
                            fields[key] = int(value)
                        elif kind == "float":
                            fields[key] = float(value)
                        elif kind == "boolean":
                            fields[key] = bool(value)
                        elif kind == "string":
                            fields[key] = str(value)
                    if fields:
                        yield encode_point(measurement, tags, fields, int(row["time"]))


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What ``<name>.json`` says about a recorded run."""

    name: str
    job: str
    fault: str
    fault_rank: int | None
    fault_step: int | None
    world_size: int
    steps: int
    export_interval_s: float
    lines: int
    seconds: float
    recorded: str
    machine: str
    note: str
    kernel_period_steps: int | None = None


NOTES = {
    "none": "a healthy run",
    "straggler": "rank 2's forward does extra matrix multiplies from step {step} "
    "(compute straggler)",
    "stall": f"rank 2 stops for {STALL_S:.0f} s once at step {{step}} between optimizer and the "
    "next "
    "step, outside every phase (checkpoint write / GC pause); its peers wait in all-reduce",
    "jit": "rank 2 stalls 1.5 s once at step {step} inside forward (a JIT recompile)",
    "dataloader": "rank 2's data phase sleeps 8 ms per step from step {step}",
    "link": "rank 2's all-reduce is delayed 8 ms per step from step {step} (slow link)",
    "regression": "every rank does extra compute from step {step} (job-wide regression)",
}


def record(
    server: ManagedInfluxDB,
    work: Path,
    fault: str,
    *,
    steps: int,
    suffix: str = "",
    phase_sampling: int | str = 1,
    kernel_period: int = 0,
) -> RunRecord:
    name = f"{fault}{suffix}"
    job = f"real-{fault}-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    with LocalStack(work / job, influx_url=server.url, database=f"rec_{job}") as stack:
        assert stack.client is not None
        config = DemoJobConfig(
            job_id=job,
            fault=fault,
            steps=steps,
            endpoint=stack.otlp_http_endpoint,
            phase_sampling=phase_sampling,
            collect_kernels=kernel_period > 0,
            kernel_period_steps=max(kernel_period, 5),
            # 2/5 of the way in (120 of 300), as the demo's 240 of 600: the corpus' runs
            # are shorter than the demo, and the fault needs windows to show in.
            fault_step=2 * steps // 5,
        )
        run_demo_job(stack.client, config, progress=lambda _: None)
        lines = list(dump_job(stack.client, job))
    OUT.mkdir(parents=True, exist_ok=True)
    with gzip.open(OUT / f"{name}.lp.gz", "wt", compresslevel=9) as handle:
        handle.write("\n".join(lines) + "\n")
    rank_fault = fault not in ("none", "regression")
    result = RunRecord(
        name=name,
        job=job,
        fault=fault,
        fault_rank=config.fault_rank if rank_fault else None,
        fault_step=config.fault_step if fault != "none" else None,
        world_size=config.world_size,
        steps=steps,
        export_interval_s=config.export_interval_s,
        lines=len(lines),
        seconds=round(time.monotonic() - started, 1),
        recorded=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()}, {platform.python_version()}, 2-core VM",
        note=NOTES[fault].replace("{step}", str(config.fault_step))
        + ("" if phase_sampling == 1 else f"; phases sampled (phase_sampling={phase_sampling!r})")
        + (
            f"; op histograms (torch.profiler) on 5 steps in every {kernel_period}"
            if kernel_period
            else ""
        ),
        kernel_period_steps=kernel_period or None,
    )
    (OUT / f"{name}.json").write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--faults", default=DEFAULT_FAULTS, help="comma-separated demo faults")
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument(
        "--suffix", default="", help="added to each file name (a second run: --suffix -2)"
    )
    parser.add_argument(
        "--phase-sampling",
        default="1",
        help="StepMonitor's phase_sampling: 1 (every step, the default), N or auto",
    )
    parser.add_argument(
        "--kernel-period",
        type=int,
        default=0,
        help="collect op histograms with torch.profiler, 5 steps in every N (0: none, the default)",
    )
    args = parser.parse_args(argv)
    sampling: int | str = (
        args.phase_sampling if args.phase_sampling == "auto" else int(args.phase_sampling)
    )
    with (
        tempfile.TemporaryDirectory() as directory,
        ManagedInfluxDB(Path(directory) / "influxdb") as server,
    ):
        for fault in [f for f in args.faults.split(",") if f]:
            run = record(
                server,
                Path(directory),
                fault,
                steps=args.steps,
                suffix=args.suffix,
                phase_sampling=sampling,
                kernel_period=args.kernel_period,
            )
            print(f"{run.name:<11} {run.lines:>6} lines  {run.seconds:>6.1f} s  {run.job}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
