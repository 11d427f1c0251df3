"""Auto mode's backward start at the autograd engine (``_engine``, ``csrc/enginegate.h``;
issue 15, twentieth round): a timed forward arms its hook at the gate instead of hooking its
output, and the next ``.backward()`` of the same step calls it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd.variable import Variable

from stepwatch.exporters import InMemoryExporter, StepMonitor, _engine
from stepwatch.exporters._engine import ENV_BACKWARD_MARK
from stepwatch.exporters._engine_gate import PythonEngineGate
from stepwatch.exporters._sampling import PhaseSampler
from tests.exporters.test_auto import ManualClock, _model, _summary

# The gate in C (exporters/csrc/enginegate.h) and its Python twin (_engine_gate): one behaviour.
GATES = [
    pytest.param(
        getattr(_engine._fastrecord, "EngineGate", None),
        id="C",
        marks=pytest.mark.skipif(_engine._fastrecord is None, reason="_fastrecord is not built"),
    ),
    pytest.param(PythonEngineGate, id="Python"),
]


def _gate() -> Any:
    gate = _engine.acquire()
    assert gate is not None
    return gate


def test_the_gate_is_torchs_engine_and_the_last_release_puts_torchs_back() -> None:
    users = _engine._users
    gate = _gate()
    try:
        engine = Variable._execution_engine
        assert isinstance(engine, torch._C._ImperativeEngine)
        assert engine.run_backward is gate
        # The engine's other methods are its own: a callback queued in a backward runs.
        called: list[int] = []
        leaf = torch.ones(2, requires_grad=True)
        middle = leaf * 3.0
        middle.register_hook(lambda grad: engine.queue_callback(lambda: called.append(1)))
        middle.sum().backward()
        assert called == [1]
        assert leaf.grad is not None and torch.equal(leaf.grad, torch.full((2,), 3.0))
        assert _gate() is gate  # one gate a process
        _engine.release(gate)
    finally:
        _engine.release(gate)
    if users == 0:  # no instrumentation of another test still holds it
        assert type(Variable._execution_engine) is torch._C._ImperativeEngine
        assert _engine.acquire() is not gate  # a new one, installed again
        _engine.release(_engine._installed["gate"])


@pytest.mark.parametrize("gate_type", GATES)
def test_the_gate_passes_every_call_through_and_fires_on_accumulating_backwards_only(
    gate_type: Any,
) -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def run(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "ran"

    gate = gate_type(run)
    fired: list[Any] = []
    assert gate.arm(fired.append, None)
    assert gate(1, 2, accumulate_grad=False) == "ran"  # autograd.grad: not a backward's start
    assert gate(1, 2, 3, 4, 5, 6, False) == "ran"  # accumulate_grad given positionally
    assert fired == [] and gate.armed == 1
    assert gate("t", None, False, False, (), allow_unreachable=True, accumulate_grad=True) == "ran"
    assert fired == [None] and gate.armed == 0 and gate.marks == 1
    assert gate(5) == "ran"  # nothing armed: a plain call
    assert calls[0] == ((1, 2), {"accumulate_grad": False})
    assert calls[2] == (
        ("t", None, False, False, ()),
        {"allow_unreachable": True, "accumulate_grad": True},
    )
    assert len(calls) == 4
    # torch's default (no accumulate_grad given) accumulates
    gate.arm(fired.append, None)
    gate(1)
    assert fired == [None, None]
    # Megatron's pipeline schedules call the engine directly, every argument by keyword
    gate.arm(fired.append, None)
    megatron = {
        "tensors": ("t",),
        "grad_tensors": ("g",),
        "keep_graph": False,
        "create_graph": False,
        "inputs": (),
        "allow_unreachable": True,
        "accumulate_grad": True,
    }
    assert gate(**megatron) == "ran"
    assert fired == [None, None, None] and calls[-1] == ((), megatron)


@pytest.mark.parametrize("gate_type", GATES)
def test_arms_beyond_the_slots_are_refused_and_hooks_cannot_break_the_backward(
    gate_type: Any,
) -> None:
    order: list[int] = []
    gate = gate_type(lambda *args, **kwargs: order.append(-1))

    def hook(number: int) -> Any:
        def call(_: Any) -> None:
            order.append(number)
            if number == 2:
                raise RuntimeError("a hook that raises")
            if number == 3:  # a hook that starts a backward itself: the arms are out already
                gate(accumulate_grad=True)

        return call

    hooks = [hook(number) for number in range(9)]
    assert all(gate.arm(hooks[number], None) for number in range(8))
    assert not gate.arm(hooks[8], None)  # no slot left: the caller hooks its output
    assert gate.arm(hooks[0], None)  # armed again: its one slot
    assert gate.disarm(hooks[7]) and not gate.disarm(hooks[7])
    assert gate.armed == 7
    gate(accumulate_grad=True)
    # each armed hook once, in order; the raise dropped; the inner backward found none armed
    assert order == [0, 1, 2, 3, -1, 4, 5, 6, -1]
    assert gate.marks == 7 and gate.armed == 0


def _job(
    monitor: StepMonitor, steps: int, clock: ManualClock | None, *, grad_between: bool = False
) -> tuple[Any, list[torch.Tensor]]:
    """``steps`` steps under ``monitor.step()``; with ``clock``, 300 ns of forward, 700 of
    backward, and (``grad_between``) 5,000 in an ``autograd.grad`` between the two."""
    model = _model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    if clock is not None:
        model[0].weight.register_post_accumulate_grad_hook(lambda _: clock.advance_ns(700))
    generator = torch.Generator().manual_seed(4)
    outputs = []
    for _ in range(steps):
        with monitor.step():
            inputs = torch.randn(4, 16, generator=generator)
            output = model(inputs)
            if clock is not None:
                clock.advance_ns(300)  # the loss: between the forward and the backward
            outputs.append(output)
            if grad_between:  # a gradient of something else: not the model's backward
                leaf = torch.ones(3, requires_grad=True)
                if clock is not None:
                    clock.advance_ns(5_000)
                torch.autograd.grad((leaf * 2.0).sum(), leaf)
            optimizer.zero_grad()
            output.pow(2).mean().backward()
            optimizer.step()
    return instrumentation, outputs


def test_a_timed_step_arms_the_engine_and_hooks_no_output() -> None:
    """The monitor's own clock: one mark per timed step, no tensor hook (the gate in C, or in
    Python where the extension is not built)."""
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="e", rank=0, world_size=1, exporter=exporter, start=False, phase_sampling=4
    )
    gate = _gate()
    try:
        marks = gate.marks
        instrumentation, outputs = _job(monitor, 40, None)
        assert instrumentation._state.engine is gate
        timed = [PhaseSampler(4).sampled(index) for index in range(40)]
        assert gate.marks - marks == sum(timed) > 0
        assert not any(output._backward_hooks for output in outputs)
        monitor.close()
        # the timed steps' backwards stand for all 40 (sampling)
        assert _summary(exporter)["phases"]["backward"]["count"] == 40
        assert monitor.stats.misuse == 0
    finally:
        _engine.release(gate)


@pytest.mark.parametrize("grad_between", [False, True], ids=["plain", "autograd.grad between"])
def test_the_engine_and_the_tensor_hook_time_the_same_backward(
    grad_between: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Python path (a manual clock): the same windows either way; an ``autograd.grad``
    between the forward and the backward starts neither."""
    summaries = []
    for mode in ("engine", "tensor-hook"):
        monkeypatch.setenv(ENV_BACKWARD_MARK, mode)
        clock, exporter = ManualClock(), InMemoryExporter()
        monitor = StepMonitor(
            job_id="e",
            rank=0,
            world_size=1,
            exporter=exporter,
            clock=clock,
            start=False,
            phase_sampling=1,
        )
        instrumentation, outputs = _job(monitor, 6, clock, grad_between=grad_between)
        assert (instrumentation._state.engine is not None) is (mode == "engine")
        assert all(bool(output._backward_hooks) is (mode != "engine") for output in outputs)
        instrumentation.remove()
        monitor.close()
        assert monitor.stats.misuse == 0
        summaries.append(_summary(exporter))
    assert summaries[0] == summaries[1]
    backward = summaries[0]["phases"]["backward"]
    assert backward["count"] == 6
    assert backward["sum"] == pytest.approx(6 * 700e-9, rel=1e-9)


