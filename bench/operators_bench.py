"""Operators' view figures: report generation, dashboard query latency, Alertmanager sink.

Run: .venv/bin/python bench/operators_bench.py [--ranks 64] [--windows 150]
Starts its own influxd and Alertmanager on free loopback ports and stops them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.operators.conftest import ManagedAlertmanager, WebhookReceiver  # noqa: E402
from tests.operators.demo_data import write_demo  # noqa: E402
from tests.operators.test_dashboards import all_queries, interpolate  # noqa: E402

from stepwatch.core import Diagnosis, ManagedInfluxDB  # noqa: E402
from stepwatch.detectors.report import write_report  # noqa: E402
from stepwatch.detectors.sinks._alertmanager import AlertmanagerSink  # noqa: E402


def bench_influx(root: Path, ranks: int, windows: int) -> None:
    with ManagedInfluxDB(root / "influxd") as server:
        client = server.client()
        now = time.time_ns()
        started = time.perf_counter()
        job = write_demo(
            client,
            end_unix_nano=now - now % 10**9,
            ranks=ranks,
            windows=windows,
            straggler_rank=min(5, ranks - 1),
            straggler_from_window=windows // 2,
        )
        print(
            f"demo data: {ranks} ranks x {windows} windows written in "
            f"{time.perf_counter() - started:.1f} s (exporter -> bridge -> influxd)"
        )
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            path = write_report(
                client,
                job.job,
                start_unix_nano=job.start_unix_nano,
                end_unix_nano=job.end_unix_nano,
                out_path=root / "report.html",
            )
            timings.append(time.perf_counter() - started)
        print(
            f"report: {min(timings) * 1000:.0f} ms best of 3, "
            f"{path.stat().st_size / 1024:.0f} KiB HTML"
        )
        variables = {
            "job": [job.job],
            "host": list(job.hosts),
            "rank": [str(rank) for rank in range(ranks)],
        }
        latencies = []
        slowest = ("", 0.0)
        for name, title, query in all_queries():
            sql = interpolate(
                query,
                variables,
                start_ms=job.start_unix_nano // 10**6,
                end_ms=job.end_unix_nano // 10**6,
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
    receiver = WebhookReceiver().start()
    manager = ManagedAlertmanager(root / "am", webhook_url=receiver.url)
    try:
        manager.start()
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
            time.sleep(0.05)
        visible = time.perf_counter() - started
        print(
            f"alertmanager: publish {findings} findings {first * 1000:.0f} ms (one POST), "
            f"re-publish {again * 1000:.2f} ms (nothing due), all visible in "
            f"/api/v2/alerts after {visible * 1000:.0f} ms"
        )
    finally:
        manager.stop()
        receiver.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--windows", type=int, default=150)
    parser.add_argument("--findings", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bench_influx(root, args.ranks, args.windows)
        (root / "am").mkdir()
        bench_alertmanager(root, args.findings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
