"""What both framework callbacks share: build the monitor, instrument, close, never raise."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from stepwatch.exporters._export import Exporter
from stepwatch.exporters._monitor import StepMonitor
from stepwatch.exporters._window import KernelSource

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
        if model is None or optimizer is None:
            return
        # The optimizer a framework hands out may wrap the torch one (accelerate does).
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        try:
            monitor.instrument(model, torch_optimizer)
        except Exception:
            logger.exception("stepwatch: could not instrument the model; steps are not timed")

    def stop(self) -> None:
        """Close the monitor: remove the hooks and flush the last windows."""
        self.events.leave_all()
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return
        try:
            monitor.close()
        except Exception:  # close never raises by contract; this is the framework's thread
            logger.exception("stepwatch: closing the monitor failed")


class EventTimer:
    """Steps and phases opened and closed by framework events instead of ``with`` blocks.

    For frameworks whose loop never calls the model's own ``forward`` (Lightning runs
    ``training_step``), auto mode's module hooks see nothing: the callback marks where each
    step and phase begins and ends instead, through the monitor's public context managers.
    """

    def __init__(self, owner: CallbackMonitor) -> None:
        self._owner = owner
        self._open: dict[str, Any] = {}  # "step" or a phase name → its entered context

    def enter(self, name: str) -> None:
        """Open the step (``name == "step"``) or a phase; a second open is ignored."""
        monitor = self._owner.monitor
        if monitor is None or name in self._open:
            return
        context = monitor.step() if name == "step" else monitor.phase(name)
        context.__enter__()
        self._open[name] = context

    def leave(self, name: str) -> None:
        """Close what :meth:`enter` opened (nothing when it was not open)."""
        context = self._open.pop(name, None)
        if context is not None:
            context.__exit__(None, None, None)

    def leave_all(self) -> None:
        """Close every open phase, then the step (the end of training, an exception)."""
        for name in [n for n in self._open if n != "step"]:
            self.leave(name)
        self.leave("step")
