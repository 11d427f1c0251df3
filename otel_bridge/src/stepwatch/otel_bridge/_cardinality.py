"""A guard against series explosions, whoever sends them.

InfluxDB 1.x indexes every series in memory; one producer writing ``stepwatch.phase=step-1``,
``step-2``, ... or inventing a job id per request would grow the index without bound. The
guard remembers every series it let through (per bridge process, forgotten after
``series_ttl_s`` without a point, or up to 1/64 of it sooner: a series' time is refreshed at
that granularity) and bounds *new* series four ways; known series always flow:

- ``max_new_series_per_s`` (a token bucket of ``new_series_burst``): the rate of new series
  of the whole process. A request bringing new series while the bucket is empty is refused
  whole and retryably (429 / RESOURCE_EXHAUSTED), so a legitimate job start is delayed by
  seconds, not lost, and a flood gets nowhere.
- ``max_series_total``: series remembered by the process; beyond it new series are rejected
  (``cardinality_limit``).
- ``max_series`` per (job, measurement) and ``max_series_per_rank`` per (job, measurement,
  rank): one producer flooding new tag values is stopped long before the totals (a stepwatch
  rank has at most 32 phase and 256 kernel series per window, plus a few health series per
  device), without refusing a legitimately large job, whose series grow with its ranks.

Budgets cannot be reset by inventing job ids: every budget is charged for each new series
and only freed when a series has been silent for ``series_ttl_s``, and a new job id is itself
new series, paid from the process-wide rate and total.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge._convert import Point


class Guarded(NamedTuple):
    """What the guard let through of one request."""

    points: list[Point]
    refused: int  # points of new series beyond a series limit (rejected for good)
    throttled: bool  # the request brings new series faster than allowed: refuse it, retryably


class CardinalityGuard:
    """Caps new series per process (rate and total), per job and measurement, and per rank.

    Args:
        max_series: distinct tag sets allowed per (job id, measurement).
        max_series_per_rank: distinct tag sets allowed per (job id, measurement, rank).
        max_series_total: series remembered by this process; None: no total.
        max_new_series_per_s: sustained rate of new series; None: no rate limit.
        new_series_burst: new series allowed at once (the bucket's size); default 10 s of
            ``max_new_series_per_s``.
        series_ttl_s: a series without a point for this long is forgotten (freeing its
            budgets; seen again, it is new), or up to 1/64 of it sooner.
        clock: monotonic seconds; injected in tests.
    """

    def __init__(
        self,
        *,
        max_series: int = 2_000_000,
        max_series_per_rank: int = 1024,
        max_series_total: int | None = 1_000_000,
        max_new_series_per_s: float | None = 2_000.0,
        new_series_burst: int | None = None,
        series_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("max_series_per_measurement", max_series),
            ("max_series_per_rank", max_series_per_rank),
            ("max_series_total", max_series_total),
            ("max_new_series_per_s", max_new_series_per_s),
            ("new_series_burst", new_series_burst),
            ("series_ttl_s", series_ttl_s),
        ):
            if value is not None and not value > 0:
                raise ConfigError(f"{name}: must be positive, got {value}")
        self.max_series = max_series
        self.max_series_per_rank = max_series_per_rank
        self.max_series_total = max_series_total
        self.max_new_series_per_s = max_new_series_per_s
        self.new_series_burst = float(
            new_series_burst
            if new_series_burst is not None
            else 10 * (max_new_series_per_s or 0) or 1
        )
        self.series_ttl_s = series_ttl_s
        # A known series' time is refreshed (and it moves to the back of the expiry order)
        # only when it is older than this: with windows every 1-10 s, most points skip the
        # move, which was a third of the fast path's guard cost. It is forgotten after
        # series_ttl_s of silence, or up to ttl/64 earlier (56 s of an hour).
        self._refresh_s = series_ttl_s / 64
        self.clock = clock
        # series key -> when last seen and whose budgets it uses; least recently seen first
        self._series: collections.OrderedDict[int, _Seen] = collections.OrderedDict()
        self._per_measurement: collections.Counter[tuple[str, str]] = collections.Counter()
        self._per_rank: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._tokens = self.new_series_burst
        self._refilled_s = clock()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._series)

    def filter(self, points: Iterable[Point]) -> Guarded:
        """The points allowed through, how many were refused, and whether to throttle."""
        now = self.clock()
        keyed = [(point, hash(_series_key(point))) for point in points]
        kept: list[Point] = []
        refused = 0
        stale_before = now - self._refresh_s
        with self._lock:
            self._expire(now)
            series = self._series
            if self.max_new_series_per_s is not None and any(k not in series for _, k in keyed):
                self._tokens = min(
                    self.new_series_burst,
                    self._tokens + (now - self._refilled_s) * self.max_new_series_per_s,
                )
                self._refilled_s = now
                if self._tokens <= 0:
                    return Guarded([], 0, True)
            for point, key in keyed:
                entry = series.get(key)
                if entry is not None:
                    if entry.last_seen_s < stale_before:
                        entry.last_seen_s = now
                        series.move_to_end(key)
                    kept.append(point)
                    continue
                job = point.tags.get(_schema.JOB_ID, "")
                rank = point.tags.get(_schema.RANK, "")
                if not self._admit_new(key, now, job, point.measurement, rank):
                    refused += 1
                    continue
                kept.append(point)
            # A large request may overdraw the bucket (it is admitted whole), by one burst.
            self._tokens = max(self._tokens, -self.new_series_burst)
        return Guarded(kept, refused, False)

    def filter_hashed(
        self, hashes: bytes, index: bytes, descs: Sequence[tuple[str, str, str]]
    ) -> tuple[list[int], bool]:
        """:meth:`filter` for the fast path's lines: ``hashes`` holds each line's series key
        hash (int64 each; the keys :meth:`filter` computes), ``index`` (int32 each) the
        line's ``(job, measurement, rank)`` in ``descs``. Returns the indexes of the lines
        refused, and whether to throttle. Known series are looked up and refreshed in C; only
        new series cost Python work."""
        from stepwatch.otel_bridge import _fastpath

        now = self.clock()
        refused: list[int] = []
        with self._lock:
            self._expire(now)
            series = self._series
            new = _fastpath.unknown(series, hashes)
            if self.max_new_series_per_s is not None and new:
                self._tokens = min(
                    self.new_series_burst,
                    self._tokens + (now - self._refilled_s) * self.max_new_series_per_s,
                )
                self._refilled_s = now
                if self._tokens <= 0:
                    return [], True
            _fastpath.touch(series, hashes, now, now - self._refresh_s)  # the known ones
            if new:
                keys, which = memoryview(hashes).cast("q"), memoryview(index).cast("i")
                for position in new:
                    key = keys[position]
                    entry = series.get(key)
                    if entry is not None:  # new earlier in this request
                        entry.last_seen_s = now
                        series.move_to_end(key)
                        continue
                    job, measurement, rank = descs[which[position]]
                    if not self._admit_new(key, now, job, measurement, rank):
                        refused.append(position)
            self._tokens = max(self._tokens, -self.new_series_burst)
        return refused, False

    def _admit_new(self, key: int, now: float, job: str, measurement: str, rank: str) -> bool:
        """Remember a new series unless a limit is reached (the lock is held)."""
        series = self._series
        group = (job, measurement)
        if (
            (self.max_series_total is not None and len(series) >= self.max_series_total)
            or self._per_measurement[group] >= self.max_series
            or self._per_rank[(job, measurement, rank)] >= self.max_series_per_rank
        ):
            return False
        series[key] = _Seen(now, job, measurement, rank)
        self._per_measurement[group] += 1
        self._per_rank[(job, measurement, rank)] += 1
        self._tokens -= 1
        return True

    def _expire(self, now: float) -> None:
        horizon = now - self.series_ttl_s
        series = self._series
        while series:
            key, entry = next(iter(series.items()))
            if entry.last_seen_s >= horizon:
                return
            del series[key]
            group = (entry.job, entry.measurement)
            self._per_measurement[group] -= 1
            if self._per_measurement[group] <= 0:
                del self._per_measurement[group]
            budget = (entry.job, entry.measurement, entry.rank)
            self._per_rank[budget] -= 1
            if self._per_rank[budget] <= 0:
                del self._per_rank[budget]


def _series_key(point: Point) -> str | tuple[str, tuple[tuple[str, str], ...]]:
    """The point's series: its escaped series key, as stored (computed by the conversion)."""
    return point.series or (point.measurement, tuple(sorted(point.tags.items())))


class _Seen:
    """One remembered series: when it was last seen, and whose budgets it counts in."""

    __slots__ = ("job", "last_seen_s", "measurement", "rank")

    def __init__(self, last_seen_s: float, job: str, measurement: str, rank: str) -> None:
        self.last_seen_s = last_seen_s
        self.job = job
        self.measurement = measurement
        self.rank = rank
