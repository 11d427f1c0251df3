"""A lean OTLP/HTTP metric exporter: one kept-alive connection of core's ``HttpClient``.

It keeps the SDK's wire format (the body is the SDK's own ``encode_metrics`` output) and sends
it on the HTTP client every stepwatch component uses (proxy, TLS and retry rules resolved once,
connections kept alive, ``interrupt()`` on shutdown), honours ``Retry-After`` within the
export's deadline and counts what it sent for the monitor's account (:class:`OtlpHttpStats`).

What it saves in CPU no longer matters at the default 10 s windows: ``bench/export_cost.py``
(2026-11-29, its defaults: 385 steps of 26 ms a window, quiet 2-core VM) built and exported a
phases window in 360 µs against the SDK HTTP exporter's 852 µs, a kernels window in 895 µs
against 1,656 µs: 36 against 85 µs (phases) and 89 against 166 µs (kernels) per second of
training, a difference of 0.005-0.008 % of a busy rank. The SDK's exporter works as well
(``StepMonitor(exporter=OTLPMetricExporter(...))``); this one stays for the shared client's
behaviour and the account, not for speed.

Behaviour follows the OTLP/HTTP specification
(https://opentelemetry.io/docs/specs/otlp/#otlphttp-response): 2xx is success (a
``partial_success`` in the answer is logged, never retried); 429, 502, 503 and 504 and
connection errors are retried with exponential backoff and jitter, honouring ``Retry-After``,
never past the export's deadline; any other status fails at once.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
import urllib.parse
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from stepwatch.core import __version__
from stepwatch.core._errors import ConfigError
from stepwatch.core._http import (
    OTLP_RETRYABLE_STATUSES,
    HttpClient,
    HttpResponse,
    TlsFiles,
    retry_after_s,
)
from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters._config import ExporterConfig
from stepwatch.exporters._otlp_protobuf import RequestEncoder

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

logger = logging.getLogger("stepwatch.exporters")

USER_AGENT: Final = f"stepwatch/{__version__} (OTLP/HTTP exporter; python http.client)"
DEFAULT_GZIP_LEVEL: Final = 6
RETRYABLE_STATUSES: Final = OTLP_RETRYABLE_STATUSES
DEFAULT_INITIAL_BACKOFF_S: Final = 0.25
DEFAULT_MAX_BACKOFF_S: Final = 5.0
_JITTER: Final = 0.5  # each backoff is scaled by uniform(1 - _JITTER, 1 + _JITTER)
_LOG_INTERVAL_S: Final = 60.0
_MAX_DISTINCT_MESSAGES: Final = 256
_MAX_LOGGED_BODY_CHARS: Final = 300


@dataclasses.dataclass(frozen=True)
class OtlpHttpStats:
    """Counters of one :class:`OtlpHttpExporter` since it was built.

    Attributes:
        exports: Calls to ``export``.
        failures: Exports that returned FAILURE.
        requests: HTTP requests sent (retries and resends included).
        retries: Requests repeated after a retryable status or a connection error.
        reconnects: Resends on a fresh connection after a stale kept-alive one failed.
        body_bytes: Request body bytes sent (after compression), retries included.
        rejected_data_points: Sum of ``partial_success.rejected_data_points`` answered.
    """

    exports: int
    failures: int
    requests: int
    retries: int
    reconnects: int
    body_bytes: int
    rejected_data_points: int


_LOGS: dict[str, RateLimitedLog] = {}
_LOGS_LOCK = threading.Lock()


def _log_for(endpoint: str) -> RateLimitedLog:
    """One rate limiter per endpoint, shared by successive exporters.

    The monitor replaces its exporter after repeated failures; a limiter per instance would
    then let the same warning through every few windows during an outage.
    """
    with _LOGS_LOCK:
        log = _LOGS.get(endpoint)
        if log is None:
            log = _LOGS[endpoint] = RateLimitedLog(logger, _LOG_INTERVAL_S)
        return log


def _status_message(body: bytes, content_type: str) -> str:
    """The ``google.rpc.Status`` message of an error answer, else the body as text."""
    if not body:
        return ""
    if "protobuf" in content_type:
        try:
            from google.rpc import status_pb2  # type: ignore[import-untyped]

            status = status_pb2.Status()
            status.ParseFromString(body)
            return str(status.message)
        except Exception:  # not installed or not a Status: fall back to the raw text
            pass
    if "json" in content_type:
        import json

        try:
            decoded = json.loads(body)
            if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):
                return str(decoded["message"])
        except ValueError:
            pass
    return body[:_MAX_LOGGED_BODY_CHARS].decode("utf-8", "replace")


class OtlpHttpExporter:
    """OTLP/HTTP (binary protobuf) metric exporter on one kept-alive ``http.client`` connection.

    An :class:`~stepwatch.exporters.Exporter`: ``export`` never raises (it returns FAILURE
    and logs, rate-limited), may run on one thread while ``shutdown`` runs on another, and
    fails without I/O after ``shutdown``. Exports are serialised.

    Compression: ``gzip`` is one gzip member from ``zlib.compressobj(level, DEFLATED, 31)``.
    The default level is 6, not the SDK's 9: on a 46-step window with 20 kernel classes (6.7 KB
    raw) level 9 cost ~1.3 ms of CPU for 1 % fewer bytes than level 6 (~0.35 ms); level 1
    (~0.1 ms) sends ~12 % more bytes, which 10,000 ranks make the bridge pay for
    (``bench/export_cost.py`` prints the figures). ``deflate`` is a zlib stream, as the SDK
    sends it.

    Connection: opened on first use and kept alive. When a reused connection turns out to be
    stale (the receiver restarted or closed it while idle: broken pipe, reset, or the answer
    never came), the request is resent once at once on a fresh connection, so a restarted
    bridge does not cost a window. Each socket operation is bounded by the time left until the
    export's deadline.

    Args:
        endpoint: Full URL including the path (``http://bridge:4318/v1/metrics``).
        headers: Extra request headers (authorization, tenant).
        compression: ``none``, ``gzip`` (the default, as ``OTEL_EXPORTER_OTLP_COMPRESSION``'s
            in stepwatch and the Collector's OTLP exporters) or ``deflate``.
        timeout_s: Default bound on one export, retries included (``export`` may pass its
            own as ``timeout_millis``).
        certificate_file: PEM CA bundle to verify an https endpoint (system CAs when None).
        client_key_file: PEM private key for mutual TLS.
        client_certificate_file: PEM client certificate (chain) for mutual TLS.
        gzip_level: zlib level for ``gzip`` and ``deflate``, 1 to 9.
        initial_backoff_s: First retry delay; doubles per retry up to ``max_backoff_s``.
        max_backoff_s: Largest retry delay (a ``Retry-After`` may ask for more).
        environ: Environment for the proxy variables (``urllib.request.getproxies()`` when
            None); read once, here.
        rng: Source of backoff jitter (seed it in tests).
        direct_encoding: Write the protobuf bytes directly (identical to the SDK's
            ``encode_metrics`` output, about half its CPU); False always uses the SDK.

    Raises:
        ConfigError: A setting is invalid (the message names it) or a TLS file is unusable.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        headers: Mapping[str, str] | None = None,
        compression: str = "gzip",
        timeout_s: float = 10.0,
        certificate_file: str | None = None,
        client_key_file: str | None = None,
        client_certificate_file: str | None = None,
        gzip_level: int = DEFAULT_GZIP_LEVEL,
        initial_backoff_s: float = DEFAULT_INITIAL_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        environ: Mapping[str, str] | None = None,
        rng: random.Random | None = None,
        direct_encoding: bool = True,
    ) -> None:
        parsed = urllib.parse.urlsplit(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"endpoint must be an http:// or https:// URL, got {endpoint!r}")
        if compression not in ("none", "gzip", "deflate"):
            raise ConfigError(f"compression must be none, gzip or deflate, got {compression!r}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        if isinstance(gzip_level, bool) or gzip_level not in range(1, 10):
            raise ConfigError(f"gzip_level must be an integer from 1 to 9, got {gzip_level!r}")
        if not 0 < initial_backoff_s <= max_backoff_s:
            raise ConfigError(
                "initial_backoff_s and max_backoff_s must satisfy 0 < initial <= max, got "
                f"{initial_backoff_s!r} and {max_backoff_s!r}"
            )
        try:
            from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
        except ImportError as exc:
            raise ConfigError(
                "OtlpHttpExporter needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-"
                "common (pip install 'stepwatch[exporters]')"
            ) from exc

        self._encode = encode_metrics
        self._direct = RequestEncoder() if direct_encoding else None
        self.endpoint = endpoint
        self._compression = compression
        self._gzip_level = gzip_level
        self._timeout_s = float(timeout_s)
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._rng = rng if rng is not None else random.Random()

        request_headers = {str(k): str(v) for k, v in (headers or {}).items()}
        reserved = {"content-type", "content-encoding", "content-length", "host"}
        request_headers = {k: v for k, v in request_headers.items() if k.lower() not in reserved}
        request_headers.setdefault("User-Agent", USER_AGENT)
        request_headers["Content-Type"] = "application/x-protobuf"
        if compression != "none":
            request_headers["Content-Encoding"] = compression

        self._headers = request_headers
        self._shutdown = threading.Event()
        self._http = HttpClient(
            tls=TlsFiles(certificate_file, client_key_file, client_certificate_file),
            environ=environ,
            stop=self._shutdown,
            max_idle=1,
        )
        self._http.check(endpoint)  # the proxy and TLS files: a ConfigError now
        self._lock = threading.Lock()  # one export at a time; guards the connection
        self._log = _log_for(endpoint)
        self._seen_messages: set[str] = set()
        self._exports = 0
        self._failures = 0
        self._retries = 0
        self._rejected = 0

    @classmethod
    def from_config(cls, config: ExporterConfig) -> OtlpHttpExporter:
        """The exporter for resolved settings (``resolve_exporter_config``)."""
        return cls(
            config.endpoint,
            headers=config.headers,
            compression=config.compression,
            timeout_s=config.timeout_s,
            certificate_file=config.certificate_file,
            client_key_file=config.client_key_file,
            client_certificate_file=config.client_certificate_file,
        )

    def __repr__(self) -> str:  # headers may hold credentials: never show them
        return f"OtlpHttpExporter({self.endpoint!r}, compression={self._compression!r})"

    @property
    def stats(self) -> OtlpHttpStats:
        """Counters since construction."""
        return OtlpHttpStats(
            exports=self._exports,
            failures=self._failures,
            requests=self._http.requests,
            retries=self._retries,
            reconnects=self._http.reconnects,
            body_bytes=self._http.body_bytes,
            rejected_data_points=self._rejected,
        )

    # ------------------------------------------------------------------ encoding

    def encode(self, metrics_data: MetricsData) -> bytes:
        """The request body for ``metrics_data``: serialised and compressed as configured."""
        return self.compress(self.serialize(metrics_data))

    def serialize(self, metrics_data: MetricsData) -> bytes:
        """``encode_metrics(metrics_data).SerializeToString()``, byte for byte.

        Written directly when ``direct_encoding`` is on and the window holds only what the
        direct encoder handles (about twice as fast); else through the SDK.
        """
        if self._direct is not None:
            serialized = self._direct.encode(metrics_data)
            if serialized is not None:
                return serialized
        return bytes(self._encode(metrics_data).SerializeToString())

    def compress(self, body: bytes) -> bytes:
        """``body`` compressed per the ``compression`` setting."""
        if self._compression == "gzip":
            compressor = zlib.compressobj(self._gzip_level, zlib.DEFLATED, 31)  # 31: gzip member
            return compressor.compress(body) + compressor.flush()
        if self._compression == "deflate":
            return zlib.compress(body, self._gzip_level)
        return body

    # ------------------------------------------------------------------ export

    def export(
        self, metrics_data: MetricsData, timeout_millis: float | None = None
    ) -> MetricExportResult:
        """Send one window; SUCCESS or FAILURE, never raises.

        Args:
            metrics_data: The window.
            timeout_millis: Bound on this export, retries included (default ``timeout_s``).
        """
        from opentelemetry.sdk.metrics.export import MetricExportResult

        timeout = self._timeout_s if timeout_millis is None else timeout_millis / 1000.0
        deadline = time.monotonic() + timeout
        self._exports += 1
        if self._shutdown.is_set():
            self._failures += 1
            self._log.log(logging.WARNING, "shutdown", "OTLP export after shutdown: dropped")
            return MetricExportResult.FAILURE
        try:
            body = self.encode(metrics_data)
            ok = self._send(body, deadline)
        except Exception:  # a bug here must not reach the training loop
            logger.debug("OTLP/HTTP export crashed", exc_info=True)
            self._log.log(
                logging.WARNING,
                "crash",
                "OTLP/HTTP export to %s failed unexpectedly; "
                "enable DEBUG logging on stepwatch.exporters for the traceback",
                self.endpoint,
            )
            ok = False
        if ok:
            return MetricExportResult.SUCCESS
        self._failures += 1
        return MetricExportResult.FAILURE

    def export_body(self, body: bytes, *, timeout_s: float | None = None) -> bool:
        """Send an already encoded (and compressed) body; True on success. Never raises."""
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        if self._shutdown.is_set():
            return False
        try:
            return self._send(body, deadline)
        except Exception:
            logger.debug("OTLP/HTTP export crashed", exc_info=True)
            return False

    def _send(self, body: bytes, deadline: float) -> bool:
        """POST ``body`` with retries until success, a permanent failure or the deadline."""
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            self._log.log(logging.WARNING, "busy", "OTLP export timed out waiting for another")
            return False
        try:
            attempt = 0
            while True:
                if self._shutdown.is_set():
                    return False
                answer, error = self._attempt(body, deadline)
                wait_s: float
                if answer is not None:
                    if 200 <= answer.status < 300:
                        self._partial_success(answer)
                        return True
                    message = _status_message(answer.body, answer.headers.get("Content-Type", ""))
                    if answer.status not in RETRYABLE_STATUSES:
                        self._log.log(
                            logging.WARNING,
                            f"status-{answer.status}",
                            "OTLP export to %s refused: HTTP %d %s: %s (not retried)",
                            self.endpoint,
                            answer.status,
                            answer.reason,
                            message or "no message",
                        )
                        return False
                    what = f"HTTP {answer.status} {answer.reason}: {message or 'no message'}"
                    asked = retry_after_s(answer.headers.get("Retry-After"))
                    wait_s = self._backoff_s(attempt) if asked is None else asked
                else:
                    what = f"{type(error).__name__}: {error}"
                    wait_s = self._backoff_s(attempt)
                remaining = deadline - time.monotonic()
                if wait_s >= remaining:
                    self._log.log(
                        logging.WARNING,
                        "gave-up",
                        "OTLP export to %s failed: %s; next retry in %.2f s would pass the "
                        "deadline (%.2f s left)",
                        self.endpoint,
                        what,
                        wait_s,
                        max(remaining, 0.0),
                    )
                    return False
                self._log.log(
                    logging.INFO,
                    "retrying",
                    "OTLP export to %s: %s; retrying in %.2f s",
                    self.endpoint,
                    what,
                    wait_s,
                )
                if self._shutdown.wait(wait_s):
                    return False
                attempt += 1
                self._retries += 1
        finally:
            self._lock.release()

    def _attempt(self, body: bytes, deadline: float) -> tuple[HttpResponse | None, OSError | None]:
        """One POST (resent at once on a fresh connection if a kept-alive one was stale)."""
        try:
            answer = self._http.request(
                "POST",
                self.endpoint,
                headers=self._headers,
                body=body,
                timeout_s=deadline - time.monotonic(),
            )
        except OSError as exc:
            return None, exc
        return answer, None

    def _backoff_s(self, attempt: int) -> float:
        base = min(self._initial_backoff_s * 2.0**attempt, self._max_backoff_s)
        return base * self._rng.uniform(1.0 - _JITTER, 1.0 + _JITTER)

    def _partial_success(self, answer: HttpResponse) -> None:
        """Log a 2xx answer's ``partial_success`` (once per distinct message, rate-limited)."""
        if not answer.body or "protobuf" not in answer.headers.get("Content-Type", "protobuf"):
            return
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceResponse,
        )

        response = ExportMetricsServiceResponse()
        try:
            response.ParseFromString(answer.body)
        except Exception:
            self._log.log(logging.WARNING, "bad-answer", "OTLP 2xx answer is not protobuf")
            return
        if not response.HasField("partial_success"):
            return
        rejected = int(response.partial_success.rejected_data_points)
        message = str(response.partial_success.error_message)
        if not rejected and not message:
            return
        self._rejected += rejected
        if message in self._seen_messages:
            return
        if len(self._seen_messages) < _MAX_DISTINCT_MESSAGES:
            self._seen_messages.add(message)
        self._log.log(
            logging.WARNING,
            "partial-success",
            "OTLP receiver %s rejected %d data points: %s",
            self.endpoint,
            rejected,
            message or "no message",
        )

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Close the connection; later exports fail without I/O. Safe from any thread.

        An export in flight on another thread is interrupted (its socket is shut down).
        """
        self._shutdown.set()
        timeout_s = max(timeout_millis / 1000.0, 0.0)
        if not self._lock.acquire(timeout=min(timeout_s, 0.05)):
            self._http.interrupt()
            if not self._lock.acquire(timeout=timeout_s):
                return  # the export thread closes its connection when it sees the flag
        try:
            self._http.close()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Same as :meth:`shutdown`."""
        self.shutdown()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Nothing is buffered: True."""
        return True
