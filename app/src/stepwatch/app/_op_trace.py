"""Op-level traces of real jobs, replayed as each rank's exporter would have reported them.

The format is that of the public artifact of Lin et al., "Understanding Stragglers in Large
Model Training Using What-if Analysis" (OSDI'25; ByteDance-Seed/StragglerAnalysis): a
Parquet table with one row per recorded operation of a Megatron job: ``rank``, ``dp_rank``,
``stage`` (pipeline rank), ``step``, ``optype`` (``forward-compute``, ``backward-send``,
``grads-reduce-scatter``, ``optimizer`` ...), ``start_ts`` (seconds from the step's start)
and ``duration`` (seconds). Its ops do not cover the whole step: waits that no op records
stay in the step and in no phase, as they do for anyone who times such a job.

A *layout* is how a user times the job (:data:`LAYOUTS`):

* ``phases``: each op's duration into its phase (compute → ``forward``/``backward``,
  send/recv and collectives → ``communication``, optimizer ops → ``optimizer``), the step
  from the rank's first op to the end of its last: Megatron's own timers, exported as
  phases;
* ``no-communication``: the same with the waits folded into the phase they happen in
  (forward send/recv → ``forward``; backward send/recv and the gradient collectives →
  ``backward``; the parameter all-gather → ``optimizer``), as the README's loop times a job;
* ``steps``: step times only.

One window per step; a trace's steps (a sample of the job's iterations) are laid one after
another from ``start_unix_nano``, each rank's window ending when its step does. Ranks sit
8 to a host (the traces name no host). Reading needs ``pyarrow``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import numpy.typing as npt

from stepwatch.core._errors import TraceFormatError
from stepwatch.detectors.simulation import RankPlacement, RankWindow, StepTiming

#: How a user may time the job (see the module docstring).
LAYOUTS = ("phases", "no-communication", "steps")
#: Start of the first window when none is given: 2026-11-21T20:00:00Z.
DEFAULT_START_UNIX_NANO = 1_795_291_200_000_000_000
RANKS_PER_HOST = 8

_COMPUTE = {"forward-compute": "forward", "backward-compute": "backward"}
_OPTIMIZER = {"optimizer": "optimizer", "optimizer-clip-main-grad": "optimizer"}
#: Communication ops, and the phase that holds each when no communication phase is timed.
_WAITS = {
    "forward-send": "forward",
    "forward-recv": "forward",
    "backward-send": "backward",
    "backward-recv": "backward",
    "grads-reduce-scatter": "backward",
    "layernorm-grads-all-reduce": "backward",
    "embedding-grads-all-reduce": "backward",
    "separate-grads-all-reduce": "backward",
    "params-all-gather": "optimizer",
}
_COLUMNS = ("rank", "dp_rank", "stage", "step", "optype", "start_ts", "duration")


def phase_of(optype: str, layout: str) -> str | None:
    """The phase an op's duration goes to in ``layout`` (``None``: no phase)."""
    if layout == "steps":
        return None
    if optype in _COMPUTE:
        return _COMPUTE[optype]
    if optype in _OPTIMIZER:
        return _OPTIMIZER[optype]
    if optype in _WAITS:
        return "communication" if layout == "phases" else _WAITS[optype]
    return None  # gc (recorded with no duration), first-op markers


@dataclasses.dataclass(frozen=True, eq=False)
class OpTrace:
    """A trace's steps per rank: ``(S, R)`` arrays of its steps and its ranks' ops.

    Attributes:
        ranks: ``(R,)`` global ranks, sorted.
        dp_ranks: ``(R,)`` data-parallel rank of each.
        stages: ``(R,)`` pipeline stage of each.
        steps: ``(S,)`` the step numbers, sorted.
        first_s: ``(S, R)`` start of the rank's first op, from the step's start.
        last_s: ``(S, R)`` end of its last op (NaN: the rank has no op in the step).
        optypes: the op types, the last axis of ``op_s``.
        op_s: ``(S, R, T)`` total duration of each op type in the step.
    """

    ranks: npt.NDArray[np.int64]
    dp_ranks: npt.NDArray[np.int64]
    stages: npt.NDArray[np.int64]
    steps: npt.NDArray[np.int64]
    first_s: npt.NDArray[np.float64]
    last_s: npt.NDArray[np.float64]
    optypes: tuple[str, ...]
    op_s: npt.NDArray[np.float64]

    def job(
        self,
        job_id: str,
        *,
        layout: str = "phases",
        world_size: int | None = None,
        start_unix_nano: int = DEFAULT_START_UNIX_NANO,
    ) -> OpTraceJob:
        """The trace as ranks timing it in ``layout`` would have reported it.

        Raises:
            ValueError: ``layout`` is not one of :data:`LAYOUTS`.
        """
        if layout not in LAYOUTS:
            raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")
        return OpTraceJob(
            trace=self,
            job_id=job_id,
            layout=layout,
            world_size=world_size or int(self.ranks.max()) + 1,
            start_unix_nano=start_unix_nano,
        )


