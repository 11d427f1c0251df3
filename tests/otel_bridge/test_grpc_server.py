"""The bridge's own gRPC server (``_h2_server``): grpcio's client and hand-made HTTP/2 frames.

The OTel SDK's gRPC exporter against it is covered where the bridge is (test_server.py, the
default server); here: the same answers as grpcio's server, large and concurrent calls on
one connection, flow control both ways, and clients that break the protocol or stall.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import hpack
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core._influx import wait_until
from stepwatch.otel_bridge import Bridge
from stepwatch.otel_bridge._h2_frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    GrpcAnswer,
    GrpcCall,
)
from stepwatch.otel_bridge._h2_server import GrpcServer
from tests.otel_bridge.otlp_requests import RecordingWriter, window_request

EXPORT_PATH = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
_HEAD = struct.Struct(">BHBBL")


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(len(payload) >> 16, len(payload) & 0xFFFF, kind, flags, stream) + payload


@contextmanager
def own_server(handler: object = None, **options: object) -> Iterator[int]:
    """A GrpcServer on a free port whose handler answers the message's SHA-256."""

    def digest(call: GrpcCall) -> GrpcAnswer:
        return GrpcAnswer(0, body=hashlib.sha256(call.message).digest())

    limits: dict[str, object] = {
        "max_message_bytes": 8 << 20,
        "max_connections": 64,
        "max_concurrent_requests": 64,
        "request_timeout_s": 5.0,
        "idle_timeout_s": 30.0,
        "inline": lambda: True,
        "early": lambda path, _metadata: (
            None if path == EXPORT_PATH else GrpcAnswer(12, f"no such method {path}")
        ),
        "busy": lambda: GrpcAnswer(8, "busy", details=b"\x08\x08"),
    }
    limits.update(options)
    server = GrpcServer(handler or digest, **limits)  # type: ignore[arg-type]
    port = server.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        server.stop(timeout_s=5.0)


# ---- the same answers as grpcio's server ----------------------------------------------------
def _answers(kind: str) -> tuple[list[str], list[str]]:
    """Codes of: a window, a gzip window, garbage, another method, no token, too big."""
    writer = RecordingWriter()
    with Bridge(writer, http_port=None, grpc_server=kind, auth_token="s3cret",
                max_request_bytes=64 * 1024) as bridge:  # fmt: skip
        channel = grpc.insecure_channel(bridge.grpc_endpoint)
        token = (("authorization", "Bearer s3cret"),)
        export = channel.unary_unary(EXPORT_PATH)
        other = channel.unary_unary(EXPORT_PATH.replace("Export", "Import"))
        window = window_request(job="parity", rank=0, world_size=1, window=0).SerializeToString()
        calls = [
            lambda: export(window, metadata=token, timeout=10),
            lambda: export(window, metadata=token, timeout=10, compression=grpc.Compression.Gzip),
            lambda: export(b"\xff\xff\xff", metadata=token, timeout=10),
            lambda: other(window, metadata=token, timeout=10),
            lambda: export(window, timeout=10),
            lambda: export(os.urandom(65 * 1024), metadata=token, timeout=10),
        ]
        codes = []
        for call in calls:
            try:
                answer = call()
                assert answer == b""  # a full success: the empty ExportMetricsServiceResponse
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)
        channel.close()
        assert wait_until(lambda: len(writer.lines) == 6, timeout_s=10)  # 2 windows stored
        counted = sorted(
            sample.labels["code"]
            for metric in bridge.metrics.registry.collect()
            if metric.name == "stepwatch_bridge_requests"
            for sample in metric.samples
            if sample.name.endswith("_total")
            and sample.labels["protocol"] == "grpc"
            and sample.value > 0
        )
    return codes, counted


def test_both_servers_give_the_same_answers() -> None:
    own, own_counted = _answers("stepwatch")
    reference, _ = _answers("grpcio")
    assert own == [
        "OK",
        "OK",
        "INVALID_ARGUMENT",
        "UNIMPLEMENTED",
        "UNAUTHENTICATED",
        "RESOURCE_EXHAUSTED",
    ]
    assert own == reference
    # the bridge counts every answer of its own server, the refusals before the body too
    assert own_counted == ["INVALID_ARGUMENT", "OK", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED",
                           "UNIMPLEMENTED"]  # fmt: skip


