"""Auto mode: phases from torch hooks, step boundary at optimizer.step(), numerics untouched."""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core import ConfigError, _schema
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
    from stepwatch.exporters.kernels import TorchProfilerSource

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


# ---------------------------------------------------------------- phase semantics, exactly
class ManualClock:
    """A Clock that moves only when the test (or the model it runs) advances it."""

    def __init__(self) -> None:
        self.now_ns = 1_000_000_000

    def monotonic_ns(self) -> int:
        return self.now_ns

    def time_ns(self) -> int:
        return 1_795_000_000_000_000_000 + self.now_ns

    def advance_ns(self, elapsed_ns: int) -> None:
        self.now_ns += elapsed_ns


def _histogram_points(exporter: InMemoryExporter, name: str) -> list[Any]:
    return [
        point
        for window in exporter.exported
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


class _ScriptedModel(torch.nn.Module):
    """A small MLP whose forwards take the next duration of a script, on the manual clock."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.clock = clock
        self.forward_ns: list[int] = []

    def forward(self, inputs: torch.Tensor) -> Any:
        self.clock.advance_ns(self.forward_ns.pop(0))
        return self.layers(inputs)


_NS = st.integers(0, 10**7)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(_NS, st.lists(st.tuples(_NS, _NS), min_size=1, max_size=3), _NS),
        min_size=1,
        max_size=5,
    )
)
def test_phase_boundaries_are_exact(script: list[tuple[int, list[tuple[int, int]], int]]) -> None:
    """Every phase and the step boundary land where the module docstring says, to the ns.

    Each step of the script is (data, [(forward, backward) per micro-batch], optimizer)
    nanoseconds, spent on a manual clock by the loop, the model, a gradient hook and an
    optimizer hook. A micro-batch's backward ends at the next forward, the last one at
    ``optimizer.step()``; a step ends at the end of ``optimizer.step()``, where the next one
    starts, so steps tile time.
    """
    clock = ManualClock()
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="exact", rank=0, world_size=1, exporter=exporter, clock=clock, start=False
    )
    model = _ScriptedModel(clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    backward_ns: list[int] = []
    optimizer_ns: list[int] = []
    # Registered before instrument(), so these run before stepwatch's post-hook: they are
    # inside the optimizer and backward phases.
    optimizer.register_step_post_hook(lambda *_: clock.advance_ns(optimizer_ns.pop(0)))
    first_weight = model.layers[0].weight
    first_weight.register_post_accumulate_grad_hook(lambda _: clock.advance_ns(backward_ns.pop(0)))
    monitor.instrument(model, optimizer)
    generator = torch.Generator().manual_seed(11)
    for data, micro_batches, optimizer_step in script:
        clock.advance_ns(data)
        optimizer.zero_grad(set_to_none=True)
        for forward, backward in micro_batches:
            model.forward_ns.append(forward)
            backward_ns.append(backward)
            model(torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
        optimizer_ns.append(optimizer_step)
        optimizer.step()
    monitor.close()
    assert monitor.stats.misuse == 0

    steps = len(script)
    expected_ns = {
        "forward": sum(f for _, batches, _ in script for f, _ in batches),
        "backward": sum(b for _, batches, _ in script for _, b in batches),
        "optimizer": sum(o for _, _, o in script),
        "data": sum(d for d, _, _ in script[1:]),  # the first step starts at its first forward
    }
    summary = _summary(exporter)
    phases = summary["phases"]
    counts = {name: entry["count"] for name, entry in phases.items()}
    assert counts == {
        "forward": steps,
        "backward": steps,
        "optimizer": steps,
        **({"data": steps - 1} if steps > 1 else {}),
    }
    for name, total_ns in expected_ns.items():
        if name in phases:
            assert phases[name]["sum"] == pytest.approx(total_ns * 1e-9, rel=1e-9, abs=1e-15)
    step_ns = [
        (data if index else 0) + sum(f + b for f, b in batches) + optimizer_step
        for index, (data, batches, optimizer_step) in enumerate(script)
    ]
    assert summary["steps"]["count"] == steps
    assert summary["steps"]["sum"] == pytest.approx(sum(step_ns) * 1e-9, rel=1e-9, abs=1e-15)
    (step_point,) = _histogram_points(exporter, _schema.STEP_DURATION)
    assert step_point.min == pytest.approx(min(step_ns) * 1e-9, rel=1e-9, abs=1e-15)
    assert step_point.max == pytest.approx(max(step_ns) * 1e-9, rel=1e-9, abs=1e-15)


class _LeafOutput(torch.nn.Module):
    """Returns its parameter itself: a leaf tensor with no autograd node."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, inputs: torch.Tensor) -> Any:
        return {"ignored": inputs, "out": [self.weight]}


@pytest.mark.usefixtures("tensor_hooks")
def test_backward_start_is_marked_on_an_output_without_autograd_node() -> None:
    clock = ManualClock()
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="leaf", rank=0, world_size=1, exporter=exporter, clock=clock, start=False
    )
    model = _LeafOutput()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    model.weight.register_post_accumulate_grad_hook(lambda _: clock.advance_ns(700))
    for _ in range(4):
        output = model(torch.zeros(3))
        assert output["out"][0].grad_fn is None
        optimizer.zero_grad()
        output["out"][0].sum().backward()
        optimizer.step()
    # The leaf outlives the steps; its hook is not added again every step.
    assert len(model.weight._backward_hooks) == 1
    monitor.close()
    assert not model.weight._backward_hooks
    phases = _summary(exporter)["phases"]
    assert phases["backward"]["count"] == 4
    assert phases["backward"]["sum"] == pytest.approx(4 * 700e-9, rel=1e-9)
    assert monitor.stats.misuse == 0


