"""The real :class:`~stepwatch.exporters.kernels.CuptiBackend`, on NVIDIA's ``cupti-python``.

Besides switching activity kinds on and off it can take CUPTI out of the process again
(:meth:`CuptiPythonBackend.detach`, ``cuptiFinalize``). Why: on an H200 (issue 15, nineteenth
round) a tiny kernel's launch took 7.35 µs before CUPTI was first enabled, 8.5–9.8 µs with its
activity kinds on, and 8.3–9.4 µs after they were disabled again. Disabling the kinds does not
give the launch its cost back; only detaching does (PyTorch's Kineto tears CUPTI down after
each profiling session for the same reason: its ``TEARDOWN_CUPTI``, on by default from CUDA
12.6).

``cuptiFinalize`` races with any thread that is inside a CUPTI call, so CUPTI's documentation
asks for it at the exit of a CUDA driver or runtime API call, from a callback. The detach
therefore subscribes a callback to both API domains and finalizes at the first exit it sees,
after a forced flush that hands every record still buffered to the source. CUPTI keeps one
subscriber per process: where another tool holds it (Kineto during a ``torch.profiler``
session), the subscription fails and the caller falls back to disabling the kinds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stepwatch.core._errors import ConfigError
from stepwatch.exporters.kernels._cupti_records import (
    ActivityColumns,
    ActivityRecord,
    activities_to_columns,
)

_log = logging.getLogger(__name__)


class CuptiPythonBackend:
    """:class:`CuptiBackend` on NVIDIA's ``cupti-python`` package (``pip install cupti-python``).

    Args:
        buffer_size_bytes: Size of each activity buffer CUPTI asks for.
    """

    def __init__(self, *, buffer_size_bytes: int = 8 << 20) -> None:
        if buffer_size_bytes < 1 << 16:
            raise ConfigError(f"buffer_size_bytes must be >= 65536, got {buffer_size_bytes}")
        self._buffer_size_bytes = buffer_size_bytes
        self._kinds: list[Any] = []
        self._registered = False  # buffer callbacks registered with the CUPTI now loaded

    def enable(
        self, on_records: Callable[[Sequence[ActivityRecord] | ActivityColumns], None]
    ) -> None:
        """Register the buffer callbacks and enable the activity kinds; each completed buffer
        reaches ``on_records`` as :class:`ActivityColumns`. The callbacks are registered once
        per CUPTI load: after :meth:`disable` this only enables the kinds again (the export
        thread may be flushing through the registered ones); after :meth:`detach` it attaches
        CUPTI again (its first call initialises it) and registers them anew."""
        from cupti import cupti

        def buffer_requested() -> tuple[int, int]:
            return self._buffer_size_bytes, 0

        activity_kind = cupti.ActivityKind
        kinds: dict[Any, str] = {}
        for member, kind in (
            (activity_kind.CONCURRENT_KERNEL, "kernel"),
            (activity_kind.KERNEL, "kernel"),
            (activity_kind.MEMCPY, "memcpy"),
            (activity_kind.MEMCPY2, "memcpy2"),
            (activity_kind.MEMSET, "memset"),
        ):
            # Keyed by the member and its int: ``activity.kind`` is found without int().
            kinds[member] = kinds[int(member)] = kind

        def buffer_completed(activities: Sequence[Any]) -> None:
            on_records(activities_to_columns(activities, kinds=kinds))

        if not self._registered:
            cupti.activity_register_callbacks(buffer_requested, buffer_completed)
            self._registered = True
        self._kinds = [
            activity_kind.CONCURRENT_KERNEL,
            activity_kind.MEMCPY,
            activity_kind.MEMCPY2,
            activity_kind.MEMSET,
        ]
        for kind in self._kinds:
            cupti.activity_enable(kind)

    def flush(self) -> None:
        """``cuptiActivityFlushAll`` with the forced flag: partial buffers are delivered too."""
        from cupti import cupti

        cupti.activity_flush_all(1)

    def timestamp_ns(self) -> int:
        """``cuptiGetTimestamp``."""
        from cupti import cupti

        return int(cupti.get_timestamp())

    def disable(self) -> None:
        """Disable every kind enabled by :meth:`enable`."""
        from cupti import cupti

        for kind in self._kinds:
            cupti.activity_disable(kind)
        self._kinds = []

    def detach(self, on_detached: Callable[[float | None], None]) -> None:
        """Disable the kinds now and take CUPTI out of the process at the next CUDA API exit.

        At the first driver or runtime API exit on any thread, the callback flushes (every
        record reaches ``on_records``), unsubscribes, calls ``cuptiFinalize`` and then
        ``on_detached`` with the seconds that took (``None`` where a call failed: CUPTI's
        state is then unknown). Until then the caller must make no CUPTI call: any call
        attaches CUPTI again. The callback never raises into the CUDA call it rides on.

        Raises:
            Exception: The subscription failed (another subscriber holds CUPTI); the kinds
                are disabled and CUPTI stays attached.
        """
        from cupti import cupti

        self.disable()
        lock = threading.Lock()
        done: list[bool] = []
        exit_site = int(cupti.ApiCallbackSite.API_EXIT)
        subscriber: list[Any] = []

        def at_api_call(_userdata: Any, _domain: Any, _cbid: Any, data: Any) -> None:
            try:
                if done or int(getattr(data, "callback_site", -1)) != exit_site:
                    return
                if not subscriber or not lock.acquire(blocking=False):
                    return  # another thread is finalizing, or the subscription is not set up
            except Exception:
                return
            try:
                if done:
                    return
                done.append(True)
                begin = time.perf_counter()
                try:
                    cupti.activity_flush_all(1)
                    cupti.unsubscribe(subscriber[0])
                    cupti.finalize()
                    self._registered = False
                except Exception:
                    _log.warning("CUPTI detach (cuptiFinalize) failed", exc_info=True)
                    took: float | None = None
                else:
                    took = time.perf_counter() - begin
                try:
                    on_detached(took)
                except Exception:
                    _log.warning("CUPTI detach: the source's hand-over failed", exc_info=True)
            finally:
                lock.release()

        handle = cupti.subscribe(at_api_call, None)
        try:
            cupti.enable_domain(1, handle, cupti.CallbackDomain.RUNTIME_API)
            cupti.enable_domain(1, handle, cupti.CallbackDomain.DRIVER_API)
        except Exception:
            cupti.unsubscribe(handle)
            raise
        subscriber.append(handle)
