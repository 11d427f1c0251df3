"""The PyTorch Lightning callback on a real Trainer (CPU), single process and 2-rank DDP."""

from __future__ import annotations

from pathlib import Path

import pytest

pl = pytest.importorskip("pytorch_lightning", reason="the lightning extra is not installed")
torch = pytest.importorskip("torch")

from stepwatch.exporters import InMemoryExporter  # noqa: E402
from stepwatch.exporters._sampling import step_hash  # noqa: E402
from stepwatch.exporters.integrations.lightning import StepwatchCallback  # noqa: E402
from tests.exporters.integrations.conftest import phase_counts  # noqa: E402

STEPS = 12
# Lightning 2.6 on torch 2.13 warns about its own use of torch's pytree and about data-loader
# workers; those are the framework's, not stepwatch's.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning"),
]


class TinyModule(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 8, generator=generator)
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=4)


def trainer(tmp_path: Path, callback: StepwatchCallback) -> pl.Trainer:
    return pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
    )


def test_every_optimizer_step_is_timed_with_its_phases(tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchCallback(job_id="pl-run", exporter=exporter, export_interval_s=0.05)
    trainer(tmp_path, callback).fit(TinyModule(), loader())
    assert callback.monitor is None  # closed (and flushed) when training ended
    steps, phases, resource = phase_counts(exporter)
    assert steps == STEPS
    assert phases["forward"] == phases["backward"] == phases["optimizer"] == STEPS
    assert phases["data"] == STEPS - 1  # the wait between steps: none before the first
    assert resource["stepwatch.job.id"] == "pl-run"
    assert (resource["stepwatch.rank"], resource["stepwatch.world_size"]) == (0, 1)


def test_a_bad_setting_never_stops_training(tmp_path: Path) -> None:
    callback = StepwatchCallback(job_id="pl-run", endpoint="not a url")
    model = TinyModule()
    before = model.layer.weight.detach().clone()
    trainer(tmp_path, callback).fit(model, loader())
    assert not torch.equal(before, model.layer.weight)  # it trained
    assert callback.monitor is None


def test_phase_sampling_reaches_the_monitor(tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchCallback(
        job_id="pl-run", exporter=exporter, export_interval_s=0.05, phase_sampling=4
    )
    strides: list[int] = []

    class Probe(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, *args: object) -> None:
            monitor = callback.monitor
            strides.append(monitor.phase_sample_stride if monitor is not None else -1)

    run = trainer(tmp_path, callback)
    run.callbacks.append(Probe())
    run.fit(TinyModule(), loader())
    assert strides == [4] * STEPS
    steps, phases, _ = phase_counts(exporter)
    assert steps == STEPS
    # Sampled steps stand for the others: at most every step, at least the sampled ones.
    sampled = sum(1 for i in range(STEPS) if step_hash(i) % 4 == 0)
    assert sampled <= phases.get("forward", 0) <= STEPS
