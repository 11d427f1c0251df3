"""The window's OTLP data points built without the SDK dataclasses' ``__init__``
(``_running.fast_constructor``) are the SDK's objects, equal to ones built normally."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import Buckets, ExponentialHistogramDataPoint

from stepwatch.exporters import KernelWindow, _running
from stepwatch.exporters._window import WindowBuilder, build_resource


@settings(max_examples=50, deadline=None)
@given(
    count=st.integers(0, 10**9),
    total=st.floats(0.0, 1e6),
    scale=st.integers(-10, 20),
    offset=st.integers(-(2**20), 2**20),
    counts=st.lists(st.integers(0, 10**6), max_size=40),
    with_min_max=st.booleans(),
)
def test_a_fast_point_is_the_sdk_point(
    count: int, total: float, scale: int, offset: int, counts: list[int], with_min_max: bool
) -> None:
    fields: dict[str, Any] = {
        "attributes": {"stepwatch.kernel.class": "gemm"},
        "start_time_unix_nano": 1,
        "time_unix_nano": 2,
        "count": count,
        "sum": total,
        "scale": scale,
        "zero_count": 0,
        "positive": Buckets(offset=offset, bucket_counts=counts),
        "negative": Buckets(offset=0, bucket_counts=[]),
        "flags": 0,
        "min": 0.5 if with_min_max else None,
        "max": 2.0 if with_min_max else None,
    }
    fast = _running.fast_constructor(ExponentialHistogramDataPoint)(**fields)
    normal = ExponentialHistogramDataPoint(**fields)
    assert type(fast) is ExponentialHistogramDataPoint
    assert fast == normal
    assert fast.exemplars == [] and fast.exemplars is not normal.exemplars  # a new list each
    buckets = _running.fast_constructor(Buckets)(offset=offset, bucket_counts=counts)
    assert buckets == Buckets(offset=offset, bucket_counts=counts)


def test_a_class_that_needs_its_init_keeps_it() -> None:
    @dataclasses.dataclass(frozen=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            assert self.value >= 0

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        value: int

    assert _running.fast_constructor(Checked) is Checked
    assert _running.fast_constructor(Slotted) is Slotted
    assert _running.fast_constructor(int) is int


def test_a_window_encodes_the_same_either_way(monkeypatch: Any) -> None:
    def window() -> bytes:
        builder = WindowBuilder(build_resource(job_id="j", rank=0, world_size=2))
        builder.add_steps(
            last_step_index=9, durations_s=[0.01 * (1 + i % 3) for i in range(10)], phases_s={}
        )
        builder.add_kernels(
            KernelWindow({("gemm", "compute"): [1e-5, 3e-5, 2e-4], ("copy", "memory"): [4e-6]})
        )
        built = builder.build(start_unix_nano=10, end_unix_nano=20)
        assert built is not None
        return bytes(encode_metrics(built).SerializeToString())

    fast = window()
    monkeypatch.setattr(_running, "fast_constructor", lambda cls: cls)
    assert window() == fast
