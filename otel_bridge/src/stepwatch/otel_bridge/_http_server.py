"""A small HTTP/1.1 server on asyncio: slow clients cost a socket, never a thread.

One event-loop thread reads every connection; a request is handled only once its headers and
body are complete (by a worker thread, or on the loop itself when the handler cannot block),
so a client trickling bytes holds no worker and no request slot. Limits, each answered with
the protocol's own error:

- ``request_timeout_s``: the whole request, headers and body, from its first byte (408, then
  the connection is closed); ``idle_timeout_s`` between keep-alive requests (closed); both
  checked once a tick (:attr:`AsyncHttpServer.tick_s`), so up to a tick late;
- ``max_connections`` open at once (beyond it a new connection gets 503 and is closed);
- ``max_concurrent_requests`` complete requests in the workers at once (beyond it 503 +
  ``Retry-After``, from the loop: no thread is spent on the refusal);
- ``max_header_bytes`` (431), the body size the ``early`` check allows (413 there).

HTTP/1.1 as RFC 9112: keep-alive by default (``Connection: close`` honoured), HTTP/1.0
closes unless ``keep-alive``; ``Expect: 100-continue`` answered once the early check passes;
``Content-Length`` bodies only (the receiver refuses chunked ones before reading).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, NamedTuple, overload

from stepwatch.otel_bridge._loop_server import NEVER, LoopConnection, LoopServer

_log = logging.getLogger("stepwatch.otel_bridge")


MAX_HEADERS = 100  # as http.client
#: Longest a closing connection drains the client's unread input (``_linger``).
LINGER_S = 2.0


class Headers:
    """A request's header fields: ``get`` by case-insensitive name; the first of repeated
    fields (a repeated ``Content-Length`` that differs is refused when parsed)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        return self._fields.get(name.lower(), default)


# RFC 9110 5.1: a field name is a token
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")


def parse_headers(block: bytes) -> Headers:
    """The header fields of a request head (after its request line), RFC 9112 section 5.

    Raises:
        _Refused: 400 for a malformed field, obsolete line folding or conflicting
            Content-Length fields; 431 for more than ``MAX_HEADERS`` fields.
    """
    fields: dict[str, str] = {}
    match = _FIELD_NAME.match
    for count, line in enumerate(block.decode("latin-1").split("\n"), 1):
        if line.endswith("\r"):
            line = line[:-1]
        if not line:
            break  # the blank line that ends the head
        if line[0] in " \t":
            raise _Refused(400, "bad headers: obsolete line folding")
        if count > MAX_HEADERS:
            raise _Refused(431, "too many headers")
        name, colon, value = line.partition(":")
        if not colon or not match(name):
            raise _Refused(400, "bad headers")
        key = name.lower()
        value = value.strip(" \t")
        known = fields.get(key)
        if known is None:
            fields[key] = value
        elif key == "content-length" and known != value:
            raise _Refused(400, "bad headers: conflicting Content-Length")
    return Headers(fields)


class HttpRequest(NamedTuple):
    method: str
    path: str
    headers: Headers  # case-insensitive ``get``
    body: bytes


