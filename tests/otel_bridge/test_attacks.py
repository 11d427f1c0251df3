"""The attack suite: each known attack family against a real bridge, a stock exporter alongside.

One ``stepwatch bridge`` process with its default limits (the module's fixture) writes to the
session's real influxd. For each family and each receiver it applies to, an attack from
``attacks.py`` runs for :data:`ATTACK_S` while a stock OpenTelemetry Python SDK exporter sends
one Export every 0.2 s on its own connection, and then these bounds must hold:

- the bridge process is alive;
- the legit exporter: at least 90 % of its exports succeed during the attack, p99 ≤ 2 s;
- right after the attack every export succeeds, also from a new exporter (a new connection);
- the bridge's RSS grows by at most 100 MiB (except under a CONTINUATION flood over gRPC:
  :data:`RSS_UNBOUNDED`);
- its CPU is back under 30 % of a core within a few seconds;
- under connection exhaustion, a new exporter's export (a new connection) succeeds within its
  10 s timeout (OTLP/HTTP: another connection's place is taken at once; OTLP/gRPC: silent
  connections are closed after ``handshake_timeout_s`` and the exporter retries).

Each run's figures are printed (``pytest -s`` shows them): docs/deployment.md quotes them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpExporter,
)
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from stepwatch.core import ManagedInfluxDB
from tests.otel_bridge import attacks
from tests.otel_bridge.otlp_requests import window_request
from tests.otel_bridge.test_server import sdk_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
ATTACK_S = 2.5
#: Families whose harm grows with what the server accumulates run longer.
LONG_ATTACK_S = 6.0
LONG_FAMILIES = frozenset({"held_answers_zero_window", "reset_complete_calls"})
LEGIT_PERIOD_S = 0.2
MAX_RSS_GROWTH_MIB = 100.0
#: The one family whose memory bound gRPC's core does not meet, and not asserted: it answers
#: the stream once the header list passes its limit but reads an endless CONTINUATION block
#: to its end, and one attacking connection at loopback speed holds 150-820 MiB in a sawtooth
#: that lasts as long as the flood (grpcio 1.85, the newest; no channel argument bounds it:
#: read chunk sizes, metadata limits and lookahead were tried). Its other bounds hold, and its
#: figures are printed. docs/deployment.md, "The attack suite", says to put a proxy that caps
#: CONTINUATION frames in front of a bridge exposed to untrusted clients.
RSS_UNBOUNDED = frozenset({("continuation_flood", "grpc")})
MAX_CPU_AFTER = 0.30


@dataclass
class BridgeProcess:
    process: subprocess.Popen[str]
    grpc: tuple[str, int]
    http: tuple[str, int]

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"VmRSS:\s+(\d+)", status)
        assert match is not None
        return int(match.group(1)) / 1024

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def bridge_process(influxd: ManagedInfluxDB) -> Iterator[BridgeProcess]:
    """``stepwatch bridge`` with its defaults, on free loopback ports, to a fresh database."""
    client = influxd.client(database="attacks")
    client.create_database()
    process = subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "--log-level", "ERROR", "bridge",
         "--influx-url", influxd.url, "--database", "attacks",
         "--grpc-port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")},
    )  # fmt: skip
    endpoints: dict[str, str] = {}
    assert process.stdout is not None
    try:
        while "writing" not in endpoints:
            line = process.stdout.readline()
            assert line, "the bridge exited before printing its endpoints"
            kind, _, value = line.partition(": ")[2].partition(" ")
            endpoints[kind] = value.strip()
        grpc_host, _, grpc_port = endpoints["OTLP/gRPC"].rpartition(":")
        http_host, _, http_port = endpoints["OTLP/HTTP"].split("/")[2].rpartition(":")
        yield BridgeProcess(process, (grpc_host, int(grpc_port)), (http_host, int(http_port)))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        process.stdout.close()


class Legit(threading.Thread):
    """A stock SDK exporter sending one Export every 0.2 s; each result and its latency."""

    def __init__(self, protocol: str, bridge: BridgeProcess, data: MetricsData) -> None:
        super().__init__(daemon=True)
        self.exporter = new_exporter(protocol, bridge)
        self.data = data
        self.results: list[tuple[bool, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            result = self.exporter.export(self.data, timeout_millis=10_000)
            elapsed = time.perf_counter() - started
            self.results.append((result is MetricExportResult.SUCCESS, elapsed))
            self.stop.wait(max(0.0, LEGIT_PERIOD_S - elapsed))


def new_exporter(protocol: str, bridge: BridgeProcess) -> GrpcExporter | HttpExporter:
    if protocol == "grpc":
        host, port = bridge.grpc
        # a connection of its own (grpcio shares one between channels to the same target)
        return GrpcExporter(
            endpoint=f"{host}:{port}",
            insecure=True,
            timeout=10,
            channel_options=(("grpc.use_local_subchannel_pool", 1),),  # type: ignore[arg-type]
        )
    host, port = bridge.http
    return HttpExporter(endpoint=f"http://{host}:{port}/v1/metrics", timeout=10)


@dataclass
class Figures:
    family: str
    protocol: str
    ok_share: float
    p99_s: float
    after_ok: int
    after_total: int
    rss_growth_mib: float
    cpu_after: float
    sent: int
    newcomer: tuple[bool, float] | None  # a new exporter's export during the attack

    def line(self) -> str:
        joined = ""
        if self.newcomer is not None:
            joined = f"; a new exporter {'got in' if self.newcomer[0] else 'FAILED'} in "
            joined += f"{self.newcomer[1]:.1f} s"
        return (
            f"{self.family} over {self.protocol}: legit {self.ok_share:.0%} OK, p99 "
            f"{self.p99_s * 1e3:.0f} ms; after {self.after_ok}/{self.after_total} OK; RSS "
            f"+{self.rss_growth_mib:.0f} MiB; CPU after {self.cpu_after:.0%} of a core; "
            f"attack sent {self.sent}{joined}"
        )


def run_attack(
    bridge: BridgeProcess, protocol: str, attack: attacks.Attack, rank: int, seconds: float
) -> Figures:
    data = sdk_metrics(f"attack-{attack.name}-{protocol}", rank=rank)
    legit = Legit(protocol, bridge, data)
    rss_before = bridge.rss_mib()
    legit.start()
    stop = threading.Event()
    workers = [
        threading.Thread(target=attack.run, args=(stop,), daemon=True)
        for _ in range(attack.threads if attack.parallel else 1)
    ]
    for worker in workers:
        worker.start()
    peak = rss_before
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, bridge.rss_mib())
        time.sleep(0.1)
    newcomer = None
    if not attack.parallel:  # connection exhaustion: a new exporter must still get in
        started = time.perf_counter()
        fresh = new_exporter(protocol, bridge)
        result = fresh.export(data, timeout_millis=10_000)
        newcomer = (result is MetricExportResult.SUCCESS, time.perf_counter() - started)
        fresh.shutdown()
    legit.stop.set()
    legit.join(30)
    stop.set()
    attack.close_all()
    for worker in workers:
        worker.join(10)
    attack.close_all()
    assert bridge.process.poll() is None, "the bridge died"
    during = legit.results
    latencies = sorted(elapsed for _, elapsed in during)
    ok_share = sum(ok for ok, _ in during) / max(1, len(during))
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    after = [legit.exporter.export(data, timeout_millis=10_000) for _ in range(3)]
    fresh = new_exporter(protocol, bridge)
    after += [fresh.export(data, timeout_millis=10_000) for _ in range(2)]
    fresh.shutdown()
    legit.exporter.shutdown()
    peak = max(peak, bridge.rss_mib())
    cpu_after = settle_cpu(bridge.cpu_s)
    figures = Figures(
        attack.name,
        protocol,
        ok_share,
        p99,
        sum(result is MetricExportResult.SUCCESS for result in after),
        len(after),
        peak - rss_before,
        cpu_after,
        attack.sent,
        newcomer,
    )
    print(figures.line())
    return figures


def settle_cpu(
    cpu_s: Callable[[], float], *, window_s: float = 0.5, within_s: float = 6.0
) -> float:
    """The bridge's CPU share over the first quiet ``window_s`` within ``within_s``."""
    deadline = time.monotonic() + within_s
    share = 1.0
    while time.monotonic() < deadline:
        before, started = cpu_s(), time.monotonic()
        time.sleep(window_s)
        share = (cpu_s() - before) / (time.monotonic() - started)
        if share < MAX_CPU_AFTER:
            break
    return share


