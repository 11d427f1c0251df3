"""``stepwatch report``: one self-contained HTML page about one job.

The page answers the detectors' three questions for a reader without Grafana: is the job
slower (step time over time, change points marked), which ranks and phases (rank × time
heatmaps, phase breakdown), which kernels moved (before/after the change, and the rank that
differs most from its peers) — and states the findings in words. Plots are inline SVG; the
file loads nothing from anywhere (no scripts, fonts, images or CDN), so it can be mailed or
attached to a ticket.
"""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._influx import InfluxClient
from stepwatch.detectors.report._data import ReportData, load_report_data, relative_to_median
from stepwatch.detectors.report._svg import (
    empty,
    format_seconds,
    heatmap_svg,
    line_svg,
    phase_svg,
    ratio_bar,
    stamp,
)
from stepwatch.detectors.sinks._alertmanager import cost_text


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


NO_KERNELS = (
    "No kernel timings: the job collected none (give StepMonitor a kernel_source, "
    "TorchProfilerSource() on CPU or CuptiSource() on GPU; stepwatch demo collects them "
    "unless --no-kernels)."
)


NO_COMPUTE = "No compute-category kernels among the job's kernel timings."


def _ratio_text(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def kernels_html(data: ReportData, *, limit: int = 12) -> str:
    """The ``limit`` kernel classes that moved most, as a table with inline ratio bars."""
    if not data.kernels:
        return empty(NO_KERNELS)
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
            f"<td class='num'>{shift.share:.0%}</td>"
            f"<td class='num'>{_ratio_text(shift.job_ratio)}</td>"
            f"<td>{ratio_bar(shift.job_ratio)}</td>"
            f"<td>{outlier}</td><td>{ratio_bar(shift.outlier_ratio)}</td>"
            "</tr>"
        )
    return (
        "<table><thead><tr><th>kernel class</th><th>category</th>"
        "<th>mean before</th><th>mean after</th><th>share of kernel time</th>"
        "<th>after / before</th><th></th>"
        "<th>most different rank (after, vs median rank)</th><th></th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def findings_html(data: ReportData) -> str:
    """The findings in words, numbered as the marks on the plots."""
    if not data.findings:
        return "<p>No findings: the detectors found nothing wrong in this range.</p>"
    items = []
    for number, finding in enumerate(data.findings, start=1):
        until = (
            "still open"
            if finding.end_unix_nano is None
            else f"until {stamp(finding.end_unix_nano)}"
        )
        items.append(
            f'<li class="{html.escape(finding.severity)}"><b>#{number} '
            f"{html.escape(finding.summary)}</b><br>"
            f"{html.escape(finding.kind.replace('_', ' '))}, {html.escape(finding.severity)}, "
            f"cost {html.escape(cost_text(finding))} (score {finding.score:.2f}); "
            f"{html.escape(finding.location)}; "
            f"since {stamp(finding.start_unix_nano)}, {until}.</li>"
        )
    return f"<ol class='findings'>{''.join(items)}</ol>"


def headline(data: ReportData) -> str:
    """One true sentence: what the costliest finding did to the job, or that it is healthy."""
    if not data.findings:
        steps = [v for v in data.step_median if v is not None]
        typical = f"; median step time {format_seconds(statistics.median(steps))}" if steps else ""
        return (
            f"Healthy: the detectors found nothing wrong in this range{typical} "
            f"over {data.total_ranks} ranks."
        )
    top = data.findings[0]  # the costliest (load_report_data orders them)
    what = top.kind.replace("_", " ") + (f" in {top.phase}" if top.phase else "")
    since = stamp(max(top.start_unix_nano, data.start_unix_nano))
    who = top.blamed
    more = len(data.findings) - 1
    tail = f" ({more} more finding{'s' if more > 1 else ''} below.)" if more else ""
    if top.slowdown > 1.0:
        subject = f"{who[:1].upper()}{who[1:]} slowed the job" if who else "The whole job slowed"
        return f"{subject} {top.slowdown:.2f}× from {since} ({what}).{tail}"
    where = f" on {who}" if who else ""
    return f"{what[:1].upper()}{what[1:]}{where} from {since}; its cost is not estimated.{tail}"


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
        f"<p class='meta'>{stamp(data.start_unix_nano)} – {stamp(data.end_unix_nano)}; "
        f"{data.total_ranks} ranks; one column = {data.bucket_s} s; generated "
        f"{stamp(time.time_ns())}.</p>",
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
        "is slow while its peers wait. With op histograms on a duty cycle (torch.profiler, "
        "the default on a CPU) a column holds the profiled steps only: columns between "
        "cycles are empty, and one may hold a few ranks' probes.</p>",
        heatmap_svg(
            data,
            relative_to_median(data.compute_by_rank),
            unit_label="×",
            no_data=NO_KERNELS if not data.kernels else NO_COMPUTE,
        ),
        "<h2>Phase breakdown</h2>",
        "<p class='note'>Mean time per step in each phase (mean over ranks).</p>",
        phase_svg(data),
        "<h2>Kernels that moved</h2>",
        f"<p class='note'>Mean kernel duration before and after {stamp(data.change_unix_nano)}"
        ", and the rank whose kernels differ most from the median rank after it; those that "
        "moved most, weighted by their share of kernel time, first.</p>",
        kernels_html(data),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(sections)}</body></html>\n"
    )
