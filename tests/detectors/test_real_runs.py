"""The detectors on recorded real DDP runs with real faults (tests/data/real_runs).

The runs are real jobs on a noisy 2-core VM, recorded once (scripts/record_real_runs.py) and
diagnosed here through InfluxDB and ``read_frame`` exactly as a live job is.
"""

from __future__ import annotations

import pytest

from stepwatch.core import Diagnosis, InfluxClient
from stepwatch.detectors import detect_job
from stepwatch.detectors.frame import job_time_range
from tests.detectors import real_runs


def diagnose_run(influx: InfluxClient, name: str) -> tuple[real_runs.RealRun, list[Diagnosis]]:
    run = real_runs.load(influx, name)
    span = job_time_range(influx, run.job)
    assert span is not None, f"{name}: nothing stored"
    found = detect_job(
        influx, run.job, start_unix_nano=span[0] - 10**9, end_unix_nano=span[1] + 10**9
    )
    return run, list(found)


def test_every_recorded_run_is_described() -> None:
    assert {"none", "straggler", "stall", "jit", "dataloader", "link", "regression"} <= set(
        real_runs.names()
    )


def test_healthy_run_has_no_finding(influx: InfluxClient) -> None:
    _, found = diagnose_run(influx, "none")
    assert found == []


@pytest.mark.parametrize(
    ("name", "kinds", "phase"),
    [
        ("straggler", {"compute_straggler", "masked_straggler"}, "forward"),
        ("dataloader", {"dataloader_stall"}, "data"),
    ],
)
def test_a_faulty_rank_is_named_with_its_phase(
    influx: InfluxClient, name: str, kinds: set[str], phase: str
) -> None:
    run, found = diagnose_run(influx, name)
    assert found, f"{name}: no finding"
    assert {d.kind for d in found} <= kinds, found
    assert all(d.ranks == (run.fault_rank,) and d.phase == phase for d in found), found


def test_a_job_wide_regression_blames_no_rank(influx: InfluxClient) -> None:
    _, found = diagnose_run(influx, "regression")
    assert [d.kind for d in found] == ["job_regression"]
    assert found[0].ranks == ()
