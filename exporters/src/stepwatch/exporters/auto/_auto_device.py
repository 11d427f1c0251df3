"""Auto mode on a device timer: the phases timed where the device runs them, not the host.

On a GPU the host launches work and runs ahead; the hooks of ``_auto`` read the host clock, so
a forward that launches in 0.3 ms and runs 8 ms on the device is a 0.3 ms forward, and the
time the device needs shows up wherever the host happens to wait for it (a copy to the host, a
full launch queue, the gloo allreduce). Seen on an H100 (docs/history/exporters.md, "Auto mode
on a GPU: phases on the device"): a rank whose forward did 7 ms of extra matrix products kept a
0.85 ms forward and doubled every rank's backward, so the job read as a backward regression on
every rank.

:class:`DeviceAutoState` is :class:`~stepwatch.exporters.auto._auto._AutoState` plus a device mark
(``DeviceTimer.mark``, a CUDA event in the current stream) at each point where a hook reads the
host clock, so each phase is the device time between the marks of its start and end:

- forward: marks where the forward wrapper opens and closes the phase;
- backward: a mark when the backward is asked for (``_engine``'s gate on torch's autograd
  engine, on the calling thread's current stream, the forward's; where the gate is not
  installed, the output's gradient hook on autograd's device thread, whose current stream is
  the forward's) to the mark at its end (the next ``optimizer.step()`` or forward);
- communication (the exposed wait): the last parameter's post-accumulate-grad hook takes a
  device mark with its clock reading (``_fastrecord.MarkStamp``, no Python frame; the Python
  :class:`DeviceStamp` without the extension or with another clock), to the same end mark as
  backward. DDP over NCCL makes the compute stream wait for its
  allreduces without blocking the host, so the host sees no wait at all: the device does.
  Taken on every step, as on the host (``stepwatch.phase.every_step``);
- optimizer: the optimizer's pre- and post-hooks;
- data (auto steps): the step's start mark (``StepRecorder.begin_step`` takes one at the
  step boundary) to the forward's first mark: what the device waited for between steps.

Phases are added to the step's record as intervals of marks (``StepRecorder.add_device_phase``,
``add_sampled_device_phase``) and turned into seconds on the export thread once the device has
passed the step's end (``_recorder.window_values``); where a mark cannot be read the host
time stays. Host timing is unchanged underneath (the stuck-rank view reads it).

Cost: a mark is a ``torch.Event`` made and recorded in C (``device/_cuda.CudaEventTimer``: 3.8 µs
on an H200, against 13.7 µs for ``torch.cuda.Event``); a sampled step takes seven, another step
two (the exposed wait) plus the step's own two, which the C recorder takes. An auto step starts
at the previous one's end mark (one instant, one mark): one fewer. In the training loop a mark
cost more than that on an H200 (docs/exporters.md, "On a GPU"; docs/history/exporters.md,
"Device-timed steps in C, and what a device timer costs").
"""

from __future__ import annotations

from typing import Any

from stepwatch.exporters._recorder import StepRecorder, new_mark_stamp
from stepwatch.exporters.auto import _auto
from stepwatch.exporters.auto._auto import Instrumentation, _AutoState

__all__ = ["DeviceAutoState", "DeviceStamp", "Instrumentation", "install_hooks"]


def install_hooks(
    recorder: StepRecorder, model: Any, optimizer: Any, **options: Any
) -> Instrumentation:
    """``_auto.install_hooks`` with the hooks that fit ``recorder``: phases timed on the
    device where it has a device timer (:class:`DeviceAutoState`), on the host clock else."""
    state_type = DeviceAutoState if recorder.device_timer is not None else _AutoState
    return _auto.install_hooks(recorder, model, optimizer, state_type=state_type, **options)