# ---- large and concurrent calls -------------------------------------------------------------
def test_large_concurrent_calls_on_one_connection_each_get_their_own_answer() -> None:
    """Messages of 3 MiB (many DATA frames, past the 1 MiB stream and the connection windows
    given back as they arrive), 24 at once on one channel, and small ones between them."""
    with (
        own_server() as port,
        grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_send_message_length", 16 << 20)],
        ) as channel,
    ):
        export = channel.unary_unary(EXPORT_PATH)
        messages = [os.urandom(3 << 20 if i % 3 == 0 else 1000 + i) for i in range(24)]
        with futures.ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda message: export(message, timeout=30), messages))
        assert answers == [hashlib.sha256(message).digest() for message in messages]


def test_a_message_above_the_limit_is_refused_also_after_decompression() -> None:
    with (
        own_server(max_message_bytes=100_000) as port,
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        export = channel.unary_unary(EXPORT_PATH)
        zeros = bytes(200_000)  # gzips to ~200 bytes
        with pytest.raises(grpc.RpcError) as caught:
            export(zeros, timeout=10, compression=grpc.Compression.Gzip)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert export(bytes(99_000), timeout=10, compression=grpc.Compression.Gzip) == (
            hashlib.sha256(bytes(99_000)).digest()
        )


def test_calls_beyond_the_limit_get_the_busy_answer_with_its_details() -> None:
    release, started = threading.Event(), threading.Event()

    def slow(call: GrpcCall) -> GrpcAnswer:
        started.set()
        release.wait(10)
        return GrpcAnswer(0, body=b"done")

    with own_server(slow, inline=lambda: False, max_concurrent_requests=1) as port, \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # fmt: skip
        export = channel.unary_unary(EXPORT_PATH)
        first = export.future(b"a", timeout=10)
        assert started.wait(10)  # the first call holds the only slot
        with pytest.raises(grpc.RpcError) as caught:
            export(b"b", timeout=10)
        release.set()
        assert first.result() == b"done"
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details() == "busy"
    assert dict(caught.value.trailing_metadata())["grpc-status-details-bin"] == b"\x08\x08"


def test_retry_info_reaches_a_grpcio_client_from_the_bridges_busy_answer() -> None:
    """The bridge's own answer when every call slot is taken is retryable (RetryInfo)."""
    writer = RecordingWriter()
    writer.gate.clear()  # InfluxDB hangs
    with Bridge(writer, http_port=None, grpc_max_concurrent_rpcs=1, retry_after_s=3) as bridge:
        receiver = bridge._grpc
        answer = receiver._busy()
    status = status_pb2.Status.FromString(answer.details)
    info = error_details_pb2.RetryInfo()
    assert answer.code == 8 and status.details[0].Unpack(info)
    assert info.retry_delay.seconds == 3
    writer.gate.set()


# ---- hand-made frames -----------------------------------------------------------------------
class RawClient:
    """An HTTP/2 client that sends what it is told to and reads frames back."""

    def __init__(self, port: int, settings: bytes = b"") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, settings))

    def call(self, stream: int, message: bytes | None, *, end: bool = True) -> None:
        block = self.encoder.encode(
            [(":method", "POST"), (":scheme", "http"), (":path", EXPORT_PATH),
             (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")]
        )  # fmt: skip
        frames = _frame(HEADERS, END_HEADERS | (0 if message is not None else END_STREAM),
                        stream, block)  # fmt: skip
        if message is not None:
            data = b"\x00" + struct.pack(">L", len(message)) + message
            pieces = [data[at : at + 16_384] for at in range(0, len(data), 16_384)]
            for piece in pieces[:-1]:
                frames += _frame(DATA, 0, stream, piece)
            frames += _frame(DATA, END_STREAM if end else 0, stream, pieces[-1])
        self.sock.sendall(frames)

    def frame(self) -> tuple[int, int, int, bytes]:
        while len(self.buffer) < 9 or len(self.buffer) < 9 + _length(self.buffer):
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed")
            self.buffer += chunk
        high, low, kind, flags, stream = _HEAD.unpack_from(self.buffer)
        length = high << 16 | low
        payload, self.buffer = self.buffer[9 : 9 + length], self.buffer[9 + length :]
        return kind, flags, stream & 0x7FFFFFFF, payload

    def until(self, kind: int, stream: int | None = None) -> tuple[int, bytes, list[int]]:
        """Frames up to the first of ``kind`` (on ``stream``): its flags, payload and the
        kinds read before it."""
        seen = []
        while True:
            got, flags, on, payload = self.frame()
            if got == kind and (stream is None or on == stream):
                return flags, payload, seen
            seen.append(got)

    def headers(self, stream: int) -> dict[str, str]:
        _, block, _ = self.until(HEADERS, stream)
        return {name: value for name, value in self.decoder.decode(block)}

    def close(self) -> None:
        self.sock.close()


def _length(buffer: bytes) -> int:
    return int.from_bytes(buffer[:3], "big")


def test_a_raw_call_gets_headers_data_and_trailers() -> None:
    with own_server() as port:
        client = RawClient(port)
        client.call(1, b"hello")
        assert client.headers(1) == {":status": "200", "content-type": "application/grpc"}
        _, data, _ = client.until(DATA, 1)
        assert data == b"\x00" + struct.pack(">L", 32) + hashlib.sha256(b"hello").digest()
        assert client.headers(1) == {"grpc-status": "0"}
        client.sock.sendall(_frame(PING, 0, 0, b"12345678"))
        flags, payload, _ = client.until(PING)
        assert (flags, payload) == (1, b"12345678")  # ACK, the same opaque data
        client.close()


def test_answers_wait_for_the_clients_flow_control_window() -> None:
    """A client announcing a 10-byte window gets 10 bytes of the 37-byte message, the rest
    only after its WINDOW_UPDATE, and the trailers only after the message."""
    with own_server() as port:
        client = RawClient(port, settings=struct.pack(">HL", 0x4, 10))
        client.call(1, b"x")
        client.headers(1)
        _, first, _ = client.until(DATA, 1)
        assert len(first) == 10
        client.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.until(DATA, 1)
        client.sock.settimeout(10)
        client.sock.sendall(_frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 100)))
        _, rest, _ = client.until(DATA, 1)
        assert first + rest == b"\x00" + struct.pack(">L", 32) + hashlib.sha256(b"x").digest()
        assert client.headers(1) == {"grpc-status": "0"}
        client.close()


