"""GPU health rides in the StepMonitor's windows (recorded NVML readings; no GPU here)."""

from __future__ import annotations

from collections.abc import Sequence

from stepwatch.core import _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor, build_resource
from stepwatch.exporters.kernels import GpuReading, HealthSampler, XidEvent


class OneGpu:
    """A real NvmlBackend replaying one A100's readings: throttled (HW slowdown) on read 2."""

    def __init__(self) -> None:
        self.reads = 0
        self.pending_xids = [XidEvent(device_index=0, code=79)]

    def device_count(self) -> int:
        return 1

    def read(self, index: int) -> GpuReading:
        self.reads += 1
        throttled = self.reads >= 2
        return GpuReading(
            index,
            "GPU-aaaa",
            "NVIDIA A100-SXM4-80GB",
            0.97,
            61_000_000_000,
            398.7 if throttled else 352.1,
            84.0 if throttled else 63.0,
            1_095_000_000.0 if throttled else 1_410_000_000.0,
            0x8 if throttled else 0x0,
            0,
        )

    def xid_events(self) -> Sequence[XidEvent]:
        events, self.pending_xids = self.pending_xids, []
        return events

    def close(self) -> None:
        pass


def _names(exporter: InMemoryExporter, window: int) -> dict[str, list[object]]:
    (resource_metrics,) = exporter.exported[window].resource_metrics
    return {
        metric.name: list(metric.data.data_points)
        for scope in resource_metrics.scope_metrics
        for metric in scope.metrics
    }


def test_each_window_carries_the_gpu_health_of_its_rank() -> None:
    exporter = InMemoryExporter()
    resource = build_resource(job_id="j", rank=0, world_size=1, host_name="node-0")
    monitor = StepMonitor(
        job_id="j",
        rank=0,
        world_size=1,
        host_name="node-0",
        exporter=exporter,
        health=HealthSampler(resource, backend=OneGpu()),
        start=False,
    )
    for window in range(2):
        with monitor.step(), monitor.phase("forward"):
            pass
        assert monitor.export_now(timeout_s=5)
        metrics = _names(exporter, window)
        assert _schema.STEP_DURATION in metrics  # one request per window: steps and health
        (sm_clock,) = metrics[_schema.GPU_SM_CLOCK]
        assert sm_clock.value == (1_410_000_000.0 if window == 0 else 1_095_000_000.0)  # type: ignore[attr-defined]
        (temperature,) = metrics[_schema.HW_TEMPERATURE]
        assert temperature.attributes[_schema.HW_TYPE] == "temperature"  # type: ignore[attr-defined]
        if window == 0:
            (xid,) = metrics[_schema.GPU_XID_ERRORS]
            assert xid.attributes[_schema.GPU_XID_CODE] == "79"  # type: ignore[attr-defined]
    monitor.close()


def test_health_off_or_without_nvml_sends_only_steps() -> None:
    import importlib.util

    # None is "auto": on only where pynvml is installed (not on these GPU-less machines).
    modes: list[bool | None] = [False]
    if importlib.util.find_spec("pynvml") is None:
        modes.append(None)
    for health in modes:
        exporter = InMemoryExporter()
        monitor = StepMonitor(
            job_id="j", rank=0, world_size=1, exporter=exporter, health=health, start=False
        )
        with monitor.step():
            pass
        assert monitor.export_now(timeout_s=5)
        assert not any(name.startswith(("hw.", "stepwatch.gpu.")) for name in _names(exporter, 0))
        monitor.close()
