"""GPU kernel source: CUPTI activity records (kernels, memcpy, memset, NCCL kernels).

The real CUPTI calls (``cupti-python``: ``cupti.cupti.activity_register_callbacks``,
``activity_enable``, ``activity_flush_all``, ``get_timestamp``) sit behind the small
:class:`CuptiBackend` Protocol. CUPTI fills its buffers asynchronously and hands completed
buffers to a callback on its own worker thread, so the training thread only records step
boundaries (one timestamp each); classification and summarising happen in
:meth:`CuptiSource.drain` on the export thread. If any backend call fails (no GPU, no
``cupti`` package, another tool owns CUPTI), the failure is logged once and the source turns into
a no-op: the training loop never notices.

Step attribution: a device record belongs to the step during whose host-side span it *started*
on the device (CUPTI timestamps and step boundaries both come from CUPTI's clock). Records that
start after the last boundary wait for the next drain. Kernels of an asynchronous step that run
past the host-side boundary are attributed to the next step; histograms per window are
unaffected, and device idle is computed per step on the device timeline.

CUPTI activity reference: https://docs.nvidia.com/cupti/api/group__CUPTI__ACTIVITY__API.html
and the cupti-python bindings: https://docs.nvidia.com/cupti-python/
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._window import KernelWindow
from stepwatch.exporters.kernels._summary import DEFAULT_TOP_K, KernelEvent, KernelSummariser

_log = logging.getLogger(__name__)

# CUpti_ActivityMemcpyKind → the names Kineto (and so the trace reader) uses.
MEMCPY_KIND_NAMES = {
    0: "Memcpy Unknown",
    1: "Memcpy HtoD",
    2: "Memcpy DtoH",
    3: "Memcpy HtoA",
    4: "Memcpy AtoH",
    5: "Memcpy AtoA",
    6: "Memcpy AtoD",
    7: "Memcpy DtoA",
    8: "Memcpy DtoD",
    9: "Memcpy HtoH",
    10: "Memcpy PtoP",
}


class ActivityRecord(NamedTuple):
    """What the source needs of one CUPTI activity record (CUPTI timestamps, nanoseconds).

    Attributes:
        kind: ``kernel``, ``memcpy`` or ``memset``.
        name: Kernel name, or ``Memcpy HtoD`` / ``Memset`` style names for copies and sets.
        start_ns: Device start.
        end_ns: Device end.
        device_id: GPU ordinal.
        stream_id: CUDA stream.
        correlation_id: Links the record to its launching runtime call.
    """

    kind: str
    name: str
    start_ns: int
    end_ns: int
    device_id: int
    stream_id: int
    correlation_id: int


class CuptiBackend(Protocol):
    """The CUPTI calls the source makes; :class:`CuptiPythonBackend` is the real one."""

    def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
        """Register buffer callbacks and enable kernel / memcpy / memset activity.

        ``on_records`` is called (on any thread) with the records of each completed buffer.
        """

    def flush(self) -> None:
        """Complete all buffers now (``cuptiActivityFlushAll``), delivering their records."""

    def timestamp_ns(self) -> int:
        """Now on CUPTI's clock (``cuptiGetTimestamp``)."""

    def disable(self) -> None:
        """Disable activity collection."""


# CUpti_ActivityKind values (cupti_activity.h); cupti-python reports ``kind`` as these ints.
# The real backend rebuilds this map from ``cupti.ActivityKind`` so it never depends on them.
DEFAULT_ACTIVITY_KINDS: Mapping[int, str] = {
    1: "memcpy",  # CUPTI_ACTIVITY_KIND_MEMCPY
    2: "memset",  # CUPTI_ACTIVITY_KIND_MEMSET
    3: "kernel",  # CUPTI_ACTIVITY_KIND_KERNEL
    10: "kernel",  # CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
    22: "memcpy2",  # CUPTI_ACTIVITY_KIND_MEMCPY2 (peer to peer)
}


def activity_to_record(
    activity: Any, *, kinds: Mapping[int, str] = DEFAULT_ACTIVITY_KINDS
) -> ActivityRecord | None:
    """Convert a cupti-python activity object; ``None`` for kinds the source ignores.

    Reads ``kind``, ``start``, ``end``, ``device_id``, ``stream_id``, ``correlation_id`` and,
    per kind, ``name`` (kernels) or ``copy_kind`` (memcpy).

    Args:
        activity: An activity object from the buffer-completed callback.
        kinds: ``CUpti_ActivityKind`` int → ``kernel``, ``memcpy``, ``memcpy2``, ``memset``.
    """
    kind = kinds.get(int(activity.kind))
    if kind == "kernel":
        name = str(activity.name)
    elif kind == "memcpy":
        name = MEMCPY_KIND_NAMES.get(int(activity.copy_kind), "Memcpy Unknown")
    elif kind == "memcpy2":
        kind, name = "memcpy", "Memcpy PtoP"
    elif kind == "memset":
        name = "Memset"
    else:
        return None
    return ActivityRecord(
        kind,
        name,
        int(activity.start),
        int(activity.end),
        int(activity.device_id),
        int(activity.stream_id),
        int(activity.correlation_id),
    )


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

    def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
        """Register the buffer callbacks and enable the activity kinds."""
        from cupti import cupti

        def buffer_requested() -> tuple[int, int]:
            return self._buffer_size_bytes, 0

        activity_kind = cupti.ActivityKind
        kinds = {
            int(activity_kind.CONCURRENT_KERNEL): "kernel",
            int(activity_kind.KERNEL): "kernel",
            int(activity_kind.MEMCPY): "memcpy",
            int(activity_kind.MEMCPY2): "memcpy2",
            int(activity_kind.MEMSET): "memset",
        }

        def buffer_completed(activities: Sequence[Any]) -> None:
            records = []
            for activity in activities:
                record = activity_to_record(activity, kinds=kinds)
                if record is not None:
                    records.append(record)
            on_records(records)

        cupti.activity_register_callbacks(buffer_requested, buffer_completed)
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


