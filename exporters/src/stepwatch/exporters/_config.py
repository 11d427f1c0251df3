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
from stepwatch.exporters._sdk_env import flag, lookup

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


def _refuse(source: str, message: str, *, from_environment: bool) -> None:
    """An argument's bad value raises; a variable's is logged and then treated as unset.

    OpenTelemetry specification, "Environment Variable Specification" (numeric and enum
    values): a value the implementation cannot use SHOULD produce a warning and be ignored,
    i.e. treated as not set. A monitor built in a training script therefore never dies of a
    typo in the environment; the warning names the variable.
    """
    if not from_environment:
        raise ConfigError(f"{source}: {message}")
    logger.warning("%s: %s; ignored (treated as unset)", source, message)


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

    A bad argument raises; a bad variable is logged (naming it) and treated as unset, as the
    specification says, so the default applies. Exception: a TLS file that does not exist
    raises, wherever it comes from (see :func:`_tls_file`).

    Args:
        endpoint: Collector or bridge URL.
        protocol: ``http/protobuf`` (default), ``grpc``, or ``http/json`` (sent as
            ``http/protobuf``, one warning).
        headers: Request headers; the variables use the ``k1=v1,k2=v2`` URL-encoded form.
        compression: ``none``, ``gzip`` (default) or ``deflate``.
        timeout_s: Per-export bound in seconds; the variables are in milliseconds.
        certificate_file: CA bundle for https (``..._CERTIFICATE``).
        client_key_file: Client key for mutual TLS (``..._CLIENT_KEY``).
        client_certificate_file: Client certificate for mutual TLS (``..._CLIENT_CERTIFICATE``).
        insecure: Plaintext for a scheme-less gRPC endpoint (``..._INSECURE``; default False).
        environ: The environment to read (``os.environ`` when omitted).

    Returns:
        The resolved settings.

    Raises:
        ConfigError: An argument is not valid, or a TLS file does not exist; the message
            names the argument or variable.
    """
    env = os.environ if environ is None else environ
    if protocol is not None:
        protocol_value, protocol_source, protocol_env = protocol, "protocol", False
    else:
        found, protocol_source = lookup(settings.OTLP_PROTOCOL, env)
        protocol_env = found is not None
        protocol_value = (found or DEFAULT_PROTOCOL).lower()  # enum values: any case
    if protocol_value in FALLBACK_PROTOCOLS:
        logger.warning(
            "%s=%s: stepwatch sends OTLP/HTTP as protobuf; using %s",
            protocol_source,
            protocol_value,
            FALLBACK_PROTOCOLS[protocol_value],
        )
        protocol_value = FALLBACK_PROTOCOLS[protocol_value]
    if protocol_value not in PROTOCOLS:
        _refuse(
            protocol_source,
            f"protocol must be one of {PROTOCOLS}, got {protocol_value!r}",
            from_environment=protocol_env,
        )
        protocol_value = DEFAULT_PROTOCOL

    endpoint_value = _endpoint(endpoint, protocol_value, insecure, env)

    if headers is not None:
        headers_value = {str(k): str(v) for k, v in headers.items()}
    else:
        raw, source = lookup(settings.OTLP_HEADERS, env)
        headers_value = _parse_headers(raw, source) if raw else {}

    if compression is not None:
        compression_value, compression_source, compression_env = compression, "compression", False
    else:
        found, compression_source = lookup(settings.OTLP_COMPRESSION, env)
        compression_value, compression_env = found or DEFAULT_COMPRESSION, found is not None
    compression_value = compression_value.lower()
    if compression_value not in COMPRESSIONS:
        _refuse(
            compression_source,
            f"compression must be one of {COMPRESSIONS}, got {compression_value!r}",
            from_environment=compression_env,
        )
        compression_value = DEFAULT_COMPRESSION

    if timeout_s is not None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        timeout_value = float(timeout_s)
    else:  # the variables are milliseconds: the setting reads them as seconds
        found_s, _ = lookup(settings.OTLP_TIMEOUT_S, env)
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


def _endpoint(
    argument: str | None, protocol: str, insecure: bool | None, environ: Mapping[str, str]
) -> str:
    """The full endpoint URL (the path rules are :func:`resolve_exporter_config`'s)."""
    default = DEFAULT_GRPC_ENDPOINT if protocol == "grpc" else DEFAULT_HTTP_ENDPOINT
    # How the path is completed for OTLP/HTTP: "base" (always /v1/metrics), "as_is" (the
    # signal-specific variable), "argument" (appended only when there is no path).
    if argument is not None:
        value, source, path_rule = argument, "endpoint", "argument"
    else:
        found, source = lookup(settings.OTLP_ENDPOINT, environ)
        value = default if found is None else found
        path_rule = "as_is" if source == settings.OTLP_ENDPOINT.variable else "base"
    if protocol == "grpc" and "://" not in value:
        plaintext = insecure if insecure is not None else flag(settings.OTLP_INSECURE, environ)
        value = ("http://" if plaintext else "https://") + value
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        _refuse(
            source,
            "endpoint must be an http:// or https:// URL (a gRPC one may omit the scheme), "
            f"got {value!r}",
            from_environment=argument is None,
        )
        value, path_rule, parsed = default, "base", urllib.parse.urlsplit(default)
    if protocol == "http/protobuf" and (
        path_rule == "base" or (path_rule == "argument" and parsed.path in ("", "/"))
    ):
        value = value.rstrip("/") + METRICS_PATH
    return value


def _tls_file(
    argument: str | None, setting: settings.Setting[str], environ: Mapping[str, str]
) -> str | None:
    """A TLS file path from the argument or the variables; it must exist.

    The one variable that raises when bad: ignoring a missing CA bundle or client key would
    silently change whom the exporter trusts or how it authenticates.
    """
    if argument is not None:
        value, source = argument, setting.name
    else:
        found, source = lookup(setting, environ)
        if found is None:
            return None
        value = found
    if not os.path.isfile(value):
        raise ConfigError(f"{source}: no such file {value!r}")
    return value


def _parse_headers(raw: str, source: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` with URL-encoded keys and values (the OTLP exporter env format).

    A malformed value is logged and discarded whole (no headers), like a malformed
    ``OTEL_RESOURCE_ATTRIBUTES``.
    """
    parsed: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _refuse(
                source,
                f"expected key=value pairs, got {item.strip()!r}",
                from_environment=True,
            )
            return {}
        parsed[urllib.parse.unquote(key.strip()).lower()] = urllib.parse.unquote(value.strip())
    return parsed
