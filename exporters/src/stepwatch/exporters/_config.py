"""OTLP exporter settings: argument > ``OTEL_EXPORTER_OTLP_METRICS_*`` > ``OTEL_EXPORTER_OTLP_*``.

The SDK exporters read the environment themselves, but each in its own way (the Python HTTP
exporter reads ``OTEL_EXPORTER_OTLP_TIMEOUT`` as seconds where the specification says
milliseconds). stepwatch resolves every setting itself, once, when the monitor is built, and
passes explicit values to the exporter (its own OTLP/HTTP exporter, or the SDK's gRPC one), so
the precedence is the specification's and is tested here:
https://opentelemetry.io/docs/specs/otel/protocol/exporter/

The variables, their order and their parsing are :mod:`stepwatch.core.settings`'s ``OTLP_*``.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Mapping
from typing import Final, cast

from stepwatch.core import settings
from stepwatch.core._errors import ConfigError

PROTOCOLS: Final = ("http/protobuf", "grpc")
COMPRESSIONS: Final = ("none", "gzip", "deflate")
DEFAULT_HTTP_ENDPOINT: Final = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT: Final = "http://localhost:4317"
METRICS_PATH: Final = "/v1/metrics"
# The defaults are the settings' (cast: a Setting's default is optional in general).
DEFAULT_PROTOCOL: Final = cast(str, settings.OTLP_PROTOCOL.default)
DEFAULT_COMPRESSION: Final = cast(str, settings.OTLP_COMPRESSION.default)
DEFAULT_TIMEOUT_S: Final = cast(float, settings.OTLP_TIMEOUT_S.default)


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


def _pick(
    setting: settings.Setting[str], argument: str | None, environ: Mapping[str, str]
) -> tuple[str | None, str]:
    """The argument, else the first variable set: (value, the argument's or variable's name)."""
    if argument is not None:
        return argument, setting.name
    value, variable = setting.lookup(environ)
    return value, variable or setting.name


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
    protocol_value, protocol_source = _pick(settings.OTLP_PROTOCOL, protocol, env)
    protocol_value = protocol_value or DEFAULT_PROTOCOL
    if protocol_value not in PROTOCOLS:
        raise ConfigError(
            f"{protocol_source}: protocol must be one of {PROTOCOLS}, got {protocol_value!r}"
        )

    if endpoint is not None:
        endpoint_value, generic = endpoint, False
    else:
        found, variable = settings.OTLP_ENDPOINT.lookup(env)
        # The signal-specific variable is used as given; the generic one (the setting's alias)
        # and the default are base URLs.
        generic = variable != settings.OTLP_ENDPOINT.variable
        default = DEFAULT_GRPC_ENDPOINT if protocol_value == "grpc" else DEFAULT_HTTP_ENDPOINT
        endpoint_value = default if found is None else found
    parsed = urllib.parse.urlsplit(endpoint_value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"endpoint must be an http:// or https:// URL, got {endpoint_value!r}")
    if protocol_value == "http/protobuf" and (generic or parsed.path in ("", "/")):
        endpoint_value = endpoint_value.rstrip("/") + METRICS_PATH

    if headers is not None:
        headers_value = {str(k): str(v) for k, v in headers.items()}
    else:
        raw, source = _pick(settings.OTLP_HEADERS, None, env)
        headers_value = _parse_headers(raw, source) if raw else {}

    compression_value, compression_source = _pick(settings.OTLP_COMPRESSION, compression, env)
    compression_value = (compression_value or DEFAULT_COMPRESSION).lower()
    if compression_value not in COMPRESSIONS:
        raise ConfigError(
            f"{compression_source}: compression must be one of {COMPRESSIONS}, "
            f"got {compression_value!r}"
        )

    if timeout_s is not None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        timeout_value = float(timeout_s)
    else:  # the variables are milliseconds: the setting reads them as seconds, names a bad one
        found_s, _ = settings.OTLP_TIMEOUT_S.lookup(env)
        timeout_value = DEFAULT_TIMEOUT_S if found_s is None else found_s
    return ExporterConfig(
        protocol=protocol_value,
        endpoint=endpoint_value,
        headers=headers_value,
        compression=compression_value,
        timeout_s=timeout_value,
        certificate_file=_tls_file(certificate_file, settings.OTLP_CERTIFICATE, env),
        client_key_file=_tls_file(client_key_file, settings.OTLP_CLIENT_KEY, env),
        client_certificate_file=_tls_file(
            client_certificate_file, settings.OTLP_CLIENT_CERTIFICATE, env
        ),
    )


def _tls_file(
    argument: str | None, setting: settings.Setting[str], environ: Mapping[str, str]
) -> str | None:
    """A TLS file path from the argument or the variables; it must exist."""
    value, source = _pick(setting, argument, environ)
    if value is None:
        return None
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