class DeviceStamp:
    """The last-gradient stamp with a device mark: ``ns`` (host clock) and ``mark`` (device).

    Called by autograd on its device thread; never raises: a mark that fails is None (the
    wait keeps its host time), a clock that fails leaves ``ns`` 0.
    """

    __slots__ = ("_clock_ns", "_device", "mark", "ns")

    def __init__(self, clock_ns: Any, device: Any) -> None:
        self._clock_ns = clock_ns
        self._device = device
        self.ns = 0
        self.mark: Any = None

    def __call__(self, *args: object, **kwargs: object) -> None:
        try:
            self.mark = self._device.mark()
        except Exception:
            self.mark = None
        try:
            self.ns = int(self._clock_ns())
        except Exception:
            self.ns = 0


class DeviceAutoState(_AutoState):
    """Auto-mode hooks that also time each phase on the device (see the module docstring)."""

    # fastrecord.c's gates copy these hooks too, marks included (_forward.hooks_in_c): with
    # the C recorder and MarkStamp a step enters no Python frame of these, timed or not.
    HOOKS_IN_C = True

    def __init__(self, recorder: StepRecorder) -> None:
        super().__init__(recorder)
        device: Any = recorder.device_timer
        self.device = device
        self.mark: Any = device.mark  # bound once (a C callable for CUDA events)
        stamp = new_mark_stamp(self.clock_ns, device)
        self.gradient_stamp = stamp if stamp is not None else DeviceStamp(self.clock_ns, device)
        self.forward_mark: Any = None
        self.backward_mark: Any = None
        self.optimizer_mark: Any = None
        self.data_mark: Any = None
        self._end_mark: Any = None  # shared by backward, the wait and the optimizer's start

    def _mark(self) -> Any:
        try:
            return self.mark()
        except Exception:
            self.recorder.misuse("device-mark", "device timer mark() raised", exc_info=True)
            return None

    def forward_pre(self, module: Any, args: Any) -> bool:
        had_data = self.data_start_ns is not None
        opened = super().forward_pre(module, args)
        if opened and self.forward_depth == 1:
            mark = self.forward_mark = self._mark()
            data_mark = self.data_mark
            if (
                had_data
                and self.data_start_ns is None
                and data_mark is not None
                and mark is not None
            ):
                self.recorder.add_sampled_device_phase("data", data_mark, mark)  # closed here
            self.data_mark = None
        return opened

    def forward_post(self, module: Any, args: Any, output: Any) -> None:
        start = self.forward_mark
        if start is not None and self.enabled and self.forward_depth == 1:
            end = self._mark()
            if end is not None:
                self.recorder.add_sampled_device_phase("forward", start, end)
            self.forward_mark = None
        super().forward_post(module, args, output)

    def backward_start(self, grad: Any) -> None:
        was_in_backward = self.in_backward
        super().backward_start(grad)
        if self.in_backward and not was_in_backward:
            self.backward_mark = self._mark()

    def _end_backward(self, now_ns: int) -> None:
        if self._end_mark is None and (self.in_backward or self.gradient_stamp.ns):
            self._end_mark = self._mark()
        if self.in_backward:
            start, end = self.backward_mark, self._end_mark
            if start is not None and end is not None:
                self.recorder.add_sampled_device_phase("backward", start, end)
            self.backward_mark = None
        super()._end_backward(now_ns)

    def _close_wait(self, now_ns: int) -> None:
        stamp = self.gradient_stamp
        if stamp.ns:
            start = getattr(stamp, "mark", None)
            end = self._end_mark if self._end_mark is not None else self._mark()
            if start is not None and end is not None:
                self.recorder.add_device_phase("communication", start, end)
        self._end_mark = None
        super()._close_wait(now_ns)

    def step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.enabled and self.recorder.sampled:
            self._end_mark = self.optimizer_mark = self._mark()
        super().step_pre(optimizer, args, kwargs)
        self._end_mark = None

    def step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        recorder = self.recorder
        start = self.optimizer_mark
        if start is not None and self.enabled:
            end = self._mark()
            if end is not None:
                recorder.add_sampled_device_phase("optimizer", start, end)
            self.optimizer_mark = None
        super().step_post(optimizer, args, kwargs)
        if self.enabled and not recorder.explicit_steps and self.data_start_ns is not None:
            # The step boundary: the new step's start mark is where the data phase starts.
            self.data_mark = getattr(recorder, "_step_start_mark", None)
