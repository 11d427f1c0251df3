"""Scale-out simulation: 10,000 ranks at a reduced rate into N SO_REUSEPORT bridge processes.

    .venv/bin/python bench/scale_sim.py [--ranks 10000] [--bridges 2] [--period-s 30]
                                        [--seconds 60] [--http-connections 384]
                                        [--grpc-channels 128]

Starts one managed influxd and ``--bridges`` bridge processes (this script in ``--serve-bridge``
mode: an in-process ``Bridge(reuse_port=True)`` each) sharing one OTLP/gRPC and one OTLP/HTTP
port on loopback. Every simulated rank has a realistic window built with the exporters'
``WindowBuilder`` (step histogram, ``step.last``, 5 phases, ``--kernels`` kernel classes, device
idle; ~28 data points, ~4.4 KB of OTLP) and sends one window every ``--period-s`` seconds,
phases spread uniformly, over ``--http-connections`` keep-alive OTLP/HTTP connections and
``--grpc-channels`` OTLP/gRPC channels, for ``--seconds``. Then it measures:

* accepted and written datapoints/s, request latency p50/p99, schedule lag of the clients;
* per bridge process: CPU seconds and RSS (peak), points written, answers by code;
* influxd: CPU seconds, points stored (checked against points accepted), write throughput;
* disk bytes per point after influxd snapshots its cache to TSM, for the sparse run (2 points
  per series: per-series overhead dominates) and for a dense slice (``--dense-ranks`` ranks
  x ``--dense-windows`` windows 1 s apart written directly, like a real run);

and prints a sizing table for 10,000 / 25,000 / 100,000 ranks at 1 window/s and 1 window/10 s,
derived from the measured CPU seconds per point (not from wall-clock throughput, which the
shared 2-core box cannot give honestly for several processes at once). Loopback only; bounded
in count and time; stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bridge_clients import (  # noqa: E402
    ACCEPTED,
    Sender,
    cpu_seconds,
    grpc_sender,
    http_sender,
    quantile,
    rss_mib,
)

PHASES = ("data", "forward", "backward", "optimizer", "communication")
RANKS_PER_NODE = 8
# A Python bridge process is bound to about one core by the GIL; plan it at 60 % so bursts
# (ranks exporting in phase), spool replay after an InfluxDB outage and retries fit.
BRIDGE_UTILISATION = 0.6


# -- the bridge process ----------------------------------------------------------------------------


def serve_bridge(config: dict[str, Any]) -> int:
    """Run one Bridge until stdin says ``stop``; answer ``report`` with its metrics as JSON."""
    from stepwatch.core import InfluxClient
    from stepwatch.otel_bridge import Bridge, InfluxV1Writer

    writer = InfluxV1Writer(InfluxClient(config["influx_url"], database=config["database"]))
    bridge = Bridge(
        writer,
        grpc_port=config["grpc_port"],
        http_port=config["http_port"],
        reuse_port=True,
        max_series_per_measurement=config["max_series"],
        # The timed run meets series the warm-up wrote straight to InfluxDB as new: size the
        # guard for a whole 10,000-rank job (280,000 series) per process, as deployment.md says.
        max_series_total=2_000_000,
        max_new_series_per_s=50_000,
        grpc_max_concurrent_rpcs=1024,
        max_concurrent_requests=256,
    ).start()

    def report() -> None:
        values: dict[str, float] = {}
        for family in bridge.metrics.registry.collect():
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        print(json.dumps(values), flush=True)

    print("ready", flush=True)
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "report":
                report()
            elif command == "stop":
                break
    finally:
        bridge.stop()
        writer.close()
    report()
    return 0


class BridgeProcess:
    """A bridge child process driven over its stdin/stdout."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-bridge", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout_s: float) -> None:
        line = self._readline(timeout_s)
        if line.strip() != "ready":
            raise SystemExit(f"bridge {self.pid} did not start: {line!r}")

    def _readline(self, timeout_s: float) -> str:
        result: list[str] = []
        reader = threading.Thread(
            target=lambda: result.append(self.process.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(timeout_s)
        if not result:
            raise SystemExit(f"bridge {self.pid} did not answer within {timeout_s} s")
        return result[0]

    def report(self) -> dict[str, float]:
        with self._lock:
            self.process.stdin.write("report\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            return dict(json.loads(self._readline(30)))

    def stop(self) -> dict[str, float]:
        final: dict[str, float] = {}
        try:
            self.process.stdin.write("stop\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            final = dict(json.loads(self._readline(60)))
            self.process.wait(timeout=30)
        except (OSError, ValueError, SystemExit, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(timeout=10)
        return final


# -- the simulated ranks ---------------------------------------------------------------------------


def first_window(rng: random.Random, *, rank: int, ranks: int, kernels: int, end_ns: int) -> Any:
    """One rank's window, built by the exporters' WindowBuilder, as an OTLP request."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (
        encode_metrics,
    )

    from stepwatch.exporters import KernelWindow, WindowBuilder, build_resource

    builder = WindowBuilder(
        build_resource(
            job_id="scale",
            rank=rank,
            world_size=ranks,
            host_name=f"node-{rank // RANKS_PER_NODE:05d}",
            local_rank=rank % RANKS_PER_NODE,
        )
    )
    steps = 3
    for step in range(steps):
        builder.add_step(
            step_index=step,
            duration_s=0.5 * rng.lognormvariate(0, 0.05),
            phases_s={phase: 0.1 * rng.lognormvariate(0, 0.1) for phase in PHASES},
        )
    durations = {
        (f"k{index:02d}", "communication" if index >= kernels - 4 else "compute"): [
            0.0005 * (index + 1) * rng.lognormvariate(0, 0.2) for _ in range(2 * steps)
        ]
        for index in range(kernels)
    }
    builder.add_kernels(KernelWindow(durations, [0.01 * rng.random() for _ in range(steps)]))
    data = builder.build(start_unix_nano=end_ns - 1_500_000_000, end_unix_nano=end_ns)
    return encode_metrics(data)


def shifted(request: Any, delta_ns: int, steps: int) -> bytes:
    """The same window ``delta_ns`` later (``steps`` more steps): the rank's next export."""
    copy = type(request)()
    copy.CopyFrom(request)
    for resource_metrics in copy.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                for point in getattr(metric, kind).data_points:
                    point.time_unix_nano += delta_ns
                    if point.start_time_unix_nano:
                        point.start_time_unix_nano += delta_ns
                    if kind == "gauge":
                        point.as_int += steps
    return bytes(copy.SerializeToString())


def point_count(request: Any) -> int:
    return sum(
        len(getattr(metric, metric.WhichOneof("data")).data_points)
        for resource_metrics in request.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    )


class Send:
    __slots__ = ("at_s", "body", "points")

    def __init__(self, at_s: float, body: bytes, points: int) -> None:
        self.at_s = at_s
        self.body = body
        self.points = points


class Client(threading.Thread):
    """One keep-alive OTLP/HTTP connection or one OTLP/gRPC channel, sending on schedule."""

    def __init__(self, transport: str, endpoint: str, sends: list[Send], stop_at: float) -> None:
        super().__init__(daemon=True)
        self.transport = transport
        self.endpoint = endpoint
        self.sends = sends
        self.stop_at = stop_at
        self.latencies_s: list[float] = []
        self.lags_s: list[float] = []
        self.codes: Counter[str] = Counter()
        self.accepted_points = 0
        self.rejected_points = 0

    def run(self) -> None:
        sender = grpc_sender if self.transport == "grpc" else http_sender
        export, close = sender(self.endpoint)
        try:
            self._loop(export)
        finally:
            close()

    def _loop(self, export: Sender) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceResponse,
        )

        for send in self.sends:
            delay = send.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing the simulated exporter, not waiting for a server
            self.lags_s.append(max(0.0, -delay))
            while time.monotonic() < self.stop_at:
                started = time.perf_counter()
                code, answer = export(send.body)
                self.latencies_s.append(time.perf_counter() - started)
                self.codes[code] += 1
                if code in ACCEPTED:
                    reply = ExportMetricsServiceResponse.FromString(answer)
                    rejected = reply.partial_success.rejected_data_points
                    self.rejected_points += rejected
                    self.accepted_points += send.points - rejected
                    break
                time.sleep(1.0)  # Retry-After / RetryInfo is 1 s


def directory_bytes(path: Path, pattern: str = "*") -> int:
    """Bytes allocated on disk (not apparent sizes: influxd preallocates its series file)."""
    return sum(item.stat().st_blocks * 512 for item in path.rglob(pattern) if item.is_file())


def wait_for_snapshot(wal: Path, timeout_s: float) -> bool:
    """Poll until influxd has snapshotted its cache (WAL segments of the run removed)."""
    from stepwatch.core._influx import wait_until

    return wait_until(lambda: directory_bytes(wal) < 64 * 1024, timeout_s=timeout_s, interval_s=1)


# -- the run ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-bridge", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=10_000)
    parser.add_argument("--bridges", type=int, default=2)
    parser.add_argument("--period-s", type=float, default=30.0, help="seconds between windows")
    parser.add_argument("--seconds", type=float, default=60.0, help="sending time (<= 120)")
    parser.add_argument("--kernels", type=int, default=20, help="kernel classes per rank")
    parser.add_argument("--http-connections", type=int, default=384)
    parser.add_argument("--grpc-channels", type=int, default=128)
    parser.add_argument("--dense-ranks", type=int, default=32)
    parser.add_argument("--dense-windows", type=int, default=120)
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip creating every series before the run (then the run is a job-start storm)",
    )
    parser.add_argument("--seed", type=int, default=6)
    args = parser.parse_args(argv)
    if args.serve_bridge:
        return serve_bridge(json.loads(args.serve_bridge))
    if not 0 < args.seconds <= 120 or not 1 <= args.bridges <= 8 or args.ranks > 200_000:
        parser.error("bounded: --seconds in (0, 120], --bridges in [1, 8], --ranks <= 200000")

    from stepwatch.core import InfluxClient, ManagedInfluxDB
    from stepwatch.core._influx import wait_until
    from stepwatch.core._net import free_port
    from stepwatch.otel_bridge import convert_request

    rng = random.Random(args.seed)
    windows_per_rank = max(1, int(args.seconds // args.period_s))
    period_ns = int(args.period_s * 1e9)
    print(
        f"{args.ranks} ranks ({args.ranks // RANKS_PER_NODE} nodes), one window per "
        f"{args.period_s:g} s each for {args.seconds:g} s ({windows_per_rank} per rank), "
        f"{args.kernels} kernel classes; {args.bridges} bridge process(es) on one port "
        f"(SO_REUSEPORT); {args.http_connections} OTLP/HTTP connections + "
        f"{args.grpc_channels} OTLP/gRPC channels"
    )
    started = time.perf_counter()
    base_ns = time.time_ns()
    offsets_s = [rank * args.period_s / args.ranks for rank in range(args.ranks)]
    firsts = [
        first_window(rng, rank=rank, ranks=args.ranks, kernels=args.kernels,
                     end_ns=base_ns + int(offsets_s[rank] * 1e9))
        for rank in range(args.ranks)
    ]  # fmt: skip
    points_per_window = point_count(firsts[0])
    body_bytes = len(firsts[0].SerializeToString())
    sample = convert_request(firsts[0]).lines
    line_bytes = sum(len(line) + 1 for line in sample) / len(sample)
    fields_per_point = sum(line.rsplit(" ", 2)[1].count(",") + 1 for line in sample) / len(sample)
    series_per_rank = len(sample)
    schedule: list[tuple[float, int, bytes]] = []  # (offset s, rank, body)
    for window in range(windows_per_rank):
        for rank, request in enumerate(firsts):
            body = shifted(request, window * period_ns, window * 3)
            schedule.append((offsets_s[rank] + window * args.period_s, rank, body))
    schedule.sort(key=lambda item: item[0])
    print(
        f"generated {len(schedule)} requests ({points_per_window} points, {body_bytes} B OTLP, "
        f"{line_bytes:.0f} B line protocol and {fields_per_point:.1f} fields per point) in "
        f"{time.perf_counter() - started:.0f} s"
    )

    with tempfile.TemporaryDirectory(prefix="scale-sim-") as directory:
        # influx 1.x reads INFLUXDB_* overrides: snapshot the cache to TSM soon after the run so
        # the disk figure is the compressed one.
        os.environ["INFLUXDB_DATA_CACHE_SNAPSHOT_WRITE_COLD_DURATION"] = "5s"
        influxd = ManagedInfluxDB(Path(directory) / "influxd", database="scale").start()
        bridges: list[BridgeProcess] = []
        try:  # influxd is stopped whatever happens below
            try:
                influx_pid = influxd._process.pid  # type: ignore[union-attr]
                # Warm-up: the job's series exist before the measured run (a training job
                # creates them in its first window); this measures series creation itself.
                warm_points = 0
                warm_s = warm_cpu = 0.0
                if args.warmup:
                    warm_client = InfluxClient(influxd.url, database="scale", timeout_s=300)
                    warm_cpu = cpu_seconds(influx_pid)
                    t_warm = time.perf_counter()
                    batch: list[str] = []
                    for request in firsts:
                        warm = type(request)()
                        warm.ParseFromString(shifted(request, -period_ns, -3))
                        batch.extend(convert_request(warm).lines)
                        if len(batch) >= 5000:
                            warm_client.write_lines(batch)
                            warm_points += len(batch)
                            batch = []
                    if batch:
                        warm_client.write_lines(batch)
                        warm_points += len(batch)
                    warm_s = time.perf_counter() - t_warm
                    warm_cpu = cpu_seconds(influx_pid) - warm_cpu
                grpc_port, http_port = free_port(), free_port()
                config = {
                    "influx_url": influxd.url, "database": "scale", "grpc_port": grpc_port,
                    "http_port": http_port,
                    # 10,000 ranks x 20 kernel classes = 200,000 kernel series in one job: the
                    # default guard (100,000 per measurement per job) would refuse half of them.
                    "max_series": max(100_000, 2 * args.ranks * (args.kernels + 6)),
                }  # fmt: skip
                bridges = [BridgeProcess(config) for _ in range(args.bridges)]
                for bridge in bridges:
                    bridge.wait_ready(120)
                idle_start = {b.pid: cpu_seconds(b.pid) for b in bridges}
                time.sleep(3.0)  # the bridges' idle cost (pollers, flush timer), for reference
                idle_cpu = sum(cpu_seconds(b.pid) - idle_start[b.pid] for b in bridges) / 3.0
                cpu_before = {b.pid: cpu_seconds(b.pid) for b in bridges}
                influx_cpu_before = cpu_seconds(influx_pid)

                clients_total = args.http_connections + args.grpc_channels
                t0 = time.monotonic() + 2.0
                stop_at = t0 + args.seconds + 30.0
                per_client: list[list[Send]] = [[] for _ in range(clients_total)]
                for offset_s, rank, body in schedule:
                    # a rank keeps its connection (like an exporter's keep-alive channel)
                    per_client[rank % clients_total].append(
                        Send(t0 + offset_s, body, points_per_window)
                    )
                clients = [
                    Client(
                        "http" if index < args.http_connections else "grpc",
                        f"127.0.0.1:{http_port}" if index < args.http_connections
                        else f"127.0.0.1:{grpc_port}",
                        sends, stop_at,
                    )
                    for index, sends in enumerate(per_client)
                ]  # fmt: skip
                for client in clients:
                    client.start()
                peak_rss = {b.pid: 0.0 for b in bridges}
                while any(client.is_alive() for client in clients):
                    for bridge in bridges:
                        peak_rss[bridge.pid] = max(peak_rss[bridge.pid], rss_mib(bridge.pid)[0])
                    for client in clients:
                        client.join(0.01)
                    time.sleep(0.5)
                send_s = time.monotonic() - t0
                accepted = sum(client.accepted_points for client in clients)

                def written() -> float:
                    return sum(
                        b.report().get("stepwatch_bridge_datapoints_written_total", 0.0)
                        for b in bridges
                    )

                drained = wait_until(lambda: written() >= accepted, timeout_s=120, interval_s=0.5)
                total_s = time.monotonic() - t0
                cpu = {b.pid: cpu_seconds(b.pid) - cpu_before[b.pid] for b in bridges}
                influx_cpu = cpu_seconds(influx_pid) - influx_cpu_before
                hwm = {b.pid: rss_mib(b.pid)[1] for b in bridges}
                reports = {b.pid: b.report() for b in bridges}
            finally:
                for bridge in bridges:
                    bridge.stop()
            client_db = InfluxClient(influxd.url, database="scale", timeout_s=300)
            stored = 0
            for row in client_db.query("SHOW MEASUREMENTS"):
                for (name,) in row.values:
                    field = "gauge" if name == "stepwatch.step.last" else "count"
                    result = client_db.query(f'SELECT count("{field}") FROM "{name}"')
                    stored += int(result[0].values[0][1]) if result else 0
            series = client_db.query("SHOW SERIES CARDINALITY")
            series_count = int(series[0].values[0][0]) if series else -1
            data_dir = influxd.data_dir
            snapshot = wait_for_snapshot(data_dir / "wal", timeout_s=60)
            influx_rss = rss_mib(influx_pid)
            sparse_bytes = directory_bytes(data_dir / "data" / "scale", "*.tsm")
            series_bytes = directory_bytes(data_dir / "data" / "scale" / "_series")

            # dense slice: fresh windows (new random values) 1 s apart, like a run at 1 window/s
            dense = InfluxClient(influxd.url, database="dense", timeout_s=300)
            dense.create_database()
            lines: list[str] = []
            for rank in range(min(args.dense_ranks, args.ranks)):
                for window in range(args.dense_windows):
                    request = first_window(
                        rng, rank=rank, ranks=args.ranks, kernels=args.kernels,
                        end_ns=base_ns + window * 1_000_000_000,
                    )  # fmt: skip
                    lines.extend(convert_request(request).lines)
            t_dense = time.perf_counter()
            influx_cpu_dense = cpu_seconds(influx_pid)
            for index in range(0, len(lines), 5000):
                dense.write_lines(lines[index : index + 5000])
            dense_s = time.perf_counter() - t_dense
            influx_cpu_dense = cpu_seconds(influx_pid) - influx_cpu_dense
            dense_snapshot = wait_for_snapshot(data_dir / "wal", timeout_s=60)
            dense_bytes = directory_bytes(data_dir / "data" / "dense", "*.tsm")
        finally:
            influxd.stop()
            os.environ.pop("INFLUXDB_DATA_CACHE_SNAPSHOT_WRITE_COLD_DURATION", None)
            shutil.rmtree(Path(directory) / "influxd", ignore_errors=True)

    latencies = [value for client in clients for value in client.latencies_s]
    lags = [value for client in clients for value in client.lags_s]
    codes: Counter[str] = Counter()
    for client in clients:
        codes.update(client.codes)
    rejected = sum(client.rejected_points for client in clients)
    total_written = sum(r.get("stepwatch_bridge_datapoints_written_total", 0.0)
                        for r in reports.values())  # fmt: skip
    bridge_cpu = sum(cpu.values())
    print("\n[1] simulation")
    print(f"  requests: {dict(codes)}; schedule lag p99 {quantile(lags, 0.99):.2f} s")
    drain_note = "" if drained else ", NOT DRAINED"
    print(f"  accepted {accepted} points ({accepted / send_s:,.0f}/s over {send_s:.0f} s), "
          f"rejected {rejected}; written {total_written:.0f} "
          f"({total_written / total_s:,.0f}/s incl. drain{drain_note})")  # fmt: skip
    print(f"  InfluxDB holds {stored} points "
          f"(incl. {warm_points} warm-up points), {series_count} series")  # fmt: skip
    stored -= warm_points
    # At least once: a request whose answer timed out (client deadline) may have been stored
    # and retried; the retry overwrites the same points (same timestamps), so
    # accepted <= stored <= written.
    consistent = accepted <= stored <= total_written
    print(f"  run stored {stored} points: accepted {accepted} <= stored <= written "
          f"{total_written:.0f}: {'OK' if consistent else 'MISMATCH'}")  # fmt: skip
    print(f"  request latency p50 {quantile(latencies, 0.5) * 1e3:.1f} ms, "
          f"p99 {quantile(latencies, 0.99) * 1e3:.1f} ms")  # fmt: skip
    for pid in cpu:
        report = reports[pid]
        share = report.get("stepwatch_bridge_datapoints_written_total", 0.0)
        print(f"  bridge pid {pid}: wrote {share:.0f} points, CPU {cpu[pid]:.1f} s "
              f"({cpu[pid] / total_s * 100:.0f} % of a core), RSS peak "
              f"{max(peak_rss[pid], hwm[pid]):.0f} MiB")  # fmt: skip
    bridge_us = bridge_cpu / max(total_written, 1) * 1e6
    influx_us = influx_cpu / max(total_written, 1) * 1e6
    print(f"  bridge CPU per point: {bridge_us:.1f} us (idle bridges: "
          f"{idle_cpu / len(cpu) * 100:.1f} % of a core each); influxd CPU per point: "
          f"{influx_us:.1f} us (influxd {influx_cpu:.1f} s CPU)")  # fmt: skip
    print(f"  influxd RSS {influx_rss[0]:.0f} MiB (peak {influx_rss[1]:.0f} MiB) holding "
          f"{series_count} series = {influx_rss[1] * 1024 / max(series_count, 1):.0f} KiB/series "
          f"at peak")  # fmt: skip
    all_stored = stored + warm_points
    sparse_bpp = sparse_bytes / max(all_stored, 1)
    print(f"  disk: {sparse_bytes / 1e6:.1f} MB TSM for {all_stored} points = {sparse_bpp:.0f} "
          f"B/point ({all_stored / max(series_count, 1):.1f} points per series; "
          f"snapshot {'done' if snapshot else 'NOT done'}); "
          f"series file {series_bytes / 1e6:.1f} MB = "
          f"{series_bytes / max(series_count, 1):.0f} B/series")  # fmt: skip
    dense_bpp = dense_bytes / max(len(lines), 1)
    dense_us = influx_cpu_dense / max(len(lines), 1) * 1e6
    print(f"\n[2] dense slice: {len(lines)} points ({args.dense_ranks} ranks x "
          f"{args.dense_windows} windows 1 s apart) written directly in {dense_s:.1f} s "
          f"({len(lines) / dense_s:,.0f} points/s, influxd {dense_us:.1f} us CPU/point); "
          f"{dense_bytes / 1e6:.1f} MB TSM = {dense_bpp:.0f} B/point "
          f"(snapshot {'done' if dense_snapshot else 'NOT done'})")  # fmt: skip

    # Steady state writes existing series; with the warm-up the run measured that directly,
    # without it the dense slice's cost stands in and the rest of influxd's CPU in the run is
    # the per-series cost. The run wrote few points per series, so the rest of its disk is
    # the per-series (per shard) cost.
    if warm_points:
        series_ms = warm_cpu / warm_points * 1e3  # every warm-up point created its series
        print(f"\n[0] warm-up: {warm_points} points creating {warm_points} series written "
              f"directly in {warm_s:.1f} s ({warm_points / warm_s:,.0f}/s), influxd "
              f"{series_ms:.2f} ms CPU per new series")  # fmt: skip
        influx_point_us = influx_us  # the run wrote existing series only
    else:
        series_ms = max(0.0, influx_cpu - dense_us * 1e-6 * stored) / max(series_count, 1) * 1e3
        influx_point_us = dense_us
    series_disk = max(0.0, sparse_bytes - dense_bpp * all_stored) / max(series_count, 1)
    influx_kib_series = influx_rss[1] * 1024 / max(series_count, 1)
    print(f"\n[3] derived: bridge {bridge_us:.0f} us CPU per point (gross: includes refused "
          f"requests and retries); influxd {influx_point_us:.1f} us per point on existing "
          f"series + "
          f"{series_ms:.2f} ms per new series; disk {dense_bpp:.0f} B/point + "
          f"{series_disk / 1e3:.1f} kB per series per shard (7-day shards); influxd "
          f"{influx_kib_series:.1f} KiB RAM per series (inmem index)")  # fmt: skip
    print(f"\n[4] sizing: bridges planned at {BRIDGE_UTILISATION:.0%} of a core each; "
          f"{points_per_window} points per window")  # fmt: skip
    header = ("ranks", "win/s", "windows/s", "points/s", "OTLP MB/s", "LP MB/s", "bridges",
              "bridge GiB", "influx cores", "fields/s", "series", "influx GiB", "disk GB/day",
              "start burst")  # fmt: skip
    print("  " + " | ".join(header))
    rss_per_bridge = max(max(peak_rss.values()), max(hwm.values())) / 1024
    for ranks in (10_000, 25_000, 100_000):
        for rate in (1.0, 0.1):
            windows_s = ranks * rate
            points_s = windows_s * points_per_window
            series = ranks * series_per_rank
            bridges_needed = math.ceil(points_s * bridge_us / 1e6 / BRIDGE_UTILISATION)
            disk_gb_day = (points_s * 86_400 * dense_bpp + series * series_disk / 7) / 1e9
            row = (
                f"{ranks:,}", f"{rate:g}", f"{windows_s:,.0f}", f"{points_s:,.0f}",
                f"{windows_s * body_bytes / 1e6:.1f}", f"{points_s * line_bytes / 1e6:.1f}",
                f"{bridges_needed}", f"{bridges_needed * rss_per_bridge:.1f}",
                f"{points_s * influx_point_us / 1e6:.1f}",
                f"{points_s * fields_per_point / 1e6:.2f}M",
                f"{series / 1e6:.2f}M", f"{series * influx_kib_series / 2**20:.0f}",
                f"{disk_gb_day:,.0f}", f"{series * series_ms / 1e3:,.0f} core-s",
            )  # fmt: skip
            print("  " + " | ".join(row))
    return 0 if drained and consistent else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop children on SIGTERM too
    sys.exit(main())
