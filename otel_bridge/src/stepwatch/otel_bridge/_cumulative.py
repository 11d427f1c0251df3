"""CUMULATIVE sums and histograms → per-window deltas, per series (docs/storage.md).

The stored layout is per window: a histogram's ``count`` is the observations of the window,
a counter's value what it counted in the window (stepwatch's exporters send DELTA). A stock
OpenTelemetry SDK sends CUMULATIVE by default: every point holds everything since
``start_time_unix_nano``. Stored as given, a 398-step run reads as 8,229 steps. So the bridge
differentiates, per series (resource + scope + metric + point attributes):

- the first point of a series is its baseline: nothing is stored for it
  (``cumulative_baseline``, in ``partial_success``); the next point stores the difference over
  ``(previous time, time]``;
- a changed ``start_time_unix_nano``, a count, bucket count or counter that went down, or a
  changed bucket layout is a reset (``cumulative_reset``): the point is the new baseline;
- a point older than the last one of its series is refused (``cumulative_out_of_order``); a
  resend of the last one (same time and values: a retry after a lost answer) stores the same
  difference again, which InfluxDB overwrites in place.

Data model: https://opentelemetry.io/docs/specs/otel/metrics/data-model/#temporality and
#resets-and-gaps (a start-time change is a reset). Monotonic sums, explicit and exponential
histograms are differentiated; non-monotonic cumulative sums are levels and are stored as
given (field ``gauge``), as are summaries (no temporality in OTLP).

State is per bridge process, bounded (``max_series``, least recently seen evicted first) and
forgotten after ``ttl_s`` of silence; a forgotten series starts again with a baseline. It is
only advanced once a request is accepted (:meth:`CumulativeState.commit`), so a request
refused with 429/503 and retried is differentiated against the same baseline.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge._reasons import (
    REASON_CUMULATIVE_BASELINE,
    REASON_CUMULATIVE_OUT_OF_ORDER,
    REASON_CUMULATIVE_RESET,
    Rejected,
)

if TYPE_CHECKING:
    from opentelemetry.proto.metrics.v1.metrics_pb2 import (
        ExponentialHistogramDataPoint,
        HistogramDataPoint,
        NumberDataPoint,
    )

# opentelemetry.proto.metrics.v1.AggregationTemporality
TEMPORALITY_CUMULATIVE = 2


class _Seen(NamedTuple):
    """The last accepted point of a series and the delta stored for it (for resends)."""

    start_time: int
    time: int
    point: bytes  # the cumulative point, serialised without attributes (~1 KB at 55 bounds)
    delta: bytes | None  # the delta point stored for it, serialised; None for a baseline
    seen_at: float  # clock() when last used


class Pending(NamedTuple):
    """A state change to apply once its request is accepted."""

    key: bytes
    seen: _Seen


class CumulativeState:
    """Per-series memory of the last cumulative point, bounded and expiring.

    Args:
        max_series: series remembered at once; the least recently seen is forgotten first.
        ttl_s: a series without a point for this long is forgotten.
        clock: monotonic seconds (injected in tests).
        on_evict: called with ``"capacity"`` or ``"expired"`` and the number forgotten.
    """

    def __init__(
        self,
        *,
        max_series: int = 100_000,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str, int], None] | None = None,
    ) -> None:
        if max_series <= 0:
            raise ConfigError(f"cumulative_max_series: must be positive, got {max_series}")
        if not ttl_s > 0:
            raise ConfigError(f"cumulative_ttl_s: must be positive, got {ttl_s}")
        self.max_series = max_series
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_evict = on_evict
        self._series: collections.OrderedDict[bytes, _Seen] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._series)

    def delta(self, series: bytes, kind: str, point: Any, pending: list[Pending]) -> Any:
        """The delta of cumulative ``point`` against its series' last point.

        Args:
            series: the series' identity (resource, scope, metric, point attributes); kept as
                a 16-byte BLAKE2b digest.
            kind: ``sum``, ``histogram`` or ``exponential_histogram``.
            point: the cumulative data point (not modified).
            pending: the state change is appended here (applied by :meth:`commit`).

        Raises:
            Rejected: a baseline, a reset or an out-of-order point: nothing to store.
        """
        key = hashlib.blake2b(series, digest_size=16).digest()
        blob = _detached(point).SerializeToString(deterministic=True)
        now = self._clock()
        with self._lock:
            last = self._series.get(key)
        start, stamp = int(point.start_time_unix_nano), int(point.time_unix_nano)
        if last is not None and now - last.seen_at > self.ttl_s:
            last = None
        if last is None:
            pending.append(Pending(key, _Seen(start, stamp, blob, None, now)))
            raise Rejected(REASON_CUMULATIVE_BASELINE)
        if blob == last.point:  # a resend (same times, same values): the same delta again
            if last.delta is None:
                raise Rejected(REASON_CUMULATIVE_BASELINE)
            pending.append(Pending(key, last._replace(seen_at=now)))
            return type(point).FromString(last.delta)
        if stamp <= last.time:
            raise Rejected(REASON_CUMULATIVE_OUT_OF_ORDER)
        delta = None
        if start == last.start_time:
            delta = _difference(kind, type(point).FromString(last.point), point)
        if delta is None:
            pending.append(Pending(key, _Seen(start, stamp, blob, None, now)))
            raise Rejected(REASON_CUMULATIVE_RESET)
        delta.start_time_unix_nano = last.time
        pending.append(Pending(key, _Seen(start, stamp, blob, delta.SerializeToString(), now)))
        return delta

    def commit(self, pending: Iterable[Pending]) -> None:
        """Apply the changes of an accepted request; evicts beyond the bounds."""
        expired = capacity = 0
        with self._lock:
            for key, seen in pending:
                current = self._series.get(key)
                if current is not None and current.time > seen.time:
                    continue  # a concurrent request already went further
                self._series[key] = seen
                self._series.move_to_end(key)
            now = self._clock()
            while self._series:
                oldest = next(iter(self._series.values()))
                if now - oldest.seen_at <= self.ttl_s:
                    break
                self._series.popitem(last=False)
                expired += 1
            while len(self._series) > self.max_series:
                self._series.popitem(last=False)
                capacity += 1
        if self._on_evict is not None:
            for reason, count in (("expired", expired), ("capacity", capacity)):
                if count:
                    self._on_evict(reason, count)


def _detached(point: Any) -> Any:
    """A standalone copy of ``point`` without attributes and exemplars (not needed to
    differentiate; the series key holds the attributes)."""
    copy = type(point)()
    copy.CopyFrom(point)
    copy.ClearField("attributes")
    copy.ClearField("exemplars")
    return copy


def _difference(kind: str, old: Any, new: Any) -> Any:
    """``new - old`` as a data point of ``new``'s type; None when it is a reset."""
    if kind == "sum":
        return _sum_difference(old, new)
    if kind == "histogram":
        return _histogram_difference(old, new)
    return _exponential_difference(old, new)


