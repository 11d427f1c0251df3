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

The callback keeps four fields of each record in flat lists (:class:`ActivityColumns`, no
object per record); the export thread summarises them on numpy arrays
(:func:`summarise_bulk`), or per event when numpy is missing or the bulk path fails (logged
once); both give the same windows.

CUPTI activity reference: https://docs.nvidia.com/cupti/api/group__CUPTI__ACTIVITY__API.html
and the cupti-python bindings: https://docs.nvidia.com/cupti-python/
"""

from __future__ import annotations

import collections
import logging
import operator
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._window import KernelWindow
from stepwatch.exporters.kernels._cupti_columns import ActivityColumns, summarise_bulk
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

    def enable(
        self, on_records: Callable[[Sequence[ActivityRecord] | ActivityColumns], None]
    ) -> None:
        """Register buffer callbacks and enable kernel / memcpy / memset activity.

        ``on_records`` is called (on any thread) with the records of each completed buffer:
        :class:`ActivityRecord` objects, or :class:`ActivityColumns` (the real backend: no
        object per record).
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
    name = _record_name(activity, kind)
    if kind is None or name is None:
        return None
    return ActivityRecord(
        "memcpy" if kind == "memcpy2" else kind,
        name,
        int(activity.start),
        int(activity.end),
        int(activity.device_id),
        int(activity.stream_id),
        int(activity.correlation_id),
    )


def _record_name(activity: Any, kind: str | None) -> str | None:
    """The name of a record of ``kind`` (``None``: a kind the source ignores)."""
    if kind == "kernel":
        return str(activity.name)
    if kind == "memcpy":
        return MEMCPY_KIND_NAMES.get(int(activity.copy_kind), "Memcpy Unknown")
    if kind == "memcpy2":
        return "Memcpy PtoP"
    if kind == "memset":
        return "Memset"
    return None


def activities_to_columns(
    activities: Iterable[Any], *, kinds: Mapping[Any, str] = DEFAULT_ACTIVITY_KINDS
) -> ActivityColumns:
    """Convert a completed buffer's activity objects at once (the buffer callback's loop).

    The records and fields :func:`activity_to_record` gives one by one, without an object per
    record: a kernel costs five attribute reads and four list appends; values stay as
    cupti-python reports them (the export thread converts them).

    Args:
        activities: The activity objects of one buffer.
        kinds: ``CUpti_ActivityKind`` (int or enum member) → ``kernel``, ``memcpy``, ...
    """
    columns = ActivityColumns()
    add_name = columns.names.append
    add_start = columns.starts.append
    add_end = columns.ends.append
    add_device = columns.devices.append
    kind_of = kinds.get
    for activity in activities:
        kind = kind_of(activity.kind)
        if kind == "kernel":
            add_name(activity.name)
        else:
            if kind is None:  # reported in another type than the table's keys
                kind = kind_of(int(activity.kind))
            name = _record_name(activity, kind)
            if name is None:
                continue
            add_name(name)
        add_start(activity.start)
        add_end(activity.end)
        add_device(activity.device_id)
    return columns


def _columns_of(records: Sequence[ActivityRecord]) -> ActivityColumns:
    """:class:`ActivityRecord` objects (backends other than the real one) → columns."""
    return ActivityColumns(
        [record.name for record in records],
        [record.start_ns for record in records],
        [record.end_ns for record in records],
        [record.device_id for record in records],
    )


def _rows(columns: ActivityColumns) -> list[tuple[int, int, int, Any]]:
    """``(start, end, device, name)`` per record, as ints; a record with a value that is no
    int (a field CUPTI did not fill) is left out rather than failing the whole drain."""
    fields = (columns.starts, columns.ends, columns.devices, columns.names)
    try:
        starts, ends, devices = (map(int, values) for values in fields[:3])
        return list(zip(starts, ends, devices, fields[3], strict=True))
    except (TypeError, ValueError, OverflowError):
        pass
    rows = []
    for start, end, device, name in zip(*fields, strict=True):
        try:
            rows.append((int(start), int(end), int(device), name))
        except (TypeError, ValueError, OverflowError):
            continue
    return rows