@pytest.mark.parametrize(
    ("garbage", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 1),  # not HTTP/2: PROTOCOL_ERROR
        (_frame(DATA, 0, 1, bytes(20_000)), 6),  # above the 16 KiB frame size: FRAME_SIZE
        (_frame(HEADERS, END_HEADERS, 1, b"\xff\xff"), 9),  # bad HPACK: COMPRESSION_ERROR
        (_frame(HEADERS, END_HEADERS, 2, b"\x82"), 1),  # a server's stream id: PROTOCOL
        (_frame(HEADERS, 0, 1, b"\x83") + _frame(PING, 0, 0, bytes(8)), 1),  # no CONTINUATION
        (_frame(CONTINUATION, END_HEADERS, 1, b"\x83"), 1),  # CONTINUATION out of nowhere
    ],
)
def test_a_protocol_error_closes_that_connection_only(garbage: bytes, code: int) -> None:
    with own_server() as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if not garbage.startswith(b"GET"):
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0))
        sock.sendall(garbage)
        received = b""
        while chunk := sock.recv(65536):  # read to the server's close
            received += chunk
        goaway = received[received.rfind(b"\x07\x00\x00\x00\x00\x00") - 3 :]
        assert goaway[3] == GOAWAY
        assert struct.unpack_from(">L", goaway, 13)[0] == code
        sock.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # still serving
            assert channel.unary_unary(EXPORT_PATH)(b"ok", timeout=10) == (
                hashlib.sha256(b"ok").digest()
            )


