"""Dashboards as code: the committed JSON is what dashboards/generate.py makes, and every
InfluxQL query in it (panels, template variables, the findings annotation) runs against a real
InfluxDB holding demo-like data and returns rows — with variables substituted the way
Grafana's InfluxDB datasource does it.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stepwatch.core import InfluxClient
from tests.detectors.demo_data import DemoJob, write_demo
from tests.otel_bridge.otel2influx import telegraf_prometheus_v1

REPO = Path(__file__).resolve().parents[2]
END_NS = time.time_ns() // 10**9 * 10**9  # both demo databases hold the same job
DASHBOARDS = REPO / "dashboards"


def load(path: Path, name: str) -> ModuleType:
    """A script of the repo (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_generator() -> ModuleType:
    # generate.py imports its sibling panels.py, as when it runs as a script.
    if str(DASHBOARDS) not in sys.path:
        sys.path.insert(0, str(DASHBOARDS))
    return load(DASHBOARDS / "generate.py", "stepwatch_dashboards")


# The queries as Grafana sends them: one copy, shared with bench/operators_bench.py.
_queries = load(DASHBOARDS / "queries.py", "stepwatch_dashboard_queries")
all_queries = _queries.all_queries
committed = _queries.committed
interpolate = _queries.interpolate


def test_committed_json_is_what_the_generator_makes() -> None:
    rendered = load_generator().render()
    assert sorted(rendered) == sorted(committed()), "stray or missing dashboard JSON"
    for name, text in rendered.items():
        assert (DASHBOARDS / name).read_text() == text, (
            f"{name} is stale: run .venv/bin/python dashboards/generate.py"
        )


def test_dashboards_are_grafana_11_with_fixed_uids_vars_links_annotations() -> None:
    boards = committed()
    uids = [board["uid"] for board in boards.values()]
    assert len(set(uids)) == len(uids) == 6
    assert all(uid.startswith("stepwatch-") for uid in uids)
    for name, board in boards.items():
        assert board["schemaVersion"] >= 39, f"{name}: not a Grafana 11 schema"
        names = [variable["name"] for variable in board["templating"]["list"]]
        assert names == ["job", "host", "rank"], name
        annotations = board["annotations"]["list"]
        assert any('"stepwatch.diagnosis"' in a["target"]["query"] for a in annotations), name
        assert board["links"][0]["type"] == "dashboards" and board["links"][0]["tags"] == [
            "stepwatch"
        ]
        assert "stepwatch" in board["tags"]
        ids = [panel["id"] for panel in board["panels"]]
        assert len(set(ids)) == len(ids)
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "stepwatch-influxdb", (name, panel["title"])
            for target in panel["targets"]:
                assert "$job" in target["query"], (name, panel["title"])
                if "stepwatch.diagnosis" not in target["query"]:
                    assert "/^$rank$/" in target["query"], (name, panel["title"])


@pytest.fixture(scope="module")
def demo(influxd: Any) -> Iterator[tuple[InfluxClient, DemoJob]]:
    client = influxd.client(database="operators_dashboards")
    client.create_database()
    job = write_demo(client, end_unix_nano=END_NS)
    yield client, job


@pytest.fixture(scope="module")
def collector_demo(influxd: Any) -> Iterator[tuple[InfluxClient, DemoJob]]:
    """The demo job as a site's OpenTelemetry Collector writes it: stepwatch windows with
    explicit buckets (``histogram_buckets="explicit"``), stored by the influxdb exporter's
    telegraf-prometheus-v1 rules (every attribute a tag, no derived fields, no ``+Inf``)."""
    client = influxd.client(database="operators_dashboards_collector")
    client.create_database()
    job = write_demo(
        client,
        end_unix_nano=END_NS,
        histogram_buckets="explicit",
        to_lines=telegraf_prometheus_v1,
    )
    yield client, job


def bridge_only_queries() -> set[tuple[str, str, str]]:
    """Queries of panels whose description says they need the bridge's derived fields."""
    marked = set()
    for name, board in committed().items():
        for panel in board["panels"]:
            if "Needs the stepwatch bridge" in panel.get("description", ""):
                marked.update((name, panel["title"], t["query"]) for t in panel["targets"])
    return marked


def test_every_query_returns_rows(demo: tuple[InfluxClient, DemoJob]) -> None:
    assert_every_query_returns_rows(*demo)


def test_every_query_but_the_bridge_only_ones_returns_rows_on_collector_data(
    collector_demo: tuple[InfluxClient, DemoJob],
) -> None:
    client, job = collector_demo
    fields = {
        row[0]
        for s in client.query('SHOW FIELD KEYS FROM "stepwatch.step.duration"')
        for row in s.values
    }
    assert {"count", "sum", "min", "max"} <= fields and not fields & {"mean", "p50", "+Inf"}
    marked = bridge_only_queries()
    # the queries reading bridge-derived fields are all in panels that say so, and no panel
    # says so needlessly; every other query (those panels' other targets too) returns rows
    derived = {q for q in all_queries() if any(f'"{f}"' in q[2] for f in ("p50", "p90", "p99"))}
    assert derived and derived <= marked
    assert {(name, title) for name, title, _ in marked} == {(n, t) for n, t, _ in derived}
    assert_every_query_returns_rows(client, job, skip=derived)
    for name, title, query in all_queries():
        assert '"mean"' not in query and '"+Inf"' not in query, (name, title)


def table(client: InfluxClient, sql: str) -> list[tuple[object, ...]]:
    """The rows of ``sql``, each led by its series' tags, sorted."""
    return sorted(
        (tuple(sorted(s.tags.items())), *row)
        for s in client.query(sql, epoch="ms")
        for row in s.values
    )


def test_collector_data_shows_what_bridge_data_shows(
    demo: tuple[InfluxClient, DemoJob], collector_demo: tuple[InfluxClient, DemoJob]
) -> None:
    """Same job, both writers: every panel not marked bridge-only draws the same numbers."""
    bridge_client, job = demo
    collector_client, _ = collector_demo
    variables = {"job": [job.job], "host": list(job.hosts), "rank": [str(r) for r in range(8)]}
    marked = bridge_only_queries()
    compared = 0
    for name, title, query in all_queries():
        if (name, title, query) in marked and any(f'"{f}"' in query for f in ("p50", "p90")):
            continue
        sql = interpolate(
            query,
            variables,
            start_ms=job.start_unix_nano // 10**6 - 60_000,
            end_ms=job.end_unix_nano // 10**6 + 60_000,
        )

        ours, theirs = table(bridge_client, sql), table(collector_client, sql)
        assert len(ours) == len(theirs), (name, title)
        for mine, other in zip(ours, theirs, strict=True):
            assert mine[:2] == other[:2], (name, title)
            for a, b in zip(mine[2:], other[2:], strict=True):
                if isinstance(a, float) and isinstance(b, int | float):
                    assert a == pytest.approx(b, rel=1e-9), (name, title)
                else:
                    assert a == b, (name, title)
        compared += 1
    assert compared >= 25


def assert_every_query_returns_rows(
    client: InfluxClient, job: DemoJob, *, skip: set[tuple[str, str, str]] | None = None
) -> None:
    start_ms = job.start_unix_nano // 10**6 - 60_000
    end_ms = job.end_unix_nano // 10**6 + 60_000
    # Template variables first, exactly as Grafana resolves them (job → host → rank).
    board = committed()["job-overview.json"]
    variable_queries = {v["name"]: v["query"] for v in board["templating"]["list"]}
    resolved: dict[str, list[str]] = {}
    for name in ("job", "host", "rank"):
        sql = interpolate(variable_queries[name], resolved, start_ms=start_ms, end_ms=end_ms)
        series = client.query(sql)
        resolved[name] = sorted({str(row[1]) for s in series for row in s.values})
    assert resolved["job"] == [job.job]
    assert resolved["host"] == list(job.hosts)
    assert sorted(resolved["rank"], key=int) == [str(r) for r in range(job.ranks)]

    selections = {
        "all": resolved,
        "one rank": {**resolved, "rank": [str(job.straggler_rank)]},
        "one host": {**resolved, "host": [job.hosts[0]]},
    }
    empty = []
    queries = all_queries()
    assert len(queries) >= 30
    for label, variables in selections.items():
        for name, title, query in queries:
            if skip and (name, title, query) in skip:
                continue
            sql = interpolate(query, variables, start_ms=start_ms, end_ms=end_ms)
            series = client.query(sql, epoch="ms")
            rows = [row for s in series for row in s.values if any(v is not None for v in row[1:])]
            if not rows:
                empty.append(f"{label}: {name} / {title}: {sql}")
    assert not empty, "queries returning no rows:\n" + "\n".join(empty)


def test_heatmap_shows_the_straggler(demo: tuple[InfluxClient, DemoJob]) -> None:
    """The compute heatmap's query puts the straggler's row on top after the change."""
    client, job = demo
    board = committed()["rank-heatmap.json"]
    query = next(p for p in board["panels"] if p["title"].startswith("Compute kernel"))
    sql = interpolate(
        query["targets"][0]["query"],
        {"job": [job.job], "host": list(job.hosts), "rank": [str(r) for r in range(job.ranks)]},
        start_ms=job.change_unix_nano // 10**6 + 60_000,
        end_ms=job.end_unix_nano // 10**6,
    )
    means = {
        s.tags["stepwatch.rank"]: sum(row[1] for row in s.values if row[1] is not None)
        for s in client.query(sql)
    }
    assert max(means, key=lambda rank: means[rank]) == str(job.straggler_rank)


def test_annotation_query_returns_regions(demo: tuple[InfluxClient, DemoJob]) -> None:
    client, job = demo
    annotation = committed()["job-overview.json"]["annotations"]["list"][0]
    sql = interpolate(
        annotation["target"]["query"],
        {"job": [job.job]},
        start_ms=job.start_unix_nano // 10**6,
        end_ms=job.end_unix_nano // 10**6,
    )
    records = [r for s in client.query(sql, epoch="ms") for r in s.records()]
    assert len(records) == len(job.findings)
    for record in records:
        assert record["title"] and record["kind"] in {f.kind for f in job.findings}
    # Closed findings are regions (time → time_end); open ones have no end yet.
    closed = [f for f in job.findings if f.end_unix_nano is not None]
    assert sorted(r["time_end"] for r in records if r["time_end"] is not None) == sorted(
        f.end_unix_nano // 10**6 for f in closed if f.end_unix_nano is not None
    )
    assert annotation["target"]["timeEndColumn"] == "time_end"


def test_detectors_read_collector_data_as_bridge_data(
    demo: tuple[InfluxClient, DemoJob], collector_demo: tuple[InfluxClient, DemoJob]
) -> None:
    """The detectors' reader needs only count, sum, min, max: the same frame from both."""
    import numpy as np

    from stepwatch.detectors import read_frame

    frames = [
        read_frame(
            client, job.job, start_unix_nano=job.start_unix_nano, end_unix_nano=job.end_unix_nano
        )
        for client, job in (demo, collector_demo)
    ]
    ours, theirs = frames
    assert ours.n_windows == theirs.n_windows > 0 and ours.ranks.tolist() == theirs.ranks.tolist()
    for name in ("step_count", "step_s", "step_max_s", "phase_s", "phase_max_s", "kernel_s"):
        np.testing.assert_allclose(getattr(theirs, name), getattr(ours, name), rtol=1e-9)
