"""Interop with a non-Python producer: the OpenTelemetry JavaScript SDK (tests/interop/js).

``producer.js`` simulates the ranks of one job in one Node process, each rank with its own
MeterProvider, reader and exporter, and exports stepwatch's schema to a real bridge writing to
the real influxd, over OTLP/HTTP (the JS exporter's body is chunked, with no Content-Length)
and OTLP/gRPC (grpc-js), with DELTA and CUMULATIVE temporality; every window it exported is
then read back from InfluxDB, and every step in it.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stepwatch.core import InfluxClient
from stepwatch.core._influx import wait_until
from stepwatch.detectors import detect_job
from stepwatch.detectors.frame import job_time_range
from stepwatch.otel_bridge import Bridge

PROJECT = Path(__file__).resolve().parent / "js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js (scripts/setup.sh installs it)")


def run_producer(*args: str, timeout_s: float) -> dict[str, Any]:
    """Run producer.js; its JSON summary."""
    assert NODE is not None
    if not (PROJECT / "node_modules").is_dir():
        pytest.fail(f"{PROJECT}/node_modules is missing: run scripts/setup.sh (npm ci)")
    run = subprocess.run(
        [NODE, str(PROJECT / "producer.js"), *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=PROJECT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return summary


def stored_windows(influx: InfluxClient, job: str) -> dict[int, list[int]]:
    """Each rank's stored step windows: the ``count`` of each, in time order."""
    series = influx.query(
        'SELECT "count" FROM "stepwatch.step.duration" '
        f'WHERE "stepwatch.job.id" = \'{job}\' GROUP BY "stepwatch.rank"'
    )
    return {int(s.tags["stepwatch.rank"]): [int(row[1]) for row in s.values] for s in series}


def expected_windows(summary: dict[str, Any]) -> dict[int, list[int]]:
    """What must be stored: every window exported (DELTA), or the differences between
    consecutive cumulative points, the first being the baseline (docs/storage.md)."""
    expected = {}
    for rank, counts in enumerate(summary["step_windows"]):
        if summary["temporality"] == "delta":
            expected[rank] = counts
        else:
            expected[rank] = [later - earlier for earlier, later in itertools.pairwise(counts)]
    return expected


@pytest.mark.parametrize("temporality", ["delta", "cumulative"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_js_sdk_stores_every_window(
    bridge: Bridge, influx: InfluxClient, protocol: str, temporality: str
) -> None:
    job = f"js-{protocol}-{temporality}"
    endpoint = bridge.http_url if protocol == "http" else f"http://{bridge.grpc_endpoint}"
    summary = run_producer(
        "--endpoint", endpoint, "--protocol", protocol, "--temporality", temporality,
        "--ranks", "4", "--job", job, "--duration-s", "3", "--step-ms", "50",
        "--export-interval-ms", "500", "--phases", "data,forward,backward,optimizer,communication",
        timeout_s=60,
    )  # fmt: skip
    assert summary["exports_failed"] == 0, summary
    assert all(steps >= 30 for steps in summary["steps_per_rank"]), summary
    expected = expected_windows(summary)
    if temporality == "delta":  # every step is in a stored window
        assert [sum(expected[rank]) for rank in range(4)] == summary["steps_per_rank"]
    assert all(len(windows) >= 5 for windows in expected.values()), summary
    assert wait_until(lambda: stored_windows(influx, job) == expected, timeout_s=10), (
        stored_windows(influx, job),
        expected,
    )
    phases = influx.query(
        'SELECT count("count") FROM "stepwatch.phase.duration" '
        f'WHERE "stepwatch.job.id" = \'{job}\' GROUP BY "stepwatch.phase"'
    )
    assert {s.tags["stepwatch.phase"] for s in phases} == {
        "data", "forward", "backward", "optimizer", "communication",
    }  # fmt: skip


def test_a_masked_straggler_shows_in_the_stored_phases(
    bridge: Bridge, influx: InfluxClient
) -> None:
    """``--slow-rank``: the straggler's forward grows, its peers' communication (the wait)."""
    job = "js-straggler"
    summary = run_producer(
        "--endpoint", bridge.http_url, "--ranks", "4", "--job", job, "--duration-s", "3",
        "--step-ms", "50", "--export-interval-ms", "500", "--slow-rank", "2",
        "--slow-factor", "2", "--buckets", "seconds",
        "--phases", "data,forward,backward,optimizer,communication",
        timeout_s=60,
    )  # fmt: skip
    assert summary["exports_failed"] == 0
    assert bridge.forwarder.wait_idle(10)

    def mean(phase: str) -> dict[int, float]:
        series = influx.query(
            'SELECT sum("sum") / sum("count") FROM "stepwatch.phase.duration" '
            f"WHERE \"stepwatch.job.id\" = '{job}' AND \"stepwatch.phase\" = '{phase}' "
            'GROUP BY "stepwatch.rank"'
        )
        return {int(s.tags["stepwatch.rank"]): float(s.values[0][1]) for s in series}

    forward, communication = mean("forward"), mean("communication")
    assert forward[2] > 1.8 * max(forward[r] for r in (0, 1, 3))
    assert communication[2] < 0.5 * min(communication[r] for r in (0, 1, 3))


def test_a_js_sdk_job_gets_the_diagnosis_stepwatch_gives(
    bridge: Bridge, influx: InfluxClient
) -> None:
    """A masked straggler exported by the JS SDK as a site would (OTLP/gRPC, cumulative, the
    SDK's default buckets, each rank's windows closing at its own instant): the straggler
    alone, at what the job's own model says it costs; quantiles no wider than the window
    allows."""
    job = "js-diagnosed"
    summary = run_producer(
        "--endpoint", f"http://{bridge.grpc_endpoint}", "--protocol", "grpc",
        "--temporality", "cumulative", "--buckets", "default", "--ranks", "4", "--job", job,
        "--duration-s", "16", "--step-ms", "50", "--export-interval-ms", "1000",
        "--slow-rank", "2", "--slow-from-s", "6", "--slow-factor", "2",
        "--phases", "data,forward,backward,optimizer,communication",
        timeout_s=90,
    )  # fmt: skip
    assert summary["exports_failed"] == 0
    assert bridge.forwarder.wait_idle(10)
    span = job_time_range(influx, job)
    assert span is not None
    found = detect_job(influx, job, start_unix_nano=span[0] - 10**9, end_unix_nano=span[1] + 10**9)
    # Synchronous: every rank's step is the slowest compute (forward is 30 % of it, doubled).
    truth = 1.3
    print([(d.kind, d.ranks, round(d.slowdown, 3), d.summary) for d in found])
    assert [(d.kind, d.ranks, d.phase) for d in found] == [("masked_straggler", (2,), "forward")], (
        found
    )
    assert found[0].slowdown == pytest.approx(truth, rel=0.15)
    steps = influx.query(
        'SELECT "p50", "sum", "count" FROM "stepwatch.step.duration" '
        f"WHERE \"stepwatch.job.id\" = '{job}'"
    )
    rows = [row for series in steps for row in series.values if row[1] is not None]
    assert rows and all(row[1] <= 2.0 * row[2] / row[3] * 1.001 for row in rows)
