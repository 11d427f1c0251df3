"""What each injected fault does to a simulated job, and the truth it leaves.

A fault changes the job's kernel array (what the exporters report) and the per-step parts
of the timing model (:class:`~._timeline.Parts`). Its change to the parts is kept as an
:class:`Effect`, so the simulator can time the same job without it: the counterfactual
that gives the fault's ground-truth cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from stepwatch.core._errors import ConfigError
from stepwatch.detectors.simulation._timeline import Parts
from stepwatch.detectors.simulation._topology import RANKS_PER_HOST, Topology
from stepwatch.detectors.simulation._truth import OUTSIDE, Fault, TruthFault
from stepwatch.detectors.stats._stats import BoolArray, FloatArray

#: Kinds whose fault names a kernel class (default ``gemm``).
KERNEL_KINDS = ("compute_straggler", "job_regression")
#: Share of a ``jit_stall`` rank's steps that stall.
STALL_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class Draws:
    """The healthy job: its kernel array and SM clock (changed in place by the faults that
    report there) and its parts (never changed: each fault's :class:`Effect` adds to them)."""

    parts: Parts
    kernel: FloatArray
    clock: FloatArray
    #: Each kernel class's (name, category, placement: ``fwdbwd``, ``optimizer``, ...).
    classes: tuple[tuple[str, str, str], ...]
    #: ``(steps, ranks)`` each rank's sequence-length factor (its replica's).
    sequence: FloatArray
    topology: Topology
    step_s: float
    fwdbwd_nominal: float

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.classes)

    def columns(self, *, category: str | None = None, placement: str | None = None) -> np.ndarray:
        """Indices of the kernel classes of ``category`` and/or ``placement``."""
        return np.array(
            [
                index
                for index, (_, kind, where) in enumerate(self.classes)
                if category in (None, kind) and placement in (None, where)
            ],
            dtype=np.intp,
        )


@dataclasses.dataclass(frozen=True)
class Effect:
    """One fault's change to the parts, and where and when it acted.

    Attributes:
        apply: the parts with the fault's change added.
        ranks: the ranks it affects (empty: job-wide).
        phase: where the detectors should localise it.
        kernel_class: the kernel class it slows, if any.
        onset_step: first step it acts on (a stall's first stall).
        stop_step: the step it stops at (exclusive).
        counterfactual: the parts as they would be if the fault's ranks behaved like their
            peers, from the parts without the fault; ``None``: the parts without it. A
            workload imbalance's what-if is balanced work (each replica the step's mean),
            not the job without the extra spread.
    """

    apply: Callable[[Parts], Parts]
    ranks: tuple[int, ...]
    phase: str | None
    kernel_class: str | None
    onset_step: int
    stop_step: int
    counterfactual: Callable[[Parts], Parts] | None = None


def _add(name: str, delta: FloatArray) -> Callable[[Parts], Parts]:
    return lambda parts: parts.replace(**{name: getattr(parts, name) + delta})


