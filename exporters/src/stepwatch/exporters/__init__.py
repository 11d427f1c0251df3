"""stepwatch.exporters: per-rank step, phase and kernel timing exported over OTLP.

The façade re-exports the public names; implementation lives in the ``_private`` modules and
in :mod:`stepwatch.exporters.kernels` (kernel events, CUPTI, torch.profiler, NVML, trace
ingest), whose public names (its ``__all__``) are re-exported here too. Importing it imports
neither torch nor the OpenTelemetry SDK; they load when used.
"""

from stepwatch.exporters import kernels
from stepwatch.exporters._auto import Instrumentation
from stepwatch.exporters._config import ExporterConfig, resolve_exporter_config
from stepwatch.exporters._device import CudaEventTimer, DeviceTimer
from stepwatch.exporters._export import Exporter, InMemoryExporter, create_exporter
from stepwatch.exporters._histogram import ExponentialHistogram, HistogramSnapshot
from stepwatch.exporters._monitor import HealthSource, MonitorStats, StepMonitor, instrument
from stepwatch.exporters._otlp_http import OtlpHttpExporter, OtlpHttpStats
from stepwatch.exporters._recorder import Clock, SystemClock
from stepwatch.exporters._window import KernelSource, KernelWindow, WindowBuilder, build_resource
from stepwatch.exporters.kernels import *  # noqa: F403  (its __all__, pinned by its own test)

__all__ = [
    "Clock",
    "CudaEventTimer",
    "DeviceTimer",
    "ExponentialHistogram",
    "Exporter",
    "ExporterConfig",
    "HealthSource",
    "HistogramSnapshot",
    "InMemoryExporter",
    "Instrumentation",
    "KernelSource",
    "KernelWindow",
    "MonitorStats",
    "OtlpHttpExporter",
    "OtlpHttpStats",
    "StepMonitor",
    "SystemClock",
    "WindowBuilder",
    "build_resource",
    "create_exporter",
    "instrument",
    "resolve_exporter_config",
]
__all__ += kernels.__all__
