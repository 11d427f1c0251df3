"""What the report shows, queried from InfluxDB and aggregated into time columns.

Data is read with InfluxQL on the stored layout (docs/schema.md); findings from
``stepwatch.diagnosis`` unless the caller passes them. With thousands of ranks only the most
deviant are fetched and drawn.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._errors import ConfigError, InfluxError
from stepwatch.core._influx import InfluxClient, QuerySeries, quote_ident, quote_literal
from stepwatch.core._schema import (
    JOB_ID,
    KERNEL_CATEGORY,
    KERNEL_CLASS,
    KERNEL_DURATION,
    PHASE,
    PHASE_DURATION,
    RANK,
    STEP_DURATION,
)
from stepwatch.detectors.sinks import read_diagnoses

MAX_HEATMAP_RANKS = 64

_MEAN = 'sum("sum") / sum("count")'
"""The mean duration of the selected windows, exact (no stored ``mean`` needed: the compact
layout and a Collector's data have ``sum`` and ``count``)."""


class KernelShift(NamedTuple):
    """How one kernel class moved between before and after the change."""

    kernel_class: str
    category: str
    before_s: float | None
    after_s: float | None
    job_ratio: float | None
    outlier_rank: str | None
    outlier_ratio: float | None
    share: float = 1.0
    """The class's share of all kernel time in the range (0 … 1)."""

    @property
    def score(self) -> float:
        """How far it moved: the larger ``|log ratio|`` of the job's and the outlier rank's."""
        ratios = [r for r in (self.job_ratio, self.outlier_ratio) if r and r > 0]
        return max((abs(math.log(r)) for r in ratios), default=0.0)

    @property
    def impact(self) -> float:
        """How far it moved, weighted by its share of kernel time: a 1 µs op that doubled
        matters less than the matrix multiplies that took 50 % longer."""
        return self.score * self.share


@dataclasses.dataclass(frozen=True)
class ReportData:
    """Everything the page shows, already aggregated (one column per ``bucket_s``)."""

    job: str
    start_unix_nano: int
    end_unix_nano: int
    bucket_s: int
    column_times_unix_nano: list[int]
    ranks: list[str]
    total_ranks: int
    step_by_rank: dict[str, list[float | None]]
    compute_by_rank: dict[str, list[float | None]]
    step_median: list[float | None]
    step_max: list[float | None]
    phases: dict[str, list[float | None]]
    kernels: list[KernelShift]
    findings: list[Diagnosis]
    change_unix_nano: int


def load_report_data(
    client: InfluxClient,
    job: str,
    *,
    start_unix_nano: int,
    end_unix_nano: int,
    findings: Sequence[Diagnosis] | None = None,
    columns: int = 120,
) -> ReportData:
    """Query and aggregate what the page draws (arguments as for ``write_report``)."""
    if end_unix_nano <= start_unix_nano:
        raise ConfigError("end_unix_nano: must be after start_unix_nano")
    if columns < 2:
        raise ConfigError(f"columns: must be at least 2, got {columns}")
    window_s = _window_length_s(client, job)
    bucket_s = max(1, math.ceil((end_unix_nano - start_unix_nano) / 1e9 / columns))
    bucket_s = max(bucket_s, math.ceil(window_s))  # no empty columns between windows
    bucket_ns = bucket_s * 1_000_000_000
    first_column = start_unix_nano - start_unix_nano % bucket_ns
    column_times = list(range(first_column, end_unix_nano + 1, bucket_ns))
    where = (
        f"{quote_ident(JOB_ID)} = {quote_literal(job)} "
        f"AND time >= {start_unix_nano} AND time <= {end_unix_nano}"
    )
    group = f"GROUP BY time({bucket_s}s)"

    def columns_of(series: QuerySeries) -> list[float | None]:
        values: list[float | None] = [None] * len(column_times)
        for row in series.values:
            index = (int(row[0]) - first_column) // bucket_ns
            if 0 <= index < len(values) and row[1] is not None:
                values[index] = float(row[1])
        return values

    def by_tag(query: str, tag: str) -> dict[str, list[float | None]]:
        return {s.tags.get(tag, ""): columns_of(s) for s in client.query(query)}

    step = quote_ident(STEP_DURATION)
    kernel = quote_ident(KERNEL_DURATION)
    compute = f"{quote_ident(KERNEL_CATEGORY)} = 'compute'"
    by_rank = f"GROUP BY {quote_ident(RANK)}"

    def per_rank_total(query: str) -> dict[str, float]:
        return {
            s.tags.get(RANK, ""): float(s.values[0][1])
            for s in client.query(query)
            if s.values and s.values[0][1] is not None
        }

    # One value per rank first: with thousands of ranks only the most deviant are drawn,
    # and only their time series are fetched.
    step_totals = per_rank_total(f"SELECT {_MEAN} FROM {step} WHERE {where} {by_rank}")
    if not step_totals:
        raise ConfigError(
            f"job: no {STEP_DURATION} data for {job!r} in the requested range "
            f"(database {client.database!r})"
        )
    compute_totals = per_rank_total(
        f'SELECT sum("sum") FROM {kernel} WHERE {where} AND {compute} {by_rank}'
    )
    all_ranks = sorted(step_totals, key=_rank_key)
    shown = most_deviant(compute_totals or step_totals, all_ranks)
    rank_filter = ""
    if len(shown) < len(all_ranks):
        alternatives = "|".join(re.escape(rank).replace("/", "\\/") for rank in shown)
        rank_filter = f" AND {quote_ident(RANK)} =~ /^({alternatives})$/"
    step_by_rank = by_tag(
        f"SELECT {_MEAN} FROM {step} WHERE {where}{rank_filter} {group}, "
        f"{quote_ident(RANK)} fill(none)",
        RANK,
    )
    compute_by_rank = by_tag(
        f'SELECT sum("sum") / {bucket_s} FROM {kernel} WHERE {where}{rank_filter} '
        f"AND {compute} {group}, {quote_ident(RANK)} fill(none)",
        RANK,
    )
    summary = client.query(
        f'SELECT median("p50"), max("max") FROM {step} WHERE {where} {group} fill(none)'
    )
    step_median: list[float | None] = [None] * len(column_times)
    step_max: list[float | None] = [None] * len(column_times)
    for series in summary:
        for row in series.values:
            index = (int(row[0]) - first_column) // bucket_ns
            if 0 <= index < len(column_times):
                step_median[index] = None if row[1] is None else float(row[1])
                step_max[index] = None if row[2] is None else float(row[2])
    phases = by_tag(
        f"SELECT {_MEAN} FROM {quote_ident(PHASE_DURATION)} WHERE {where} {group}, "
        f"{quote_ident(PHASE)} fill(none)",
        PHASE,
    )
    if findings is None:
        findings = read_findings(
            client, job, start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano
        )
    # Most expensive first: operators fix what costs the job most.
    found = sorted(findings, key=lambda f: (-f.slowdown, f.start_unix_nano, f.kind))
    inside = [f.start_unix_nano for f in found if start_unix_nano < f.start_unix_nano]
    change = min(inside) if inside else (start_unix_nano + end_unix_nano) // 2
    kernels = kernel_shifts(
        client,
        job,
        start_unix_nano=start_unix_nano,
        change_unix_nano=change,
        end_unix_nano=end_unix_nano,
    )
    return ReportData(
        job=job,
        start_unix_nano=start_unix_nano,
        end_unix_nano=end_unix_nano,
        bucket_s=bucket_s,
        column_times_unix_nano=column_times,
        ranks=shown,
        total_ranks=len(all_ranks),
        step_by_rank=step_by_rank,
        compute_by_rank=compute_by_rank,
        step_median=step_median,
        step_max=step_max,
        phases=phases,
        kernels=kernels,
        findings=found,
        change_unix_nano=change,
    )


def _window_length_s(client: InfluxClient, job: str) -> float:
    """Export window length of ``job`` (time minus ``start_time_unix_nano`` of a point)."""
    series = client.query(
        f'SELECT last("start_time_unix_nano") FROM {quote_ident(STEP_DURATION)} '
        f"WHERE {quote_ident(JOB_ID)} = {quote_literal(job)}"
    )
    if not series or not series[0].values or series[0].values[0][1] is None:
        return 1.0
    end, start = series[0].values[0][0], series[0].values[0][1]
    return max(0.0, (int(end) - int(start)) / 1e9)


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), rank) if rank.isdigit() else (1 << 62, rank)


