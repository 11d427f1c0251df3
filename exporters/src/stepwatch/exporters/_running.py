"""Running totals per series: what a window's histograms become under CUMULATIVE temporality.

``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=cumulative`` (OTLP Exporter,
"Additional Environment Variable Configuration":
https://opentelemetry.io/docs/specs/otel/metrics/sdk_exporters/otlp/) asks for cumulative
histograms and counters. A cumulative point holds everything since its
``start_time_unix_nano`` (data model, "Temporality":
https://opentelemetry.io/docs/specs/otel/metrics/data-model/#temporality), so per series
(metric + point attributes; the resource is the monitor's and fixed) :class:`RunningTotals`
keeps one histogram of the whole run and merges each window into it
(:func:`~stepwatch.exporters._histogram.merge_snapshots`).

Choices (docs/exporters.md, "Temporality"):

- Only the series that had observations in a window are sent in it. The data model allows
  a gap ("Resets and gaps"): the next point's total still covers what the gap did not hold,
  and a reader that differences totals (the bridge) attributes it to the interval since the
  series' previous point. Re-sending unchanged totals would cost every kernel class that ran
  once, in every later window, on the wire.
- ``min``/``max`` are the run's (the smallest and largest value since the start).
- Memory is bounded like a window: at most ``max_series`` series per metric over the whole
  run; the values of a new series past the cap go to the overflow series (``other``) and are
  counted, as in a delta window.

:func:`histogram_metric` writes a window's or a run's histograms as one OTLP metric;
:func:`number_metric` a window's gauges or counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from stepwatch.exporters._histogram import HistogramSnapshot, explicit_layout, merge_snapshots

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Metric

_T = TypeVar("_T")

# Metric descriptions are not sent: OTLP makes them optional, the bridge does not store them,
# and on a one-step window they cost ~130 of ~1,250 gzipped bytes (bench/kernel_bytes.py).
# docs/schema.md describes every metric.
_DESCRIPTION = ""

Series = tuple[dict[str, str], HistogramSnapshot]


class RunningTotals:
    """The running histogram of every series of one monitor (export thread only).

    Args:
        max_size: Most buckets per running histogram.
        max_series: Metric name → most series of that metric (more fold into ``overflow``).
        overflow: Metric name → the attributes of its overflow series.
    """

    def __init__(
        self,
        *,
        max_size: int,
        max_series: Mapping[str, int],
        overflow: Mapping[str, dict[str, str]],
    ) -> None:
        self._max_size = max_size
        self._max_series = dict(max_series)
        self._overflow = dict(overflow)
        self._totals: dict[str, dict[tuple[tuple[str, str], ...], HistogramSnapshot]] = {}
        self.start_unix_nano: int | None = None
        """Start of every cumulative point: the first window's start (constant for the run)."""
        self.overflow_observations = 0
        """Observations folded into an overflow series by the run-wide cap."""

    def add(self, metric: str, window: Sequence[Series]) -> list[Series]:
        """Merge one window's series of ``metric``; their running totals, in ``window``'s order.

        A series folded into the overflow series appears once, as that series' total.
        """
        totals = self._totals.setdefault(metric, {})
        cap = self._max_series.get(metric)
        touched: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
        for attributes, snapshot in window:
            if not snapshot.count:
                continue
            key = tuple(sorted(attributes.items()))
            if key not in totals and cap is not None and len(totals) >= cap:
                overflow = self._overflow.get(metric, {})
                overflow_key = tuple(sorted(overflow.items()))
                if key != overflow_key:
                    self.overflow_observations += snapshot.count
                    key, attributes = overflow_key, overflow
            total = totals.get(key)
            totals[key] = (
                snapshot
                if total is None
                else merge_snapshots(total, snapshot, max_size=self._max_size)
            )
            touched.setdefault(key, attributes)
        return [(attributes, totals[key]) for key, attributes in touched.items()]

    def series_count(self) -> int:
        """Series held, all metrics together."""
        return sum(len(totals) for totals in self._totals.values())


_CONSTRUCTORS: dict[type, Callable[..., Any]] = {}


