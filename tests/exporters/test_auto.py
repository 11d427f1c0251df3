"""Auto mode: phases from torch hooks, step boundary at optimizer.step(), numerics untouched."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stepwatch import ConfigError, _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor


def _summary(exporter: InMemoryExporter) -> dict[str, Any]:
    """Counts and sums per phase, plus step totals, over every exported window."""
    phases: dict[str, dict[str, float]] = {}
    steps = {"count": 0, "sum": 0.0}
    last = -1
    for window in exporter.exported:
        for metric in window.resource_metrics[0].scope_metrics[0].metrics:
            if metric.name == _schema.PHASE_DURATION:
                for point in metric.data.data_points:
                    entry = phases.setdefault(
                        str(point.attributes[_schema.PHASE]), {"count": 0, "sum": 0.0}
                    )
                    entry["count"] += point.count
                    entry["sum"] += point.sum
            elif metric.name == _schema.STEP_DURATION:
                steps["count"] += metric.data.data_points[0].count
                steps["sum"] += metric.data.data_points[0].sum
            elif metric.name == _schema.STEP_LAST:
                last = max(last, int(metric.data.data_points[0].value))
    return {"phases": phases, "steps": steps, "last": last}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        inputs = torch.randn(8, 16, generator=generator)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _monitor(exporter: InMemoryExporter, rank: int = 0, world_size: int = 1) -> StepMonitor:
    return StepMonitor(
        job_id="auto", rank=rank, world_size=world_size, exporter=exporter, start=False
    )


def test_auto_steps_and_phases_without_touching_numerics() -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    instrumentation = monitor.instrument(model, optimizer)
    assert not instrumentation.communication_timed
    _train(model, optimizer, 10)
    monitor.close()

    reference = _model(0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    _train(reference, reference_optimizer, 10)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)

    summary = _summary(exporter)
    assert summary["steps"]["count"] == 10  # step boundary = end of optimizer.step()
    assert summary["last"] == 9
    phases = summary["phases"]
    assert {name: entry["count"] for name, entry in phases.items()} == {
        "forward": 10,
        "backward": 10,
        "optimizer": 10,
        "data": 9,  # between steps: none before the first
    }
    for entry in phases.values():
        assert 0 < entry["sum"] < summary["steps"]["sum"]
    assert monitor.stats.misuse == 0


def test_auto_phases_inside_explicit_steps() -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    with torch.no_grad():
        model(torch.zeros(2, 16))  # a forward before the first step() opens an auto step
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        with monitor.step():
            with monitor.phase("data"):
                inputs = torch.randn(8, 16, generator=generator)
            loss = model(inputs).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    monitor.close()
    assert monitor.stats.misuse == 0
    summary = _summary(exporter)
    assert summary["steps"]["count"] == 5
    assert {name: entry["count"] for name, entry in summary["phases"].items()} == {
        "data": 5,
        "forward": 5,  # the warm-up forward adds to the first step's forward time
        "backward": 5,
        "optimizer": 5,
    }


def test_no_grad_forward_and_removed_hooks_add_nothing() -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    with torch.no_grad():
        model(torch.zeros(2, 16))  # opens the first auto step, registers no backward hook
    instrumentation.remove()
    _train(model, optimizer, 3)
    monitor.close()
    assert monitor.stats.steps_recorded == 0
    assert monitor.stats.misuse == 0


def test_instrument_rejects_non_torch_objects() -> None:
    monitor = _monitor(InMemoryExporter())
    model = _model(0)
    with pytest.raises(ConfigError, match="model"):
        monitor.instrument(object(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="optimizer"):
        monitor.instrument(model, object())
    monitor.close()


# ---------------------------------------------------------------- real 2-process DDP (gloo)
def _ddp_rank(rank: int, world_size: int, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    # A file store: no rendezvous port to race other tests for (gloo binds its own).
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world_size
    )
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        exporter, user_hook_exporter = InMemoryExporter(), InMemoryExporter()
        registered_exporter = InMemoryExporter()
        monitor = _monitor(exporter, rank=rank, world_size=world_size)
        user_hook_monitor = _monitor(user_hook_exporter, rank=rank, world_size=world_size)
        registered_monitor = _monitor(registered_exporter, rank=rank, world_size=world_size)
        models = [DistributedDataParallel(_model(0)) for _ in range(4)]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
        instrumentation = monitor.instrument(models[0], optimizers[0])
        # A user's own comm hook, passed to instrument() so it gets wrapped by the timing hook.
        user_hook_instrumentation = user_hook_monitor.instrument(
            models[1], optimizers[1], comm_hook=allreduce_hook
        )
        # A comm hook registered before instrument(): the exposed wait is still timed.
        models[3].register_comm_hook(None, allreduce_hook)
        registered_instrumentation = registered_monitor.instrument(models[3], optimizers[3])
        generator = torch.Generator().manual_seed(100 + rank)
        for _ in range(20):
            inputs = torch.randn(32, 16, generator=generator)
            for model, opt in zip(models, optimizers, strict=True):
                loss = model(inputs).pow(2).mean()
                opt.zero_grad(set_to_none=True)
                if model is models[0] and rank == 1:
                    time.sleep(0.005)  # rank 1 reaches the allreduce late: rank 0 waits
                loss.backward()
                opt.step()
        monitor.close()
        user_hook_monitor.close()
        registered_monitor.close()
        identical = all(
            torch.equal(a, b) and torch.equal(a, c)
            for a, b, c, _ in zip(*(m.parameters() for m in models), strict=True)
        )
        result = {
            "summary": _summary(exporter),
            "user_hook_summary": _summary(user_hook_exporter),
            "identical": identical,
            "registered_hook_summary": _summary(registered_exporter),
            "communication_timed": instrumentation.communication_timed
            and user_hook_instrumentation.communication_timed
            and registered_instrumentation.communication_timed,
            "stats": monitor.stats.__dict__,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_gloo_ddp_auto_mode(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    world_size = 2
    mp.start_processes(  # type: ignore[no-untyped-call]
        _ddp_rank,
        args=(world_size, str(tmp_path)),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    results = [
        json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)
    ]
    # The exposed wait: the rank that arrives last at the collective waits least in it.
    waits = [r["summary"]["phases"]["communication"]["sum"] for r in results]
    assert waits[0] >= waits[1] + 20 * 0.002, waits
    for result in results:
        assert result["identical"], "auto mode changed the numerics"
        assert result["communication_timed"]
        summary = result["summary"]
        assert summary["steps"]["count"] == 20
        assert summary["last"] == 19
        phases = summary["phases"]
        for name in ("forward", "backward", "optimizer", "communication"):
            assert phases[name]["count"] == 20, name
            assert 0 < phases[name]["sum"] < summary["steps"]["sum"], name
        assert phases["data"]["count"] == 19
        # The allreduce runs inside backward (DDP waits for it before backward returns).
        assert phases["communication"]["sum"] <= phases["backward"]["sum"]
        assert result["user_hook_summary"]["phases"]["communication"]["count"] == 20
        assert result["registered_hook_summary"]["phases"]["communication"]["count"] == 20
        assert result["stats"]["misuse"] == 0
        assert result["stats"]["steps_dropped"] == 0


def test_real_torch_profiler_kernel_source_feeds_the_window() -> None:
    from stepwatch.exporters import TorchProfilerSource

    exporter = InMemoryExporter()
    source = TorchProfilerSource(active_steps=2, period_steps=4)
    monitor = StepMonitor(
        job_id="kernels", rank=0, world_size=1, exporter=exporter, kernel_source=source, start=False
    )
    model = _model(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    _train(model, optimizer, 12)
    monitor.close()
    kernel_points = [
        point
        for window in exporter.exported
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
        if metric.name == _schema.KERNEL_DURATION
        for point in metric.data.data_points
    ]
    assert kernel_points
    categories = {str(p.attributes[_schema.KERNEL_CATEGORY]) for p in kernel_points}
    assert categories <= set(_schema.KERNEL_CATEGORIES)
    assert "compute" in categories
    assert all(p.count > 0 and p.sum >= 0 for p in kernel_points)
