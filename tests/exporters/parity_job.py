"""A real 3-rank gloo DDP job in auto mode whose phases have known lengths (sleeps), for the
C/Python parity test (tests/exporters/test_c_python_parity.py).

    python -m tests.exporters.parity_job OUT_DIR

Each rank writes OUT_DIR/rankN.json: each step's phases (ms, from the recorder's buffer before
the export), its phases over every exported window (count, sum in s), and which implementation
ran (``_cext.IMPLEMENTATION``, the autograd engine gate's type). Run
it once as is and once with ``STEPWATCH_EXPORTERS_NO_C=1``: the two must give the same
phases. The lengths are chosen so that the two ways a phase boundary could differ show:

- the loss's own backward (``LOSS_BACKWARD_S``) runs before the gradient reaches the model's
  output: in the backward phase when its start is the moment ``loss.backward()`` is called
  (the engine's gate), not with a tensor hook on the output;
- gradient clipping between ``backward()`` and ``optimizer.step()`` (``CLIP_S``) is not a wait
  for the peers: ``communication`` ends when ``loss.backward()`` returns, not at the optimizer;
- the last rank reaches the allreduce ``STRAGGLE_S`` late (a longer forward), so the others
  wait about that long in ``communication``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

WORLD_SIZE = 3
STEPS = 20
DATA_S = 0.004
FORWARD_S = 0.006
STRAGGLE_S = 0.030  # the last rank's forward is this much longer
MODEL_BACKWARD_S = 0.008
LOSS_BACKWARD_S = 0.050
CLIP_S = 0.050


def _sleepy(seconds_forward: float, seconds_backward: float) -> Any:
    """A torch module that passes its input through, sleeping in forward and in backward."""
    import torch

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, inputs: Any) -> Any:
            time.sleep(seconds_forward)
            return inputs.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            time.sleep(seconds_backward)
            return grad

    class Sleepy(torch.nn.Module):
        def forward(self, inputs: Any) -> Any:
            return Sleep.apply(inputs)

    return Sleepy()


def rank_main(rank: int, world_size: int, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import InMemoryExporter, StepMonitor, _cext
    from tests.exporters.test_auto import _summary

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)
        forward_s = FORWARD_S + (STRAGGLE_S if rank == world_size - 1 else 0.0)
        net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), _sleepy(forward_s, MODEL_BACKWARD_S), torch.nn.Linear(32, 4)
        )
        model = DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        exporter = InMemoryExporter()
        monitor = StepMonitor(
            job_id="parity",
            rank=rank,
            world_size=world_size,
            exporter=exporter,
            health=False,
            phase_sampling=1,
            start=False,  # the steps stay in the buffer until close()
        )
        handle = monitor.instrument(model, optimizer)
        loss_backward = _sleepy(0.0, LOSS_BACKWARD_S)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            time.sleep(DATA_S)  # the data phase: previous step's end to the forward
            inputs = torch.randn(8, 16, generator=generator)
            loss = loss_backward(model(inputs)).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            time.sleep(CLIP_S)  # the loop's own work between backward() and step()
            optimizer.step()
        engine = type(handle._state.engine).__name__
        handle.remove()
        steps = [  # the auto phases of each (timed) step, and its exposed wait
            {
                **{name: ns / 1e6 for name, ns in record[5].items()},
                **{name: ns / 1e6 for name, ns in record[3].items()},
            }
            for record in monitor._recorder.buffer
        ]
        monitor.close()
        result = {
            "implementation": _cext.IMPLEMENTATION,
            "engine_gate": engine,
            "steps_ms": steps,
            "summary": _summary(exporter),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main(out_dir: str) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(  # type: ignore[no-untyped-call]
        rank_main, args=(WORLD_SIZE, out_dir), nprocs=WORLD_SIZE, join=True, start_method="spawn"
    )


if __name__ == "__main__":
    main(sys.argv[1])