@pytest.mark.parametrize(
    "fields",
    [[("", "")], [(":path", EXPORT_PATH), ("Content-Type", "application/grpc")]],
    ids=["empty name", "upper-case name"],
)
def test_a_malformed_header_list_resets_its_stream_only(fields: list[tuple[str, str]]) -> None:
    with own_server() as port:
        client = RawClient(port)
        client.sock.sendall(_frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                   client.encoder.encode(fields)))  # fmt: skip
        _, payload, _ = client.until(RST_STREAM, 1)
        assert struct.unpack(">L", payload)[0] == 1  # PROTOCOL_ERROR, on that stream
        client.call(3, b"next")  # the connection serves on
        assert client.headers(3)[":status"] == "200"
        client.close()


def test_stalled_calls_time_out_and_extra_streams_are_refused() -> None:
    with own_server(request_timeout_s=0.5, idle_timeout_s=1.0, max_concurrent_streams=1) as port:
        client = RawClient(port)
        started = time.monotonic()
        client.call(1, b"half", end=False)  # the message never ends
        client.call(3, b"other")  # one stream at a time here
        _flags, payload, _ = client.until(RST_STREAM, 3)
        assert struct.unpack(">L", payload)[0] == 7  # REFUSED_STREAM: clients retry those
        trailers = client.headers(1)
        assert trailers["grpc-status"] == "4"  # DEADLINE_EXCEEDED
        assert trailers["grpc-message"] == "request not received in time"
        assert 0.4 < time.monotonic() - started < 3.0
        _, payload, _ = client.until(RST_STREAM, 1)  # the client may stop sending
        assert struct.unpack(">L", payload)[0] == 0
        # idle now: closed with GOAWAY NO_ERROR after the idle timeout
        _, payload, _ = client.until(GOAWAY)
        assert struct.unpack_from(">L", payload, 4)[0] == 0
        assert time.monotonic() - started < 5.0
        client.close()


def test_connections_beyond_the_limit_get_goaway_and_the_rest_keep_serving() -> None:
    with own_server(max_connections=1) as port:
        first = RawClient(port)
        first.call(1, b"a")
        assert first.headers(1)[":status"] == "200"
        second = socket.create_connection(("127.0.0.1", port), timeout=10)
        received = b""
        while chunk := second.recv(65536):
            received += chunk
        kinds = []
        while received:  # the server's SETTINGS, then GOAWAY ENHANCE_YOUR_CALM, then closed
            length = _length(received)
            kinds.append(received[3])
            if received[3] == GOAWAY:
                assert struct.unpack_from(">L", received, 13)[0] == 11
            received = received[9 + length :]
        assert kinds == [SETTINGS, GOAWAY]
        second.close()
        first.call(3, b"b")  # the first connection is served as before
        assert first.headers(3)[":status"] == "200"
        first.close()


# ---- fuzzing the frame layer ----------------------------------------------------------------
_ENCODER = hpack.Encoder()
_CALL_BLOCK = _ENCODER.encode([(":method", "POST"), (":path", EXPORT_PATH),
                               ("content-type", "application/grpc")])  # fmt: skip
