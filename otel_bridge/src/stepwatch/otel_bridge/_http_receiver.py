"""The OTLP/HTTP receiver: ``POST /v1/metrics``, plus ``GET /metrics`` and ``GET /healthz``.

Answers follow the OTLP specification (https://opentelemetry.io/docs/specs/otlp/#otlphttp):
200 with an ``ExportMetricsServiceResponse`` in the request's encoding (``partial_success``
counting refused points); 400 malformed body, 401 missing or wrong bearer token, 404 unknown
path, 411 no ``Content-Length``, 413 body too large (also after decompression), 415 unknown
content type or encoding (not retryable); 429 queue full and 503 too many requests in flight,
both with ``Retry-After`` (retryable). Error bodies are a ``google.rpc.Status``. Every bad
request is answered and the server keeps serving. Connections, threads, timeouts and request
slots are this module's.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from stepwatch.core._errors import ConfigError, ServerStartError
from stepwatch.otel_bridge._decode import JSON, PROTOBUF, RequestError, decode_body, media_type
from stepwatch.otel_bridge._intake import Outcome, ReceiverContext

_log = logging.getLogger("stepwatch.otel_bridge")

HTTP_PATH = "/v1/metrics"
# google.rpc.Code (https://github.com/googleapis/googleapis/blob/master/google/rpc/code.proto)
_CODE_INVALID_ARGUMENT = 3
_CODE_RESOURCE_EXHAUSTED = 8
_CODE_UNAUTHENTICATED = 16
_TEXT = "text/plain; charset=utf-8"


class HttpReceiver:
    """Serves OTLP/HTTP, the bridge's ``/metrics`` and ``/healthz`` on one port once started.

    Args:
        context: the intake, metrics and limits both receivers share.
        max_concurrent_requests: exports processed at once; beyond it 503 + ``Retry-After``.
        tls_files: PEM ``(certificate file, private key file)``; plaintext when None.
    """

    def __init__(
        self,
        context: ReceiverContext,
        *,
        max_concurrent_requests: int,
        tls_files: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None,
    ) -> None:
        if max_concurrent_requests <= 0:
            raise ConfigError(
                f"max_concurrent_requests: must be positive, got {max_concurrent_requests}"
            )
        self.context = context
        self.slots = threading.BoundedSemaphore(max_concurrent_requests)
        self._tls_files = tls_files
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` and serve from a thread; the bound port.

        Raises:
            ServerStartError: the address cannot be bound.
            ConfigError: the TLS certificate or key cannot be loaded.
        """
        try:
            server = _HTTPServer((host, port), _Handler, receiver=self)
        except OSError as exc:
            raise ServerStartError(f"bridge HTTP cannot listen on {host}:{port}: {exc}") from exc
        if self._tls_files is not None:
            tls_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                tls_context.load_cert_chain(str(self._tls_files[0]), str(self._tls_files[1]))
            except (OSError, ssl.SSLError) as exc:
                server.server_close()
                raise ConfigError(f"tls_cert_file, tls_key_file: {exc}") from exc
            server.socket = tls_context.wrap_socket(server.socket, server_side=True)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="stepwatch-bridge-http",
            daemon=True,
        )
        self._thread.start()
        return int(server.server_address[1])

    def stop(self, *, timeout_s: float) -> None:
        """Stop accepting, close open connections, join the serving thread."""
        if self._server is not None:
            self._server.shutdown()
            self._server.close_connections()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: Callable[..., http.server.BaseHTTPRequestHandler],
        *,
        receiver: HttpReceiver,
    ) -> None:
        self.receiver = receiver
        # Keep-alive connections outlive serve_forever(): remember them so stop() can close
        # them, or an exporter reusing its connection would talk to a stopped bridge forever.
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Close every open client connection (after ``shutdown()``: none are accepted)."""
        with self._connections_lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def server_bind(self) -> None:
        if self.receiver.context.reuse_port and hasattr(socket, "SO_REUSEPORT"):
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("bridge HTTP connection from %s failed", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: exporters reuse connections
    # One segment per response, sent at once: with Nagle on and the body written apart from
    # the headers, a keep-alive client waits for the delayed ACK (~40 ms per request).
    disable_nagle_algorithm = True
    wbufsize = 64 * 1024
    server: _HTTPServer
    timeout = 30.0

    @property
    def context(self) -> ReceiverContext:
        return self.server.receiver.context

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("bridge HTTP %s: " + format, self.client_address[0], *args)

    def _send(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, content_type = self.context.metrics.exposition()
            self._send(200, body, content_type)
        elif path == "/healthz":
            self._send(200, b"ok\n", _TEXT)
        else:
            self._send(404, b"not found\n", _TEXT)

    def _encoded(self, message: Any, *, json_body: bool) -> tuple[bytes, str]:
        """A protobuf message in the request's encoding, and its content type."""
        from google.protobuf import json_format

        if json_body:
            return json_format.MessageToJson(message, indent=None).encode(), JSON
        return bytes(message.SerializeToString()), PROTOBUF

    def _fail(self, status: int, message: str, *, json_body: bool, close: bool = False) -> None:
        from google.rpc import status_pb2  # type: ignore[import-untyped]

        context = self.context
        context.metrics.requests.labels(protocol="http", code=str(status)).inc()
        rpc_code = {
            401: _CODE_UNAUTHENTICATED,
            429: _CODE_RESOURCE_EXHAUSTED,
            503: _CODE_RESOURCE_EXHAUSTED,
        }.get(status, _CODE_INVALID_ARGUMENT)
        body, content_type = self._encoded(
            status_pb2.Status(code=rpc_code, message=message), json_body=json_body
        )
        headers: dict[str, str] = {}
        if status in (429, 503):
            headers["Retry-After"] = str(context.retry_after_s)
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="stepwatch"'
        if close:
            headers["Connection"] = "close"
            self.close_connection = True
        self._send(status, body, content_type, headers)

    def do_POST(self) -> None:
        receiver = self.server.receiver
        json_body = media_type(self.headers.get("Content-Type")) == JSON
        if self.path.split("?", 1)[0] != HTTP_PATH:
            self._discard_body()
            self._fail(404, f"no such endpoint {self.path[:100]!r}", json_body=json_body)
            return
        if not self.context.intake.authorized(self.headers.get("Authorization")):
            self._fail(401, "missing or wrong bearer token", json_body=json_body, close=True)
            return
        if not receiver.slots.acquire(blocking=False):
            self._fail(
                503, "too many requests in flight, retry later", json_body=json_body, close=True
            )
            return
        try:
            self._export(json_body=json_body)
        finally:
            receiver.slots.release()

    def _export(self, *, json_body: bool) -> None:
        context = self.context
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self._fail(411, "chunked bodies are not accepted", json_body=json_body, close=True)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._fail(411, "Content-Length required", json_body=json_body, close=True)
            return
        if length < 0:
            self._fail(400, "negative Content-Length", json_body=json_body, close=True)
            return
        if length > context.max_request_bytes:
            self._fail(
                413,
                f"body of {length} bytes exceeds {context.max_request_bytes}",
                json_body=json_body,
                close=True,
            )
            return
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            return  # the client went away mid-body
        try:
            request = decode_body(
                body,
                content_type=self.headers.get("Content-Type"),
                content_encoding=self.headers.get("Content-Encoding"),
                max_bytes=context.max_request_bytes,
            )
        except RequestError as exc:
            self._fail(exc.status, exc.message, json_body=json_body)
            return
        try:
            outcome = context.intake.ingest(request)
        except Exception:  # a bug must not take the receiver down: answer and keep serving
            _log.exception("bridge failed to ingest an OTLP/HTTP request")
            self._fail(500, "internal error", json_body=json_body)
            return
        if not outcome.accepted:
            self._fail(429, outcome.message, json_body=json_body)
            return
        self._respond_ok(outcome, json_body=json_body)

    def _respond_ok(self, outcome: Outcome, *, json_body: bool) -> None:
        body, content_type = self._encoded(outcome.response(), json_body=json_body)
        self.context.metrics.requests.labels(protocol="http", code="200").inc()
        self._send(200, body, content_type)

    def _discard_body(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if 0 < length <= self.context.max_request_bytes:
            self.rfile.read(length)
        elif length:
            self.close_connection = True
