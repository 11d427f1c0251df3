"""OTLP exporter settings: argument > ``OTEL_EXPORTER_OTLP_METRICS_*`` > ``OTEL_EXPORTER_OTLP_*``.

The SDK exporters read the environment themselves, but each in its own way (the Python HTTP
exporter reads ``OTEL_EXPORTER_OTLP_TIMEOUT`` as seconds where the specification says
milliseconds). stepwatch resolves every setting itself, once, when the monitor is built, and
passes explicit values to the exporter (its own OTLP/HTTP exporter, or the SDK's gRPC one), so
the precedence is the specification's and is tested here:
https://opentelemetry.io/docs/specs/otel/protocol/exporter/ ("OTLP Exporter Configuration").

Endpoints, as that section says: ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL to which
``/v1/metrics`` is appended for OTLP/HTTP; ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` "MUST be used
as-is without any modification". For gRPC an endpoint may come without a scheme
(``collector:4317``); ``OTEL_EXPORTER_OTLP_[METRICS_]INSECURE=true`` then means plaintext, else
TLS ("This option only applies to OTLP/gRPC when an endpoint is provided without the http or
https scheme"). ``http/json`` is a valid protocol value; stepwatch sends OTLP/HTTP in protobuf
only, so it is taken as ``http/protobuf`` with one warning (the receiver accepts both).

The variables, their order and their parsing are :mod:`stepwatch.core.settings`'s ``OTLP_*``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import urllib.parse
from collections.abc import Mapping
from typing import Final, cast

from stepwatch.core import settings
from stepwatch.core._errors import ConfigError
from stepwatch.exporters._sdk_env import flag

logger = logging.getLogger("stepwatch.exporters")

PROTOCOLS: Final = ("http/protobuf", "grpc")
#: Valid in the specification, sent as ``http/protobuf`` (one warning).
FALLBACK_PROTOCOLS: Final = {"http/json": "http/protobuf"}
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
    insecure: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> ExporterConfig:
    """Resolve OTLP settings: argument > ``..._METRICS_*`` variable > ``OTEL_EXPORTER_OTLP_*``.

    HTTP endpoints: ``..._METRICS_ENDPOINT`` is used as given (the specification); the
    generic ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL and gets ``/v1/metrics`` appended;
    the ``endpoint`` argument is used as given unless it has no path, in which case
    ``/v1/metrics`` is appended (so ``endpoint="http://bridge:4318"`` works). gRPC endpoints
    may lack the scheme: ``insecure`` (else ``..._INSECURE``) picks ``http://`` (plaintext)
    over ``https://`` (TLS, the default).

    Args:
        endpoint: Collector or bridge URL.
        protocol: ``http/protobuf`` (default), ``grpc``, or ``http/json`` (sent as
            ``http/protobuf``, one warning).
        headers: Request headers; the variables use the ``k1=v1,k2=v2`` URL-encoded form.
        compression: ``none`` (default), ``gzip`` or ``deflate``.
        timeout_s: Per-export bound in seconds; the variables are in milliseconds.
        certificate_file: CA bundle for https (``..._CERTIFICATE``).
        client_key_file: Client key for mutual TLS (``..._CLIENT_KEY``).
        client_certificate_file: Client certificate for mutual TLS (``..._CLIENT_CERTIFICATE``).
        insecure: Plaintext for a scheme-less gRPC endpoint (``..._INSECURE``; default False).
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
    if protocol_value in FALLBACK_PROTOCOLS:
        logger.warning(
            "%s=%s: stepwatch sends OTLP/HTTP as protobuf; using %s",
            protocol_source,
            protocol_value,
            FALLBACK_PROTOCOLS[protocol_value],
        )
        protocol_value = FALLBACK_PROTOCOLS[protocol_value]
    if protocol_value not in PROTOCOLS:
        raise ConfigError(
            f"{protocol_source}: protocol must be one of {PROTOCOLS}, got {protocol_value!r}"
        )

    # How the path is completed for OTLP/HTTP: "base" (always /v1/metrics), "as_is" (the
    # signal-specific variable), "argument" (appended only when there is no path).
    if endpoint is not None:
        endpoint_value, source, path_rule = endpoint, "endpoint", "argument"
    else:
        found, variable = settings.OTLP_ENDPOINT.lookup(env)
        is_signal = variable == settings.OTLP_ENDPOINT.variable
        default = DEFAULT_GRPC_ENDPOINT if protocol_value == "grpc" else DEFAULT_HTTP_ENDPOINT
        endpoint_value = default if found is None else found
        source = variable or "endpoint"
        path_rule = "as_is" if is_signal else "base"
    if protocol_value == "grpc" and "://" not in endpoint_value:
        plaintext = insecure if insecure is not None else flag(settings.OTLP_INSECURE, env)
        endpoint_value = ("http://" if plaintext else "https://") + endpoint_value
    parsed = urllib.parse.urlsplit(endpoint_value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(
            f"{source}: endpoint must be an http:// or https:// URL (a gRPC one may omit the "
            f"scheme), got {endpoint_value!r}"
        )
    if protocol_value == "http/protobuf" and (
        path_rule == "base" or (path_rule == "argument" and parsed.path in ("", "/"))
    ):
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
