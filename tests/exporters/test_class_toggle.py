"""Auto mode's class swap only on the steps it times (issue 15, ``_forward._ClassSwap``).

The recorder gives an instrumented model its own class at the start of a step whose phases are
not timed and the timing subclass at the start of one whose are
(``_sampling.swap_forward_classes``, in C in ``fastrecord.c``). Real 1-rank gloo DDP, both
recorders; phases and the every-step wait checked against what the steps did.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from stepwatch.exporters import InMemoryExporter, StepMonitor, _recorder
from stepwatch.exporters._sampling import swap_forward_classes


@pytest.fixture(params=["c", "python"])
def recorder_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "c" and _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    if request.param == "python":
        monkeypatch.setattr(_recorder, "FAST_RECORDER", None)
    return str(request.param)


def _monitor(stride: int = 1 << 40) -> StepMonitor:
    """A monitor keeping its windows in memory that times 1 step in ``stride`` (the default:
    nothing sampled unless a test sets the stride to 1)."""
    return StepMonitor(
        job_id="toggle",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        start=False,
        health=False,
        phase_sampling=stride,
    )


def _instrumented() -> tuple[Any, Any, StepMonitor, Any]:
    """A 1-rank DDP model and its optimizer, instrumented by a fresh monitor (and the handle)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor()
    return model, optimizer, monitor, monitor.instrument(model, optimizer)


def _step(monitor: StepMonitor, model: Any, optimizer: Any, micro_batches: int = 1) -> None:
    with monitor.step():
        for _ in range(micro_batches):
            model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _python_frames_of(package: str) -> tuple[list[str], Any]:
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            entered.append(frame.f_code.co_name)

    return entered, profile


def test_an_untimed_step_runs_the_models_own_class(recorder_kind: str, gloo: None) -> None:
    model, optimizer, monitor, handle = _instrumented()
    recorder = monitor._recorder
    timed_class = type(model)
    assert timed_class is not DistributedDataParallel  # installed: the subclass
    assert type(recorder).__name__ == (
        "StepRecorder" if recorder_kind == "python" else "_FastStepRecorder"
    )
    try:
        recorder.sampler.stride = 1
        _step(monitor, model, optimizer)  # timed
        assert type(model) is timed_class
        recorder.sampler.stride = 1 << 40
        for _ in range(3):  # untimed: the model's own class from the step's start
            with monitor.step():
                assert recorder.sampled is False
                assert type(model) is DistributedDataParallel
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        # Between steps a copy or a pickle is of the original class, as during timed steps.
        assert type(copy.deepcopy(model)) is DistributedDataParallel
        recorder.sampler.stride = 1
        with monitor.step():  # timed again: the subclass from the step's start
            assert type(model) is timed_class
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.export_now()
        summary = _summary(monitor)
        assert summary["steps"] == 5
        # Forward and backward rest on the two timed steps, shared out over all five; the
        # exposed wait is on every step, sampled or not.
        assert summary["forward"] == 5 and summary["backward"] == 5
        assert summary["communication"] == 5
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)
    assert type(model) is DistributedDataParallel
    assert recorder.forward_swaps == ()
    with monitor.step():  # removed: nothing swaps the class back
        pass
    assert type(model) is DistributedDataParallel


def _summary(monitor: StepMonitor) -> dict[str, int]:
    from tests.exporters.test_auto import _summary as summarise

    exporter = monitor._transport.exporter
    assert isinstance(exporter, InMemoryExporter)
    summary = summarise(exporter)
    counts = {name: int(entry["count"]) for name, entry in summary["phases"].items()}
    return {"steps": int(summary["steps"]["count"]), **counts}


def test_an_untimed_ddp_step_enters_no_python_frame_of_stepwatch(gloo: None) -> None:
    if _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    model, optimizer, monitor, handle = _instrumented()
    package = str(Path(_recorder.__file__).parent)
    try:
        for _ in range(2):
            _step(monitor, model, optimizer)
        entered, profile = _python_frames_of(package)
        sys.setprofile(profile)
        try:
            _step(monitor, model, optimizer)
        finally:
            sys.setprofile(None)
        assert entered == []
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)


