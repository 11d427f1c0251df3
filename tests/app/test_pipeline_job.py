"""The pipeline-parallel job (stepwatch.app._pipeline_job): its schedule, faults, device time
and truth, and one real run end to end.

The live run is real: ``pp × dp`` processes training with gloo on loopback, instrumented by
hand with ``StepMonitor``, exporting OTLP/HTTP to an in-process bridge that writes to the
session's influxd; the test reads what was stored back with InfluxQL.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stepwatch.app._demo import StoredSummary, last_steps, summarize, wait_for_job
from stepwatch.app._pipeline_config import (
    BACKWARD_FACTOR,
    EMBEDDING_BLOCKS,
    FAULTS,
    HEAD_BLOCKS,
    PipelineJobConfig,
    block_series,
    blocks_held,
    blocks_run,
    even_partition,
    fault_active,
    head_spread,
    sequence_lengths,
    stall_step,
    truth_block,
    uneven_partition,
)
from stepwatch.app._pipeline_job import launch
from stepwatch.app._pipeline_model import DeviceClock, Stage
from stepwatch.app._pipeline_schedule import Compute, Transfer, one_f_one_b
from stepwatch.app._pipeline_truth import drift, paired_truth, results_of
from stepwatch.app._stack import LocalStack
from stepwatch.core import ConfigError, ManagedInfluxDB
from stepwatch.core._influx import quote_literal

# ---- the 1F1B schedule ----------------------------------------------------------------------

#: The operation at the other end of each point-to-point operation, and its direction.
_COUNTERPART = {
    "send_forward": ("recv_forward", 1),
    "recv_forward": ("send_forward", -1),
    "send_backward": ("recv_backward", -1),
    "recv_backward": ("send_backward", 1),
}


def _run_schedules(stages: int, microbatches: int) -> list[list[str]]:
    """Run every stage's schedule with rendezvous point-to-point semantics (an operation
    completes only once its neighbour has posted the counterpart; a transfer's operations
    are posted together); each stage's log of what it did. Fails on a deadlock."""
    schedules = [one_f_one_b(stage, stages, microbatches) for stage in range(stages)]
    position = [0] * stages
    pending: list[set[tuple[str, int]] | None] = [None] * stages
    logs: list[list[str]] = [[] for _ in range(stages)]
    while any(position[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for stage in range(stages):
            while position[stage] < len(schedules[stage]):
                item = schedules[stage][position[stage]]
                if isinstance(item, Compute):
                    logs[stage].append(f"{item.kind} {item.microbatch}")
                    position[stage] += 1
                    progressed = True
                    continue
                if pending[stage] is None:
                    pending[stage] = set(item.ops)
                break
        for stage in range(stages):
            for op, mb in list(pending[stage] or ()):
                other, step = _COUNTERPART[op]
                peer = pending[stage + step] if 0 <= stage + step < stages else None
                if peer is not None and (other, mb) in peer:
                    peer.discard((other, mb))
                    pending[stage].discard((op, mb))  # type: ignore[union-attr]
                    logs[stage].append(f"{op} {mb}")
                    logs[stage + step].append(f"{other} {mb}")
        for stage in range(stages):
            if pending[stage] is not None and not pending[stage]:
                pending[stage] = None
                position[stage] += 1
                progressed = True
        assert progressed, f"deadlock at {position} (stages {stages}, microbatches {microbatches})"
    return logs


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7])
def test_every_stage_runs_1f1b_without_deadlock(stages: int, microbatches: int) -> None:
    logs = _run_schedules(stages, microbatches)
    for stage, log in enumerate(logs):
        forwards = [int(entry.split()[1]) for entry in log if entry.startswith("forward")]
        backwards = [int(entry.split()[1]) for entry in log if entry.startswith("backward")]
        assert forwards == backwards == list(range(microbatches)), (stage, log)
        # 1F1B's memory bound: at most (stages - stage) microbatches in flight.
        in_flight = peak = 0
        for entry in log:
            in_flight += entry.startswith("forward") - entry.startswith("backward")
            peak = max(peak, in_flight)
        assert peak == min(stages - stage, microbatches), (stage, log)
        ops = {entry.split()[0] for entry in log}
        assert ("recv_forward" in ops) == ("send_backward" in ops) == (stage > 0)
        assert ("send_forward" in ops) == ("recv_backward" in ops) == (stage < stages - 1)


