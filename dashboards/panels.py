"""Building blocks of stepwatch's dashboards: InfluxQL targets, annotations, panels.

Used by ``dashboards/generate.py`` (run it from the repository root; this file sits beside it).
Every query is raw InfluxQL on the stored layout (docs/storage.md).
"""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    heatmap,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model

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
#: Mean per observation (per step) of a histogram: exact over any number of windows, and built
#: on ``count``/``sum``, which every writer stores (the bridge and a Collector's influxdb
#: exporter alike; the bridge's own ``mean`` field is not written by a Collector).
MEAN = 'sum("sum") / sum("count")'
#: The description of a panel of kernel busy time: under a duty cycle, the profiled steps'.
SAMPLED_KERNELS = (
    "With op histograms on a duty cycle (torch.profiler, the default on a CPU: 5 steps every "
    "few thousand) only the profiled steps count, alike on every rank: compare ranks and "
    "categories, not the level; windows between cycles show no data."
)
#: The description of a panel reading the bridge's derived quantiles.
BRIDGE_ONLY = (
    "Needs the stepwatch bridge: p50/p90/p99 are derived from the buckets by the bridge "
    "(docs/storage.md), clamped to the window's min and max, else bounded by its mean: with "
    "buckets far wider than the values (an OpenTelemetry SDK's default bounds) they are "
    "bounds, not estimates. Data a Collector's influxdb exporter wrote has count, sum, min, "
    "max and the bucket fields only, so this shows no data there."
)


def m(name: str) -> str:
    """A measurement or key as an InfluxQL identifier (names contain dots)."""
    return '"' + name + '"'


class Q(cogbuilder.Builder[cogvariants.Dataquery], cogvariants.Dataquery):
    """A raw InfluxQL target of Grafana's InfluxDB datasource (not modelled by the SDK).

    It is its own builder: the SDK's panels take builders.
    """

    def __init__(
        self, query: str, *, alias: str = "", ref_id: str = "A", table_format: bool = False
    ) -> None:
        self.ref_id = ref_id
        self.query = query
        self.alias = alias
        self.result_format = "table" if table_format else "time_series"

    def build(self) -> cogvariants.Dataquery:
        return self

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


class Annotation(cogbuilder.Builder[model.AnnotationQuery], model.AnnotationQuery):
    """An InfluxQL annotation query (its own builder): columns name the region end, text, tags."""

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

    def build(self) -> model.AnnotationQuery:
        return self


FINDINGS_ANNOTATION = (
    'SELECT "title", "text", "time_end", "kind", "severity", "ranks" '
    f"FROM {m('stepwatch.diagnosis')} WHERE {JOB} = '$job' AND $timeFilter"
)


def query_variable(
    name: str, query: str, sort: model.VariableSort, *, multi: bool = True
) -> dash.QueryVariable:
    variable = (
        dash.QueryVariable(name)
        .label(name.capitalize())
        .datasource(DATASOURCE)
        .query(query)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
    )
    if not multi:
        return variable
    return (
        variable.multi(True)
        .include_all(True)
        .current(model.VariableOption(selected=True, text="All", value="$__all"))
    )


def variables() -> list[cogbuilder.Builder[model.VariableModel]]:
    step = m("stepwatch.step.duration")
    tag_values = f"SHOW TAG VALUES FROM {step} WITH KEY ="
    return [
        query_variable(
            "job", f"{tag_values} {JOB}", model.VariableSort.ALPHABETICAL_ASC, multi=False
        ),
        query_variable(
            "host", f"{tag_values} {HOST} WHERE {JOB} = '$job'", model.VariableSort.NATURAL_ASC
        ),
        query_variable(
            "rank",
            f"{tag_values} {RANK} WHERE {JOB} = '$job' AND {HOST} =~ /^$host$/",
            model.VariableSort.NUMERICAL_ASC,
        ),
    ]


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


def by_rank(title: str, select: str, source: str, *, unit: str = "s", where: str = "") -> Any:
    """One line per rank: ``SELECT {select} FROM {source} WHERE selection {where}``."""
    return ts(
        title,
        f"SELECT {select} FROM {source} WHERE {SELECTION}{where} {BY_TIME}, {RANK} fill(none)",
        alias=per_rank_alias(),
        unit=unit,
    )


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


def stat_panel(title: str, query: str, *, unit: str) -> stat.Panel:
    """A small number at the top of a board (6 columns wide)."""
    return stat.Panel().title(title).datasource(DATASOURCE).with_target(Q(query)).unit(unit)


def bar(title: str, query: str, *, alias: str, height: int) -> bargauge.Panel:
    """Horizontal bars, one per tag value (8 columns wide)."""
    return (
        bargauge.Panel()
        .title(title)
        .datasource(DATASOURCE)
        .with_target(Q(query, alias=alias))
        .unit("s")
        .orientation(common.VizOrientation.HORIZONTAL)
        .span(8)
        .height(height)
    )


def table_panel(title: str, query: str, *, span: int, height: int) -> table.Panel:
    return (
        table.Panel()
        .title(title)
        .datasource(DATASOURCE)
        .with_target(Q(query, table_format=True))
        .span(span)
        .height(height)
    )
