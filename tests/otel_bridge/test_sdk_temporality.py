"""A stock opentelemetry-sdk producer (CUMULATIVE or DELTA) → real Bridge → influxd → detectors.

Issue 13 item 1: four ranks, each its own ``MeterProvider`` and resource, record
``stepwatch.step.duration`` and ``stepwatch.phase.duration`` with explicit buckets and export
with the SDK's own OTLP exporter over real HTTP or gRPC. Rank 2's forward is slower and the
others wait for it in backward's allreduce (phase ``communication``, as stepwatch records the
collective), so step times are equal: a masked straggler. Stored per window, the counts match
what was recorded and the detectors name rank 2's forward; stored as cumulative totals, they
named nothing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpExporter,
)
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from stepwatch.core import InfluxClient
from stepwatch.core._influx import wait_until
from stepwatch.detectors import detect_job
from stepwatch.otel_bridge import Bridge, InfluxV1Writer
from tests.otel_bridge.test_server import metrics_values

RANKS = 4
SLOW_RANK = 2
EXPORTS = 36
EXPORT_INTERVAL_S = 0.25
STEPS_PER_EXPORT = 5
# log-spaced bounds, 1 ms .. ~30 s, 12 per decade
BOUNDS = [round(0.001 * 10 ** (i / 12), 9) for i in range(55)]
PHASES = {"forward": 0.040, "backward": 0.080, "communication": 0.005, "optimizer": 0.010}


@pytest.fixture
def bridge(influx: InfluxClient) -> Iterator[Bridge]:
    server = Bridge(InfluxV1Writer(influx), flush_interval_s=0.02).start()
    try:
        yield server
    finally:
        server.stop()


def _provider(
    bridge: Bridge, job: str, rank: int, temporality: str, protocol: str
) -> MeterProvider:
    chosen = AggregationTemporality[temporality]
    preferred = {Histogram: chosen, Counter: chosen}
    exporter = (
        HttpExporter(endpoint=bridge.http_url, preferred_temporality=preferred)
        if protocol == "http"
        else GrpcExporter(
            endpoint=bridge.grpc_endpoint, insecure=True, preferred_temporality=preferred
        )
    )
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    return MeterProvider(
        metric_readers=[reader],
        resource=Resource(
            {
                "stepwatch.job.id": job,
                "stepwatch.rank": rank,
                "stepwatch.world_size": RANKS,
                "host.name": f"node-{rank}",
                "service.instance.id": f"{job}-{rank}",
            }
        ),
        views=[
            View(
                instrument_name="stepwatch.*",
                aggregation=ExplicitBucketHistogramAggregation(boundaries=BOUNDS),
            )
        ],
    )


@pytest.mark.parametrize(
    ("temporality", "protocol"), [("CUMULATIVE", "http"), ("DELTA", "grpc"), ("CUMULATIVE", "grpc")]
)
def test_sdk_job_is_stored_per_window_and_diagnosed(
    bridge: Bridge, influx: InfluxClient, temporality: str, protocol: str
) -> None:
    job = f"sdk-{temporality.lower()}-{protocol}"
    providers = [_provider(bridge, job, rank, temporality, protocol) for rank in range(RANKS)]
    meters = [provider.get_meter("train") for provider in providers]
    steps = [meter.create_histogram("stepwatch.step.duration", unit="s") for meter in meters]
    phases = [meter.create_histogram("stepwatch.phase.duration", unit="s") for meter in meters]
    done = [meter.create_counter("train.steps") for meter in meters]
    noise = random.Random(13)
    start_ns = time.time_ns()
    recorded = 0
    for export in range(EXPORTS):
        for _ in range(STEPS_PER_EXPORT):
            slow = 1.5 if export >= EXPORTS // 3 else 1.0  # rank 2 slows down a third in
            forward = {
                rank: PHASES["forward"]
                * (slow if rank == SLOW_RANK else 1.0)
                * noise.gauss(1, 0.02)
                for rank in range(RANKS)
            }
            latest = max(forward.values())
            for rank in range(RANKS):
                # backward's allreduce waits for the latest rank's forward
                durations = {
                    "forward": forward[rank],
                    "backward": PHASES["backward"] * noise.gauss(1, 0.02),
                    "communication": PHASES["communication"] * noise.gauss(1, 0.02)
                    + latest
                    - forward[rank],
                    "optimizer": PHASES["optimizer"] * noise.gauss(1, 0.02),
                }
                for name, value in durations.items():
                    phases[rank].record(value, {"stepwatch.phase": name})
                steps[rank].record(sum(durations.values()))
                done[rank].add(1)
            recorded += 1
        for provider in providers:
            assert provider.force_flush(timeout_millis=10_000)
        time.sleep(EXPORT_INTERVAL_S)
    for provider in providers:
        provider.shutdown()
    end_ns = time.time_ns()
    # CUMULATIVE: the first export of every series is its baseline and stores nothing
    stored_exports = EXPORTS - 1 if temporality == "CUMULATIVE" else EXPORTS
    expected_steps = RANKS * stored_exports * STEPS_PER_EXPORT

    def stored_steps() -> float:
        rows = influx.query(
            'SELECT sum("count") FROM "stepwatch.step.duration" '
            f"WHERE \"stepwatch.job.id\" = '{job}'"
        )[0].records()
        return float(rows[0]["sum"]) if rows else 0.0

    assert wait_until(lambda: stored_steps() >= expected_steps, timeout_s=15)
    assert stored_steps() == expected_steps  # not 8,229 for 398 (issue 13)
    counters = influx.query(
        f'SELECT sum("counter") FROM "train.steps" WHERE "stepwatch.job.id" = \'{job}\''
    )[0].records()
    assert counters[0]["sum"] == expected_steps
    per_window = influx.query(
        'SELECT "count", "start_time_unix_nano" FROM "stepwatch.step.duration" '
        f"WHERE \"stepwatch.job.id\" = '{job}' AND \"stepwatch.rank\" = '0'"
    )[0].records()
    counts = [row["count"] for row in per_window]
    # shutdown() exports once more: an empty window (CUMULATIVE: unchanged totals) may follow
    assert counts[:stored_exports] == [STEPS_PER_EXPORT] * stored_exports, counts
    assert not any(counts[stored_exports:]), counts
    values = metrics_values(bridge)
    baselines = values.get("stepwatch_bridge_datapoints_rejected_total{reason=cumulative_baseline}")
    # step histogram + 4 phase histograms + the counter, per rank
    assert (baselines or 0) == (RANKS * 6 if temporality == "CUMULATIVE" else 0)

    findings = detect_job(influx, job, start_unix_nano=start_ns, end_unix_nano=end_ns)
    named = {(d.kind, d.ranks, d.phase) for d in findings}
    assert any(ranks == (SLOW_RANK,) and phase == "forward" for _, ranks, phase in named), named
    assert all(SLOW_RANK in ranks for _, ranks, _ in named), named
    assert recorded == EXPORTS * STEPS_PER_EXPORT
