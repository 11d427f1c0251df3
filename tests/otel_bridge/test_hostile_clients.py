"""Cardinality bounded whoever sends it; slow clients cannot starve fast ones (issue 17, 2-3)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)

from stepwatch.core import InfluxClient
from stepwatch.core._influx import count_points, wait_until
from stepwatch.exporters import StepMonitor
from stepwatch.otel_bridge import Bridge, InfluxV1Writer
from tests.otel_bridge.fake_influx import FakeInflux
from tests.otel_bridge.otlp_requests import (
    T1,
    RecordingWriter,
    gauge,
    post,
    request,
    window_request,
)

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def flood_body(job: str, rank: int) -> bytes:
    """A window with 8 kernel-class-like phases: 10 new series per request, invented job id."""
    phases = [f"k{index}" for index in range(8)]
    message = window_request(job=job, rank=rank, world_size=1024, window=0, phases=phases)
    return bytes(message.SerializeToString())


def test_random_job_ids_cannot_reset_the_series_budgets() -> None:
    writer = RecordingWriter()
    with Bridge(
        writer, max_new_series_per_s=200, max_series_total=3_000, flush_interval_s=0.01
    ) as bridge:
        legit = window_request(job="legit", rank=0, world_size=1, window=0).SerializeToString()
        assert post(bridge.http_url, legit, PROTOBUF)[0] == 200
        codes: dict[int, int] = {}
        started = time.monotonic()
        for index in range(600):  # 6,000 new series, each request a new job id
            status, headers, _ = post(
                bridge.http_url, flood_body(uuid.uuid4().hex, index), PROTOBUF
            )
            codes[status] = codes.get(status, 0) + 1
            if status == 429:
                assert headers["Retry-After"] == "1"
            if index % 50 == 0:  # the legitimate job's known series always flow
                again = window_request(job="legit", rank=0, world_size=1, window=index + 1)
                assert post(bridge.http_url, again.SerializeToString(), PROTOBUF)[0] == 200
        elapsed = time.monotonic() - started
        assert bridge.guard is not None
        # burst (10 s of the rate) + the rate over the run, whatever the job ids
        assert len(bridge.guard) <= 2_000 + 200 * elapsed + 10 + 3
        assert codes[429] >= 300
        refused = bridge.metrics.refused.labels(reason="series_rate")._value.get()
        assert refused == codes[429]


def test_total_series_per_process_is_bounded() -> None:
    writer = RecordingWriter()
    with Bridge(
        writer, max_series_total=50, max_new_series_per_s=None, flush_interval_s=0.01
    ) as bridge:
        rejected = 0
        for index in range(20):
            answer = post(bridge.http_url, flood_body(f"job-{index}", 0), PROTOBUF)
            assert answer[0] == 200
            reply = ExportMetricsServiceResponse.FromString(answer[2])
            rejected += reply.partial_success.rejected_data_points
        assert bridge.guard is not None and len(bridge.guard) == 50
        assert rejected == 20 * 10 - 50


def test_refused_batch_keeps_its_innocent_lines() -> None:
    # An InfluxDB (2.x/3.x, a proxy) refusing a whole batch for one bad line: the bridge
    # splits it and stores every other line, dropping (and counting) only the bad one.
    with FakeInflux("poison") as fake:
        writer = InfluxV1Writer(InfluxClient(fake.url))
        with Bridge(writer, flush_interval_s=0.3, batch_max_lines=5_000) as bridge:
            for window in range(20):
                job = "poison" if window == 7 else "innocent"
                message = window_request(job=job, rank=0, world_size=1, window=window)
                assert post(bridge.http_url, message.SerializeToString(), PROTOBUF)[0] == 200
            assert bridge.forwarder.wait_idle(10)
            dropped = bridge.metrics.dropped.labels(reason="influx_refused")._value.get()
        assert dropped == 3
        assert len(fake.lines) == 19 * 3


def test_field_type_conflict_in_real_influxdb_drops_only_the_conflicting_point(
    influx: InfluxClient,
) -> None:
    # The same shard as the bridge's points (field types are per shard): a string field.
    influx.write_lines([f'conflict,stepwatch.job.id=x gauge="text" {T1}'])
    with Bridge(InfluxV1Writer(influx), flush_interval_s=0.3) as bridge:
        for window in range(10):
            message = window_request(job="ok", rank=0, world_size=1, window=window)
            assert post(bridge.http_url, message.SerializeToString(), PROTOBUF)[0] == 200
        bad = request([gauge("conflict", 1.0)], {"stepwatch.job.id": "x"})
        assert post(bridge.http_url, bad.SerializeToString(), PROTOBUF)[0] == 200
        assert bridge.forwarder.wait_idle(10)
        assert bridge.metrics.dropped.labels(reason="influx_refused")._value.get() == 1
    assert count_points(influx, "stepwatch.step.last") == 10


@contextmanager
def slow_clients(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections sending whole headers, then trickling the body a byte a second."""
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
    stop = threading.Event()

    def trickle() -> None:
        for sock in sockets:
            with suppress(OSError):
                sock.sendall(b"POST /v1/metrics HTTP/1.1\r\nContent-Length: 100000\r\n\r\n")
        while not stop.wait(1.0):
            for sock in sockets:
                with suppress(OSError):
                    sock.sendall(b"X")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        yield sockets
    finally:
        stop.set()
        thread.join(5)
        for sock in sockets:
            sock.close()


