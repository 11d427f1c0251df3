"""Offline ingest: one window per step, rank/world size/time mapping, failures isolated."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.exporters.kernels import ingest_traces, read_trace


class RecordingExporter:
    """A real :class:`MetricsExporter`: keeps every window it is given."""

    def __init__(self, *, fail: bool = False) -> None:
        self.windows: list[MetricsData] = []
        self.fail = fail

    def export(self, metrics_data: MetricsData, /) -> MetricExportResult:
        self.windows.append(metrics_data)
        return MetricExportResult.FAILURE if self.fail else MetricExportResult.SUCCESS


def _metrics(window: MetricsData) -> dict[str, Any]:
    (resource_metrics,) = window.resource_metrics
    (scope_metrics,) = resource_metrics.scope_metrics
    return {metric.name: metric for metric in scope_metrics.metrics}


def _resource(window: MetricsData) -> dict[str, Any]:
    return dict(window.resource_metrics[0].resource.attributes)


def test_dlrm_eight_ranks_one_window_per_step(dlrm_traces: list[Path], tmp_path: Path) -> None:
    broken = tmp_path / "worker8_step_12.json"
    broken.write_bytes(dlrm_traces[0].read_bytes()[:50_000])
    exporter = RecordingExporter()
    messages: list[str] = []
    origin = 1_800_000_000_000_000_000
    result = ingest_traces(
        [*dlrm_traces, broken],
        job_id="dlrm",
        exporter=exporter,
        time_origin_unix_nano=origin,
        progress=messages.append,
    )
    assert [trace.rank for trace in result.traces] == list(range(8))
    assert all(trace.world_size == 8 and trace.exported == 1 for trace in result.traces)
    assert len(exporter.windows) == 8
    (failure,) = result.failures
    assert failure.path == str(broken)
    assert str(broken) in failure.message and "byte" in failure.message
    assert not result.ok
    assert any("exported 1/1 windows" in message for message in messages)

    starts = []
    for window in exporter.windows:
        resource = _resource(window)
        assert resource[_schema.JOB_ID] == "dlrm"
        assert resource[_schema.WORLD_SIZE] == 8
        assert resource[_schema.HOST_NAME] == "unknown"
        metrics = _metrics(window)
        assert set(metrics) == {
            _schema.STEP_DURATION,
            _schema.STEP_LAST,
            _schema.PHASE_DURATION,
            _schema.KERNEL_DURATION,
            _schema.DEVICE_IDLE_DURATION,
        }
        assert metrics[_schema.STEP_LAST].data.data_points[0].value == 10
        kernel_points = metrics[_schema.KERNEL_DURATION].data.data_points
        classes = {point.attributes[_schema.KERNEL_CLASS] for point in kernel_points}
        assert {"gemm", "nccl_allreduce", "memcpy_htod"} <= classes
        assert "other" not in classes  # fewer classes than top_k: nothing folded
        phases = {
            point.attributes[_schema.PHASE]
            for point in metrics[_schema.PHASE_DURATION].data.data_points
        }
        assert {"forward", "backward", "optimizer", "data", "other"} <= phases
        starts.append(kernel_points[0].start_time_unix_nano)
    # The earliest step of the whole set starts at the origin; ranks keep their offsets.
    assert min(starts) == origin
    assert max(starts) - origin < 1_000_000_000


def test_kernel_counts_match_the_trace(dlrm_traces: list[Path]) -> None:
    exporter = RecordingExporter()
    ingest_traces(dlrm_traces[:1], job_id="j", exporter=exporter, clock_unix_nano=lambda: 0)
    trace = read_trace(dlrm_traces[0])
    points = _metrics(exporter.windows[0])[_schema.KERNEL_DURATION].data.data_points
    assert sum(point.count for point in points) == len(trace.steps[0].kernels)
    total_s = sum(point.sum for point in points)
    kernels = trace.steps[0].kernels
    exact_s = sum(event.duration_ns for event in kernels) / 1e9
    # Each duration is on the 2**-30 s grid (at most 0.47 ns off) and each point's sum is sent
    # with 12 significant bits (at most 2**-12 of it off).
    assert total_s == pytest.approx(exact_s, abs=len(kernels) * 0.47e-9 + exact_s * 2**-12)


def test_without_origin_the_set_ends_now(hta_traces: list[Path]) -> None:
    exporter = RecordingExporter()
    now = 1_900_000_000_000_000_000
    ingest_traces(hta_traces, job_id="hta", exporter=exporter, clock_unix_nano=lambda: now)
    ends = [
        _metrics(window)[_schema.STEP_DURATION].data.data_points[0].time_unix_nano
        for window in exporter.windows
    ]
    assert len(ends) == 4  # 2 ranks x 2 steps
    assert max(ends) == now
    ranks = {_resource(window)[_schema.RANK] for window in exporter.windows}
    assert ranks == {0, 1}
    assert {_resource(window)[_schema.WORLD_SIZE] for window in exporter.windows} == {128}


def test_base_time_and_rank_from_file_name(cpu_trace: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "rank-5.pt.trace.json.gz"
    shutil.copy(cpu_trace, renamed)
    exporter = RecordingExporter()
    result = ingest_traces([renamed], job_id="cpu", exporter=exporter, time_origin_unix_nano=123)
    (ingested,) = result.traces
    assert (ingested.rank, ingested.world_size) == (5, 6)
    trace = read_trace(renamed)
    assert trace.base_time_unix_nano is not None
    first = _metrics(exporter.windows[0])[_schema.STEP_DURATION].data.data_points[0]
    # baseTimeNanoseconds wins over the origin: the trace's own Unix time.
    assert first.start_time_unix_nano == trace.base_time_unix_nano + trace.steps[0].start_ns
    assert _resource(exporter.windows[0])[_schema.HOST_NAME] == "vm"  # the trace's host_name
    classes = {
        point.attributes[_schema.KERNEL_CLASS]
        for window in exporter.windows
        for point in _metrics(window)[_schema.KERNEL_DURATION].data.data_points
    }
    assert {"gemm", "relu"} <= classes


def test_duplicate_ranks_are_refused(dlrm_traces: list[Path]) -> None:
    exporter = RecordingExporter()
    result = ingest_traces(
        [dlrm_traces[0], dlrm_traces[0]], job_id="j", exporter=exporter, time_origin_unix_nano=0
    )
    assert len(result.traces) == 1 and len(exporter.windows) == 1
    (failure,) = result.failures
    assert "rank 0 was already ingested" in failure.message


def test_export_failures_are_reported(hta_traces: list[Path]) -> None:
    result = ingest_traces(
        hta_traces[:1], job_id="j", exporter=RecordingExporter(fail=True), clock_unix_nano=lambda: 0
    )
    (failure,) = result.failures
    assert "2 of 2 windows failed to export" in failure.message


def test_gzip_and_plain_give_the_same_windows(dlrm_traces: list[Path], tmp_path: Path) -> None:
    zipped = tmp_path / "rank-0.json.gz"
    zipped.write_bytes(gzip.compress(dlrm_traces[0].read_bytes()))
    plain, packed = RecordingExporter(), RecordingExporter()
    ingest_traces(dlrm_traces[:1], job_id="j", exporter=plain, time_origin_unix_nano=0)
    ingest_traces([zipped], job_id="j", exporter=packed, time_origin_unix_nano=0)
    assert plain.windows[0].to_json() == packed.windows[0].to_json()


@pytest.mark.parametrize(
    ("paths", "job", "options", "name"),
    [
        ([], "j", {}, "paths"),
        (["x.json"], "", {}, "job_id"),
        (["x.json"], "j", {"top_k": 0}, "top_k"),
        (["x.json"], "j", {"max_size": 0}, "max_size"),
    ],
)
def test_config_errors(paths: list[str], job: str, options: dict[str, int], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        ingest_traces(paths, job_id=job, exporter=RecordingExporter(), **options)
