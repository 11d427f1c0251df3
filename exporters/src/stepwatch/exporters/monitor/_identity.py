"""Who the rank is: the monitor's resource from its arguments, torchrun's and OTel's variables.

Each of ``job_id``, ``rank``, ``world_size`` and ``local_rank`` is the argument when given, else
what torchrun set for every worker (``TORCHELASTIC_RUN_ID``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``); ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` add to the resource
(``_sdk_env`` parses them; the arguments win), which always has a ``service.instance.id``.
Unlike a bad OTel variable, a bad identity raises :class:`ConfigError` at construction: a wrong
rank would corrupt every per-rank series.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from stepwatch.core import _schema, settings
from stepwatch.core._errors import ConfigError
from stepwatch.exporters._sdk_env import (
    SERVICE_INSTANCE_ID,
    environment_attributes,
    instance_id,
    logger,
    resolve_service_name,
)
from stepwatch.exporters._window import build_resource

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

#: torchrun's ``--rdzv-id`` default: not a job id.
_NO_RUN_ID: Final = "none"


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