@pytest.mark.usefixtures("tensor_hooks")
def test_remove_detaches_the_pending_backward_start_hook() -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    _train(model, optimizer, 2)
    output = model(torch.ones(2, 16))  # forward done, backward pending
    assert output._backward_hooks  # the backward-start hook sits on the output
    instrumentation.remove()
    assert not output._backward_hooks
    output.sum().backward()
    optimizer.step()
    monitor.close()
    summary = _summary(exporter)
    assert summary["steps"]["count"] == 2  # the step left open at remove() is not recorded
    assert summary["phases"]["backward"]["count"] == 2
    assert monitor.stats.misuse == 0


class _SelfHookingModel(torch.nn.Module):
    """Registers its own hook on its output, as some models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.linear = torch.nn.Linear(4, 4)
        self.gradients_seen = 0

    def forward(self, inputs: torch.Tensor) -> Any:
        output = self.linear(inputs)
        output.register_hook(self._count)
        return output

    def _count(self, grad: torch.Tensor) -> None:
        self.gradients_seen += 1


@pytest.mark.usefixtures("tensor_hooks")
@pytest.mark.parametrize("direct", [True, False], ids=["direct-hook-dict", "register_hook"])
def test_backward_start_alongside_the_models_own_output_hooks(direct: bool) -> None:
    """Both registration paths; the model's hooks keep running once per backward."""
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _SelfHookingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    assert instrumentation._state._direct_tensor_hooks  # the probe passes on this torch
    instrumentation._state._direct_tensor_hooks = direct
    generator = torch.Generator().manual_seed(9)
    late_hook_calls: list[int] = []
    for _ in range(5):
        output = model(torch.randn(3, 4, generator=generator))
        # A hook the loop adds after the forward, on top of stepwatch's.
        handle = output.register_hook(lambda grad: late_hook_calls.append(1))
        loss = output.pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        handle.remove()
        optimizer.step()
    assert len(late_hook_calls) == 5
    # A forward with no hooks of the model's own: the direct path puts a plain dict there.
    plain = torch.nn.Linear(4, 4)
    plain_instrumentation = monitor.instrument(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    plain_instrumentation._state._direct_tensor_hooks = direct
    assert len(plain(torch.ones(1, 4))._backward_hooks) == 1
    plain_instrumentation.remove()
    monitor.close()
    assert model.gradients_seen == 5
    summary = _summary(exporter)
    assert summary["phases"]["backward"]["count"] == 5
    assert monitor.stats.misuse == 0


def test_forward_that_raises_keeps_later_forwards_timed() -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    with pytest.raises(RuntimeError):
        model(torch.zeros(2, 5))  # wrong width: the forward raises
    _train(model, optimizer, 3)
    monitor.close()
    summary = _summary(exporter)
    assert summary["steps"]["count"] == 3
    assert summary["phases"]["forward"]["count"] == 3


def test_deep_copy_of_an_instrumented_model_is_not_instrumented() -> None:
    import copy

    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    _train(model, optimizer, 2)
    average = copy.deepcopy(model)  # e.g. an EMA copy, made after instrument()
    assert type(average) is torch.nn.Sequential  # a plain module of the original class
    assert isinstance(model, torch.nn.Sequential) and type(model) is not torch.nn.Sequential
    with torch.no_grad():
        average[0].weight.add_(1.0)  # the copy computes with its own weights
        assert not torch.equal(average(torch.ones(2, 16)), model(torch.ones(2, 16)))
        for _ in range(3):
            average(torch.ones(2, 16))
    _train(model, optimizer, 2)
    monitor.close()
    summary = _summary(exporter)
    assert summary["steps"]["count"] == 4
    assert summary["phases"]["forward"]["count"] == 4
    assert monitor.stats.misuse == 0


class _Subclass(torch.Tensor):
    """A tensor subclass (it inherits ``__torch_function__``): register_hook is its business."""


class _SubclassOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, inputs: torch.Tensor) -> Any:
        return self.linear(inputs).as_subclass(_Subclass)


