"""The spine end to end: a real 4-rank PyTorch DDP job → OTLP → the bridge → a real influxd.

Nothing here is faked: the ranks are separate processes training with gloo on loopback, each
instrumented by ``StepMonitor`` in auto mode; they export OTLP/HTTP to an in-process bridge
that writes line protocol to the session's influxd; the test reads it back with InfluxQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepwatch.app._demo import StoredSummary, run_demo_job
from stepwatch.app._demo_job import DemoJobConfig
from stepwatch.app._stack import LocalStack
from stepwatch.core import ManagedInfluxDB
from stepwatch.core._influx import quote_literal

STEPS = 60
RANKS = 4


@pytest.fixture(scope="module")
def stack(
    influxd: ManagedInfluxDB, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    database = f"ddp_{uuid.uuid4().hex[:8]}"
    with LocalStack(
        tmp_path_factory.mktemp("stack"), influx_url=influxd.url, database=database
    ) as local:
        yield local


@pytest.fixture(scope="module")
def clean_run(stack: LocalStack) -> StoredSummary:
    assert stack.client is not None
    config = DemoJobConfig(
        job_id=f"it-{uuid.uuid4().hex[:6]}",
        world_size=RANKS,
        steps=STEPS,
        endpoint=stack.otlp_http_endpoint,
        export_interval_s=0.1,  # several windows even when the 60 steps take under a second
    )
    return run_demo_job(stack.client, config, progress=lambda _: None)


def test_every_rank_reports_every_step(clean_run: StoredSummary) -> None:
    assert clean_run.last_step_by_rank == {rank: STEPS - 1 for rank in range(RANKS)}


def test_every_rank_has_every_phase_with_one_observation_per_step(
    clean_run: StoredSummary,
) -> None:
    by_rank: dict[int, dict[str, int]] = {}
    for row in clean_run.rows:
        by_rank.setdefault(row.rank, {})[row.phase] = row.observations
    assert sorted(by_rank) == list(range(RANKS))
    for rank, phases in by_rank.items():
        # The loop's phase("data") and DDP's allreduce wait are timed on every step.
        assert phases.get("data") == STEPS, (rank, phases)
        assert phases.get("communication") == STEPS, (rank, phases)
        # Auto mode's own phases are sampled by default (phase_sampling="auto"): each
        # sampled step stands for the steps before it, so the counts are whole steps, less
        # those after the run's last sampled step (auto times every step until the first
        # export, so some are counted; exact weights: tests/exporters/test_sampling.py).
        for phase in ("forward", "backward", "optimizer"):
            assert 0 < phases.get(phase, 0) <= STEPS, (rank, phase, phases)
        assert phases["forward"] == phases["backward"] == phases["optimizer"], (rank, phases)


def test_windows_hold_whole_steps_and_plausible_durations(
    stack: LocalStack, clean_run: StoredSummary
) -> None:
    assert stack.client is not None
    for row in clean_run.rows:
        # 0.1 s export interval over a run of ~0.4 s or more: several windows, each whole steps.
        assert 2 <= row.windows <= STEPS, row
        assert 1e-6 < row.mean_s < 1.0, row
    series = stack.client.query(
        'SELECT sum("count"), sum("sum"), max("max"), min("min") '
        'FROM "stepwatch.step.duration" '
        f'WHERE "stepwatch.job.id" = {quote_literal(clean_run.job)} GROUP BY "stepwatch.rank"'
    )
    assert len(series) == RANKS
    phase_mean_sum = {rank: 0.0 for rank in range(RANKS)}
    for row in clean_run.rows:
        if row.phase != "communication":  # overlaps backward
            phase_mean_sum[row.rank] += row.mean_s
    timed = _timed_step_mean_s(stack, clean_run.job)
    for item in series:
        _, count, total_s, longest_s, shortest_s = item.values[0]
        rank = int(item.tags["stepwatch.rank"])
        assert count == STEPS
        assert 0 < shortest_s <= total_s / count <= longest_s < 5.0
        # Phases partition the step (data, forward, backward, optimizer; the rest is loop
        # overhead): their means add up to the mean of the steps they were timed on within
        # 25% (with phases sampled, a hiccup on an untimed step is in the step mean only).
        assert phase_mean_sum[rank] == pytest.approx(timed[rank], rel=0.25)


def _timed_step_mean_s(stack: LocalStack, job: str) -> dict[int, float]:
    """Per rank, the mean duration of the steps whose phases were timed (docs/schema.md):
    every step of a window before the rank's first sampled-step point, then the sampled
    steps (weighted as their phases)."""
    assert stack.client is not None
    where = f'WHERE "stepwatch.job.id" = {quote_literal(job)} GROUP BY "stepwatch.rank"'
    windows: dict[int, dict[int, tuple[str, float, float]]] = {}
    for measurement in ("stepwatch.step.duration", "stepwatch.step.sampled.duration"):
        for item in stack.client.query(f'SELECT "count", "sum" FROM "{measurement}" {where}'):
            rank = int(item.tags["stepwatch.rank"])
            for time_ns, count, total_s in item.values:
                known = windows.setdefault(rank, {}).get(time_ns)
                if known is None or measurement.endswith("sampled.duration"):
                    windows[rank][time_ns] = (measurement, count, total_s)
    means = {}
    for rank, by_time in windows.items():
        ordered = [by_time[t] for t in sorted(by_time)]
        first = next(
            (i for i, w in enumerate(ordered) if w[0].endswith("sampled.duration")), len(ordered)
        )
        kept = ordered[:first] + [w for w in ordered[first:] if w[0].endswith("sampled.duration")]
        means[rank] = sum(w[2] for w in kept) / sum(w[1] for w in kept)
    return means


def test_tags_are_the_schema_resource_attributes(
    stack: LocalStack, clean_run: StoredSummary
) -> None:
    assert stack.client is not None
    keys = {
        row[0]
        for series in stack.client.query('SHOW TAG KEYS FROM "stepwatch.phase.duration"')
        for row in series.values
    }
    assert {"stepwatch.job.id", "stepwatch.rank", "stepwatch.world_size", "host.name"} <= keys
    assert "stepwatch.phase" in keys
    hosts = stack.client.query(
        'SHOW TAG VALUES FROM "stepwatch.step.duration" WITH KEY = "host.name" '
        f'WHERE "stepwatch.job.id" = {quote_literal(clean_run.job)}'
    )
    assert len(hosts[0].values) == RANKS // 2  # the demo puts two ranks per node


def test_stored_bytes_per_rank_per_step_are_small(clean_run: StoredSummary) -> None:
    per_step = clean_run.bytes_per_rank_step(STEPS)
    assert per_step is not None
    print(f"\nline protocol stored: {per_step:.0f} bytes per rank per step")
    # Step, phase and step.last series at ≤2 windows/s: well under ARGUS's 2.7 KB.
    assert per_step < 2700


def test_demo_cli_help_lists_fault_flags(tmp_path: Path) -> None:
    from stepwatch.app._cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["demo", "--fault", "straggler", "--fault-rank", "1"])
    assert (args.fault, args.fault_rank, args.ranks, args.steps) == ("straggler", 1, 4, 600)
    # No arguments: the default story (a straggler from step 240), kernels as the fault says.
    default = parser.parse_args(["demo"])
    assert (default.fault, default.fault_rank, default.fault_step) == ("straggler", 2, 240)
    assert default.kernels is None and parser.parse_args(["demo", "--no-kernels"]).kernels is False
    # Phase sampling: every step by default, 'auto' or a stride; anything else is refused.
    assert default.phase_sampling == "auto"
    assert parser.parse_args(["demo", "--phase-sampling", "auto"]).phase_sampling == "auto"
    assert parser.parse_args(["demo", "--phase-sampling", "8"]).phase_sampling == 8
    for bad in ("0", "-2", "often"):
        with pytest.raises(SystemExit):
            parser.parse_args(["demo", "--phase-sampling", bad])
