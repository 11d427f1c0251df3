"""Builders of OTLP metrics requests for the bridge tests (protobuf messages, no SDK)."""

from __future__ import annotations

import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2

from stepwatch.core import InfluxError, InfluxUnavailableError

T0 = 1_795_000_000_000_000_000
T1 = T0 + 10_000_000_000
SECOND = 1_000_000_000
PROTO = {"Content-Type": "application/x-protobuf"}

AttrValue = str | int | float | bool


def attributes(values: Mapping[str, AttrValue]) -> list[KeyValue]:
    items = []
    for key, value in values.items():
        item = KeyValue(key=key)
        if isinstance(value, bool):
            item.value.bool_value = value
        elif isinstance(value, int):
            item.value.int_value = value
        elif isinstance(value, float):
            item.value.double_value = value
        else:
            item.value.string_value = value
        items.append(item)
    return items


def rank_resource(job: str = "run-1", rank: int = 0, world_size: int = 4) -> dict[str, AttrValue]:
    return {
        "stepwatch.job.id": job,
        "stepwatch.rank": rank,
        "stepwatch.world_size": world_size,
        "host.name": f"node-{rank // 2}",
        "service.name": "stepwatch",
    }


def request(
    metrics: Sequence[metrics_pb2.Metric], resource: Mapping[str, AttrValue] | None = None
) -> ExportMetricsServiceRequest:
    message = ExportMetricsServiceRequest()
    resource_metrics = message.resource_metrics.add()
    resource_metrics.resource.attributes.extend(
        attributes(rank_resource() if resource is None else resource)
    )
    scope = resource_metrics.scope_metrics.add()
    scope.scope.name = "tests"
    scope.metrics.extend(metrics)
    return message


def _histogram_point(
    point: metrics_pb2.HistogramDataPoint | metrics_pb2.ExponentialHistogramDataPoint,
    attrs: Mapping[str, AttrValue] | None,
    time_unix_nano: int,
    *,
    total: float,
    minimum: float | None,
    maximum: float | None,
) -> None:
    """What every histogram point here carries: attributes, window, sum, min and max if given."""
    point.attributes.extend(attributes(attrs or {}))
    point.start_time_unix_nano = T0
    point.time_unix_nano = time_unix_nano
    point.sum = total
    if minimum is not None:
        point.min = minimum
    if maximum is not None:
        point.max = maximum


def _number_point(
    point: metrics_pb2.NumberDataPoint,
    value: float | int,
    attrs: Mapping[str, AttrValue] | None,
    time_unix_nano: int,
) -> None:
    point.attributes.extend(attributes(attrs or {}))
    point.time_unix_nano = time_unix_nano
    if isinstance(value, int):
        point.as_int = value
    else:
        point.as_double = value


def explicit_histogram(
    name: str,
    *,
    bounds: Sequence[float],
    counts: Sequence[int],
    total: float,
    minimum: float | None = None,
    maximum: float | None = None,
    attrs: Mapping[str, AttrValue] | None = None,
    time_unix_nano: int = T1,
    count: int | None = None,
    unit: str = "s",
) -> metrics_pb2.Metric:
    metric = metrics_pb2.Metric(name=name, unit=unit)
    metric.histogram.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
    point = metric.histogram.data_points.add()
    _histogram_point(point, attrs, time_unix_nano, total=total, minimum=minimum, maximum=maximum)
    point.count = sum(counts) if count is None else count
    point.explicit_bounds.extend(bounds)
    point.bucket_counts.extend(counts)
    return metric


def exponential_histogram(
    name: str,
    *,
    scale: int,
    offset: int,
    counts: Sequence[int],
    total: float,
    zero_count: int = 0,
    zero_threshold: float = 0.0,
    negative_offset: int = 0,
    negative_counts: Sequence[int] = (),
    minimum: float | None = None,
    maximum: float | None = None,
    attrs: Mapping[str, AttrValue] | None = None,
    unit: str = "s",
    time_unix_nano: int = T1,
) -> metrics_pb2.Metric:
    metric = metrics_pb2.Metric(name=name, unit=unit)
    metric.exponential_histogram.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
    point = metric.exponential_histogram.data_points.add()
    _histogram_point(point, attrs, time_unix_nano, total=total, minimum=minimum, maximum=maximum)
    point.count = sum(counts) + zero_count + sum(negative_counts)
    point.scale = scale
    point.zero_count = zero_count
    point.zero_threshold = zero_threshold
    point.positive.offset = offset
    point.positive.bucket_counts.extend(counts)
    point.negative.offset = negative_offset
    point.negative.bucket_counts.extend(negative_counts)
    return metric


def gauge(
    name: str,
    value: float | int,
    *,
    attrs: Mapping[str, AttrValue] | None = None,
    time_unix_nano: int = T1,
    unit: str = "1",
) -> metrics_pb2.Metric:
    metric = metrics_pb2.Metric(name=name, unit=unit)
    _number_point(metric.gauge.data_points.add(), value, attrs, time_unix_nano)
    return metric


