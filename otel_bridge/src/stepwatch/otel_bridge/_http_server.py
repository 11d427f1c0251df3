"""A small HTTP/1.1 server on asyncio: slow clients cost a socket, never a thread.

One event-loop thread reads every connection; a request is handled only once its headers and
body are complete (by a worker thread, or on the loop itself when the handler cannot block),
so a client trickling bytes holds no worker and no request slot. Limits, each answered with
the protocol's own error:

- ``request_timeout_s``: the whole request, headers and body, from its first byte (408, then
  the connection is closed); ``idle_timeout_s`` between keep-alive requests (closed);
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
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent import futures
from http import HTTPStatus
from typing import NamedTuple, overload

from stepwatch.core._errors import ServerStartError

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
    for count, raw in enumerate(block.split(b"\n"), 1):
        line = raw[:-1] if raw.endswith(b"\r") else raw
        if not line:
            break  # the blank line that ends the head
        if line[:1] in (b" ", b"\t"):
            raise _Refused(400, "bad headers: obsolete line folding")
        if count > MAX_HEADERS:
            raise _Refused(431, "too many headers")
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon or not _FIELD_NAME.match(name):
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


class AsyncHttpServer:
    """Serves ``handler`` on ``host:port`` from an event-loop thread and a worker pool.

    Args:
        handler: answers a complete request (runs in a worker thread).
        early: checks method, path and headers before the body is read (runs in the loop;
            must be cheap): returns a response to refuse with, or the body length to read.
        busy: the answer when every request slot is taken (runs in the loop).
        max_connections: open connections at once.
        max_concurrent_requests: complete requests being handled at once (worker threads).
        request_timeout_s: deadline for one request's headers and body.
        idle_timeout_s: how long a keep-alive connection may wait for its next request.
        max_header_bytes: request line and headers together.
        ssl_context: serve TLS when set (handshake bounded by ``request_timeout_s``).
        reuse_port: set SO_REUSEPORT.
        inline: asked for each complete request: True runs ``handler`` on the loop thread
            (when it cannot block: a bridge with a memory spool never waits for a disk),
            saving the hand-off to a worker and back (~20 % of the bridge's CPU per request
            over OTLP/HTTP, ``bench/bridge_e2e.py``); False (the default) uses a worker.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        early: EarlyCheck,
        busy: Busy,
        max_connections: int,
        max_concurrent_requests: int,
        request_timeout_s: float,
        idle_timeout_s: float,
        max_header_bytes: int = 64 * 1024,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
        inline: Callable[[], bool] = lambda: False,
    ) -> None:
        self.handler = handler
        self.inline = inline
        self.early = early
        self.busy = busy
        self.max_connections = max_connections
        self.max_concurrent_requests = max_concurrent_requests
        self.request_timeout_s = request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_header_bytes = max_header_bytes
        self.ssl_context = ssl_context
        self.reuse_port = reuse_port
        self.in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._workers: futures.ThreadPoolExecutor | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    def start(self, host: str, port: int) -> int:
        """Bind, start the loop thread; the bound port.

        Raises:
            ServerStartError: the address cannot be bound.
        """
        loop = asyncio.new_event_loop()
        self._workers = futures.ThreadPoolExecutor(
            max_workers=self.max_concurrent_requests + 2, thread_name_prefix="stepwatch-bridge-http"
        )
        try:
            server = loop.run_until_complete(
                asyncio.start_server(
                    self._serve,
                    host,
                    port,
                    ssl=self.ssl_context,
                    ssl_handshake_timeout=self.request_timeout_s if self.ssl_context else None,
                    reuse_address=True,
                    reuse_port=self.reuse_port or None,
                    backlog=1024,
                    limit=self.max_header_bytes,
                )
            )
        except OSError as exc:
            loop.close()
            self._workers.shutdown(wait=False)
            raise ServerStartError(f"bridge HTTP cannot listen on {host}:{port}: {exc}") from exc
        self._loop, self._server = loop, server
        self._thread = threading.Thread(
            target=loop.run_forever, name="stepwatch-bridge-http-loop", daemon=True
        )
        self._thread.start()
        return int(server.sockets[0].getsockname()[1])

    def stop(self, *, timeout_s: float) -> None:
        """Stop accepting, close every connection, let handlers finish, stop the loop."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._connections):
                writer.transport.abort()
            if self._server is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._server.wait_closed(), timeout_s)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), loop).result(timeout_s)
        if self._workers is not None:
            self._workers.shutdown(wait=True, cancel_futures=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = self._server = self._workers = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            await self._respond(writer, _plain(503, "too many connections"))
            writer.transport.abort()
            return
        self._connections.add(writer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                keep, answered = await self._one_request(reader, writer)
                if not keep:
                    break
            if answered:
                await self._linger(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
            pass
        except Exception:  # never let a connection's failure reach the loop
            _log.debug("bridge HTTP connection failed", exc_info=True)
        finally:
            self._connections.discard(writer)
            writer.transport.abort()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Close after a last answer without resetting it: send FIN, then read and drop what
        the client still sends (the rest of a body it was told was late or too big) until it
        closes too, for at most :data:`LINGER_S`. Closing with unread input makes the kernel
        send a reset, and a client can get that reset instead of the answer (a trickling
        client read ``ConnectionResetError`` rather than its 408)."""
        with contextlib.suppress(OSError, RuntimeError, TimeoutError, ssl.SSLError):
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(65536):
                    pass

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[bool, bool]:
        """Read, handle and answer one request: (keep the connection, an answer was sent)."""
        try:  # asyncio.timeout, not wait_for: no task per request
            async with asyncio.timeout(self.idle_timeout_s):
                first = await reader.read(1)
        except TimeoutError:
            return False, False
        if not first:
            return False, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                method, path, version, headers = await self._read_head(first, reader)
                keep_alive = _keep_alive(version, headers)
                checked = self.early(method, path, headers)
                if isinstance(checked, HttpResponse):
                    await self._respond(writer, checked._replace(close=True), method=method)
                    return False, True
                if checked and headers.get("Expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await reader.readexactly(checked) if checked else b""
        except TimeoutError:
            await self._respond(writer, _plain(408, "request not received in time"))
            return False, True
        except _Refused as refused:
            await self._respond(writer, _plain(refused.status, str(refused)))
            return False, True
        request = HttpRequest(method, path, headers, body)
        if method == "POST":
            if self.in_flight >= self.max_concurrent_requests:
                response = self.busy(request)
                await self._respond(writer, response)
                return keep_alive and not response.close, True
            self.in_flight += 1
        try:
            workers = self._workers
            if workers is None:  # stopping
                return False, False
            if self.inline():
                response = self._handle(request)
            else:
                response = await loop.run_in_executor(workers, self._handle, request)
        finally:
            if method == "POST":
                self.in_flight -= 1
        await self._respond(writer, response, method=method)
        return keep_alive and not response.close, True

    def _handle(self, request: HttpRequest) -> HttpResponse:
        try:
            return self.handler(request)
        except Exception:  # a bug must not take the server down: answer and keep serving
            _log.exception("bridge HTTP handler failed")
            return _plain(500, "internal error", close=False)

    async def _read_head(
        self, first: bytes, reader: asyncio.StreamReader
    ) -> tuple[str, str, str, Headers]:
        try:
            head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise _Refused(431, "request headers too large") from exc
        if len(head) > self.max_header_bytes:
            raise _Refused(431, "request headers too large")
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Refused(400, "malformed request line")
        method, path, version = parts
        headers = parse_headers(rest)  # http.client's (an email parser) took ~30 us a request
        if method not in ("GET", "HEAD", "POST"):
            raise _Refused(501, f"unsupported method {method[:20]}")
        return method, path, version, headers

    async def _respond(
        self, writer: asyncio.StreamWriter, response: HttpResponse, *, method: str = ""
    ) -> None:
        reason = HTTPStatus(response.status).phrase if response.status in _KNOWN else "Status"
        head = [f"HTTP/1.1 {response.status} {reason}"]
        head += [f"{key}: {value}" for key, value in response.headers.items()]
        head.append(f"Content-Length: {len(response.body)}")
        if response.close:
            head.append("Connection: close")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        writer.write(data if method == "HEAD" else data + response.body)
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(self.request_timeout_s):
                await writer.drain()


_KNOWN = {status.value for status in HTTPStatus}


def _keep_alive(version: str, headers: Headers) -> bool:
    connection = (headers.get("Connection") or "").lower()
    if version == "HTTP/1.0":
        return "keep-alive" in connection
    return "close" not in connection
