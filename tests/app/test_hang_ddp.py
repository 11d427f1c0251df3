"""A hung real DDP job is found in seconds and the rank that holds it is named (issue 12).

Real 4-rank PyTorch DDP jobs (separate processes, gloo on loopback, ``StepMonitor`` in auto
mode with an explicit data phase) stream through a real bridge into the session's influxd,
while the stack's detector service runs with ``stepwatch up``'s defaults (a full pass every
30 s, a hang probe every 5 s, threshold max(10 s, 10 usual steps)). Each hung job runs in its
own session and is killed whole afterwards; the test checks no process of it is left.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from stepwatch.app._demo import HangDemo, run_hang_demo
from stepwatch.app._demo_job import DemoJobConfig, start
from stepwatch.app._stack import LocalStack
from stepwatch.core import Diagnosis, InfluxClient, ManagedInfluxDB
from stepwatch.core._influx import wait_until
from stepwatch.detectors import detect_job, read_diagnoses
from stepwatch.detectors.frame import read_progress

pytestmark = pytest.mark.slow

#: The issue's bound with `up`'s defaults: the finding exists within 30 s of the onset.
FOUND_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def stack(
    influxd: ManagedInfluxDB, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    database = f"hang_{uuid.uuid4().hex[:8]}"
    with LocalStack(
        tmp_path_factory.mktemp("stack"),
        influx_url=influxd.url,
        database=database,
        detect_every_s=30.0,  # `stepwatch up`'s default; the probe's 5 s is the setting's
    ) as local:
        yield local


def _client(stack: LocalStack) -> InfluxClient:
    assert stack.client is not None
    return stack.client


def _config(stack: LocalStack, fault: str, **options: object) -> DemoJobConfig:
    return DemoJobConfig(
        job_id=f"{fault}-{uuid.uuid4().hex[:6]}",
        fault=fault,
        fault_rank=2,
        fault_step=60,
        steps=100_000,  # never reached: the job hangs
        endpoint=stack.otlp_http_endpoint,
        **options,  # type: ignore[arg-type]
    )


def _gone(seen: HangDemo) -> bool:
    try:
        os.killpg(seen.process_group, 0)
    except ProcessLookupError:
        return True
    return False


#: Where the waiting ranks are, by the job's instrumentation: auto mode's communication
#: phase, or (the README's loop: hand phases, no communication) backward, which holds DDP's
#: all-reduce.
WAITING = {
    "auto": "ranks 0-1,3 wait in communication",
    "hand": "ranks 0-1,3 wait in backward (which holds the collective)",
}


def _one_shot(client: InfluxClient, job: str, found: list[Diagnosis]) -> Callable[[], None]:
    """A one-shot ``stepwatch detect`` over the last minutes of the hung job."""

    def detect() -> None:
        now = time.time_ns()
        found.extend(detect_job(client, job, start_unix_nano=now - 600 * 10**9, end_unix_nano=now))

    return detect


@pytest.mark.parametrize(
    ("instrumentation", "phase_sampling"), [("auto", 1), ("auto", 1_000_000), ("hand", "auto")]
)
def test_a_rank_blocked_in_its_data_phase_is_named_within_30_s(
    stack: LocalStack, instrumentation: str, phase_sampling: int | str
) -> None:
    # 1_000_000: auto mode times (almost) no step's phases: the waiting ranks are found in
    # communication from their stacks and the last gradient's mark (``_AutoState._stack_phase``).
    config = _config(stack, "hang", phase_sampling=phase_sampling, instrumentation=instrumentation)
    detected: list[Diagnosis] = []
    seen = run_hang_demo(
        _client(stack),
        config,
        progress=lambda _: None,
        while_hung=_one_shot(_client(stack), config.job_id, detected),
    )
    assert _gone(seen), "a process of the hung job is still alive"
    finding = seen.finding
    assert finding is not None, "no hang found"
    assert (finding.ranks, finding.phase, finding.severity) == ((2,), "data", "critical")
    assert WAITING[instrumentation] in finding.summary
    assert seen.found_after_s is not None and seen.found_after_s <= FOUND_WITHIN_S
    assert seen.closed is not None, "the finding did not close once the job was killed"
    hangs = [d for d in detected if d.kind == "hang"]
    assert [(d.ranks, d.phase) for d in hangs] == [((2,), "data")], detected


@pytest.mark.parametrize("instrumentation", ["auto", "hand"])
def test_a_sigstopped_rank_is_named_within_30_s(stack: LocalStack, instrumentation: str) -> None:
    config = _config(stack, "freeze", instrumentation=instrumentation)
    detected: list[Diagnosis] = []
    seen = run_hang_demo(
        _client(stack),
        config,
        progress=lambda _: None,
        while_hung=_one_shot(_client(stack), config.job_id, detected),
    )
    assert _gone(seen), "a process of the frozen job is still alive"
    finding = seen.finding
    assert finding is not None, "no hang found"
    assert (finding.ranks, finding.severity) == ((2,), "critical")
    assert "rank 2 silent since" in finding.summary
    assert WAITING[instrumentation] in finding.summary
    assert seen.found_after_s is not None and seen.found_after_s <= FOUND_WITHIN_S
    assert seen.closed is not None
    assert [d.ranks for d in detected if d.kind == "hang"] == [(2,)], detected


@pytest.mark.parametrize("instrumentation", ["auto", "hand"])
def test_an_evaluation_pass_on_every_rank_and_the_end_of_the_job_are_not_hangs(
    stack: LocalStack, instrumentation: str
) -> None:
    client = _client(stack)
    config = DemoJobConfig(
        job_id=f"eval-{uuid.uuid4().hex[:6]}",
        fault="eval",  # every rank evaluates for 15 s at step 40: longer than the threshold
        fault_step=40,
        steps=120,
        endpoint=stack.otlp_http_endpoint,
        instrumentation=instrumentation,
    )
    detector = stack.detector_service
    assert detector is not None
    with start(config) as job:

        def evaluating_past_the_threshold() -> bool:
            now = time.time_ns()
            ranks = read_progress(client, config.job_id, now_unix_nano=now).ranks
            return len(ranks) == 4 and all(
                r.phase == "eval" and now - r.last_progress_unix_nano > 10.5e9 for r in ranks
            )

        assert wait_until(evaluating_past_the_threshold, timeout_s=90, interval_s=0.25)
        assert detector.probe_once()[config.job_id].opened == ()
        assert job.wait(120) == 0  # the job ends: every monitor closes
    detector.probe_once()  # once more after the end
    stored = [d for d, _ in read_diagnoses(client, config.job_id) if d.kind == "hang"]
    assert stored == []