_START = operator.itemgetter(0)


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

    def enable(
        self, on_records: Callable[[Sequence[ActivityRecord] | ActivityColumns], None]
    ) -> None:
        """Register the buffer callbacks and enable the activity kinds; each completed buffer
        reaches ``on_records`` as :class:`ActivityColumns`."""
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
        self._columns = ActivityColumns()
        self._records_lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._boundaries: collections.deque[tuple[int, int]] = collections.deque()
        self._last_boundary_ns: int | None = None
        self._enabled = False
        self._failed = False
        self._bulk = True  # False once numpy was missing or the bulk path failed
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

    def _on_records(self, records: Sequence[ActivityRecord] | ActivityColumns) -> None:
        columns = records if isinstance(records, ActivityColumns) else _columns_of(records)
        with self._records_lock:
            room = self._max_buffered - len(self._columns)
            if room < len(columns):
                self.dropped_records += len(columns) - max(room, 0)
                columns = columns.head(max(room, 0))
            self._columns.extend(columns)

    def on_monitor_start(self) -> None:
        """Enable CUPTI when the monitor is made, so the first step's kernels are recorded.

        That step's start is unknown to CUPTI: its kernels count and its idle time does not,
        and kernels launched between the monitor's creation and the first step count in it.
        """
        self._ensure_enabled()

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
                columns, self._columns = self._columns, ActivityColumns()
            carried = self._summarise(columns, boundaries)
            if len(carried):
                with self._records_lock:
                    self._columns.prepend(carried)
            return self._summariser.drain()

    def _summarise(
        self, columns: ActivityColumns, boundaries: list[tuple[int, int]]
    ) -> ActivityColumns:
        """Add whole steps to the summariser; return records of the step still running.

        On numpy arrays (:func:`summarise_bulk`) when it can, else per event: the same result.
        """
        if self._bulk:
            bounds = [boundary_ns for _, boundary_ns in boundaries]
            try:
                summary = summarise_bulk(
                    columns, bounds, self._last_boundary_ns, self._summariser.classifier
                )
            except ImportError:
                self._bulk = False
                _log.debug("numpy is not installed: CUPTI records are summarised per event")
            except Exception:
                self._bulk = False
                _log.warning(
                    "bulk summary of CUPTI records failed; summarising them per event from now on",
                    exc_info=True,
                )
            else:
                if summary is not None:
                    self._summariser.add_bulk(summary.durations_s, summary.idle_s)
                    if bounds:
                        self._last_boundary_ns = bounds[-1]
                    return summary.carried
        return self._summarise_events(columns, boundaries)

    def _summarise_events(
        self, columns: ActivityColumns, boundaries: list[tuple[int, int]]
    ) -> ActivityColumns:
        """:meth:`_summarise` one :class:`KernelEvent` at a time (Python ints throughout)."""
        rows = _rows(columns)
        rows.sort(key=_START)
        position = 0
        for _step_index, boundary_ns in boundaries:
            step_start = self._last_boundary_ns
            events: list[KernelEvent] = []
            while position < len(rows) and rows[position][0] <= boundary_ns:
                start, end, device, name = rows[position]
                events.append(KernelEvent(str(name), start, max(0, end - start), device))
                position += 1
            if step_start is None:
                # The first step's start is unknown (collection began inside it): its kernels
                # count, its idle time does not.
                self._summariser.add_events(events)
            else:
                self._summariser.add_step(events, start_ns=step_start, end_ns=boundary_ns)
            self._last_boundary_ns = boundary_ns
        rest = rows[position:]
        return ActivityColumns(
            [row[3] for row in rest],
            [row[0] for row in rest],
            [row[1] for row in rest],
            [row[2] for row in rest],
        )

    def close(self) -> None:
        """Disable CUPTI activity collection (records not yet drained are discarded)."""
        if self._enabled and not self._failed:
            try:
                self._backend.disable()
            except Exception:
                self._fail("activity_disable")
        self._enabled = False
