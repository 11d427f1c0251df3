"""A lean OTLP/HTTP metric exporter: one kept-alive ``http.client`` connection, no ``requests``.

The SDK's HTTP exporter spends most of a window's export CPU outside the protocol: gzip at level
9, and a ``requests`` session that re-reads the proxy environment and rebuilds the request on
every POST (~2.5 ms per window on the bench machine, against ~0.26 ms for a kept-alive
``http.client`` POST of the same body). Every millisecond of the export thread per second is
~0.1 % of a busy rank's step time, and it holds the GIL, so this exporter keeps the SDK's wire
format (the body is the SDK's own ``encode_metrics`` output) and its behaviour, and drops the
rest: settings (proxy, TLS, headers) are resolved once at construction and the connection is
reused.

Behaviour follows the OTLP/HTTP specification
(https://opentelemetry.io/docs/specs/otlp/#otlphttp-response): 2xx is success (a
``partial_success`` in the answer is logged, never retried); 429, 502, 503 and 504 and
connection errors are retried with exponential backoff and jitter, honouring ``Retry-After``,
never past the export's deadline; any other status fails at once.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import email.utils
import http.client
import logging
import math
import random
import socket
import ssl
import struct
import threading
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from stepwatch.core import __version__
from stepwatch.core._errors import ConfigError
from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters._config import ExporterConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

logger = logging.getLogger("stepwatch.exporters")

USER_AGENT: Final = f"stepwatch/{__version__} (OTLP/HTTP exporter; python http.client)"
DEFAULT_GZIP_LEVEL: Final = 6
RETRYABLE_STATUSES: Final = frozenset({429, 502, 503, 504})
DEFAULT_INITIAL_BACKOFF_S: Final = 0.25
DEFAULT_MAX_BACKOFF_S: Final = 5.0
_JITTER: Final = 0.5  # each backoff is scaled by uniform(1 - _JITTER, 1 + _JITTER)
_LOG_INTERVAL_S: Final = 60.0
_MAX_DISTINCT_MESSAGES: Final = 256
_MAX_LOGGED_BODY_CHARS: Final = 300
# A kept-alive connection the server has since closed fails on first use with one of these;
# the request never reached a live server, so it is resent at once on a fresh connection.
_STALE_ERRORS: Final = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


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


@dataclasses.dataclass(frozen=True)
class _Proxy:
    host: str
    port: int
    authorization: str | None
    source: str


@dataclasses.dataclass(frozen=True)
class _Answer:
    status: int
    reason: str
    headers: http.client.HTTPMessage
    body: bytes


def _proxies_from(environ: Mapping[str, str]) -> dict[str, str]:
    """``urllib.request.getproxies_environment`` for an explicit mapping (lowercase wins)."""
    proxies: dict[str, str] = {}
    for name, value in environ.items():
        if value and name.lower().endswith("_proxy") and name != name.lower():
            proxies[name[:-6].lower()] = value
    for name, value in environ.items():
        if name.lower().endswith("_proxy") and name == name.lower():
            if value:
                proxies[name[:-6]] = value
            else:
                proxies.pop(name[:-6], None)
    if "REQUEST_METHOD" in environ:  # CGI: HTTP_PROXY may come from a request header
        proxies.pop("http", None)
    return proxies


def resolve_proxy(endpoint: str, *, environ: Mapping[str, str] | None = None) -> str | None:
    """The proxy URL ``requests`` would have used for ``endpoint``, or None for a direct link.

    ``<scheme>_proxy`` then ``all_proxy`` (either case, lowercase first), unless the host
    matches ``no_proxy`` (``urllib.request.proxy_bypass_environment`` semantics).

    Args:
        endpoint: The OTLP endpoint URL.
        environ: The environment to read (``urllib.request.getproxies()`` when omitted).
    """
    proxies = urllib.request.getproxies() if environ is None else _proxies_from(environ)
    parsed = urllib.parse.urlsplit(endpoint)
    host = parsed.hostname or ""
    target = f"{host}:{parsed.port}" if parsed.port else host
    if urllib.request.proxy_bypass_environment(target, proxies):  # type: ignore[attr-defined]
        return None
    return proxies.get(parsed.scheme) or proxies.get("all")


def _parse_proxy(url: str) -> _Proxy:
    source = url
    if "://" not in url:
        url = "http://" + url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ConfigError(
            f"proxy {source!r} (from *_proxy environment variables): only http:// proxies "
            "are supported; set no_proxy for the OTLP endpoint's host to bypass it"
        )
    authorization = None
    if parsed.username is not None:
        credentials = (
            f"{urllib.parse.unquote(parsed.username)}:{urllib.parse.unquote(parsed.password or '')}"
        )
        authorization = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    return _Proxy(parsed.hostname, parsed.port or 80, authorization, source)


def retry_after_s(value: str | None, *, now_unix_s: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds or HTTP-date), or None.

    RFC 9110 section 10.2.3. A date in the past gives ``0.0``; an unparsable value gives None.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    now = time.time() if now_unix_s is None else now_unix_s
    return max(when.timestamp() - now, 0.0)


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
        compression: ``none``, ``gzip`` or ``deflate``.
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
        compression: str = "none",
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
        self._direct = _RequestEncoder() if direct_encoding else None
        self.endpoint = endpoint
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)
        self._path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        self._compression = compression
        self._gzip_level = gzip_level
        self._timeout_s = float(timeout_s)
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._rng = rng if rng is not None else random.Random()

        request_headers = {str(k): str(v) for k, v in (headers or {}).items()}
        reserved = {"content-type", "content-encoding", "content-length", "host"}
        self._headers = {k: v for k, v in request_headers.items() if k.lower() not in reserved}
        self._headers.setdefault("User-Agent", USER_AGENT)
        self._headers["Content-Type"] = "application/x-protobuf"
        if compression != "none":
            self._headers["Content-Encoding"] = compression

        proxy_url = resolve_proxy(endpoint, environ=environ)
        self._proxy = _parse_proxy(proxy_url) if proxy_url else None
        self._ssl_context = (
            _ssl_context(certificate_file, client_key_file, client_certificate_file)
            if self._https
            else None
        )
        if self._proxy is not None and not self._https:
            # Plain HTTP through a proxy: the request line carries the absolute URI (RFC 9112
            # section 3.2.2) and the proxy forwards it.
            self._path = urllib.parse.urlunsplit(
                (parsed.scheme, parsed.netloc, parsed.path or "/", parsed.query, "")
            )
            if self._proxy.authorization:
                self._headers["Proxy-Authorization"] = self._proxy.authorization

        self._lock = threading.Lock()  # one export at a time; guards the connection
        self._connection: http.client.HTTPConnection | None = None
        self._shutdown = threading.Event()
        self._log = _log_for(endpoint)
        self._seen_messages: set[str] = set()
        self._exports = 0
        self._failures = 0
        self._requests = 0
        self._retries = 0
        self._reconnects = 0
        self._body_bytes = 0
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
            requests=self._requests,
            retries=self._retries,
            reconnects=self._reconnects,
            body_bytes=self._body_bytes,
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

    def _backoff_s(self, attempt: int) -> float:
        base = min(self._initial_backoff_s * 2.0**attempt, self._max_backoff_s)
        return base * self._rng.uniform(1.0 - _JITTER, 1.0 + _JITTER)

    def _attempt(self, body: bytes, deadline: float) -> tuple[_Answer | None, Exception | None]:
        """One POST, plus one immediate resend when a kept-alive connection was stale."""
        reused = self._connection is not None and self._connection.sock is not None
        try:
            return self._post(body, deadline), None
        except (*_STALE_ERRORS, http.client.BadStatusLine) as exc:
            self._close_connection()
            if not reused or self._shutdown.is_set() or deadline <= time.monotonic():
                return None, exc
            self._reconnects += 1
            logger.debug("kept-alive OTLP connection was stale (%r); resending", exc)
        except (OSError, http.client.HTTPException) as exc:
            self._close_connection()
            return None, exc
        try:
            return self._post(body, deadline), None
        except (OSError, http.client.HTTPException) as exc:
            self._close_connection()
            return None, exc

    def _post(self, body: bytes, deadline: float) -> _Answer:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the export deadline passed")
        connection = self._connection
        if connection is None:
            connection = self._connection = self._new_connection(remaining)
        connection.timeout = remaining
        if connection.sock is None:
            connection.connect()
            if connection.sock is not None:
                # http.client writes the headers and the body in two sends: without
                # TCP_NODELAY the body may wait for the delayed ACK of the headers (Nagle).
                connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            connection.sock.settimeout(remaining)
        self._requests += 1
        self._body_bytes += len(body)
        connection.request("POST", self._path, body=body, headers=self._headers)
        response = connection.getresponse()
        answer = _Answer(
            status=response.status,
            reason=response.reason,
            headers=response.headers,
            body=response.read(),  # read it all, or the connection cannot be reused
        )
        if response.will_close:
            self._close_connection()
        return answer

    def _new_connection(self, timeout_s: float) -> http.client.HTTPConnection:
        proxy = self._proxy
        connection: http.client.HTTPConnection
        if self._https:
            if proxy is None:
                connection = http.client.HTTPSConnection(
                    self._host, self._port, timeout=timeout_s, context=self._ssl_context
                )
            else:  # CONNECT through the proxy, then TLS to the endpoint inside the tunnel
                connection = http.client.HTTPSConnection(
                    proxy.host, proxy.port, timeout=timeout_s, context=self._ssl_context
                )
                tunnel_headers = (
                    {"Proxy-Authorization": proxy.authorization} if proxy.authorization else None
                )
                connection.set_tunnel(self._host, self._port, headers=tunnel_headers)
        elif proxy is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        else:
            connection = http.client.HTTPConnection(proxy.host, proxy.port, timeout=timeout_s)
        return connection

    def _close_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _partial_success(self, answer: _Answer) -> None:
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
            connection = self._connection
            sock = connection.sock if connection is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            if not self._lock.acquire(timeout=timeout_s):
                return  # the export thread closes its connection when it sees the flag
        try:
            self._close_connection()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Same as :meth:`shutdown`."""
        self.shutdown()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Nothing is buffered: True."""
        return True


def _ssl_context(
    certificate_file: str | None, client_key_file: str | None, client_certificate_file: str | None
) -> ssl.SSLContext:
    """``ssl.create_default_context`` with the configured CA bundle and client certificate."""
    try:
        context = ssl.create_default_context(cafile=certificate_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"certificate_file {certificate_file!r} is unusable: {exc}") from exc
    if client_certificate_file is not None:
        try:
            context.load_cert_chain(client_certificate_file, keyfile=client_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"client_certificate_file {client_certificate_file!r} / client_key_file "
                f"{client_key_file!r} are unusable: {exc}"
            ) from exc
    elif client_key_file is not None:
        raise ConfigError("client_key_file needs client_certificate_file")
    return context


# ---------------------------------------------------------------------- direct protobuf encoding
#
# The SDK's encode_metrics builds one protobuf object per data point, attribute and value
# through the Python API (~0.3-1 ms per window), then serialises it. stepwatch windows use a
# handful of message types, so ``encode_request`` writes the same bytes directly: fields in
# ascending field-number order, proto3 defaults omitted, ``optional`` and ``oneof`` fields
# written when set, exactly as upb serialises the SDK's messages (the test suite compares the
# two byte for byte on random windows). Anything it does not handle (exemplars, explicit
# histograms, nested attribute values, out-of-range numbers) makes it return None and the
# caller uses the SDK encoder. Field numbers: opentelemetry-proto, metrics/v1/metrics.proto and
# common/v1/common.proto; wire format: https://protobuf.dev/programming-guides/encoding/

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_sfixed64 = struct.Struct("<q").pack
_ONE_BYTE = tuple(bytes((value,)) for value in range(128))
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_UINT32_MAX = (1 << 32) - 1


class _Unsupported(Exception):
    """The direct encoder does not handle this input: use the SDK's."""


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if value < 0:
        value &= 0xFFFF_FFFF_FFFF_FFFF  # int64: two's complement, ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _sint32(value: int) -> bytes:
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise _Unsupported("sint32 out of range")
    return _varint((value << 1) ^ (value >> 31))


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _any_value(value: object) -> bytes:
    """An ``AnyValue`` message body (``_encode_value`` in the SDK)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _length_delimited(b"\x0a", value.encode("utf-8"))
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Unsupported("int64 out of range")
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, bytes):
        return _length_delimited(b"\x3a", value)
    raise _Unsupported(f"attribute value of type {type(value).__name__}")


def _attributes(tag: bytes, attributes: Mapping[str, object] | None) -> bytes:
    """Repeated ``KeyValue`` fields under ``tag``."""
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        if not isinstance(key, str):
            raise _Unsupported("attribute key is not a string")
        encoded_key = _length_delimited(b"\x0a", key.encode("utf-8")) if key else b""
        parts.append(
            _length_delimited(tag, encoded_key + _length_delimited(b"\x12", _any_value(value)))
        )
    return b"".join(parts)


class _AttributeCache:
    """Encoded point attributes, remembered when every value is a string (the usual case).

    Windows repeat the same few attribute sets (one per phase, kernel class) every second.
    Only all-string sets are cached: ``1``, ``True`` and ``1.0`` are equal dictionary keys
    but encode differently.
    """

    _MAX_ENTRIES: Final = 4096

    def __init__(self) -> None:
        self._encoded: dict[tuple[bytes, tuple[tuple[str, object], ...]], bytes] = {}

    def __call__(self, tag: bytes, attributes: Mapping[str, object] | None) -> bytes:
        if not attributes:
            return b""
        items = tuple(attributes.items())
        for _, value in items:
            if type(value) is not str:
                return _attributes(tag, attributes)
        key = (tag, items)
        encoded = self._encoded.get(key)
        if encoded is None:
            if len(self._encoded) >= self._MAX_ENTRIES:
                self._encoded.clear()
            encoded = self._encoded[key] = _attributes(tag, attributes)
        return encoded


def _string(tag: bytes, value: str | None) -> bytes:
    return _length_delimited(tag, value.encode("utf-8")) if value else b""


def _fixed64(tag: bytes, value: int) -> bytes:
    return tag + _pack_fixed64(value) if value else b""


def _exponential_point(point: Any, attributes: _AttributeCache) -> bytes:
    if point.exemplars:
        raise _Unsupported("exemplars")
    parts = [
        attributes(b"\x0a", point.attributes),
        _fixed64(b"\x11", point.start_time_unix_nano),
        _fixed64(b"\x19", point.time_unix_nano),
        _fixed64(b"\x21", point.count),
    ]
    if point.sum is not None:
        parts.append(b"\x29" + _pack_double(point.sum))
    if point.scale:
        parts.append(b"\x30" + _sint32(point.scale))
    parts.append(_fixed64(b"\x39", point.zero_count))
    for tag, buckets in ((b"\x42", point.positive), (b"\x4a", point.negative)):
        counts = buckets.bucket_counts
        if counts:
            body = b"\x08" + _sint32(buckets.offset) if buckets.offset else b""
            packed = bytes(counts) if max(counts) < 0x80 else b"".join(map(_varint, counts))
            body += _length_delimited(b"\x12", packed)
            parts.append(_length_delimited(tag, body))
    if point.flags:
        if not 0 <= point.flags <= _UINT32_MAX:
            raise _Unsupported("flags out of range")
        parts.append(b"\x50" + _varint(point.flags))
    if point.min is not None:
        parts.append(b"\x61" + _pack_double(point.min))
    if point.max is not None:
        parts.append(b"\x69" + _pack_double(point.max))
    return b"".join(parts)


def _number_point(point: Any, attributes: _AttributeCache, *, with_start: bool) -> bytes:
    if point.exemplars:
        raise _Unsupported("exemplars")
    parts = [
        _fixed64(b"\x11", point.start_time_unix_nano) if with_start else b"",
        _fixed64(b"\x19", point.time_unix_nano),
    ]
    value = point.value
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Unsupported("int64 out of range")
        parts.append(b"\x31" + _pack_sfixed64(value))
    elif isinstance(value, float):
        parts.append(b"\x21" + _pack_double(value))
    else:
        raise _Unsupported(f"value of type {type(value).__name__}")
    parts.append(attributes(b"\x3a", point.attributes))
    return b"".join(parts)


def _metric(metric: Any, types: Any, attributes: _AttributeCache) -> bytes:
    parts = [
        _string(b"\x0a", metric.name),
        _string(b"\x12", metric.description),
        _string(b"\x1a", metric.unit),
    ]
    data = metric.data
    points = data.data_points
    if isinstance(data, types.ExponentialHistogram):
        if points:
            body = b"".join(
                _length_delimited(b"\x0a", _exponential_point(point, attributes))
                for point in points
            )
            temporality = int(data.aggregation_temporality)
            body += b"\x10" + _varint(temporality) if temporality else b""
            parts.append(_length_delimited(b"\x52", body))
    elif isinstance(data, types.Sum):
        if points:
            body = b"".join(
                _length_delimited(b"\x0a", _number_point(point, attributes, with_start=True))
                for point in points
            )
            temporality = int(data.aggregation_temporality)
            body += b"\x10" + _varint(temporality) if temporality else b""
            body += b"\x18\x01" if data.is_monotonic else b""
            parts.append(_length_delimited(b"\x3a", body))
    elif isinstance(data, types.Gauge):
        if points:
            body = b"".join(
                _length_delimited(b"\x0a", _number_point(point, attributes, with_start=False))
                for point in points
            )
            parts.append(_length_delimited(b"\x2a", body))
    else:
        raise _Unsupported(f"metric data of type {type(data).__name__}")
    return b"".join(parts)


def _scope(scope: Any) -> bytes:
    if scope is None:
        raise _Unsupported("no instrumentation scope")
    return (
        _string(b"\x0a", scope.name)
        + _string(b"\x12", scope.version)
        + _attributes(b"\x1a", scope.attributes)
    )


class _RequestEncoder:
    """``encode_metrics(data).SerializeToString()``, written directly (see above).

    Caches the encoded resource: a monitor sends the same one every window.
    """

    def __init__(self) -> None:
        from opentelemetry.sdk.metrics import export as types

        self._types = types
        self._attributes = _AttributeCache()
        self._resource_cache: tuple[object, bytes] = (None, b"")

    def encode(self, metrics_data: MetricsData) -> bytes | None:
        """The serialised ``ExportMetricsServiceRequest``, or None when unsupported."""
        try:
            return self._encode(metrics_data)
        except (_Unsupported, struct.error, AttributeError, TypeError, ValueError):
            return None

    def _resource_body(self, resource: Any) -> bytes:
        cached_resource, encoded = self._resource_cache  # one tuple: safe across threads
        if cached_resource is not resource:
            encoded = _attributes(b"\x0a", resource.attributes)
            self._resource_cache = (resource, encoded)
        return encoded

    def _encode(self, metrics_data: MetricsData) -> bytes:
        types = self._types
        # Mirror encode_metrics: resources and scopes are dict keys (equal ones merge, the
        # later scope's metrics replacing the earlier's), schema URLs come from the SDK
        # Resource and InstrumentationScope objects.
        by_resource: dict[Any, dict[Any, list[bytes]]] = {}
        for resource_metrics in metrics_data.resource_metrics:
            scopes: dict[Any, list[bytes]] = {}
            by_resource[resource_metrics.resource] = scopes
            for scope_metrics in resource_metrics.scope_metrics:
                scopes[scope_metrics.scope] = [
                    _length_delimited(b"\x12", _metric(metric, types, self._attributes))
                    for metric in scope_metrics.metrics
                ]
        out = []
        for resource, scopes in by_resource.items():
            body = [_length_delimited(b"\x0a", self._resource_body(resource))]
            for scope, metrics in scopes.items():
                scope_body = (
                    _length_delimited(b"\x0a", _scope(scope))
                    + b"".join(metrics)
                    + _string(b"\x1a", scope.schema_url)
                )
                body.append(_length_delimited(b"\x12", scope_body))
            body.append(_string(b"\x1a", resource.schema_url))
            out.append(_length_delimited(b"\x0a", b"".join(body)))
        return b"".join(out)
