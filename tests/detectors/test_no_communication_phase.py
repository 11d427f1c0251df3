"""Producers that record no ``communication`` phase: the collective wait is inside backward.

The stock OpenTelemetry SDK, Lightning and HF timers, a hand-written ``with
phase("backward")`` around ``loss.backward()``: the gradient all-reduce and the wait for the
last rank in it are part of backward. A rank whose forward (or data loading) is slow is then
the rank whose backward is the *shortest*, while every rank's step is the same.
"""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest

from stepwatch.core import Diagnosis, InfluxClient
from stepwatch.detectors import DetectorConfig, analyse, detect_job, diagnose
from stepwatch.detectors.frame import JobFrame, job_time_range
from stepwatch.detectors.simulation import Fault, producer_scenarios, score, simulate
from tests.detectors import real_runs

RANKS = 4
SLOW_RANK = 2
WINDOWS = 36
STEPS_PER_WINDOW = 5
PHASES = {"data": 0.005, "forward": 0.040, "backward": 0.080, "optimizer": 0.010}
TRANSFER_S = 0.005


def _steps(fault: str, factor: float, seed: int) -> dict[str, np.ndarray]:
    """Per-step ``(steps, ranks)`` phase times of a 4-rank DDP job (see the SDK test): the
    all-reduce at the end of backward waits for the last rank, then transfers."""
    rng = np.random.default_rng(seed)
    steps = WINDOWS * STEPS_PER_WINDOW
    times = {name: base * rng.normal(1.0, 0.02, (steps, RANKS)) for name, base in PHASES.items()}
    onset = np.arange(steps)[:, None] >= (WINDOWS // 3) * STEPS_PER_WINDOW
    hit = onset & (np.arange(RANKS) == SLOW_RANK)[None, :]
    if fault == "forward":
        times["forward"] = np.where(hit, times["forward"] * factor, times["forward"])
    elif fault == "backward":
        times["backward"] = np.where(hit, times["backward"] * factor, times["backward"])
    elif fault == "data":
        times["data"] = np.where(hit, times["data"] + (factor - 1.0) * 0.1, times["data"])
    arrival = times["data"] + times["forward"] + times["backward"]
    transfer = TRANSFER_S * rng.normal(1.0, 0.02, (steps, RANKS))
    times["communication"] = (
        arrival.max(axis=1, keepdims=True) - arrival + transfer.max(axis=1)[:, None]
    )
    times["step"] = arrival + times["communication"] + times["optimizer"]
    return times


def _frame(times: dict[str, np.ndarray], phases: tuple[str, ...]) -> JobFrame:
    """The windows a producer of ``phases`` stores: without ``communication``, its time is
    inside ``backward`` (the timer runs around ``loss.backward()``)."""
    columns = dict(times)
    if "communication" not in phases:
        columns["backward"] = times["backward"] + times["communication"]
    shape = (WINDOWS, STEPS_PER_WINDOW, RANKS)
    phase = np.stack([columns[name] for name in phases], axis=-1).reshape(*shape, len(phases))
    step = times["step"].reshape(shape)
    nothing = np.full((WINDOWS, RANKS), np.nan)
    return JobFrame(
        job="sdk-shaped",
        window_s=1.0,
        window_end_unix_nano=1_795_291_200_000_000_000
        + 10**9 * np.arange(1, WINDOWS + 1, dtype=np.int64),
        ranks=np.arange(RANKS),
        hosts=tuple(f"node-{rank}" for rank in range(RANKS)),
        pp_ranks=np.full(RANKS, -1),
        step_count=np.full((WINDOWS, RANKS), float(STEPS_PER_WINDOW)),
        step_s=step.mean(axis=1),
        step_max_s=step.max(axis=1),
        phases=phases,
        phase_s=phase.mean(axis=1),
        phase_max_s=phase.max(axis=1),
        kernel_classes=(),
        kernel_categories=(),
        kernel_s=np.zeros((WINDOWS, RANKS, 0)),
        idle_s=nothing,
        idle_max_s=nothing.copy(),
        phase_min_s=phase.min(axis=1),
    )


NO_COMMUNICATION = ("data", "forward", "backward", "optimizer")
WITH_COMMUNICATION = ("data", "forward", "backward", "communication", "optimizer")


def _true_cost(fault: str, factor: float, seed: int) -> float:
    """The job's step with the fault over the same job without it, from the onset on."""
    onset = (WINDOWS // 3) * STEPS_PER_WINDOW
    actual = _steps(fault, factor, seed)["step"].max(axis=1)[onset:]
    healthy = _steps("none", factor, seed)["step"].max(axis=1)[onset:]
    return float(actual.mean() / healthy.mean())


@pytest.mark.parametrize("seed", [13, 14, 15])
@pytest.mark.parametrize(("fault", "phase", "kind"), [
    ("forward", "forward", "masked_straggler"),
    ("data", "data", "dataloader_stall"),
])  # fmt: skip
def test_a_slow_rank_is_named_when_its_peers_wait_inside_backward(
    seed: int, fault: str, phase: str, kind: str
) -> None:
    # Rank 2's forward 1.5x (or its data loading 50 ms longer); the others' backward holds
    # the wait, so every step is as long as rank 2's and rank 2's backward is the shortest.
    times = _steps(fault, 1.5, seed)
    late = slice((WINDOWS // 3) * STEPS_PER_WINDOW, None)
    backward = (times["backward"] + times["communication"])[late].mean(axis=0)
    assert int(np.argmin(backward)) == SLOW_RANK  # the masked signature
    assert np.ptp(times["step"][late].mean(axis=0)) < 0.01 * times["step"].mean()
    found = analyse(_frame(times, NO_COMMUNICATION))
    assert [(f.diagnosis.kind, f.diagnosis.ranks, f.diagnosis.phase) for f in found] == [
        (kind, (SLOW_RANK,), phase)
    ], [f.diagnosis.summary for f in found]
    # Its cost: the job would be faster by about rank 2's excess.
    truth = _true_cost(fault, 1.5, seed)
    assert found[0].diagnosis.slowdown == pytest.approx(truth, rel=0.05), (truth, found)
    # The same job recorded with its communication phase says the same.
    with_phase = analyse(_frame(times, WITH_COMMUNICATION))
    assert [(f.diagnosis.kind, f.diagnosis.ranks, f.diagnosis.phase) for f in with_phase] == [
        (kind, (SLOW_RANK,), phase)
    ]


@pytest.mark.parametrize("seed", [13, 14, 15, 16])
def test_a_healthy_job_without_a_communication_phase_raises_nothing(seed: int) -> None:
    assert analyse(_frame(_steps("none", 1.0, seed), NO_COMMUNICATION)) == []


def test_a_slow_backward_blames_no_waiter() -> None:
    # Rank 2's own backward 1.5x: the others wait for it inside their backward, so every
    # rank's backward and step end alike. Phase times alone cannot tell which rank it is
    # (nor a slow backward from a slow link): the job's step grew, and no rank is named.
    found = analyse(_frame(_steps("backward", 1.5, 13), NO_COMMUNICATION))
    assert all(f.diagnosis.ranks == () for f in found), [f.diagnosis.summary for f in found]
    assert [f.diagnosis.kind for f in found] == ["job_regression"]
    assert found[0].diagnosis.slowdown == pytest.approx(_true_cost("backward", 1.5, 13), rel=0.05)


def test_the_recordings_hold_their_all_reduce_inside_backward() -> None:
    # What makes dropping the communication points the right fold: in every window of every
    # recorded run, each rank's backward counts as many occurrences as its communication
    # phase and holds at least as much time. (Not in the sampled runs: there, backward is
    # the sample's estimate, and a collective timed by a comm hook is every step's.)
    for name in [n for n in real_runs.names() if "-sampled" not in n]:
        windows: dict[tuple[str, str], dict[str, tuple[float, float]]] = collections.defaultdict(
            dict
        )
        for line in real_runs.lines(name):
            phase = real_runs.phase_of(line)
            if phase not in ("backward", "communication"):
                continue
            head, fields, stamp = line.split(" ")
            rank = head.split(",stepwatch.rank=", 1)[1].split(",", 1)[0]
            # Not a plain split on ",": the compact layout's bucket string holds commas.
            values = dict(re.findall(r"(?:^|,)(sum|count)=([^,]+)", fields))
            windows[(rank, stamp)][phase] = (float(values["sum"]), float(values["count"]))
        assert windows, name
        for key, both in windows.items():
            assert set(both) == {"backward", "communication"}, (name, key)
            assert both["backward"][1] == both["communication"][1], (name, key)
            assert both["backward"][0] >= both["communication"][0], (name, key)


def _diagnose_folded(influx: InfluxClient, name: str) -> tuple[real_runs.RealRun, list[Diagnosis]]:
    run = real_runs.load(influx, name, communication=False)
    span = job_time_range(influx, run.job)
    assert span is not None, f"{name}: nothing stored"
    found = detect_job(
        influx, run.job, start_unix_nano=span[0] - 10**9, end_unix_nano=span[1] + 10**9
    )
    return run, list(found)


@pytest.mark.parametrize(
    ("name", "kinds", "phase"),
    [
        ("straggler", {"masked_straggler", "compute_straggler"}, "forward"),
        ("straggler-3", {"masked_straggler", "compute_straggler"}, "forward"),
        ("dataloader", {"dataloader_stall"}, "data"),
        ("jit", {"jit_stall"}, "forward"),
        ("stall", {"jit_stall"}, None),
        ("stall-2", {"jit_stall"}, None),
    ],
)
def test_a_real_straggler_is_named_without_the_communication_phase(
    influx: InfluxClient, name: str, kinds: set[str], phase: str
) -> None:
    run, found = _diagnose_folded(influx, name)
    assert run.fault_rank == SLOW_RANK
    assert found, f"{name}: no finding"
    assert {d.kind for d in found} <= kinds, found
    assert all(d.ranks == (SLOW_RANK,) and d.phase == phase for d in found), found
    assert all(d.slowdown >= 1.2 and d.severity == "critical" for d in found), found


@pytest.mark.parametrize("name", ["link-2", "link-3"])
def test_a_real_late_link_without_the_communication_phase_names_no_waiter(
    influx: InfluxClient, name: str
) -> None:
    # Rank 2's all-reduce is held 8 ms in its comm hook, inside backward: every rank's
    # backward grows alike and every step ends together. Without the communication phase
    # that is a job-level slowdown in backward; no rank is blamed (with it: rank 2's host).
    _, found = _diagnose_folded(influx, name)
    assert [(d.kind, d.ranks, d.phase) for d in found] == [("job_regression", (), "backward")]


@pytest.mark.parametrize("name", ["none", "none-2", "none-3"])
def test_a_real_healthy_run_without_the_communication_phase_has_no_finding(
    influx: InfluxClient, name: str
) -> None:
    _, found = _diagnose_folded(influx, name)
    assert found == []


def test_the_simulator_folds_the_all_reduce_into_backward() -> None:
    fault = [Fault("masked_straggler", 20, (3,), 1.5)]
    stepwatch = simulate(8, steps=60, faults=fault, seed=4)
    folded = simulate(8, steps=60, faults=fault, seed=4, communication_phase=False)
    timer = simulate(
        8, steps=60, faults=fault, seed=4, communication_phase=False, device_metrics=False
    )
    assert "communication" in stepwatch.phases
    assert "communication" not in folded.phases
    own = stepwatch.phase_s[..., stepwatch.phases.index("backward")]
    wait = stepwatch.phase_s[..., stepwatch.phases.index("communication")]
    np.testing.assert_allclose(folded.phase_s[..., folded.phases.index("backward")], own + wait)
    np.testing.assert_array_equal(folded.step_s, stepwatch.step_s)
    assert folded.truth == stepwatch.truth
    frame = timer.frame()
    assert frame.kernel_classes == () and frame.sm_clock_hz is None
    assert not np.isfinite(frame.idle_s).any()
    observed = timer.observed(0, 0)
    assert observed is not None
    assert observed.kernel_durations_s == {} and observed.idle_durations_s == []


def test_producer_scenarios_score_without_false_alarms() -> None:
    # The suite's family of jobs recorded without a communication phase (bench/score_suite.py
    # scores all of it): a slice of small jobs, every required fault found and localised.
    picked = producer_scenarios(24, max_world_size=64)
    assert {s.producer for s in picked} == {"backward-timer", "phase-timer"}
    assert any(s.kind is None for s in picked)
    required = 0
    for scenario in picked:
        job = scenario.simulate()
        assert "communication" not in job.phases, scenario.name
        result = score(
            job.truth, diagnose(job.frame()), min_slowdown=DetectorConfig().min_slowdown_for
        )
        assert not result.false_alarms, scenario.name
        assert all(item.localised for item in result.faults if item.required), scenario.name
        required += sum(item.required for item in result.faults)
    assert required >= 8