class CuptiSource:
    """A :class:`~stepwatch.exporters._window.KernelSource` of CUPTI activity records.

    Args:
        backend: The CUPTI calls (default :class:`CuptiPythonBackend`).
        top_k: Kernel classes kept by name (see :class:`KernelSummariser`).
        max_buffered_records: Records held between drains; beyond it new records are dropped
            and counted in :attr:`dropped_records` (bounded memory if the exporter stalls).

    Raises:
        ConfigError: An option is out of range.
    """

    def __init__(
        self,
        *,
        backend: CuptiBackend | None = None,
        top_k: int = DEFAULT_TOP_K,
        max_buffered_records: int = 2_000_000,
    ) -> None:
        if max_buffered_records < 1:
            raise ConfigError(f"max_buffered_records must be >= 1, got {max_buffered_records}")
        self._backend: CuptiBackend = backend if backend is not None else CuptiPythonBackend()
        self._summariser = KernelSummariser(top_k=top_k)
        self._max_buffered = max_buffered_records
        self._records: list[ActivityRecord] = []
        self._records_lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._boundaries: collections.deque[tuple[int, int]] = collections.deque()
        self._last_boundary_ns: int | None = None
        self._enabled = False
        self._failed = False
        self.dropped_records = 0
        """Records discarded because the buffer bound was reached (cumulative)."""

    @property
    def active(self) -> bool:
        """False once a CUPTI call failed (the source is then a no-op)."""
        return not self._failed

    def _fail(self, what: str) -> None:
        if not self._failed:
            _log.warning(
                "CUPTI %s failed; GPU kernel collection disabled for this process",
                what,
                exc_info=True,
            )
        self._failed = True

    def _ensure_enabled(self) -> bool:
        if self._enabled:
            return True
        if self._failed:
            return False
        try:
            self._backend.enable(self._on_records)
        except Exception:
            self._fail("enable")
            return False
        self._enabled = True
        return True

    def _on_records(self, records: Sequence[ActivityRecord]) -> None:
        with self._records_lock:
            room = self._max_buffered - len(self._records)
            if room < len(records):
                self.dropped_records += len(records) - max(room, 0)
                records = records[: max(room, 0)]
            self._records.extend(records)

    def on_step_end(self, step_index: int) -> None:
        """Step boundary (training thread): one CUPTI timestamp and an append."""
        if self._failed:
            return
        try:
            if not self._ensure_enabled():
                return
            self._boundaries.append((step_index, self._backend.timestamp_ns()))
        except Exception:
            self._fail("get_timestamp")

    def drain(self) -> KernelWindow:
        """Records of the steps finished since the last drain (export thread)."""
        with self._drain_lock:
            if self._failed or not self._enabled:
                return self._summariser.drain()
            # Boundaries first: a step that ends while we flush waits for the next drain.
            boundaries = []
            while self._boundaries:
                boundaries.append(self._boundaries.popleft())
            try:
                self._backend.flush()
            except Exception:
                self._fail("activity_flush_all")
                return self._summariser.drain()
            with self._records_lock:
                records, self._records = self._records, []
            carried = self._summarise(records, boundaries)
            if carried:
                with self._records_lock:
                    self._records[:0] = carried
            return self._summariser.drain()

    def _summarise(
        self, records: list[ActivityRecord], boundaries: list[tuple[int, int]]
    ) -> list[ActivityRecord]:
        """Add whole steps to the summariser; return records of the step still running."""
        records.sort(key=lambda record: record.start_ns)
        position = 0
        for _step_index, boundary_ns in boundaries:
            step_start = self._last_boundary_ns
            events: list[KernelEvent] = []
            while position < len(records) and records[position].start_ns <= boundary_ns:
                record = records[position]
                events.append(
                    KernelEvent(
                        record.name,
                        record.start_ns,
                        max(0, record.end_ns - record.start_ns),
                        record.device_id,
                    )
                )
                position += 1
            if step_start is None:
                # The first step's start is unknown (collection began inside it): its kernels
                # count, its idle time does not.
                self._summariser.add_events(events)
            else:
                self._summariser.add_step(events, start_ns=step_start, end_ns=boundary_ns)
            self._last_boundary_ns = boundary_ns
        return records[position:]

    def close(self) -> None:
        """Disable CUPTI activity collection (records not yet drained are discarded)."""
        if self._enabled and not self._failed:
            try:
                self._backend.disable()
            except Exception:
                self._fail("activity_disable")
        self._enabled = False