def test_trickling_client_hits_the_request_deadline() -> None:
    # A deadline between two trickled bytes (1 s apart): at 1.0 s the server could close
    # with a byte just arrived and unread, and the kernel's reset then beat the 408 to the
    # client (a flaky ConnectionResetError in CI).
    with Bridge(RecordingWriter(), request_timeout_s=1.5, grpc_port=None) as bridge:
        assert bridge.http_port is not None
        with slow_clients(bridge.http_port, 1) as (sock,):
            sock.settimeout(10)
            started = time.monotonic()
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408")
            assert time.monotonic() - started < 5
            assert sock.recv(4096) == b""  # and closed


def test_a_client_still_sending_past_the_deadline_reads_its_408_not_a_reset() -> None:
    # The server answers 408 at 1.0 s while the client is still sending its body (a byte
    # every 20 ms): it then drains that input before closing. Closing with it unread made the
    # kernel reset the connection: the client's next send failed and the 408 was lost.
    with Bridge(RecordingWriter(), request_timeout_s=1.0, grpc_port=None) as bridge:
        assert bridge.http_port is not None
        with socket.create_connection(("127.0.0.1", bridge.http_port), timeout=5) as sock:
            sock.sendall(
                b"POST /v1/metrics HTTP/1.1\r\nHost: bridge\r\n"
                b"Content-Type: application/x-protobuf\r\nContent-Length: 1000000\r\n\r\n"
            )
            until = time.monotonic() + 1.8
            while time.monotonic() < until:
                sock.sendall(b"x" * 64)
                time.sleep(0.02)
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"Connection: close" in answer
            assert sock.recv(4096) == b""  # then closed, in order


def test_slow_clients_cannot_starve_a_step_monitor() -> None:
    writer = RecordingWriter()
    threads_before = threading.active_count()
    with ExitStack() as stack:
        bridge = stack.enter_context(Bridge(writer, grpc_port=None, flush_interval_s=0.05))
        assert bridge.http_port is not None
        stack.enter_context(slow_clients(bridge.http_port, 300))
        time.sleep(0.5)  # let them all connect and start trickling
        # Slow connections cost no thread: a loop thread and at most the handler pool.
        assert threading.active_count() - threads_before < 80
        monitor = StepMonitor(
            job_id="starved?",
            rank=0,
            world_size=1,
            endpoint=bridge.http_url.removesuffix("/v1/metrics"),
            export_interval_s=0.2,
            health=False,
            start=False,
        )
        windows = 20
        for _ in range(windows):
            with monitor.step(), monitor.phase("forward"):
                pass
            monitor.export_now(timeout_s=5)
        stats = monitor.stats
        monitor.close()
        assert stats.windows_exported >= 0.8 * windows, stats
        assert wait_until(
            lambda: (
                sum(line.startswith("stepwatch.step.last") for line in writer.lines)
                == stats.windows_exported
            ),
            timeout_s=10,
        )


def test_a_new_client_gets_in_past_the_connection_limit() -> None:
    """At the bound a new connection takes the place of the slow request begun earliest."""
    with Bridge(RecordingWriter(), max_connections=5, grpc_port=None) as bridge:
        assert bridge.http_port is not None
        body = window_request(job="after", rank=0, world_size=1, window=0).SerializeToString()
        with slow_clients(bridge.http_port, 5) as sockets:
            time.sleep(0.3)
            assert post(bridge.http_url, body, PROTOBUF)[0] == 200
            assert sockets[0].recv(4096) == b""  # the first slow client's place went
        assert wait_until(lambda: post(bridge.http_url, body, PROTOBUF)[0] == 200, timeout_s=5)
