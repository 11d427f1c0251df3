"""A timed step's auto-mode hooks in C (issue 15): ``ForwardGate.time_in_c``,
``OptimizerGate``'s timed path and ``BackwardStart``.

Each phase of a real 1-rank gloo DDP step is made to last a known time (sleeps in the model's
forward, in a custom autograd function's backward and in the optimizer's step); the C path and
the pure-Python one (no extension: ``_recorder.FAST_RECORDER`` off) must both put each sleep
in its own phase, and with the extension a timed step must enter no Python frame of
stepwatch's.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from stepwatch.exporters import InMemoryExporter, StepMonitor, _recorder
from tests.exporters.test_class_toggle import _monitor

SLEEP_S = {"data": 0.015, "forward": 0.020, "backward": 0.050, "optimizer": 0.030}


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S["backward"])
        return grad


class _SlowModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S["forward"])
        return _SlowBackward.apply(self.linear(inputs))


class _SlowSGD(torch.optim.Optimizer):
    """Plain SGD that sleeps first. Not a subclass of ``torch.optim.SGD`` calling its
    ``step``: torch hooks each optimizer class's ``step``, so once ``SGD.step`` is hooked (by
    any SGD made earlier in the process) the hooks would run around the inner call too."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(SLEEP_S["optimizer"])
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.add_(parameter.grad, alpha=-group["lr"])
        return None


def _timed_steps(steps: int, loop_marks: bool) -> tuple[list[dict[str, int]], StepMonitor]:
    """``steps`` timed DDP steps of the slow model, marked by the loop (``monitor.step()``)
    or by auto mode (the optimizer's post-hook): each step's sampled phases (its record's)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(_SlowModel())
    optimizer = _SlowSGD(model.parameters(), lr=0.01)
    monitor = _monitor(1)
    handle = monitor.instrument(model, optimizer)
    context = monitor.step if loop_marks else contextlib.nullcontext
    try:
        for _ in range(steps):
            with context():
                time.sleep(SLEEP_S["data"])  # auto steps: the data phase
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        handle.remove()
    records = list(monitor._recorder.buffer)
    assert [record[0] for record in records] == list(range(len(records)))
    for record in records:
        assert sum(record[5].values()) <= record[2] - record[1]  # the phases fit in the step
    return [dict(record[5]) for record in records], monitor


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("loop_marks", [True, False], ids=["step()", "auto steps"])
def test_each_phase_holds_its_own_sleep(
    path: str, loop_marks: bool, gloo: None, monkeypatch: Any
) -> None:
    if path == "c" and _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    if path == "python":
        monkeypatch.setattr(_recorder, "FAST_RECORDER", None)
    phases, monitor = _timed_steps(5, loop_marks)
    try:
        # Auto steps: each ends at the optimizer's post-hook, and the first has no data phase
        # (it opened at its own forward).
        expected = ["backward", "forward", "optimizer"]
        assert len(phases) == 5
        for index, step in enumerate(phases):
            names = expected if loop_marks or index == 0 else ["data", *expected]
            assert sorted(step) == sorted(names), step
            for name in names:
                assert step[name] >= SLEEP_S[name] * 1e9, (name, step)
        # No phase holds another's sleep (the median step: a loaded host may oversleep once).
        median = {name: statistics.median(step[name] for step in phases) for name in expected}
        assert median["forward"] < SLEEP_S["backward"] * 1e9
        assert median["backward"] < (SLEEP_S["backward"] + SLEEP_S["optimizer"]) * 1e9
        assert median["optimizer"] < SLEEP_S["backward"] * 1e9 + SLEEP_S["optimizer"] * 1e9
        if not loop_marks:
            data = statistics.median(step["data"] for step in phases[1:])
            assert SLEEP_S["data"] * 1e9 <= data < SLEEP_S["backward"] * 1e9
        monitor.export_now()
        exported = monitor._transport.exporter
        assert isinstance(exported, InMemoryExporter) and exported.exported
    finally:
        monitor.close(timeout_s=1.0)


@pytest.mark.parametrize("loop_marks", [True, False], ids=["step()", "auto steps"])
@pytest.mark.parametrize("stride", [1, 1 << 40], ids=["timed", "untimed"])
def test_a_ddp_step_enters_no_python_frame_of_stepwatch(
    loop_marks: bool, stride: int, gloo: None
) -> None:
    if _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(stride)
    handle = monitor.instrument(model, optimizer)
    package = str(Path(_recorder.__file__).parent)
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            entered.append(frame.f_code.co_name)

    context = monitor.step if loop_marks else contextlib.nullcontext

    def step() -> None:
        with context():
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    try:
        step()
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        assert monitor._recorder.sampled is (stride == 1)
        assert entered == []
        step()
        assert len(monitor._recorder.buffer) == 3
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)


def test_a_timed_forward_that_raises_closes_its_phase_and_raises(gloo: None) -> None:
    class Failing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)
            self.fail = False

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise ValueError("boom")
            return self.linear(inputs)

    inner = Failing()
    model = DistributedDataParallel(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(1)
    handle = monitor.instrument(model, optimizer)
    recorder = monitor._recorder
    try:
        with monitor.step():
            inner.fail = True
            with pytest.raises(ValueError, match="boom"):
                model(torch.randn(4, 8))
            assert "forward" in recorder._sampled_ns  # closed, as the Python wrapper does
            assert handle._state.forward_depth == 0
            inner.fail = False
            model(torch.randn(4, 8)).sum().backward()  # the next forward is timed again
            optimizer.step()
            optimizer.zero_grad()
        assert monitor.stats.misuse == 0
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)


def test_backward_start_sets_the_state_once_and_never_raises() -> None:
    if _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    from stepwatch.exporters import _fastrecord

    class State:
        def __init__(self) -> None:
            self.enabled = True
            self.in_backward = False
            self.backward_start_ns = 0

    state = State()
    hook = _fastrecord.BackwardStart(state)
    before = time.perf_counter_ns()
    assert hook(torch.ones(1)) is None
    assert state.in_backward is True and before <= state.backward_start_ns
    first = state.backward_start_ns
    hook(None)
    assert state.backward_start_ns == first  # a backward already open keeps its start
    state.in_backward = False
    state.enabled = False
    hook()
    assert state.in_backward is False  # disabled: nothing
    odd = State()
    odd.in_backward = "yes"  # type: ignore[assignment]  # not a bool: left to Python's rules
    _fastrecord.BackwardStart(odd)(1, 2, key=3)
    assert odd.backward_start_ns == 0
    _fastrecord.BackwardStart(object())()  # no __dict__: nothing, no error
