"""A guard against series explosions (e.g. step numbers put into an allowlisted tag).

InfluxDB 1.x indexes every series in memory; one producer writing ``stepwatch.phase=step-1``,
``step-2``, ... would grow the index without bound. The guard remembers the series it has let
through per (job, measurement) and refuses points of *new* series beyond the limits; known
series keep flowing. Two limits: ``max_series_per_rank`` catches one producer flooding (a
stepwatch rank has at most 32 phase and 256 kernel series per window, plus a few health series
per device) without refusing a legitimately large job, whose series grow with its ranks;
``max_series`` caps the (job, measurement) as a whole. Memory is bounded by ``max_series``
hashes per (job, measurement) and ``max_jobs`` jobs (least recently seen job forgotten first).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge._convert import Point


class CardinalityGuard:
    """Caps distinct series per measurement per job.

    Args:
        max_series: distinct tag sets allowed per (job id, measurement).
        max_series_per_rank: distinct tag sets allowed per (job id, measurement, rank).
        max_jobs: jobs remembered at once.
    """

    def __init__(
        self, *, max_series: int = 2_000_000, max_series_per_rank: int = 1024, max_jobs: int = 256
    ) -> None:
        if max_series <= 0:
            raise ConfigError(f"max_series_per_measurement: must be positive, got {max_series}")
        if max_series_per_rank <= 0:
            raise ConfigError(f"max_series_per_rank: must be positive, got {max_series_per_rank}")
        if max_jobs <= 0:
            raise ConfigError(f"max_jobs: must be positive, got {max_jobs}")
        self.max_series = max_series
        self.max_series_per_rank = max_series_per_rank
        self.max_jobs = max_jobs
        self._jobs: collections.OrderedDict[str, dict[str, _Series]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def filter(self, points: Iterable[Point]) -> tuple[list[Point], int]:
        """The points allowed through, and how many were refused."""
        kept: list[Point] = []
        refused = 0
        with self._lock:
            for point in points:
                job = point.tags.get(_schema.JOB_ID, "")
                measurements = self._jobs.get(job)
                if measurements is None:
                    measurements = self._jobs[job] = {}
                    while len(self._jobs) > self.max_jobs:
                        self._jobs.popitem(last=False)
                else:
                    self._jobs.move_to_end(job)
                series = measurements.get(point.measurement)
                if series is None:
                    series = measurements[point.measurement] = _Series()
                key = hash(tuple(sorted(point.tags.items())))
                rank = point.tags.get(_schema.RANK, "")
                if key in series.keys:
                    kept.append(point)
                elif (
                    len(series.keys) < self.max_series
                    and series.per_rank[rank] < self.max_series_per_rank
                ):
                    series.keys.add(key)
                    series.per_rank[rank] += 1
                    kept.append(point)
                else:
                    refused += 1
        return kept, refused


class _Series:
    """The series of one (job, measurement) let through so far, and how many per rank."""

    __slots__ = ("keys", "per_rank")

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.per_rank: collections.Counter[str] = collections.Counter()
