"""The OTLP/gRPC receiver: ``MetricsService/Export`` over the shared :class:`Intake`.

Answers follow the OTLP specification (https://opentelemetry.io/docs/specs/otlp/#otlpgrpc):
OK with an ``ExportMetricsServiceResponse`` (``partial_success`` counting refused points);
INVALID_ARGUMENT for malformed protobuf (not retryable); UNAUTHENTICATED for a missing or wrong
bearer token; RESOURCE_EXHAUSTED (queue or spool full, new series too fast) or UNAVAILABLE
(the bridge cannot store now), both with a ``RetryInfo`` detail (retryable); UNIMPLEMENTED
for another method. The same answers from either server: the bridge's own
(``_h2_server``, the default) or grpcio's (imported only when that one starts).
"""

from __future__ import annotations

import logging
import os
from concurrent import futures
from typing import Any

from stepwatch.core._errors import ConfigError, ServerStartError
from stepwatch.otel_bridge._h2_frames import (
    INTERNAL,
    INVALID_ARGUMENT,
    OK,
    RESOURCE_EXHAUSTED,
    STATUS_NAMES,
    UNAUTHENTICATED,
    UNAVAILABLE,
    UNIMPLEMENTED,
    GrpcAnswer,
    GrpcCall,
)
from stepwatch.otel_bridge._h2_server import GrpcServer
from stepwatch.otel_bridge._intake import ReceiverContext
from stepwatch.otel_bridge._loop_server import tls_context

_log = logging.getLogger("stepwatch.otel_bridge")

GRPC_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
EXPORT_PATH = f"/{GRPC_SERVICE}/Export"


#: The servers that can speak OTLP/gRPC: the bridge's own (``_h2_server``), or grpcio's.
SERVERS = ("stepwatch", "grpcio")


