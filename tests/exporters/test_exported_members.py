"""The public surface of stepwatch.exporters is pinned, and importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import stepwatch.exporters
from stepwatch.exporters import kernels

EXPECTED_CORE = {
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
}


def test_all_is_pinned() -> None:
    exported = set(stepwatch.exporters.__all__)
    assert exported >= EXPECTED_CORE
    extra = exported - EXPECTED_CORE
    # Anything else is re-exported from stepwatch.exporters.kernels (its own test pins it).
    assert extra == set(kernels.__all__)
    assert len(stepwatch.exporters.__all__) == len(exported)


def test_every_exported_name_exists_and_is_public() -> None:
    for name in stepwatch.exporters.__all__:
        member = getattr(stepwatch.exporters, name)
        module = getattr(member, "__module__", None)
        if isinstance(module, str):  # classes and functions; constants have no module
            assert module.startswith("stepwatch.exporters"), (name, module)


def test_import_does_not_load_torch_or_the_sdk() -> None:
    code = (
        "import sys, stepwatch.exporters; "
        "heavy = [m for m in ('torch', 'opentelemetry.sdk', 'grpc') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == ""
