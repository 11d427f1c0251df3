"""OTLP exporter settings: argument > ``OTEL_EXPORTER_OTLP_METRICS_*`` > ``OTEL_EXPORTER_OTLP_*``.

The SDK exporters read the environment themselves, but each in its own way (the Python HTTP
exporter reads ``OTEL_EXPORTER_OTLP_TIMEOUT`` as seconds where the specification says
milliseconds). stepwatch resolves every setting itself, once, when the monitor is built, and
passes explicit values to the exporter (its own OTLP/HTTP exporter, or the SDK's gRPC one), so
the precedence is the specification's and is tested here:
https://opentelemetry.io/docs/specs/otel/protocol/exporter/
"""

from __future__ import annotations

import dataclasses
import os
import threading
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from stepwatch.core._errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

PROTOCOLS = ("http/protobuf", "grpc")
COMPRESSIONS = ("none", "gzip", "deflate")
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
METRICS_PATH = "/v1/metrics"
DEFAULT_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ExporterConfig:
    """Resolved OTLP exporter settings.

    Attributes:
        protocol: ``http/protobuf`` or ``grpc``.
        endpoint: Full URL; for HTTP it includes the ``/v1/metrics`` path.
        headers: Extra request headers (gRPC metadata).
        compression: ``none``, ``gzip`` or ``deflate``.
        timeout_s: Bound on one export call, retries included.
        certificate_file: PEM CA bundle verifying an https endpoint (system CAs when None).
        client_key_file: PEM private key for mutual TLS.
        client_certificate_file: PEM client certificate for mutual TLS.
    """

    protocol: str
    endpoint: str
    headers: Mapping[str, str]
    compression: str
    timeout_s: float
    certificate_file: str | None = None
    client_key_file: str | None = None
    client_certificate_file: str | None = None


def _pick(argument: str | None, name: str, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The first set value among the argument, the metrics-specific and the generic variable."""
    if argument is not None:
        return argument, name
    for variable in (
        f"OTEL_EXPORTER_OTLP_METRICS_{name.upper()}",
        f"OTEL_EXPORTER_OTLP_{name.upper()}",
    ):
        value = environ.get(variable, "").strip()
        if value:
            return value, variable
    return None, name


def resolve_exporter_config(
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    headers: Mapping[str, str] | None = None,
    compression: str | None = None,
    timeout_s: float | None = None,
    certificate_file: str | None = None,
    client_key_file: str | None = None,
    client_certificate_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ExporterConfig:
    """Resolve OTLP settings: argument > ``..._METRICS_*`` variable > ``OTEL_EXPORTER_OTLP_*``.

    HTTP endpoints: a signal-specific value (argument or ``..._METRICS_ENDPOINT``) is used as
    given unless it has no path, in which case ``/v1/metrics`` is appended (so
    ``endpoint="http://bridge:4318"`` works); the generic ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a
    base URL and always gets ``/v1/metrics`` appended, as the specification says.

    Args:
        endpoint: Collector or bridge URL.
        protocol: ``http/protobuf`` (default) or ``grpc``.
        headers: Request headers; the variables use the ``k1=v1,k2=v2`` URL-encoded form.
        compression: ``none`` (default), ``gzip`` or ``deflate``.
        timeout_s: Per-export bound in seconds; the variables are in milliseconds.
        certificate_file: CA bundle for https (``..._CERTIFICATE``).
        client_key_file: Client key for mutual TLS (``..._CLIENT_KEY``).
        client_certificate_file: Client certificate for mutual TLS (``..._CLIENT_CERTIFICATE``).
        environ: The environment to read (``os.environ`` when omitted).

    Returns:
        The resolved settings.

    Raises:
        ConfigError: A value is not valid or a TLS file does not exist; the message names the
            argument or variable.
    """
    env = os.environ if environ is None else environ
    protocol_value, protocol_source = _pick(protocol, "protocol", env)
    protocol_value = protocol_value or "http/protobuf"
    if protocol_value not in PROTOCOLS:
        raise ConfigError(
            f"{protocol_source}: protocol must be one of {PROTOCOLS}, got {protocol_value!r}"
        )

    if endpoint is not None:
        endpoint_value, generic = endpoint, False
    elif env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip():
        endpoint_value, generic = env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"].strip(), False
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        endpoint_value, generic = env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip(), True
    else:
        endpoint_value = (
            DEFAULT_GRPC_ENDPOINT if protocol_value == "grpc" else DEFAULT_HTTP_ENDPOINT
        )
        generic = True
    parsed = urllib.parse.urlsplit(endpoint_value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"endpoint must be an http:// or https:// URL, got {endpoint_value!r}")
    if protocol_value == "http/protobuf" and (generic or parsed.path in ("", "/")):
        endpoint_value = endpoint_value.rstrip("/") + METRICS_PATH

    if headers is not None:
        headers_value = {str(k): str(v) for k, v in headers.items()}
    else:
        raw, source = _pick(None, "headers", env)
        headers_value = _parse_headers(raw, source) if raw else {}

    compression_value, compression_source = _pick(compression, "compression", env)
    compression_value = (compression_value or "none").lower()
    if compression_value not in COMPRESSIONS:
        raise ConfigError(
            f"{compression_source}: compression must be one of {COMPRESSIONS}, "
            f"got {compression_value!r}"
        )

    if timeout_s is not None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        timeout_value = float(timeout_s)
    else:
        raw, source = _pick(None, "timeout", env)
        timeout_value = DEFAULT_TIMEOUT_S
        if raw:
            try:
                timeout_value = float(raw) / 1000.0  # the variables are milliseconds
            except ValueError as exc:
                raise ConfigError(f"{source} must be milliseconds, got {raw!r}") from exc
            if not timeout_value > 0:
                raise ConfigError(f"{source} must be positive, got {raw!r}")
    tls_files = {
        name: _tls_file(argument, name, env)
        for name, argument in (
            ("certificate", certificate_file),
            ("client_key", client_key_file),
            ("client_certificate", client_certificate_file),
        )
    }
    return ExporterConfig(
        protocol=protocol_value,
        endpoint=endpoint_value,
        headers=headers_value,
        compression=compression_value,
        timeout_s=timeout_value,
        certificate_file=tls_files["certificate"],
        client_key_file=tls_files["client_key"],
        client_certificate_file=tls_files["client_certificate"],
    )


def _tls_file(argument: str | None, name: str, environ: Mapping[str, str]) -> str | None:
    """A TLS file path from the argument or the variables; it must exist."""
    value, source = _pick(argument, name, environ)
    if value is None:
        return None
    if source == name:
        source = f"{name}_file"  # the argument's name
    if not os.path.isfile(value):
        raise ConfigError(f"{source}: no such file {value!r}")
    return value


def _parse_headers(raw: str, source: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` with URL-encoded keys and values (the OTLP exporter env format)."""
    parsed: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source}: expected key=value pairs, got {item.strip()!r}")
        parsed[urllib.parse.unquote(key.strip()).lower()] = urllib.parse.unquote(value.strip())
    return parsed


