"""Generate stepwatch's Grafana dashboards as code (grafana-foundation-sdk, Grafana 11 schema).

Run ``.venv/bin/python dashboards/generate.py`` after editing this file and commit the JSON;
``--check`` exits 1 when a committed file differs from what this file generates (the test
in tests/operators does the same and also runs every query against a real InfluxDB).

Every query is raw InfluxQL on the stored layout (docs/CONTRACTS.md): measurement = metric
name, tags = attribute keys verbatim (``"stepwatch.rank"``), histogram fields
``count/sum/min/max/mean/p50/p90/p99``. Template variables ``$job``, ``$host``, ``$rank``
filter every panel; findings come from an InfluxDB annotation query on
``stepwatch.diagnosis`` (no Grafana credentials needed).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    heatmap,
    stat,
    statushistory,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model

HERE = Path(__file__).resolve().parent

# The datasource provisioned by grafana/provisioning/datasources/stepwatch.yaml.
DATASOURCE = model.DataSourceRef(type_val="influxdb", uid="stepwatch-influxdb")

# Dashboard uids are fixed: links, alert dashboard_url and bookmarks depend on them.
UIDS = {
    "overview": "stepwatch-job",
    "ranks": "stepwatch-ranks",
    "phases": "stepwatch-phases",
    "kernels": "stepwatch-kernels",
    "comm": "stepwatch-comm-compute",
    "health": "stepwatch-device-health",
}

JOB = '"stepwatch.job.id"'
RANK = '"stepwatch.rank"'
HOST = '"host.name"'
SELECTION = f"{JOB} = '$job' AND {HOST} =~ /^$host$/ AND {RANK} =~ /^$rank$/ AND $timeFilter"
BY_TIME = "GROUP BY time($__interval)"


def m(name: str) -> str:
    """A measurement or key as an InfluxQL identifier (names contain dots)."""
    return '"' + name + '"'


class InfluxQLQuery(cogvariants.Dataquery):
    """A raw InfluxQL target of Grafana's InfluxDB datasource (not modelled by the SDK)."""

    def __init__(self, query: str, *, alias: str = "", result_format: str = "time_series"):
        self.ref_id = "A"
        self.query = query
        self.alias = alias
        self.result_format = result_format

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
            "refId": self.ref_id,
            "datasource": DATASOURCE.to_json(),
            "query": self.query,
            "rawQuery": True,
            "resultFormat": self.result_format,
        }
        if self.alias:
            payload["alias"] = self.alias
        return payload


class Q(cogbuilder.Builder[cogvariants.Dataquery]):
    """Builder for :class:`InfluxQLQuery` (the SDK's panels take builders)."""

    def __init__(
        self, query: str, *, alias: str = "", ref_id: str = "A", table_format: bool = False
    ) -> None:
        self._query = InfluxQLQuery(
            query, alias=alias, result_format="table" if table_format else "time_series"
        )
        self._query.ref_id = ref_id

    def build(self) -> cogvariants.Dataquery:
        return self._query


class InfluxAnnotation(model.AnnotationQuery):
    """An InfluxQL annotation query: columns name the region end, text and tags."""

    def __init__(self, query: str) -> None:
        super().__init__(
            name="stepwatch findings",
            datasource=DATASOURCE,
            enable=True,
            icon_color="red",
        )
        self.query = query

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        columns = {
            "titleColumn": "title",
            "textColumn": "text",
            "tagsColumn": "kind,severity,ranks",
            "timeEndColumn": "time_end",
        }
        # Grafana 11 reads ``target``; the top-level copy is the pre-10 form it migrates.
        payload["target"] = {
            "refId": "Anno",
            "query": self.query,
            "rawQuery": True,
            "resultFormat": "table",
            "fromAnnotations": True,
            **columns,
        }
        payload["query"] = self.query
        payload.update(columns)
        return payload


class Annotation(cogbuilder.Builder[model.AnnotationQuery]):
    def __init__(self, query: str) -> None:
        self._annotation = InfluxAnnotation(query)

    def build(self) -> model.AnnotationQuery:
        return self._annotation


