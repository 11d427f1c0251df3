"""The public surface of stepwatch.exporters.kernels (the façade's __all__ is a contract)."""

from __future__ import annotations

import subprocess
import sys

import stepwatch.exporters.kernels as kernels

PUBLIC = [
    "CLOCK_EVENT_REASONS",
    "DEFAULT_ACTIVITY_KINDS",
    "DEFAULT_KERNEL_MAX_SCALE",
    "DEFAULT_KERNEL_MAX_SIZE",
    "DEFAULT_TOP_K",
    "MEMCPY_KIND_NAMES",
    "ActivityRecord",
    "CuptiBackend",
    "CuptiPythonBackend",
    "CuptiSource",
    "GpuReading",
    "HealthSampler",
    "IngestFailure",
    "IngestResult",
    "IngestedTrace",
    "KernelClass",
    "KernelEvent",
    "KernelSummariser",
    "KinetoTrace",
    "MetricsExporter",
    "NvmlBackend",
    "OpRecord",
    "ProfilerBackend",
    "ProfilerDutyCycle",
    "PynvmlBackend",
    "TorchProfilerBackend",
    "TorchProfilerSource",
    "TraceStep",
    "TraceWindow",
    "XidEvent",
    "activity_to_record",
    "busy_ns",
    "classify_kernel",
    "ingest_traces",
    "parse_trace",
    "phase_of_annotation",
    "quantised_seconds",
    "rank_from_file_name",
    "read_kineto_ops",
    "read_trace",
    "self_time_events",
    "step_idle_s",
    "trace_windows",
]


def test_all_is_pinned() -> None:
    assert kernels.__all__ == PUBLIC
    for name in PUBLIC:
        if not name.isupper():  # constants have no __module__
            assert getattr(kernels, name).__module__.startswith("stepwatch.exporters.kernels.")


def test_import_is_light_and_inert() -> None:
    # Importing the package pulls in neither torch, cupti, pynvml, grpc nor the OTel SDK.
    code = (
        "import sys, stepwatch.exporters.kernels, stepwatch.app._ingest_command;"
        "heavy = [m for m in ('torch', 'cupti', 'pynvml', 'grpc', 'opentelemetry.sdk')"
        " if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
