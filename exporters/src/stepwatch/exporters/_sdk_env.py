"""The OpenTelemetry SDK variables a StepMonitor honours.

OpenTelemetry specification, "Environment Variable Specification"
(https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/):

* "General SDK Configuration": ``OTEL_SDK_DISABLED`` (boolean; only ``true``, any case, is
  true), ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` ("If ``service.name`` is also
  provided in ``OTEL_RESOURCE_ATTRIBUTES``, then ``OTEL_SERVICE_NAME`` takes precedence").
* "Parsing empty value" / boolean values: anything but ``true`` or ``false`` (any case) is
  false and logs a warning.

``OTEL_RESOURCE_ATTRIBUTES`` follows the Resource SDK section "Specifying resource information
via an environment variable": ``key1=value1,key2=value2``, values percent-decoded, whitespace
around keys and values trimmed; "if the value is not valid ... the entire value SHOULD be
discarded and an error SHOULD be reported" (here: one warning, nothing raised).

Semantic conventions, "Service" (``service.instance.id``): "MUST be unique for each instance
of the same ``service.namespace,service.name`` pair"; a random UUID v4 is recommended. One is
drawn per process (again after a fork) unless ``OTEL_RESOURCE_ATTRIBUTES`` gives one.

Nothing here raises on a bad variable: a value that cannot be honoured is logged and
treated as unset (the specification's rule for numeric, enum and boolean values; ``_config``
does the same for the exporter's variables but TLS files). Who the rank is (torchrun's
variables, which raise when bad) is ``monitor/_identity``'s; it reads the resource variables
through this module.
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import Any, Final, cast

from stepwatch.core import _schema, settings
from stepwatch.core._errors import ConfigError

logger = logging.getLogger("stepwatch.exporters")

SERVICE_INSTANCE_ID: Final = "service.instance.id"
DEFAULT_SERVICE_NAME: Final = "stepwatch"
_TEMPORALITIES: Final = ("cumulative", "delta", "lowmemory")

_DEFAULT_INTERVAL_S: Final = cast(float, settings.METRIC_EXPORT_INTERVAL_S.default)
_instance_lock = threading.Lock()
_instance: tuple[int, str] | None = None  # (pid, uuid): redrawn in a forked child


def flag(setting: settings.Setting[str], environ: Mapping[str, str]) -> bool:
    """An OTel boolean variable: ``true`` (any case) is true; anything else is false.

    A value that is neither ``true`` nor ``false`` logs a warning (specification, "Boolean
    value").
    """
    value, variable = setting.lookup(environ)
    if value is None:
        return False
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        logger.warning("%s=%r is not true or false; taken as false", variable, value)
    return lowered == "true"


def lookup(setting: settings.Setting[Any], environ: Mapping[str, str]) -> tuple[Any, str]:
    """The first variable set (value, its name), or (None, the option's name); a variable that
    does not parse is logged and treated as unset."""
    try:
        value, variable = setting.lookup(environ)
    except ConfigError as exc:
        logger.warning("%s; ignored (treated as unset)", exc)
        return None, setting.name
    return value, variable or setting.name


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    """``OTEL_SDK_DISABLED=true``: the monitor is a no-op."""
    return flag(settings.SDK_DISABLED, environ)


def instance_id() -> str:
    """This process's ``service.instance.id``: a UUID v4 drawn once per process."""
    global _instance
    pid = os.getpid()
    with _instance_lock:
        if _instance is None or _instance[0] != pid:
            _instance = (pid, str(uuid.uuid4()))
        return _instance[1]


def parse_resource_attributes(raw: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` (percent-encoded, W3C Baggage form without properties) as a dict.

    Raises:
        ValueError: a member without ``=``, an empty key, or a bad percent-encoding.
    """
    attributes: dict[str, str] = {}
    for member in raw.split(","):
        if not member.strip():
            continue
        key, sep, value = member.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"expected key=value, got {member.strip()!r}")
        attributes[_decode(key)] = _decode(value.strip())
    return attributes


def _decode(text: str) -> str:
    # unquote() leaves a malformed escape as is; the specification wants it refused.
    index = text.find("%")
    while index != -1:
        escape = text[index + 1 : index + 3]
        if len(escape) != 2 or any(c not in "0123456789abcdefABCDEF" for c in escape):
            raise ValueError(f"bad percent-encoding in {text!r}")
        index = text.find("%", index + 3)
    return urllib.parse.unquote(text, errors="strict")


def environment_attributes(environ: Mapping[str, str]) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES`` parsed; on a parse error one warning and nothing."""
    raw, variable = settings.RESOURCE_ATTRIBUTES.lookup(environ)
    if raw is None:
        return {}
    try:
        return parse_resource_attributes(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        logger.warning("%s discarded: %s", variable, exc)
        return {}


def resolve_service_name(
    argument: str | None, attributes: Mapping[str, str], environ: Mapping[str, str]
) -> str:
    """The argument > ``OTEL_SERVICE_NAME`` > ``service.name`` in the attributes > stepwatch."""
    if argument is not None:
        return argument
    named, _ = settings.SERVICE_NAME.lookup(environ)
    return named or attributes.get(_schema.SERVICE_NAME) or DEFAULT_SERVICE_NAME


def temporality_preference(environ: Mapping[str, str], *, warn: bool = True) -> str:
    """``..._METRICS_TEMPORALITY_PREFERENCE`` as what histograms and counters go out as.

    Specification, OTLP Exporter, "Additional Environment Variable Configuration"
    (https://opentelemetry.io/docs/specs/otel/metrics/sdk_exporters/otlp/): ``cumulative``
    (every instrument cumulative), ``delta`` (counters and histograms delta) or ``lowmemory``
    (counters and histograms delta too; only synchronous up-down counters differ, and
    stepwatch has none), case-insensitive. Unset is ``delta``: unlike an SDK, whose default
    is ``cumulative``, a stepwatch window is the distribution of the steps finished in it and
    the bridge stores windows (docs/exporters.md, "Temporality"). Another value is warned
    about (when ``warn``) and treated as unset, as the specification says for enum values.

    Returns:
        ``cumulative`` or ``delta``.
    """
    value, variable = settings.OTLP_TEMPORALITY_PREFERENCE.lookup(environ)
    if value is None:
        return "delta"
    lowered = value.strip().lower()
    if lowered not in _TEMPORALITIES:
        if warn:
            logger.warning("%s=%r is not one of %s; ignored", variable, value, _TEMPORALITIES)
        return "delta"
    return "cumulative" if lowered == "cumulative" else "delta"


def export_interval(argument: float | None, environ: Mapping[str, str]) -> float:
    """The argument > ``OTEL_METRIC_EXPORT_INTERVAL`` (ms) > 10 s.

    Raises:
        ConfigError: the argument is not positive (a bad variable is logged and ignored).
    """
    if argument is not None:
        if isinstance(argument, bool) or not argument > 0:
            raise ConfigError(f"export_interval_s must be positive, got {argument!r}")
        return float(argument)
    # The variable is milliseconds; the setting reads it as seconds. A bad value is logged
    # and treated as unset (specification, "Environment Variable Specification").
    interval_s, _ = lookup(settings.METRIC_EXPORT_INTERVAL_S, environ)
    return _DEFAULT_INTERVAL_S if interval_s is None else interval_s
