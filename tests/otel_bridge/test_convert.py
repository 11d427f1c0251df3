"""OTLP → line protocol conversion: golden files, validation, hypothesis properties."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from google.protobuf import json_format
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics._internal.exponential_histogram.mapping.exponent_mapping import (
    ExponentMapping,
)
from opentelemetry.sdk.metrics._internal.exponential_histogram.mapping.logarithm_mapping import (
    LogarithmMapping,
)

from stepwatch.core._errors import ConfigError
from stepwatch.core._lineproto import encode_point
from stepwatch.otel_bridge import TAG_ALLOWLIST, _convert, bucket_quantile, convert_request
from stepwatch.otel_bridge._buckets import (
    explicit_buckets,
    exponential_buckets,
    format_bound,
    nearest_rank_quantile,
)
from stepwatch.otel_bridge._convert import Point
from stepwatch.otel_bridge._decode import decode_body
from tests.otel_bridge.otlp_requests import (
    T1,
    bucket_fields,
    counter,
    explicit_histogram,
    exponential_histogram,
    gauge,
    line_fields,
    rank_resource,
    request,
)

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("STEPWATCH_UPDATE_GOLDEN") == "1"


def golden_request() -> object:
    """Every metric kind once, with attributes to keep, drop and escape."""
    return request(
        [
            explicit_histogram(
                "stepwatch.phase.duration",
                bounds=[0.005, 0.01, 0.1],
                counts=[1, 3, 4, 2],
                total=0.95,
                minimum=0.004,
                maximum=0.3,
                attrs={"stepwatch.phase": "backward", "step": 17},
            ),
            exponential_histogram(
                "stepwatch.kernel.duration",
                scale=1,
                offset=-8,
                counts=[2, 0, 5, 1],
                zero_count=1,
                total=0.95,
                minimum=0.0,
                maximum=0.24,
                attrs={
                    "stepwatch.kernel.class": "gemm, fp16=on",
                    "stepwatch.kernel.category": "compute",
                    "kernel.raw": "void at::native::gemm<float>(...)",
                },
            ),
            gauge("stepwatch.step.last", 41, unit="{step}"),
            gauge("hw.temperature", 71.5, attrs={"hw.type": "gpu", "hw.id": "GPU 0"}),
            counter("hw.errors", 3, attrs={"hw.type": "gpu"}),
            counter("queue.size", -2.5, monotonic=False),
        ],
        {**rank_resource("run 42", 3, 8), "process.command_line": "python train.py --lr=1"},
    )


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        path.write_text(text)
        if not UPDATE:
            pytest.fail(f"golden file {name} was missing and has been written; re-run")
    assert text == path.read_text()


def test_golden_line_protocol() -> None:
    conversion = convert_request(golden_request())  # type: ignore[arg-type]
    assert conversion.accepted_points == 6
    assert conversion.rejected == {}
    # step + process.command_line on 6 points, and kernel.raw once
    assert conversion.dropped_attributes == 6 + 1 + 1
    check_golden("convert.lp", "\n".join(conversion.lines) + "\n")
    # the Collector-compatible layout: one field per bound (docs/storage.md, "Histogram layouts")
    legacy = convert_request(golden_request(), histogram_layout="per_bound")  # type: ignore[arg-type]
    assert legacy.accepted_points == 6
    check_golden("convert_per_bound.lp", "\n".join(legacy.lines) + "\n")


def test_golden_otlp_json_payload_converts_identically() -> None:
    message = golden_request()
    payload = json_format.MessageToJson(message)  # type: ignore[arg-type]
    check_golden("request.json", payload + "\n")
    decoded = decode_body(
        (GOLDEN / "request.json").read_bytes(),
        content_type="application/json",
        content_encoding=None,
        max_bytes=1 << 20,
    )
    assert convert_request(decoded).lines == (GOLDEN / "convert.lp").read_text().splitlines()


def test_otlp_json_accepts_hex_ids_int_enums_and_unknown_fields() -> None:
    document = json.loads((GOLDEN / "request.json").read_text())
    metric = document["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]
    metric["histogram"]["aggregationTemporality"] = 1
    metric["histogram"]["futureField"] = {"x": 1}
    metric["histogram"]["dataPoints"][0]["exemplars"] = [
        {
            "timeUnixNano": "1",
            "asDouble": 0.1,
            "traceId": "5b8efff798038103d269b633813fc60c",
            "spanId": "eee19b7ec3c1b174",
        }
    ]
    decoded = decode_body(
        json.dumps(document).encode(),
        content_type="application/json; charset=utf-8",
        content_encoding="identity",
        max_bytes=1 << 20,
    )
    exemplar = decoded.resource_metrics[0].scope_metrics[0].metrics[0].histogram.data_points[0]
    assert exemplar.exemplars[0].span_id.hex() == "eee19b7ec3c1b174"
    assert convert_request(decoded).accepted_points == 6


def fields_of(line: str) -> dict[str, str]:
    return line_fields(line)


def test_explicit_histogram_fields_are_telegraf_prometheus_v1() -> None:
    conversion = convert_request(golden_request(), histogram_layout="per_bound")  # type: ignore[arg-type]
    fields = fields_of(conversion.lines[0])
    assert fields["count"] == "10.0" and fields["sum"] == "0.95"
    assert [fields[key] for key in ("0.005", "0.01", "0.1", "+Inf")] == [
        "1.0",
        "4.0",
        "8.0",
        "10.0",
    ]
    # nearest rank: p50 -> rank 5 -> bucket (0.01, 0.1] -> midpoint 0.055
    assert float(fields["p50"]) == pytest.approx(0.055)
    assert float(fields["p99"]) == 0.3  # +Inf bucket -> max
    assert fields["start_time_unix_nano"].endswith("i")


def test_compact_layout_holds_the_buckets_in_one_string_field() -> None:
    lines = convert_request(golden_request()).lines  # type: ignore[arg-type]
    explicit, exponential = fields_of(lines[0]), fields_of(lines[1])
    assert explicit["buckets"] == '"x0.005,0.01,0.1:1,3,4,2"'
    assert exponential["buckets"] == '"e1:-8:2,0,5,1;z1"'
    assert not {key for key in (*explicit, *exponential) if key[0].isdigit() or key == "+Inf"}
    # the same quantiles as the per-bound layout, and the same cumulative counts
    legacy = convert_request(golden_request(), histogram_layout="per_bound").lines  # type: ignore[arg-type]
    for compact, per_bound in zip(lines[:2], legacy[:2], strict=True):
        stored, old = fields_of(compact), fields_of(per_bound)
        assert (stored["count"], stored["sum"]) == (old["count"], old["sum"])
        for name in ("p50", "p90"):  # 12 significant bits in the compact layout
            assert float(stored[name]) == pytest.approx(float(old[name]), rel=2**-12, abs=0)
        # mean is sum / count, p99 is read from the buckets: neither is stored
        assert "mean" not in stored and "p99" not in stored
        assert float(old["mean"]) == float(stored["sum"]) / float(stored["count"])
        text = stored["buckets"].strip('"')
        p99 = bucket_quantile(
            text, 0.99, minimum=float(stored["min"]), maximum=float(stored["max"])
        )
        assert p99 == float(old["p99"])
        assert bucket_fields(stored) == {
            key: value for key, value in old.items() if key[0].isdigit() or key == "+Inf"
        }


def test_exponential_histogram_uses_real_bounds() -> None:
    conversion = convert_request(golden_request(), histogram_layout="per_bound")  # type: ignore[arg-type]
    fields = fields_of(conversion.lines[1])
    # scale 1: base sqrt(2); positive bucket -8 is (2^-4, 2^-3.5]
    assert fields["0"] == "1.0"  # the zero bucket
    assert fields["0.08838834764831845"] == "3.0"  # 2^-3.5
    assert fields["0.125"] == "3.0"
    assert fields["+Inf"] == "9.0"


def test_tags_are_allowlisted_and_escaped() -> None:
    lines = convert_request(golden_request()).lines  # type: ignore[arg-type]
    assert lines[1].startswith(
        "stepwatch.kernel.duration,host.name=node-1,service.name=stepwatch,"
        "stepwatch.job.id=run\\ 42,stepwatch.kernel.category=compute,"
        "stepwatch.kernel.class=gemm\\,\\ fp16\\=on,"
    )
    assert "process.command_line" not in "".join(lines)
    assert "kernel.raw" not in "".join(lines)
    extended = convert_request(
        golden_request(),  # type: ignore[arg-type]
        tag_allowlist=TAG_ALLOWLIST | {"kernel.raw"},
    )
    assert "kernel.raw=void\\ at::native::gemm<float>(...)" in extended.lines[1]


def test_known_series_are_bounded_and_never_change_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Escaped tags of (metric, point tags) are kept and reused; the store is cleared when full.
    request = golden_request()
    expected = convert_request(request).lines  # type: ignore[arg-type]
    monkeypatch.setattr(_convert, "MAX_KNOWN_SERIES", 3)
    _convert._forget_series()
    for _ in range(3):
        assert convert_request(request).lines == expected  # type: ignore[arg-type]
        assert len(_convert._known) <= 3
    _convert._forget_series()


_TAG_TEXT = st.sampled_from(["", "a", "b c", "x,y=z", "end\\", "mid\\dle", "é"])


@settings(max_examples=300)
@given(
    resource_extra=st.dictionaries(st.sampled_from(["host.name", "service.name"]), _TAG_TEXT),
    point_tags=st.dictionaries(
        st.sampled_from(["host.name", "stepwatch.kernel.class", "stepwatch.job.id", "other"]),
        _TAG_TEXT,
        max_size=3,
    ),
    name=st.sampled_from(["custom.metric", "with space,comma"]),
)
def test_series_keys_merge_resource_and_point_tags_as_the_encoder_does(
    resource_extra: dict[str, str], point_tags: dict[str, str], name: str
) -> None:
    # resource and point tags are escaped apart and merged per point; a point attribute
    # overrides a resource one; a value ending in a backslash is rejected
    resource = {"stepwatch.job.id": "j", "stepwatch.rank": 0, **resource_extra}
    conversion = convert_request(request([gauge(name, 1.5, attrs=point_tags)], resource))
    merged = {
        key: str(value) for key, value in {**resource, **point_tags}.items() if key in TAG_ALLOWLIST
    }
    if any(value.endswith("\\") for value in merged.values()):
        assert conversion.rejected == {"unrepresentable": 1}
        return
    assert conversion.lines == [encode_point(name, merged, {"gauge": 1.5}, T1)]
    assert Point(name, merged, {"gauge": 1.5}, T1).encode() == conversion.lines[0]


def test_gauges_and_sums_use_telegraf_names() -> None:
    lines = convert_request(golden_request()).lines  # type: ignore[arg-type]
    assert fields_of(lines[2])["gauge"] == "41.0"
    assert fields_of(lines[4])["counter"] == "3.0"
    assert fields_of(lines[5])["gauge"] == "-2.5"


@pytest.mark.parametrize(
    ("metric", "reason"),
    [
        (
            explicit_histogram(
                "stepwatch.step.duration", bounds=[1.0], counts=[1, 1], total=math.nan
            ),
            "non_finite",
        ),
        (
            explicit_histogram(
                "stepwatch.step.duration", bounds=[1.0], counts=[1, 1], total=1.0, minimum=-0.5
            ),
            "negative_duration",
        ),
        (
            explicit_histogram(
                "stepwatch.step.duration", bounds=[1.0], counts=[1, 1], total=1.0, count=5
            ),
            "count_mismatch",
        ),
        (
            explicit_histogram(
                "stepwatch.step.duration", bounds=[1.0, 0.5], counts=[1, 1, 0], total=1.0
            ),
            "bucket_layout",
        ),
        (
            explicit_histogram(
                "stepwatch.step.duration", bounds=[1.0], counts=[1, 1, 1], total=1.0
            ),
            "bucket_layout",
        ),
        (
            exponential_histogram(
                "stepwatch.kernel.duration",
                scale=0,
                offset=0,
                counts=[1],
                negative_counts=[1],
                total=0.0,
            ),
            "negative_duration",
        ),
        (
            exponential_histogram(
                "stepwatch.kernel.duration", scale=0, offset=2000, counts=[1], total=1.0
            ),
            "bucket_layout",
        ),
        (gauge("hw.power", math.inf), "non_finite"),
        (gauge("hw.power", 1.0, time_unix_nano=0), "missing_time"),
        (gauge("hw.power", 1.0, time_unix_nano=2**64 - 1), "time_out_of_range"),
    ],
)
def test_invalid_points_are_rejected_by_reason(metric: object, reason: str) -> None:
    conversion = convert_request(request([metric, gauge("hw.power", 5.0)]))  # type: ignore[list-item]
    assert conversion.rejected == {reason: 1}
    assert conversion.accepted_points == 1


def test_resource_validation_applies_to_stepwatch_metrics_only() -> None:
    metrics = [gauge("stepwatch.step.last", 1), gauge("process.cpu", 0.5)]
    missing: dict[str, str | int] = {"host.name": "n", "stepwatch.rank": 0}
    assert convert_request(request(metrics, missing)).rejected == {"missing_resource_attribute": 1}
    empty_job = rank_resource("", 0, 4)
    assert convert_request(request(metrics, empty_job)).rejected == {
        "missing_resource_attribute": 1
    }
    out_of_range = rank_resource("j", 4, 4)
    conversion = convert_request(request(metrics, out_of_range))
    assert conversion.rejected == {"rank_out_of_range": 1}
    assert conversion.lines[0].startswith("process.cpu,")


def test_format_bound_matches_go_formatfloat() -> None:
    assert format_bound(0.005) == "0.005"
    assert format_bound(1e-05) == "0.00001"
    assert format_bound(2.0) == "2"
    assert format_bound(-0.0) == format_bound(0.0) == "0"
    assert format_bound(1e21) == "1000000000000000000000"
    assert format_bound(0.1 + 0.2) == "0.30000000000000004"


@given(st.floats(min_value=1e-300, max_value=1e300, allow_nan=False))
def test_format_bound_round_trips(value: float) -> None:
    assert float(format_bound(value)) == value


counts_strategy = st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=40)


@given(
    scale=st.integers(min_value=-4, max_value=8),
    offset=st.integers(min_value=-60, max_value=58),
    counts=counts_strategy,
    negative=st.lists(st.integers(min_value=0, max_value=50), max_size=10),
    zero_count=st.integers(min_value=0, max_value=10),
)
def test_exponential_buckets_are_cumulative_and_ascending(
    scale: int, offset: int, counts: list[int], negative: list[int], zero_count: int
) -> None:
    widest = offset + max(len(counts), len(negative)) + 1
    assume(widest * 2.0**-scale < 1020)  # beyond, the bound overflows a float: rejected
    buckets = exponential_buckets(
        scale,
        positive_offset=offset,
        positive_counts=counts,
        negative_offset=offset,
        negative_counts=negative,
        zero_count=zero_count,
    )
    assert all(a <= b for a, b in zip(buckets.cumulative, buckets.cumulative[1:], strict=False))
    assert all(a < b for a, b in zip(buckets.uppers, buckets.uppers[1:], strict=False))
    assert all(lo <= hi for lo, hi in zip(buckets.lowers, buckets.uppers, strict=True))
    assert buckets.cumulative[-1] == sum(counts) + sum(negative) + zero_count


def true_nearest_rank(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(
        st.floats(min_value=1e-6, max_value=1e4, allow_nan=False), min_size=1, max_size=200
    ),
    scale=st.integers(min_value=-2, max_value=6),
    quantile=st.sampled_from([0.01, 0.5, 0.9, 0.99, 1.0]),
)
def test_exponential_quantile_within_bucket_of_true_nearest_rank(
    values: list[float], scale: int, quantile: float
) -> None:
    mapping = LogarithmMapping(scale) if scale > 0 else ExponentMapping(scale)
    indexes = [mapping.map_to_index(value) for value in values]
    low = min(indexes)
    counts = [0] * (max(indexes) - low + 1)
    for index in indexes:
        counts[index - low] += 1
    buckets = exponential_buckets(scale, positive_offset=low, positive_counts=counts)
    estimate = nearest_rank_quantile(buckets, quantile, minimum=min(values), maximum=max(values))
    truth = true_nearest_rank(values, quantile)
    index = mapping.map_to_index(truth)
    width = mapping.get_lower_boundary(index + 1) - mapping.get_lower_boundary(index)
    assert estimate is not None
    assert abs(estimate - truth) <= width * (1 + 1e-9)
    assert min(values) <= estimate <= max(values)


@given(
    bounds=st.lists(
        st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
        min_size=0,
        max_size=20,
        unique=True,
    ).map(sorted),
    data=st.data(),
)
def test_explicit_buckets_cumulative_monotonic(bounds: list[float], data: st.DataObject) -> None:
    counts = data.draw(
        st.lists(st.integers(0, 1000), min_size=len(bounds) + 1, max_size=len(bounds) + 1)
    )
    buckets = explicit_buckets(bounds, counts)
    assert buckets.cumulative[-1] == sum(counts)
    assert all(a <= b for a, b in zip(buckets.cumulative, buckets.cumulative[1:], strict=False))
    for quantile in (0.5, 0.9, 0.99):
        value = nearest_rank_quantile(buckets, quantile, minimum=None, maximum=None)
        assert (value is None) == (sum(counts) == 0)
        if value is not None:
            assert math.isfinite(value)


names = st.text(min_size=1, max_size=12)


@given(
    measurement=names,
    tags=st.dictionaries(names, st.text(max_size=12), max_size=4),
    fields=st.dictionaries(
        names,
        st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**63), 2**63)),
        min_size=1,
        max_size=5,
    ),
    time_unix_nano=st.integers(0, 2**63 - 1),
)
def test_cached_encoder_matches_core_encode_point(
    measurement: str,
    tags: dict[str, str],
    fields: dict[str, float | int],
    time_unix_nano: int,
) -> None:
    point = Point(measurement, tags, dict(fields), time_unix_nano)
    # Tags with an empty value are not written at all (InfluxDB refuses empty tag values).
    texts = [measurement, *(text for item in tags.items() if item[1] for text in item), *fields]
    if any(text.endswith("\\") for text in texts):
        # Unrepresentable in line protocol: both encoders refuse it the same way.
        with pytest.raises(ConfigError, match="backslash"):
            point.encode()
        with pytest.raises(ConfigError, match="backslash"):
            encode_point(measurement, tags, fields, time_unix_nano)
        return
    assert point.encode() == encode_point(measurement, tags, fields, time_unix_nano)


def test_exponential_fields_keep_only_edges_of_populated_buckets() -> None:
    # Two clusters 64 buckets apart at scale 5 (two octaves): the empty buckets between them
    # add no field; both edges of each populated bucket stay (the lowest is `min`), so the
    # bucket of every observation (and the nearest-rank quantiles) can be read back.
    counts = [3, 0, 1] + [0] * 61 + [2]
    metric = exponential_histogram(
        "stepwatch.kernel.duration", scale=5, offset=-320, counts=counts, total=0.02
    )
    (line,) = convert_request(request([metric]), histogram_layout="per_bound").lines
    fields = dict(item.split("=") for item in line.split(" ")[1].split(","))
    edges = {format_bound(2.0 ** ((-320 + i) * 2.0**-5)) for i in (1, 2, 3, 64, 65)}
    bucket_keys = {key for key in fields if key[0].isdigit()}
    assert bucket_keys == edges
    cumulative = sorted((float(key), float(fields[key])) for key in bucket_keys)
    # The first bucket's lower edge is the data's own `min` (as in the dense layout).
    assert [count for _, count in cumulative] == [3.0, 3.0, 4.0, 4.0, 6.0]
    assert fields["+Inf"] == "6.0"


@pytest.mark.parametrize("explicit", [False, True])
def test_one_observation_without_min_max_reads_back_as_its_sum(explicit: bool) -> None:
    """OTLP min/max are optional (stepwatch's kernel histograms leave them out); with one
    observation its value is the sum, so min, max and every quantile are that value, not a
    bucket midpoint. With two observations nothing is invented."""
    value = 0.0123456789
    for count in (1, 2):
        total = value * count
        if explicit:
            metric = explicit_histogram(
                "stepwatch.kernel.duration", bounds=[0.01, 0.02], counts=[0, count, 0], total=total
            )
        else:  # scale 4: bucket -102 is (2**(-102/16), 2**(-101/16)] = (0.01205, 0.01258]
            metric = exponential_histogram(
                "stepwatch.kernel.duration", scale=4, offset=-102, counts=[count], total=total
            )
        (line,) = convert_request(request([metric])).lines
        fields = fields_of(line)
        if count == 1:
            for name in ("min", "max", "p50", "p90"):
                assert float(fields[name]) == value, name
            text = fields["buckets"].strip('"')
            assert bucket_quantile(text, 0.99, minimum=value, maximum=value) == value
        else:
            assert "min" not in fields and "max" not in fields
            assert float(fields["p50"]) != value


def test_identity_attributes_are_read_not_counted_as_dropped() -> None:
    """``service.instance.id`` and ``process.pid`` (every StepMonitor sends the first) feed
    the duplicate-rank guard: not tags, and not counted as dropped; other extras still are."""
    resource = {
        **rank_resource(),
        "service.instance.id": "0b6c5e2a-5b0e-4a59-9a8e-0f3d1f0a7c11",
        "process.pid": 4242,
        "deployment.environment": "prod",
    }
    conversion = convert_request(
        request([gauge("stepwatch.step.last", 1), gauge("hw.power", 300.0)], resource)
    )
    assert conversion.accepted_points == 2
    assert conversion.dropped_attributes == 2  # deployment.environment on both points
    assert all("service.instance.id" not in line for line in conversion.lines)
