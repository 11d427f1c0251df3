"""Offline ingest: recorded PyTorch profiler traces → exactly the windows a live rank emits.

One trace file per rank. Each ``ProfilerStep#N`` becomes one window built by the same
:class:`~stepwatch.exporters._window.WindowBuilder` and :class:`KernelSummariser` a live rank
uses, and is handed to an OTLP exporter (any object with the SDK ``MetricExporter.export``).

Time mapping (trace clock → Unix nanoseconds), chosen once for the whole set of files so ranks
stay aligned with each other:

1. a trace with ``baseTimeNanoseconds`` (newer Kineto): ``unix = base + ts``;
2. else, when ``time_origin_unix_nano`` is given: the earliest step start over all files maps
   to it (``unix = origin + ts − earliest``);
3. else: the set is placed so its latest step end is *now* (``unix = now − (latest − ts)``),
   which keeps replayed data inside dashboards' and detectors' recent time ranges.

Ingest is per file: a file that cannot be read or parsed (or that the reader fails on in any
way) is one :class:`IngestFailure` naming it, and the other files are still ingested. Files are
streamed (see :func:`~stepwatch.exporters.kernels.read_trace`) and each window is exported as
soon as it is built.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stepwatch.core._errors import ConfigError, TraceFormatError
from stepwatch.exporters._window import (
    DEFAULT_KERNEL_MIN_MAX,
    DEFAULT_KERNEL_SIGNIFICANT_BITS,
    WindowBuilder,
    build_resource,
)
from stepwatch.exporters.kernels._summary import DEFAULT_TOP_K, KernelSummariser
from stepwatch.exporters.kernels._trace import (
    DEFAULT_MAX_EVENTS,
    KinetoTrace,
    rank_from_file_name,
    read_trace,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.resources import Resource

_log = logging.getLogger(__name__)

DEFAULT_KERNEL_MAX_SCALE = 4
"""Exponential-histogram scale ingest uses: buckets 4.4 % wide, so a bucket midpoint is within
2.2 % of any value in it (half the 5 % fidelity budget); see bench/kernel_bytes.py for sizes."""
DEFAULT_KERNEL_MAX_SIZE = 320
"""Most buckets per histogram: 320 buckets at scale 4 span 20 octaves (1 µs … 1 s) before the
histogram has to downscale (and double its bucket width); 160 did not on the HTA trace."""


class MetricsExporter(Protocol):
    """What ingest needs of an exporter: the SDK ``MetricExporter.export`` call."""

    def export(self, metrics_data: MetricsData, /) -> Any:
        """Send one window; returns ``MetricExportResult`` (``SUCCESS`` or ``FAILURE``)."""


@dataclasses.dataclass(frozen=True)
class IngestedTrace:
    """One trace file that was ingested.

    Attributes:
        path: The file.
        rank: The rank it was ingested as.
        world_size: The world size it was ingested with.
        steps: Windows (steps) built.
        kernels: Kernel events summarised.
        raw_size_bytes: Decompressed size of the trace document.
        exported: Windows the exporter accepted.
        skipped_events: Trace events skipped as unusable (see
            :attr:`~stepwatch.exporters.kernels.KinetoTrace.skipped_events`).
        first_skipped: The first of them and why, when there were any.
    """

    path: str
    rank: int
    world_size: int
    steps: int
    kernels: int
    raw_size_bytes: int
    exported: int
    skipped_events: int = 0
    first_skipped: str | None = None


@dataclasses.dataclass(frozen=True)
class IngestFailure:
    """A trace file that could not be ingested (or whose windows failed to export)."""

    path: str
    message: str


@dataclasses.dataclass(frozen=True)
class IngestResult:
    """Outcome of :func:`ingest_traces`.

    Attributes:
        traces: Files ingested.
        failures: Files that failed, with the reason.
        time_offset_ns: ``unix_nano − trace_ns`` used for traces without a base time.
    """

    traces: tuple[IngestedTrace, ...]
    failures: tuple[IngestFailure, ...]
    time_offset_ns: int

    @property
    def ok(self) -> bool:
        """True when every file was ingested and every window exported."""
        return not self.failures


@dataclasses.dataclass(frozen=True)
class TraceWindow:
    """One step of a trace, as the window a live rank would export."""

    step_index: int
    start_unix_nano: int
    end_unix_nano: int
    metrics: MetricsData


def trace_windows(
    trace: KinetoTrace,
    *,
    job_id: str,
    rank: int,
    world_size: int,
    time_offset_ns: int,
    host_name: str | None = None,
    top_k: int = DEFAULT_TOP_K,
    max_scale: int = DEFAULT_KERNEL_MAX_SCALE,
    max_size: int = DEFAULT_KERNEL_MAX_SIZE,
    kernel_significant_bits: int = DEFAULT_KERNEL_SIGNIFICANT_BITS,
    kernel_min_max: bool = DEFAULT_KERNEL_MIN_MAX,
) -> list[TraceWindow]:
    """The windows (one per step) of a parsed trace.

    Args:
        trace: The parsed trace.
        job_id: ``stepwatch.job.id``.
        rank: The rank the trace is reported as.
        world_size: The job's world size.
        time_offset_ns: Added to trace times when the trace has no ``baseTimeNanoseconds``.
        host_name: ``host.name``; default the trace's ``host_name``, else ``"unknown"``.
        top_k: Kernel classes kept by name; the whole trace's totals decide which.
        max_scale: Exponential-histogram scale.
        max_size: Most buckets per histogram.
        kernel_significant_bits: Significant bits of kernel histograms' sum/min/max on the
            wire (see :class:`~stepwatch.exporters.WindowBuilder`).
        kernel_min_max: Send ``min``/``max`` on kernel histograms (see
            :class:`~stepwatch.exporters.WindowBuilder`).

    Returns:
        The windows, in step order.

    Raises:
        ConfigError: The resource attributes are inconsistent (e.g. rank ≥ world size).
    """
    resource = _resource(
        trace, job_id=job_id, rank=rank, world_size=world_size, host_name=host_name
    )
    builder = WindowBuilder(
        resource,
        max_scale=max_scale,
        max_size=max_size,
        kernel_significant_bits=kernel_significant_bits,
        kernel_min_max=kernel_min_max,
    )
    return list(_windows(trace, builder, top_k=top_k, time_offset_ns=time_offset_ns))


def _resource(
    trace: KinetoTrace, *, job_id: str, rank: int, world_size: int, host_name: str | None
) -> Resource:
    return build_resource(
        job_id=job_id,
        rank=rank,
        world_size=world_size,
        host_name=host_name or trace.host_name or "unknown",
    )


def _windows(
    trace: KinetoTrace, builder: WindowBuilder, *, top_k: int, time_offset_ns: int
) -> Iterator[TraceWindow]:
    """:func:`trace_windows` one window at a time, built with ``builder``."""
    summariser = KernelSummariser(top_k=top_k, initial_totals_s=_class_totals(trace))
    offset = trace.base_time_unix_nano if trace.base_time_unix_nano is not None else time_offset_ns
    for step in trace.steps:
        builder.add_step(step_index=step.index, duration_s=step.duration_s, phases_s=step.phases_s)
        summariser.add_step(
            step.kernels, start_ns=step.start_ns, end_ns=step.end_ns, busy=step.busy
        )
        builder.add_kernels(summariser.drain())
        start, end = step.start_ns + offset, step.end_ns + offset
        metrics = builder.build(start_unix_nano=start, end_unix_nano=end)
        if metrics is not None:
            yield TraceWindow(step.index, start, end, metrics)


def _class_totals(trace: KinetoTrace) -> dict[tuple[str, str], float]:
    from stepwatch.exporters.kernels._names import classify_kernel

    totals: dict[tuple[str, str], float] = {}
    for step in trace.steps:
        for event in step.kernels:
            key = classify_kernel(event.name)
            totals[key] = totals.get(key, 0.0) + event.duration_ns / 1e9
    return totals


def ingest_traces(
    paths: Sequence[str | Path],
    *,
    job_id: str,
    exporter: MetricsExporter,
    time_origin_unix_nano: int | None = None,
    host_name: str | None = None,
    top_k: int = DEFAULT_TOP_K,
    max_scale: int = DEFAULT_KERNEL_MAX_SCALE,
    max_size: int = DEFAULT_KERNEL_MAX_SIZE,
    clock_unix_nano: Callable[[], int] = time.time_ns,
    progress: Callable[[str], None] | None = None,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> IngestResult:
    """Ingest trace files (one per rank) and export one window per step.

    Ingest is per file: a file that cannot be read or parsed is reported in
    :attr:`IngestResult.failures` with a one-line message naming it, and the other files are
    still ingested. Events a trace could not use are skipped and counted
    (:attr:`IngestedTrace.skipped_events`).

    Args:
        paths: Trace files (``.json`` / ``.json.gz``), one per rank.
        job_id: ``stepwatch.job.id`` for every rank.
        exporter: Receives each window's ``MetricsData`` (e.g. the SDK OTLP exporter).
        time_origin_unix_nano: Where the earliest step starts, for traces without a base time.
        host_name: ``host.name`` for every rank (default: each trace's ``host_name``, else
            ``"unknown"``).
        top_k: Kernel classes kept by name per rank.
        max_scale: Exponential-histogram scale for every histogram.
        max_size: Most buckets per histogram.
        clock_unix_nano: "Now", for placing traces with neither a base time nor an origin.
        progress: Called with one-line progress messages (per file, per 64 MB read).
        max_events: Most events one trace may keep for step splitting (see
            :func:`~stepwatch.exporters.kernels.read_trace`); bounds the memory of a file.

    Returns:
        What was ingested and what failed.

    Raises:
        ConfigError: ``paths``, ``job_id``, ``host_name``, ``top_k``, ``max_scale``,
            ``max_size`` or ``max_events`` is invalid (checked before any file is read).
    """
    if not paths:
        raise ConfigError("paths: at least one trace file is required")
    if not job_id:
        raise ConfigError("job_id: must not be empty")
    if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
        raise ConfigError(f"max_events: must be a positive integer, got {max_events!r}")
    # Options are checked before any file is read, so a typo fails fast and alone.
    KernelSummariser(top_k=top_k)
    WindowBuilder(
        build_resource(job_id=job_id, rank=0, world_size=1, host_name=host_name or "unknown"),
        max_scale=max_scale,
        max_size=max_size,
    )
    failures: list[IngestFailure] = []
    parsed: list[tuple[str, KinetoTrace]] = []
    for path in paths:
        trace = _read_one(path, failures, progress=progress, max_events=max_events)
        if trace is not None:
            parsed.append((str(path), trace))
    offset = _time_offset_ns(
        [trace for _, trace in parsed],
        origin_unix_nano=time_origin_unix_nano,
        now_unix_nano=clock_unix_nano(),
    )
    file_count = len(paths)
    ingested: list[IngestedTrace] = []
    seen_ranks: dict[int, str] = {}
    for position, (path, trace) in enumerate(parsed):
        rank = trace.rank if trace.rank is not None else rank_from_file_name(path)
        if rank is None:
            rank = position
        world_size = trace.world_size
        if world_size is None:
            world_size = max(file_count, rank + 1)
        if rank in seen_ranks:
            failures.append(
                IngestFailure(
                    path,
                    f"{path}: rank {rank} was already ingested from {seen_ranks[rank]}; skipped",
                )
            )
            continue
        seen_ranks[rank] = path
        try:
            resource = _resource(
                trace, job_id=job_id, rank=rank, world_size=world_size, host_name=host_name
            )
        except ConfigError as exc:
            failures.append(IngestFailure(path, f"{path}: {exc}"))
            continue
        builder = WindowBuilder(resource, max_scale=max_scale, max_size=max_size)
        windows = _windows(trace, builder, top_k=top_k, time_offset_ns=offset)
        built, exported = _export(path, windows, exporter)
        if exported < built:
            failures.append(
                IngestFailure(
                    path, f"{path}: {built - exported} of {built} windows failed to export"
                )
            )
        ingested.append(
            IngestedTrace(
                path=path,
                rank=rank,
                world_size=world_size,
                steps=len(trace.steps),
                kernels=sum(len(step.kernels) for step in trace.steps),
                raw_size_bytes=trace.raw_size_bytes,
                exported=exported,
                skipped_events=trace.skipped_events,
                first_skipped=trace.first_skipped,
            )
        )
        if progress is not None:
            progress(f"{path}: rank {rank}: exported {exported}/{built} windows")
    return IngestResult(traces=tuple(ingested), failures=tuple(failures), time_offset_ns=offset)


def _read_one(
    path: str | Path,
    failures: list[IngestFailure],
    *,
    progress: Callable[[str], None] | None,
    max_events: int,
) -> KinetoTrace | None:
    """One file's trace, or ``None`` with its failure appended."""
    started = time.perf_counter()
    try:
        trace = read_trace(path, progress=progress, max_events=max_events)
    except TraceFormatError as exc:
        message = str(exc)
    except Exception as exc:  # a reader bug must cost this file, not the whole ingest
        _log.debug("%s: reading failed", path, exc_info=True)
        message = f"{path}: cannot ingest ({type(exc).__name__}: {exc})"
    else:
        if progress is not None:
            skipped = (
                f"; skipped {trace.skipped_events} malformed event(s) "
                f"(first: {trace.first_skipped})"
                if trace.skipped_events
                else ""
            )
            progress(
                f"{path}: {trace.raw_size_bytes / 1e6:.1f} MB, {len(trace.steps)} steps, "
                f"parsed in {time.perf_counter() - started:.2f} s{skipped}"
            )
        return trace
    _log.error("%s", message)
    failures.append(IngestFailure(str(path), message))
    return None


def _export(
    path: str, windows: Iterator[TraceWindow], exporter: MetricsExporter
) -> tuple[int, int]:
    """Export each window as soon as it is built: ``(built, exported)``."""
    built = exported = 0
    for window in windows:
        built += 1
        try:
            result = exporter.export(window.metrics)
        except Exception as exc:  # the exporter is third-party code: count, keep going
            _log.warning("%s: exporting step %d failed: %r", path, window.step_index, exc)
            continue
        if getattr(result, "name", "SUCCESS") == "SUCCESS":
            exported += 1
    return built, exported


def _time_offset_ns(
    traces: Sequence[KinetoTrace], *, origin_unix_nano: int | None, now_unix_nano: int
) -> int:
    relative = [trace for trace in traces if trace.base_time_unix_nano is None]
    if not relative:
        return 0
    earliest = min(trace.steps[0].start_ns for trace in relative)
    if origin_unix_nano is not None:
        return origin_unix_nano - earliest
    latest = max(max(step.end_ns for step in trace.steps) for trace in relative)
    return now_unix_nano - latest
