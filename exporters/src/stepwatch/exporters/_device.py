"""Device-side timing of steps and phases (CUDA events), behind one small Protocol.

On a GPU the host runs ahead of the device: a phase timed with the host clock measures how long
it took to *launch* the work. A :class:`DeviceTimer` puts timestamps into the device's stream
instead; the training thread only enqueues them (non-blocking) and the export thread reads the
elapsed times once the device has passed them, so a window holds only steps the device has
finished. Without a GPU the monitor uses the host clock: ``device_timer="auto"`` picks CUDA
events only when torch is already imported and CUDA is available.

Device health (NVML, ``kernels.HealthSampler``) rides along: :class:`HealthSource` is what a
monitor samples once per window, :func:`with_health` adds its readings to the window.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING, Any, Protocol

from stepwatch.core._errors import ConfigError
from stepwatch.core._ratelog import RateLimitedLog

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.resources import Resource


class DeviceTimer(Protocol):
    """Timestamps taken in the device's execution order."""

    def mark(self) -> Any:
        """Enqueue a timestamp at this point of the stream (training thread; non-blocking)."""

    def ready(self, mark: Any) -> bool:
        """Whether the device has passed ``mark`` (export thread; non-blocking)."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Device time between two ready marks, in seconds."""


class CudaEventTimer:
    """A :class:`DeviceTimer` on ``torch.cuda.Event(enable_timing=True)`` in the current stream.

    Raises:
        ConfigError: torch or CUDA is not available.
    """

    def __init__(self) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ConfigError("device_timer='cuda' needs torch") from exc
        if not torch.cuda.is_available():
            raise ConfigError("device_timer='cuda' needs a CUDA device; none is available")
        self._event_type: Any = torch.cuda.Event

    def mark(self) -> Any:
        """Record a timing event in the current CUDA stream."""
        event = self._event_type(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: Any) -> bool:
        """``event.query()``: True once the device has executed up to the event."""
        return bool(mark.query())

    def elapsed_s(self, start: Any, end: Any) -> float:
        """``start.elapsed_time(end)`` (milliseconds) in seconds."""
        return float(start.elapsed_time(end)) / 1000.0


def resolve_device_timer(device_timer: DeviceTimer | str | None) -> DeviceTimer | None:
    """``"auto"`` → CUDA events when torch is imported and CUDA is available, else None.

    Args:
        device_timer: ``"auto"``, ``"cuda"``, ``"cpu"``/None (host clock only) or a timer.

    Raises:
        ConfigError: An unknown name, or ``"cuda"`` without a CUDA device.
    """
    if device_timer is None or device_timer == "cpu":
        return None
    if device_timer == "cuda":
        return CudaEventTimer()
    if device_timer == "auto":
        torch = sys.modules.get("torch")  # never import torch just to find out
        if torch is None:
            return None
        try:
            available = bool(torch.cuda.is_available())
        except Exception:
            return None
        return CudaEventTimer() if available else None
    if isinstance(device_timer, str):
        raise ConfigError(
            f"device_timer must be 'auto', 'cuda', 'cpu' or a DeviceTimer, got {device_timer!r}"
        )
    return device_timer


class HealthSource(Protocol):
    """Device-health readings for a window (e.g. ``kernels.HealthSampler`` over NVML)."""

    def sample(self) -> None:
        """Read the devices now (export thread); never raises."""

    def build(self, *, start_unix_nano: int, end_unix_nano: int) -> MetricsData | None:
        """The readings since the last build as metrics of this rank's resource."""


def resolve_health(health: HealthSource | bool | None, resource: Resource) -> HealthSource | None:
    """``False`` → None; ``None`` → an NVML sampler when ``pynvml`` is installed; ``True`` → one."""
    from stepwatch.exporters.kernels._nvml import HealthSampler

    if health is False:
        return None
    if health is None or health is True:
        if health is None and importlib.util.find_spec("pynvml") is None:
            return None
        return HealthSampler(resource)
    return health


def with_health(
    health: HealthSource | None,
    metrics: MetricsData,
    start_unix_nano: int,
    end_unix_nano: int,
    log: RateLimitedLog,
) -> MetricsData:
    """``metrics`` plus this window's device-health scope (one request per window)."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics

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
