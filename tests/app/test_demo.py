"""The demo's injected faults are diagnosed from REAL data: a 4-rank DDP job on this host.

One real run (separate processes, gloo on loopback, StepMonitor → OTLP/HTTP → the bridge →
the session's influxd), then the same diagnosis the ``stepwatch demo`` CLI prints
(:func:`stepwatch.app._demo.write_outputs`). Timing on a shared 2-core host is noisy and bursty,
so this is the detectors' small-world test: four ranks, ~20 windows of 0.5 s.
"""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest

from stepwatch.app._demo import run_demo_job, write_outputs
from stepwatch.app._demo_job import DemoJobConfig
from stepwatch.app._stack import LocalStack
from stepwatch.core import Diagnosis, ManagedInfluxDB, _schema
from stepwatch.core._influx import QuerySeries
from stepwatch.detectors.frame import job_time_range
from stepwatch.detectors.frame._frame import export_window_s
from stepwatch.detectors.stats._stats import change_points, multiscale_outliers, sustained_outliers

STRAGGLER_KINDS = {"compute_straggler", "masked_straggler"}


def _four_rank_straggler(
    influxd: ManagedInfluxDB, tmp_path: Path
) -> tuple[list[Diagnosis], Path | None]:
    database = f"demo_{uuid.uuid4().hex[:8]}"
    with LocalStack(tmp_path / "stack", influx_url=influxd.url, database=database) as stack:
        assert stack.client is not None
        config = DemoJobConfig(
            job_id=f"straggler-{uuid.uuid4().hex[:6]}",
            fault="straggler",
            fault_rank=2,
            endpoint=stack.otlp_http_endpoint,
            # No kernel timings (the CLI's --no-kernels): the straggler is seen only in its
            # phases' wall time, a masked straggler. The CLI's 600 steps, 360 of them faulty:
            # on a 2-core host running 4 ranks, bursts of neighbour load can break the run of
            # consecutive windows the sustained rule needs (one CI run in about a dozen found
            # nothing when the job had 300 steps in all).
            collect_kernels=False,
        )
        summary = run_demo_job(stack.client, config, progress=lambda _: None)
        assert summary.last_step_by_rank == {rank: config.steps - 1 for rank in range(4)}
        time_range = job_time_range(stack.client, config.job_id)
        assert time_range is not None
        diagnoses, report = write_outputs(
            stack.client,
            config.job_id,
            out_dir=tmp_path,
            start_unix_nano=time_range[0] - 1_000_000_000,
            end_unix_nano=time_range[1] + 1_000_000_000,
        )
    return list(diagnoses), report


def _rank_alone(diagnoses: list[Diagnosis], rank: int) -> bool:
    """A straggler first, on ``rank``'s forward, and nothing else anywhere."""
    stragglers = [d for d in diagnoses if d.kind in STRAGGLER_KINDS]
    return (
        bool(stragglers)
        and stragglers[0] is diagnoses[0]
        and stragglers[0].phase == "forward"
        and all(d.ranks == (rank,) for d in diagnoses)
    )


# A rerun on an overloaded host is reported in pytest's warnings summary, not an error (the
# project turns warnings into errors: without this the first miss failed the test, no rerun).
RERUN_REPORTED = pytest.mark.filterwarnings("always:.-rank demo straggler missed:UserWarning")


def _rerun_warning(what: str, diagnoses: list[Diagnosis]) -> None:
    load, cores = os.getloadavg()[0], os.cpu_count()
    warnings.warn(
        f"{what} missed at load {load:.1f} on {cores} cores: "
        f"{[(d.kind, d.ranks, d.phase) for d in diagnoses]}; ran it again",
        stacklevel=2,
    )


@RERUN_REPORTED
def test_real_straggler_is_blamed_on_its_rank_and_forward_phase(
    influxd: ManagedInfluxDB, tmp_path: Path
) -> None:
    diagnoses, report = _four_rank_straggler(influxd, tmp_path / "first")
    if not _rank_alone(diagnoses, 2):
        # Load on the shared 2-core host: fresh-clone CI named ranks (2, 3) once and a full
        # local run (1, 2) once (rank 2 alone in 18 of 25 story runs at load 1-11, README).
        # One more run, reported in pytest's warnings; judge that one, as the story test does.
        _rerun_warning("4-rank demo straggler", diagnoses)
        diagnoses, report = _four_rank_straggler(influxd, tmp_path / "again")
    described = [(d.kind, d.ranks, d.phase) for d in diagnoses]
    # Rank 2 alone and first: the peers that wait for it are not stragglers, and nothing
    # else is blamed.
    assert _rank_alone(diagnoses, 2), described
    assert {d.kind for d in diagnoses} <= STRAGGLER_KINDS, described
    assert report is not None and report.exists()


