"""A PyTorch Lightning callback that times every training step with stepwatch.

Example::

    import lightning.pytorch as pl  # or: import pytorch_lightning as pl
    from stepwatch.exporters.integrations.lightning import StepwatchCallback

    trainer = pl.Trainer(callbacks=[StepwatchCallback(job_id="run-42")])
    trainer.fit(model, data)

Both import names of Lightning work: ``StepwatchCallback`` is a ``Callback`` of each Lightning
package installed (``lightning``, whose trainer is ``lightning.pytorch.Trainer``, and
``pytorch-lightning``, ``pytorch_lightning.Trainer``), so either trainer takes it.

The monitor starts when training starts, with the trainer's global rank, world size and local
rank, and closes when training ends. Lightning runs ``training_step`` (never the module's own
``forward``) inside ``optimizer.step(closure)``, so auto mode's hooks cannot see its phases:
the callback times them from Lightning's own events instead. A step is what ``StepMonitor``'s
auto mode calls one, one optimizer step: from the end of the previous one
(``on_train_batch_end`` of a batch whose optimizer stepped) to the end of this one, so the
wait for its batch is inside it. Its phases:

- data: ``on_train_batch_end`` → the next ``on_train_batch_start`` (the loader's wait, and
  whatever Lightning does between batches), less an evaluation pass;
- forward: ``on_train_batch_start`` → ``on_before_backward`` (``training_step``);
- backward: ``on_before_backward`` → ``on_after_backward`` (DDP's all-reduce wait included);
- communication (a ``DistributedDataParallel`` model): the exposed all-reduce wait, from the
  model's last gradient to ``on_after_backward``, inside backward as in auto mode;
- optimizer: ``on_before_optimizer_step`` → ``on_train_batch_end``;
- eval: ``on_validation_start`` → ``on_validation_end`` during training (a validation pass
  between batches is in the step it delays, as this phase; its batches are not steps).

With gradient accumulation a step holds each of its batches' phases (the data waits between
them included); with manual optimization, a step ends with each batch in which an optimizer
stepped through Lightning (``self.optimizers()``), or with every batch when none ever does.

Needs the ``lightning`` extra (``lightning`` and ``pytorch-lightning``; either one is enough).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from stepwatch.exporters._export import Exporter
from stepwatch.exporters._protocols import KernelSource
from stepwatch.exporters.integrations._common import (
    CallbackMonitor,
    GradientWait,
    MonitorOptions,
)
from stepwatch.exporters.monitor._monitor import StepMonitor

__all__ = ["StepwatchCallback"]

logger = logging.getLogger("stepwatch.exporters")

#: Lightning's two import names: the ``lightning`` package's and ``pytorch-lightning``'s.
LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def callback_classes() -> tuple[type, ...]:
    """The ``Callback`` class of each Lightning package that imports, in
    :data:`LIGHTNING_PACKAGES` order.

    Raises:
        ModuleNotFoundError: Neither imports (``name`` is ``lightning``; the message names
            the extra).
    """
    found: list[type] = []
    for name in LIGHTNING_PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found.append(module.Callback)
    if not found:
        raise ModuleNotFoundError(
            "stepwatch.exporters.integrations.lightning needs Lightning: pip install lightning "
            "(or pytorch-lightning), or the exporters' extra: pip install "
            "'stepwatch-exporters[lightning]'",
            name="lightning",
        )
    return tuple(found)


def _callback_base() -> type:
    """One class whose subclasses are a ``Callback`` of every Lightning package installed.

    A trainer of either package takes them (``Trainer(callbacks=cb)`` checks
    ``isinstance(cb, Callback)``, and so does user code); the hooks are the same names in both.
    """
    classes = callback_classes()
    if len(classes) == 1:
        return classes[0]
    return type("LightningCallbacks", classes, {"__module__": __name__})


if TYPE_CHECKING:
    from lightning.pytorch import Callback as _CallbackBase
else:
    _CallbackBase = _callback_base()


class StepwatchCallback(_CallbackBase):
    """Runs a :class:`~stepwatch.exporters.StepMonitor` for ``Trainer.fit`` (either Lightning).

    Args:
        job_id: The training run (default: ``lightning-<logger version>``, or
            ``lightning-run`` without a logger).
        endpoint: OTLP endpoint (else the ``OTEL_EXPORTER_OTLP_*`` variables).
        protocol: ``http/protobuf`` or ``grpc`` (else the variables).
        export_interval_s: Seconds between exports (else ``OTEL_METRIC_EXPORT_INTERVAL``).
        exporter: Any :class:`~stepwatch.exporters.Exporter` instead of OTLP (tests).
        kernel_source: Kernel events per window (e.g. ``TorchProfilerSource()``).
        phase_sampling: ``StepMonitor``'s; the callback times its phases with ``phase()``
            contexts, which are timed on every step whatever it says.
    """

    def __init__(
        self,
        job_id: str | None = None,
        *,
        endpoint: str | None = None,
        protocol: str | None = None,
        export_interval_s: float | None = None,
        exporter: Exporter | None = None,
        kernel_source: KernelSource | None = None,
        phase_sampling: int | str = "auto",
    ) -> None:
        super().__init__()
        self._run = CallbackMonitor(
            MonitorOptions(
                job_id=job_id,
                endpoint=endpoint,
                protocol=protocol,
                export_interval_s=export_interval_s,
                exporter=exporter,
                kernel_source=kernel_source,
                phase_sampling=phase_sampling,
            )
        )
        self._wait = GradientWait(self._run.events)
        self._stepped = False  # an optimizer stepped in this batch
        self._ever_stepped = False  # ... in any batch of this run
        self._manual = False  # the module optimizes manually

    @property
    def monitor(self) -> StepMonitor | None:
        """The running monitor (``None`` before training starts and after it ends)."""
        return self._run.monitor

    # Lightning calls hooks positionally: (trainer, pl_module, ...). They are typed Any, as
    # the trainer and module may be either package's.
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        logger_ = trainer.logger
        version = getattr(logger_, "version", None) if logger_ is not None else None
        self._run.start(
            default_job_id=f"lightning-{version if version is not None else 'run'}",
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            local_rank=trainer.local_rank,
        )
        self._stepped = self._ever_stepped = False
        try:
            self._manual = not bool(pl_module.automatic_optimization)
            if self._run.monitor is not None:
                self._wait.attach(trainer.strategy.model)
        except Exception:
            logger.warning("stepwatch: could not read the trainer's model", exc_info=True)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        events = self._run.events
        events.leave("data")
        events.begin_step()  # the first batch; later ones begin where the last step ended
        events.enter("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        events = self._run.events
        events.leave("forward")
        events.leave("optimizer")  # manual optimization: a second backward after a step
        events.enter("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._wait.end()
        self._run.events.leave("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        events = self._run.events
        events.leave("forward")  # manual optimization: a step without a backward
        events.enter("optimizer")
        self._stepped = self._ever_stepped = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        events = self._run.events
        if self._stepped or (self._manual and not self._ever_stepped):
            events.end_step()  # and the next one begins now, waiting for its batch
        else:  # gradients accumulate: the step goes on
            events.leave_all()
        self._stepped = False
        events.enter("data")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        events = self._run.events
        if events.in_step:  # a validation pass during training: not a step, not data
            events.leave("data")
            events.enter("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        events = self._run.events
        if events.in_step:
            events.leave("eval")
            events.enter("data")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        self._wait.detach()
        self._run.stop()

    def state_dict(self) -> dict[str, Any]:
        return {}
