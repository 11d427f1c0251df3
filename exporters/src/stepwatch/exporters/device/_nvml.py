"""GPU health from NVML on the OpenTelemetry hardware semantic conventions.

The real calls (``pynvml`` from ``nvidia-ml-py``) sit behind :class:`NvmlBackend`;
:class:`HealthSampler` reads every device on :meth:`~HealthSampler.sample` and turns the last
readings of a window into OTel SDK ``MetricsData`` on :meth:`~HealthSampler.build`:

| metric | instrument | unit | value (attributes) |
|---|---|---|---|
| ``hw.gpu.utilization`` | gauge | 1 | SM busy ratio, 0..1 |
| ``hw.gpu.memory.usage`` | updowncounter (*) | By | device memory used |
| ``hw.power`` | gauge | W | board power draw |
| ``hw.temperature`` | gauge | Cel | GPU core temperature (``hw.type=temperature``, **) |
| ``hw.errors`` | counter (***) | {error} | new uncorrected ECC errors (``error.type``) |
| ``stepwatch.gpu.sm_clock`` | gauge | Hz | SM clock |
| ``stepwatch.gpu.clock_event.mask`` | gauge | 1 | NVML clock-event bitmask |
| ``stepwatch.gpu.clock_event.active`` | gauge | 1 | 0/1 per ``stepwatch.gpu.clock_event.reason`` |
| ``stepwatch.gpu.xid.errors`` | counter (***) | {error} | XIDs per ``stepwatch.gpu.xid.code`` |

Every point has ``hw.id``, ``hw.name`` and ``hw.type=gpu`` (but temperature, **);
``hw.errors`` has ``error.type=uncorrected``.

Semantic conventions (https://opentelemetry.io/docs/specs/semconv/hardware/): ``gpu.md``
(``hw.gpu.*``; ``hw.errors`` with ``error.type`` ``corrected``/``uncorrected``),
``temperature.md`` (``hw.temperature`` is a temperature sensor's metric:
``hw.type=temperature``), ``common.md`` (``hw.power``). (*) An UpDownCounter observed
asynchronously: a non-monotonic CUMULATIVE sum whose start is the sampler's first window.
(**) The sensor is its own component: ``hw.id`` is the GPU's id plus ``:temperature`` and
``hw.parent`` the GPU's id. ``hw.id`` of a GPU is its UUID, else its NVML index. The
``stepwatch.gpu.*`` names follow the naming rules (a plural only for a count with a ``{unit}``;
no metric named like an attribute namespace). Per-reason points are always sent (0 or 1) so
"last value" queries never see a stale 1. (***) DELTA (the window's count); CUMULATIVE with
``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=cumulative``: the count since the sampler's
first window (its start), sent for every device and code seen so far.

Without a GPU or without ``pynvml`` the first failing call is logged once and the sampler
produces nothing. NVML reference: https://docs.nvidia.com/deploy/nvml-api/
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from stepwatch.core import _schema
from stepwatch.exporters._sdk_env import temporality_preference

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Metric, MetricsData, NumberDataPoint
    from opentelemetry.sdk.resources import Resource

_log = logging.getLogger(__name__)

# nvmlClocksEventReasons bits (nvml.h, "ClocksEventReasons"; formerly ClocksThrottleReasons).
CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


@dataclasses.dataclass(frozen=True)
class GpuReading:
    """One reading of one GPU (``None`` where the device does not support a query).

    Attributes:
        index: NVML device index.
        uuid: GPU UUID (``hw.id``); empty when unknown.
        name: Product name (``hw.name``).
        utilization_ratio: SM utilisation, 0..1.
        memory_used_bytes: Device memory in use.
        power_w: Board power draw, watts.
        temperature_c: Core temperature, °C.
        sm_clock_hz: SM clock, hertz.
        clock_event_reasons: ``nvmlDeviceGetCurrentClocksEventReasons`` bitmask.
        ecc_uncorrected_errors: Volatile uncorrected ECC error count (cumulative).
    """

    index: int
    uuid: str = ""
    name: str = ""
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_hz: float | None = None
    clock_event_reasons: int | None = None
    ecc_uncorrected_errors: int | None = None


class XidEvent(NamedTuple):
    """An NVML ``XidCriticalError`` event."""

    device_index: int
    code: int


class NvmlBackend(Protocol):
    """The NVML calls the sampler makes; :class:`PynvmlBackend` is the real one."""

    def device_count(self) -> int:
        """Number of GPUs (initialises NVML on first use)."""

    def read(self, index: int) -> GpuReading:
        """One reading of device ``index``."""

    def xid_events(self) -> Sequence[XidEvent]:
        """XID events since the previous call, without blocking."""

    def close(self) -> None:
        """Release NVML."""


class PynvmlBackend:
    """:class:`NvmlBackend` on ``pynvml`` (``pip install nvidia-ml-py``)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._event_set: Any = None

    def _init(self) -> Any:
        if self._nvml is None:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            try:
                event_set = pynvml.nvmlEventSetCreate()
                for handle in self._handles:
                    pynvml.nvmlDeviceRegisterEvents(
                        handle, pynvml.nvmlEventTypeXidCriticalError, event_set
                    )
                self._event_set = event_set
            except pynvml.NVMLError:
                _log.info("NVML XID events not supported here; XID counts disabled")
        return self._nvml

    def device_count(self) -> int:
        """Number of GPUs."""
        self._init()
        return len(self._handles)

    def read(self, index: int) -> GpuReading:
        """Query every supported field of one device."""
        nvml = self._init()
        handle = self._handles[index]

        def query(call: Callable[[], Any]) -> Any:
            try:
                return call()
            except nvml.NVMLError:
                return None

        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value or "")

        utilization = query(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = query(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = query(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        clock_mhz = query(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        reasons_call = getattr(
            nvml,
            "nvmlDeviceGetCurrentClocksEventReasons",
            getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
        )
        return GpuReading(
            index=index,
            uuid=text(query(lambda: nvml.nvmlDeviceGetUUID(handle))),
            name=text(query(lambda: nvml.nvmlDeviceGetName(handle))),
            utilization_ratio=None if utilization is None else utilization.gpu / 100.0,
            memory_used_bytes=None if memory is None else int(memory.used),
            power_w=None if power_mw is None else power_mw / 1000.0,
            temperature_c=query(
                lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            ),
            sm_clock_hz=None if clock_mhz is None else clock_mhz * 1e6,
            clock_event_reasons=None
            if reasons_call is None
            else query(lambda: reasons_call(handle)),
            ecc_uncorrected_errors=query(
                lambda: nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            ),
        )

    def xid_events(self) -> Sequence[XidEvent]:
        """Poll the event set with a zero timeout until it is empty."""
        nvml = self._init()
        if self._event_set is None:
            return []
        events: list[XidEvent] = []
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except nvml.NVMLError_Timeout:
                return events
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                index = -1
            events.append(XidEvent(index, int(data.eventData)))

    def close(self) -> None:
        """``nvmlEventSetFree`` and ``nvmlShutdown``."""
        if self._nvml is not None:
            if self._event_set is not None:
                self._nvml.nvmlEventSetFree(self._event_set)
            self._nvml.nvmlShutdown()
            self._nvml = None


class HealthSampler:
    """Samples GPU health and builds a window of gauges and counts.

    Args:
        resource: The rank's resource (``build_resource``).
        backend: NVML calls (default :class:`PynvmlBackend`).
        devices: NVML indices to report (default: all).
        temporality: ``delta`` or ``cumulative`` for the two counters; default: the
            temporality preference variable (``_sdk_env.temporality_preference``).
    """

    def __init__(
        self,
        resource: Resource,
        *,
        backend: NvmlBackend | None = None,
        devices: Sequence[int] | None = None,
        temporality: str | None = None,
    ) -> None:
        if temporality is None:  # the monitor has warned about a bad value already
            temporality = temporality_preference(os.environ, warn=False)
        self._cumulative = temporality == "cumulative"
        self._resource = resource
        self._backend: NvmlBackend = backend if backend is not None else PynvmlBackend()
        self._devices = None if devices is None else list(devices)
        self._failed = False
        self._last: dict[int, GpuReading] = {}
        self._ecc_baseline: dict[int, int] = {}
        self._first_start_unix_nano: int | None = None  # start of the cumulative sums
        self._ecc_delta: dict[int, int] = {}
        self._xid_counts: dict[tuple[int, int], int] = {}

    @property
    def active(self) -> bool:
        """False once NVML failed (the sampler is then a no-op)."""
        return not self._failed

    def sample(self) -> None:
        """Read every device now and collect pending XID events; never raises."""
        if self._failed:
            return
        try:
            devices = self._devices
            if devices is None:
                devices = self._devices = list(range(self._backend.device_count()))
            for index in devices:
                reading = self._backend.read(index)
                self._last[index] = reading
                errors = reading.ecc_uncorrected_errors
                if errors is not None:
                    baseline = self._ecc_baseline.get(index, errors)
                    self._ecc_delta[index] = self._ecc_delta.get(index, 0) + max(
                        0, errors - baseline
                    )
                    self._ecc_baseline[index] = errors
            for event in self._backend.xid_events():
                key = (event.device_index, event.code)
                self._xid_counts[key] = self._xid_counts.get(key, 0) + 1
        except Exception as exc:
            # No GPU, no driver, no libnvidia-ml: one quiet line on a CPU machine, never a
            # traceback on every rank. A failure after readings worked is worth a warning.
            if self._devices is None or not self._last:
                _log.info("no NVML here (%s); GPU health metrics off", exc)
            else:
                _log.warning("NVML stopped answering (%s); GPU health metrics off", exc)
            _log.debug("NVML failure", exc_info=True)
            self._failed = True

    def build(self, *, start_unix_nano: int, end_unix_nano: int) -> MetricsData | None:
        """The window's health metrics from the last readings; ``None`` when nothing was read.

        Resets the error and XID counts when they are DELTA sums (CUMULATIVE ones keep
        counting from the first window); gauges report the last reading.
        """
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            Gauge,
            Metric,
            MetricsData,
            NumberDataPoint,
            ResourceMetrics,
            ScopeMetrics,
            Sum,
        )
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        if not self._last:
            return None
        readings = [self._last[index] for index in sorted(self._last)]
        self._last = {}
        if self._first_start_unix_nano is None:
            self._first_start_unix_nano = start_unix_nano
        first_start = self._first_start_unix_nano
        cumulative = self._cumulative
        counter_start = first_start if cumulative else start_unix_nano

        def point(
            reading: GpuReading,
            value: float,
            extra: dict[str, str] | None = None,
            *,
            start: int = start_unix_nano,
        ) -> NumberDataPoint:
            gpu_id = reading.uuid or str(reading.index)
            attributes: dict[str, str] = {_schema.HW_TYPE: "gpu", _schema.HW_ID: gpu_id}
            if reading.name:
                attributes[_schema.HW_NAME] = reading.name
            attributes.update(extra or {})
            if attributes[_schema.HW_TYPE] == "temperature":  # the GPU's sensor (temperature.md)
                attributes[_schema.HW_ID] = f"{gpu_id}:temperature"
                attributes[_schema.HW_PARENT] = gpu_id
            return NumberDataPoint(
                attributes=attributes,
                start_time_unix_nano=start,
                time_unix_nano=end_unix_nano,
                value=value,
            )

        def points_of(
            field: str, extra: dict[str, str] | None = None, *, start: int = start_unix_nano
        ) -> list[NumberDataPoint]:
            return [
                point(reading, getattr(reading, field), extra, start=start)
                for reading in readings
                if getattr(reading, field) is not None
            ]

        metrics: list[Metric] = []

        def add(name: str, unit: str, data: Any) -> None:
            if data.data_points:
                metrics.append(Metric(name=name, description="", unit=unit, data=data))

        add(_schema.HW_GPU_UTILIZATION, "1", Gauge(points_of("utilization_ratio")))
        add(
            _schema.HW_GPU_MEMORY_USAGE,
            "By",
            Sum(
                data_points=points_of("memory_used_bytes", start=first_start),
                aggregation_temporality=AggregationTemporality.CUMULATIVE,
                is_monotonic=False,
            ),
        )
        add(_schema.HW_POWER, "W", Gauge(points_of("power_w")))
        add(
            _schema.HW_TEMPERATURE,
            "Cel",
            Gauge(points_of("temperature_c", {_schema.HW_TYPE: "temperature"})),
        )
        add(_schema.GPU_SM_CLOCK, "Hz", Gauge(points_of("sm_clock_hz")))
        add(_schema.GPU_CLOCK_EVENT_MASK, "1", Gauge(points_of("clock_event_reasons")))
        active_points = [
            point(reading, 1 if mask & bit else 0, {_schema.GPU_CLOCK_EVENT_REASON: reason})
            for reading in readings
            if (mask := reading.clock_event_reasons) is not None
            for bit, reason in CLOCK_EVENT_REASONS
        ]
        add(_schema.GPU_CLOCK_EVENT_ACTIVE, "1", Gauge(active_points))
        by_index = {reading.index: reading for reading in readings}
        error_points = [
            point(
                by_index[index],
                self._ecc_delta.get(index, 0),
                {_schema.ERROR_TYPE: "uncorrected"},
                start=counter_start,
            )
            for index in sorted(by_index)
            if by_index[index].ecc_uncorrected_errors is not None
        ]
        counter = AggregationTemporality.CUMULATIVE if cumulative else AggregationTemporality.DELTA
        if not cumulative:
            self._ecc_delta = {}
        add(_schema.HW_ERRORS, "{error}", _counter(error_points, Sum, counter))
        xid_points = [
            point(
                by_index.get(device, GpuReading(index=device)),
                count,
                {_schema.GPU_XID_CODE: str(code)},
                start=counter_start,
            )
            for (device, code), count in sorted(self._xid_counts.items())
        ]
        if not cumulative:
            self._xid_counts = {}
        add(_schema.GPU_XID_ERRORS, "{error}", _counter(xid_points, Sum, counter))
        scope = InstrumentationScope("stepwatch.exporters.kernels")
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=self._resource,
                    scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")],
                    schema_url="",
                )
            ]
        )

    def close(self) -> None:
        """Release NVML."""
        try:
            self._backend.close()
        except Exception:
            _log.debug("NVML close failed", exc_info=True)


def probe(resource: Resource) -> HealthSampler | None:
    """A sampler when ``pynvml`` is installed, else None (``health=None``); on a machine
    without a GPU it logs that once and goes quiet."""
    if importlib.util.find_spec("pynvml") is None:
        return None
    return HealthSampler(resource)


def _counter(points: list[NumberDataPoint], sum_type: Any, temporality: Any) -> Any:
    """A monotonic sum (a counter) of ``points``: the window's (DELTA) or the run's."""
    return sum_type(data_points=points, aggregation_temporality=temporality, is_monotonic=True)
