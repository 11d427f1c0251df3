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


#: The tag of a phase point's phase, as the bridge stores it.
_PHASE_TAG = ",stepwatch.phase="


def lines(name: str, *, directory: Path = RUNS) -> list[str]:
    """Every stored point of ``<name>.lp.gz`` in ``directory`` (line protocol)."""
    with gzip.open(directory / f"{name}.lp.gz", "rt") as handle:
        return [line for line in handle.read().splitlines() if line]


def phase_of(line: str) -> str | None:
    """The ``stepwatch.phase`` tag of a point, ``None`` for other points."""
    head = line.split(" ", 1)[0]
    if _PHASE_TAG not in head:
        return None
    return head.split(_PHASE_TAG, 1)[1].split(",", 1)[0]


def without_communication(points: list[str]) -> list[str]:
    """The run as a producer without a communication phase would have stored it.

    These runs are DDP: the all-reduce runs inside ``loss.backward()``, so each window's
    ``backward`` sum, count, max and min already hold it and the ``communication`` points
    only repeat that time; folding it into backward is dropping them (the test checks
    the nesting on every window first).
    """
    return [line for line in points if phase_of(line) != "communication"]


def write(client: InfluxClient, points: list[str]) -> None:
    """Write line-protocol ``points`` into ``client``'s database, in batches."""
    for start in range(0, len(points), 5000):
        client.write_lines(points[start : start + 5000])


#: What a producer that times steps and nothing else stores.
_STEP_ONLY = ("stepwatch.step.duration,", "stepwatch.step.last,", "stepwatch.monitor.closed,")


def steps_only(points: list[str]) -> list[str]:
    """The run as a producer of step times alone would have stored it."""
    return [line for line in points if line.startswith(_STEP_ONLY)]


#: How a run may be stored (:func:`load`): as recorded (stepwatch's auto mode), without its
#: communication phase (the README's loop), or step times alone.
LAYOUTS = ("auto", "no-communication", "steps")


def load(
    client: InfluxClient, name: str, *, communication: bool = True, layout: str = "auto"
) -> RealRun:
    """Write ``<name>.lp.gz`` into ``client``'s database; the run's description.

    ``communication=False`` (or ``layout="no-communication"``): without its communication
    phase (:func:`without_communication`); ``layout="steps"``: :func:`steps_only`.
    """
    meta = json.loads((RUNS / f"{name}.json").read_text())
    points = lines(name)
    if not communication or layout == "no-communication":
        points = without_communication(points)
    elif layout == "steps":
        points = steps_only(points)
    write(client, points)
    return RealRun(
        name=name,
        job=meta["job"],
        fault=meta["fault"],
        fault_rank=meta["fault_rank"],
        fault_step=meta["fault_step"],
        world_size=meta["world_size"],
    )
