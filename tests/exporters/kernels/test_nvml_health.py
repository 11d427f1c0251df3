"""GPU health from recorded NVML readings: names, units, attributes, deltas, XIDs."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricsData

from stepwatch.core import _schema
from stepwatch.exporters import build_resource
from stepwatch.exporters.kernels import GpuReading, HealthSampler, XidEvent
from stepwatch.otel_bridge import convert_request

# Two samples of two A100s as NVML reported them (values from a DGX A100 under load).
READINGS = [
    [
        GpuReading(
            0,
            "GPU-aaaa",
            "NVIDIA A100-SXM4-80GB",
            0.97,
            61_000_000_000,
            352.1,
            63.0,
            1_410_000_000.0,
            0x0,
            0,
        ),
        GpuReading(
            1,
            "GPU-bbbb",
            "NVIDIA A100-SXM4-80GB",
            0.95,
            60_500_000_000,
            349.8,
            64.0,
            1_410_000_000.0,
            0x0,
            2,
        ),
    ],
    [
        GpuReading(
            0,
            "GPU-aaaa",
            "NVIDIA A100-SXM4-80GB",
            0.98,
            61_100_000_000,
            398.7,
            84.0,
            1_095_000_000.0,
            0x20 | 0x4,
            0,
        ),
        GpuReading(
            1,
            "GPU-bbbb",
            "NVIDIA A100-SXM4-80GB",
            0.31,
            60_500_000_000,
            120.2,
            66.0,
            1_410_000_000.0,
            0x0,
            5,
        ),
    ],
]


class RecordedNvml:
    """A real :class:`NvmlBackend` replaying recorded readings, one sample per call round."""

    def __init__(self, samples: Sequence[Sequence[GpuReading]], xids: Sequence[XidEvent]) -> None:
        self.samples = [list(sample) for sample in samples]
        self.round = -1
        self.xids = list(xids)
        self.closed = False

    def device_count(self) -> int:
        return len(self.samples[0])

    def read(self, index: int) -> GpuReading:
        if index == 0:
            self.round += 1
        return self.samples[self.round][index]

    def xid_events(self) -> Sequence[XidEvent]:
        events, self.xids = self.xids, []
        return events

    def close(self) -> None:
        self.closed = True


def _points(data: MetricsData) -> dict[str, list]:  # type: ignore[type-arg]
    (resource_metrics,) = data.resource_metrics
    (scope_metrics,) = resource_metrics.scope_metrics
    return {m.name: list(m.data.data_points) for m in scope_metrics.metrics}


def _sampler(backend: RecordedNvml) -> HealthSampler:
    resource = build_resource(job_id="j", rank=3, world_size=8, host_name="node-1")
    return HealthSampler(resource, backend=backend)


def test_health_window_from_recorded_readings() -> None:
    backend = RecordedNvml(READINGS, [XidEvent(1, 79), XidEvent(1, 79), XidEvent(0, 48)])
    sampler = _sampler(backend)
    sampler.sample()
    sampler.sample()
    data = sampler.build(start_unix_nano=1_000, end_unix_nano=2_000)
    assert data is not None
    points = _points(data)
    assert set(points) == {
        _schema.HW_GPU_UTILIZATION,
        _schema.HW_GPU_MEMORY_USAGE,
        _schema.HW_POWER,
        _schema.HW_TEMPERATURE,
        _schema.GPU_SM_CLOCK,
        _schema.GPU_CLOCK_EVENT_MASK,
        _schema.GPU_CLOCK_EVENT_ACTIVE,
        _schema.HW_ERRORS,
        _schema.GPU_XID_ERRORS,
    }
    # hw.temperature is a temperature sensor's metric (semconv hardware/temperature.md): its
    # own hw.type and hw.id, the GPU as hw.parent.
    temperature = {p.attributes[_schema.HW_PARENT]: p.value for p in points[_schema.HW_TEMPERATURE]}
    assert temperature == {"GPU-aaaa": 84.0, "GPU-bbbb": 66.0}  # the last reading
    for point in points[_schema.HW_TEMPERATURE]:
        assert point.attributes[_schema.HW_TYPE] == "temperature"
        assert (
            point.attributes[_schema.HW_ID] == point.attributes[_schema.HW_PARENT] + ":temperature"
        )
    for name in set(points) - {_schema.HW_TEMPERATURE}:
        assert all(p.attributes[_schema.HW_TYPE] == "gpu" for p in points[name]), name
        assert all(_schema.HW_PARENT not in p.attributes for p in points[name]), name
    for point in points[_schema.HW_POWER]:
        assert point.attributes[_schema.HW_NAME] == "NVIDIA A100-SXM4-80GB"
        assert (point.start_time_unix_nano, point.time_unix_nano) == (1_000, 2_000)
    masks = {p.attributes[_schema.HW_ID]: p.value for p in points[_schema.GPU_CLOCK_EVENT_MASK]}
    assert masks == {"GPU-aaaa": 0x24, "GPU-bbbb": 0}
    assert all(
        _schema.GPU_CLOCK_EVENT_REASON not in p.attributes
        for p in points[_schema.GPU_CLOCK_EVENT_MASK]
    )
    reasons = {
        (p.attributes[_schema.HW_ID], p.attributes[_schema.GPU_CLOCK_EVENT_REASON]): p.value
        for p in points[_schema.GPU_CLOCK_EVENT_ACTIVE]
    }
    assert len(reasons) == 2 * 9  # every known reason, 0 or 1, per GPU
    assert reasons[("GPU-aaaa", "sw_thermal_slowdown")] == 1
    assert reasons[("GPU-aaaa", "sw_power_cap")] == 1
    assert reasons[("GPU-aaaa", "hw_slowdown")] == 0
    assert reasons[("GPU-bbbb", "sw_thermal_slowdown")] == 0
    errors = {
        (p.attributes[_schema.HW_ID], p.attributes[_schema.ERROR_TYPE]): p.value
        for p in points[_schema.HW_ERRORS]
    }
    assert errors == {("GPU-aaaa", "uncorrected"): 0, ("GPU-bbbb", "uncorrected"): 3}  # 2 → 5
    xids = {
        (p.attributes[_schema.HW_ID], p.attributes[_schema.GPU_XID_CODE]): p.value
        for p in points[_schema.GPU_XID_ERRORS]
    }
    assert xids == {("GPU-bbbb", "79"): 2, ("GPU-aaaa", "48"): 1}
    (scope_metrics,) = data.resource_metrics[0].scope_metrics
    kinds = {m.name: m.data for m in scope_metrics.metrics}
    for name in (_schema.HW_ERRORS, _schema.GPU_XID_ERRORS):  # counters
        assert kinds[name].aggregation_temporality == AggregationTemporality.DELTA
        assert kinds[name].is_monotonic
    memory = kinds[_schema.HW_GPU_MEMORY_USAGE]  # an UpDownCounter: non-monotonic sum
    assert memory.aggregation_temporality == AggregationTemporality.CUMULATIVE
    assert not memory.is_monotonic
    assert {p.value for p in memory.data_points} == {61_100_000_000, 60_500_000_000}
    units = {m.name: m.unit for m in scope_metrics.metrics}
    assert units == {
        _schema.HW_GPU_UTILIZATION: "1",
        _schema.HW_GPU_MEMORY_USAGE: "By",
        _schema.HW_POWER: "W",
        _schema.HW_TEMPERATURE: "Cel",
        _schema.GPU_SM_CLOCK: "Hz",
        _schema.GPU_CLOCK_EVENT_MASK: "1",
        _schema.GPU_CLOCK_EVENT_ACTIVE: "1",
        _schema.HW_ERRORS: "{error}",
        _schema.GPU_XID_ERRORS: "{error}",
    }


def test_memory_usage_is_cumulative_from_the_first_window() -> None:
    sampler = _sampler(RecordedNvml(READINGS, []))
    starts = []
    for window in range(2):
        sampler.sample()
        data = sampler.build(
            start_unix_nano=1_000 * (window + 1), end_unix_nano=1_000 * (window + 2)
        )
        assert data is not None
        points = _points(data)
        starts.append({p.start_time_unix_nano for p in points[_schema.HW_GPU_MEMORY_USAGE]})
        assert {p.start_time_unix_nano for p in points[_schema.HW_POWER]} == {1_000 * (window + 1)}
    assert starts == [{1_000}, {1_000}]  # a cumulative sum keeps its start


def test_the_bridge_stores_every_health_point() -> None:
    backend = RecordedNvml(READINGS, [XidEvent(1, 79)])
    sampler = _sampler(backend)
    sampler.sample()
    data = sampler.build(start_unix_nano=1_000, end_unix_nano=2_000)
    assert data is not None
    conversion = convert_request(encode_metrics(data))
    assert conversion.rejected == {}
    assert conversion.accepted_points == sum(len(v) for v in _points(data).values())
    power = [line for line in conversion.lines if line.startswith("hw.power,")]
    assert len(power) == 2 and all("hw.type=gpu" in line for line in power)
    assert any(
        line.startswith("stepwatch.gpu.xid.errors,") and "counter=1" in line
        for line in conversion.lines
    )
    # The semconv attributes are stored as tags, the UpDownCounter as a gauge field.
    assert conversion.dropped_attributes == 0
    errors = [line for line in conversion.lines if line.startswith("hw.errors,")]
    assert len(errors) == 2 and all("error.type=uncorrected" in line for line in errors)
    (temperature, _) = [line for line in conversion.lines if line.startswith("hw.temperature,")]
    assert "hw.type=temperature" in temperature and "hw.parent=GPU-aaaa" in temperature
    memory = [line for line in conversion.lines if line.startswith("hw.gpu.memory.usage,")]
    assert len(memory) == 2 and all(" gauge=" in line for line in memory)


def test_counts_reset_between_windows_and_empty_window_is_none() -> None:
    backend = RecordedNvml(READINGS, [XidEvent(0, 13)])
    sampler = _sampler(backend)
    sampler.sample()
    first = sampler.build(start_unix_nano=0, end_unix_nano=1)
    assert first is not None and _schema.GPU_XID_ERRORS in _points(first)
    assert sampler.build(start_unix_nano=1, end_unix_nano=2) is None  # nothing sampled since
    sampler.sample()
    second = sampler.build(start_unix_nano=2, end_unix_nano=3)
    assert second is not None and _schema.GPU_XID_ERRORS not in _points(second)
    sampler.close()
    assert backend.closed


def test_without_nvml_the_sampler_is_a_quiet_no_op(caplog: pytest.LogCaptureFixture) -> None:
    # pynvml is not installed / no GPU here: the real backend fails, once, quietly: one INFO
    # line on a CPU machine, never a traceback (the traceback is kept for DEBUG).
    sampler = HealthSampler(build_resource(job_id="j", rank=0, world_size=1, host_name="h"))
    with caplog.at_level(logging.DEBUG, logger="stepwatch.exporters"):
        sampler.sample()
        sampler.sample()
    assert not sampler.active
    assert sampler.build(start_unix_nano=0, end_unix_nano=1) is None
    shown = [record for record in caplog.records if record.levelno >= logging.INFO]
    assert [record.levelno for record in shown] == [logging.INFO]
    assert "no NVML here" in shown[0].getMessage() and shown[0].exc_info is None
    sampler.close()


def test_nvml_failing_after_it_worked_warns_once_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = RecordedNvml(READINGS[:1], [])  # one round of readings, then read() fails
    sampler = _sampler(backend)
    with caplog.at_level(logging.DEBUG, logger="stepwatch.exporters"):
        sampler.sample()
        sampler.sample()
        sampler.sample()
    shown = [record for record in caplog.records if record.levelno >= logging.INFO]
    assert [record.levelno for record in shown] == [logging.WARNING]
    assert "stopped answering" in shown[0].getMessage() and shown[0].exc_info is None
    assert not sampler.active
