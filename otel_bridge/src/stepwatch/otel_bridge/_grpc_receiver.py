"""The OTLP/gRPC receiver: ``MetricsService/Export`` on gRPC's asyncio server (``grpc.aio``).

Answers follow the OTLP specification (https://opentelemetry.io/docs/specs/otlp/#otlpgrpc):
OK with an ``ExportMetricsServiceResponse`` (``partial_success`` counting refused points);
INVALID_ARGUMENT for malformed protobuf (not retryable); UNAUTHENTICATED for a missing or wrong
bearer token; RESOURCE_EXHAUSTED (queue or spool full, new series too fast, too many calls in
flight) or UNAVAILABLE (the bridge cannot store now), both with a ``RetryInfo`` detail
(retryable); DEADLINE_EXCEEDED for a message not received within ``request_timeout_s``;
UNIMPLEMENTED for another method.

HTTP/2, HPACK, flow control and the gRPC framing are gRPC's C core, configured for a hostile
network (:func:`server_options`; docs/deployment.md, "What the bridge defends against"):
the stream limit is advertised and a stream counts against it until it is freed (an answer
waiting for the client's flow-control window keeps its slot), header lists are bounded while
they are decoded, idle and ping-only connections are closed, a connection lives at most
``max_connection_age_s`` (then GOAWAY and a grace to finish its calls, after which whatever it
still holds, answers the client never let through included, is dropped), and at most
``max_connections`` are open at once.

Each call is read by the handler itself (registered as a client-streaming method, which is
the same on the wire as a unary one), so the bridge puts its own deadline on the message:
gRPC's unary handlers are called only once the message is complete, with no deadline unless
the client sent one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from concurrent import futures
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar

from stepwatch.core._errors import ConfigError, ServerStartError
from stepwatch.otel_bridge._intake import ReceiverContext

_log = logging.getLogger("stepwatch.otel_bridge")

GRPC_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
EXPORT_PATH = f"/{GRPC_SERVICE}/Export"
_T = TypeVar("_T")

if TYPE_CHECKING:
    import grpc
    from grpc import aio


class GrpcLimits(NamedTuple):
    """What one gRPC connection and call may hold (docs/deployment.md, "Limits").

    Attributes:
        max_connections: connections open at once; beyond it new ones are closed at once.
        max_concurrent_streams: streams per connection (HTTP/2 ``MAX_CONCURRENT_STREAMS``,
            advertised); a stream whose answer waits for the client's window still counts.
        request_timeout_s: a call's message must arrive within this (DEADLINE_EXCEEDED).
        idle_timeout_s: a connection without calls is closed after this (GOAWAY), whatever
            PINGs it sends.
        handshake_timeout_s: a new connection must finish TLS and send its HTTP/2 preface
            and SETTINGS within this, or it is closed.
        max_connection_age_s: a connection is sent GOAWAY after this (clients reconnect and
            spread over the processes sharing the port) ...
        max_connection_age_grace_s: ... and closed this much later, with whatever it holds.
        keepalive_s: a connection is PINGed after this long without traffic and closed if
            the PING is not answered within ``keepalive_timeout_s``.
        keepalive_timeout_s: see ``keepalive_s``.
        max_header_bytes: a call's header list, counted while it is decoded.
    """

    max_connections: int = 4096
    max_concurrent_streams: int = 32
    request_timeout_s: float = 30.0
    idle_timeout_s: float = 120.0
    handshake_timeout_s: float = 5.0
    max_connection_age_s: float = 300.0
    max_connection_age_grace_s: float = 30.0
    keepalive_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    max_header_bytes: int = 16 * 1024


def server_options(
    limits: GrpcLimits, *, max_message_bytes: int, reuse_port: bool
) -> list[tuple[str, int]]:
    """gRPC core channel arguments for the bridge's server.

    Their meaning: gRPC's ``include/grpc/impl/channel_arg_names.h``.
    """

    def ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    return [
        ("grpc.max_receive_message_length", max_message_bytes),  # also after decompression
        ("grpc.max_send_message_length", 1 << 20),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        # streams count until freed, not until answered (the core's default; said here)
        ("grpc.http.overload_protection", 1),
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ("grpc.server_handshake_timeout_ms", ms(limits.handshake_timeout_s)),
        ("grpc.max_connection_idle_ms", ms(limits.idle_timeout_s)),
        ("grpc.max_connection_age_ms", ms(limits.max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", ms(limits.max_connection_age_grace_s)),
        ("grpc.keepalive_time_ms", ms(limits.keepalive_s)),
        ("grpc.keepalive_timeout_ms", ms(limits.keepalive_timeout_s)),
        # a client PINGing without calls, or more often than every 5 min without data, is
        # struck; the third strike closes its connection (GOAWAY ENHANCE_YOUR_CALM)
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 300_000),
        ("grpc.http2.max_ping_strikes", 2),
        # a connection reads at most 64 KiB at once: a flood (an endless CONTINUATION header
        # block at loopback speed) grew the process by up to 170 MiB with the default
        # (reads sized to the flow), 35-75 MiB with this
        ("grpc.experimental.tcp_max_read_chunk_size", 65536),
        ("grpc.max_metadata_size", limits.max_header_bytes),
        ("grpc.absolute_max_metadata_size", limits.max_header_bytes),
    ]


class _LoopThread:
    """The one event loop every ``grpc.aio`` server of this process runs on.

    gRPC's asyncio stack dispatches completions for every loop through the loop that first
    used it; a loop per server would stall the others once that first one stopped.
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coroutine: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
        """Run ``coroutine`` on the loop (started at the first use) and wait for its result."""
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="stepwatch-bridge-grpc-loop", daemon=True
                ).start()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout_s)


