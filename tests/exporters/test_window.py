"""WindowBuilder and build_resource: the OTLP shape of one window, as docs/schema.md says."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ExponentialHistogram,
    Gauge,
    MetricsData,
)

from stepwatch.core import ConfigError, _schema
from stepwatch.exporters import KernelWindow, WindowBuilder, build_resource
from stepwatch.exporters._window import SCOPE_NAME
from stepwatch.otel_bridge._buckets import exponential_buckets, nearest_rank_quantile

GOLDEN = Path(__file__).with_name("test_window_golden.json")
START = 1_795_000_000_000_000_000
END = START + 31_000_000


def _resource() -> Any:
    return build_resource(
        job_id="run-42",
        rank=3,
        world_size=8,
        host_name="node-1",
        local_rank=1,
        dp_rank=3,
        tp_rank=0,
        pp_rank=0,
    )


def _window() -> MetricsData:
    builder = WindowBuilder(_resource())
    for index, duration in ((10, 0.010), (11, 0.0105), (12, 0.0105)):
        builder.add_step(
            step_index=index,
            duration_s=duration,
            phases_s={"data": 0.001, "forward": 0.003, "backward": 0.005, "optimizer": 0.001},
        )
    builder.add_kernels(
        KernelWindow(
            durations_s={
                ("gemm", "compute"): [0.0002, 0.00021, 0.00019],
                ("allreduce", "communication"): [0.001],
            },
            idle_durations_s=[0.0004, 0.0005, 0.0],
        )
    )
    metrics = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert metrics is not None
    return metrics


def _wire_json(metrics: MetricsData) -> dict[str, Any]:
    return MessageToDict(encode_metrics(metrics))


def test_window_matches_golden_otlp_json() -> None:
    payload = _wire_json(_window())
    if os.environ.get("STEPWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    assert payload == json.loads(GOLDEN.read_text())


def test_names_units_temporality_and_attributes_follow_the_schema() -> None:
    metrics = _window()
    (resource_metrics,) = metrics.resource_metrics
    assert dict(resource_metrics.resource.attributes) == {
        _schema.JOB_ID: "run-42",
        _schema.RANK: 3,
        _schema.WORLD_SIZE: 8,
        _schema.HOST_NAME: "node-1",
        _schema.LOCAL_RANK: 1,
        _schema.DP_RANK: 3,
        _schema.TP_RANK: 0,
        _schema.PP_RANK: 0,
        _schema.SERVICE_NAME: "stepwatch",
    }
    (scope_metrics,) = resource_metrics.scope_metrics
    by_name = {metric.name: metric for metric in scope_metrics.metrics}
    assert set(by_name) == {
        _schema.STEP_DURATION,
        _schema.STEP_LAST,
        _schema.PHASE_DURATION,
        _schema.KERNEL_DURATION,
        _schema.DEVICE_IDLE_DURATION,
    }
    for name in (
        _schema.STEP_DURATION,
        _schema.PHASE_DURATION,
        _schema.KERNEL_DURATION,
        _schema.DEVICE_IDLE_DURATION,
    ):
        metric = by_name[name]
        assert metric.unit == "s"
        assert isinstance(metric.data, ExponentialHistogram)
        assert metric.data.aggregation_temporality is AggregationTemporality.DELTA
        for point in metric.data.data_points:
            assert (point.start_time_unix_nano, point.time_unix_nano) == (START, END)
    last = by_name[_schema.STEP_LAST]
    assert last.unit == "{step}"
    assert isinstance(last.data, Gauge)
    (point,) = last.data.data_points
    assert point.value == 12
    assert (point.start_time_unix_nano, point.time_unix_nano) == (START, END)

    step_data = by_name[_schema.STEP_DURATION].data
    assert isinstance(step_data, ExponentialHistogram)
    (step_point,) = step_data.data_points
    assert step_point.count == 3
    assert step_point.attributes == {}
    assert (step_point.min, step_point.max) == (0.010, 0.0105)

    phase_data = by_name[_schema.PHASE_DURATION].data
    assert isinstance(phase_data, ExponentialHistogram)
    assert sorted(p.attributes[_schema.PHASE] for p in phase_data.data_points) == [
        "backward",
        "data",
        "forward",
        "optimizer",
    ]
    assert all(p.count == 3 for p in phase_data.data_points)

    kernel_data = by_name[_schema.KERNEL_DURATION].data
    assert isinstance(kernel_data, ExponentialHistogram)
    assert {
        (p.attributes[_schema.KERNEL_CLASS], p.attributes[_schema.KERNEL_CATEGORY]): p.count
        for p in kernel_data.data_points
    } == {("gemm", "compute"): 3, ("allreduce", "communication"): 1}
    idle = by_name[_schema.DEVICE_IDLE_DURATION].data
    assert isinstance(idle, ExponentialHistogram)
    assert idle.data_points[0].count == 3
    assert idle.data_points[0].zero_count == 1


def test_build_resets_and_returns_none_when_empty() -> None:
    builder = WindowBuilder(_resource())
    assert builder.build(start_unix_nano=START, end_unix_nano=END) is None
    builder.add_step(step_index=0, duration_s=0.01, phases_s={})
    assert builder.build(start_unix_nano=START, end_unix_nano=END) is not None
    assert builder.empty
    assert builder.build(start_unix_nano=START, end_unix_nano=END) is None


def test_kernel_only_window_has_no_step_metrics() -> None:
    builder = WindowBuilder(_resource())
    builder.add_kernels(KernelWindow(durations_s={("gemm", "compute"): [0.001]}))
    metrics = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert metrics is not None
    names = [m.name for m in metrics.resource_metrics[0].scope_metrics[0].metrics]
    assert names == [_schema.KERNEL_DURATION]


def test_series_caps_fold_into_other_and_count_the_overflow() -> None:
    builder = WindowBuilder(_resource(), max_phase_series=2, max_kernel_series=2)
    builder.add_step(step_index=0, duration_s=0.01, phases_s={"a": 0.001, "b": 0.001, "c": 0.002})
    builder.add_kernels(
        KernelWindow(
            durations_s={
                ("k1", "compute"): [0.001],
                ("k2", "compute"): [0.001],
                ("k3", "memory"): [0.001, 0.002],
            }
        )
    )
    assert builder.overflow_observations == 3
    metrics = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert metrics is not None
    by_name = {m.name: m for m in metrics.resource_metrics[0].scope_metrics[0].metrics}
    phase_data = by_name[_schema.PHASE_DURATION].data
    assert isinstance(phase_data, ExponentialHistogram)
    assert {p.attributes[_schema.PHASE] for p in phase_data.data_points} == {"a", "b", "other"}
    kernel_data = by_name[_schema.KERNEL_DURATION].data
    assert isinstance(kernel_data, ExponentialHistogram)
    folded = [p for p in kernel_data.data_points if p.attributes[_schema.KERNEL_CLASS] == "other"]
    assert folded[0].count == 2
    assert folded[0].attributes[_schema.KERNEL_CATEGORY] == "other"


def test_bad_durations_are_rejected_and_counted() -> None:
    builder = WindowBuilder(_resource())
    builder.add_step(step_index=0, duration_s=-1.0, phases_s={"forward": float("nan")})
    assert builder.rejected_observations == 2


def test_build_resource_defaults() -> None:
    resource = build_resource(job_id="j", rank=0, world_size=1)
    assert dict(resource.attributes) == {
        _schema.JOB_ID: "j",
        _schema.RANK: 0,
        _schema.WORLD_SIZE: 1,
        _schema.HOST_NAME: socket.gethostname(),
        _schema.SERVICE_NAME: "stepwatch",
    }


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"job_id": ""}, "job_id"),
        ({"rank": -1}, "rank"),
        ({"rank": 4}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"local_rank": -2}, "local_rank"),
        ({"pp_rank": True}, "pp_rank"),
        ({"host_name": ""}, "host_name"),
        ({"service_name": ""}, "service_name"),
    ],
)
def test_build_resource_names_the_bad_argument(options: dict[str, Any], name: str) -> None:
    arguments: dict[str, Any] = {"job_id": "j", "rank": 0, "world_size": 4} | options
    with pytest.raises(ConfigError, match=name):
        build_resource(**arguments)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"max_scale": 30}, "max_scale"),
        ({"max_size": 0}, "max_size"),
        ({"max_phase_series": 0}, "max_phase_series"),
        ({"max_kernel_series": 0}, "max_kernel_series"),
        ({"kernel_significant_bits": 0}, "kernel_significant_bits"),
        ({"kernel_significant_bits": 54}, "kernel_significant_bits"),
        ({"kernel_significant_bits": True}, "kernel_significant_bits"),
        ({"kernel_min_max": 1}, "kernel_min_max"),
    ],
)
def test_window_builder_options_are_checked(options: dict[str, int], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        WindowBuilder(_resource(), **options)


def _kernel_points(metrics: MetricsData) -> list[Any]:
    by_name = {m.name: m for m in metrics.resource_metrics[0].scope_metrics[0].metrics}
    data = by_name[_schema.KERNEL_DURATION].data
    assert isinstance(data, ExponentialHistogram)
    return list(data.data_points)


def test_wire_order_scope_and_kernel_point_order() -> None:
    metrics = _window()
    (scope_metrics,) = metrics.resource_metrics[0].scope_metrics
    assert (scope_metrics.scope.name, scope_metrics.scope.version) == (SCOPE_NAME, None)
    assert [m.name for m in scope_metrics.metrics] == [
        _schema.STEP_DURATION,
        _schema.STEP_LAST,
        _schema.DEVICE_IDLE_DURATION,
        _schema.PHASE_DURATION,
        _schema.KERNEL_DURATION,
    ]
    builder = WindowBuilder(_resource())
    builder.add_kernels(
        KernelWindow(
            durations_s={
                ("b", "compute"): [0.003],
                ("a", "memory"): [0.001, 0.001],
                ("c", "compute"): [0.002],
                ("a", "compute"): [0.002],
            }
        )
    )
    built = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert built is not None
    order = [
        (p.attributes[_schema.KERNEL_CLASS], p.attributes[_schema.KERNEL_CATEGORY])
        for p in _kernel_points(built)
    ]
    # By total time, ties by class then category: deterministic, whatever the input order.
    assert order == [("a", "compute"), ("a", "memory"), ("c", "compute"), ("b", "compute")]


@pytest.mark.parametrize("bits", [12, 53])
def test_kernel_sum_min_max_are_rounded_outwards_and_the_rest_is_exact(bits: int) -> None:
    values = [0.00019, 0.00021, 0.0002]
    exact = bits == 53
    builder = WindowBuilder(_resource(), kernel_significant_bits=bits, kernel_min_max=True)
    builder.add_step(step_index=0, duration_s=0.0123456789, phases_s={"data": 0.00123456789})
    builder.add_kernels(
        KernelWindow(durations_s={("gemm", "compute"): values, ("one", "compute"): [0.0123456789]})
    )
    built = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert built is not None
    gemm, one = sorted(_kernel_points(built), key=lambda p: p.count, reverse=True)
    assert gemm.min <= min(values) and gemm.max >= max(values)
    assert gemm.sum == pytest.approx(sum(values), rel=2**-12, abs=0)
    assert (gemm.min, gemm.max, gemm.sum) == (
        (min(values), max(values), sum(values))
        if exact
        else (0.00018996000289916992, 0.00021004676818847656, 0.0006000995635986328)
    )
    # One observation: sent exactly, so it reads back exactly.
    assert one.min == one.max == one.sum == 0.0123456789
    for metric in built.resource_metrics[0].scope_metrics[0].metrics:
        if metric.name != _schema.KERNEL_DURATION and isinstance(metric.data, ExponentialHistogram):
            (point,) = metric.data.data_points
            assert point.sum in (0.0123456789, 0.00123456789)


def test_kernel_histograms_carry_no_min_max_by_default_and_the_others_do() -> None:
    builder = WindowBuilder(_resource())
    builder.add_step(step_index=0, duration_s=0.02, phases_s={"data": 0.001})
    builder.add_kernels(
        KernelWindow(
            durations_s={("gemm", "compute"): [0.0002, 0.0003]},
            idle_durations_s=[0.001],
        )
    )
    built = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert built is not None
    request = encode_metrics(built)
    seen = set()
    for metric in request.resource_metrics[0].scope_metrics[0].metrics:
        if not metric.HasField("exponential_histogram"):
            continue
        seen.add(metric.name)
        for point in metric.exponential_histogram.data_points:
            carried = point.HasField("min") and point.HasField("max")
            assert carried == (metric.name != _schema.KERNEL_DURATION), metric.name
    assert seen == {
        _schema.STEP_DURATION,
        _schema.PHASE_DURATION,
        _schema.KERNEL_DURATION,
        _schema.DEVICE_IDLE_DURATION,
    }


def _bucket_half_width(scale: int) -> float:
    """Worst relative error of a bucket midpoint: (base - 1) / 2, base = 2 ** 2 ** -scale."""
    return (2.0 ** (2.0**-scale) - 1.0) / 2.0


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(
        st.integers(1, 5_000_000).map(lambda ns: round(ns * 2**30 / 1e9) / 2**30),
        min_size=1,
        max_size=60,
    ),
    bits=st.sampled_from([8, 12, 53]),
    min_max=st.booleans(),
)
def test_every_quantile_the_bridge_estimates_is_within_the_bucket_bound(
    values: list[float], bits: int, min_max: bool
) -> None:
    """Rounded min/max still contain every value, so clamping never adds error (and without
    them the buckets alone bound it): each nearest-rank quantile the bridge computes is within
    the bucket half-width (2.2 % at the ingest scale 4) of the exact one."""
    builder = WindowBuilder(
        _resource(),
        max_scale=4,
        max_size=320,
        kernel_significant_bits=bits,
        kernel_min_max=min_max,
    )
    builder.add_kernels(KernelWindow(durations_s={("k", "compute"): values}))
    built = builder.build(start_unix_nano=START, end_unix_nano=END)
    assert built is not None
    (point,) = _kernel_points(built)
    buckets = exponential_buckets(
        point.scale,
        positive_offset=point.positive.offset,
        positive_counts=list(point.positive.bucket_counts),
        zero_count=point.zero_count,
    )
    ordered = sorted(values)
    bound = _bucket_half_width(point.scale) * (1 + 1e-9)
    for rank in range(1, len(ordered) + 1):
        quantile = (rank - 0.5) / len(ordered)  # nearest rank: ceil(q * n) == rank
        exact = ordered[rank - 1]
        got = nearest_rank_quantile(buckets, quantile, minimum=point.min, maximum=point.max)
        assert got is not None
        assert abs(got - exact) <= bound * exact, (rank, got, exact)
    if min_max and len(set(values)) == 1:
        assert (
            nearest_rank_quantile(buckets, 0.5, minimum=point.min, maximum=point.max) == (values[0])
        )


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.one_of(st.floats(0.0, 10.0), st.just(float("nan"))),
            st.dictionaries(
                st.sampled_from(["data", "forward", "backward", "p3", "p4", "p5"]),
                st.one_of(st.floats(0.0, 5.0), st.just(-1.0), st.just(float("inf"))),
                max_size=6,
            ),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_add_steps_builds_the_window_add_step_builds(
    steps: list[tuple[float, dict[str, float]]],
) -> None:
    """The export thread's batch path: same histograms, caps, overflow and refusals."""
    one_by_one = WindowBuilder(_resource(), max_phase_series=3)
    batched = WindowBuilder(_resource(), max_phase_series=3)
    phases: dict[str, list[float]] = {}
    for index, (duration, step_phases) in enumerate(steps):
        one_by_one.add_step(step_index=index, duration_s=duration, phases_s=step_phases)
        for name, seconds in step_phases.items():
            phases.setdefault(name, []).append(seconds)
    batched.add_steps(
        last_step_index=len(steps) - 1, durations_s=[d for d, _ in steps], phases_s=phases
    )
    assert batched.overflow_observations == one_by_one.overflow_observations
    assert batched.rejected_observations == one_by_one.rejected_observations
    expected = one_by_one.build(start_unix_nano=1, end_unix_nano=2)
    got = batched.build(start_unix_nano=1, end_unix_nano=2)
    assert expected is not None and got is not None
    # Phases folded into "other" are summed in another order: the last bit of its sum may differ.
    assert _rounded_sums(MessageToDict(encode_metrics(got))) == _rounded_sums(
        MessageToDict(encode_metrics(expected))
    )


def _rounded_sums(document: Any) -> Any:
    if isinstance(document, dict):
        return {
            key: round(value, 9) if key == "sum" else _rounded_sums(value)
            for key, value in document.items()
        }
    if isinstance(document, list):
        return [_rounded_sums(item) for item in document]
    return document
