"""Grafana provisioning, the example Alertmanager route and the bridge's Prometheus rules.

Alertmanager's config is checked by the real ``amtool`` (check-config and routing). Prometheus
rules are checked with ``promtool`` when it is installed; Debian's ``prometheus`` package that
ships it is ~100 MB, so otherwise a structural check runs: YAML shape, durations, labels, and
a small PromQL lexer (balanced brackets, known functions, valid range durations, and every
``stepwatch_bridge_*`` series name exists in the bridge's real metrics registry).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepwatch.core import settings

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
AMTOOL = shutil.which("amtool")


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_datasources_match_the_dashboards() -> None:
    uids = {
        target["datasource"]["uid"]
        for board in (REPO / "dashboards").glob("*.json")
        for panel in json.loads(board.read_text())["panels"]
        for target in panel["targets"]
    }
    folder = GRAFANA / "provisioning" / "datasources"
    v1 = load(folder / "stepwatch.yaml")
    v2 = load(folder / "stepwatch-influxdb2.yaml.example")
    for config in (v1, v2):
        assert config["apiVersion"] == 1
        (source,) = config["datasources"]
        assert {source["uid"]} == uids
        assert source["type"] == "influxdb"
        assert source["jsonData"]["version"] == "InfluxQL"
        assert source["jsonData"]["dbName"] == "${STEPWATCH_INFLUX_DATABASE}"
        assert source["url"] == "${STEPWATCH_INFLUX_URL}"
        # Grafana's smallest bucket is one export window by default: no per-second spikes.
        default_s = settings.METRIC_EXPORT_INTERVAL_S.default
        assert source["jsonData"]["timeInterval"] == f"{default_s:g}s"
    assert v2["datasources"][0]["jsonData"]["httpHeaderName1"] == "Authorization"
    token = v2["datasources"][0]["secureJsonData"]["httpHeaderValue1"]
    assert token == "Token ${STEPWATCH_INFLUX_TOKEN}"


def test_dashboard_provider_points_at_a_folder() -> None:
    config = load(GRAFANA / "provisioning" / "dashboards" / "stepwatch.yaml")
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    assert provider["folderUid"] == "stepwatch"
    assert provider["options"]["path"].startswith("/")
    docs = (REPO / "docs" / "operators.md").read_text()
    assert provider["options"]["path"] in docs, "docs/operators.md must say where to copy"


@pytest.mark.skipif(AMTOOL is None, reason="amtool (prometheus-alertmanager) not installed")
def test_alertmanager_route_example_is_valid_and_routes() -> None:
    path = GRAFANA / "alertmanager" / "route-example.yml"
    assert AMTOOL is not None
    check = subprocess.run(
        [AMTOOL, "check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr

    def receivers(*labels: str) -> set[str]:
        result = subprocess.run(
            [AMTOOL, "config", "routes", "test", f"--config.file={path}", *labels],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return set(result.stdout.strip().split(","))

    def sent(severity: str, kind: str, ranks: tuple[int, ...], hosts: tuple[str, ...]) -> list[str]:
        """The labels the detectors' Alertmanager sink really sends for such a finding."""
        from stepwatch.core import Diagnosis
        from stepwatch.detectors.sinks._alertmanager import finding_labels

        finding = Diagnosis(
            job="run-42",
            kind=kind,
            start_unix_nano=1,
            end_unix_nano=None,
            severity=severity,
            score=1.0,
            summary="s",
            ranks=ranks,
            hosts=hosts,
        )
        return [f"{key}={value}" for key, value in finding_labels(finding).items()]

    one_rank = ((3,), ("node-0",))
    assert receivers(*sent("critical", "compute_straggler", *one_rank)) == {
        "stepwatch-page",
        "stepwatch-team",
    }
    assert receivers(*sent("warning", "compute_straggler", *one_rank)) == {"stepwatch-team"}
    assert receivers(*sent("info", "job_regression", (), ())) == {"stepwatch-team"}
    # A GPU-health finding on one host also reaches the node operators; on several, it cannot
    # be routed by host (no host label) and goes to the team only.
    assert receivers(*sent("warning", "gpu_health", *one_rank)) == {
        "stepwatch-hardware",
        "stepwatch-team",
    }
    several = ((3, 11), ("node-0", "node-1"))
    assert receivers(*sent("warning", "gpu_health", *several)) == {"stepwatch-team"}
    bridge = ["alertname=StepwatchBridgeDown", "job=stepwatch-bridge", "instance=b:9464"]
    assert receivers(*bridge) == {"stepwatch-platform"}
    route = load(path)["route"]["routes"][0]
    assert route["group_by"] == ["alertname", "training_job"], "one notification group per job"


