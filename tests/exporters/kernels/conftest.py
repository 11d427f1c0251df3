"""Fixtures for kernel-collection tests: the public Kineto traces, unpacked once."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
DATA = REPO_ROOT / "tests" / "data" / "kineto"
DLRM_RANK0 = DATA / "dlrm_worker0_step_12.pt.trace.json.gz"
CPU_TRACE = DATA / "cpu_mlp_3steps.pt.trace.json.gz"


@pytest.fixture(scope="session")
def dlrm_rank0() -> Path:
    """Rank 0 of the DLRM trace, kept under tests/data (gzipped)."""
    return DLRM_RANK0


@pytest.fixture(scope="session")
def cpu_trace() -> Path:
    """A 3-step CPU-only trace recorded with torch 2.13 (tests/data)."""
    return CPU_TRACE


@pytest.fixture(scope="session")
def dlrm_traces(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The 8 per-rank DLRM traces (MIT, Meta), under tests/data (extracted once)."""
    target = tmp_path_factory.mktemp("dlrm")
    with tarfile.open(DATA / "param_dlrm_8rank" / "dlrm_kineto.tar.gz") as archive:
        archive.extractall(target, filter="data")
    files = sorted(target.rglob("*.json"))
    assert len(files) == 8
    return files


@pytest.fixture(scope="session")
def hta_traces() -> list[Path]:
    """The 2 sampled HTA traces (MIT, Meta), gzipped JSON under tests/data."""
    return sorted((DATA / "hta_sampled_2rank").glob("*.json.gz"))
