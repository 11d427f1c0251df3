"""The exposed wait ends when the backward returns, at the autograd engine's gate, and an untimed
step's optimizer pre gate leaves torch's loop (issue 15; ``enginegate.h``, ``fastrecord.c``).

Real 1-rank gloo DDP (the last-gradient stamp is registered on DDP models only). The wait runs
from the model's last gradient to the end of ``loss.backward()`` (DDP waits there for its
allreduces); what the loop does between ``backward()`` and ``optimizer.step()`` (gradient
clipping, say) is not waiting for the peers. Where the gate is not installed (the tensor-hook
fallback) the optimizer's pre gate ends the wait, as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._recorder import FAST_RECORDER, UNSAMPLED
from stepwatch.exporters._sampling import PhaseSampler

# The C gates' own behaviour (the pre gate out of torch's loop); the end of the wait itself is
# the same without them (_engine_gate.PythonEngineGate): that test runs either way.
needs_c = pytest.mark.skipif(FAST_RECORDER is None, reason="_fastrecord is not built")

UNTIMED, TIMED = PhaseSampler(1 << 62), PhaseSampler(1)
AFTER_BACKWARD_S = 0.03  # the loop's own work between backward() and step()


@pytest.fixture
def job(gloo: None) -> Iterator[tuple[StepMonitor, Any, Any, Any]]:
    """A 1-rank DDP model and its optimizer, instrumented: (monitor, model, optimizer, handle);
    the hooks removed and the monitor closed after the test."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = StepMonitor(
        job_id="wait-at-engine",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        start=False,
        health=False,
    )
    handle = monitor.instrument(model, optimizer)
    try:
        yield monitor, model, optimizer, handle
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)


def _step(
    monitor: StepMonitor, model: Any, optimizer: Any, sampler: Any, *, pause_s: float = 0.0
) -> None:
    monitor._recorder.sampler = sampler
    with monitor.step():
        model(torch.randn(4, 8)).sum().backward()
        if pause_s:
            time.sleep(pause_s)  # clipping, unscaling, logging: not a wait for the peers
        optimizer.step()
        optimizer.zero_grad()


def _records(monitor: StepMonitor) -> list[tuple[int, bool]]:
    """Per buffered step: its exposed wait (ns) and whether its auto phases were timed."""
    out = []
    for record in monitor._recorder.buffer:
        timed = record[5] is not UNSAMPLED and "optimizer" in record[5]
        out.append((record[3].get("communication", 0), timed))
    return out


def test_the_wait_ends_when_backward_returns_on_every_step(job: Any) -> None:
    monitor, model, optimizer, handle = job
    engine = handle._state.engine
    assert engine is not None and engine.closing >= 1
    closing, closed = engine.closing, engine.closed
    samplers = (TIMED, UNTIMED, UNTIMED, TIMED, UNTIMED)
    for sampler in samplers:
        _step(monitor, model, optimizer, sampler, pause_s=AFTER_BACKWARD_S)
    records = _records(monitor)
    assert [timed for _, timed in records] == [s is TIMED for s in samplers]
    assert all(0 < wait < AFTER_BACKWARD_S * 1e9 / 2 for wait, _ in records), records
    assert engine.closed == closed + len(samplers)
    phases = [record[5] for record in monitor._recorder.buffer if record[5] is not UNSAMPLED]
    # A timed step's backward still runs to the optimizer: the pause is in it.
    assert all(p["backward"] >= AFTER_BACKWARD_S * 1e9 for p in phases)
    handle.remove()
    assert engine.closing == closing - 1


@needs_c
def test_without_the_engine_gate_the_optimizer_ends_the_wait(tensor_hooks: None, job: Any) -> None:
    monitor, model, optimizer, handle = job
    assert handle._state.engine is None
    (pre,) = optimizer._optimizer_step_pre_hooks.values()
    for sampler in (UNTIMED, TIMED, UNTIMED):
        _step(monitor, model, optimizer, sampler, pause_s=AFTER_BACKWARD_S)
        assert not pre.pre_hidden
    assert all(wait >= AFTER_BACKWARD_S * 1e9 for wait, _ in _records(monitor))


