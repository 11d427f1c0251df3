"""A real pipeline-parallel training job (CPU, gloo), instrumented by hand, with real faults.

Run: ``python -m stepwatch.app._pipeline_job --pp 2 --dp 2 --fault slow-worker`` with
``stepwatch up`` running (``--endpoint`` its OTLP/HTTP endpoint; ``--help`` for the rest).

``pp × dp`` processes train a small transformer-shaped model (residual MLP blocks over token
sequences, ``blocks_per_stage`` = 6 a stage) split into ``pp`` stages; rank
``pp_rank * dp + dp_rank`` (stages contiguous, as Megatron orders them). Stage 0 holds the
embedding, the last stage the loss head (a vocabulary projection and cross-entropy). Each
step runs a hand-written 1F1B schedule (``_pipeline_schedule.one_f_one_b``) over
``microbatches`` microbatches with ``torch.distributed`` point-to-point sends and receives of
activations and gradients between adjacent stages, then all-reduces each stage's gradients
among its ``dp`` replicas (none when ``dp`` is 1), then steps the optimizer.

**Device time, a CPU stand-in** (``_pipeline_model``). On GPUs each stage computes on its
own device at the same time as the others; four processes doing their matrix multiplies on
this project's 2-core host would take turns on the cores instead, and a pipeline's structure
(its slowest stage pacing the others) would not show. So each part of the model computes a
little for real (hidden size 32: real tensors, real autograd) and launches the kernels it
stands for on a device clock: a block's forward ``device_ms_per_block`` (0.5 ms) per
microbatch of ``seq_len`` tokens, its backward twice that, the loss head about one block
(``HEAD_BLOCKS``), the embedding a tenth (``EMBEDDING_BLOCKS``), so the healthy last stage
does 1.15-1.17x the others' work, as a real LLM's does with 6 layers a stage. As on a GPU the
launches queue and return; each microbatch's forward and backward end by waiting for the
device, asleep (no CPU), inside its phase. ``--device-ms-per-block 0`` leaves the real
compute alone. Everything else is real: the processes, gloo's transfers and all-reduce of
real tensors, the 1F1B schedule, autograd, the optimizer, the instrumentation.

It is instrumented as docs/exporters.md ("Instrumenting a pipeline by hand") says a user
should: ``monitor.step()`` around the step, ``phase("data")`` where a stage reads its
microbatches, ``phase("forward")``/``phase("backward")`` around each microbatch's compute,
``phase("communication")`` around every point-to-point wait and the all-reduce,
``phase("optimizer")``; ``pp_rank`` and ``dp_rank`` on the monitor.

Faults (``_pipeline_config.FAULTS``), real effects inside the job:

- ``healthy``: none (the last stage is still heavier: the loss head);
- ``slow-worker``: one rank is ``fault_factor`` times slower from ``fault_step``: its device
  time is ``fault_factor`` times longer, and its forward and backward repeat their real
  matrix multiplies (without gradients or device time) ``fault_factor - 1`` times more;
- ``heavy-stage``: one stage holds twice ``blocks_per_stage`` blocks (as many more as a
  stage holds, each with its device time) on every replica, from step 0 (partitioning);
- ``rotating-microbatches``: from ``fault_step`` the microbatches' sequence lengths differ
  between replicas, and the replica with the longest ones changes every step (device time
  scales with the sequence length);
- ``stall``: one rank stops ``STALL_S`` (3 s) once at ``fault_step``, between its optimizer and
  the end of its step (outside every phase).

**Ground truth in the same run.** After the ``steps`` recorded steps the job closes its monitor
and runs ``truth_pairs`` pairs of ``truth_block_steps``-step blocks, one block with the fault
and one without in each pair (their order alternating, ABBA), exporting to the job
``<job_id>-truth`` so that the recorded job holds a clean onset and a sustained fault only.
Each rank times every step with its own clock; ``_pipeline_truth.paired_truth`` turns the
blocks into the fault's cost (mean step with the fault / without). ``heavy-stage``'s block
without the fault runs the same blocks partitioned evenly (what re-partitioning saves);
``healthy``'s pairs are the same job twice (the measurement's noise floor), followed by a
second series, the job as it is against the same job with its loss head's device time spread
evenly over the stages (what the heavier last stage costs: more than any partition of whole
blocks saves); ``stall``'s block with the fault holds one stall.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from stepwatch.app._demo_job import demo_host
from stepwatch.app._pipeline_config import (
    FAULTS,
    HEAD_BLOCKS,
    STALL_S,
    PipelineJobConfig,
    blocks_held,
    blocks_run,
    fault_active,
    head_spread,
    sequence_lengths,
    stall_step,
)
from stepwatch.app._pipeline_schedule import Transfer, one_f_one_b
from stepwatch.app._pipeline_truth import results_of
from stepwatch.app._ranks import join_gloo, run_ranks
from stepwatch.core._errors import ConfigError
from stepwatch.exporters import StepMonitor


def launch(config: PipelineJobConfig, *, timeout_s: float = 900.0) -> dict[str, Any] | None:
    """Run the job (``pp × dp`` processes) to the end; what it measured, with a result file.

    Raises:
        StepwatchError: a rank failed or the job did not finish within ``timeout_s``.
    """
    run_ranks(
        _rank_main, (config,), world_size=config.world_size, timeout_s=timeout_s, what="pipeline"
    )
    if config.result_file is None:
        return None
    with open(config.result_file) as handle:
        results: dict[str, Any] = json.load(handle)
    return results


def _rank_main(rank: int, config: PipelineJobConfig, master_port: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    join_gloo(rank, config.world_size, master_port, seed=config.seed)
    import torch.distributed as dist

    try:
        worker = _Worker(config, rank)
        worker.run()
        timings: list[Any] = [None] * config.world_size
        dist.all_gather_object(timings, worker.timings())
        if rank == 0 and config.result_file is not None:
            with open(config.result_file, "w") as handle:
                json.dump(results_of(config, timings), handle, indent=2)
    finally:
        dist.destroy_process_group()


def _monitor(config: PipelineJobConfig, rank: int, job_id: str) -> StepMonitor:

    stage, replica = config.coordinates(rank)
    return StepMonitor(
        job_id=job_id,
        rank=rank,
        world_size=config.world_size,
        host_name=demo_host(rank),
        local_rank=rank % 2,
        pp_rank=stage,
        dp_rank=replica,
        endpoint=config.endpoint,
        export_interval_s=config.export_interval_s,
    )


class _Worker:
    """One rank: its stage of the model, its neighbours, its data-parallel group."""

    def __init__(self, config: PipelineJobConfig, rank: int) -> None:
        import torch
        import torch.distributed as dist

        self.config = config
        self.rank = rank
        self.stage, self.replica = config.coordinates(rank)
        self.first = self.stage == 0
        self.last = self.stage == config.pp - 1
        self.prev = None if self.first else config.rank_of(self.stage - 1, self.replica)
        self.next = None if self.last else config.rank_of(self.stage + 1, self.replica)
        # Every rank creates every stage's group, in the same order (new_group's contract).
        self.dp_group = None
        for stage in range(config.pp):
            members = [config.rank_of(stage, r) for r in range(config.dp)]
            group = dist.new_group(members) if config.dp > 1 else None
            if stage == self.stage:
                self.dp_group = group
        from stepwatch.app._pipeline_model import Stage

        self.model = Stage(config, self.stage, blocks=blocks_held(config, self.stage))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.schedule = one_f_one_b(self.stage, config.pp, config.microbatches)
        self.step_s: list[float] = []
        self.compute_s: list[float] = []
        self.device_s: list[float] = []

    def timings(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "device_s": self.device_s,
        }

    def run(self) -> None:
        config = self.config
        monitor = _monitor(config, self.rank, config.job_id)
        for step in range(config.steps):
            self.train_step(monitor, step)
        monitor.close()
        if config.truth_pairs:
            truth = _monitor(config, self.rank, f"{config.job_id}-truth")
            for step in range(config.steps, config.total_steps):
                self.train_step(truth, step)
            truth.close()

    def train_step(self, monitor: StepMonitor, step: int) -> None:
        config = self.config
        active = fault_active(config, step)
        slow = config.fault == "slow-worker" and self.rank == config.faulty_rank and active
        self.model.blocks_run = blocks_run(config, self.stage, step)
        self.model.clock.factor = config.fault_factor if slow else 1.0
        spread = head_spread(config, step)
        self.model.head_blocks = 0.0 if spread else HEAD_BLOCKS
        self.model.share_blocks = HEAD_BLOCKS / config.pp if spread else 0.0
        lengths = sequence_lengths(config, step, self.replica)
        started = time.perf_counter()
        device_before = self.model.clock.spent_s
        compute_ns = 0
        with monitor.step():
            batch = self.read_batch(monitor, step, lengths)
            state = _Microbatches(lengths)
            for item in self.schedule:
                if isinstance(item, Transfer):
                    with monitor.phase("communication"):
                        self.transfer(item, state)
                else:
                    begin = time.perf_counter_ns()
                    with monitor.phase(item.kind):
                        if item.kind == "forward":
                            self.forward(item.microbatch, state, batch, slow=slow)
                        else:
                            self.backward(item.microbatch, state, batch, slow=slow)
                        self.model.clock.synchronize()  # its output or gradient is ready
                    compute_ns += time.perf_counter_ns() - begin
            with monitor.phase("communication"):
                self.all_reduce()
            with monitor.phase("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if stall_step(config, step) and self.rank == config.faulty_rank:
                time.sleep(STALL_S)  # outside every phase: a checkpoint write, a GC pause
        self.step_s.append(time.perf_counter() - started)
        self.compute_s.append(compute_ns / 1e9)
        self.device_s.append(self.model.clock.spent_s - device_before)

    def read_batch(self, monitor: StepMonitor, step: int, lengths: Sequence[int]) -> list[Any]:
        """The step's token ids (first stage) or targets (last stage), one per microbatch;
        every stage of a replica draws the same ones."""
        import torch

        if not (self.first or self.last):
            return []
        config = self.config
        with monitor.phase("data"):
            generator = torch.Generator().manual_seed(config.seed + 7919 * step + self.replica)
            return [
                torch.randint(0, config.vocab, (config.batch, length), generator=generator)
                for length in lengths
            ]

    def forward(self, mb: int, state: _Microbatches, batch: list[Any], *, slow: bool) -> None:
        import torch

        inputs = batch[mb] if self.first else state.inputs[mb]
        output = self.model(inputs)
        if self.last:
            logits = output.reshape(-1, self.config.vocab)
            loss = torch.nn.functional.cross_entropy(logits, batch[mb].reshape(-1))
            output = loss / self.config.microbatches
        state.outputs[mb] = output
        if slow:
            self.burn(inputs, repeats=self.config.fault_factor - 1.0)

    def backward(self, mb: int, state: _Microbatches, batch: list[Any], *, slow: bool) -> None:
        import torch

        output = state.outputs.pop(mb)
        if self.last:
            output.backward()
        else:
            torch.autograd.backward(output, grad_tensors=state.grads.pop(mb))
        if slow:  # a backward costs about two forwards
            inputs = batch[mb] if self.first else state.inputs[mb]
            self.burn(inputs, repeats=2.0 * (self.config.fault_factor - 1.0))

    def burn(self, inputs: Any, *, repeats: float) -> None:
        """Run this stage's real compute again ``repeats`` times without gradients or device
        time: a slower worker's host work, inside the phase it slows (its device time is
        ``fault_factor`` times longer by its clock)."""
        import torch

        with torch.no_grad(), self.model.clock.paused():
            for _ in range(max(1, round(repeats))):
                self.model(inputs.detach())

    def transfer(self, item: Transfer, state: _Microbatches) -> None:
        import torch
        import torch.distributed as dist

        config = self.config
        works: list[Any] = []
        for op, mb in item.ops:
            shape = (config.batch, state.lengths[mb], config.hidden)
            if op == "send_forward":
                works.append(dist.isend(state.outputs[mb].detach(), self.next))
            elif op == "recv_forward":
                buffer = torch.empty(shape)
                state.inputs[mb] = buffer
                works.append(dist.irecv(buffer, self.prev))
            elif op == "send_backward":
                works.append(dist.isend(state.inputs.pop(mb).grad, self.prev))
            else:  # recv_backward
                buffer = torch.empty(shape)
                state.grads[mb] = buffer
                works.append(dist.irecv(buffer, self.next))
        for work in works:
            work.wait()
        for op, mb in item.ops:
            if op == "recv_forward":
                state.inputs[mb].requires_grad_()

    def all_reduce(self) -> None:
        """Average the stage's gradients over its replicas: one flat all-reduce."""
        import torch
        import torch.distributed as dist

        if self.dp_group is None:
            return
        params = list(self.model.parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.config.dp
        offset = 0
        for param in params:
            size = param.numel()
            param.grad = flat[offset : offset + size].view_as(param).clone()
            offset += size


class _Microbatches:
    """One step's microbatches in flight on a stage: what each received, produced and got
    back, by microbatch index."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)
        self.inputs: dict[int, Any] = {}  # received activations (they collect the gradient)
        self.outputs: dict[int, Any] = {}  # the stage's output, or the loss on the last stage
        self.grads: dict[int, Any] = {}  # received gradients of the outputs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stepwatch.app._pipeline_job``: run the job, print what it measured."""
    defaults = PipelineJobConfig(job_id="-")
    parser = argparse.ArgumentParser(
        prog="python -m stepwatch.app._pipeline_job",
        description="A real pipeline-parallel job (CPU, gloo, device time slept), instrumented "
        "by hand.",
    )
    parser.add_argument("--job", default=f"pipeline-{os.getpid()}", help="stepwatch.job.id")
    parser.add_argument("--pp", type=int, default=defaults.pp, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=defaults.dp, help="data-parallel replicas")
    parser.add_argument("--microbatches", type=int, default=defaults.microbatches)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--fault", choices=FAULTS, default=defaults.fault)
    parser.add_argument("--fault-rank", type=int, default=None, help="default: rank 1")
    parser.add_argument("--fault-stage", type=int, default=None, help="heavy-stage's stage")
    parser.add_argument("--fault-step", type=int, default=defaults.fault_step)
    parser.add_argument("--truth-pairs", type=int, default=defaults.truth_pairs)
    parser.add_argument("--truth-block-steps", type=int, default=defaults.truth_block_steps)
    parser.add_argument("--blocks-per-stage", type=int, default=defaults.blocks_per_stage)
    parser.add_argument(
        "--device-ms-per-block",
        type=float,
        default=defaults.device_ms_per_block,
        help="device time (slept) of a block's forward on a microbatch; its backward twice "
        f"that; 0: none (default {defaults.device_ms_per_block:g})",
    )
    parser.add_argument("--endpoint", default=defaults.endpoint, help="OTLP/HTTP endpoint")
    parser.add_argument(
        "--export-interval", type=float, default=10.0, help="seconds per window (default 10)"
    )
    args = parser.parse_args(argv)
    scratch = tempfile.TemporaryDirectory(prefix="stepwatch-pipeline-")
    try:
        config = PipelineJobConfig(
            job_id=args.job,
            pp=args.pp,
            dp=args.dp,
            microbatches=args.microbatches,
            steps=args.steps,
            fault=args.fault,
            fault_rank=args.fault_rank,
            fault_stage=args.fault_stage,
            fault_step=args.fault_step,
            truth_pairs=args.truth_pairs,
            truth_block_steps=args.truth_block_steps,
            blocks_per_stage=args.blocks_per_stage,
            device_ms_per_block=args.device_ms_per_block,
            endpoint=args.endpoint,
            export_interval_s=args.export_interval,
            result_file=os.path.join(scratch.name, "results.json"),
        )
    except ConfigError as exc:
        scratch.cleanup()
        parser.error(str(exc))
    started = time.monotonic()
    with scratch:
        results = launch(config)
    print(f"job {config.job_id}: {config.total_steps} steps in {time.monotonic() - started:.1f} s")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