RULES = GRAFANA / "prometheus" / "stepwatch-bridge-rules.yml"
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
FUNCTIONS = {
    "sum",
    "rate",
    "min_over_time",
    "max_over_time",
    "deriv",
    "histogram_quantile",
    "clamp_min",
    "increase",
    "absent",
}
KEYWORDS = {"by", "without", "and", "or", "unless", "on", "ignoring", "bool"}


def bridge_series_names() -> set[str]:
    from stepwatch.otel_bridge import BridgeMetrics

    names = set()
    for family in BridgeMetrics().registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def check_promql(expr: str, known_series: set[str]) -> list[str]:
    """Problems found by a minimal PromQL lexer (not a full parser)."""
    problems = []
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in without_strings:
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            problems.append(f"unbalanced {char!r}")
    if stack:
        problems.append(f"unclosed {stack!r}")
    for duration in re.findall(r"\[([^\]]*)\]", without_strings):
        if not DURATION.match(duration):
            problems.append(f"bad range duration [{duration}]")
    no_labels = re.sub(r"\{[^}]*\}", "", without_strings)
    no_groupings = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", no_labels)
    for name, call in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", no_groupings):
        if name in KEYWORDS or re.fullmatch(r"\d+(e-?\d+)?|\d+[smhdwy]", name):
            continue
        if call:
            if name not in FUNCTIONS:
                problems.append(f"unknown function {name}")
        elif name.startswith("stepwatch_bridge_") and name not in known_series:
            problems.append(f"{name} is not a series the bridge exports")
        elif not name.startswith("stepwatch_bridge_") and name != "up":
            problems.append(f"unexpected identifier {name}")
    return problems


def test_bridge_rules_are_valid() -> None:
    promtool = shutil.which("promtool")
    if promtool is not None:
        result = subprocess.run(
            [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
    config = load(RULES)
    (group,) = config["groups"]
    rules = group["rules"]
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names)
    assert all(name.startswith("StepwatchBridge") for name in names)
    known = bridge_series_names()
    for rule in rules:
        assert DURATION.match(rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"], rule["alert"]
        assert check_promql(rule["expr"], known) == [], rule["alert"]
    exprs = " ".join(rule["expr"] for rule in rules)
    for required in (
        'up{job="stepwatch-bridge"} == 0',
        "stepwatch_bridge_datapoints_dropped_total",
        "stepwatch_bridge_datapoints_rejected_total",
        "stepwatch_bridge_queue_depth",
        "stepwatch_bridge_spool_bytes",
    ):
        assert required in exprs


def test_the_promql_check_catches_mistakes() -> None:
    known = {"stepwatch_bridge_queue_depth"}
    assert check_promql("deriv(stepwatch_bridge_queue_depth[10m]) > 0", known) == []
    assert check_promql("deriv(stepwatch_bridge_queue_depth[10x]) > 0", known)
    assert check_promql("rate(stepwatch_bridge_queue_depth[5m]", known)
    assert check_promql("stepwatch_bridge_queue_depht > 0", known)
    assert check_promql("ratee(stepwatch_bridge_queue_depth[5m])", known)
