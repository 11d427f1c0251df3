"""HTTP/2 frames and gRPC answers for the bridge's own gRPC server (``_h2_server``).

The wire constants (RFC 9113: frame types, flags, error codes, the settings the server
announces), the gRPC status codes it answers with, a call and its answer, and
:class:`AnswerSender`: the sending half of a connection, which writes each answer's frames
and holds its DATA (and what follows it) until the client's flow-control windows admit it.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from typing import NamedTuple

from stepwatch.otel_bridge._decode import RequestError, gunzip, inflate
from stepwatch.otel_bridge._hpack import encode

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# error codes (RFC 9113 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 5, 6, 7, 9
ENHANCE_YOUR_CALM = 11
ERROR_NAMES = {
    NO_ERROR: "NO_ERROR",
    PROTOCOL_ERROR: "PROTOCOL_ERROR",
    INTERNAL_ERROR: "INTERNAL_ERROR",
    FLOW_CONTROL_ERROR: "FLOW_CONTROL_ERROR",
    STREAM_CLOSED: "STREAM_CLOSED",
    FRAME_SIZE_ERROR: "FRAME_SIZE_ERROR",
    REFUSED_STREAM: "REFUSED_STREAM",
    COMPRESSION_ERROR: "COMPRESSION_ERROR",
    ENHANCE_YOUR_CALM: "ENHANCE_YOUR_CALM",
}
# gRPC status codes, and their names
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 0, 3, 4, 8
UNIMPLEMENTED, INTERNAL, UNAVAILABLE, UNAUTHENTICATED = 12, 13, 14, 16
STATUS_NAMES = {
    OK: "OK",
    INVALID_ARGUMENT: "INVALID_ARGUMENT",
    DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    UNIMPLEMENTED: "UNIMPLEMENTED",
    INTERNAL: "INTERNAL",
    UNAVAILABLE: "UNAVAILABLE",
    UNAUTHENTICATED: "UNAUTHENTICATED",
}

MAX_FRAME = 16_384  # SETTINGS_MAX_FRAME_SIZE: the protocol's default, not raised
STREAM_WINDOW = 1 << 20  # SETTINGS_INITIAL_WINDOW_SIZE announced
CONNECTION_WINDOW = 16 << 20
DEFAULT_WINDOW = 65_535
MAX_WINDOW = (1 << 31) - 1
HEAD = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, stream id
SETTING = struct.Struct(">HL")
U32 = struct.Struct(">L")


class GrpcCall(NamedTuple):
    """A complete unary call: its path, metadata (lower-case names; the first of repeated
    ones) and request message (decompressed)."""

    path: str
    metadata: dict[str, str]
    message: bytes


class GrpcAnswer(NamedTuple):
    """A call's answer: ``code`` 0 with the response message ``body``, or a status."""

    code: int
    message: str = ""
    body: bytes = b""
    details: bytes = b""  # a serialized google.rpc.Status (grpc-status-details-bin)


