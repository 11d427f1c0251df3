"""bench/overhead.py's HookSwitch: arm B really runs without stepwatch, arm A with all of it.

The switch swaps torch's per-object hook dicts (internals); if a torch version moved them, the
bench would compare stepwatch against itself and print a small overhead. This pins it.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stepwatch.core import _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor

BENCH = Path(__file__).resolve().parents[2] / "bench" / "overhead.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("overhead_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_switched_off_hooks_record_nothing_and_switched_on_record_every_phase() -> None:
    bench = load_bench()
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8)))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            exporter = InMemoryExporter()
            monitor = StepMonitor(
                job_id="switch", rank=0, world_size=1, exporter=exporter, start=False
            )
            state = monitor.instrument(model, optimizer)._state
            switch = bench.HookSwitch(model, optimizer)
            x = torch.randn(4, 8)

            def train(steps: int) -> None:
                for _ in range(steps):
                    model(x).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()

            first = next(model.parameters())

            def hook_counts() -> list[int]:
                dicts = (
                    model._forward_pre_hooks,
                    model._forward_hooks,
                    optimizer._optimizer_step_pre_hooks,
                    optimizer._optimizer_step_post_hooks,
                    first._post_accumulate_grad_hooks or {},
                )
                # The forward is timed by a subclass of DDP swapped in (no module hook).
                return [int(type(model) is not DistributedDataParallel)] + [
                    len(hooks) for hooks in dicts
                ]

            assert hook_counts() == [1, 0, 0, 1, 1, 1]  # where instrument() puts its hooks
            gate = state.engine  # the autograd engine's gate (_engine), where installed
            engine = torch.autograd.variable.Variable._execution_engine
            assert gate is None or engine.run_backward is gate
            switch.set(False)
            assert hook_counts() == [0, 0, 0, 0, 0, 0]
            assert type(torch.autograd.variable.Variable._execution_engine) is (
                torch._C._ImperativeEngine
            )
            train(3)
            assert monitor.stats.steps_recorded == 0
            # No hook ran at all: no phase, no step opened, no gradient-ready time taken.
            assert not monitor._recorder._phases_ns and monitor._recorder.step_depth == 0
            assert state.gradient_stamp.ns == 0 and state.forward_depth == 0
            switch.set(True)
            assert torch.autograd.variable.Variable._execution_engine is engine
            train(3)
            # Auto mode: a step ends at each optimizer.step(), the first one opened by forward.
            assert monitor.stats.steps_recorded == 3
            assert monitor.export_now()
            names = {
                str(point.attributes[_schema.PHASE])
                for window in exporter.exported
                for metric in window.resource_metrics[0].scope_metrics[0].metrics
                if metric.name == _schema.PHASE_DURATION
                for point in metric.data.data_points
            }
            assert {"forward", "backward", "optimizer", "communication"} <= names
            switch.set(False)
            train(2)
            assert monitor.stats.steps_recorded == 3
            monitor.close(timeout_s=1.0)
        finally:
            dist.destroy_process_group()