def most_deviant(means: Mapping[str, float], ranks: list[str]) -> list[str]:
    """All ranks when few; else the ``MAX_HEATMAP_RANKS`` farthest from the median rank."""
    if len(ranks) <= MAX_HEATMAP_RANKS:
        return ranks
    centre = statistics.median(means.get(rank, 0.0) for rank in ranks)
    chosen = sorted(ranks, key=lambda r: -abs(means.get(r, 0.0) - centre))[:MAX_HEATMAP_RANKS]
    return sorted(chosen, key=_rank_key)


def kernel_shifts(
    client: InfluxClient,
    job: str,
    *,
    start_unix_nano: int,
    change_unix_nano: int,
    end_unix_nano: int,
) -> list[KernelShift]:
    """Per kernel class: mean duration before vs after the change, and the outlier rank;
    those that moved most, weighted by their share of kernel time, first."""
    kernel = quote_ident(KERNEL_DURATION)
    keys = f"{quote_ident(KERNEL_CLASS)}, {quote_ident(KERNEL_CATEGORY)}"
    job_filter = f"{quote_ident(JOB_ID)} = {quote_literal(job)}"

    def period(start: int, end: int, extra: str = "") -> dict[tuple[str, ...], float]:
        result: dict[tuple[str, ...], float] = {}
        query = (
            f"SELECT {_MEAN} FROM {kernel} WHERE {job_filter} AND time >= {start} "
            f"AND time < {end} GROUP BY {keys}{extra}"
        )
        for series in client.query(query):
            if series.values and series.values[0][1] is not None:
                key = (
                    series.tags.get(KERNEL_CLASS, ""),
                    series.tags.get(KERNEL_CATEGORY, ""),
                    series.tags.get(RANK, ""),
                )
                result[key] = float(series.values[0][1])
        return result

    totals: dict[tuple[str, str], float] = {}
    for series in client.query(
        f'SELECT sum("sum") FROM {kernel} WHERE {job_filter} AND time >= {start_unix_nano} '
        f"AND time <= {end_unix_nano} GROUP BY {keys}"
    ):
        if series.values and series.values[0][1] is not None:
            named = (series.tags.get(KERNEL_CLASS, ""), series.tags.get(KERNEL_CATEGORY, ""))
            totals[named] = float(series.values[0][1])
    all_time = sum(totals.values())
    before = period(start_unix_nano, change_unix_nano)
    after = period(change_unix_nano, end_unix_nano + 1)
    after_by_rank = period(change_unix_nano, end_unix_nano + 1, f", {quote_ident(RANK)}")
    shifts = []
    for kernel_class, category, _ in sorted(set(before) | set(after)):
        key = (kernel_class, category, "")
        before_s, after_s = before.get(key), after.get(key)
        job_ratio = after_s / before_s if before_s and after_s is not None else None
        per_rank = {
            rank: value
            for (k_class, k_cat, rank), value in after_by_rank.items()
            if (k_class, k_cat) == (kernel_class, category)
        }
        outlier_rank = outlier_ratio = None
        if len(per_rank) >= 2:
            centre = statistics.median(per_rank.values())
            if centre > 0:
                outlier_rank = max(per_rank, key=lambda r: abs(math.log(per_rank[r] / centre)))
                outlier_ratio = per_rank[outlier_rank] / centre
        shifts.append(
            KernelShift(
                kernel_class,
                category,
                before_s,
                after_s,
                job_ratio,
                outlier_rank,
                outlier_ratio,
                share=totals.get((kernel_class, category), 0.0) / all_time if all_time else 0.0,
            )
        )
    return sorted(shifts, key=lambda s: (-s.impact, -s.score, s.kernel_class))