def test_steady_state_sends_and_receives_travel_together() -> None:
    # Stage 0 of 2, 4 microbatches: one warm-up forward, then each output goes forward with
    # the previous microbatch's gradient coming back (Megatron's send_forward_recv_backward).
    schedule = one_f_one_b(0, 2, 4)
    assert schedule[:4] == [
        Compute("forward", 0),
        Transfer((("send_forward", 0),)),
        Compute("forward", 1),
        Transfer((("send_forward", 1), ("recv_backward", 0))),
    ]
    assert schedule[-2:] == [Transfer((("recv_backward", 3),)), Compute("backward", 3)]


# ---- faults, data and the truth blocks ------------------------------------------------------


def test_truth_blocks_alternate_abba_after_the_recorded_steps() -> None:
    config = PipelineJobConfig(
        job_id="j", fault="slow-worker", steps=10, truth_pairs=4, truth_block_steps=3
    )
    assert config.total_steps == 10 + 4 * 2 * 3
    assert truth_block(config, 9) is None
    blocks = [truth_block(config, step) for step in range(10, config.total_steps)]
    assert [b for b in blocks[::3]] == [
        (0, False),
        (1, True),
        (2, True),
        (3, False),
        (4, False),
        (5, True),
        (6, True),
        (7, False),
    ]
    assert truth_block(config, config.total_steps) is None
    # The recorded steps: the fault from fault_step (default 120 > 10: never here).
    assert not any(fault_active(config, step) for step in range(10))
    healthy = PipelineJobConfig(job_id="j", steps=10, truth_pairs=2, truth_block_steps=3)
    assert not any(fault_active(healthy, step) for step in range(healthy.total_steps))


def test_a_structural_fault_is_there_from_step_zero_and_toggles_in_the_truth_blocks() -> None:
    config = PipelineJobConfig(
        job_id="j", fault="heavy-stage", steps=10, truth_pairs=1, truth_block_steps=2
    )
    assert config.onset_step is None
    assert all(fault_active(config, step) for step in range(10))
    assert [fault_active(config, step) for step in range(10, 14)] == [False, False, True, True]


def test_a_healthy_job_measures_its_noise_then_what_its_loss_head_costs() -> None:
    # Two series: the job twice (A/A), then the job as it is against its loss head's device
    # time spread evenly over the stages, ABBA in each.
    config = PipelineJobConfig(job_id="j", steps=10, truth_pairs=2, truth_block_steps=3)
    assert config.truth_series == ("fault", "even-head")
    assert config.total_steps == 10 + 2 * 2 * 2 * 3
    blocks = [truth_block(config, step) for step in range(10, config.total_steps, 3)]
    assert [block_series(config, index) for index, _ in blocks] == ["fault"] * 4 + ["even-head"] * 4
    assert [faulty for _, faulty in blocks] == [False] * 4 + [False, True, True, False]
    spread = [head_spread(config, step) for step in range(10, config.total_steps, 3)]
    assert spread == [False] * 4 + [True, False, False, True]
    assert not any(fault_active(config, step) for step in range(config.total_steps))
    faulty = PipelineJobConfig(job_id="j", fault="slow-worker", steps=10, truth_pairs=2)
    assert faulty.truth_series == ("fault",)
    assert not any(head_spread(faulty, step) for step in range(faulty.total_steps))


