"""The C fast path (``_fastpath``) against the Python converter: same lines, same outcomes.

Every case runs both: the fast path either declines (None: the Python path runs, unchanged)
or gives the Python path's lines byte for byte, in order, with the same dropped attributes,
rejections and duplicate-rank checks. Windows of the exporters' WindowBuilder must be handled
(that is the point of the fast path); real opentelemetry-sdk output, hypothesis variations and
malformed bodies must be identical or declined.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2

from stepwatch.core import _schema
from stepwatch.otel_bridge import _fast
from stepwatch.otel_bridge._convert import MAX_DURATION_S, TAG_ALLOWLIST, convert_to_points
from stepwatch.otel_bridge._decode import RequestError, parse_protobuf
from stepwatch.otel_bridge._identity import IDENTITY_KEYS
from tests.c_extensions import needs

pytestmark = needs(_fast.AVAILABLE, "the bridge's C fast path")
NOW_NS = time.time_ns()


class Recorder:
    """A resource_check that records its calls and refuses the ranks in ``refuse``."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.calls: list[dict[str, str]] = []
        self.refuse = refuse

    def __call__(self, attributes: Mapping[str, str]) -> str | None:
        self.calls.append(dict(attributes))
        return "duplicate_rank" if attributes.get(_schema.RANK) in self.refuse else None


def compare(
    body: bytes,
    *,
    tag_allowlist: frozenset[str] = TAG_ALLOWLIST,
    max_duration_s: float | None = MAX_DURATION_S,
    bounds: tuple[int, int] | None = None,
    refuse: frozenset[str] | None = None,
) -> bool:
    """Both paths on ``body``; True when the fast path handled it (and agreed)."""
    fast_check = None if refuse is None else Recorder(refuse)
    fast = _fast.convert(
        body,
        tag_allowlist=tag_allowlist,
        max_duration_s=max_duration_s,
        time_bounds_unix_nano=bounds,
        resource_check=fast_check,
    )
    if fast is None:
        assert fast_check is None or fast_check.calls == []  # declined before any check
        return False
    request = parse_protobuf(body)  # the fast path handled it: it must parse
    python_check = None if refuse is None else Recorder(refuse)
    batch = convert_to_points(
        request,
        tag_allowlist=tag_allowlist,
        max_duration_s=max_duration_s,
        time_bounds_unix_nano=bounds,
        resource_check=python_check,
    )
    assert fast.lines == [point.encode() for point in batch.points]
    assert fast.dropped_attributes == batch.dropped_attributes
    assert Counter(fast.rejected) == batch.rejected
    assert batch.pending == []
    if python_check is not None and fast_check is not None:
        assert fast_check.calls == python_check.calls
    # the cardinality guard's keys and budgets, as CardinalityGuard.filter computes them
    keys = memoryview(fast.hashes).cast("q").tolist()
    assert keys == [hash(point.series) for point in batch.points]
    which = memoryview(fast.descs_index).cast("i").tolist()
    assert [fast.descs[index] for index in which] == [
        (
            point.tags.get(_schema.JOB_ID, ""),
            point.measurement,
            point.tags.get(_schema.RANK, ""),
        )
        for point in batch.points
    ]
    return True


def test_extension_is_built() -> None:
    """Where the extension is built (CI: ``STEPWATCH_REQUIRE_C=1``), the fast path really runs in
    the tests."""
    assert _fast.AVAILABLE, _fast.IMPORT_ERROR
    from stepwatch.otel_bridge import _fastpath

    constants = _fastpath.CONSTANTS
    assert constants["JOB_ID"] == _schema.JOB_ID
    assert constants["RANK"] == _schema.RANK
    assert constants["WORLD_SIZE"] == _schema.WORLD_SIZE
    assert constants["STEP_DURATION"] == _schema.STEP_DURATION
    assert constants["IDENTITY_KEYS"] == IDENTITY_KEYS


def window_body(rng: random.Random, *, rank: int, ranks: int, kernels: int) -> bytes:
    from bench.storage_bytes import window

    start = NOW_NS - 30 * 10**9
    request, _ = window(
        rng, rank=rank, ranks=ranks, kernels=kernels, start_ns=start, end_ns=start + 10**10
    )
    return bytes(request.SerializeToString())


