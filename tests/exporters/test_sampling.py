"""Phase sampling (``_sampling``): which steps auto mode times, and what a sample stands for."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core import ConfigError, _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._histogram import ExponentialHistogram
from stepwatch.exporters._recorder import UNSAMPLED, StepRecord, sampled_steps, window_values
from stepwatch.exporters._sampling import (
    MAX_STRIDE,
    SAMPLE_INTERVAL_S,
    SAMPLES_PER_WINDOW,
    PhaseSampler,
    ideal_stride,
    sample_interval,
    share_out,
    step_hash,
)
from tests.exporters.test_auto import _model, _summary


def test_a_fixed_stride_samples_the_same_steps_on_every_rank_and_strides_nest() -> None:
    by_stride = {
        stride: {i for i in range(20_000) if PhaseSampler(stride).sampled(i)}
        for stride in (1, 2, 4, 8, 16)
    }
    assert by_stride[1] == set(range(20_000))
    for stride, chosen in by_stride.items():
        assert chosen == {i for i in range(20_000) if PhaseSampler(stride).sampled(i)}
        assert len(chosen) / 20_000 == pytest.approx(1 / stride, rel=0.1)
    # A rank at stride 16 looks at a subset of the steps a rank at stride 8 looks at.
    assert by_stride[16] <= by_stride[8] <= by_stride[4] <= by_stride[2]


@pytest.mark.parametrize("period", [2, 3, 4, 8, 16])
def test_no_period_of_the_workload_aliases_with_the_sample(period: int) -> None:
    # A schedule with a period (micro-batches, a pipeline's warm-up) must not be seen through
    # one phase of it: at stride 8 every residue of the period is sampled about equally.
    chosen = [i for i in range(160_000) if PhaseSampler(8).sampled(i)]
    shares = [sum(1 for i in chosen if i % period == r) / len(chosen) for r in range(period)]
    assert max(shares) == pytest.approx(1 / period, rel=0.15)
    assert min(shares) == pytest.approx(1 / period, rel=0.15)


def test_step_hash_is_a_fixed_function() -> None:
    # Ranks in different processes (and versions) must agree: a pinned value, no collisions.
    assert step_hash(0) == 0xE220A8397B1DCDAF
    assert len({step_hash(i) for i in range(10_000)}) == 10_000


def test_the_adaptive_stride_keeps_sampled_steps_50_ms_apart() -> None:
    assert ideal_stride(0.2) == 1
    assert ideal_stride(0.05) == 1
    assert ideal_stride(0.02) == 4  # 2.5 -> the next power of two
    assert ideal_stride(0.004) == 16
    assert ideal_stride(1e-6) == MAX_STRIDE
    assert ideal_stride(float("nan")) == 1
    sampler = PhaseSampler("auto")
    assert sampler.stride == 1  # every step until the first window
    sampler.observe([0.02] * 9 + [5.0])  # the median: one slow step does not count
    assert sampler.stride == 4
    # Hysteresis: a step a few percent off the power-of-two boundary keeps the stride.
    sampler.observe([0.05 / 4 * 0.95] * 5)  # ideal 4.2: would be 8 without hysteresis
    assert sampler.stride == 4
    sampler.observe([0.05 / 8] * 5)  # ideal 8, clearly past: moves
    assert sampler.stride == 8
    sampler.observe([0.5] * 5)
    assert sampler.stride == 1
    fixed = PhaseSampler(4)
    fixed.observe([0.0001] * 5)
    assert fixed.stride == 4


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "often", None])
def test_a_bad_phase_sampling_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match="phase_sampling"):
        PhaseSampler(bad)
    with pytest.raises(ConfigError, match="phase_sampling"):
        _sampling_monitor(bad)


@given(st.integers(0, 500), st.integers(1, 50))
def test_share_out_is_as_even_as_can_be(steps: int, samples: int) -> None:
    weights = share_out(steps + samples, samples)
    assert sum(weights) == steps + samples
    assert max(weights) - min(weights) <= 1
    assert share_out(10, 0) == []


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.floats(0, 10, allow_nan=False), st.integers(0, 40)), min_size=1, max_size=30
    )
)
def test_a_weighted_value_is_that_value_recorded_weight_times(pairs: list[Any]) -> None:
    weighted, repeated = ExponentialHistogram(), ExponentialHistogram()
    assert weighted.record_weighted([v for v, _ in pairs], [w for _, w in pairs]) == 0
    for value, weight in pairs:
        for _ in range(weight):
            repeated.record(value)
    a, b = weighted.snapshot(), repeated.snapshot()
    assert (a.count, a.zero_count, a.scale, a.offset, a.bucket_counts) == (
        b.count,
        b.zero_count,
        b.scale,
        b.offset,
        b.bucket_counts,
    )
    assert a.sum == pytest.approx(b.sum, rel=1e-12, abs=1e-12)
    if b.count:
        assert (a.min, a.max) == (b.min, b.max)


def _sampling_monitor(stride: Any, exporter: InMemoryExporter | None = None) -> StepMonitor:
    return StepMonitor(
        job_id="s",
        rank=0,
        world_size=1,
        exporter=exporter if exporter is not None else InMemoryExporter(),
        start=False,
        phase_sampling=stride,
    )


def _record(index: int, auto: dict[str, int] | None, step_ns: int = 10_000) -> StepRecord:
    return (index, index * step_ns, (index + 1) * step_ns, {"data": 100}, None, auto)


def test_sampled_steps_stand_for_the_steps_of_their_batch() -> None:
    records = [
        _record(i, {"forward": 1000 * (i + 1)} if i in (2, 5) else UNSAMPLED) for i in range(7)
    ]
    durations, phases, weighted, carry = window_values(records, None, 64)
    assert len(durations) == 7 and phases["data"] == pytest.approx([1e-7] * 7)
    values, weights = weighted["forward"]
    assert values == pytest.approx([3e-6, 6e-6]) and weights == [4, 3]  # 7 steps, 2 samples
    assert carry == 0
    # A batch without a sampled step hands its steps on to the next sampled one.
    _, _, weighted, carry = window_values([_record(i, UNSAMPLED) for i in range(5)], None, 64)
    assert weighted == {} and carry == 5
    _, _, weighted, carry = window_values([_record(9, {"forward": 7})], None, 64, carry)
    assert weighted["forward"][1] == [6] and carry == 0
    # Steps no auto mode watched count for nothing.
    _, _, weighted, carry = window_values([_record(1, None), _record(2, {"forward": 7})], None, 64)
    assert weighted["forward"][1] == [1] and carry == 0


def test_the_sampled_steps_durations_carry_their_phases_weights() -> None:
    records = [
        _record(i, {"forward": 1000} if i in (2, 5) else UNSAMPLED, step_ns=1000 * (i + 1))
        for i in range(7)
    ]
    durations, _, weighted, _ = window_values(records, None, 64, 3)
    steps = sampled_steps(records, durations, 3, PhaseSampler(4))
    assert steps is not None
    assert steps[0] == [durations[2], durations[5]]
    assert steps[1] == weighted["forward"][1] == [5, 5]  # 7 steps + 3 carried, 2 samples
    # Every step timed: nothing, unless the stride says phases are sampled.
    every = [_record(i, {"forward": 1000}) for i in range(4)]
    durations, _, _, _ = window_values(every, None, 64)
    assert sampled_steps(every, durations, 0, PhaseSampler(1)) is None
    assert sampled_steps(every, durations, 0, PhaseSampler("auto")) is None  # stride 1 now
    assert sampled_steps(every, durations, 0, PhaseSampler(2)) == (durations, [1, 1, 1, 1])
    none_timed = [_record(i, UNSAMPLED) for i in range(4)]
    durations, _, _, _ = window_values(none_timed, None, 64)
    assert sampled_steps(none_timed, durations, 0, PhaseSampler(2)) is None


def _train_steps(
    monitor: StepMonitor, model: Any, optimizer: Any, steps: int, forwarded: Any = None
) -> None:
    generator = torch.Generator().manual_seed(7)
    for index in range(steps):
        with monitor.step():
            with monitor.phase("data"):
                inputs = torch.randn(8, 16, generator=generator)
            loss = model(inputs).pow(2).mean()
            if forwarded is not None:
                forwarded(index)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if index % 50 == 49:
            monitor.export_now()


def test_auto_mode_times_a_sample_and_its_histograms_still_count_every_step() -> None:
    exporter = InMemoryExporter()
    monitor = _sampling_monitor(8, exporter)
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    timed: list[int] = []
    recorder = monitor._recorder

    def forwarded(index: int) -> None:  # the step's forward was timed (in C or in Python)
        if "forward" in recorder._sampled_ns:
            timed.append(index)

    _train_steps(monitor, model, optimizer, 400, forwarded)
    monitor.close()
    expected = [i for i in range(400) if PhaseSampler(8).sampled(i)]
    assert timed == expected  # exactly the sampled steps, the same on every rank
    summary = _summary(exporter)
    assert summary["steps"]["count"] == 400
    for phase in ("data", "forward", "backward", "optimizer"):
        assert summary["phases"][phase]["count"] == 400, phase
    assert monitor.phase_sample_stride == 8
    # What the phases rest on: the sampled steps, their number and their weighted durations.
    sampled = {"steps": 0, "count": 0}
    for window in exporter.exported:
        for metric in window.resource_metrics[0].scope_metrics[0].metrics:
            if metric.name == _schema.SAMPLED_STEPS:
                sampled["steps"] += metric.data.data_points[0].value
                assert metric.data.is_monotonic
            elif metric.name == _schema.SAMPLED_STEP_DURATION:
                sampled["count"] += metric.data.data_points[0].count
    assert sampled == {"steps": len(expected), "count": 400}
    # Numerics untouched whether a step is sampled or not.
    reference = _model(0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    _train_steps(
        StepMonitor(job_id="r", rank=0, world_size=1, exporter=InMemoryExporter(), start=False),
        reference,
        reference_optimizer,
        400,
    )
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.usefixtures("tensor_hooks")
def test_an_unsampled_step_registers_no_backward_hook() -> None:
    monitor = _sampling_monitor(4)
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    outputs = []
    for _ in range(40):
        with monitor.step():
            output = model(torch.ones(2, 16))
            outputs.append(output)
            output.sum().backward()
            optimizer.step()
    sampler = PhaseSampler(4)
    for index, output in enumerate(outputs):
        assert bool(output._backward_hooks) == sampler.sampled(index), index
    monitor.close()


def test_the_default_samples_32_steps_a_window_at_least_50_ms_apart() -> None:
    # Since issue 15's seventh round the collective wait is timed on every step, so a
    # one-off stall on an untimed step is still placed; phases are then sampled by default.
    # Since its tenth, sampled steps are a 64th of a window apart where that is more than
    # 50 ms, since its twenty-second a 32nd: at the default 10 s windows 0.3125 s, 1 in 16
    # at 20 ms, every step from ~0.3 s.
    monitor = StepMonitor(
        job_id="s", rank=0, world_size=1, exporter=InMemoryExporter(), start=False
    )
    assert monitor.phase_sample_stride == 1  # every step until the first window's median
    monitor._timing.sampler.observe([0.020] * 10)
    assert monitor.phase_sample_stride == 16
    monitor._timing.sampler.observe([0.001] * 10)
    assert monitor.phase_sample_stride == 256
    monitor._timing.sampler.observe([0.2] * 10)
    assert monitor.phase_sample_stride == 2
    monitor._timing.sampler.observe([0.4] * 10)
    assert monitor.phase_sample_stride == 1
    monitor.close()
    for interval_s, stride_at_20_ms, stride_at_1_ms in (
        (1.0, 4, 64),
        (0.25, 4, 64),
        (60.0, 128, 256),
    ):
        short = StepMonitor(
            job_id="s",
            rank=0,
            world_size=1,
            exporter=InMemoryExporter(),
            start=False,
            export_interval_s=interval_s,
        )
        short._timing.sampler.observe([0.020] * 10)
        assert short.phase_sample_stride == stride_at_20_ms
        short._timing.sampler.observe([0.001] * 10)
        assert short.phase_sample_stride == stride_at_1_ms
        short.close()


def test_the_sample_interval_follows_the_window() -> None:
    assert sample_interval(None) == SAMPLE_INTERVAL_S == sample_interval(1.0)
    assert sample_interval(10.0) == 10.0 / SAMPLES_PER_WINDOW
    assert sample_interval(float("inf")) == SAMPLE_INTERVAL_S
    assert ideal_stride(0.02, sample_interval(10.0)) == 16


def test_phase_sampling_1_times_every_step() -> None:
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="s", rank=0, world_size=1, exporter=exporter, start=False, phase_sampling=1
    )
    assert monitor.phase_sample_stride == 1
    monitor._timing.sampler.observe([0.001] * 10)
    assert monitor.phase_sample_stride == 1
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.instrument(model, optimizer)
    _train_steps(monitor, model, optimizer, 60)
    monitor.close()
    names = {
        metric.name
        for window in exporter.exported
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
    }
    assert _schema.PHASE_DURATION in names  # and nothing about samples: every step is one
    assert not names & {_schema.SAMPLED_STEPS, _schema.SAMPLED_STEP_DURATION}


class _Blocking(torch.autograd.Function):
    """Identity whose backward waits for an event: a rank stuck inside backward."""

    release = threading.Event()
    entered = threading.Event()

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Blocking.entered.set()
        _Blocking.release.wait(10)
        return grad


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.block_forward: threading.Event | None = None
        self.entered = threading.Event()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.block_forward is not None:
            self.entered.set()
            self.block_forward.wait(10)
        return self.linear(_Blocking.apply(inputs))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rank_stuck_in_an_unsampled_step_says_which_phase_from_its_stack(where: str) -> None:
    monitor = _sampling_monitor(1_000_000)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instrumentation = monitor.instrument(model, optimizer)
    unsampled = next(i for i in range(1, 100) if not PhaseSampler(1_000_000).sampled(i))
    _Blocking.release.set()
    for _ in range(unsampled):
        with monitor.step():
            model(torch.ones(2, 4, requires_grad=True)).sum().backward()
            optimizer.step()
    _Blocking.release.clear()
    _Blocking.entered.clear()
    gate = threading.Event()
    if where == "forward":
        model.block_forward = gate

    def stuck_step() -> None:
        with monitor.step():
            model(torch.ones(2, 4, requires_grad=True)).sum().backward()
            optimizer.step()

    worker = threading.Thread(target=stuck_step)
    worker.start()
    try:
        assert (model.entered if where == "forward" else _Blocking.entered).wait(10)
        time.sleep(0.01)
        assert not monitor._recorder.sampled
        found = instrumentation.open_phase()
        assert found is not None and found[0] == where
        assert found[1] == monitor._recorder.step_start_ns
    finally:
        gate.set()
        _Blocking.release.set()
        worker.join(10)
    monitor.close()
    assert math.isfinite(monitor.stats.steps_recorded)
