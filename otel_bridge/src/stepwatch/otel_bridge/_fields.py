"""One OTLP data point → its InfluxDB fields (the field table of docs/storage.md).

Field names follow the OpenTelemetry Collector's influxdb exporter (``otel2influx``, schema
``telegraf-prometheus-v1``); stepwatch adds ``mean``, ``min``, ``max``, the quantiles of
:data:`QUANTILES` and ``start_time_unix_nano``. Histogram buckets are stored per
:data:`LAYOUTS`: ``compact`` (the default) puts them in one ``buckets`` string field
(``_bucket_text``), ``per_bound`` writes one field per bound as otel2influx does. A point
that cannot be stored raises :class:`Rejected` with the reason.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from stepwatch.core._lineproto import FieldValue
from stepwatch.otel_bridge._bucket_text import counts_text, encode_explicit, encode_exponential
from stepwatch.otel_bridge._buckets import (
    MAX_BUCKETS,
    Buckets,
    explicit_buckets,
    exponential_buckets,
    format_bound,
    nearest_rank_quantile,
    populated_edges,
    range_bounds,
)
from stepwatch.otel_bridge._reasons import (
    REASON_BUCKET_LAYOUT,
    REASON_COUNT_MISMATCH,
    REASON_IMPLAUSIBLE_DURATION,
    REASON_NEGATIVE_DURATION,
    REASON_NO_VALUE,
    REASON_NON_FINITE,
    Rejected,
)

if TYPE_CHECKING:
    from opentelemetry.proto.metrics.v1.metrics_pb2 import (
        ExponentialHistogramDataPoint,
        HistogramDataPoint,
        NumberDataPoint,
        SummaryDataPoint,
    )

    DataPoint = (
        NumberDataPoint | HistogramDataPoint | ExponentialHistogramDataPoint | SummaryDataPoint
    )

QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
"""The quantile fields derived from every histogram in the ``per_bound`` layout (docs/storage.md,
"Derived quantiles")."""

COMPACT_QUANTILES: tuple[tuple[str, float], ...] = QUANTILES[:2]
"""The quantile fields derived in the ``compact`` layout: ``p50`` and ``p90`` (the ones the
dashboards and report read). ``p99`` and every other quantile come from the ``buckets`` field
(:func:`~stepwatch.otel_bridge.bucket_quantile`), and ``mean`` is ``sum / count``: each stored
field costs its own timestamps on disk (docs/deployment.md, "Stored bytes")."""

LAYOUT_COMPACT = "compact"
LAYOUT_PER_BOUND = "per_bound"
LAYOUTS: tuple[str, ...] = (LAYOUT_COMPACT, LAYOUT_PER_BOUND)
"""How histogram buckets (and summary quantiles) are stored (docs/storage.md, "Histogram
layouts"): ``compact``, one ``buckets`` string field, so a measurement's field keys are
:data:`COMPACT_FIELDS` whatever the data; ``per_bound``, one field per bound (otel2influx's
columns, unbounded)."""

COMPACT_FIELDS: frozenset[str] = frozenset(
    {"count", "sum", "min", "max", "buckets", "quantiles", "start_time_unix_nano"}
    | {name for name, _ in QUANTILES}
    | {"gauge", "counter"}
)
"""Every field key the compact layout can write, all metric kinds together."""


def point_fields(
    kind: str,
    point: DataPoint,
    *,
    monotonic: bool,
    duration: bool,
    max_duration_s: float | None,
    layout: str = LAYOUT_COMPACT,
) -> dict[str, FieldValue]:
    """The fields of one data point of a metric of ``kind`` (``Metric.WhichOneof("data")``).

    Args:
        kind: ``gauge``, ``sum``, ``histogram``, ``exponential_histogram`` or ``summary``.
        point: the data point.
        monotonic: a ``sum`` is monotonic (stored as ``counter``, else ``gauge``).
        duration: the metric measures durations (no negative values).
        max_duration_s: a duration whose max or mean exceeds this is implausible; None: any.
        layout: one of :data:`LAYOUTS`.

    Raises:
        Rejected: the point cannot be stored; ``reason`` says why.
    """
    if kind == "gauge":
        fields = _number_fields(point, "gauge")  # type: ignore[arg-type]
    elif kind == "sum":
        fields = _number_fields(point, "counter" if monotonic else "gauge")  # type: ignore[arg-type]
    elif kind == "histogram":
        fields = _histogram_fields(point, duration=duration, layout=layout)  # type: ignore[arg-type]
    elif kind == "exponential_histogram":
        fields = (
            _compact_positive(point, duration)  # type: ignore[arg-type]
            if layout == LAYOUT_COMPACT
            else None
        ) or _exponential_fields(point, duration=duration, layout=layout)  # type: ignore[arg-type]
    else:
        fields = _summary_fields(point, duration=duration, layout=layout)  # type: ignore[arg-type]
    if duration and max_duration_s is not None:
        _plausible(fields, max_duration_s)
    return fields


def _plausible(fields: Mapping[str, FieldValue], max_duration_s: float) -> None:
    """A duration histogram/summary's max and mean stay within ``max_duration_s``.

    The sum alone is not checked: a cumulative histogram's sum grows with the run.
    """
    count, total = fields.get("count"), fields.get("sum")
    mean = total / count if isinstance(total, float) and isinstance(count, float) and count else 0.0
    maximum = fields.get("max")  # summaries carry neither max nor mean: the mean is computed
    if mean > max_duration_s or (isinstance(maximum, float) and maximum > max_duration_s):
        raise Rejected(REASON_IMPLAUSIBLE_DURATION)


def _finite(*values: float) -> None:
    if not all(math.isfinite(value) for value in values):
        raise Rejected(REASON_NON_FINITE)


def _number_fields(point: NumberDataPoint, field: str) -> dict[str, FieldValue]:
    kind = point.WhichOneof("value")
    if kind is None:
        raise Rejected(REASON_NO_VALUE)
    value = float(point.as_int) if kind == "as_int" else point.as_double
    _finite(value)
    fields: dict[str, FieldValue] = {field: value}
    if point.start_time_unix_nano:
        fields["start_time_unix_nano"] = int(point.start_time_unix_nano)
    return fields


class _Head(NamedTuple):
    """A histogram's ``count``/``sum``/``mean``/``min``/``max`` fields, and the ``min`` and
    ``max`` that bound its quantiles (known exactly for one observation)."""

    fields: dict[str, FieldValue]
    minimum: float | None
    maximum: float | None


def _histogram_head(
    point: HistogramDataPoint | ExponentialHistogramDataPoint, *, duration: bool
) -> _Head:
    count = int(point.count)
    fields: dict[str, FieldValue] = {"count": float(count)}
    minimum = point.min if point.HasField("min") else None
    maximum = point.max if point.HasField("max") else None
    if point.HasField("sum"):
        total = point.sum
        if not math.isfinite(total):
            raise Rejected(REASON_NON_FINITE)
        if duration and total < 0:
            raise Rejected(REASON_NEGATIVE_DURATION)
        fields["sum"] = total
        if count > 0:
            fields["mean"] = total / count
        if count == 1:
            # One observation is its own sum: min and max are optional in OTLP and stepwatch's
            # kernel histograms leave them out, but they are known exactly here.
            minimum = total if minimum is None else minimum
            maximum = total if maximum is None else maximum
    if minimum is not None:
        _bounded_value(minimum, duration)
        fields["min"] = minimum
    if maximum is not None:
        _bounded_value(maximum, duration)
        fields["max"] = maximum
    if minimum is not None and maximum is not None and minimum > maximum and count > 0:
        raise Rejected(REASON_BUCKET_LAYOUT)
    return _Head(fields, minimum, maximum)


def _bounded_value(value: float, duration: bool) -> None:
    if not math.isfinite(value):
        raise Rejected(REASON_NON_FINITE)
    if duration and value < 0:
        raise Rejected(REASON_NEGATIVE_DURATION)


DERIVED_BITS = 12
"""Significant bits of the derived ``p50`` and ``p90`` in the compact layout."""


def _rounded(value: float, minimum: float | None, maximum: float | None) -> float:
    """``value`` to :data:`DERIVED_BITS` significant bits (relative error < 2**-12), kept in
    ``[minimum, maximum]``: a float's last 40 bits of noise cost InfluxDB's XOR float encoding
    ~4 bytes per value; an estimate within half a bucket (≥ 2 %) does not need them."""
    mantissa, exponent = math.frexp(value)
    value = math.ldexp(round(mantissa * (1 << DERIVED_BITS)), exponent - DERIVED_BITS)
    if minimum is not None:
        value = max(value, minimum)
    if maximum is not None:
        value = min(value, maximum)
    return value


def markov_bound(mean: float, quantile: float, minimum: float | None) -> float:
    """The most a ``quantile`` of non-negative values with this ``mean`` can be.

    Buckets wider than the values (the OpenTelemetry SDKs' default bounds, 0-5-10-25-...,
    are meant for milliseconds; a step of 60 ms falls in the first) put a bucket's midpoint,
    2.5 s, above every value. Without the window's ``max`` to clamp it (a cumulative stream
    turned into deltas has none), Markov's inequality does: at most ``1 - q`` of
    non-negative values exceed ``mean / (1 - q)``. Never below ``minimum``.
    """
    bound = mean / max(1.0 - quantile, 1e-12)
    return bound if minimum is None else max(bound, minimum)


def _add_buckets(
    head: _Head,
    buckets: Buckets,
    start_time_unix_nano: int,
    *,
    text: str | None,
    sparse: bool = False,
    nonnegative: bool = False,
) -> dict[str, FieldValue]:
    """The head's fields plus the quantiles and the buckets: the ``buckets`` string when
    ``text`` is given (compact layout), else one cumulative count per bound and ``+Inf``.
    ``nonnegative``: the values cannot be negative (durations), so a quantile without a
    ``max`` to clamp it is bounded by the mean (:func:`markov_bound`)."""
    fields, minimum, maximum = head
    if text is None:
        keep = populated_edges(buckets) if sparse else range(len(buckets.uppers))
        for index in keep:
            upper = buckets.uppers[index]
            key = "+Inf" if math.isinf(upper) else format_bound(upper)
            fields[key] = float(buckets.cumulative[index])
        if not buckets.uppers or not math.isinf(buckets.uppers[-1]):
            fields["+Inf"] = fields["count"]
    mean = fields.get("mean")
    for name, quantile in QUANTILES if text is None else COMPACT_QUANTILES:
        value = nearest_rank_quantile(buckets, quantile, minimum=minimum, maximum=maximum)
        if value is not None and nonnegative and maximum is None and isinstance(mean, float):
            value = min(value, markov_bound(mean, quantile, minimum))
        if value is not None:
            fields[name] = value if text is None else _rounded(value, minimum, maximum)
    if text is not None:
        fields.pop("mean", None)  # sum / count
        fields["buckets"] = text
    if start_time_unix_nano:
        fields["start_time_unix_nano"] = start_time_unix_nano
    return fields


def _histogram_fields(
    point: HistogramDataPoint, *, duration: bool, layout: str
) -> dict[str, FieldValue]:
    head = _histogram_head(point, duration=duration)
    counts = list(point.bucket_counts)
    if not counts:  # a histogram without buckets: count/sum/min/max only
        if point.explicit_bounds:
            raise Rejected(REASON_BUCKET_LAYOUT)
        fields = head.fields
        if layout == LAYOUT_COMPACT:
            fields.pop("mean", None)  # sum / count
        if point.start_time_unix_nano:
            fields["start_time_unix_nano"] = int(point.start_time_unix_nano)
        return fields
    bounds = list(point.explicit_bounds)
    buckets = explicit_buckets(bounds, counts)
    if buckets.cumulative[-1] != point.count:
        raise Rejected(REASON_COUNT_MISMATCH)
    if duration and point.count > 0 and buckets.uppers[0] < 0 and buckets.cumulative[0] > 0:
        raise Rejected(REASON_NEGATIVE_DURATION)
    text = encode_explicit(bounds, counts) if layout == LAYOUT_COMPACT else None
    # Explicit bounds may be far wider than the values (the SDKs' defaults): bound by the mean.
    return _add_buckets(
        head, buckets, int(point.start_time_unix_nano), text=text, nonnegative=duration
    )


def _exponential_fields(
    point: ExponentialHistogramDataPoint, *, duration: bool, layout: str
) -> dict[str, FieldValue]:
    head = _histogram_head(point, duration=duration)
    negative, positive = point.negative, point.positive  # each field read once: upb calls
    negative_counts = list(negative.bucket_counts)
    if not any(negative_counts):
        negative_counts = []  # SDKs send an empty negative range as zeros; no "-1" fields
    if duration and negative_counts:
        raise Rejected(REASON_NEGATIVE_DURATION)
    scale, positive_counts = int(point.scale), list(positive.bucket_counts)
    offset, negative_offset = int(positive.offset), int(negative.offset)
    zero_count, zero_threshold = int(point.zero_count), float(point.zero_threshold)
    buckets = exponential_buckets(
        scale,
        positive_offset=offset,
        positive_counts=positive_counts,
        negative_offset=negative_offset,
        negative_counts=negative_counts,
        zero_count=zero_count,
        zero_threshold=zero_threshold,
    )
    if buckets.cumulative[-1] != point.count:
        raise Rejected(REASON_COUNT_MISMATCH)
    text = None
    if layout == LAYOUT_COMPACT:
        text = encode_exponential(
            scale,
            offset=offset,
            counts=positive_counts,
            zero_count=zero_count,
            zero_threshold=zero_threshold,
            negative_offset=negative_offset,
            negative_counts=negative_counts,
        )
    return _add_buckets(head, buckets, int(point.start_time_unix_nano), text=text, sparse=True)


def _compact_positive(
    point: ExponentialHistogramDataPoint, duration: bool
) -> dict[str, FieldValue] | None:
    """:func:`_exponential_fields` in the compact layout for what stepwatch's exporters send
    (observations in the positive range only), with the same checks in the same order and
    the same fields; None for any other histogram (the general path takes it)."""
    positive = point.positive
    counts = positive.bucket_counts[:]  # a list; twice as fast as list() with upb
    if not counts or point.zero_count or point.zero_threshold:
        return None
    if point.HasField("negative") and point.negative.bucket_counts:
        return None
    fields, minimum, maximum = _histogram_head(point, duration=duration)
    scale, offset = int(point.scale), int(positive.offset)
    if len(counts) > MAX_BUCKETS or not -10 <= scale <= 20:
        raise Rejected(REASON_BUCKET_LAYOUT)
    lowers, uppers, _, increasing = range_bounds(scale, offset, len(counts))
    if not increasing:
        raise Rejected(REASON_BUCKET_LAYOUT)  # degenerate: underflowed bounds
    cumulative = list(itertools.accumulate(counts))
    total = cumulative[-1]
    if total != point.count:
        raise Rejected(REASON_COUNT_MISMATCH)
    if total > 0:  # nearest_rank_quantile, for finite bounds
        for name, quantile in COMPACT_QUANTILES:
            index = bisect.bisect_left(cumulative, max(1, math.ceil(quantile * total)))
            value = (lowers[index] + uppers[index]) / 2.0
            if minimum is not None:
                value = max(value, minimum)
            if maximum is not None:
                value = min(value, maximum)
            fields[name] = _rounded(value, minimum, maximum)
    fields.pop("mean", None)  # sum / count
    fields["buckets"] = f"e{scale}:{offset}:{counts_text(counts)}"
    start_time_unix_nano = int(point.start_time_unix_nano)
    if start_time_unix_nano:
        fields["start_time_unix_nano"] = start_time_unix_nano
    return fields


def _summary_fields(
    point: SummaryDataPoint, *, duration: bool, layout: str
) -> dict[str, FieldValue]:
    _finite(point.sum)
    if duration and point.sum < 0:
        raise Rejected(REASON_NEGATIVE_DURATION)
    fields: dict[str, FieldValue] = {"count": float(point.count), "sum": point.sum}
    pairs: list[str] = []
    for item in point.quantile_values:
        _finite(item.quantile, item.value)
        if not 0.0 <= item.quantile <= 1.0:
            raise Rejected(REASON_BUCKET_LAYOUT)
        if layout == LAYOUT_COMPACT:
            pairs.append(f"{format_bound(item.quantile)}={item.value!r}")
        else:
            fields[format_bound(item.quantile)] = item.value
    if pairs:
        # compact: every quantile in one string; those of QUANTILES also as plain fields
        values = {item.quantile: item.value for item in point.quantile_values}
        for name, quantile in QUANTILES:
            if quantile in values:
                fields[name] = values[quantile]
        fields["quantiles"] = ",".join(pairs)
    if point.start_time_unix_nano:
        fields["start_time_unix_nano"] = int(point.start_time_unix_nano)
    return fields
