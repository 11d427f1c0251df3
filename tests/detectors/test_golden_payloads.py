"""Golden files for the sinks' wire payloads (Alertmanager postableAlert, Grafana annotation).

Regenerate after an intended change with ``STEPWATCH_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepwatch.core import Diagnosis
from stepwatch.core._http import HttpResponse
from stepwatch.detectors.sinks._alertmanager import AlertmanagerSink
from stepwatch.detectors.sinks._grafana import GrafanaAnnotationSink

GOLDEN = Path(__file__).resolve().parent / "golden"
NOW_NS = 1_800_000_000 * 10**9
FINDING = Diagnosis(
    job="run-42",
    kind="compute_straggler",
    start_unix_nano=NOW_NS - 300 * 10**9,
    end_unix_nano=None,
    severity="critical",
    score=3.4,
    summary=(
        "rank 17 (stage 2, dp 5) backward compute 1.31x its stage (gemm 1.42x) since 07:55:00; "
        "costs the job ~1.27x step time"
    ),
    ranks=(17,),
    hosts=("node-3",),
    phase="backward",
    kernel_class="gemm",
    slowdown=1.27,
)

SEVERAL_RANKS = dataclasses.replace(
    FINDING,
    kind="workload_imbalance",
    severity="warning",
    summary="ranks 3, 17 finish last in turn; costs the job ~1.08x step time",
    ranks=(3, 17),
    hosts=("node-0", "node-3"),
    phase=None,
    kernel_class=None,
    slowdown=1.08,
)


def check(name: str, payload: Any) -> None:
    path = GOLDEN / name
    text = json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if os.environ.get("STEPWATCH_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, f"{name} changed; see the module docstring"


class Recorder:
    def __init__(self) -> None:
        self.bodies: list[Any] = []

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_s: float,
    ) -> HttpResponse:
        del headers, timeout_s
        self.bodies.append({"method": method, "url": url, "body": json.loads(body or b"null")})
        return HttpResponse(200, b'{"id": 7}' if method == "POST" else b"[]")


def test_alertmanager_payload() -> None:
    recorder = Recorder()
    sink = AlertmanagerSink(
        "http://alertmanager:9093",
        dashboard_url="http://grafana:3000/d/stepwatch-job",
        transport=recorder,
        clock=lambda: NOW_NS,
    )
    # A one-rank finding (rank and host labels) and one blaming several ranks on several
    # hosts (no rank/host label; the lists are the ranks/hosts annotations).
    sink.publish([FINDING, SEVERAL_RANKS])
    check("alertmanager-alert.json", recorder.bodies)


def test_grafana_payloads() -> None:
    recorder = Recorder()
    sink = GrafanaAnnotationSink(
        "http://grafana:3000",
        token="t",
        dashboard_uid="stepwatch-job",
        transport=recorder,
        clock=lambda: NOW_NS,
    )
    sink.publish([FINDING])
    import dataclasses

    sink.publish([dataclasses.replace(FINDING, end_unix_nano=NOW_NS)])
    check("grafana-annotation.json", recorder.bodies)
