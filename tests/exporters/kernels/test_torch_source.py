"""The torch.profiler CPU source: duty cycle, step attribution, never raising."""

from __future__ import annotations

import itertools
import logging
import math
import random
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from stepwatch.core._errors import ConfigError
from stepwatch.exporters.kernels import OpRecord, TorchProfilerSource, _torch_source
from stepwatch.exporters.kernels._torch_source import (
    DEFAULT_MIN_PERIOD_STEPS,
    PROBES,
    _power_of_two_at_least,
)

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # a failure prints its example


class ScriptedBackend:
    """A real :class:`ProfilerBackend` that replays scripted ops per cycle."""

    def __init__(self, cycles: Sequence[Sequence[OpRecord]]) -> None:
        self.cycles = list(cycles)
        self.starts = 0
        self.stops = 0
        self.running = False

    def start(self) -> None:
        assert not self.running
        self.running = True
        self.starts += 1

    def stop(self) -> Callable[[], Sequence[OpRecord]]:
        assert self.running
        self.running = False
        self.stops += 1
        ops = self.cycles.pop(0) if self.cycles else []
        return lambda: ops


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns


def test_duty_cycle_starts_and_stops_on_step_boundaries() -> None:
    backend = ScriptedBackend([])
    clock = FakeClock()
    source = TorchProfilerSource(active_steps=2, period_steps=5, backend=backend, clock_ns=clock)
    running = []
    for step in range(12):
        clock.now_ns += 1000
        source.on_step_end(step)
        running.append(backend.running)
    # Cycles begin after steps 0, 5, 10 and cover two steps each.
    assert running == [True, True, False, False, False, True, True, False, False, False, True, True]
    assert backend.starts == 3 and backend.stops == 2


def test_ops_are_attributed_to_steps_by_self_time() -> None:
    clock = FakeClock()
    ops = [
        # step 1 (1000, 2000]: linear wraps addmm; relu alone.
        OpRecord("aten::linear", 1100, 1500, 7),
        OpRecord("aten::addmm", 1150, 1450, 7),
        OpRecord("aten::relu", 1600, 1700, 7),
        # step 2 (2000, 3000]
        OpRecord("aten::mm", 2100, 2900, 7),
    ]
    backend = ScriptedBackend([ops])
    source = TorchProfilerSource(active_steps=2, period_steps=2, backend=backend, clock_ns=clock)
    for step, now in enumerate((1000, 2000, 3000)):
        clock.now_ns = now
        source.on_step_end(step)
    window = source.drain()
    gemm = sorted(window.durations_s[("gemm", "compute")])
    assert gemm == pytest.approx([100e-9, 300e-9, 800e-9], abs=1e-9)  # linear self, addmm, mm
    assert window.durations_s[("relu", "compute")] == pytest.approx([100e-9], abs=1e-9)
    # Idle per step: step 1 busy 400 + 100 of 1000; step 2 busy 800 of 1000.
    assert window.idle_durations_s == pytest.approx((500e-9, 200e-9), abs=1e-9)
    assert source.drain().durations_s == {}


def test_backend_failure_disables_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(ScriptedBackend):
        def start(self) -> None:
            raise RuntimeError("profiler already running")

    source = TorchProfilerSource(active_steps=1, period_steps=1, backend=Broken([]))
    with caplog.at_level(logging.ERROR):
        for step in range(5):
            source.on_step_end(step)
    assert sum("kernel collection disabled" in r.message for r in caplog.records) == 1
    assert source.drain().durations_s == {}


