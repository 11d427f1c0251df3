"""The public surface of stepwatch.exporters.kernels (the façade's __all__ is a contract)."""

from __future__ import annotations

import subprocess
import sys

import stepwatch.exporters.kernels as kernels

#: What users call, by role. Helpers and tables (busy_ns, activity_to_record, the default
#: sizes...) live in the private modules; tests import them there.
PUBLIC_BY_ROLE = {
    "CUPTI (GPU activity)": (
        "CuptiSource",
        "CuptiBackend",
        "CuptiPythonBackend",
        "ActivityRecord",
        "CuptiDutyCycle",
    ),
    "torch.profiler (CPU ops)": (
        "TorchProfilerSource",
        "ProfilerBackend",
        "TorchProfilerBackend",
        "OpRecord",
        "ProfilerDutyCycle",
    ),
    "NVML (device health)": ("HealthSampler", "NvmlBackend", "GpuReading", "XidEvent"),
    "summaries": ("KernelSummariser", "KernelEvent", "classify_kernel", "KernelClass"),
    "recorded traces": (
        "read_trace",
        "parse_trace",
        "KinetoTrace",
        "TraceStep",
        "trace_windows",
        "TraceWindow",
        "ingest_traces",
        "IngestResult",
        "IngestedTrace",
        "IngestFailure",
        "MetricsExporter",
    ),
}


def test_all_is_pinned() -> None:
    expected = sorted(name for names in PUBLIC_BY_ROLE.values() for name in names)
    assert sorted(kernels.__all__) == expected
    assert len(set(kernels.__all__)) == len(kernels.__all__)
    for name in kernels.__all__:
        assert getattr(kernels, name).__module__ == "stepwatch.exporters.kernels", name


def test_import_is_light_and_inert() -> None:
    # Importing the package pulls in neither torch, cupti, pynvml, grpc nor the OTel SDK.
    code = (
        "import sys, stepwatch.exporters.kernels, stepwatch.app._ingest_command;"
        "heavy = [m for m in ('torch', 'cupti', 'pynvml', 'grpc', 'opentelemetry.sdk')"
        " if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
