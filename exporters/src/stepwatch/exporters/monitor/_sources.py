"""The sources part of a monitor: its kernel events, its device's health, its device timer.

:func:`resolve_sources` takes the caller's kernel source as given and resolves ``health`` and
``device_timer`` through the device back ends (``device/_backends``: ``"auto"`` asks each in
turn); :func:`start_sources` starts the kernel source, last, once every other part is
resolved; :meth:`Sources.add_health` adds the health readings to a window.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from stepwatch.exporters._protocols import DeviceTimer, HealthSource, KernelSource
from stepwatch.exporters.device._backends import resolve_device_timer, resolve_health

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.resources import Resource

    from stepwatch.core._ratelog import RateLimitedLog

logger = logging.getLogger("stepwatch.exporters")


@dataclasses.dataclass(frozen=True)
class Sources:
    """What a monitor reads besides its own clock.

    Attributes:
        kernels: Kernel events added to each window, or None.
        health: Device health sampled once per window and sent with it, or None.
        device_timer: Device-side timing of steps and phases, or None (the host clock).
    """

    kernels: KernelSource | None
    health: HealthSource | None
    device_timer: DeviceTimer | None

    def add_health(
        self, metrics: MetricsData, start_unix_nano: int, end_unix_nano: int, log: RateLimitedLog
    ) -> MetricsData:
        """``metrics`` plus this window's device-health scope (one request per window)."""
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics

        health = self.health
        try:
            if health is None:
                return metrics
            health.sample()
            extra = health.build(start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano)
        except Exception:
            log.warning("health", "device-health sampling raised", exc_info=True)
            return metrics
        if extra is None or not extra.resource_metrics:
            return metrics
        window = metrics.resource_metrics[0]
        scopes = [*window.scope_metrics]
        for resource_metrics in extra.resource_metrics:
            scopes.extend(resource_metrics.scope_metrics)
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=window.resource, scope_metrics=scopes, schema_url=window.schema_url
                )
            ]
        )


def resolve_sources(
    resource: Resource,
    *,
    kernel_source: KernelSource | None,
    health: HealthSource | bool | None,
    device_timer: DeviceTimer | str | None,
) -> Sources:
    """The sources part (see the module docstring).

    Raises:
        ConfigError: ``device_timer`` names no back end, or one whose device is not here.
    """
    return Sources(
        kernels=kernel_source,
        health=resolve_health(health, resource),
        device_timer=resolve_device_timer(device_timer),
    )


def start_sources(sources: Sources) -> Sources:
    """Tell the kernel source the monitor starts (``on_monitor_start``: CUPTI from here, so
    the first step counts); the sources the monitor then runs with.

    A source whose ``on_monitor_start`` raises is logged once, with the exception, closed
    (that raising too is logged) and left out: the monitor runs without kernel events rather
    than raise into the code that builds it (docs/exporters.md, "Failure behaviour").
    """
    source = sources.kernels
    start = getattr(source, "on_monitor_start", None)
    if source is None or start is None:
        return sources
    try:
        start()
    except Exception:
        logger.warning(
            "the kernel source %s raised in on_monitor_start; the monitor runs without it",
            type(source).__name__,
            exc_info=True,
        )
        try:
            source.close()
        except Exception:
            logger.warning("closing the kernel source that failed to start raised", exc_info=True)
        return dataclasses.replace(sources, kernels=None)
    return sources