def test_slow_export_thread_drops_old_cycles() -> None:
    backend = ScriptedBackend([[OpRecord("aten::mm", 1, 2, 0)]] * 10)
    source = TorchProfilerSource(
        active_steps=1, period_steps=1, backend=backend, max_pending_cycles=2
    )
    for step in range(8):
        source.on_step_end(step)
    assert source.dropped_cycles == 5
    source.close()
    assert not backend.running


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"active_steps": 0}, "active_steps"),
        ({"active_steps": 5, "period_steps": 4}, "period_steps"),
        ({"max_pending_cycles": 0}, "max_pending_cycles"),
        ({"overhead_budget": 0.0}, "overhead_budget"),
        ({"overhead_budget": 1.5}, "overhead_budget"),
        ({"active_steps": 5, "min_period_steps": 5}, "min_period_steps"),
        ({"min_period_steps": 100, "max_period_steps": 99}, "max_period_steps"),
    ],
)
def test_config_errors(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TorchProfilerSource(backend=ScriptedBackend([]), **kwargs)


def test_real_torch_profiler_on_a_training_loop() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
    source = TorchProfilerSource(active_steps=3, period_steps=4)
    windows = []

    def export_thread() -> None:
        windows.append(source.drain())

    for step in range(8):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        source.on_step_end(step)
    thread = threading.Thread(target=export_thread)
    thread.start()
    thread.join()
    source.close()
    (window,) = windows
    classes = {name for name, _ in window.durations_s}
    assert {"gemm", "relu"} <= classes
    # Steps 1-3 and 5-7 profiled (two cycles of three steps): one idle value per step.
    assert len(window.idle_durations_s) == 6
    forward_gemms = len(window.durations_s[("gemm", "compute")])
    assert forward_gemms >= 6 * 2  # at least two linear layers per profiled step


def test_step_monitor_exports_cpu_kernels() -> None:
    """The source plugs into StepMonitor: kernel histograms ride in the step windows."""
    from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

    from stepwatch.core import _schema
    from stepwatch.exporters import StepMonitor

    class Recording:
        def __init__(self) -> None:
            self.windows: list[MetricsData] = []

        def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000) -> Any:
            self.windows.append(metrics_data)
            return MetricExportResult.SUCCESS

        def shutdown(self, timeout_millis: float = 30_000) -> None:
            pass

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    x = torch.randn(4, 8)
    exporter = Recording()
    source = TorchProfilerSource(active_steps=2, period_steps=2)
    monitor = StepMonitor(
        job_id="j",
        rank=0,
        world_size=1,
        host_name="h",
        exporter=exporter,
        kernel_source=source,
        start=False,
    )
    for _ in range(5):
        with monitor.step():
            model(x).sum().backward()
    monitor.export_now()
    monitor.close()
    names = {
        metric.name: metric
        for window in exporter.windows
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
    }
    assert _schema.KERNEL_DURATION in names
    classes = {
        point.attributes[_schema.KERNEL_CLASS]
        for point in names[_schema.KERNEL_DURATION].data.data_points
    }
    assert "gemm" in classes


