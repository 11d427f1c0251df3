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
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stepwatch.core._errors import TraceFormatError
from stepwatch.exporters.kernels._summary import KernelEvent, quantised_seconds, self_time_events

_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
_RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime"})
_STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
_RANK_IN_NAME = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)
_CHUNK_BYTES = 8 << 20


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
    """

    source: str
    rank: int | None
    world_size: int | None
    base_time_unix_nano: int | None
    steps: tuple[TraceStep, ...]
    raw_size_bytes: int
    device_kind: str
    host_name: str | None = None


def rank_from_file_name(path: str | Path) -> int | None:
    """The rank in a file name such as ``rank-3.json.gz`` or ``worker3_step_12.json``."""
    match = _RANK_IN_NAME.search(Path(path).name)
    return int(match.group(1)) if match else None


def read_trace(
    path: str | Path,
    *,
    progress: Callable[[str], None] | None = None,
    progress_every_bytes: int = 64 << 20,
) -> KinetoTrace:
    """Read and parse one trace file (``.json`` or ``.json.gz``).

    Args:
        path: The file.
        progress: Called with a one-line message every ``progress_every_bytes`` read.
        progress_every_bytes: Progress granularity (decompressed bytes).

    Returns:
        The parsed trace.

    Raises:
        TraceFormatError: The file is unreadable, truncated or not a trace; the message names
            the file and the byte / line position.
    """
    path = Path(path)
    data = _read_bytes(path, progress=progress, progress_every_bytes=progress_every_bytes)
    try:
        document = json.loads(data)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            f"{path}: malformed or truncated JSON at line {exc.lineno} column {exc.colno} "
            f"(byte {exc.pos} of {len(data)}): {exc.msg}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: not UTF-8 text at byte {exc.start}") from exc
    return parse_trace(document, source=str(path), raw_size_bytes=len(data))


def _read_bytes(
    path: Path, *, progress: Callable[[str], None] | None, progress_every_bytes: int
) -> bytes:
    chunks: list[bytes] = []
    size = 0
    reported = 0
    try:
        with path.open("rb") as raw:
            magic = raw.read(2)
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw
            while chunk := stream.read(_CHUNK_BYTES):
                chunks.append(chunk)
                size += len(chunk)
                if progress is not None and size - reported >= progress_every_bytes:
                    reported = size
                    progress(f"{path}: read {size / 1e6:.0f} MB")
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceFormatError(
            f"{path}: gzip stream truncated or corrupt after {size} decompressed bytes: {exc}"
        ) from exc
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc
    return b"".join(chunks)


def parse_trace(
    document: object, *, source: str = "<trace>", raw_size_bytes: int = 0
) -> KinetoTrace:
    """Parse a decoded trace document (the JSON object).

    Args:
        document: The decoded JSON.
        source: Label used in error messages.
        raw_size_bytes: Size of the encoded document, recorded in the result.

    Returns:
        The parsed trace.

    Raises:
        TraceFormatError: The document is not a Kineto / Chrome trace with ProfilerStep spans.
    """
    if isinstance(document, list):
        document = {"traceEvents": document}  # Chrome's "JSON array format"
    if not isinstance(document, dict):
        raise TraceFormatError(f"{source}: not a trace (top level is {type(document).__name__})")
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise TraceFormatError(f"{source}: not a trace (no 'traceEvents' list)")
    info = document.get("distributedInfo")
    rank = world_size = None
    if isinstance(info, dict):
        rank = _optional_int(info.get("rank"))
        world_size = _optional_int(info.get("world_size"))
    base = _optional_int(document.get("baseTimeNanoseconds"))
    host_name = document.get("host_name")
    try:
        steps, device_kind = _split_steps(events)
    except (TypeError, ValueError, KeyError) as exc:
        raise TraceFormatError(f"{source}: malformed trace event: {exc!r}") from exc
    if not steps:
        raise TraceFormatError(f"{source}: no ProfilerStep#N spans; cannot split into steps")
    return KinetoTrace(
        source=source,
        rank=rank,
        world_size=world_size,
        base_time_unix_nano=base,
        steps=tuple(steps),
        raw_size_bytes=raw_size_bytes,
        device_kind=device_kind,
        host_name=host_name if isinstance(host_name, str) and host_name else None,
    )


def _optional_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _ns(microseconds: Any) -> int:
    # Integer µs stay exact (epoch-µs timestamps exceed float64's integer range once in ns).
    if isinstance(microseconds, int) and not isinstance(microseconds, bool):
        return microseconds * 1000
    return round(float(microseconds) * 1000)


class _Span:
    __slots__ = ("args", "end", "name", "pid", "start", "tid")

    def __init__(self, event: dict[str, Any]) -> None:
        self.name: str = str(event.get("name", ""))
        self.start = _ns(event["ts"])
        self.end = self.start + _ns(event.get("dur", 0))
        self.pid = event.get("pid")
        self.tid = event.get("tid")
        args = event.get("args")
        self.args: dict[str, Any] = args if isinstance(args, dict) else {}


def _split_steps(events: Sequence[Any]) -> tuple[list[TraceStep], str]:
    steps: list[tuple[int, _Span]] = []
    device: list[_Span] = []
    runtime_step_of: dict[int, int] = {}
    cpu_ops: list[_Span] = []
    annotations: list[_Span] = []
    runtime: list[_Span] = []
    flow_starts: dict[Any, int] = {}
    flow_ends: dict[tuple[Any, Any, int], Any] = {}
    for event in events:
        if not isinstance(event, dict):
            continue
        phase = event.get("ph")
        if phase == "X":
            category = str(event.get("cat", "")).lower()
            name = event.get("name", "")
            if category in _DEVICE_CATEGORIES:
                device.append(_Span(event))
            elif category in _RUNTIME_CATEGORIES:
                runtime.append(_Span(event))
            elif category in (
                "user_annotation",
                "cpu_op",
                "python_function",
                "gpu_user_annotation",
            ):
                match = _STEP_NAME.match(name) if isinstance(name, str) else None
                if match is not None:
                    steps.append((int(match.group(1)), _Span(event)))
                elif category == "cpu_op":
                    cpu_ops.append(_Span(event))
                elif category == "user_annotation":
                    annotations.append(_Span(event))
        elif phase in ("s", "f") and event.get("cat") == "ac2g":
            if phase == "s":
                flow_starts[event.get("id")] = _ns(event["ts"])
            else:
                key = (event.get("pid"), event.get("tid"), _ns(event["ts"]))
                flow_ends[key] = event.get("id")
    steps.sort(key=lambda item: item[1].start)
    if not steps:
        return [], "gpu" if device else "cpu"
    starts = [span.start for _, span in steps]

    def step_at(time_ns: int) -> int | None:
        # The step whose span holds time_ns (steps do not overlap on the host).
        position = bisect.bisect_right(starts, time_ns) - 1
        if position < 0 or time_ns > steps[position][1].end:
            return None
        return position

    for call in runtime:
        correlation = call.args.get("correlation")
        position = step_at(call.start)
        if isinstance(correlation, int) and position is not None:
            runtime_step_of[correlation] = position
    per_step: list[list[KernelEvent]] = [[] for _ in steps]
    busy_per_step: list[list[KernelEvent]] | None = None
    if device:
        for kernel in device:
            position = _device_step(kernel, runtime_step_of, flow_starts, flow_ends, step_at)
            if position is None:
                continue
            per_step[position].append(
                KernelEvent(
                    kernel.name,
                    kernel.start,
                    kernel.end - kernel.start,
                    _optional_int(kernel.args.get("device")) or 0,
                )
            )
        device_kind = "gpu"
    else:
        own, top = self_time_events(
            (op.name, op.start, op.end, hash((op.pid, op.tid))) for op in cpu_ops
        )
        busy_per_step = [[] for _ in steps]
        for target, events_of in ((per_step, own), (busy_per_step, top)):
            for event in events_of:
                position = step_at(event.start_ns)
                if position is not None:
                    target[position].append(event)
        device_kind = "cpu"
    result = []
    for position, (index, span) in enumerate(steps):
        phases = _phases(span, annotations)
        kernels = per_step[position]
        kernels.sort(key=lambda event: event.start_ns)
        result.append(
            TraceStep(
                index=index,
                start_ns=span.start,
                end_ns=span.end,
                phases_s=phases,
                kernels=tuple(kernels),
                busy=None if busy_per_step is None else tuple(busy_per_step[position]),
            )
        )
    return result, device_kind


def _device_step(
    kernel: _Span,
    runtime_step_of: Mapping[int, int],
    flow_starts: Mapping[Any, int],
    flow_ends: Mapping[tuple[Any, Any, int], Any],
    step_at: Callable[[int], int | None],
) -> int | None:
    correlation = kernel.args.get("correlation")
    if isinstance(correlation, int) and correlation in runtime_step_of:
        return runtime_step_of[correlation]
    flow_id = flow_ends.get((kernel.pid, kernel.tid, kernel.start))
    if flow_id is not None and flow_id in flow_starts:
        return step_at(flow_starts[flow_id])
    return step_at(kernel.start)


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


def _phases(step: _Span, annotations: Sequence[_Span]) -> dict[str, float]:
    marked = sorted(
        (
            (span.start, -span.end, phase, span)
            for span in annotations
            if span.pid == step.pid
            and span.tid == step.tid
            and span.start >= step.start
            and span.end <= step.end
            and (phase := phase_of_annotation(span.name)) is not None
        ),
        key=lambda item: (item[0], item[1]),
    )
    totals: dict[str, int] = {}
    covered_until = step.start
    for start, negative_end, phase, _span in marked:
        end = -negative_end
        if start < covered_until:
            continue  # nested inside an already counted phase span
        totals[phase] = totals.get(phase, 0) + end - start
        covered_until = end
    step_ns = step.end - step.start
    other = step_ns - sum(totals.values())
    result = {phase: quantised_seconds(ns) for phase, ns in totals.items()}
    result["other"] = quantised_seconds(max(0, other))
    return result
