"""The optimizer hooks' C gates (``_fastrecord.OptimizerGate``, issue 15): a step whose phases
are not timed enters no Python frame in ``optimizer.step()``, and records what the Python hooks
record (the exposed wait since the last gradient, nothing else); anything else is theirs."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._recorder import FAST_RECORDER, SystemClock
from stepwatch.exporters.auto import _auto
from tests.exporters.test_auto import _summary

pytestmark = pytest.mark.skipif(FAST_RECORDER is None, reason="_fastrecord is not built")


def _recorder_and_calls() -> tuple[Any, list[tuple[Any, ...]], Any]:
    assert FAST_RECORDER is not None
    recorder = FAST_RECORDER(
        clock=SystemClock(),
        device_timer=None,
        kernel_source=None,
        buffer_steps=8,
        log=RateLimitedLog(logging.getLogger("test-gate"), 0.0),
    )
    calls: list[tuple[Any, ...]] = []

    def slow(*args: Any) -> str:
        calls.append(args)
        return "slow"

    return recorder, calls, slow


def test_the_pre_gate_records_the_wait_of_an_untimed_step_in_c() -> None:
    from stepwatch.exporters import _fastrecord

    recorder, calls, slow = _recorder_and_calls()
    stamp = _fastrecord.ClockStamp()
    gate = _fastrecord.OptimizerGate("pre", recorder, slow, stamp)
    recorder.sampled = True  # a timed step: the Python hook, with torch's arguments
    assert gate("opt", ("a",), {"k": 1}) == "slow" and calls == [("opt", ("a",), {"k": 1})]
    recorder.sampled = False
    recorder.begin_step(explicit=True)
    assert gate("opt", (), {}) is None and recorder._wait_ns == 0  # no last gradient yet
    stamp(None)
    before = time.perf_counter_ns()
    stamped = stamp.ns
    gate("opt", (), {})
    waited = recorder._wait_ns
    assert before - stamped <= waited <= time.perf_counter_ns() - stamped
    assert stamp.ns == 0 and len(calls) == 1  # reset, as _AutoState._close_wait does
    # Kept in the recorder's struct, not in the phase dict: the hook touches no dict.
    assert recorder._phases_ns == {}
    stamp(None)
    gate("opt", (), {})
    assert recorder._wait_ns > waited  # a second wait in the step adds
    total = recorder._wait_ns
    recorder.add_phase_ns("communication", 7)  # a wait closed elsewhere (a forward) adds too
    recorder.end_step(explicit=True)
    assert recorder.buffer[-1][3] == {"communication": total + 7}  # in the step's phases
    assert recorder._wait_ns == 0 and recorder._phases_ns == {}
    recorder.begin_step(explicit=True)
    recorder.end_step(explicit=True)
    assert recorder.buffer[-1][3] == {}  # and in no later step's


def test_a_wait_that_cannot_be_folded_is_reported_not_raised() -> None:
    from stepwatch.exporters import _fastrecord

    recorder, _, slow = _recorder_and_calls()
    stamp = _fastrecord.ClockStamp()
    gate = _fastrecord.OptimizerGate("pre", recorder, slow, stamp)
    recorder.sampled = False
    recorder.begin_step(explicit=True)
    stamp(None)
    gate("opt", (), {})
    waited = recorder._wait_ns
    assert waited > 0
    phases = recorder._phases_ns
    recorder._phases_ns = ["not", "a", "dict"]  # the fold into it fails
    recorder.end_step(explicit=True)  # does not raise into the loop
    assert recorder.misuse_count == 1 and recorder._wait_ns == waited  # kept for later
    recorder._phases_ns = phases
    recorder.begin_step(explicit=True)
    recorder.end_step(explicit=True)
    assert recorder.buffer[-1][3] == {"communication": waited} and recorder._wait_ns == 0


def test_the_count_of_open_calls_is_kept_in_the_pre_gate() -> None:
    from stepwatch.exporters import _fastrecord

    recorder, calls, slow = _recorder_and_calls()
    stamp = _fastrecord.ClockStamp()
    pre = _fastrecord.OptimizerGate("pre", recorder, slow, stamp)
    post = _fastrecord.OptimizerGate("post", recorder, slow, [], None, None, pre)
    assert post.partner is pre and pre.partner is None and pre.calls == 0
    recorder.sampled, recorder.explicit_steps = False, True
    pre("opt", (), {})
    assert pre.calls == 1
    post("opt", (), {})
    assert pre.calls == 0
    pre.calls = 3  # nested calls open: a post-hook closes one and does nothing else
    recorder.sampled = True
    assert post("opt", (), {}) is None and pre.calls == 2 and calls == []
    with pytest.raises(TypeError):
        _fastrecord.OptimizerGate("post", recorder, slow, [], None, None, post)  # not a pre
    with pytest.raises(TypeError):
        _fastrecord.OptimizerGate("pre", recorder, slow, stamp, None, None, pre)


def test_the_post_gate_passes_all_but_a_plain_untimed_step() -> None:
    from stepwatch.exporters import _fastrecord

    recorder, calls, slow = _recorder_and_calls()
    issued: list[int] = []
    gate = _fastrecord.OptimizerGate("post", recorder, slow, issued)
    recorder.sampled, recorder.explicit_steps = False, True
    assert gate("opt", (), {}) is None and calls == []
    issued.append(5)  # a timed collective this step: the hook records it
    gate("opt", (), {})
    issued.clear()
    recorder.explicit_steps = False  # auto steps: the hook marks the step boundary
    gate("opt", (), {})
    recorder.explicit_steps, recorder.sampled = True, True
    gate("opt", (), {})
    assert len(calls) == 3


def test_an_inactive_or_copied_gate_does_nothing() -> None:
    from stepwatch.exporters import _fastrecord

    recorder, calls, slow = _recorder_and_calls()
    stamp = _fastrecord.ClockStamp()
    gate = _fastrecord.OptimizerGate("pre", recorder, slow, stamp)
    recorder.sampled = True
    for inert in (copy.deepcopy(gate), copy.copy(gate)):
        assert inert("opt", (), {}) is None
    gate.active = False
    assert gate("opt", (), {}) is None and calls == []
    with pytest.raises(TypeError):
        _fastrecord.OptimizerGate("pre", recorder, slow, [])  # a pre gate needs the stamp
    with pytest.raises(TypeError):
        _fastrecord.OptimizerGate("post", recorder, slow, stamp)
    with pytest.raises(ValueError):
        _fastrecord.OptimizerGate("middle", recorder, slow, stamp)


def _job(tmp_path: Path, steps: int, *, gates: bool, monkeypatch: Any) -> tuple[Any, Any]:
    if not gates:
        monkeypatch.setattr(
            _auto, "gates", lambda state, _: (state.optimizer_pre, state.optimizer_post)
        )
    exporter = InMemoryExporter()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(8, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = StepMonitor(
            job_id="gate",
            rank=0,
            world_size=1,
            exporter=exporter,
            start=False,
            health=False,
            phase_sampling=1 << 40,  # no step timed after the first
        )
        handle = monitor.instrument(model, optimizer)
        kinds = [type(hook).__name__ for hook in optimizer._optimizer_step_pre_hooks.values()]
        for _ in range(steps):
            with monitor.step():
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        monitor.export_now()
        handle.remove()
        with monitor.step():  # removed: the gates are off, no wait is recorded
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        copied = copy.deepcopy(optimizer)  # an instrumented optimizer's copy is not
        copied.step()
        monitor.close(timeout_s=1.0)
    finally:
        dist.destroy_process_group()
    return exporter, kinds


@pytest.mark.parametrize("gates", [True, False])
def test_a_ddp_job_records_the_wait_on_every_step_with_or_without_gates(
    tmp_path: Path, monkeypatch: Any, gates: bool
) -> None:
    exporter, kinds = _job(tmp_path, 12, gates=gates, monkeypatch=monkeypatch)
    assert kinds == (["OptimizerGate"] if gates else ["method"])
    summary = _summary(exporter)
    assert summary["steps"]["count"] == 13
    # The wait on each of the 12 instrumented steps, none on the step after removal.
    assert summary["phases"]["communication"]["count"] == 12
    assert summary["phases"]["communication"]["sum"] > 0


def test_the_forward_gate_keeps_the_signature_and_the_untimed_path_in_c(
    tmp_path: Path, tensor_hooks: None
) -> None:
    """The class swap's ``forward`` is a C gate (``_fastrecord.ForwardGate``) where the
    recorder and stamp are C: an untimed step calls the original forward directly; a last
    gradient already come (gradients accumulate) still ends its wait at the next forward.
    (Without the autograd engine's gate, which ends each wait as its backward returns:
    test_wait_at_engine.py.)"""
    import inspect

    from stepwatch.exporters import _fastrecord

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(8, 4))
        original_signature = inspect.signature(model.forward)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = StepMonitor(
            job_id="gate",
            rank=0,
            world_size=1,
            exporter=InMemoryExporter(),
            start=False,
            health=False,
            phase_sampling=1 << 40,
        )
        handle = monitor.instrument(model, optimizer)
        gate = vars(type(model))["forward"]
        assert type(gate) is _fastrecord.ForwardGate
        assert inspect.signature(model.forward) == original_signature
        assert model.forward.__wrapped__ is DistributedDataParallel.forward
        timed_class = type(model)
        recorder, stamp = monitor._recorder, handle._state.gradient_stamp
        recorder.sampler.stride = 1
        with monitor.step():  # step 0 is timed, two micro-batches
            assert recorder.sampled is True
            model(torch.randn(4, 8)).sum().backward()
            model(torch.randn(4, 8)).sum().backward()  # gradients accumulate: the swap stays
            optimizer.step()
            optimizer.zero_grad()
        recorder.sampler.stride = 1 << 40
        with monitor.step():  # untimed, two micro-batches
            assert recorder.sampled is False
            assert type(model) is timed_class
            model(torch.randn(4, 8)).sum().backward()
            assert stamp.ns > 0  # the first micro-batch's last gradient
            model(torch.randn(4, 8)).sum().backward()  # its wait ends at this forward
            first_wait = recorder._phases_ns["communication"]
            assert first_wait > 0
            optimizer.step()  # the second's: in the recorder's struct until the step ends
            assert recorder._phases_ns["communication"] == first_wait
            second_wait = recorder._wait_ns
            assert second_wait > 0
            optimizer.zero_grad()
        assert recorder.buffer[-1][3]["communication"] == first_wait + second_wait
        other = DistributedDataParallel(torch.nn.Linear(8, 4))
        object.__setattr__(other, "__class__", timed_class)  # another instance: plain forward
        assert other(torch.randn(2, 8)).shape == (2, 4)
        handle.remove()
        assert type(model) is DistributedDataParallel
        monitor.close(timeout_s=1.0)
    finally:
        dist.destroy_process_group()
