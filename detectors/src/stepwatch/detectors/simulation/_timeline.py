"""The timing model of one simulated step: pipelines, the gradient all-reduce, late starts.

Every array is ``(steps, ranks)``. Per step and rank, before the model:

* ``data``: data loading (host side, device idle);
* ``work``: forward + backward kernel time (all micro-batches), ``gap``: host launch gaps;
* ``optimizer``, ``other``: after the all-reduce; ``transfer``: the all-reduce's own time;
* ``extra_bubble``: idle time a stage adds inside the pipeline (``pipeline_bubble``);
* ``pause``: time a rank spends at the *end* of the step outside every phase (a GC pause,
  a checkpoint write, a compile between phases): the rank starts its next step that late.

The model:

1. A *chain* is the ranks of one data-parallel replica and tensor-parallel index, one per
   pipeline stage (``pp = 1``: each rank alone). It starts when its last rank has loaded
   its data (each rank starting ``pause`` of the previous step late), then runs a 1F1B
   schedule of ``m`` micro-batches: ``T = sum_s c_s + (m - 1) max_s c_s`` with ``c_s`` the
   stage's busy time (``work + gap``) per micro-batch, so the slowest stage paces the
   pipeline. The fill and drain leave devices idle (bubbles); the other stages wait for
   the slowest one, and for the chain's start, in their point-to-point kernels, which spin
   while they wait (NCCL): communication kernel time, not idle.
2. Every rank then enters the gradient all-reduce; all wait for the last arrival (NCCL
   kernels spin: the wait is communication kernel time), then transfer, then optimizer.

Simplifications: tensor-parallel ranks are not coupled within a layer, and a rank's delay
carries into the next step only through its ``pause``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stepwatch.detectors.simulation._topology import Topology
from stepwatch.detectors.stats._stats import FloatArray


@dataclasses.dataclass(frozen=True)
class Parts:
    """The per-step, per-rank inputs of :func:`timeline` (seconds; see the module)."""

    data: FloatArray
    work: FloatArray
    gap: FloatArray
    optimizer: FloatArray
    other: FloatArray
    transfer: FloatArray
    extra_bubble: FloatArray
    pause: FloatArray
    alive: np.ndarray

    def replace(self, **changes: FloatArray) -> Parts:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Timings:
    """What :func:`timeline` computes, ``(steps, ranks)`` each; ``arrival`` is when the
    rank enters the all-reduce on the step's common clock."""

    step: FloatArray
    data: FloatArray
    forward: FloatArray
    backward: FloatArray
    communication: FloatArray
    optimizer: FloatArray
    other: FloatArray
    bubble: FloatArray
    idle: FloatArray
    arrival: FloatArray
    p2p_wait: FloatArray

    def job_step(self, parts: Parts) -> FloatArray:
        """``(steps,)`` the job's time per step: from the common start of a step to the
        end of its last rank (a rank's pause carries into the next step, through its late
        start: counted once). NaN where no rank is alive."""
        alive = parts.alive
        with np.errstate(invalid="ignore"):
            last = np.max(np.where(alive, self.arrival, -np.inf), axis=1)
            tail = parts.transfer + parts.optimizer + parts.other
            after = np.max(np.where(alive, tail, -np.inf), axis=1)
        result = last + after
        return np.where(np.isfinite(result), result, np.nan)


def chains(topology: Topology) -> np.ndarray:
    """``(ranks,)`` the chain (pipeline of one replica and tensor index) of each rank."""
    ranks = np.arange(topology.world_size)
    return ranks % (topology.dp * topology.tp)


def timeline(parts: Parts, topology: Topology, *, microbatches: int) -> Timings:
    """Step, phase, bubble and idle times of every rank (see the module)."""
    steps = parts.work.shape[0]
    late = np.zeros_like(parts.pause)
    late[1:] = parts.pause[:-1]  # a pause at the end of a step delays the next one
    chain = chains(topology)
    n_chains = topology.dp * topology.tp
    busy = parts.work + parts.gap
    per_micro = busy / microbatches
    ready = late + parts.data
    # Chain start (its last rank ready) and 1F1B length, per chain: ranks of a chain are
    # its stages, one per pipeline rank (rank = stage * n_chains + chain).
    ready_c = ready.reshape(steps, topology.pp, n_chains)
    micro_c = per_micro.reshape(steps, topology.pp, n_chains)
    start = ready_c.max(axis=1)
    length = micro_c.sum(axis=1) + (microbatches - 1) * micro_c.max(axis=1)
    chain_start = start[:, chain]
    chain_length = length[:, chain]
    own = per_micro
    # Device idle: the pipeline's fill and drain (the other stages' time per micro-batch)
    # plus any bubble a fault adds. Waiting for a slower stage, or for the chain's start,
    # is spent in the point-to-point kernels, which spin while they wait (NCCL).
    fill = micro_c.sum(axis=1)[:, chain] - own
    bubble = fill + parts.extra_bubble
    p2p_wait = (chain_start - ready) + (microbatches - 1) * (micro_c.max(axis=1)[:, chain] - own)
    arrival = chain_start + chain_length + parts.extra_bubble  # on the common clock
    last = np.max(np.where(parts.alive, arrival, -np.inf), axis=1, keepdims=True)
    last = np.where(np.isfinite(last), last, arrival)
    communication = (last - arrival) + parts.transfer
    held = bubble + parts.gap + p2p_wait  # inside forward and backward, 1:2 like the work
    forward = parts.work / 3.0 + held / 3.0
    backward = 2.0 * parts.work / 3.0 + 2.0 * held / 3.0
    step = (
        parts.data + forward + backward + communication + parts.optimizer + parts.other
    ) + parts.pause
    return Timings(
        step=step,
        data=parts.data,
        forward=forward,
        backward=backward,
        communication=communication,
        optimizer=parts.optimizer,
        other=parts.other,
        bubble=bubble,
        idle=parts.data + bubble + parts.gap,
        arrival=arrival,
        p2p_wait=p2p_wait,
    )
