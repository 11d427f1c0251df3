"""The Hugging Face Trainer callback on a real ``transformers.Trainer`` (CPU) and tiny model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="the huggingface extra is not installed")
torch = pytest.importorskip("torch")

from stepwatch.exporters import InMemoryExporter  # noqa: E402
from stepwatch.exporters.integrations.huggingface import (  # noqa: E402
    StepwatchTrainerCallback,
    trained_model,
)
from tests.exporters.integrations.conftest import exported_totals, phase_counts  # noqa: E402

STEPS = 10


class TinyRegressor(torch.nn.Module):
    """The smallest model the Trainer accepts: ``forward(**batch)`` returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return {"loss": torch.nn.functional.mse_loss(self.layer(inputs).squeeze(-1), labels)}


class Dataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows of 8; ``wait_s`` per row read (a slow data pipeline)."""

    def __init__(self, rows: int = 64, wait_s: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(rows, 8, generator=generator)
        self.wait_s = wait_s

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.wait_s)
        row = self.inputs[index]
        return {"inputs": row, "labels": row.sum()}


def trainer(
    tmp_path: Path,
    callback: StepwatchTrainerCallback,
    *,
    data: Dataset | None = None,
    **options: Any,
) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "run_name": "hf-run",
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 0.01,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": True,
        "dataloader_num_workers": 0,
    }
    settings.update(options)
    return transformers.Trainer(
        model=TinyRegressor(),
        args=transformers.TrainingArguments(**settings),
        train_dataset=data if data is not None else Dataset(),
        eval_dataset=Dataset(rows=8, wait_s=0.01),
        callbacks=[callback],
    )


def test_every_trainer_step_is_timed_with_its_phases(tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchTrainerCallback(exporter=exporter, export_interval_s=0.05)
    trainer(tmp_path, callback).train()
    assert callback.monitor is None
    steps, phases, resource = phase_counts(exporter)
    assert steps == STEPS
    assert phases["forward"] == phases["backward"] == phases["optimizer"] == STEPS
    assert phases["data"] == STEPS - 1
    assert resource["stepwatch.job.id"] == "hf-run"
    assert (resource["stepwatch.rank"], resource["stepwatch.world_size"]) == (0, 1)


def test_a_step_holds_the_wait_for_its_batches_and_accumulates(tmp_path: Path) -> None:
    # Auto mode's steps: one optimizer step each (2 accumulated batches), from the end of
    # the previous one, so the loading of its batches (4 rows x 5 ms each) is inside it.
    exporter = InMemoryExporter()
    callback = StepwatchTrainerCallback(exporter=exporter, export_interval_s=0.05, phase_sampling=1)
    # Rows to spare: accelerate's loader reads a batch ahead, so the last step's reads
    # would find the end one batch early.
    data = Dataset(rows=4 * 2 * (STEPS + 1), wait_s=0.005)
    trainer(tmp_path, callback, data=data, gradient_accumulation_steps=2).train()
    totals = exported_totals(exporter)
    assert totals.steps == STEPS
    assert totals.phase_counts["forward"] == totals.phase_counts["optimizer"] == STEPS
    assert totals.mean_s("data") >= 2 * 4 * 0.005
    tiled = sum(totals.phase_s[phase] for phase in ("data", "forward", "backward", "optimizer"))
    assert tiled <= totals.step_s


def test_an_evaluation_during_training_is_an_eval_phase_not_steps(tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchTrainerCallback(exporter=exporter, export_interval_s=0.05)
    trainer(tmp_path, callback, eval_strategy="steps", eval_steps=4).train()
    totals = exported_totals(exporter)
    assert totals.steps == STEPS  # evaluation batches are not steps
    # After steps 4 and 8 (the one after the last step is in no step): 8 rows x 10 ms.
    assert totals.phase_counts["eval"] == 2
    assert totals.mean_s("eval") >= 8 * 0.01


def test_a_single_process_trains_the_model_it_was_given() -> None:
    model = TinyRegressor()
    assert trained_model(model) is model  # no Trainer calling, no DDP
