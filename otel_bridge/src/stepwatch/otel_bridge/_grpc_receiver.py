"""The OTLP/gRPC receiver: ``MetricsService/Export`` over the shared :class:`Intake`.

Answers follow the OTLP specification (https://opentelemetry.io/docs/specs/otlp/#otlpgrpc):
OK with an ``ExportMetricsServiceResponse`` (``partial_success`` counting refused points);
INVALID_ARGUMENT for malformed protobuf (not retryable); UNAUTHENTICATED for a missing or wrong
bearer token; RESOURCE_EXHAUSTED (queue or spool full, new series too fast) or UNAVAILABLE
(the bridge cannot store now), both with a ``RetryInfo`` detail (retryable). ``grpcio`` is
imported when the receiver starts, not at import.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Any

from stepwatch.core._errors import ConfigError, ServerStartError
from stepwatch.otel_bridge._intake import ReceiverContext

_log = logging.getLogger("stepwatch.otel_bridge")

GRPC_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"


class GrpcReceiver:
    """Serves OTLP/gRPC on one port once started.

    Args:
        context: the intake, metrics and limits both receivers share.
        workers: handler threads.
        max_concurrent_rpcs: RPCs admitted at once (running or waiting for a worker).
        tls: PEM ``(certificate, private key)`` bytes; plaintext when None.
    """

    def __init__(
        self,
        context: ReceiverContext,
        *,
        workers: int,
        max_concurrent_rpcs: int,
        tls: tuple[bytes, bytes] | None,
    ) -> None:
        if workers <= 0:
            raise ConfigError(f"grpc_workers: must be positive, got {workers}")
        if max_concurrent_rpcs <= 0:
            raise ConfigError(
                f"grpc_max_concurrent_rpcs: must be positive, got {max_concurrent_rpcs}"
            )
        self.context = context
        self.workers = workers
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self._tls = tls
        self._server: Any = None
        self._ok: Any = None  # requests{protocol="grpc", code="OK"}, looked up once
        self._grpc: Any = None  # the grpc module, imported at start
        self._statuses: dict[tuple[Any, str], bytes] = {}  # _retry_status's answers

    def start(self, address: str) -> int:
        """Listen on ``address`` (``host:port``, IPv6 hosts in brackets); the bound port.

        Raises:
            ServerStartError: the address cannot be bound.
        """
        import grpc

        self._grpc = grpc
        self._ok = self.context.metrics.requests.labels(protocol="grpc", code="OK")
        handler = grpc.method_handlers_generic_handler(
            GRPC_SERVICE,
            {
                # Raw bytes in and out: decoding ourselves lets malformed protobuf be answered
                # INVALID_ARGUMENT instead of grpc's generic INTERNAL.
                "Export": grpc.unary_unary_rpc_method_handler(self._export),
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
        if self._server is not None:
            self._server.stop(grace=min(timeout_s, 2.0)).wait(timeout_s)
            self._server = None

    def _export(self, body: bytes, context: Any) -> bytes:
        grpc, intake, metrics = self._grpc, self.context.intake, self.context.metrics

        def fail(code: Any, message: str) -> None:
            metrics.requests.labels(protocol="grpc", code=code.name).inc()
            context.abort(code, message)

        metadata = dict(context.invocation_metadata() or ())
        if not intake.authorized(metadata.get("authorization")):
            fail(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        outcome = None
        try:  # the fast path takes the raw message; parsed only where it declines
            outcome = intake.ingest_body(body)
        except Exception:  # a bug must not take the receiver down: answer and keep serving
            _log.exception("bridge failed to ingest an OTLP/gRPC request")
            fail(grpc.StatusCode.INTERNAL, "internal error")
        if outcome is None:
            from google.protobuf.message import DecodeError
            from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
                ExportMetricsServiceRequest,
            )

            request = ExportMetricsServiceRequest()
            try:
                request.ParseFromString(body)
            except (DecodeError, RuntimeError, ValueError) as exc:
                fail(grpc.StatusCode.INVALID_ARGUMENT, f"invalid protobuf: {exc}")
            try:
                outcome = intake.ingest(request)
            except Exception:  # a bug must not take the receiver down: answer, keep serving
                _log.exception("bridge failed to ingest an OTLP/gRPC request")
                fail(grpc.StatusCode.INTERNAL, "internal error")
        if outcome is None:  # pragma: no cover - fail() raises (context.abort)
            raise RuntimeError("no outcome")
        if not outcome.accepted:
            code = (
                grpc.StatusCode.UNAVAILABLE
                if outcome.unavailable
                else grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            context.set_trailing_metadata(
                (("grpc-status-details-bin", self._retry_status(code, outcome.message)),)
            )
            fail(code, outcome.message)
        self._ok.inc()
        return outcome.response_bytes()

    def _retry_status(self, code: Any, message: str) -> bytes:
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

    def _build_status(self, code: Any, message: str) -> bytes:
        from google.rpc import (  # type: ignore[import-untyped]
            error_details_pb2,
            status_pb2,
        )

        info = error_details_pb2.RetryInfo()
        info.retry_delay.seconds = self.context.retry_after_s
        status = status_pb2.Status(code=code.value[0], message=message)
        status.details.add().Pack(info)
        return bytes(status.SerializeToString())