@pytest.mark.parametrize("kernels", [0, 3, 20])
def test_exporter_windows_are_handled_and_identical(kernels: int) -> None:
    rng = random.Random(kernels)
    for rank in range(6):
        body = window_body(rng, rank=rank, ranks=8, kernels=kernels)
        assert compare(body)
        assert compare(body, bounds=(NOW_NS - 10**12, NOW_NS + 10**11), refuse=frozenset())
        # the duplicate-rank guard refuses a resource: its stepwatch.* points are rejected
        assert compare(body, refuse=frozenset({str(rank)}))
        assert compare(body, tag_allowlist=frozenset({"host.name", _schema.RANK}))
        assert compare(body, max_duration_s=None)
    # the Python path would reject these points: the fast path leaves them to it
    body = window_body(rng, rank=1, ranks=8, kernels=kernels)
    assert not compare(body, bounds=(NOW_NS, NOW_NS + 1))
    assert not compare(body, max_duration_s=1e-6)


def test_batched_windows_of_many_ranks() -> None:
    """Several resources in one request (a collector batching ranks)."""
    rng = random.Random(7)
    merged = ExportMetricsServiceRequest()
    for rank in range(5):
        merged.MergeFromString(window_body(rng, rank=rank, ranks=5, kernels=4))
    body = merged.SerializeToString()
    assert compare(body, refuse=frozenset({"1", "3"}))
    assert compare(body, refuse=frozenset())