def check(figures: Figures) -> None:
    assert figures.ok_share >= 0.9, figures.line()
    assert figures.p99_s <= 2.0, figures.line()
    assert figures.after_ok == figures.after_total, figures.line()
    if (figures.family, figures.protocol) not in RSS_UNBOUNDED:
        assert figures.rss_growth_mib <= MAX_RSS_GROWTH_MIB, figures.line()
    assert figures.cpu_after < MAX_CPU_AFTER, figures.line()
    if figures.newcomer is not None:
        assert figures.newcomer[0], figures.line()


# family -> (attack class, threads)
GRPC_FAMILIES: dict[str, tuple[type[attacks.Attack], int]] = {
    "hpack_bomb": (attacks.HpackBomb, 4),
    "held_answers_zero_window": (attacks.HeldAnswers, 1),
    "never_reading": (attacks.NeverReading, 2),
    "reset_complete_calls": (attacks.ResetComplete, 1),
    "rapid_reset": (attacks.RapidReset, 1),
    "continuation_flood": (attacks.ContinuationFlood, 1),
    "trickled_header_block": (attacks.TrickledHeaders, 20),
    "stream_id_abuse": (attacks.StreamIdAbuse, 1),
    "control_frame_flood": (attacks.ControlFlood, 2),
    "slowloris": (attacks.GrpcSlowloris, 50),
    "compression_bomb": (attacks.GrpcCompressionBomb, 1),
    "stalled_unfinished_calls": (attacks.StalledCalls, 20),
    "connection_exhaustion_silent": (attacks.SilentConnections, 4200),
    "connection_exhaustion_ping_only": (attacks.PingOnly, 200),
}
HTTP_FAMILIES: dict[str, tuple[type[attacks.Attack], int]] = {
    "never_reading": (attacks.HttpNeverReading, 2),
    "slowloris": (attacks.HttpSlowloris, 100),
    "trickled_header_block": (attacks.HttpHugeHeaders, 2),
    "chunked_abuse": (attacks.HttpChunkAbuse, 1),
    "compression_bomb": (attacks.HttpCompressionBomb, 1),
    "stalled_unfinished_calls": (attacks.HttpStalledBodies, 100),
    "connection_exhaustion_silent": (attacks.SilentConnections, 4200),
}
CASES = [("grpc", family) for family in GRPC_FAMILIES] + [
    ("http", family) for family in HTTP_FAMILIES
]


@pytest.mark.parametrize(("protocol", "family"), CASES, ids=[f"{p}-{f}" for p, f in CASES])
def test_attack_family_leaves_the_legit_exporter_served(
    bridge_process: BridgeProcess, protocol: str, family: str
) -> None:
    kind, threads = (GRPC_FAMILIES if protocol == "grpc" else HTTP_FAMILIES)[family]
    seconds = LONG_ATTACK_S if family in LONG_FAMILIES else ATTACK_S
    host, port = bridge_process.grpc if protocol == "grpc" else bridge_process.http
    body = window_request(job=f"attacker-{family}", rank=0, world_size=1, window=0)
    attack = kind(family, host, port, body=body.SerializeToString(), threads=threads)
    rank = CASES.index((protocol, family)) + 1
    check(run_attack(bridge_process, protocol, attack, rank, seconds))
