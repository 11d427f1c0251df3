"""OTLP metrics → InfluxDB line protocol (telegraf-prometheus-v1 compatible).

The stored layout is docs/storage.md ("Stored layout"); the metrics stepwatch sends are
docs/schema.md. This module walks a request: resource checks (job, rank), the tag allowlist,
time checks, one :class:`Point` per data point; ``_fields`` turns a data point into fields
following the OpenTelemetry Collector's influxdb exporter (``otel2influx``, schema
``telegraf-prometheus-v1``): histograms carry ``count``, ``sum``, ``min``, ``max`` and one
cumulative-count field per bucket upper bound plus ``+Inf``; gauges ``gauge``; monotonic sums
``counter``; summaries ``count``, ``sum`` and one field per quantile. stepwatch adds ``mean``,
``p50``, ``p90``, ``p99`` and ``start_time_unix_nano``. That is the ``per_bound`` layout; the
default ``compact`` layout stores the buckets (summary quantiles) in one string field
``buckets`` (``quantiles``) instead, so a measurement has a fixed set of columns.

Data model: https://opentelemetry.io/docs/specs/otel/metrics/data-model/
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.core._lineproto import (
    FieldValue,
    escape_key,
    escape_measurement,
    format_field_value,
)
from stepwatch.otel_bridge._cumulative import TEMPORALITY_CUMULATIVE, CumulativeState, Pending
from stepwatch.otel_bridge._fields import LAYOUT_COMPACT, LAYOUTS, point_fields
from stepwatch.otel_bridge._identity import IDENTITY_KEYS
from stepwatch.otel_bridge._reasons import (
    REASON_CLOCK_SKEW,
    REASON_INVALID_NAME,
    REASON_MISSING_RESOURCE,
    REASON_MISSING_TIME,
    REASON_RANK_RANGE,
    REASON_TIME_RANGE,
    REASON_UNREPRESENTABLE,
    Rejected,
)

if TYPE_CHECKING:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

    from stepwatch.otel_bridge._fields import DataPoint

TAG_ALLOWLIST: frozenset[str] = _schema.TAG_ALLOWLIST
"""Attribute keys stored as tags by default (resource and point attributes merged)."""

# InfluxDB's timestamp range ends at 2**63 - 2 ns (2262-04-11); integer fields at 2**63 - 1.
MAX_TIME_UNIX_NANO = 2**63 - 2
_STEPWATCH_PREFIX = "stepwatch."
_REQUIRED_RESOURCE = (_schema.JOB_ID, _schema.RANK)
# A duration histogram whose max or mean exceeds this is a broken clock or unit, not a step.
MAX_DURATION_S = 86_400.0

ResourceCheck = Callable[[Mapping[str, str]], str | None]
"""Called with a resource's scalar attributes (as tag strings) once its job and rank are valid;
returns a rejection reason for its ``stepwatch.*`` points, or None to accept them."""


class Point(NamedTuple):
    """One InfluxDB point before encoding (tags are allowlisted, values stringified).

    ``series`` is the escaped series key (measurement and sorted tags, as the line starts);
    empty: computed from ``measurement`` and ``tags`` when encoding.
    """

    measurement: str
    tags: dict[str, str]
    fields: dict[str, FieldValue]
    time_unix_nano: int
    series: str = ""

    def encode(self) -> str:
        """The point as one line; byte-identical to :func:`stepwatch.core._lineproto.encode_point`.

        Measurements, tag sets and field keys repeat across windows, so their escaped forms
        are computed once (the bridge's hot path; see bench/bridge_cpu.py).
        """
        field_text = ",".join(
            [
                f"{_field_key(key)}={value!r}"  # finite: validated during conversion
                if type(value) is float
                else f"{_field_key(key)}={format_field_value(value)}"
                for key, value in self.fields.items()
            ]
        )
        head = self.series or _series_text(self.measurement, tuple(sorted(self.tags.items())))
        return f"{head} {field_text} {int(self.time_unix_nano)}"


@functools.lru_cache(maxsize=65_536)
def _series_text(measurement: str, tags: tuple[tuple[str, str], ...]) -> str:
    parts = [escape_measurement(measurement)]
    parts.extend(f",{escape_key(key)}={escape_key(value)}" for key, value in tags if value != "")
    return "".join(parts)


@functools.lru_cache(maxsize=16_384)
def _field_key(key: str) -> str:
    return escape_key(key)


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
    # cumulative series' state changes, for CumulativeState.commit once the batch is accepted
    pending: list[Pending] = dataclasses.field(default_factory=list)


def convert_request(
    request: ExportMetricsServiceRequest,
    *,
    tag_allowlist: frozenset[str] = TAG_ALLOWLIST,
    max_duration_s: float | None = MAX_DURATION_S,
    time_bounds_unix_nano: tuple[int, int] | None = None,
    cumulative: CumulativeState | None = None,
    histogram_layout: str = LAYOUT_COMPACT,
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
        cumulative: the per-series state that turns CUMULATIVE sums and histograms into
            per-window deltas (``_cumulative.py``), advanced by this call. None: a fresh one,
            so every cumulative point is a baseline (``cumulative_baseline``).
        histogram_layout: ``compact`` (histogram buckets in one ``buckets`` string field,
            summary quantiles in ``quantiles``: a fixed set of columns) or ``per_bound`` (one
            field per bound, the columns of a Collector's influxdb exporter); docs/storage.md.

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
        cumulative=cumulative,
        histogram_layout=histogram_layout,
    )
    if cumulative is not None:
        cumulative.commit(batch.pending)
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
    cumulative: CumulativeState | None = None,
    histogram_layout: str = LAYOUT_COMPACT,
) -> PointBatch:
    """Like :func:`convert_request` but returns unencoded points (for filtering).

    ``resource_check`` (the bridge's duplicate-rank guard) may refuse a resource's
    ``stepwatch.*`` points; it is called only for resources that carry any. ``cumulative``
    is *not* advanced: the caller commits ``batch.pending`` once the points are accepted.

    Raises:
        ValueError: ``histogram_layout`` is not one of ``compact``, ``per_bound``.
    """
    if histogram_layout not in LAYOUTS:
        raise ValueError(f"histogram_layout: {histogram_layout!r} is not one of {LAYOUTS}")
    batch = PointBatch(points=[], rejected=Counter(), dropped_attributes=0)
    limits = _Limits(
        max_duration_s, time_bounds_unix_nano, cumulative or CumulativeState(), histogram_layout
    )
    for resource_metrics in request.resource_metrics:
        resource_attrs = resource_metrics.resource.attributes
        resource_tags, dropped = _tags(resource_attrs, tag_allowlist, consumed=IDENTITY_KEYS)
        resource = _resource_part(resource_tags)
        resource_problem = _resource_problem(resource_attrs)
        checked = resource_check is None or resource_problem is not None
        resource_key = _attributes_key(resource_attrs)
        for scope_metrics in resource_metrics.scope_metrics:
            scope = b"\x00".join(
                (
                    resource_key,
                    scope_metrics.scope.name.encode(),
                    scope_metrics.scope.version.encode(),
                )
            )
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
                _convert_metric(metric, resource, tag_allowlist, batch, limits, scope)
    return batch


class _Limits(NamedTuple):
    max_duration_s: float | None
    time_bounds_unix_nano: tuple[int, int] | None
    cumulative: CumulativeState
    histogram_layout: str


def _attributes_key(attributes: Iterable[KeyValue]) -> bytes:
    """The identity of an attribute set (any value type, any order), length-prefixed."""
    parts = sorted(item.SerializeToString(deterministic=True) for item in attributes)
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


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


def _tags(
    attributes: Iterable[KeyValue],
    allowlist: frozenset[str],
    *,
    consumed: Iterable[str] = (),
) -> tuple[dict[str, str], int]:
    """The allowlisted attributes as tags, and how many others were dropped. Keys in
    ``consumed`` are not tags but not lost either (the duplicate-rank guard reads a resource's
    ``service.instance.id`` and ``process.pid``): they are not counted as dropped."""
    tags: dict[str, str] = {}
    dropped = 0
    for item in attributes:
        text = _tag_value(item.value) if item.key in allowlist else None
        if text is None:
            if item.key not in consumed:
                dropped += 1
        else:
            tags[item.key] = text
    return tags, dropped


Pieces = tuple[tuple[str, str], ...]
"""Tags as ``(key, ",key=value")`` escaped, sorted by key; empty values left out (not stored)."""


class _TagPart(NamedTuple):
    """Tags of a resource, or of a metric's point, ready to be merged into a series key.

    ``pieces`` is None when a tag cannot be carried: a value ending in a backslash
    (``unrepresentable``, the point is rejected) or a key ending in one (the encoder raises)."""

    tags: dict[str, str]
    pieces: Pieces | None
    unrepresentable: bool


def _tag_part(tags: dict[str, str]) -> _TagPart:
    if any(value.endswith("\\") for value in tags.values()):
        return _TagPart(tags, None, True)
    try:
        pieces = tuple(
            sorted(
                (key, f",{escape_key(key)}={escape_key(value)}")
                for key, value in tags.items()
                if value != ""
            )
        )
    except ConfigError:
        return _TagPart(tags, None, False)
    return _TagPart(tags, pieces, False)


class _Resource(NamedTuple):
    part: _TagPart
    text: str  # the pieces joined: the series key after the measurement, for points without tags


def _resource_part(resource_tags: dict[str, str]) -> _Resource:
    """Once per resource of a request: its tags escaped and sorted."""
    part = _tag_part(resource_tags)
    return _Resource(part, "".join(piece for _, piece in part.pieces or ()))


class _Metric(NamedTuple):
    measurement: str  # escaped
    point: _TagPart


# (metric name, allowlisted point tags) -> their escaped parts; rank-independent (kernel classes,
# phases, devices), so small; cleared whole beyond this many entries.
MAX_KNOWN_SERIES = 65_536
_known: dict[tuple[str, Pieces], _Metric] = {}


def _forget_series() -> None:
    _known.clear()


def _metric_part(name: str, point_tags: Pieces) -> _Metric:
    known = _known.get((name, point_tags))
    if known is None:
        if len(_known) >= MAX_KNOWN_SERIES:
            _forget_series()
        known = _known[(name, point_tags)] = _Metric(
            escape_measurement(name), _tag_part(dict(point_tags))
        )
    return known


def _series(resource: _Resource, metric: _Metric) -> tuple[dict[str, str], str, bool]:
    """A point's tags, its series key (empty: the encoder computes it, or raises), and
    whether a tag value cannot be carried; as ``Point.encode`` writes them."""
    point = metric.point
    if not point.tags:
        part = resource.part
        text = "" if part.pieces is None else metric.measurement + resource.text
        return part.tags, text, part.unrepresentable
    tags = {**resource.part.tags, **point.tags}
    if (
        resource.part.pieces is None
        or point.pieces is None
        or len(tags) != len(resource.part.tags) + len(point.tags)
    ):  # a point tag overrides a resource tag: from the merged tags
        merged = _tag_part(tags)
        if merged.pieces is None:
            return tags, "", merged.unrepresentable
        pieces = merged.pieces
    else:
        pieces = tuple(sorted(resource.part.pieces + point.pieces))
    return tags, metric.measurement + "".join([piece for _, piece in pieces]), False


def _convert_metric(
    metric: Metric,
    resource: _Resource,
    allowlist: frozenset[str],
    batch: PointBatch,
    limits: _Limits,
    scope: bytes,
) -> None:
    kind = str(metric.WhichOneof("data"))
    name = metric.name
    data = getattr(metric, kind)
    duration = metric.unit == "s" or name.endswith(".duration")
    monotonic = kind == "sum" and data.is_monotonic
    # Data model, "Temporality": a CUMULATIVE point covers (start, time]; stored per window.
    # A non-monotonic sum is a level (stored as given), a summary has no temporality.
    cumulative = (
        kind in ("histogram", "exponential_histogram") or monotonic
    ) and data.aggregation_temporality == TEMPORALITY_CUMULATIVE
    series = b"\x00".join((scope, name.encode(), kind.encode())) if cumulative else b""
    # Compact layout: a stepwatch.* histogram's window is its rank's step window (the exporter
    # builds them together), so its start is stored once, on stepwatch.step.duration.
    shared_start = (
        limits.histogram_layout == LAYOUT_COMPACT
        and kind in ("histogram", "exponential_histogram")
        and name.startswith(_STEPWATCH_PREFIX)
        and name != _schema.STEP_DURATION
    )
    bounds = limits.time_bounds_unix_nano
    max_duration_s = limits.max_duration_s
    layout = limits.histogram_layout
    rejected = batch.rejected
    append = batch.points.append
    points: Sequence[DataPoint] = data.data_points
    for point in points:
        time_unix_nano = point.time_unix_nano
        try:
            if time_unix_nano == 0:
                raise Rejected(REASON_MISSING_TIME)
            if time_unix_nano > MAX_TIME_UNIX_NANO or (
                point.start_time_unix_nano > MAX_TIME_UNIX_NANO
            ):
                raise Rejected(REASON_TIME_RANGE)  # fixed64 on the wire; found by fuzzing
            if bounds is not None and not bounds[0] <= time_unix_nano <= bounds[1]:
                raise Rejected(REASON_CLOCK_SKEW)
            if cumulative:
                point = limits.cumulative.delta(
                    series + b"\x00" + _attributes_key(point.attributes),
                    kind,
                    point,
                    batch.pending,
                )
            fields = point_fields(
                kind,
                point,
                monotonic=monotonic,
                duration=duration,
                max_duration_s=max_duration_s,
                layout=layout,
            )
        except Rejected as exc:
            rejected[exc.reason] += 1
            continue
        if shared_start:
            fields.pop("start_time_unix_nano", None)
        point_tags: list[tuple[str, str]] = []
        dropped = 0
        for item in point.attributes:
            key = item.key
            text = _tag_value(item.value) if key in allowlist else None
            if text is None:
                dropped += 1
            else:
                point_tags.append((key, text))
        if dropped:
            batch.dropped_attributes += dropped
        tag_key = tuple(point_tags)
        tags, text, unrepresentable = _series(resource, _metric_part(name, tag_key))
        if unrepresentable:
            rejected[REASON_UNREPRESENTABLE] += 1
            continue
        append(Point(name, tags, fields, int(time_unix_nano), text))
