"""The detectors on three real Megatron jobs (tests/data/bytedance_whatif), not reproductions.

Each trace is replayed as its ranks' exporters would have reported it in a layout a user may
time such a job with (:mod:`stepwatch.app._op_trace`), through the bridge's conversion into a
real InfluxDB, and diagnosed as a live job is. The truth is the artifact's own what-if
analysis (``result-*.json``, ``blocking_slowdown``: actual over ideal step time, the ideal
with every operation at its kind's typical duration).
"""

from __future__ import annotations

import functools
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from stepwatch.app._op_trace import OpTrace, load_op_trace
from stepwatch.app._replay import write_direct
from stepwatch.core import Diagnosis, InfluxClient
from stepwatch.detectors import detect_job

TRACES = Path(__file__).resolve().parents[1] / "data" / "bytedance_whatif"


@functools.cache
def trace(name: str) -> OpTrace:
    return load_op_trace(TRACES / f"trace-{name}.parquet")


def what_if(name: str) -> float:
    """The artifact's what-if slowdown of the whole job."""
    return float(json.loads((TRACES / f"result-{name}.json").read_text())["blocking_slowdown"])


def diagnose(influx: InfluxClient, name: str, layout: str) -> list[Diagnosis]:
    meta = yaml.safe_load((TRACES / f"meta-{name}.yaml").read_text())
    job = trace(name).job(
        f"{name}-{layout}-{uuid.uuid4().hex[:6]}", layout=layout, world_size=meta["world_size"]
    )
    write_direct(job, influx)
    end = job.start_unix_nano + round(float(job.step_s.max(axis=1).sum()) * 1e9)
    return detect_job(
        influx, job.job_id, start_unix_nano=job.start_unix_nano - 10**9, end_unix_nano=end + 10**10
    )


def test_the_traces_hold_what_their_readme_says() -> None:
    ar = trace("AR")
    assert ar.ranks.size == 16 and set(ar.stages.tolist()) == {0, 1, 2, 3}
    # The last stage's ops cover about half of each 46 s step; the rest is waiting no op
    # records (its rank of the slow replica also waits for it in recorded receives).
    last = ar.stages == 3
    covered = ar.op_s[:, last].sum(axis=2) / (ar.last_s - ar.first_s)[:, last]
    assert 0.4 < float(np.median(covered)) < 0.6
    assert what_if("AR") == pytest.approx(1.973, abs=0.001)


def test_ar_names_only_the_slow_worker_at_its_what_if_cost(influx: InfluxClient) -> None:
    found = diagnose(influx, "AR", "phases")
    # dp 0, stage 0 is rank 0; the 22 s per step its last stage spends outside every op,
    # from the first step on, is structure, not a stall.
    assert [(d.kind, d.ranks) for d in found] == [("masked_straggler", (0,))], found
    assert found[0].slowdown == pytest.approx(what_if("AR"), rel=0.15)
    assert "backward" in found[0].summary and "its stage" in found[0].summary


def test_st_names_the_heavy_last_stage_at_its_what_if_cost(influx: InfluxClient) -> None:
    found = diagnose(influx, "ST", "phases")
    assert [(d.kind, d.ranks) for d in found] == [("stage_imbalance", (6, 7))], found
    assert found[0].slowdown == pytest.approx(what_if("ST"), rel=0.15)
    assert "pipeline stage 3" in found[0].summary


def test_se_names_no_rank_and_no_stage_and_says_the_loss(influx: InfluxClient) -> None:
    found = diagnose(influx, "SE", "phases")
    assert [(d.kind, d.ranks) for d in found] == [("workload_imbalance", ())], found
    assert found[0].slowdown == pytest.approx(what_if("SE"), rel=0.20)
    assert "slowest keeps changing" in found[0].summary


def test_ar_without_a_communication_phase_names_the_replica_and_says_what_it_lacks(
    influx: InfluxClient,
) -> None:
    # The waits are inside forward and backward: the slow replica is plain, not which stage.
    found = diagnose(influx, "AR", "no-communication")
    assert [(d.kind, d.ranks) for d in found] == [("masked_straggler", (0, 16, 32, 48))], found
    assert "without a communication phase the data cannot tell which" in found[0].summary
    assert found[0].slowdown == pytest.approx(what_if("AR"), rel=0.15)


@pytest.mark.parametrize("name", ["AR", "SE", "ST"])
def test_step_times_alone_of_a_synchronous_job_claim_nothing(
    influx: InfluxClient, name: str
) -> None:
    # Every rank's step ends at the same all-reduce: step times cannot show who was late.
    assert diagnose(influx, name, "steps") == []