# ---------------------------------------------------------------- the overhead budget
class SimulatedTraining:
    """A fake clock, CPU clock and :class:`ProfilerBackend` in one: a seeded training loop.

    Steps take ``step_ns`` (±``jitter`` uniform, seeded); a profiled step takes
    ``1 + inflation`` times as long; starting and stopping the profiler take ``start_ns`` /
    ``stop_ns`` on the training thread; reading one profiled step's ops takes ``read_ns`` of
    export-thread CPU. Tracks the true cost so tests can hold the source to its budget.
    ``slow_cycles`` maps the index of a cycle (0: the first, the warm-up) to ns its first
    profiled step takes longer for reasons of its own (another process on the core): the
    step's time, not the profiler's cost.
    """

    def __init__(
        self,
        *,
        step_ns: int = 4_000_000,
        inflation: float = 0.45,
        start_ns: int = 800_000,
        stop_ns: int = 500_000,
        read_ns: int = 600_000,
        jitter: float = 0.05,
        seed: int = 0,
        honour_skips: bool = True,
        slow_cycles: dict[int, int] | None = None,
    ) -> None:
        self.step_ns, self.inflation, self.jitter = step_ns, inflation, jitter
        self.slow_cycles = slow_cycles or {}
        self.start_ns, self.stop_ns, self.read_ns = start_ns, stop_ns, read_ns
        self.random = random.Random(seed)
        self.now_ns = 1_700_000_000 * 10**9
        self.cpu_ns = 0
        self.running = False
        self.cycle_steps: list[int] = []  # profiled steps per finished cycle
        self.started_after: list[int] = []  # steps finished when each cycle started
        self.steps = 0
        self.base_ns = 0.0  # what the steps would have taken without the profiler
        self.cost_ns = 0.0  # what the profiler added (both threads)
        self._profiled = 0
        self._ops: list[OpRecord] = []  # one op in the middle of each profiled step
        self.honour_skips = honour_skips  # skip the step ends the source says it need not see
        self.skip = 0
        self.told = 0  # step ends the source was told of

    # Clocks.
    def clock_ns(self) -> int:
        return self.now_ns

    def cpu_clock_ns(self) -> int:
        return self.cpu_ns

    # ProfilerBackend.
    def start(self) -> None:
        assert not self.running
        self.running = True
        self.started_after.append(self.steps)
        self._profiled = 0
        self._ops = []
        self.now_ns += self.start_ns
        self.cost_ns += self.start_ns

    def stop(self) -> Callable[[], Sequence[OpRecord]]:
        assert self.running
        self.running = False
        self.cycle_steps.append(self._profiled)
        self.now_ns += self.stop_ns
        self.cost_ns += self.stop_ns
        profiled, ops = self._profiled, self._ops

        def read() -> Sequence[OpRecord]:
            self.cpu_ns += self.read_ns * profiled
            self.cost_ns += self.read_ns * profiled
            return ops

        return read

    def run(
        self, source: TorchProfilerSource, steps: int, *, drain_every: int | None = 250
    ) -> None:
        """Train ``steps`` steps, draining every ``drain_every`` and at the end (None: never)."""
        for _ in range(steps):
            base = self.step_ns * (1.0 + self.random.uniform(-self.jitter, self.jitter))
            extra = base * self.inflation if self.running else 0.0
            if self.running and self._profiled == 0:
                base += self.slow_cycles.get(len(self.cycle_steps), 0)
            self._profiled += self.running
            if self.running:
                middle = self.now_ns + round((base + extra) / 2)
                self._ops.append(OpRecord("aten::mm", middle, middle + 1000, 1))
            self.now_ns += round(base + extra)
            self.base_ns += base
            self.cost_ns += extra
            self.steps += 1
            if self.skip > 0:  # as the recorder does: the source asked not to be told
                self.skip -= 1
            else:
                self.told += 1
                answer = source.on_step_end(self.steps - 1)
                self.skip = answer if self.honour_skips and answer else 0
            if drain_every is not None and self.steps % drain_every == 0:
                source.drain()
        if drain_every is not None:
            source.drain()

    def cycle_cost_ns(self, active_steps: int) -> float:
        """True cost of one full cycle."""
        return (
            self.start_ns
            + self.stop_ns
            + active_steps * (self.step_ns * self.inflation + self.read_ns)
        )


def _adaptive(sim: SimulatedTraining, **options: Any) -> TorchProfilerSource:
    return TorchProfilerSource(
        backend=sim, clock_ns=sim.clock_ns, cpu_clock_ns=sim.cpu_clock_ns, **options
    )


def test_a_one_step_warm_up_then_a_one_step_probe_after_the_floor() -> None:
    # The first run pays Kineto's one-time set-up: a warm-up is measured, not charged.
    sim = SimulatedTraining(start_ns=300_000_000, jitter=0.0)
    source = _adaptive(sim, active_steps=5, min_period_steps=20)
    assert source.duty_cycle.cycles == 0 and source.duty_cycle.cycle_cost_s is None
    sim.run(source, 35)
    # After the floor, on the grid: the first multiple of 32 (the power of two at or above
    # the floor) past 20 steps, the same step on every rank.
    assert sim.started_after == [32] and sim.cycle_steps == [1]
    warm = source.duty_cycle
    assert warm.cycles == 1 and warm.cycle_cost_s is None and warm.spent_s == 0
    assert warm.warmup_cost_s is not None and warm.warmup_cost_s >= 0.3
    sim.start_ns = 800_000  # set up: later starts cost what they usually do
    sim.run(source, 32)
    assert sim.started_after == [32, 64] and sim.cycle_steps == [1, 1]
    duty = source.duty_cycle
    assert duty.cycles == 2 and duty.adaptive
    # The probe's measured cost is the first prediction: the start once, the rest (stop,
    # inflation, reading) scaled to five steps: an over-estimate, as the stop counts five times.
    per_step = sim.stop_ns + sim.step_ns * sim.inflation + sim.read_ns
    assert duty.cycle_cost_s == pytest.approx((sim.start_ns + 5 * per_step) / 1e9, rel=0.1)
    assert duty.cycle_cost_s > sim.cycle_cost_ns(5) / 1e9


