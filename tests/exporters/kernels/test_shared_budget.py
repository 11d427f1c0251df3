"""One budget off the training step: the export work's CPU time paid from the op histograms'.

The torch.profiler source's cycles get what a monitor's export leaves of ``overhead_budget``
(``TorchProfilerSource.charge``), and the monitor measures that export work on the CPU clock
of the thread doing it (``_account.CpuLedger``).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from typing import Any

import pytest

from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._protocols import KernelWindow
from stepwatch.exporters.kernels import TorchProfilerSource
from stepwatch.exporters.kernels._torch_source import PROBES, _power_of_two_at_least
from stepwatch.exporters.monitor._account import CpuLedger
from tests.exporters.kernels.test_torch_source import SimulatedTraining, _adaptive

BUDGET = 0.002


def _train(sim: SimulatedTraining, source: TorchProfilerSource, share: float, steps: int) -> None:
    """``steps`` steps; every 250, the export is charged ``share`` of their time, then drains."""
    for _ in range(steps // 250):
        sim.run(source, 250, drain_every=None)
        source.charge(share * 250 * sim.step_ns)
        source.drain()


def _gap(sim: SimulatedTraining) -> float:
    """The median steps between cycle starts, the warm-up and the probes left out."""
    starts = sim.started_after[2 + PROBES :]
    return statistics.median(b - a for a, b in itertools.pairwise(starts))


@pytest.mark.parametrize("share", [0.0, 0.0005, 0.001, 0.0015])
def test_cycles_get_what_the_export_leaves_of_the_budget(share: float) -> None:
    sim = SimulatedTraining(seed=3)
    source = _adaptive(sim, active_steps=5, overhead_budget=BUDGET)
    _train(sim, source, share, 80_000)
    duty = source.duty_cycle
    expected = sim.cycle_cost_ns(5) / ((BUDGET - share) * sim.step_ns) + 5
    # On the grid: the power of two at or above what the budget pays for.
    assert duty.period_steps == _power_of_two_at_least(expected)
    assert _gap(sim) == duty.period_steps
    assert duty.shared_spent_s == pytest.approx(share * 80_000 * sim.step_ns / 1e9)
    if share:
        # Of the training time, what the source was told of: between cycles it skips up to a
        # grid's worth of step ends (8,192 of these 80,000 at the largest share), whose time it
        # earns when told of the next one.
        assert duty.shared_share == pytest.approx(share, rel=0.12)
    # The profiler's own cost and the export's together stay within the budget.
    assert duty.spent_s + duty.shared_spent_s <= BUDGET * sim.base_ns / 1e9 * 1.02
    assert duty.within_budget


def test_without_sharing_the_charge_is_only_reported() -> None:
    shared, apart = SimulatedTraining(seed=4), SimulatedTraining(seed=4)
    sources = [
        _adaptive(sim, active_steps=5, overhead_budget=BUDGET, share_budget=share)
        for sim, share in ((shared, True), (apart, False))
    ]
    for sim, source in zip((shared, apart), sources, strict=True):
        _train(sim, source, 0.001, 60_000)
    expected_apart = apart.cycle_cost_ns(5) / (BUDGET * apart.step_ns) + 5
    assert sources[1].duty_cycle.period_steps == _power_of_two_at_least(expected_apart)
    assert _gap(apart) == sources[1].duty_cycle.period_steps
    assert sources[1].duty_cycle.shared_spent_s == pytest.approx(0.001 * 60_000 * 4e-3)
    assert _gap(shared) == 2 * _gap(apart)  # half the budget left: the next power of two


def test_an_export_dearer_than_the_budget_leaves_cycles_to_the_ceiling() -> None:
    sim = SimulatedTraining(seed=5)
    source = _adaptive(
        sim, active_steps=5, overhead_budget=BUDGET, min_period_steps=50, max_period_steps=2_000
    )
    _train(sim, source, 2 * BUDGET, 20_000)
    duty = source.duty_cycle
    # The grid's ceiling is the power of two at or below max_period_steps; a forced cycle
    # starts on the first step of it at or past the ceiling.
    assert duty.period_steps == 1_024 and not duty.within_budget
    full = sim.started_after[1 + PROBES :]  # the warm-up and the probes left out
    assert max(b - a for a, b in itertools.pairwise(full)) == 2_048


def test_drain_charges_its_whole_call_once() -> None:
    """Each cycle's reading is charged as before; the rest of the call (the summary) too."""
    ticks = itertools.count(step=1_000)
    sim = SimulatedTraining(jitter=0.0)
    source = TorchProfilerSource(
        backend=sim, clock_ns=sim.clock_ns, cpu_clock_ns=lambda: next(ticks), period_steps=5
    )
    source.drain()  # nothing pending: two clock reads, 1 µs apart
    assert source.duty_cycle.drain_spent_s == pytest.approx(1e-6)
    sim.run(source, 11, drain_every=None)  # cycles after steps 1 and 6 (fixed period)
    spent = source.duty_cycle.drain_spent_s
    source.drain()  # two cycles read: 1 µs each, 4 µs the whole call
    assert source.duty_cycle.drain_spent_s - spent == pytest.approx(5e-6)
    assert source.duty_cycle.drain_cost_s == pytest.approx(1e-6)