def counter(
    name: str,
    value: float | int,
    *,
    monotonic: bool = True,
    attrs: Mapping[str, AttrValue] | None = None,
    time_unix_nano: int = T1,
    temporality: int = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA,
) -> metrics_pb2.Metric:
    metric = metrics_pb2.Metric(name=name, unit="1")
    metric.sum.is_monotonic = monotonic
    metric.sum.aggregation_temporality = temporality  # type: ignore[assignment]
    point = metric.sum.data_points.add()
    point.start_time_unix_nano = T0
    _number_point(point, value, attrs, time_unix_nano)
    return metric


def window_request(
    *, job: str, rank: int, world_size: int, window: int, phases: Sequence[str] = ("forward",)
) -> ExportMetricsServiceRequest:
    """One rank's window: a step histogram, phase histograms and the last-step gauge."""
    end = T1 + window * 1_000_000_000
    metrics = [
        explicit_histogram(
            "stepwatch.step.duration",
            bounds=[0.1, 0.2, 0.4],
            counts=[1, 2, 1, 0],
            total=0.9,
            minimum=0.05,
            maximum=0.35,
            time_unix_nano=end,
        ),
        gauge("stepwatch.step.last", window * 4 + 3, time_unix_nano=end, unit="{step}"),
    ]
    metrics.extend(
        explicit_histogram(
            "stepwatch.phase.duration",
            bounds=[0.05, 0.1],
            counts=[2, 2, 0],
            total=0.3,
            attrs={"stepwatch.phase": phase},
            time_unix_nano=end,
        )
        for phase in phases
    )
    return request(metrics, rank_resource(job, rank, world_size))


class FixedClock:
    """A receive-time clock the test moves by hand."""

    def __init__(self, now_unix_nano: int) -> None:
        self.now_unix_nano = now_unix_nano

    def __call__(self) -> int:
        return self.now_unix_nano


class RecordingWriter:
    """A LineWriter keeping batches in memory; can be made unavailable or blocked."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.available = True
        self.refuse = False
        self.gate = threading.Event()
        self.gate.set()
        self.attempts = 0

    def write_lines(self, lines: Sequence[str]) -> None:
        self.gate.wait(30)
        self.attempts += 1
        if not self.available:
            raise InfluxUnavailableError("down for the test")
        if self.refuse:
            raise InfluxError("field type conflict", status=400)
        self.batches.append(list(lines))

    def close(self) -> None:
        pass

    @property
    def lines(self) -> list[str]:
        return [line for batch in self.batches for line in batch]


def post(
    url: str, body: bytes, headers: dict[str, str], *, context: ssl.SSLContext | None = None
) -> tuple[int, dict[str, str], bytes]:
    """POST and return (status, headers, body) for any status."""
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def line_fields(line: str) -> dict[str, str]:
    """The fields of one line of line protocol, values as written (strings keep their quotes).

    Splits on the commas and spaces outside quoted string values (the compact layout's
    ``buckets`` field holds commas); keys and tags carry no escaped separators in these tests.
    """
    head, _, rest = line.partition(" ")
    while head.endswith("\\"):  # an escaped space in the series key
        more, _, rest = rest.partition(" ")
        head += " " + more
    fields: dict[str, str] = {}
    key, value, quoted, index = "", "", False, 0
    in_value = False
    while index < len(rest):
        char = rest[index]
        if in_value and quoted and char == "\\":
            value += rest[index : index + 2]
            index += 2
            continue
        if in_value and char == '"':
            quoted = not quoted
        if not quoted and char in ", ":
            fields[key] = value
            key, value, in_value = "", "", False
            if char == " ":
                break
        elif not in_value and char == "=":
            in_value = True
        elif in_value:
            value += char
        else:
            key += char
        index += 1
    return fields


def bucket_fields(fields: Mapping[str, str]) -> dict[str, str]:
    """The per-bound fields (``"0.1": "4.0"``, ``"+Inf"``) of a compact ``buckets`` field, as
    the ``per_bound`` layout writes them (exponential: the edges of populated buckets only)."""
    import math

    from stepwatch.otel_bridge import decode_buckets
    from stepwatch.otel_bridge._buckets import format_bound, populated_edges

    text = fields["buckets"]
    assert text.startswith('"') and text.endswith('"'), text
    buckets = decode_buckets(text[1:-1])
    keep = populated_edges(buckets) if text.startswith('"e') else range(len(buckets.uppers))
    out = {
        "+Inf" if math.isinf(buckets.uppers[i]) else format_bound(buckets.uppers[i]): (
            f"{float(buckets.cumulative[i])!r}"
        )
        for i in keep
    }
    out["+Inf"] = f"{float(buckets.cumulative[-1])!r}"
    return out
