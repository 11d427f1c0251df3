"""Load on the bridge: many simulated ranks over real OTLP gRPC and HTTP on loopback.

    .venv/bin/python bench/bridge_load.py [--ranks 256] [--seconds 15] [--clients 16]

Starts a managed influxd and the bridge as its own process (``stepwatch bridge``), then:

1. sustained: ``--clients`` client threads (half OTLP/HTTP protobuf, half OTLP/gRPC) send the
   windows of ``--ranks`` ranks (one step histogram, six phase histograms, ``--kernels``
   kernel-class histograms and the last-step gauge per window) as fast as the bridge answers.
   Reports datapoints/s written to InfluxDB (from the bridge's own /metrics), request latency
   p50/p99, the bridge's RSS, and checks InfluxDB holds exactly the points accepted.
2. direct: the same points as line protocol written straight to the same influxd with
   ``InfluxClient`` in 5,000-line batches, for comparison.
3. overload: a bridge with a small queue, ``--overload-clients`` clients, and influxd
   stalled (SIGSTOP) for the first half: the bridge must answer 429/503/RESOURCE_EXHAUSTED
   instead of growing, and its RSS stays bounded.
4. ack latency: requests one at a time on one keep-alive connection, with a memory spool
   and with a disk spool (every answer waits for its fsync'd group commit): the cost of
   "accepted means durable".
5. slow clients: ``--slow-clients`` connections send a request's headers, then trickle its
   body one byte a second while a real ``StepMonitor`` exports windows: the share of windows
   delivered, and the bridge's thread count.
6. CPU per call: for each protocol, a fresh bridge process takes every window over
   ``--clients`` connections of that protocol alone; its CPU (``/proc``, all threads) from the
   first request until InfluxDB has every point, per request and per point, and what that is
   for a fleet of ``--fleet-ranks`` ranks exporting every ``--fleet-interval-s``
   (``--cpu-only``: this phase alone).

Bounded in count and time; prints its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bridge_clients import (  # noqa: E402
    ACCEPTED,
    grpc_sender,
    http_sender,
    quantile,
    rss_mib,
)

T0 = 1_790_000_000_000_000_000
PHASES = ("data", "forward", "backward", "optimizer", "communication", "other")


def window_body(
    rng: random.Random, *, job: str, rank: int, world_size: int, window: int, kernels: int
) -> bytes:
    """One rank's window as an OTLP ExportMetricsServiceRequest (protobuf bytes)."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    end = T0 + window * 1_000_000_000
    request = ExportMetricsServiceRequest()
    resource_metrics = request.resource_metrics.add()
    for key, value in (
        ("stepwatch.job.id", job),
        ("stepwatch.rank", rank),
        ("stepwatch.world_size", world_size),
        ("host.name", f"node-{rank // 8}"),
        ("stepwatch.local_rank", rank % 8),
    ):
        item = resource_metrics.resource.attributes.add(key=key)
        if isinstance(value, int):
            item.value.int_value = value
        else:
            item.value.string_value = value
    scope = resource_metrics.scope_metrics.add()
    scope.scope.name = "stepwatch"

    def histogram(name: str, attrs: dict[str, str], base_s: float) -> None:
        metric = scope.metrics.add(name=name, unit="s")
        metric.exponential_histogram.aggregation_temporality = 1  # type: ignore[assignment]
        point = metric.exponential_histogram.data_points.add(
            start_time_unix_nano=end - 1_000_000_000, time_unix_nano=end, scale=3
        )
        for key, value in attrs.items():
            point.attributes.add(key=key).value.string_value = value
        values = [base_s * rng.lognormvariate(0, 0.1) for _ in range(8)]
        indexes = [math.ceil(math.log2(v) * 8) - 1 for v in values]
        low = min(indexes)
        counts = [0] * (max(indexes) - low + 1)
        for index in indexes:
            counts[index - low] += 1
        point.positive.offset = low
        point.positive.bucket_counts.extend(counts)
        point.count = len(values)
        point.sum = sum(values)
        point.min = min(values)
        point.max = max(values)

    histogram("stepwatch.step.duration", {}, 0.25)
    for phase in PHASES:
        histogram("stepwatch.phase.duration", {"stepwatch.phase": phase}, 0.04)
    for index in range(kernels):
        histogram(
            "stepwatch.kernel.duration",
            {"stepwatch.kernel.class": f"k{index}", "stepwatch.kernel.category": "compute"},
            0.002,
        )
    gauge = scope.metrics.add(name="stepwatch.step.last", unit="{step}")
    gauge.gauge.data_points.add(time_unix_nano=end, as_int=window * 8 + 7)
    return bytes(request.SerializeToString())


