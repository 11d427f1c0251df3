"""The OTLP/HTTP receiver: ``POST /v1/metrics``, plus ``GET /metrics`` and ``GET /healthz``.

Answers follow the OTLP specification (https://opentelemetry.io/docs/specs/otlp/#otlphttp):
200 with an ``ExportMetricsServiceResponse`` in the request's encoding (``partial_success``
counting refused points); 400 malformed body, 401 missing or wrong bearer token, 404 unknown
path, 408 request not complete within ``request_timeout_s``, 413 body too large (also after
decompression; a ``Content-Length`` or chunked body alike), 415 unknown content type or
encoding (not retryable); 429 queue or spool full, new series too fast, and 503 bridge unable
to store or too many requests in flight, both with ``Retry-After`` (retryable). Error bodies are a
``google.rpc.Status``. Every bad request is answered and the server keeps serving.

The wire is llhttp's and connections, deadlines and request slots are
:class:`~._http_server.AsyncHttpServer`'s: a request takes a slot only once its body is read,
so slow clients cannot starve fast ones.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge._decode import (
    JSON,
    PROTOBUF,
    RequestError,
    decode_body,
    decompressed_body,
    media_type,
    parse_protobuf,
)
from stepwatch.otel_bridge._http_server import (
    AsyncHttpServer,
    Headers,
    HttpRequest,
    HttpResponse,
)
from stepwatch.otel_bridge._intake import Outcome, ReceiverContext
from stepwatch.otel_bridge._loop_server import tls_context

_log = logging.getLogger("stepwatch.otel_bridge")

HTTP_PATH = "/v1/metrics"
# google.rpc.Code (https://github.com/googleapis/googleapis/blob/master/google/rpc/code.proto)
_CODE_INVALID_ARGUMENT = 3
_CODE_RESOURCE_EXHAUSTED = 8
_CODE_UNAVAILABLE = 14
_CODE_UNAUTHENTICATED = 16
_TEXT = "text/plain; charset=utf-8"
_RPC_CODES = {
    401: _CODE_UNAUTHENTICATED,
    429: _CODE_RESOURCE_EXHAUSTED,
    503: _CODE_UNAVAILABLE,
}


class HttpReceiver:
    """Serves OTLP/HTTP, the bridge's ``/metrics`` and ``/healthz`` on one port once started.

    Args:
        context: the intake, metrics and limits both receivers share.
        max_concurrent_requests: exports processed at once; beyond it 503 + ``Retry-After``.
        max_connections: connections open at once.
        request_timeout_s: deadline for a request's headers and body together.
        idle_timeout_s: how long an idle keep-alive connection is kept.
        max_header_bytes: request line and header fields together (431 beyond).
        tls_files: PEM ``(certificate file, private key file)``; plaintext when None.
    """

    def __init__(
        self,
        context: ReceiverContext,
        *,
        max_concurrent_requests: int,
        max_connections: int = 4096,
        request_timeout_s: float = 30.0,
        idle_timeout_s: float = 120.0,
        max_header_bytes: int = 16 * 1024,
        tls_files: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None,
    ) -> None:
        for name, value in (
            ("max_concurrent_requests", max_concurrent_requests),
            ("max_connections", max_connections),
            ("request_timeout_s", request_timeout_s),
            ("idle_timeout_s", idle_timeout_s),
            ("max_header_bytes", max_header_bytes),
        ):
            if not value > 0:
                raise ConfigError(f"{name}: must be positive, got {value}")
        self.context = context
        self.max_concurrent_requests = max_concurrent_requests
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_header_bytes = max_header_bytes
        self._tls_files = tls_files
        self._counters: dict[int, Any] = {}  # status -> its requests{protocol="http"} child
        self._server: AsyncHttpServer | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` and serve from a thread; the bound port.

        Raises:
            ServerStartError: the address cannot be bound.
            ConfigError: the TLS certificate or key cannot be loaded.
        """
        tls = None if self._tls_files is None else tls_context(self._tls_files)
        server = AsyncHttpServer(
            self._handle,
            early=self._early,
            busy=self._busy,
            max_connections=self.max_connections,
            max_concurrent_requests=self.max_concurrent_requests,
            request_timeout_s=self.request_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            max_header_bytes=self.max_header_bytes,
            ssl_context=tls,
            reuse_port=self.context.reuse_port,
            # a memory spool never waits: handled on the loop; a disk spool's fsync'd group
            # commit is waited for in a worker, never on the loop
            inline=lambda: not self.context.intake.forwarder.spool.durable,
        )
        bound = server.start(host, port)
        self._server = server
        self.context.metrics.connections.labels(protocol="http").set_function(
            lambda: server.connections
        )
        return bound

    def stop(self, *, timeout_s: float) -> None:
        """Stop accepting, close open connections, let handlers finish."""
        if self._server is not None:
            self._server.stop(timeout_s=timeout_s)
            self._server = None

    # ---- answers ------------------------------------------------------------------------
    def _count(self, status: int) -> None:
        counter = self._counters.get(status)
        if counter is None:  # a labelled child per status, looked up once (~3 us a request)
            counter = self.context.metrics.requests.labels(protocol="http", code=str(status))
            self._counters[status] = counter
        counter.inc()

    def _fail(
        self, status: int, message: str, *, json_body: bool, close: bool = False
    ) -> HttpResponse:
        """A ``google.rpc.Status`` answer in the request's encoding."""
        from google.rpc import status_pb2  # type: ignore[import-untyped]

        self._count(status)
        body, content_type = _encoded(
            status_pb2.Status(code=_RPC_CODES.get(status, _CODE_INVALID_ARGUMENT), message=message),
            json_body=json_body,
        )
        headers = {"Content-Type": content_type}
        if status in (429, 503):
            headers["Retry-After"] = str(self.context.retry_after_s)
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="stepwatch"'
        return HttpResponse(status, headers, body, close)

    def _early(self, method: str, path: str, headers: Headers) -> HttpResponse | int:
        """Refuse what can be refused before the body is read; else the largest body to read."""
        path = path.split("?", 1)[0]
        json_body = media_type(headers.get("Content-Type")) == JSON
        if method in ("GET", "HEAD"):
            return 0 if path in ("/metrics", "/healthz") else _text(404, "not found")
        if path != HTTP_PATH:
            return self._fail(404, f"no such endpoint {path[:100]!r}", json_body=json_body)
        if not self.context.intake.authorized(headers.get("Authorization")):
            return self._fail(401, "missing or wrong bearer token", json_body=json_body)
        limit = self.context.max_request_bytes
        length = headers.get("Content-Length")  # llhttp has checked it is a number, or absent
        if length is not None and int(length) > limit:
            return self._fail(413, f"body of {length} bytes exceeds {limit}", json_body=json_body)
        return limit  # a chunked body is counted as it arrives (413 once past the limit)

    def _busy(self, request: HttpRequest) -> HttpResponse:
        json_body = media_type(request.headers.get("Content-Type")) == JSON
        return self._fail(503, "too many requests in flight, retry later", json_body=json_body)

    def _handle(self, request: HttpRequest) -> HttpResponse:
        path = request.path.split("?", 1)[0]
        if request.method in ("GET", "HEAD"):
            if path == "/metrics":
                body, content_type = self.context.metrics.exposition()
                return HttpResponse(200, {"Content-Type": content_type}, body)
            health = self.context.intake.forwarder.health()
            return _text(200 if health.ok else 503, health.message, close=False)
        return self._export(request)

    def _export(self, request: HttpRequest) -> HttpResponse:
        content_type = request.headers.get("Content-Type")
        json_body = media_type(content_type) == JSON
        intake = self.context.intake
        # binary protobuf: the body goes to the fast path unparsed, parsed only if it declines
        fast = intake.fast_path and media_type(content_type) == PROTOBUF
        outcome: Outcome | None = None
        try:
            if fast:
                body = decompressed_body(
                    request.body,
                    content_type=content_type,
                    content_encoding=request.headers.get("Content-Encoding"),
                    max_bytes=self.context.max_request_bytes,
                )
                outcome = _ingest_or_fail(intake.ingest_body, body)
                message = parse_protobuf(body) if outcome is None else None
            else:
                message = decode_body(
                    request.body,
                    content_type=content_type,
                    content_encoding=request.headers.get("Content-Encoding"),
                    max_bytes=self.context.max_request_bytes,
                )
            if message is not None:
                outcome = _ingest_or_fail(intake.ingest, message)
        except RequestError as exc:
            return self._fail(exc.status, exc.message, json_body=json_body)
        except _IngestFailed:
            return self._fail(500, "internal error", json_body=json_body)
        if outcome is None:  # pragma: no cover - ingest() always answers
            raise RuntimeError("no outcome")
        if not outcome.accepted:
            status = 503 if outcome.unavailable else 429
            return self._fail(status, outcome.message, json_body=json_body)
        if json_body:
            body, content_type = _encoded(outcome.response(), json_body=True)
        else:
            body, content_type = outcome.response_bytes(), PROTOBUF
        self._count(200)
        return HttpResponse(200, {"Content-Type": content_type}, body)


_T = TypeVar("_T")


class _IngestFailed(Exception):
    """Ingesting a request raised: logged, answered 500."""


def _ingest_or_fail(call: Callable[[_T], Outcome | None], argument: _T) -> Outcome | None:
    try:
        return call(argument)
    except Exception as exc:  # a bug must not take the receiver down: answer and keep serving
        _log.exception("bridge failed to ingest an OTLP/HTTP request")
        raise _IngestFailed from exc


def _encoded(message: Any, *, json_body: bool) -> tuple[bytes, str]:
    """A protobuf message in the request's encoding, and its content type."""
    from google.protobuf import json_format

    if json_body:
        return json_format.MessageToJson(message, indent=None).encode(), JSON
    return bytes(message.SerializeToString()), PROTOBUF


def _text(status: int, message: str, *, close: bool = True) -> HttpResponse:
    return HttpResponse(status, {"Content-Type": _TEXT}, (message + "\n").encode(), close)
