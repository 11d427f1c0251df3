"""gRPC over HTTP/2 for unary calls, on the bridge's own event loop (no grpcio server).

Why: grpcio's server spends ~200 us of Python and thread hand-offs around every call,
three times the bridge's HTTP/1.1 server around a request (``bench/receiver_cost.py``;
docs/adr/0002-own-grpc-server.md). Each connection is an :class:`asyncio.Protocol` that
parses frames as they arrive and answers a call once its message is complete, on the loop
when the handler cannot block, as :class:`~._http_server.AsyncHttpServer` does.

What is spoken, server side only (RFC 9113, gRPC's PROTOCOL-HTTP2.md; the list with every
limit is in docs/deployment.md, "The bridge's own gRPC server"): h2c with prior knowledge or
TLS with ALPN ``h2``; every frame type (PRIORITY and unknown ones ignored); flow control both
ways (the client may send 1 MiB per stream and 16 MiB per connection ahead; answers are cut
to its windows); one message per call, identity, gzip or deflate; the status in trailers, a
refusal as a Trailers-Only answer. Each limit is answered with the protocol's code, a protocol
error closes only its connection (GOAWAY with the code), and the server serves on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from stepwatch.otel_bridge._decode import RequestError
from stepwatch.otel_bridge._h2_frames import (
    ACK,
    COMPRESSION_ERROR,
    CONNECTION_WINDOW,
    CONTINUATION,
    DATA,
    DEADLINE_EXCEEDED,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    ERROR_NAMES,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HANDLING,
    HEAD,
    HEADERS,
    INTERNAL,
    INTERNAL_ERROR,
    MAX_FRAME,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RECEIVING,
    REFUSED_STREAM,
    RESOURCE_EXHAUSTED,
    RST_STREAM,
    SETTING,
    SETTINGS,
    STREAM_CLOSED,
    STREAM_WINDOW,
    U32,
    UNAVAILABLE,
    UNIMPLEMENTED,
    WINDOW_UPDATE,
    AnswerSender,
    CallStream,
    GrpcAnswer,
    GrpcCall,
    ProtocolFault,
    frame,
    goaway,
    unframe,
)
from stepwatch.otel_bridge._hpack import Decoder, HpackError, encode
from stepwatch.otel_bridge._loop_server import LoopConnection, LoopServer

_log = logging.getLogger("stepwatch.otel_bridge")

Handler = Callable[[GrpcCall], GrpcAnswer]
EarlyCheck = Callable[[str, dict[str, str]], "GrpcAnswer | None"]
"""Before the message is read: an answer to refuse the call with, or None."""


class GrpcServer(LoopServer):
    """Serves unary gRPC calls with ``handler`` on ``host:port`` (:class:`LoopServer`).

    Args:
        handler: answers a complete call (on the loop when ``inline`` says so, else a worker).
        early: checks path and metadata before the message is read (on the loop; cheap).
        busy: the answer when ``max_concurrent_requests`` calls are being handled.
        refused: told the status code of every answer the server gives itself (a message
            too large, late or malformed; the handler failing; the server stopping).
        protocol_error: told ``("connection" | "stream", error name)`` of every HTTP/2 error
            the server answers with (GOAWAY with an error code, RST_STREAM but NO_ERROR).
        max_message_bytes: largest request message, also after decompression.
        max_concurrent_streams: calls open at once on one connection.
        max_header_bytes: a call's header list (names, values, 32 bytes a field: RFC 9113).
        **limits: :class:`LoopServer`'s limits (``max_concurrent_requests``: calls handled
            at once over all connections), TLS and ``inline``.
    """

    protocol = "gRPC"

    def __init__(
        self,
        handler: Handler,
        *,
        early: EarlyCheck,
        busy: Callable[[], GrpcAnswer],
        max_message_bytes: int,
        refused: Callable[[int], None] = lambda _code: None,
        protocol_error: Callable[[str, str], None] = lambda _scope, _code: None,
        max_concurrent_streams: int = 128,
        max_header_bytes: int = 64 * 1024,
        **limits: Any,
    ) -> None:
        super().__init__(**limits)  # a TLS context must offer ALPN "h2" (``tls_context``)
        self.handler = handler
        self.early = early
        self.busy = busy
        self.refused = refused
        self.protocol_error = protocol_error
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_bytes = max_header_bytes
        settings = b"".join(
            SETTING.pack(key, value)
            for key, value in (
                (0x3, max_concurrent_streams),  # SETTINGS_MAX_CONCURRENT_STREAMS
                (0x4, STREAM_WINDOW),  # SETTINGS_INITIAL_WINDOW_SIZE
                (0x6, max_header_bytes),  # SETTINGS_MAX_HEADER_LIST_SIZE
            )
        )
        self.preface = frame(SETTINGS, 0, 0, settings) + frame(
            WINDOW_UPDATE, 0, 0, U32.pack(CONNECTION_WINDOW - DEFAULT_WINDOW)
        )

    def _new_connection(self) -> asyncio.Protocol:
        return _Connection(self)

    def _handle(self, call: GrpcCall) -> GrpcAnswer:
        try:
            return self.handler(call)
        except Exception:  # a bug must not take the server down: answer and keep serving
            _log.exception("bridge gRPC handler failed")
            self.refused(INTERNAL)
            return GrpcAnswer(INTERNAL, "internal error")


class _Connection(LoopConnection):
    """One client connection: frames parsed as they arrive, calls answered when complete."""

    server: GrpcServer

    def __init__(self, server: GrpcServer) -> None:
        super().__init__(server)
        self.buffer = bytearray()
        self.preface_read = False
        self.decoder = Decoder()
        self.streams: dict[int, CallStream] = {}
        self.last_stream = 0
        self.continued: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self.window = CONNECTION_WINDOW  # what the client may still send on the connection
        self.buffered = 0  # message bytes of calls still being received
        self.unacked = 0
        self.sender = AnswerSender(self._write)
        self.closed = False

    # ---- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._admit(transport):
            self.server.protocol_error("connection", "ENHANCE_YOUR_CALM")
            self.closed = True
            assert self.transport is not None
            self.transport.write(
                frame(SETTINGS, 0, 0)
                + goaway(0, ENHANCE_YOUR_CALM, "too many connections, retry later")
            )
            self.transport.close()
            return
        assert self.transport is not None
        self.transport.write(self.server.preface)
        self.deadline = self.loop.time() + self.server.request_timeout_s  # until the preface

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buffer += data
        try:
            self._frames()
        except ProtocolFault as error:
            _log.debug("bridge gRPC connection error: %s", error)
            self._fail(error.code, str(error))
        except Exception:  # never let a connection's failure reach the loop
            _log.debug("bridge gRPC connection failed", exc_info=True)
            self._fail(INTERNAL_ERROR, "internal error")
        else:
            self._restart_deadline()

    def eof_received(self) -> bool:
        self._close()
        return False

    def _serving(self) -> bool:
        return not self.closed

    def _closed(self) -> None:
        self.closed = True
        super()._closed()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self._restart_deadline()

    # ---- frames -----------------------------------------------------------------------------
    def _frames(self) -> None:
        buffer = self.buffer
        if not self.preface_read:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise ProtocolFault(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return
            if not buffer.startswith(PREFACE):
                raise ProtocolFault(PROTOCOL_ERROR, "not an HTTP/2 client preface")
            del buffer[: len(PREFACE)]
            self.preface_read = True
        pos, end = 0, len(buffer)
        unpack = HEAD.unpack_from
        try:
            while end - pos >= 9 and not self.closed:
                high, low, kind, flags, stream = unpack(buffer, pos)
                length = high << 16 | low
                if length > MAX_FRAME:
                    raise ProtocolFault(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - pos - 9 < length:
                    break
                payload = bytes(buffer[pos + 9 : pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, stream & 0x7FFFFFFF, payload)
        finally:
            del buffer[:pos]

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self.continued is not None and (kind != CONTINUATION or stream != self.continued[0]):
            raise ProtocolFault(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            self._data(flags, stream, payload)
        elif kind == HEADERS:
            self._headers(flags, stream, payload)
        elif kind == CONTINUATION:
            if self.continued is None:
                raise ProtocolFault(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            stream, first_flags, block = self.continued
            block += payload
            if len(block) > self.server.max_header_bytes:
                raise ProtocolFault(ENHANCE_YOUR_CALM, "header block too large")
            if flags & END_HEADERS:
                self.continued = None
                self._header_block(stream, first_flags, bytes(block))
        elif kind == SETTINGS:
            self._settings(flags, stream, payload)
        elif kind == PING:
            if stream or len(payload) != 8:
                raise ProtocolFault(PROTOCOL_ERROR, "malformed PING")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._window_update(stream, payload)
        elif kind == RST_STREAM:
            if not stream or len(payload) != 4:
                raise ProtocolFault(PROTOCOL_ERROR, "malformed RST_STREAM")
            self._forget(stream)
        elif kind == GOAWAY:
            if stream:
                raise ProtocolFault(PROTOCOL_ERROR, "GOAWAY on a stream")
        elif kind == PUSH_PROMISE:
            raise ProtocolFault(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        elif kind == PRIORITY and not stream:
            raise ProtocolFault(PROTOCOL_ERROR, "PRIORITY on stream 0")
        # PRIORITY and unknown frame types: ignored (RFC 9113 5.5)

    def _settings(self, flags: int, stream: int, payload: bytes) -> None:
        if stream:
            raise ProtocolFault(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolFault(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolFault(FRAME_SIZE_ERROR, "SETTINGS of a partial entry")
        for offset in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, offset)
            if key == 0x4:  # SETTINGS_INITIAL_WINDOW_SIZE: applies to open streams too
                if value > MAX_WINDOW:
                    raise ProtocolFault(FLOW_CONTROL_ERROR, "initial window too large")
                self.sender.set_initial_window(value)
            elif key == 0x5:  # SETTINGS_MAX_FRAME_SIZE
                if not MAX_FRAME <= value <= (1 << 24) - 1:
                    raise ProtocolFault(PROTOCOL_ERROR, f"max frame size {value}")
                self.sender.max_frame = value
            elif key == 0x1 and value < 4096:  # SETTINGS_HEADER_TABLE_SIZE lowered
                self.sender.lower_table_size()
            elif key == 0x2 and value > 1:  # SETTINGS_ENABLE_PUSH
                raise ProtocolFault(PROTOCOL_ERROR, "ENABLE_PUSH above 1")
            # the others: advisory to a server that sends only answers
        self._write(frame(SETTINGS, ACK, 0))
        self.sender.flush_all()

    def _window_update(self, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolFault(FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
        if not increment:
            if not stream:
                raise ProtocolFault(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._reset(stream, PROTOCOL_ERROR)
            return
        if not self.sender.grant(stream, increment):
            raise ProtocolFault(FLOW_CONTROL_ERROR, "connection window overflow")

    def _headers(self, flags: int, stream: int, payload: bytes) -> None:
        if not stream or not stream & 1:
            raise ProtocolFault(PROTOCOL_ERROR, f"HEADERS on stream {stream}")
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ProtocolFault(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - payload[0]]
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolFault(FRAME_SIZE_ERROR, "short priority fields")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream, flags, payload)
        else:
            self.continued = (stream, flags, bytearray(payload))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            fields = self.decoder.decode(block)  # always: the table must stay in step
        except HpackError as exc:
            raise ProtocolFault(COMPRESSION_ERROR, str(exc)) from None
        stream = self.streams.get(stream_id)
        if stream is not None or stream_id <= self.last_stream:
            # trailers from the client (gRPC sends none) or a stream already answered
            if stream is not None and flags & END_STREAM and stream.state == RECEIVING:
                self._complete(stream)
            return
        self.last_stream = stream_id
        server = self.server
        if len(self.streams) >= server.max_concurrent_streams:
            self.server.protocol_error("stream", "REFUSED_STREAM")
            self._write(frame(RST_STREAM, 0, stream_id, U32.pack(REFUSED_STREAM)))
            return
        stream = CallStream(stream_id, self.loop.time())
        self.streams[stream_id] = stream
        self.sender.open(stream_id)
        size = 0
        metadata = stream.metadata
        method = content_type = ""
        for name, value in fields:
            size += len(name) + len(value) + 32
            if not name or name != name.lower():  # malformed (RFC 9113 8.2): a stream error
                self._reset(stream_id, PROTOCOL_ERROR)
                return
            if name[0] == ":":
                if name == ":path":
                    stream.path = value
                elif name == ":method":
                    method = value
                continue
            if name == "content-type":
                content_type = value
            metadata.setdefault(name, value)
        if size > server.max_header_bytes:
            self._refuse(stream, self._own(GrpcAnswer(RESOURCE_EXHAUSTED, "header list too large")))
            return
        if method != "POST" or not content_type.startswith("application/grpc"):
            # not a gRPC call (gRPC's PROTOCOL-HTTP2.md: HTTP 415 for another content type)
            status = "405" if method != "POST" else "415"
            self.sender.headers_only(stream_id, encode(((":status", status),)))
            self._end_stream(stream, received=bool(flags & END_STREAM))
            return
        refusal = server.early(stream.path, metadata)
        if refusal is not None:
            self._refuse(stream, refusal, received=bool(flags & END_STREAM))
            return
        if flags & END_STREAM:
            self._complete(stream)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ProtocolFault(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)  # flow control counts the padding too
        self.window -= length
        if self.window < 0:
            raise ProtocolFault(FLOW_CONTROL_ERROR, "connection window exceeded")
        self.unacked += length
        if self.unacked >= CONNECTION_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.unacked)))
            self.window += self.unacked
            self.unacked = 0
        if flags & PADDED:
            if not payload or payload[0] >= length:
                raise ProtocolFault(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : length - payload[0]]
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream:
                raise ProtocolFault(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream already answered or reset: its data is dropped
        if stream.state != RECEIVING:
            raise ProtocolFault(STREAM_CLOSED, f"DATA after END_STREAM on {stream_id}")
        stream.window -= length
        if stream.window < 0:
            self._reset(stream_id, FLOW_CONTROL_ERROR)
            return
        stream.body += payload
        self.buffered += len(payload)
        if len(stream.body) > self.server.max_message_bytes + 5:
            limit = self.server.max_message_bytes
            self._refuse(
                stream, self._own(GrpcAnswer(RESOURCE_EXHAUSTED, f"message above {limit} bytes"))
            )
            return
        if self.buffered > 4 * (self.server.max_message_bytes + 5):
            # unfinished calls on this connection hold four full messages' worth: refused,
            # retryably, so one connection's memory stays bounded whatever its streams send
            self._refuse(stream, self.server.busy())
            return
        if flags & END_STREAM:
            self._complete(stream)
            return
        stream.unacked += length
        if stream.unacked >= STREAM_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, stream_id, U32.pack(stream.unacked)))
            stream.window += stream.unacked
            stream.unacked = 0

    # ---- calls ------------------------------------------------------------------------------
    def _complete(self, stream: CallStream) -> None:
        """The client's half is done: unframe the message, then handle the call."""
        stream.state = HANDLING
        self.buffered -= len(stream.body)
        try:
            message = unframe(
                stream.body,
                stream.metadata.get("grpc-encoding", "identity"),
                max_bytes=self.server.max_message_bytes,
            )
        except RequestError as error:
            code = RESOURCE_EXHAUSTED if error.status == 413 else INTERNAL
            if error.status == 415:
                code = UNIMPLEMENTED
            self._answer(stream.id, self._own(GrpcAnswer(code, error.message)))
            return
        call = GrpcCall(stream.path, stream.metadata, message)
        stream.body = bytearray()
        server = self.server
        if server.in_flight >= server.max_concurrent_requests:
            self._answer(stream.id, server.busy())
            return
        workers = server._workers
        if workers is None:  # stopping
            self._answer(stream.id, self._own(GrpcAnswer(UNAVAILABLE, "the bridge is stopping")))
            return
        server.in_flight += 1
        if server.inline():
            try:
                answer = server._handle(call)
            finally:
                server.in_flight -= 1
            self._answer(stream.id, answer)
            return
        try:
            future = self.loop.run_in_executor(workers, server._handle, call)
        except RuntimeError:  # the pool is shutting down
            server.in_flight -= 1
            self._answer(stream.id, self._own(GrpcAnswer(UNAVAILABLE, "the bridge is stopping")))
            return
        future.add_done_callback(lambda done: self._handled(stream.id, done))

    def _handled(self, stream_id: int, done: asyncio.Future[GrpcAnswer]) -> None:
        self.server.in_flight -= 1
        if self.closed or stream_id not in self.streams:
            return  # reset or closed meanwhile
        if done.cancelled() or done.exception() is not None:
            answer = self._own(GrpcAnswer(UNAVAILABLE, "the bridge is stopping"))
        else:
            answer = done.result()
        try:
            self._answer(stream_id, answer)
        except Exception:  # never let a connection's failure reach the loop
            _log.debug("bridge gRPC connection failed", exc_info=True)
            self.abort()

    def _answer(self, stream_id: int, answer: GrpcAnswer) -> None:
        self.sender.answer(stream_id, answer)
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._end_stream(stream, received=True)

    def _refuse(self, stream: CallStream, answer: GrpcAnswer, *, received: bool = False) -> None:
        """Answer before the client's half is done, then reset its sending (NO_ERROR)."""
        self.sender.answer(stream.id, answer)
        self._end_stream(stream, received=received)

    def _own(self, answer: GrpcAnswer) -> GrpcAnswer:
        """An answer of the server's own: counted by ``refused``."""
        self.server.refused(answer.code)
        return answer

    def _end_stream(self, stream: CallStream, *, received: bool) -> None:
        if stream.state == RECEIVING:
            self.buffered -= len(stream.body)
            if not received:
                self._write(frame(RST_STREAM, 0, stream.id, U32.pack(NO_ERROR)))
        stream.state = HANDLING
        self.streams.pop(stream.id, None)

    def _forget(self, stream_id: int) -> None:
        """RST_STREAM from the client: nothing more is sent or read on the stream."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None and stream.state == RECEIVING:
            self.buffered -= len(stream.body)
            stream.state = HANDLING
        self.sender.forget(stream_id)

    def _reset(self, stream_id: int, code: int) -> None:
        self.server.protocol_error("stream", ERROR_NAMES.get(code, str(code)))
        self._write(frame(RST_STREAM, 0, stream_id, U32.pack(code)))
        self._forget(stream_id)

    # ---- deadlines and closing --------------------------------------------------------------
    def _restart_deadline(self) -> None:
        if self.closed:
            return
        server = self.server
        receiving = [s.started for s in self.streams.values() if s.state == RECEIVING]
        if receiving or self.continued is not None or not self.preface_read:
            start = min(receiving) if receiving else self.loop.time()
            self.deadline = start + server.request_timeout_s
        else:
            self.deadline = self.loop.time() + server.idle_timeout_s
        if self.paused:
            self.deadline = min(self.deadline, self.loop.time() + server.request_timeout_s)

    def expire(self) -> None:
        """Past the deadline: calls not received in time get DEADLINE_EXCEEDED; an idle
        connection, one without a preface, or one whose client reads nothing is closed."""
        now = self.loop.time()
        late = [
            s
            for s in self.streams.values()
            if s.state == RECEIVING and s.started + self.server.request_timeout_s <= now
        ]
        if self.paused or not self.preface_read or self.continued is not None:
            self.abort()
        elif late:
            for stream in late:
                self._refuse(
                    stream, self._own(GrpcAnswer(DEADLINE_EXCEEDED, "request not received in time"))
                )
            self._restart_deadline()
        elif not self.streams:
            self._fail(NO_ERROR, "idle")
        else:
            self._restart_deadline()

    def _fail(self, code: int, message: str) -> None:
        """GOAWAY with ``code``, then close: calls not yet answered are not processed."""
        if code != NO_ERROR:
            self.server.protocol_error("connection", ERROR_NAMES.get(code, str(code)))
        self._write(goaway(self.last_stream, code, message))
        self._close()

    def _close(self) -> None:
        self._closed()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close now (the server stops, a stalled client): GOAWAY first when it can be sent."""
        if self.transport is not None and not self.paused and not self.closed:
            self._write(goaway(self.last_stream, NO_ERROR, "closing"))
        self._closed()
        if self.transport is not None:
            (self.transport.abort if self.paused else self.transport.close)()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
