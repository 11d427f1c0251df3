"""Start the ranks of a real multi-process job (CPU, gloo on loopback) and wait for them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from stepwatch.core._errors import StepwatchError
from stepwatch.core._net import free_port


def run_ranks(
    rank_main: Callable[..., None],
    args: tuple[Any, ...],
    *,
    world_size: int,
    timeout_s: float,
    what: str,
) -> None:
    """Run ``rank_main(rank, *args, master_port)`` in ``world_size`` spawned processes.

    ``rank_main`` must be importable by name (spawned processes unpickle it). Returns when
    every rank has finished; the ranks still running when one fails, or at the deadline,
    are terminated.

    Raises:
        StepwatchError: a rank failed or the job did not finish within ``timeout_s``
            (``what`` names the job in the message).
    """
    from torch.multiprocessing.spawn import (
        ProcessExitedException,
        ProcessRaisedException,
        start_processes,
    )

    context = start_processes(  # type: ignore[no-untyped-call]
        rank_main,
        args=(*args, free_port()),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise StepwatchError(f"{what} did not finish within {timeout_s:.0f} s")
    except ProcessRaisedException as exc:
        raise StepwatchError(f"a {what} rank failed: {exc}") from exc
    except ProcessExitedException as exc:
        raise StepwatchError(f"a {what} rank exited abnormally: {exc}") from exc
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


def join_gloo(rank: int, world_size: int, master_port: int, *, seed: int) -> None:
    """In a rank's process: one CPU thread (the ranks share the host's cores), a seed of its
    own (``seed + rank``), and the job's gloo process group on loopback."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(seed + rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{master_port}",
        rank=rank,
        world_size=world_size,
    )