def test_accumulating_gradients_keep_the_subclass_and_every_wait(
    recorder_kind: str, gloo: None
) -> None:
    """Seen on a timed step (two micro-batches), the subclass stays on untimed steps, whose
    forward then ends each micro-batch's wait: two waits per step, as on a timed step."""
    model, optimizer, monitor, handle = _instrumented()
    recorder = monitor._recorder
    timed_class = type(model)
    try:
        recorder.sampler.stride = 1
        _step(monitor, model, optimizer, micro_batches=2)
        recorder.sampler.stride = 1 << 40
        waits: list[int] = []
        for _ in range(2):
            with monitor.step():
                assert recorder.sampled is False and type(model) is timed_class
                model(torch.randn(4, 8)).sum().backward()  # the first wait ends as it
                # returns (the autograd engine's gate), else at the next forward; pending
                # in the C recorder's wait until the step ends
                model(torch.randn(4, 8)).sum().backward()
                pending = getattr(recorder, "_wait_ns", 0)
                waits.append(recorder._phases_ns.get("communication", 0) + pending)
                optimizer.step()  # the second one by here
                optimizer.zero_grad()
        assert all(wait > 0 for wait in waits)
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)
    assert type(model) is DistributedDataParallel


def test_a_skipped_optimizer_step_is_not_taken_for_accumulation(
    recorder_kind: str, gloo: None
) -> None:
    """A backward whose optimizer step was skipped (a gradient scaler on overflow), then the
    next step's forward: not gradients accumulating, so untimed steps still drop the swap."""
    model, optimizer, monitor, handle = _instrumented()
    recorder = monitor._recorder
    try:
        recorder.sampler.stride = 1
        with monitor.step():
            model(torch.randn(4, 8)).sum().backward()  # no optimizer.step()
        _step(monitor, model, optimizer)  # timed: its forward comes after that backward
        recorder.sampler.stride = 1 << 40
        with monitor.step():
            assert type(model) is DistributedDataParallel
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)


def test_swap_forward_classes_leaves_other_classes_alone() -> None:
    class Base:
        pass

    class Timed(Base):
        pass

    class Someone(Base):
        pass

    model, other = Base(), Someone()
    swaps = ((model, Base, Timed), (other, Base, Timed))
    swap_forward_classes(swaps, True)
    assert type(model) is Timed and type(other) is Someone
    swap_forward_classes(swaps, False)
    assert type(model) is Base and type(other) is Someone
    swap_forward_classes(((model, Timed, Timed),), False)  # kept: accumulation seen
    assert type(model) is Base  # only a model of one of the two classes is swapped
    swap_forward_classes(((model, Base, Timed),), True)
    swap_forward_classes(((model, Timed, Timed),), False)
    assert type(model) is Timed


def test_a_refused_class_assignment_leaves_the_class() -> None:
    class Slotted:
        __slots__ = ("a",)

    class Other:  # a different layout: Python refuses the assignment
        __slots__ = ("b", "c")

    model = Slotted()
    swap_forward_classes(((model, Slotted, Other),), True)
    assert type(model) is Slotted


def test_the_c_recorder_swaps_at_each_begin_and_survives_a_refusal() -> None:
    if _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    import logging

    from stepwatch.core._ratelog import RateLimitedLog
    from stepwatch.exporters._recorder import SystemClock
    from stepwatch.exporters._sampling import PhaseSampler

    class Plain:
        pass

    class Timed(Plain):
        pass

    class Slotted:
        __slots__ = ("a",)

    class Other:
        __slots__ = ("b", "c")

    recorder = _recorder.FAST_RECORDER(
        clock=SystemClock(),
        device_timer=None,
        kernel_source=None,
        buffer_steps=8,
        log=RateLimitedLog(logging.getLogger("test-toggle"), 0.0),
        sampler=PhaseSampler(1),
    )
    recorder.watchers = 1
    model, refusing = Plain(), Slotted()
    recorder.forward_swaps = ((refusing, Slotted, Other), (model, Plain, Timed))
    recorder.begin_step(explicit=True)
    assert recorder.sampled is True and type(model) is Timed and type(refusing) is Slotted
    recorder.end_step(explicit=True)
    recorder.sampler = PhaseSampler(1 << 40)
    recorder.begin_step(explicit=True)
    assert recorder.sampled is False and type(model) is Plain
    recorder.end_step(explicit=True)
    assert recorder.steps_recorded == 2 and recorder.misuse_count == 0
    recorder.forward_swaps = "not a tuple"  # ignored, never raises into the step
    recorder.begin_step(explicit=True)
    recorder.end_step(explicit=True)
    assert recorder.steps_recorded == 3
