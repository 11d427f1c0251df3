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
