"""A PyTorch Lightning callback that times every training step with stepwatch.

Example::

    import pytorch_lightning as pl
    from stepwatch.exporters.integrations.lightning import StepwatchCallback

    trainer = pl.Trainer(callbacks=[StepwatchCallback(job_id="run-42")])
    trainer.fit(model, data)

The monitor starts when training starts, with the trainer's global rank, world size and local
rank, and closes when training ends. Lightning runs ``training_step`` (never the module's own
``forward``) inside ``optimizer.step(closure)``, so auto mode's hooks cannot see its phases:
the callback times them from Lightning's own events instead. One step per training batch:

- data: ``on_train_batch_end`` → the next ``on_train_batch_start`` (the loader's wait);
- forward: ``on_train_batch_start`` → ``on_before_backward`` (``training_step``);
- backward: ``on_before_backward`` → ``on_after_backward`` (DDP's all-reduce wait included:
  Lightning gives no event between the last gradient and the end of backward);
- optimizer: ``on_before_optimizer_step`` → ``on_train_batch_end``.

Needs the ``lightning`` extra (``pytorch-lightning``).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from stepwatch.exporters._export import Exporter
from stepwatch.exporters._monitor import StepMonitor
from stepwatch.exporters._window import KernelSource
from stepwatch.exporters.integrations._common import CallbackMonitor, MonitorOptions

__all__ = ["StepwatchCallback"]


class StepwatchCallback(pl.Callback):
    """Runs a :class:`~stepwatch.exporters.StepMonitor` in auto mode for ``Trainer.fit``.

    Args:
        job_id: The training run (default: ``lightning-<logger version>`` or
            ``lightning-<pid of rank 0's launcher>``).
        endpoint: OTLP endpoint (else the ``OTEL_EXPORTER_OTLP_*`` variables).
        protocol: ``http/protobuf`` or ``grpc`` (else the variables).
        export_interval_s: Seconds between exports (else ``OTEL_METRIC_EXPORT_INTERVAL``).
        exporter: Any :class:`~stepwatch.exporters.Exporter` instead of OTLP (tests).
        kernel_source: Kernel events per window (e.g. ``TorchProfilerSource()``).
        phase_sampling: Which steps auto mode times phase by phase (``StepMonitor``'s:
            ``"auto"``, steps at least 50 ms apart, by default; 1: every step).
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

    @property
    def monitor(self) -> StepMonitor | None:
        """The running monitor (``None`` before training starts and after it ends)."""
        return self._run.monitor

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logger = trainer.logger
        version = getattr(logger, "version", None) if logger is not None else None
        self._run.start(
            default_job_id=f"lightning-{version if version is not None else 'run'}",
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            local_rank=trainer.local_rank,
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        events = self._run.events
        events.leave("data")
        events.enter("step")
        events.enter("forward")

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        self._run.events.leave("forward")
        self._run.events.enter("backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run.events.leave("backward")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._run.events.enter("optimizer")

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        events = self._run.events
        events.leave_all()
        events.enter("data")  # a phase outside a step goes to the next step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run.events.leave("data")  # no next step: the last wait belongs to none
        self._run.stop()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._run.stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._run.stop()

    def state_dict(self) -> dict[str, Any]:
        return {}