def load_op_trace(path: str | Path) -> OpTrace:
    """Read a Parquet op trace (the what-if artifact's ``trace-*.parquet``).

    Raises:
        TraceFormatError: not Parquet, or a column is missing or empty (names the file).
    """
    import pyarrow.parquet as parquet

    try:
        table = parquet.read_table(path, columns=list(_COLUMNS))
    except (OSError, ValueError, KeyError) as exc:  # pyarrow's errors derive from these
        raise TraceFormatError(f"{path}: not an op trace ({exc})") from exc
    if table.num_rows == 0:
        raise TraceFormatError(f"{path}: no operations")
    column = {name: table.column(name).to_numpy(zero_copy_only=False) for name in _COLUMNS}
    ranks, rank_index = np.unique(column["rank"].astype(np.int64), return_inverse=True)
    steps, step_index = np.unique(column["step"].astype(np.int64), return_inverse=True)
    optypes, type_index = np.unique(column["optype"].astype(str), return_inverse=True)
    start = column["start_ts"].astype(np.float64)
    end = start + column["duration"].astype(np.float64)
    shape = (steps.size, ranks.size)
    first = np.full(shape, np.inf)
    last = np.full(shape, -np.inf)
    np.minimum.at(first, (step_index, rank_index), start)
    np.maximum.at(last, (step_index, rank_index), end)
    op_s = np.zeros((*shape, optypes.size))
    np.add.at(op_s, (step_index, rank_index, type_index), column["duration"].astype(np.float64))
    dp = np.zeros(ranks.size, dtype=np.int64)
    stage = np.zeros(ranks.size, dtype=np.int64)
    dp[rank_index] = column["dp_rank"].astype(np.int64)
    stage[rank_index] = column["stage"].astype(np.int64)
    return OpTrace(
        ranks=ranks,
        dp_ranks=dp,
        stages=stage,
        steps=steps,
        first_s=np.where(np.isfinite(first), first, np.nan),
        last_s=np.where(np.isfinite(last), last, np.nan),
        optypes=tuple(str(t) for t in optypes),
        op_s=op_s,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class OpTraceJob:
    """An :class:`OpTrace` as its ranks' exporters would have reported it, one window per
    step (a :class:`~stepwatch.app._replay.ReplayJob`)."""

    trace: OpTrace
    job_id: str
    layout: str
    world_size: int
    start_unix_nano: int

    @property
    def rank_ids(self) -> tuple[int, ...]:
        return tuple(int(r) for r in self.trace.ranks)

    @property
    def n_windows(self) -> int:
        return int(self.trace.steps.size)

    @property
    def step_s(self) -> npt.NDArray[np.float64]:
        """``(S, R)`` each rank's step: from its first op's start to its last op's end."""
        return np.asarray(self.trace.last_s - self.trace.first_s, dtype=np.float64)

    def placement(self, rank: int) -> RankPlacement:
        index = self._index(rank)
        return RankPlacement(
            rank=rank,
            host_name=f"node-{rank // RANKS_PER_HOST:04d}",
            local_rank=rank % RANKS_PER_HOST,
            dp_rank=int(self.trace.dp_ranks[index]),
            tp_rank=0,
            pp_rank=int(self.trace.stages[index]),
        )

    def observed(self, window: int, rank: int) -> RankWindow | None:
        """What ``rank`` reported for step ``window`` (``None``: it has no op in it)."""
        index = self._index(rank)
        step_s = self.step_s
        duration = float(step_s[window, index])
        if not math.isfinite(duration) or duration <= 0:
            return None
        starts = np.concatenate([[0.0], np.cumsum(np.nanmax(step_s, axis=1))])
        start = self.start_unix_nano + round(float(starts[window]) * 1e9)
        phases: dict[str, float] = {}
        for column, optype in enumerate(self.trace.optypes):
            phase = phase_of(optype, self.layout)
            value = float(self.trace.op_s[window, index, column])
            if phase is not None and value > 0:
                phases[phase] = phases.get(phase, 0.0) + value
        step = StepTiming(
            step_index=int(self.trace.steps[window]), duration_s=duration, phases_s=phases
        )
        return RankWindow(
            rank=rank,
            start_unix_nano=start,
            end_unix_nano=start + round(duration * 1e9),
            steps=(step,),
            kernel_durations_s={},
            idle_durations_s=[],
            sm_clock_hz=math.nan,
        )

    def _index(self, rank: int) -> int:
        found = np.flatnonzero(self.trace.ranks == rank)
        if found.size != 1:
            raise KeyError(f"rank {rank} is not in the trace")
        return int(found[0])
