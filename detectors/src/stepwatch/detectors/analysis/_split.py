"""Each rank's step split once into its own work and the time it waited for others.

Every rule that asks *who was late* or *what would the job have taken* reads this split, so
the answer does not depend on which rule asks. Producers lay out a step differently, and
the split follows what the data shows:

* **A communication phase nested inside another** (stepwatch's auto mode times the
  collective inside ``loss.backward()``; the phases add up to more than the step): the time
  outside the collective is the rank's own, the collective holds its wait.
* **A communication phase beside the others** (hand-timed loops, Megatron-style op timers
  where send/recv and collectives are ops of their own): the rank's own work is its other
  phases. What no phase covers is *untimed*: a pause between phases on one rank (a GC
  pause, a checkpoint write), or waiting that no timer records (a pipeline stage idling
  for its neighbours between its ops). The part a rank's peer group shows from its first
  windows on is structure (:attr:`Split.structural_untimed_s`) and counts as waiting;
  only untimed time beyond it is the rank's own.
* **No communication phase, backward timed** (the README's loop, framework timers): the
  collective and its wait are inside ``backward``
  (:func:`~._context.held_wait_phase`); the time outside it is the rank's own.
* **Other phases only**, or **step times only**: the whole step, less the group's
  structural untimed time; such data cannot tell a rank's work from its waiting, and the
  findings built on it say so (:attr:`Split.evidence`). In a pipeline (stage coordinates)
  whose phases leave its waits untimed, the phases alone: the waits are what no phase
  covers (:func:`~._context.held_wait_phase`).

``lead_s`` — the time a rank spends before its final wait in a step — is what paces a
synchronous job: in data parallelism every rank waits in the gradient all-reduce for the
rank with the largest lead; in a pipeline each replica waits for its slowest stage, and
the replicas for the slowest replica (ARGUS's arrival order; the what-if of Lin et al.,
OSDI'25).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stepwatch.detectors.analysis._groups import PeerGroups
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY, JobFrame
from stepwatch.detectors.stats._stats import BoolArray, FloatArray, nanmedian

#: What a split rests on (:attr:`Split.evidence`).
COMMUNICATION = "communication"
HELD = "held"
UNTIMED = "untimed"
STEPS = "steps"


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """Each rank's step split into its own work and its waiting, per window.

    Attributes:
        lead_s: ``(W, R)`` time per step before the rank's final wait: its own work plus
            untimed time beyond its group's structure (NaN where silent).
        untimed_s: ``(W, R)`` time per step in no phase, at least 0 (NaN without phases).
        structural_untimed_s: ``(R,)`` the untimed time of each rank's peer group in the
            frame's first windows: structure, counted as waiting.
        evidence: what the split rests on: ``communication`` (a communication phase),
            ``held`` (the phase that holds the collective), ``untimed`` (phases without
            either: work and waiting are told apart only by what no phase covers) or
            ``steps`` (step times only).
        waiting_phase: the phase that holds the wait (``communication`` or the held phase),
            ``None`` when the wait is timed by communication kernels, and for ``untimed``
            and ``steps``.
    """

    lead_s: FloatArray
    untimed_s: FloatArray
    structural_untimed_s: FloatArray
    evidence: str
    waiting_phase: str | None

    @property
    def tells_work_from_waiting(self) -> bool:
        """Whether the data times the wait itself (a communication or held phase)."""
        return self.evidence in (COMMUNICATION, HELD)


def split(
    frame: JobFrame,
    *,
    present: BoolArray,
    nested: bool,
    held: str | None,
    groups: PeerGroups,
    baseline: BoolArray,
) -> Split:
    """Split every rank's step (see the module docstring).

    Args:
        frame: the job's windows.
        present: ``(W, R)`` the rank finished a step in the window.
        nested: the communication phase lies inside another phase (the phases overlap it).
        held: the phase that holds the collective when there is no communication phase.
        groups: the peer groups (structure is a group's).
        baseline: ``(W,)`` the windows that define the structure.
    """
    step = frame.phase_step
    shape = step.shape
    phases = frame.phases
    communication = frame.phase(COMMUNICATION_CATEGORY)
    has_communication = communication is not None and bool(np.isfinite(communication).any())
    total = np.nansum(frame.phase_s, axis=2) if phases else np.zeros(shape)
    kernels = frame.category_s(COMMUNICATION_CATEGORY)
    if has_communication and communication is not None:
        index = phases.index(COMMUNICATION_CATEGORY)
        outside = frame.phase_base(index) - np.where(np.isfinite(communication), communication, 0)
        # Nested: the other phases already cover the collective; beside: they do not.
        others = total - np.nan_to_num(communication)
        covered = others if nested else total
        evidence, waiting = COMMUNICATION, COMMUNICATION_CATEGORY
    elif held is not None and not _kernels_time_wait(
        kernels, frame.phase_s[:, :, phases.index(held)]
    ):
        # The phase that holds the collective holds its wait; a profiler's communication
        # ops may not (torch.profiler's gloo ops on a CPU: a few % of it).
        index = phases.index(held)
        values = frame.phase_s[:, :, index]
        outside = frame.phase_base(index) - np.where(np.isfinite(values), values, 0.0)
        covered = total
        evidence, waiting = HELD, held
    elif bool(np.isfinite(kernels).any()):
        # No phase holds the collective, communication kernels time it: the time outside.
        outside = step - np.where(np.isfinite(kernels), kernels, 0.0)
        covered = total
        evidence, waiting = COMMUNICATION, None
    else:
        outside = step
        covered = total
        evidence, waiting = (UNTIMED if phases else STEPS), None
    with np.errstate(invalid="ignore"):
        untimed = np.where(present, np.clip(step - covered, 0.0, None), np.nan)
    if not phases:
        untimed = np.where(present, 0.0, np.nan)
    structural = structure(untimed, groups, baseline)
    waiting_column = None if waiting is None else phases.index(waiting)
    if waiting_column is not None and not nested:
        # Own work: the other phases; plus untimed time beyond the group's structure. (The
        # time outside the wait also holds that structure, and send/recv ops that run
        # beside compute make it smaller than the work itself.)
        own = total - np.nan_to_num(frame.phase_s[:, :, waiting_column])
        lead = own + np.clip(untimed - structural[None, :], 0.0, None)
    elif evidence == COMMUNICATION:
        lead = outside
    elif evidence == UNTIMED and groups.source == "coordinates" and groups.n_groups > 1:
        # A pipeline whose waits are untimed: a stage idles for its neighbours in no phase,
        # and a waiter's untimed time grows as much as a slow stage's phases do, so only
        # the phases are the rank's own (a pause between them is the stall rule's).
        lead = total
    else:
        lead = outside - structural[None, :]
    with np.errstate(invalid="ignore"):
        lead = np.where(present & (lead > 0), lead, np.nan)
    return Split(
        lead_s=np.asarray(lead, dtype=np.float64),
        untimed_s=np.asarray(untimed, dtype=np.float64),
        structural_untimed_s=structural,
        evidence=evidence,
        waiting_phase=waiting,
    )


def structure(values: FloatArray, groups: PeerGroups, baseline: BoolArray) -> FloatArray:
    """``(R,)`` each rank's group's median of ``(W, R)`` values over the baseline windows:
    what the group shows from its first windows on (0 where unknown)."""
    result = np.zeros(values.shape[1])
    rows = values[baseline] if baseline.any() else values[:0]
    if rows.shape[0] == 0:
        return result
    for group in range(groups.n_groups):
        members = groups.members(group)
        values = rows[:, members]
        if np.isfinite(values).any():
            result[members] = float(nanmedian(values.reshape(1, -1), axis=1)[0, 0])
    return result


#: Communication kernels time the wait when they hold at least this share of the phase that
#: holds the collective (NCCL kernels spin through the wait: most of it).
KERNEL_WAIT_SHARE = 0.1


def _kernels_time_wait(kernels: FloatArray, held: FloatArray) -> bool:
    """Whether communication kernel times hold the collective's wait, not just its launch."""
    both = np.isfinite(kernels) & np.isfinite(held) & (held > 0)
    if not both.any():
        return False
    return bool(np.median(kernels[both]) >= KERNEL_WAIT_SHARE * np.median(held[both]))