@pytest.mark.parametrize("inflation", [0.05, 0.45, 2.0])
def test_period_follows_the_measured_cost(inflation: float) -> None:
    sim = SimulatedTraining(inflation=inflation, seed=1)
    source = _adaptive(sim, active_steps=5, overhead_budget=0.002)
    sim.run(source, 60_000)
    duty = source.duty_cycle
    expected = sim.cycle_cost_ns(5) / (0.002 * sim.step_ns) + 5
    # The period is the grid: the power of two at or above what the budget pays for.
    grid = _power_of_two_at_least(expected)
    assert duty.period_steps == grid
    assert duty.cycle_cost_s == pytest.approx(sim.cycle_cost_ns(5) / 1e9, rel=0.1)
    assert duty.baseline_step_s == pytest.approx(sim.step_ns / 1e9, rel=0.03)
    assert duty.expected_overhead == pytest.approx(0.002 * expected / grid, rel=0.1)
    assert duty.within_budget
    # The warm-up and the probes are one step each, then full cycles.
    assert sim.cycle_steps[: 1 + PROBES] == [1] * (1 + PROBES)
    assert set(sim.cycle_steps[1 + PROBES :]) == {5}
    # The cycles really are that far apart (after the probes have been paid off), each on a
    # multiple of the grid.
    gaps = [b - a for a, b in itertools.pairwise(sim.started_after[2 + PROBES :])]
    assert statistics.median(gaps) == grid
    assert all(after % grid == 0 for after in sim.started_after[2 + PROBES :])


@pytest.mark.parametrize(
    ("probes", "slow_probe"), [(PROBES, 1), (PROBES, 2), (PROBES, PROBES), (1, 1)]
)
def test_a_probe_on_a_slow_step_does_not_set_the_prediction(
    monkeypatch: pytest.MonkeyPatch, probes: int, slow_probe: int
) -> None:
    # A probe is one step: a step 10 ms slow for reasons of its own (a 4 ms step here) would
    # read as a cycle five times as dear. On a real 2-rank job one such probe pinned the
    # period at the ceiling for three minutes at the 0.04 % budget. The smallest of PROBES
    # probes is the prediction, so one slow probe does not; a lone probe (the former design,
    # probes=1) does.
    monkeypatch.setattr(_torch_source, "PROBES", probes)
    sim = SimulatedTraining(slow_cycles={slow_probe: 10_000_000}, seed=3)
    source = _adaptive(sim, active_steps=5, overhead_budget=0.002)
    sim.run(source, 20_000)
    duty = source.duty_cycle
    true_cycle = sim.cycle_cost_ns(5)
    cycles = zip(sim.started_after, sim.cycle_steps, strict=True)
    full = [after for after, steps in cycles if steps == 5]
    expected_gap = true_cycle / (0.002 * sim.step_ns) + 5
    if probes == 1:
        # The lone probe was the slow one: ~4x the true cost, the first full cycle ~4x late.
        assert sim.cycle_steps[:2] == [1, 1]
        assert full[0] - sim.started_after[1] > 3 * expected_gap
        return
    assert sim.cycle_steps[: 1 + probes] == [1] * (1 + probes)
    grid = _power_of_two_at_least(expected_gap)
    # The slow step's 10 ms is charged once (the source cannot tell it from the profiler's
    # cost) and paid back from the budget: the first full cycle comes within three steps of
    # the grid, not after the ~4x a prediction from the slow probe would wait.
    assert full[0] - sim.started_after[probes] <= 3 * grid
    gaps = [b - a for a, b in itertools.pairwise(full)]
    assert statistics.median(gaps) == grid == duty.period_steps
    assert duty.cycle_cost_s == pytest.approx(true_cycle / 1e9, rel=0.1)


