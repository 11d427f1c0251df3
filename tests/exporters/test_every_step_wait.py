"""The collective wait is timed on every step while the other auto phases are sampled.

A one-off stall on a step whose phases are not timed must still show who waited: the peers'
exposed wait (DDP's allreduce, from the last gradient to ``optimizer.step()``) is long on that
step, the stalled rank's is not. The wait's start is a clock stamp called by autograd (C where
it can be: ``_fastrecord.ClockStamp``), its end the optimizer pre-hook; the window says which
phases rest on every step (``stepwatch.phase.every_step``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stepwatch.core import _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._recorder import (
    FAST_RECORDER,
    UNSAMPLED,
    StepRecord,
    new_clock_stamp,
    sampled_steps,
    window_values,
)
from stepwatch.exporters._sampling import PhaseSampler
from stepwatch.exporters._window import WindowBuilder
from tests.exporters.test_auto import _model, _summary

STEPS = 48
STRIDE = 8


def _unsampled_step(after: int) -> int:
    return next(i for i in range(after, STEPS) if not PhaseSampler(STRIDE).sampled(i))


def _every_step_points(exporter: InMemoryExporter) -> dict[str, int]:
    totals: dict[str, int] = {}
    for window in exporter.exported:
        for metric in window.resource_metrics[0].scope_metrics[0].metrics:
            if metric.name == _schema.PHASE_EVERY_STEP:
                assert metric.data.is_monotonic
                for point in metric.data.data_points:
                    phase = str(point.attributes[_schema.PHASE])
                    totals[phase] = totals.get(phase, 0) + int(point.value)
    return totals


def _phase_max(exporter: InMemoryExporter, phase: str) -> float:
    return max(
        (
            point.max
            for window in exporter.exported
            for metric in window.resource_metrics[0].scope_metrics[0].metrics
            if metric.name == _schema.PHASE_DURATION
            for point in metric.data.data_points
            if point.attributes[_schema.PHASE] == phase
        ),
        default=0.0,
    )


def _ddp_rank(rank: int, world_size: int, out_dir: str, stall_step: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world_size
    )
    try:
        exporter = InMemoryExporter()
        monitor = StepMonitor(
            job_id="wait",
            rank=rank,
            world_size=world_size,
            exporter=exporter,
            start=False,
            phase_sampling=STRIDE,
        )
        model = DistributedDataParallel(_model(0))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        instrumentation = monitor.instrument(model, optimizer)
        generator = torch.Generator().manual_seed(100 + rank)
        for step in range(STEPS):
            with monitor.step():
                inputs = torch.randn(32, 16, generator=generator)
                loss = model(inputs).pow(2).mean()
                optimizer.zero_grad(set_to_none=True)
                if rank == 1 and step == stall_step:
                    time.sleep(0.3)  # a one-off stall between phases of an untimed step
                loss.backward()
                optimizer.step()
            if step % 16 == 15:
                monitor.export_now()
        monitor.close()
        result = {
            "summary": _summary(exporter),
            "every_step": _every_step_points(exporter),
            "communication_max": _phase_max(exporter, "communication"),
            "forward_max": _phase_max(exporter, "forward"),
            "stamp": type(instrumentation._state.gradient_stamp).__name__,
            "misuse": monitor.stats.misuse,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # torch 2.13 with gloo aborts now and then at interpreter exit, after all of the above
    # ("terminate called without an active exception", in a thread of its own; also before
    # issue 15's fourteenth round): the rank's work is done and written, so it leaves without
    # the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_a_stall_on_an_untimed_step_shows_in_the_peers_every_step_wait(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    stall_step = _unsampled_step(20)
    mp.start_processes(  # type: ignore[no-untyped-call]
        _ddp_rank, args=(2, str(tmp_path), stall_step), nprocs=2, join=True, start_method="spawn"
    )
    waiter, stalled = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    sampled = sum(PhaseSampler(STRIDE).sampled(i) for i in range(STEPS))
    assert 0 < sampled < STEPS // 2
    for result in (waiter, stalled):
        phases = result["summary"]["phases"]
        assert result["summary"]["steps"]["count"] == STEPS
        # The wait is one observation per step; the sampled phases count every step too
        # (their weights), but only the wait says so on the wire.
        assert phases["communication"]["count"] == STEPS
        assert phases["forward"]["count"] == STEPS
        assert result["every_step"] == {"communication": STEPS}
        assert result["misuse"] == 0
        if FAST_RECORDER is not None:
            assert result["stamp"] == "ClockStamp"  # the C stamp: no Python frame in backward
    # The untimed step's stall: rank 0 waited for it in the allreduce, rank 1 did not.
    assert waiter["communication_max"] >= 0.25
    assert stalled["communication_max"] < 0.1
    assert max(waiter["forward_max"], stalled["forward_max"]) < 0.1  # no timed phase saw it


def _record(index: int, auto: dict[str, int], every: dict[str, int]) -> StepRecord:
    return (index, index * 1000, index * 1000 + 900, every, None, auto)


def test_the_window_says_which_phases_rest_on_every_step() -> None:
    records = [
        _record(i, {"forward": 100} if i % 4 == 0 else UNSAMPLED, {"communication": 50})
        for i in range(8)
    ]
    sampler = PhaseSampler(4)
    durations, phases, weighted, carry = window_values(records, None, 64)
    sampled = sampled_steps(records, durations, carry, sampler)
    assert sampled is not None and set(weighted) == {"forward"}

    def points(temporality: str, windows: int) -> list[dict[str, int]]:
        builder = WindowBuilder(_resource(), temporality=temporality)
        seen = []
        for window in range(windows):
            builder.add_steps(
                last_step_index=7,
                durations_s=durations,
                phases_s=phases,
                weighted_phases_s=weighted,
                sampled_steps_s=sampled,
                sampling=True,
            )
            built = builder.build(start_unix_nano=window, end_unix_nano=window + 1)
            assert built is not None
            (metric,) = (
                m
                for m in built.resource_metrics[0].scope_metrics[0].metrics
                if m.name == _schema.PHASE_EVERY_STEP
            )
            seen.append(
                {str(p.attributes[_schema.PHASE]): p.value for p in metric.data.data_points}
            )
        return seen

    assert points("delta", 2) == [{"communication": 8}, {"communication": 8}]
    assert points("cumulative", 2) == [{"communication": 8}, {"communication": 16}]
    # Every step timed (not sampling): nothing is said, the wire is as before.
    builder = WindowBuilder(_resource())
    builder.add_steps(last_step_index=7, durations_s=durations, phases_s=phases)
    built = builder.build(start_unix_nano=0, end_unix_nano=1)
    assert built is not None
    names = {m.name for m in built.resource_metrics[0].scope_metrics[0].metrics}
    assert _schema.PHASE_EVERY_STEP not in names


def _resource() -> Any:
    from opentelemetry.sdk.resources import Resource

    return Resource.create({_schema.JOB_ID: "w", _schema.RANK: 0})


def test_once_sampling_was_reported_auto_keeps_reporting_at_stride_one() -> None:
    every = [_record(i, {"forward": 100}, {}) for i in range(4)]
    durations, _, _, _ = window_values(every, None, 64)
    sampler = PhaseSampler("auto")
    assert sampled_steps(every, durations, 0, sampler) is None  # stride 1 from the start
    sampler.stride = 4
    mixed = [_record(i, {"forward": 100} if i == 0 else UNSAMPLED, {}) for i in range(4)]
    assert sampled_steps(mixed, durations, 0, sampler) is not None
    sampler.stride = 1  # the steps grew: every step timed again
    # Still said: a rank's window without it would read as one with no step timed.
    assert sampled_steps(every, durations, 0, sampler) == (durations, [1, 1, 1, 1])


def test_the_clock_stamp_reads_the_monitor_clock() -> None:
    stamp = new_clock_stamp(time.perf_counter_ns)
    assert stamp.ns == 0
    before = time.perf_counter_ns()
    stamp(torch.zeros(1))
    assert before <= stamp.ns <= time.perf_counter_ns()
    stamp.ns = 0
    assert stamp.ns == 0
    if FAST_RECORDER is not None:
        assert type(stamp).__module__ == "stepwatch.exporters._fastrecord"
    # Another clock: the Python stamp, which never raises into autograd.
    readings = iter([5, 7])
    python_stamp = new_clock_stamp(lambda: next(readings))
    python_stamp(object())
    assert python_stamp.ns == 5

    def broken() -> int:
        raise RuntimeError("clock")

    raising: Any = new_clock_stamp(broken)
    raising(object())
    assert raising.ns == 0
