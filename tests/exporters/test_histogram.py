"""Exponential histogram aggregation: exact counts, bucket placement, downscaling."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core import ConfigError
from stepwatch.exporters._histogram import (
    FLOAT_BITS,
    MAX_SCALE,
    MIN_SCALE,
    ExponentialHistogram,
    lower_boundary,
    map_to_index,
    round_significant,
)

# Durations from a nanosecond to an hour, plus exact zeros.
durations = st.one_of(
    st.floats(min_value=1e-9, max_value=3600.0, allow_nan=False, allow_infinity=False),
    st.just(0.0),
)


def test_powers_of_two_are_upper_inclusive_bounds() -> None:
    # Bucket i holds (base**i, base**(i+1)]: 1.0 is the top of bucket -1 at every scale.
    for scale in range(MIN_SCALE, MAX_SCALE + 1):
        assert map_to_index(1.0, scale) == -1
    assert map_to_index(2.0, 0) == 0
    assert map_to_index(3.0, 0) == 1
    assert map_to_index(4.0, 0) == 1
    assert map_to_index(4.0, 1) == 3
    assert lower_boundary(0, 3) == 1.0
    assert lower_boundary(8, 3) == 2.0
    assert lower_boundary(-1, 0) == 0.5


@settings(max_examples=300, deadline=None)
@given(
    value=st.floats(min_value=1e-300, max_value=1e300, allow_nan=False),
    scale=st.integers(MIN_SCALE, MAX_SCALE),
)
def test_value_lies_inside_its_bucket(value: float, scale: int) -> None:
    index = map_to_index(value, scale)
    assert lower_boundary(index, scale) < value <= lower_boundary(index + 1, scale)


@settings(max_examples=200, deadline=None)
@given(value=st.floats(min_value=1e-30, max_value=1e30), scale=st.integers(-10, 20))
def test_index_agrees_with_the_sdk_reference_mapping(value: float, scale: int) -> None:
    import importlib

    package = "opentelemetry.sdk.metrics._internal.exponential_histogram.mapping"
    if scale > 0:
        reference = importlib.import_module(f"{package}.logarithm_mapping").LogarithmMapping(scale)
    else:
        reference = importlib.import_module(f"{package}.exponent_mapping").ExponentMapping(scale)
    assert map_to_index(value, scale) == reference.map_to_index(value)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(durations, min_size=1, max_size=300),
    max_size=st.integers(2, 160),
    max_scale=st.integers(-2, 20),
)
def test_count_sum_min_max_are_exact_and_every_value_is_in_its_bucket(
    values: list[float], max_size: int, max_scale: int
) -> None:
    histogram = ExponentialHistogram(max_scale=max_scale, max_size=max_size)
    for value in values:
        assert histogram.record(value)
    snap = histogram.snapshot()
    assert snap.count == len(values)
    expected_sum = 0.0
    for value in values:
        expected_sum += value
    assert snap.sum == expected_sum
    assert snap.min == min(values)
    assert snap.max == max(values)
    assert len(snap.bucket_counts) <= max_size
    assert snap.scale <= max_scale
    assert snap.zero_count == sum(1 for v in values if v == 0.0)
    assert snap.zero_count + sum(snap.bucket_counts) == snap.count
    expected = collections.Counter(map_to_index(v, snap.scale) for v in values if v > 0.0)
    for position, count in enumerate(snap.bucket_counts):
        index = snap.offset + position
        assert count == expected.get(index, 0)
        if count:
            assert lower_boundary(index, snap.scale) < max(values)
    for value in values:
        if value > 0.0:
            index = map_to_index(value, snap.scale)
            assert snap.offset <= index < snap.offset + len(snap.bucket_counts)
            assert (
                lower_boundary(index, snap.scale) < value <= lower_boundary(index + 1, snap.scale)
            )


@settings(max_examples=150, deadline=None)
@given(values=st.lists(durations, min_size=1, max_size=200), max_size=st.integers(2, 40))
def test_downscaling_merges_buckets_without_losing_counts(
    values: list[float], max_size: int
) -> None:
    fine = ExponentialHistogram(max_scale=8, max_size=100_000)
    coarse = ExponentialHistogram(max_scale=8, max_size=max_size)
    for value in values:
        fine.record(value)
        coarse.record(value)
    fine_snap, coarse_snap = fine.snapshot(), coarse.snapshot()
    change = fine_snap.scale - coarse_snap.scale
    assert change >= 0
    merged: collections.Counter[int] = collections.Counter()
    for position, count in enumerate(fine_snap.bucket_counts):
        merged[(fine_snap.offset + position) >> change] += count
    coarse_counts = {
        coarse_snap.offset + i: c for i, c in enumerate(coarse_snap.bucket_counts) if c
    }
    assert coarse_counts == {k: v for k, v in merged.items() if v}
    assert sum(coarse_snap.bucket_counts) == sum(fine_snap.bucket_counts)


def test_wide_range_downscales_to_fit_max_size() -> None:
    histogram = ExponentialHistogram(max_scale=5, max_size=160)
    for value in (1e-6, 1e-3, 1.0, 1e3):
        histogram.record(value)
    snap = histogram.snapshot()
    assert snap.scale < 5
    assert len(snap.bucket_counts) <= 160
    assert snap.count == 4


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf])
def test_bad_values_are_refused_and_not_recorded(bad: float) -> None:
    histogram = ExponentialHistogram()
    assert not histogram.record(bad)
    assert histogram.snapshot().count == 0


def test_empty_snapshot_and_reset() -> None:
    histogram = ExponentialHistogram(max_scale=3)
    snap = histogram.snapshot()
    assert (snap.count, snap.sum, snap.min, snap.max, snap.bucket_counts) == (0, 0.0, 0.0, 0.0, ())
    histogram.record(0.5)
    histogram.reset()
    assert histogram.snapshot().count == 0
    assert histogram.scale == 3


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"max_scale": 21}, "max_scale"),
        ({"max_scale": -11}, "max_scale"),
        ({"max_size": 1}, "max_size"),
    ],
)
def test_bad_options_raise_config_error_naming_them(options: dict[str, int], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        ExponentialHistogram(**options)


def _significant_bits(value: float) -> int:
    """Bits between the leading and the trailing one bit of ``value``'s mantissa, inclusive."""
    mantissa = int(math.ldexp(math.frexp(value)[0], FLOAT_BITS))
    return FLOAT_BITS - ((mantissa & -mantissa).bit_length() - 1)


