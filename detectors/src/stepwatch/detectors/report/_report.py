"""``stepwatch report``: one self-contained HTML page about one job.

The page answers the detectors' three questions for a reader without Grafana: is the job
slower (step time over time, change points marked), which ranks and phases (rank × time
heatmaps, phase breakdown), which kernels moved (before/after the change, and the rank that
differs most from its peers) — and states the findings in words. Plots are inline SVG; the
file loads nothing from anywhere (no scripts, fonts, images or CDN), so it can be mailed or
attached to a ticket.

Data is read from InfluxDB with InfluxQL on the stored layout (docs/CONTRACTS.md); findings
from ``stepwatch.diagnosis`` unless the caller passes them.
"""

from __future__ import annotations

import dataclasses
import html
import math
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
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

MAX_HEATMAP_RANKS = 64
PHASE_COLOURS = {
    "data": "#8c6bb1",
    "forward": "#4c78a8",
    "backward": "#f58518",
    "optimizer": "#54a24b",
    "communication": "#e45756",
    "other": "#9d9d9d",
}
EXTRA_COLOURS = ("#72b7b2", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d")
# A perceptually ordered scale (viridis stops), dark = fast, bright = slow.
SCALE = (
    (68, 1, 84),
    (72, 40, 120),
    (62, 74, 137),
    (49, 104, 142),
    (38, 130, 142),
    (31, 158, 137),
    (53, 183, 121),
    (110, 206, 88),
    (181, 222, 43),
    (253, 231, 37),
)


class KernelShift(NamedTuple):
    """How one kernel class moved between before and after the change."""

    kernel_class: str
    category: str
    before_s: float | None
    after_s: float | None
    job_ratio: float | None
    outlier_rank: str | None
    outlier_ratio: float | None

    @property
    def score(self) -> float:
        ratios = [r for r in (self.job_ratio, self.outlier_ratio) if r and r > 0]
        return max((abs(math.log(r)) for r in ratios), default=0.0)


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


def write_report(
    client: InfluxClient,
    job: str,
    *,
    start_unix_nano: int,
    end_unix_nano: int,
    out_path: str | Path,
    findings: Sequence[Diagnosis] | None = None,
    columns: int = 120,
) -> Path:
    """Write the HTML report of ``job`` over ``[start, end]`` to ``out_path``.

    Args:
        client: where the job's windows are stored.
        job: the ``stepwatch.job.id``.
        start_unix_nano: report range start.
        end_unix_nano: report range end.
        out_path: the HTML file to write (parent folders are created).
        findings: findings to show; read from ``stepwatch.diagnosis`` when None.
        columns: time columns of the plots.

    Returns:
        The path written.

    Raises:
        ConfigError: an empty range or no data for ``job`` in it.
        InfluxError: InfluxDB failed.
    """
    data = load_report_data(
        client,
        job,
        start_unix_nano=start_unix_nano,
        end_unix_nano=end_unix_nano,
        findings=findings,
        columns=columns,
    )
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(data), encoding="utf-8")
    return path


def job_extent(client: InfluxClient, job: str) -> tuple[int, int] | None:
    """First and last window end stored for ``job`` (None when it has none)."""
    where = f"{quote_ident(JOB_ID)} = {quote_literal(job)}"
    bounds = []
    for function in ("first", "last"):
        series = client.query(
            f'SELECT {function}("count") FROM {quote_ident(STEP_DURATION)} WHERE {where}'
        )
        if not series or not series[0].values:
            return None
        bounds.append(int(series[0].values[0][0]))
    return bounds[0], bounds[1]


def load_report_data(
    client: InfluxClient,
    job: str,
    *,
    start_unix_nano: int,
    end_unix_nano: int,
    findings: Sequence[Diagnosis] | None = None,
    columns: int = 120,
) -> ReportData:
    """Query and aggregate what :func:`render_html` draws (see :func:`write_report`)."""
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
    step_totals = per_rank_total(f'SELECT mean("mean") FROM {step} WHERE {where} {by_rank}')
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
        f'SELECT mean("mean") FROM {step} WHERE {where}{rank_filter} {group}, '
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
        f'SELECT mean("mean") FROM {quote_ident(PHASE_DURATION)} WHERE {where} {group}, '
        f"{quote_ident(PHASE)} fill(none)",
        PHASE,
    )
    if findings is None:
        findings = read_findings(
            client, job, start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano
        )
    found = sorted(findings, key=lambda f: (f.start_unix_nano, f.kind))
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
    """Per kernel class: mean duration before vs after the change, and the outlier rank."""
    kernel = quote_ident(KERNEL_DURATION)
    keys = f"{quote_ident(KERNEL_CLASS)}, {quote_ident(KERNEL_CATEGORY)}"
    job_filter = f"{quote_ident(JOB_ID)} = {quote_literal(job)}"

    def period(start: int, end: int, extra: str = "") -> dict[tuple[str, ...], float]:
        result: dict[tuple[str, ...], float] = {}
        query = (
            f'SELECT mean("mean") FROM {kernel} WHERE {job_filter} AND time >= {start} '
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
                kernel_class, category, before_s, after_s, job_ratio, outlier_rank, outlier_ratio
            )
        )
    return sorted(shifts, key=lambda s: -s.score)


