"""Generate stepwatch's Grafana dashboards as code (grafana-foundation-sdk, Grafana 11 schema).

Run ``.venv/bin/python dashboards/generate.py`` after editing this file and commit the JSON;
``--check`` exits 1 when a committed file differs from what this file generates (the test
in tests/dashboards does the same and also runs every query against a real InfluxDB).

Every query is raw InfluxQL on the stored layout (docs/storage.md): measurement = metric
name, tags = attribute keys verbatim (``"stepwatch.rank"``), histogram fields
``count/sum/min/max`` and the bucket bounds, which a Collector's influxdb exporter writes too
(means are ``sum("sum") / sum("count")``: exact per step); ``p50/p90/p99`` are derived by the
bridge only, and the panels reading them say so (:data:`panels.BRIDGE_ONLY`). Template
variables ``$job``, ``$host``, ``$rank`` filter every panel; findings come from an InfluxDB
annotation query on ``stepwatch.diagnosis`` (no Grafana credentials needed).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import (
    statushistory,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from panels import (  # the sibling module: run this file as a script
    BRIDGE_ONLY,
    BY_TIME,
    DATASOURCE,
    HOST,
    JOB,
    MEAN,
    RANK,
    SAMPLED_KERNELS,
    SELECTION,
    Q,
    bar,
    base,
    by_rank,
    m,
    per_rank_alias,
    rank_heatmap,
    stat_panel,
    table_panel,
    ts,
)

HERE = Path(__file__).resolve().parent


def overview() -> dash.Dashboard:
    step = m("stepwatch.step.duration")
    board = base(
        "overview",
        "stepwatch / Job overview",
        "Is the job slower than it was? Step time, throughput and the findings of the "
        "detectors for one training job.",
    )
    stats = [
        stat_panel(
            "Step time p50 (median rank)",
            f'SELECT median("p50") FROM {step} WHERE {SELECTION}',
            unit="s",
        ).description(BRIDGE_ONLY),
        stat_panel(
            "Throughput",
            f'SELECT non_negative_derivative(max("gauge"), 1s) '
            f"FROM {m('stepwatch.step.last')} WHERE {SELECTION} {BY_TIME} fill(none)",
            unit="steps/s",
        ),
        stat_panel(
            "Ranks reporting",
            f'SELECT count("last") FROM (SELECT last("count") AS "last" FROM {step} '
            f"WHERE {SELECTION} GROUP BY {RANK})",
            unit="none",
        ),
        stat_panel(
            "Open findings",
            f'SELECT count("title") FROM {m("stepwatch.diagnosis")} '
            f"WHERE {JOB} = '$job' AND \"state\" = 'open' AND $timeFilter",
            unit="none",
        ).no_value("0"),
    ]
    for panel in stats:
        board = board.with_panel(panel.span(6).height(4))
    board = board.with_panel(
        timeseries.Panel()
        .title("Step time: median rank p50 and slowest step")
        .description(
            "p50: " + BRIDGE_ONLY + " The slowest step (max) is read from any writer's data."
        )
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
        table_panel(
            "Findings",
            'SELECT "severity", "kind", "title", "ranks", "hosts", "phase", '
            f'"kernel_class", "score", "state" FROM {m("stepwatch.diagnosis")} '
            f"WHERE {JOB} = '$job' AND $timeFilter ORDER BY time DESC LIMIT 200",
            span=24,
            height=9,
        ).description("Written by the detectors to stepwatch.diagnosis, newest first.")
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
            f"SELECT {MEAN} FROM {step} WHERE {SELECTION} {BY_TIME}, {RANK} fill(none)",
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
            "is the bright row: its compute is slow while its peers wait. " + SAMPLED_KERNELS,
        )
    )
    board = board.with_panel(
        by_rank("Step time p50 by rank", 'mean("p50")', step).span(16).description(BRIDGE_ONLY)
    )
    return board.with_panel(
        table_panel(
            "Slowest ranks (worst window p90)",
            f'SELECT top("p90", {RANK}, 10) FROM {step} WHERE {SELECTION}',
            span=8,
            height=8,
        ).description(BRIDGE_ONLY)
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
            f"SELECT {MEAN} FROM {phase} WHERE {SELECTION} "
            f"{BY_TIME}, {m('stepwatch.phase')} fill(none)",
            alias="[[tag_stepwatch.phase]]",
            stacked=True,
        ).span(16)
    )
    board = board.with_panel(
        bar(
            "Share of time by phase",
            f'SELECT sum("sum") FROM {phase} WHERE {SELECTION} GROUP BY {m("stepwatch.phase")}',
            alias="[[tag_stepwatch.phase]]",
            height=8,
        )
    )
    board = board.with_panel(
        ts(
            "Cross-rank spread by phase (slowest rank / median rank)",
            # per rank and window: sum / count (the bridge's "mean", computed here so data a
            # Collector wrote works too)
            f'SELECT max("per_step") / median("per_step") FROM (SELECT "sum" / "count" AS '
            f'"per_step" FROM {phase} WHERE {SELECTION} GROUP BY {m("stepwatch.phase")}) '
            f"WHERE $timeFilter {BY_TIME}, {m('stepwatch.phase')} fill(none)",
            alias="[[tag_stepwatch.phase]]",
            unit="none",
        ).span(12)
    )
    return board.with_panel(
        by_rank(
            "Data-loader time by rank",
            MEAN,
            phase,
            where=f" AND {m('stepwatch.phase')} = 'data'",
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
        bar(
            "Top kernel classes by total time",
            f'SELECT sum("sum") FROM {kernel} WHERE {SELECTION} GROUP BY {kclass}',
            alias="[[tag_stepwatch.kernel.class]]",
            height=10,
        )
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
        ).description(BRIDGE_ONLY)
    )
    return board.with_panel(
        ts(
            "Kernel p90 duration by class",
            f'SELECT max("p90") FROM {kernel} WHERE {SELECTION} {BY_TIME}, {kclass} fill(none)',
            alias="[[tag_stepwatch.kernel.class]]",
        ).description(BRIDGE_ONLY)
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
        ).description(SAMPLED_KERNELS)
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
        by_rank(
            "Device idle time per step by rank",
            MEAN,
            m("stepwatch.device.idle.duration"),
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
            by_rank(f"{title} by rank", 'mean("gauge")', m(measurement), unit=unit)
        )
    board = board.with_panel(
        statushistory.Panel()
        .title("Clock-event (throttle) reasons bitmask by rank")
        .description("Non-zero = clocks held down (thermal, power, sync boost...).")
        .datasource(DATASOURCE)
        .with_target(
            Q(
                f'SELECT max("gauge") FROM {m("stepwatch.gpu.clock_event.mask")} '
                f"WHERE {SELECTION} {BY_TIME}, {RANK} fill(none)",
                alias=per_rank_alias(),
            )
        )
        .span(12)
        .height(8)
    )
    return board.with_panel(
        table_panel(
            "XID errors",
            f'SELECT max("counter") AS "events" FROM {m("stepwatch.gpu.xid.errors")} '
            f"WHERE {SELECTION} GROUP BY {RANK}, {HOST}, {m('stepwatch.gpu.xid.code')}",
            span=24,
            height=6,
        )
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
