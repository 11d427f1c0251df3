"""The PyTorch Lightning callback on a real Trainer (CPU, one process), under both of
Lightning's import names: ``lightning.pytorch`` (the ``lightning`` package) and
``pytorch_lightning``. Real multi-process DDP jobs: tests/app/test_callbacks_ddp.py."""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not any(importlib.util.find_spec(name) for name in ("lightning", "pytorch_lightning")):
    pytest.skip("the lightning extra is not installed", allow_module_level=True)

from stepwatch.exporters import InMemoryExporter  # noqa: E402
from stepwatch.exporters._sampling import step_hash  # noqa: E402
from stepwatch.exporters.integrations import lightning as integration  # noqa: E402
from stepwatch.exporters.integrations.lightning import StepwatchCallback  # noqa: E402
from tests.exporters.integrations.conftest import exported_totals, phase_counts  # noqa: E402

STEPS = 12
NAMES = [
    pytest.param(name, marks=pytest.mark.skipif(
        importlib.util.find_spec(name.split(".")[0]) is None, reason=f"{name} not installed"
    ))
    for name in integration.LIGHTNING_PACKAGES
]  # fmt: skip
# Lightning 2.6 on torch 2.13 warns about its own use of torch's pytree and about data-loader
# workers; those are the framework's, not stepwatch's.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*val_check_interval.*"),
]


@pytest.fixture(params=NAMES)
def pl(request: pytest.FixtureRequest) -> ModuleType:
    """One of Lightning's import names (both when both are installed)."""
    return importlib.import_module(request.param)