FINDINGS_ANNOTATION = (
    'SELECT "title", "text", "time_end", "kind", "severity", "ranks" '
    f"FROM {m('stepwatch.diagnosis')} WHERE {JOB} = '$job' AND $timeFilter"
)


def variables() -> list[cogbuilder.Builder[model.VariableModel]]:
    step = m("stepwatch.step.duration")
    job = (
        dash.QueryVariable("job")
        .label("Job")
        .datasource(DATASOURCE)
        .query(f"SHOW TAG VALUES FROM {step} WITH KEY = {JOB}")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )
    host = (
        dash.QueryVariable("host")
        .label("Host")
        .datasource(DATASOURCE)
        .query(f"SHOW TAG VALUES FROM {step} WITH KEY = {HOST} WHERE {JOB} = '$job'")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .current(model.VariableOption(selected=True, text="All", value="$__all"))
    )
    rank = (
        dash.QueryVariable("rank")
        .label("Rank")
        .datasource(DATASOURCE)
        .query(
            f"SHOW TAG VALUES FROM {step} WITH KEY = {RANK} "
            f"WHERE {JOB} = '$job' AND {HOST} =~ /^$host$/"
        )
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.NUMERICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(model.VariableOption(selected=True, text="All", value="$__all"))
    )
    return [job, host, rank]


def links() -> list[cogbuilder.Builder[model.DashboardLink]]:
    """One dropdown to every stepwatch dashboard, keeping time range and variables."""
    return [
        dash.DashboardLink("stepwatch")
        .type(model.DashboardLinkType.DASHBOARDS)
        .tags(["stepwatch"])
        .as_dropdown(True)
        .include_vars(True)
        .keep_time(True)
    ]


def base(key: str, title: str, description: str) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(UIDS[key])
        .description(description)
        .tags(["stepwatch"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-3h", "now")
        .refresh("1m")
        .timezone("browser")
        .variables(variables())
        .annotation(Annotation(FINDINGS_ANNOTATION))
        .links(links())
    )


def per_rank_alias() -> str:
    return "rank [[tag_stepwatch.rank]]"


def ts(
    title: str, query: str, *, unit: str = "s", alias: str = "", stacked: bool = False
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .datasource(DATASOURCE)
        .with_target(Q(query, alias=alias))
        .unit(unit)
        .span(12)
        .height(8)
        .fill_opacity(10 if not stacked else 60)
        .line_width(1)
        .span_nulls(True)
    )
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    return panel


def rank_heatmap(title: str, query: str, *, unit: str, description: str) -> heatmap.Panel:
    """Ranks as rows, time as columns, colour = value: a straggler is one bright row."""
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(Q(query, alias="[[tag_stepwatch.rank]]"))
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN))
        .y_axis(heatmap.YAxisConfig().axis_label("rank"))
        .cell_values(heatmap.CellValues().unit(unit))
        .color(
            heatmap.HeatmapColorOptions()
            .mode(heatmap_model.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .scale(heatmap_model.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
        )
        .cell_gap(1)
        .show_legend()
        .span(24)
        .height(10)
    )


def overview() -> dash.Dashboard:
    step = m("stepwatch.step.duration")
    board = base(
        "overview",
        "stepwatch / Job overview",
        "Is the job slower than it was? Step time, throughput and the findings of the "
        "detectors for one training job.",
    )
    board = board.with_panel(
        stat.Panel()
        .title("Step time p50 (median rank)")
        .datasource(DATASOURCE)
        .with_target(Q(f'SELECT median("p50") FROM {step} WHERE {SELECTION}'))
        .unit("s")
        .span(6)
        .height(4)
    )
    board = board.with_panel(
        stat.Panel()
        .title("Throughput")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT non_negative_derivative(max("gauge"), 1s) '
                f"FROM {m('stepwatch.step.last')} WHERE {SELECTION} {BY_TIME} fill(none)"
            )
        )
        .unit("steps/s")
        .span(6)
        .height(4)
    )
    board = board.with_panel(
        stat.Panel()
        .title("Ranks reporting")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT count("last") FROM (SELECT last("count") AS "last" FROM {step} '
                f"WHERE {SELECTION} GROUP BY {RANK})"
            )
        )
        .unit("none")
        .span(6)
        .height(4)
    )
    board = board.with_panel(
        stat.Panel()
        .title("Open findings")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT count("title") FROM {m("stepwatch.diagnosis")} '
                f"WHERE {JOB} = '$job' AND \"state\" = 'open' AND $timeFilter"
            )
        )
        .unit("none")
        .no_value("0")
        .span(6)
        .height(4)
    )
    board = board.with_panel(
        timeseries.Panel()
        .title("Step time: median rank p50 and slowest step")
        .datasource(DATASOURCE)
        .targets(
            [
                Q(
                    f'SELECT median("p50") AS "p50 (median rank)" FROM {step} '
                    f"WHERE {SELECTION} {BY_TIME} fill(none)",
                    ref_id="A",
                ),
                Q(
                    f'SELECT max("max") AS "max (any rank)" FROM {step} '
                    f"WHERE {SELECTION} {BY_TIME} fill(none)",
                    ref_id="B",
                ),
            ]
        )
        .unit("s")
        .fill_opacity(10)
        .span_nulls(True)
        .span(16)
        .height(9)
    )
    board = board.with_panel(
        ts(
            "Throughput (steps/s)",
            f'SELECT non_negative_derivative(max("gauge"), 1s) AS "steps/s" '
            f"FROM {m('stepwatch.step.last')} WHERE {SELECTION} {BY_TIME} fill(none)",
            unit="none",
        )
        .span(8)
        .height(9)
    )
    return board.with_panel(
        table.Panel()
        .title("Findings")
        .description("Written by the detectors to stepwatch.diagnosis, newest first.")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                'SELECT "severity", "kind", "title", "ranks", "hosts", "phase", '
                f'"kernel_class", "score", "state" FROM {m("stepwatch.diagnosis")} '
                f"WHERE {JOB} = '$job' AND $timeFilter ORDER BY time DESC LIMIT 200",
                table_format=True,
            )
        )
        .span(24)
        .height(9)
    )


