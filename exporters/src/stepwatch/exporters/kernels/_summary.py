"""The one summariser every kernel source feeds: raw events → a bounded :class:`KernelWindow`.

Sources (CUPTI, torch.profiler, Kineto trace files) hand over the kernel events of whole steps;
the summariser classifies each name once (:func:`classify_kernel`, cached), appends the
duration to that class's list, computes the device-idle time of the step from the union of
kernel intervals, and on :meth:`KernelSummariser.drain` folds every class outside the top K
(by total time seen so far) into class ``other`` of the same category. The result's series
count is therefore at most ``top_k + 4`` whatever the workload does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from stepwatch.core._errors import ConfigError
from stepwatch.exporters import _cext
from stepwatch.exporters._window import KernelWindow
from stepwatch.exporters.kernels._names import OTHER_CLASS, KernelClass, classify_kernel

_fasthist = _cext.fasthist  # self_time_events' loop in C (exporters/csrc/fasthist.c), or None

DEFAULT_TOP_K = 48
_NS_PER_S = 1e9
# Durations are reported on a binary grid of 2**-30 s (0.93 ns): finer than any kernel clock
# (CUPTI is ns, Kineto traces µs), and a float64 on that grid has >= 22 trailing zero mantissa
# bits, so the histogram sum/min/max fields gzip to a fraction of their 8 bytes on the wire.
_QUANTA_PER_S = float(2**30)
_QUANTA_PER_NS = _QUANTA_PER_S / _NS_PER_S


def quantised_seconds(duration_ns: float) -> float:
    """Nanoseconds → seconds on the 2**-30 s grid (error < 0.47 ns).

    Example:
        >>> abs(quantised_seconds(3000) - 3e-6) < 1e-9
        True
    """
    return round(duration_ns * _QUANTA_PER_NS) / _QUANTA_PER_S


class KernelEvent(NamedTuple):
    """One kernel (or CPU op) execution as a source observed it.

    Attributes:
        name: Raw name (template arguments and all); classified by the summariser.
        start_ns: Start on the source's clock, nanoseconds (any epoch, consistent per source).
        duration_ns: Duration, nanoseconds.
        device: The device (GPU ordinal, or 0 for the CPU) whose timeline it occupies.
    """

    name: str
    start_ns: int
    duration_ns: int
    device: int = 0


def busy_ns(intervals: Iterable[tuple[int, int]], *, start_ns: int, end_ns: int) -> int:
    """Length of the union of ``[start, end)`` intervals, clipped to ``[start_ns, end_ns)``.

    Args:
        intervals: ``(start, end)`` pairs in nanoseconds, in any order, overlaps allowed.
        start_ns: Clip start.
        end_ns: Clip end.

    Returns:
        Busy nanoseconds, ``0 <= busy <= max(0, end_ns - start_ns)``.

    Example:
        >>> busy_ns([(0, 10), (5, 20), (30, 40)], start_ns=0, end_ns=35)
        25
    """
    clipped = sorted(
        (max(start, start_ns), min(end, end_ns))
        for start, end in intervals
        if end > start_ns and start < end_ns and end > start
    )
    total = 0
    current_start = current_end = None
    for start, end in clipped:
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        elif end > current_end:
            current_end = end
    if current_end is not None and current_start is not None:
        total += current_end - current_start
    return total


def step_idle_s(events: Iterable[KernelEvent], *, start_ns: int, end_ns: int) -> dict[int, float]:
    """Device-idle seconds of one step, per device.

    The step's span on a device is ``[start_ns, max(end_ns, last kernel end)]``: kernels are
    launched asynchronously and may finish after the host-side step ended, and that tail is
    busy time of this step, not idle time of the next. Idle = span − union of kernel intervals
    (overlapping streams count once).

    Args:
        events: The step's kernel events.
        start_ns: Step start on the events' clock.
        end_ns: Step end on the events' clock.

    Returns:
        Device → idle seconds (devices with no kernel in the step are absent).
    """
    per_device: dict[int, list[tuple[int, int]]] = {}
    for event in events:
        per_device.setdefault(event.device, []).append(
            (event.start_ns, event.start_ns + event.duration_ns)
        )
    idle: dict[int, float] = {}
    for device, intervals in per_device.items():
        span_end = max(end_ns, max(end for _, end in intervals))
        busy = busy_ns(intervals, start_ns=start_ns, end_ns=span_end)
        idle[device] = quantised_seconds(max(0, span_end - start_ns - busy))
    return idle


def self_time_events(
    spans: Iterable[tuple[str, int, int, int]],
) -> tuple[list[KernelEvent], list[KernelEvent]]:
    """Nested CPU ops → one event per op with its *self* time, plus the top-level ops.

    CPU ops nest (``aten::linear`` → ``aten::addmm`` → ``aten::copy_``); counting each op's
    full duration would count the same time several times, and counting only leaves would
    drop the time an op spends outside its children (``addmm``'s BLAS call). Self time
    (duration − time covered by direct children) counts every nanosecond once. Device idle
    uses the top-level ops, whose union is the time the thread ran any op.

    Args:
        spans: ``(name, start_ns, end_ns, thread_id)`` of each op, any order.

    Returns:
        ``(self_time_events, top_level_events)``, both on device 0, in start order.

    Example:
        >>> own, top = self_time_events([("aten::linear", 0, 100, 1), ("aten::addmm", 10, 90, 1)])
        >>> [(e.name, e.duration_ns) for e in own], [(e.name, e.duration_ns) for e in top]
        ([('aten::linear', 20), ('aten::addmm', 80)], [('aten::linear', 100)])

    A list or tuple of plain spans goes to the C loop (``_fasthist.self_time``: the same
    events in the same order, ~10x faster; a profiler cycle's ~1,000 ops cost the export
    thread ~1.1 ms in Python), anything else to :func:`self_time_events_python`.
    """
    if _fasthist is not None and isinstance(spans, (list, tuple)):
        done = _fasthist.self_time(spans, KernelEvent)
        if done is not None:
            return done
    return self_time_events_python(spans)


def self_time_events_python(
    spans: Iterable[tuple[str, int, int, int]],
) -> tuple[list[KernelEvent], list[KernelEvent]]:
    """:func:`self_time_events` in Python (the C loop's reference, and its fallback)."""
    by_thread: dict[int, list[tuple[int, int, str]]] = {}
    for name, start, end, thread in spans:
        by_thread.setdefault(thread, []).append((start, max(start, end), name))
    own: list[KernelEvent] = []
    top: list[KernelEvent] = []
    for thread_spans in by_thread.values():
        thread_spans.sort(key=lambda span: (span[0], -span[1]))
        # Stack entries: [start, end, name, time covered by direct children].
        stack: list[list[Any]] = []

        def finish(entry: list[Any]) -> None:
            start, end, name, children = entry
            own.append(KernelEvent(name, start, max(0, end - start - children), 0))

        for start, end, name in thread_spans:
            while stack and stack[-1][1] <= start:
                finish(stack.pop())
            if stack:
                parent = stack[-1]
                parent[3] += min(end, parent[1]) - start
            else:
                top.append(KernelEvent(name, start, end - start, 0))
            stack.append([start, end, name, 0])
        while stack:
            finish(stack.pop())
    own.sort(key=lambda event: event.start_ns)
    top.sort(key=lambda event: event.start_ns)
    return own, top


class KernelSummariser:
    """Classifies kernel events, keeps per-window duration lists and folds rare classes.

    Not thread-safe: a source owns one and serialises access to it.

    Args:
        top_k: Most kernel classes kept by name; the rest (smallest total time seen so far)
            are reported as class ``other`` with their category. ``top_k + 4`` bounds the
            series count of every window.
        classify: Raw name → :class:`KernelClass` (default :func:`classify_kernel`).
        initial_totals_s: Total seconds per ``(class, category)`` known in advance (offline
            ingest passes the whole trace's totals so every step folds the same classes).

    Raises:
        ConfigError: ``top_k`` is below 1.
    """

    def __init__(
        self,
        *,
        top_k: int = DEFAULT_TOP_K,
        classify: Callable[[str], KernelClass] = classify_kernel,
        initial_totals_s: Mapping[tuple[str, str], float] | None = None,
    ) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"top_k must be an integer >= 1, got {top_k!r}")
        self._top_k = top_k
        self._classify = classify
        self._totals_s: dict[tuple[str, str], float] = dict(initial_totals_s or {})
        self._durations_s: dict[tuple[str, str], list[float]] = {}
        self._idle_s: list[float] = []
        self.events = 0
        """Events added since construction (cumulative)."""

    @property
    def top_k(self) -> int:
        """The configured K."""
        return self._top_k

    @property
    def classifier(self) -> Callable[[str], KernelClass]:
        """Raw name → :class:`KernelClass`, as :meth:`add_events` classifies (bulk sources
        classify each distinct name once with it and hand over :meth:`add_bulk`)."""
        return self._classify

    def add_events(self, events: Iterable[KernelEvent]) -> None:
        """Add kernel executions that belong to no particular step (no idle computed)."""
        durations = self._durations_s
        classify = self._classify
        count = 0
        for event in events:
            key = classify(event.name)
            bucket = durations.get(key)
            if bucket is None:
                bucket = durations[key] = []
            bucket.append(round(event.duration_ns * _QUANTA_PER_NS) / _QUANTA_PER_S)
            count += 1
        self.events += count

    def add_step(
        self,
        events: Iterable[KernelEvent],
        *,
        start_ns: int,
        end_ns: int,
        busy: Iterable[KernelEvent] | None = None,
    ) -> None:
        """Add the kernel executions of one step and its device-idle time (one value per device
        that ran a kernel in the step).

        Args:
            events: The step's events.
            start_ns: Step start, on the events' clock.
            end_ns: Step end, on the events' clock.
            busy: Intervals that make the device busy, when they differ from ``events``
                (CPU ops reported by self time pass their top-level ops here).
        """
        materialised = list(events)
        self.add_events(materialised)
        intervals = materialised if busy is None else list(busy)
        if intervals:
            idle = step_idle_s(intervals, start_ns=start_ns, end_ns=end_ns)
            self._idle_s.extend(idle[device] for device in sorted(idle))
        else:
            self._idle_s.append(quantised_seconds(max(0, end_ns - start_ns)))

    def add_bulk(
        self,
        durations_by_class: Mapping[tuple[str, str], Sequence[float]],
        idle_s: Iterable[float],
    ) -> None:
        """Add pre-summarised steps: quantised durations per class and device-idle values.

        What :meth:`add_events` and :meth:`add_step` would have appended, computed by the
        caller in bulk (:class:`CuptiSource` on numpy arrays): the durations must already be on
        the 2**-30 s grid (:func:`quantised_seconds`) and the keys come from
        :attr:`classifier`. Folding, top K and totals are those of the other paths.

        Args:
            durations_by_class: ``(class, category)`` → durations in seconds, in event order.
            idle_s: Idle seconds, in the order :meth:`add_step` would append them.
        """
        durations = self._durations_s
        count = 0
        for key, values in durations_by_class.items():
            if not values:
                continue
            bucket = durations.get(key)
            if bucket is None:
                bucket = durations[key] = []
            bucket.extend(values)
            count += len(values)
        self.events += count
        self._idle_s.extend(idle_s)

    def kept_classes(self) -> frozenset[tuple[str, str]]:
        """The ``(class, category)`` keys currently kept by name (top K by total time)."""
        ranked = sorted(self._totals_s.items(), key=lambda item: (-item[1], item[0]))
        return frozenset(key for key, _ in ranked[: self._top_k])

    def drain(self) -> KernelWindow:
        """Everything added since the last drain, rare classes folded; resets the window."""
        for key, durations in self._durations_s.items():
            self._totals_s[key] = self._totals_s.get(key, 0.0) + sum(durations)
        self._bound_totals()
        kept = self.kept_classes()
        folded: dict[tuple[str, str], list[float]] = {}
        for key, durations in self._durations_s.items():
            target = key if key in kept else (OTHER_CLASS, key[1])
            existing = folded.get(target)
            if existing is None:
                folded[target] = durations
            else:
                existing.extend(durations)
        window = KernelWindow(durations_s=folded, idle_durations_s=tuple(self._idle_s))
        self._durations_s = {}
        self._idle_s = []
        return window

    def _bound_totals(self) -> None:
        # Keep memory bounded when a workload produces endless distinct classes: remember the
        # 8·K largest totals, which is plenty to keep the top-K ranking stable.
        limit = 8 * self._top_k
        if len(self._totals_s) > 2 * limit:
            ranked = sorted(self._totals_s.items(), key=lambda item: (-item[1], item[0]))
            self._totals_s = dict(ranked[:limit])
