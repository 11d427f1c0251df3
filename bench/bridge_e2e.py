"""The bridge process's whole CPU per stored point against influxd's, end to end, before vs after.

Run: ``.venv/bin/python bench/bridge_e2e.py [--ranks 64] [--windows 40] [--baseline-rev REV]``

``bench/bridge_cpu.py`` times the intake alone (decompression, conversion, guards, spool).
This bench is the issue's measure: the CPU of the whole bridge process (its OTLP/HTTP and
OTLP/gRPC servers, the intake, the writer sending batches to InfluxDB, its metrics) per stored
point, against the CPU of the influxd that stores them (write, then snapshot and full
compaction of the shard), in one run.

Builds ``ranks x windows`` realistic windows with the exporters' WindowBuilder (as
bench/bridge_cpu.py does: 28 points per window with 20 kernel classes). For each round, each
version (``--baseline-rev``'s code via ``git archive``, its C fast path built in place; and the
working tree's) and each protocol: a fresh managed influxd, the bridge as its own process with
that version's code (``Bridge`` with an ``InfluxV1Writer``, the defaults otherwise), and
``--connections`` client threads in this process sending every window once over keep-alive
OTLP/HTTP (gzip bodies, as exporters send by default) or OTLP/gRPC channels. The bridge's
CPU is read from ``/proc`` from before the first request to the moment it has written
everything; influxd's from its start of writing to the end of its compaction. Refused requests
are sent again after 50 ms (exporters retry them). Every figure is
the median of the rounds (min-max); the ratio is taken per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROTOCOLS = ("http", "grpc")


def serve(influx_url: str, database: str) -> int:
    """Child: a bridge on free ports; prints them, then answers ``idle`` on stdin."""
    from stepwatch.core import InfluxClient
    from stepwatch.otel_bridge import Bridge, InfluxV1Writer

    writer = InfluxV1Writer(InfluxClient(influx_url, database=database))
    bridge = Bridge(writer, grpc_port=0, http_port=0, max_new_series_per_s=None).start()
    print(f"{bridge.http_url} {bridge.grpc_endpoint}", flush=True)
    try:
        for line in sys.stdin:
            if line.strip() == "idle":
                print("idle" if bridge.forwarder.wait_idle(120) else "busy", flush=True)
            elif line.strip() == "stop":
                break
    finally:
        bridge.stop()
        writer.close()
    return 0


def _send_all(protocol: str, endpoint: str, bodies: list[bytes], connections: int) -> int:
    """Every body over ``connections`` keep-alive connections until it is accepted; the
    number of refusals."""
    import http.client

    from bench.bridge_clients import grpc_sender, post_metrics

    refused = [0]

    def work(part: list[bytes]) -> None:
        # A refused request (429/503, RESOURCE_EXHAUSTED/UNAVAILABLE: the queue is full while
        # influxd creates a large job's series) is sent again, as exporters do; the bridge's
        # work on refusals is part of its cost.
        if protocol == "http":
            host, port = endpoint.rsplit(":", 1)
            connection = http.client.HTTPConnection(host, int(port), timeout=60)
            headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
            for body in part:
                while post_metrics(connection, body, headers)[0] != 200:
                    refused[0] += 1
                    time.sleep(0.05)
            connection.close()
        else:
            send, close = grpc_sender(endpoint, timeout_s=60)
            for body in part:
                while send(body)[0] != "grpc:OK":
                    refused[0] += 1
                    time.sleep(0.05)
            close()

    threads = [
        threading.Thread(target=work, args=(bodies[index::connections],))
        for index in range(connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return refused[0]


def one_run(
    tree: Path, protocol: str, bodies: list[bytes], points: int, connections: int
) -> dict[str, float]:
    """A fresh influxd and bridge: the bridge's and influxd's CPU per stored point."""
    from bench.bridge_clients import cpu_seconds
    from bench.storage_bytes import settle
    from stepwatch.core import InfluxClient, ManagedInfluxDB

    with tempfile.TemporaryDirectory(prefix="bridge-e2e-") as directory:
        os.environ["INFLUXDB_DATA_CACHE_SNAPSHOT_WRITE_COLD_DURATION"] = "2s"
        os.environ["INFLUXDB_DATA_COMPACT_FULL_WRITE_COLD_DURATION"] = "5s"
        data_dir = Path(directory) / "influxd"
        influxd = ManagedInfluxDB(data_dir, database="e2e").start()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(tree / s) for s in ("core/src", "exporters/src", "otel_bridge/src")] + [str(REPO)]
        )
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", influxd.url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            client = InfluxClient(influxd.url, database="e2e")
            client.create_database()
            assert child.stdout is not None and child.stdin is not None
            http_url, grpc_endpoint = child.stdout.readline().split()
            endpoint = http_url.split("//", 1)[1].split("/", 1)[0]
            influx_pid = influxd._process.pid  # type: ignore[union-attr]
            bridge_before, influx_before = cpu_seconds(child.pid), cpu_seconds(influx_pid)
            refusals = _send_all(
                protocol, endpoint if protocol == "http" else grpc_endpoint, bodies, connections
            )
            child.stdin.write("idle\n")
            child.stdin.flush()
            idle = child.stdout.readline().strip() == "idle"
            bridge_cpu = cpu_seconds(child.pid) - bridge_before
            _, settled = settle(data_dir, "e2e", timeout_s=300)
            influx_cpu = cpu_seconds(influx_pid) - influx_before
            child.stdin.write("stop\n")
            child.stdin.flush()
            child.wait(60)
        finally:
            if child.poll() is None:
                child.kill()
            influxd.stop()
    return {
        "bridge": bridge_cpu / points * 1e6,
        "influxd": influx_cpu / points * 1e6,
        "refused": float(refusals),
        "idle": float(idle),
        "settled": float(settled),
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--windows", type=int, default=40, help="windows per rank")
    parser.add_argument("--kernels", type=int, default=20, help="kernel classes per window")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per version")
    parser.add_argument("--connections", type=int, default=8, help="client connections")
    parser.add_argument("--baseline-rev", default="", help="git rev measured as 'before'")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument(
        "--protocols", default=",".join(PROTOCOLS), help="comma-separated: http, grpc"
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve, "e2e")

    import gzip

    from bench.bridge_cpu import build_bodies, source_tree

    bodies = build_bodies(args.ranks, args.windows, args.kernels, args.seed)
    raw = [gzip.decompress(body) for body in bodies]  # gRPC sends the protobuf as is
    from stepwatch.otel_bridge._convert import convert_request
    from stepwatch.otel_bridge._decode import parse_protobuf

    points = sum(len(convert_request(parse_protobuf(body)).lines) for body in raw)
    with tempfile.TemporaryDirectory(prefix="bridge-e2e-trees-") as directory:
        versions = {"after": source_tree("", Path(directory))}
        if args.baseline_rev:
            (Path(directory) / "before").mkdir()
            before = source_tree(args.baseline_rev, Path(directory) / "before")
            versions = {"before": before, **versions}
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for protocol in args.protocols.split(","):
                for version, tree in versions.items():
                    run = one_run(
                        tree, protocol, bodies if protocol == "http" else raw, points,
                        args.connections,
                    )  # fmt: skip
                    results.setdefault((version, protocol), []).append(run)
    print(
        f"{args.ranks} ranks x {args.windows} windows, {args.kernels} kernel classes: {points} "
        f"points in {len(bodies)} requests over {args.connections} connections; CPU per stored "
        f"point, median of {args.rounds} interleaved rounds (min-max)"
    )
    for (version, protocol), runs in results.items():
        bridge = [run["bridge"] for run in runs]
        influxd = [run["influxd"] for run in runs]
        ratios = [b / i for b, i in zip(bridge, influxd, strict=True)]
        problems = sum(run["refused"] for run in runs)
        unsettled = sum(not run["settled"] or not run["idle"] for run in runs)
        print(
            f"  {version:6} {protocol:4}  bridge {spread(bridge)} us  influxd {spread(influxd)} "
            f"us  bridge / influxd {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
            + (f"  [{problems:.0f} refusals, sent again]" if problems else "")
            + (f"  [{unsettled} runs not settled]" if unsettled else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