def ranks() -> dash.Dashboard:
    step = m("stepwatch.step.duration")
    kernel = m("stepwatch.kernel.duration")
    board = base(
        "ranks",
        "stepwatch / Rank heatmap",
        "Which rank? Ranks of one job run the same code, so one row that stands out is the "
        "lead. Compute-only busy time blames the culprit; wall time also marks its victims.",
    )
    board = board.with_panel(
        rank_heatmap(
            "Step time by rank (mean)",
            f'SELECT mean("mean") FROM {step} WHERE {SELECTION} {BY_TIME}, {RANK} fill(none)',
            unit="s",
            description="Wall time per step. A slow rank makes every rank slow (they wait "
            "in collectives), so compare with compute time below.",
        )
    )
    board = board.with_panel(
        rank_heatmap(
            "Compute kernel time by rank (busy seconds per second)",
            f'SELECT sum("sum") * 1000 / $__interval_ms FROM {kernel} WHERE {SELECTION} '
            f"AND {m('stepwatch.kernel.category')} = 'compute' {BY_TIME}, {RANK} fill(none)",
            unit="percentunit",
            description="Time compute kernels ran, per second of wall time. The straggler "
            "is the bright row: its compute is slow while its peers wait.",
        )
    )
    board = board.with_panel(
        ts(
            "Step time p50 by rank",
            f'SELECT mean("p50") FROM {step} WHERE {SELECTION} {BY_TIME}, {RANK} fill(none)',
            alias=per_rank_alias(),
        ).span(16)
    )
    return board.with_panel(
        table.Panel()
        .title("Slowest ranks (worst window p90)")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT top("p90", {RANK}, 10) FROM {step} WHERE {SELECTION}',
                table_format=True,
            )
        )
        .span(8)
        .height(8)
    )


