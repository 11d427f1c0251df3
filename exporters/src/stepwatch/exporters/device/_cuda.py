"""Device-side timing of steps and phases on CUDA events (:class:`CudaEventTimer`).

On a GPU the host runs ahead of the device: a phase timed with the host clock measures how long
it took to *launch* the work. A :class:`~stepwatch.exporters.DeviceTimer` puts timestamps into
the device's stream instead; the training thread only enqueues them (non-blocking) and the
export thread reads the elapsed times once the device has passed them, so a window holds only
steps the device has finished. Without a GPU the monitor uses the host clock
(``_backends``: which timer ``device_timer="auto"`` picks).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from stepwatch.core._errors import ConfigError
from stepwatch.exporters import _cext

_fastrecord = _cext.fastrecord  # C helpers (exporters/csrc/fastrecord.c); None: not built or off


EVENT_POOL = 32768
"""Most CUDA events a :class:`CudaEventTimer` keeps for reuse (about what 10 s of 2 ms steps
hold in flight at ~3.5 marks a step; more than that are made and destroyed as before)."""


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


def probe() -> CudaEventTimer | None:
    """A timer when torch is already imported and CUDA is available, else None (``"auto"``)."""
    torch = sys.modules.get("torch")  # never import torch just to find out
    if torch is None:
        return None
    try:
        available = bool(torch.cuda.is_available())
    except Exception:
        return None
    return CudaEventTimer() if available else None