def _kernel_delta(
    draws: Draws, columns: np.ndarray, factor: FloatArray
) -> Callable[[Parts], Parts]:
    """Multiply kernel ``columns`` by ``factor`` (steps, ranks); the parts change alike."""
    kernel = draws.kernel
    before = kernel[..., columns]
    kernel[..., columns] = before * factor[..., None]
    grown = before * (factor[..., None] - 1.0)
    deltas: dict[str, FloatArray] = {}
    for part, placement in (("work", "fwdbwd"), ("optimizer", "optimizer"), ("other", "other")):
        chosen = np.isin(columns, draws.columns(placement=placement))
        if chosen.any():
            deltas[part] = grown[..., chosen].sum(axis=2)

    def apply(parts: Parts) -> Parts:
        return parts.replace(**{name: getattr(parts, name) + d for name, d in deltas.items()})

    return apply


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where and when a fault acts: its steps, its ranks and the cells of both."""

    draws: Draws
    fault: Fault
    rng: np.random.Generator
    when: BoolArray  # (steps, 1)
    rank_mask: BoolArray  # (ranks,)

    @property
    def hit(self) -> BoolArray:
        return self.when & self.rank_mask[None, :]

    @property
    def shape(self) -> tuple[int, int]:
        steps, world = self.draws.parts.data.shape
        return steps, world


class _Model(NamedTuple):
    """What a fault model returns: its change, where to localise it, and its what-if."""

    apply: Callable[[Parts], Parts]
    phase: str | None = None
    kernel_class: str | None = None
    onset_step: int | None = None  # None: the fault's start step
    counterfactual: Callable[[Parts], Parts] | None = None
    ranks: BoolArray | None = None  # None: the fault's ranks


def _slower_kernel(at: _Where) -> _Model:
    names = at.draws.names
    kernel_class = at.fault.kernel_class or "gemm"
    if kernel_class not in names:
        raise ConfigError(f"fault: unknown kernel class {kernel_class!r}")
    column = np.array([names.index(kernel_class)])
    apply = _kernel_delta(at.draws, column, np.where(at.hit, at.fault.severity, 1.0))
    return _Model(apply, phase="backward", kernel_class=kernel_class)


def _gpu_health(at: _Where) -> _Model:
    factor = np.where(at.hit, at.fault.severity, 1.0)
    apply = _kernel_delta(at.draws, at.draws.columns(category="compute"), factor)
    at.draws.clock[...] = at.draws.clock / factor
    return _Model(apply)


def _stage_imbalance(at: _Where) -> _Model:
    """More layers on the stage: forward and backward."""
    draws, (steps, _) = at.draws, at.shape
    fwdbwd = draws.columns(placement="fwdbwd")
    factor = np.where(at.hit, at.fault.severity, 1.0)
    added = (draws.kernel[..., fwdbwd] * (factor[..., None] - 1.0)).sum(axis=2)
    apply = _kernel_delta(draws, fwdbwd, factor)
    # The what-if of re-partitioning: the extra layers spread evenly over the stages of
    # each replica (every stage does the mean work; Lin et al., OSDI'25).
    topology = draws.topology
    spread_out = added.reshape(steps, topology.pp, topology.dp * topology.tp).mean(axis=1)
    shared = np.tile(spread_out, (1, topology.pp))

    def repartitioned(parts: Parts) -> Parts:
        return parts.replace(work=parts.work + shared)

    return _Model(apply, phase="backward", counterfactual=repartitioned)


def _workload_imbalance(at: _Where) -> _Model:
    """Each replica's work spread with log-sd log(severity), its mean kept: only the
    balance changes, not the total."""
    draws, (steps, world) = at.draws, at.shape
    sigma = math.log(at.fault.severity)
    spread = np.exp(at.rng.normal(0.0, sigma, size=(steps, draws.topology.dp)) - sigma**2 / 2.0)
    replica_of = (np.arange(world) // draws.topology.tp) % draws.topology.dp
    factor = np.where(at.hit, spread[:, replica_of], 1.0)
    apply = _kernel_delta(draws, draws.columns(placement="fwdbwd"), factor)
    total = draws.sequence * factor
    balance = np.where(at.hit, total.mean(axis=1, keepdims=True) / draws.sequence, 1.0)

    def balanced(parts: Parts) -> Parts:
        return parts.replace(work=parts.work * balance)

    return _Model(apply, phase="backward", counterfactual=balanced)


def _masked_straggler(at: _Where) -> _Model:
    extra = (at.fault.severity - 1.0) * at.draws.fwdbwd_nominal
    return _Model(_add("gap", np.where(at.hit, extra, 0.0)), phase="backward")


def _dataloader_stall(at: _Where) -> _Model:
    extra = (at.fault.severity - 1.0) * at.draws.step_s
    return _Model(_add("data", np.where(at.hit, extra, 0.0)), phase="data")


def _jit_stall(at: _Where) -> _Model:
    hit = at.hit
    stalls = hit & (at.rng.random(hit.shape) < STALL_SHARE)
    length = np.where(stalls, 10.0 * (at.fault.severity - 1.0) * at.draws.step_s, 0.0)
    outside = at.fault.phase == OUTSIDE
    stalled_steps = np.flatnonzero(stalls.any(axis=1))
    return _Model(
        _add("pause" if outside else "gap", length),
        phase=None if outside else "forward",
        # Random stalls: the slowdown begins with the first one.
        onset_step=int(stalled_steps[0]) if stalled_steps.size else None,
    )


def _pipeline_bubble(at: _Where) -> _Model:
    extra = (at.fault.severity - 1.0) * at.draws.fwdbwd_nominal
    return _Model(_add("extra_bubble", np.where(at.hit, extra, 0.0)))


def _link_degradation(at: _Where) -> _Model:
    """Every rank of the fault's hosts sends slower."""
    host_index = np.arange(at.shape[1]) // RANKS_PER_HOST
    rank_mask = np.isin(host_index, host_index[at.rank_mask])
    factor = np.where(at.when & rank_mask[None, :], at.fault.severity, 1.0)

    def apply(parts: Parts) -> Parts:
        return parts.replace(transfer=parts.transfer * factor)

    return _Model(apply, ranks=rank_mask)


