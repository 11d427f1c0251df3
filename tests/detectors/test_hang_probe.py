"""The hang probe through the real pipeline: StepMonitors → the bridge → influxd → the probe.

Four "ranks" are threads of this process, each with its own real ``StepMonitor`` exporting over
OTLP/HTTP to a real bridge in front of the session's influxd; a shared barrier plays the
collective (the ranks wait for each other in their ``communication`` phase). The threshold is
lowered to 2 s so each case takes seconds; the real DDP jobs are in tests/app/test_hang_ddp.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from stepwatch.app._stack import LocalStack
from stepwatch.core import InfluxClient, ManagedAlertmanager, ManagedInfluxDB
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.detectors import DetectorConfig, DetectorService, MemorySink, read_diagnoses
from stepwatch.detectors.analysis.rules.hang import find_hangs
from stepwatch.detectors.frame import read_progress
from stepwatch.detectors.sinks import AlertmanagerSink
from stepwatch.exporters import OtlpHttpExporter, StepMonitor
from tests.detectors.conftest import WebhookReceiver

FAST = DetectorConfig(hang_min_s=2.0)
WORLD = 4


class Freezable:
    """An exporter that can be frozen like a SIGSTOPped process's export thread."""

    def __init__(self, endpoint: str) -> None:
        self.inner = OtlpHttpExporter(f"{endpoint}/v1/metrics", timeout_s=5.0)
        self.thawed = threading.Event()
        self.thawed.set()

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        self.thawed.wait()
        return self.inner.export(metrics_data, timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        self.thawed.set()
        self.inner.shutdown(timeout_millis=timeout_millis)


class Job:
    """``WORLD`` rank threads stepping in lockstep; ``block`` decides where each one stops."""

    def __init__(self, endpoint: str) -> None:
        self.id = f"probe-{uuid.uuid4().hex[:8]}"
        self.exporters = [Freezable(endpoint) for _ in range(WORLD)]
        self.monitors = [
            StepMonitor(
                job_id=self.id,
                rank=rank,
                world_size=WORLD,
                host_name=f"node{rank // 2}",
                exporter=self.exporters[rank],
                export_interval_s=0.2,
                health=False,
            )
            for rank in range(WORLD)
        ]
        self.collective = threading.Barrier(WORLD)
        self.go = threading.Event()
        self.go.set()
        self.hold: Callable[[int, int], str | None] = lambda rank, step: None
        self.stop = threading.Event()
        self.steps = 0
        self.closing: set[int] = set()
        self.threads = [
            threading.Thread(target=self._run, args=(r,), daemon=True) for r in range(WORLD)
        ]

    def _run(self, rank: int) -> None:
        monitor = self.monitors[rank]
        step = 0
        while not self.stop.is_set() and rank not in self.closing:
            with monitor.step():
                with monitor.phase("data"):
                    time.sleep(0.002)
                    if self.hold(rank, step) == "data":
                        self.go.wait()
                # read once: a hold set between two reads would block the rank in "forward"
                held = self.hold(rank, step)
                with monitor.phase(held or "forward"):
                    if held in ("eval", "checkpoint"):
                        self.go.wait()
                    time.sleep(0.008)
                with monitor.phase("communication"):
                    try:
                        self.collective.wait(timeout=120)
                    except threading.BrokenBarrierError:
                        return
            step += 1
            if rank == 0:
                self.steps = step
        monitor.close()

    def __enter__(self) -> Job:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.go.set()
        for exporter in self.exporters:
            exporter.thawed.set()
        self.stop.set()
        self.collective.abort()
        for thread in self.threads:
            thread.join(timeout=30)
        for monitor in self.monitors:
            monitor.close()


@pytest.fixture
def stack(influxd: ManagedInfluxDB, tmp_path: Path) -> Iterator[LocalStack]:
    database = f"hang_{uuid.uuid4().hex[:8]}"
    with LocalStack(tmp_path / "stack", influx_url=influxd.url, database=database) as local:
        yield local


def _client(stack: LocalStack) -> InfluxClient:
    assert stack.client is not None
    return stack.client


def _wait(predicate: Callable[[], Any], *, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s")


def _hangs(client: InfluxClient, job: str, *, state: str | None = None) -> list[Diagnosis]:
    stored = read_diagnoses(client, job, state=state)
    return [diagnosis for diagnosis, _ in stored if diagnosis.kind == "hang"]


def _service(client: InfluxClient, *sinks: Any) -> DetectorService:
    return DetectorService(
        client, sinks=[MemorySink(), *sinks], interval_s=3600, probe_interval_s=0.5, config=FAST
    )


def test_a_stuck_rank_is_named_alerted_and_closed_when_the_job_moves_again(
    stack: LocalStack, alertmanager: ManagedAlertmanager, webhook: WebhookReceiver
) -> None:
    client = _client(stack)
    service = _service(client, AlertmanagerSink(alertmanager.url))
    with Job(stack.otlp_http_endpoint) as job:
        _wait(lambda: job.steps >= 30, timeout_s=30)
        onset = time.monotonic()
        job.go.clear()
        job.hold = lambda rank, step: "data" if rank == 2 else None
        service.start()
        try:
            (hang,) = _wait(lambda: _hangs(client, job.id, state="open"), timeout_s=30)
            print(f"found {time.monotonic() - onset:.1f} s after the onset")
            found_after_s = time.monotonic() - onset
            assert (hang.ranks, hang.phase, hang.severity) == ((2,), "data", "critical")
            assert hang.hosts == ("node1",)
            assert "wait in communication" in hang.summary
            # Threshold + probe period + exports, and the service's first (full) pass, which
            # runs first and shares its thread with the probe, on a loaded 2-core host.
            assert found_after_s < 15.0, found_after_s
            firing = webhook.wait_for(
                lambda p: (
                    p["groupLabels"].get("training_job") == job.id and p["status"] == "firing"
                ),
                timeout_s=30,
            )
            labels = firing["alerts"][0]["labels"]
            assert (labels["kind"], labels["severity"], labels["rank"]) == ("hang", "critical", "2")

            job.hold = lambda rank, step: None
            job.go.set()  # the loader returns: the job moves again
            (closed,) = _wait(lambda: _hangs(client, job.id, state="closed"), timeout_s=20)
            assert closed.finding_id == hang.finding_id and closed.end_unix_nano is not None
            webhook.wait_for(
                lambda p: (
                    p["groupLabels"].get("training_job") == job.id and p["status"] == "resolved"
                ),
                timeout_s=30,
            )
        finally:
            service.stop()
    assert len(_hangs(client, job.id)) == 1


def test_a_frozen_rank_is_named_while_its_peers_wait(stack: LocalStack) -> None:
    client = _client(stack)
    service = _service(client)
    with Job(stack.otlp_http_endpoint) as job:
        _wait(lambda: job.steps >= 30, timeout_s=30)
        job.go.clear()
        job.exporters[1].thawed.clear()  # its export thread freezes ...
        job.hold = lambda rank, step: "data" if rank == 1 else None  # ... and its training
        service.start()
        try:
            (hang,) = _wait(lambda: _hangs(client, job.id, state="open"), timeout_s=30)
        finally:
            service.stop()
    assert hang.ranks == (1,)
    assert "rank 1 silent since" in hang.summary


def test_a_long_step_on_every_rank_is_not_a_hang(stack: LocalStack) -> None:
    client = _client(stack)
    service = _service(client)
    with Job(stack.otlp_http_endpoint) as job:
        _wait(lambda: job.steps >= 30, timeout_s=30)
        job.go.clear()
        # Every rank evaluates for 5 s (2.5x the threshold), from the same step: a hold that
        # changed between two ranks' reads of one step left the later ones in the collective.
        start = job.steps + 2  # the ranks are at most a step apart (the barrier)
        job.hold = lambda rank, step: "eval" if step >= start else None

        def all_evaluating() -> bool:
            ranks = read_progress(client, job.id, now_unix_nano=time.time_ns()).ranks
            return len(ranks) == WORLD and all(r.phase == "eval" for r in ranks)

        _wait(all_evaluating, timeout_s=10)
        time.sleep(4.0)
        assert service.probe_once()[job.id].opened == ()
        job.go.set()
        job.hold = lambda rank, step: None
        _wait(lambda: job.steps >= 60, timeout_s=30)
    assert _hangs(client, job.id) == []


def test_a_rank_that_exits_and_the_end_of_the_job_are_not_hangs(stack: LocalStack) -> None:
    client = _client(stack)
    service = _service(client)
    with Job(stack.otlp_http_endpoint) as job:
        job.collective = threading.Barrier(WORLD - 1)  # rank 3 leaves; the others go on
        job.closing.add(3)
        _wait(lambda: job.steps >= 30, timeout_s=30)
        time.sleep(3.0)
        assert service.probe_once()[job.id].opened == ()
    # Every monitor closed: the job ended.
    time.sleep(3.0)
    results = service.probe_once()
    assert job.id not in results or results[job.id].opened == ()
    progress = read_progress(client, job.id, now_unix_nano=time.time_ns())
    assert all(r.closed for r in progress.ranks)
    assert _hangs(client, job.id) == []


class _SteppedClock:
    """A monitor clock that moves only when told to, its wall time ``behind_s`` in the past."""

    def __init__(self, behind_s: float) -> None:
        self.now_ns = 1_000_000_000
        self.wall_anchor_ns = time.time_ns() - round(behind_s * 1e9)

    def monotonic_ns(self) -> int:
        return self.now_ns

    def time_ns(self) -> int:
        return self.wall_anchor_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += round(seconds * 1e9)


def test_a_hang_just_after_an_export_is_not_every_rank_silent(stack: LocalStack) -> None:
    # 10 s windows (the default interval): a hang 0.5 s after an export leaves each rank's
    # last window of steps 0.5 s long. The ranks' cadence is the longer of their last two
    # windows (10 s), not that one: 12 s after the hang, before the next window says where
    # each rank is, no rank is silent yet (it was "every rank stopped reporting" before).
    client = _client(stack)
    job = f"cadence-{uuid.uuid4().hex[:8]}"
    clock = _SteppedClock(behind_s=22.5)
    monitors = [
        StepMonitor(
            job_id=job,
            rank=rank,
            world_size=WORLD,
            exporter=OtlpHttpExporter(f"{stack.otlp_http_endpoint}/v1/metrics", timeout_s=5.0),
            clock=clock,
            start=False,
            health=False,
        )
        for rank in range(WORLD)
    ]
    try:
        for steps in (100, 5):  # 10 s of 0.1 s steps, an export; 0.5 s more, an export
            for _ in range(steps):
                with contextlib.ExitStack() as open_steps:
                    for monitor in monitors:
                        open_steps.enter_context(monitor.step())
                    clock.advance(0.1)
            for monitor in monitors:
                assert monitor.export_now()
        onset_ns = clock.wall_anchor_ns + (clock.now_ns - 1_000_000_000)

        def every_rank_stored() -> Any:
            progress = read_progress(client, job, now_unix_nano=onset_ns + 12 * 10**9)
            return progress if len(progress.ranks) == WORLD else None

        progress = _wait(every_rank_stored, timeout_s=10)
        assert progress.export_interval_s == pytest.approx(10.0, rel=0.05)
        assert [r.export_window_s for r in progress.ranks] == [pytest.approx(10.0, rel=0.05)] * 4
        hangs = find_hangs(progress, hang_steps=10.0, hang_min_s=10.0)
        assert hangs == []  # stuck or waiting is not known until the next window
    finally:
        for monitor in monitors:
            monitor.close()