def test_an_arm_left_by_a_closed_step_is_dropped() -> None:
    """A forward under grad whose output no backward reaches in its step (an evaluation with
    grad on, say): a later backward does not open that step's backward."""
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="e", rank=0, world_size=1, exporter=exporter, start=False, phase_sampling=1
    )
    gate = _gate()
    try:
        model = _model(5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        instrumentation = monitor.instrument(model, optimizer)
        state = instrumentation._state
        with monitor.step():
            left = model(torch.ones(2, 16))  # armed, never backpropagated in this step
        assert gate.armed >= 1
        marks, dropped = gate.marks, gate.dropped
        left.sum().backward()  # after the step: the arm is stale
        assert (gate.marks, gate.dropped) == (marks, dropped + 1)
        assert not state.in_backward
        with monitor.step():
            output = model(torch.ones(2, 16))
            output.sum().backward()
            optimizer.step()
        assert gate.marks == marks + 1
        instrumentation.remove()
        monitor.close()
        phases = _summary(exporter)["phases"]
        assert phases["backward"]["count"] == 1  # the second step's alone
        assert phases["forward"]["count"] == 2
        assert monitor.stats.misuse == 0
    finally:
        _engine.release(gate)


def test_remove_disarms_and_two_models_start_at_one_backward() -> None:
    gate = _gate()
    try:
        monitors, models, instrumentations = [], [], []
        for seed in (6, 7):
            monitor = StepMonitor(
                job_id=f"m{seed}",
                rank=0,
                world_size=1,
                exporter=InMemoryExporter(),
                start=False,
                phase_sampling=1,
            )
            model = _model(seed)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            instrumentations.append(monitor.instrument(model, optimizer))
            monitors.append((monitor, optimizer))
            models.append(model)
        marks = gate.marks
        for _ in range(3):  # both models feed one loss (auto steps)
            loss = models[0](torch.ones(2, 16)).sum() + models[1](torch.ones(2, 16)).sum()
            loss.backward()
            for _monitor, optimizer in monitors:
                optimizer.step()
        assert gate.marks - marks == 6
        assert all(not instrumentation._state.in_backward for instrumentation in instrumentations)
        models[0](torch.ones(2, 16))  # forward done, backward pending
        armed = gate.armed
        instrumentations[0].remove()
        assert gate.armed == armed - 1
        marks = gate.marks
        models[0](torch.ones(2, 16)).sum().backward()  # not instrumented any more
        assert gate.marks == marks
        instrumentations[1].remove()
        for (monitor, _optimizer), expected in zip(monitors, (3, 3), strict=True):
            monitor.close()
            assert _summary(monitor._exporter)["phases"]["backward"]["count"] == expected  # type: ignore[arg-type]
            assert monitor.stats.misuse == 0
    finally:
        _engine.release(gate)


def test_someone_elses_engine_or_the_environment_keeps_tensor_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_BACKWARD_MARK, "tensor-hook")
    assert _engine.acquire() is None
    monkeypatch.delenv(ENV_BACKWARD_MARK)

    class TheirEngine(torch._C._ImperativeEngine):
        pass

    theirs = TheirEngine()
    monkeypatch.setattr(Variable, "_execution_engine", theirs)
    monkeypatch.setattr(_engine, "_installed", {})
    monkeypatch.setattr(_engine, "_users", 0)
    monkeypatch.setattr(_engine, "_refused", False)
    assert _engine.acquire() is None
    assert Variable._execution_engine is theirs
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="e", rank=0, world_size=1, exporter=exporter, start=False, phase_sampling=1
    )
    instrumentation, outputs = _job(monitor, 3, None)
    assert instrumentation._state.engine is None
    assert all(output._backward_hooks for output in outputs)  # the tensor hook, as before
    instrumentation.remove()
    monitor.close()
    assert _summary(exporter)["phases"]["backward"]["count"] == 3


