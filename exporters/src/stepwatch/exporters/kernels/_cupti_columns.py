"""The bulk summary of columnar CUPTI records on numpy (the export thread's fast path).

CUPTI's buffer callback appends the four fields the summary needs of each record to flat lists
(:class:`~stepwatch.exporters.kernels._cupti_records.ActivityColumns`) instead of building an
object per record. On the export thread, :func:`summarise_bulk` turns them into numpy arrays and
computes, in a handful of array passes, exactly what
:class:`~stepwatch.exporters.kernels.CuptiSource`'s per-event path feeds
:meth:`KernelSummariser.add_events` / :meth:`KernelSummariser.add_step` with, one
:class:`KernelEvent` at a time:

- step attribution: ``searchsorted`` of the (stably sorted) record starts on the boundaries; a
  record belongs to the first step whose boundary is at or after its start;
- classes: each *distinct* name is classified once, records carry a class index;
- durations: ``max(0, end - start)`` on the 2**-30 s grid, grouped by class in start order;
- device idle: per (step, device) group, sorted by start, the union of the kernel intervals is
  the sum of what each interval adds beyond the running maximum of the ends before it in its
  group (the running maximum never crosses groups).

numpy comes with ``cupti-python`` (the only producer of real records) but is not a dependency of
stepwatch-exporters: it is imported lazily here, and the source falls back to its per-event
path when it is missing or when anything here fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from stepwatch.exporters.kernels._cupti_records import ActivityColumns
from stepwatch.exporters.kernels._names import KernelClass
from stepwatch.exporters.kernels._summary import _QUANTA_PER_NS, _QUANTA_PER_S

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# Every timestamp must lie in [0, 2**62): differences and the per-group offsets of the running
# maximum then never overflow int64. Anything else takes the per-event path (Python ints).
_LIMIT_NS = 1 << 62


class BulkSummary(NamedTuple):
    """What :func:`summarise_bulk` hands to :meth:`KernelSummariser.add_bulk`, and the rest.

    Attributes:
        durations_s: Class → quantised durations (seconds), classes in order of first
            appearance, durations in start order.
        idle_s: Idle seconds per step with a known start, devices in sorted order.
        carried: Records that started after the last boundary, sorted by start.
    """

    durations_s: dict[tuple[str, str], list[float]]
    idle_s: list[float]
    carried: ActivityColumns


def summarise_bulk(
    columns: ActivityColumns,
    boundaries_ns: Sequence[int],
    last_boundary_ns: int | None,
    classify: Callable[[str], KernelClass],
) -> BulkSummary | None:
    """Summarise whole steps of ``columns`` on numpy, as the per-event path would.

    Args:
        columns: The records drained (any order).
        boundaries_ns: End of each finished step, in step order (CUPTI clock).
        last_boundary_ns: End of the step before the first one (its start); ``None`` when
            collection began inside the first step: its kernels count, its idle does not.
        classify: The summariser's :attr:`~KernelSummariser.classifier`.

    Returns:
        The summary, or ``None`` when a value is no int in ``[0, 2**62)`` (the caller takes
        the per-event path for these records).

    Raises:
        ImportError: numpy is not installed.
    """
    import numpy as np

    try:
        starts = np.fromiter(columns.starts, dtype=np.int64, count=len(columns.starts))
        ends = np.fromiter(columns.ends, dtype=np.int64, count=len(columns.ends))
        devices = np.fromiter(columns.devices, dtype=np.int64, count=len(columns.devices))
        bounds = np.fromiter(boundaries_ns, dtype=np.int64, count=len(boundaries_ns))
    except (TypeError, ValueError, OverflowError):
        return None
    if not len(columns.names) == len(starts) == len(ends) == len(devices):
        return None
    if last_boundary_ns is not None and not 0 <= last_boundary_ns < _LIMIT_NS:
        return None
    for values in (starts, ends, bounds):
        if values.size and (int(values.min()) < 0 or int(values.max()) >= _LIMIT_NS):
            return None

    names = columns.names
    order = np.argsort(starts, kind="stable")
    starts, ends, devices = starts[order], ends[order], devices[order]
    assigned = 0
    if bounds.size:
        # A later boundary below an earlier one takes no record (the per-event loop's position
        # never moves back): attribution follows the running maximum of the boundaries.
        ceiling = np.maximum.accumulate(bounds)
        assigned = int(np.searchsorted(starts, ceiling[-1], side="right"))
    carried = ActivityColumns(
        [names[index] for index in order[assigned:].tolist()],
        starts[assigned:].tolist(),
        ends[assigned:].tolist(),
        devices[assigned:].tolist(),
    )
    if not bounds.size:
        return BulkSummary({}, [], carried)

    steps = np.searchsorted(ceiling, starts[:assigned], side="left")
    starts, ends, devices = starts[:assigned], ends[:assigned], devices[:assigned]
    durations = _durations_by_class(names, order[:assigned], starts, ends, classify)
    idle = _idle_by_step(steps, starts, ends, devices, bounds, last_boundary_ns)
    return BulkSummary(durations, idle, carried)


def _durations_by_class(
    names: list[Any],
    order: npt.NDArray[np.intp],
    starts: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    classify: Callable[[str], KernelClass],
) -> dict[tuple[str, str], list[float]]:
    """Quantised durations per class (first-appearance order), each list in start order."""
    import numpy as np

    if not len(order):
        return {}
    # A distinct name is known by its first position (one C-level dict pass over the names),
    # and classified once.
    first_position: dict[Any, int] = {}
    name_ids = np.fromiter(
        map(first_position.setdefault, names, itertools.count()),
        dtype=np.intp,
        count=len(names),
    )
    class_ids: dict[tuple[str, str], int] = {}
    keys: list[tuple[str, str]] = []
    class_at = np.zeros(len(names), dtype=np.intp)
    for name, position in first_position.items():
        key = classify(str(name))
        class_id = class_ids.get(key)
        if class_id is None:
            class_id = class_ids[key] = len(keys)
            keys.append(key)
        class_at[position] = class_id
    record_class = class_at[name_ids[order]]
    seconds = np.rint(np.maximum(ends - starts, 0) * _QUANTA_PER_NS) / _QUANTA_PER_S
    # Stable: each class keeps start order (uint16 sorts by radix, twice as fast).
    sortable = record_class.astype(np.uint16) if len(keys) <= 1 << 16 else record_class
    by_class = np.argsort(sortable, kind="stable")
    grouped = seconds[by_class].tolist()
    counts = np.bincount(record_class, minlength=len(keys))
    offsets = np.concatenate(([0], np.cumsum(counts))).tolist()
    present = np.flatnonzero(counts)
    first_seen = by_class[np.asarray(offsets)[present]]  # a class's first record in start order
    result: dict[tuple[str, str], list[float]] = {}
    for class_id in present[np.argsort(first_seen)].tolist():
        result[keys[class_id]] = grouped[offsets[class_id] : offsets[class_id + 1]]
    return result


def _idle_by_step(
    steps: npt.NDArray[np.intp],
    starts: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    devices: npt.NDArray[np.int64],
    bounds: npt.NDArray[np.int64],
    last_boundary_ns: int | None,
) -> list[float]:
    """:func:`step_idle_s` of every step with a known start, devices sorted, quantised.

    A step without records reports its whole span once, as :meth:`KernelSummariser.add_step`.
    """
    import numpy as np

    count = len(bounds)
    step_start = np.empty(count, dtype=np.int64)
    step_start[1:] = bounds[:-1]
    step_start[0] = 0 if last_boundary_ns is None else last_boundary_ns
    first_step = 1 if last_boundary_ns is None else 0
    low = int(np.searchsorted(steps, first_step, side="left"))
    steps = steps[low:]
    per_step = np.bincount(steps, minlength=count)
    empty = np.flatnonzero(per_step[first_step:] == 0) + first_step
    idle_steps = [empty]
    idle_ns = [np.maximum(bounds[empty] - step_start[empty], 0)]
    if steps.size:
        starts = starts[low:]
        # A KernelEvent ends at start + max(0, end - start).
        ends = np.maximum(ends[low:], starts)
        devices = devices[low:]
        if devices[0] == devices.min() == devices.max():  # one GPU per process: no sort
            group = steps
        else:
            device_values, device_rank = np.unique(devices, return_inverse=True)
            group = steps * len(device_values) + device_rank.reshape(-1)
        by_group = np.argsort(group, kind="stable")  # starts stay sorted inside a group
        group, group_step = group[by_group], steps[by_group]
        origin = step_start[group_step]
        # Relative to the step start and clipped to it, as busy_ns clips; the tail past the
        # boundary is busy time of this step (the span reaches the last kernel end).
        rel_start = np.maximum(starts[by_group], origin) - origin
        rel_end = np.maximum(ends[by_group] - origin, 0)
        firsts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
        before = _previous_max_in_group(rel_end, firsts)
        covered = np.maximum(rel_end - np.maximum(rel_start, before), 0)
        busy = np.add.reduceat(covered, firsts)
        owner = group_step[firsts]
        span = np.maximum(bounds[owner] - step_start[owner], np.maximum.reduceat(rel_end, firsts))
        idle_steps.append(owner)
        idle_ns.append(np.maximum(span - busy, 0))
    all_steps = np.concatenate(idle_steps)
    values = np.concatenate(idle_ns)[np.argsort(all_steps, kind="stable")]
    seconds: list[float] = (np.rint(values * _QUANTA_PER_NS) / _QUANTA_PER_S).tolist()
    return seconds


def _previous_max_in_group(
    values: npt.NDArray[np.int64], firsts: npt.NDArray[np.intp]
) -> npt.NDArray[np.int64]:
    """For each position, the largest value before it in its group (negative at a group's
    first position). ``values`` are >= 0; groups are contiguous and start at ``firsts``."""
    import numpy as np

    size = len(values)
    width = int(values.max()) + 1
    before = np.empty(size, dtype=np.int64)
    if len(firsts) * width < _LIMIT_NS:
        # Lift group g by g * width: a running maximum then never reaches back into an
        # earlier group, and at a group's first position it lands below zero.
        rank = np.zeros(size, dtype=np.int64)
        rank[firsts[1:]] = 1
        offset = np.cumsum(rank) * width
        running = np.maximum.accumulate(values + offset)
        before[1:] = running[:-1] - offset[1:]
        before[0] = -1
        return before
    edges = [*firsts.tolist(), size]
    for low, high in itertools.pairwise(edges):
        before[low] = -1
        if high - low > 1:
            before[low + 1 : high] = np.maximum.accumulate(values[low : high - 1])
    return before
