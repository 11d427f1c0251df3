"""The C loops of ``record_many`` / ``record_weighted`` (``_fasthist``) against the Python loops.

Every case records the same values into two histograms, one through the C extension and one
with ``_histogram._fasthist`` set to None (the Python loops, what runs where the extension is
not built), and compares the whole state: count, the sum's bits, min and max (bits and type),
zero count, scale, occupied range, the bucket dict (items in insertion order) and the refused
count, or the exception both raise. The values aim at the edges: zero and -0.0, subnormals,
negative, NaN, infinities, extreme magnitudes (downscaling), powers of two and other exact
bucket boundaries and their neighbours. Without the extension the C cases are skipped; the
Python path is still checked against :meth:`ExponentialHistogram.record`.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.exporters import _histogram
from stepwatch.exporters._histogram import (
    MAX_SCALE,
    MIN_SCALE,
    ExponentialHistogram,
    lower_boundary,
)

needs_c = pytest.mark.skipif(
    not _histogram.AVAILABLE,
    reason="stepwatch.exporters._fasthist not built (no C compiler when installed)",
)


def _bits(value: object) -> object:
    """A float by its bits (0.0 vs -0.0, the last ulp), anything else as itself, with its type."""
    if isinstance(value, float):
        return ("float", struct.pack("<d", value).hex())
    return (type(value).__name__, value)


def state(histogram: ExponentialHistogram) -> tuple[object, ...]:
    """Everything the loops write, exactly."""
    return (
        _bits(histogram._count),
        _bits(histogram._sum),
        _bits(histogram._min),
        _bits(histogram._max),
        _bits(histogram._zero_count),
        histogram._scale,
        histogram._low,
        histogram._high,
        [(_bits(key), _bits(count)) for key, count in histogram._counts.items()],
        histogram.snapshot(),
    )


@pytest.fixture
def python_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Python loops only (as without the extension)."""
    monkeypatch.setattr(_histogram, "_fasthist", None)
    yield


def _outcome(call: Callable[[], int]) -> object:
    try:
        return call()
    except Exception as exc:  # both paths must raise the same
        return (type(exc), str(exc))


def run_both(
    fast: ExponentialHistogram,
    slow: ExponentialHistogram,
    call: Callable[[ExponentialHistogram], int],
) -> None:
    """``call`` on ``fast`` with the extension, on ``slow`` without; same outcome and state."""
    assert _histogram._fasthist is not None
    fast_result = _outcome(lambda: call(fast))
    saved = _histogram._fasthist
    _histogram._fasthist = None
    try:
        slow_result = _outcome(lambda: call(slow))
    finally:
        _histogram._fasthist = saved
    assert fast_result == slow_result
    assert state(fast) == state(slow)


def _pair(max_scale: int, max_size: int) -> tuple[ExponentialHistogram, ExponentialHistogram]:
    return (
        ExponentialHistogram(max_scale=max_scale, max_size=max_size),
        ExponentialHistogram(max_scale=max_scale, max_size=max_size),
    )


def _boundary(index_scale: tuple[int, int]) -> float:
    value = lower_boundary(*index_scale)
    return value if 0.0 < value < math.inf else 1.0


_MIN_NORMAL = sys.float_info.min
boundaries = st.builds(  # exact bucket boundaries base**k at a positive scale
    _boundary, st.tuples(st.integers(-1022 * 8, 1023 * 8), st.integers(1, 3))
) | st.builds(
    lambda k, scale: _boundary((k, scale)), st.integers(-2000, 2000), st.integers(4, MAX_SCALE)
)
edge_values = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324]),
    st.sampled_from([_MIN_NORMAL, math.nextafter(_MIN_NORMAL, 0.0), sys.float_info.max]),
    st.floats(min_value=5e-324, max_value=_MIN_NORMAL, exclude_max=True),  # subnormals
    st.integers(-1074, 1023).map(lambda e: math.ldexp(1.0, e)),  # powers of two
    boundaries,
    boundaries.map(lambda v: math.nextafter(v, math.inf)),
    boundaries.map(lambda v: math.nextafter(v, 0.0)),
    st.floats(min_value=1e-300, max_value=1e300),  # magnitudes that force downscaling
    st.floats(),  # anything, negative and non-finite included
)
durations = st.one_of(
    st.floats(min_value=1e-7, max_value=10.0),
    st.floats(min_value=0.015, max_value=0.025),  # a training step's 20 ms, jittered
)
values_lists = st.lists(st.one_of(edge_values, durations), max_size=200)
scales = st.integers(MIN_SCALE, MAX_SCALE)
sizes = st.sampled_from([2, 3, 4, 8, 20, 160, 300, 2000])  # 300, 2000: buffers on the heap
FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@needs_c
@FAST
@given(batches=st.lists(values_lists, min_size=1, max_size=3), max_scale=scales, max_size=sizes)
def test_record_many_matches_python(
    batches: list[list[float]], max_scale: int, max_size: int
) -> None:
    fast, slow = _pair(max_scale, max_size)
    for values in batches:
        run_both(fast, slow, lambda h: h.record_many(values))  # noqa: B023 - called at once
        run_both(fast, slow, lambda h: h.record_many(tuple(reversed(values))))  # noqa: B023
    # The C itself took every value (no silent fallback to the Python loop makes this pass).
    probe, _ = _pair(max_scale, max_size)
    assert _fast().record_many(probe, batches[0])[1] == len(batches[0])


