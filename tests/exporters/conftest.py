"""Fixtures shared by the exporters' tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo process group (file rendezvous in ``tmp_path``) for the test's duration."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tensor_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto mode marks a backward's start with a tensor hook on the forward's output (the
    fallback), not at the autograd engine (``_engine``), for instrumentations made in the test."""
    from stepwatch.exporters.auto._engine import ENV_BACKWARD_MARK

    monkeypatch.setenv(ENV_BACKWARD_MARK, "tensor-hook")
