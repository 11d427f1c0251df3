"""Round trips through a real influxd: reader, diagnosis sink, incremental runner, CLI."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepwatch.app._cli import main
from stepwatch.app._replay import iter_line_batches, send_otlp, write_direct
from stepwatch.core import Diagnosis, InfluxClient
from stepwatch.core._influx import count_points, wait_until
from stepwatch.core._schema import DIAGNOSIS_MEASUREMENT
from stepwatch.detectors import (
    DetectorService,
    Fault,
    IncrementalDetector,
    InfluxDiagnosisSink,
    MemorySink,
    SimulatedJob,
    Topology,
    detect_job,
    read_diagnoses,
    read_frame,
    simulate,
)

WINDOW_NS = 5_000_000_000


@pytest.fixture(scope="module")
def small_job() -> SimulatedJob:
    faults = [
        dataclasses.replace(Fault.parse("compute_straggler@60:3:1.5"), end_step=150),
        Fault.parse("rank_missing@170:6"),
    ]
    return simulate(8, steps=250, faults=faults, seed=21, job="it-job")


@pytest.fixture(scope="module")
def small_lines(small_job: SimulatedJob) -> list[str]:
    """The job's line protocol (exporters' WindowBuilder → bridge's convert_request), once."""
    return [line for batch in iter_line_batches(small_job) for line in batch]


def test_reader_rebuilds_the_simulated_frame(influx: InfluxClient, small_job: SimulatedJob) -> None:
    assert write_direct(small_job, influx) > 0
    truth = small_job.truth
    frame = read_frame(
        influx, truth.job, start_unix_nano=truth.start_unix_nano, end_unix_nano=truth.end_unix_nano
    )
    memory = small_job.frame()
    assert frame.window_s == 5.0
    n = memory.n_windows
    assert frame.ranks.tolist() == list(range(8))
    assert frame.hosts == memory.hosts
    assert np.array_equal(frame.present[:n], memory.present)
    np.testing.assert_allclose(frame.step_s[:n], memory.step_s, rtol=1e-9)
    np.testing.assert_allclose(frame.phase_s[:n], memory.phase_s, rtol=1e-9)
    np.testing.assert_allclose(frame.idle_s[:n], memory.idle_s, rtol=1e-9)
    # Kernel sums travel with 12 significant bits (exporters' DEFAULT_KERNEL_SIGNIFICANT_BITS).
    for index, name in enumerate(memory.kernel_classes):
        ours = frame.kernel_s[:n, :, frame.kernel_classes.index(name)]
        np.testing.assert_allclose(ours, memory.kernel_s[:, :, index], rtol=2.0**-12)
    assert frame.sm_clock_hz is not None
    kinds = {
        (d.kind, d.ranks)
        for d in detect_job(
            influx,
            truth.job,
            start_unix_nano=truth.start_unix_nano,
            end_unix_nano=truth.end_unix_nano,
        )
    }
    assert kinds == {("compute_straggler", (3,)), ("rank_missing", (6,))}


def test_diagnosis_sink_is_idempotent(influx: InfluxClient) -> None:
    diagnosis = Diagnosis(
        job="j",
        kind="compute_straggler",
        ranks=(17,),
        hosts=("node-3",),
        phase="backward",
        kernel_class="gemm",
        start_unix_nano=1_795_291_200_000_000_000,
        end_unix_nano=None,
        severity="critical",
        score=3.4,
        summary="rank 17 backward compute 1.31x peers (gemm 1.42x) since 20:00:00",
    )
    sink = InfluxDiagnosisSink(influx)
    sink.publish([diagnosis])
    sink.publish([diagnosis])
    closed = dataclasses.replace(diagnosis, end_unix_nano=diagnosis.start_unix_nano + WINDOW_NS)
    sink.publish([closed])
    assert count_points(influx, DIAGNOSIS_MEASUREMENT) == 1
    ((stored, _),) = read_diagnoses(influx, "j")
    assert stored == closed
    rows = influx.query(
        'SELECT "text", "title", "time_end" FROM "stepwatch.diagnosis" WHERE "kind" = '
        "'compute_straggler'",
        epoch="ms",
    )[0].records()
    assert rows[0]["time_end"] == rows[0]["time"] + 5000
    assert rows[0]["title"] == "compute_straggler: rank 17 backward gemm"