@pytest.mark.usefixtures("tensor_hooks")
def test_backward_start_on_a_tensor_subclass_output_goes_through_register_hook() -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _SubclassOutput()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    generator = torch.Generator().manual_seed(13)
    for _ in range(3):
        output = model(torch.randn(2, 4, generator=generator))
        assert type(output) is _Subclass
        # torch's register_hook made the hook dict (an OrderedDict), not stepwatch's shortcut.
        assert type(output._backward_hooks) is collections.OrderedDict
        optimizer.zero_grad()
        output.sum().backward()
        optimizer.step()
    monitor.close()
    assert _summary(exporter)["phases"]["backward"]["count"] == 3
    assert monitor.stats.misuse == 0


def test_pickled_and_replicated_copies_run_their_own_forward_untimed() -> None:
    import pickle

    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(13)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    assert model.forward.__wrapped__ is torch.nn.Sequential.forward  # signature kept
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored) is torch.nn.Sequential
    # What nn.DataParallel's replicate() does: a new instance of type(model), same __dict__.
    replica = model._replicate_for_data_parallel()
    assert type(replica) is type(model)
    inputs = torch.ones(2, 16)
    with torch.no_grad():
        restored[0].weight.add_(1.0)
        assert not torch.equal(restored(inputs), model(inputs))
        replica(inputs)
    assert monitor._recorder.step_depth == 1  # only the model's own forward opened a step
    _train(model, optimizer, 2)
    instrumentation.remove()
    assert type(model) is torch.nn.Sequential
    _train(model, optimizer, 2)
    monitor.close()
    summary = _summary(exporter)
    assert summary["steps"]["count"] == 2
    # One forward phase per step: the no-grad forward and the first step's are summed.
    assert summary["phases"]["forward"]["count"] == 2
    assert monitor.stats.misuse == 0


def test_a_forward_set_on_the_instance_is_timed_with_module_hooks() -> None:
    exporter = InMemoryExporter()
    monitor = _monitor(exporter)
    model = _model(14)
    plain_forward = model.forward
    calls: list[int] = []

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return plain_forward(inputs)

    model.forward = forward  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    assert type(model) is torch.nn.Sequential  # no swap: the instance's forward would win
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    _train(model, optimizer, 3)
    instrumentation.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks
    monitor.close()
    assert len(calls) == 3
    summary = _summary(exporter)
    assert summary["phases"]["forward"]["count"] == 3
    assert summary["phases"]["backward"]["count"] == 3
