"""Real multi-process CPU jobs for the framework-callback tests (``test_callbacks_ddp.py``).

Each rank is a process started as ``torchrun`` starts one (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), running ``python -m tests.app.callback_jobs
CONFIG``. It trains the same small MLP on the same data twice, as two stepwatch jobs:

1. ``<job>-cb``: with the framework's trainer and stepwatch's callback, as the README says:
   a Lightning ``Trainer(strategy="ddp")`` (the ``lightning`` or the ``pytorch_lightning``
   package) or a Hugging Face ``Trainer`` (accelerate wraps the model in DDP);
2. ``<job>-sm``: a plain DDP loop on the process group the trainer set up, timed by
   ``StepMonitor`` in auto mode (``monitor.instrument(ddp, optimizer)``).

With ``blocks`` > 1 the two alternate, ``steps / blocks`` each at a time (a trainer and a
monitor per block), so the host's load falls on both alike.

Faults are real effects in both runs from ``onset`` steps on: ``dataloader`` sleeps in the
collate function of ``fault_rank`` (a slow loader); ``straggler`` adds matrix multiplies to its
forward; ``slow_forward`` makes its forward wait ``fault_forward_s`` (a straggler that does not
take the CPU from its peers: on a host with fewer cores than ranks, extra compute on one rank
slows every rank). With ``fault_every`` = k, only every k-th step after ``onset`` is hit: the
healthy steps in between give the job's own step time side by side with the faulty ones.
Each rank writes what its own clock saw (the end of every step of both runs) to
``out_dir/rank<r>.json``: the ground truth the tests hold stepwatch's numbers against.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

FRAMEWORKS = ("lightning.pytorch", "pytorch_lightning", "transformers")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """One run of both jobs on every rank.

    ``data_s``: every batch's loading time (a sleep: I/O, not CPU); ``fault_data_s``: the slow
    loader's extra per batch; ``fault_factor``: the straggler's forward compute (x its own).
    """

    framework: str
    job_id: str
    endpoint: str
    out_dir: str
    steps: int = 200
    fault: str = "none"
    fault_rank: int = 1
    onset: int = 100
    data_s: float = 0.004
    fault_data_s: float = 0.040
    fault_factor: float = 2.0
    fault_forward_s: float = 0.030
    fault_every: int = 1
    batch_size: int = 32
    hidden: int = 256
    export_interval_s: float = 0.25
    plain: bool = True
    blocks: int = 1
    forward_s: float = 0.0
    backward_s: float = 0.0


def _torch_setup() -> Any:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    return torch


class Batches:
    """The collate function: stacks rows, waits ``data_s`` (``+ fault_data_s`` on the slow
    loader's rank from ``onset`` batches on). Counts batches per run (``reset``)."""

    def __init__(self, config: JobConfig, rank: int) -> None:
        self.config = config
        self.slow = config.fault == "dataloader" and rank == config.fault_rank
        self.count = 0

    def __call__(self, rows: list[Any]) -> Any:
        import torch

        self.count += 1
        wait_s = self.config.data_s
        if self.slow and _hit(self.config, self.count):
            wait_s += self.config.fault_data_s
        time.sleep(wait_s)
        inputs = torch.stack([row[0] for row in rows])
        labels = torch.stack([row[1] for row in rows])
        return {"inputs": inputs, "labels": labels}


def _hit(config: JobConfig, count: int) -> bool:
    """Whether the ``count``-th batch or forward (from 1) is faulty."""
    return count > config.onset and (count - config.onset) % config.fault_every == 0


def _model(config: JobConfig, rank: int) -> Any:
    torch = _torch_setup()

    class Delay(torch.autograd.Function):
        """Identity that waits ``forward_s`` in the forward and ``backward_s`` in the backward."""

        @staticmethod
        def forward(ctx: Any, tensor: Any) -> Any:
            time.sleep(config.forward_s)
            return tensor.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            time.sleep(config.backward_s)
            return grad

    class Net(torch.nn.Module):
        """An MLP whose forward does extra compute on the straggler from ``onset`` forwards."""

        def __init__(self) -> None:
            super().__init__()
            hidden = config.hidden
            self.layers = torch.nn.Sequential(
                torch.nn.Linear(64, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, 10),
            )
            self.burn = torch.randn(hidden, hidden) / hidden**0.5
            faulty = rank == config.fault_rank
            self.slow = config.fault == "straggler" and faulty
            self.wait_s = config.fault_forward_s if config.fault == "slow_forward" and faulty else 0
            self.forwards = 0

        def forward(self, inputs: Any, labels: Any = None) -> Any:
            if torch.is_grad_enabled():
                self.forwards += 1
            hidden = self.layers[1](self.layers[0](inputs))
            if config.forward_s or config.backward_s:
                # After the first layer: its gradients (the model's last) wait for no sleep.
                hidden = Delay.apply(hidden)
            output = self.layers[2:](hidden)
            hit = _hit(config, self.forwards)
            if self.wait_s and hit:
                time.sleep(self.wait_s)
            if self.slow and hit:
                # As much compute again as the forward's own, times (fault_factor - 1); no
                # gradient, so the backward stays as it was.
                with torch.no_grad():
                    burn = self.layers[0](inputs)
                    for _ in range(round(2 * (config.fault_factor - 1.0))):
                        burn = (burn @ self.burn).clamp_(-1.0, 1.0)
                output = output + 0.0 * burn.sum()
            if labels is None:
                return output
            return {"loss": torch.nn.functional.cross_entropy(output, labels)}

    torch.manual_seed(1234)
    return Net()


def _dataset(config: JobConfig, world_size: int) -> Any:
    torch = _torch_setup()
    generator = torch.Generator().manual_seed(7)
    rows = (config.steps + 1) * config.batch_size * world_size  # one epoch each run
    inputs = torch.randn(rows, 64, generator=generator)
    labels = torch.randint(0, 10, (rows,), generator=generator)

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return rows

        def __getitem__(self, index: int) -> tuple[Any, Any]:
            return inputs[index], labels[index]

    return Rows()


def _loader(config: JobConfig, rank: int, world_size: int, batches: Batches) -> Any:
    torch = _torch_setup()
    data = _dataset(config, world_size)
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=world_size, rank=rank, shuffle=False
    )
    return torch.utils.data.DataLoader(
        data, batch_size=config.batch_size, sampler=sampler, collate_fn=batches
    )