def _sum_difference(old: NumberDataPoint, new: NumberDataPoint) -> NumberDataPoint | None:
    kind = new.WhichOneof("value")
    if kind is None or old.WhichOneof("value") is None:
        return None
    before = old.as_int if old.WhichOneof("value") == "as_int" else old.as_double
    after = new.as_int if kind == "as_int" else new.as_double
    if after < before:
        return None  # a monotonic sum went down: a reset
    delta = type(new)()
    delta.CopyFrom(new)
    delta.ClearField("exemplars")
    if kind == "as_int" and isinstance(before, int):
        delta.as_int = new.as_int - int(before)
    else:
        delta.as_double = float(after) - float(before)
    return delta


def _head_difference(old: Any, new: Any, delta: Any) -> bool:
    """Count and sum of ``new - old`` into ``delta``; False when they went down (a reset)."""
    if new.count < old.count:
        return False
    delta.count = new.count - old.count
    if new.HasField("sum") and old.HasField("sum"):
        delta.sum = new.sum - old.sum  # < 0 for a duration: refused as negative_duration
    # min and max of a cumulative point cover the whole run, not the window: dropped.
    delta.ClearField("min")
    delta.ClearField("max")
    delta.ClearField("exemplars")
    return True


def _histogram_difference(
    old: HistogramDataPoint, new: HistogramDataPoint
) -> HistogramDataPoint | None:
    if list(old.explicit_bounds) != list(new.explicit_bounds):
        return None  # the layout changed: a reset
    if len(old.bucket_counts) != len(new.bucket_counts):
        return None
    pairs = zip(old.bucket_counts, new.bucket_counts, strict=True)
    counts = [after - before for before, after in pairs]
    if any(count < 0 for count in counts):
        return None
    delta = type(new)()
    delta.CopyFrom(new)
    if not _head_difference(old, new, delta):
        return None
    del delta.bucket_counts[:]
    delta.bucket_counts.extend(counts)
    return delta


def _downscaled(offset: int, counts: Iterable[int], shift: int) -> dict[int, int]:
    """Bucket index → count at a scale ``shift`` lower (data model: "downscaling")."""
    merged: dict[int, int] = {}
    for position, count in enumerate(counts):
        if count:
            index = (offset + position) >> shift
            merged[index] = merged.get(index, 0) + int(count)
    return merged


def _exponential_difference(
    old: ExponentialHistogramDataPoint, new: ExponentialHistogramDataPoint
) -> ExponentialHistogramDataPoint | None:
    shift = old.scale - new.scale  # an SDK only lowers the scale of a cumulative histogram
    if shift < 0 or old.zero_threshold != new.zero_threshold or new.zero_count < old.zero_count:
        return None
    delta = type(new)()
    delta.CopyFrom(new)
    if not _head_difference(old, new, delta):
        return None
    delta.zero_count = new.zero_count - old.zero_count
    for side in ("positive", "negative"):
        before_side, after_side = getattr(old, side), getattr(new, side)
        before = _downscaled(before_side.offset, before_side.bucket_counts, shift)
        counts = list(after_side.bucket_counts)
        for index, count in before.items():
            position = index - after_side.offset
            if not 0 <= position < len(counts) or counts[position] < count:
                return None  # an old observation vanished: a reset
            counts[position] -= count
        target = getattr(delta, side)
        del target.bucket_counts[:]
        target.bucket_counts.extend(counts)
    return delta
