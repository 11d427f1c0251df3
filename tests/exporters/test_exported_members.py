"""The public surface of stepwatch.exporters is pinned, and importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import stepwatch.exporters

#: What users call, by role. Helpers live in the private modules (tests import them there);
#: kernel collection has its own façade, stepwatch.exporters.kernels.
PUBLIC_BY_ROLE = {
    "the monitor": ("StepMonitor", "MonitorStats", "instrument", "Instrumentation"),
    "protocols": ("Clock", "DeviceTimer", "HealthSource", "KernelSource", "Exporter"),
    "what a kernel source returns": ("KernelWindow",),
    "export configuration": ("ExporterConfig", "resolve_exporter_config", "create_exporter"),
    "exporters": ("OtlpHttpExporter", "OtlpHttpStats", "InMemoryExporter"),
    "windows in stepwatch's schema": ("WindowBuilder", "build_resource"),
}


def test_all_is_pinned() -> None:
    expected = sorted(name for names in PUBLIC_BY_ROLE.values() for name in names)
    assert sorted(stepwatch.exporters.__all__) == expected
    assert len(set(stepwatch.exporters.__all__)) == len(stepwatch.exporters.__all__)


def test_every_exported_name_names_the_facade_as_its_module() -> None:
    for name in stepwatch.exporters.__all__:
        member = getattr(stepwatch.exporters, name)
        assert member.__module__ == "stepwatch.exporters", name
    assert stepwatch.exporters.StepMonitor.__module__ == "stepwatch.exporters"
    # The function is the method: one implementation, two spellings.
    assert stepwatch.exporters.instrument is stepwatch.exporters.StepMonitor.instrument


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