def _fast() -> Any:
    assert _histogram._fasthist is not None
    return _histogram._fasthist


weight_items = st.one_of(
    st.integers(-3, 12),
    st.sampled_from([0, 1, 1, 1, 2**40, 2**41, 2**70, -(2**70)]),  # past the C's 2**40: Python
)


@needs_c
@FAST
@given(data=st.data(), values=values_lists, max_scale=scales, max_size=sizes, ones=st.booleans())
def test_record_weighted_matches_python(
    data: st.DataObject, values: list[float], max_scale: int, max_size: int, ones: bool
) -> None:
    size = len(values)
    weights = (
        [1] * size if ones else data.draw(st.lists(weight_items, min_size=size, max_size=size))
    )
    fast, slow = _pair(max_scale, max_size)
    run_both(fast, slow, lambda h: h.record_many(values[: size // 2]))
    run_both(fast, slow, lambda h: h.record_weighted(values, weights))
    run_both(fast, slow, lambda h: h.record_weighted(tuple(values), tuple(weights)))
    if all(weight <= 2**40 for weight in weights):
        probe, _ = _pair(max_scale, max_size)
        assert _fast().record_weighted(probe, values, weights)[1] == size


odd_items = st.sampled_from(
    [1, 0, -2, True, False, 3, 2**60, 10**400, "x", None, 1.5, 0.0]  # 10**400: OverflowError
)


@needs_c
@FAST
@given(
    values=st.lists(st.one_of(edge_values, durations, odd_items), max_size=60),
    weights=st.lists(st.one_of(weight_items, st.sampled_from([1.0, 0.5, True, -1.5])), max_size=60),
    max_scale=scales,
    max_size=sizes,
)
def test_other_types_and_errors_match_python(
    values: list[Any], weights: list[Any], max_scale: int, max_size: int
) -> None:
    """Ints, bools, huge ints, strings, float weights: the C stops there and the Python loop
    goes on from that value, so results and exceptions (TypeError, OverflowError, ValueError
    for unequal lengths) are the Python's, with the same state left behind."""
    fast, slow = _pair(max_scale, max_size)
    run_both(fast, slow, lambda h: h.record_many(values))
    run_both(fast, slow, lambda h: h.record_many([0.5, 2.0, 1e-9]))  # after an int min/max/sum
    run_both(fast, slow, lambda h: h.record_weighted(values, weights))
    paired = weights[: len(values)] + [1] * (len(values) - len(weights))
    run_both(fast, slow, lambda h: h.record_weighted(values, paired))
    run_both(fast, slow, lambda h: h.record_many(iter(values)))  # not a list: the Python loop


@needs_c
def test_the_c_declines_what_it_does_not_read() -> None:
    histogram = ExponentialHistogram()
    assert _fast().record_many(histogram, [0.5, 1, 0.25]) == (0, 1)  # stops at the int
    assert (histogram.count, histogram._counts) == (1, {-33: 1})  # 0.5 at scale 5
    assert _fast().record_weighted(histogram, [0.5], [1.0]) == (0, 0)  # a float weight
    assert _fast().record_many(histogram, iter([0.5])) == (0, 0)  # not a list or tuple
    assert histogram.count == 1
    assert histogram.record_many([2]) == 0  # an int max: the C leaves such a histogram ...
    assert histogram._max == 2 and type(histogram._max) is int
    assert _fast().record_many(histogram, [0.5]) == (0, 0)  # ... to the Python loop
    fresh = ExponentialHistogram()
    assert _fast().record_weighted(fresh, [0.5, -1.0, 0.25], [2, 5, 0]) == (1, 3)
    assert (fresh.count, fresh._counts, fresh._sum) == (2, {-33: 2}, 1.0)


@needs_c
def test_the_c_constants_are_the_pythons() -> None:
    fast = _fast()
    assert fast.SCALE_FACTORS == _histogram._SCALE_FACTORS
    assert fast.MIN_NORMAL == _histogram._MIN_NORMAL
    assert (fast.BOUNDARY_MARGIN, fast.UPPER_MARGIN) == (
        _histogram._BOUNDARY_MARGIN,
        _histogram._UPPER_MARGIN,
    )
    assert (fast.MIN_SCALE, fast.MAX_SCALE) == (MIN_SCALE, MAX_SCALE)


@needs_c
def test_the_methods_go_through_the_c(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = _fast()

    class Spy:
        def record_many(self, *args: Any) -> tuple[int, int]:
            calls.append("many")
            return real.record_many(*args)  # type: ignore[no-any-return]

        def record_weighted(self, *args: Any) -> tuple[int, int]:
            calls.append("weighted")
            return real.record_weighted(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(_histogram, "_fasthist", Spy())
    histogram = ExponentialHistogram()
    assert histogram.record_many([0.02, 0.021, -1.0]) == 1
    assert histogram.record_weighted([0.02, 0.03], [3, 0]) == 0
    assert calls == ["many", "weighted"]
    assert histogram.count == 5


def _one_by_one(values: list[float], weights: list[int], max_scale: int, max_size: int) -> Any:
    """What :meth:`ExponentialHistogram.record`, once per observation, leaves; refused values."""
    histogram = ExponentialHistogram(max_scale=max_scale, max_size=max_size)
    refused = 0
    for value, weight in zip(values, weights, strict=True):
        accepted = [histogram.record(value) for _ in range(weight)]
        refused += not all(accepted)
    return histogram, refused


@pytest.mark.parametrize("fast", [True, False], ids=["default", "python"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    values=st.lists(st.one_of(edge_values, durations), max_size=80),
    max_scale=scales,
    max_size=sizes,
)
def test_batches_equal_one_record_per_observation(
    fast: bool, data: st.DataObject, values: list[float], max_scale: int, max_size: int
) -> None:
    """Whichever path runs by default, and the Python loops forced, against ``record``.

    Runs without the extension too (both are the Python loops then)."""
    weights = data.draw(st.lists(st.integers(0, 3), min_size=len(values), max_size=len(values)))
    saved = _histogram._fasthist
    if not fast:
        _histogram._fasthist = None
    try:
        many = ExponentialHistogram(max_scale=max_scale, max_size=max_size)
        refused_many = many.record_many(values)
        weighted = ExponentialHistogram(max_scale=max_scale, max_size=max_size)
        refused_weighted = weighted.record_weighted(values, weights)
    finally:
        _histogram._fasthist = saved
    reference, refused = _one_by_one(values, [1] * len(values), max_scale, max_size)
    assert (refused_many, state(many)) == (refused, state(reference))
    expected, refused = _one_by_one(values, weights, max_scale, max_size)
    assert refused_weighted == refused
    # value * weight rounds once where ``weight`` additions round ``weight`` times: the sum
    # may differ in its last bits, nothing else may.
    got, want = weighted.snapshot(), expected.snapshot()
    assert math.isclose(got.sum, want.sum, rel_tol=1e-12)
    assert got._replace(sum=0.0) == want._replace(sum=0.0)


@pytest.mark.usefixtures("python_path")
def test_python_path_when_forced_off() -> None:
    """``_fasthist = None`` (as without the extension): both methods still work."""
    assert _histogram._fasthist is None
    histogram = ExponentialHistogram(max_scale=0)
    assert histogram.record_many([0.0, 1.0, 2.0, 3.0, -1.0, math.nan]) == 2
    assert histogram.record_weighted([4.0, math.inf, 0.5], [2, 1, 0]) == 1
    with pytest.raises(ValueError, match="differ in length"):
        histogram.record_weighted([1.0], [])
    snap = histogram.snapshot()
    assert (snap.count, snap.sum, snap.min, snap.max, snap.zero_count) == (6, 14.0, 0.0, 4.0, 1)
    assert (snap.scale, snap.offset, snap.bucket_counts) == (0, -1, (1, 1, 3))
