"""Time from a fault's onset to its finding, at the default 10 s windows.

Run: ``.venv/bin/python bench/onset_latency.py [--ranks 4,64] [--export-interval-s 10]
[--slow-from-s 60] [--duration-s 150]``

A job of N ranks exported by the OpenTelemetry JS SDK (tests/interop/js/producer.js: each
rank's window closing at its own instant) through a real bridge into a real influxd; rank
N/2's forward doubles at ``--slow-from-s`` (a masked straggler, ~1.3x). Then the detectors are
run the way ``stepwatch detect --every`` runs them, on the data up to each instant in turn
(every 5 s past the onset), and the first instant whose pass names the straggler is the
finding's time. Prints, per job size, the onset-to-finding time in seconds and in windows.
Needs Node.js and ``npm ci`` in tests/interop/js (scripts/setup.sh).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stepwatch.core import ManagedInfluxDB
from stepwatch.detectors import detect_job
from stepwatch.detectors.frame import job_time_range
from stepwatch.otel_bridge import Bridge, InfluxV1Writer

PRODUCER = Path(__file__).resolve().parents[1] / "tests" / "interop" / "js" / "producer.js"


def measure(server: ManagedInfluxDB, ranks: int, args: argparse.Namespace) -> str:
    influx = server.client(database=f"onset_{ranks}")
    influx.create_database()
    bridge = Bridge(InfluxV1Writer(influx), flush_interval_s=0.05).start()
    job = f"onset-{ranks}"
    try:
        started_ns = time.time_ns()
        run = subprocess.run(
            ["node", str(PRODUCER), "--endpoint", bridge.http_url, "--ranks", str(ranks),
             "--job", job, "--duration-s", str(args.duration_s), "--step-ms", "50",
             "--export-interval-ms", str(round(args.export_interval_s * 1000)),
             "--slow-rank", str(ranks // 2), "--slow-from-s", str(args.slow_from_s),
             "--slow-factor", "2", "--phases", "data,forward,backward,optimizer,communication"],
            capture_output=True, text=True, cwd=PRODUCER.parent, check=True,
        )  # fmt: skip
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        bridge.forwarder.wait_idle(30)
    finally:
        bridge.stop()
    if summary["exports_failed"]:
        return f"{ranks} ranks: {summary['exports_failed']} exports failed"
    span = job_time_range(influx, job)
    assert span is not None
    onset = started_ns + round(args.slow_from_s * 1e9)
    for offset_s in range(0, round(args.duration_s - args.slow_from_s) + 30, 5):
        now = onset + offset_s * 10**9
        found = detect_job(influx, job, start_unix_nano=span[0] - 10**9, end_unix_nano=now)
        if any(ranks // 2 in d.ranks for d in found):
            named = next(d for d in found if ranks // 2 in d.ranks)
            windows = offset_s / args.export_interval_s
            return (
                f"{ranks} ranks: {named.kind} rank {ranks // 2} named {offset_s} s "
                f"({windows:.1f} windows) after the onset, at {named.slowdown:.2f}x"
            )
    return f"{ranks} ranks: not named"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="4,64")
    parser.add_argument("--export-interval-s", type=float, default=10.0)
    parser.add_argument("--slow-from-s", type=float, default=60.0)
    parser.add_argument("--duration-s", type=float, default=150.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory, ManagedInfluxDB(directory) as server:
        for ranks in (int(r) for r in args.ranks.split(",")):
            print(measure(server, ranks, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
