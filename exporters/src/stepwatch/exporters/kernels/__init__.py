"""Kernel-level collection: kernel events → per-step, per-kernel-class histograms.

Sources (:class:`TorchProfilerSource` for CPU ops, :class:`CuptiSource` for GPU activity
records, recorded Kineto traces via :func:`ingest_traces` / ``stepwatch ingest``) all feed one
:class:`KernelSummariser`, which classifies names (:func:`classify_kernel`), folds classes
outside the top K into ``other`` and computes device-idle time per step.
:class:`HealthSampler` turns NVML readings into device-health gauges. Each source reads its
device through a backend Protocol (:class:`CuptiBackend`, :class:`ProfilerBackend`,
:class:`NvmlBackend`), so tests pass fakes.

Usage with the step monitor (the sources implement ``stepwatch.exporters.KernelSource``)::

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.kernels import CuptiSource, TorchProfilerSource

    source = CuptiSource() if torch.cuda.is_available() else TorchProfilerSource()
    monitor = StepMonitor(job_id="run-42", rank=rank, world_size=world, kernel_source=source)

Without a GPU, ``cupti`` or ``pynvml`` the GPU classes log once and do nothing.
``CuptiSource(period_steps=256, detach="finalize")`` records 5 steps in 256 (the same steps on
every rank) and takes CUPTI out of the process in between, so a kernel launch pays nothing for
it there; built and tested on recorded CUPTI records, not yet run on a GPU
(docs/exporters.md, "Kernel and op histograms").
"""

from stepwatch.core._facade import publish
from stepwatch.exporters.device._nvml import GpuReading, HealthSampler, NvmlBackend, XidEvent
from stepwatch.exporters.kernels._cupti import CuptiBackend, CuptiSource
from stepwatch.exporters.kernels._cupti_backend import CuptiPythonBackend
from stepwatch.exporters.kernels._cupti_cycle import CuptiDutyCycle
from stepwatch.exporters.kernels._cupti_records import ActivityRecord
from stepwatch.exporters.kernels._duty import ProfilerDutyCycle
from stepwatch.exporters.kernels._ingest import (
    IngestedTrace,
    IngestFailure,
    IngestResult,
    MetricsExporter,
    TraceWindow,
    ingest_traces,
    trace_windows,
)
from stepwatch.exporters.kernels._names import KernelClass, classify_kernel
from stepwatch.exporters.kernels._summary import KernelEvent, KernelSummariser
from stepwatch.exporters.kernels._torch_backend import (
    OpRecord,
    ProfilerBackend,
    TorchProfilerBackend,
)
from stepwatch.exporters.kernels._torch_source import TorchProfilerSource
from stepwatch.exporters.kernels._trace import KinetoTrace, TraceStep, parse_trace, read_trace

__all__ = [
    "ActivityRecord",
    "CuptiBackend",
    "CuptiDutyCycle",
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
    "TorchProfilerBackend",
    "TorchProfilerSource",
    "TraceStep",
    "TraceWindow",
    "XidEvent",
    "classify_kernel",
    "ingest_traces",
    "parse_trace",
    "read_trace",
    "trace_windows",
]

publish(__name__, [globals()[name] for name in __all__])