_PAYLOADS = st.one_of(
    st.binary(max_size=40),
    st.just(_CALL_BLOCK),
    st.just(b"\x00\x00\x00\x00\x03abc"),  # a whole gRPC message
    st.builds(lambda n: struct.pack(">HL", 0x4, n), st.integers(0, 2**32 - 1)),  # a setting
    st.builds(lambda n: struct.pack(">L", n), st.integers(0, 2**32 - 1)),  # a window update
)
_FRAMES = st.lists(
    st.tuples(
        st.integers(0, 11),  # the ten types and unknown ones
        st.sampled_from([0, END_STREAM, END_HEADERS, END_STREAM | END_HEADERS, 0x8, 0x20, 0xFF]),
        st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]),
        _PAYLOADS,
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(frames=_FRAMES, raw=st.binary(max_size=30), preface=st.booleans())
def test_any_frames_get_answers_or_a_classified_error_never_an_internal_one(
    fuzzed_port: int, frames: list[tuple[int, int, int, bytes]], raw: bytes, preface: bool
) -> None:
    """Random frame sequences (and trailing garbage): the connection either stays usable
    (a PING after them is answered) or is closed with a protocol error code, never with
    INTERNAL_ERROR (a bug of ours); and the server keeps serving other connections."""
    sock = socket.create_connection(("127.0.0.1", fuzzed_port), timeout=10)
    wire = (PREFACE + _frame(SETTINGS, 0, 0)) if preface else b""
    wire += b"".join(
        _frame(kind, flags, stream, payload) for kind, flags, stream, payload in frames
    )
    with contextlib.suppress(OSError):  # closed by the server before all of it was sent
        sock.sendall(wire + raw + _frame(PING, 0, 0, b"fuzzping"))
    received = b""
    with contextlib.suppress(OSError):
        while b"fuzzping" not in received and (chunk := sock.recv(65536)):
            received += chunk
    sock.close()
    codes = []
    while len(received) >= 9 and len(received) >= 9 + _length(received):
        if received[3] == GOAWAY:
            codes.append(struct.unpack_from(">L", received, 13)[0])
        received = received[9 + _length(received) :]
    assert 2 not in codes  # INTERNAL_ERROR


@pytest.fixture(scope="module")
def fuzzed_port() -> Iterator[int]:
    with own_server(request_timeout_s=2.0) as port:
        yield port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # still serving
            assert channel.unary_unary(EXPORT_PATH)(b"ok", timeout=10) == (
                hashlib.sha256(b"ok").digest()
            )


