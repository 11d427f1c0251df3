"""Auto mode on a device timer with its hooks in C (issue 15): ``OptimizerGate``,
``ForwardGate.time_in_c`` and ``BackwardStart`` take ``DeviceAutoState``'s marks themselves.

The device is virtual (a counter that work advances while the host clock, the real one here,
barely moves), so every device phase has a known length in device nanoseconds, whatever the
host does. Three paths must agree to the nanosecond and in the marks they take: everything in
C, the C recorder with the Python hooks (as before this round), and pure Python (no
extension). With the extension a device-timed DDP step must enter no Python frame of
stepwatch's, timed or not.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from stepwatch.exporters import InMemoryExporter, StepMonitor, _recorder
from stepwatch.exporters.auto import _auto, _forward
from stepwatch.exporters.auto._auto_device import DeviceAutoState
from tests.exporters import test_auto_device as auto_device
from tests.exporters.test_auto import _summary

# Device time of each piece, per step (distinct primes: a sum names its pieces).
DATA_NS, FORWARD_NS, BACKWARD_NS, WAIT_NS, OPTIMIZER_NS = 3_001, 7_013, 11_027, 5_009, 2_003


class VirtualDevice(auto_device.VirtualDevice):
    """``test_auto_device``'s virtual device, advanced by work alone (the host clock is the
    real one here), whose marks can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    def run(self, device_ns: int, clock: Any = None) -> None:
        self.now_ns += device_ns

    def mark(self) -> int:
        if self.failing:
            raise RuntimeError("the device is gone")
        return super().mark()


class _Model(torch.nn.Module):
    def __init__(self, device: VirtualDevice) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.device = device

    def forward(self, inputs: torch.Tensor) -> Any:
        self.device.run(FORWARD_NS)
        return self.layers(inputs)


def _use_path(path: str, monkeypatch: Any) -> None:
    if path != "python" and _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    if path == "python":
        monkeypatch.setattr(_recorder, "FAST_RECORDER", None)
    elif path == "python-hooks":  # the C recorder, the hooks in Python (the previous round)
        monkeypatch.setattr(_auto, "hooks_in_c", lambda state: (False, None))
        monkeypatch.setattr(_forward, "hooks_in_c", lambda state: (False, None))


def _job(
    steps: int, sampling: int, loop_marks: bool, device: VirtualDevice
) -> tuple[StepMonitor, Any, Any, list[bool]]:
    """A 1-rank DDP job on ``device``, instrumented; returns the monitor, its handle, a
    function running one step (the caller's process group) and whether each step was timed."""
    model = _Model(device)
    first = model.layers[0].weight  # autograd's last gradient: where DDP's wait starts
    first.register_post_accumulate_grad_hook(lambda _: device.run(BACKWARD_NS))  # in backward
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    optimizer.register_step_post_hook(lambda *_: device.run(OPTIMIZER_NS))
    monitor = StepMonitor(
        job_id="device-c",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        device_timer=device,
        phase_sampling=sampling,
        start=False,
        health=False,
    )
    handle = monitor.instrument(ddp, optimizer)
    # After instrument(): after the last gradient's stamp, i.e. the exposed wait.
    first.register_post_accumulate_grad_hook(lambda _: device.run(WAIT_NS))
    generator = torch.Generator().manual_seed(1)
    context = monitor.step if loop_marks else contextlib.nullcontext
    timed: list[bool] = []

    def step() -> None:
        with context():
            device.run(DATA_NS)  # e.g. the batch's copy to the device
            optimizer.zero_grad(set_to_none=True)
            loss = ddp(torch.randn(4, 8, generator=generator)).pow(2).mean()
            timed.append(monitor._recorder.sampled)  # this step's (auto: opened by now)
            loss.backward()
            optimizer.step()

    return monitor, handle, step, timed


