"""The OpenTelemetry SDK variables a StepMonitor honours, and who the rank is under torchrun.

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
does the same for the exporter's variables but TLS files). Identity is the exception: a bad
``RANK`` raises :class:`ConfigError` at construction, because a wrong rank would corrupt every
per-rank series.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, cast

from stepwatch.core import _schema, settings
from stepwatch.core._errors import ConfigError
from stepwatch.exporters._recorder import _NULL_CONTEXT
from stepwatch.exporters._window import build_resource

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

logger = logging.getLogger("stepwatch.exporters")

SERVICE_INSTANCE_ID: Final = "service.instance.id"
DEFAULT_SERVICE_NAME: Final = "stepwatch"
#: torchrun's ``--rdzv-id`` default: not a job id.
_NO_RUN_ID: Final = "none"
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


def with_environment(resource: Resource, attributes: Mapping[str, str]) -> Resource:
    """``resource`` plus the environment's attributes and ``service.instance.id``.

    The resource's own keys (the schema's, set from arguments and torchrun) win; ``stepwatch.*``
    keys from the environment are ignored with a warning (they would contradict the
    arguments). ``service.instance.id`` comes from the attributes or :func:`instance_id`.
    """
    from opentelemetry.sdk.resources import Resource

    merged: dict[str, str | int] = {}
    for key, value in resource.attributes.items():
        if isinstance(value, (str, int)):
            merged[key] = value
    ignored = sorted(key for key in attributes if key.startswith("stepwatch."))
    if ignored:
        logger.warning(
            "OTEL_RESOURCE_ATTRIBUTES keys %s ignored: stepwatch.* attributes come from the "
            "StepMonitor arguments (or torchrun's variables)",
            ", ".join(ignored),
        )
    for key, value in attributes.items():
        if key not in merged and key not in ignored:
            merged[key] = value
    merged.setdefault(SERVICE_INSTANCE_ID, instance_id())
    return Resource(merged)


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


def identity(
    *,
    job_id: str | None,
    rank: int | None,
    world_size: int | None,
    local_rank: int | None,
    environ: Mapping[str, str],
) -> tuple[str, int, int, int | None]:
    """(job id, rank, world size, local rank): each argument > torchrun's variable.

    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``TORCHELASTIC_RUN_ID`` are what torchrun sets
    for every worker. Without any (a single process): rank 0 of 1.

    Raises:
        ConfigError: No job id (neither the argument nor ``TORCHELASTIC_RUN_ID``), only one of
            rank and world size, or a variable that is not an integer (the message names it).
    """
    if job_id is None:
        found, _ = settings.TORCHRUN_RUN_ID.lookup(environ)
        if found is not None and found != _NO_RUN_ID:
            job_id = found
    if job_id is None:
        raise ConfigError(
            "job_id not given and TORCHELASTIC_RUN_ID not set (torchrun sets it from --rdzv-id)"
        )
    if rank is None:
        rank, _ = settings.TORCHRUN_RANK.lookup(environ)
    if world_size is None:
        world_size, _ = settings.TORCHRUN_WORLD_SIZE.lookup(environ)
    if rank is None and world_size is None:
        rank, world_size = 0, 1
    elif rank is None:
        raise ConfigError("world_size given but no rank (argument or RANK)")
    elif world_size is None:
        raise ConfigError("rank given but no world_size (argument or WORLD_SIZE)")
    if local_rank is None:
        local_rank, _ = settings.TORCHRUN_LOCAL_RANK.lookup(environ)
    return job_id, rank, world_size, local_rank


def rank_resource(
    environ: Mapping[str, str],
    *,
    job_id: str | None,
    rank: int | None,
    world_size: int | None,
    host_name: str | None,
    local_rank: int | None,
    dp_rank: int | None,
    tp_rank: int | None,
    pp_rank: int | None,
    service_name: str | None,
) -> Resource:
    """The monitor's resource: arguments > torchrun's and OTel's variables > defaults.

    Raises:
        ConfigError: as :func:`identity` and ``build_resource``.
    """
    job_id, rank, world_size, local_rank = identity(
        job_id=job_id, rank=rank, world_size=world_size, local_rank=local_rank, environ=environ
    )
    attributes = environment_attributes(environ)
    resource = build_resource(
        job_id=job_id,
        rank=rank,
        world_size=world_size,
        host_name=host_name if host_name is not None else attributes.get(_schema.HOST_NAME),
        local_rank=local_rank,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        service_name=resolve_service_name(service_name, attributes, environ),
    )
    return with_environment(resource, attributes)


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
    try:
        interval_s, _ = settings.METRIC_EXPORT_INTERVAL_S.lookup(environ)
    except ConfigError as exc:
        logger.warning("%s; ignored (treated as unset)", exc)
        interval_s = None
    return _DEFAULT_INTERVAL_S if interval_s is None else interval_s


def buffer_size(argument: int | None, interval_s: float, per_second: int) -> int:
    """The argument, else ``per_second`` steps per second of export interval (at least one s).

    Raises:
        ConfigError: the argument is not a positive integer.
    """
    if argument is None:
        return per_second * max(1, math.ceil(interval_s))
    if isinstance(argument, bool) or not isinstance(argument, int) or argument < 1:
        raise ConfigError(f"buffer_steps must be a positive integer, got {argument!r}")
    return argument


class NullPhases(dict[str, Any]):
    """A disabled monitor's phase contexts: every name is the null context."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        """The null context, whatever the name."""
        return _NULL_CONTEXT


class NoHooks:
    """What ``instrument()`` returns when the SDK is disabled: no hooks to remove."""

    communication_timed = False

    def open_phase(self) -> None:
        """Never in a phase."""
        return None

    def remove(self) -> None:
        """Nothing to remove."""
        return None