def phases() -> dash.Dashboard:
    phase = m("stepwatch.phase.duration")
    board = base(
        "phases",
        "stepwatch / Phase breakdown",
        "Which phase? Data, forward, backward, optimizer, communication per step.",
    )
    board = board.with_panel(
        ts(
            "Phase time per step (mean over ranks, stacked)",
            f'SELECT mean("mean") FROM {phase} WHERE {SELECTION} '
            f"{BY_TIME}, {m('stepwatch.phase')} fill(none)",
            alias="[[tag_stepwatch.phase]]",
            stacked=True,
        ).span(16)
    )
    board = board.with_panel(
        bargauge.Panel()
        .title("Share of time by phase")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT sum("sum") FROM {phase} WHERE {SELECTION} GROUP BY {m("stepwatch.phase")}',
                alias="[[tag_stepwatch.phase]]",
            )
        )
        .unit("s")
        .orientation(common.VizOrientation.HORIZONTAL)
        .span(8)
        .height(8)
    )
    board = board.with_panel(
        ts(
            "Cross-rank spread by phase (slowest rank / median rank)",
            f'SELECT max("mean") / median("mean") FROM {phase} WHERE {SELECTION} '
            f"{BY_TIME}, {m('stepwatch.phase')} fill(none)",
            alias="[[tag_stepwatch.phase]]",
            unit="none",
        ).span(12)
    )
    return board.with_panel(
        ts(
            "Data-loader time by rank",
            f'SELECT mean("mean") FROM {phase} WHERE {SELECTION} '
            f"AND {m('stepwatch.phase')} = 'data' {BY_TIME}, {RANK} fill(none)",
            alias=per_rank_alias(),
        )
    )


def kernels() -> dash.Dashboard:
    kernel = m("stepwatch.kernel.duration")
    kclass = m("stepwatch.kernel.class")
    board = base(
        "kernels",
        "stepwatch / Kernel classes",
        "Which kernel? Time per kernel class, and how much it differs across ranks.",
    )
    board = board.with_panel(
        bargauge.Panel()
        .title("Top kernel classes by total time")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT sum("sum") FROM {kernel} WHERE {SELECTION} GROUP BY {kclass}',
                alias="[[tag_stepwatch.kernel.class]]",
            )
        )
        .unit("s")
        .orientation(common.VizOrientation.HORIZONTAL)
        .span(8)
        .height(10)
    )
    board = board.with_panel(
        ts(
            "Kernel time by class (busy seconds per second, all ranks)",
            f'SELECT sum("sum") * 1000 / $__interval_ms '
            f"FROM {kernel} WHERE {SELECTION} {BY_TIME}, {kclass} fill(none)",
            alias="[[tag_stepwatch.kernel.class]]",
            unit="none",
        )
        .span(16)
        .height(10)
    )
    board = board.with_panel(
        ts(
            "Cross-rank spread of median kernel duration (slowest / fastest rank)",
            f'SELECT max("p50") / min("p50") FROM {kernel} WHERE {SELECTION} '
            f"{BY_TIME}, {kclass} fill(none)",
            alias="[[tag_stepwatch.kernel.class]]",
            unit="none",
        )
    )
    return board.with_panel(
        ts(
            "Kernel p90 duration by class",
            f'SELECT max("p90") FROM {kernel} WHERE {SELECTION} {BY_TIME}, {kclass} fill(none)',
            alias="[[tag_stepwatch.kernel.class]]",
        )
    )