class GrpcReceiver:
    """Serves OTLP/gRPC on one port once started.

    Args:
        context: the intake, metrics and limits both receivers share.
        workers: grpcio's handler threads (the bridge's own server hands a call to a worker
            only with a disk spool, up to ``max_concurrent_rpcs`` of them).
        max_concurrent_rpcs: calls admitted at once; beyond it RESOURCE_EXHAUSTED.
        tls: PEM ``(certificate, private key)`` bytes for grpcio; plaintext when None.
        tls_files: the same as files, for the bridge's own server.
        server: ``"stepwatch"`` (the default: ``_h2_server``, ~3x less CPU around a call,
            ``bench/receiver_cost.py``) or ``"grpcio"``.
        request_timeout_s, idle_timeout_s, max_connections: the bridge's own server's
            limits (as the HTTP receiver's).
    """

    def __init__(
        self,
        context: ReceiverContext,
        *,
        workers: int,
        max_concurrent_rpcs: int,
        tls: tuple[bytes, bytes] | None,
        tls_files: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
        server: str = "stepwatch",
        request_timeout_s: float = 30.0,
        idle_timeout_s: float = 120.0,
        max_connections: int = 4096,
    ) -> None:
        if workers <= 0:
            raise ConfigError(f"grpc_workers: must be positive, got {workers}")
        if max_concurrent_rpcs <= 0:
            raise ConfigError(
                f"grpc_max_concurrent_rpcs: must be positive, got {max_concurrent_rpcs}"
            )
        if server not in SERVERS:
            raise ConfigError(f"grpc_server: one of {', '.join(SERVERS)}, got {server!r}")
        if server == "stepwatch" and tls is not None and tls_files is None:
            raise ConfigError("tls_files: the bridge's own gRPC server reads TLS from files")
        self.context = context
        self.workers = workers
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.server_kind = server
        self.request_timeout_s = request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._tls = tls
        self._tls_files = tls_files
        self._server: Any = None
        self._counters: dict[int, Any] = {}  # code -> its requests{protocol="grpc"} child
        self._statuses: dict[tuple[int, str], bytes] = {}  # _retry_status's answers

    def start(self, address: str) -> int:
        """Listen on ``address`` (``host:port``, IPv6 hosts in brackets); the bound port.

        Raises:
            ServerStartError: the address cannot be bound.
            ConfigError: the TLS certificate or key cannot be loaded.
        """
        if self.server_kind == "grpcio":
            return self._start_grpcio(address)
        host, _, port = address.rpartition(":")
        tls = None if self._tls_files is None else tls_context(self._tls_files, alpn=["h2"])
        metrics = self.context.metrics
        server = GrpcServer(
            self._call,
            early=self._early,
            busy=self._busy,
            refused=self._count,
            protocol_error=lambda scope, code: metrics.grpc_protocol_errors.labels(
                scope=scope, code=code
            ).inc(),
            max_message_bytes=self.context.max_request_bytes,
            max_connections=self.max_connections,
            max_concurrent_requests=self.max_concurrent_rpcs,
            request_timeout_s=self.request_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            ssl_context=tls,
            reuse_port=self.context.reuse_port,
            # a memory spool never waits: handled on the loop; a disk spool's fsync'd group
            # commit is waited for in a worker, never on the loop
            inline=lambda: not self.context.intake.forwarder.spool.durable,
        )
        bound = server.start(host.strip("[]"), int(port))
        self._server = server
        metrics.connections.labels(protocol="grpc").set_function(lambda: server.connections)
        return bound

    def _start_grpcio(self, address: str) -> int:
        import grpc

        handler = grpc.method_handlers_generic_handler(
            GRPC_SERVICE,
            {
                # Raw bytes in and out: decoding ourselves lets malformed protobuf be answered
                # INVALID_ARGUMENT instead of grpc's generic INTERNAL.
                "Export": grpc.unary_unary_rpc_method_handler(self._grpcio_export),
            },
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.workers, thread_name_prefix="stepwatch-bridge-grpc"
            ),
            handlers=[handler],
            options=[
                ("grpc.max_receive_message_length", self.context.max_request_bytes),
                ("grpc.so_reuseport", 1 if self.context.reuse_port else 0),
            ],
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
        )
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
        self._server = server
        return int(bound)

    def stop(self, *, timeout_s: float) -> None:
        """Stop accepting; RPCs in flight get up to 2 s (within ``timeout_s``) to finish."""
        server, self._server = self._server, None
        if server is None:
            return
        if isinstance(server, GrpcServer):
            server.stop(timeout_s=timeout_s)
        else:
            server.stop(grace=min(timeout_s, 2.0)).wait(timeout_s)

    # ---- answers ----------------------------------------------------------------------------
    def _count(self, code: int) -> None:
        counter = self._counters.get(code)
        if counter is None:
            name = STATUS_NAMES.get(code, str(code))
            counter = self.context.metrics.requests.labels(protocol="grpc", code=name)
            self._counters[code] = counter
        counter.inc()

    def _early(self, path: str, metadata: dict[str, str]) -> GrpcAnswer | None:
        """Refuse an unknown method or a wrong token before the message is read."""
        if path != EXPORT_PATH:
            return self._counted(GrpcAnswer(UNIMPLEMENTED, f"no such method {path[:100]!r}"))
        if not self.context.intake.authorized(metadata.get("authorization")):
            return self._counted(GrpcAnswer(UNAUTHENTICATED, "missing or wrong bearer token"))
        return None

    def _busy(self) -> GrpcAnswer:
        message = "too many calls in flight, retry later"
        details = self._retry_status(RESOURCE_EXHAUSTED, message)
        return self._counted(GrpcAnswer(RESOURCE_EXHAUSTED, message, details=details))

    def _counted(self, answer: GrpcAnswer) -> GrpcAnswer:
        self._count(answer.code)
        return answer

    def _call(self, call: GrpcCall) -> GrpcAnswer:
        return self._counted(self._export(call.message))

    def _export(self, body: bytes) -> GrpcAnswer:
        """One Export call's answer (after the method and token are checked)."""
        intake = self.context.intake
        outcome = None
        try:  # the fast path takes the raw message; parsed only where it declines
            outcome = intake.ingest_body(body)
        except Exception:  # a bug must not take the receiver down: answer and keep serving
            _log.exception("bridge failed to ingest an OTLP/gRPC request")
            return GrpcAnswer(INTERNAL, "internal error")
        if outcome is None:
            from google.protobuf.message import DecodeError
            from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
                ExportMetricsServiceRequest,
            )

            request = ExportMetricsServiceRequest()
            try:
                request.ParseFromString(body)
            except (DecodeError, RuntimeError, ValueError) as exc:
                return GrpcAnswer(INVALID_ARGUMENT, f"invalid protobuf: {exc}")
            try:
                outcome = intake.ingest(request)
            except Exception:  # a bug must not take the receiver down: answer, keep serving
                _log.exception("bridge failed to ingest an OTLP/gRPC request")
                return GrpcAnswer(INTERNAL, "internal error")
        if not outcome.accepted:
            code = UNAVAILABLE if outcome.unavailable else RESOURCE_EXHAUSTED
            return GrpcAnswer(
                code, outcome.message, details=self._retry_status(code, outcome.message)
            )
        return GrpcAnswer(OK, body=outcome.response_bytes())

    def _grpcio_export(self, body: bytes, context: Any) -> bytes:
        """grpcio's handler: the same answers as the bridge's own server gives."""

        metadata = dict(context.invocation_metadata() or ())
        answer = self._early(EXPORT_PATH, metadata) or self._call(GrpcCall(EXPORT_PATH, {}, body))
        if answer.code == OK:
            return answer.body
        if answer.details:
            context.set_trailing_metadata((("grpc-status-details-bin", answer.details),))
        context.abort(_GRPCIO_CODES[answer.code], answer.message)
        raise RuntimeError("unreachable")  # pragma: no cover - abort raises

    def _retry_status(self, code: int, message: str) -> bytes:
        """A google.rpc.Status with RetryInfo: makes RESOURCE_EXHAUSTED retryable (OTLP).

        Refusals come in bursts with a handful of messages: each is built once.
        """
        key = (code, message)
        status = self._statuses.get(key)
        if status is None:
            if len(self._statuses) >= 64:
                self._statuses.clear()
            status = self._statuses[key] = self._build_status(code, message)
        return status

    def _build_status(self, code: int, message: str) -> bytes:
        from google.rpc import (  # type: ignore[import-untyped]
            error_details_pb2,
            status_pb2,
        )

        info = error_details_pb2.RetryInfo()
        info.retry_delay.seconds = self.context.retry_after_s
        status = status_pb2.Status(code=code, message=message)
        status.details.add().Pack(info)
        return bytes(status.SerializeToString())


class _GrpcioCodes(dict[int, Any]):
    """grpc.StatusCode by number, filled at the first use (grpcio imported only then)."""

    def __missing__(self, code: int) -> Any:
        import grpc

        self.update({status.value[0]: status for status in grpc.StatusCode})
        return self[code]


_GRPCIO_CODES = _GrpcioCodes()