def _callback_options(config: JobConfig) -> dict[str, Any]:
    """Either callback's settings: every step's phases timed, as the plain arm's."""
    return {
        "job_id": f"{config.job_id}-cb",
        "endpoint": config.endpoint,
        "export_interval_s": config.export_interval_s,
        "phase_sampling": 1,
    }


class Framework:
    """The framework arm: a trainer per block with stepwatch's callback (a new monitor each,
    so no step spans the other arm's block); returns each step's end by this rank's clock."""

    def __init__(self, config: JobConfig, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.batches = Batches(config, rank)
        self.model = _model(config, rank)
        self.module: Any = None

    def run(self, steps: int) -> list[float]:
        if self.config.framework == "transformers":
            return self._transformers(steps)
        return self._lightning(steps)

    def _lightning(self, steps: int) -> list[float]:
        """``Trainer(strategy="ddp")`` with ``StepwatchCallback``; every batch steps."""
        import importlib

        torch = _torch_setup()
        pl = importlib.import_module(self.config.framework)
        from stepwatch.exporters.integrations.lightning import StepwatchCallback

        net = self.model
        ends: list[float] = []

        class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def training_step(self, batch: dict[str, Any], index: int) -> Any:
                return self.net(batch["inputs"], batch["labels"])["loss"]

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

        class Clock(pl.Callback):  # type: ignore[misc,name-defined]
            def on_train_batch_end(self, *args: Any) -> None:
                ends.append(time.perf_counter())

        config = self.config
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=self.world_size,
            strategy="ddp",
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[
                StepwatchCallback(**_callback_options(config)),
                Clock(),
            ],
        )
        if self.module is None:
            self.module = Module()
        trainer.fit(self.module, _loader(config, self.rank, self.world_size, self.batches))
        return ends

    def _transformers(self, steps: int) -> list[float]:
        """``Trainer`` (accelerate wraps the model in DDP) with ``StepwatchTrainerCallback``."""
        import transformers

        from stepwatch.exporters.integrations.huggingface import StepwatchTrainerCallback

        ends: list[float] = []

        class Clock(transformers.TrainerCallback):  # type: ignore[misc]
            def on_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
                ends.append(time.perf_counter())

        config = self.config
        args = transformers.TrainingArguments(
            output_dir=str(Path(config.out_dir) / "hf"),
            max_steps=steps,
            per_device_train_batch_size=config.batch_size,
            learning_rate=0.01,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            dataloader_num_workers=0,
            ddp_backend="gloo",
        )
        trainer = transformers.Trainer(
            model=self.model,
            args=args,
            train_dataset=_dataset(config, self.world_size),
            data_collator=self.batches,
            callbacks=[
                StepwatchTrainerCallback(**_callback_options(config)),
                Clock(),
            ],
        )
        trainer.train()
        return ends


