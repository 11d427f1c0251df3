"""``histogram_buckets="explicit"``: fixed log-spaced bounds that survive a Collector.

Issue 13 item 2: a Collector's influxdb exporter (otel2influx, telegraf-prometheus-v1) has no
case for exponential histograms and drops the whole request. With explicit buckets every
window converts by its published rules (tests/otel_bridge/otel2influx.py), nothing is
dropped, the bucket fields are the ones the bridge writes, and the bridge's quantiles stay
within 5 %.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics

from stepwatch.core import ConfigError
from stepwatch.exporters import KernelWindow, WindowBuilder, build_resource
from stepwatch.exporters._histogram import (
    EXPLICIT_GRID_SCALE,
    MAX_EXPLICIT_BOUNDS,
    ExponentialHistogram,
    explicit_layout,
    lower_boundary,
)
from stepwatch.otel_bridge import bucket_quantile, convert_request
from tests.otel_bridge.otel2influx import UnknownMetricType, telegraf_prometheus_v1

START = 1_795_000_000_000_000_000
END = START + 10_000_000_000
GRID = {lower_boundary(i, EXPLICIT_GRID_SCALE) for i in range(-200, 100)}

# one series spans at most a factor of 40 (5.3 octaves): within MAX_EXPLICIT_BOUNDS at scale 3
durations = st.lists(
    st.floats(min_value=1.0, max_value=40.0).map(lambda x: x * 1e-4), min_size=1, max_size=200
)


def window(explicit: bool, values: list[float]):  # type: ignore[no-untyped-def]
    builder = WindowBuilder(
        build_resource(job_id="run 7", rank=3, world_size=8, host_name="node-1"),
        histogram_buckets="explicit" if explicit else "exponential",
    )
    for index, value in enumerate(values):
        builder.add_step(
            step_index=index, duration_s=value, phases_s={"forward": value / 3, "backward": 0.0}
        )
    builder.add_kernels(
        KernelWindow(
            durations_s={("gemm", "compute"): values, ("nccl_all_reduce", "communication"): [1e-3]},
            idle_durations_s=[value / 10 for value in values],
        )
    )
    data = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert data is not None
    return encode_metrics(data)


def nearest_rank(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


@settings(max_examples=80, deadline=None)
@given(durations)
def test_every_observation_stays_in_its_bucket_and_bounds_are_fixed(values: list[float]) -> None:
    histogram = ExponentialHistogram(max_scale=5, max_size=160)
    for value in [*values, 0.0]:
        histogram.record(value)
    bounds, counts = explicit_layout(histogram.snapshot())
    assert len(counts) == len(bounds) + 1 and sum(counts) == len(values) + 1
    assert len(bounds) <= MAX_EXPLICIT_BOUNDS
    assert bounds == sorted(set(bounds)) and bounds[0] == 0.0
    assert set(bounds[1:]) <= GRID  # drawn from one table: the same field keys every window
    running = 0
    for bound, count in zip(bounds, counts, strict=False):
        running += count
        assert running == sum(1 for value in [*values, 0.0] if value <= bound)
    assert counts[-1] == 0  # nothing above the last bound: +Inf holds no observation


def test_a_wide_series_coarsens_to_fit_the_bound_limit() -> None:
    histogram = ExponentialHistogram(max_scale=5, max_size=160)
    values = [1e-6 * 1.05**i for i in range(400)]  # 1 µs .. 0.3 s: 18 octaves
    for value in values:
        histogram.record(value)
    bounds, counts = explicit_layout(histogram.snapshot())
    assert len(bounds) <= MAX_EXPLICIT_BOUNDS and sum(counts) == len(values)
    assert set(bounds) <= GRID
    running = 0
    for bound, count in zip(bounds, counts, strict=False):
        running += count
        assert running == sum(1 for value in values if value <= bound)
    with pytest.raises(ConfigError, match="max_bounds"):
        explicit_layout(histogram.snapshot(), max_bounds=2)
    with pytest.raises(ConfigError, match="histogram_buckets"):
        WindowBuilder(
            build_resource(job_id="j", rank=0, world_size=1, host_name="h"),
            histogram_buckets="linear",
        )


def _fields(text: str) -> dict[str, str]:
    """A line's fields; the compact layout's ``buckets`` string holds commas but no ``=``."""
    fields: dict[str, str] = {}
    key = ""
    for item in text.split(","):
        if "=" in item:
            key, value = item.split("=", 1)
            fields[key] = value
        else:
            fields[key] += "," + item
    return fields


@settings(max_examples=60, deadline=None)
@given(durations)
def test_bridge_quantiles_of_explicit_windows_stay_within_5_percent(values: list[float]) -> None:
    conversion = convert_request(window(True, values))
    assert conversion.rejected == {}
    lines = {line.rsplit(" ", 2)[0]: line for line in conversion.lines}
    for head, line in lines.items():
        if not head.startswith(("stepwatch.step.duration", "stepwatch.kernel.duration,")):
            continue
        if "nccl" in head:
            continue
        fields = _fields(line.rsplit(" ", 2)[1])
        stored = {
            "p50": float(fields["p50"]),
            "p90": float(fields["p90"]),
            # p99 is not a stored field in the compact layout: read from the buckets field
            "p99": bucket_quantile(
                fields["buckets"].strip('"'),
                0.99,
                minimum=float(fields["min"]) if "min" in fields else None,
                maximum=float(fields["max"]) if "max" in fields else None,
            ),
        }
        for name, quantile in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            want = nearest_rank(values, quantile)
            assert stored[name] == pytest.approx(want, rel=0.05), (head, name)
    # the error bound of the grid: half a bucket of ratio 2**(1/8)
    assert (2 ** (1 / 8) - 1) / 2 < 0.05


def test_a_collector_drops_exponential_windows_and_keeps_explicit_ones() -> None:
    values = [0.0123 * (1 + i / 50) for i in range(40)]
    with pytest.raises(UnknownMetricType, match="exponential_histogram"):
        telegraf_prometheus_v1(window(False, values))  # the whole request is lost
    request = window(True, values)
    collector = telegraf_prometheus_v1(request)
    bridge = convert_request(request, histogram_layout="per_bound").lines  # otel2influx's columns
    # nothing dropped: one line per data point, as the bridge writes
    points = sum(
        len(getattr(metric, str(metric.WhichOneof("data"))).data_points)
        for metric in request.resource_metrics[0].scope_metrics[0].metrics
    )
    assert len(collector) == len(bridge) == points

    def parse(line: str) -> tuple[str, dict[str, str], dict[str, str]]:
        series, field_text, _ = line.rsplit(" ", 2)
        measurement, *tag_items = series.replace("\\ ", "\x00").split(",")
        tags = dict(item.replace("\x00", " ").split("=", 1) for item in tag_items)
        return measurement, tags, _fields(field_text)

    by_series = {}
    for line in bridge:
        measurement, tags, fields = parse(line)
        by_series[
            (measurement, tags.get("stepwatch.phase"), tags.get("stepwatch.kernel.class"))
        ] = (
            tags,
            fields,
        )
    for line in collector:
        measurement, tags, fields = parse(line)
        ours_tags, ours = by_series[
            (measurement, tags.get("stepwatch.phase"), tags.get("stepwatch.kernel.class"))
        ]
        # every attribute a tag (the bridge's allowlist keeps these), plus the scope's name
        assert {**ours_tags, "otel.library.name": "stepwatch"} == tags
        assert line.endswith(f" {END}")
        if "count" not in fields:
            # gauges: same value; the Collector keeps an integer an integer (41i, not 41.0)
            assert {k: float(v.rstrip("i")) for k, v in fields.items()} == {
                k: float(v.rstrip("i")) for k, v in ours.items() if k in fields
            }
            continue
        bucket_keys = {key for key in fields if key[0].isdigit()}
        assert bucket_keys and bucket_keys == {key for key in ours if key[0].isdigit()}
        for key in bucket_keys | {"count", "sum", "start_time_unix_nano"}:
            assert fields[key] == ours[key], (measurement, key)
        assert "+Inf" not in fields and ours["+Inf"] == fields["count"]
        for key in ("min", "max"):
            assert (key in fields) == (key in ours and measurement != "stepwatch.kernel.duration")


def _monitor_histogram_kinds(caplog: pytest.LogCaptureFixture, **options: object) -> set[str]:
    """The histogram kinds in the first window a StepMonitor with ``options`` exports."""
    from stepwatch.exporters import InMemoryExporter, StepMonitor

    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, exporter=exporter, start=False, health=False, **options
    )  # type: ignore[arg-type]
    with monitor.step():
        pass
    assert monitor.export_now()
    monitor.close()
    metrics = exporter.exported[0].resource_metrics[0].scope_metrics[0].metrics
    return {type(metric.data).__name__ for metric in metrics if metric.name.endswith("duration")}


def test_step_monitor_takes_the_layout_from_its_argument_then_the_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("STEPWATCH_HISTOGRAM_BUCKETS", raising=False)
    assert _monitor_histogram_kinds(caplog) == {"ExponentialHistogram"}
    monkeypatch.setenv("STEPWATCH_HISTOGRAM_BUCKETS", "explicit")
    assert _monitor_histogram_kinds(caplog) == {"Histogram"}
    assert _monitor_histogram_kinds(caplog, histogram_buckets="exponential") == {
        "ExponentialHistogram"
    }
    # a typo in the environment warns (naming the variable) and keeps the default
    monkeypatch.setenv("STEPWATCH_HISTOGRAM_BUCKETS", "explict")
    with caplog.at_level("WARNING", logger="stepwatch.exporters"):
        assert _monitor_histogram_kinds(caplog) == {"ExponentialHistogram"}
    assert any("STEPWATCH_HISTOGRAM_BUCKETS" in r.getMessage() for r in caplog.records)
    # a bad argument raises at construction
    with pytest.raises(ConfigError, match="histogram_buckets"):
        _monitor_histogram_kinds(caplog, histogram_buckets="linear")