class Client(threading.Thread):
    """Sends bodies over one keep-alive HTTP connection or one gRPC channel."""

    def __init__(self, transport: str, endpoint: str, bodies: list[bytes], deadline: float) -> None:
        super().__init__(daemon=True)
        self.transport = transport
        self.endpoint = endpoint
        self.bodies = bodies
        self.deadline = deadline
        self.latencies_s: list[float] = []
        self.codes: Counter[str] = Counter()
        self.accepted_bodies: list[bytes] = []

    def run(self) -> None:
        sender = grpc_sender if self.transport == "grpc" else http_sender
        send, close = sender(self.endpoint)
        try:
            for body in self.bodies:
                if time.monotonic() > self.deadline:
                    break
                while time.monotonic() <= self.deadline:
                    started = time.perf_counter()
                    code, _ = send(body)
                    self.latencies_s.append(time.perf_counter() - started)
                    self.codes[code] += 1
                    if code in ACCEPTED:
                        self.accepted_bodies.append(body)
                        break
                    time.sleep(0.05)  # a real exporter backs off (Retry-After is 1 s)
        finally:
            close()


def scrape(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def start_bridge(
    influx_url: str, database: str, extra: Sequence[str]
) -> tuple[subprocess.Popen[str], dict[str, str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "--log-level", "ERROR", "bridge",
         "--influx-url", influx_url, "--database", database,
         "--grpc-port", "0", "--http-port", "0", *extra],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")},
    )  # fmt: skip
    endpoints: dict[str, str] = {}
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    while "writing" not in endpoints and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise SystemExit("bridge exited before printing its endpoints")
        kind, _, value = line.partition(": ")[2].partition(" ")
        endpoints[kind] = value.strip()
    return process, endpoints


def stop_bridge(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
    if process.stdout is not None:
        process.stdout.close()


def run_clients(
    endpoints: dict[str, str],
    bodies: list[list[bytes]],
    clients: int,
    seconds: float,
) -> list[Client]:
    http_endpoint = endpoints["OTLP/HTTP"].split("://", 1)[1].split("/", 1)[0]
    deadline = time.monotonic() + seconds
    threads = [
        Client(
            "grpc" if index % 2 else "http",
            endpoints["OTLP/gRPC"] if index % 2 else http_endpoint,
            bodies[index],
            deadline,
        )
        for index in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    return threads


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--windows", type=int, default=40, help="windows per rank at most")
    parser.add_argument("--kernels", type=int, default=12)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--overload-clients", type=int, default=96)
    parser.add_argument("--overload-seconds", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--slow-clients", type=int, default=300)
    parser.add_argument("--fleet-ranks", type=int, default=10_000)
    parser.add_argument("--fleet-interval-s", type=float, default=10.0)
    parser.add_argument("--cpu-only", action="store_true", help="phase [6] alone")
    args = parser.parse_args(argv)

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    from stepwatch.core import InfluxClient, ManagedInfluxDB
    from stepwatch.core._influx import wait_until
    from stepwatch.otel_bridge import convert_request

    rng = random.Random(args.seed)
    points_per_window = 1 + len(PHASES) + args.kernels + 1
    print(
        f"{args.ranks} ranks x <= {args.windows} windows, {points_per_window} points per "
        f"window, {args.clients} clients (half HTTP, half gRPC), {args.seconds:.0f} s"
    )
    started = time.perf_counter()
    windows = [
        [
            window_body(
                rng, job="load", rank=rank, world_size=args.ranks, window=window,
                kernels=args.kernels,
            )
            for rank in range(args.ranks)
        ]
        for window in range(args.windows)
    ]  # fmt: skip
    # client i sends ranks i, i+clients, ... window by window (like ranks exporting in step)
    per_client: list[list[bytes]] = [[] for _ in range(max(args.clients, args.overload_clients))]
    for window in windows:
        for rank, body in enumerate(window):
            per_client[rank % args.clients].append(body)
    print(f"generated {sum(map(len, windows))} requests in {time.perf_counter() - started:.1f} s")

    with tempfile.TemporaryDirectory() as directory:
        influxd = ManagedInfluxDB(Path(directory) / "influxd").start()
        try:
            if args.cpu_only:
                cpu_report(influxd.url, per_client[: args.clients], points_per_window, args)
                return 0
            # 1. sustained load through the bridge
            process, endpoints = start_bridge(influxd.url, "load", [])
            try:
                client = InfluxClient(influxd.url, database="load")
                metrics_url = endpoints["metrics"]
                before = scrape(metrics_url)
                t_start = time.perf_counter()
                threads = run_clients(endpoints, per_client[: args.clients], args.clients,
                                      args.seconds)  # fmt: skip
                sent_s = time.perf_counter() - t_start
                accepted = sum(len(thread.accepted_bodies) for thread in threads)
                expected_points = accepted * points_per_window

                def drained() -> bool:
                    values = scrape(metrics_url)
                    written = values.get("stepwatch_bridge_datapoints_written_total", 0.0)
                    return bool(written >= expected_points)

                wait_until(drained, timeout_s=120, interval_s=0.2)
                total_s = time.perf_counter() - t_start
                after = scrape(metrics_url)
                rss, hwm = rss_mib(process.pid)
            finally:
                stop_bridge(process)
            latencies = [value for thread in threads for value in thread.latencies_s]
            codes: Counter[str] = Counter()
            for thread in threads:
                codes.update(thread.codes)
            written = after["stepwatch_bridge_datapoints_written_total"] - before.get(
                "stepwatch_bridge_datapoints_written_total", 0
            )
            stored = sum(
                row.values[0][1]
                for row in client.query(
                    'SELECT count("count") FROM "stepwatch.step.duration",'
                    '"stepwatch.phase.duration","stepwatch.kernel.duration"'
                )
            ) + sum(row.values[0][1] for row in client.query(
                'SELECT count("gauge") FROM "stepwatch.step.last"'))  # fmt: skip
            print("\n[1] sustained load through the bridge")
            print(f"  requests accepted: {accepted} in {sent_s:.1f} s; answers: {dict(codes)}")
            print(f"  datapoints written: {written:.0f} ({written / total_s:,.0f}/s incl. drain; "
                  f"{expected_points / sent_s:,.0f}/s accepted while sending)")  # fmt: skip
            print(f"  InfluxDB holds {stored} points; expected {expected_points} "
                  f"({'OK' if stored == expected_points else 'MISMATCH'})")  # fmt: skip
            print(f"  request latency p50 {quantile(latencies, 0.5) * 1e3:.1f} ms, "
                  f"p99 {quantile(latencies, 0.99) * 1e3:.1f} ms")  # fmt: skip
            write_s = after["stepwatch_bridge_write_duration_seconds_sum"]
            print(f"  bridge RSS {rss:.0f} MiB (peak {hwm:.0f} MiB)")
            print(f"  time inside InfluxDB writes: {write_s:.1f} s "
                  f"({written / write_s:,.0f} points/s while writing)")  # fmt: skip

            # 2. the same points written directly as line protocol
            lines: list[str] = []
            for body in (b for thread in threads for b in thread.accepted_bodies):
                request = ExportMetricsServiceRequest.FromString(body)
                lines.extend(convert_request(request).lines)
            direct = InfluxClient(influxd.url, database="direct")
            direct.create_database()
            t_direct = time.perf_counter()
            for index in range(0, len(lines), 5000):
                direct.write_lines(lines[index : index + 5000])
            direct_s = time.perf_counter() - t_direct
            print("\n[2] direct line-protocol write to the same influxd (5,000-line batches)")
            print(f"  {len(lines)} points in {direct_s:.1f} s: {len(lines) / direct_s:,.0f}/s")

            # 3. overload: many clients, small queue
            overload_bodies: list[list[bytes]] = [[] for _ in range(args.overload_clients)]
            for window in windows:
                for rank, body in enumerate(window):
                    overload_bodies[rank % args.overload_clients].append(body)
            process, endpoints = start_bridge(
                influxd.url, "overload", ["--max-queue-lines", "20000"]
            )
            try:
                peak = [0.0]
                stop = threading.Event()

                def sample() -> None:
                    while not stop.wait(0.2):
                        peak[0] = max(peak[0], rss_mib(process.pid)[0])

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                # InfluxDB stalls (SIGSTOP) for the first half: writes hang, the queue fills.
                influxd_pid = influxd._process.pid  # type: ignore[union-attr]
                os.kill(influxd_pid, signal.SIGSTOP)
                resume = threading.Timer(
                    args.overload_seconds / 2, os.kill, (influxd_pid, signal.SIGCONT)
                )
                resume.start()
                try:
                    threads = run_clients(endpoints, overload_bodies, args.overload_clients,
                                          args.overload_seconds)  # fmt: skip
                finally:
                    resume.join()
                    os.kill(influxd_pid, signal.SIGCONT)
                stop.set()
                sampler.join()
                values = scrape(endpoints["metrics"])
                rss, hwm = rss_mib(process.pid)
            finally:
                stop_bridge(process)
            codes = Counter()
            for thread in threads:
                codes.update(thread.codes)
            latencies = [value for thread in threads for value in thread.latencies_s]
            refused = sum(v for k, v in codes.items() if not k.endswith((":200", ":OK")))
            print(
                f"\n[3] overload: {args.overload_clients} clients, queue bound 20,000 points, "
                f"influxd stalled for {args.overload_seconds / 2:.0f} s"
            )
            print(f"  answers: {dict(codes)}")
            print(f"  refused (429/503/RESOURCE_EXHAUSTED): {refused} of {sum(codes.values())}")
            print(f"  written {values['stepwatch_bridge_datapoints_written_total']:.0f} points; "
                  f"latency p99 {quantile(latencies, 0.99) * 1e3:.0f} ms")  # fmt: skip
            print(f"  bridge RSS peak {max(peak[0], hwm):.0f} MiB (now {rss:.0f} MiB)")

            print("\n[4] ack latency, one request at a time (keep-alive HTTP)")
            for label, extra in (("memory spool", []), ("disk spool", ["--spool-dir"])):
                if extra:
                    extra = [*extra, str(Path(directory) / "ack-spool")]
                latencies = ack_latencies(influxd.url, windows[0][:200], extra)
                print(f"  {label}: p50 {quantile(latencies, 0.5) * 1e3:.2f} ms, "
                      f"p99 {quantile(latencies, 0.99) * 1e3:.2f} ms")  # fmt: skip

            exported, windows_sent, threads_now = slow_clients(influxd.url, args.slow_clients)
            print(f"\n[5] {args.slow_clients} slow clients trickling bodies, one StepMonitor")
            print(f"  windows exported: {exported} of {windows_sent} "
                  f"({exported / windows_sent:.0%}); bridge threads {threads_now}")  # fmt: skip

            cpu_report(influxd.url, per_client[: args.clients], points_per_window, args)
        finally:
            influxd.stop()
    return 0


def cpu_report(
    influx_url: str, bodies: list[list[bytes]], points_per_window: int, args: argparse.Namespace
) -> None:
    """Phase [6]: the bridge's CPU per call for each protocol, and for the fleet."""
    print(f"\n[6] bridge CPU per call, {args.clients} connections of one protocol; "
          f"a {args.fleet_ranks:,}-rank fleet at one window every "
          f"{args.fleet_interval_s:g} s makes "
          f"{args.fleet_ranks / args.fleet_interval_s:,.0f} calls/s")  # fmt: skip
    for transport in ("http", "grpc"):
        calls, cpu_s = cpu_per_call(
            influx_url, f"cpu_{transport}", transport, bodies,
            points_per_window,
        )  # fmt: skip
        per_call_us = cpu_s / calls * 1e6
        share = per_call_us * 1e-6 * args.fleet_ranks / args.fleet_interval_s
        print(f"  {transport}: {calls} calls, {per_call_us:.0f} us CPU per call, "
              f"{per_call_us / points_per_window:.1f} us per point; the fleet: "
              f"{share:.2f} of one core")  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system, all threads), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_call(
    influx_url: str, database: str, transport: str, bodies: list[list[bytes]], points: int
) -> tuple[int, float]:
    """Calls accepted and the bridge's CPU seconds for them (one protocol, fresh process)."""
    from stepwatch.core import InfluxClient
    from stepwatch.core._influx import wait_until

    InfluxClient(influx_url, database=database).create_database()
    process, endpoints = start_bridge(influx_url, database, [])
    try:
        if transport == "grpc":
            endpoint = endpoints["OTLP/gRPC"]
        else:
            endpoint = endpoints["OTLP/HTTP"].split("://", 1)[1].split("/", 1)[0]
        deadline = time.monotonic() + 120
        threads = [Client(transport, endpoint, share, deadline) for share in bodies]
        before = cpu_seconds(process.pid)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(130)
        calls = sum(len(thread.accepted_bodies) for thread in threads)

        def drained() -> bool:
            values = scrape(endpoints["metrics"])
            return values.get("stepwatch_bridge_datapoints_written_total", 0.0) >= calls * points

        wait_until(drained, timeout_s=120, interval_s=0.2)
        return calls, cpu_seconds(process.pid) - before
    finally:
        stop_bridge(process)


def ack_latencies(influx_url: str, bodies: list[bytes], extra: list[str]) -> list[float]:
    """Latency of each request sent one at a time to a fresh bridge."""
    process, endpoints = start_bridge(influx_url, "ack", extra)
    try:
        send, close = http_sender(endpoints["OTLP/HTTP"].split("://", 1)[1].split("/", 1)[0])
        latencies = []
        for body in bodies:
            started = time.perf_counter()
            code, _ = send(body)
            latencies.append(time.perf_counter() - started)
            if code != "http:200":
                raise SystemExit(f"ack latency: answer {code}")
        close()
    finally:
        stop_bridge(process)
    return latencies


def slow_clients(influx_url: str, count: int, windows: int = 30) -> tuple[int, int, int]:
    """Windows a StepMonitor exports while ``count`` clients trickle; the bridge's threads."""
    import socket

    from stepwatch.exporters import StepMonitor

    process, endpoints = start_bridge(influx_url, "slow", [])
    url = endpoints["OTLP/HTTP"]
    host, port = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    sockets = []
    stop = threading.Event()
    try:
        for _ in range(count):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"POST /v1/metrics HTTP/1.1\r\nContent-Length: 100000\r\n\r\n")
            sockets.append(sock)

        def trickle() -> None:
            while not stop.wait(1.0):
                for sock in sockets:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X")

        threading.Thread(target=trickle, daemon=True).start()
        monitor = StepMonitor(
            job_id="slow-bench", rank=0, world_size=1, endpoint=url.removesuffix("/v1/metrics"),
            health=False, start=False, timeout_s=5,
        )  # fmt: skip
        for _ in range(windows):
            with monitor.step(), monitor.phase("forward"):
                time.sleep(0.1)
            monitor.export_now(timeout_s=5)
        exported = monitor.stats.windows_exported
        monitor.close()
        status = Path(f"/proc/{process.pid}/status").read_text()
        threads_now = int(status.split("Threads:")[1].split()[0])
    finally:
        stop.set()
        for sock in sockets:
            sock.close()
        stop_bridge(process)
    return exported, windows, threads_now


if __name__ == "__main__":
    sys.exit(main())
