"""Cumulative histogram buckets: bounds as field keys, nearest-rank quantiles, explicit and
exponential layouts.

OTLP data model: https://opentelemetry.io/docs/specs/otel/metrics/data-model/#histogram and
#exponentialhistogram. A layout the bridge cannot store raises :class:`Rejected`
(``bucket_layout``), a ``ValueError``.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Sequence
from decimal import Decimal
from typing import NamedTuple

from stepwatch.otel_bridge._reasons import REASON_BUCKET_LAYOUT, Rejected

# Exponential histograms wider than this are refused: each bucket becomes a field.
MAX_BUCKETS = 4096


@functools.lru_cache(maxsize=65_536)
def format_bound(bound: float) -> str:
    """A bucket bound as a field key: shortest round-trip decimal, never exponent notation.

    Matches Go's ``strconv.FormatFloat(bound, 'f', -1, 64)`` used by otel2influx.
    """
    if bound == 0:
        return "0"  # -0.0 == 0.0 (also as a cache key): one field for both
    text = repr(bound)
    if "e" not in text and "E" not in text:
        return text[:-2] if text.endswith(".0") else text
    return format(Decimal(text), "f")


class Buckets(NamedTuple):
    """Cumulative buckets: ``uppers[i]`` has ``cumulative[i]`` observations at or below it.

    ``lowers[i]`` is the bucket's lower bound (``-inf`` for an open first bucket). The last
    bucket may be ``+inf`` (the overflow bucket).
    """

    lowers: list[float]
    uppers: list[float]
    cumulative: list[int]


def nearest_rank_quantile(
    buckets: Buckets, quantile: float, *, minimum: float | None, maximum: float | None
) -> float | None:
    """Nearest-rank quantile estimated from cumulative buckets.

    The bucket where the cumulative count first reaches ``ceil(quantile * count)``; the value is
    the midpoint of its ``[lower, upper]`` bounds clamped to ``[minimum, maximum]``. An open
    first bucket uses ``minimum`` (else 0 or its upper bound) as lower bound; the ``+Inf``
    bucket answers ``maximum`` (else the last finite bound). None for an empty histogram.
    """
    if not buckets.cumulative or buckets.cumulative[-1] <= 0:
        return None
    total = buckets.cumulative[-1]
    rank = max(1, math.ceil(quantile * total))
    index = bisect.bisect_left(buckets.cumulative, rank)  # cumulative is non-decreasing
    lower, upper = buckets.lowers[index], buckets.uppers[index]
    if math.isinf(upper):
        if maximum is not None:
            return maximum
        value = lower if math.isfinite(lower) else 0.0
    else:
        if math.isinf(lower):
            lower = minimum if minimum is not None else min(0.0, upper)
        value = (lower + upper) / 2.0
    if minimum is not None:
        value = max(value, minimum)
    if maximum is not None:
        value = min(value, maximum)
    return value


def populated_edges(buckets: Buckets) -> list[int]:
    """Indexes of the bounds that edge a populated bucket (its lower or its upper bound).

    An exponential histogram's empty buckets between populated ones add nothing a reader
    needs: the cumulative count is flat across them. Keeping both edges of every populated
    bucket keeps each observation's bucket exact (quantiles survive) while a window that spans
    several octaves at scale 5 stores a handful of fields instead of ~32 per octave.
    """
    cumulative = buckets.cumulative
    keep: list[int] = []
    for index in range(len(cumulative)):
        count = cumulative[index] - (cumulative[index - 1] if index else 0)
        following = cumulative[index + 1] - cumulative[index] if index + 1 < len(cumulative) else 0
        if count or following or index == len(cumulative) - 1:
            keep.append(index)
    return keep


def explicit_buckets(bounds: Sequence[float], counts: Sequence[int]) -> Buckets:
    """Cumulative buckets of an explicit-bounds histogram.

    Raises:
        ValueError: bounds not finite and strictly increasing, or counts not one longer.
    """
    if len(counts) != len(bounds) + 1:
        raise Rejected(REASON_BUCKET_LAYOUT)
    if not all(math.isfinite(bound) for bound in bounds):
        raise Rejected(REASON_BUCKET_LAYOUT)
    if any(later <= earlier for earlier, later in itertools.pairwise(bounds)):
        raise Rejected(REASON_BUCKET_LAYOUT)
    lowers = [-math.inf, *bounds]
    uppers = [*bounds, math.inf]
    cumulative: list[int] = []
    running = 0
    for count in counts:
        running += int(count)
        cumulative.append(running)
    return Buckets(lowers, uppers, cumulative)


@functools.lru_cache(maxsize=65_536)
def _exponential_boundary(scale: int, index: int) -> float | None:
    """``base ** index`` with ``base = 2 ** (2 ** -scale)``; None when it overflows."""
    try:
        return float(2.0 ** (index * 2.0**-scale))
    except OverflowError:
        return None


@functools.lru_cache(maxsize=16_384)
def range_bounds(scale: int, offset: int, length: int) -> tuple[tuple[float, ...], ...]:
    """Lower and upper bounds of the buckets ``offset .. offset + length - 1`` (positive
    side: ``(base**i, base**(i+1)]``), each only if strictly increasing, else ``()``.

    Windows of one series repeat the same few ranges, so they are computed once.

    Raises:
        Rejected: a bound overflows a float.
    """
    bounds = [_exponential_boundary(scale, offset + index) for index in range(length + 1)]
    finite = [bound for bound in bounds if bound is not None]
    if len(finite) != len(bounds):
        raise Rejected(REASON_BUCKET_LAYOUT)
    lowers, uppers = tuple(finite[:-1]), tuple(finite[1:])
    increasing = [
        part if all(later > earlier for earlier, later in itertools.pairwise(part)) else ()
        for part in (lowers, uppers)
    ]
    return lowers, uppers, increasing[0], increasing[1]


def exponential_buckets(
    scale: int,
    *,
    positive_offset: int,
    positive_counts: Sequence[int],
    negative_offset: int = 0,
    negative_counts: Sequence[int] = (),
    zero_count: int = 0,
    zero_threshold: float = 0.0,
) -> Buckets:
    """Cumulative buckets of an exponential histogram at their real bounds.

    With ``base = 2 ** (2 ** -scale)``, positive bucket ``i`` holds ``(base**i, base**(i+1)]``,
    negative bucket ``i`` holds ``[-base**(i+1), -base**i)`` and the zero bucket holds
    ``[-zero_threshold, zero_threshold]``. Buckets are listed in ascending value order.

    Raises:
        ValueError: bounds overflow a float, scale outside [-10, 20], too many buckets,
            bounds not strictly increasing (underflow, a zero threshold above them).
    """
    if len(positive_counts) + len(negative_counts) > MAX_BUCKETS or not -10 <= scale <= 20:
        raise Rejected(REASON_BUCKET_LAYOUT)
    if not math.isfinite(zero_threshold) or zero_threshold < 0:
        raise Rejected(REASON_BUCKET_LAYOUT)
    if positive_counts and not (negative_counts or zero_count or zero_threshold):
        # what stepwatch's exporters send: the positive range only (the bridge's hot path)
        positive_lowers, positive_uppers, _, increasing = range_bounds(
            scale, positive_offset, len(positive_counts)
        )
        if not increasing:
            raise Rejected(REASON_BUCKET_LAYOUT)  # degenerate: underflowed bounds
        cumulative = list(itertools.accumulate(map(int, positive_counts)))
        return Buckets(list(positive_lowers), list(positive_uppers), cumulative)
    lowers: list[float] = []
    uppers: list[float] = []
    counts: list[int] = []
    if negative_counts:
        negative_lowers, negative_uppers, increasing, _ = range_bounds(
            scale, negative_offset, len(negative_counts)
        )
        if not increasing:  # the uppers below are the lowers' negations, reversed
            raise Rejected(REASON_BUCKET_LAYOUT)  # degenerate: underflowed bounds
        lowers.extend(-bound for bound in reversed(negative_uppers))
        uppers.extend(-bound for bound in reversed(negative_lowers))
        counts.extend(int(count) for count in reversed(negative_counts))
    if zero_count or zero_threshold or not (positive_counts or negative_counts):
        if uppers and not zero_threshold > uppers[-1]:
            raise Rejected(REASON_BUCKET_LAYOUT)
        lowers.append(-zero_threshold)
        uppers.append(zero_threshold)
        counts.append(int(zero_count))
    if positive_counts:
        positive_lowers, positive_uppers, _, increasing = range_bounds(
            scale, positive_offset, len(positive_counts)
        )
        if not increasing or (uppers and not positive_uppers[0] > uppers[-1]):
            raise Rejected(REASON_BUCKET_LAYOUT)  # degenerate (zero_threshold, underflow)
        lowers.extend(positive_lowers)
        uppers.extend(positive_uppers)
        counts.extend(int(count) for count in positive_counts)
    return Buckets(lowers, uppers, list(itertools.accumulate(counts)))