class _Clock:
    def __init__(self, now_unix_nano: int) -> None:
        self.now_unix_nano = now_unix_nano

    def __call__(self) -> int:
        return self.now_unix_nano


class _CrashingSink:
    """Dies like a killed process would, after the state was written."""

    def publish(self, findings: object) -> None:
        raise KeyboardInterrupt


def test_incremental_runner_survives_restarts_without_duplicates(
    influx: InfluxClient, small_job: SimulatedJob, small_lines: list[str]
) -> None:
    influx.write_lines(small_lines)
    start = small_job.truth.start_unix_nano
    clock = _Clock(start)
    memory = MemorySink()
    printed: list[Diagnosis] = []

    class _Recorder:
        def publish(self, findings: list[Diagnosis]) -> None:
            printed.extend(findings)

    def detector(*sinks: object) -> IncrementalDetector:
        return IncrementalDetector(
            influx, "it-job", sinks=[memory, *sinks], lookback_s=300.0, clock=clock
        )

    opened: list[Diagnosis] = []
    closed: list[Diagnosis] = []
    for window in range(8, 57, 4):
        clock.now_unix_nano = start + window * WINDOW_NS
        if window == 20:  # killed mid-run, restarted (a fresh object reads the stored state)
            with pytest.raises(KeyboardInterrupt):
                detector(_CrashingSink()).run_pass()
            continue
        result = detector().run_pass()  # a new process every pass
        opened.extend(result.opened)
        closed.extend(result.closed)
    stored = [d for d, _ in read_diagnoses(influx, "it-job")]
    assert sorted((d.kind, d.ranks) for d in stored) == [
        ("compute_straggler", (3,)),
        ("rank_missing", (6,)),
    ]
    assert count_points(influx, DIAGNOSIS_MEASUREMENT) == 2
    assert len({d.finding_id for d in opened}) == len(opened) <= 2
    straggler = next(d for d in stored if d.kind == "compute_straggler")
    missing = next(d for d in stored if d.kind == "rank_missing")
    assert straggler.end_unix_nano is not None
    assert 30 <= (straggler.end_unix_nano - start) / WINDOW_NS <= 38
    assert abs((straggler.start_unix_nano - start) / WINDOW_NS - 12) <= 1
    assert missing.end_unix_nano is None
    assert [d.finding_id for d in closed] == [straggler.finding_id]
    assert set(memory.findings) == {straggler.finding_id, missing.finding_id}
    assert memory.findings[straggler.finding_id].end_unix_nano == straggler.end_unix_nano


def test_detector_service_runs_every_job(
    influx: InfluxClient, small_job: SimulatedJob, small_lines: list[str]
) -> None:
    influx.write_lines(small_lines)
    clock = _Clock(small_job.truth.start_unix_nano + 45 * WINDOW_NS)
    memory = MemorySink()
    service = DetectorService(influx, sinks=[memory], interval_s=0.05, lookback_s=600, clock=clock)
    results = service.run_once()
    assert list(results) == ["it-job"]
    assert {d.kind for d in memory.findings.values()} == {"compute_straggler", "rank_missing"}
    service.start()
    service.stop()


