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

import functools
import importlib.util
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from stepwatch.core._errors import ConfigError
from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters import _cext

_fastrecord = _cext.fastrecord  # C helpers (exporters/csrc/fastrecord.c); None: not built or off

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.resources import Resource


EVENT_POOL = 32768
"""Most CUDA events a :class:`CudaEventTimer` keeps for reuse (about what 10 s of 2 ms steps
hold in flight at ~3.5 marks a step; more than that are made and destroyed as before)."""


class DeviceTimer(Protocol):
    """Timestamps taken in the device's execution order."""

    def mark(self) -> Any:
        """Enqueue a timestamp at this point of the stream (training thread; non-blocking)."""

    def ready(self, mark: Any) -> bool:
        """Whether the device has passed ``mark`` (export thread; non-blocking)."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Device time between two ready marks, in seconds."""


class CudaEventTimer:
    """A :class:`DeviceTimer` on CUDA timing events recorded in the current stream.

    A mark is a ``torch.Event("cuda", enable_timing=True)`` recorded with no stream argument,
    which records on the current stream in C++, made and recorded by
    ``_fastrecord.EventMarker`` without a Python frame where the extension is built. Where
    ``torch.Event`` is missing or refuses (older torch), ``torch.cuda.Event``, whose
    ``record()`` builds a ``Stream`` object in Python for each mark.

    Args:
        pool: The C marker keeps up to this many events and records one again once no step
            or interval holds it (the export thread has timed it), instead of making a new
            CUDA event for each mark and destroying it later; 0 makes one each time.

    Raises:
        ConfigError: torch or CUDA is not available.
    """

    mark: Callable[[], Any]
    """Enqueue a timestamp at this point of the current stream (training thread)."""

    def __init__(self, *, pool: int = EVENT_POOL) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ConfigError("device_timer='cuda' needs torch") from exc
        if not torch.cuda.is_available():
            raise ConfigError("device_timer='cuda' needs a CUDA device; none is available")
        self._event_type: Any = torch.cuda.Event
        self.mark = self._cuda_event_mark
        self.kind = "torch.cuda.Event"
        marker = _event_marker(getattr(torch, "Event", None), pool)
        if marker is not None:
            self.mark, self.kind = marker

    def _cuda_event_mark(self) -> Any:
        event = self._event_type(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: Any) -> bool:
        """``event.query()``: True once the device has executed up to the event."""
        return bool(mark.query())

    def elapsed_s(self, start: Any, end: Any) -> float:
        """``start.elapsed_time(end)`` (milliseconds) in seconds."""
        return float(start.elapsed_time(end)) / 1000.0


def _event_marker(event_type: Any, pool: int = 0) -> tuple[Callable[[], Any], str] | None:
    """A mark() on ``torch.Event`` (C++ all the way) and its name, or None where it does not
    work here: two marks are made, waited for and timed once, at set-up."""
    if event_type is None:
        return None
    try:
        factory = functools.partial(event_type, "cuda", enable_timing=True)
        marker: Callable[[], Any]
        if _fastrecord is not None:
            marker = _fastrecord.EventMarker(factory, pool)
            kind = "torch.Event (C marker, pool)" if pool else "torch.Event (C marker)"
        else:

            def marker() -> Any:
                event = factory()
                event.record()
                return event

            kind = "torch.Event"
        first, second = marker(), marker()
        second.synchronize()
        if not (first.query() and float(first.elapsed_time(second)) >= 0.0):
            return None
        return marker, kind
    except Exception:
        return None


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
