"""Framework callbacks that run a :class:`~stepwatch.exporters.StepMonitor` for you.

Each module needs its framework (an extra of ``stepwatch-exporters``) and is imported on its
own; importing this package imports neither:

- :mod:`stepwatch.exporters.integrations.lightning`: ``StepwatchCallback`` for a PyTorch
  Lightning ``Trainer``, from ``lightning.pytorch`` or ``pytorch_lightning``
  (``pip install './exporters[lightning]'``).
- :mod:`stepwatch.exporters.integrations.huggingface`: ``StepwatchTrainerCallback`` for a
  Hugging Face ``transformers.Trainer`` (``pip install './exporters[huggingface]'``).

Both give auto mode's steps (one optimizer step, from the end of the previous one, the wait
for its batch inside it) and phases (data, forward, backward, optimizer, DDP's exposed wait as
communication, and an evaluation pass as eval), take the rank and world size from the
framework, never raise into training, and close the monitor (flushing the last windows) when
training ends. docs/exporters.md, "Framework callbacks".
"""

from __future__ import annotations

__all__: list[str] = []