def test_cli_simulate_detect_evaluate(influx: InfluxClient, tmp_path: Path) -> None:
    truth = tmp_path / "truth.json"
    common = ["--influx-url", influx.url, "--database", influx.database]
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        code = main(
            [
                "simulate",
                "--ranks",
                "8",
                "--steps",
                "150",
                "--fault",
                "dataloader_stall@60:4:1.3",
                "--seed",
                "3",
                "--job",
                "cli-job",
                "--write-direct",
                "--truth",
                str(truth),
                *common,
            ]
        )
    assert code == 0, buffer.getvalue()
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(["detect", "--job", "cli-job", "--since", "1h", "--json", *common]) == 0
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [(d["kind"], d["ranks"], d["phase"]) for d in lines] == [
        ("dataloader_stall", [4], "data")
    ]
    diagnoses = tmp_path / "d.jsonl"
    diagnoses.write_text(buffer.getvalue())
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(["evaluate", "--truth", str(truth), "--diagnoses", str(diagnoses)]) == 0
        assert main(["evaluate", "--truth", str(truth), "--json", *common]) == 0
    assert "localised=True" in buffer.getvalue()
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(["detect", "--job", "cli-job", "--since", "1h", *common]) == 0
        assert (
            main(
                ["detect", "--job", "cli-job", "--every", "1s", "--passes", "1", "--json", *common]
            )
            == 0
        )
    assert "dataloader_stall" in buffer.getvalue()
    assert count_points(influx, DIAGNOSIS_MEASUREMENT) == 1
    # A restarted incremental runner finds the open finding in InfluxDB: nothing new printed.
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        every = ["detect", "--job", "cli-job", "--every", "1s", "--passes", "1", "--json"]
        assert main([*every, *common]) == 0
    assert buffer.getvalue() == ""
    assert count_points(influx, DIAGNOSIS_MEASUREMENT) == 1


@pytest.mark.parametrize("producer", ["backward-timer", "phase-timer"])
def test_cli_simulates_other_producers(influx: InfluxClient, producer: str) -> None:
    """``--producer``: no communication phase (and, phase-timer, no device metrics) is
    written, and the stall is still found on the right rank."""
    from stepwatch.core._schema import KERNEL_DURATION, PHASE, PHASE_DURATION

    job = f"cli-{producer}"
    common = ["--influx-url", influx.url, "--database", influx.database]
    simulate_args = ["simulate", "--ranks", "8", "--steps", "150", "--seed", "3"]
    fault = ["--fault", "dataloader_stall@60:4:1.3", "--job", job, "--producer", producer]
    with redirect_stdout(io.StringIO()):
        assert main([*simulate_args, *fault, "--write-direct", *common]) == 0
    phases = {
        str(row[1])
        for series in influx.query(
            f'SHOW TAG VALUES FROM "{PHASE_DURATION}" WITH KEY = "{PHASE}" '
            f"WHERE \"stepwatch.job.id\" = '{job}'"
        )
        for row in series.values
    }
    assert "backward" in phases and "data" in phases and "communication" not in phases
    kernels = count_points(influx, KERNEL_DURATION, f"\"stepwatch.job.id\" = '{job}'")
    assert (kernels == 0) == (producer == "phase-timer")
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(["detect", "--job", job, "--since", "1h", "--json", *common]) == 0
    found = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [(d["kind"], d["ranks"]) for d in found] == [("dataloader_stall", [4])]


