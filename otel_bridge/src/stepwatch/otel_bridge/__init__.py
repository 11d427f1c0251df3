"""stepwatch.otel_bridge: OTLP metrics (gRPC, HTTP protobuf/JSON) → InfluxDB line protocol.

Needs the ``[bridge]`` extra. The stored layout is documented in docs/storage.md.

Example:
    >>> from stepwatch.otel_bridge import convert_request
    >>> from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ...     ExportMetricsServiceRequest)
    >>> convert_request(ExportMetricsServiceRequest()).lines
    []
"""

from stepwatch.core._facade import publish
from stepwatch.otel_bridge._bridge import Bridge
from stepwatch.otel_bridge._bucket_text import (
    bucket_quantile,
    buckets_from_bound_fields,
    decode_buckets,
    merge_buckets,
)
from stepwatch.otel_bridge._cardinality import CardinalityGuard
from stepwatch.otel_bridge._convert import TAG_ALLOWLIST, Conversion, convert_request
from stepwatch.otel_bridge._fields import COMPACT_FIELDS, LAYOUTS
from stepwatch.otel_bridge._metrics import BridgeMetrics
from stepwatch.otel_bridge._spool import DiskSpool, MemorySpool, SpoolAppend
from stepwatch.otel_bridge._writers import InfluxV1Writer, InfluxV2Writer, LineWriter

__all__ = [
    "COMPACT_FIELDS",
    "LAYOUTS",
    "TAG_ALLOWLIST",
    "Bridge",
    "BridgeMetrics",
    "CardinalityGuard",
    "Conversion",
    "DiskSpool",
    "InfluxV1Writer",
    "InfluxV2Writer",
    "LineWriter",
    "MemorySpool",
    "SpoolAppend",
    "bucket_quantile",
    "buckets_from_bound_fields",
    "convert_request",
    "decode_buckets",
    "merge_buckets",
]

publish(__name__, [globals()[name] for name in __all__])
