"""OTLP metrics → InfluxDB line protocol (telegraf-prometheus-v1 compatible).

The stored layout is docs/CONTRACTS.md "Stored layout" and docs/storage.md. Field names follow
the OpenTelemetry Collector's influxdb exporter (``otel2influx``, schema
``telegraf-prometheus-v1``): histograms carry ``count``, ``sum``, ``min``, ``max`` and one
cumulative-count field per bucket upper bound plus ``+Inf``; gauges ``gauge``; monotonic sums
``counter``; summaries ``count``, ``sum`` and one field per quantile. stepwatch adds ``mean``,
``p50``, ``p90``, ``p99`` and ``start_time_unix_nano``.

Data model: https://opentelemetry.io/docs/specs/otel/metrics/data-model/
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, NamedTuple

from stepwatch.core import _schema
from stepwatch.core._lineproto import (
    FieldValue,
    escape_key,
    escape_measurement,
    format_field_value,
)

if TYPE_CHECKING:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.metrics.v1.metrics_pb2 import (
        ExponentialHistogramDataPoint,
        HistogramDataPoint,
        Metric,
        NumberDataPoint,
        SummaryDataPoint,
    )

TAG_ALLOWLIST: frozenset[str] = _schema.TAG_ALLOWLIST
"""Attribute keys stored as tags by default (resource and point attributes merged)."""

QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))

# Rejection reasons (the ``reason`` label of stepwatch_bridge_datapoints_rejected_total).
REASON_NON_FINITE = "non_finite"
REASON_NEGATIVE_DURATION = "negative_duration"
REASON_COUNT_MISMATCH = "count_mismatch"
REASON_BUCKET_LAYOUT = "bucket_layout"
REASON_MISSING_RESOURCE = "missing_resource_attribute"
REASON_RANK_RANGE = "rank_out_of_range"
REASON_MISSING_TIME = "missing_time"
REASON_TIME_RANGE = "time_out_of_range"
REASON_INVALID_NAME = "invalid_name"
REASON_NO_VALUE = "no_value"
REASON_CARDINALITY = "cardinality_limit"
REASON_CLOCK_SKEW = "clock_skew"
REASON_IMPLAUSIBLE_DURATION = "implausible_duration"
REASON_DUPLICATE_RANK = "duplicate_rank"
# InfluxDB's line-protocol parser reads a trailing backslash as escaping the delimiter after
# it, so a name or tag value ending in "\\" cannot be written (found by bench/bridge_fuzz.py).
REASON_UNREPRESENTABLE = "unrepresentable"

# InfluxDB's timestamp range ends at 2**63 - 2 ns (2262-04-11); integer fields at 2**63 - 1.
MAX_TIME_UNIX_NANO = 2**63 - 2
# Exponential histograms wider than this are refused: each bucket becomes a field.
MAX_BUCKETS = 4096
_STEPWATCH_PREFIX = "stepwatch."
_REQUIRED_RESOURCE = (_schema.JOB_ID, _schema.RANK)
# A duration histogram whose max or mean exceeds this is a broken clock or unit, not a step.
MAX_DURATION_S = 86_400.0

ResourceCheck = Callable[[Mapping[str, str]], str | None]
"""Called with a resource's scalar attributes (as tag strings) once its job and rank are valid;
returns a rejection reason for its ``stepwatch.*`` points, or None to accept them."""


class Point(NamedTuple):
    """One InfluxDB point before encoding (tags are allowlisted, values stringified)."""

    measurement: str
    tags: dict[str, str]
    fields: dict[str, FieldValue]
    time_unix_nano: int

    def encode(self) -> str:
        """The point as one line; byte-identical to :func:`stepwatch.core._lineproto.encode_point`.

        Measurements, tag sets and field keys repeat across windows, so their escaped forms
        are cached (the bridge's hot path; see bench/bridge_load.py).
        """
        field_text = ",".join(
            f"{_field_key(key)}={_field_value(value)}" for key, value in self.fields.items()
        )
        head = _series_text(self.measurement, tuple(sorted(self.tags.items())))
        return f"{head} {field_text} {int(self.time_unix_nano)}"


@functools.lru_cache(maxsize=65_536)
def _series_text(measurement: str, tags: tuple[tuple[str, str], ...]) -> str:
    parts = [escape_measurement(measurement)]
    parts.extend(f",{escape_key(key)}={escape_key(value)}" for key, value in tags if value != "")
    return "".join(parts)


@functools.lru_cache(maxsize=16_384)
def _field_key(key: str) -> str:
    return escape_key(key)


def _field_value(value: FieldValue) -> str:
    if type(value) is float:
        return repr(value)  # finite: validated during conversion
    return format_field_value(value)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """The result of converting one ``ExportMetricsServiceRequest``.

    Attributes:
        lines: line protocol, one point per line, in request order.
        accepted_points: data points converted (one line each).
        rejected: data points refused, by reason (never stored).
        dropped_attributes: attributes not stored because their key is not allowlisted or
            their value is not a scalar (the points themselves are kept).
    """

    lines: list[str]
    accepted_points: int
    rejected: dict[str, int]
    dropped_attributes: int = 0

    @property
    def rejected_points(self) -> int:
        return sum(self.rejected.values())


@dataclasses.dataclass
class PointBatch:
    """Points of one request before encoding (the bridge filters them further)."""

    points: list[Point]
    rejected: Counter[str]
    dropped_attributes: int


class _Rejected(ValueError):
    """A data point fails validation; carries the reason label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def convert_request(
    request: ExportMetricsServiceRequest,
    *,
    tag_allowlist: frozenset[str] = TAG_ALLOWLIST,
    max_duration_s: float | None = MAX_DURATION_S,
    time_bounds_unix_nano: tuple[int, int] | None = None,
) -> Conversion:
    """Convert an OTLP metrics export request to InfluxDB line protocol.

    Args:
        request: the decoded ``ExportMetricsServiceRequest`` from any producer.
        tag_allowlist: attribute keys stored as tags; others are dropped and counted.
        max_duration_s: a duration histogram or summary (unit ``s`` or a name ending in
            ``.duration``) whose max or mean exceeds this is rejected
            (``implausible_duration``); None disables the check.
        time_bounds_unix_nano: ``(earliest, latest)`` accepted ``time_unix_nano``; points
            outside are rejected (``clock_skew``). None (the default) accepts any valid time;
            the bridge derives the bounds from its receive time.

    Returns:
        The lines, the number of accepted points and the rejected points by reason.

    Example:
        >>> from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ...     ExportMetricsServiceRequest)
        >>> convert_request(ExportMetricsServiceRequest()).accepted_points
        0
    """
    batch = convert_to_points(
        request,
        tag_allowlist=tag_allowlist,
        max_duration_s=max_duration_s,
        time_bounds_unix_nano=time_bounds_unix_nano,
    )
    return Conversion(
        lines=[point.encode() for point in batch.points],
        accepted_points=len(batch.points),
        rejected=dict(batch.rejected),
        dropped_attributes=batch.dropped_attributes,
    )


def convert_to_points(
    request: ExportMetricsServiceRequest,
    *,
    tag_allowlist: frozenset[str] = TAG_ALLOWLIST,
    max_duration_s: float | None = MAX_DURATION_S,
    time_bounds_unix_nano: tuple[int, int] | None = None,
    resource_check: ResourceCheck | None = None,
) -> PointBatch:
    """Like :func:`convert_request` but returns unencoded points (for filtering).

    ``resource_check`` (the bridge's duplicate-rank guard) may refuse a resource's
    ``stepwatch.*`` points; it is called only for resources that carry any.
    """
    batch = PointBatch(points=[], rejected=Counter(), dropped_attributes=0)
    limits = _Limits(max_duration_s, time_bounds_unix_nano)
    for resource_metrics in request.resource_metrics:
        resource_attrs = resource_metrics.resource.attributes
        resource_tags, dropped = _tags(resource_attrs, tag_allowlist)
        resource_problem = _resource_problem(resource_attrs)
        checked = resource_check is None or resource_problem is not None
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                total = _point_count(metric)
                if total == 0:
                    continue
                batch.dropped_attributes += dropped * total
                if not metric.name:
                    batch.rejected[REASON_INVALID_NAME] += total
                    continue
                if metric.name.endswith("\\"):
                    batch.rejected[REASON_UNREPRESENTABLE] += total
                    continue
                if metric.name.startswith(_STEPWATCH_PREFIX):
                    if not checked and resource_check is not None:
                        resource_problem = resource_check(_scalar_attributes(resource_attrs))
                        checked = True
                    if resource_problem is not None:
                        batch.rejected[resource_problem] += total
                        continue
                _convert_metric(metric, resource_tags, tag_allowlist, batch, limits)
    return batch


class _Limits(NamedTuple):
    max_duration_s: float | None
    time_bounds_unix_nano: tuple[int, int] | None


def _scalar_attributes(attributes: Iterable[KeyValue]) -> dict[str, str]:
    scalars: dict[str, str] = {}
    for item in attributes:
        text = _tag_value(item.value)
        if text is not None:
            scalars[item.key] = text
    return scalars


def _point_count(metric: Metric) -> int:
    kind = metric.WhichOneof("data")
    if kind is None:
        return 0
    return len(getattr(metric, kind).data_points)


def _resource_problem(attributes: Iterable[KeyValue]) -> str | None:
    """Why a resource cannot carry stepwatch.* metrics (missing job/rank, bad rank)."""
    values = {item.key: item.value for item in attributes}
    if any(key not in values for key in _REQUIRED_RESOURCE):
        return REASON_MISSING_RESOURCE
    if not _tag_value(values[_schema.JOB_ID]):
        return REASON_MISSING_RESOURCE  # an empty job id would be stored without the tag
    rank = _as_int(values[_schema.RANK])
    if rank is None or rank < 0:
        return REASON_RANK_RANGE
    if _schema.WORLD_SIZE in values:
        world_size = _as_int(values[_schema.WORLD_SIZE])
        if world_size is None or rank >= world_size:
            return REASON_RANK_RANGE
    return None


def _as_int(value: AnyValue) -> int | None:
    kind = value.WhichOneof("value")
    if kind == "int_value":
        return int(value.int_value)
    if kind == "string_value":
        try:
            return int(value.string_value)
        except ValueError:
            return None
    return None


def _tag_value(value: AnyValue) -> str | None:
    """A scalar attribute as a tag string (ints in decimal); None for arrays/maps/bytes."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return str(value.int_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind == "double_value":
        return repr(value.double_value)
    return None


def _tags(attributes: Iterable[KeyValue], allowlist: frozenset[str]) -> tuple[dict[str, str], int]:
    tags: dict[str, str] = {}
    dropped = 0
    for item in attributes:
        text = _tag_value(item.value) if item.key in allowlist else None
        if text is None:
            dropped += 1
        else:
            tags[item.key] = text
    return tags, dropped


def _is_duration(metric: Metric) -> bool:
    return metric.unit == "s" or metric.name.endswith(".duration")


def _convert_metric(
    metric: Metric,
    resource_tags: Mapping[str, str],
    allowlist: frozenset[str],
    batch: PointBatch,
    limits: _Limits,
) -> None:
    kind = metric.WhichOneof("data")
    duration = _is_duration(metric)
    bounds = limits.time_bounds_unix_nano
    points: Sequence[
        NumberDataPoint | HistogramDataPoint | ExponentialHistogramDataPoint | SummaryDataPoint
    ] = getattr(metric, str(kind)).data_points
    for point in points:
        try:
            if point.time_unix_nano == 0:
                raise _Rejected(REASON_MISSING_TIME)
            if max(point.time_unix_nano, point.start_time_unix_nano) > MAX_TIME_UNIX_NANO:
                raise _Rejected(REASON_TIME_RANGE)  # fixed64 on the wire; found by fuzzing
            if bounds is not None and not bounds[0] <= point.time_unix_nano <= bounds[1]:
                raise _Rejected(REASON_CLOCK_SKEW)
            if kind == "gauge":
                fields = _number_fields(point, "gauge")  # type: ignore[arg-type]
            elif kind == "sum":
                name = "counter" if metric.sum.is_monotonic else "gauge"
                fields = _number_fields(point, name)  # type: ignore[arg-type]
            elif kind == "histogram":
                fields = _histogram_fields(point, duration=duration)  # type: ignore[arg-type]
            elif kind == "exponential_histogram":
                fields = _exponential_fields(point, duration=duration)  # type: ignore[arg-type]
            else:
                fields = _summary_fields(point, duration=duration)  # type: ignore[arg-type]
            if duration and limits.max_duration_s is not None:
                _plausible(fields, limits.max_duration_s)
        except _Rejected as exc:
            batch.rejected[exc.reason] += 1
            continue
        point_tags, dropped = _tags(point.attributes, allowlist)
        batch.dropped_attributes += dropped
        tags = {**resource_tags, **point_tags}
        if any(value.endswith("\\") for value in tags.values()):
            batch.rejected[REASON_UNREPRESENTABLE] += 1
            continue
        batch.points.append(Point(metric.name, tags, fields, int(point.time_unix_nano)))


def _plausible(fields: Mapping[str, FieldValue], max_duration_s: float) -> None:
    """A duration histogram/summary's max and mean stay within ``max_duration_s``.

    The sum alone is not checked: a cumulative histogram's sum grows with the run.
    """
    count, total = fields.get("count"), fields.get("sum")
    mean = total / count if isinstance(total, float) and isinstance(count, float) and count else 0.0
    maximum = fields.get("max")  # summaries carry neither max nor mean: the mean is computed
    if mean > max_duration_s or (isinstance(maximum, float) and maximum > max_duration_s):
        raise _Rejected(REASON_IMPLAUSIBLE_DURATION)


def _finite(*values: float) -> None:
    if not all(math.isfinite(value) for value in values):
        raise _Rejected(REASON_NON_FINITE)


def _number_fields(point: NumberDataPoint, field: str) -> dict[str, FieldValue]:
    kind = point.WhichOneof("value")
    if kind is None:
        raise _Rejected(REASON_NO_VALUE)
    value = float(point.as_int) if kind == "as_int" else point.as_double
    _finite(value)
    fields: dict[str, FieldValue] = {field: value}
    if point.start_time_unix_nano:
        fields["start_time_unix_nano"] = int(point.start_time_unix_nano)
    return fields


@functools.lru_cache(maxsize=65_536)
def format_bound(bound: float) -> str:
    """A bucket bound as a field key: shortest round-trip decimal, never exponent notation.

    Matches Go's ``strconv.FormatFloat(bound, 'f', -1, 64)`` used by otel2influx.
    """
    if bound == 0:
        return "0"  # -0.0 == 0.0 (also as a cache key): one field for both
    text = repr(bound)
    if "e" not in text and "E" not in text:
        return text[:-2] if text.endswith(".0") else text
    return format(Decimal(text), "f")


class Buckets(NamedTuple):
    """Cumulative buckets: ``uppers[i]`` has ``cumulative[i]`` observations at or below it.

    ``lowers[i]`` is the bucket's lower bound (``-inf`` for an open first bucket). The last
    bucket may be ``+inf`` (the overflow bucket).
    """

    lowers: list[float]
    uppers: list[float]
    cumulative: list[int]


def nearest_rank_quantile(
    buckets: Buckets, quantile: float, *, minimum: float | None, maximum: float | None
) -> float | None:
    """Nearest-rank quantile estimated from cumulative buckets.

    The bucket where the cumulative count first reaches ``ceil(quantile * count)``; the value is
    the midpoint of its ``[lower, upper]`` bounds clamped to ``[minimum, maximum]``. An open
    first bucket uses ``minimum`` (else 0 or its upper bound) as lower bound; the ``+Inf``
    bucket answers ``maximum`` (else the last finite bound). None for an empty histogram.
    """
    if not buckets.cumulative or buckets.cumulative[-1] <= 0:
        return None
    total = buckets.cumulative[-1]
    rank = max(1, math.ceil(quantile * total))
    index = bisect.bisect_left(buckets.cumulative, rank)  # cumulative is non-decreasing
    lower, upper = buckets.lowers[index], buckets.uppers[index]
    if math.isinf(upper):
        if maximum is not None:
            return maximum
        value = lower if math.isfinite(lower) else 0.0
    else:
        if math.isinf(lower):
            lower = minimum if minimum is not None else min(0.0, upper)
        value = (lower + upper) / 2.0
    if minimum is not None:
        value = max(value, minimum)
    if maximum is not None:
        value = min(value, maximum)
    return value


def _histogram_common(
    point: HistogramDataPoint | ExponentialHistogramDataPoint, *, duration: bool
) -> tuple[dict[str, FieldValue], float | None, float | None]:
    count = int(point.count)
    fields: dict[str, FieldValue] = {"count": float(count)}
    minimum = point.min if point.HasField("min") else None
    maximum = point.max if point.HasField("max") else None
    if point.HasField("sum"):
        _finite(point.sum)
        if duration and point.sum < 0:
            raise _Rejected(REASON_NEGATIVE_DURATION)
        fields["sum"] = point.sum
        if count > 0:
            fields["mean"] = point.sum / count
        if count == 1:
            # One observation is its own sum: min and max are optional in OTLP and stepwatch's
            # kernel histograms leave them out, but they are known exactly here.
            minimum = point.sum if minimum is None else minimum
            maximum = point.sum if maximum is None else maximum
    for name, value in (("min", minimum), ("max", maximum)):
        if value is not None:
            _finite(value)
            if duration and value < 0:
                raise _Rejected(REASON_NEGATIVE_DURATION)
            fields[name] = value
    if minimum is not None and maximum is not None and minimum > maximum and count > 0:
        raise _Rejected(REASON_BUCKET_LAYOUT)
    return fields, minimum, maximum


def _add_buckets(
    fields: dict[str, FieldValue],
    buckets: Buckets,
    *,
    minimum: float | None,
    maximum: float | None,
    start_time_unix_nano: int,
    sparse: bool = False,
) -> dict[str, FieldValue]:
    keep = _populated_edges(buckets) if sparse else range(len(buckets.uppers))
    for index in keep:
        upper = buckets.uppers[index]
        key = "+Inf" if math.isinf(upper) else format_bound(upper)
        fields[key] = float(buckets.cumulative[index])
    if not buckets.uppers or not math.isinf(buckets.uppers[-1]):
        fields["+Inf"] = fields["count"]
    for name, quantile in QUANTILES:
        value = nearest_rank_quantile(buckets, quantile, minimum=minimum, maximum=maximum)
        if value is not None:
            fields[name] = value
    if start_time_unix_nano:
        fields["start_time_unix_nano"] = start_time_unix_nano
    return fields


def _populated_edges(buckets: Buckets) -> list[int]:
    """Indexes of the bounds that edge a populated bucket (its lower or its upper bound).

    An exponential histogram's empty buckets between populated ones add nothing a reader
    needs: the cumulative count is flat across them. Keeping both edges of every populated
    bucket keeps each observation's bucket exact (quantiles survive) while a window that spans
    several octaves at scale 5 stores a handful of fields instead of ~32 per octave.
    """
    cumulative = buckets.cumulative
    keep: list[int] = []
    for index in range(len(cumulative)):
        count = cumulative[index] - (cumulative[index - 1] if index else 0)
        following = cumulative[index + 1] - cumulative[index] if index + 1 < len(cumulative) else 0
        if count or following or index == len(cumulative) - 1:
            keep.append(index)
    return keep


def explicit_buckets(bounds: Sequence[float], counts: Sequence[int]) -> Buckets:
    """Cumulative buckets of an explicit-bounds histogram.

    Raises:
        ValueError: bounds not finite and strictly increasing, or counts not one longer.
    """
    if len(counts) != len(bounds) + 1:
        raise _Rejected(REASON_BUCKET_LAYOUT)
    if not all(math.isfinite(bound) for bound in bounds):
        raise _Rejected(REASON_BUCKET_LAYOUT)
    if any(later <= earlier for earlier, later in itertools.pairwise(bounds)):
        raise _Rejected(REASON_BUCKET_LAYOUT)
    lowers = [-math.inf, *bounds]
    uppers = [*bounds, math.inf]
    cumulative: list[int] = []
    running = 0
    for count in counts:
        running += int(count)
        cumulative.append(running)
    return Buckets(lowers, uppers, cumulative)


def _histogram_fields(point: HistogramDataPoint, *, duration: bool) -> dict[str, FieldValue]:
    fields, minimum, maximum = _histogram_common(point, duration=duration)
    counts = list(point.bucket_counts)
    if not counts:  # a histogram without buckets: count/sum/min/max only
        if point.explicit_bounds:
            raise _Rejected(REASON_BUCKET_LAYOUT)
        if point.start_time_unix_nano:
            fields["start_time_unix_nano"] = int(point.start_time_unix_nano)
        return fields
    buckets = explicit_buckets(list(point.explicit_bounds), counts)
    if buckets.cumulative[-1] != point.count:
        raise _Rejected(REASON_COUNT_MISMATCH)
    if duration and point.count > 0 and buckets.uppers[0] < 0 and buckets.cumulative[0] > 0:
        raise _Rejected(REASON_NEGATIVE_DURATION)
    return _add_buckets(
        fields,
        buckets,
        minimum=minimum,
        maximum=maximum,
        start_time_unix_nano=int(point.start_time_unix_nano),
    )


@functools.lru_cache(maxsize=65_536)
def _exponential_boundary(scale: int, index: int) -> float | None:
    """``base ** index`` with ``base = 2 ** (2 ** -scale)``; None when it overflows."""
    try:
        return float(2.0 ** (index * 2.0**-scale))
    except OverflowError:
        return None


def exponential_buckets(
    scale: int,
    *,
    positive_offset: int,
    positive_counts: Sequence[int],
    negative_offset: int = 0,
    negative_counts: Sequence[int] = (),
    zero_count: int = 0,
    zero_threshold: float = 0.0,
) -> Buckets:
    """Cumulative buckets of an exponential histogram at their real bounds.

    With ``base = 2 ** (2 ** -scale)``, positive bucket ``i`` holds ``(base**i, base**(i+1)]``,
    negative bucket ``i`` holds ``[-base**(i+1), -base**i)`` and the zero bucket holds
    ``[-zero_threshold, zero_threshold]``. Buckets are listed in ascending value order.

    Raises:
        ValueError: bounds overflow a float, scale outside [-10, 20], too many buckets.
    """
    if len(positive_counts) + len(negative_counts) > MAX_BUCKETS or not -10 <= scale <= 20:
        raise _Rejected(REASON_BUCKET_LAYOUT)
    if not math.isfinite(zero_threshold) or zero_threshold < 0:
        raise _Rejected(REASON_BUCKET_LAYOUT)

    def boundary(index: int) -> float:
        bound = _exponential_boundary(scale, index)
        if bound is None:
            raise _Rejected(REASON_BUCKET_LAYOUT)
        return bound

    lowers: list[float] = []
    uppers: list[float] = []
    counts: list[int] = []
    for position in reversed(range(len(negative_counts))):
        index = negative_offset + position
        lowers.append(-boundary(index + 1))
        uppers.append(-boundary(index))
        counts.append(int(negative_counts[position]))
    if zero_count or zero_threshold or not (positive_counts or negative_counts):
        lowers.append(-zero_threshold)
        uppers.append(zero_threshold)
        counts.append(int(zero_count))
    for position, count in enumerate(positive_counts):
        index = positive_offset + position
        lowers.append(boundary(index))
        uppers.append(boundary(index + 1))
        counts.append(int(count))
    if any(math.isinf(bound) for bound in uppers) or any(
        later <= earlier for earlier, later in itertools.pairwise(uppers)
    ):
        raise _Rejected(REASON_BUCKET_LAYOUT)  # overflowed or degenerate (zero_threshold)
    cumulative: list[int] = []
    running = 0
    for count in counts:
        running += count
        cumulative.append(running)
    return Buckets(lowers, uppers, cumulative)


def _exponential_fields(
    point: ExponentialHistogramDataPoint, *, duration: bool
) -> dict[str, FieldValue]:
    fields, minimum, maximum = _histogram_common(point, duration=duration)
    negative_counts = list(point.negative.bucket_counts)
    if not any(negative_counts):
        negative_counts = []  # SDKs send an empty negative range as zeros; no "-1" fields
    if duration and negative_counts:
        raise _Rejected(REASON_NEGATIVE_DURATION)
    buckets = exponential_buckets(
        int(point.scale),
        positive_offset=int(point.positive.offset),
        positive_counts=list(point.positive.bucket_counts),
        negative_offset=int(point.negative.offset),
        negative_counts=negative_counts,
        zero_count=int(point.zero_count),
        zero_threshold=float(point.zero_threshold),
    )
    if buckets.cumulative[-1] != point.count:
        raise _Rejected(REASON_COUNT_MISMATCH)
    return _add_buckets(
        fields,
        buckets,
        minimum=minimum,
        maximum=maximum,
        start_time_unix_nano=int(point.start_time_unix_nano),
        sparse=True,
    )


def _summary_fields(point: SummaryDataPoint, *, duration: bool) -> dict[str, FieldValue]:
    _finite(point.sum)
    if duration and point.sum < 0:
        raise _Rejected(REASON_NEGATIVE_DURATION)
    fields: dict[str, FieldValue] = {"count": float(point.count), "sum": point.sum}
    for item in point.quantile_values:
        _finite(item.quantile, item.value)
        if not 0.0 <= item.quantile <= 1.0:
            raise _Rejected(REASON_BUCKET_LAYOUT)
        fields[format_bound(item.quantile)] = item.value
    if point.start_time_unix_nano:
        fields["start_time_unix_nano"] = int(point.start_time_unix_nano)
    return fields


def iter_series_keys(points: Iterable[Point]) -> Iterator[tuple[str, tuple[tuple[str, str], ...]]]:
    """(measurement, sorted tag items) per point: the InfluxDB series identity."""
    for point in points:
        yield point.measurement, tuple(sorted(point.tags.items()))
