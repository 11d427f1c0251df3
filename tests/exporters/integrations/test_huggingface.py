"""The Hugging Face Trainer callback on a real ``transformers.Trainer`` (CPU) and tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="the huggingface extra is not installed")
torch = pytest.importorskip("torch")

from stepwatch.exporters import InMemoryExporter  # noqa: E402
from stepwatch.exporters.integrations.huggingface import StepwatchTrainerCallback  # noqa: E402
from tests.exporters.integrations.conftest import phase_counts  # noqa: E402

STEPS = 10


class TinyRegressor(torch.nn.Module):
    """The smallest model the Trainer accepts: ``forward(**batch)`` returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return {"loss": torch.nn.functional.mse_loss(self.layer(inputs).squeeze(-1), labels)}


class Dataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(64, 8, generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.inputs[index]
        return {"inputs": row, "labels": row.sum()}


def test_every_trainer_step_is_timed_with_its_phases(tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchTrainerCallback(exporter=exporter, export_interval_s=0.05)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        run_name="hf-run",
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=0.01,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=TinyRegressor(), args=args, train_dataset=Dataset(), callbacks=[callback]
    )
    trainer.train()
    assert callback.monitor is None
    steps, phases, resource = phase_counts(exporter)
    assert steps == STEPS
    assert phases["forward"] == phases["backward"] == phases["optimizer"] == STEPS
    assert phases["data"] == STEPS - 1
    assert resource["stepwatch.job.id"] == "hf-run"
    assert (resource["stepwatch.rank"], resource["stepwatch.world_size"]) == (0, 1)