@pytest.mark.parametrize(("pp", "dp"), [(2, 2), (4, 1), (3, 1), (8, 1)])
def test_a_heavy_stage_and_its_balanced_truth_partition_the_same_blocks(pp: int, dp: int) -> None:
    config = PipelineJobConfig(
        job_id="j", pp=pp, dp=dp, fault="heavy-stage", steps=4, truth_pairs=1, truth_block_steps=2
    )
    heavy, base = config.heavy_stage, config.blocks_per_stage
    uneven = [blocks_run(config, stage, 0) for stage in range(pp)]
    even = [blocks_run(config, stage, 4) for stage in range(pp)]  # the first truth block: off
    # The heavy stage holds as many blocks more as a stage has: twice the work.
    assert uneven == uneven_partition(config)
    assert uneven[heavy] == 2 * base and all(
        n == base for stage, n in enumerate(uneven) if stage != heavy
    )
    # The same blocks as evenly as whole blocks go, the last stage (the loss head) never
    # holding more than another.
    assert even == even_partition(config) and sum(even) == sum(uneven)
    assert max(even) - min(even) <= 1 and even[-1] == min(even)
    assert all(max(uneven[s], even[s]) == blocks_held(config, s) for s in range(pp))
    healthy = PipelineJobConfig(job_id="j", pp=pp, dp=dp)
    assert [blocks_held(healthy, s) for s in range(pp)] == [base] * pp
    assert [blocks_run(healthy, s, 0) for s in range(pp)] == [base] * pp


def test_the_even_partition_of_four_stages_fills_the_middle_ones_first() -> None:
    config = PipelineJobConfig(job_id="j", pp=4, dp=1, fault="heavy-stage")
    assert uneven_partition(config) == [6, 12, 6, 6]
    assert even_partition(config) == [7, 8, 8, 7]


def test_a_stall_happens_once_in_the_recording_and_once_per_faulty_truth_block() -> None:
    config = PipelineJobConfig(
        job_id="j", fault="stall", steps=20, fault_step=8, truth_pairs=2, truth_block_steps=4
    )
    stalls = [step for step in range(config.total_steps) if stall_step(config, step)]
    # The truth blocks from step 20 (4 steps each) are off, on, on, off; each block with
    # the fault stalls at its middle step.
    assert stalls == [8, 20 + 4 + 2, 20 + 8 + 2]


def test_rotating_microbatches_move_the_longest_replica_every_step() -> None:
    config = PipelineJobConfig(job_id="j", fault="rotating-microbatches", fault_step=5)
    assert sequence_lengths(config, 4, 0) == [config.seq_len] * config.microbatches
    longest = []
    for step in range(5, 25):
        per_replica = [sum(sequence_lengths(config, step, r)) for r in range(config.dp)]
        longest.append(per_replica.index(max(per_replica)))
        mean = sum(per_replica) / (config.dp * config.microbatches)
        assert mean == pytest.approx(config.seq_len, rel=0.15)
        assert sequence_lengths(config, step, 1) == sequence_lengths(config, step, 1)
    assert all(a != b for a, b in itertools.pairwise(longest))


def test_paired_truth_is_the_ratio_of_the_mean_steps() -> None:
    truth = paired_truth(
        [(False, [1.0, 1.0]), (True, [2.0, 2.0]), (True, [3.0, 3.0]), (False, [1.0, 1.0])]
    )
    assert truth.pairs == ((1.0, 2.0), (1.0, 3.0))
    assert truth.ratio == pytest.approx(2.5)
    assert (truth.ratio_min, truth.ratio_max) == (2.0, 3.0)
    assert truth.ratio_se == pytest.approx(math.sqrt(0.5) / math.sqrt(2))
    assert truth.lost_s == pytest.approx(3.0)
    with pytest.raises(ConfigError):
        paired_truth([(False, [1.0])])