# ---- another HTTP/2 implementation: Node's http2 (nghttp2) as the gRPC client ---------------
_NODE_CLIENT = r"""
const http2 = require('http2');
const [port, ...hexBodies] = process.argv.slice(1);
const session = http2.connect('http://127.0.0.1:' + port,
  {settings: {headerTableSize: Number(process.env.TABLE_SIZE || 4096),
              initialWindowSize: Number(process.env.WINDOW || 65535)}});
const calls = hexBodies.map((hex, i) => new Promise((resolve) => {
  const message = Buffer.from(hex === 'big' ? 'ab'.repeat(2 << 20) : hex, 'hex');
  const prefix = Buffer.alloc(5); prefix.writeUInt32BE(message.length, 1);
  const stream = session.request({':method': 'POST', ':path': process.env.GRPC_PATH,
    'content-type': 'application/grpc', 'te': 'trailers'});
  const chunks = []; let status = null;
  stream.on('response', (headers) => { status = headers[':status']; });
  stream.on('data', (chunk) => chunks.push(chunk));
  stream.on('trailers', (trailers) => {
    resolve({i, status, grpc: trailers['grpc-status'],
             body: Buffer.concat(chunks).toString('hex')});
  });
  stream.on('error', (e) => resolve({i, error: String(e)}));
  stream.end(Buffer.concat([prefix, message]));
}));
Promise.all(calls).then((results) => {
  console.log(JSON.stringify(results)); session.close();
});
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js (its http2 module)")
@pytest.mark.parametrize(
    ("table_size", "window"), [("4096", "65535"), ("0", "65535"), ("100", "7")]
)
def test_nodes_http2_client_nghttp2_gets_the_same_answers(table_size: str, window: str) -> None:
    """An independent HTTP/2 implementation (nghttp2, inside Node) as the client: concurrent
    calls on one session, a 2 MiB message among them; also with the client's header table
    lowered, after which nghttp2 requires a table size update in the server's next block
    (RFC 7541 4.2: without it the session failed); and with a 7-byte window, smaller than
    any answer (answers split to fit)."""
    messages = ["68656c6c6f", "big", "", "00" * 100]
    with own_server() as port:
        done = subprocess.run(
            ["node", "-e", _NODE_CLIENT, str(port), *messages],
            capture_output=True, text=True, timeout=60, check=True,
            env={**os.environ, "GRPC_PATH": EXPORT_PATH, "TABLE_SIZE": table_size,
                 "WINDOW": window},
        )  # fmt: skip
    results = json.loads(done.stdout)
    for result, hex_message in zip(results, messages, strict=True):
        message = bytes.fromhex("ab" * (2 << 20) if hex_message == "big" else hex_message)
        digest = hashlib.sha256(message).digest()
        assert (str(result["status"]), result["grpc"]) == ("200", "0")
        assert bytes.fromhex(result["body"]) == b"\x00" + struct.pack(">L", 32) + digest


def test_unfinished_calls_cannot_pile_up_memory_on_one_connection() -> None:
    """Streams that send without ending: beyond four full messages' worth held on one
    connection the next one is refused (retryably); the others still complete."""
    with own_server(max_message_bytes=100_000) as port:
        client = RawClient(port)
        chunk = bytes(90_000)
        for stream in (1, 3, 5, 7, 9):  # the fifth brings 450 kB unfinished > 4 x 100 kB
            client.call(stream, chunk, end=False)
        refused = client.headers(9)
        assert refused["grpc-status"] == "8" and refused["grpc-message"] == "busy"
        assert refused["grpc-status-details-bin"] == "CAg"  # the busy answer's details
        client.sock.sendall(_frame(DATA, END_STREAM, 1, b""))  # the first call ends
        assert client.headers(1)[":status"] == "200"
        _, data, _ = client.until(DATA, 1)
        assert data[5:] == hashlib.sha256(chunk).digest()
        client.close()


def test_a_grpcio_channel_carries_on_across_idle_goaways() -> None:
    """An exporter whose interval is longer than the idle timeout: the server closes the idle
    connection with GOAWAY NO_ERROR and the channel's next call reconnects, unharmed."""
    with (
        own_server(idle_timeout_s=0.3) as port,
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        export = channel.unary_unary(EXPORT_PATH)
        for pause in (0.6, 0.6, 0.0):
            assert export(b"x", timeout=5) == hashlib.sha256(b"x").digest()
            time.sleep(pause)


def _samples(bridge: Bridge, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(sample.labels.values()): sample.value
        for metric in bridge.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name
    }


def test_the_bridge_reports_open_connections_and_protocol_errors() -> None:
    """``/metrics``: connections open per protocol (read at the scrape), and the HTTP/2
    errors the gRPC server answered, by scope and code."""
    with Bridge(RecordingWriter(), max_connections=2) as bridge:
        port = int(bridge.grpc_endpoint.rsplit(":", 1)[1])
        before = _samples(bridge, "stepwatch_bridge_connections")
        assert before == {("grpc",): 0.0, ("http",): 0.0}
        client = RawClient(port)
        client.call(1, b"\xff")  # a call (INVALID_ARGUMENT): the connection is open
        client.headers(1)
        http = socket.create_connection(("127.0.0.1", bridge.http_port), timeout=10)
        assert wait_until(
            lambda: (
                _samples(bridge, "stepwatch_bridge_connections") == {("grpc",): 1.0, ("http",): 1.0}
            ),
            timeout_s=5,
        )
        for garbage in (b"GET / HTTP/1.1\r\n\r\n", PREFACE + _frame(DATA, 0, 0, b"")):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(garbage)
            while sock.recv(65536):
                pass
            sock.close()
        client.sock.sendall(_frame(HEADERS, END_HEADERS, 3, client.encoder.encode([("", "")])))
        client.until(RST_STREAM, 3)
        second = RawClient(port)
        second.call(1, b"\xff")
        second.headers(1)  # two gRPC connections open: the limit
        third = socket.create_connection(("127.0.0.1", port), timeout=10)
        while third.recv(65536):
            pass
        errors = _samples(bridge, "stepwatch_bridge_grpc_protocol_errors_total")
        assert errors == {
            ("connection", "PROTOCOL_ERROR"): 2.0,  # not HTTP/2; DATA on stream 0
            ("stream", "PROTOCOL_ERROR"): 1.0,  # the empty header name
            ("connection", "ENHANCE_YOUR_CALM"): 1.0,  # the connection beyond the limit
        }
        for sock in (client, second, http, third):
            sock.close()
        assert wait_until(
            lambda: (
                _samples(bridge, "stepwatch_bridge_connections") == {("grpc",): 0.0, ("http",): 0.0}
            ),
            timeout_s=5,
        )
