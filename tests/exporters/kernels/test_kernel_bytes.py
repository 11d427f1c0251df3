"""Bytes per rank per step on the public DLRM trace (issue 3): a budget that cannot creep up.

bench/kernel_bytes.py prints the full table; this test pins its headline on the ingest defaults
(scale 4, 320 buckets, top 48 classes): every kernel class of the trace is kept, the gzipped
OTLP request stays within budget, and the bridge's p50/p90/p99 of every class, computed from
exactly those bytes, stay within the scale-4 bucket bound of the exact values.
"""

from __future__ import annotations

import gzip
import math
import statistics
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

from stepwatch import _schema
from stepwatch.exporters.kernels import classify_kernel, read_trace, trace_windows
from stepwatch.otel_bridge import exponential_buckets, nearest_rank_quantile

# Measured 1,082 B mean with gzip level 6 (1,138 B before the wire changes); the margin
# absorbs zlib-version differences, not regressions.
GZIP_BUDGET_BYTES = 1_095
# Worst relative error of a bucket midpoint at scale 4: (2 ** (1 / 16) - 1) / 2.
SCALE4_BOUND = (2.0 ** (1 / 16) - 1.0) / 2.0
GRID_S = 2.0**-31


def test_dlrm_window_bytes_classes_and_quantiles(dlrm_traces: list[Path]) -> None:
    zipped: list[int] = []
    for path in dlrm_traces:
        trace = read_trace(path)
        (step,) = trace.steps
        exact: dict[str, list[float]] = {}
        for event in step.kernels:
            exact.setdefault(classify_kernel(event.name).name, []).append(event.duration_ns / 1e9)
        (window,) = trace_windows(
            trace, job_id="bytes", rank=trace.rank or 0, world_size=8, time_offset_ns=0
        )
        request = encode_metrics(window.metrics)
        zipped.append(len(gzip.compress(request.SerializeToString(), 6)))
        (kernel_metric,) = [
            m
            for m in request.resource_metrics[0].scope_metrics[0].metrics
            if m.name == _schema.KERNEL_DURATION
        ]
        points = {
            {a.key: a.value.string_value for a in p.attributes}[_schema.KERNEL_CLASS]: p
            for p in kernel_metric.exponential_histogram.data_points
        }
        assert set(points) == set(exact)  # every class kept, none folded into "other"
        for name, values in exact.items():
            point = points[name]
            assert point.scale == 4
            # Durations are recorded on the 2**-30 s grid (nearest, < 0.47 ns off the raw value).
            assert point.min <= min(values) + GRID_S and point.max >= max(values) - GRID_S
            buckets = exponential_buckets(
                point.scale,
                positive_offset=point.positive.offset,
                positive_counts=list(point.positive.bucket_counts),
                zero_count=point.zero_count,
            )
            ordered = sorted(values)
            for quantile in (0.5, 0.9, 0.99):
                want = ordered[max(1, math.ceil(quantile * len(ordered))) - 1]
                got = nearest_rank_quantile(buckets, quantile, minimum=point.min, maximum=point.max)
                assert got is not None
                assert abs(got - want) <= SCALE4_BOUND * want, (name, quantile, got, want)
    assert statistics.mean(zipped) <= GZIP_BUDGET_BYTES, zipped
