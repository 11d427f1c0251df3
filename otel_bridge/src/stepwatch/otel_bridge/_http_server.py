"""The bridge's HTTP/1.1 server: llhttp (through ``httptools``) parses, asyncio serves.

The wire is parsed by llhttp, Node.js's HTTP/1.1 parser (``httptools``, the binding uvicorn
uses): request lines, header fields, ``Content-Length`` and chunked bodies (RFC 9112 §6–7,
chunk extensions and trailers included), keep-alive and pipelined requests; what llhttp
refuses (conflicting lengths, both ``Content-Length`` and ``Transfer-Encoding``, bad
characters) is answered 400. This module is the policy around it, each limit answered with
the protocol's own error and the server serving on:

- ``request_timeout_s``: a whole request, headers and body, from its first byte (408, then
  the connection is closed; never restarted by a byte that trickles in); ``idle_timeout_s``
  between keep-alive requests (closed); both checked once a tick, so up to a tick late;
- ``max_header_bytes`` of request line and fields, counted as they are parsed, and at most
  :data:`MAX_HEADERS` fields (431);
- the body size the ``early`` check allows, also for chunked bodies (413 once passed);
- ``max_connections`` open at once: a new connection takes the place of the one idle longest
  (one that never sent a request first; :class:`LoopServer`), and gets 503 only when every
  connection is busy with a request;
- ``max_concurrent_requests`` complete requests being handled at once (503 + ``Retry-After``
  beyond it, from the loop);
- a client that does not read its answers: reading stops once its unread answers fill the
  transport's buffer (asyncio's high-water mark), and it is dropped after
  ``request_timeout_s``; requests it pipelined meanwhile wait unparsed in the socket.

A request is handled only once its headers and body are complete (on the loop, or by a worker
when the handler may block), so a slow client holds a socket, never a thread or a slot.
``Expect: 100-continue`` is answered once the early check passes; an ``Upgrade`` is ignored
(the request is answered, then the connection closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, NamedTuple, overload

import httptools

from stepwatch.otel_bridge._loop_server import (
    BUSY,
    IDLE,
    NEVER,
    READING,
    LoopConnection,
    LoopServer,
)

_log = logging.getLogger("stepwatch.otel_bridge")

MAX_HEADERS = 100  # as http.client
#: Longest a closing connection drains the client's unread input (``_linger``).
LINGER_S = 2.0
_METHODS = frozenset({"GET", "HEAD", "POST"})


class Headers:
    """A request's header fields: ``get`` by case-insensitive name; the first of repeated
    fields (llhttp refuses repeated ``Content-Length``)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        return self._fields.get(name.lower(), default)


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
"""Before the body is read: a response to refuse with, or the largest body to accept."""
Busy = Callable[[HttpRequest], HttpResponse]


def _plain(status: int, message: str, *, close: bool = True) -> HttpResponse:
    return HttpResponse(
        status, {"Content-Type": "text/plain; charset=utf-8"}, (message + "\n").encode(), close
    )


class _Refused(Exception):
    """Raised from a parser callback: answer ``response`` and close."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.status)
        self.response = response


class AsyncHttpServer(LoopServer):
    """Serves ``handler`` on ``host:port`` from an event-loop thread (and workers).

    Args:
        handler: answers a complete request (runs in a worker thread, or on the loop when
            ``inline`` says so).
        early: checks method, path and headers before the body is read (runs in the loop;
            must be cheap): returns a response to refuse with, or the largest body to read.
        busy: the answer when every request slot is taken (runs in the loop).
        max_header_bytes: request line and header fields together.
        **limits: :class:`LoopServer`'s connection and request limits, TLS and ``inline``.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        early: EarlyCheck,
        busy: Busy,
        max_header_bytes: int = 16 * 1024,
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


class _Pending(NamedTuple):
    request: HttpRequest
    keep_alive: bool


