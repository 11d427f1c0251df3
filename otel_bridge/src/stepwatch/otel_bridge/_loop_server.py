"""The event-loop machinery under the bridge's HTTP/1.1 server (no protocol: that is llhttp's).

One event-loop thread serves every connection of a server; a connection is an
:class:`asyncio.Protocol` fed bytes as they arrive, so a slow client costs a socket, never a
thread. Here: the listener, the set of open connections and its bound (a new connection takes
the place of the one that has been idle longest), the one sweep a tick that times connections
out, the count of requests in flight and the workers that run handlers which may block, and TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, cast

from stepwatch.core._errors import ConfigError, ServerStartError

_log = logging.getLogger("stepwatch.otel_bridge")

NEVER = float("inf")


def tls_context(
    files: tuple[str | os.PathLike[str], str | os.PathLike[str]], *, alpn: list[str] | None = None
) -> ssl.SSLContext:
    """A server TLS context from PEM ``(certificate file, private key file)``.

    Raises:
        ConfigError: the certificate or key cannot be loaded.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(files[0]), str(files[1]))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert_file, tls_key_file: {exc}") from exc
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


class LoopServer:
    """One event-loop thread serving connections, a worker pool, and the deadline sweep.

    What :class:`~._http_server.AsyncHttpServer`'s connections share: the listening socket,
    the set of open connections (each an :class:`asyncio.Protocol` with a ``deadline`` in loop
    time, an ``expire()`` called once it has passed, and an ``abort()``), the count of requests in
    flight, and the workers that run handlers which may block. Deadlines are checked by one
    sweep of the connections a tick (:attr:`tick_s`: an eighth of the shorter timeout,
    between 50 ms and 1 s), so a timeout fires up to a tick late.

    Args:
        max_connections: open connections at once. At the bound a new connection is admitted
            in place of another, chosen in this order: one that has sent nothing yet (oldest
            first), one idle between requests (idle longest first), one reading a request
            (begun earliest first); one being handled is never chosen. Only when every
            connection is being handled is the new one refused.
        max_concurrent_requests: complete requests being handled at once.
        request_timeout_s: deadline for one request's headers and body.
        idle_timeout_s: how long a connection may wait for its next request.
        ssl_context: serve TLS when set (handshake bounded by ``request_timeout_s``).
        reuse_port: set SO_REUSEPORT.
        inline: asked for each complete request: True runs the handler on the loop thread
            (when it cannot block: a bridge with a memory spool never waits for a disk),
            saving the hand-off to a worker and back (~20 % of the bridge's CPU per request
            over OTLP/HTTP, ``bench/bridge_e2e.py``); False (the default) uses a worker.
    """

    #: Named in thread names and messages.
    protocol = "HTTP"

    def __init__(
        self,
        *,
        max_connections: int,
        max_concurrent_requests: int,
        request_timeout_s: float,
        idle_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
        inline: Callable[[], bool] = lambda: False,
    ) -> None:
        self.inline = inline
        self.max_connections = max_connections
        self.max_concurrent_requests = max_concurrent_requests
        self.request_timeout_s = request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.ssl_context = ssl_context
        self.reuse_port = reuse_port
        self.tick_s = min(1.0, max(0.05, min(request_timeout_s, idle_timeout_s) / 8))
        self.in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._workers: futures.ThreadPoolExecutor | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._connections: set[Any] = set()
        # reclaimable connections by kind, each in the order it became so (dicts keep it)
        self._reclaimable: tuple[dict[Any, None], ...] = ({}, {}, {})

    @property
    def connections(self) -> int:
        return len(self._connections)

    def _new_connection(self) -> asyncio.Protocol:
        raise NotImplementedError

    def start(self, host: str, port: int) -> int:
        """Bind, start the loop thread; the bound port.

        Raises:
            ServerStartError: the address cannot be bound.
        """
        loop = asyncio.new_event_loop()
        name = self.protocol.lower()
        self._workers = futures.ThreadPoolExecutor(
            max_workers=self.max_concurrent_requests + 2,
            thread_name_prefix=f"stepwatch-bridge-{name}",
        )
        try:
            server = loop.run_until_complete(
                loop.create_server(
                    self._new_connection,
                    host,
                    port,
                    ssl=self.ssl_context,
                    ssl_handshake_timeout=self.request_timeout_s if self.ssl_context else None,
                    reuse_address=True,
                    reuse_port=self.reuse_port or None,
                    backlog=1024,
                )
            )
        except OSError as exc:
            loop.close()
            self._workers.shutdown(wait=False)
            raise ServerStartError(
                f"bridge {self.protocol} cannot listen on {host}:{port}: {exc}"
            ) from exc
        self._loop, self._server = loop, server
        self._sweep = loop.call_later(self.tick_s, self._expire)
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"stepwatch-bridge-{name}-loop", daemon=True
        )
        self._thread.start()
        return int(server.sockets[0].getsockname()[1])

    def stop(self, *, timeout_s: float) -> None:
        """Stop accepting, close every connection, let handlers finish, stop the loop."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shut() -> None:
            if self._sweep is not None:
                self._sweep.cancel()
            if self._server is not None:
                self._server.close()
            for connection in list(self._connections):
                connection.abort()
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
        self._loop = self._thread = self._server = self._workers = self._sweep = None

    def _expire(self) -> None:
        """The tick: every connection past its deadline is timed out; the next tick."""
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        for connection in [c for c in self._connections if c.deadline <= now]:
            try:
                connection.expire()
            except Exception:  # never let one connection stop the sweep
                _log.debug("bridge %s connection failed to time out", self.protocol, exc_info=True)
                connection.abort()
        self._sweep = loop.call_later(self.tick_s, self._expire)


#: What a connection is doing, for reclaiming one at the connection bound (in that order).
FRESH, IDLE, READING, BUSY = range(4)


class LoopConnection(asyncio.Protocol):
    """What a :class:`LoopServer`'s connections share: admission under ``max_connections``,
    ``TCP_NODELAY``, the deadline the sweep reads, and a client that does not read its
    answers (reading paused; dropped after ``request_timeout_s``)."""

    kind = BUSY

    def __init__(self, server: LoopServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.deadline = NEVER
        self.paused = False  # the client is not reading its answers

    def _admit(self, transport: asyncio.BaseTransport) -> bool:
        """Take the connection into the server's set; False beyond ``max_connections``."""
        self.transport = cast(asyncio.Transport, transport)
        server = self.server
        if len(server._connections) >= server.max_connections:
            victim = next((next(iter(kind)) for kind in server._reclaimable if kind), None)
            if victim is None:
                return False
            victim.abort()  # its place goes to the new connection
        server._connections.add(self)
        self._mark(FRESH)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True

    def _serving(self) -> bool:
        """Whether requests are still read (not closing)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close at once (a reset)."""
        raise NotImplementedError

    def expire(self) -> None:
        """Past the deadline."""
        raise NotImplementedError

    def _mark(self, kind: int) -> None:
        """Say what the connection is doing now (FRESH, IDLE, READING or BUSY)."""
        reclaimable = self.server._reclaimable
        if self.kind != BUSY:
            reclaimable[self.kind].pop(self, None)
        self.kind = kind
        if kind != BUSY:
            reclaimable[kind][self] = None

    def _closed(self) -> None:
        """Mark the connection closed (no deadline, out of the server's set)."""
        self.deadline = NEVER
        self._mark(BUSY)
        self.server._connections.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()

    def pause_writing(self) -> None:
        self.paused = True
        if self.transport is not None and self._serving():
            self.transport.pause_reading()
            self.deadline = min(self.deadline, self.loop.time() + self.server.request_timeout_s)
