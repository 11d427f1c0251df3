"""Accepted means durable; the writer never dies (issue 17, items 1 and 4).

Whatever the bridge answers 200 to must reach InfluxDB through a SIGKILL of the bridge and an
InfluxDB that is down, hung or lying mid-reply; whatever it cannot keep it must refuse with a
retryable 429/503. ``fake_influx.FakeInflux`` plays the InfluxDB that misbehaves on cue.
"""

from __future__ import annotations

import errno
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from stepwatch.core import InfluxClient
from stepwatch.core._influx import count_points, wait_until
from stepwatch.otel_bridge import Bridge, DiskSpool, InfluxV1Writer, SpoolAppend
from tests.otel_bridge.fake_influx import FakeInflux, dead_port
from tests.otel_bridge.otlp_requests import RecordingWriter, post, window_request

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPORT_PATH = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
PROTOBUF = {"Content-Type": "application/x-protobuf"}
POINTS_PER_WINDOW = 3
MEASUREMENTS = ("stepwatch.step.duration", "stepwatch.step.last", "stepwatch.phase.duration")


def body(window: int, *, job: str = "durable", rank: int = 0) -> bytes:
    message = window_request(job=job, rank=rank, world_size=4, window=window)
    return bytes(message.SerializeToString())


def healthz(bridge: Bridge) -> int:
    url = bridge.http_url.replace("/v1/metrics", "/healthz")
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code)


class ChaosWriter(RecordingWriter):
    """Raises what a broken InfluxDB client raises, ``failures`` times, then writes."""

    def __init__(self, failures: Sequence[Exception]) -> None:
        super().__init__()
        self.failures = list(failures)

    def write_lines(self, lines: Sequence[str]) -> None:
        if self.failures:
            self.attempts += 1
            raise self.failures.pop(0)
        super().write_lines(lines)


def test_writer_survives_any_exception_and_resumes() -> None:
    writer = ChaosWriter(
        [RuntimeError("a bug"), http.client.IncompleteRead(b""), ValueError("junk"), KeyError(1)]
    )
    with Bridge(writer, flush_interval_s=0.01, retry_backoff_s=0.01, max_backoff_s=0.05) as bridge:
        for window in range(10):
            assert post(bridge.http_url, body(window), PROTOBUF)[0] == 200
        assert bridge.forwarder.wait_idle(10)
        assert len(writer.lines) == 10 * POINTS_PER_WINDOW
        failures = bridge.metrics.write_failures
        assert failures.labels(reason="error")._value.get() == 4
        assert healthz(bridge) == 200
        assert bridge.metrics.dropped.labels(reason="influx_refused")._value.get() == 0


def test_influxdb_breaking_off_its_replies_loses_nothing(tmp_path: Path) -> None:
    # 30% of writes: connection closed with or without storing, a short body, a junk status.
    with FakeInflux("flaky", failure_rate=0.3) as fake:
        writer = InfluxV1Writer(InfluxClient(fake.url, timeout_s=2))
        with Bridge(
            writer,
            spool_dir=tmp_path / "spool",
            batch_max_lines=9,
            flush_interval_s=0.01,
            retry_backoff_s=0.01,
            max_backoff_s=0.05,
        ) as bridge:
            for window in range(60):
                assert post(bridge.http_url, body(window), PROTOBUF)[0] == 200
            assert wait_until(lambda: bridge.forwarder.spool.batches == 0, timeout_s=30)
        assert fake.failures >= 5
        steps = {line for line in fake.lines if line.startswith("stepwatch.step.last")}
        assert len(steps) == 60  # every accepted window, none lost
        assert len(fake.lines) == 60 * POINTS_PER_WINDOW


class FillableDiskSpool(DiskSpool):
    """A disk spool whose disk can be made full (``ENOSPC`` on every append)."""

    full = False

    def append(self, lines: Sequence[str]) -> SpoolAppend:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().append(lines)


