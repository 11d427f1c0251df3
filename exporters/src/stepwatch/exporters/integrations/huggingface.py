"""A Hugging Face ``transformers.Trainer`` callback that times every step with stepwatch.

Example::

    from transformers import Trainer
    from stepwatch.exporters.integrations.huggingface import StepwatchTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[StepwatchTrainerCallback(job_id="run-42")])
    trainer.train()

The monitor starts at ``on_train_begin`` with the run's process index, world size and local
process index, instruments the model and the optimizer (unwrapping accelerate's), and closes
at ``on_train_end``. Needs the ``huggingface`` extra (``transformers``, ``accelerate``).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from stepwatch.exporters._export import Exporter
from stepwatch.exporters._monitor import StepMonitor
from stepwatch.exporters._window import KernelSource
from stepwatch.exporters.integrations._common import CallbackMonitor, MonitorOptions

__all__ = ["StepwatchTrainerCallback"]


class StepwatchTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """Runs a :class:`~stepwatch.exporters.StepMonitor` in auto mode for ``Trainer.train``.

    Args:
        job_id: The training run (default: ``TrainingArguments.run_name``).
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

    # transformers calls every event with the model, optimizer, ... as keyword arguments.
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._run.start(
            default_job_id=str(args.run_name or "huggingface"),
            rank=int(args.process_index),
            world_size=int(args.world_size),
            local_rank=int(args.local_process_index),
            model=kwargs.get("model"),
            optimizer=kwargs.get("optimizer"),
        )

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._run.stop()
