"""One export window: whole steps (and the kernels that ran in them) as OTLP ``MetricsData``.

The exporter does not use the SDK's ``MeterProvider``: its collection cycle cannot align a
window with step boundaries. :class:`WindowBuilder` aggregates the steps of one window into
exponential histograms itself and emits SDK ``MetricsData`` (DELTA, one data point per series,
window bounds as ``start_time_unix_nano``/``time_unix_nano``) that any SDK
``MetricExporter`` (OTLP gRPC, OTLP HTTP, in-memory) exports unchanged. With
``temporality="cumulative"`` histograms are running totals instead (``_running``).

Cardinality is bounded by construction, which is why the SDK's default per-instrument
cardinality limit (2000 series) is never relevant and can never be silently hit: a window holds
one ``stepwatch.step.duration`` series, one ``stepwatch.step.last`` series, one
``stepwatch.device.idle.duration`` series, at most ``max_phase_series`` phase series and at most
``max_kernel_series`` kernel series (defaults 32 and 256). Phases or kernel classes past the cap
are folded into ``other`` and counted in :attr:`WindowBuilder.overflow_observations`. A window
without a finished step carries at most three progress gauges instead (where the rank is:
:meth:`WindowBuilder.set_progress`), and the monitor's last one ``stepwatch.monitor.closed``.

Bytes on the wire (bench/kernel_bytes.py: under 1 KB gzipped per rank per step on the DLRM
trace, every kernel class and every docs/schema.md attribute kept): kernel histograms carry no
``min``/``max`` (OTLP makes both optional; see :data:`DEFAULT_KERNEL_MIN_MAX`), their ``sum``
carries 12 significant bits, metrics and kernel points are ordered so deflate finds repeats
close by, and the scope has no version. Nothing else is approximated; buckets and counts are
exact, and step, phase and idle histograms are sent exactly, ``min`` and ``max`` included.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol, TypedDict

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.exporters._histogram import (
    FLOAT_BITS,
    ExponentialHistogram,
    HistogramSnapshot,
)
from stepwatch.exporters._running import RunningTotals, number_metric
from stepwatch.exporters._running import histogram_metric as _histogram_metric

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Metric, MetricsData
    from opentelemetry.sdk.resources import Resource

# The instrumentation scope is "stepwatch" without a version: OTLP makes the version optional,
# no reader stores either (the bridge ignores the scope), and on the one-step DLRM window the
# longer name and the version cost 17 of ~1,000 gzipped bytes (bench/kernel_bytes.py).
SCOPE_NAME = "stepwatch"
OTHER = "other"
DEFAULT_KERNEL_SIGNIFICANT_BITS = 12
"""Significant bits of kernel histograms' sum/min/max on the wire: relative error at most
2**-12 (0.024 %) for ``sum`` and below 2**-11 (0.049 %) for ``min`` (rounded down) and ``max``
(rounded up), both under the detectors' 0.05 % noise floor and 100x under the 5 % fidelity
budget; saves ~22 gzipped bytes per window on the DLRM trace (bench/kernel_bytes.py)."""

DEFAULT_KERNEL_MIN_MAX = False
"""Whether kernel histograms carry ``min``/``max``. Off by default: the populated buckets already
bound every kernel duration within one bucket (4.4 % at the kernel scale 4), the bridge's
p50/p90/p99 come from the buckets, a one-execution histogram's value is its ``sum`` (the bridge
stores it as ``min`` and ``max``), and no detector reads kernel extremes; on the one-step DLRM
window the two fields cost ~100 of ~1,080 gzipped bytes (bench/kernel_bytes.py). Step, phase and
idle histograms always carry exact ``min``/``max``: the stall detectors read the longest step
and phase."""

HISTOGRAM_BUCKETS = ("exponential", "explicit")
"""How histograms go on the wire (``STEPWATCH_HISTOGRAM_BUCKETS``, docs/storage.md):
``exponential`` (the default: compact, exact to 2.2 % at scale 5) or ``explicit``, explicit
buckets on the fixed log-spaced bounds of :data:`~stepwatch.exporters._histogram.
EXPLICIT_GRID_SCALE` (quantiles within 4.5 %), the one histogram kind an OpenTelemetry
Collector's influxdb exporter (otel2influx, telegraf-prometheus-v1) stores: it has no case for
exponential histograms and fails the whole request on one."""

TEMPORALITIES = ("delta", "cumulative")
"""What histograms go out as (``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``,
:func:`~stepwatch.exporters._sdk_env.temporality_preference`): ``delta``, one window each (the
default), or ``cumulative``, running totals since the first window (``_running``)."""


class WindowOptions(TypedDict):
    """The :class:`WindowBuilder` options a monitor resolves from its arguments and variables."""

    histogram_buckets: str
    temporality: str


@dataclasses.dataclass(frozen=True)
class KernelWindow:
    """Kernel events of one export window, already classified.

    Attributes:
        durations_s: ``(kernel class, category)`` → one duration per execution, in seconds.
        idle_durations_s: Device-idle gap time, one value per step, in seconds.
    """

    durations_s: Mapping[tuple[str, str], Sequence[float]]
    idle_durations_s: Sequence[float] = ()


class Progress(NamedTuple):
    """Where a rank is when a window is built (the progress gauges of docs/schema.md).

    Attributes:
        step_index: The step in progress (the next one to finish).
        step_elapsed_s: Seconds since the rank last finished a step (since the monitor
            started when none has): how long it has made no progress.
        phase: The innermost phase open now, or None between phases.
        phase_elapsed_s: Seconds since that phase was entered (None without a phase).
    """

    step_index: int
    step_elapsed_s: float
    phase: str | None = None
    phase_elapsed_s: float | None = None


class KernelSource(Protocol):
    """A producer of kernel events (CUPTI, torch.profiler, a trace file) for a StepMonitor.
    It may also have ``on_monitor_start()`` (never raises), called when the monitor is made,
    and ``charge(cpu_ns)``: the monitor's export work after each export, paid from its budget.
    """

    def on_step_end(self, step_index: int) -> int | None:
        """Mark a step boundary (training thread: O(1), never raises). An int ``n > 0`` back:
        the next ``n`` step ends go unreported (the next ``step_index`` says how many)."""

    def drain(self) -> KernelWindow:
        """Kernel events since the previous drain. Called on the export thread."""

    def close(self) -> None:
        """Stop collecting and release resources."""


STAMP_NS: Final = 1_000_000
"""Window times go out in whole milliseconds (:func:`window_stamp`)."""


def window_stamp(unix_nano: int, *, after: int | None = None) -> int:
    """``unix_nano`` rounded to the millisecond, and later than ``after`` when given.

    A window's time is the end of its last step; nanosecond digits there are timer jitter that
    InfluxDB stores for every field of every point (TSM encodes a series' timestamps as
    deltas scaled by their largest common power of ten: jittered nanoseconds take 8 bytes
    per field and point, whole milliseconds about 2), which was two thirds of the stored bytes
    per rank and window (bench/storage_bytes.py). Half a millisecond is nothing against a
    window of whole steps. ``after`` (the previous window's stamp) keeps the stamps of one
    monitor strictly increasing, so two windows never share a time and overwrite each other.
    """
    stamped = (unix_nano + STAMP_NS // 2) // STAMP_NS * STAMP_NS
    if after is not None and stamped <= after:
        stamped = (after // STAMP_NS + 1) * STAMP_NS  # the next millisecond after it
    return stamped


def build_resource(
    *,
    job_id: str,
    rank: int,
    world_size: int,
    host_name: str | None = None,
    local_rank: int | None = None,
    dp_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    service_name: str = "stepwatch",
) -> Resource:
    """The OTel resource of one rank of one job, with exactly the attributes of docs/schema.md.

    The resource is built directly (not with ``Resource.create``) so no SDK default or
    ``OTEL_RESOURCE_ATTRIBUTES`` key sneaks in: every key is one the bridge turns into a tag.

    Args:
        job_id: ``stepwatch.job.id``, the training run; not empty.
        rank: ``stepwatch.rank``, the global rank, below ``world_size``.
        world_size: ``stepwatch.world_size``, at least 1.
        host_name: ``host.name`` (``socket.gethostname()`` when None).
        local_rank: ``stepwatch.local_rank``, sent when given (so are the next three).
        dp_rank: ``stepwatch.dp_rank``, the data-parallel coordinate.
        tp_rank: ``stepwatch.tp_rank``, the tensor-parallel coordinate.
        pp_rank: ``stepwatch.pp_rank``, the pipeline-parallel coordinate.
        service_name: ``service.name``.

    Returns:
        The resource.

    Raises:
        ConfigError: An argument is empty, negative or inconsistent (names the argument).
    """
    from opentelemetry.sdk.resources import Resource

    if not isinstance(job_id, str) or not job_id:
        raise ConfigError(f"job_id must be a non-empty string, got {job_id!r}")
    _check_int("world_size", world_size, minimum=1)
    _check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ConfigError(f"rank must be < world_size ({world_size}), got {rank}")
    if host_name is None:
        host_name = socket.gethostname()
    if not isinstance(host_name, str) or not host_name:
        raise ConfigError(f"host_name must be a non-empty string, got {host_name!r}")
    if not isinstance(service_name, str) or not service_name:
        raise ConfigError(f"service_name must be a non-empty string, got {service_name!r}")
    attributes: dict[str, str | int] = {
        _schema.JOB_ID: job_id,
        _schema.RANK: rank,
        _schema.WORLD_SIZE: world_size,
        _schema.HOST_NAME: host_name,
    }
    for name, key, value in (
        ("local_rank", _schema.LOCAL_RANK, local_rank),
        ("dp_rank", _schema.DP_RANK, dp_rank),
        ("tp_rank", _schema.TP_RANK, tp_rank),
        ("pp_rank", _schema.PP_RANK, pp_rank),
    ):
        if value is not None:
            _check_int(name, value, minimum=0)
            attributes[key] = value
    attributes[_schema.SERVICE_NAME] = service_name
    return Resource(attributes)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


class WindowBuilder:
    """Aggregates whole steps and kernel events into the ``MetricsData`` of one window.

    Owned by one thread (the export thread); not thread-safe.

    Args:
        resource: The rank's resource (see :func:`build_resource`).
        max_scale: Finest exponential-histogram scale; histograms downscale from here.
        max_size: Most buckets per histogram.
        max_phase_series: Most distinct phases per window; more fold into ``other``.
        max_kernel_series: Most ``(class, category)`` series per window; more fold into
            ``("other", "other")``.
        kernel_significant_bits: Significant bits kept in the ``sum``, ``min`` (rounded down)
            and ``max`` (rounded up) of kernel histograms on the wire; 53 sends them exactly.
            Step, phase and idle histograms are always sent exactly.
        kernel_min_max: Send ``min``/``max`` on kernel histograms (see
            :data:`DEFAULT_KERNEL_MIN_MAX`).
        histogram_buckets: ``exponential`` or ``explicit`` (see :data:`HISTOGRAM_BUCKETS`).
        temporality: ``delta`` or ``cumulative`` (see :data:`TEMPORALITIES`). Cumulative
            histograms carry exact sums (a rounded total would err by a share of the run, not
            of the window, once differenced) and their series are capped over the run.

    Raises:
        ConfigError: An option is out of range.
    """

    def __init__(
        self,
        resource: Resource,
        *,
        max_scale: int = 5,
        max_size: int = 160,
        max_phase_series: int = 32,
        max_kernel_series: int = 256,
        kernel_significant_bits: int = DEFAULT_KERNEL_SIGNIFICANT_BITS,
        kernel_min_max: bool = DEFAULT_KERNEL_MIN_MAX,
        histogram_buckets: str = "exponential",
        temporality: str = "delta",
    ) -> None:
        ExponentialHistogram(max_scale=max_scale, max_size=max_size)  # validates both
        if histogram_buckets not in HISTOGRAM_BUCKETS:
            raise ConfigError(
                f"histogram_buckets must be one of {HISTOGRAM_BUCKETS}, got {histogram_buckets!r}"
            )
        self._explicit = histogram_buckets == "explicit"
        if temporality not in TEMPORALITIES:
            raise ConfigError(f"temporality must be one of {TEMPORALITIES}, got {temporality!r}")
        if max_phase_series < 1:
            raise ConfigError(f"max_phase_series must be >= 1, got {max_phase_series}")
        if max_kernel_series < 1:
            raise ConfigError(f"max_kernel_series must be >= 1, got {max_kernel_series}")
        if (
            isinstance(kernel_significant_bits, bool)
            or not isinstance(kernel_significant_bits, int)
            or not 1 <= kernel_significant_bits <= FLOAT_BITS
        ):
            raise ConfigError(
                f"kernel_significant_bits must be an integer in [1, {FLOAT_BITS}], "
                f"got {kernel_significant_bits!r}"
            )
        if not isinstance(kernel_min_max, bool):
            raise ConfigError(f"kernel_min_max must be a bool, got {kernel_min_max!r}")
        self._kernel_significant_bits = kernel_significant_bits
        self._kernel_min_max = kernel_min_max
        self._resource = resource
        self._max_scale = max_scale
        self._max_size = max_size
        self._max_phase_series = max_phase_series
        self._max_kernel_series = max_kernel_series
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._scope = InstrumentationScope(SCOPE_NAME)
        self._totals: RunningTotals | None = None
        if temporality == "cumulative":
            self._totals = RunningTotals(
                max_size=max_size,
                max_series={
                    _schema.PHASE_DURATION: max_phase_series,
                    _schema.KERNEL_DURATION: max_kernel_series,
                },
                overflow={
                    _schema.PHASE_DURATION: {_schema.PHASE: OTHER},
                    _schema.KERNEL_DURATION: {
                        _schema.KERNEL_CLASS: OTHER,
                        _schema.KERNEL_CATEGORY: OTHER,
                    },
                },
            )
        self._counts_run: dict[tuple[str, str], int] = {}  # cumulative: _counts since the start
        self._overflow_observations = 0
        self.rejected_observations = 0
        """Durations refused for being negative, NaN or infinite (cumulative)."""
        self._reset()

    @property
    def overflow_observations(self) -> int:
        """Observations folded into ``other`` because a series cap was reached (cumulative)."""
        run_wide = 0 if self._totals is None else self._totals.overflow_observations
        return self._overflow_observations + run_wide

    @property
    def temporality(self) -> str:
        """``delta`` or ``cumulative``."""
        return "delta" if self._totals is None else "cumulative"

    def _new_histogram(self) -> ExponentialHistogram:
        return ExponentialHistogram(max_scale=self._max_scale, max_size=self._max_size)

    def _reset(self) -> None:
        self._steps = self._new_histogram()
        self._sampled = self._new_histogram()
        # Counters of steps: (metric, phase or "") -> steps (_count_metric).
        self._counts: dict[tuple[str, str], int] = {}
        self._idle = self._new_histogram()
        self._phases: dict[str, ExponentialHistogram] = {}
        self._kernels: dict[tuple[str, str], ExponentialHistogram] = {}
        self._last_step: int | None = None
        self._progress: Progress | None = None
        self._closed = False

    def _record(self, histogram: ExponentialHistogram, value: float) -> None:
        if not histogram.record(value):
            self.rejected_observations += 1

    def add_step(
        self, *, step_index: int, duration_s: float, phases_s: Mapping[str, float]
    ) -> None:
        """Add one finished step.

        Args:
            step_index: The step's index; the largest in the window becomes ``stepwatch.step.last``.
            duration_s: Wall time of the step.
            phases_s: Phase name → time spent in that phase during this step.
        """
        self._record(self._steps, duration_s)
        if self._last_step is None or step_index > self._last_step:
            self._last_step = step_index
        for phase, seconds in phases_s.items():
            self._record(self._phase_histogram(phase, 1), seconds)

    def add_steps(
        self,
        *,
        last_step_index: int,
        durations_s: Sequence[float],
        phases_s: Mapping[str, Sequence[float]],
        weighted_phases_s: Mapping[str, tuple[Sequence[float], Sequence[int]]] | None = None,
        sampled_steps_s: tuple[Sequence[float], Sequence[int]] | None = None,
        sampling: bool = False,
    ) -> None:
        """Add many finished steps at once: what :meth:`add_step` on each does, in one pass
        per histogram (:meth:`ExponentialHistogram.record_many`; the export thread's cost).

        Args:
            last_step_index: The largest step index among them.
            durations_s: Wall time of each step.
            phases_s: Phase name → that phase's time in each step it occurred in.
            weighted_phases_s: Phase name → (time, weight) of each sampled step it occurred
                in: auto mode's phases, timed on a sample of steps (``_sampling``).
            sampled_steps_s: (wall time, weight) of each step whose phases were timed, with
                the weights of ``weighted_phases_s``, while phases are sampled
                (``stepwatch.step.sampled.duration`` and ``stepwatch.step.sampled``).
            sampling: Whether auto mode's phases are sampled in these steps: the phases of
                ``phases_s`` alone, timed on every step, are then said to be
                (``stepwatch.phase.every_step``).
        """
        self.rejected_observations += self._steps.record_many(durations_s)
        if self._last_step is None or last_step_index > self._last_step:
            self._last_step = last_step_index
        weighted = weighted_phases_s or {}
        for phase, values in phases_s.items():
            histogram = self._phase_histogram(phase, len(values))
            self.rejected_observations += histogram.record_many(values)
            if sampling and phase not in weighted:
                name = phase if phase in self._phases else OTHER
                self._count(_schema.PHASE_EVERY_STEP, name, len(values))
        for phase, (values, weights) in weighted.items():
            histogram = self._phase_histogram(phase, sum(weights))
            self.rejected_observations += histogram.record_weighted(values, weights)
        if sampled_steps_s is not None:
            values, weights = sampled_steps_s
            self.rejected_observations += self._sampled.record_weighted(values, weights)
            self._count(_schema.SAMPLED_STEPS, "", len(values))

    def _phase_histogram(self, phase: str, observations: int) -> ExponentialHistogram:
        """The histogram of ``phase``, made on first use (past the cap: ``other``'s)."""
        histogram = self._phases.get(phase)
        if histogram is None:
            if len(self._phases) >= self._max_phase_series and phase != OTHER:
                self._overflow_observations += observations
                phase = OTHER
                histogram = self._phases.get(phase)
            if histogram is None:
                histogram = self._phases[phase] = self._new_histogram()
        return histogram

    def add_kernels(self, window: KernelWindow) -> None:
        """Add the kernel executions and device-idle gaps of a drained :class:`KernelWindow`."""
        overflow = (OTHER, OTHER)
        for key, durations in window.durations_s.items():
            histogram = self._kernels.get(key)
            if histogram is None:
                if len(self._kernels) >= self._max_kernel_series and key != overflow:
                    self._overflow_observations += len(durations)
                    key = overflow
                    histogram = self._kernels.get(key)
                if histogram is None:
                    histogram = self._kernels[key] = self._new_histogram()
            self.rejected_observations += histogram.record_many(durations)
        self.rejected_observations += self._idle.record_many(window.idle_durations_s)

    def set_progress(self, progress: Progress) -> None:
        """Say where the rank is now (the window then carries the progress gauges).

        The monitor sets it on windows that hold no finished step, so a rank stuck inside a
        step still reports its step, its phase and for how long (docs/schema.md).
        """
        self._progress = progress

    def mark_closed(self) -> None:
        """Make this the monitor's last window (``stepwatch.monitor.closed`` = 1)."""
        self._closed = True

    def _count(self, name: str, phase: str, steps: int) -> None:
        key = (name, phase)
        self._counts[key] = self._counts.get(key, 0) + steps

    def _count_metric(self, name: str, bounds: tuple[int, int]) -> Metric:
        """A counter of steps: ``stepwatch.step.sampled`` (how many steps the window's sampled
        phase times rest on), ``stepwatch.phase.every_step`` (per phase timed on every step
        while the others are sampled); since the first window when cumulative."""
        counts = {key: value for key, value in self._counts.items() if key[0] == name}
        if self._totals is not None:
            for key, value in counts.items():
                counts[key] = self._counts_run[key] = self._counts_run.get(key, 0) + value
        points = [({_schema.PHASE: p} if p else {}, v) for (_, p), v in sorted(counts.items())]
        return number_metric(name, "{step}", points, bounds, counter=self.temporality)

    @property
    def empty(self) -> bool:
        """True when nothing was added since the last build."""
        return (
            self._steps.count == 0
            and self._idle.count == 0
            and not any(h.count for h in self._phases.values())
            and not any(h.count for h in self._kernels.values())
        )

    @staticmethod
    def stamp(unix_nano: int, *, after: int | None = None) -> int:
        """A window time as it goes out: :func:`window_stamp`."""
        return window_stamp(unix_nano, after=after)

    def build(self, *, start_unix_nano: int, end_unix_nano: int) -> MetricsData | None:
        """The window as ``MetricsData``; resets the builder.

        Args:
            start_unix_nano: Window start (the first step's start), Unix epoch nanoseconds.
            end_unix_nano: Window end (the last step's end), Unix epoch nanoseconds.

        Returns:
            The metrics, or ``None`` when nothing was added since the last build.
        """
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics

        if self.empty and self._last_step is None and self._progress is None and not self._closed:
            self._reset()
            return None
        end_unix_nano = max(end_unix_nano, start_unix_nano)
        bounds = (start_unix_nano, end_unix_nano)
        totals = self._totals
        histogram_bounds = bounds
        if totals is not None:  # cumulative: every point since the first window's start
            if totals.start_unix_nano is None:
                totals.start_unix_nano = start_unix_nano
            histogram_bounds = (totals.start_unix_nano, end_unix_nano)
        # Metric and point order is free in OTLP; this one is the smallest gzipped on the DLRM
        # window (bench/kernel_bytes.py): the one-point histograms together, so deflate finds
        # their shared bytes close by, and kernel points by total time, so neighbours have
        # similar offsets, bucket runs and doubles.
        metrics: list[Metric] = []
        explicit = self._explicit

        def histograms(name: str, series: list[tuple[dict[str, str], HistogramSnapshot]]) -> None:
            if totals is not None:
                series = totals.add(name, series)
            if series:
                metrics.append(
                    _histogram_metric(
                        name,
                        series,
                        histogram_bounds,
                        explicit=explicit,
                        cumulative=totals is not None,
                    )
                )

        if self._steps.count:
            histograms(_schema.STEP_DURATION, [({}, self._steps.snapshot())])
        if self._sampled.count:
            histograms(_schema.SAMPLED_STEP_DURATION, [({}, self._sampled.snapshot())])
            metrics.append(self._count_metric(_schema.SAMPLED_STEPS, histogram_bounds))
        if any(name == _schema.PHASE_EVERY_STEP for name, _ in self._counts):
            metrics.append(self._count_metric(_schema.PHASE_EVERY_STEP, histogram_bounds))
        if self._last_step is not None:
            metrics.append(
                number_metric(_schema.STEP_LAST, "{step}", [({}, self._last_step)], bounds)
            )
        if self._idle.count:
            histograms(_schema.DEVICE_IDLE_DURATION, [({}, self._idle.snapshot())])
        phases = [
            ({_schema.PHASE: phase}, histogram.snapshot())
            for phase, histogram in sorted(self._phases.items())
            if histogram.count
        ]
        histograms(_schema.PHASE_DURATION, phases)
        kernels = self._kernel_metric(histogram_bounds)
        if kernels is not None:
            metrics.append(kernels)
        if self._progress is not None:
            metrics.extend(_progress_metrics(self._progress, bounds))
        if self._closed:
            metrics.append(number_metric(_schema.MONITOR_CLOSED, "1", [({}, 1)], bounds))
        self._reset()
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=self._resource,
                    scope_metrics=[ScopeMetrics(scope=self._scope, metrics=metrics, schema_url="")],
                    schema_url="",
                )
            ]
        )

    def _kernel_metric(self, bounds: tuple[int, int]) -> Metric | None:
        """The window's kernel histograms as one metric, by total time; ``None`` if none."""
        totals = self._totals
        kernels = [
            (
                {_schema.KERNEL_CLASS: kernel_class, _schema.KERNEL_CATEGORY: category},
                histogram.snapshot(),
            )
            for (kernel_class, category), histogram in sorted(self._kernels.items())
            if histogram.count
        ]
        if totals is not None:
            kernels = totals.add(_schema.KERNEL_DURATION, kernels)
        else:  # a cumulative sum stays exact: its rounding error would be a share of the run
            bits = self._kernel_significant_bits
            sent = self._kernel_min_max  # min/max rounded only when they are sent
            kernels = [
                (key, snap.with_significant_bits(bits, bounds=sent)) for key, snap in kernels
            ]
        kernels.sort(key=lambda series: series[1].sum)  # stable: ties stay in (class, category)
        if not kernels:
            return None
        return _histogram_metric(
            _schema.KERNEL_DURATION,
            kernels,
            bounds,
            min_max=self._kernel_min_max,
            explicit=self._explicit,
            cumulative=totals is not None,
        )


def _progress_metrics(progress: Progress, bounds: tuple[int, int]) -> list[Metric]:
    """The progress gauges of docs/schema.md, stamped at the window's end (the export)."""
    phase = {_schema.PHASE: progress.phase} if progress.phase is not None else {}
    metrics = [
        number_metric(_schema.STEP_CURRENT, "{step}", [({}, progress.step_index)], bounds),
        number_metric(_schema.STEP_ELAPSED, "s", [(phase, progress.step_elapsed_s)], bounds),
    ]
    if progress.phase is not None and progress.phase_elapsed_s is not None:
        metrics.append(
            number_metric(_schema.PHASE_ELAPSED, "s", [(phase, progress.phase_elapsed_s)], bounds)
        )
    return metrics
