"""Framework callbacks that run a :class:`~stepwatch.exporters.StepMonitor` for you.

Each module needs its framework (an extra of ``stepwatch-exporters``) and is imported on its
own; importing this package imports neither:

- :mod:`stepwatch.exporters.integrations.lightning`: ``StepwatchCallback`` for a PyTorch
  Lightning ``Trainer`` (``pip install './exporters[lightning]'``).
- :mod:`stepwatch.exporters.integrations.huggingface`: ``StepwatchTrainerCallback`` for a
  Hugging Face ``transformers.Trainer`` (``pip install './exporters[huggingface]'``).

Both time every optimizer step with auto mode (forward, backward, optimizer, the data wait
between steps, and DDP communication when the framework wraps the model in DDP), take the rank
and world size from the framework, never raise into training, and close the monitor (flushing
the last windows) when training ends.
"""

from __future__ import annotations

__all__: list[str] = []