class HttpResponse(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes
    close: bool = False  # close the connection after answering


Handler = Callable[[HttpRequest], HttpResponse]
EarlyCheck = Callable[[str, str, Headers], "HttpResponse | int"]
"""Before the body is read: a response to refuse with, or the body's length to read."""
Busy = Callable[[HttpRequest], HttpResponse]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _plain(status: int, message: str, *, close: bool = True) -> HttpResponse:
    return HttpResponse(
        status, {"Content-Type": "text/plain; charset=utf-8"}, (message + "\n").encode(), close
    )


class AsyncHttpServer(LoopServer):
    """Serves ``handler`` on ``host:port`` from an event-loop thread and a worker pool.

    Each connection is an :class:`asyncio.Protocol` (:class:`_Connection`) that parses what
    arrives as it arrives: no stream reader, coroutine or timer per request (deadlines are
    :class:`LoopServer`'s sweep). Against asyncio's streams with a timer per wait this took the
    server's CPU around a request from ~100 to ~45 us (``bench/receiver_cost.py``).

    Args:
        handler: answers a complete request (runs in a worker thread, or on the loop when
            ``inline`` says so).
        early: checks method, path and headers before the body is read (runs in the loop;
            must be cheap): returns a response to refuse with, or the body length to read.
        busy: the answer when every request slot is taken (runs in the loop).
        max_header_bytes: request line and headers together.
        **limits: :class:`LoopServer`'s connection and request limits, TLS and ``inline``.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        early: EarlyCheck,
        busy: Busy,
        max_header_bytes: int = 64 * 1024,
        **limits: Any,
    ) -> None:
        super().__init__(**limits)
        self.handler = handler
        self.early = early
        self.busy = busy
        self.max_header_bytes = max_header_bytes

    def _new_connection(self) -> asyncio.Protocol:
        return _Connection(self)

    def _handle(self, request: HttpRequest) -> HttpResponse:
        try:
            return self.handler(request)
        except Exception:  # a bug must not take the server down: answer and keep serving
            _log.exception("bridge HTTP handler failed")
            return _plain(500, "internal error", close=False)


_IDLE, _READING, _HANDLING, _LINGERING, _CLOSED = range(5)


class _Connection(LoopConnection):
    """One client connection: reads requests as bytes arrive, answers them in order.

    States: idle (waiting for a request's first byte; closed after ``idle_timeout_s``),
    reading (head, then body; 408 after ``request_timeout_s`` from the first byte), handling
    (a worker has the request; reading paused), lingering (the last answer sent: input is
    read and dropped until the client closes, for at most :data:`LINGER_S`), closed.
    """

    server: AsyncHttpServer

    def __init__(self, server: AsyncHttpServer) -> None:
        super().__init__(server)
        self.buffer = bytearray()
        self.state = _IDLE
        self.request: tuple[str, str, str, Headers, bool] | None = None  # the head read
        self.length = 0  # of the body being read
        self.eof = False

    # ---- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._admit(transport):
            self.state = _CLOSED
            assert self.transport is not None
            self.transport.write(_encode(_plain(503, "too many connections")))
            self.transport.close()
            return
        self.deadline = self.loop.time() + self.server.idle_timeout_s

    def data_received(self, data: bytes) -> None:
        if self.state >= _LINGERING:
            return  # what a closing client still sends is dropped
        self.buffer += data
        if self.state == _HANDLING:
            return  # the next request waits for this one's answer (reading is paused)
        try:
            self._advance()
        except Exception:  # never let a connection's failure reach the loop
            _log.debug("bridge HTTP connection failed", exc_info=True)
            self.abort()

    def eof_received(self) -> bool:
        self.eof = True
        if self.state == _HANDLING:
            return True  # answer first, then close (_answer sees eof)
        self._close()
        return False

    def _serving(self) -> bool:
        return self.state < _LINGERING

    def _closed(self) -> None:
        self.state = _CLOSED
        super()._closed()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and self.state in (_IDLE, _READING):
            self.transport.resume_reading()
            self._restart_deadline()
            self._advance()

    # ---- requests ---------------------------------------------------------------------------
    def _advance(self) -> None:
        """Parse and answer every request complete in the buffer."""
        server = self.server
        while self.state in (_IDLE, _READING) and not self.paused:
            if self.request is None:
                if not self.buffer:
                    return
                if self.state == _IDLE:
                    self.state = _READING
                    self.deadline = self.loop.time() + server.request_timeout_s
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0 or end + 4 > server.max_header_bytes:
                    if end >= 0 or len(self.buffer) > server.max_header_bytes:
                        self._answer(_plain(431, "request headers too large"), "", False)
                    return
                head = bytes(self.buffer[:end])
                del self.buffer[: end + 4]
                try:
                    method, path, version, headers = _parse_head(head)
                except _Refused as refused:
                    self._answer(_plain(refused.status, str(refused)), "", False)
                    return
                checked = server.early(method, path, headers)
                if isinstance(checked, HttpResponse):
                    self._answer(checked._replace(close=True), method, False)
                    return
                if checked and headers.get("Expect", "").lower() == "100-continue":
                    self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.request = (method, path, version, headers, _keep_alive(version, headers))
                self.length = checked
            if len(self.buffer) < self.length:
                return
            method, path, _version, headers, keep_alive = self.request
            if self.length:
                with memoryview(self.buffer) as view:
                    body = bytes(view[: self.length])
                del self.buffer[: self.length]
            else:
                body = b""
            self.request = None
            self._dispatch(HttpRequest(method, path, headers, body), keep_alive)

    def _dispatch(self, request: HttpRequest, keep_alive: bool) -> None:
        server = self.server
        post = request.method == "POST"
        if post:
            if server.in_flight >= server.max_concurrent_requests:
                self._answer(server.busy(request), request.method, keep_alive)
                return
            server.in_flight += 1
        workers = server._workers
        if workers is None:  # stopping
            if post:
                server.in_flight -= 1
            self.abort()
            return
        if server.inline():
            try:
                response = server._handle(request)
            finally:
                if post:
                    server.in_flight -= 1
            self._answer(response, request.method, keep_alive)
            return
        self.state = _HANDLING
        self.deadline = NEVER  # a handler is not timed out; the client waits for it
        assert self.transport is not None
        self.transport.pause_reading()
        try:
            future = self.loop.run_in_executor(workers, server._handle, request)
        except RuntimeError:  # the pool is shutting down
            if post:
                server.in_flight -= 1
            self.abort()
            return
        future.add_done_callback(lambda done: self._handled(done, request.method, keep_alive, post))

    def _handled(
        self, done: asyncio.Future[HttpResponse], method: str, keep_alive: bool, post: bool
    ) -> None:
        if post:
            self.server.in_flight -= 1
        if self.state != _HANDLING:
            return  # closed meanwhile
        if done.cancelled() or done.exception() is not None:
            self.abort()
            return
        self.state = _IDLE
        try:
            if self.transport is not None and not self.paused:
                self.transport.resume_reading()
            self._answer(done.result(), method, keep_alive)
            if self.eof and self.state < _LINGERING:
                self._close()
            elif self.state in (_IDLE, _READING):
                self._advance()
        except Exception:  # never let a connection's failure reach the loop
            _log.debug("bridge HTTP connection failed", exc_info=True)
            self.abort()

    def _answer(self, response: HttpResponse, method: str, keep_alive: bool) -> None:
        """Send ``response``; then wait for the next request or close (lingering)."""
        data = _encode(response)
        if method == "HEAD":
            data = data[: len(data) - len(response.body)] if response.body else data
        self._write(data)
        if not keep_alive or response.close:
            self._linger()
            return
        self.state = _IDLE
        self._restart_deadline()

    def _restart_deadline(self) -> None:
        server = self.server
        timeout = server.request_timeout_s if self.buffer else server.idle_timeout_s
        if self.buffer:
            self.state = _READING
        self.deadline = self.loop.time() + timeout
        if self.paused:
            self.deadline = min(self.deadline, self.loop.time() + server.request_timeout_s)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    # ---- closing ----------------------------------------------------------------------------
    def expire(self) -> None:
        """Past the deadline: 408 mid-request, close when idle, abort when lingering or when
        the client has not read its answers in ``request_timeout_s``."""
        if self.paused or self.state == _LINGERING:
            self.abort()
        elif self.state == _READING:
            self.request = None
            self._answer(_plain(408, "request not received in time"), "", False)
        elif self.state == _IDLE:
            self._close()

    def _linger(self) -> None:
        """Close after a last answer without resetting it: send FIN, then read and drop what
        the client still sends (the rest of a body it was told was late or too big) until it
        closes too, for at most :data:`LINGER_S`. Closing with unread input makes the kernel
        send a reset, and a client can get that reset instead of the answer (a trickling
        client read ``ConnectionResetError`` rather than its 408)."""
        self.state = _LINGERING
        self.buffer.clear()
        self.request = None
        self.deadline = self.loop.time() + LINGER_S
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.eof:
            transport.close()
            return
        transport.resume_reading()  # read (and drop) what the client still sends
        if transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()

    def _close(self, *, reset: bool = False) -> None:
        self._closed()
        if self.transport is not None:
            (self.transport.abort if reset else self.transport.close)()

    def abort(self) -> None:
        self._close(reset=True)


def _parse_head(head: bytes) -> tuple[str, str, str, Headers]:
    """Request line and header fields of a head (without its blank line).

    Raises:
        _Refused: 400 malformed request line or headers, 431, 501 unsupported method.
    """
    line, _, rest = head.partition(b"\r\n")
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _Refused(400, "malformed request line")
    method, path, version = parts
    headers = parse_headers(rest + b"\r\n") if rest else Headers({})
    if method not in ("GET", "HEAD", "POST"):
        raise _Refused(501, f"unsupported method {method[:20]}")
    return method, path, version, headers


def _encode(response: HttpResponse) -> bytes:
    reason = _REASONS.get(response.status, "Status")
    head = [f"HTTP/1.1 {response.status} {reason}"]
    head += [f"{key}: {value}" for key, value in response.headers.items()]
    head.append(f"Content-Length: {len(response.body)}")
    if response.close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body


_REASONS = {status.value: status.phrase for status in HTTPStatus}


def _keep_alive(version: str, headers: Headers) -> bool:
    connection = (headers.get("Connection") or "").lower()
    if version == "HTTP/1.0":
        return "keep-alive" in connection
    return "close" not in connection
