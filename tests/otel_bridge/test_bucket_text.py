"""The compact layout (issue 15): the ``buckets`` string field round-trips, columns stay bounded."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics._internal.exponential_histogram.mapping.exponent_mapping import (
    ExponentMapping,
)
from opentelemetry.sdk.metrics._internal.exponential_histogram.mapping.logarithm_mapping import (
    LogarithmMapping,
)

from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge import (
    COMPACT_FIELDS,
    Bridge,
    bucket_quantile,
    buckets_from_bound_fields,
    convert_request,
    decode_buckets,
    merge_buckets,
)
from stepwatch.otel_bridge._bucket_text import (
    _counts_text_reference,
    counts_text,
    encode_explicit,
    encode_exponential,
)
from stepwatch.otel_bridge._buckets import explicit_buckets, exponential_buckets
from tests.otel_bridge.otlp_requests import (
    RecordingWriter,
    explicit_histogram,
    exponential_histogram,
    line_fields,
    request,
)

# counts with long zero runs (the `*k` form) as well as dense ones
counts_strategy = st.lists(
    st.one_of(st.integers(0, 3), st.just(0), st.integers(0, 10**12)), max_size=60
)


@settings(max_examples=300, deadline=None)
@given(
    scale=st.integers(-10, 20),
    offset=st.integers(-2000, 2000),
    counts=counts_strategy,
    negative_offset=st.integers(-200, 200),
    negative=counts_strategy,
    zero_count=st.integers(0, 10**6),
    zero_threshold=st.sampled_from([0.0, 1e-300, 1e-9]),
)
def test_exponential_text_round_trips(
    scale: int,
    offset: int,
    counts: list[int],
    negative_offset: int,
    negative: list[int],
    zero_count: int,
    zero_threshold: float,
) -> None:
    options = {
        "positive_offset": offset,
        "positive_counts": counts,
        "negative_offset": negative_offset,
        "negative_counts": negative,
        "zero_count": zero_count,
        "zero_threshold": zero_threshold,
    }
    try:
        expected = exponential_buckets(scale, **options)  # type: ignore[arg-type]
    except ValueError:
        assume(False)  # overflowing bounds: the bridge refuses the point before encoding
    text = encode_exponential(
        scale,
        offset=offset,
        counts=counts,
        zero_count=zero_count,
        zero_threshold=zero_threshold,
        negative_offset=negative_offset,
        negative_counts=negative,
    )
    assert text.isascii() and '"' not in text and "\\" not in text and " " not in text
    assert decode_buckets(text) == expected


@settings(max_examples=300, deadline=None)
@given(
    bounds=st.lists(
        st.floats(allow_nan=False, allow_infinity=False, width=64), unique=True, max_size=40
    ).map(sorted),
    data=st.data(),
)
def test_explicit_text_round_trips(bounds: list[float], data: st.DataObject) -> None:
    assume(all(b > a for a, b in itertools.pairwise(bounds)))  # -0.0 == 0.0
    counts = data.draw(
        st.lists(st.integers(0, 10**9), min_size=len(bounds) + 1, max_size=len(bounds) + 1)
    )
    text = encode_explicit(bounds, counts)
    assert decode_buckets(text) == explicit_buckets(bounds, counts)


@settings(max_examples=500)
@given(st.lists(st.sampled_from([0, 0, 0, 1, 7, 10, 100, 2**64 - 1]), max_size=40))
def test_zero_runs_are_written_as_the_reference_writes_them(counts: list[int]) -> None:
    # the hot path's loop writes what the reference writes
    assert counts_text(counts) == _counts_text_reference(counts)
    assert counts_text([0, 0, 0, 10, 0, 0, 100, 0, 0, 0, 0]) == "*3,10,0,0,100,*4"


def test_encoding_examples() -> None:
    assert encode_exponential(5, offset=-200, counts=[3, 0, 0, 0, 0, 1]) == "e5:-200:3,*4,1"
    assert encode_exponential(0, offset=4, counts=[]) == "e0:0:"
    assert encode_explicit([], [7]) == "x:7"
    assert decode_buckets("x:7").cumulative == [7]
    assert decode_buckets("e5:-200:3,*4,1").cumulative == [3, 3, 3, 3, 3, 4]


@pytest.mark.parametrize(
    "text",
    ["", "y1:2", "e5", "e5:1", "e5:1:x", "e5:1:-1", "e5:1:1;q2", "x0.1:1", "x0.2,0.1:1,1,1",
     "xnan:1,1", "e99:0:1", "e5:0:*0", "e5:0:1;z-1", "x0.1:1,+1"],
)  # fmt: skip
def test_malformed_text_is_a_clear_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        decode_buckets(text)


def _exponential_text(values: list[float], scale: int) -> str:
    mapping = LogarithmMapping(scale) if scale > 0 else ExponentMapping(scale)
    indexes = [mapping.map_to_index(value) for value in values]
    low = min(indexes)
    counts = [0] * (max(indexes) - low + 1)
    for index in indexes:
        counts[index - low] += 1
    return encode_exponential(scale, offset=low, counts=counts)


def _nearest_rank(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


@settings(max_examples=150, deadline=None)
@given(
    windows=st.lists(
        st.tuples(st.lists(st.floats(1e-6, 1e3), min_size=1, max_size=50), st.integers(2, 6)),
        min_size=1,
        max_size=6,
    ),
    quantile=st.sampled_from([0.5, 0.9, 0.99]),
)
def test_merged_quantile_of_windows_at_any_scales(
    windows: list[tuple[list[float], int]], quantile: float
) -> None:
    """Windows stored at different scales merge (at the lowest) and give the quantile of all
    their observations to within one bucket at that scale."""
    merged = merge_buckets(_exponential_text(values, scale) for values, scale in windows)
    every = [value for values, _ in windows for value in values]
    assert merged.cumulative[-1] == len(every)
    lowest = min(scale for _, scale in windows)
    estimate = bucket_quantile_of(merged, quantile, min(every), max(every))
    truth = _nearest_rank(every, quantile)
    assert abs(estimate - truth) <= truth * (2.0 ** (2.0**-lowest) - 1) * (1 + 1e-9)


def bucket_quantile_of(buckets: object, quantile: float, low: float, high: float) -> float:
    from stepwatch.otel_bridge._buckets import nearest_rank_quantile

    value = nearest_rank_quantile(buckets, quantile, minimum=low, maximum=high)  # type: ignore[arg-type]
    assert value is not None
    return value


def test_merge_refuses_explicit_buckets_that_split_each_other() -> None:
    merged = merge_buckets(["x0.1,0.2:1,0,0", "x0.2,0.4:0,2,0"])  # aligned where populated
    assert merged.uppers == [0.1, 0.2, 0.4, math.inf] and merged.cumulative == [1, 1, 3, 3]
    assert merged.lowers == [-math.inf, 0.1, 0.2, 0.4]
    with pytest.raises(ValueError, match="split"):
        merge_buckets(["x0.1,0.4:0,2,0", "x0.2:1,0"])
    with pytest.raises(ValueError, match="explicit and exponential"):
        merge_buckets(["x0.1:1,0", "e3:0:1"])


def test_stored_quantiles_are_the_buckets_fields_quantiles() -> None:
    metric = exponential_histogram(
        "stepwatch.kernel.duration", scale=5, offset=-300, counts=[4, 0, 0, 9, 1, 0, 2],
        total=0.03, minimum=0.0015, maximum=0.0019,
    )  # fmt: skip
    fields = line_fields(convert_request(request([metric])).lines[0])
    text = fields["buckets"].strip('"')
    for name, quantile in (("p50", 0.5), ("p90", 0.9)):
        value = bucket_quantile(text, quantile, minimum=0.0015, maximum=0.0019)
        assert value is not None and float(fields[name]) != value  # rounded: 12 bits
        assert float(fields[name]) == pytest.approx(value, rel=2**-12, abs=0)
    # p99 and mean are not stored in the compact layout: the buckets and sum / count hold them
    assert "p99" not in fields and "mean" not in fields
    assert bucket_quantile(text, 0.99, minimum=0.0015, maximum=0.0019) is not None


layouts = st.one_of(
    st.builds(
        lambda bounds, data: ("x", sorted(bounds), data),
        st.lists(st.floats(1e-9, 1e6), unique=True, min_size=1, max_size=30),
        st.integers(0, 2**31),
    ),
    st.builds(
        lambda scale, offset, width: ("e", scale, offset, width),
        st.integers(-3, 8),
        st.integers(-400, 100),
        st.integers(1, 80),
    ),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(layouts, min_size=1, max_size=25))
def test_columns_are_bounded_whatever_the_bounds(histograms: list[tuple[object, ...]]) -> None:
    """Many histograms with random bounds and scales into one measurement: the compact layout
    writes only the fixed field set; the per-bound layout grows with the bounds."""
    metrics = []
    for item in histograms:
        if item[0] == "x":
            _, bounds, seed = item
            counts = [(seed >> i) % 3 for i in range(len(bounds) + 1)]  # type: ignore[arg-type]
            metrics.append(
                explicit_histogram("m.duration", bounds=bounds, counts=counts, total=1.0)  # type: ignore[arg-type]
            )
        else:
            _, scale, offset, width = item
            widest = max(abs(int(offset)), abs(int(offset) + int(width)))  # type: ignore[call-overload]
            assume(widest * 2.0 ** -int(scale) < 1000)  # type: ignore[call-overload]
            metrics.append(
                exponential_histogram(
                    "m.duration",
                    scale=scale,
                    offset=offset,
                    counts=[1] * width,
                    total=1.0,  # type: ignore[arg-type]
                )
            )
    compact = convert_request(request(metrics), max_duration_s=None)
    keys = {key for line in compact.lines for key in line_fields(line)}
    assert compact.accepted_points == len(metrics)
    assert keys <= COMPACT_FIELDS and len(COMPACT_FIELDS) <= 16
    legacy = convert_request(request(metrics), max_duration_s=None, histogram_layout="per_bound")
    legacy_keys = {key for line in legacy.lines for key in line_fields(line)}
    assert len(legacy_keys) >= len(keys)


def test_summary_quantiles_go_to_one_field_in_the_compact_layout() -> None:
    from opentelemetry.proto.metrics.v1 import metrics_pb2

    metric = metrics_pb2.Metric(name="rpc.latency", unit="s")
    point = metric.summary.data_points.add(time_unix_nano=10**18, count=4, sum=2.0)
    for quantile, value in ((0.5, 0.4), (0.9, 0.8), (0.999, 1.2)):
        point.quantile_values.add(quantile=quantile, value=value)
    fields = line_fields(convert_request(request([metric])).lines[0])
    assert fields == {
        "count": "4.0", "sum": "2.0", "p50": "0.4", "p90": "0.8",
        "quantiles": '"0.5=0.4,0.9=0.8,0.999=1.2"',
    }  # fmt: skip
    legacy = convert_request(request([metric]), histogram_layout="per_bound").lines[0]
    assert line_fields(legacy)["0.999"] == "1.2"


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="histogram_layout"):
        convert_request(request([]), histogram_layout="columns")
    with pytest.raises(ConfigError, match="histogram_layout"):
        Bridge(RecordingWriter(), histogram_layout="columns")


def test_bridge_writes_the_chosen_layout() -> None:
    metric = explicit_histogram("stepwatch.step.duration", bounds=[0.1], counts=[1, 1], total=0.3)
    from tests.otel_bridge.otlp_requests import rank_resource

    lines = {}
    for layout in ("compact", "per_bound"):
        writer = RecordingWriter()
        bridge = Bridge(writer, grpc_port=None, histogram_layout=layout).start()
        try:
            outcome = bridge.ingest(request([metric], rank_resource()))
            assert outcome.accepted and outcome.rejected_points == 0, outcome
        finally:
            bridge.stop(timeout_s=10)
        (lines[layout],) = writer.lines
    assert line_fields(lines["compact"])["buckets"] == '"x0.1:1,1"'
    assert line_fields(lines["per_bound"])["0.1"] == "1.0"


def test_per_bound_and_collector_points_read_back_as_the_same_buckets() -> None:
    """Data written one field per bound (the per_bound layout, or a Collector's influxdb
    exporter without +Inf) gives the quantiles the compact `buckets` field gives."""
    from tests.otel_bridge.test_convert import golden_request

    compact = convert_request(golden_request()).lines  # type: ignore[arg-type]
    legacy = convert_request(golden_request(), histogram_layout="per_bound").lines  # type: ignore[arg-type]
    for new, old in zip(compact[:2], legacy[:2], strict=True):
        stored = line_fields(new)
        row: dict[str, object] = {k: float(v) for k, v in line_fields(old).items() if "i" not in v}
        from_fields = buckets_from_bound_fields(row)
        decoded = decode_buckets(stored["buckets"].strip('"'))
        del row["+Inf"]  # what a Collector writes: count stands in
        assert buckets_from_bound_fields(row) == from_fields
        for quantile in (0.01, 0.5, 0.9, 0.99, 1.0):
            assert bucket_quantile(from_fields, quantile) == bucket_quantile(decoded, quantile)
    explicit = line_fields(compact[0])["buckets"].strip('"')
    assert buckets_from_bound_fields(
        {k: float(v) for k, v in line_fields(legacy[0]).items() if "i" not in v}
    ) == decode_buckets(explicit)
    with pytest.raises(ValueError, match="cumulative"):
        buckets_from_bound_fields({"count": 3.0, "0.1": 2.0, "0.2": 1.0})


def _reference_exponential_buckets(  # the straightforward version the bridge had before
    scale: int, offset: int, counts: list[int], negative_offset: int, negative: list[int],
    zero_count: int, zero_threshold: float,
) -> object:  # fmt: skip
    def boundary(index: int) -> float:
        try:
            return float(2.0 ** (index * 2.0**-scale))
        except OverflowError:
            raise ValueError("overflow") from None

    lowers, uppers, each = [], [], []
    for position in reversed(range(len(negative))):
        lowers.append(-boundary(negative_offset + position + 1))
        uppers.append(-boundary(negative_offset + position))
        each.append(negative[position])
    if zero_count or zero_threshold or not (counts or negative):
        lowers.append(-zero_threshold)
        uppers.append(zero_threshold)
        each.append(zero_count)
    for position, count in enumerate(counts):
        lowers.append(boundary(offset + position))
        uppers.append(boundary(offset + position + 1))
        each.append(count)
    if any(later <= earlier for earlier, later in itertools.pairwise(uppers)):
        raise ValueError("degenerate")
    return lowers, uppers, list(itertools.accumulate(each))


@settings(max_examples=400, deadline=None)
@given(
    scale=st.integers(-10, 20),
    offset=st.one_of(st.integers(-60, 60), st.integers(-1100, -1000), st.integers(-(10**7), 10**7)),
    counts=st.lists(st.integers(0, 5), max_size=30),
    negative_offset=st.one_of(st.integers(-60, 60), st.integers(-1100, -1000)),
    negative=st.lists(st.integers(0, 5), max_size=10),
    zero_count=st.integers(0, 3),
    zero_threshold=st.sampled_from([0.0, 1e-320, 1e-9, 0.5]),
)
def test_exponential_buckets_match_the_reference(
    scale: int,
    offset: int,
    counts: list[int],
    negative_offset: int,
    negative: list[int],
    zero_count: int,
    zero_threshold: float,
) -> None:
    """The cached-bounds implementation accepts and refuses exactly what the plain one does."""
    try:
        want = _reference_exponential_buckets(
            scale, offset, counts, negative_offset, negative, zero_count, zero_threshold
        )
    except ValueError:
        want = None
    try:
        got = exponential_buckets(
            scale,
            positive_offset=offset,
            positive_counts=counts,
            negative_offset=negative_offset,
            negative_counts=negative,
            zero_count=zero_count,
            zero_threshold=zero_threshold,
        )
    except ValueError:
        got = None
    assert (None if got is None else tuple(got)) == want


@settings(max_examples=500)
@given(
    scale=st.integers(-12, 22),
    offset=st.integers(-1100, 1100),
    counts=st.lists(st.integers(0, 5), max_size=12),
    extra=st.sampled_from([0, 0, 0, -1, 1]),
    sum_=st.one_of(st.none(), st.floats(-1.0, 1e6), st.just(math.inf)),
    minimum=st.one_of(st.none(), st.floats(-1.0, 1e6)),
    maximum=st.one_of(st.none(), st.floats(-1.0, 1e6)),
    zero_count=st.sampled_from([0, 0, 0, 0, 1]),
    negative=st.sampled_from([[], [], [], [], [0], [1]]),
    duration=st.booleans(),
)
def test_compact_fast_path_matches_the_general_path(
    scale: int,
    offset: int,
    counts: list[int],
    extra: int,
    sum_: float | None,
    minimum: float | None,
    maximum: float | None,
    zero_count: int,
    negative: list[int],
    duration: bool,
) -> None:
    # stepwatch's exporters send positive-only exponential histograms: the bridge takes them
    # by a shorter path, which must give the same fields or refuse for the same reason
    from opentelemetry.proto.metrics.v1.metrics_pb2 import ExponentialHistogramDataPoint

    from stepwatch.otel_bridge._fields import (
        LAYOUT_COMPACT,
        _compact_positive,
        _exponential_fields,
    )
    from stepwatch.otel_bridge._reasons import Rejected

    point = ExponentialHistogramDataPoint(
        count=max(0, sum(counts) + zero_count + sum(negative) + extra),
        scale=scale,
        zero_count=zero_count,
        start_time_unix_nano=5,
    )
    point.positive.offset = offset
    point.positive.bucket_counts.extend(counts)
    point.negative.bucket_counts.extend(negative)
    for name, value in (("sum", sum_), ("min", minimum), ("max", maximum)):
        if value is not None:
            setattr(point, name, value)

    def outcome(fast: bool) -> object:
        try:
            if fast:
                return _compact_positive(point, duration)
            return _exponential_fields(point, duration=duration, layout=LAYOUT_COMPACT)
        except Rejected as exc:
            return exc.reason

    fast = outcome(True)
    if fast is None:
        assert not counts or zero_count or negative
        return
    general = outcome(False)
    assert fast == general
    if isinstance(fast, dict):
        assert list(fast) == list(general)  # type: ignore[call-overload]
