"""Recorded real DDP runs (tests/data/real_runs): load one into InfluxDB like a live job."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

from stepwatch.core import InfluxClient

RUNS = Path(__file__).resolve().parents[1] / "data" / "real_runs"


@dataclasses.dataclass(frozen=True)
class RealRun:
    """One recorded run loaded into a database: its job id and what its ``.json`` says."""

    name: str
    job: str
    fault: str
    fault_rank: int | None
    fault_step: int | None
    world_size: int


def names() -> list[str]:
    return sorted(path.name.removesuffix(".lp.gz") for path in RUNS.glob("*.lp.gz"))


def load(client: InfluxClient, name: str) -> RealRun:
    """Write ``<name>.lp.gz`` into ``client``'s database; the run's description."""
    meta = json.loads((RUNS / f"{name}.json").read_text())
    with gzip.open(RUNS / f"{name}.lp.gz", "rt") as handle:
        lines = [line for line in handle.read().splitlines() if line]
    for start in range(0, len(lines), 5000):
        client.write_lines(lines[start : start + 5000])
    return RealRun(
        name=name,
        job=meta["job"],
        fault=meta["fault"],
        fault_rank=meta["fault_rank"],
        fault_step=meta["fault_step"],
        world_size=meta["world_size"],
    )
