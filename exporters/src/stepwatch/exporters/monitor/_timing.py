"""The timing part of a monitor: its clock, its cadence, its step buffer, phase sampling, and
how a window's histograms are kept.

:func:`resolve_timing` resolves each from its argument, else its variable, else the default:
``export_interval_s`` (``OTEL_METRIC_EXPORT_INTERVAL``, 10 s), ``buffer_steps`` (4,096 steps per
second of interval), ``phase_sampling`` (``"auto"``: ``_sampling``), ``histogram_buckets``
(``STEPWATCH_HISTOGRAM_BUCKETS``, exponential), the temporality
(``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``, delta) and the histograms' scale and
size. A bad argument raises :class:`ConfigError`; a bad variable is logged and taken as unset.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from stepwatch.core import settings
from stepwatch.core._errors import ConfigError
from stepwatch.exporters._protocols import Clock
from stepwatch.exporters._recorder import SystemClock
from stepwatch.exporters._sampling import PhaseSampler
from stepwatch.exporters._sdk_env import (
    export_interval,
    logger,
    lookup,
    temporality_preference,
)
from stepwatch.exporters._window import HISTOGRAM_BUCKETS, WindowBuilder, WindowOptions

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

DEFAULT_BUFFER_STEPS: Final = 4096  # per second of export interval (at least this many)


@dataclasses.dataclass(frozen=True)
class Timing:
    """How a monitor times steps and keeps them until they are exported.

    Attributes:
        clock: The monitor's clock (the system clock unless a test passes one).
        interval_s: Seconds between exports.
        buffer_steps: Most finished steps waiting for export.
        sampler: Which steps auto mode times phase by phase.
        max_scale: Finest exponential-histogram scale.
        max_size: Most buckets per histogram.
        window: The histograms' bucket kind and temporality.
    """

    clock: Clock
    interval_s: float
    buffer_steps: int
    sampler: PhaseSampler
    max_scale: int
    max_size: int
    window: WindowOptions

    def window_builder(self, resource: Resource) -> WindowBuilder:
        """The monitor's window builder, for the rank's ``resource``."""
        return WindowBuilder(
            resource, max_scale=self.max_scale, max_size=self.max_size, **self.window
        )


def resolve_timing(
    environ: Mapping[str, str],
    *,
    clock: Clock | None,
    export_interval_s: float | None,
    buffer_steps: int | None,
    phase_sampling: int | str,
    histogram_buckets: str | None,
    max_scale: int,
    max_size: int,
) -> Timing:
    """The timing part from the monitor's arguments (see the module docstring).

    Raises:
        ConfigError: An argument is invalid (the message names it).
    """
    interval_s = export_interval(export_interval_s, environ)
    return Timing(
        clock=clock if clock is not None else SystemClock(),
        interval_s=interval_s,
        buffer_steps=buffer_size(buffer_steps, interval_s, DEFAULT_BUFFER_STEPS),
        sampler=PhaseSampler(phase_sampling, export_interval_s=interval_s),
        max_scale=max_scale,
        max_size=max_size,
        window=window_options(histogram_buckets, environ),
    )


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


def resolve_histogram_buckets(argument: str | None, environ: Mapping[str, str]) -> str:
    """The argument > ``STEPWATCH_HISTOGRAM_BUCKETS`` > ``exponential`` (docs/storage.md).

    Raises:
        ConfigError: the argument is not ``exponential`` or ``explicit`` (a bad variable is
            logged and treated as unset, like the OpenTelemetry variables).
    """
    if argument is not None:
        if argument not in HISTOGRAM_BUCKETS:
            raise ConfigError(
                f"histogram_buckets must be one of {HISTOGRAM_BUCKETS}, got {argument!r}"
            )
        return argument
    found, source = lookup(settings.HISTOGRAM_BUCKETS, environ)
    if found is None:
        return str(settings.HISTOGRAM_BUCKETS.default)
    value = str(found).strip().lower()
    if value not in HISTOGRAM_BUCKETS:
        logger.warning(
            "%s must be one of %s, got %r; ignored (treated as unset)",
            source,
            HISTOGRAM_BUCKETS,
            found,
        )
        return str(settings.HISTOGRAM_BUCKETS.default)
    return value


def window_options(histogram_buckets: str | None, environ: Mapping[str, str]) -> WindowOptions:
    """The :class:`~stepwatch.exporters.WindowBuilder` options a monitor resolves.

    ``histogram_buckets`` as :func:`resolve_histogram_buckets`; ``temporality`` from
    ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` (:func:`temporality_preference`).
    """
    return WindowOptions(
        histogram_buckets=resolve_histogram_buckets(histogram_buckets, environ),
        temporality=temporality_preference(environ),
    )