def read_findings(
    client: InfluxClient, job: str, *, start_unix_nano: int, end_unix_nano: int
) -> list[Diagnosis]:
    """Findings of ``job`` stored in ``stepwatch.diagnosis`` that overlap the range."""
    from stepwatch.detectors.sinks._sinks import read_diagnoses

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


# ---------------------------------------------------------------------------------------
# Rendering: plain SVG strings.


def _clock(time_unix_nano: int) -> str:
    return datetime.fromtimestamp(time_unix_nano / 1e9, tz=UTC).strftime("%H:%M:%S")


def _stamp(time_unix_nano: int) -> str:
    return datetime.fromtimestamp(time_unix_nano / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_seconds(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if abs(value) < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if abs(value) < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _colour(fraction: float) -> str:
    fraction = min(max(fraction, 0.0), 1.0) * (len(SCALE) - 1)
    low = int(fraction)
    high = min(low + 1, len(SCALE) - 1)
    mix = fraction - low
    rgb = [round(a + (b - a) * mix) for a, b in zip(SCALE[low], SCALE[high], strict=True)]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclasses.dataclass(frozen=True)
class _Frame:
    """Plot area geometry shared by the time plots (so they line up)."""

    left: float = 90.0
    width: float = 860.0
    top: float = 28.0

    def x(self, data: ReportData, time_unix_nano: int) -> float:
        """Horizontal position; the axis spans the columns, so cells line up with it."""
        first, last = axis_range(data)
        return self.left + self.width * (time_unix_nano - first) / max(1, last - first)


def axis_range(data: ReportData) -> tuple[int, int]:
    """Start of the first column to the end of the last one."""
    bucket_ns = data.bucket_s * 1_000_000_000
    return data.column_times_unix_nano[0], data.column_times_unix_nano[-1] + bucket_ns


FRAME = _Frame()


def _time_axis(data: ReportData, y: float) -> str:
    parts = [
        f'<line x1="{FRAME.left}" y1="{y}" x2="{FRAME.left + FRAME.width}" y2="{y}" class="axis"/>'
    ]
    first, last = axis_range(data)
    for index in range(6):
        moment = first + (last - first) * index // 5
        x = FRAME.x(data, moment)
        parts.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" class="axis"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle" class="tick">'
            f"{_clock(moment)}</text>"
        )
    return "".join(parts)


def _finding_marks(data: ReportData, top: float, bottom: float, *, labels: bool) -> str:
    parts = []
    for number, finding in enumerate(data.findings, start=1):
        x = FRAME.x(data, max(finding.start_unix_nano, data.start_unix_nano))
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" class="change">'
            f"<title>{html.escape(finding.summary)}</title></line>"
        )
        if labels:
            parts.append(
                f'<text x="{x + 3:.1f}" y="{top + 11 * number}" class="changelabel">#{number} '
                f"{html.escape(finding.kind.replace('_', ' '))}</text>"
            )
    return "".join(parts)