class _Answer(NamedTuple):
    code: Any  # grpc.StatusCode (grpc is imported when a receiver starts)
    message: str = ""
    body: bytes = b""
    details: bytes = b""  # a serialized google.rpc.Status (grpc-status-details-bin)


class GrpcReceiver:
    """Serves OTLP/gRPC on one port once started.

    Args:
        context: the intake, metrics and limits both receivers share.
        workers: threads that run a call whose intake may block (a disk spool's fsync'd
            commit); with a memory spool calls are handled on the server's event loop.
        max_concurrent_rpcs: calls being handled at once (after their message arrived);
            beyond it RESOURCE_EXHAUSTED with RetryInfo.
        tls: PEM ``(certificate, private key)`` bytes; plaintext when None.
        limits: connection, stream and time limits (:class:`GrpcLimits`).
    """

    def __init__(
        self,
        context: ReceiverContext,
        *,
        workers: int,
        max_concurrent_rpcs: int,
        tls: tuple[bytes, bytes] | None = None,
        limits: GrpcLimits | None = None,
    ) -> None:
        limits = GrpcLimits() if limits is None else limits
        checks: list[tuple[str, float]] = [
            ("grpc_workers", workers),
            ("grpc_max_concurrent_rpcs", max_concurrent_rpcs),
        ]
        checks += [(f"grpc {name}", value) for name, value in limits._asdict().items()]
        for name, value in checks:
            if not value > 0:
                raise ConfigError(f"{name}: must be positive, got {value}")
        self.context = context
        self.workers = workers
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.limits = limits
        self.in_flight = 0
        self._tls = tls
        self._server: aio.Server | None = None
        self._codes: Any = None  # grpc.StatusCode, once started
        self._pool: futures.ThreadPoolExecutor | None = None
        self._counters: dict[grpc.StatusCode, Any] = {}  # its requests{protocol="grpc"} child
        self._statuses: dict[tuple[int, str], bytes] = {}  # _retry_status's answers

    def start(self, address: str) -> int:
        """Listen on ``address`` (``host:port``, IPv6 hosts in brackets); the bound port.

        Raises:
            ServerStartError: the address cannot be bound.
        """
        import grpc

        self._codes = grpc.StatusCode
        credentials = None
        if self._tls is not None:
            credentials = grpc.ssl_server_credentials([(self._tls[1], self._tls[0])])
        self._pool = futures.ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix="stepwatch-bridge-grpc"
        )
        try:
            return _LoopThread.run(self._start(address, credentials), timeout_s=30.0)
        except BaseException:
            self._pool.shutdown(wait=False)
            self._pool = None
            raise

    async def _start(self, address: str, credentials: Any) -> int:
        import grpc
        from grpc import aio

        handlers = grpc.method_handlers_generic_handler(
            GRPC_SERVICE,  # another method: UNIMPLEMENTED, from gRPC
            {"Export": grpc.stream_unary_rpc_method_handler(self.export)},
        )
        server = aio.server(
            handlers=[handlers],
            options=server_options(
                self.limits,
                max_message_bytes=self.context.max_request_bytes,
                reuse_port=self.context.reuse_port,
            ),
        )
        try:
            if credentials is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise ServerStartError(f"bridge gRPC cannot listen on {address}: {exc}") from exc
        if not bound:
            raise ServerStartError(f"bridge gRPC cannot listen on {address}")
        await server.start()
        self._server = server
        return int(bound)

    def stop(self, *, timeout_s: float) -> None:
        """Stop accepting; calls in flight get up to 2 s (within ``timeout_s``) to finish."""
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                _LoopThread.run(server.stop(min(timeout_s, 2.0)), timeout_s=timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # ---- calls ------------------------------------------------------------------------------
    async def export(self, requests: Any, context: aio.ServicerContext[Any, Any]) -> bytes:
        """One Export call: token, the message within the deadline, then the intake.

        Registered as client-streaming (the same on the wire as unary) so that the message is
        read here, under the bridge's deadline, not before the handler is called.
        """
        del requests  # read through the context, with a deadline
        codes = self._codes
        intake = self.context.intake
        token = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                token = value if isinstance(value, str) else None
                break
        if not intake.authorized(token):
            await self._abort(
                context, _Answer(codes.UNAUTHENTICATED, "missing or wrong bearer token")
            )
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                body = await context.read()
        except TimeoutError:
            await self._abort(
                context, _Answer(codes.DEADLINE_EXCEEDED, "message not received in time")
            )
        if not isinstance(body, bytes):  # EOF: the client half-closed without a message
            await self._abort(context, _Answer(codes.INVALID_ARGUMENT, "no message"))
        if self.in_flight >= self.max_concurrent_rpcs:
            message = "too many calls in flight, retry later"
            details = self._retry_status(codes.RESOURCE_EXHAUSTED, message)
            await self._abort(context, _Answer(codes.RESOURCE_EXHAUSTED, message, details=details))
        self.in_flight += 1
        try:
            if self.context.intake.forwarder.spool.durable and self._pool is not None:
                loop = asyncio.get_running_loop()
                answer = await loop.run_in_executor(self._pool, self._export, body)
            else:  # a memory spool never waits: handled on the loop
                answer = self._export(body)
        finally:
            self.in_flight -= 1
        if answer.code != codes.OK:
            await self._abort(context, answer)
        self._count(codes.OK)
        return answer.body

    async def _abort(self, context: aio.ServicerContext[Any, Any], answer: _Answer) -> NoReturn:
        self._count(answer.code)
        trailing = (("grpc-status-details-bin", answer.details),) if answer.details else ()
        await context.abort(answer.code, answer.message, trailing)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def _count(self, code: Any) -> None:
        counter = self._counters.get(code)
        if counter is None:
            counter = self.context.metrics.requests.labels(protocol="grpc", code=code.name)
            self._counters[code] = counter
        counter.inc()

    def _export(self, body: bytes) -> _Answer:
        """One Export message's answer (after the method and token are checked)."""
        intake = self.context.intake
        codes = self._codes
        outcome = None
        try:  # the fast path takes the raw message; parsed only where it declines
            outcome = intake.ingest_body(body)
        except Exception:  # a bug must not take the receiver down: answer and keep serving
            _log.exception("bridge failed to ingest an OTLP/gRPC request")
            return _Answer(codes.INTERNAL, "internal error")
        if outcome is None:
            from google.protobuf.message import DecodeError
            from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
                ExportMetricsServiceRequest,
            )

            request = ExportMetricsServiceRequest()
            try:
                request.ParseFromString(body)
            except (DecodeError, RuntimeError, ValueError) as exc:
                return _Answer(codes.INVALID_ARGUMENT, f"invalid protobuf: {exc}")
            try:
                outcome = intake.ingest(request)
            except Exception:  # a bug must not take the receiver down: answer, keep serving
                _log.exception("bridge failed to ingest an OTLP/gRPC request")
                return _Answer(codes.INTERNAL, "internal error")
        if not outcome.accepted:
            code = codes.UNAVAILABLE if outcome.unavailable else codes.RESOURCE_EXHAUSTED
            return _Answer(code, outcome.message, details=self._retry_status(code, outcome.message))
        return _Answer(codes.OK, body=outcome.response_bytes())

    def _retry_status(self, code: Any, message: str) -> bytes:
        """A google.rpc.Status with RetryInfo: makes RESOURCE_EXHAUSTED retryable (OTLP).

        Refusals come in bursts with a handful of messages: each is built once.
        """
        number = int(code.value[0])
        key = (number, message)
        status = self._statuses.get(key)
        if status is None:
            if len(self._statuses) >= 64:
                self._statuses.clear()
            status = self._statuses[key] = self._build_status(number, message)
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
