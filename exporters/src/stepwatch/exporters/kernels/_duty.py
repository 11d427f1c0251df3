"""What :class:`~stepwatch.exporters.kernels.TorchProfilerSource` decides and measures: its
defaults, its report (:class:`ProfilerDutyCycle`), a cycle's record, and the pure arithmetic
of its schedule (the grid's powers of two, the cost estimate's smoothing).

The schedule itself, its budget and why each rule is there: ``_torch_source``'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from stepwatch.exporters.kernels._summary import KernelEvent
from stepwatch.exporters.kernels._torch_backend import OpRecord

DEFAULT_OVERHEAD_BUDGET = 0.0004
"""0.04 % of step time, for everything stepwatch does off the training step (the op
histograms' cycles and, shared with them, a monitor's export work: ``share_budget``): what the
whole 0.1 % goal at a 20 ms step (issue 15) leaves after the training thread's share, measured
at ~0.044 % there with ``auto`` timing 1 step in 16 (~0.06 % at 1 in 8; auto-mode hooks and
``step()``: docs/exporters.md, "Cost"). It was 0.05 % (half
and half) until the twenty-second round, which made a cycle's drain on the export thread 2.3x
cheaper (the op reading and the self-time pass, bench/profiler_cost.py ``--drain-only``), so
the cycles come about as often as before within less budget. bench/offstep_cost.py measures
the part off the step, bench/step_segments.py the training thread's."""
DEFAULT_MIN_PERIOD_STEPS = 50
PROBES = 3
"""One-step probe cycles before the first full one; the first prediction is the smallest of
their estimates (``_torch_source``'s docstring)."""
DEFAULT_MAX_PERIOD_STEPS = 10_000
_BASELINE_STEPS = 64  # unprofiled step durations kept for the baseline median
_BASELINE_MIN_STEPS = 8  # fewer known steps: no cycle starts (nothing to compare against)
_COST_SMOOTHING = 0.5  # weight of the newest cycle in the cost estimate
_GRID_HYSTERESIS = 1.25  # the grid moves when the period moves 25 % past a power of two
_NEVER = 1 << 62
"""Step ends a disabled or closed source asks the recorder not to report (all of them)."""
_PAUSE_FACTOR = 8.0
"""A step longer than this many baseline steps is a pause of the training loop (evaluation,
a checkpoint, a stall, a loop that stopped calling ``step()``), not training: no profiler makes
a step 8x slower, and a pause must neither pay for cycles nor be charged to one."""


def _take_until(
    events: Sequence[KernelEvent], position: int, start_ns: int, end_ns: int
) -> tuple[list[KernelEvent], int]:
    """Events (sorted by start) starting in ``[start_ns, end_ns)`` from ``position`` on."""
    taken = []
    while position < len(events) and events[position].start_ns < end_ns:
        if events[position].start_ns >= start_ns:
            taken.append(events[position])
        position += 1
    return taken, position


class ProfilerDutyCycle(NamedTuple):
    """What :class:`TorchProfilerSource` decided, and what it measured.

    Attributes:
        active_steps: Consecutive steps profiled per cycle (the probe cycles profile one).
        period_steps: Steps from one cycle's start to the next: the fixed ``period_steps``, or
            the period that keeps the predicted cycle cost within the budget (clamped to the
            floor and ceiling).
        adaptive: Whether the period follows the measured cost.
        overhead_budget: Fraction of step time the profiler may cost (adaptive mode).
        cycles: Cycles finished so far (the warm-up and the probes included).
        baseline_step_s: Median of the recent unprofiled steps, or ``None`` before enough.
        cycle_cost_s: Predicted cost of one cycle (training thread + export thread), or
            ``None`` before the first cycle.
        training_cost_s: Last cycle's measured cost on the training thread (start, stop and
            the inflation of its profiled steps over the baseline).
        drain_cost_s: Last cycle's export-thread CPU time (reading and summarising its ops).
        spent_s: Total cost charged so far (both threads), the warm-up excluded.
        drain_spent_s: The export thread's part of ``spent_s`` (a measurement of that
            thread's CPU clock also holds it).
        warmup_cost_s: What the adaptive mode's first, one-step cycle cost (training thread
            and export thread), or ``None`` before it ran: the profiler's one-time set-up.
        expected_overhead: ``cycle_cost_s / (period_steps * baseline_step_s)``, the amortised
            share of step time the current decision costs, or ``None`` before it is known.
        within_budget: ``False`` when ``max_period_steps`` forced a cycle the credit did not
            cover (the ceiling wins over the budget).
        interrupted_cycles: Cycles during which the loop paused (a profiled step longer
            than 8 baseline steps): charged the predicted cost of their steps instead of the
            measured one, which is mostly the pause, and not used to predict.
        shared_spent_s: CPU time of other stepwatch work charged to the same budget
            (:meth:`TorchProfilerSource.charge`: a monitor's export work), not in ``spent_s``.
        shared_share: ``shared_spent_s`` as a share of the training time that earned budget
            (what is left of ``overhead_budget`` for cycles), or ``None`` before any.
    """

    active_steps: int
    period_steps: int
    adaptive: bool
    overhead_budget: float
    cycles: int
    baseline_step_s: float | None
    cycle_cost_s: float | None
    training_cost_s: float | None
    drain_cost_s: float | None
    spent_s: float
    expected_overhead: float | None
    within_budget: bool
    warmup_cost_s: float | None = None
    interrupted_cycles: int = 0
    drain_spent_s: float = 0.0
    shared_spent_s: float = 0.0
    shared_share: float | None = None


class _Cycle(NamedTuple):
    read_ops: Callable[[], Sequence[OpRecord]]
    start_ns: int
    boundaries: list[tuple[int, int]]  # (step index, step end ns), in order
    active_steps: int
    charged_from_ns: int  # just before the profiler started: its start cost is charged too
    warmup: bool = False  # the process's first profiler run: measured, not charged
    probe: bool = False  # a one-step probe of the cycle's cost (PROBES of them)
    interrupted: bool = False  # the loop paused inside it: dropped unread


def _power_of_two_at_least(value: float) -> int:
    """The smallest power of two >= ``value`` (1 for anything up to 1)."""
    if not value > 1.0:
        return 1
    return 1 << math.ceil(math.log2(value))


def _power_of_two_at_most(value: float) -> int:
    """The largest power of two <= ``value`` (1 for anything below 2)."""
    if not value >= 2.0:
        return 1
    return 1 << math.floor(math.log2(value))


def _longest_step_ns(cycle: _Cycle) -> int:
    """The longest profiled step of a cycle (the first one runs from the profiler's start)."""
    longest, previous = 0, cycle.start_ns
    for _, end_ns in cycle.boundaries:
        longest = max(longest, end_ns - previous)
        previous = end_ns
    return longest


def _smooth(previous: float | None, latest: float) -> float:
    """Cost estimate: an exponential average that follows any rise at once."""
    if previous is None:
        return latest
    return max(latest, (1.0 - _COST_SMOOTHING) * previous + _COST_SMOOTHING * latest)


def _seconds(value_ns: float | None) -> float | None:
    return None if value_ns is None else value_ns / 1e9