class _Stamp:
    """The last-gradient stamp (``_recorder._ClockStamp``'s ``ns``)."""

    def __init__(self) -> None:
        self.ns = 0


class _Recorder:
    """What the Python gate reads of a recorder: its open step, clock and phases."""

    def __init__(self, now_ns: int) -> None:
        self.step_depth, self.step_index, self.now_ns = 1, 0, now_ns
        self.phases: dict[str, int] = {}

    def clock_ns(self) -> int:
        return self.now_ns

    def add_phase_ns(self, name: str, elapsed_ns: int) -> None:
        self.phases[name] = self.phases.get(name, 0) + elapsed_ns


def test_the_python_gate_ends_each_set_wait_when_a_backward_returns_or_raises() -> None:
    """``close_waits`` of the Python twin: the C gate's (``enginegate.h``), on Python stamps
    and recorders (the C one takes only its own types, tested through real DDP jobs)."""

    def run(*args: Any, **kwargs: Any) -> str:
        if kwargs.get("fail"):
            raise RuntimeError("the engine raised")
        return "ran"

    gate = PythonEngineGate(run)
    stamps, recorders = [_Stamp() for _ in range(9)], [_Recorder(1_000) for _ in range(9)]
    assert all(gate.close_waits(stamps[i], recorders[i]) for i in range(8))
    assert not gate.close_waits(stamps[8], recorders[8])  # no slot left
    assert gate.close_waits(stamps[0], recorders[8])  # the same stamp takes the new recorder
    assert gate.closing == 8
    stamps[0].ns, stamps[1].ns, stamps[2].ns = 400, 1_500, 0  # 1_500: after "now", not counted
    assert gate() == "ran"
    assert recorders[8].phases == {"communication": 600} and recorders[0].phases == {}
    assert recorders[1].phases == {} and stamps[0].ns == stamps[1].ns == 0
    assert gate.closed == 2
    stamps[3].ns = 900
    with pytest.raises(RuntimeError):
        gate(fail=True)
    assert recorders[3].phases == {"communication": 100} and stamps[3].ns == 0
    assert gate.unclose(stamps[3]) and not gate.unclose(stamps[3]) and gate.closing == 7
    stamps[3].ns = 10
    gate()
    assert stamps[3].ns == 10  # no longer closed here


def test_the_python_gate_drops_an_arm_whose_step_closed() -> None:
    gate, recorder = PythonEngineGate(lambda *a, **k: None), _Recorder(0)
    fired: list[Any] = []
    recorder.step_depth = 0
    assert not gate.arm(fired.append, recorder)  # no step open: not armed
    recorder.step_depth = 1
    assert gate.arm(fired.append, recorder)
    recorder.step_index = 1  # that step closed, the next one is open
    gate()
    assert fired == [] and gate.dropped == 1 and gate.marks == 0
