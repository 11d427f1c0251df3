"""The bridge's own Prometheus metrics, in an injected ``CollectorRegistry``."""

from __future__ import annotations

from typing import Any


class BridgeMetrics:
    """Counters, gauges and histograms the bridge exports on ``/metrics``.

    Args:
        registry: a ``prometheus_client.CollectorRegistry``; a fresh one when None (never the
            global default registry, so several bridges can live in one process).
    """

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry: Any = registry if registry is not None else CollectorRegistry()
        self.received = Counter(
            "stepwatch_bridge_datapoints_received",
            "OTLP data points received (accepted or not).",
            registry=self.registry,
        )
        self.written = Counter(
            "stepwatch_bridge_datapoints_written",
            "Data points InfluxDB accepted (direct or replayed from the spool).",
            registry=self.registry,
        )
        self.rejected = Counter(
            "stepwatch_bridge_datapoints_rejected",
            "Data points refused at conversion (invalid, clock skew, duplicate rank, cardinality).",
            ["reason"],
            registry=self.registry,
        )
        self.dropped = Counter(
            "stepwatch_bridge_datapoints_dropped",
            "Accepted data points lost later: spool_full (drop_oldest overflow), influx_refused "
            "(InfluxDB refused the very line), shutdown (memory spool at exit).",
            ["reason"],
            registry=self.registry,
        )
        self.attributes_dropped = Counter(
            "stepwatch_bridge_attributes_dropped",
            "Attributes not stored as tags (key not allowlisted or value not a scalar).",
            registry=self.registry,
        )
        self.write_duration = Histogram(
            "stepwatch_bridge_write_duration_seconds",
            "Duration of one batch write to InfluxDB (successful or not).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "stepwatch_bridge_queue_depth",
            "Data points waiting in memory for the writer.",
            registry=self.registry,
        )
        self.spool_bytes = Gauge(
            "stepwatch_bridge_spool_bytes",
            "Bytes of line protocol spooled while InfluxDB is unavailable.",
            registry=self.registry,
        )
        self.rank_conflicts = Counter(
            "stepwatch_bridge_rank_conflicts",
            "Exports from a second producer of one (job, rank): rejected while the first is "
            "live, or taken_over after it went silent.",
            ["outcome"],
            registry=self.registry,
        )
        self.write_failures = Counter(
            "stepwatch_bridge_write_failures",
            "Failed InfluxDB write attempts: unavailable (down, 5xx, timeout, connection closed "
            "mid-reply; retried), refused (4xx; the batch is split to keep its valid lines), "
            "error (anything else; retried). The points stay in the spool until written.",
            ["reason"],
            registry=self.registry,
        )
        self.spool_failures = Counter(
            "stepwatch_bridge_spool_failures",
            "Spool commits that failed (disk full, I/O error); their requests were answered "
            "503 and nothing of them was accepted.",
            registry=self.registry,
        )
        self.refused = Counter(
            "stepwatch_bridge_requests_refused",
            "Requests answered 429/503 (RESOURCE_EXHAUSTED/UNAVAILABLE) so the producer keeps "
            "and retries them: queue_full, spool_full, series_rate, unavailable.",
            ["reason"],
            registry=self.registry,
        )
        self.commit_duration = Histogram(
            "stepwatch_bridge_commit_duration_seconds",
            "Time a request waits for its lines to be in the spool (fsync'd for a disk spool) "
            "before it is answered.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self.healthy = Gauge(
            "stepwatch_bridge_healthy",
            "1 while the bridge can accept durably (its spool commits and its writer runs); "
            "0 while it refuses with 503 and /healthz fails.",
            registry=self.registry,
        )
        self.healthy.set(1)
        self.fast_path = Gauge(
            "stepwatch_bridge_fast_path",
            "1: request bodies are converted by the C fast path (stepwatch.otel_bridge._fastpath)"
            "; 0: by the Python path (the extension is not built, or fast_path=False).",
            registry=self.registry,
        )
        self.series = Gauge(
            "stepwatch_bridge_series",
            "Series the cardinality guard currently remembers (seen within its TTL).",
            registry=self.registry,
        )
        self.cumulative_series = Gauge(
            "stepwatch_bridge_cumulative_series",
            "CUMULATIVE series whose last point this process remembers (to store deltas).",
            registry=self.registry,
        )
        self.cumulative_evicted = Counter(
            "stepwatch_bridge_cumulative_evicted",
            "CUMULATIVE series forgotten: expired (silent for the series TTL) or capacity "
            "(the least recently seen, beyond the bound); seen again, they start with a baseline.",
            ["reason"],
            registry=self.registry,
        )
        self.requests = Counter(
            "stepwatch_bridge_requests",
            "OTLP export requests answered, by protocol (grpc/http) and code.",
            ["protocol", "code"],
            registry=self.registry,
        )
        self.connections = Gauge(
            "stepwatch_bridge_connections",
            "OTLP/HTTP client connections open now (protocol=http).",
            ["protocol"],
            registry=self.registry,
        )

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), str(CONTENT_TYPE_LATEST)