class _Connection(LoopConnection):
    """One client connection: llhttp's callbacks build requests, answered in order.

    States: idle (no request begun; closed after ``idle_timeout_s``), reading (a request's
    head or body; 408 after ``request_timeout_s`` from its first byte), handling (a worker has
    a request; reading paused), lingering (the last answer sent: input is read and dropped
    until the client closes, for at most :data:`LINGER_S`), closed.
    """

    server: AsyncHttpServer

    def __init__(self, server: AsyncHttpServer) -> None:
        super().__init__(server)
        self.parser = httptools.HttpRequestParser(self)
        self.state = _IDLE
        self.eof = False
        self.upgraded = False
        self.ready: deque[_Pending] = deque()  # complete requests not yet answered
        # the request being parsed
        self.in_message = False
        self.in_head = False
        self.head_fed = 0  # bytes fed to llhttp while in a head (bounds its buffers)
        self.head_size = 0  # request line and complete fields, as parsed
        self.begun = 0.0  # loop time of the request's first byte
        self.url = b""
        self.fields: dict[str, str] = {}
        self.field_count = 0
        self.method = ""
        self.keep_alive = True
        self.body = bytearray()
        self.body_limit = 0

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
        if self.state == _IDLE:
            self.state = _READING
            self.deadline = self.loop.time() + self.server.request_timeout_s
            self._mark(READING)
        try:
            self._feed(data)
        except _Refused as refused:
            self._refuse(refused.response)
            return
        except httptools.HttpParserUpgrade:
            self.upgraded = True  # the request is answered, then the connection closed
        except httptools.HttpParserCallbackError as error:
            if isinstance(error.__context__, _Refused):
                self._refuse(error.__context__.response)
            else:
                _log.debug("bridge HTTP connection failed", exc_info=True)
                self.abort()
            return
        except httptools.HttpParserError as error:
            self._refuse(_plain(400, f"bad request: {error}"))
            return
        except Exception:  # never let a connection's failure reach the loop
            _log.debug("bridge HTTP connection failed", exc_info=True)
            self.abort()
            return
        self._advance()

    def _feed(self, data: bytes) -> None:
        """Feed llhttp; while a head is incomplete, no more than its remaining budget at once,
        so an endless header line costs at most ``max_header_bytes``."""
        limit = self.server.max_header_bytes
        with memoryview(data) as view:
            offset = 0
            while offset < len(view):
                if self.in_message and not self.in_head:  # a body: llhttp streams it
                    self.parser.feed_data(view[offset:])
                    return
                room = max(1, limit + 1 - self.head_fed)
                chunk = view[offset : offset + room]
                self.head_fed += len(chunk)
                offset += len(chunk)
                self.parser.feed_data(chunk)
                if (self.in_head or not self.in_message) and self.head_fed > limit:
                    raise _Refused(_plain(431, "request headers too large"))

    def eof_received(self) -> bool:
        self.eof = True
        if self.state == _HANDLING or self.ready:
            return True  # answer first, then close
        self._close()
        return False

    def _serving(self) -> bool:
        return self.state < _LINGERING

    def _closed(self) -> None:
        self.state = _CLOSED
        super()._closed()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and self.state < _LINGERING:
            self._restart_deadline()
            self._advance()

    # ---- llhttp's callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_message = self.in_head = True
        self.head_fed = self.head_size = 0
        self.begun = self.loop.time()
        self.url = b""
        self.fields = {}
        self.field_count = 0
        self.body = bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))

    def _count_head(self, size: int) -> None:
        self.head_size += size
        if self.head_size > self.server.max_header_bytes:
            raise _Refused(_plain(431, "request headers too large"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.field_count += 1
        if self.field_count > MAX_HEADERS:
            raise _Refused(_plain(431, "too many headers"))
        self._count_head(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        if key not in self.fields:
            self.fields[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.in_head = False
        parser = self.parser
        method = parser.get_method().decode("latin-1")
        if method not in _METHODS:
            raise _Refused(_plain(501, f"unsupported method {method[:20]}"))
        self.method = method
        self.keep_alive = parser.should_keep_alive()
        path = self.url.decode("latin-1")
        headers = Headers(self.fields)
        checked = self.server.early(method, path, headers)
        if isinstance(checked, HttpResponse):
            raise _Refused(checked._replace(close=True))
        self.body_limit = checked
        if (self.fields.get("expect") or "").lower() == "100-continue" and method == "POST":
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if len(self.body) + len(body) > self.body_limit:
            raise _Refused(_plain(413, f"body exceeds {self.body_limit} bytes"))
        self.body += body

    def on_message_complete(self) -> None:
        self.in_message = False
        self.head_fed = 0
        request = HttpRequest(
            self.method, self.url.decode("latin-1"), Headers(self.fields), bytes(self.body)
        )
        self.body = bytearray()
        self.ready.append(_Pending(request, self.keep_alive))

    # ---- requests ---------------------------------------------------------------------------
    def _advance(self) -> None:
        """Answer the complete requests in order while the client reads its answers."""
        while self.ready and self.state in (_IDLE, _READING) and not self.paused:
            pending = self.ready.popleft()
            self._dispatch(pending.request, pending.keep_alive)
        transport = self.transport
        if transport is None or self.state >= _LINGERING:
            return
        if self.ready or self.state == _HANDLING or self.paused:
            transport.pause_reading()  # pipelined requests wait in the socket
        else:
            transport.resume_reading()
            if self.upgraded:
                self._linger()
            elif self.eof:
                self._close()

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
        self._mark(BUSY)
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
        self.state = _READING if self.ready else _IDLE
        try:
            self._answer(done.result(), method, keep_alive)
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
        self.state = _READING if self.ready or self.in_message else _IDLE
        self._restart_deadline()

    def _refuse(self, response: HttpResponse) -> None:
        """A request llhttp or a limit refused: answer it (after those before it), close."""
        self.ready.clear()
        self._answer(response._replace(close=True), "", False)

    def _restart_deadline(self) -> None:
        server = self.server
        now = self.loop.time()
        if self.state == _IDLE:
            self.deadline = now + server.idle_timeout_s
            self._mark(IDLE)
        elif self.state == _READING:
            start = self.begun if self.in_message else now
            self.deadline = start + server.request_timeout_s
            self._mark(READING)
        if self.paused:
            self.deadline = min(self.deadline, now + server.request_timeout_s)

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
            self._refuse(_plain(408, "request not received in time"))
        elif self.state == _IDLE:
            self._close()

    def _linger(self) -> None:
        """Close after a last answer without resetting it: send FIN, then read and drop what
        the client still sends (the rest of a body it was told was late or too big) until it
        closes too, for at most :data:`LINGER_S`. Closing with unread input makes the kernel
        send a reset, and a client can get that reset instead of the answer."""
        self.state = _LINGERING
        self.ready.clear()
        self._mark(BUSY)
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


def _encode(response: HttpResponse) -> bytes:
    reason = _REASONS.get(response.status, "Status")
    head = [f"HTTP/1.1 {response.status} {reason}"]
    head += [f"{key}: {value}" for key, value in response.headers.items()]
    head.append(f"Content-Length: {len(response.body)}")
    if response.close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body


_REASONS = {status.value: status.phrase for status in HTTPStatus}