def create_exporter(config: ExporterConfig) -> Exporter:
    """The OTLP exporter for ``config``, every setting passed explicitly.

    ``http/protobuf``: :class:`~stepwatch.exporters.OtlpHttpExporter` (the SDK's wire format on
    one kept-alive ``http.client`` connection; a fraction of the SDK HTTP exporter's CPU per
    window). ``grpc``: the SDK's gRPC exporter, which reads the TLS variables itself. The SDK's
    HTTP exporter stays usable: pass one as ``StepMonitor(exporter=...)``.

    Raises:
        ConfigError: The exporter package for the protocol is not installed.
    """
    if config.protocol == "grpc":
        try:
            import grpc
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "protocol 'grpc' needs opentelemetry-exporter-otlp-proto-grpc "
                "(pip install 'stepwatch[exporters]')"
            ) from exc
        grpc_compression = {
            "none": grpc.Compression.NoCompression,
            "gzip": grpc.Compression.Gzip,
            "deflate": grpc.Compression.Deflate,
        }[config.compression]
        exporter: MetricExporter = GrpcExporter(
            endpoint=config.endpoint,
            insecure=config.endpoint.startswith("http://"),
            headers=dict(config.headers),
            timeout=config.timeout_s,
            compression=grpc_compression,
        )
        return exporter
    from stepwatch.exporters._otlp_http import OtlpHttpExporter

    return OtlpHttpExporter.from_config(config)


class Exporter(Protocol):
    """What a monitor needs from an exporter: every SDK ``MetricExporter`` satisfies it."""

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        """Send one window; return SUCCESS or FAILURE."""

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Release connections; later exports fail."""


class InMemoryExporter:
    """An :class:`Exporter` keeping every exported window in memory (tests, simulators).

    Attributes:
        exported: Every ``MetricsData`` received, in order.
    """

    def __init__(self) -> None:
        self.exported: list[MetricsData] = []
        self._lock = threading.Lock()
        self._shutdown = False

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        """Keep ``metrics_data``; FAILURE after :meth:`shutdown`."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        with self._lock:
            if self._shutdown:
                return MetricExportResult.FAILURE
            self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Refuse later exports (what is kept stays readable)."""
        with self._lock:
            self._shutdown = True