@settings(max_examples=400, deadline=None)
@given(
    value=st.floats(min_value=1e-300, max_value=1e300, allow_nan=False),
    bits=st.integers(1, FLOAT_BITS - 1),
)
def test_round_significant_bounds_and_directions(value: float, bits: int) -> None:
    nearest = round_significant(value, bits)
    down = round_significant(value, bits, direction="down")
    up = round_significant(value, bits, direction="up")
    assert down <= value <= up
    assert down <= nearest <= up
    # The stated bounds: 2**-bits to nearest, below 2**(1 - bits) down or up.
    assert abs(nearest - value) <= math.ldexp(value, -bits)
    assert value - down < math.ldexp(value, 1 - bits)
    assert up - value < math.ldexp(value, 1 - bits)
    for rounded in (nearest, down, up):
        assert _significant_bits(rounded) <= bits
        assert round_significant(rounded, bits) == rounded  # idempotent: already on the grid


@pytest.mark.parametrize("value", [0.0, math.inf, -math.inf, 1.7976931348623157e308])
def test_round_significant_leaves_zero_infinities_and_overflow_alone(value: float) -> None:
    assert round_significant(value, 12, direction="up") == value
    assert math.isnan(round_significant(math.nan, 12))
    assert round_significant(0.1, FLOAT_BITS) == 0.1


