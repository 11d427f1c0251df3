"""The bridge's HTTP/1.1 server: llhttp's framing answered as RFC 9112 says, and the policy
around it (where requests run, pipelining, keep-alive, limits, the connection bound)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwatch.core._influx import wait_until
from stepwatch.otel_bridge import Bridge, DiskSpool, _fast
from stepwatch.otel_bridge._http_server import MAX_HEADERS
from tests.c_extensions import needs
from tests.otel_bridge.otlp_requests import RecordingWriter, post, window_request


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


_HEAD = b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (_HEAD + b"Content-Length: 0\r\nContent-Length: 5\r\n\r\n", 400),  # smuggling
        (_HEAD + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),  # not a chunk size
        (b"GET /healthz HTTP/1.1\r\nBad Name: x\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n", 431),
        (b"GET /healthz HTTP/1.1\r\nX: " + b"v" * (17 * 1024) + b"\r\n\r\n", 431),
        (b"DELETE /v1/metrics HTTP/1.1\r\n\r\n", 501),
        (_HEAD + b"Content-Length: 99999999999\r\n\r\n", 413),
        (_HEAD + b"Transfer-Encoding: chunked\r\n\r\n4000\r\n" + b"z" * 0x4000 + b"\r\n", 413),
    ],
    ids=["conflicting-lengths", "length-and-chunked", "bad-chunk", "bad-field-name",
         "too-many-fields", "long-field", "method", "too-long", "chunked-too-long"],
)  # fmt: skip
def test_a_bad_request_gets_its_status_and_the_bridge_keeps_serving(
    request_bytes: bytes, status: int
) -> None:
    with Bridge(RecordingWriter(), grpc_port=None, http_port=0,
                max_request_bytes=8192) as bridge:  # type: ignore[arg-type]  # fmt: skip
        port = int(bridge.http_url.split(":")[2].split("/")[0])
        assert _exchange(port, request_bytes).startswith(b"HTTP/1.1 %d " % status)
        healthy = _exchange(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert healthy.startswith(b"HTTP/1.1 200 ")


def test_chunked_bodies_with_extensions_and_trailers_are_read_whole() -> None:
    """RFC 9112 §7.1: what the OpenTelemetry JS exporter sends (no Content-Length)."""
    writer = RecordingWriter()
    with Bridge(writer, grpc_port=None, http_port=0) as bridge:  # type: ignore[arg-type]
        port = int(bridge.http_url.split(":")[2].split("/")[0])
        body = window_request(job="chunked", rank=0, world_size=1, window=0).SerializeToString()
        chunks = b"".join(
            b"%x;ext=1\r\n%s\r\n" % (len(body[i : i + 100]), body[i : i + 100])
            for i in range(0, len(body), 100)
        )
        request = _HEAD + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        answer = _exchange(port, request + chunks + b"0\r\nX-Trailer: t\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert bridge.forwarder.wait_idle(10)
    assert len(writer.lines) > 0


def test_a_new_connection_takes_the_place_of_the_one_idle_longest() -> None:
    with _serving(inline=True, max_connections=3) as (server, port):
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        served = socket.create_connection(("127.0.0.1", port), timeout=10)
        served.sendall(b"GET /a HTTP/1.1\r\n\r\n")
        _read_answers(served, 1)
        busy = socket.create_connection(("127.0.0.1", port), timeout=10)
        busy.sendall(b"POST /b HTTP/1.1\r\nContent-Length: 9\r\n\r\nabc")  # mid-request
        assert wait_until(lambda: server.connections == 3, timeout_s=5)
        newcomer = socket.create_connection(("127.0.0.1", port), timeout=10)
        newcomer.sendall(b"GET /c HTTP/1.1\r\n\r\n")
        assert _read_answers(newcomer, 1)[0].startswith(b"GET /c ")
        assert silent.recv(4096) == b""  # it had sent nothing: its place went first
        served.sendall(b"GET /d HTTP/1.1\r\n\r\n")
        assert _read_answers(served, 1)[0].startswith(b"GET /d ")
        for sock in (silent, served, busy, newcomer):
            sock.close()


@needs(_fast.AVAILABLE, "the bridge's C fast path")  # its ingest_body is what runs where
@pytest.mark.parametrize("durable", [False, True])
def test_exports_run_on_the_loop_unless_the_spool_waits_for_a_disk(
    durable: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memory spool never blocks: its requests are handled on the event loop (no hand-off
    to a worker and back); a disk spool's fsync'd commit is waited for in a worker."""
    from stepwatch.otel_bridge._intake import Intake

    threads: list[str] = []
    ingest_body = Intake.ingest_body

    def recording(self: Intake, body: bytes) -> Any:
        threads.append(threading.current_thread().name)
        return ingest_body(self, body)

    monkeypatch.setattr(Intake, "ingest_body", recording)
    writer = RecordingWriter()
    options: dict[str, Any] = {}
    if durable:
        options["spool"] = DiskSpool(tmp_path, max_bytes=1 << 24, overflow="drop_oldest")
    with Bridge(writer, grpc_port=None, http_port=0, **options) as bridge:  # type: ignore[arg-type]
        for window in range(3):
            body = window_request(job="j", rank=0, world_size=1, window=window)
            headers = {"Content-Type": "application/x-protobuf"}
            assert post(bridge.http_url, body.SerializeToString(), headers)[0] == 200
        assert bridge.forwarder.wait_idle(10)
    assert len(writer.lines) > 0 and len(threads) == 3
    expected = "stepwatch-bridge-http_" if durable else "stepwatch-bridge-http-loop"
    assert all(name.startswith(expected) for name in threads), threads


