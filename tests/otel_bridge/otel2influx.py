"""What an OpenTelemetry Collector's ``influxdb`` exporter writes, by its published rules.

The exporter is influxdata/influxdb-observability's ``otel2influx`` with schema
``telegraf-prometheus-v1`` (docs/metrics.md, "Schema MetricsSchemaTelegrafPrometheusV1";
behaviour as in ``otel2influx/metrics_telegraf_prometheus_v1.go`` and ``common.go`` at commit
23eff36). No Collector binary is available here, so the tests convert requests by these
rules, written out independently:

- measurement = metric name; timestamp = ``time_unix_nano`` (0: the request fails);
- tags = every point attribute (its value as a string), then every resource attribute, then
  ``otel.library.name`` / ``otel.library.version`` from the scope when not empty;
- field ``start_time_unix_nano`` (integer) when set;
- gauge → ``gauge``; monotonic sum → ``counter``; non-monotonic sum → ``gauge`` (integer
  values stay integers);
- histogram → ``count``, ``sum``, ``min`` and ``max`` when present, and one field per explicit
  bound (key: Go's ``FormatFloat(b, 'f', -1, 64)``) holding the cumulative count up to it;
  no ``+Inf`` field ("the infinity bucket is not used in this schema");
- summary → ``count``, ``sum``, one field per quantile;
- any other kind (exponential histograms) → "unknown metric type": an error that fails the
  whole request (:class:`UnknownMetricType`), so nothing of it is written.
"""

from __future__ import annotations

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from stepwatch.core._lineproto import FieldValue, encode_point
from stepwatch.otel_bridge._buckets import format_bound


class UnknownMetricType(ValueError):
    """The exporter's ``unknown metric type`` error: the whole request is dropped."""


def _as_string(value: AnyValue) -> str:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return str(value.int_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind == "double_value":
        return format_bound(value.double_value)
    if kind is None:
        return ""
    raise ValueError(f"attribute of kind {kind}: not used by stepwatch")


def _number(point: object) -> FieldValue:
    kind = point.WhichOneof("value")  # type: ignore[attr-defined]
    return int(point.as_int) if kind == "as_int" else float(point.as_double)  # type: ignore[attr-defined]


def telegraf_prometheus_v1(request: ExportMetricsServiceRequest) -> list[str]:
    """The line protocol the Collector's influxdb exporter writes for ``request``.

    Raises:
        UnknownMetricType: the request holds a metric kind the schema has no case for.
    """
    lines: list[str] = []
    for resource_metrics in request.resource_metrics:
        resource_tags = {
            item.key: _as_string(item.value)
            for item in resource_metrics.resource.attributes
            if item.key
        }
        for scope_metrics in resource_metrics.scope_metrics:
            scope_tags = {}
            if scope_metrics.scope.name:
                scope_tags["otel.library.name"] = scope_metrics.scope.name
            if scope_metrics.scope.version:
                scope_tags["otel.library.version"] = scope_metrics.scope.version
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind not in ("gauge", "sum", "histogram", "summary"):
                    raise UnknownMetricType(f'unknown metric type "{kind}"')
                for point in getattr(metric, kind).data_points:
                    if not point.time_unix_nano:
                        raise ValueError("metric has no timestamp")
                    tags = {item.key: _as_string(item.value) for item in point.attributes}
                    tags.update(resource_tags)
                    tags.update(scope_tags)
                    fields: dict[str, FieldValue] = {}
                    if point.start_time_unix_nano:
                        fields["start_time_unix_nano"] = int(point.start_time_unix_nano)
                    if kind == "gauge" or (kind == "sum" and not metric.sum.is_monotonic):
                        if point.WhichOneof("value") is None:
                            continue
                        fields["gauge"] = _number(point)
                    elif kind == "sum":
                        if point.WhichOneof("value") is None:
                            continue
                        fields["counter"] = _number(point)
                    elif kind == "histogram":
                        fields["count"] = float(point.count)
                        fields["sum"] = point.sum
                        if point.HasField("min"):
                            fields["min"] = point.min
                        if point.HasField("max"):
                            fields["max"] = point.max
                        running = 0
                        for bound, count in zip(
                            point.explicit_bounds, point.bucket_counts, strict=False
                        ):
                            running += count
                            fields[format_bound(bound)] = float(running)
                    else:
                        fields["count"] = float(point.count)
                        fields["sum"] = point.sum
                        for item in point.quantile_values:
                            fields[format_bound(item.quantile)] = item.value
                    lines.append(encode_point(metric.name, tags, fields, int(point.time_unix_nano)))
    return lines
