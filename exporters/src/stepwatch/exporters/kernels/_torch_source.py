"""CPU kernel source: ATen ops recorded by ``torch.profiler``, in cycles paid from a budget.

Cost model (``bench/profiler_cost.py``, torch 2.13 CPU): while the profiler runs, every op pays
its RecordFunction callbacks (+45 % on the bench's op-dense 4 ms MLP step); starting it costs
~0.8 ms, stopping it ~2.9 µs per recorded op (Kineto materialises its result), and reading the
events through ``kineto_results.events()`` ~3.6 µs per op on the export thread (against ~60 µs
through ``prof.events()``). Profiling every step would cost tens of percent, so the source
profiles ``active_steps`` consecutive steps per cycle and spaces the cycles out.

How far apart is measured, not guessed. The source charges each cycle what it cost: on the
training thread, the wall time from just before the profiler started to just after it stopped
minus what those steps take unprofiled (the median of the recent unprofiled steps), plus the
export thread's CPU time spent reading and summarising the cycle. It earns
``overhead_budget`` × the time of every step and starts the next cycle only when the credit
covers the predicted cost of one (a token bucket), so over a run the profiler's cost stays
within the budget whatever the step looks like: op-dense CPU steps get long periods, steps of
a few large ops short ones, bounded by ``min_period_steps`` and ``max_period_steps``. The
first cycle is a one-step warm-up after ``min_period_steps`` steps: the first profiler run in
a process pays Kineto's one-time set-up (hundreds of milliseconds on a large model), which is
no guide to what later cycles cost, so it is reported (``warmup_cost_s``) and not charged to
the budget. Then come :data:`PROBES` one-step probes, the first ``min_period_steps`` later and
each of the others once the budget covers the cheapest one so far; each one's cost (the
profiler's start once, the rest scaled to ``active_steps``) estimates a full cycle, and the
smallest estimate is the first prediction. A probe is a single step, so whatever that step
meets besides the profiler (a slow step, another process on the core) is multiplied by
``active_steps`` in its estimate: with one probe, a step 10 ms slow on a real 2-rank job made
the first prediction ~50 ms, and at a 0.04 % budget the next cycle waited for the ceiling,
three minutes of steps without op histograms (issue 15, twenty-second round). A step is
only ever slowed by what it meets, so the smallest of several probes is the one to trust.
:attr:`TorchProfilerSource.duty_cycle` reports the decision. A fixed ``period_steps`` turns
the adaptation off (costs are still measured).

Every rank profiles the same steps. In a synchronous job (data parallel, a pipeline) a
profiled step that takes longer on one rank holds every rank up at the next collective, so
cycles at different steps on different ranks cost the job the sum of the ranks' budgets: N
times the budget on N ranks, the whole job at profiler speed once N × ``active_steps`` reaches
the period. So an adaptive cycle starts only where the step count is a multiple of its grid
(issue 15, twenty-second round), a power of two: for the warm-up and the probes the one at or
above ``min_period_steps`` (64 by default), for full cycles the one at or above the period the
budget pays for, kept until that period moves 25 % past it. Ranks start together and count the
same steps, so ranks whose costs differ by a little share the grid and profile the same steps,
and a rank whose period crossed a power of two profiles every second (fourth, ...) of them: the
grids nest, and the job pays for one rank's cycles. The price is the rounding: a cycle comes up
to twice as far apart as the budget would pay for (the token bucket still never spends more).
The ceiling then holds to the grid: a cycle the budget did not cover starts at the first step
of the grid at or past ``max_period_steps``. A fixed ``period_steps`` starts at the first step
boundary and is the same on every rank that starts together.

The budget is shared (``share_budget=True``, the default): a :class:`~stepwatch.exporters.
StepMonitor` charges it, through :meth:`TorchProfilerSource.charge`, the CPU time of its export
work too (building, encoding and sending each window, and the export thread's looks between
windows), measured on that thread's CPU clock; the cycles get what is left. So everything
stepwatch does off the training step, op histograms and export together, stays within
``overhead_budget`` of training time; with 10 s windows the export takes ~0.01–0.03 % of it
(docs/exporters.md, "Kernel and op histograms", its shared budget; how it came:
docs/history/exporters.md, "One budget off the training step").

Pauses of the training loop (evaluation, checkpoints, stalls: a step longer than 8 baseline
steps) are not training time. One that falls between cycles earns no more budget than 8
steps; one that falls inside a cycle would otherwise be charged to the profiler as hundreds of
milliseconds of "overhead" and push the period to its ceiling, so that cycle is charged the
predicted cost of its steps instead (the probe is simply run again) and counted in
``duty_cycle.interrupted_cycles``. Such a cycle's ops are dropped unread: the profiler recorded
the pause's work too (an evaluation pass's ops, say), which is not the training steps', and
reading it would cost the export thread in proportion to the pause (400 ms for a 1.7 s pause
on the overhead bench, charged to the budget, pinned the period at its ceiling).

Start/stop happen on the training thread at step boundaries (the profiler's state belongs to
the thread that started it); events are read on the export thread in
:meth:`TorchProfilerSource.drain`.

Timestamps: Kineto stamps CPU ops on the Unix-epoch clock in nanoseconds, the same clock as
``time.time_ns()``, which is the default ``clock_ns`` for step boundaries.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._protocols import KernelWindow
from stepwatch.exporters.kernels._duty import (
    _BASELINE_MIN_STEPS,
    _BASELINE_STEPS,
    _GRID_HYSTERESIS,
    _NEVER,
    _PAUSE_FACTOR,
    DEFAULT_MAX_PERIOD_STEPS,
    DEFAULT_MIN_PERIOD_STEPS,
    DEFAULT_OVERHEAD_BUDGET,
    PROBES,
    ProfilerDutyCycle,
    _Cycle,
    _longest_step_ns,
    _power_of_two_at_least,
    _power_of_two_at_most,
    _seconds,
    _smooth,
    _take_until,
)
from stepwatch.exporters.kernels._summary import (
    DEFAULT_TOP_K,
    KernelSummariser,
    self_time_events,
)
from stepwatch.exporters.kernels._torch_backend import (
    OpRecord,
    ProfilerBackend,
    TorchProfilerBackend,
)

_log = logging.getLogger(__name__)


class TorchProfilerSource:
    """A :class:`~stepwatch.exporters.KernelSource` of ATen CPU ops.

    Args:
        active_steps: Consecutive steps profiled per cycle.
        period_steps: Profile on a fixed schedule instead: a cycle starts every
            ``period_steps`` steps (``>= active_steps``; equal profiles every step), the first
            at the first step boundary. ``None`` (default): the period follows the measured
            cost (see the module docstring).
        overhead_budget: Share of step time the profiler may cost, e.g. ``0.0004`` = 0.04 %
            (the default; adaptive mode).
        share_budget: Whether what :meth:`charge` reports (a monitor's export work) is paid
            from the same budget (default), leaving the cycles the rest; ``False``: reported
            in ``duty_cycle.shared_spent_s`` only.
        min_period_steps: Floor of the adaptive period, and the steps before the probe cycle.
        max_period_steps: Ceiling of the adaptive period: a cycle starts at least this often
            even if the budget has not earned it (reported in ``duty_cycle.within_budget``).
        top_k: Kernel classes kept by name (see :class:`KernelSummariser`).
        backend: Starts / stops the profiler (default :class:`TorchProfilerBackend`).
        clock_ns: Clock of the step boundaries; must be the profiler's (Unix-epoch ns).
        cpu_clock_ns: CPU-time clock of the calling thread, for the export thread's cost.
        max_pending_cycles: Finished cycles kept for the next drain; older ones are dropped
            (counted in :attr:`dropped_cycles`) if the export thread falls behind.

    Raises:
        ConfigError: An option is out of range (names it).
    """

    def __init__(
        self,
        *,
        active_steps: int = 5,
        period_steps: int | None = None,
        overhead_budget: float = DEFAULT_OVERHEAD_BUDGET,
        min_period_steps: int = DEFAULT_MIN_PERIOD_STEPS,
        max_period_steps: int = DEFAULT_MAX_PERIOD_STEPS,
        top_k: int = DEFAULT_TOP_K,
        backend: ProfilerBackend | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        cpu_clock_ns: Callable[[], int] = time.thread_time_ns,
        max_pending_cycles: int = 4,
        share_budget: bool = True,
    ) -> None:
        if active_steps < 1:
            raise ConfigError(f"active_steps must be >= 1, got {active_steps}")
        if period_steps is not None and period_steps < active_steps:
            raise ConfigError(
                f"period_steps must be >= active_steps ({active_steps}), got {period_steps}"
            )
        if not 0.0 < overhead_budget < 1.0:
            raise ConfigError(f"overhead_budget must be in (0, 1), got {overhead_budget}")
        if period_steps is None and min_period_steps <= active_steps:
            raise ConfigError(
                f"min_period_steps must be > active_steps ({active_steps}), got {min_period_steps}"
            )
        if max_period_steps < min_period_steps:
            raise ConfigError(
                f"max_period_steps must be >= min_period_steps ({min_period_steps}), "
                f"got {max_period_steps}"
            )
        if max_pending_cycles < 1:
            raise ConfigError(f"max_pending_cycles must be >= 1, got {max_pending_cycles}")
        self._active_steps = active_steps
        self._fixed_period = period_steps
        self._budget = overhead_budget
        self._share_budget = share_budget
        self._min_period = min_period_steps
        self._max_period = max_period_steps
        self._backend: ProfilerBackend = backend if backend is not None else TorchProfilerBackend()
        self._clock_ns = clock_ns
        self._cpu_clock_ns = cpu_clock_ns
        self._summariser = KernelSummariser(top_k=top_k)
        self._pending: collections.deque[_Cycle] = collections.deque()
        self._max_pending = max_pending_cycles
        self._lock = threading.Lock()  # serialises drain() callers, never the training thread
        self._running: _Cycle | None = None
        self._disabled = False
        self._closed = False
        # Training-thread state.
        self._last_boundary_ns: int | None = None
        self._last_index: int | None = None  # the step index last reported
        self._recent_ns: collections.deque[int] = collections.deque(maxlen=_BASELINE_STEPS)
        self._baseline_ns: float | None = None
        self._steps_since_start = 0  # step boundaries since the last cycle started
        self._credit_ns = 0.0  # budget earned minus training-thread cost charged
        self._earned_ns = 0.0  # training time that earned budget (pauses capped)
        self._training_spent_ns = 0.0
        self._cycle_training_ns: float | None = None  # smoothed, per full cycle
        self._probe_estimates: list[float] = []  # each probe's full-cycle estimate
        self._probe_ns: float | None = None  # the cheapest probe's own training-thread cost
        self._grid_steps: int | None = None  # the full cycles' grid (_grid)
        self._last_training_ns: float | None = None
        self._cycles = 0
        self._warmup_ns: float | None = None
        self._forced = False
        self._interrupted = 0
        # Export-thread state (written only by drain(), read by the training thread).
        self._drain_spent_ns = 0
        self._cycle_drain_ns: float | None = None  # smoothed, per full cycle
        self._last_drain_ns: float | None = None
        self._shared_spent_ns = 0.0  # charge(): other stepwatch work paid from the budget
        self.dropped_cycles = 0
        """Finished cycles discarded because drain() fell behind (cumulative)."""

    # ------------------------------------------------------------------ training thread
    def on_step_end(self, step_index: int) -> int | None:
        """Step boundary (training thread): O(1) except when a cycle starts or stops.

        Returns how many of the following step ends need not be reported (the recorder skips
        them; the next call's ``step_index`` says how many there were): between cycles the
        source needs a call only near the next one (:meth:`_skip_ahead`), not on every step.
        """
        if self._disabled or self._closed:
            return _NEVER
        try:
            now = self._clock_ns()
            last_index, self._last_index = self._last_index, step_index
            steps = step_index - last_index if last_index is not None else 1
            if steps < 1:  # a caller that restarted its count: one step
                steps = 1
            running = self._running
            if running is not None:
                running.boundaries.append((step_index, now))
                self._steps_since_start += steps
                if len(running.boundaries) >= running.active_steps:
                    stopped = self._finish_cycle(running)
                    if (
                        self._fixed_period is not None
                        and not self._closed
                        and self._due(step_index)
                    ):
                        self._start_cycle(stopped)  # period == active_steps: back to back
                return None
            last = self._last_boundary_ns
            self._last_boundary_ns = now
            self._steps_since_start += steps
            if last is not None and now > last:
                elapsed = now - last
                if steps == 1:
                    self._recent_ns.append(elapsed)
                baseline = self._baseline_ns
                if baseline:
                    # A pause earns no budget, only training time does: a step earns at most
                    # 8 baseline steps, and several steps reported at once at most as many
                    # baseline steps plus 7 (one of them may have been a pause).
                    elapsed = min(elapsed, round((steps - 1 + _PAUSE_FACTOR) * baseline))
                self._credit_ns += self._budget * elapsed
                self._earned_ns += elapsed
            if self._closed:
                return _NEVER
            if not self._due(step_index):
                return self._skip_ahead(step_index)
            self._start_cycle(now)
        except Exception:  # never raise into the training loop
            _log.exception("torch.profiler kernel source failed; kernel collection disabled")
            self._disabled = True
            self._running = None
            return _NEVER
        return None

    def _skip_ahead(self, step_index: int) -> int:
        """Step ends that can go unreported before the next cycle could be due (0: none).

        Reporting a step costs the training thread a Python call (~1 % of the 0.1 % goal
        at a 20 ms step, docs/exporters.md); between cycles nothing happens but the budget
        growing. The next cycle is due at the fixed period, at the ceiling, or when the
        credit covers the predicted cycle: at the baseline step's pace that is ``until``
        steps away. Half of it is skipped (a step twice as slow earns twice the credit and
        still finds the call on time), less the last :data:`_BASELINE_STEPS`, which are
        reported one by one so the baseline median is fresh when the cycle starts. Cheap
        cycles (periods of a few hundred steps) skip little or nothing. An adaptive cycle starts
        only on its grid (:meth:`_grid`), so the next boundary on it is never skipped.
        """
        since = self._steps_since_start
        if self._fixed_period is not None:
            if self._cycles == 0:
                return 0
            return max(0, self._fixed_period - since - 1 - _BASELINE_STEPS)
        baseline = self._baseline_ns
        predicted = self._next_cycle_ns()
        if not baseline or predicted is None:
            return 0
        # Drained cycles only add to what is spent, so this available credit is an upper
        # bound, and the steps until the cycle a lower one.
        available = self._available_ns()
        by_credit = max(0.0, (predicted - available) / (self._budget * baseline))
        until = min(self._max_period - since, max(self._min_period - since, by_credit))
        # The first boundary on the grid at or past half of it: the steps before it, less the
        # baseline's, go unreported (the boundary itself is reported).
        grid = self._grid()
        earliest = step_index + 1 + int(until / 2)
        boundary = -(-earliest // grid) * grid  # a multiple of grid: the end of step boundary-1
        return max(0, boundary - 1 - step_index - 1 - _BASELINE_STEPS)

    def _due(self, step_index: int) -> bool:
        """Whether a cycle starts at this boundary (the end of step ``step_index``)."""
        since = self._steps_since_start
        if self._fixed_period is not None:
            return self._cycles == 0 or since >= self._fixed_period
        if since < self._min_period or len(self._recent_ns) < _BASELINE_MIN_STEPS:
            return False
        grid = self._grid()
        if (step_index + 1) % grid != 0:
            return False  # between two steps of the grid: every rank waits for the same one
        predicted = self._next_cycle_ns()
        if predicted is None:  # the first probe
            return True
        # Cycles not drained yet will cost the export thread too: reserve for them now.
        drain = self._cycle_drain_ns
        unpaid = len(self._pending) * drain if drain is not None else 0.0
        if self._available_ns() - unpaid >= predicted:
            return True
        if since >= self._max_period:  # the first step on the grid at or past the ceiling
            self._forced = True
            return True
        return False

    def _grid(self) -> int:
        """Adaptive cycles start only where the step count is a multiple of this, a power of
        two: the same steps on every rank (module docstring, "Every rank profiles the same
        steps"). The warm-up and the probes: the one at or above ``min_period_steps``; full
        cycles: the one at or above the period the budget pays for (:meth:`_needed_period`),
        kept until that period moves 25 % past it (ranks whose costs differ by a hair keep
        the same grid), within ``min_period_steps`` and ``max_period_steps``. The second and
        third probes: the one at or above the steps the budget takes to pay for the next probe
        (each rank's own credit would put them on different steps)."""
        if self._probing():
            return self._probe_grid()
        needed = self._needed_period()
        grid = self._grid_for(needed)
        if needed is not None:
            self._grid_steps = grid
        return grid

    def _probe_grid(self) -> int:
        """:meth:`_grid` while probing: ``min_period_steps``' power of two before a probe's
        cost is known, then the power of two at or above the steps that pay for the next."""
        floor = _power_of_two_at_least(self._min_period)
        predicted = self._next_cycle_ns()
        paid = self._steps_paying(predicted) if predicted is not None else None
        if paid is None:
            return floor
        ceiling = max(floor, _power_of_two_at_most(self._max_period))
        return min(ceiling, max(floor, _power_of_two_at_least(paid + 1)))

    def _grid_for(self, needed: float | None) -> int:
        """:meth:`_grid` for a needed period (None: the warm-up's and the probes'), with no
        state changed (any thread)."""
        floor = _power_of_two_at_least(self._min_period)
        if needed is None:
            return floor
        ceiling = max(floor, _power_of_two_at_most(self._max_period))
        current = self._grid_steps
        low = _power_of_two_at_least(needed / _GRID_HYSTERESIS)
        high = _power_of_two_at_least(needed * _GRID_HYSTERESIS)
        if current is None or not low <= current <= high:
            current = _power_of_two_at_least(needed)
        return min(ceiling, max(floor, current))

    def _needed_period(self) -> float | None:
        """Steps from one full cycle's start to the next that the budget pays for (what is
        left of it after shared work), or None before a prediction and a baseline."""
        predicted = self._predicted_cycle_ns()
        paid = self._steps_paying(predicted) if predicted is not None else None
        return None if paid is None else paid + self._active_steps

    def _steps_paying(self, cost_ns: float) -> float | None:
        """Steps whose credit pays ``cost_ns`` (what is left of the budget after shared
        work; the ceiling when nothing is left), or None before a baseline."""
        baseline = self._baseline_ns
        if baseline is None and len(self._recent_ns) >= _BASELINE_MIN_STEPS:
            baseline = statistics.median(self._recent_ns)
        if not baseline:
            return None
        earned = self._earned_ns
        shared = self._shared_spent_ns / earned if earned > 0 and self._share_budget else 0.0
        left = self._budget - shared
        if left <= 0:
            return float(self._max_period)
        return cost_ns / (left * baseline)

    def _start_cycle(self, now: int) -> None:
        active = self._active_steps
        warmup = self._fixed_period is None and self._cycles == 0
        probe = not warmup and self._probing()
        if warmup or probe:
            active = 1  # the warm-up and the probes: the cheapest cycle there is
        self._baseline_ns = statistics.median(self._recent_ns) if self._recent_ns else None
        self._steps_since_start = 0
        self._backend.start()
        started = self._clock_ns()
        self._running = _Cycle(list, started, [], active, now, warmup, probe=probe)

    def _finish_cycle(self, running: _Cycle) -> int:
        """Stop the profiler, queue the cycle, charge its cost; returns the time after stop."""
        self._running = None
        read_ops = self._backend.stop()
        stopped = self._clock_ns()
        self._last_boundary_ns = stopped  # the next step is timed from here
        steps = len(running.boundaries)
        baseline = self._baseline_ns if self._baseline_ns is not None else 0.0
        paused = bool(baseline) and _longest_step_ns(running) > _PAUSE_FACTOR * baseline
        interrupted = paused and not running.warmup
        self._pending.append(running._replace(read_ops=read_ops, interrupted=interrupted))
        while len(self._pending) > self._max_pending:
            self._pending.popleft()
            self.dropped_cycles += 1
        cost = max(0.0, (stopped - running.charged_from_ns) - steps * baseline)
        self._cycles += 1
        if running.warmup:  # one-time set-up: reported, neither charged nor a prediction
            self._warmup_ns = cost
            self._last_training_ns = cost
            return stopped
        if interrupted:
            # The loop paused inside the cycle: the measured time is mostly the pause's. Charge
            # what its steps are predicted to cost (nothing for the probe, which runs again at
            # the next boundary) and keep the prediction as it was. Its ops are dropped unread
            # (see drain()).
            self._interrupted += 1
            predicted = self._cycle_training_ns
            cost = 0.0 if predicted is None else predicted * min(1.0, steps / self._active_steps)
            self._credit_ns += self._budget * steps * baseline - cost
            self._earned_ns += steps * baseline
            self._training_spent_ns += cost
            self._last_training_ns = cost
            return stopped
        self._credit_ns += self._budget * steps * baseline - cost
        self._earned_ns += steps * baseline
        self._training_spent_ns += cost
        self._last_training_ns = cost
        # Scaled to a full cycle: the profiler's start is paid once per cycle, the rest (the
        # profiled steps' inflation and the stop, which grows with the ops recorded) per step.
        # Exact for full cycles; for the one-step probe an estimate that errs high.
        start_cost = min(cost, max(0, running.start_ns - running.charged_from_ns))
        full_cycle = start_cost + (cost - start_cost) * self._active_steps / steps
        if running.probe:
            # The smallest probe so far: a step is only slowed by what it meets.
            self._probe_estimates.append(full_cycle)
            if self._probe_ns is None or cost < self._probe_ns:
                self._probe_ns = cost
            self._cycle_training_ns = min(self._probe_estimates)
        else:
            self._cycle_training_ns = _smooth(self._cycle_training_ns, full_cycle)
        return stopped

    def _probing(self) -> bool:
        """Whether the next cycle is a probe (adaptive mode, fewer than PROBES measured)."""
        return self._fixed_period is None and len(self._probe_estimates) < PROBES

    def _next_cycle_ns(self) -> float | None:
        """What the next cycle is predicted to cost: a probe's own cost while probing (None
        before the first), then a full cycle's."""
        predicted = self._predicted_cycle_ns()
        if predicted is None or not self._probing() or self._probe_ns is None:
            return predicted
        drain = self._cycle_drain_ns
        return self._probe_ns + (drain / self._active_steps if drain is not None else 0.0)

    def _available_ns(self) -> float:
        """Credit left for cycles: earned, less what cycles and shared work have spent."""
        shared = self._shared_spent_ns if self._share_budget else 0.0
        return self._credit_ns - self._drain_spent_ns - shared

    def _predicted_cycle_ns(self) -> float | None:
        training = self._cycle_training_ns
        if training is None:
            return None
        drain = self._cycle_drain_ns
        return training + (drain if drain is not None else 0.0)

    # ------------------------------------------------------------------ export thread
    def charge(self, cpu_ns: float) -> None:
        """Other stepwatch work's CPU time, paid from this budget (``share_budget``).

        A :class:`~stepwatch.exporters.StepMonitor` calls it after each export with that
        export's CPU time (its drain of this source excluded, which :meth:`drain` charges
        itself) and the export thread's since the previous one. Never raises.
        """
        if cpu_ns > 0:
            self._shared_spent_ns += cpu_ns

    def drain(self) -> KernelWindow:
        """Ops of the cycles finished since the last drain, as one window (export thread).

        Its CPU time is charged to the budget: each cycle's reading (which also predicts the
        next cycles' cost) and the rest of the call (the summary), the warm-up's excepted.
        """
        with self._lock:
            called = self._cpu_clock_ns()
            uncharged = 0  # the cycles' own readings, charged (or not) one by one below
            while self._pending:
                cycle = self._pending.popleft()
                if cycle.interrupted:
                    # Everything the pause ran (an evaluation pass, a checkpoint) was recorded
                    # too: reading it would cost the export thread in proportion to the pause,
                    # and its ops are not training steps' ops. Dropped unread.
                    continue
                started = self._cpu_clock_ns()
                try:
                    ops = cycle.read_ops()
                    self._add_cycle(cycle, ops)
                except Exception:
                    _log.exception("reading torch.profiler results failed; cycle dropped")
                cost = max(0, self._cpu_clock_ns() - started)
                uncharged += cost
                self._last_drain_ns = float(cost)
                if cycle.warmup:
                    self._warmup_ns = (self._warmup_ns or 0.0) + cost
                    continue
                self._drain_spent_ns += cost
                per_cycle = cost * self._active_steps / max(1, len(cycle.boundaries))
                self._cycle_drain_ns = _smooth(self._cycle_drain_ns, per_cycle)
            window = self._summariser.drain()
            self._drain_spent_ns += max(0, self._cpu_clock_ns() - called - uncharged)
            return window

    def _add_cycle(self, cycle: _Cycle, ops: Sequence[OpRecord]) -> None:
        own, top = self_time_events(ops)
        own_position = top_position = 0
        step_start = cycle.start_ns
        for _step_index, step_end in cycle.boundaries:
            events, own_position = _take_until(own, own_position, step_start, step_end)
            busy, top_position = _take_until(top, top_position, step_start, step_end)
            self._summariser.add_step(events, start_ns=step_start, end_ns=step_end, busy=busy)
            step_start = step_end

    # ------------------------------------------------------------------ reporting
    @property
    def duty_cycle(self) -> ProfilerDutyCycle:
        """The current schedule decision and the measured costs (any thread)."""
        baseline = self._baseline_ns
        if baseline is None and len(self._recent_ns) >= _BASELINE_MIN_STEPS:
            baseline = statistics.median(list(self._recent_ns))
        predicted = self._predicted_cycle_ns()
        earned = self._earned_ns
        shared_share = self._shared_spent_ns / earned if earned > 0 else None
        if self._fixed_period is not None:
            period = self._fixed_period
        else:
            period = self._grid_for(self._needed_period())
        expected = predicted / (period * baseline) if predicted is not None and baseline else None
        return ProfilerDutyCycle(
            active_steps=self._active_steps,
            period_steps=period,
            adaptive=self._fixed_period is None,
            overhead_budget=self._budget,
            cycles=self._cycles,
            baseline_step_s=_seconds(baseline),
            cycle_cost_s=_seconds(predicted),
            training_cost_s=_seconds(self._last_training_ns),
            drain_cost_s=_seconds(self._last_drain_ns),
            spent_s=(self._training_spent_ns + self._drain_spent_ns) / 1e9,
            expected_overhead=expected,
            within_budget=not self._forced,
            warmup_cost_s=_seconds(self._warmup_ns),
            interrupted_cycles=self._interrupted,
            drain_spent_s=self._drain_spent_ns / 1e9,
            shared_spent_s=self._shared_spent_ns / 1e9,
            shared_share=shared_share,
        )

    def close(self) -> None:
        """Stop a running cycle (its partial data is discarded) and collect nothing more."""
        self._closed = True
        if self._running is not None:
            self._running = None
            try:
                self._backend.stop()
            except Exception:
                _log.exception("stopping torch.profiler failed")