def comm() -> dash.Dashboard:
    kernel = m("stepwatch.kernel.duration")
    category = m("stepwatch.kernel.category")
    board = base(
        "comm",
        "stepwatch / Communication vs compute",
        "Link or compute? Communication kernels slow on the ranks of one node with normal "
        "compute point at a link or NIC; peers waiting on one slow rank point at it.",
    )
    board = board.with_panel(
        ts(
            "Busy time by kernel category (seconds per second, all ranks)",
            f'SELECT sum("sum") * 1000 / $__interval_ms FROM {kernel} WHERE {SELECTION} '
            f"{BY_TIME}, {category} fill(none)",
            alias="[[tag_stepwatch.kernel.category]]",
            unit="none",
            stacked=True,
        )
    )
    board = board.with_panel(
        ts(
            "Communication time by host",
            f'SELECT sum("sum") * 1000 / $__interval_ms FROM {kernel} WHERE {SELECTION} '
            f"AND {category} = 'communication' {BY_TIME}, {HOST} fill(none)",
            alias="[[tag_host.name]]",
            unit="none",
        )
    )
    board = board.with_panel(
        rank_heatmap(
            "Communication kernel time by rank (busy seconds per second)",
            f'SELECT sum("sum") * 1000 / $__interval_ms FROM {kernel} WHERE {SELECTION} '
            f"AND {category} = 'communication' {BY_TIME}, {RANK} fill(none)",
            unit="percentunit",
            description="Waiting in collectives counts here: victims of a straggler are "
            "bright, the straggler itself is dark.",
        )
    )
    return board.with_panel(
        ts(
            "Device idle time per step by rank",
            f'SELECT mean("mean") FROM {m("stepwatch.device.idle.duration")} '
            f"WHERE {SELECTION} {BY_TIME}, {RANK} fill(none)",
            alias=per_rank_alias(),
        ).span(24)
    )


def health() -> dash.Dashboard:
    board = base(
        "health",
        "stepwatch / Device health",
        "GPU clocks, temperature, power, utilisation and XID errors (NVML), by rank.",
    )
    gauges = [
        ("SM clock", "stepwatch.gpu.sm_clock", "hertz"),
        ("GPU utilisation", "hw.gpu.utilization", "percentunit"),
        ("Temperature", "hw.temperature", "celsius"),
        ("Power", "hw.power", "watt"),
        ("Memory used", "hw.gpu.memory.usage", "bytes"),
    ]
    for title, measurement, unit in gauges:
        board = board.with_panel(
            ts(
                f"{title} by rank",
                f'SELECT mean("gauge") FROM {m(measurement)} WHERE {SELECTION} '
                f"{BY_TIME}, {RANK} fill(none)",
                alias=per_rank_alias(),
                unit=unit,
            )
        )
    board = board.with_panel(
        statushistory.Panel()
        .title("Clock-event (throttle) reasons bitmask by rank")
        .description("Non-zero = clocks held down (thermal, power, sync boost...).")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT max("gauge") FROM {m("stepwatch.gpu.clock_event.reasons")} '
                f"WHERE {SELECTION} {BY_TIME}, {RANK} fill(none)",
                alias=per_rank_alias(),
            )
        )
        .span(12)
        .height(8)
    )
    return board.with_panel(
        table.Panel()
        .title("XID errors")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT max("counter") AS "events" FROM {m("stepwatch.gpu.xid")} '
                f"WHERE {SELECTION} GROUP BY {RANK}, {HOST}, {m('stepwatch.gpu.xid.code')}",
                table_format=True,
            )
        )
        .span(24)
        .height(6)
    )


BUILDERS: dict[str, Callable[[], dash.Dashboard]] = {
    "job-overview": overview,
    "rank-heatmap": ranks,
    "phase-breakdown": phases,
    "kernel-classes": kernels,
    "comm-vs-compute": comm,
    "device-health": health,
}


def render() -> dict[str, str]:
    """File name → JSON text of every dashboard (deterministic: sorted keys, fixed ids)."""
    rendered: dict[str, str] = {}
    for name, build in BUILDERS.items():
        data: dict[str, Any] = json.loads(json.dumps(build().build(), cls=JSONEncoder))
        for panel_id, panel in enumerate(data.get("panels", []), start=1):
            panel["id"] = panel_id
        rendered[f"{name}.json"] = json.dumps(data, indent=2, sort_keys=True) + "\n"
    return rendered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="diff instead of writing")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder")
    args = parser.parse_args(argv)
    differs = False
    for name, text in render().items():
        path = args.out / name
        old = path.read_text() if path.exists() else ""
        if args.check:
            if old != text:
                differs = True
                sys.stdout.writelines(
                    difflib.unified_diff(old.splitlines(True), text.splitlines(True), name, name)
                )
        elif old != text:
            path.write_text(text)
            print(f"wrote {path}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
