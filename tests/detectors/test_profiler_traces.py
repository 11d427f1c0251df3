"""Recorded profiler traces, ingested like live ranks and diagnosed from a single step.

The public 8-rank PARAM DLRM Kineto trace (tests/data/kineto/param_dlrm_8rank, MIT, Meta)
holds one profiled step per rank: too little for the cross-rank statistics, enough to see
who reached each collective last. In it rank 7 waits 0.39 ms in the all-to-all
(``nccl_sendrecv``) while its peers wait 1.8-9.5 ms (median 6.1 ms), and ranks 4 and 5
wait 0.2 ms in the all-reduce against 1.4-1.8 ms: they arrived late, the others waited.
HTA's ``find_stragglers_with_late_start_comm_kernels`` (top 2 by the start of the last
all-to-all kernel) names ranks 7 and 2; rank 2 waited 1.8 ms, a third of the median.
"""

from __future__ import annotations

from pathlib import Path

from stepwatch.core import Diagnosis, InfluxClient
from stepwatch.detectors import detect_job
from stepwatch.detectors.frame import job_time_range
from stepwatch.exporters import create_exporter, resolve_exporter_config
from stepwatch.exporters.kernels import ingest_traces
from stepwatch.otel_bridge import Bridge, InfluxV1Writer
from tests.exporters.kernels.conftest import dlrm_traces  # the 8 traces, extracted once

__all__ = ["dlrm_traces"]  # a fixture: pytest finds it in this module

KINETO = Path(__file__).resolve().parents[1] / "data" / "kineto"
ORIGIN_UNIX_NANO = 1_795_291_200_000_000_000


def ingest_and_detect(influx: InfluxClient, files: list[Path], job: str) -> list[Diagnosis]:
    bridge = Bridge(InfluxV1Writer(influx), grpc_port=None, http_port=0).start()
    try:
        config = resolve_exporter_config(
            endpoint=bridge.http_url, protocol="http/protobuf", timeout_s=None
        )
        exporter = create_exporter(config)
        try:
            result = ingest_traces(
                [str(f) for f in files],
                job_id=job,
                exporter=exporter,
                time_origin_unix_nano=ORIGIN_UNIX_NANO,
                host_name=None,
                top_k=48,
                progress=lambda _: None,
            )
        finally:
            exporter.shutdown()
    finally:
        bridge.stop()
    assert not result.failures
    span = job_time_range(influx, job)
    assert span is not None
    return detect_job(influx, job, start_unix_nano=span[0] - 10**9, end_unix_nano=span[1] + 10**9)


def test_dlrm_names_the_late_ranks_not_the_waiters_and_the_cost_of_one_step(
    influx: InfluxClient, dlrm_traces: list[Path]
) -> None:
    found = ingest_and_detect(influx, dlrm_traces, "dlrm")
    assert [(d.kind, d.ranks) for d in found] == [("masked_straggler", (4, 5, 7))], found
    (late,) = found
    assert "rank 7 reached nccl_sendrecv last" in late.summary
    assert "ranks 4-5 reached nccl_allreduce last" in late.summary
    # The ranks that arrived first only waited: they are quoted, never blamed.
    assert "ranks 1,3 waited longest" in late.summary
    assert 1.1 <= late.slowdown <= 1.3  # 2.6 ms of a 16 ms step
    assert late.severity == "warning"


def test_two_ranks_are_too_few_to_compare(influx: InfluxClient) -> None:
    # HTA's 2-rank sample: with fewer than 4 ranks no rank can be told from its peers.
    files = sorted((KINETO / "hta_sampled_2rank").glob("*.json.gz"))
    assert ingest_and_detect(influx, files, "hta") == []