def test_results_are_the_ranks_mean_steps_before_after_and_in_the_truth_blocks() -> None:
    config = PipelineJobConfig(
        job_id="j",
        pp=2,
        dp=1,
        fault="slow-worker",
        steps=10,
        fault_step=6,
        truth_pairs=2,
        truth_block_steps=2,
    )
    recorded = [1.0] * 6 + [1.5] * 4
    truth = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 1.0, 1.0]  # off, on, on, off
    timings = [
        {
            "rank": 0,
            "step_s": recorded + truth,
            "compute_s": [0.25] * 18,
            "device_s": [0.125] * 18,
        },
        {
            "rank": 1,
            "step_s": [s + 0.5 for s in recorded + truth],
            "compute_s": [0.5] * 18,
            "device_s": [0.375] * 18,
        },
    ]
    results = results_of(config, timings)
    assert results["recorded"] == {
        "mean_step_s_before": 1.25,
        "mean_step_s_after": 1.75,
        "stage_compute_s": [0.25, 0.5],
        "stage_device_s": [0.125, 0.375],
        "step_drift_before": None,  # fewer than two chunks of 25 steps
        "step_drift_after": None,
    }
    assert "truth_even_head" not in results
    assert results["truth"]["pairs"] == ((1.25, 2.25), (1.25, 3.25))
    assert results["truth"]["ratio"] == pytest.approx(2.75 / 1.25)
    assert results["truth"]["lost_s"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("overrides", "argument"),
    [
        ({"fault": "slowness"}, "fault"),
        ({"pp": 1}, "pp"),
        ({"fault": "rotating-microbatches", "dp": 1}, "rotating"),
        ({"fault_rank": 4}, "fault_rank"),
        ({"fault_stage": 2}, "fault_stage"),
        ({"fault_factor": 1.0}, "fault_factor"),
        ({"blocks_per_stage": 0}, "blocks_per_stage"),
        ({"device_ms_per_block": -1.0}, "device_ms_per_block"),
    ],
)
def test_a_bad_configuration_names_its_argument(overrides: dict[str, Any], argument: str) -> None:
    with pytest.raises(ConfigError, match=argument):
        PipelineJobConfig(job_id="j", **overrides)


def test_defaults_put_faults_off_the_last_stage() -> None:
    assert set(FAULTS) == {
        "healthy",
        "slow-worker",
        "heavy-stage",
        "rotating-microbatches",
        "stall",
    }
    two_by_two = PipelineJobConfig(job_id="j")
    assert (two_by_two.faulty_rank, two_by_two.coordinates(1), two_by_two.heavy_stage) == (
        1,
        (0, 1),
        0,
    )
    four_by_one = PipelineJobConfig(job_id="j", pp=4, dp=1)
    assert (four_by_one.coordinates(1), four_by_one.heavy_stage) == ((1, 0), 1)


def test_drift_is_the_largest_chunks_mean_step_over_the_smallest() -> None:
    assert drift([1.0] * 24) is None
    assert drift([1.0] * 25 + [1.2] * 25 + [1.1] * 24) == pytest.approx(1.2)
    assert drift([1.0] * 10 + [1.5] * 10, chunk=5) == pytest.approx(1.5)


def test_a_healthy_jobs_results_hold_both_series() -> None:
    config = PipelineJobConfig(job_id="j", pp=2, dp=1, steps=6, truth_pairs=1, truth_block_steps=2)
    # A/A (off, on: the same job), then even-head: spread (off), as it is (on).
    truth = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.2, 1.2]
    timings = [
        {"rank": rank, "step_s": [1.0] * 6 + truth, "compute_s": [0.5] * 14, "device_s": [0.4] * 14}
        for rank in range(2)
    ]
    results = results_of(config, timings)
    assert results["truth"]["ratio"] == pytest.approx(1.0)
    assert results["truth_even_head"]["ratio"] == pytest.approx(1.2)
    assert results["truth_even_head"]["pairs"] == ((1.0, 1.2),)


# ---- device time ----------------------------------------------------------------------------