class ChargedSource:
    """A kernel source with a ``charge``, its drain advancing the CPU clock."""

    def __init__(self, clock: list[int], drain_ns: int = 0) -> None:
        self.clock, self.drain_ns = clock, drain_ns
        self.charged: list[float] = []

    def drain(self) -> KernelWindow:
        self.clock[0] += self.drain_ns
        return KernelWindow({})

    def charge(self, cpu_ns: float) -> None:
        self.charged.append(cpu_ns)

    def on_step_end(self, step_index: int) -> int | None:
        return None

    def close(self) -> None:
        pass


def _ledger(clock: list[int]) -> CpuLedger:
    return CpuLedger(clock_ns=lambda: clock[0])


def test_ledger_charges_the_export_thread_between_exports_and_not_its_first() -> None:
    clock = [0]
    ledger, source = _ledger(clock), ChargedSource(clock, drain_ns=300)
    log = logging.getLogger("test")
    for gap_ns, build_ns in ((5_000, 1_000), (200, 700), (100, 900)):
        clock[0] += gap_ns  # the thread's looks at the step count, before this export
        started = ledger.begin()
        ledger.drain(source, log)
        clock[0] += build_ns
        ledger.end(started, source, export_thread=True)
    # First export: counted (1,000 + the drain's 300), not charged. Then everything since the
    # previous export ended, less the source's own drain, which charges itself.
    assert source.charged == [200 + 700, 100 + 900]
    assert ledger.spent_ns == 1_300 + (200 + 700 + 300) + (100 + 900 + 300)


def test_ledger_charges_another_thread_its_own_export_only() -> None:
    clock = [10_000]
    ledger, source = _ledger(clock), ChargedSource(clock, drain_ns=50)
    started = ledger.begin()
    ledger.drain(source, logging.getLogger("test"))
    clock[0] += 400
    ledger.end(started, source, export_thread=False)
    assert source.charged == [400] and ledger.spent_ns == 450


def test_ledger_never_raises_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(ChargedSource):
        def drain(self) -> KernelWindow:
            raise RuntimeError("drain broke")

        def charge(self, cpu_ns: float) -> None:
            raise RuntimeError("charge broke")

    clock = [0]
    ledger, source = _ledger(clock), Broken(clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            started = ledger.begin()
            assert ledger.drain(source, _Log()) is None
            ledger.end(started, source, export_thread=False)
    assert sum("charge() raised" in r.getMessage() for r in caplog.records) == 1


class _Log:
    """The monitor's rate-limited log, as the ledger calls it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def warning(self, key: str, message: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((key, message))


def test_a_real_monitor_charges_its_exports_to_the_profiler_budget() -> None:
    """Real StepMonitor, real torch.profiler source: the export thread's CPU is paid from
    the op histograms' budget and shown in the monitor's stats."""
    source = TorchProfilerSource(min_period_steps=20)
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="shared-budget",
        rank=0,
        world_size=1,
        exporter=exporter,
        kernel_source=source,
        export_interval_s=0.05,
        health=False,
        device_timer=None,
    )
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline or len(exporter.exported) < 4:
        with monitor.step():
            sum(i * i for i in range(2_000))
    monitor.close()
    stats, duty = monitor.stats, source.duty_cycle
    assert stats.windows_exported >= 4
    assert 0 < duty.shared_spent_s < stats.export_cpu_s
    assert duty.shared_share is not None and duty.shared_share > 0
    # What was charged is the export work's CPU, not wall time: a few ms per window at most.
    assert stats.export_cpu_s < 0.05 * stats.windows_exported + 0.2
