"""What both framework callbacks share: build the monitor, instrument, close, never raise."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from stepwatch.exporters._export import Exporter
from stepwatch.exporters._protocols import KernelSource
from stepwatch.exporters.monitor._monitor import StepMonitor

logger = logging.getLogger("stepwatch.exporters")


@dataclasses.dataclass
class MonitorOptions:
    """The StepMonitor settings a callback passes on (the rest come from the environment)."""

    job_id: str | None = None
    endpoint: str | None = None
    protocol: str | None = None
    export_interval_s: float | None = None
    exporter: Exporter | None = None
    kernel_source: KernelSource | None = None
    phase_sampling: int | str = "auto"


class CallbackMonitor:
    """One monitor for one training run, started and stopped by framework events."""

    def __init__(self, options: MonitorOptions) -> None:
        self.options = options
        self.monitor: StepMonitor | None = None
        self.events = EventTimer(self)

    def start(
        self,
        *,
        default_job_id: str,
        rank: int,
        world_size: int,
        local_rank: int | None,
        model: Any = None,
        optimizer: Any = None,
    ) -> None:
        """Build the monitor and, when given, instrument ``model``/``optimizer`` (auto mode).

        Logs instead of raising.

        A configuration mistake (a bad endpoint, say) is logged once and training goes on
        unmonitored: a framework callback has no earlier point at which to raise it.
        """
        if self.monitor is not None:
            return
        options = self.options
        try:
            monitor = StepMonitor(
                job_id=options.job_id or default_job_id,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                endpoint=options.endpoint,
                protocol=options.protocol,
                export_interval_s=options.export_interval_s,
                exporter=options.exporter,
                kernel_source=options.kernel_source,
                phase_sampling=options.phase_sampling,
            )
        except Exception:
            logger.exception("stepwatch: could not start the monitor; training goes on without")
            return
        self.monitor = monitor
        self.events.reset()
        if model is None or optimizer is None:
            return
        # The optimizer a framework hands out may wrap the torch one (accelerate does).
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        try:
            monitor.instrument(model, torch_optimizer)
        except Exception:
            logger.exception("stepwatch: could not instrument the model; steps are not timed")

    def stop(self) -> None:
        """Close the monitor: remove the hooks and flush the last windows.

        The step still open (begun at the last step's end: the wait for a batch that never
        came) is left out, as auto mode leaves it out.
        """
        self.events.abandon()
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return
        try:
            monitor.close()
        except Exception:  # close never raises by contract; this is the framework's thread
            logger.exception("stepwatch: closing the monitor failed")


class EventTimer:
    """Steps and phases opened and closed by framework events instead of ``with`` blocks.

    A step is what ``StepMonitor``'s auto mode calls one: from the end of the previous
    optimizer step to the end of this one, so the wait for the step's batch (``data``) is
    inside it. The first step begins at the first batch (there is no previous end); the step
    still open when training ends (only the wait for a next batch) is never recorded.

    Every method never raises (the framework's training loop calls it): a failure is logged
    once and the run goes on, its timing possibly incomplete.
    """

    def __init__(self, owner: CallbackMonitor) -> None:
        self._owner = owner
        self._step: Any = None  # the entered step context, or None between runs
        self._open: dict[str, Any] = {}  # phase name → its entered context
        self._failed = False

    def reset(self) -> None:
        """Forget any step and phase of an earlier run (a new monitor)."""
        self._step = None
        self._open = {}

    @property
    def in_step(self) -> bool:
        """Whether a step is open."""
        return self._step is not None

    def begin_step(self) -> None:
        """Open a step unless one is open."""
        monitor = self._owner.monitor
        if monitor is None or self._step is not None:
            return
        try:
            context = monitor.step()
            context.__enter__()
            self._step = context
        except Exception:
            self._fail()

    def end_step(self) -> None:
        """Close every open phase, record the open step and open the next at once."""
        self.leave_all()
        context = self._step
        if context is None:
            return
        self._step = None
        try:
            context.__exit__(None, None, None)
        except Exception:
            self._fail()
        self.begin_step()

    def enter(self, name: str) -> None:
        """Open phase ``name``; opening an open phase does nothing."""
        monitor = self._owner.monitor
        if monitor is None or name in self._open:
            return
        try:
            context = monitor.phase(name)
            context.__enter__()
            self._open[name] = context
        except Exception:
            self._fail()

    def leave(self, name: str) -> None:
        """Close what :meth:`enter` opened (nothing when it was not open)."""
        context = self._open.pop(name, None)
        if context is None:
            return
        try:
            context.__exit__(None, None, None)
        except Exception:
            self._fail()

    def leave_all(self) -> None:
        """Close every open phase."""
        for name in list(self._open):
            self.leave(name)

    def abandon(self) -> None:
        """Close every open phase and drop the open step unrecorded (training ended)."""
        self.leave_all()
        self._step = None

    def _fail(self) -> None:
        if not self._failed:
            self._failed = True
            logger.warning("stepwatch: a framework event could not be timed", exc_info=True)


class GradientWait:
    """A DDP model's exposed all-reduce wait as the ``communication`` phase, from events.

    As in auto mode: from the moment the model's last gradient is ready (a hook on its first
    trainable parameter, whose gradient autograd produces last, which is when DDP issues its
    last bucket) to the end of the backward (the framework's after-backward event), while
    DDP waits there for its all-reduces. The phase is a ``phase()`` context, so a rank stuck
    in the all-reduce reads ``communication`` in its progress (a waiter, for the hang rule).
    """

    def __init__(self, events: EventTimer) -> None:
        self._events = events
        self._handle: Any = None

    def attach(self, model: Any) -> bool:
        """Hook ``model`` when it is a ``DistributedDataParallel``; True when hooked."""
        self.detach()
        try:
            from torch.nn.parallel import DistributedDataParallel

            if not isinstance(model, DistributedDataParallel):
                return False
            first = next((p for p in model.parameters() if p.requires_grad), None)
            if first is None:
                return False
            register: Any = first.register_post_accumulate_grad_hook
            self._handle = register(self._last_gradient)
            return True
        except Exception:
            logger.warning("stepwatch: the all-reduce wait is not timed", exc_info=True)
            return False

    def _last_gradient(self, parameter: Any) -> None:
        # Called by autograd: never raise into the backward (enter() does not).
        if self._events.in_step:
            self._events.enter("communication")

    def end(self) -> None:
        """The backward returned: the wait is over."""
        self._events.leave("communication")

    def detach(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.remove()
            except Exception:
                logger.warning("stepwatch: removing the gradient hook failed", exc_info=True)