@needs_c
def test_an_untimed_step_takes_the_pre_gate_out_and_a_timed_one_puts_it_back(job: Any) -> None:
    monitor, model, optimizer, _handle = job
    real = optimizer._optimizer_step_pre_hooks
    (pre,) = real.values()
    samplers = (UNTIMED, UNTIMED, UNTIMED, TIMED, UNTIMED, TIMED, TIMED, UNTIMED)
    seen = []
    for sampler in samplers:
        _step(monitor, model, optimizer, sampler)
        hooks = optimizer._optimizer_step_pre_hooks
        seen.append((pre.pre_hidden, pre.post_hidden, hooks is real, len(hooks)))
    assert seen == [
        (True, True, False, 0),  # the first untimed step's pre gate leaves after its call
        (True, True, False, 0),  # not called: the stand-in is empty
        (True, True, False, 0),
        (False, False, True, 1),  # a timed step's begin put the dict back: the gate ran
        (True, True, False, 0),
        (False, False, True, 1),
        (False, False, True, 1),
        (True, True, False, 0),
    ]
    assert type(optimizer._optimizer_step_pre_hooks) is type(real)
    records = _records(monitor)
    assert [timed for _, timed in records] == [s is TIMED for s in samplers]
    assert all(wait > 0 for wait, _ in records)  # every step's wait, the gate out or not
    assert pre.calls == 0


@needs_c
def test_a_pre_hook_registered_while_out_runs_and_keeps_the_gate_in(job: Any) -> None:
    monitor, model, optimizer, _handle = job
    (pre,) = optimizer._optimizer_step_pre_hooks.values()
    calls: list[int] = []
    _step(monitor, model, optimizer, UNTIMED)
    assert pre.pre_hidden
    user = optimizer.register_step_pre_hook(lambda *args: calls.append(1))
    _step(monitor, model, optimizer, UNTIMED)  # the stand-in holds the user's hook
    assert len(calls) == 1
    _step(monitor, model, optimizer, TIMED)  # the stand-in kept, the gate first in it
    hooks = optimizer._optimizer_step_pre_hooks
    assert next(iter(hooks.values())) is pre and len(hooks) == 2 and len(calls) == 2
    _step(monitor, model, optimizer, UNTIMED)  # hiding has stopped: both run
    assert not pre.pre_hidden and len(calls) == 3
    user.remove()
    assert list(optimizer._optimizer_step_pre_hooks.values()) == [pre]
    _step(monitor, model, optimizer, TIMED)
    assert len(calls) == 3
    assert [timed for _, timed in _records(monitor)] == [False, False, True, False, True]


@needs_c
def test_removal_while_the_pre_gate_is_out_puts_the_dict_back(job: Any) -> None:
    monitor, model, optimizer, handle = job
    real = optimizer._optimizer_step_pre_hooks
    (pre,) = real.values()
    engine = handle._state.engine
    closing = engine.closing
    _step(monitor, model, optimizer, UNTIMED)
    assert pre.pre_hidden and optimizer._optimizer_step_pre_hooks is not real
    handle.remove()
    assert optimizer._optimizer_step_pre_hooks is real and len(real) == 0
    assert not pre.pre_hidden and engine.closing == closing - 1
    _step(monitor, model, optimizer, UNTIMED)  # plain from now on
    assert optimizer._optimizer_step_pre_hooks is real


@needs_c
def test_a_wait_the_engine_did_not_end_is_dropped_and_the_gate_stays_in(job: Any) -> None:
    """A last gradient whose backward did not pass the engine's gate (someone else's engine,
    a backward from C++) while the pre gate is out: the next timed step's begin drops that
    wait instead of counting it up to its optimizer, and the gate stays in torch's loop."""
    monitor, model, optimizer, handle = job
    (pre,) = optimizer._optimizer_step_pre_hooks.values()
    stamp = handle._state.gradient_stamp
    _step(monitor, model, optimizer, UNTIMED)
    assert pre.pre_hidden
    stamp.ns = time.monotonic_ns() - 5 * 10**9  # a last gradient 5 s ago, never ended
    _step(monitor, model, optimizer, TIMED)
    assert stamp.ns == 0 and not pre.pre_hidden
    for _ in range(2):
        _step(monitor, model, optimizer, UNTIMED)
        assert not pre.pre_hidden  # from now on the pre gate ends what is left
    waits = [wait for wait, _ in _records(monitor)]
    assert len(waits) == 4 and all(0 < wait < 10**9 for wait in waits), waits


@needs_c
def test_auto_steps_keep_the_pre_gate_in(job: Any) -> None:
    """Without ``monitor.step()`` the optimizer's hooks mark each step's boundary."""
    monitor, model, optimizer, _handle = job
    real = optimizer._optimizer_step_pre_hooks
    (pre,) = real.values()
    monitor._recorder.sampler = UNTIMED
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert not pre.pre_hidden and optimizer._optimizer_step_pre_hooks is real
    assert monitor._recorder.steps_recorded >= 3
