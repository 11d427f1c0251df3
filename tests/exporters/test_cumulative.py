"""``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=cumulative``: running totals per series.

Issue 13 item 3. The running histogram of a series is the merge of its windows
(``merge_snapshots``): the same histogram one aggregator would hold for every value. A
StepMonitor with the variable set sends CUMULATIVE histograms whose counts never go down and
whose start never moves; and through the bridge's differencing (``otel_bridge/_cumulative``)
the cumulative windows store the same count and sum as the delta ones, but for the first
window of each series, which is the bridge's baseline (docs/exporters.md).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import AggregationTemporality

from stepwatch.core import _schema
from stepwatch.exporters import (
    InMemoryExporter,
    KernelWindow,
    StepMonitor,
    WindowBuilder,
    build_resource,
)
from stepwatch.exporters._histogram import (
    EXPLICIT_GRID_SCALE,
    ExponentialHistogram,
    HistogramSnapshot,
    explicit_layout,
    lower_boundary,
    merge_snapshots,
)
from stepwatch.otel_bridge import convert_request
from stepwatch.otel_bridge._cumulative import CumulativeState
from tests.otel_bridge.otlp_requests import line_fields

VARIABLE = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
START = 1_795_000_000_000_000_000
SECOND = 1_000_000_000

values = st.one_of(
    st.just(0.0),
    st.floats(min_value=1e-7, max_value=1e3, allow_nan=False, allow_infinity=False),
)
windows = st.lists(st.lists(values, max_size=30), min_size=1, max_size=8)


def histogram_of(samples: list[float], max_size: int) -> HistogramSnapshot:
    histogram = ExponentialHistogram(max_scale=5, max_size=max_size)
    assert histogram.record_many(samples) == 0
    return histogram.snapshot()


# ---------------------------------------------------------------- the running histogram
@settings(max_examples=300, deadline=None)
@given(windows, st.integers(min_value=2, max_value=40))
def test_merged_windows_are_the_histogram_of_all_values(
    samples: list[list[float]], max_size: int
) -> None:
    total = histogram_of([], max_size)
    for window in samples:
        before = total
        total = merge_snapshots(total, histogram_of(window, max_size), max_size=max_size)
        assert total.scale <= before.scale or before.count == 0  # never finer: differencable
        assert total.count == before.count + len(window)
    everything = [value for window in samples for value in window]
    single = histogram_of(everything, max_size)
    assert total.count == single.count == len(everything)
    assert total.zero_count + sum(total.bucket_counts) == total.count  # counts conserved
    assert len(total.bucket_counts) <= max_size
    if total.count:
        assert (total.min, total.max) == (single.min, single.max)
        assert math.isclose(total.sum, single.sum, rel_tol=1e-9)
    assert (total.scale, total.zero_count, total.offset, total.bucket_counts) == (
        single.scale,
        single.zero_count,
        single.offset,
        single.bucket_counts,
    )


def test_merge_downscales_to_respect_max_size() -> None:
    narrow = histogram_of([1.0, 1.01], 8)
    wide = histogram_of([1000.0], 8)
    assert narrow.scale == 5 and wide.scale == 5
    merged = merge_snapshots(narrow, wide, max_size=8)
    assert len(merged.bucket_counts) <= 8 and merged.scale < 5
    assert merged.count == 3 and sum(merged.bucket_counts) == 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=1.0, max_value=40.0), min_size=1, max_size=50))
def test_contiguous_explicit_layout_lists_every_grid_bound_between(samples: list[float]) -> None:
    snapshot = histogram_of([value * 1e-3 for value in samples], 160)
    bounds, counts = explicit_layout(snapshot, contiguous=True)
    grid = [lower_boundary(i, EXPLICIT_GRID_SCALE) for i in range(-200, 100)]
    assert bounds[0] == 0.0 and counts[0] == 0  # always there: zeros never change the layout
    first = grid.index(bounds[1])
    assert bounds[1:] == grid[first : first + len(bounds) - 1]  # no grid bound skipped
    whole_octaves = first % 8 == 0 and (len(bounds) - 2) % 8 == 0  # grid from index -200
    assert len(bounds) <= 48 and (whole_octaves or len(bounds) > 33)  # else too wide to round
    assert sum(counts) == len(samples) and counts[1] == counts[-1] == 0
    running = 0
    for bound, count in zip(bounds, counts, strict=False):
        running += count
        assert running == sum(1 for value in samples if value * 1e-3 <= bound)


# ---------------------------------------------------------------- StepMonitor
class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * SECOND

    def monotonic_ns(self) -> int:
        return self.now

    def time_ns(self) -> int:
        return START + self.now


def points(data: Any, name: str) -> list[Any]:
    return [
        point
        for scope in data.resource_metrics[0].scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def test_monitor_with_the_variable_sends_running_totals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIABLE, "cumulative")
    clock = Clock()
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="run-1",
        rank=0,
        world_size=1,
        host_name="n0",
        exporter=exporter,
        start=False,
        health=False,
        clock=clock,
        device_timer="cpu",
    )
    steps = 0
    for window in range(5):
        for _ in range(window % 3):  # windows of 0, 1, 2, 0, 1 steps
            with monitor.step():
                with monitor.phase("forward"):
                    clock.now += 2_000_000
                if steps % 2:
                    with monitor.phase("backward"):
                        clock.now += 3_000_000
            steps += 1
        clock.now += SECOND
        assert monitor.export_now()
    monitor.close()
    sent = exporter.exported
    assert len(sent) == 6  # five windows and the closing one
    counts: list[int] = []
    starts: set[int] = set()
    for data in sent:
        for scope in data.resource_metrics[0].scope_metrics:
            for metric in scope.metrics:
                temporality = getattr(metric.data, "aggregation_temporality", None)
                if metric.name.endswith(".duration"):
                    assert temporality == AggregationTemporality.CUMULATIVE
                    starts.update(p.start_time_unix_nano for p in metric.data.data_points)
                else:
                    assert temporality is None, metric.name  # gauges are unaffected
        counts.extend(p.count for p in points(data, _schema.STEP_DURATION))
    assert counts == [1, 3, 4]  # windows without a step omit the series: a gap, not a zero
    assert len(starts) == 1  # one start for every series, the first window's
    series: dict[tuple[str, tuple[Any, ...]], list[tuple[int, float]]] = {}
    for data in sent:
        for name in (_schema.STEP_DURATION, _schema.PHASE_DURATION):
            for p in points(data, name):
                key = (name, tuple(sorted(p.attributes.items())))
                series.setdefault(key, []).append((p.count, p.sum))
                assert p.time_unix_nano > p.start_time_unix_nano
    assert len(series) == 3  # step, forward, backward
    for totals in series.values():
        assert totals == sorted(totals) and len(set(totals)) == len(totals)  # they only grow
    progress = [points(data, _schema.STEP_CURRENT) for data in sent]
    assert progress[0] and progress[3]  # the hang probe's windows are unchanged
    assert [p.value for p in points(sent[-1], _schema.MONITOR_CLOSED)] == [1]


# ---------------------------------------------------------------- through the bridge
def build_windows(temporality: str, buckets: str, seed: int) -> list[Any]:
    """Twelve windows of steps, phases, kernels and idle gaps, one request each."""
    rng = random.Random(seed)
    builder = WindowBuilder(
        build_resource(job_id="run-7", rank=3, world_size=8, host_name="node-1"),
        histogram_buckets=buckets,
        temporality=temporality,
        kernel_significant_bits=53,  # delta kernel sums exact too, so both compare exactly
    )
    requests = []
    step = 0
    for window in range(12):
        for _ in range(rng.randint(1, 4)):
            duration = rng.uniform(0.08, 0.12)
            phases = {"forward": duration / 3, "backward": duration / 2}
            if window % 4 == 1:  # a phase absent from most windows
                phases["checkpoint"] = rng.uniform(0.5, 0.7)
            builder.add_step(step_index=step, duration_s=duration, phases_s=phases)
            step += 1
        kernels = {("gemm", "compute"): [rng.uniform(1e-4, 3e-4) for _ in range(20)]}
        if window >= 5:  # a kernel class first seen in the sixth window
            kernels[("nccl_all_reduce", "communication")] = [rng.uniform(1e-3, 2e-3)]
        builder.add_kernels(
            KernelWindow(durations_s=kernels, idle_durations_s=[rng.uniform(1e-3, 4e-3)])
        )
        end = START + (window + 1) * SECOND
        data = builder.build(start_unix_nano=end - SECOND + 1_000_000, end_unix_nano=end)
        assert data is not None
        requests.append(encode_metrics(data))
    return requests


def stored(
    requests: list[Any], state: CumulativeState | None
) -> tuple[dict[tuple[str, int], tuple[float, float]], Counter[str]]:
    """(series key, time) → (count, sum) as the bridge stores them; rejections by reason."""
    rows = {}
    rejected: Counter[str] = Counter()
    for request in requests:
        conversion = convert_request(request, cumulative=state)
        rejected.update(conversion.rejected)
        for line in conversion.lines:
            head, _, stamp = line.rpartition(" ")
            fields = line_fields(line)
            if "count" in fields:
                key = head.partition(" ")[0]
                rows[key, int(stamp)] = (float(fields["count"]), float(fields["sum"]))
    return rows, rejected


@pytest.mark.parametrize(("buckets", "most_resets"), [("exponential", 0), ("explicit", 3)])
def test_cumulative_windows_store_what_delta_windows_store(buckets: str, most_resets: int) -> None:
    delta, refused = stored(build_windows("delta", buckets, seed=5), None)
    cumulative, rejected = stored(build_windows("cumulative", buckets, seed=5), CumulativeState())
    assert not refused
    series = {key for key, _ in delta}
    assert len(series) == 7  # step, idle, 3 phases, 2 kernel classes
    # The first point of each series is the bridge's baseline; an explicit series whose
    # values left the octaves of its bounds so far is a reset (new bounds): a baseline again.
    assert rejected["cumulative_baseline"] == len(series)
    assert rejected["cumulative_reset"] <= most_resets
    assert set(rejected) <= {"cumulative_baseline", "cumulative_reset"}
    assert len(cumulative) == len(delta) - rejected.total()
    first: dict[str, int] = {}
    for key, stamp in sorted(delta, key=lambda row: row[1]):
        first.setdefault(key, stamp)
    assert not set(first.items()) & set(cumulative)  # the windows lost are the baselines...
    for row, (count, total) in cumulative.items():  # ...every other window is stored as sent
        want_count, want_total = delta[row]
        assert count == want_count, row
        assert math.isclose(total, want_total, rel_tol=1e-9, abs_tol=1e-12), row


# ---------------------------------------------------------------- bounds and counters
def test_series_are_capped_over_the_run_not_per_window() -> None:
    builder = WindowBuilder(
        build_resource(job_id="run-7", rank=0, world_size=1, host_name="node-1"),
        max_kernel_series=2,
        temporality="cumulative",
    )
    sent = []
    for window, kernel_class in enumerate(["a", "b", "c", "d", "a"]):
        builder.add_kernels(KernelWindow(durations_s={(kernel_class, "compute"): [1e-3, 2e-3]}))
        end = START + (window + 1) * SECOND
        data = builder.build(start_unix_nano=end - SECOND, end_unix_nano=end)
        assert data is not None
        sent.append(
            [
                (p.attributes[_schema.KERNEL_CLASS], p.count)
                for p in points(data, _schema.KERNEL_DURATION)
            ]
        )
    # one class per window, never more than two series per window: a delta builder keeps all
    assert sent == [[("a", 2)], [("b", 2)], [("other", 2)], [("other", 4)], [("a", 4)]]
    assert builder.overflow_observations == 4


def test_nvml_counters_count_from_the_first_window(monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwatch.exporters.kernels import HealthSampler, XidEvent
    from tests.exporters.kernels.test_nvml_health import READINGS, RecordedNvml

    monkeypatch.setenv(VARIABLE, "cumulative")
    resource = build_resource(job_id="j", rank=3, world_size=8, host_name="node-1")
    sampler = HealthSampler(resource, backend=RecordedNvml(READINGS, [XidEvent(0, 79)]))
    sent = []
    for window in range(2):
        sampler.sample()
        end = START + (window + 1) * SECOND
        data = sampler.build(start_unix_nano=end - SECOND, end_unix_nano=end)
        assert data is not None
        sent.append(data)
    for name in (_schema.HW_ERRORS, _schema.GPU_XID_ERRORS):
        metric = next(
            m for m in sent[1].resource_metrics[0].scope_metrics[0].metrics if m.name == name
        )
        assert metric.data.aggregation_temporality == AggregationTemporality.CUMULATIVE
        assert metric.data.is_monotonic
    errors = [[p.value for p in points(data, _schema.HW_ERRORS)] for data in sent]
    assert errors == [[0, 0], [0, 3]]  # GPU 1 went from 2 to 5 uncorrected errors
    xids = [[p.value for p in points(data, _schema.GPU_XID_ERRORS)] for data in sent]
    assert xids == [[1], [1]]  # the total so far, sent again
    starts = {p.start_time_unix_nano for data in sent for p in points(data, _schema.HW_ERRORS)}
    assert starts == {START}
    delta = HealthSampler(resource, backend=RecordedNvml(READINGS, []), temporality="delta")
    delta.sample()
    data = delta.build(start_unix_nano=START, end_unix_nano=START + SECOND)
    assert data is not None
    metric = next(
        m for m in data.resource_metrics[0].scope_metrics[0].metrics if m.name == _schema.HW_ERRORS
    )
    assert metric.data.aggregation_temporality == AggregationTemporality.DELTA


def test_sampled_steps_through_the_bridge_read_the_same_either_way() -> None:
    # stepwatch.step.sampled (a counter) and stepwatch.step.sampled.duration (a weighted
    # histogram): cumulative windows, differenced by the bridge, store the delta windows.
    def windows(temporality: str) -> list[Any]:
        rng = random.Random(11)
        builder = WindowBuilder(
            build_resource(job_id="run-8", rank=1, world_size=4),
            temporality=temporality,
        )
        requests = []
        for window in range(6):
            durations = [rng.uniform(0.018, 0.022) for _ in range(40)]
            timed = [rng.uniform(0.018, 0.03) for _ in range(5)]
            builder.add_steps(
                last_step_index=40 * window + 39,
                durations_s=durations,
                phases_s={},
                weighted_phases_s={"forward": ([d / 3 for d in timed], [8] * 5)},
                sampled_steps_s=(timed, [8] * 5),
            )
            end = START + (window + 1) * SECOND
            data = builder.build(start_unix_nano=end - SECOND + 1_000_000, end_unix_nano=end)
            requests.append(encode_metrics(data))
        return requests

    def sampled_rows(requests: list[Any], state: CumulativeState | None) -> dict[Any, Any]:
        rows = {}
        for request in requests:
            for line in convert_request(request, cumulative=state).lines:
                head, _, stamp = line.rpartition(" ")
                name = head.partition(",")[0]
                fields = line_fields(line)
                if name == _schema.SAMPLED_STEPS:
                    rows[name, int(stamp)] = float(fields["counter"])
                elif name == _schema.SAMPLED_STEP_DURATION:
                    rows[name, int(stamp)] = (float(fields["count"]), float(fields["sum"]))
        return rows

    delta = sampled_rows(windows("delta"), None)
    cumulative = sampled_rows(windows("cumulative"), CumulativeState())
    assert {value for (name, _), value in delta.items() if name == _schema.SAMPLED_STEPS} == {5.0}
    assert len(delta) == 12 and len(cumulative) == 10  # each series' first: the baseline
    for row, value in cumulative.items():
        if row[0] == _schema.SAMPLED_STEPS:
            assert value == delta[row], row
        else:
            assert value[0] == delta[row][0] == 40.0, row  # 5 steps standing for 8 each
            assert math.isclose(value[1], delta[row][1], rel_tol=1e-9), row
