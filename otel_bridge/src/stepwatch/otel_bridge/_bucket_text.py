"""The ``buckets`` string field: a histogram's bucket counts in one compact, lossless text.

The compact layout (docs/storage.md, "Histogram layouts") stores a histogram's buckets in one
string field instead of one field per bound, so a measurement's columns are a fixed small set
whatever the bounds. Grammar (ASCII; sections separated by ``;``; counts are non-negative
decimal integers, bounds shortest round-trip decimals as in :func:`format_bound`):

* explicit bounds: ``x<b1>,<b2>,...,<bn>:<c0>,<c1>,...,<cn>``; ``n`` bounds, ``n + 1`` counts
  (the last is the overflow bucket above ``bn``); no bounds: ``x:<c0>``;
* exponential: ``e<scale>:<offset>:<c0>,<c1>,...`` the positive range (bucket ``offset + i``
  holds ``(base**(offset+i), base**(offset+i+1)]``, ``base = 2**(2**-scale)``), then
  optionally ``;z<zero_count>`` and/or ``;t<zero_threshold>`` and ``;n<offset>:<counts>``
  (the negative range). An empty positive range is ``e<scale>:0:``.

A run of ``k >= 3`` zero counts may be written ``*k`` (``1,*5,2`` is ``1,0,0,0,0,0,2``).

:func:`decode_buckets` turns the text back into :class:`Buckets` (cumulative counts at real
bounds) for :func:`bucket_quantile`; :func:`merge_buckets` adds histograms of one series (or
of many ranks) so a quantile over several windows is exact to the bucket.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from stepwatch.otel_bridge._buckets import (
    Buckets,
    explicit_buckets,
    exponential_buckets,
    format_bound,
    nearest_rank_quantile,
)


class BucketText(NamedTuple):
    """A parsed ``buckets`` field: explicit (``scale`` None) or exponential."""

    scale: int | None
    bounds: tuple[float, ...]
    offset: int
    counts: tuple[int, ...]
    zero_count: int = 0
    zero_threshold: float = 0.0
    negative_offset: int = 0
    negative_counts: tuple[int, ...] = ()

    def buckets(self) -> Buckets:
        """Cumulative buckets at their real bounds (as the bridge computed its quantiles)."""
        if self.scale is None:
            return explicit_buckets(list(self.bounds), list(self.counts))
        return exponential_buckets(
            self.scale,
            positive_offset=self.offset,
            positive_counts=self.counts,
            negative_offset=self.negative_offset,
            negative_counts=self.negative_counts,
            zero_count=self.zero_count,
            zero_threshold=self.zero_threshold,
        )

    def downscaled(self, scale: int) -> BucketText:
        """The same exponential histogram at a lower ``scale`` (buckets merged pairwise)."""
        if self.scale is None or scale > self.scale:
            raise ValueError(f"cannot downscale {self.scale} to {scale}")
        shift = self.scale - scale
        offset, counts = _downscale(self.offset, self.counts, shift)
        negative_offset, negative_counts = _downscale(
            self.negative_offset, self.negative_counts, shift
        )
        return self._replace(
            scale=scale,
            offset=offset,
            counts=counts,
            negative_offset=negative_offset,
            negative_counts=negative_counts,
        )


def _downscale(offset: int, counts: Sequence[int], shift: int) -> tuple[int, tuple[int, ...]]:
    if not counts:
        return offset >> shift, ()
    merged: dict[int, int] = {}
    for position, count in enumerate(counts):
        index = (offset + position) >> shift
        merged[index] = merged.get(index, 0) + count
    low = min(merged)
    return low, tuple(merged.get(index, 0) for index in range(low, max(merged) + 1))


def _zeros(run: int) -> str:
    return "0" if run == 1 else "0,0" if run == 2 else f"*{run}"


def counts_text(counts: Iterable[int]) -> str:
    """Counts as ``c0,c1,...``, a run of three or more zeros as ``*k`` (the bridge's hot path:
    kernel histograms are mostly empty buckets, so zeros cost one addition each)."""
    parts: list[str] = []
    zeros = 0
    for count in counts:
        if count:
            if zeros:
                parts.append(_zeros(zeros))
                zeros = 0
            parts.append(str(count))
        else:
            zeros += 1
    if zeros:
        parts.append(_zeros(zeros))
    return ",".join(parts)


def _counts_text_reference(counts: Iterable[int]) -> str:
    """:func:`counts_text` as first written (the tests check that both agree)."""
    parts: list[str] = []
    zeros = 0
    for count in counts:
        if count == 0:
            zeros += 1
            continue
        parts.extend(("0",) * zeros if zeros < 3 else (f"*{zeros}",))
        zeros = 0
        parts.append(str(count))
    parts.extend(("0",) * zeros if zeros < 3 else (f"*{zeros}",))
    return ",".join(parts)


def encode_explicit(bounds: Sequence[float], counts: Sequence[int]) -> str:
    """The ``buckets`` text of an explicit-bounds histogram (bounds already validated)."""
    return "x" + ",".join(format_bound(bound) for bound in bounds) + ":" + counts_text(counts)


def encode_exponential(
    scale: int,
    *,
    offset: int,
    counts: Sequence[int],
    zero_count: int = 0,
    zero_threshold: float = 0.0,
    negative_offset: int = 0,
    negative_counts: Sequence[int] = (),
) -> str:
    """The ``buckets`` text of an exponential histogram (layout already validated)."""
    text = f"e{scale}:{offset if counts else 0}:{counts_text(counts)}"
    if zero_count:
        text += f";z{zero_count}"
    if zero_threshold:
        text += f";t{format_bound(zero_threshold)}"
    if negative_counts:
        text += f";n{negative_offset}:{counts_text(negative_counts)}"
    return text


def _parse_counts(text: str) -> tuple[int, ...]:
    if not text:
        return ()
    counts: list[int] = []
    for item in text.split(","):
        if item.startswith("*"):
            run = int(item[1:])
            if run < 1:
                raise ValueError(f"zero run {item!r}")
            counts.extend((0,) * run)
            continue
        count = int(item)
        if count < 0 or not item.isdigit():
            raise ValueError(f"count {item!r}")
        counts.append(count)
    return tuple(counts)


def parse_buckets(text: str) -> BucketText:
    """Parse a ``buckets`` field without checking the layout (:func:`decode_buckets` does).

    Raises:
        ValueError: ``text`` does not follow the grammar of this module.
    """
    try:
        if text.startswith("x"):
            bounds_text, counts_text = text[1:].split(":")
            bounds = tuple(float(item) for item in bounds_text.split(",")) if bounds_text else ()
            return BucketText(None, bounds, 0, _parse_counts(counts_text))
        if not text.startswith("e"):
            raise ValueError("not x... or e...")
        head, *sections = text[1:].split(";")
        scale_text, offset_text, counts_text = head.split(":")
        parsed = BucketText(int(scale_text), (), int(offset_text), _parse_counts(counts_text))
        for section in sections:
            key, value = section[:1], section[1:]
            if key == "z":
                parsed = parsed._replace(zero_count=int(value))
            elif key == "t":
                parsed = parsed._replace(zero_threshold=float(value))
            elif key == "n":
                offset, counts = value.split(":")
                parsed = parsed._replace(
                    negative_offset=int(offset), negative_counts=_parse_counts(counts)
                )
            else:
                raise ValueError(f"section {section!r}")
    except ValueError as exc:
        raise ValueError(f"not a buckets field: {text[:80]!r} ({exc})") from None
    if parsed.zero_count < 0:
        raise ValueError(f"not a buckets field: {text[:80]!r} (negative zero count)")
    return parsed


def decode_buckets(text: str) -> Buckets:
    """The cumulative buckets of a stored ``buckets`` field, at their real bounds.

    Raises:
        ValueError: not a ``buckets`` field, or a layout the bridge would refuse.

    Example:
        >>> decode_buckets("x0.01,0.1:1,3,0").cumulative
        [1, 4, 4]
    """
    return parse_buckets(text).buckets()


def bucket_quantile(
    buckets: str | Buckets,
    quantile: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float | None:
    """The nearest-rank quantile of a stored ``buckets`` field or of decoded buckets.

    Pass the point's ``min`` and ``max`` to get the stored ``pNN`` values (before their
    rounding to 12 significant bits). None for an empty histogram.
    """
    decoded = decode_buckets(buckets) if isinstance(buckets, str) else buckets
    return nearest_rank_quantile(decoded, quantile, minimum=minimum, maximum=maximum)


def buckets_from_bound_fields(row: Mapping[str, object]) -> Buckets:
    """The cumulative buckets of a point stored one field per bound: the ``per_bound`` layout,
    or a Collector's influxdb exporter (which writes no ``+Inf``: ``count`` stands in).

    ``row`` maps field keys to values as a query returns them (``None`` for a bound another
    point has). Keys that are not numbers (``count``, ``sum``, ``p50``, ...) are ignored.

    Example:
        >>> buckets_from_bound_fields({"count": 10.0, "0.005": 1.0, "0.1": 8.0}).cumulative
        [1, 8, 10]
    """
    bounds: list[tuple[float, int]] = []
    for key, value in row.items():
        if value is None or (not key[:1].isdigit() and not key.startswith("-")):
            continue
        try:
            bound = float(key)
        except ValueError:
            continue
        if math.isfinite(bound) and isinstance(value, int | float):
            bounds.append((bound, int(value)))
    bounds.sort()
    total = row.get("+Inf", row.get("count"))
    if not isinstance(total, int | float):
        raise ValueError("neither +Inf nor count: not a histogram point")
    uppers = [bound for bound, _ in bounds] + [math.inf]
    cumulative = [count for _, count in bounds] + [int(total)]
    if any(later < earlier for earlier, later in itertools.pairwise(cumulative)):
        raise ValueError("bucket fields are not cumulative")
    return Buckets([-math.inf, *uppers[:-1]], uppers, cumulative)


def merge_buckets(texts: Iterable[str]) -> Buckets:
    """The buckets of several ``buckets`` fields added together (windows, ranks).

    Exponential histograms are first brought to their lowest scale (exact: each bucket is
    a union of buckets at higher scales). Explicit histograms must share bounds where they
    have observations: a bound of one that falls inside a populated bucket of another
    raises ``ValueError``, since the split of that bucket's count is unknown.
    """
    parsed = [parse_buckets(text) for text in texts]
    scales = [item.scale for item in parsed if item.scale is not None]
    if scales and len(scales) != len(parsed):
        raise ValueError("cannot merge explicit and exponential buckets")
    if scales:
        parsed = [item.downscaled(min(scales)) for item in parsed]
    return _merge([item.buckets() for item in parsed])


def _merge(histograms: Sequence[Buckets]) -> Buckets:
    edges = sorted({upper for item in histograms for upper in item.uppers})
    counts = dict.fromkeys(edges, 0)
    lowers: dict[float, float] = {}
    for item in histograms:
        previous = 0
        for lower, upper, cumulative in zip(item.lowers, item.uppers, item.cumulative, strict=True):
            count, previous = cumulative - previous, cumulative
            if not count:
                continue
            inside = bisect.bisect_right(edges, lower)
            if inside < len(edges) and edges[inside] < upper:
                raise ValueError(f"bucket ({lower}, {upper}] is split by another histogram")
            counts[upper] += count
            lowers[upper] = max(lowers.get(upper, -math.inf), lower)
    result = Buckets([], [], [])
    running = 0
    previous_edge = -math.inf
    for edge in edges:
        running += counts[edge]
        result.lowers.append(lowers.get(edge, previous_edge))
        result.uppers.append(edge)
        result.cumulative.append(running)
        previous_edge = edge
    return result
