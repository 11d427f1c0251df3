"""Reading PyTorch profiler traces (Kineto / Chrome trace-event JSON, optionally gzipped).

A trace is split into steps by its ``ProfilerStep#N`` spans. Device events (``kernel``,
``gpu_memcpy``, ``gpu_memset``) are assigned to the step whose host side launched them: the
launching runtime call (``cuda_runtime`` / ``cuda_driver``) carries the same
``args.correlation`` as the kernel, or, when a trace lacks correlation ids, an ``ac2g`` flow
links them; kernels with neither are assigned by start time. A trace without device events is
a CPU-only trace: its ``cpu_op`` events are the "kernels", each with its self time (see
:func:`self_time_events`), exactly as :class:`~stepwatch.exporters.kernels.TorchProfilerSource`
reports them.

Phases come from the step's own annotations (``## forward ##``, ``## backward ##``,
``## optimizer ##``, ``Optimizer.step#...``, ``enumerate(DataLoader)#...``); the remainder of
the step is phase ``other``.

Format reference: Chrome trace-event format
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU) and Kineto's
``ChromeTraceLogger`` (https://github.com/pytorch/kineto/blob/main/libkineto/src/output_json.cpp).
Timestamps (``ts``, ``dur``) are microseconds; ``ts`` is relative to
``baseTimeNanoseconds`` when the trace has it, else the host's clock in Unix microseconds.

Hostile or damaged files: the file is streamed (:mod:`._json_stream`), so its size costs no
memory; what a trace costs is the events step splitting keeps (at most ``max_events``). A
document that is not JSON, not a trace, cut short or nested too deeply is a
:class:`~stepwatch.core.TraceFormatError` naming the file and position. One event that cannot
be used (a ``ts`` that is a string, a ``dur`` that is NaN, infinite, negative or beyond the
int64 nanosecond range, a ``pid`` that is an array ...) is skipped and counted
(:attr:`KinetoTrace.skipped_events`); the rest of the trace is used.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stepwatch.core._errors import TraceFormatError
from stepwatch.exporters.kernels._json_stream import TraceDocument, json_type
from stepwatch.exporters.kernels._summary import KernelEvent, quantised_seconds, self_time_events
from stepwatch.exporters.kernels._trace_events import (
    MAX_NS,
    BadEvent,
    Kernel,
    Marker,
    Span,
    hashable_field,
    not_scalar,
    optional_int,
    time_ns,
)

_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
_RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime"})
_STEP_CATEGORIES = frozenset(
    {"user_annotation", "cpu_op", "python_function", "gpu_user_annotation"}
)
_STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
_RANK_IN_NAME = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)
_HEADER_MEMBERS = ("distributedInfo", "baseTimeNanoseconds", "host_name")
_MAX_RANK = 2**31 - 1  # torch.distributed ranks are C ints
_MAX_HOST_NAME_CHARS = 255  # a DNS name is at most 253
_MAX_NAME_CHARS = 4096
"""Kernel / op names are cut to this many characters (real ones are under 2 kB; a name is
classified by its start)."""
DEFAULT_MAX_EVENTS = 10_000_000
"""Most events one trace may keep for step splitting (kernels, runtime launches, flows, CPU ops,
phase annotations, steps): about 1.6 GB at ~160 bytes each. A GPU trace keeps about six per
kernel; 1 GB of DLRM trace keeps 2.1 million."""


@dataclasses.dataclass(frozen=True)
class TraceStep:
    """One ``ProfilerStep`` of a trace, on the trace's own clock.

    Attributes:
        index: The step number ``N`` of ``ProfilerStep#N``.
        start_ns: Step start, nanoseconds on the trace clock.
        end_ns: Step end, nanoseconds on the trace clock.
        phases_s: Phase → seconds within the step (includes ``other``).
        kernels: Kernel events launched in the step (CPU ops: self time).
        busy: Intervals that kept the device busy, when they differ from ``kernels`` (CPU-only
            traces: the top-level ops); ``None`` means ``kernels``.
    """

    index: int
    start_ns: int
    end_ns: int
    phases_s: Mapping[str, float]
    kernels: tuple[KernelEvent, ...]
    busy: tuple[KernelEvent, ...] | None = None

    @property
    def duration_s(self) -> float:
        """Wall time of the step."""
        return quantised_seconds(self.end_ns - self.start_ns)


@dataclasses.dataclass(frozen=True)
class KinetoTrace:
    """A parsed trace: per-rank metadata and its steps.

    Attributes:
        source: Where it came from (path or label), for messages.
        rank: ``distributedInfo.rank`` if present.
        world_size: ``distributedInfo.world_size`` if present.
        base_time_unix_nano: ``baseTimeNanoseconds`` if present (``ts`` is relative to it).
        steps: The steps in time order.
        raw_size_bytes: Size of the trace document (decompressed) in bytes.
        device_kind: ``"gpu"`` if the trace has device events, else ``"cpu"``.
        host_name: The trace's ``host_name`` (newer Kineto) if present.
        skipped_events: Events that were skipped because they could not be used (a field of
            the wrong type, a time that is not finite, negative or out of range).
        first_skipped: Which event was skipped first and why (``traceEvents[i]: reason``).
    """

    source: str
    rank: int | None
    world_size: int | None
    base_time_unix_nano: int | None
    steps: tuple[TraceStep, ...]
    raw_size_bytes: int
    device_kind: str
    host_name: str | None = None
    skipped_events: int = 0
    first_skipped: str | None = None


def rank_from_file_name(path: str | Path) -> int | None:
    """The rank in a file name such as ``rank-3.json.gz`` or ``worker3_step_12.json``."""
    match = _RANK_IN_NAME.search(Path(path).name)
    return int(match.group(1)) if match else None


def read_trace(
    path: str | Path,
    *,
    progress: Callable[[str], None] | None = None,
    progress_every_bytes: int = 64 << 20,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> KinetoTrace:
    """Read and parse one trace file (``.json`` or ``.json.gz``), streaming it.

    Memory is bounded by what the trace keeps (see :data:`DEFAULT_MAX_EVENTS`), not by the
    file's size: the file is decoded one event at a time.

    Args:
        path: The file.
        progress: Called with a one-line message every ``progress_every_bytes`` read.
        progress_every_bytes: Progress granularity (decompressed bytes).
        max_events: Most events kept for step splitting (kernels, runtime calls, flows, CPU
            ops, phase annotations, steps); a trace with more is refused.

    Returns:
        The parsed trace.

    Raises:
        TraceFormatError: The file is unreadable, truncated or not a trace, or keeps more
            than ``max_events`` events; the message names the file and the line / byte
            position.
    """
    path = Path(path)
    splitter = _StepSplitter(source=str(path), max_events=max_events)
    with TraceDocument(
        path,
        keep=_HEADER_MEMBERS,
        progress=progress,
        progress_every_bytes=progress_every_bytes,
    ) as document:
        for event in document.events():
            splitter.add(event)
    return _trace(document.members, splitter, source=str(path), raw_size_bytes=document.size_bytes)


def parse_trace(
    document: object,
    *,
    source: str = "<trace>",
    raw_size_bytes: int = 0,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> KinetoTrace:
    """Parse a decoded trace document (the JSON object).

    Args:
        document: The decoded JSON.
        source: Label used in error messages.
        raw_size_bytes: Size of the encoded document, recorded in the result.
        max_events: Most events kept for step splitting (see :func:`read_trace`).

    Returns:
        The parsed trace.

    Raises:
        TraceFormatError: The document is not a Kineto / Chrome trace with ProfilerStep spans.
    """
    if isinstance(document, list):
        document = {"traceEvents": document}  # Chrome's "JSON array format"
    if not isinstance(document, dict):
        raise TraceFormatError(f"{source}: not a trace (top level is {json_type(document)})")
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise TraceFormatError(f"{source}: not a trace (no 'traceEvents' array)")
    splitter = _StepSplitter(source=source, max_events=max_events)
    for event in events:
        splitter.add(event)
    return _trace(document, splitter, source=source, raw_size_bytes=raw_size_bytes)


def _trace(
    members: Mapping[str, object],
    splitter: _StepSplitter,
    *,
    source: str,
    raw_size_bytes: int,
) -> KinetoTrace:
    info = members.get("distributedInfo")
    rank = world_size = None
    if isinstance(info, dict):
        rank = _header_int(info.get("rank"), "distributedInfo.rank", 0, _MAX_RANK, source)
        world_size = _header_int(
            info.get("world_size"), "distributedInfo.world_size", 1, _MAX_RANK + 1, source
        )
    base = _header_int(members.get("baseTimeNanoseconds"), "baseTimeNanoseconds", 0, MAX_NS, source)
    host_name = members.get("host_name")
    if isinstance(host_name, str) and len(host_name) > _MAX_HOST_NAME_CHARS:
        raise TraceFormatError(
            f"{source}: host_name is {len(host_name):,} characters long "
            f"(at most {_MAX_HOST_NAME_CHARS})"
        )
    steps, device_kind = splitter.finish()
    if not steps:
        raise TraceFormatError(
            f"{source}: no ProfilerStep#N spans; cannot split into steps{splitter.skip_note()}"
        )
    return KinetoTrace(
        source=source,
        rank=rank,
        world_size=world_size,
        base_time_unix_nano=base,
        steps=tuple(steps),
        raw_size_bytes=raw_size_bytes,
        device_kind=device_kind,
        host_name=host_name if isinstance(host_name, str) and host_name else None,
        skipped_events=splitter.skipped,
        first_skipped=splitter.first_skipped,
    )


def _header_int(value: object, label: str, minimum: int, maximum: int, source: str) -> int | None:
    """A header integer: ``None`` when absent or not an integer, an error when out of range."""
    number = optional_int(value)
    if number is not None and not minimum <= number <= maximum:
        raise TraceFormatError(f"{source}: {label} is {number}; expected {minimum}..{maximum}")
    return number


class _StepSplitter:
    """What step splitting needs from a stream of trace events, kept compactly.

    Each event is looked at once (:meth:`add`) and only what :meth:`finish` uses is kept: a
    small tuple per kernel, runtime launch, flow, CPU op (until the first device event shows
    the trace is a GPU trace), phase annotation and step; names are shared. An event that a
    step needs but cannot be used (a field of the wrong type, a time that is NaN, infinite,
    negative or beyond the int64 nanosecond range) is skipped and counted.
    """

    def __init__(self, *, source: str, max_events: int) -> None:
        self.skipped = 0
        self.first_skipped: str | None = None
        self._source = source
        self._max_events = max_events
        self._seen = 0
        self._kept = 0
        self._names: dict[str, str] = {}
        self._threads: dict[Hashable, Hashable] = {}
        self._steps: list[tuple[int, Span]] = []
        self._kernels: list[Kernel] = []
        self._has_device = False
        self._launches: list[tuple[int, int]] = []  # (start, correlation) of runtime calls
        self._cpu_ops: list[Span] = []
        self._markers: list[Marker] = []
        self._flow_starts: dict[Hashable, int] = {}
        self._flow_ends: dict[tuple[Hashable, Hashable, int], Hashable] = {}

    def add(self, event: object) -> None:
        """Look at the next event of ``traceEvents``."""
        index = self._seen
        self._seen += 1
        try:
            kept = self._add(event)
        except BadEvent as exc:
            self.skipped += 1
            if self.first_skipped is None:
                self.first_skipped = f"traceEvents[{index}]: {exc}"
            return
        if kept:
            self._kept += 1
            if self._kept > self._max_events:
                raise TraceFormatError(
                    f"{self._source}: more than {self._max_events:,} kernel, runtime, flow and "
                    "step events to keep; refused (raise max_events, or stepwatch ingest "
                    "--max-events, to ingest it)"
                )

    def skip_note(self) -> str:
        """``" (N malformed events skipped; first: ...)"`` or ``""``."""
        if not self.skipped:
            return ""
        events = "event" if self.skipped == 1 else "events"
        return f" ({self.skipped} malformed trace {events} skipped; first: {self.first_skipped})"

    def _add(self, event: object) -> bool:
        if not isinstance(event, dict):
            raise BadEvent(f"{json_type(event)}, not an object")
        phase = event.get("ph")
        if phase == "X":
            category = event.get("cat", "")
            category = category.lower() if isinstance(category, str) else ""
            if category in _DEVICE_CATEGORIES:
                return self._add_kernel(event)
            if category in _RUNTIME_CATEGORIES:
                args = event.get("args")
                correlation = args.get("correlation") if isinstance(args, dict) else None
                if not isinstance(correlation, int):
                    return False
                self._launches.append((time_ns(event, "ts"), correlation))
                return True
            if category in _STEP_CATEGORIES:
                return self._add_host_span(event, category)
        elif phase in ("s", "f") and event.get("cat") == "ac2g":
            flow_id = hashable_field(event, "id")
            when_ns = time_ns(event, "ts")
            if phase == "s":
                self._flow_starts[flow_id] = when_ns
            else:
                key = (self._thread(event, "pid"), self._thread(event, "tid"), when_ns)
                self._flow_ends[key] = flow_id
            return True
        return False

    def _add_kernel(self, event: dict[str, Any]) -> bool:
        self._has_device = True
        if self._cpu_ops:  # a GPU trace: its CPU ops are not the "kernels"
            self._kept -= len(self._cpu_ops)
            self._cpu_ops = []
        args = event.get("args")
        args = args if isinstance(args, dict) else {}
        correlation = args.get("correlation")
        self._kernels.append(
            Kernel(
                self._span(event),
                correlation if isinstance(correlation, int) else None,
                optional_int(args.get("device")) or 0,
            )
        )
        return True

    def _add_host_span(self, event: dict[str, Any], category: str) -> bool:
        name = event.get("name", "")
        match = _STEP_NAME.match(name) if isinstance(name, str) else None
        if match is not None:
            try:
                index = int(match.group(1))
            except ValueError:  # more than 4300 digits
                raise BadEvent("step number too long") from None
            if index > MAX_NS:
                raise BadEvent(f"step number {index} is beyond the int64 range")
            self._steps.append((index, self._span(event)))
            return True
        if category == "cpu_op" and not self._has_device:
            self._cpu_ops.append(self._span(event))
            return True
        if category == "user_annotation" and isinstance(name, str):
            phase = phase_of_annotation(name)
            if phase is not None:
                span = self._span(event)
                self._markers.append(Marker(span.start, span.end, span.pid, span.tid, phase))
                return True
        return False

    def _span(self, event: Mapping[str, Any]) -> Span:
        name = event.get("name", "")
        if not isinstance(name, str):
            raise BadEvent(f"'name' is {json_type(name)}, not a string")
        name = name[:_MAX_NAME_CHARS]
        name = self._names.setdefault(name, name)
        start = time_ns(event, "ts")
        duration = time_ns(event, "dur", default=0)
        if duration < 0:
            raise BadEvent(f"'dur' is negative ({event['dur']!r})")
        if start + duration > MAX_NS:
            raise BadEvent("'ts' + 'dur' is beyond the int64 nanosecond range")
        return Span(
            name, start, start + duration, self._thread(event, "pid"), self._thread(event, "tid")
        )

    def _thread(self, event: Mapping[str, Any], key: str) -> Hashable:
        """``pid`` / ``tid``, shared: a trace has few, each decoded anew per event."""
        value = event.get(key)
        try:
            return self._threads.setdefault(value, value)
        except TypeError:  # an array or object
            raise not_scalar(key, value) from None

    def finish(self) -> tuple[list[TraceStep], str]:
        """The steps (in time order) and the device kind (``"gpu"`` or ``"cpu"``)."""
        steps = sorted(self._steps, key=lambda item: item[1].start)
        device_kind = "gpu" if self._has_device else "cpu"
        if not steps:
            return [], device_kind
        starts = [span.start for _, span in steps]

        def step_at(time_ns: int) -> int | None:
            # The step whose span holds time_ns (steps do not overlap on the host).
            position = bisect.bisect_right(starts, time_ns) - 1
            if position < 0 or time_ns > steps[position][1].end:
                return None
            return position

        per_step: list[list[KernelEvent]] = [[] for _ in steps]
        busy_per_step: list[list[KernelEvent]] | None = None
        if self._has_device:
            launched_in: dict[int, int] = {}
            for start, correlation in self._launches:
                position = step_at(start)
                if position is not None:
                    launched_in[correlation] = position
            self._launches = []  # freed before the kernel events are built: a lower peak
            for kernel in self._kernels:
                position = self._kernel_step(kernel, launched_in, step_at)
                if position is not None:
                    span = kernel.span
                    per_step[position].append(
                        KernelEvent(span.name, span.start, span.end - span.start, kernel.device)
                    )
        else:
            own, top = self_time_events(
                (op.name, op.start, op.end, hash((op.pid, op.tid))) for op in self._cpu_ops
            )
            busy_per_step = [[] for _ in steps]
            for target, events_of in ((per_step, own), (busy_per_step, top)):
                for event in events_of:
                    position = step_at(event.start_ns)
                    if position is not None:
                        target[position].append(event)
        markers = sorted(self._markers, key=lambda marker: marker.start)
        marker_starts = [marker.start for marker in markers]
        result = []
        for position, (index, span) in enumerate(steps):
            first = bisect.bisect_left(marker_starts, span.start)
            last = bisect.bisect_right(marker_starts, span.end)
            kernels = per_step[position]
            kernels.sort(key=lambda event: event.start_ns)
            result.append(
                TraceStep(
                    index=index,
                    start_ns=span.start,
                    end_ns=span.end,
                    phases_s=_phases(span, markers[first:last]),
                    kernels=tuple(kernels),
                    busy=None if busy_per_step is None else tuple(busy_per_step[position]),
                )
            )
        return result, device_kind

    def _kernel_step(
        self,
        kernel: Kernel,
        launched_in: Mapping[int, int],
        step_at: Callable[[int], int | None],
    ) -> int | None:
        if kernel.correlation is not None and kernel.correlation in launched_in:
            return launched_in[kernel.correlation]
        span = kernel.span
        flow_id = self._flow_ends.get((span.pid, span.tid, span.start))
        if flow_id is not None and flow_id in self._flow_starts:
            return step_at(self._flow_starts[flow_id])
        return step_at(span.start)


_PHASE_MARKERS = (
    ("forward", ("forward", "fwd")),
    ("backward", ("backward", "bwd")),
    ("optimizer", ("optimizer", "zero_grad", "optimizer_step", "optim")),
    ("data", ("data_load", "dataloader", "data", "copy_batch_to_gpu", "wait_for_batch")),
)


def phase_of_annotation(name: str) -> str | None:
    """The ``stepwatch.phase`` an annotation marks, or ``None``.

    ``## forward ##``-style markers (torchrec / DLRM / HTA convention), ``Optimizer.step#...``
    and ``Optimizer.zero_grad#...`` (torch.optim's record_function names) and
    ``enumerate(DataLoader)#...`` (the DataLoader's) are recognised.

    Example:
        >>> phase_of_annotation("## backward ##"), phase_of_annotation("Optimizer.step#Adam.step")
        ('backward', 'optimizer')
    """
    if name.startswith("Optimizer."):
        return "optimizer"
    if name.startswith("enumerate(DataLoader)"):
        return "data"
    if not (name.startswith("##") and name.endswith("##")):
        return None
    marker = name.strip("# ").lower()
    for phase, markers in _PHASE_MARKERS:
        if marker in markers:
            return phase
    return None


def _phases(step: Span, markers: Sequence[Marker]) -> dict[str, float]:
    """Phase → seconds of one step, from the phase markers that start inside it."""
    marked = sorted(
        (
            marker
            for marker in markers
            if marker.pid == step.pid
            and marker.tid == step.tid
            and marker.start >= step.start
            and marker.end <= step.end
        ),
        key=lambda marker: (marker.start, -marker.end),
    )
    totals: dict[str, int] = {}
    covered_until = step.start
    for marker in marked:
        if marker.start < covered_until:
            continue  # nested inside an already counted phase span
        totals[marker.phase] = totals.get(marker.phase, 0) + marker.end - marker.start
        covered_until = marker.end
    step_ns = step.end - step.start
    other = step_ns - sum(totals.values())
    result = {phase: quantised_seconds(ns) for phase, ns in totals.items()}
    result["other"] = quantised_seconds(max(0, other))
    return result
