"""Base-2 exponential histogram aggregation (the OTLP ``ExponentialHistogram`` data model).

A bucket at ``scale`` with index ``i`` holds the values in ``(base**i, base**(i + 1)]`` where
``base = 2 ** (2 ** -scale)`` (OTLP metrics data model, "ExponentialHistogram":
https://opentelemetry.io/docs/specs/otel/metrics/data-model/#exponentialhistogram). When the
occupied index range grows past ``max_size`` buckets the histogram *downscales*: the scale drops
by ``k`` and index ``i`` becomes ``i >> k``, merging ``2**k`` neighbouring buckets without losing
any count.

Durations are never negative, so this aggregator keeps positive buckets and a zero count only;
negative and non-finite values are refused (``record`` returns ``False``) and the caller counts
them.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, NamedTuple

from stepwatch.core._errors import ConfigError
from stepwatch.exporters import _cext

MIN_SCALE = -10
MAX_SCALE = 20
_MIN_NORMAL = sys.float_info.min
_SCALE_FACTORS = {
    scale: math.ldexp(1.0 / math.log(2.0), scale) for scale in range(1, MAX_SCALE + 1)
}
# |log(v) * 2**scale / ln 2| < 2**30 for normal floats; its rounding error stays far below this.
_BOUNDARY_MARGIN = 1e-5
_UPPER_MARGIN = 1.0 - _BOUNDARY_MARGIN
_ZEROS = itertools.repeat(0)  # endless default argument for dict.get in snapshot()
_INF = math.inf
_log = math.log
_floor = math.floor
FLOAT_BITS = 53
"""Significant bits of a float64: rounding to this many changes nothing."""

_SEQUENCES = (list, tuple)  # what the C loops (exporters/csrc/fasthist.c) take

_fasthist = _cext.fasthist  # None: not built (no C compiler), or STEPWATCH_EXPORTERS_NO_C
if _fasthist is not None and (
    _fasthist.SCALE_FACTORS != _SCALE_FACTORS
    or (_fasthist.MIN_NORMAL, _fasthist.BOUNDARY_MARGIN, _fasthist.UPPER_MARGIN)
    != (_MIN_NORMAL, _BOUNDARY_MARGIN, _UPPER_MARGIN)
):  # pragma: no cover - a C library whose log() differs from the one math uses
    _fasthist = None  # type: ignore[assignment]
AVAILABLE: bool = _fasthist is not None
"""``record_many`` and ``record_weighted`` run their loops in C (tests set ``_fasthist`` to
None for the Python loops, which give the same results)."""

_ROUNDERS: dict[str, Callable[[float], int]] = {
    "nearest": round,
    "down": math.floor,
    "up": math.ceil,
}


def round_significant(
    value: float, bits: int, *, direction: Literal["nearest", "down", "up"] = "nearest"
) -> float:
    """``value`` rounded to a float with at most ``bits`` significant bits.

    Why: a float64 with few significant bits ends in zero bytes, and the OTLP encoding of a
    ``double`` is its 8 little-endian bytes, so those zeros become back-references for gzip.
    The relative error is at most ``2**-bits`` rounding to nearest and below ``2**(1 - bits)``
    rounding down or up (12 bits: 0.024 % and 0.049 %).

    Args:
        value: Any float; zero, NaN and infinities are returned unchanged.
        bits: Significant bits kept, ``1 <= bits``; ``FLOAT_BITS`` or more keeps every value.
        direction: ``nearest`` (ties to even), ``down`` (the result is ``<= value``) or
            ``up`` (the result is ``>= value``).

    Returns:
        The rounded value.

    Example:
        >>> round_significant(0.1, 4), round_significant(0.1, 4, direction="down")
        (0.1015625, 0.09375)
    """
    if bits >= FLOAT_BITS or value == 0.0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)  # |mantissa| in [0.5, 1): `bits` bits sit above 1
    whole = _ROUNDERS[direction](math.ldexp(mantissa, bits))
    try:
        return math.ldexp(whole, exponent - bits)
    except OverflowError:  # rounding up past the largest float: the value itself is an upper bound
        return value


def map_to_index(value: float, scale: int) -> int:
    """Index of the bucket holding a positive, finite ``value`` at ``scale``.

    Args:
        value: A positive normal float.
        scale: The histogram scale, ``MIN_SCALE <= scale <= MAX_SCALE``.

    Returns:
        ``i`` such that ``lower_boundary(i, scale) < value <= lower_boundary(i + 1, scale)``.
    """
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    ieee_exponent = exponent - 1  # value = (2 * mantissa) * 2**ieee_exponent
    if scale <= 0:
        # Exact: bucket boundaries are powers of two. An exact power of two is the *upper*
        # (inclusive) boundary of the bucket below.
        exact = 1 if mantissa == 0.5 else 0
        return (ieee_exponent - exact) >> -scale
    if mantissa == 0.5:
        return (ieee_exponent << scale) - 1
    position = math.log(value) * _SCALE_FACTORS[scale]
    index = math.floor(position)
    fraction = position - index
    if _BOUNDARY_MARGIN < fraction < 1.0 - _BOUNDARY_MARGIN:
        return index  # far from a boundary: log()'s rounding error cannot matter
    # Near a boundary log() may be off by one: decide against the boundary function itself,
    # so that map_to_index and lower_boundary never disagree.
    if value <= lower_boundary(index, scale):
        index -= 1
    elif value > lower_boundary(index + 1, scale):
        index += 1
    return index


def lower_boundary(index: int, scale: int) -> float:
    """The exclusive lower bound ``base**index`` of bucket ``index`` at ``scale``.

    ``math.inf`` past the float range (the top bucket's upper bound at coarse scales).
    """
    try:
        if scale <= 0:
            return math.ldexp(1.0, index << -scale)
        whole, fraction = divmod(index, 1 << scale)
        return math.ldexp(2.0 ** (fraction / (1 << scale)), whole)
    except OverflowError:
        return math.inf


class HistogramSnapshot(NamedTuple):
    """The state of one exponential histogram, ready to become one OTLP data point.

    A named tuple, not a frozen dataclass: the export thread makes one per series per window
    (~26 in a window with 20 kernel classes), and a frozen dataclass' ``__init__`` (one
    ``object.__setattr__`` per field) cost ~5x a tuple's (bench/export_cost.py).

    Attributes:
        count: Number of recorded values (``zero_count + sum(bucket_counts)``).
        sum: Sum of the recorded values.
        min: Smallest recorded value (``0.0`` when empty).
        max: Largest recorded value (``0.0`` when empty).
        scale: Resolution of the buckets.
        zero_count: Values recorded as zero.
        offset: Index of ``bucket_counts[0]``.
        bucket_counts: Dense counts of the positive buckets from ``offset`` upwards.
    """

    count: int  # type: ignore[assignment]  # shadows tuple.count, unused on snapshots
    sum: float
    min: float
    max: float
    scale: int
    zero_count: int
    offset: int
    bucket_counts: tuple[int, ...]

    def with_significant_bits(self, bits: int, *, bounds: bool = True) -> HistogramSnapshot:
        """The snapshot with ``sum``, ``min`` and ``max`` rounded to ``bits`` significant bits.

        ``min`` rounds down and ``max`` rounds up, so they still bound every recorded value
        (readers clamp quantile estimates to them; detectors read ``max``); ``sum`` rounds to
        nearest. Counts and buckets are unchanged. See :func:`round_significant` for the bound.
        When every recorded value is equal (``min == max``, e.g. one observation) nothing is
        rounded: the three fields then repeat one double, which gzip stores once anyway, and a
        single observation reads back exactly.

        Args:
            bits: Significant bits kept, ``1 <= bits``.
            bounds: Round ``min`` and ``max`` too (``False``: only ``sum``, for a point that
                will not carry them: the kernel points by default).

        Returns:
            The rounded snapshot (``self`` when ``bits >= FLOAT_BITS`` or ``min == max``).
        """
        if bits >= FLOAT_BITS or self.min == self.max:
            return self
        if not bounds:
            return self._replace(sum=round_significant(self.sum, bits))
        return self._replace(
            sum=round_significant(self.sum, bits),
            min=round_significant(self.min, bits, direction="down"),
            max=round_significant(self.max, bits, direction="up"),
        )


class ExponentialHistogram:
    """Aggregates non-negative values into a base-2 exponential histogram.

    Not thread-safe: one owner (the export thread's window builder).

    Args:
        max_scale: Starting (finest) scale; the histogram only ever downscales from here.
        max_size: Most positive buckets kept; a wider value range lowers the scale.

    Raises:
        ConfigError: ``max_scale`` or ``max_size`` out of range.
    """

    def __init__(self, *, max_scale: int = 5, max_size: int = 160) -> None:
        if not MIN_SCALE <= max_scale <= MAX_SCALE:
            raise ConfigError(f"max_scale must be in [{MIN_SCALE}, {MAX_SCALE}], got {max_scale}")
        if max_size < 2:
            raise ConfigError(f"max_size must be at least 2, got {max_size}")
        self._max_scale = max_scale
        self._max_size = max_size
        self.reset()

    def reset(self) -> None:
        """Forget every value and return to ``max_scale``."""
        self._scale = self._max_scale
        self._counts: dict[int, int] = {}
        self._low = 0
        self._high = -1
        self._count = 0
        self._zero_count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf

    @property
    def count(self) -> int:
        """Number of values recorded since the last reset."""
        return self._count

    @property
    def scale(self) -> int:
        """Current scale."""
        return self._scale

    def record(self, value: float) -> bool:
        """Add one value.

        The common case (a positive scale, a value away from a bucket boundary, an index
        inside the occupied range) is inlined here: this runs once per phase, step and kernel
        observation on the export thread. Everything else takes :func:`map_to_index`.

        Args:
            value: A finite, non-negative number.

        Returns:
            ``False`` (and nothing recorded) when the value is negative, NaN or infinite.
        """
        if not (value >= 0.0 and value != _INF):  # also rejects NaN
            return False
        self._count += 1
        self._sum += value
        if value < self._min:
            self._min = value
        if value > self._max:
            self._max = value
        if value < _MIN_NORMAL:
            self._zero_count += 1
            return True
        scale = self._scale
        if scale > 0:
            position = _log(value) * _SCALE_FACTORS[scale]
            index = _floor(position)
            fraction = position - index
            if not (_BOUNDARY_MARGIN < fraction < _UPPER_MARGIN):
                index = map_to_index(value, scale)  # near a boundary (or a power of two)
        else:
            index = map_to_index(value, scale)
        counts = self._counts
        if not self._low <= index <= self._high:
            index = self._widen(index)
            counts = self._counts
        counts[index] = counts.get(index, 0) + 1
        return True

    def _widen(self, index: int) -> int:
        """Grow the occupied range to hold ``index``, downscaling if needed; the new index."""
        if not self._counts:
            self._low = self._high = index
            return index
        low = min(self._low, index)
        high = max(self._high, index)
        change = _downscale_needed(low, high, self._max_size)
        if change:
            self._downscale(change)
            index >>= change
            low >>= change
            high >>= change
        self._low, self._high = low, high
        return index

    def record_many(self, values: Iterable[float]) -> int:
        """Add every value; the same result as :meth:`record` on each in turn, faster.

        Args:
            values: Durations; negative, NaN and infinite ones are refused.

        Returns:
            How many values were refused (not recorded).
        """
        refused = 0
        if _fasthist is not None and (type(values) is list or type(values) is tuple):
            refused, done = _fasthist.record_many(self, values)
            if done == len(values):
                return refused
            values = values[done:]  # from a value the C leaves (not a float) on
        count = self._count
        total = self._sum
        smallest = self._min
        largest = self._max
        zero_count = self._zero_count
        counts = self._counts
        scale = self._scale
        factor = _SCALE_FACTORS[scale] if scale > 0 else 0.0
        low = self._low
        high = self._high
        get = counts.get
        try:
            for value in values:
                if not (value >= 0.0 and value != _INF):
                    refused += 1
                    continue
                count += 1
                total += value
                if value < smallest:
                    smallest = value
                if value > largest:
                    largest = value
                if value < _MIN_NORMAL:
                    zero_count += 1
                    continue
                if factor:
                    position = _log(value) * factor
                    index = _floor(position)
                    fraction = position - index
                    if not (_BOUNDARY_MARGIN < fraction < _UPPER_MARGIN):
                        index = map_to_index(value, scale)
                else:
                    index = map_to_index(value, scale)
                if low <= index <= high:
                    counts[index] = get(index, 0) + 1
                    continue
                index = self._widen(index)  # outside the occupied range: may downscale
                counts = self._counts
                get = counts.get
                counts[index] = get(index, 0) + 1
                scale = self._scale
                factor = _SCALE_FACTORS[scale] if scale > 0 else 0.0
                low, high = self._low, self._high
        finally:
            self._count, self._sum, self._min, self._max = count, total, smallest, largest
            self._zero_count = zero_count
        return refused

    def record_weighted(self, values: Sequence[float], weights: Sequence[int]) -> int:
        """Add each value as if recorded ``weight`` times (a sampled step standing for others).

        The same state as :meth:`record` called ``weight`` times per value. Returns how many
        values were refused (negative, NaN or infinite; their weights are not counted).
        """
        if len(values) != len(weights):
            raise ValueError("values and weights differ in length")
        refused = 0
        if _fasthist is not None and type(values) in _SEQUENCES and type(weights) in _SEQUENCES:
            refused, done = _fasthist.record_weighted(self, values, weights)
            if done == len(values):
                return refused
            values, weights = values[done:], weights[done:]  # from a value the C leaves on
        if all(weight == 1 for weight in weights):  # every step timed: the fast path
            return refused + self.record_many(values)
        for value, weight in zip(values, weights, strict=True):
            if weight <= 0:
                continue
            if not (value >= 0.0 and value != _INF):
                refused += 1
                continue
            self._count += weight
            self._sum += value * weight
            if value < self._min:
                self._min = value
            if value > self._max:
                self._max = value
            if value < _MIN_NORMAL:
                self._zero_count += weight
                continue
            index = map_to_index(value, self._scale)
            if not self._low <= index <= self._high:
                index = self._widen(index)
            self._counts[index] = self._counts.get(index, 0) + weight
        return refused

    def _downscale(self, change: int) -> None:
        merged: dict[int, int] = {}
        for index, count in self._counts.items():
            merged[index >> change] = merged.get(index >> change, 0) + count
        self._counts = merged
        self._scale -= change

    def snapshot(self) -> HistogramSnapshot:
        """The current state as an immutable value."""
        counts = self._counts
        if counts:
            offset = low = self._low
            width = self._high - low + 1
            if len(counts) * 4 < width:  # sparse (a few executions over many buckets)
                dense = [0] * width
                for index, count in counts.items():
                    dense[index - low] = count
                buckets = tuple(dense)
            else:
                buckets = tuple(map(counts.get, range(low, low + width), _ZEROS))
        else:
            offset, buckets = 0, ()
        empty = self._count == 0
        return HistogramSnapshot(
            count=self._count,
            sum=self._sum,
            min=0.0 if empty else self._min,
            max=0.0 if empty else self._max,
            scale=self._scale,
            zero_count=self._zero_count,
            offset=offset,
            bucket_counts=buckets,
        )


def _downscale_needed(low: int, high: int, max_size: int) -> int:
    change = 0
    while (high >> change) - (low >> change) + 1 > max_size:
        change += 1
    return change


EXPLICIT_GRID_SCALE = 3
"""The fixed log-spaced bounds of explicit buckets: ``2 ** (i / 8)`` for every integer ``i``,
the bucket boundaries of an exponential histogram at scale 3 (ratio 1.0905 between bounds), so
the bridge's midpoint quantile estimate is off by at most ``(2 ** (1 / 8) - 1) / 2`` = 4.5 %."""

MAX_EXPLICIT_BOUNDS = 48
"""Most bounds on one explicit point. A window whose values span more than ~5.9 octaves in one
series is sent at the next coarser grid (every second bound: 9.5 % error, then 19 %, ...)."""


def explicit_layout(
    snapshot: HistogramSnapshot, *, max_bounds: int = MAX_EXPLICIT_BOUNDS, contiguous: bool = False
) -> tuple[list[float], list[int]]:
    """``(explicit_bounds, bucket_counts)`` of ``snapshot`` on the fixed grid.

    Only the grid bounds that edge a populated bucket are listed (plus ``0`` when zeros were
    recorded), so the empty buckets between them, below them and above them (``+Inf``) hold
    nothing: every observation stays in its grid bucket ``(bound[i-1], bound[i]]`` (OTLP
    explicit buckets are upper-inclusive, like exponential ones). A bucket at a finer scale
    than the grid lies inside one grid bucket; at a coarser scale it spans several grid
    buckets and is sent whole, edged by grid bounds. The bounds of every point are drawn from
    one table, so a reader (a Collector's influxdb exporter: one field per bound) sees the same
    keys in every window.

    Args:
        snapshot: The exponential histogram's state.
        max_bounds: Most bounds returned; the grid coarsens (halves) until they fit.
        contiguous: For a CUMULATIVE series, whose reader differences two totals and needs
            equal bounds to do so: every grid bound from the octave below the lowest populated
            bucket to the octave above the highest (whole octaves; without the spare octaves,
            then without rounding, when they do not fit), and always ``0``. The bounds then
            change only when a value falls outside those octaves or the grid coarsens.

    Returns:
        Ascending finite bounds and ``len(bounds) + 1`` counts.
    """
    if max_bounds < 3:
        raise ConfigError(f"max_bounds must be >= 3, got {max_bounds}")
    level = min(snapshot.scale, EXPLICIT_GRID_SCALE)
    shift = snapshot.scale - level  # snapshot buckets inside one level bucket: 2**shift
    buckets: dict[int, int] = {}
    for position, count in enumerate(snapshot.bucket_counts):
        if count:
            index = (snapshot.offset + position) >> shift
            buckets[index] = buckets.get(index, 0) + count
    zero_bound = 1 if snapshot.zero_count or contiguous else 0
    while True:
        if contiguous and buckets:
            edges = _padded_edges(min(buckets), max(buckets) + 1, level, max_bounds - zero_bound)
        else:
            edges = {index for index in buckets} | {index + 1 for index in buckets}
        if len(edges) + zero_bound <= max_bounds or level <= MIN_SCALE:
            break
        level -= 1
        merged: dict[int, int] = {}
        for index, count in buckets.items():
            merged[index >> 1] = merged.get(index >> 1, 0) + count
        buckets = merged
    factor = EXPLICIT_GRID_SCALE - level  # >= 0: the grid is never finer than a level bucket
    ordered = sorted(edges)
    bounds = [lower_boundary(edge << factor, EXPLICIT_GRID_SCALE) for edge in ordered]
    slot = {edge: number for number, edge in enumerate(ordered)}
    counts = [0] * (len(bounds) + 1)
    for index, count in buckets.items():
        # bucket ``index`` is (bound of edge index, bound of edge index + 1]: counts[i] is the
        # interval (bounds[i - 1], bounds[i]], so it sits at its upper edge's position
        counts[slot[index + 1]] += count
    if zero_bound:
        bounds.insert(0, 0.0)
        counts.insert(0, snapshot.zero_count)
    if any(math.isinf(value) for value in bounds):
        raise ConfigError("explicit_layout: a bound overflows a float")
    return bounds, counts


def merge_snapshots(
    total: HistogramSnapshot, window: HistogramSnapshot, *, max_size: int
) -> HistogramSnapshot:
    """``total`` plus ``window``: the running histogram of a CUMULATIVE series.

    Both are brought to the smaller of their scales (index ``i`` becomes ``i >> shift``: the
    data model's downscaling, "ExponentialHistogram" → "Scale"), their counts added, and the
    result downscaled further until its occupied range fits ``max_size`` buckets. That is the
    histogram one aggregator would hold after recording the values of both (same scale, same
    buckets: tests/exporters/test_cumulative.py), and its scale never rises, so a reader can
    difference two successive totals (its buckets map onto the newer, coarser ones).
    ``min``/``max`` are the smallest and largest over both; ``sum`` is their sum.

    Args:
        total: The running histogram (may be empty).
        window: One window's histogram (may be empty).
        max_size: Most positive buckets in the result.

    Returns:
        The merged snapshot; ``total`` itself when ``window`` is empty.
    """
    if window.count == 0:
        return total
    if total.count == 0 and window.scale <= total.scale:
        return window
    scale = min(total.scale, window.scale)
    counts: dict[int, int] = {}
    for snap in (total, window):
        shift = snap.scale - scale
        for position, count in enumerate(snap.bucket_counts):
            if count:
                index = (snap.offset + position) >> shift
                counts[index] = counts.get(index, 0) + count
    if counts:
        change = _downscale_needed(min(counts), max(counts), max_size)
        if change:
            scale -= change
            merged: dict[int, int] = {}
            for index, count in counts.items():
                merged[index >> change] = merged.get(index >> change, 0) + count
            counts = merged
        low, high = min(counts), max(counts)
        offset, buckets = low, tuple(counts.get(i, 0) for i in range(low, high + 1))
    else:
        offset, buckets = 0, ()
    extremes = [snap for snap in (total, window) if snap.count]
    return HistogramSnapshot(
        count=total.count + window.count,
        sum=total.sum + window.sum,
        min=min(snap.min for snap in extremes),
        max=max(snap.max for snap in extremes),
        scale=scale,
        zero_count=total.zero_count + window.zero_count,
        offset=offset,
        bucket_counts=buckets,
    )


def _padded_edges(low: int, high: int, level: int, room: int) -> set[int]:
    """Grid edges ``low..high`` at ``level``, widened to whole octaves plus one spare octave
    on each side when they fit in ``room``, else to whole octaves, else as they are."""
    per = 1 << level if level > 0 else 1  # level buckets per octave
    for pad in (1, 0):
        first = (low // per - pad) * per
        last = (-(-high // per) + pad) * per
        if last - first + 1 <= room:
            return set(range(first, last + 1))
    return set(range(low, high + 1))
