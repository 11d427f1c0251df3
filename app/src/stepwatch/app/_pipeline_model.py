"""The pipeline job's model (``stepwatch.app._pipeline_job``): one stage of it, and the device
time its parts stand for.

**Device time, a CPU stand-in.** On a GPU a stage's kernels run on the device: the host's
CPU only launches them, so the stages of a pipeline (one GPU each) compute at the same time.
Four processes that do their matrix multiplies on a 2-core host do not: they take turns on
the cores, a rank that waits frees its core for the others, and what a pipeline's structure
costs (its slowest stage pacing the others) never shows. So each part of the model does a
small real computation (real tensors, real autograd) and launches its kernels on a
:class:`DeviceClock`: a block's forward ``device_ms_per_block`` per microbatch of
``seq_len`` tokens (more for longer sequences), its backward ``BACKWARD_FACTOR`` times that
(inside autograd's backward: :func:`device_time`), the loss head ``HEAD_BLOCKS`` blocks'
worth and the embedding ``EMBEDDING_BLOCKS``. As on a GPU the launches return at once and
queue on the device; the job waits for the device (:meth:`DeviceClock.synchronize`, a
``time.sleep`` that uses no CPU) at the end of each microbatch's forward and backward, where
a real stage's output or gradient must be ready for the transfer. Everything else is real:
the processes, gloo's point-to-point transfers and all-reduce of real tensors, the 1F1B
schedule, the optimizer, the instrumentation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from stepwatch.app._pipeline_config import (
    BACKWARD_FACTOR,
    EMBEDDING_BLOCKS,
    HEAD_BLOCKS,
    PipelineJobConfig,
)


class DeviceClock:
    """One rank's device, a queue of kernels on the host's clock (``time.perf_counter``).

    A block's forward takes ``ms_per_block`` on a microbatch of ``seq_len`` tokens a
    sequence, in proportion to its tokens, times ``factor`` (a slower worker's device).
    :meth:`launch` queues a kernel: it starts when the kernels before it are done, or at its
    launch if the device was idle, and the host goes on. :meth:`synchronize` waits, asleep,
    until the device is done: the host's own work between launches overlaps the device's, as
    it does on a GPU, and a late host leaves the device idle.
    """

    def __init__(self, ms_per_block: float, seq_len: int) -> None:
        self.ms_per_block = ms_per_block
        self.seq_len = seq_len
        self.factor = 1.0
        self.spent_s = 0.0  # device time launched so far
        self.busy_until = 0.0  # when the device finishes what it was given
        self._paused = False

    def forward_s(self, blocks: float, tokens: int) -> float:
        """The device time of ``blocks`` blocks' forward on sequences of ``tokens`` tokens."""
        if self._paused:
            return 0.0
        return self.factor * self.ms_per_block / 1000.0 * blocks * tokens / self.seq_len

    def launch(self, seconds: float) -> None:
        """Queue kernels that take ``seconds`` on the device; returns at once."""
        if seconds <= 0.0:
            return
        self.spent_s += seconds
        self.busy_until = max(self.busy_until, time.perf_counter()) + seconds

    def synchronize(self) -> None:
        """Wait until the device is done with every kernel launched (asleep: off the CPU)."""
        remaining = self.busy_until - time.perf_counter()
        if remaining > 0.0:
            time.sleep(remaining)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Real compute only, no device time: a slower worker's repeated matrix multiplies."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False


class _DeviceTime(torch.autograd.Function):
    """Identity that launches device time in its forward and ``BACKWARD_FACTOR`` times as
    much in its backward (where autograd's backward reaches it: before the part it follows)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, clock: DeviceClock, seconds: float) -> Any:
        clock.launch(seconds)
        ctx.clock = clock
        ctx.seconds = BACKWARD_FACTOR * seconds
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.clock.launch(ctx.seconds)
        return grad, None, None


def device_time(tensor: torch.Tensor, clock: DeviceClock, blocks: float) -> Any:
    """``tensor``, with ``blocks`` blocks' forward device time launched on it (its sequence
    length, ``tensor.shape[1]``, scales it); in the backward, as many blocks' backward device
    time launched on its gradient."""
    seconds = clock.forward_s(blocks, tokens=tensor.shape[1])
    if seconds <= 0.0:
        return tensor
    return _DeviceTime.apply(tensor, clock, seconds)  # type: ignore[no-untyped-call]


class Block(torch.nn.Module):
    """A residual block, ``x + gelu(linear(x))`` (the real compute kept small: real tensors,
    real autograd), then its device time."""

    def __init__(self, hidden: int, clock: DeviceClock) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.clock = clock

    def forward(self, inputs: torch.Tensor) -> Any:
        outputs = inputs + torch.nn.functional.gelu(self.linear(inputs))
        return device_time(outputs, self.clock, 1.0)


class Stage(torch.nn.Module):
    """Stage ``stage`` of the model: the embedding on the first stage, ``blocks`` blocks (the
    first ``blocks_run`` of them run), the loss head's vocabulary projection on the last.

    ``head_blocks``: the loss head's device time, in blocks (``HEAD_BLOCKS``; 0 where it is
    spread over the stages); ``share_blocks``: device time every microbatch's forward adds
    beside its parts (a share of the loss head's, where it is spread).
    """

    def __init__(self, config: PipelineJobConfig, stage: int, blocks: int) -> None:
        super().__init__()
        hidden, vocab = config.hidden, config.vocab
        self.clock = DeviceClock(config.device_ms_per_block, config.seq_len)
        first, last = stage == 0, stage == config.pp - 1
        self.embed = torch.nn.Embedding(vocab, hidden) if first else None
        self.blocks = torch.nn.ModuleList(Block(hidden, self.clock) for _ in range(blocks))
        self.head = (
            torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab))
            if last
            else None
        )
        self.blocks_run = blocks
        self.head_blocks = HEAD_BLOCKS
        self.share_blocks = 0.0

    def forward(self, inputs: torch.Tensor) -> Any:
        states = inputs
        if self.embed is not None:
            states = device_time(self.embed(inputs), self.clock, EMBEDDING_BLOCKS)
        for block in self.blocks[: self.blocks_run]:
            states = block(states)
        if self.share_blocks:
            states = device_time(states, self.clock, self.share_blocks)
        if self.head is not None:
            states = device_time(self.head(states), self.clock, self.head_blocks)
        return states