class ProtocolFault(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY with ``code``, then the connection closes."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


RECEIVING, HANDLING = 0, 1


class CallStream:
    """One call's stream while the server reads it: its headers, message so far, and the
    client's send window on it."""

    __slots__ = ("body", "id", "metadata", "path", "started", "state", "unacked", "window")

    def __init__(self, stream_id: int, started: float) -> None:
        self.id = stream_id
        self.metadata: dict[str, str] = {}
        self.path = ""
        self.body = bytearray()
        self.started = started
        self.window = STREAM_WINDOW  # what the client may still send before an update
        self.unacked = 0  # received, not yet given back
        self.state = RECEIVING  # then HANDLING, once the client's half is done


def unframe(body: bytes | bytearray, encoding: str, *, max_bytes: int) -> bytes:
    """The one gRPC message of a unary call's body, decompressed per ``grpc-encoding``.

    Raises:
        RequestError: 400 not exactly one length-prefixed message, 413 above ``max_bytes``
            after decompression, 415 an unknown encoding.
    """
    if len(body) < 5 or 5 + U32.unpack_from(body, 1)[0] != len(body):
        raise RequestError(400, "not one length-prefixed gRPC message")
    message = bytes(body[5:])
    if not body[0]:
        return message
    if encoding == "gzip":
        return gunzip(message, max_bytes=max_bytes)
    if encoding == "deflate":
        return inflate(message, max_bytes=max_bytes)
    raise RequestError(415, f"unsupported grpc-encoding {encoding[:40]!r}")


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: the 9-byte header, then ``payload``."""
    length = len(payload)
    return HEAD.pack(length >> 16, length & 0xFFFF, kind, flags, stream) + payload


_OK_HEADERS = encode(((":status", "200"), ("content-type", "application/grpc")))
_OK_TRAILERS = encode((("grpc-status", "0"),))
_TABLE_SIZE_ZERO = b"\x20"  # a dynamic table size update to 0 (RFC 7541 6.3)


class AnswerSender:
    """The server's sending half of one connection (RFC 9113 6.9, flow control).

    Every answer ends the server's side of its stream, so a stream's send window lives from
    :meth:`open` (the call's headers arrived) until its answer is written out in full, or
    until :meth:`forget` (the client reset it). DATA waits for both the connection's and the
    stream's window; frames after a waiting DATA frame (the trailers) wait behind it.

    Args:
        write: writes bytes to the connection.
    """

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self.write = write
        self.window = DEFAULT_WINDOW  # the connection's
        self.initial_window = DEFAULT_WINDOW  # the client's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = MAX_FRAME  # the client's SETTINGS_MAX_FRAME_SIZE
        self.windows: dict[int, int] = {}  # open streams'
        self.blocked: dict[int, list[bytes]] = {}  # answers waiting for a window
        # RFC 7541 4.2: after the client lowers SETTINGS_HEADER_TABLE_SIZE, the next header
        # block written must open with a dynamic table size update (nghttp2 enforces it)
        self.table_update = b""

    def lower_table_size(self) -> None:
        """The client announced a header table below 4,096 bytes: the next header block
        written opens with an update to 0 (the server's blocks never use the table)."""
        self.table_update = _TABLE_SIZE_ZERO

    def open(self, stream_id: int) -> None:
        self.windows[stream_id] = self.initial_window

    def set_initial_window(self, value: int) -> None:
        """A new SETTINGS_INITIAL_WINDOW_SIZE: every open stream's window moves by the change."""
        delta = value - self.initial_window
        self.initial_window = value
        for stream_id in self.windows:
            self.windows[stream_id] += delta

    def grant(self, stream_id: int, increment: int) -> bool:
        """A WINDOW_UPDATE (stream 0: the connection); False when the connection's window
        would pass 2**31 - 1 (a FLOW_CONTROL_ERROR)."""
        if not stream_id:
            self.window += increment
            if self.window > MAX_WINDOW:
                return False
        elif stream_id in self.windows:
            self.windows[stream_id] += increment
        self.flush_all()
        return True

    def answer(self, stream_id: int, answer: GrpcAnswer) -> None:
        """A call's answer: headers, the length-prefixed message and trailers when OK; else
        one Trailers-Only header block with the status."""
        if answer.code == OK:
            body = answer.body
            data = b"\x00" + U32.pack(len(body)) + body  # uncompressed, length-prefixed
            step = self.max_frame
            self._send(
                stream_id,
                [
                    frame(HEADERS, END_HEADERS, stream_id, _OK_HEADERS),
                    *(
                        frame(DATA, 0, stream_id, data[at : at + step])
                        for at in range(0, len(data), step)
                    ),
                    frame(HEADERS, END_HEADERS | END_STREAM, stream_id, _OK_TRAILERS),
                ],
            )
        else:
            self.headers_only(stream_id, status_block(answer))

    def headers_only(self, stream_id: int, block: bytes) -> None:
        """One header block that ends the stream."""
        self._send(stream_id, [frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block)])

    def forget(self, stream_id: int) -> None:
        """The client reset the stream: nothing more is sent on it."""
        self.windows.pop(stream_id, None)
        self.blocked.pop(stream_id, None)

    def flush_all(self) -> None:
        for stream_id in list(self.blocked):
            self._flush(stream_id)

    def _send(self, stream_id: int, frames: list[bytes]) -> None:
        queue = self.blocked.get(stream_id)
        if queue is not None:
            queue.extend(frames)
            return
        self.blocked[stream_id] = frames
        self._flush(stream_id)

    def _flush(self, stream_id: int) -> None:
        """Write the stream's queued frames as far as the windows allow; a DATA frame larger
        than what is left of them is split (RFC 9113 6.9.1), so even a client with a tiny
        window gets its answer a piece at a time."""
        queue = self.blocked[stream_id]
        sent = 0
        while sent < len(queue):
            item = queue[sent]
            if item[3] == HEADERS and self.table_update:
                queue[sent] = frame(HEADERS, item[4], stream_id, self.table_update + item[9:])
                self.table_update = b""
            elif item[3] == DATA:
                length = len(item) - 9
                allowed = min(self.window, self.windows.get(stream_id, 0))
                if length > allowed:
                    if allowed <= 0:
                        break
                    queue[sent : sent + 1] = [
                        frame(DATA, 0, stream_id, item[9 : 9 + allowed]),
                        frame(DATA, 0, stream_id, item[9 + allowed :]),
                    ]
                    length = allowed
                self.window -= length
                self.windows[stream_id] -= length
            sent += 1
        if sent:
            self.write(b"".join(queue[:sent]))
            del queue[:sent]
        if not queue:  # the answer is out: the stream is done on the server's side
            del self.blocked[stream_id]
            self.windows.pop(stream_id, None)


def goaway(last_stream: int, code: int, message: str) -> bytes:
    return frame(GOAWAY, 0, 0, U32.pack(last_stream) + U32.pack(code) + message.encode())


def status_block(answer: GrpcAnswer) -> bytes:
    """A Trailers-Only answer's header block: HTTP 200, the gRPC status and its message."""
    fields = [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", str(answer.code)),
    ]
    if answer.message:
        fields.append(("grpc-message", percent(answer.message)))
    if answer.details:
        fields.append(
            ("grpc-status-details-bin", base64.b64encode(answer.details).decode().rstrip("="))
        )
    return encode(fields)


def percent(message: str) -> str:
    """gRPC's percent-encoding of ``grpc-message``: UTF-8, bytes outside 0x20-0x7E and '%'."""
    return "".join(
        chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}"
        for byte in message.encode("utf-8")
    )
