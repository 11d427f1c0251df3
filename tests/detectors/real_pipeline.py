"""Recorded real pipeline runs (tests/data/real_pipeline): load one into InfluxDB, as a job."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stepwatch.core import InfluxClient
from tests.detectors import real_runs

RUNS = Path(__file__).resolve().parents[1] / "data" / "real_pipeline"


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """One recorded pipeline run loaded into a database: its job id and its ``.json``."""

    name: str
    job: str
    pp: int
    dp: int
    fault: str
    fault_rank: int | None
    fault_stage: int | None
    fault_step: int | None
    truth: dict[str, Any]

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of ``stage`` (rank ``pp_rank * dp + dp_rank``)."""
        return tuple(stage * self.dp + replica for replica in range(self.dp))


def names() -> list[str]:
    return sorted(path.name.removesuffix(".lp.gz") for path in RUNS.glob("*.lp.gz"))


def describe(name: str) -> dict[str, Any]:
    """What ``<name>.json`` says."""
    meta: dict[str, Any] = json.loads((RUNS / f"{name}.json").read_text())
    return meta


def load(client: InfluxClient, name: str, *, layout: str = "auto") -> PipelineRun:
    """Write ``<name>.lp.gz`` into ``client``'s database; the run's description.

    ``layout`` (:data:`real_runs.LAYOUTS`): as recorded (hand phases, every wait in
    ``communication``); ``"no-communication"``: as a producer that times its compute and
    leaves its point-to-point waits and all-reduce untimed (Megatron-style op timers without
    the wait timers) stores it: the waits lie outside every phase; ``"steps"``: step times
    alone.
    """
    meta = describe(name)
    points = real_runs.lines(name, directory=RUNS)
    if layout == "no-communication":
        points = real_runs.without_communication(points)
    elif layout == "steps":
        points = real_runs.steps_only(points)
    real_runs.write(client, points)
    return PipelineRun(
        name=name,
        job=meta["job"],
        pp=meta["pp"],
        dp=meta["dp"],
        fault=meta["fault"],
        fault_rank=meta["fault_rank"],
        fault_stage=meta["fault_stage"],
        fault_step=meta["fault_step"],
        truth=meta["truth"],
    )
