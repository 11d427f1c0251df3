"""Auto mode with a device timer: every phase is the device's time, not the host's.

The device here is virtual (a counter the model and its hooks advance, as kernels would make a
GPU busy while the host only launches them), so each phase's device time differs from its host
time by design: a phase read from the host clock fails the assertions. The same code ran on an
H100 (bench/gpu_check.py; docs/history/exporters.md, "Auto mode on a GPU: phases on the device").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._recorder import _device_seconds
from stepwatch.exporters.auto._auto_device import DeviceAutoState, DeviceStamp
from tests.exporters.test_auto import ManualClock, _summary

HOST_NS = 1_000  # what the host spends in each piece of work: launching it
# Device time of each piece, per step (distinct primes: a sum names its pieces).
DATA_NS, FORWARD_NS, BACKWARD_NS, WAIT_NS, OPTIMIZER_NS = 3_001, 7_013, 11_027, 5_009, 2_003


class VirtualDevice:
    """A DeviceTimer over a device clock that work advances (marks are its readings)."""

    def __init__(self) -> None:
        self.now_ns = 0
        self.marks = 0

    def run(self, device_ns: int, clock: ManualClock) -> None:
        """Work that keeps the device busy ``device_ns`` while the host launches it."""
        self.now_ns += device_ns
        clock.advance_ns(HOST_NS)

    def mark(self) -> int:
        self.marks += 1
        return self.now_ns

    def ready(self, mark: int) -> bool:
        return True

    def elapsed_s(self, start: int, end: int) -> float:
        return (end - start) * 1e-9


class _DeviceModel(torch.nn.Module):
    def __init__(self, device: VirtualDevice, clock: ManualClock) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.device, self.clock = device, clock

    def forward(self, inputs: torch.Tensor) -> Any:
        self.device.run(FORWARD_NS, self.clock)
        return self.layers(inputs)


def _run(tmp_path: Path, *, steps: int, sampling: int) -> tuple[dict[str, Any], StepMonitor, int]:
    device = VirtualDevice()
    exporter, monitor = device_job(tmp_path, device, steps=steps, sampling=sampling)
    return _summary(exporter), monitor, device.marks


def device_job(
    tmp_path: Path,
    device: VirtualDevice,
    *,
    steps: int,
    sampling: int,
    export_every: int = 0,
    uneven: bool = False,
) -> tuple[InMemoryExporter, StepMonitor]:
    """A 1-rank DDP job on ``device`` (auto mode): its windows, exported every
    ``export_every`` steps (0: at close), and its monitor. ``uneven``: the data's device time
    varies from step to step."""
    clock, exporter = ManualClock(), InMemoryExporter()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _DeviceModel(device, clock)
        first = model.layers[0].weight  # autograd's last gradient: where DDP's wait starts
        # Before instrument(): inside backward. After it (below): after the last gradient's
        # stamp, i.e. the exposed wait for the allreduce.
        first.register_post_accumulate_grad_hook(lambda _: device.run(BACKWARD_NS, clock))
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        optimizer.register_step_post_hook(lambda *_: device.run(OPTIMIZER_NS, clock))
        monitor = StepMonitor(
            job_id="device",
            rank=0,
            world_size=1,
            exporter=exporter,
            clock=clock,
            device_timer=device,
            phase_sampling=sampling,
            start=False,
        )
        monitor.instrument(ddp, optimizer)
        first.register_post_accumulate_grad_hook(lambda _: device.run(WAIT_NS, clock))
        generator = torch.Generator().manual_seed(1)
        for step in range(steps):
            device.run(DATA_NS + (step % 7 if uneven else 0), clock)  # e.g. the batch's copy
            optimizer.zero_grad(set_to_none=True)
            ddp(torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            if export_every and step % export_every == export_every - 1:
                monitor.export_now()
        monitor.close()
    finally:
        dist.destroy_process_group()
    return exporter, monitor


def test_every_auto_phase_is_the_devices_time(tmp_path: Path) -> None:
    steps = 6
    summary, monitor, _ = _run(tmp_path, steps=steps, sampling=1)
    assert isinstance(monitor._instrumentations[0]._state, DeviceAutoState)
    assert monitor.stats.misuse == 0
    phases = summary["phases"]
    expected = {
        "forward": steps * FORWARD_NS,
        # backward ends when loss.backward() returns: DDP's wait is inside it, as on the host
        "backward": steps * (BACKWARD_NS + WAIT_NS),
        "communication": steps * WAIT_NS,
        "optimizer": steps * OPTIMIZER_NS,
        "data": (steps - 1) * DATA_NS,  # the first step starts at its first forward
    }
    assert {name: round(entry["sum"] * 1e9) for name, entry in phases.items()} == expected
    assert {name: entry["count"] for name, entry in phases.items()} == {
        "forward": steps,
        "backward": steps,
        "communication": steps,
        "optimizer": steps,
        "data": steps - 1,
    }
    # Steps tile the device's time from the first step's start (its forward) on.
    per_step = DATA_NS + FORWARD_NS + BACKWARD_NS + WAIT_NS + OPTIMIZER_NS
    assert round(summary["steps"]["sum"] * 1e9) == steps * per_step - DATA_NS


def test_sampled_steps_time_phases_on_the_device_and_every_step_its_wait(
    tmp_path: Path,
) -> None:
    steps = 24
    summary, monitor, marks = _run(tmp_path, steps=steps, sampling=4)
    assert monitor.stats.misuse == 0
    phases = summary["phases"]
    # The wait is timed on every step, on the device.
    assert phases["communication"]["count"] == steps
    assert round(phases["communication"]["sum"] * 1e9) == steps * WAIT_NS
    # The other phases on the sampled steps only (each weighted for the steps around it, so
    # the sums stand for every step), each one the device's time.
    for name, per_step in (
        ("forward", FORWARD_NS),
        ("optimizer", OPTIMIZER_NS),
        ("backward", BACKWARD_NS + WAIT_NS),
    ):
        assert phases[name]["count"] == steps
        assert round(phases[name]["sum"] * 1e9) == steps * per_step
    # Marks: every step's end, wait start and end (an auto step starts at the last one's end
    # mark); 4 more on a timed step (forward 2, backward start, optimizer end; its start is
    # the wait's end): far fewer than 8 a step.
    assert steps * 3 <= marks < steps * 5


def test_without_a_device_timer_the_phases_stay_on_the_host(tmp_path: Path) -> None:
    """The control: the same job with the host clock alone reads the host's launch times."""
    clock, device, exporter = ManualClock(), VirtualDevice(), InMemoryExporter()
    model = _DeviceModel(device, clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = StepMonitor(
        job_id="host", rank=0, world_size=1, exporter=exporter, clock=clock, start=False
    )
    monitor.instrument(model, optimizer)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
    monitor.close()
    forward = _summary(exporter)["phases"]["forward"]
    assert round(forward["sum"] * 1e9) == 3 * HOST_NS
    assert device.marks == 0


def test_a_mark_the_timer_cannot_read_leaves_the_host_time() -> None:
    class Unreadable(VirtualDevice):
        def elapsed_s(self, start: int, end: int) -> float:
            if start == 13:
                raise RuntimeError("event not recorded")
            return super().elapsed_s(start, end)

    seconds = _device_seconds(Unreadable(), {"forward": [(0, 10)], "backward": [(13, 20)]})
    assert seconds == {"forward": pytest.approx(10e-9)}


def test_the_device_stamp_never_raises_into_autograd() -> None:
    class Broken:
        def mark(self) -> Any:
            raise RuntimeError("no device")

    stamp = DeviceStamp(lambda: 5, Broken())
    stamp(torch.zeros(1))
    assert (stamp.ns, stamp.mark) == (5, None)  # the wait keeps its host time

    def no_clock() -> int:
        raise RuntimeError("no clock")

    clockless = DeviceStamp(no_clock, VirtualDevice())
    clockless(torch.zeros(1))
    assert clockless.ns == 0
    working = DeviceStamp(lambda: 5, VirtualDevice())
    working(torch.zeros(1))
    assert (working.ns, working.mark) == (5, 0)


def test_with_the_system_clock_the_last_gradient_stamp_is_the_c_one() -> None:
    """No Python frame from autograd for the stamp (``_fastrecord.MarkStamp``), where the
    extension is built; the Python :class:`DeviceStamp` otherwise."""
    from stepwatch.exporters import _recorder

    recorder = _recorder.new_recorder(
        clock=_recorder.SystemClock(),
        device_timer=VirtualDevice(),
        kernel_source=None,
        buffer_steps=4,
        log=RateLimitedLog(logging.getLogger("test-auto-device"), 0.0),
    )
    stamp = DeviceAutoState(recorder).gradient_stamp
    if _recorder.FAST_RECORDER is None:
        assert isinstance(stamp, DeviceStamp)
    else:
        assert type(stamp).__name__ == "MarkStamp"
    stamp(torch.zeros(1))
    assert stamp.ns > 0 and stamp.mark == 0


class _TorchEvent:
    """Shaped like ``torch.Event`` on a device: two marks 2.5 ms apart."""

    clock_ms = 0.0
    refuse = False

    def __init__(self, device: str, *, enable_timing: bool) -> None:
        assert (device, enable_timing) == ("cuda", True)
        self.at_ms: float | None = None

    def record(self) -> None:
        if self.refuse:
            raise RuntimeError("torch.Event is not supported here")
        type(self).clock_ms += 2.5
        self.at_ms = self.clock_ms

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return self.at_ms is not None

    def elapsed_time(self, end: _TorchEvent) -> float:
        assert self.at_ms is not None and end.at_ms is not None
        return end.at_ms - self.at_ms


def test_cuda_marks_are_torch_events_made_in_c_where_torch_has_them() -> None:
    from stepwatch.exporters.device import _cuda

    found = _cuda._event_marker(_TorchEvent)
    assert found is not None
    marker, kind = found
    assert kind == ("torch.Event (C marker)" if _cuda._fastrecord is not None else "torch.Event")
    first, second = marker(), marker()
    assert second.at_ms - first.at_ms == 2.5
    assert _cuda._event_marker(None) is None  # an older torch: torch.cuda.Event stays

    class Refusing(_TorchEvent):
        refuse = True

    assert _cuda._event_marker(Refusing) is None