@pytest.mark.parametrize("sampling", [1, 4], ids=["every step", "1 in 4"])
@pytest.mark.parametrize("loop_marks", [True, False], ids=["step()", "auto steps"])
@pytest.mark.parametrize("path", ["c", "python-hooks", "python"])
def test_device_phases_are_exact_on_every_path(
    path: str, loop_marks: bool, sampling: int, gloo: None, monkeypatch: Any
) -> None:
    _use_path(path, monkeypatch)
    steps, device = 24, VirtualDevice()
    monitor, handle, step, timed = _job(steps, sampling, loop_marks, device)
    state = handle._state
    assert isinstance(state, DeviceAutoState)
    assert bool(state.gates) is (path == "c")  # the optimizer's C gates
    for _ in range(steps):
        step()
    handle.remove()
    monitor.close()
    assert monitor.stats.misuse == 0
    phases = {
        name: round(entry["sum"] * 1e9)
        for name, entry in _summary(
            monitor._transport.exporter  # type: ignore[arg-type]
        )["phases"].items()
    }
    expected = {
        "forward": steps * FORWARD_NS,
        # backward ends when loss.backward() returns: DDP's wait is inside it
        "backward": steps * (BACKWARD_NS + WAIT_NS),
        "communication": steps * WAIT_NS,
        "optimizer": steps * OPTIMIZER_NS,
    }
    if not loop_marks:  # the first step starts at its first forward: no data phase
        expected["data"] = (steps - 1) * DATA_NS
    if sampling == 1 or loop_marks:
        assert phases == expected
    else:  # auto steps at 1 in 4: the data phase of the sampled steps stands for the rest
        assert {k: v for k, v in phases.items() if k != "data"} == {
            k: v for k, v in expected.items() if k != "data"
        }
        assert phases["data"] == steps * DATA_NS
    # Marks: each step's start, end, wait start and end; a timed step 4 more. An auto step
    # starts at the previous one's end mark (the first at a mark of its own).
    assert 0 < sum(timed) <= (steps if sampling == 1 else steps // 2)
    assert device.marks == 4 * sum(timed) + (4 * steps if loop_marks else 3 * steps + 1)


@pytest.mark.parametrize("loop_marks", [True, False], ids=["step()", "auto steps"])
@pytest.mark.parametrize("stride", [1, 1 << 40], ids=["timed", "untimed"])
def test_a_device_timed_ddp_step_enters_no_python_frame_of_stepwatch(
    loop_marks: bool, stride: int, gloo: None
) -> None:
    if _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    device = VirtualDevice()
    monitor, handle, step, _ = _job(3, stride, loop_marks, device)
    package = str(Path(_recorder.__file__).parent)
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            entered.append(frame.f_code.co_name)

    try:
        step()
        before = device.marks
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        assert monitor._recorder.sampled is (stride == 1)
        assert entered == []
        # 4 a step, 4 more when timed; an auto step's start is the last one's end mark
        assert device.marks - before == (8 if stride == 1 else 4) - (0 if loop_marks else 1)
        step()
        assert len(monitor._recorder.buffer) == 3
        assert monitor.stats.misuse == 0
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_device_that_fails_never_raises_into_the_step_and_the_host_time_stays(
    path: str, gloo: None, monkeypatch: Any
) -> None:
    _use_path(path, monkeypatch)
    device = VirtualDevice()
    monitor, handle, step, _ = _job(9, 1, True, device)
    try:
        for index in range(9):
            device.failing = 3 <= index < 6  # three steps with a device that cannot mark
            step()
        handle.remove()
        monitor.close()
        assert monitor.stats.misuse > 0  # said, not raised
        summary = _summary(monitor._transport.exporter)  # type: ignore[arg-type]
        assert summary["steps"]["count"] == 9
        phases = summary["phases"]
        for name in ("forward", "backward", "communication", "optimizer"):
            assert phases[name]["count"] == 9, name  # host time where the device had none
        # The steps whose marks all came read the device's time; the others the host's.
        assert phases["forward"]["sum"] >= 6 * FORWARD_NS * 1e-9
    finally:
        device.failing = False
        monitor.close(timeout_s=1.0)


def test_backward_start_takes_the_backward_mark_or_reports_its_failure() -> None:
    if _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    from stepwatch.exporters import _fastrecord

    class Recorder:
        def __init__(self) -> None:
            self.reported: list[str] = []

        def misuse(self, key: str, message: str, *args: object, exc_info: Any = False) -> None:
            self.reported.append(key)

    class State:
        def __init__(self) -> None:
            self.enabled = True
            self.in_backward = False
            self.backward_start_ns = 0
            self.backward_mark: Any = None
            self.recorder = Recorder()

    device = VirtualDevice()
    device.run(42)
    state = State()
    _fastrecord.BackwardStart(state, device)(torch.ones(1))
    assert (state.in_backward, state.backward_mark, device.marks) == (True, 42, 1)
    _fastrecord.BackwardStart(state, device)(None)  # already open: no second mark
    assert device.marks == 1
    device.failing = True
    failing = State()
    _fastrecord.BackwardStart(failing, device)()
    assert failing.in_backward is True and failing.backward_mark is None
    assert failing.recorder.reported == ["device-mark"]