def test_full_spool_disk_refuses_with_503_and_recovers(tmp_path: Path) -> None:
    writer = RecordingWriter()
    spool = FillableDiskSpool(tmp_path, max_bytes=1 << 20, overflow="drop_oldest")
    with Bridge(writer, spool=spool, flush_interval_s=0.01, retry_after_s=3) as bridge:
        assert post(bridge.http_url, body(0), PROTOBUF)[0] == 200
        spool.full = True
        status, headers, _ = post(bridge.http_url, body(1), PROTOBUF)
        assert status == 503 and headers["Retry-After"] == "3"
        assert healthz(bridge) == 503
        channel = grpc.insecure_channel(bridge.grpc_endpoint)
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(EXPORT_PATH)(body(1), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = dict(caught.value.trailing_metadata())["grpc-status-details-bin"]
        info = error_details_pb2.RetryInfo()
        assert status_pb2.Status.FromString(details).details[0].Unpack(info)
        assert bridge.metrics.spool_failures._value.get() == 2
        spool.full = False  # space freed: the next request is stored, health recovers
        assert post(bridge.http_url, body(1), PROTOBUF)[0] == 200
        assert channel.unary_unary(EXPORT_PATH)(body(2), timeout=5) == b""
        channel.close()
        assert healthz(bridge) == 200
        assert bridge.forwarder.wait_idle(10)
        assert len(writer.lines) == 3 * POINTS_PER_WINDOW  # exactly what was answered 200


def test_stuck_writer_fails_healthz_and_the_receivers_refuse() -> None:
    writer = RecordingWriter()
    writer.gate.clear()  # write_lines blocks: the writer makes no progress
    with Bridge(writer, flush_interval_s=0.01, stall_timeout_s=0.5) as bridge:
        assert post(bridge.http_url, body(0), PROTOBUF)[0] == 200
        assert wait_until(lambda: healthz(bridge) == 503, timeout_s=10)
        healthy = "stepwatch_bridge_healthy"  # read at the scrape: no request needed
        assert bridge.metrics.registry.get_sample_value(healthy) == 0
        assert post(bridge.http_url, body(1), PROTOBUF)[0] == 503
        writer.gate.set()
        assert wait_until(lambda: healthz(bridge) == 200, timeout_s=10)
        assert bridge.metrics.registry.get_sample_value(healthy) == 1
        assert post(bridge.http_url, body(1), PROTOBUF)[0] == 200
        assert bridge.forwarder.wait_idle(10)
        assert len(writer.lines) == 2 * POINTS_PER_WINDOW


@contextmanager
def cli_bridge(influx_url: str, spool_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``stepwatch bridge`` as its own process (so it can be SIGKILLed); its OTLP/HTTP URL."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stepwatch",
            "bridge",
            "--influx-url",
            influx_url,
            "--database",
            "durable",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--spool-dir",
            str(spool_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO_ROOT,
        text=True,
    )
    try:
        assert process.stdout is not None
        url = ""
        while not url:
            line = process.stdout.readline()
            assert line, "the bridge exited before printing its endpoints"
            if "OTLP/HTTP" in line:
                url = line.split()[-1]
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        process.stdout.close()  # type: ignore[union-attr]


def send_windows(url: str, windows: int) -> int:
    """POST windows on one keep-alive connection; how many were answered 200."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    accepted = 0
    for window in range(windows):
        connection.request("POST", "/v1/metrics", body=body(window), headers=PROTOBUF)
        response = connection.getresponse()
        response.read()
        accepted += response.status == 200
    connection.close()
    return accepted


def stored_points(client: InfluxClient) -> int:
    return sum(count_points(client, measurement) for measurement in MEASUREMENTS)


@pytest.mark.parametrize(
    ("influxdb", "stop"), [("down", "kill"), ("hung", "kill"), ("hung", "term")]
)
def test_accepted_points_survive_the_bridge_dying(
    influx: InfluxClient, tmp_path: Path, influxdb: str, stop: str
) -> None:
    """InfluxDB down or hung; the bridge SIGKILLed (or SIGTERMed) right after its last 200."""
    spool_dir = tmp_path / "spool"
    with FakeInflux("hang") as hung, dead_port() as down:
        target = down if influxdb == "down" else hung.url
        with cli_bridge(target, spool_dir) as (process, url):
            accepted = send_windows(url, 40)
            if stop == "kill":
                process.kill()
            else:
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                assert process.wait(30) == 0
                assert time.monotonic() - started < 15
            process.wait(30)
    assert accepted == 40
    assert sum(int(path.stem.split("-")[1]) for path in spool_dir.glob("*.lp")) == 40 * 3
    # The next bridge on the same spool directory writes every accepted point, once.
    with Bridge(InfluxV1Writer(influx), spool_dir=spool_dir, flush_interval_s=0.01) as bridge:
        assert wait_until(lambda: stored_points(influx) == accepted * 3, timeout_s=30)
        assert bridge.forwarder.wait_idle(10)
    assert not list(spool_dir.glob("*.lp"))


def test_sigterm_with_a_memory_spool_counts_what_it_loses() -> None:
    writer = RecordingWriter()
    writer.available = False
    bridge = Bridge(writer, flush_interval_s=0.01, retry_backoff_s=0.01).start()
    for window in range(5):
        assert post(bridge.http_url, body(window), PROTOBUF)[0] == 200
    bridge.stop(timeout_s=2)
    assert bridge.metrics.dropped.labels(reason="shutdown")._value.get() == 5 * 3


def test_slow_influxdb_backpressure_then_resumes_by_itself() -> None:
    writer = RecordingWriter()
    writer.gate.clear()
    threading.Timer(1.0, writer.gate.set).start()
    with Bridge(writer, max_queue_lines=9, flush_interval_s=0.01) as bridge:
        codes = [post(bridge.http_url, body(window), PROTOBUF)[0] for window in range(6)]
        assert codes[:3] == [200, 200, 200] and set(codes[3:]) == {429}
        assert wait_until(lambda: len(writer.lines) == 9, timeout_s=10)
        assert post(bridge.http_url, body(9), PROTOBUF)[0] == 200
