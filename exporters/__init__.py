"""stepwatch.exporters: per-rank step, phase and kernel timing exported over OTLP.

The façade re-exports the public names; implementation lives in the ``_private`` modules.
Importing it imports neither torch nor the OpenTelemetry SDK; they load when used.
"""

from stepwatch.exporters._auto import Instrumentation, instrument
from stepwatch.exporters._export import (
    Exporter,
    ExporterConfig,
    InMemoryExporter,
    create_exporter,
    resolve_exporter_config,
)
from stepwatch.exporters._histogram import ExponentialHistogram, HistogramSnapshot
from stepwatch.exporters._monitor import Clock, MonitorStats, StepMonitor, SystemClock
from stepwatch.exporters._window import KernelSource, KernelWindow, WindowBuilder, build_resource

__all__ = [
    "Clock",
    "ExponentialHistogram",
    "Exporter",
    "ExporterConfig",
    "HistogramSnapshot",
    "InMemoryExporter",
    "Instrumentation",
    "KernelSource",
    "KernelWindow",
    "MonitorStats",
    "StepMonitor",
    "SystemClock",
    "WindowBuilder",
    "build_resource",
    "create_exporter",
    "instrument",
    "resolve_exporter_config",
]