def heatmap_svg(
    data: ReportData, values_by_rank: Mapping[str, list[float | None]], *, unit_label: str
) -> str:
    """Ranks as rows, time as columns; colour scaled between the 2nd and 98th percentile."""
    ranks = [rank for rank in data.ranks if rank in values_by_rank]
    if not ranks:
        return '<p class="empty">No data.</p>'
    row_h = max(4.0, min(16.0, 420.0 / len(ranks)))
    columns = len(data.column_times_unix_nano)
    cell_w = FRAME.width / columns
    every = [v for rank in ranks for v in values_by_rank[rank] if v is not None]
    if not every:
        return '<p class="empty">No data.</p>'
    # Top of the scale = the largest value, so one slow row stands out; the bottom ignores
    # the lowest 2 % (partial windows at the edges of the range).
    low, high = _quantile(every, 0.02), max(every)
    spread = high - low or 1.0

    def show(value: float) -> str:
        if unit_label == "s":
            return format_seconds(value)
        return f"{value:.2f}{unit_label}" if unit_label == "×" else f"{value:.3f}"

    height = FRAME.top + row_h * len(ranks) + 60
    parts = [
        f'<svg class="plot" viewBox="0 0 1000 {height:.0f}" width="1000" '
        f'height="{height:.0f}" role="img">'
    ]
    label_every = max(1, math.ceil(len(ranks) / 32))
    for row, rank in enumerate(ranks):
        y = FRAME.top + row * row_h
        if row % label_every == 0:
            parts.append(
                f'<text x="{FRAME.left - 6}" y="{y + row_h * 0.75:.1f}" text-anchor="end" '
                f'class="tick">rank {html.escape(rank)}</text>'
            )
        for column, value in enumerate(values_by_rank[rank]):
            if value is None:
                continue
            x = FRAME.left + column * cell_w
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{cell_w + 0.3:.1f}" '
                f'height="{row_h:.1f}" fill="{_colour((value - low) / spread)}">'
                f"<title>rank {html.escape(rank)} {_clock(data.column_times_unix_nano[column])}"
                f": {show(value)}</title>"
                "</rect>"
            )
    bottom = FRAME.top + row_h * len(ranks)
    parts.append(_finding_marks(data, FRAME.top - 14, bottom, labels=False))
    parts.append(_time_axis(data, bottom + 2))
    legend_y = bottom + 32
    for index in range(40):
        parts.append(
            f'<rect x="{FRAME.left + index * 5}" y="{legend_y}" width="5.2" height="10" '
            f'fill="{_colour(index / 39)}"/>'
        )
    suffix = {"s": "", "×": " the median rank"}.get(unit_label, " " + unit_label)
    parts.append(
        f'<text x="{FRAME.left + 206}" y="{legend_y + 9}" class="tick">{show(low)} … '
        f"{show(high)}{html.escape(suffix)}</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


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


def _y_scale(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if high <= low:
        high = low + (abs(low) or 1.0)
    pad = (high - low) * 0.08
    return max(0.0, low - pad), high + pad


def line_svg(data: ReportData, series: Sequence[tuple[str, list[float | None], str]]) -> str:
    """Time series lines (seconds), findings as vertical lines labelled with their number."""
    every = [v for _, values, _ in series for v in values if v is not None]
    if not every:
        return '<p class="empty">No data.</p>'
    low, high = _y_scale(every)
    plot_h = 220.0
    top = FRAME.top
    parts = ['<svg class="plot" viewBox="0 0 1000 300" width="1000" height="300" role="img">']
    for index in range(5):
        tick = low + (high - low) * index / 4
        y = top + plot_h - plot_h * index / 4
        parts.append(
            f'<line x1="{FRAME.left}" y1="{y:.1f}" x2="{FRAME.left + FRAME.width}" '
            f'y2="{y:.1f}" class="grid"/>'
            f'<text x="{FRAME.left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
            f"{format_seconds(tick)}</text>"
        )
    for finding in data.findings:
        end = finding.end_unix_nano if finding.end_unix_nano is not None else data.end_unix_nano
        x1 = FRAME.x(data, max(finding.start_unix_nano, data.start_unix_nano))
        x2 = FRAME.x(data, min(end, data.end_unix_nano))
        parts.append(
            f'<rect x="{x1:.1f}" y="{top}" width="{max(1.0, x2 - x1):.1f}" height="{plot_h}" '
            'class="region"/>'
        )
    bucket_ns = data.bucket_s * 1_000_000_000
    for name, values, colour in series:
        points = []
        for column, value in enumerate(values):
            if value is None:
                continue
            x = FRAME.x(data, data.column_times_unix_nano[column] + bucket_ns // 2)
            y = top + plot_h - plot_h * (value - low) / (high - low)
            points.append(f"{x:.1f},{y:.1f}")
        if points:
            parts.append(
                f'<polyline points="{" ".join(points)}" fill="none" stroke="{colour}" '
                f'stroke-width="1.8"><title>{html.escape(name)}</title></polyline>'
            )
    parts.append(_finding_marks(data, top, top + plot_h, labels=True))
    parts.append(_time_axis(data, top + plot_h + 2))
    legend_x = FRAME.left
    for name, _, colour in series:
        parts.append(
            f'<rect x="{legend_x}" y="6" width="14" height="4" fill="{colour}"/>'
            f'<text x="{legend_x + 18}" y="12" class="tick">{html.escape(name)}</text>'
        )
        legend_x += 30 + 7 * len(name)
    parts.append("</svg>")
    return "".join(parts)


def phase_svg(data: ReportData) -> str:
    """Stacked bars: mean time per step in each phase, per time column."""
    if not data.phases:
        return '<p class="empty">No phase data.</p>'
    order = [p for p in PHASE_COLOURS if p in data.phases]
    order += sorted(p for p in data.phases if p not in PHASE_COLOURS)
    colours = dict(PHASE_COLOURS)
    for index, phase in enumerate(p for p in order if p not in PHASE_COLOURS):
        colours[phase] = EXTRA_COLOURS[index % len(EXTRA_COLOURS)]
    columns = len(data.column_times_unix_nano)
    totals = [sum(data.phases[p][c] or 0.0 for p in order) for c in range(columns)]
    high = max(totals) * 1.08 or 1.0
    plot_h = 220.0
    top = FRAME.top
    cell_w = FRAME.width / columns
    parts = ['<svg class="plot" viewBox="0 0 1000 300" width="1000" height="300" role="img">']
    for index in range(5):
        tick = high * index / 4
        y = top + plot_h - plot_h * index / 4
        parts.append(
            f'<line x1="{FRAME.left}" y1="{y:.1f}" x2="{FRAME.left + FRAME.width}" '
            f'y2="{y:.1f}" class="grid"/>'
            f'<text x="{FRAME.left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
            f"{format_seconds(tick)}</text>"
        )
    for column in range(columns):
        y = top + plot_h
        for phase in order:
            value = data.phases[phase][column]
            if not value:
                continue
            h = plot_h * value / high
            y -= h
            parts.append(
                f'<rect x="{FRAME.left + column * cell_w:.1f}" y="{y:.1f}" '
                f'width="{max(cell_w - 0.6, 0.4):.1f}" height="{h:.1f}" '
                f'fill="{colours[phase]}"><title>{html.escape(phase)} '
                f"{_clock(data.column_times_unix_nano[column])}: {format_seconds(value)}"
                "</title></rect>"
            )
    parts.append(_finding_marks(data, top, top + plot_h, labels=False))
    parts.append(_time_axis(data, top + plot_h + 2))
    legend_x = FRAME.left
    for phase in order:
        parts.append(
            f'<rect x="{legend_x}" y="4" width="10" height="10" fill="{colours[phase]}"/>'
            f'<text x="{legend_x + 14}" y="13" class="tick">{html.escape(phase)}</text>'
        )
        legend_x += 24 + 7 * len(phase)
    parts.append("</svg>")
    return "".join(parts)


def _ratio_text(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def _ratio_bar(ratio: float | None) -> str:
    """A tiny inline bar centred on 1×: right and red = slower, left and blue = faster."""
    if ratio is None or ratio <= 0:
        return ""
    shift = max(-1.0, min(1.0, math.log2(ratio)))
    width = abs(shift) * 60
    x = 60 if shift >= 0 else 60 - width
    colour = "#d62728" if shift > 0 else "#1f77b4"
    return (
        '<svg class="bar" viewBox="0 0 120 12" width="120" height="12">'
        '<line x1="60" y1="0" x2="60" y2="12" class="axis"/>'
        f'<rect x="{x:.1f}" y="2" width="{width:.1f}" height="8" fill="{colour}"/></svg>'
    )


def kernels_html(data: ReportData, *, limit: int = 12) -> str:
    if not data.kernels:
        return '<p class="empty">No kernel data.</p>'
    rows = []
    for shift in data.kernels[:limit]:
        outlier = (
            f"rank {html.escape(shift.outlier_rank)} {_ratio_text(shift.outlier_ratio)}"
            if shift.outlier_rank is not None
            else "–"
        )
        rows.append(
            "<tr>"
            f"<td><code>{html.escape(shift.kernel_class)}</code></td>"
            f"<td>{html.escape(shift.category)}</td>"
            f"<td class='num'>{format_seconds(shift.before_s)}</td>"
            f"<td class='num'>{format_seconds(shift.after_s)}</td>"
            f"<td class='num'>{_ratio_text(shift.job_ratio)}</td>"
            f"<td>{_ratio_bar(shift.job_ratio)}</td>"
            f"<td>{outlier}</td><td>{_ratio_bar(shift.outlier_ratio)}</td>"
            "</tr>"
        )
    return (
        "<table><thead><tr><th>kernel class</th><th>category</th>"
        "<th>mean before</th><th>mean after</th><th>after / before</th><th></th>"
        "<th>most different rank (after, vs median rank)</th><th></th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def findings_html(data: ReportData) -> str:
    if not data.findings:
        return "<p>No findings: the detectors found nothing wrong in this range.</p>"
    items = []
    for number, finding in enumerate(data.findings, start=1):
        until = (
            "still open"
            if finding.end_unix_nano is None
            else f"until {_stamp(finding.end_unix_nano)}"
        )
        items.append(
            f'<li class="{html.escape(finding.severity)}"><b>#{number} '
            f"{html.escape(finding.summary)}</b><br>"
            f"{html.escape(finding.kind.replace('_', ' '))}, {html.escape(finding.severity)} "
            f"(score {finding.score:.2f}); "
            f"{html.escape(finding.location)}; "
            f"since {_stamp(finding.start_unix_nano)}, {until}.</li>"
        )
    return f"<ol class='findings'>{''.join(items)}</ol>"


def headline(data: ReportData) -> str:
    """One sentence: how step time moved across the change."""
    change_column = (data.change_unix_nano - data.column_times_unix_nano[0]) // (
        data.bucket_s * 1_000_000_000
    )
    before = [v for v in data.step_median[:change_column] if v is not None]
    after = [v for v in data.step_median[change_column:] if v is not None]
    if not before or not after:
        return "Not enough data on both sides of the change to compare step time."
    ratio = statistics.median(after) / statistics.median(before)
    return (
        f"Median step time went from {format_seconds(statistics.median(before))} to "
        f"{format_seconds(statistics.median(after))} ({ratio:.2f}×) at "
        f"{_stamp(data.change_unix_nano)}."
    )


STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       margin: 24px auto; max-width: 1020px; color: #1d2329; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 6px; }
.meta { color: #5b6670; } .lead { font-size: 15px; }
svg.plot { display: block; background: #fbfbfc; border: 1px solid #e3e6ea; }
svg text.tick { font-size: 11px; fill: #4a535c; }
svg text.changelabel { font-size: 11px; fill: #b40000; font-weight: 600; }
svg line.axis { stroke: #7a848d; stroke-width: 1; } svg line.grid { stroke: #e6e9ec; }
svg line.change { stroke: #d40000; stroke-width: 1.5; stroke-dasharray: 4 3; }
svg rect.region { fill: #d40000; fill-opacity: 0.06; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e3e6ea; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
ol.findings li { margin-bottom: 8px; padding-left: 4px; }
li.critical b { color: #b40000; } li.warning b { color: #9a5b00; }
.empty { color: #8a939b; font-style: italic; } .note { color: #5b6670; font-size: 12px; }
"""


def render_html(data: ReportData) -> str:
    """The whole page; no external resources of any kind."""
    shown = (
        f"all {data.total_ranks} ranks"
        if len(data.ranks) == data.total_ranks
        else f"the {len(data.ranks)} ranks farthest from the median of {data.total_ranks}"
    )
    title = f"stepwatch report: {data.job}"
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='meta'>{_stamp(data.start_unix_nano)} – {_stamp(data.end_unix_nano)}; "
        f"{data.total_ranks} ranks; one column = {data.bucket_s} s; generated "
        f"{_stamp(time.time_ns())}.</p>",
        f"<p class='lead'>{html.escape(headline(data))}</p>",
        "<h2>Findings</h2>",
        findings_html(data),
        "<h2>Step time</h2>",
        "<p class='note'>Median over ranks of each window's p50, and the slowest step of any "
        "rank. Dashed red lines: findings start (change points); shaded: while open.</p>",
        line_svg(
            data,
            [
                ("p50 (median rank)", data.step_median, "#1f77b4"),
                ("max (any rank)", data.step_max, "#ff7f0e"),
            ],
        ),
        "<h2>Step time by rank</h2>",
        f"<p class='note'>Mean step wall time, {shown}. Ranks wait for each other in "
        "collectives, so a straggler slows every row; compare with compute time below.</p>",
        heatmap_svg(data, data.step_by_rank, unit_label="s"),
        "<h2>Compute kernel time by rank, relative to the median rank</h2>",
        "<p class='note'>Compute-kernel time of each rank divided by the median rank's in "
        "the same column (1.00× = typical). The straggler is the bright row: its own compute "
        "is slow while its peers wait.</p>",
        heatmap_svg(data, relative_to_median(data.compute_by_rank), unit_label="×"),
        "<h2>Phase breakdown</h2>",
        "<p class='note'>Mean time per step in each phase (mean over ranks).</p>",
        phase_svg(data),
        "<h2>Kernels that moved</h2>",
        f"<p class='note'>Mean kernel duration before and after {_stamp(data.change_unix_nano)}"
        ", and the rank whose kernels differ most from the median rank after it.</p>",
        kernels_html(data),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(sections)}</body></html>\n"
    )
