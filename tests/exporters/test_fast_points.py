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


# ---- the C point writer (_fasthist.exponential_point) against the Python one -------------

_ints = st.one_of(
    st.integers(0, 2**64 - 1),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(0, 1e20),
)


@settings(max_examples=400, deadline=None)
@given(
    start=_ints,
    end=_ints,
    count=_ints,
    total=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-(2**80), 2**80)),
    scale=st.one_of(st.integers(-(2**33), 2**33), st.integers(-20, 20), st.booleans()),
    zero=_ints,
    offset=st.one_of(st.integers(-(2**33), 2**33), st.integers(-500, 500)),
    counts=st.one_of(
        st.lists(st.integers(0, 127), max_size=30),
        st.lists(st.integers(-5, 2**65), max_size=30),
        st.lists(st.integers(0, 3), max_size=3).map(tuple),
    ),
    negative=st.lists(st.integers(0, 300), max_size=4),
    flags=st.one_of(st.integers(0, 2**33), st.just(0)),
    low=st.one_of(st.none(), st.floats(allow_nan=False), st.integers(0, 10)),
    high=st.one_of(st.none(), st.floats(allow_nan=False)),
    exemplars=st.booleans(),
)
def test_the_c_point_writer_writes_the_python_bytes_or_steps_aside(
    start: Any,
    end: Any,
    count: Any,
    total: Any,
    scale: Any,
    zero: Any,
    offset: int,
    counts: Any,
    negative: list[int],
    flags: int,
    low: Any,
    high: Any,
    exemplars: bool,
) -> None:
    from stepwatch.exporters import _histogram, _otlp_protobuf

    fast = _histogram._fasthist
    if fast is None:
        return  # the C extension is not built here: nothing to compare
    point = _running.fast_constructor(ExponentialHistogramDataPoint)(
        attributes={"stepwatch.kernel.class": "gemm"},
        start_time_unix_nano=start,
        time_unix_nano=end,
        count=count,
        sum=total,
        scale=scale,
        zero_count=zero,
        positive=Buckets(offset=offset, bucket_counts=counts),
        negative=Buckets(offset=-offset, bucket_counts=negative),
        flags=flags,
        min=low,
        max=high,
    )
    if exemplars:
        object.__setattr__(point, "exemplars", [object()])
    cache = _otlp_protobuf._AttributeCache()
    encoded_attributes = cache(b"\x0a", point.attributes)
    written = fast.exponential_point(point, encoded_attributes)
    try:
        python = _otlp_protobuf._length_delimited(
            b"\x0a", _otlp_protobuf._exponential_point(point, cache)
        )
    except Exception:  # the Python refuses it (or fails): the C must have stepped aside
        assert written is None
        return
    if written is not None:
        assert written == python
    plain = (
        all(type(v) is int and 0 <= v < 2**64 for v in (start, end, count, zero))
        and (total is None or type(total) is float)
        and type(scale) is int
        and -(2**31) <= scale < 2**31
        and -(2**31) <= offset < 2**31
        and type(counts) in (list, tuple)
        and all(0 <= c < 2**63 for c in counts)
        and flags < 2**32
        and all(v is None or type(v) is float for v in (low, high))
        and not exemplars
    )
    if plain:  # what stepwatch's own windows hold: always the C's
        assert written == python
