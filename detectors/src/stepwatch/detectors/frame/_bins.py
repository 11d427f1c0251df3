"""Query results into analysis-window bins: which series feeds which array, summed per bin.

:func:`bin_series` walks the series of :func:`~stepwatch.detectors.frame.read_frame`'s
statements once for the job's identity (ranks, hosts, parallel coordinates) and once for the
values, adding each row to the :class:`Accumulator` of its measurement at the bin its window
ends in. Sums and counts add, so a per-step mean stays exact whatever the number of exports a
bin holds; maxima and minima fold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from stepwatch.core import _schema
from stepwatch.core._influx import QuerySeries
from stepwatch.detectors.stats._stats import FloatArray

#: The fields a histogram series is read by (a gauge or a counter is read by its one field).
_HISTOGRAM = ("sum", "count", "max", "min")


def series_rank(series: QuerySeries) -> int | None:
    """The series' ``stepwatch.rank``, or ``None`` where it carries none that is a number."""
    text = series.tags.get(_schema.RANK, "")
    try:
        return int(text)
    except ValueError:
        return None


def _number(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _coordinate(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


@dataclasses.dataclass
class Accumulator:
    """Sums, maxima and minima per (bin, rank[, key]) while parsing query results."""

    n_bins: int
    rank_index: dict[int, int]
    keys: dict[str, int] = dataclasses.field(default_factory=dict)
    rows: list[tuple[int, int, int, float, float, float, float]] = dataclasses.field(
        default_factory=list
    )

    def add(
        self,
        bin_index: int,
        rank: int,
        key: str,
        total: float,
        count: float,
        peak: float,
        low: float = math.nan,
    ) -> None:
        key_index = self.keys.setdefault(key, len(self.keys))
        self.rows.append((bin_index, self.rank_index[rank], key_index, total, count, peak, low))

    def arrays(self, n_ranks: int) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """``(total, count, peak, low)``, each ``(bins, ranks, keys)``; NaN where no row."""
        shape = (self.n_bins, n_ranks, max(len(self.keys), 1))
        total = np.zeros(shape)
        count = np.zeros(shape)
        peak = np.full(shape, np.nan)
        low = np.full(shape, np.nan)
        if self.rows:
            data = np.array(self.rows, dtype=np.float64)
            index = (
                data[:, 0].astype(np.int64),
                data[:, 1].astype(np.int64),
                data[:, 2].astype(np.int64),
            )
            np.add.at(total, index, data[:, 3])
            np.add.at(count, index, data[:, 4])
            np.fmax.at(peak, index, data[:, 5])
            np.fmin.at(low, index, data[:, 6])
        return total, count, peak, low


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who the job's ranks are: sorted ranks, host and parallel coordinates per rank."""

    ranks: tuple[int, ...]
    hosts: dict[int, str]
    coordinates: dict[str, dict[int, int]]

    def coordinate(self, tag: str) -> np.ndarray | None:
        """One coordinate per rank (-1 where unknown); ``None`` when no rank carries it."""
        known = self.coordinates[tag]
        if not known:
            return None
        return np.array([known.get(rank, -1) for rank in self.ranks], dtype=np.int64)


def identity(results: Sequence[QuerySeries]) -> Identity:
    """The ranks in ``results`` and, from their step series, host and coordinates."""
    hosts: dict[int, str] = {}
    coordinates: dict[str, dict[int, int]] = {
        _schema.PP_RANK: {},
        _schema.DP_RANK: {},
        _schema.TP_RANK: {},
    }
    ranks: set[int] = set()
    for series in results:
        rank = series_rank(series)
        if rank is None:
            continue
        ranks.add(rank)
        if series.name != _schema.STEP_DURATION:
            continue
        hosts[rank] = series.tags.get(_schema.HOST_NAME, "") or hosts.get(rank, "")
        for tag, known in coordinates.items():
            number = _coordinate(series.tags.get(tag, ""))
            if number is not None:
                known[rank] = number
    return Identity(tuple(sorted(ranks)), hosts, coordinates)


@dataclasses.dataclass
class Bins:
    """One accumulator per measurement the frame reads, and the kernel classes' categories."""

    step: Accumulator
    phase: Accumulator
    kernel: Accumulator
    idle: Accumulator
    clock: Accumulator
    sampled: Accumulator
    sampled_steps: Accumulator
    every_step: Accumulator
    categories: dict[str, str]

    def route(self, series: QuerySeries) -> tuple[Accumulator, str, tuple[str, ...]] | None:
        """Where a series goes: its accumulator, its key there, the fields it is read by."""
        tags = series.tags
        name = series.name
        if name == _schema.KERNEL_DURATION:
            key = tags.get(_schema.KERNEL_CLASS, "") or "other"
            self.categories[key] = tags.get(_schema.KERNEL_CATEGORY, "") or "other"
            return self.kernel, key, _HISTOGRAM
        routes: dict[str, tuple[Accumulator, str, tuple[str, ...]]] = {
            _schema.GPU_SM_CLOCK: (self.clock, "clock", ("gauge",)),
            _schema.SAMPLED_STEPS: (self.sampled_steps, "sampled", ("counter",)),
            _schema.PHASE_EVERY_STEP: (
                self.every_step,
                tags.get(_schema.PHASE, "") or "other",
                ("counter",),
            ),
            _schema.STEP_DURATION: (self.step, "step", _HISTOGRAM),
            _schema.PHASE_DURATION: (
                self.phase,
                tags.get(_schema.PHASE, "") or "other",
                _HISTOGRAM,
            ),
            _schema.DEVICE_IDLE_DURATION: (self.idle, "idle", _HISTOGRAM),
            _schema.SAMPLED_STEP_DURATION: (self.sampled, "sampled", _HISTOGRAM),
        }
        return routes.get(name)


def _add_rows(
    series: QuerySeries,
    rank: int,
    route: tuple[Accumulator, str, tuple[str, ...]],
    *,
    origin_unix_nano: int,
    window_ns: int,
) -> None:
    target, key, layout = route
    positions = [series.columns.index(f) if f in series.columns else -1 for f in layout]
    for row in series.values:
        bin_index = (int(row[0]) - origin_unix_nano) // window_ns
        if not 0 <= bin_index < target.n_bins:
            continue
        numbers = [_number(row[p]) if p >= 0 else math.nan for p in positions]
        if len(layout) == 1:  # a gauge or a counter
            value = numbers[0]
            if math.isfinite(value):
                target.add(bin_index, rank, key, value, 1.0, value)
            continue
        total, count, peak, low = numbers
        if math.isfinite(total) and math.isfinite(count):
            target.add(bin_index, rank, key, total, count, peak, low)


def bin_series(
    results: Sequence[QuerySeries],
    who: Identity,
    *,
    origin_unix_nano: int,
    n_bins: int,
    window_ns: int,
) -> Bins:
    """Every row of ``results`` added to its measurement's accumulator at its bin."""
    rank_index = {rank: index for index, rank in enumerate(who.ranks)}

    def accumulator() -> Accumulator:
        return Accumulator(n_bins, rank_index)

    bins = Bins(
        step=accumulator(),
        phase=accumulator(),
        kernel=accumulator(),
        idle=accumulator(),
        clock=accumulator(),
        sampled=accumulator(),
        sampled_steps=accumulator(),
        every_step=accumulator(),
        categories={},
    )
    for series in results:
        rank = series_rank(series)
        route = bins.route(series) if rank is not None else None
        if rank is None or route is None:
            continue
        _add_rows(series, rank, route, origin_unix_nano=origin_unix_nano, window_ns=window_ns)
    return bins