def test_the_device_clock_queues_kernels_and_waits_for_them_off_the_cpu() -> None:
    clock = DeviceClock(2.0, 16)
    assert clock.forward_s(1.0, tokens=16) == pytest.approx(0.002)
    assert clock.forward_s(3.0, tokens=32) == pytest.approx(0.012)  # longer sequences
    clock.factor = 2.0  # a slower worker's device
    assert clock.forward_s(1.0, tokens=16) == pytest.approx(0.004)
    with clock.paused():
        assert clock.forward_s(1.0, tokens=16) == 0.0
    clock.factor = 1.0
    # Launches return at once and queue back to back; synchronize sleeps until they are done.
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(40):
        clock.launch(0.001)
    launched = time.perf_counter() - wall
    clock.synchronize()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert clock.spent_s == pytest.approx(0.040)
    assert launched < 0.010 and wall >= 0.040
    assert cpu < 0.5 * wall
    # An idle device starts a kernel when it is launched, not before.
    time.sleep(0.005)
    started = time.perf_counter()
    clock.launch(0.003)
    assert clock.busy_until >= started + 0.003
    clock.synchronize()
    assert time.perf_counter() >= started + 0.003


def _stage(pp: int, stage: int, **overrides: Any) -> Stage:
    config = PipelineJobConfig(job_id="j", pp=pp, dp=1, device_ms_per_block=0.2, **overrides)
    return Stage(config, stage, blocks=config.blocks_per_stage)


def _spent_on_one_microbatch(model: Stage, tokens: int = 16) -> float:
    """Device time launched by one microbatch's forward (in blocks' forward time), checking
    that its backward launches ``BACKWARD_FACTOR`` times as much."""
    if model.embed is not None:
        inputs = torch.randint(0, model.embed.num_embeddings, (2, tokens))
    else:
        inputs = torch.randn(2, tokens, 32, requires_grad=True)
    before = model.clock.spent_s
    outputs = model(inputs)
    forward = model.clock.spent_s - before
    outputs.sum().backward()
    total = model.clock.spent_s - before
    assert total == pytest.approx((1 + BACKWARD_FACTOR) * forward)
    return forward / 0.0002


def test_each_part_of_a_stage_stands_for_its_device_time_forward_and_backward() -> None:
    blocks = PipelineJobConfig(job_id="j").blocks_per_stage
    first, middle, last = _stage(3, 0), _stage(3, 1), _stage(3, 2)
    assert _spent_on_one_microbatch(first) == pytest.approx(blocks + EMBEDDING_BLOCKS)
    assert _spent_on_one_microbatch(middle) == pytest.approx(blocks)
    assert _spent_on_one_microbatch(last) == pytest.approx(blocks + HEAD_BLOCKS)
    # The healthy last stage does ~1.17x a middle stage's work: one block's worth more.
    assert 1.15 <= (blocks + HEAD_BLOCKS) / blocks <= 1.2
    # Longer sequences take longer; a slower device multiplies it all.
    assert _spent_on_one_microbatch(middle, tokens=24) == pytest.approx(1.5 * blocks)
    middle.clock.factor = 2.0
    assert _spent_on_one_microbatch(middle) == pytest.approx(2 * blocks)
    # The loss head's device time spread over the stages (healthy's even-head truth).
    last.head_blocks, last.share_blocks = 0.0, HEAD_BLOCKS / 3
    assert _spent_on_one_microbatch(last) == pytest.approx(blocks + HEAD_BLOCKS / 3)
    # Fewer blocks run (a partition), fewer blocks' time.
    middle.clock.factor, middle.blocks_run = 1.0, 4
    assert _spent_on_one_microbatch(middle) == pytest.approx(4)


# ---- a real run, end to end -----------------------------------------------------------------

STEPS = 50
FAULT_STEP = 20


