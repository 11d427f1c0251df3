"""The OpenTelemetry JavaScript SDK over OTLP/HTTP for a minute: windows sent vs stored.

Run: ``.venv/bin/python bench/bridge_js_minute.py [--ranks 8] [--seconds 60] [--protocol http]``

Starts a managed influxd and a bridge (its defaults), runs ``tests/interop/js/producer.js``
(``--ranks`` ranks, one export a second each, DELTA; the JS exporter's bodies are chunked, with
no ``Content-Length``), then counts the step windows the producer's exporters sent and had
answered, and the windows InfluxDB holds, per rank, with every step in them. Needs Node.js and
``npm ci`` in tests/interop/js (scripts/setup.sh).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--temporality", choices=("delta", "cumulative"), default="delta")
    args = parser.parse_args()

    from stepwatch.core import ManagedInfluxDB
    from stepwatch.otel_bridge import Bridge, InfluxV1Writer

    with tempfile.TemporaryDirectory() as directory:
        influxd = ManagedInfluxDB(Path(directory) / "influxd").start()
        try:
            client = influxd.client(database="js")
            client.create_database()
            with Bridge(InfluxV1Writer(client)) as bridge:
                endpoint = (
                    bridge.http_url if args.protocol == "http" else f"http://{bridge.grpc_endpoint}"
                )
                started = time.monotonic()
                run = subprocess.run(
                    ["node", str(REPO / "tests/interop/js/producer.js"), "--endpoint", endpoint,
                     "--protocol", args.protocol, "--temporality", args.temporality,
                     "--ranks", str(args.ranks), "--job", "js-minute",
                     "--duration-s", str(args.seconds), "--step-ms", "100",
                     "--export-interval-ms", "1000",
                     "--phases", "data,forward,backward,optimizer,communication"],
                    capture_output=True, text=True, check=True, timeout=args.seconds + 120,
                )  # fmt: skip
                summary = json.loads(run.stdout.strip().splitlines()[-1])
                bridge.forwarder.wait_idle(30)
                elapsed = time.monotonic() - started
                requests = {
                    sample.labels["code"]: int(sample.value)
                    for metric in bridge.metrics.registry.collect()
                    if metric.name == "stepwatch_bridge_requests"
                    for sample in metric.samples
                    if sample.name.endswith("_total") and sample.labels["protocol"] == args.protocol
                }
            series = client.query(
                'SELECT "count" FROM "stepwatch.step.duration" GROUP BY "stepwatch.rank"'
            )
            stored = {int(s.tags["stepwatch.rank"]): [int(r[1]) for r in s.values] for s in series}
        finally:
            influxd.stop()
    sent = summary["step_windows"]
    if args.temporality == "cumulative":
        sent = [[b - a for a, b in itertools.pairwise(counts)] for counts in sent]
    same = all(stored.get(rank) == windows for rank, windows in enumerate(sent))
    print(f"JS SDK over OTLP/{args.protocol.upper()}, {args.temporality}, {args.ranks} ranks, "
          f"{args.seconds:g} s ({elapsed:.0f} s with start and flush)")  # fmt: skip
    print(f"  exports attempted {summary['exports_attempted']}, failed "
          f"{summary['exports_failed']}; bridge answers {requests}")  # fmt: skip
    print(f"  step windows sent {sum(map(len, sent))}, stored {sum(map(len, stored.values()))}; "
          f"steps sent {sum(map(sum, sent))}, stored {sum(map(sum, stored.values()))}; "
          f"every window stored as sent: {same}")  # fmt: skip
    return 0 if same and not summary["exports_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
