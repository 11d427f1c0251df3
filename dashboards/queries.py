"""The committed dashboards' InfluxQL queries, substituted the way Grafana sends them.

Shared by ``bench/operators_bench.py`` (query latency) and ``tests/dashboards`` (every query
returns rows); it sits beside the generator that writes the JSON it reads. Grafana's InfluxDB
datasource inserts single-value variables as they are, regex-escapes multi-value/All ones
joined as ``(a|b)``, and turns ``$timeFilter`` into ``time >= Xms and time <= Yms``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parent
#: ``$__interval`` as Grafana picks it for these ranges.
INTERVAL_S = 30


def committed() -> dict[str, dict[str, Any]]:
    """The committed dashboard JSON by file name."""
    return {path.name: json.loads(path.read_text()) for path in DASHBOARDS.glob("*.json")}


def all_queries() -> list[tuple[str, str, str]]:
    """``(file, panel or annotation title, query)`` of every panel target and annotation."""
    found = []
    for name, board in sorted(committed().items()):
        for panel in board["panels"]:
            for target in panel["targets"]:
                found.append((name, panel["title"], target["query"]))
        for annotation in board["annotations"]["list"]:
            found.append((name, "annotation " + annotation["name"], annotation["target"]["query"]))
    return found


def grafana_regex_escape(value: str) -> str:
    return re.sub(r"([\\^$*+?.()|{}\[\]/])", r"\\\1", value)


def substitute(text: str, name: str, replacement: str) -> str:
    return re.sub(rf"\${name}\b", lambda _: replacement, text)


def interpolate(query: str, variables: dict[str, list[str]], *, start_ms: int, end_ms: int) -> str:
    """What Grafana's InfluxDB datasource sends for ``query``.

    Raises:
        ValueError: a variable of the query has no value in ``variables``.
    """
    text = query.replace("$timeFilter", f"time >= {start_ms}ms and time <= {end_ms}ms")
    text = text.replace("$__interval_ms", str(INTERVAL_S * 1000))
    text = text.replace("$__interval", f"{INTERVAL_S}s")
    for name, values in variables.items():
        if name == "job":
            replacement = values[0]
        elif len(values) == 1:
            replacement = grafana_regex_escape(values[0])
        else:
            replacement = "(" + "|".join(grafana_regex_escape(v) for v in values) + ")"
        text = substitute(text, name, replacement)
    if re.search(r"\$\w|\[\[", text):
        raise ValueError(f"uninterpolated variable in {text}")
    return text