class Plain:
    """The StepMonitor arm: the same training in a plain DDP loop, auto mode, a monitor per
    block; returns each step's end by this rank's clock."""

    def __init__(self, config: JobConfig, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.batches = Batches(config, rank)
        self.ddp: Any = None

    def run(self, steps: int) -> list[float]:
        torch = _torch_setup()
        from torch.nn.parallel import DistributedDataParallel

        from stepwatch.exporters import StepMonitor

        config = self.config
        if self.ddp is None:  # after the trainer's first block: its process group
            self.ddp = DistributedDataParallel(_model(config, self.rank))
        ddp = self.ddp
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        monitor = StepMonitor(
            job_id=f"{config.job_id}-sm",
            rank=self.rank,
            world_size=self.world_size,
            endpoint=config.endpoint,
            export_interval_s=config.export_interval_s,
            phase_sampling=1,
        )
        monitor.instrument(ddp, optimizer)
        ends: list[float] = []
        loader = iter(_loader(config, self.rank, self.world_size, self.batches))
        for _ in range(steps):
            batch = next(loader)
            loss = ddp(batch["inputs"], batch["labels"])["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ends.append(time.perf_counter())
        monitor.close()
        return ends


def launch(
    config: JobConfig, world_size: int, *, timeout_s: float = 120.0
) -> dict[int, dict[str, list[float]]]:
    """Start ``world_size`` ranks as torchrun would, wait, and return each rank's clock.

    Raises:
        RuntimeError: a rank failed or the job ran past ``timeout_s`` (with its output).
    """
    from stepwatch.core._net import free_port

    repo = Path(__file__).resolve().parents[2]
    base = dict(os.environ)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    logs = [Path(config.out_dir, f"rank{rank}.log") for rank in range(world_size)]
    processes = []
    for rank in range(world_size):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        with logs[rank].open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.app.callback_jobs",
                        json.dumps(dataclasses.asdict(config)),
                    ],
                    cwd=repo,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout_s
    try:
        for rank, process in enumerate(processes):
            code = process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if code != 0:
                raise RuntimeError(f"rank {rank} exited {code}:\n{logs[rank].read_text()[-3000:]}")
    except subprocess.TimeoutExpired as exc:
        tails = "\n".join(log.read_text()[-1500:] for log in logs)
        raise RuntimeError(f"the job ran past {timeout_s:.0f} s:\n{tails}") from exc
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return {
        rank: json.loads(Path(config.out_dir, f"rank{rank}.json").read_text())
        for rank in range(world_size)
    }


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    config = JobConfig(**json.loads(argv[0]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _torch_setup()
    import torch.distributed as dist

    framework = Framework(config, rank, world_size)
    plain = Plain(config, rank, world_size)
    result: dict[str, list[float]] = {"cb": [], "sm": []}
    block = config.steps // config.blocks
    for _ in range(config.blocks):  # the two arms alternate: the host's load falls on both
        result["cb"] += framework.run(block)
        gc.collect()  # the block's trainer and its DDP: no stale reducer on the next block
        if config.plain:
            dist.barrier()  # both arms start together on every rank
            result["sm"] += plain.run(block)
            dist.barrier()
    Path(config.out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