def fast_constructor(cls: type[_T]) -> Callable[..., _T]:
    """``cls(**fields)`` without the frozen dataclass' ``__init__`` (the SDK's data points).

    A frozen dataclass' ``__init__`` sets each field with ``object.__setattr__``: ~2.6 us for
    an ``ExponentialHistogramDataPoint``, ~0.5 us for a new instance whose ``__dict__`` is
    filled at once, and the export thread makes ~80 of them (points and buckets) a window with
    20 kernel classes. The instance is the same (equal, same type; tested). ``cls`` itself
    where that cannot be done safely: not a plain dataclass, slots, or a ``__post_init__``.
    """
    known = _CONSTRUCTORS.get(cls)
    if known is not None:
        return known
    constructor: Callable[..., Any] = cls
    if (
        dataclasses.is_dataclass(cls)
        and not hasattr(cls, "__post_init__")
        and "__slots__" not in vars(cls)
    ):
        fields = dataclasses.fields(cls)
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        factories = [
            (f.name, f.default_factory)
            for f in fields
            if f.default_factory is not dataclasses.MISSING
        ]
        new = object.__new__

        def constructor(**values: Any) -> Any:
            instance = new(cls)
            state = instance.__dict__
            state.update(defaults)
            for name, factory in factories:
                state[name] = factory()
            state.update(values)
            return instance

    _CONSTRUCTORS[cls] = constructor
    return constructor


def histogram_metric(
    name: str,
    series: Sequence[tuple[dict[str, str], HistogramSnapshot]],
    bounds: tuple[int, int],
    *,
    min_max: bool = True,
    explicit: bool = False,
    cumulative: bool = False,
) -> Metric:
    """One histogram metric of ``series``, DELTA or CUMULATIVE, exponential or explicit."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Buckets,
        ExponentialHistogramDataPoint,
        HistogramDataPoint,
        Metric,
    )
    from opentelemetry.sdk.metrics.export import ExponentialHistogram as OtelHistogram
    from opentelemetry.sdk.metrics.export import Histogram as ExplicitHistogram

    # OTLP's min and max are optional fields; the SDK's encoder leaves them unset when None
    # (its dataclass annotates them as float, hence the cast).
    unset = cast(float, None)
    temporality = AggregationTemporality.CUMULATIVE if cumulative else AggregationTemporality.DELTA
    if explicit:
        explicit_points = []
        for attributes, snap in series:
            explicit_bounds, bucket_counts = explicit_layout(snap, contiguous=cumulative)
            explicit_points.append(
                HistogramDataPoint(
                    attributes=attributes,
                    start_time_unix_nano=bounds[0],
                    time_unix_nano=bounds[1],
                    count=snap.count,
                    sum=snap.sum,
                    bucket_counts=bucket_counts,
                    explicit_bounds=explicit_bounds,
                    min=snap.min if min_max else unset,
                    max=snap.max if min_max else unset,
                )
            )
        return Metric(
            name=name,
            description=_DESCRIPTION,
            unit="s",
            data=ExplicitHistogram(
                data_points=explicit_points, aggregation_temporality=temporality
            ),
        )
    points = []
    new_point = fast_constructor(ExponentialHistogramDataPoint)
    new_buckets = fast_constructor(Buckets)
    start, end = bounds
    for attributes, snap in series:
        points.append(
            new_point(
                attributes=attributes,
                start_time_unix_nano=start,
                time_unix_nano=end,
                count=snap.count,
                sum=snap.sum,
                scale=snap.scale,
                zero_count=snap.zero_count,
                positive=new_buckets(offset=snap.offset, bucket_counts=list(snap.bucket_counts)),
                negative=new_buckets(offset=0, bucket_counts=[]),
                flags=0,
                min=snap.min if min_max else unset,
                max=snap.max if min_max else unset,
            )
        )
    return Metric(
        name=name,
        description=_DESCRIPTION,
        unit="s",
        data=OtelHistogram(data_points=points, aggregation_temporality=temporality),
    )


def number_metric(
    name: str,
    unit: str,
    points: Sequence[tuple[dict[str, str], int | float]],
    bounds: tuple[int, int],
    *,
    counter: str | None = None,
) -> Metric:
    """A gauge, or with ``counter`` (``"delta"``/``"cumulative"``) a monotonic sum."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Metric,
        NumberDataPoint,
        Sum,
    )

    data_points = [
        NumberDataPoint(
            attributes=attributes,
            start_time_unix_nano=bounds[0],
            time_unix_nano=bounds[1],
            value=value,
        )
        for attributes, value in points
    ]
    data: Gauge | Sum = Gauge(data_points=data_points)
    if counter is not None:
        temporality = (
            AggregationTemporality.CUMULATIVE
            if counter == "cumulative"
            else AggregationTemporality.DELTA
        )
        data = Sum(data_points=data_points, aggregation_temporality=temporality, is_monotonic=True)
    return Metric(name=name, description=_DESCRIPTION, unit=unit, data=data)
