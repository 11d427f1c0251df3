"""The report's plots as plain SVG strings: heatmaps, time lines and stacked phase bars.

Every time plot shares one plot-area geometry (:data:`FRAME`), so columns, findings and the
time axis line up from one plot to the next. Colours: a perceptually ordered scale (viridis)
for heatmaps, a fixed colour per phase.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from stepwatch.detectors.report._data import ReportData

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


def _clock(time_unix_nano: int) -> str:
    return datetime.fromtimestamp(time_unix_nano / 1e9, tz=UTC).strftime("%H:%M:%S")


def stamp(time_unix_nano: int) -> str:
    """A moment as ``YYYY-mm-dd HH:MM:SS UTC``."""
    return datetime.fromtimestamp(time_unix_nano / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_seconds(value: float | None) -> str:
    """A duration in the unit that reads best (µs, ms or s); ``–`` when unknown."""
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


def empty(reason: str) -> str:
    """What a section without data shows: why it has none."""
    return f'<p class="empty">{html.escape(reason)}</p>'


NO_STEPS = "No step windows in this range."
NO_PHASES = (
    "No phase timings: the job reported steps without phases (time them with "
    "monitor.phase(...) or monitor.instrument(model, optimizer))."
)


def heatmap_svg(
    data: ReportData,
    values_by_rank: Mapping[str, list[float | None]],
    *,
    unit_label: str,
    no_data: str = NO_STEPS,
) -> str:
    """Ranks as rows, time as columns; colour scaled between the 2nd and 98th percentile.

    ``no_data``: what the section says when there is nothing to draw (why).
    """
    ranks = [rank for rank in data.ranks if rank in values_by_rank]
    if not ranks:
        return empty(no_data)
    row_h = max(4.0, min(16.0, 420.0 / len(ranks)))
    columns = len(data.column_times_unix_nano)
    cell_w = FRAME.width / columns
    every = [v for rank in ranks for v in values_by_rank[rank] if v is not None]
    if not every:
        return empty(no_data)
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


_PLOT_OPEN = '<svg class="plot" viewBox="0 0 1000 300" width="1000" height="300" role="img">'


def _seconds_grid(low: float, high: float, *, top: float, plot_h: float) -> str:
    """Five horizontal grid lines from ``low`` to ``high`` seconds, labelled on the left."""
    parts = []
    for index in range(5):
        tick = low + (high - low) * index / 4
        y = top + plot_h - plot_h * index / 4
        parts.append(
            f'<line x1="{FRAME.left}" y1="{y:.1f}" x2="{FRAME.left + FRAME.width}" '
            f'y2="{y:.1f}" class="grid"/>'
            f'<text x="{FRAME.left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
            f"{format_seconds(tick)}</text>"
        )
    return "".join(parts)


def _y_scale(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if high <= low:
        high = low + (abs(low) or 1.0)
    pad = (high - low) * 0.08
    return max(0.0, low - pad), high + pad


def _legend(
    entries: Sequence[tuple[str, str]], *, box: tuple[int, int, int], text_y: int, gap: int
) -> str:
    """Names with their colour swatch in a row along the top (``box``: y, width, height)."""
    box_y, box_w, box_h = box
    parts = []
    x = FRAME.left
    for name, colour in entries:
        parts.append(
            f'<rect x="{x}" y="{box_y}" width="{box_w}" height="{box_h}" fill="{colour}"/>'
            f'<text x="{x + box_w + 4}" y="{text_y}" class="tick">{html.escape(name)}</text>'
        )
        x += gap + 7 * len(name)
    return "".join(parts)


def line_svg(data: ReportData, series: Sequence[tuple[str, list[float | None], str]]) -> str:
    """Time series lines (seconds), findings as vertical lines labelled with their number."""
    every = [v for _, values, _ in series for v in values if v is not None]
    if not every:
        return empty(NO_STEPS)
    low, high = _y_scale(every)
    plot_h = 220.0
    top = FRAME.top
    parts = [_PLOT_OPEN, _seconds_grid(low, high, top=top, plot_h=plot_h)]
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
    legend = [(name, colour) for name, _, colour in series]
    parts.append(_legend(legend, box=(6, 14, 4), text_y=12, gap=30))
    parts.append("</svg>")
    return "".join(parts)


def phase_svg(data: ReportData) -> str:
    """Stacked bars: mean time per step in each phase, per time column."""
    if not data.phases:
        return empty(NO_PHASES)
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
    parts = [_PLOT_OPEN, _seconds_grid(0.0, high, top=top, plot_h=plot_h)]
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
    legend = [(phase, colours[phase]) for phase in order]
    parts.append(_legend(legend, box=(4, 10, 10), text_y=13, gap=24))
    parts.append("</svg>")
    return "".join(parts)


def ratio_bar(ratio: float | None) -> str:
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