def module_class(pl: ModuleType, *, manual: bool = False, bypass: bool = False) -> type:
    """A tiny LightningModule of ``pl``; ``manual``: it optimizes by hand (through
    Lightning's optimizer, or with ``bypass`` the torch one)."""

    class TinyModule(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.automatic_optimization = not manual

        def training_step(self, batch: tuple[Any, Any], index: int) -> Any:
            inputs, targets = batch
            loss = torch.nn.functional.mse_loss(self.layer(inputs), targets)
            if not manual:
                return loss
            optimizer = self.trainer.optimizers[0] if bypass else self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return TinyModule


def loader(batches: int = 16, wait_s: float = 0.0) -> Any:
    """Batches of 4 rows; each waits ``wait_s`` in the loader (a slow data pipeline)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4 * batches, 8, generator=generator)
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))

    def collate(rows: list[tuple[Any, Any]]) -> tuple[Any, Any]:
        time.sleep(wait_s)
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    return torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collate)


def trainer(pl: ModuleType, tmp_path: Path, *callbacks: Any, **options: Any) -> Any:
    settings: dict[str, Any] = {
        "max_steps": STEPS,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
        "num_sanity_val_steps": 0,
        "callbacks": list(callbacks),
    }
    settings.update(options)
    return pl.Trainer(**settings)


def test_every_optimizer_step_is_timed_with_its_phases(pl: ModuleType, tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchCallback(job_id="pl-run", exporter=exporter, export_interval_s=0.05)
    trainer(pl, tmp_path, callback).fit(module_class(pl)(), loader())
    assert callback.monitor is None  # closed (and flushed) when training ended
    steps, phases, resource = phase_counts(exporter)
    assert steps == STEPS
    assert phases["forward"] == phases["backward"] == phases["optimizer"] == STEPS
    assert phases["data"] == STEPS - 1  # the wait before each step's batch: none before the first
    assert "communication" not in phases  # not a DDP model
    assert resource["stepwatch.job.id"] == "pl-run"
    assert (resource["stepwatch.rank"], resource["stepwatch.world_size"]) == (0, 1)


def test_a_step_holds_the_wait_for_its_batch(pl: ModuleType, tmp_path: Path) -> None:
    # As in StepMonitor's auto mode: a step runs from the end of one optimizer step to the
    # end of the next, so a slow loader makes the step longer (not shorter than its peers').
    exporter = InMemoryExporter()
    callback = StepwatchCallback(job_id="pl-run", exporter=exporter, export_interval_s=0.05)
    ends: list[float] = []

    class Clock(pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_end(self, *args: object) -> None:
            ends.append(time.perf_counter())

    trainer(pl, tmp_path, callback, Clock()).fit(module_class(pl)(), loader(wait_s=0.02))
    totals = exported_totals(exporter)
    assert totals.steps == STEPS
    assert totals.mean_s("data") >= 0.02
    # The steps follow one another: together, the time from the first batch to the last
    # step's end (the first step, without a wait before it, is at least its phases).
    first = sum(totals.mean_s(phase) for phase in ("forward", "backward", "optimizer"))
    assert totals.step_s == pytest.approx(ends[-1] - ends[0] + first, rel=0.1)
    tiled = sum(totals.phase_s[phase] for phase in ("data", "forward", "backward", "optimizer"))
    assert tiled <= totals.step_s <= 1.1 * tiled


def test_accumulated_batches_are_one_step(pl: ModuleType, tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchCallback(job_id="pl-run", exporter=exporter, export_interval_s=0.05)
    run = trainer(pl, tmp_path, callback, max_steps=4, accumulate_grad_batches=3)
    run.fit(module_class(pl)(), loader(wait_s=0.01))
    totals = exported_totals(exporter)
    assert totals.steps == 4  # optimizer steps, of 3 batches each
    counts = totals.phase_counts
    assert counts["forward"] == counts["backward"] == counts["optimizer"] == 4
    assert counts["data"] == 4  # the first step has the waits between its batches
    # Each step holds its 3 batches' work and the waits for its 3 batches (2 in the first).
    assert totals.phase_s["data"] >= (4 * 3 - 1) * 0.01


def test_validation_during_training_is_an_eval_phase_not_steps(
    pl: ModuleType, tmp_path: Path
) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchCallback(job_id="pl-run", exporter=exporter, export_interval_s=0.05)

    class Validated(module_class(pl)):  # type: ignore[misc]
        def validation_step(self, batch: Any, index: int) -> None:
            time.sleep(0.05)

    run = trainer(pl, tmp_path, callback, val_check_interval=4, limit_val_batches=2)
    run.fit(Validated(), loader(), loader())
    totals = exported_totals(exporter)
    assert totals.steps == STEPS  # validation batches are not steps
    # After batches 4 and 8, in the step each delays (the pass after the last batch is in
    # no step); its time is eval, not data.
    assert totals.phase_counts["eval"] == 2
    assert totals.mean_s("eval") >= 2 * 0.05
    assert totals.phase_max_s["data"] < 0.05


@pytest.mark.parametrize("bypass", [False, True])
def test_manual_optimization(pl: ModuleType, tmp_path: Path, bypass: bool) -> None:
    # Through self.optimizers(): a step per optimizer step. With the torch optimizer itself
    # Lightning sees no optimizer step (and counts none): a step per batch.
    exporter = InMemoryExporter()
    callback = StepwatchCallback(job_id="pl-run", exporter=exporter, export_interval_s=0.05)
    options = {"max_steps": -1, "max_epochs": 1, "limit_train_batches": 6} if bypass else {}
    trainer(pl, tmp_path, callback, **options).fit(
        module_class(pl, manual=True, bypass=bypass)(), loader()
    )
    totals = exported_totals(exporter)
    expected = 6 if bypass else STEPS
    assert totals.steps == expected
    assert totals.phase_counts["forward"] == totals.phase_counts["backward"] == expected
    assert totals.phase_counts.get("optimizer", 0) == (0 if bypass else expected)


def test_a_bad_setting_never_stops_training(pl: ModuleType, tmp_path: Path) -> None:
    callback = StepwatchCallback(job_id="pl-run", endpoint="not a url")
    model = module_class(pl)()
    before = model.layer.weight.detach().clone()
    trainer(pl, tmp_path, callback).fit(model, loader())
    assert not torch.equal(before, model.layer.weight)  # it trained
    assert callback.monitor is None


def test_events_out_of_order_never_raise(pl: ModuleType, tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchCallback(job_id="pl-run", exporter=exporter, export_interval_s=0.05)
    run = trainer(pl, tmp_path, callback)
    module = module_class(pl)()
    # Before training (no monitor), then with one: stray and repeated events.
    for _ in range(2):
        callback.on_after_backward(run, module)
        callback.on_train_batch_end(run, module, None, None, 0)
        callback.on_train_batch_end(run, module, None, None, 0)
        callback.on_validation_end(run, module)
        callback.on_before_optimizer_step(run, module, None)
        callback.on_before_backward(run, module, None)
        callback.on_train_batch_start(run, module, None, 0)
        callback.on_train_batch_start(run, module, None, 0)
        callback.on_train_start(run, module)
    callback.on_exception(run, module, RuntimeError("user code"))
    callback.teardown(run, module, "fit")
    assert callback.monitor is None


def test_an_error_in_the_training_step_is_the_users(pl: ModuleType, tmp_path: Path) -> None:
    callback = StepwatchCallback(job_id="pl-run", exporter=InMemoryExporter())

    class Failing(module_class(pl)):  # type: ignore[misc]
        def training_step(self, batch: Any, index: int) -> Any:
            if index == 3:
                raise RuntimeError("the user's own error")
            return super().training_step(batch, index)

    with pytest.raises(RuntimeError, match="the user's own error"):
        trainer(pl, tmp_path, callback).fit(Failing(), loader())
    assert callback.monitor is None  # closed on the exception


def test_phase_sampling_reaches_the_monitor(pl: ModuleType, tmp_path: Path) -> None:
    exporter = InMemoryExporter()
    callback = StepwatchCallback(
        job_id="pl-run", exporter=exporter, export_interval_s=0.05, phase_sampling=4
    )
    strides: list[int] = []

    class Probe(pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_end(self, *args: object) -> None:
            monitor = callback.monitor
            strides.append(monitor.phase_sample_stride if monitor is not None else -1)

    trainer(pl, tmp_path, callback, Probe()).fit(module_class(pl)(), loader())
    assert strides == [4] * STEPS
    steps, phases, _ = phase_counts(exporter)
    assert steps == STEPS
    # The callback's phases are phase() contexts: timed on every step whatever the stride
    # (auto mode's own phases are what it samples).
    assert phases["forward"] == STEPS
    assert 0 <= sum(1 for i in range(STEPS) if step_hash(i) % 4 == 0) <= STEPS


def test_either_trainer_takes_the_callback(pl: ModuleType, tmp_path: Path) -> None:
    callback = StepwatchCallback(job_id="pl-run", exporter=InMemoryExporter())
    assert isinstance(callback, pl.Callback)
    # A single callback, not in a list: the trainer checks isinstance(callbacks, Callback).
    run = pl.Trainer(callbacks=callback, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=tmp_path)  # fmt: skip
    assert callback in run.callbacks


def test_the_callback_class_follows_what_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = [
        name for name in integration.LIGHTNING_PACKAGES if importlib.util.find_spec(
            name.split(".")[0]) is not None
    ]  # fmt: skip
    bases = {importlib.import_module(name).Callback for name in installed}
    assert set(integration.callback_classes()) == bases
    assert all(issubclass(StepwatchCallback, base) for base in bases)
    for blocked in integration.LIGHTNING_PACKAGES:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, blocked, None)  # import raises ImportError
            found = integration.callback_classes()
            assert len(found) == len(installed) - (blocked in installed)
    with monkeypatch.context() as patch:
        for name in integration.LIGHTNING_PACKAGES:
            patch.setitem(sys.modules, name, None)
        with pytest.raises(ImportError, match=r"stepwatch-exporters\[lightning\]"):
            integration.callback_classes()


def test_the_callback_pickles_as_ddp_spawn_sends_it(pl: ModuleType) -> None:
    callback = pickle.loads(pickle.dumps(StepwatchCallback(job_id="pl-run")))
    assert isinstance(callback, StepwatchCallback) and isinstance(callback, pl.Callback)
    assert callback.monitor is None
