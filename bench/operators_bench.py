"""Operators' view figures: report generation, dashboard query latency, Alertmanager sink.

Run: .venv/bin/python bench/operators_bench.py [--ranks 64] [--windows 150]
Starts its own influxd and Alertmanager on free loopback ports and stops them. The job is a
simulated one (a compute straggler from mid-run) replayed through the real exporter and
bridge code into influxd, and diagnosed by the detectors, like ``stepwatch simulate
--write-direct`` then ``stepwatch detect``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The dashboards' queries as Grafana sends them, from the module beside the generator.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dashboards"))
from queries import all_queries, interpolate

from stepwatch.app._replay import write_direct
from stepwatch.core import Diagnosis, InfluxClient, ManagedAlertmanager, ManagedInfluxDB
from stepwatch.detectors import (
    AlertmanagerSink,
    Fault,
    InfluxDiagnosisSink,
    SimulatedJob,
    detect_job,
    simulate,
    write_report,
)

STEPS_PER_WINDOW = 4
STEP_S = 0.5  # 2 s windows


def write_job(client: InfluxClient, *, ranks: int, windows: int) -> SimulatedJob:
    """A job ending now with a straggler from the middle; its findings stored too."""
    window_ns = round(STEPS_PER_WINDOW * STEP_S * 1e9)
    now = time.time_ns()
    start = (now // window_ns - windows) * window_ns
    straggler = min(5, ranks - 1)
    job = simulate(
        ranks,
        steps=windows * STEPS_PER_WINDOW,
        faults=[
            Fault.parse(f"compute_straggler@{windows * STEPS_PER_WINDOW // 2}:{straggler}:1.4")
        ],
        seed=7,
        job="bench-job",
        steps_per_window=STEPS_PER_WINDOW,
        step_s=STEP_S,
        start_unix_nano=start,
    )
    write_direct(job, client)
    truth = job.truth
    findings = detect_job(
        client, truth.job, start_unix_nano=truth.start_unix_nano, end_unix_nano=truth.end_unix_nano
    )
    InfluxDiagnosisSink(client).publish(findings)
    return job


def bench_influx(root: Path, ranks: int, windows: int) -> None:
    with ManagedInfluxDB(root / "influxd") as server:
        client = server.client()
        started = time.perf_counter()
        job = write_job(client, ranks=ranks, windows=windows)
        truth = job.truth
        print(
            f"demo data: {ranks} ranks x {windows} windows written and diagnosed in "
            f"{time.perf_counter() - started:.1f} s (exporter -> bridge -> influxd -> detectors)"
        )
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            path = write_report(
                client,
                truth.job,
                start_unix_nano=truth.start_unix_nano,
                end_unix_nano=truth.end_unix_nano,
                out_path=root / "report.html",
            )
            timings.append(time.perf_counter() - started)
        print(
            f"report: {min(timings) * 1000:.0f} ms best of 3, "
            f"{path.stat().st_size / 1024:.0f} KiB HTML"
        )
        variables = {
            "job": [truth.job],
            "host": sorted(set(job.hosts)),
            "rank": [str(rank) for rank in range(ranks)],
        }
        latencies = []
        slowest = ("", 0.0)
        for name, title, query in all_queries():
            sql = interpolate(
                query,
                variables,
                start_ms=truth.start_unix_nano // 10**6,
                end_ms=truth.end_unix_nano // 10**6,
            )
            started = time.perf_counter()
            client.query(sql, epoch="ms")
            elapsed = time.perf_counter() - started
            latencies.append(elapsed)
            if elapsed > slowest[1]:
                slowest = (f"{name} / {title}", elapsed)
        print(
            f"dashboard queries: {len(latencies)} queries, median "
            f"{statistics.median(latencies) * 1000:.1f} ms, max {slowest[1] * 1000:.1f} ms "
            f"({slowest[0]}), all {sum(latencies) * 1000:.0f} ms"
        )


def bench_alertmanager(root: Path, findings: int) -> None:
    with ManagedAlertmanager(root / "am") as manager:
        sink = AlertmanagerSink(manager.url)
        start = time.time_ns() - 60 * 10**9
        batch = [
            Diagnosis(
                job=f"bench-{i % 20}",
                kind="compute_straggler",
                start_unix_nano=start,
                end_unix_nano=None,
                severity="warning",
                score=3.0,
                summary=f"rank {i} slow",
                ranks=(i,),
            )
            for i in range(findings)
        ]
        started = time.perf_counter()
        sink.publish(batch)
        first = time.perf_counter() - started
        started = time.perf_counter()
        sink.publish(batch)
        again = time.perf_counter() - started
        started = time.perf_counter()
        while len(manager.alerts()) < findings and time.perf_counter() - started < 30:
            time.sleep(0.05)  # polling Alertmanager's API is what is measured
        visible = time.perf_counter() - started
        print(
            f"alertmanager: publish {findings} findings {first * 1000:.0f} ms (one POST), "
            f"re-publish {again * 1000:.2f} ms (nothing due), all visible in "
            f"/api/v2/alerts after {visible * 1000:.0f} ms"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--windows", type=int, default=150)
    parser.add_argument("--findings", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bench_influx(root, args.ranks, args.windows)
        bench_alertmanager(root, args.findings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
