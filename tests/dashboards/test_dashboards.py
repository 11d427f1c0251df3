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

REPO = Path(__file__).resolve().parents[2]
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
    now_ns = time.time_ns()
    job = write_demo(client, end_unix_nano=now_ns - now_ns % 10**9)
    yield client, job


def test_every_query_returns_rows(demo: tuple[InfluxClient, DemoJob]) -> None:
    client, job = demo
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
