"""The bridge's HTTP server: header parsing (RFC 9112 section 5), and where requests run."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from stepwatch.otel_bridge import Bridge, DiskSpool
from stepwatch.otel_bridge._http_server import MAX_HEADERS, _Refused, parse_headers
from tests.otel_bridge.otlp_requests import RecordingWriter, post, window_request


def test_fields_are_read_by_case_insensitive_name() -> None:
    headers = parse_headers(
        b"Host: 127.0.0.1:4318\r\ncontent-TYPE:application/x-protobuf \r\n"
        b"Content-Length:\t12\r\nX-Empty:\r\n\r\n"
    )
    assert headers.get("Content-Type") == "application/x-protobuf"
    assert headers.get("content-length") == "12"
    assert headers.get("X-Empty") == ""
    assert headers.get("Missing") is None
    assert headers.get("Missing", "default") == "default"


def test_the_first_of_repeated_fields_and_bare_line_feeds() -> None:
    headers = parse_headers(b"Accept: a\nAccept: b\nContent-Length: 3\nContent-Length: 3\n\n")
    assert headers.get("accept") == "a"
    assert headers.get("content-length") == "3"
    # the head ends at its first blank line: nothing after it is a field
    assert parse_headers(b"A: 1\r\n\r\nB: 2\r\n").get("B") is None


@pytest.mark.parametrize(
    ("block", "status"),
    [
        (b"Content-Length: 3\r\nContent-Length: 4\r\n\r\n", 400),  # smuggling
        (b"X-Folded: a\r\n  b\r\n\r\n", 400),  # obsolete line folding
        (b"No colon here\r\n\r\n", 400),
        (b"Bad Name: x\r\n\r\n", 400),
        (b": no name\r\n\r\n", 400),
        (b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n", 431),
    ],
)
def test_malformed_heads_are_refused(block: bytes, status: int) -> None:
    with pytest.raises(_Refused) as refused:
        parse_headers(block)
    assert refused.value.status == status
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS)) + b"\r\n"
    assert parse_headers(fields).get(f"x-{MAX_HEADERS - 1}") == "v"  # the limit itself is fine


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_a_bad_head_gets_its_status_and_the_bridge_keeps_serving() -> None:
    with Bridge(RecordingWriter(), grpc_port=None, http_port=0) as bridge:  # type: ignore[arg-type]
        port = int(bridge.http_url.split(":")[2].split("/")[0])
        smuggled = (
            b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 0\r\nContent-Length: 5\r\n\r\n"
        )
        assert _exchange(port, smuggled).startswith(b"HTTP/1.1 400 ")
        many = b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n"
        assert _exchange(port, many).startswith(b"HTTP/1.1 431 ")
        healthy = _exchange(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert healthy.startswith(b"HTTP/1.1 200 ")


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
