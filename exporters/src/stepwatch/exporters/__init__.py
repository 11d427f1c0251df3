"""stepwatch.exporters: per-rank step, phase and kernel timing exported over OTLP.

The façade re-exports the public names; implementation lives in the ``_private`` modules.
Kernel collection (CUPTI, torch.profiler, NVML health, trace ingest) has its own façade,
:mod:`stepwatch.exporters.kernels`. Importing either imports neither torch nor the
OpenTelemetry SDK; they load when used.
"""

from stepwatch.core._facade import publish
from stepwatch.exporters._config import ExporterConfig, resolve_exporter_config
from stepwatch.exporters._export import Exporter, InMemoryExporter, create_exporter
from stepwatch.exporters._otlp_http import OtlpHttpExporter, OtlpHttpStats
from stepwatch.exporters._protocols import (
    Clock,
    DeviceTimer,
    HealthSource,
    KernelSource,
    KernelWindow,
)
from stepwatch.exporters._window import WindowBuilder, build_resource
from stepwatch.exporters.auto._auto import Instrumentation
from stepwatch.exporters.monitor._account import MonitorStats
from stepwatch.exporters.monitor._monitor import StepMonitor, instrument

__all__ = [
    "Clock",
    "DeviceTimer",
    "Exporter",
    "ExporterConfig",
    "HealthSource",
    "InMemoryExporter",
    "Instrumentation",
    "KernelSource",
    "KernelWindow",
    "MonitorStats",
    "OtlpHttpExporter",
    "OtlpHttpStats",
    "StepMonitor",
    "WindowBuilder",
    "build_resource",
    "create_exporter",
    "instrument",
    "resolve_exporter_config",
]

publish(__name__, [globals()[name] for name in __all__])