# ---- the connection state machine, on a bare AsyncHttpServer ---------------------------------
def _echo_server(*, inline: bool, idle_timeout_s: float = 30.0, max_connections: int = 16) -> Any:
    from stepwatch.otel_bridge._http_server import AsyncHttpServer, HttpRequest, HttpResponse

    def handle(request: HttpRequest) -> HttpResponse:
        answer = (
            f"{request.method} {request.path} {len(request.body)} {threading.current_thread().name}"
        )
        return HttpResponse(200, {"Content-Type": "text/plain"}, answer.encode(), False)

    return AsyncHttpServer(
        handle,
        early=lambda _method, _path, _headers: 1 << 20,
        busy=lambda _request: HttpResponse(503, {}, b"busy", False),
        max_connections=max_connections,
        max_concurrent_requests=4,
        request_timeout_s=5.0,
        idle_timeout_s=idle_timeout_s,
        inline=lambda: inline,
    )


@contextlib.contextmanager
def _serving(**options: Any) -> Iterator[tuple[Any, int]]:
    server = _echo_server(**options)
    port = server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        server.stop(timeout_s=5)


def _read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` whole answers (Content-Length framed) from ``sock``: their bodies."""
    data, bodies = b"", []
    while len(bodies) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode("latin-1")
            length = int(head.lower().split("content-length: ")[1].split("\r\n")[0])
            if len(data) >= head_end + 4 + length:
                assert head.startswith("HTTP/1.1 200 "), head
                bodies.append(data[head_end + 4 : head_end + 4 + length])
                data = data[head_end + 4 + length :]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(bodies)} answers"
        data += chunk
    assert data == b""
    return bodies


@pytest.mark.parametrize("inline", [True, False])
def test_pipelined_requests_are_answered_in_order(inline: bool) -> None:
    with _serving(inline=inline) as (server, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            requests = [
                b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
                b"GET /b HTTP/1.1\r\n\r\n",
                b"POST /c HTTP/1.1\r\nContent-Length: 5\r\n\r\n12345",
            ]
            payload = b"".join(requests)
            for piece in (payload[:7], payload[7:40], payload[40:]):  # split anywhere
                sock.sendall(piece)
            bodies = _read_answers(sock, 3)
        assert [body.split()[:3] for body in bodies] == [
            [b"POST", b"/a", b"3"], [b"GET", b"/b", b"0"], [b"POST", b"/c", b"5"],
        ]  # fmt: skip
        where = {body.split()[3].decode().rsplit("_", 1)[0] for body in bodies}
        assert where == {"stepwatch-bridge-http-loop" if inline else "stepwatch-bridge-http"}
        assert server.in_flight == 0


def test_idle_keep_alive_connections_are_closed() -> None:
    with _serving(inline=True, idle_timeout_s=0.4) as (server, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /x HTTP/1.1\r\n\r\n")
            _read_answers(sock, 1)
            assert server.connections == 1
            started = time.monotonic()
            assert sock.recv(4096) == b""  # closed by the server, without an answer
            assert 0.3 < time.monotonic() - started < 3.0
        assert wait_until(lambda: server.connections == 0, timeout_s=5)


def test_expect_continue_head_and_a_half_closed_client() -> None:
    with (
        _serving(inline=False) as (_server, port),
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
    ):
        sock.sendall(b"POST /e HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"data")
        assert _read_answers(sock, 1)[0].startswith(b"POST /e 4 ")
        sock.sendall(b"HEAD /h HTTP/1.1\r\n\r\n")
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        assert b"Content-Length: " in head  # the GET's length, and no body
        sock.sendall(b"POST /last HTTP/1.1\r\nContent-Length: 2\r\n\r\nok")
        sock.shutdown(socket.SHUT_WR)  # nothing more: the answer still comes, then close
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 ") and b"POST /last 2 " in answer


def test_an_oversized_head_is_refused() -> None:
    with _serving(inline=True) as (_server, port):
        huge = b"GET / HTTP/1.1\r\nX-Big: " + b"v" * (20 * 1024) + b"\r\n\r\n"
        assert _exchange(port, huge).startswith(b"HTTP/1.1 431 ")
        endless = b"GET / HTTP/1.1\r\nX-Big: " + b"v" * (70 * 1024)  # no end of head at all
        assert _exchange_half(port, endless).startswith(b"HTTP/1.1 431 ")


def _exchange_half(port: int, request: bytes) -> bytes:
    """As :func:`_exchange`, reading without closing the sending side first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        return sock.recv(65536)