def _two_rank_straggler(influxd: ManagedInfluxDB, tmp_path: Path) -> list[Diagnosis]:
    database = f"demo_{uuid.uuid4().hex[:8]}"
    with LocalStack(tmp_path / "stack", influx_url=influxd.url, database=database) as stack:
        assert stack.client is not None
        config = DemoJobConfig(
            job_id=f"straggler2-{uuid.uuid4().hex[:6]}",
            world_size=2,
            # 2 ranks step ~2x faster than 4: 3,000 steps (~15 s) give ~30 analysis windows
            steps=3000,
            fault="straggler",
            fault_rank=1,
            fault_step=1200,
            endpoint=stack.otlp_http_endpoint,
            collect_kernels=False,
        )
        run_demo_job(stack.client, config, progress=lambda _: None)
        time_range = job_time_range(stack.client, config.job_id)
        assert time_range is not None
        diagnoses, _ = write_outputs(
            stack.client,
            config.job_id,
            out_dir=tmp_path,
            start_unix_nano=time_range[0] - 1_000_000_000,
            end_unix_nano=time_range[1] + 1_000_000_000,
        )
    return list(diagnoses)


@RERUN_REPORTED
def test_a_real_two_rank_straggler_is_named_against_its_own_level(
    influxd: ManagedInfluxDB, tmp_path: Path
) -> None:
    """Two ranks are too few for the peers' statistics (``min_ranks`` 4): the rank that spent
    the job's step shift in its own forward while the other waited is named
    (``analysis/_few_ranks.py``); before, this read as a job regression "on every rank"."""
    diagnoses = _two_rank_straggler(influxd, tmp_path / "first")
    if not _rank_alone(diagnoses, 1):
        # One fresh-clone CI run of the 1,500-step version found nothing (right after setup);
        # 5 local runs were right. One more run, reported in the warnings; judge that one.
        _rerun_warning("2-rank demo straggler", diagnoses)
        diagnoses = _two_rank_straggler(influxd, tmp_path / "again")
    described = [(d.kind, d.ranks, d.phase) for d in diagnoses]
    assert _rank_alone(diagnoses, 1), described


# ---- the small-world statistics the real demo needs (fast, synthetic) ----------------------


def _single_window_test(log_values: np.ndarray) -> object:
    return multiscale_outliers(log_values, metric="m", scales=(1,))[1]


@pytest.mark.parametrize("noise", [0.05, 0.3, 1.0])
def test_sustained_rule_almost_never_flags_exchangeable_noise(noise: float) -> None:
    # Not "never": with four ranks, a rank that happens to be the slowest in 6 of 7 windows
    # by 1.5x or more is flagged. Measured: 2 runs in 3,000 at each of these noise levels
    # (log-normal sd up to 1.0, i.e. steps jittering by up to 2.7x). A hypothesis version
    # of this test found seed 723 at noise 1.0 (one of those runs) and so failed once in
    # ~60 CI runs; 400 fixed seeds bound the rate instead (<= 1 %).
    flagged = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        logs = rng.normal(0.0, noise, size=(40, 4))
        test = multiscale_outliers(logs, metric="m", scales=(1,))[1]
        flags = sustained_outliers(test, windows=6, q=1e-6, min_log_effect=np.log(1.5))
        flagged += bool(flags.any())
    assert flagged <= 4, flagged


def test_sustained_rule_flags_a_rank_slower_in_every_window_despite_bursty_peers() -> None:
    rng = np.random.default_rng(11)
    logs = rng.normal(0.0, 0.3, size=(20, 4))
    logs[rng.random((20, 4)) < 0.1] += 1.0  # bursts that move from rank to rank
    logs[8:, 2] += 2.0  # rank 2 ~7x slower from window 8 on
    test = multiscale_outliers(logs, metric="m", scales=(1,))[1]
    flags = sustained_outliers(test, windows=6, q=1e-6, min_log_effect=np.log(1.5))
    assert flags[:, 2].any() and not flags[:, [0, 1, 3]].any()
    assert int(np.flatnonzero(flags[:, 2])[0]) >= 8 + 6 - 1


def test_short_job_level_shift_is_found_and_short_noise_is_not() -> None:
    rng = np.random.default_rng(5)
    series = np.exp(rng.normal(0.0, 0.15, size=14))
    series[4:] *= 10.0
    points = change_points(series)
    assert [p.index for p in points] == [4]
    # The level alpha = 1e-3 per series holds for short series too (about 0.15% measured
    # over 2000 seeds): at most a rare false shift in 300 pure-noise series.
    false_shifts = sum(
        bool(change_points(np.exp(np.random.default_rng(seed).normal(0.0, 0.3, size=14))))
        for seed in range(300)
    )
    assert false_shifts <= 2


@pytest.mark.parametrize(
    ("export_s", "window_s"), [(0.25, 0.5), (0.26, 0.5), (0.5, 1.0), (1.0, 1.0), (10.2, 10.0)]
)
def test_analysis_window_follows_the_export_window(export_s: float, window_s: float) -> None:
    end = 1_700_000_000_000_000_000
    rows = [[end + i * 10**9, round(end + i * 10**9 - export_s * 1e9)] for i in range(5)]
    series = QuerySeries(
        name=_schema.STEP_DURATION,
        tags={},
        columns=["time", "start_time_unix_nano"],
        values=[list(row) for row in rows],
    )
    assert export_window_s([series]) == window_s
