"""What CUPTI hands over: activity records, one object each or as columns.

cupti-python's buffer callback hands each completed buffer's activity objects over; the source
keeps the four fields its summary needs of each (:class:`ActivityColumns`, flat lists: no
object per record), or takes :class:`ActivityRecord` objects from a backend that builds them
(the tests' fakes). :func:`activities_to_columns` is the buffer callback's loop,
:func:`activity_to_record` the same conversion one record at a time. Both the source
(``_cupti``) and the real backend (``_cupti_backend``) use these; neither imports the other
for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

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


class ActivityColumns:
    """Activity records as four parallel lists, in arrival order.

    Values are kept as cupti-python reports them (ints, kernel names as ``str``); the export
    thread converts them.

    Args:
        names: Record names (kernel names, ``Memcpy HtoD`` style names).
        starts: Device start, nanoseconds on CUPTI's clock.
        ends: Device end.
        devices: GPU ordinal.
    """

    __slots__ = ("devices", "ends", "names", "starts")

    def __init__(
        self,
        names: list[Any] | None = None,
        starts: list[Any] | None = None,
        ends: list[Any] | None = None,
        devices: list[Any] | None = None,
    ) -> None:
        self.names: list[Any] = [] if names is None else names
        self.starts: list[Any] = [] if starts is None else starts
        self.ends: list[Any] = [] if ends is None else ends
        self.devices: list[Any] = [] if devices is None else devices

    def __len__(self) -> int:
        return len(self.starts)

    def __repr__(self) -> str:
        return f"ActivityColumns({len(self)} records)"

    def head(self, count: int) -> ActivityColumns:
        """The first ``count`` records (a copy)."""
        return ActivityColumns(
            self.names[:count], self.starts[:count], self.ends[:count], self.devices[:count]
        )

    def extend(self, other: ActivityColumns) -> None:
        """Append ``other``'s records."""
        self.names.extend(other.names)
        self.starts.extend(other.starts)
        self.ends.extend(other.ends)
        self.devices.extend(other.devices)

    def prepend(self, other: ActivityColumns) -> None:
        """Insert ``other``'s records before these."""
        self.names[:0] = other.names
        self.starts[:0] = other.starts
        self.ends[:0] = other.ends
        self.devices[:0] = other.devices


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


def columns_of(records: Sequence[ActivityRecord]) -> ActivityColumns:
    """:class:`ActivityRecord` objects (backends other than the real one) → columns."""
    return ActivityColumns(
        [record.name for record in records],
        [record.start_ns for record in records],
        [record.end_ns for record in records],
        [record.device_id for record in records],
    )
