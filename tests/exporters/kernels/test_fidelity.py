"""Fidelity end to end: trace → ingest → OTLP/HTTP → real bridge → real InfluxDB → p50/p90/p99.

The stored quantiles (the bridge's nearest-rank estimate from exponential buckets: midpoint of
the bucket holding rank ceil(q·n), clamped to [min, max]) must be within 5 % of the exact
nearest-rank quantiles of the raw kernel durations, for every kernel class of every step of
every rank of the public DLRM (8 ranks) and HTA (2 ranks × 2 steps) traces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from stepwatch.core import InfluxClient
from stepwatch.core._influx import quote_literal
from stepwatch.exporters import create_exporter, resolve_exporter_config
from stepwatch.exporters.kernels import classify_kernel, ingest_traces, read_trace
from stepwatch.otel_bridge import Bridge, InfluxV1Writer, bucket_quantile

TOLERANCE = 0.05
ORIGIN_UNIX_NANO = 1_790_000_000_000_000_000


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    """The exact nearest-rank quantile: the ceil(q·n)-th smallest value."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


def _exact(paths: Sequence[Path]) -> dict[tuple[int, int, str], list[float]]:
    """(rank, step start offset, class) → raw durations in seconds, straight from the traces."""
    exact: dict[tuple[int, int, str], list[float]] = {}
    for path in paths:
        trace = read_trace(path)
        assert trace.rank is not None
        for position, step in enumerate(trace.steps):
            for event in step.kernels:
                key = (trace.rank, position, classify_kernel(event.name).name)
                exact.setdefault(key, []).append(event.duration_ns / 1e9)
    return exact


@pytest.mark.parametrize("protocol", ["http/protobuf"])
def test_stored_quantiles_within_five_percent(
    influx: InfluxClient,
    dlrm_traces: list[Path],
    hta_traces: list[Path],
    protocol: str,
) -> None:
    checked = 0
    for job, paths in (("fidelity-dlrm", dlrm_traces), ("fidelity-hta", hta_traces)):
        bridge = Bridge(InfluxV1Writer(influx), grpc_port=None, http_port=0).start()
        try:
            exporter = create_exporter(
                resolve_exporter_config(endpoint=bridge.http_url, protocol=protocol, environ={})
            )
            result = ingest_traces(
                paths, job_id=job, exporter=exporter, time_origin_unix_nano=ORIGIN_UNIX_NANO
            )
            exporter.shutdown()
        finally:
            bridge.stop()  # flushes the queue to InfluxDB
        assert result.ok, result.failures
        exact = _exact(paths)
        series = influx.query(
            'SELECT "p50", "p90", "buckets", "min", "max", "count" '
            'FROM "stepwatch.kernel.duration" '
            f'WHERE "stepwatch.job.id" = {quote_literal(job)} '
            'GROUP BY "stepwatch.rank", "stepwatch.kernel.class"'
        )
        stored: dict[tuple[int, int, str], dict[str, float]] = {}
        for item in series:
            rank = int(item.tags["stepwatch.rank"])
            for position, row in enumerate(item.records()):  # one row per step, in time order
                stored[(rank, position, item.tags["stepwatch.kernel.class"])] = row
        assert set(stored) == set(exact)
        for key, durations in exact.items():
            row = stored[key]
            assert row["count"] == len(durations)
            # p99 is not a stored field (compact layout): read it from the buckets string
            row["p99"] = bucket_quantile(
                str(row["buckets"]), 0.99, minimum=row.get("min"), maximum=row.get("max")
            )
            for field, quantile in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                want = nearest_rank(durations, quantile)
                assert row[field] == pytest.approx(want, rel=TOLERANCE), (key, field)
                checked += 1
    assert checked > 300