def test_simulated_ranks_over_otlp_through_the_bridge(influx: InfluxClient) -> None:
    from stepwatch.core._influx import wait_until
    from stepwatch.otel_bridge import Bridge, InfluxV1Writer

    job = simulate(
        8, steps=120, faults=[Fault.parse("gpu_health@50:2:1.3")], seed=8, job="otlp-job"
    )
    bridge = Bridge(InfluxV1Writer(influx), grpc_port=None, http_port=0)
    bridge.start()
    try:
        exports = send_otlp(job, f"http://127.0.0.1:{bridge.http_port}")
        assert exports == 8 * job.n_windows
        expected = 8 * job.n_windows
        assert wait_until(
            lambda: count_points(influx, "stepwatch.step.duration") >= expected, timeout_s=30
        )
    finally:
        bridge.stop()
    truth = job.truth
    frame = read_frame(
        influx, truth.job, start_unix_nano=truth.start_unix_nano, end_unix_nano=truth.end_unix_nano
    )
    np.testing.assert_allclose(frame.step_s[: job.n_windows], job.frame().step_s, rtol=1e-9)
    # No NVML exporter in a simulation: GPU health shows as a compute straggler on rank 2
    # (every compute class slower); with the clock it would be named gpu_health.
    kinds = {
        (d.kind, d.ranks)
        for d in detect_job(
            influx,
            truth.job,
            start_unix_nano=truth.start_unix_nano,
            end_unix_nano=truth.end_unix_nano,
        )
    }
    assert kinds == {("compute_straggler", (2,))}


def test_one_shot_and_incremental_give_the_same_findings_and_costs(influx: InfluxClient) -> None:
    # A pipeline job with structure (heavier first and last stages), a straggler and a
    # heavy stage: `detect` over the job and one `--every` pass at its end agree.
    from stepwatch.detectors.simulation._suite import stage_work

    faults = [
        Fault.parse("stage_imbalance@0:12-15:1.4"),
        Fault("compute_straggler", 40, (5,), 2.0, kernel_class="gemm"),
    ]
    job = simulate(
        16, steps=200, topology=Topology(4, 1, 4), faults=faults, seed=9, job="same-job",
        stage_work=stage_work(4), gc_rate=0.01,
    )  # fmt: skip
    write_direct(job, influx)
    truth = job.truth
    one_shot = detect_job(
        influx, "same-job", start_unix_nano=truth.start_unix_nano, end_unix_nano=truth.end_unix_nano
    )
    result = IncrementalDetector(
        influx,
        "same-job",
        lookback_s=(truth.end_unix_nano - truth.start_unix_nano) / 1e9,
        clock=_Clock(truth.end_unix_nano),
    ).run_pass()
    assert sorted((d.kind, d.ranks) for d in one_shot) == [
        ("compute_straggler", (5,)),
        ("stage_imbalance", (12, 13, 14, 15)),
    ]
    assert [d.slowdown for d in one_shot] == sorted((d.slowdown for d in one_shot), reverse=True)
    incremental = sorted(result.open_now, key=lambda d: -d.slowdown)
    assert [(d.kind, d.ranks, round(d.slowdown, 3)) for d in incremental] == [
        (d.kind, d.ranks, round(d.slowdown, 3)) for d in one_shot
    ]
    stored = sorted((d for d, _ in read_diagnoses(influx, "same-job")), key=lambda d: -d.slowdown)
    assert [round(d.slowdown, 3) for d in stored] == [round(d.slowdown, 3) for d in one_shot]


class _BuggyOnce(InfluxClient):
    """A real client whose first query fails with a bug, not an InfluxDB error."""

    def __init__(self, client: InfluxClient) -> None:
        super().__init__(client.url, database=client.database)
        self.queries = 0

    def query(self, influxql: str, *, database: str | None = None, epoch: str = "ns") -> Any:
        self.queries += 1
        if self.queries == 1:
            raise RuntimeError("a bug in a pass")
        return super().query(influxql, database=database, epoch=epoch)


def test_the_service_outlives_a_bug_in_one_pass(
    influx: InfluxClient, caplog: pytest.LogCaptureFixture
) -> None:
    client = _BuggyOnce(influx)
    service = DetectorService(client, interval_s=0.05, probe_interval_s=0)
    with caplog.at_level(logging.ERROR, logger="stepwatch.detectors"):
        service.start()
        try:
            assert wait_until(lambda: client.queries >= 3, timeout_s=10)
            assert all(thread.is_alive() for thread in service._threads)
        finally:
            service.stop()
    assert any("a bug in a pass" in (r.exc_text or "") for r in caplog.records), caplog.text
