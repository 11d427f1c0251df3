"""Replaying a simulated or recorded job through the real exporter and bridge code.

Each rank's observed windows (:meth:`SimulatedJob.observed`, or a recorded trace's:
:mod:`._op_trace`) are fed to the exporters' ``WindowBuilder`` exactly as a step monitor
would, then either converted by the bridge's ``convert_request`` and written to InfluxDB
(:func:`write_direct`), or exported over OTLP/HTTP like real ranks do (:func:`send_otlp`).
This joins three components (detectors' simulator, exporters, otel_bridge), so it lives in
the app; it needs the OpenTelemetry SDK.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from stepwatch.core import _schema
from stepwatch.core._errors import StepwatchError
from stepwatch.core._influx import InfluxClient
from stepwatch.core._lineproto import encode_point

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData

    from stepwatch.detectors.simulation import RankPlacement, RankWindow
    from stepwatch.exporters import WindowBuilder


class ReplayJob(Protocol):
    """A job recorded window by window, as each rank's exporter saw it: a simulated run
    (:class:`~stepwatch.detectors.simulation.SimulatedJob`) or a recorded trace
    (:class:`~stepwatch.app._op_trace.OpTraceJob`)."""

    @property
    def job_id(self) -> str: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank_ids(self) -> tuple[int, ...]: ...

    @property
    def n_windows(self) -> int: ...

    def placement(self, rank: int) -> RankPlacement: ...

    def observed(self, window: int, rank: int) -> RankWindow | None: ...


def _builders(job: ReplayJob) -> dict[int, WindowBuilder]:
    """One ``WindowBuilder`` per rank, with the rank's resource."""
    from stepwatch.exporters import WindowBuilder, build_resource

    builders = {}
    for rank in job.rank_ids:
        placement = job.placement(rank)
        resource = build_resource(
            job_id=job.job_id,
            rank=rank,
            world_size=job.world_size,
            host_name=placement.host_name,
            local_rank=placement.local_rank,
            dp_rank=placement.dp_rank,
            tp_rank=placement.tp_rank,
            pp_rank=placement.pp_rank,
        )
        builders[rank] = WindowBuilder(resource)
    return builders


def _build(builder: WindowBuilder, observed: RankWindow) -> MetricsData | None:
    """Feed one rank's window into its builder, as the step monitor and kernel source do."""
    from stepwatch.exporters import KernelWindow

    for step in observed.steps:
        builder.add_step(
            step_index=step.step_index, duration_s=step.duration_s, phases_s=step.phases_s
        )
    builder.add_kernels(
        KernelWindow(
            durations_s=observed.kernel_durations_s,
            idle_durations_s=observed.idle_durations_s,
        )
    )
    return builder.build(
        start_unix_nano=observed.start_unix_nano, end_unix_nano=observed.end_unix_nano
    )


def _windows(job: ReplayJob) -> Iterator[list[tuple[RankWindow, MetricsData | None]]]:
    """Per export window: every reporting rank's observation and its built metrics."""
    builders = _builders(job)
    for window in range(job.n_windows):
        batch = []
        for rank, builder in builders.items():
            observed = job.observed(window, rank)
            if observed is not None:
                batch.append((observed, _build(builder, observed)))
        yield batch


def _clock_line(job: ReplayJob, observed: RankWindow) -> str:
    """The SM clock gauge as the bridge stores an OTLP gauge (field ``gauge``)."""
    placement = job.placement(observed.rank)
    tags = {
        _schema.JOB_ID: job.job_id,
        _schema.RANK: str(observed.rank),
        _schema.WORLD_SIZE: str(job.world_size),
        _schema.HOST_NAME: placement.host_name,
        _schema.HW_TYPE: "gpu",
        _schema.HW_ID: str(placement.local_rank),
    }
    return encode_point(
        _schema.GPU_SM_CLOCK, tags, {"gauge": observed.sm_clock_hz}, observed.end_unix_nano
    )


def iter_line_batches(job: ReplayJob) -> Iterator[list[str]]:
    """Line protocol per window, produced by the real exporter and bridge code paths."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (
        encode_metrics,
    )
    from opentelemetry.sdk.metrics.export import MetricsData

    from stepwatch.otel_bridge import convert_request

    for batch in _windows(job):
        built = [data for _, data in batch if data is not None]
        lines: list[str] = []
        if built:
            merged = MetricsData(
                resource_metrics=[rm for data in built for rm in data.resource_metrics]
            )
            lines.extend(convert_request(encode_metrics(merged)).lines)
        lines.extend(
            _clock_line(job, observed)
            for observed, _ in batch
            if math.isfinite(observed.sm_clock_hz)
        )
        yield lines


def write_direct(job: ReplayJob, client: InfluxClient, *, batch_lines: int = 20_000) -> int:
    """Write the job into InfluxDB through WindowBuilder → convert_request; returns points."""
    pending: list[str] = []
    written = 0
    for lines in iter_line_batches(job):
        pending.extend(lines)
        if len(pending) >= batch_lines:
            written += _flush(client, pending)
    return written + _flush(client, pending)


def _flush(client: InfluxClient, pending: list[str]) -> int:
    """Write and empty ``pending``; the number of points written."""
    count = len(pending)
    if count:
        client.write_lines(pending)
        pending.clear()
    return count


def send_otlp(job: ReplayJob, endpoint: str, *, timeout_s: float = 10.0) -> int:
    """Send the job over OTLP/HTTP like real ranks do (one export per rank window).

    SM clock gauges are not sent (they come from the NVML exporter in real jobs).

    Raises:
        StepwatchError: an export failed (the OTel exporter logged why).
    """
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/metrics"):
        url += "/v1/metrics"
    exporter = OTLPMetricExporter(endpoint=url, timeout=timeout_s)
    sent = 0
    try:
        for batch in _windows(job):
            for _, data in batch:
                if data is None:
                    continue
                if exporter.export(data) is not MetricExportResult.SUCCESS:
                    raise StepwatchError(f"OTLP export to {url} failed (see the log)")
                sent += 1
    finally:
        exporter.shutdown()
    return sent
