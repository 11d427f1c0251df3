"""The OTLP metrics request written directly: ``encode_metrics(data).SerializeToString()``.

The SDK's ``encode_metrics`` builds one protobuf object per data point, attribute and value
through the Python API (~0.3-1 ms per window), then serialises it. stepwatch windows use a
handful of message types, so :class:`RequestEncoder` writes the same bytes directly: fields in
ascending field-number order, proto3 defaults omitted, ``optional`` and ``oneof`` fields
written when set, exactly as upb serialises the SDK's messages (the test suite compares the
two byte for byte on random windows). Anything it does not handle (exemplars, nested
attribute values, out-of-range numbers) makes it return None and the caller uses the SDK
encoder.

Field numbers: opentelemetry-proto, metrics/v1/metrics.proto and common/v1/common.proto; wire
format: https://protobuf.dev/programming-guides/encoding/
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from stepwatch.exporters import _histogram  # its _fasthist: the C point writer, or None

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_sfixed64 = struct.Struct("<q").pack
_ONE_BYTE = tuple(bytes((value,)) for value in range(128))
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_UINT32_MAX = (1 << 32) - 1


class _Unsupported(Exception):
    """The direct encoder does not handle this input: use the SDK's."""


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if value < 0:
        value &= 0xFFFF_FFFF_FFFF_FFFF  # int64: two's complement, ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _sint32(value: int) -> bytes:
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise _Unsupported("sint32 out of range")
    return _varint((value << 1) ^ (value >> 31))


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _any_value(value: object) -> bytes:
    """An ``AnyValue`` message body (``_encode_value`` in the SDK)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _length_delimited(b"\x0a", value.encode("utf-8"))
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Unsupported("int64 out of range")
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, bytes):
        return _length_delimited(b"\x3a", value)
    raise _Unsupported(f"attribute value of type {type(value).__name__}")


def _attributes(tag: bytes, attributes: Mapping[str, object] | None) -> bytes:
    """Repeated ``KeyValue`` fields under ``tag``."""
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        if not isinstance(key, str):
            raise _Unsupported("attribute key is not a string")
        encoded_key = _length_delimited(b"\x0a", key.encode("utf-8")) if key else b""
        parts.append(
            _length_delimited(tag, encoded_key + _length_delimited(b"\x12", _any_value(value)))
        )
    return b"".join(parts)


class _AttributeCache:
    """Encoded point attributes, remembered when every value is a string (the usual case).

    Windows repeat the same few attribute sets (one per phase, kernel class) every second.
    Only all-string sets are cached: ``1``, ``True`` and ``1.0`` are equal dictionary keys
    but encode differently.
    """

    _MAX_ENTRIES: Final = 4096

    def __init__(self) -> None:
        self._encoded: dict[tuple[bytes, tuple[tuple[str, object], ...]], bytes] = {}

    def __call__(self, tag: bytes, attributes: Mapping[str, object] | None) -> bytes:
        if not attributes:
            return b""
        items = tuple(attributes.items())
        for _, value in items:
            if type(value) is not str:
                return _attributes(tag, attributes)
        key = (tag, items)
        encoded = self._encoded.get(key)
        if encoded is None:
            if len(self._encoded) >= self._MAX_ENTRIES:
                self._encoded.clear()
            encoded = self._encoded[key] = _attributes(tag, attributes)
        return encoded


def _string(tag: bytes, value: str | None) -> bytes:
    return _length_delimited(tag, value.encode("utf-8")) if value else b""


def _fixed64(tag: bytes, value: int) -> bytes:
    return tag + _pack_fixed64(value) if value else b""


def _exponential_point(point: Any, attributes: _AttributeCache) -> bytes:
    if point.exemplars:
        raise _Unsupported("exemplars")
    parts = [
        attributes(b"\x0a", point.attributes),
        _fixed64(b"\x11", point.start_time_unix_nano),
        _fixed64(b"\x19", point.time_unix_nano),
        _fixed64(b"\x21", point.count),
    ]
    if point.sum is not None:
        parts.append(b"\x29" + _pack_double(point.sum))
    if point.scale:
        parts.append(b"\x30" + _sint32(point.scale))
    parts.append(_fixed64(b"\x39", point.zero_count))
    for tag, buckets in ((b"\x42", point.positive), (b"\x4a", point.negative)):
        counts = buckets.bucket_counts
        if counts:
            body = b"\x08" + _sint32(buckets.offset) if buckets.offset else b""
            packed = bytes(counts) if max(counts) < 0x80 else b"".join(map(_varint, counts))
            body += _length_delimited(b"\x12", packed)
            parts.append(_length_delimited(tag, body))
    if point.flags:
        if not 0 <= point.flags <= _UINT32_MAX:
            raise _Unsupported("flags out of range")
        parts.append(b"\x50" + _varint(point.flags))
    if point.min is not None:
        parts.append(b"\x61" + _pack_double(point.min))
    if point.max is not None:
        parts.append(b"\x69" + _pack_double(point.max))
    return b"".join(parts)


def _explicit_point(point: Any, attributes: _AttributeCache) -> bytes:
    """A ``HistogramDataPoint``: start 2, time 3, count 4, sum 5, bucket_counts 6 (packed
    fixed64), explicit_bounds 7 (packed double), attributes 9, min 11, max 12."""
    if point.exemplars:
        raise _Unsupported("exemplars")
    parts = [
        _fixed64(b"\x11", point.start_time_unix_nano),
        _fixed64(b"\x19", point.time_unix_nano),
        _fixed64(b"\x21", point.count),
    ]
    if point.sum is not None:
        parts.append(b"\x29" + _pack_double(point.sum))
    counts, bounds = point.bucket_counts, point.explicit_bounds
    if counts:
        if min(counts) < 0 or max(counts) > 0xFFFF_FFFF_FFFF_FFFF:
            raise _Unsupported("bucket count out of range")
        parts.append(_length_delimited(b"\x32", b"".join(map(_pack_fixed64, counts))))
    if bounds:
        parts.append(_length_delimited(b"\x3a", b"".join(map(_pack_double, bounds))))
    parts.append(attributes(b"\x4a", point.attributes))
    if point.min is not None:
        parts.append(b"\x59" + _pack_double(point.min))
    if point.max is not None:
        parts.append(b"\x61" + _pack_double(point.max))
    return b"".join(parts)


def _number_point(point: Any, attributes: _AttributeCache, *, with_start: bool) -> bytes:
    if point.exemplars:
        raise _Unsupported("exemplars")
    parts = [
        _fixed64(b"\x11", point.start_time_unix_nano) if with_start else b"",
        _fixed64(b"\x19", point.time_unix_nano),
    ]
    value = point.value
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Unsupported("int64 out of range")
        parts.append(b"\x31" + _pack_sfixed64(value))
    elif isinstance(value, float):
        parts.append(b"\x21" + _pack_double(value))
    else:
        raise _Unsupported(f"value of type {type(value).__name__}")
    parts.append(attributes(b"\x3a", point.attributes))
    return b"".join(parts)


def _metric(metric: Any, types: Any, attributes: _AttributeCache) -> bytes:
    parts = [
        _string(b"\x0a", metric.name),
        _string(b"\x12", metric.description),
        _string(b"\x1a", metric.unit),
    ]
    data = metric.data
    points = data.data_points
    # Metric.data is a oneof: gauge 5, sum 7, histogram 9, exponential_histogram 10. In each,
    # data_points is field 1, aggregation_temporality field 2 (not in Gauge), is_monotonic
    # field 3 (Sum).
    if isinstance(data, types.ExponentialHistogram):
        field, kind = b"\x52", "histogram"
    elif isinstance(data, types.Histogram):
        field, kind = b"\x4a", "explicit"
    elif isinstance(data, types.Sum):
        field, kind = b"\x3a", "sum"
    elif isinstance(data, types.Gauge):
        field, kind = b"\x2a", "gauge"
    else:
        raise _Unsupported(f"metric data of type {type(data).__name__}")
    if points:
        fast = _histogram._fasthist  # type: ignore[attr-defined]  # None: STEPWATCH_EXPORTERS_NO_C
        if kind == "histogram" and fast is not None:  # each point in C, else as below
            body = b"".join(
                [
                    fast.exponential_point(point, attributes(b"\x0a", point.attributes))
                    or _length_delimited(b"\x0a", _exponential_point(point, attributes))
                    for point in points
                ]
            )
        else:
            if kind == "histogram":
                encoded = [_exponential_point(point, attributes) for point in points]
            elif kind == "explicit":
                encoded = [_explicit_point(point, attributes) for point in points]
            else:
                with_start = kind == "sum"
                encoded = [
                    _number_point(point, attributes, with_start=with_start) for point in points
                ]
            body = b"".join([_length_delimited(b"\x0a", point) for point in encoded])
        if kind != "gauge":
            temporality = int(data.aggregation_temporality)
            body += b"\x10" + _varint(temporality) if temporality else b""
            body += b"\x18\x01" if kind == "sum" and data.is_monotonic else b""
        parts.append(_length_delimited(field, body))
    return b"".join(parts)


def _scope(scope: Any) -> bytes:
    if scope is None:
        raise _Unsupported("no instrumentation scope")
    return (
        _string(b"\x0a", scope.name)
        + _string(b"\x12", scope.version)
        + _attributes(b"\x1a", scope.attributes)
    )


class RequestEncoder:
    """``encode_metrics(data).SerializeToString()``, written directly (see the module docstring).

    Caches the encoded resource: a monitor sends the same one every window.
    """

    def __init__(self) -> None:
        from opentelemetry.sdk.metrics import export as types

        self._types = types
        self._attributes = _AttributeCache()
        self._resource_cache: tuple[object, bytes] = (None, b"")

    def encode(self, metrics_data: MetricsData) -> bytes | None:
        """The serialised ``ExportMetricsServiceRequest``, or None when unsupported."""
        try:
            return self._encode(metrics_data)
        except (_Unsupported, struct.error, AttributeError, TypeError, ValueError):
            return None

    def _resource_body(self, resource: Any) -> bytes:
        cached_resource, encoded = self._resource_cache  # one tuple: safe across threads
        if cached_resource is not resource:
            encoded = _attributes(b"\x0a", resource.attributes)
            self._resource_cache = (resource, encoded)
        return encoded

    def _encode(self, metrics_data: MetricsData) -> bytes:
        types = self._types
        # Mirror encode_metrics: resources and scopes are dict keys (equal ones merge, the
        # later scope's metrics replacing the earlier's), schema URLs come from the SDK
        # Resource and InstrumentationScope objects.
        by_resource: dict[Any, dict[Any, list[bytes]]] = {}
        for resource_metrics in metrics_data.resource_metrics:
            scopes: dict[Any, list[bytes]] = {}
            by_resource[resource_metrics.resource] = scopes
            for scope_metrics in resource_metrics.scope_metrics:
                scopes[scope_metrics.scope] = [
                    _length_delimited(b"\x12", _metric(metric, types, self._attributes))
                    for metric in scope_metrics.metrics
                ]
        out = []
        for resource, scopes in by_resource.items():
            body = [_length_delimited(b"\x0a", self._resource_body(resource))]
            for scope, metrics in scopes.items():
                scope_body = (
                    _length_delimited(b"\x0a", _scope(scope))
                    + b"".join(metrics)
                    + _string(b"\x1a", scope.schema_url)
                )
                body.append(_length_delimited(b"\x12", scope_body))
            body.append(_string(b"\x1a", resource.schema_url))
            out.append(_length_delimited(b"\x0a", b"".join(body)))
        return b"".join(out)