@settings(max_examples=200, deadline=None)
@given(values=st.lists(durations, min_size=1, max_size=100), bits=st.integers(1, FLOAT_BITS))
def test_rounded_snapshot_still_bounds_every_value(values: list[float], bits: int) -> None:
    histogram = ExponentialHistogram(max_scale=4, max_size=320)
    for value in values:
        histogram.record(value)
    exact = histogram.snapshot()
    rounded = exact.with_significant_bits(bits)
    assert rounded.min <= min(values) and rounded.max >= max(values)
    assert abs(rounded.sum - exact.sum) <= math.ldexp(exact.sum, -bits)
    assert (rounded.count, rounded.zero_count, rounded.scale, rounded.offset) == (
        exact.count,
        exact.zero_count,
        exact.scale,
        exact.offset,
    )
    assert rounded.bucket_counts == exact.bucket_counts
    if len(set(values)) == 1 or bits == FLOAT_BITS:
        assert rounded == exact  # equal values (one observation) are sent exactly


def test_docstring_examples() -> None:
    import doctest

    from stepwatch.exporters import _histogram

    result = doctest.testmod(_histogram)
    assert result.attempted > 0
    assert result.failed == 0


# Values with bad ones mixed in, and values sitting exactly on (or one ulp off) bucket
# boundaries, where the inlined fast path of record() must defer to map_to_index().
_boundary_values = st.builds(
    lambda index, scale, ulps: (
        math.nextafter(lower_boundary(index, scale), math.inf if ulps > 0 else -math.inf)
        if ulps
        else lower_boundary(index, scale)
    ),
    st.integers(-400, 200),
    st.integers(1, 8),
    st.integers(-1, 1),
)
_mixed_values = st.one_of(
    durations, _boundary_values, st.sampled_from([-1.0, math.nan, math.inf, -math.inf])
)


@settings(max_examples=200, deadline=None)
@given(
    batches=st.lists(st.lists(_mixed_values, max_size=60), min_size=1, max_size=5),
    max_size=st.integers(2, 160),
    max_scale=st.integers(-2, 20),
)
def test_record_many_equals_record_one_by_one(
    batches: list[list[float]], max_size: int, max_scale: int
) -> None:
    one_by_one = ExponentialHistogram(max_scale=max_scale, max_size=max_size)
    batched = ExponentialHistogram(max_scale=max_scale, max_size=max_size)
    for batch in batches:
        refused = sum(1 for value in batch if not one_by_one.record(value))
        assert batched.record_many(batch) == refused
        assert batched.snapshot() == one_by_one.snapshot()
        assert batched.count == one_by_one.count


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_boundary_values, min_size=1, max_size=50), max_scale=st.integers(1, 8))
def test_boundary_values_land_where_map_to_index_puts_them(
    values: list[float], max_scale: int
) -> None:
    histogram = ExponentialHistogram(max_scale=max_scale, max_size=100_000)
    for value in values:
        histogram.record(value)
    snap = histogram.snapshot()
    expected = collections.Counter(map_to_index(v, snap.scale) for v in values if v > 0.0)
    got = {snap.offset + i: c for i, c in enumerate(snap.bucket_counts) if c}
    assert got == dict(expected)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(durations, min_size=1, max_size=200), bits=st.integers(1, FLOAT_BITS))
def test_snapshot_buckets_are_the_dense_counts_whatever_the_path(
    values: list[float], bits: int
) -> None:
    # snapshot() fills sparse histograms from their few buckets and dense ones by index:
    # both must give every bucket from the lowest to the highest, zeros included.
    histogram = ExponentialHistogram(max_scale=5, max_size=160)
    histogram.record_many(values)
    snap = histogram.snapshot()
    counts = histogram._counts
    if counts:  # else every value was zero
        low, high = min(counts), max(counts)
        assert snap.offset == low
        assert snap.bucket_counts == tuple(counts.get(i, 0) for i in range(low, high + 1))
    else:
        assert snap.bucket_counts == ()
    assert sum(snap.bucket_counts) + snap.zero_count == snap.count == len(values)
    # Rounding only the sum (min/max not sent) leaves them exact and the sum as rounded.
    both, only_sum = (
        snap.with_significant_bits(bits),
        snap.with_significant_bits(bits, bounds=False),
    )
    assert only_sum.sum == both.sum
    assert (only_sum.min, only_sum.max) == (snap.min, snap.max)
