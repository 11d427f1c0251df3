"""The optimizer's post gate out of torch's post-hook loop on untimed steps (issue 15, cold
memory): where the loop marks its steps and the post-hook dict holds the post gate alone, the
pre gate of a step whose phases are not timed installs an empty stand-in for the dict, and the
first step that needs the post gate puts the dict back. Nothing a step records changes; hooks
registered meanwhile, nested ``step()`` calls and removal keep working."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._recorder import FAST_RECORDER, UNSAMPLED
from stepwatch.exporters._sampling import PhaseSampler

pytestmark = pytest.mark.skipif(FAST_RECORDER is None, reason="_fastrecord is not built")

UNTIMED, TIMED = PhaseSampler(1 << 62), PhaseSampler(1)


class _Outer(torch.optim.SGD):
    """SGD whose ``step`` calls its parent's: the hooks run nested once SGD is hooked too."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(0.002)
        return super().step(closure)


def _job(optimizer_type: type = torch.optim.SGD) -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = optimizer_type(model.parameters(), lr=0.01)
    monitor = StepMonitor(
        job_id="hidden-post",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        start=False,
        health=False,
    )
    handle = monitor.instrument(model, optimizer)
    ((pre,),) = [list(optimizer._optimizer_step_pre_hooks.values())]
    return monitor, model, optimizer, (handle, pre)


def _step(monitor: Any, model: Any, optimizer: Any, sampler: Any, *, explicit: bool = True) -> None:
    monitor._recorder.sampler = sampler
    if explicit:
        with monitor.step():
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _optimizer_phases(monitor: Any) -> list[bool]:
    """Per buffered step: whether its auto-mode phases hold the optimizer (a timed step)."""
    records = list(monitor._recorder.buffer)
    return [record[5] is not UNSAMPLED and "optimizer" in record[5] for record in records]


def test_an_untimed_step_hides_the_post_gate_and_a_timed_one_brings_it_back() -> None:
    monitor, model, optimizer, (_, pre) = _job()
    real = optimizer._optimizer_step_post_hooks
    (post,) = real.values()
    seen = []
    for sampler in (UNTIMED, UNTIMED, TIMED, UNTIMED, TIMED, TIMED, UNTIMED):
        _step(monitor, model, optimizer, sampler)
        hooks = optimizer._optimizer_step_post_hooks
        seen.append((pre.post_hidden, hooks is real, len(hooks)))
    assert seen == [
        (True, False, 0),  # the stand-in: empty, the same type
        (True, False, 0),
        (False, True, 1),  # the dict back, with the post gate
        (True, False, 0),
        (False, True, 1),
        (False, True, 1),
        (True, False, 0),
    ]
    assert type(optimizer._optimizer_step_post_hooks) is type(real)
    assert list(real.values()) == [post]
    # Each timed step has its optimizer phase (the post gate closed it), no untimed one does.
    assert _optimizer_phases(monitor) == [False, False, True, False, True, True, False]
    assert pre.calls == 0
    monitor.close(timeout_s=1.0)


def test_nested_step_calls_are_counted_across_hidden_and_timed_steps() -> None:
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD.step hooked too
    monitor, model, optimizer, (_, pre) = _job(_Outer)
    samplers = (UNTIMED, TIMED, UNTIMED, UNTIMED, TIMED)
    for sampler in samplers:
        _step(monitor, model, optimizer, sampler)
        assert pre.calls == 0  # every call closed (or none counted while hidden)
    assert _optimizer_phases(monitor) == [s is TIMED for s in samplers]
    optimizer_ns = [record[5]["optimizer"] for record in monitor._recorder.buffer if record[5]]
    assert all(ns >= 0.002 * 1e9 for ns in optimizer_ns)  # the whole outer call, once
    monitor.close(timeout_s=1.0)


def test_a_post_hook_registered_while_hidden_runs_and_its_handle_removes_it() -> None:
    monitor, model, optimizer, (_, pre) = _job()
    (post,) = optimizer._optimizer_step_post_hooks.values()
    _step(monitor, model, optimizer, UNTIMED)
    assert pre.post_hidden
    calls: list[int] = []
    user = optimizer.register_step_post_hook(lambda *args: calls.append(1))
    _step(monitor, model, optimizer, UNTIMED)  # the stand-in holds the user's hook: it runs
    _step(monitor, model, optimizer, TIMED)  # the stand-in kept, the post gate first in it
    hooks = optimizer._optimizer_step_post_hooks
    assert next(iter(hooks.values())) is post and len(hooks) == 2 and len(calls) == 2
    _step(monitor, model, optimizer, UNTIMED)  # hiding has stopped: both hooks run
    assert not pre.post_hidden and len(calls) == 3
    user.remove()
    assert list(optimizer._optimizer_step_post_hooks.values()) == [post]
    _step(monitor, model, optimizer, TIMED)
    assert len(calls) == 3
    assert _optimizer_phases(monitor) == [False, False, True, False, True]
    monitor.close(timeout_s=1.0)


def test_a_post_hook_of_the_user_keeps_the_gate_in_the_loop() -> None:
    monitor, model, optimizer, (_, pre) = _job()
    calls: list[int] = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    real = optimizer._optimizer_step_post_hooks
    for sampler in (UNTIMED, TIMED, UNTIMED):
        _step(monitor, model, optimizer, sampler)
        assert not pre.post_hidden and optimizer._optimizer_step_post_hooks is real
    assert len(calls) == 3
    monitor.close(timeout_s=1.0)


def test_removal_while_hidden_puts_the_dict_back() -> None:
    monitor, model, optimizer, (handle, pre) = _job()
    real = optimizer._optimizer_step_post_hooks
    _step(monitor, model, optimizer, UNTIMED)
    assert pre.post_hidden and optimizer._optimizer_step_post_hooks is not real
    handle.remove()
    assert optimizer._optimizer_step_post_hooks is real and len(real) == 0
    assert not pre.post_hidden and len(optimizer._optimizer_step_pre_hooks) == 0
    _step(monitor, model, optimizer, UNTIMED)  # plain from now on
    assert optimizer._optimizer_step_post_hooks is real
    monitor.close(timeout_s=1.0)


def test_auto_steps_and_a_second_optimizer_keep_the_post_gate() -> None:
    monitor, model, optimizer, (_, pre) = _job()
    real = optimizer._optimizer_step_post_hooks
    for _ in range(4):  # no monitor.step(): the post gate marks each step's boundary
        _step(monitor, model, optimizer, UNTIMED, explicit=False)
        assert not pre.post_hidden and optimizer._optimizer_step_post_hooks is real
    assert monitor._recorder.steps_recorded >= 3
    monitor.close(timeout_s=1.0)

    monitor, model, optimizer, (_, pre) = _job()
    real = optimizer._optimizer_step_post_hooks
    _step(monitor, model, optimizer, UNTIMED)
    assert pre.post_hidden
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    pre(other, (), {})  # the same gate called for another optimizer: hiding given up
    monitor._recorder.sampler = TIMED
    with monitor.step():
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    assert optimizer._optimizer_step_post_hooks is real and not pre.post_hidden
    _step(monitor, model, optimizer, UNTIMED)
    assert optimizer._optimizer_step_post_hooks is real and not pre.post_hidden
    monitor.close(timeout_s=1.0)
