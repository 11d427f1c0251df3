"""The bridge: OTLP/gRPC and OTLP/HTTP receivers feeding the forwarder.

Answers follow the OTLP specification (https://opentelemetry.io/docs/specs/otlp/):
success is 200 / OK with an ``ExportMetricsServiceResponse`` whose ``partial_success``
counts the rejected data points; malformed input is 400 / INVALID_ARGUMENT (not retryable);
a full queue is 429 + ``Retry-After`` / RESOURCE_EXHAUSTED with ``RetryInfo`` (retryable).
Every bad request is answered and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError, ServerStartError
from stepwatch.otel_bridge._cardinality import CardinalityGuard
from stepwatch.otel_bridge._convert import MAX_DURATION_S, TAG_ALLOWLIST, convert_to_points
from stepwatch.otel_bridge._decode import JSON, RequestError, decode_body, media_type
from stepwatch.otel_bridge._forwarder import Forwarder
from stepwatch.otel_bridge._identity import RankIdentityGuard, Verdict
from stepwatch.otel_bridge._metrics import BridgeMetrics
from stepwatch.otel_bridge._reasons import REASON_CARDINALITY, REASON_DUPLICATE_RANK
from stepwatch.otel_bridge._spool import DiskSpool, MemorySpool, OverflowPolicy, Spool
from stepwatch.otel_bridge._writers import LineWriter

if TYPE_CHECKING:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

_log = logging.getLogger("stepwatch.otel_bridge")

_GRPC_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_HTTP_PATH = "/v1/metrics"
# google.rpc.Code values (https://github.com/googleapis/googleapis/blob/master/google/rpc/code.proto)
_CODE_INVALID_ARGUMENT = 3
_CODE_RESOURCE_EXHAUSTED = 8
_CODE_UNAUTHENTICATED = 16


class Outcome(NamedTuple):
    """What ingesting one request did."""

    accepted: bool  # False: over capacity, retry later
    rejected_points: int
    message: str


def _read_secret(path: str | os.PathLike[str], argument: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{argument}: cannot read {path}: {exc}") from exc


class Bridge:
    """An in-process OTLP → InfluxDB bridge (gRPC and HTTP receivers, forwarder, /metrics).

    Args:
        writer: where batches go (:class:`InfluxV1Writer`, :class:`InfluxV2Writer`).
        host: interface to listen on; loopback by default.
        grpc_port: OTLP/gRPC port (0: a free one; None: no gRPC receiver).
        http_port: OTLP/HTTP port, also serving ``/metrics`` and ``/healthz`` (0: a free one).
        registry: prometheus ``CollectorRegistry`` for the bridge's metrics (fresh when None).
        tag_allowlist: attribute keys stored as tags.
        spool_dir: directory of the disk spool; in memory when None.
        spool_max_bytes: bound on the spool.
        spool_overflow: ``drop_oldest`` or ``drop_newest`` when the spool is full.
        max_queue_lines: in-memory queue bound; beyond it requests get 429/RESOURCE_EXHAUSTED.
        batch_max_lines: points per InfluxDB write.
        flush_interval_s: longest a point waits for its batch.
        max_retries: quick retries before a batch is spooled.
        retry_backoff_s: first retry delay (doubles, up to ``max_backoff_s`` for replay).
        max_backoff_s: longest delay between spool replay attempts.
        max_request_bytes: largest request body (after decompression); larger is 413.
        max_series_per_measurement: cardinality guard per (job, measurement); None disables.
        max_series_per_rank: cardinality guard per (job, measurement, rank): one producer
            flooding new tag values is stopped here long before the per-measurement cap.
        auth_token: when set, both receivers require ``Authorization: Bearer <token>``.
        tls_cert_file: PEM certificate; with ``tls_key_file`` both receivers use TLS.
        tls_key_file: PEM private key.
        reuse_port: set SO_REUSEPORT so several bridge processes can share the ports.
        grpc_workers: gRPC handler threads.
        grpc_max_concurrent_rpcs: RPCs admitted at once (running or waiting for a worker);
            beyond it gRPC itself answers RESOURCE_EXHAUSTED *without* RetryInfo, which
            OTLP clients do not retry, so keep it above the number of concurrent exporters.
        max_concurrent_requests: OTLP/HTTP requests processed at once; beyond it 503 +
            ``Retry-After`` (with the queue bound this bounds the bridge's memory).
        retry_after_s: the ``Retry-After`` / RetryInfo delay under backpressure.
        max_future_skew_s: points stamped further than this ahead of the receive time are
            rejected (``clock_skew``); None accepts any future time.
        max_past_skew_s: points stamped further than this behind the receive time are
            rejected (``clock_skew``); None (the default: backfills and replays are
            legitimate) accepts any past time. Production sites set e.g. 7 days.
        max_duration_s: duration histograms whose max or mean exceed this are rejected
            (``implausible_duration``); None disables the check.
        duplicate_rank_takeover_s: a second producer of a live (job, rank) is rejected
            (``duplicate_rank``) until the first has been silent this long; None disables the
            duplicate-rank guard (see :class:`RankIdentityGuard`).
        clock_unix_nano: the receive-time clock (injected in tests).
    """

    def __init__(
        self,
        writer: LineWriter,
        *,
        host: str = "127.0.0.1",
        grpc_port: int | None = 0,
        http_port: int | None = 0,
        registry: Any = None,
        tag_allowlist: frozenset[str] = TAG_ALLOWLIST,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        spool_overflow: OverflowPolicy = "drop_oldest",
        max_queue_lines: int = 200_000,
        batch_max_lines: int = 5_000,
        flush_interval_s: float = 0.2,
        max_retries: int = 2,
        retry_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        max_request_bytes: int = 16 * 1024 * 1024,
        max_series_per_measurement: int | None = 2_000_000,
        max_series_per_rank: int = 1024,
        auth_token: str | None = None,
        tls_cert_file: str | os.PathLike[str] | None = None,
        tls_key_file: str | os.PathLike[str] | None = None,
        reuse_port: bool = False,
        grpc_workers: int = 8,
        grpc_max_concurrent_rpcs: int = 256,
        max_concurrent_requests: int = 64,
        retry_after_s: int = 1,
        max_future_skew_s: float | None = 600.0,
        max_past_skew_s: float | None = None,
        max_duration_s: float | None = MAX_DURATION_S,
        duplicate_rank_takeover_s: float | None = 30.0,
        clock_unix_nano: Callable[[], int] = time.time_ns,
    ) -> None:
        for name, port in (("grpc_port", grpc_port), ("http_port", http_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{name}: {port} is not a TCP port")
        if http_port is None and grpc_port is None:
            raise ConfigError("grpc_port, http_port: at least one receiver is needed")
        if max_request_bytes <= 0:
            raise ConfigError(f"max_request_bytes: must be positive, got {max_request_bytes}")
        if grpc_workers <= 0:
            raise ConfigError(f"grpc_workers: must be positive, got {grpc_workers}")
        if grpc_max_concurrent_rpcs <= 0:
            raise ConfigError(
                f"grpc_max_concurrent_rpcs: must be positive, got {grpc_max_concurrent_rpcs}"
            )
        if max_concurrent_requests <= 0:
            raise ConfigError(
                f"max_concurrent_requests: must be positive, got {max_concurrent_requests}"
            )
        if retry_after_s <= 0:
            raise ConfigError(f"retry_after_s: must be positive, got {retry_after_s}")
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ConfigError("tls_cert_file, tls_key_file: give both or neither")
        if auth_token is not None and not auth_token.strip():
            raise ConfigError("auth_token: must not be empty")
        for name, bound in (
            ("max_future_skew_s", max_future_skew_s),
            ("max_past_skew_s", max_past_skew_s),
            ("max_duration_s", max_duration_s),
        ):
            if bound is not None and not bound > 0:
                raise ConfigError(f"{name}: must be positive or None, got {bound}")
        self.max_future_skew_s = max_future_skew_s
        self.max_past_skew_s = max_past_skew_s
        self.max_duration_s = max_duration_s
        self.clock_unix_nano = clock_unix_nano
        self.identity = (
            None
            if duplicate_rank_takeover_s is None
            else RankIdentityGuard(takeover_after_s=duplicate_rank_takeover_s)
        )
        self._logged_conflicts: set[tuple[str, str]] = set()
        self.host = host
        self.metrics = BridgeMetrics(registry)
        self.tag_allowlist = frozenset(tag_allowlist)
        self.max_request_bytes = max_request_bytes
        self.retry_after_s = retry_after_s
        self.reuse_port = reuse_port
        self.grpc_workers = grpc_workers
        self.grpc_max_concurrent_rpcs = grpc_max_concurrent_rpcs
        self.http_slots = threading.BoundedSemaphore(max_concurrent_requests)
        self._requested_grpc_port = grpc_port
        self._requested_http_port = http_port
        self._auth = None if auth_token is None else f"Bearer {auth_token.strip()}".encode()
        self._tls: tuple[bytes, bytes] | None = None
        self._tls_files = (tls_cert_file, tls_key_file)
        if tls_cert_file is not None and tls_key_file is not None:
            self._tls = (
                _read_secret(tls_cert_file, "tls_cert_file"),
                _read_secret(tls_key_file, "tls_key_file"),
            )
        if spool_dir is None:  # a writer may carry the site's spool directory
            spool_dir = getattr(writer, "spool_dir", None)
        spool: Spool
        if spool_dir is None:
            spool = MemorySpool(max_bytes=spool_max_bytes, overflow=spool_overflow)
        else:
            spool = DiskSpool(spool_dir, max_bytes=spool_max_bytes, overflow=spool_overflow)
        self.forwarder = Forwarder(
            writer,
            spool=spool,
            metrics=self.metrics,
            max_queue_lines=max_queue_lines,
            batch_max_lines=batch_max_lines,
            flush_interval_s=flush_interval_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            max_backoff_s=max_backoff_s,
        )
        self.guard = (
            None
            if max_series_per_measurement is None
            else CardinalityGuard(
                max_series=max_series_per_measurement, max_series_per_rank=max_series_per_rank
            )
        )
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc_server: Any = None
        self._http_server: _HTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    def __repr__(self) -> str:  # never show the token
        return f"Bridge(host={self.host!r}, grpc_port={self.grpc_port}, http_port={self.http_port})"

    @property
    def scheme(self) -> str:
        return "https" if self._tls else "http"

    @property
    def metrics_url(self) -> str:
        return f"{self.scheme}://{self._url_host}:{self.http_port}/metrics"

    @property
    def http_url(self) -> str:
        """The OTLP/HTTP metrics endpoint."""
        return f"{self.scheme}://{self._url_host}:{self.http_port}{_HTTP_PATH}"

    @property
    def grpc_endpoint(self) -> str:
        return f"{self._url_host}:{self.grpc_port}"

    @property
    def _url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Bridge:
        """Bind the ports and start serving; returns self."""
        self.forwarder.start()
        try:
            if self._requested_http_port is not None:
                self._start_http(self._requested_http_port)
            if self._requested_grpc_port is not None:
                self._start_grpc(self._requested_grpc_port)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop accepting, flush the queue (to InfluxDB or the spool), release the ports."""
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=min(timeout_s, 2.0)).wait(timeout_s)
            self._grpc_server = None
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.close_connections()
            self._http_server.server_close()
            self._http_server = None
        if self._http_thread is not None:
            self._http_thread.join(timeout_s)
            self._http_thread = None
        self.forwarder.stop(timeout_s=timeout_s)
        spool = self.forwarder.spool
        if isinstance(spool, MemorySpool) and spool.batches:
            lost = spool.lines
            _log.warning("bridge stopped with %d points in its memory spool: lost", lost)
            self.metrics.dropped.labels(reason="shutdown").inc(lost)
            while (head := spool.peek()) is not None:
                spool.remove(head[0])

    def __enter__(self) -> Bridge:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _start_http(self, port: int) -> None:
        try:
            server = _HTTPServer((self.host, port), _Handler, bridge=self)
        except OSError as exc:
            raise ServerStartError(
                f"bridge HTTP cannot listen on {self.host}:{port}: {exc}"
            ) from exc
        if self._tls_files[0] is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                context.load_cert_chain(str(self._tls_files[0]), str(self._tls_files[1]))
            except (OSError, ssl.SSLError) as exc:
                server.server_close()
                raise ConfigError(f"tls_cert_file, tls_key_file: {exc}") from exc
            server.socket = context.wrap_socket(server.socket, server_side=True)
        self._http_server = server
        self.http_port = int(server.server_address[1])
        self._http_thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="stepwatch-bridge-http",
            daemon=True,
        )
        self._http_thread.start()

    def _start_grpc(self, port: int) -> None:
        import grpc

        handler = grpc.method_handlers_generic_handler(
            _GRPC_SERVICE,
            {
                # Raw bytes in and out: decoding ourselves lets malformed protobuf be answered
                # INVALID_ARGUMENT instead of grpc's generic INTERNAL.
                "Export": grpc.unary_unary_rpc_method_handler(self._grpc_export),
            },
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.grpc_workers, thread_name_prefix="stepwatch-bridge-grpc"
            ),
            handlers=[handler],
            options=[
                ("grpc.max_receive_message_length", self.max_request_bytes),
                ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            ],
            maximum_concurrent_rpcs=self.grpc_max_concurrent_rpcs,
        )
        address = f"{self._url_host}:{port}"
        try:
            if self._tls is not None:
                credentials = grpc.ssl_server_credentials([(self._tls[1], self._tls[0])])
                bound = server.add_secure_port(address, credentials)
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ServerStartError(f"bridge gRPC cannot listen on {address}: {exc}") from exc
        if not bound:
            raise ServerStartError(f"bridge gRPC cannot listen on {address}")
        server.start()
        self._grpc_server = server
        self.grpc_port = int(bound)

    # -- the shared ingest path --------------------------------------------------------------
    def authorized(self, header: str | bytes | None) -> bool:
        if self._auth is None:
            return True
        if header is None:
            return False
        value = header.encode("latin-1", "replace") if isinstance(header, str) else header
        return hmac.compare_digest(value.strip(), self._auth)

    def ingest(self, request: ExportMetricsServiceRequest) -> Outcome:
        """Convert, guard and queue one request (called by both receivers)."""
        if self.forwarder.full:  # refuse before spending CPU on a request we cannot queue
            return Outcome(False, 0, "bridge queue full, retry later")
        now_unix_nano = self.clock_unix_nano()
        batch = convert_to_points(
            request,
            tag_allowlist=self.tag_allowlist,
            max_duration_s=self.max_duration_s,
            time_bounds_unix_nano=self._time_bounds(now_unix_nano),
            resource_check=None if self.identity is None else self._identity_check(now_unix_nano),
        )
        points = batch.points
        rejected = batch.rejected
        if self.guard is not None and points:
            points, refused = self.guard.filter(points)
            if refused:
                rejected[REASON_CARDINALITY] += refused
        lines = [point.encode() for point in points]
        if not self.forwarder.offer(lines):
            return Outcome(False, 0, "bridge queue full, retry later")
        total_rejected = sum(rejected.values())
        self.metrics.received.inc(len(lines) + total_rejected)
        for reason, count in rejected.items():
            self.metrics.rejected.labels(reason=reason).inc(count)
        if batch.dropped_attributes:
            self.metrics.attributes_dropped.inc(batch.dropped_attributes)
        message = ""
        if total_rejected:
            message = "rejected data points: " + ", ".join(
                f"{reason}={count}" for reason, count in sorted(rejected.items())
            )
        return Outcome(True, total_rejected, message)

    def _time_bounds(self, now_unix_nano: int) -> tuple[int, int] | None:
        """The accepted ``time_unix_nano`` range around the receive time (clock skew)."""
        if self.max_future_skew_s is None and self.max_past_skew_s is None:
            return None
        earliest = (
            0 if self.max_past_skew_s is None else now_unix_nano - int(self.max_past_skew_s * 1e9)
        )
        latest = (
            2**64
            if self.max_future_skew_s is None
            else now_unix_nano + int(self.max_future_skew_s * 1e9)
        )
        return earliest, latest

    def _identity_check(self, now_unix_nano: int) -> Callable[[Mapping[str, str]], str | None]:
        guard = self.identity
        if guard is None:  # pragma: no cover - only called with a guard
            raise RuntimeError("no duplicate-rank guard")

        def check(attributes: Mapping[str, str]) -> str | None:
            verdict = guard.observe(attributes, now_unix_nano=now_unix_nano)
            if verdict is Verdict.TAKEOVER:
                self.metrics.rank_conflicts.labels(outcome="taken_over").inc()
                return None
            if verdict is not Verdict.CONFLICT:
                return None
            self.metrics.rank_conflicts.labels(outcome="rejected").inc()
            key = (attributes.get(_schema.JOB_ID, ""), attributes.get(_schema.RANK, ""))
            if key not in self._logged_conflicts:  # once per (job, rank): exporters repeat
                if len(self._logged_conflicts) >= 4096:
                    self._logged_conflicts.clear()
                self._logged_conflicts.add(key)
                _log.warning(
                    "duplicate rank: job %s rank %s claimed by %s while %s is live; rejected",
                    key[0],
                    key[1],
                    "/".join(attributes.get(name, "") for name in guard.identity_keys).rstrip("/"),
                    "/".join(guard.owner(*key) or ()).rstrip("/"),
                )
            return REASON_DUPLICATE_RANK

        return check

    def _grpc_export(self, body: bytes, context: Any) -> bytes:
        import grpc
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
        )

        def fail(code: Any, message: str) -> None:
            self.metrics.requests.labels(protocol="grpc", code=code.name).inc()
            context.abort(code, message)

        metadata = dict(context.invocation_metadata() or ())
        if not self.authorized(metadata.get("authorization")):
            fail(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        request = ExportMetricsServiceRequest()
        try:
            request.ParseFromString(body)
        except (DecodeError, RuntimeError, ValueError) as exc:
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"invalid protobuf: {exc}")
        try:
            outcome = self.ingest(request)
        except Exception:  # a bug must not take the receiver down: answer and keep serving
            _log.exception("bridge failed to ingest an OTLP/gRPC request")
            fail(grpc.StatusCode.INTERNAL, "internal error")
        if not outcome.accepted:
            context.set_trailing_metadata(
                (("grpc-status-details-bin", self._retry_status(outcome.message)),)
            )
            fail(grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.message)
        response = ExportMetricsServiceResponse()
        if outcome.rejected_points:
            response.partial_success.rejected_data_points = outcome.rejected_points
            response.partial_success.error_message = outcome.message
        self.metrics.requests.labels(protocol="grpc", code="OK").inc()
        return bytes(response.SerializeToString())

    def _retry_status(self, message: str) -> bytes:
        """A google.rpc.Status with RetryInfo: makes RESOURCE_EXHAUSTED retryable (OTLP)."""
        from google.rpc import (  # type: ignore[import-untyped]
            error_details_pb2,
            status_pb2,
        )

        info = error_details_pb2.RetryInfo()
        info.retry_delay.seconds = self.retry_after_s
        status = status_pb2.Status(code=_CODE_RESOURCE_EXHAUSTED, message=message)
        status.details.add().Pack(info)
        return bytes(status.SerializeToString())


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: Callable[..., http.server.BaseHTTPRequestHandler],
        *,
        bridge: Bridge,
    ) -> None:
        self.bridge = bridge
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
        if self.bridge.reuse_port and hasattr(socket, "SO_REUSEPORT"):
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
        bridge = self.server.bridge
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, content_type = bridge.metrics.exposition()
            self._send(200, body, content_type)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _status_body(self, code: int, message: str, *, json_body: bool) -> tuple[bytes, str]:
        from google.protobuf import json_format
        from google.rpc import status_pb2  # type: ignore[import-untyped]

        status = status_pb2.Status(code=code, message=message)
        if json_body:
            return json_format.MessageToJson(status, indent=None).encode(), JSON
        return bytes(status.SerializeToString()), "application/x-protobuf"

    def _fail(self, status: int, message: str, *, json_body: bool, close: bool = False) -> None:
        bridge = self.server.bridge
        bridge.metrics.requests.labels(protocol="http", code=str(status)).inc()
        rpc_code = {
            401: _CODE_UNAUTHENTICATED,
            429: _CODE_RESOURCE_EXHAUSTED,
            503: _CODE_RESOURCE_EXHAUSTED,
        }.get(status, _CODE_INVALID_ARGUMENT)
        body, content_type = self._status_body(rpc_code, message, json_body=json_body)
        headers: dict[str, str] = {}
        if status in (429, 503):
            headers["Retry-After"] = str(bridge.retry_after_s)
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="stepwatch"'
        if close:
            headers["Connection"] = "close"
            self.close_connection = True
        self._send(status, body, content_type, headers)

    def do_POST(self) -> None:
        bridge = self.server.bridge
        json_body = media_type(self.headers.get("Content-Type")) == JSON
        if self.path.split("?", 1)[0] != _HTTP_PATH:
            self._discard_body()
            self._fail(404, f"no such endpoint {self.path[:100]!r}", json_body=json_body)
            return
        if not bridge.authorized(self.headers.get("Authorization")):
            self._fail(401, "missing or wrong bearer token", json_body=json_body, close=True)
            return
        if not bridge.http_slots.acquire(blocking=False):
            self._fail(
                503, "too many requests in flight, retry later", json_body=json_body, close=True
            )
            return
        try:
            self._export(json_body=json_body)
        finally:
            bridge.http_slots.release()

    def _export(self, *, json_body: bool) -> None:
        bridge = self.server.bridge
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
        if length > bridge.max_request_bytes:
            self._fail(
                413,
                f"body of {length} bytes exceeds {bridge.max_request_bytes}",
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
                max_bytes=bridge.max_request_bytes,
            )
        except RequestError as exc:
            self._fail(exc.status, exc.message, json_body=json_body)
            return
        try:
            outcome = bridge.ingest(request)
        except Exception:  # a bug must not take the receiver down: answer and keep serving
            _log.exception("bridge failed to ingest an OTLP/HTTP request")
            self._fail(500, "internal error", json_body=json_body)
            return
        if not outcome.accepted:
            self._fail(429, outcome.message, json_body=json_body)
            return
        self._respond_ok(outcome, json_body=json_body)

    def _respond_ok(self, outcome: Outcome, *, json_body: bool) -> None:
        from google.protobuf import json_format
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceResponse,
        )

        response = ExportMetricsServiceResponse()
        if outcome.rejected_points:
            response.partial_success.rejected_data_points = outcome.rejected_points
            response.partial_success.error_message = outcome.message
        if json_body:
            body = json_format.MessageToJson(response, indent=None).encode()
            content_type = JSON
        else:
            body = bytes(response.SerializeToString())
            content_type = "application/x-protobuf"
        self.server.bridge.metrics.requests.labels(protocol="http", code="200").inc()
        self._send(200, body, content_type)

    def _discard_body(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if 0 < length <= self.server.bridge.max_request_bytes:
            self.rfile.read(length)
        elif length:
            self.close_connection = True
