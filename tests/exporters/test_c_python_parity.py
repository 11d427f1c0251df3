"""One program, two implementations: the same real DDP job gives the same phases with the C
extensions and with the Python paths (``STEPWATCH_EXPORTERS_NO_C=1``, as a wheel built without
a C compiler runs).

The job (tests/exporters/parity_job.py: 3 ranks, gloo, auto mode, every step timed) has
phases of known length. Before issue 46 the Python paths marked a backward's start with a
tensor hook (the loss's own backward, 50 ms here, fell out of the backward phase) and ended
the exposed wait at ``optimizer.step()`` (the loop's 50 ms of gradient clipping counted as
``communication``), so this test failed by those amounts.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stepwatch.exporters import _cext
from tests.exporters import parity_job as job

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
# A phase's median over the steps, C vs Python, at loads up to 12 on 2 cores; the boundaries
# the two paths could disagree on move 50 ms (parity_job.LOSS_BACKWARD_S, CLIP_S).
TOLERANCE_MS = 10.0


def _run(tmp_path: Path, name: str, no_c: bool) -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    environment = {k: v for k, v in os.environ.items() if k != "STEPWATCH_EXPORTERS_NO_C"}
    if no_c:
        environment["STEPWATCH_EXPORTERS_NO_C"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "tests.exporters.parity_job", str(out)],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(job.WORLD_SIZE)]


def _medians(result: dict[str, Any]) -> dict[str, float]:
    """Each phase's median over the job's steps (ms): steps a busy machine stalled move a
    mean, not the boundaries."""
    names = {name for step in result["steps_ms"] for name in step}
    return {
        name: statistics.median(step.get(name, 0.0) for step in result["steps_ms"])
        for name in names
    }


@pytest.mark.slow
@pytest.mark.skipif(_cext.fastrecord is None, reason="the C extensions are not built here")
def test_the_c_and_the_python_paths_time_the_same_phases(tmp_path: Path) -> None:
    c_ranks = _run(tmp_path, "c", no_c=False)
    python_ranks = _run(tmp_path, "python", no_c=True)
    assert {r["implementation"] for r in c_ranks} == {"c"}
    assert {r["engine_gate"] for r in c_ranks} == {"EngineGate"}
    assert {r["implementation"] for r in python_ranks} == {"python"}
    assert {r["engine_gate"] for r in python_ranks} == {"PythonEngineGate"}
    report = []
    for rank, (c_result, python_result) in enumerate(zip(c_ranks, python_ranks, strict=True)):
        c_counts, python_counts = (
            {name: p["count"] for name, p in r["summary"]["phases"].items()}
            for r in (c_result, python_result)
        )
        assert c_counts == python_counts
        assert sorted(c_counts) == ["backward", "communication", "data", "forward", "optimizer"]
        c_ms, python_ms = _medians(c_result), _medians(python_result)
        for name in sorted(c_counts):
            report.append(
                f"rank {rank} {name}: C {c_ms[name]:.1f} ms, Python {python_ms[name]:.1f} ms"
            )
        for name in sorted(c_counts):
            assert abs(c_ms[name] - python_ms[name]) <= TOLERANCE_MS, "\n".join(report)
        for medians in (c_ms, python_ms):
            # The backward starts when asked for (the loss's backward is in it) and runs to
            # the optimizer (the clipping is in it); the wait ends when backward() returns.
            floor_s = job.LOSS_BACKWARD_S + job.MODEL_BACKWARD_S + job.CLIP_S
            assert medians["backward"] >= floor_s * 1e3, "\n".join(report)
            assert medians["communication"] < job.CLIP_S * 1e3, "\n".join(report)
            if rank < job.WORLD_SIZE - 1:  # they wait for the straggler
                assert medians["communication"] >= job.STRAGGLE_S * 1e3 / 2, "\n".join(report)
    print("\n".join(report))
