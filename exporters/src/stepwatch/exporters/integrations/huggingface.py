"""A Hugging Face ``transformers.Trainer`` callback that times every step with stepwatch.

Example::

    from transformers import Trainer
    from stepwatch.exporters.integrations.huggingface import StepwatchTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[StepwatchTrainerCallback(job_id="run-42")])
    trainer.train()

The monitor starts at ``on_train_begin`` with the run's process index, world size and local
process index, instruments the model the trainer trains and the optimizer (unwrapping
accelerate's) with ``StepMonitor``'s auto mode, and closes at ``on_train_end``. Steps and
phases are therefore auto mode's, as on a hand-written loop that calls
``monitor.instrument(model, optimizer)``:

- a step: from the end of one ``optimizer.step()`` to the end of the next (all micro-batches
  of gradient accumulation are one step), so the wait for its batches is inside it;
- data: from the previous step's end to the step's first forward: the trainer's work after
  the optimizer (scheduler, logging, evaluation, checkpoints) and ``get_batch_samples``,
  which loads all the step's micro-batches at once;
- forward, backward, optimizer: auto mode's (the model's ``forward``; from the backward's
  start to the next forward or ``optimizer.step()``, gradient clipping included; the
  optimizer's step);
- communication (a ``DistributedDataParallel`` model: the trainer wraps it under
  ``torchrun``): the exposed all-reduce wait, from the last gradient to the backward's end;
- eval: an evaluation pass during training, from ``on_step_end`` (or ``on_epoch_end``) that
  asks for one to ``on_evaluate``, in the step it delays (inside its ``data`` too, as auto
  mode sees it). Evaluation batches are not steps.

transformers hands callbacks the unwrapped model, not the ``DistributedDataParallel`` that
trains; the callback takes that one from the calling ``Trainer``'s ``model_wrapped``. Needs
the ``huggingface`` extra (``transformers``, ``accelerate``).
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from stepwatch.exporters._export import Exporter
from stepwatch.exporters._protocols import KernelSource
from stepwatch.exporters.integrations._common import CallbackMonitor, MonitorOptions
from stepwatch.exporters.monitor._monitor import StepMonitor

__all__ = ["StepwatchTrainerCallback"]

logger = logging.getLogger("stepwatch.exporters")

#: How many frames up from a callback event the calling ``Trainer`` may be
#: (``_inner_training_loop`` → ``CallbackHandler.on_train_begin`` → ``call_event`` → here).
_TRAINER_FRAMES = 8


def trained_model(model: Any) -> Any:
    """The model the calling ``Trainer`` trains: its ``model_wrapped`` when that is a
    ``DistributedDataParallel`` of ``model`` (the trainer wraps it before ``on_train_begin``
    and hands callbacks ``model``), else ``model``."""
    try:
        from torch.nn.parallel import DistributedDataParallel

        frame: FrameType | None = sys._getframe(1)
        for _ in range(_TRAINER_FRAMES):
            if frame is None:
                break
            caller = frame.f_locals.get("self")
            if isinstance(caller, Trainer):
                wrapped = getattr(caller, "model_wrapped", None)
                if isinstance(wrapped, DistributedDataParallel) and wrapped.module is model:
                    return wrapped
                break
            frame = frame.f_back
    except Exception:
        logger.warning("stepwatch: could not find the trainer's wrapped model", exc_info=True)
    return model


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
            model=trained_model(kwargs.get("model")),
            optimizer=kwargs.get("optimizer"),
        )

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # The default flow callback (first in the list) has said whether the trainer
        # evaluates now, before its next batches.
        if getattr(control, "should_evaluate", False) and self._run.monitor is not None:
            self._run.events.enter("eval")

    on_epoch_end = on_step_end  # an evaluation may follow either

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._run.events.leave("eval")

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._run.events.leave("eval")  # an evaluation that never said it ended

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._run.stop()