def test_export_thread_cost_counts_against_the_budget() -> None:
    cheap_reads, dear_reads = SimulatedTraining(read_ns=0), SimulatedTraining(read_ns=4_000_000)
    periods = []
    for sim in (cheap_reads, dear_reads):
        # A budget whose periods stay under the 10,000-step ceiling with these reads.
        source = _adaptive(sim, overhead_budget=0.001)
        sim.run(source, 30_000)
        periods.append(source.duty_cycle.period_steps)
        assert source.duty_cycle.drain_cost_s == pytest.approx(sim.read_ns * 5 / 1e9)
        expected = sim.cycle_cost_ns(5) / (0.001 * sim.step_ns) + 5
        assert periods[-1] == _power_of_two_at_least(expected)
    assert periods[1] >= 2 * periods[0]


@settings(max_examples=40, deadline=None, derandomize=True, phases=NO_SHRINK)
@given(
    step_ms=st.floats(0.5, 2000.0),
    inflation=st.floats(0.0, 3.0),
    start_ms=st.floats(0.0, 5.0),
    stop_ms=st.floats(0.0, 5.0),
    read_ms=st.floats(0.0, 5.0),
    budget=st.floats(0.001, 0.05),
    active=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_cost_stays_within_the_budget(
    step_ms: float,
    inflation: float,
    start_ms: float,
    stop_ms: float,
    read_ms: float,
    budget: float,
    active: int,
    seed: int,
) -> None:
    sim = SimulatedTraining(
        step_ns=round(step_ms * 1e6),
        inflation=inflation,
        start_ns=round(start_ms * 1e6),
        stop_ns=round(stop_ms * 1e6),
        read_ns=round(read_ms * 1e6),
        jitter=0.1,
        seed=seed,
    )
    source = _adaptive(sim, active_steps=active, overhead_budget=budget, max_period_steps=10**9)
    sim.run(source, 20_000)
    cycle = sim.cycle_cost_ns(active)
    # The source charges each cycle its measured cost: the true cost plus the jitter of the
    # profiled steps against the baseline median (uniform +-10 %: sd 0.058 step per step),
    # never below zero (which biases a free cycle's cost up by ~0.025 step per step).
    profiled = sum(sim.cycle_steps)
    noise_ns = 0.3 * sim.step_ns * math.sqrt(profiled)
    duty = source.duty_cycle
    # The one-step warm-up is measured but not charged: on a real first run it is Kineto's
    # one-time set-up.
    assert duty.warmup_cost_s is not None
    charged = sim.cost_ns - duty.warmup_cost_s * 1e9
    assert duty.spent_s * 1e9 >= 0.99 * charged - noise_ns
    assert duty.spent_s * 1e9 <= 1.01 * charged + noise_ns + 0.05 * sim.step_ns * profiled
    # A token bucket: what was spent never exceeds what was earned by more than one cycle's
    # misprediction (noise included) ...
    assert charged <= budget * sim.base_ns + cycle + noise_ns
    # ... and the budget is used, not hoarded: cycles keep coming at the rate it pays for (or
    # at the floor's rate when cycles are that cheap).
    # (On the grid, a power of two at or above the period the budget pays for: at least half
    # of it is used, and at the floor's grid, 64 steps.)
    at_floor = sim.steps / _power_of_two_at_least(DEFAULT_MIN_PERIOD_STEPS) * cycle
    assert sim.cost_ns >= 0.45 * min(budget * sim.base_ns, at_floor) - 2 * cycle - noise_ns
    assert duty.within_budget


def test_ceiling_forces_cycles_and_says_so() -> None:
    sim = SimulatedTraining(inflation=3.0, start_ns=50_000_000)
    source = _adaptive(sim, active_steps=2, min_period_steps=10, max_period_steps=100)
    sim.run(source, 1000)
    duty = source.duty_cycle
    assert duty.period_steps == 64  # the grid: the power of two at or below the ceiling
    assert not duty.within_budget
    # A forced cycle starts on the first step of the grid at or past the ceiling.
    gaps = [b - a for a, b in itertools.pairwise(sim.started_after[1 + PROBES :])]
    assert gaps and max(gaps) == 128


def test_fixed_period_ignores_the_adaptive_floor() -> None:
    source = TorchProfilerSource(active_steps=50, period_steps=50, backend=ScriptedBackend([]))
    assert source.duty_cycle.period_steps == 50


def test_fixed_period_still_measures_its_cost() -> None:
    sim = SimulatedTraining(jitter=0.0)
    source = _adaptive(sim, active_steps=2, period_steps=10)
    sim.run(source, 100)
    duty = source.duty_cycle
    assert not duty.adaptive and duty.period_steps == 10 and duty.cycles == 10
    assert sim.started_after[:3] == [1, 11, 21]
    assert duty.training_cost_s == pytest.approx(
        (sim.start_ns + sim.stop_ns + 2 * sim.step_ns * sim.inflation) / 1e9, rel=0.01
    )


def test_real_torch_profiler_adapts_its_period() -> None:
    """Adaptive mode on a real training loop: a probe, then full cycles, costs measured."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 2, (16,))
    # A generous budget so that a short loop sees several cycles (the probes and the full
    # cycles wait for a power-of-two grid: up to twice what the budget needs).
    source = TorchProfilerSource(active_steps=2, overhead_budget=0.5, min_period_steps=10)
    classes: set[str] = set()
    for step in range(480):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        source.on_step_end(step)
        if step % 20 == 19:
            classes |= {name for name, _ in source.drain().durations_s}
    source.close()
    duty = source.duty_cycle
    assert duty.adaptive and duty.cycles >= 5  # the warm-up, three probes, a full cycle
    assert duty.training_cost_s is not None and duty.training_cost_s > 0
    assert duty.drain_cost_s is not None and duty.drain_cost_s > 0
    assert duty.cycle_cost_s is not None and duty.baseline_step_s is not None
    assert duty.period_steps >= 10
    assert duty.expected_overhead is not None and duty.expected_overhead <= 0.5
    assert "gemm" in classes


def _pause_inside_next_cycle(sim: SimulatedTraining, source: TorchProfilerSource, ns: int) -> None:
    """Train until a profiling cycle is running, then stop the loop for ``ns`` (e.g. an
    evaluation pass that does not call ``step()``) and train one more step."""
    while not sim.running:
        sim.run(source, 1)
    sim.now_ns += ns
    sim.run(source, 1)


def test_a_pause_inside_the_probe_is_not_charged_and_the_probe_runs_again() -> None:
    steady, paused = SimulatedTraining(seed=3), SimulatedTraining(seed=3)
    references = []
    for sim in (steady, paused):
        source = _adaptive(sim, active_steps=5, overhead_budget=0.002)
        sim.run(source, 70)  # past the warm-up (after 50 steps, on the grid: the 64th)
        if sim is paused:
            _pause_inside_next_cycle(sim, source, 2_000_000_000)  # 500 steps of 4 ms
            assert source.duty_cycle.interrupted_cycles == 1
            duty = source.duty_cycle
            assert duty.training_cost_s == 0  # the pause is not the profiler's
            assert duty.spent_s == 0  # and its ops are dropped unread
            assert duty.cycle_cost_s is None  # no prediction from it
        sim.run(source, 20_000)
        references.append(source.duty_cycle)
    calm, interrupted = references
    assert interrupted.interrupted_cycles == 1 and calm.interrupted_cycles == 0
    # Without the rule the 2 s pause would be the prediction: the period would hit 10,000.
    assert interrupted.period_steps == pytest.approx(calm.period_steps, rel=0.1)
    assert interrupted.cycles == pytest.approx(calm.cycles, abs=2)


def test_a_pause_inside_a_cycle_is_charged_the_prediction_only() -> None:
    sim = SimulatedTraining(seed=4)
    source = _adaptive(sim, active_steps=5, overhead_budget=0.002)
    sim.run(source, 5_000)
    before = source.duty_cycle
    assert before.cycle_cost_s is not None and before.interrupted_cycles == 0
    _pause_inside_next_cycle(sim, source, 3_000_000_000)
    while sim.running:
        sim.run(source, 1)
    after = source.duty_cycle
    assert after.interrupted_cycles == 1
    assert after.cycle_cost_s == pytest.approx(before.cycle_cost_s, rel=0.05)
    # Charged about one cycle's predicted cost, not the 3 s pause.
    assert after.spent_s - before.spent_s < 2 * before.cycle_cost_s
    assert after.period_steps == pytest.approx(before.period_steps, rel=0.1)


def test_an_interrupted_cycle_is_dropped_unread() -> None:
    """The profiler records the pause's work too: reading it would cost the export thread in
    proportion to the pause (and charge the budget); its ops are not training steps'."""
    sim = SimulatedTraining(seed=6)
    source = _adaptive(sim, active_steps=5, overhead_budget=0.002)
    sim.run(source, 5_000)
    source.drain()
    while not sim.running:
        sim.run(source, 1, drain_every=None)
    while sim.running:  # a whole cycle without a pause: read, one op per step
        sim.run(source, 1, drain_every=None)
    cpu_ns = sim.cpu_ns
    window = source.drain()
    assert sum(map(len, window.durations_s.values())) == 5, window
    assert sim.cpu_ns > cpu_ns
    before = source.duty_cycle
    _pause_inside_next_cycle(sim, source, 3_000_000_000)
    while sim.running:
        sim.run(source, 1, drain_every=None)
    cpu_ns = sim.cpu_ns
    window = source.drain()
    assert sim.cpu_ns == cpu_ns, "the interrupted cycle's ops were read"
    assert not window.idle_durations_s and not window.durations_s
    after = source.duty_cycle
    assert after.interrupted_cycles == 1
    assert after.drain_cost_s == before.drain_cost_s


@pytest.mark.parametrize("honour_skips", [False, True], ids=["told-every-step", "skipping"])
def test_a_pause_between_cycles_earns_at_most_eight_steps_of_budget(honour_skips: bool) -> None:
    sim = SimulatedTraining(seed=5, jitter=0.0, honour_skips=honour_skips)
    source = _adaptive(sim, active_steps=5, overhead_budget=0.002)
    sim.run(source, 5_000)
    for _ in range(10_000):  # on to a step end told past any cycle (skipping: one that skips)
        told = sim.told
        sim.run(source, 1)
        if sim.told > told and not sim.running and (sim.skip > 0 or not honour_skips):
            break
    # Skipping, the source is told of the next sim.skip + 1 steps at once; one was a pause.
    steps = sim.skip + 1
    assert (steps > 1) == honour_skips
    credit = source._credit_ns
    sim.now_ns += 10 * 60 * 10**9  # a 10-minute evaluation between two steps
    sim.run(source, steps)
    if not sim.running:  # no cycle started at that boundary: nothing else moved the credit
        earned = source._credit_ns - credit
        assert earned == pytest.approx(0.002 * (steps - 1 + 8) * sim.step_ns, rel=0.01)
    # A 10-minute pause at 0.2 % would have paid for 1.2 s of profiling: dozens of cycles in a
    # row. Capped, the next cycles keep their usual spacing.
    sim.run(source, 12_000)
    gaps = [b - a for a, b in itertools.pairwise(sim.started_after[-4:])]
    assert min(gaps) >= 0.5 * source.duty_cycle.period_steps


@pytest.mark.parametrize("jitter", [0.0, 0.05])
@pytest.mark.parametrize(
    "kind",
    [
        {},  # the op-dense 4 ms step
        {"step_ns": 20_000_000, "inflation": 0.66},
        {"inflation": 3.0, "start_ns": 50_000_000},  # the ceiling decides
    ],
)
def test_between_cycles_the_source_is_told_of_few_step_ends(
    kind: dict[str, Any], jitter: float
) -> None:
    """Each step end told costs the training thread a Python call; the source asks for those
    near the next cycle only, and its cycles come as if it were told of every step."""
    runs = {}
    for honour in (False, True):
        sim = SimulatedTraining(seed=3, jitter=jitter, honour_skips=honour, **kind)
        source = _adaptive(sim, active_steps=5)
        sim.run(source, 40_000)
        runs[honour] = (sim, source.duty_cycle)
    (every, every_duty), (skipping, duty) = runs[False], runs[True]
    assert every.told == 40_000
    assert skipping.told < 0.05 * 40_000  # ~2 % in these runs
    if not jitter:  # the very same cycles
        assert skipping.started_after == every.started_after
        assert duty == every_duty
    else:
        # Jittered, cycles that start a step apart profile other steps, whose jitter makes
        # their measured costs, and the spacing those buy, drift apart: the same budget still.
        assert abs(duty.cycles - every_duty.cycles) <= 1
        assert duty.spent_s == pytest.approx(every_duty.spent_s, rel=0.05)


def test_a_fixed_period_is_kept_to_the_step_while_skipping() -> None:
    sim = SimulatedTraining(jitter=0.0)
    source = _adaptive(sim, active_steps=2, period_steps=1_000)
    sim.run(source, 10_000)
    assert sim.started_after == [1 + 1_000 * cycle for cycle in range(10)]
    # Per period: the cycle's two steps, then the 64 steps before the next reported one by one
    # (a fresh baseline for its cost), and a handful in between.
    assert sim.told < 10 * (2 + 64 + 8)


@pytest.mark.parametrize("preset", [None, "2"])
def test_kineto_log_lines_are_silenced_unless_the_user_set_the_level(preset: str | None) -> None:
    """torch 2.13's Kineto prints two lines per profiler start/stop: an always-on source must
    not write them into every rank's stderr, but a level the user chose is theirs."""
    import os
    import subprocess
    import sys

    code = (
        "import os, torch\n"
        "from stepwatch.exporters.kernels import TorchProfilerSource\n"
        "source = TorchProfilerSource(active_steps=2, period_steps=3)\n"
        "for step in range(9):\n"
        "    torch.ones(4) @ torch.ones(4)\n"
        "    source.on_step_end(step)\n"
        "window = source.drain()\n"
        "source.close()\n"
        "print(os.environ['KINETO_LOG_LEVEL'], len(window.idle_durations_s))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    if preset is not None:
        env["KINETO_LOG_LEVEL"] = preset
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    level, profiled_steps = done.stdout.split()
    assert int(profiled_steps) == 6  # three cycles of two steps really ran
    if preset is None:
        assert level == "6"
        assert "profiler_start" not in done.stderr, done.stderr
    else:
        assert level == preset
        assert done.stderr.count("profiler_start") == 3


@pytest.mark.parametrize("aligned", [True, False], ids=["grid", "no-grid"])
def test_every_rank_profiles_the_same_steps(monkeypatch: pytest.MonkeyPatch, aligned: bool) -> None:
    """In a synchronous job a rank's profiled step holds every rank up at the next
    collective: cycles at different steps on different ranks would cost the job the sum of
    their budgets. On the grid, ranks whose costs differ (another seed, 20 % dearer steps) start
    every full cycle, and their probes, on the same steps; without it (the former design)
    they do not."""
    if not aligned:
        monkeypatch.setattr(TorchProfilerSource, "_grid", lambda self: 1)
    ranks = [
        SimulatedTraining(seed=11),
        SimulatedTraining(seed=12, inflation=0.45 * 1.2),
        SimulatedTraining(seed=13, jitter=0.1),
    ]
    for sim in ranks:
        sim.run(_adaptive(sim, active_steps=5, overhead_budget=0.002), 30_000)

    def full_cycles(sim: SimulatedTraining) -> set[int]:
        return {a for a, n in zip(sim.started_after, sim.cycle_steps, strict=True) if n == 5}

    starts = [full_cycles(sim) for sim in ranks]
    assert all(len(s) >= 6 for s in starts)
    densest = max(starts, key=len)
    # The warm-up and the probes too: each rank's credit for a probe comes at its own step,
    # the probes' grid (the power of two that pays for the next) at the same one.
    first = [tuple(sim.started_after[: 1 + PROBES]) for sim in ranks]
    assert all(sim.cycle_steps[: 1 + PROBES] == [1] * (1 + PROBES) for sim in ranks)
    assert (len(set(first)) == 1) == aligned, first
    if aligned:
        # The same grid, the same steps; a rank whose period crossed a power of two (the
        # dearer one here) profiles a subset of them: the grids nest.
        assert starts[0] == starts[2] and starts[1] <= starts[0]
        # Profiled steps of the job (any rank profiling): one rank's, not three ranks'.
        assert set.union(*starts) == densest
    else:
        assert len(set.union(*starts)) > 2 * len(densest)
