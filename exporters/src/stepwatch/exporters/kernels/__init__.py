"""Kernel-level collection: kernel events → per-step, per-kernel-class histograms.

Sources (:class:`TorchProfilerSource` for CPU ops, :class:`CuptiSource` for GPU activity
records, recorded Kineto traces via :func:`ingest_traces` / ``stepwatch ingest``) all feed one
:class:`KernelSummariser`, which classifies names (:func:`classify_kernel`), folds classes
outside the top K into ``other`` and computes device-idle time per step.
:class:`HealthSampler` turns NVML readings into device-health gauges.

Usage with the step monitor (the sources implement ``stepwatch.exporters.KernelSource``)::

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.kernels import CuptiSource, TorchProfilerSource

    source = CuptiSource() if torch.cuda.is_available() else TorchProfilerSource()
    monitor = StepMonitor(job_id="run-42", rank=rank, world_size=world, kernel_source=source)

Without a GPU, ``cupti`` or ``pynvml`` the GPU classes log once and do nothing.
"""

from stepwatch.exporters.kernels._cupti import (
    DEFAULT_ACTIVITY_KINDS,
    MEMCPY_KIND_NAMES,
    ActivityRecord,
    CuptiBackend,
    CuptiPythonBackend,
    CuptiSource,
    activity_to_record,
)
from stepwatch.exporters.kernels._ingest import (
    DEFAULT_KERNEL_MAX_SCALE,
    DEFAULT_KERNEL_MAX_SIZE,
    IngestedTrace,
    IngestFailure,
    IngestResult,
    MetricsExporter,
    TraceWindow,
    ingest_traces,
    trace_windows,
)
from stepwatch.exporters.kernels._names import KernelClass, classify_kernel
from stepwatch.exporters.kernels._nvml import (
    CLOCK_EVENT_REASONS,
    GpuReading,
    HealthSampler,
    NvmlBackend,
    PynvmlBackend,
    XidEvent,
)
from stepwatch.exporters.kernels._summary import (
    DEFAULT_TOP_K,
    KernelEvent,
    KernelSummariser,
    busy_ns,
    quantised_seconds,
    self_time_events,
    step_idle_s,
)
from stepwatch.exporters.kernels._torch_source import (
    OpRecord,
    ProfilerBackend,
    ProfilerDutyCycle,
    TorchProfilerBackend,
    TorchProfilerSource,
    read_kineto_ops,
)
from stepwatch.exporters.kernels._trace import (
    KinetoTrace,
    TraceStep,
    parse_trace,
    phase_of_annotation,
    rank_from_file_name,
    read_trace,
)

__all__ = [
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
