"""Quantiles a producer's buckets cannot support are bounded, not invented.

The OpenTelemetry SDKs' default explicit bounds (0, 5, 10, 25, ... 10000) are meant for
milliseconds; step times in seconds all fall into the first bucket, whose midpoint is 2.5 s.
Turned from cumulative into per-window deltas a histogram has no ``min`` or ``max`` to clamp
that to, and the stored p50 once read 2.5 s for 60 ms steps: more than the window's sum.
"""

from __future__ import annotations

import random
import re

import pytest
from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from stepwatch.otel_bridge import convert_request
from stepwatch.otel_bridge._cumulative import CumulativeState


def _fields(line: str) -> dict[str, float]:
    """A line's numeric fields (its string fields, the buckets, left out)."""
    fields = line.split(" ")[1]
    return {
        key: float(value.rstrip("i"))
        for key, value in re.findall(r'([\w.+]+)=("(?:[^"\\]|\\.)*"|[^,]+)', fields)
        if not value.startswith('"')
    }


@pytest.mark.parametrize("temporality", ["CUMULATIVE", "DELTA"])
def test_default_bucket_quantiles_stay_within_what_the_window_allows(temporality: str) -> None:
    chosen = AggregationTemporality[temporality]
    reader = InMemoryMetricReader(preferred_temporality={Histogram: chosen})
    resource = Resource({"stepwatch.job.id": "j", "stepwatch.rank": 0, "stepwatch.world_size": 1,
                         "host.name": "n"})  # fmt: skip
    provider = MeterProvider(metric_readers=[reader], resource=resource)
    steps = provider.get_meter("test").create_histogram("stepwatch.step.duration", unit="s")
    state = CumulativeState()
    rng = random.Random(3)
    stored = []
    for _ in range(3):  # three windows: the first cumulative one is only a baseline
        values = [rng.uniform(0.05, 0.07) for _ in range(100)]
        for value in values:
            steps.record(value)
        data = reader.get_metrics_data()
        assert data is not None
        lines = convert_request(encode_metrics(data), cumulative=state).lines
        stored += [(_fields(line), values) for line in lines]
    provider.shutdown()
    assert len(stored) == (2 if temporality == "CUMULATIVE" else 3)
    for fields, values in stored:
        mean = fields["sum"] / fields["count"]
        assert mean == pytest.approx(sum(values) / len(values))
        # p50 is at most twice the mean, p90 ten times it (Markov, for non-negative values),
        # and never above the window's max where the window has one.
        assert fields["p50"] <= 2.0 * mean * 1.001
        assert fields["p90"] <= 10.0 * mean * 1.001
        if "max" in fields:
            assert fields["p50"] <= fields["max"] and fields["p90"] <= fields["max"]