def sdk_body(temporality: str, exponential: bool) -> bytes:
    """Real opentelemetry-sdk output, encoded by its OTLP encoder."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (
        encode_metrics,
    )
    from opentelemetry.sdk.metrics import (
        Counter as SdkCounter,
    )
    from opentelemetry.sdk.metrics import (
        Histogram,
        MeterProvider,
        UpDownCounter,
    )
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import Resource

    chosen = AggregationTemporality[temporality]
    reader = InMemoryMetricReader(
        preferred_temporality={SdkCounter: chosen, Histogram: chosen, UpDownCounter: chosen}
    )
    views = [View(instrument_type=Histogram, aggregation=ExponentialBucketHistogramAggregation())]
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create(
            {_schema.JOB_ID: "sdk", _schema.RANK: 2, _schema.WORLD_SIZE: 4, "host.name": "h"}
        ),
        views=views if exponential else [],
    )
    meter = provider.get_meter("test", "1.0")
    histogram = meter.create_histogram(_schema.STEP_DURATION, unit="s")
    phases = meter.create_histogram(_schema.PHASE_DURATION, unit="s")
    counter = meter.create_counter("app.requests")
    updown = meter.create_up_down_counter("app.queue")
    meter.create_observable_gauge(
        "app.temperature",
        callbacks=[lambda _options: [_observation(41.5, {"device": "0"})]],
    )
    rng = random.Random(3)
    for _ in range(50):
        histogram.record(0.3 * rng.lognormvariate(0, 0.2))
        phases.record(0.1 * rng.random() + 0.001, {"stepwatch.phase": "forward"})
        counter.add(3, {"route": "a b,c=d"})
        updown.add(rng.choice((-1, 1)))
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return bytes(encode_metrics(data).SerializeToString())


def _observation(value: float, attributes: dict[str, str]) -> Any:
    from opentelemetry.metrics import Observation

    return Observation(value, attributes)


@pytest.mark.parametrize("exponential", [True, False])
@pytest.mark.parametrize("temporality", ["DELTA", "CUMULATIVE"])
def test_opentelemetry_sdk_output(temporality: str, exponential: bool) -> None:
    body = sdk_body(temporality, exponential)
    handled = compare(body, refuse=frozenset())
    # delta exponential histograms, sums and gauges are the fast path's; explicit-bounds
    # histograms and cumulative state are the Python path's
    assert handled == (temporality == "DELTA" and exponential)


# ---- hypothesis: variations around a valid request ----------------------------------------

_scalars = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "a\\", "x y", "a,b", "k=v", "new\nline", "é", "日本", "0", "-3"]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
)
_keys = st.one_of(
    st.sampled_from(sorted(TAG_ALLOWLIST)),
    st.sampled_from([*IDENTITY_KEYS, "other", "", "k\\", "a b"]),
    st.text(max_size=4),
)


def _any_value(value: object) -> AnyValue:
    if value is None:
        return AnyValue()
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value={"values": [_any_value(item) for item in value]})
    return AnyValue(string_value=str(value))


def _attrs(pairs: list[tuple[str, object]]) -> list[KeyValue]:
    return [KeyValue(key=key, value=_any_value(value)) for key, value in pairs]


_pairs = st.lists(st.tuples(_keys, st.one_of(_scalars, st.just([1, "x"]))), max_size=4)
_times = st.one_of(
    st.just(NOW_NS),
    st.integers(min_value=0, max_value=2**64 - 1),
    st.sampled_from([0, 1, 2**63 - 2, 2**63 - 1, 2**64 - 1, NOW_NS + 10**12]),
)
_doubles = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=10, allow_nan=False),
)


@st.composite
def requests(draw: st.DrawFn) -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        resource = request.resource_metrics.add()
        base: list[tuple[str, object]] = [
            (_schema.JOB_ID, draw(st.sampled_from(["j", "", "a b", 7, None]))),
            (_schema.RANK, draw(st.sampled_from([0, 3, -1, "5", "x", "07", None]))),
        ]
        if draw(st.booleans()):
            base.append((_schema.WORLD_SIZE, draw(st.sampled_from([4, 2, "8", 1.5]))))
        extra = draw(_pairs)
        resource.resource.attributes.extend(_attrs(base + extra))
        scope = resource.scope_metrics.add()
        scope.scope.name = draw(st.sampled_from(["", "s"]))
        for _ in range(draw(st.integers(0, 3))):
            _add_metric(draw, scope.metrics.add())
    return request


def _add_metric(draw: st.DrawFn, metric: metrics_pb2.Metric) -> None:
    metric.name = draw(
        st.one_of(
            st.sampled_from(
                [
                    _schema.STEP_DURATION,
                    _schema.PHASE_DURATION,
                    _schema.KERNEL_DURATION,
                    _schema.STEP_LAST,
                    "x.duration",
                    "app.m",
                    "a b,c",
                    "",
                    "bad\\",
                    "stepwatch.é",
                ]
            ),
            st.text(max_size=5),
        )
    )
    metric.unit = draw(st.sampled_from(["", "s", "ms"]))
    kind = draw(st.sampled_from(["gauge", "sum", "exponential_histogram", "histogram"]))
    for _ in range(draw(st.integers(0, 3))):
        if kind == "exponential_histogram":
            metric.exponential_histogram.aggregation_temporality = draw(st.sampled_from([0, 1, 2]))
            point = metric.exponential_histogram.data_points.add()
            counts = draw(
                st.lists(
                    st.one_of(st.integers(0, 5), st.sampled_from([0, 0, 0, 2**63, 2**64 - 1])),
                    max_size=40,
                )
            )
            point.positive.bucket_counts.extend(counts)
            point.positive.offset = draw(
                st.one_of(st.integers(-300, 300), st.sampled_from([-(2**31), 2**31 - 1]))
            )
            point.scale = draw(st.one_of(st.integers(-3, 8), st.sampled_from([-11, 20, 21])))
            wrong = draw(st.sampled_from([0, 0, 0, 1, -1]))
            point.count = max(0, min(2**64 - 1, sum(counts) + wrong))
            if draw(st.booleans()):
                point.sum = draw(_doubles)
            if draw(st.booleans()):
                point.min = draw(_doubles)
            if draw(st.booleans()):
                point.max = draw(_doubles)
            if draw(st.integers(0, 5)) == 0:
                point.zero_count = 1
            if draw(st.integers(0, 5)) == 0:
                point.negative.bucket_counts.extend(draw(st.lists(st.integers(0, 2), max_size=2)))
            if draw(st.integers(0, 5)) == 0:
                point.zero_threshold = draw(_doubles)
        elif kind == "histogram":
            metric.histogram.aggregation_temporality = 1
            point = metric.histogram.data_points.add()
            point.explicit_bounds.extend([0.1, 1.0])
            point.bucket_counts.extend([1, 0, 1])
            point.count = 2
        else:
            data = metric.gauge if kind == "gauge" else metric.sum
            if kind == "sum":
                metric.sum.is_monotonic = draw(st.booleans())
                metric.sum.aggregation_temporality = draw(st.sampled_from([0, 1, 2]))
            point = data.data_points.add()
            if draw(st.booleans()):
                point.as_double = draw(_doubles)
            elif draw(st.booleans()):
                point.as_int = draw(st.integers(-(2**63), 2**63 - 1))
        point.time_unix_nano = draw(_times)
        point.start_time_unix_nano = (
            draw(st.sampled_from([0, NOW_NS - 10**10])) if draw(st.booleans()) else draw(_times)
        )
        point.attributes.extend(_attrs(draw(_pairs)))


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    request=requests(),
    allowlist=st.sampled_from(
        [TAG_ALLOWLIST, frozenset(), frozenset({"other", "", "a b", "k\\"}) | TAG_ALLOWLIST]
    ),
    max_duration_s=st.sampled_from([MAX_DURATION_S, None, 0.5]),
    bounds=st.sampled_from([None, (NOW_NS - 10**12, NOW_NS + 10**11), (-5, 2**64)]),
    refuse=st.sampled_from([None, frozenset(), frozenset({"3"})]),
)
def test_hypothesis_variations(
    request: ExportMetricsServiceRequest,
    allowlist: frozenset[str],
    max_duration_s: float | None,
    bounds: tuple[int, int] | None,
    refuse: frozenset[str] | None,
) -> None:
    compare(
        request.SerializeToString(),
        tag_allowlist=allowlist,
        max_duration_s=max_duration_s,
        bounds=bounds,
        refuse=refuse,
    )


@pytest.mark.parametrize(
    "pairs",
    [
        [("stepwatch.phase", "a b,c=d")],  # escapes in tag values
        [("stepwatch.phase", 7), ("device", "x")],  # an int tag, a dropped attribute
        [("stepwatch.phase", True), ("stepwatch.kernel", 1.5)],  # bool and double tags
        [("stepwatch.phase", math.nan), ("stepwatch.kernel", "日本")],  # nan, non-ASCII
        [("stepwatch.phase", "")],  # an empty value: a tag, but not in the series key
        [("stepwatch.phase", None), ("other", "x")],  # no value: dropped
    ],
)
@pytest.mark.parametrize("rank", [3, "07"])
def test_variations_the_fast_path_handles(pairs: list[tuple[str, object]], rank: object) -> None:
    request = ExportMetricsServiceRequest()
    resource = request.resource_metrics.add()
    resource.resource.attributes.extend(
        _attrs(
            [
                (_schema.JOB_ID, "job a,b"),
                (_schema.RANK, rank),
                (_schema.WORLD_SIZE, 8),
                ("host.name", "h=1"),
                ("process.pid", 12),
            ]
        )
    )
    scope = resource.scope_metrics.add()
    metric = scope.metrics.add(name="stepwatch.kernel.duration", unit="s")
    metric.exponential_histogram.aggregation_temporality = 1
    for counts, offset in (([0, 0, 0, 1, 0, 2], -40), ([5], 3), ([2**40, 0, 0, 0, 1], 0)):
        point = metric.exponential_histogram.data_points.add(
            time_unix_nano=NOW_NS, start_time_unix_nano=NOW_NS - 10**10, scale=3
        )
        point.positive.offset = offset
        point.positive.bucket_counts.extend(counts)
        point.count = sum(counts)
        point.sum = 0.25 * sum(counts)
        point.attributes.extend(_attrs(pairs))
    metric = scope.metrics.add(name="app queue", unit="1")
    metric.sum.is_monotonic = True
    metric.sum.aggregation_temporality = 1
    metric.sum.data_points.add(time_unix_nano=NOW_NS, as_int=-(2**62)).attributes.extend(
        _attrs(pairs)
    )
    metric = scope.metrics.add(name=_schema.STEP_LAST)
    metric.gauge.data_points.add(time_unix_nano=NOW_NS, as_double=1e22)
    assert compare(request.SerializeToString(), refuse=frozenset())
    assert compare(request.SerializeToString(), refuse=frozenset({"3", "07"}))
    # an array attribute (dropped by the Python path) is left to the Python path
    point.attributes.extend(_attrs([("other", [1, "x"])]))
    assert not compare(request.SerializeToString(), refuse=frozenset())


# ---- malformed input --------------------------------------------------------------------


def _python_result(body: bytes) -> list[str] | RequestError:
    try:
        request = parse_protobuf(body)
    except RequestError as exc:
        return exc
    return [point.encode() for point in convert_to_points(request).points]


def _check_malformed(body: bytes) -> bool:
    fast = _fast.convert(
        body,
        tag_allowlist=TAG_ALLOWLIST,
        max_duration_s=MAX_DURATION_S,
        time_bounds_unix_nano=None,
        resource_check=None,
    )
    if fast is None:
        return False
    expected = _python_result(body)
    assert not isinstance(expected, RequestError), "handled a body protobuf refuses"
    assert fast.lines == expected
    return True


def test_tags_and_lengths_in_more_than_five_bytes_are_left_to_python() -> None:
    """protobuf (upb) refuses a tag or a length encoded in more than 5 bytes, whatever its
    value; the fast path once took them (found by the fuzzer's oracle)."""
    for size in range(1, 11):
        overlong = bytes([0x80] * (size - 1) + [0x00])
        length = b"\x0a" + overlong  # resource_metrics, empty, its length in `size` bytes
        tag = (b"\x8a" + overlong[1:] if size > 1 else b"\x0a") + b"\x00"
        for body in (
            length,
            tag,
            length * 3 + window_body(random.Random(size), rank=0, ranks=1, kernels=0),
        ):
            handled = _check_malformed(body)
            assert handled is (size <= 5), (size, body.hex())


def test_tags_whose_values_are_all_empty() -> None:
    """Allowlisted attributes with empty values (not stored) as a resource's or a point's only
    tags: the tags write no text at all. Under UBSan (scripts/ci_sanitizers.sh) the fast path
    once added their offset to a buffer never allocated (NULL + 0, found by the fuzzer)."""
    from tests.otel_bridge import otlp_requests as otlp

    cases = [
        otlp.request([otlp.gauge("hw.power", 1.5, attrs={"hw.id": "GPU-0"})], {"host.name": ""}),
        otlp.request(
            [otlp.gauge("stepwatch.step.last", 7.0, attrs={"stepwatch.phase": ""})],
            {**otlp.rank_resource(), "host.name": "", "service.name": ""},
        ),
        otlp.request([otlp.gauge("hw.power", 2.0, attrs={"hw.id": ""})], {"host.name": ""}),
    ]
    for request in cases:
        body = request.SerializeToString()
        for allowlist in (TAG_ALLOWLIST, frozenset({"host.name", _schema.RANK})):
            assert compare(body, tag_allowlist=allowlist)


def test_truncated_and_corrupted_bodies() -> None:
    rng = random.Random(11)
    body = window_body(rng, rank=0, ranks=2, kernels=3)
    handled = 0
    for end in range(len(body)):
        handled += _check_malformed(body[:end])
    assert handled < len(body)  # most truncations are refused, some are valid shorter requests
    for _ in range(3000):
        corrupted = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            corrupted[rng.randrange(len(corrupted))] = rng.randrange(256)
        _check_malformed(bytes(corrupted))


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes(body: bytes) -> None:
    _check_malformed(body)


@settings(max_examples=2000, deadline=None)
@given(st.data())
def test_spliced_bodies(data: st.DataObject) -> None:
    """Valid fragments glued at random places (lengths and tags that point anywhere)."""
    rng = random.Random(data.draw(st.integers(0, 10)))
    body = window_body(rng, rank=1, ranks=2, kernels=1)
    start = data.draw(st.integers(0, len(body)))
    end = data.draw(st.integers(start, len(body)))
    insert = data.draw(st.binary(max_size=12))
    _check_malformed(body[:start] + insert + body[end:])
    _check_malformed(body[start:end])


def test_non_finite_and_huge_values_are_declined_or_identical() -> None:
    for value in (math.nan, math.inf, -math.inf, 1e308, 5e-324, -0.0, 2.0**53 + 1):
        request = ExportMetricsServiceRequest()
        resource = request.resource_metrics.add()
        resource.resource.attributes.extend(_attrs([(_schema.JOB_ID, "j"), (_schema.RANK, 0)]))
        metric = resource.scope_metrics.add().metrics.add()
        metric.name = _schema.STEP_DURATION
        metric.unit = "s"
        point = metric.exponential_histogram.data_points.add()
        point.time_unix_nano = NOW_NS
        point.positive.bucket_counts.extend([1])
        point.count = 1
        point.sum = value
        compare(request.SerializeToString(), max_duration_s=None)
        gauge = resource.scope_metrics[0].metrics.add()
        gauge.name = "g"
        gauge.gauge.data_points.add(time_unix_nano=NOW_NS, as_double=value)
        compare(request.SerializeToString(), max_duration_s=None)