@pytest.fixture(scope="module")
def stack(
    influxd: ManagedInfluxDB, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    database = f"pipe_{uuid.uuid4().hex[:8]}"
    with LocalStack(
        tmp_path_factory.mktemp("stack"), influx_url=influxd.url, database=database
    ) as local:
        yield local


@pytest.fixture(scope="module")
def live_run(
    stack: LocalStack, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PipelineJobConfig, dict[str, Any], StoredSummary]:
    assert stack.client is not None
    config = PipelineJobConfig(
        job_id=f"pipe-{uuid.uuid4().hex[:6]}",
        steps=STEPS,
        fault="slow-worker",
        fault_step=FAULT_STEP,
        truth_pairs=1,
        truth_block_steps=4,
        endpoint=stack.otlp_http_endpoint,
        export_interval_s=0.1,
        result_file=str(tmp_path_factory.mktemp("pipe") / "results.json"),
    )
    results = launch(config, timeout_s=300.0)
    assert results is not None
    assert wait_for_job(stack.client, config.job_id, world_size=config.world_size, steps=STEPS)
    truth_steps = config.total_steps - STEPS  # its own monitor counts them from 0
    assert wait_for_job(
        stack.client, f"{config.job_id}-truth", world_size=config.world_size, steps=truth_steps
    )
    return config, results, summarize(stack.client, config.job_id)


@pytest.mark.slow
def test_every_rank_reports_the_recorded_steps_and_the_truth_goes_to_its_own_job(
    stack: LocalStack, live_run: tuple[PipelineJobConfig, dict[str, Any], StoredSummary]
) -> None:
    assert stack.client is not None
    config, results, summary = live_run
    assert summary.last_step_by_rank == {rank: STEPS - 1 for rank in range(4)}
    truth_steps = last_steps(stack.client, f"{config.job_id}-truth")
    assert truth_steps == {rank: config.total_steps - STEPS - 1 for rank in range(4)}
    assert results["truth"]["ratio"] > 0 and len(results["truth"]["pairs"]) == 1
    assert json.loads(Path(str(config.result_file)).read_text()) == results


@pytest.mark.slow
def test_every_rank_times_its_phases_once_per_step(
    live_run: tuple[PipelineJobConfig, dict[str, Any], StoredSummary],
) -> None:
    _, _, summary = live_run
    phases: dict[int, dict[str, int]] = {}
    for row in summary.rows:
        phases.setdefault(row.rank, {})[row.phase] = row.observations
    # Both stages read data (token ids on the first, targets on the last); a phase entered
    # once per microbatch is one observation per step: the sum of its time in the step.
    expected = dict.fromkeys(("backward", "communication", "data", "forward", "optimizer"), STEPS)
    assert phases == dict.fromkeys(range(4), expected)


@pytest.mark.slow
def test_the_ranks_carry_their_pipeline_coordinates(
    stack: LocalStack, live_run: tuple[PipelineJobConfig, dict[str, Any], StoredSummary]
) -> None:
    assert stack.client is not None
    config, _, _ = live_run
    series = stack.client.query(
        'SELECT count("count") FROM "stepwatch.step.duration" '
        f'WHERE "stepwatch.job.id" = {quote_literal(config.job_id)} '
        'GROUP BY "stepwatch.rank", "stepwatch.pp_rank", "stepwatch.dp_rank"'
    )
    coordinates = {
        int(item.tags["stepwatch.rank"]): (
            int(item.tags["stepwatch.pp_rank"]),
            int(item.tags["stepwatch.dp_rank"]),
        )
        for item in series
    }
    assert coordinates == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}


@pytest.mark.slow
def test_the_slow_worker_computes_longer_than_its_stage_peer(
    live_run: tuple[PipelineJobConfig, dict[str, Any], StoredSummary],
) -> None:
    # Rank 1 repeats its matrix multiplies from step 20 of 50: over the run its forward
    # and backward take longer than rank 0's (the same stage), whatever the host's load.
    _, _, summary = live_run
    mean = {(row.rank, row.phase): row.mean_s for row in summary.rows}
    for phase in ("forward", "backward"):
        assert mean[1, phase] > 1.15 * mean[0, phase], (phase, mean)
