"""Real GPU jobs (tests/data/gpu_runs): their own exporter's OTLP through the bridge, diagnosed.

Each capture is every OTLP/HTTP request a real DDP job on an NVIDIA H100 sent, recorded by
``bench/gpu_check.py``: CUPTI kernel histograms, NVML health and phases timed with CUDA events.
Here each request goes to the real bridge over HTTP, into the real influxd, and the detectors
read it back as they would a live job's.
"""

from __future__ import annotations

import base64
import gzip
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepwatch.core import Diagnosis, InfluxClient, _schema
from stepwatch.detectors import detect_job
from stepwatch.detectors.frame import job_time_range
from stepwatch.otel_bridge import Bridge, InfluxV1Writer

RUNS = Path(__file__).resolve().parents[1] / "data" / "gpu_runs"


@pytest.fixture
def bridge(influx: InfluxClient) -> Iterator[Bridge]:
    server = Bridge(InfluxV1Writer(influx), flush_interval_s=0.02, grpc_port=None).start()
    try:
        yield server
    finally:
        server.stop()


def replay(bridge: Bridge, name: str) -> str:
    """POST every request of ``<name>.otlp.jsonl.gz`` in order; the job id it carries."""
    meta = json.loads((RUNS / f"{name}.json").read_text())
    with gzip.open(RUNS / f"{name}.otlp.jsonl.gz", "rt") as lines:
        for line in lines:
            request = json.loads(line)
            headers = {"Content-Type": request["content_type"]}
            if request["content_encoding"]:
                headers["Content-Encoding"] = request["content_encoding"]
            post = urllib.request.Request(
                f"http://127.0.0.1:{bridge.http_port}{request['path']}",
                data=base64.b64decode(request["body"]),
                headers=headers,
                method="POST",
            )
            with urllib.request.urlopen(post, timeout=30) as answer:
                assert answer.status == 200
    bridge.stop()  # everything accepted is written before it returns
    return str(meta["job"])


def diagnose(influx: InfluxClient, job: str) -> list[Diagnosis]:
    span = job_time_range(influx, job)
    assert span is not None, f"{job}: nothing stored"
    return list(
        detect_job(influx, job, start_unix_nano=span[0] - 10**9, end_unix_nano=span[1] + 10**9)
    )


def _mean_ms(influx: InfluxClient, job: str, phase: str, rank: int, *, after: bool) -> float:
    """A rank's mean phase time before or after the fault's start (the run's ``fault_time``)."""
    fault = next(
        json.loads(path.read_text())["fault_time"]
        for path in RUNS.glob("*.json")
        if json.loads(path.read_text())["job"] == job
    )
    when = f"time >= '{fault}' + 3s" if after else f"time < '{fault}'"
    series = influx.query(
        f'SELECT sum("sum") / sum("count") FROM "{_schema.PHASE_DURATION}" '
        f"WHERE \"{_schema.JOB_ID}\" = '{job}' AND \"{_schema.PHASE}\" = '{phase}' "
        f"AND \"{_schema.RANK}\" = '{rank}' AND {when}"
    )
    return float(series[0].values[0][1]) * 1e3


def test_every_capture_is_described() -> None:
    captures = {path.name.removesuffix(".otlp.jsonl.gz") for path in RUNS.glob("*.otlp.jsonl.gz")}
    described = {path.stem for path in RUNS.glob("*.json")}
    assert captures == described and captures


def test_a_gpu_compute_straggler_is_named_with_its_phase_and_kernel(
    influx: InfluxClient, bridge: Bridge
) -> None:
    """4 ranks on one H100; from the middle on rank 1's forward does 3 more 4096^3 products."""
    job = replay(bridge, "straggler4")
    found = diagnose(influx, job)
    assert [(d.kind, d.ranks, d.phase, d.kernel_class) for d in found] == [
        ("compute_straggler", (1,), "forward", "gemm")
    ], found
    assert found[0].slowdown >= 1.2


def test_a_two_rank_gpu_straggler_is_named_against_its_own_level(
    influx: InfluxClient, bridge: Bridge
) -> None:
    """2 ranks: too few for the peer statistics; rank 1 spent the shift in its forward while
    rank 0 waited (``analysis/_few_ranks.py``)."""
    job = replay(bridge, "straggler2")
    found = diagnose(influx, job)
    assert [(d.kind, d.ranks, d.phase, d.kernel_class) for d in found] == [
        ("compute_straggler", (1,), "forward", "gemm")
    ], found
    assert "rank 0 waits for it" in found[0].summary


def test_a_gpu_job_wide_regression_blames_no_rank(influx: InfluxClient, bridge: Bridge) -> None:
    job = replay(bridge, "regression2")
    found = diagnose(influx, job)
    assert [(d.kind, d.ranks, d.phase, d.kernel_class) for d in found] == [
        ("job_regression", (), "forward", "gemm")
    ], found


def test_phases_are_the_devices_time(influx: InfluxClient, bridge: Bridge) -> None:
    """On the device, rank 1's forward takes the extra products and rank 0 waits for it.

    Host-timed (``straggler2-host-phases``, the exporter before phases were timed on the
    device), rank 1's forward moved 0.73 -> 0.85 ms: it only launches the products.
    """
    job = replay(bridge, "straggler2")
    forward = [_mean_ms(influx, job, "forward", rank, after=True) for rank in (0, 1)]
    before = [_mean_ms(influx, job, "forward", rank, after=False) for rank in (0, 1)]
    wait = [_mean_ms(influx, job, "communication", rank, after=True) for rank in (0, 1)]
    wait_before = [_mean_ms(influx, job, "communication", rank, after=False) for rank in (0, 1)]
    assert forward[1] - before[1] > 5.0  # ~7 ms of products on the device
    assert forward[0] - before[0] < 1.0
    assert wait[0] - wait_before[0] > 5.0  # rank 0 waits for rank 1 in the all-reduce
    assert wait[1] - wait_before[1] < 1.0


def test_host_timed_phases_missed_the_device_work(influx: InfluxClient, bridge: Bridge) -> None:
    """The same fault with the old host-timed phases: the forward did not move (why the
    phases are now timed on the device)."""
    job = replay(bridge, "straggler2-host-phases")
    before = _mean_ms(influx, job, "forward", 1, after=False)
    after = _mean_ms(influx, job, "forward", 1, after=True)
    assert after - before < 0.5


def test_gpu_health_and_kernels_are_stored(influx: InfluxClient, bridge: Bridge) -> None:
    job = replay(bridge, "regression2")
    power = influx.query(
        f'SELECT max("gauge") FROM "hw.power" WHERE "{_schema.JOB_ID}" = \'{job}\''
    )
    assert power and 50.0 < float(power[0].values[0][1]) < 1000.0  # watts, an H100's range
    classes = influx.query(
        f'SHOW TAG VALUES FROM "{_schema.KERNEL_DURATION}" WITH KEY = "{_schema.KERNEL_CLASS}" '
        f"WHERE \"{_schema.JOB_ID}\" = '{job}'"
    )
    names = {value for series in classes for _, value in series.values}
    assert {"gemm", "elementwise", "memcpy_htod"} <= names, names