def read_findings(
    client: InfluxClient, job: str, *, start_unix_nano: int, end_unix_nano: int
) -> list[Diagnosis]:
    """Findings of ``job`` stored in ``stepwatch.diagnosis`` that overlap the range."""
    try:
        stored = read_diagnoses(client, job)
    except InfluxError as exc:
        if "database not found" in str(exc):
            return []
        raise
    return [
        finding
        for finding, _ in stored
        if finding.start_unix_nano <= end_unix_nano
        and (finding.end_unix_nano is None or finding.end_unix_nano >= start_unix_nano)
    ]


def relative_to_median(
    values_by_rank: Mapping[str, list[float | None]],
) -> dict[str, list[float | None]]:
    """Each value divided by the median over ranks of its column (1.0 = a typical rank)."""
    columns = max((len(values) for values in values_by_rank.values()), default=0)
    medians: list[float] = []
    for column in range(columns):
        present = [x for x in (v[column] for v in values_by_rank.values()) if x is not None]
        medians.append(statistics.median(present) if present else 0.0)
    relative: dict[str, list[float | None]] = {}
    for rank, values in values_by_rank.items():
        relative[rank] = [
            value / medians[column] if value is not None and medians[column] > 0 else None
            for column, value in enumerate(values)
        ]
    return relative