def _rank_missing(at: _Where) -> _Model:
    hit = at.hit

    def apply(parts: Parts) -> Parts:
        return dataclasses.replace(parts, alive=parts.alive & ~hit)

    return _Model(apply)


#: Each kind the simulator can inject, and its model. Every kind a rule declares simulated
#: must be here (tests/detectors/test_kinds.py).
_MODELS: dict[str, Callable[[_Where], _Model]] = {
    **dict.fromkeys(KERNEL_KINDS, _slower_kernel),
    "gpu_health": _gpu_health,
    "stage_imbalance": _stage_imbalance,
    "workload_imbalance": _workload_imbalance,
    "masked_straggler": _masked_straggler,
    "dataloader_stall": _dataloader_stall,
    "jit_stall": _jit_stall,
    "pipeline_bubble": _pipeline_bubble,
    "link_degradation": _link_degradation,
    "rank_missing": _rank_missing,
}
#: The kinds :func:`apply_fault` has a model for.
FAULT_MODELS = frozenset(_MODELS)
#: Kinds that act on every rank: their truth names none.
_JOB_WIDE = ("job_regression", "workload_imbalance")


def apply_fault(draws: Draws, fault: Fault, rng: np.random.Generator) -> Effect:
    """Inject ``fault`` into ``draws.kernel`` (in place); its change to the parts."""
    model_of = _MODELS.get(fault.kind)
    if model_of is None:
        raise ConfigError(f"fault: the simulator cannot inject {fault.kind!r}")
    steps, world = draws.parts.data.shape
    stop = fault.end_step if fault.end_step is not None else steps
    step_index = np.arange(steps)[:, None]
    rank_mask = np.zeros(world, dtype=bool)
    rank_mask[list(fault.ranks)] = True
    if fault.kind in _JOB_WIDE or not fault.ranks:
        rank_mask[:] = True
    where = _Where(
        draws,
        fault,
        rng,
        when=(step_index >= fault.start_step) & (step_index < stop),
        rank_mask=rank_mask,
    )
    model = model_of(where)
    affected = model.ranks if model.ranks is not None else rank_mask
    return Effect(
        apply=model.apply,
        ranks=() if fault.kind in _JOB_WIDE else tuple(int(r) for r in np.flatnonzero(affected)),
        phase=model.phase,
        kernel_class=model.kernel_class,
        onset_step=fault.start_step if model.onset_step is None else model.onset_step,
        stop_step=stop,
        counterfactual=model.counterfactual,
    )


def fault_truth(
    fault: Fault,
    effect: Effect,
    job_step: FloatArray,
    counterfactual_step: FloatArray,
    *,
    hosts: tuple[str, ...],
    start_unix_nano: int,
    steps_per_window: int,
    step_s: float,
) -> TruthFault:
    """The truth of one fault, its cost from the job timed with and without it."""
    span = slice(effect.onset_step, max(effect.stop_step, effect.onset_step + 1))
    actual = float(np.nanmean(job_step[span])) if np.isfinite(job_step[span]).any() else 0.0
    without = counterfactual_step[span]
    baseline = float(np.nanmean(without)) if np.isfinite(without).any() else 0.0
    slowdown = max(1.0, actual / baseline) if baseline > 0 and actual > 0 else 1.0
    window_ns = round(steps_per_window * step_s * 1e9)
    step_ns = round(step_s * 1e9)
    onset = effect.onset_step
    return TruthFault(
        kind=fault.kind,
        ranks=effect.ranks,
        hosts=tuple(sorted({hosts[r] for r in effect.ranks}))
        if fault.kind == "link_degradation"
        else (),
        phase=effect.phase,
        kernel_class=effect.kernel_class,
        severity=fault.severity,
        start_unix_nano=start_unix_nano
        + (onset // steps_per_window) * window_ns
        + (onset % steps_per_window) * step_ns,
        end_unix_nano=None
        if fault.end_step is None
        else start_unix_nano + fault.end_step * step_ns,
        slowdown=slowdown,
    )
