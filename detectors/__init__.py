"""stepwatch.detectors: progressive diagnosis of distributed training jobs.

Reads windows back from InfluxDB (:func:`read_frame`), tests them coarse to fine (job-level
change points, cross-rank robust outliers with FDR control, kernel and link localisation),
classifies findings into the SCHEMA.md kinds (:func:`analyse`, :func:`detect_job`), runs
incrementally and restart-safe (:class:`IncrementalDetector`, :class:`DetectorService`) and
publishes to sinks (:class:`Sink`, :class:`InfluxDiagnosisSink`). :func:`simulate` and
:func:`score` generate and score seeded scenarios. Needs the ``[detectors]`` extra.

Example:
    >>> from stepwatch.detectors import Fault, diagnose, simulate
    >>> job = simulate(16, steps=300, faults=[Fault.parse("compute_straggler@150:5:1.3")])
    >>> [(d.kind, d.ranks, d.kernel_class) for d in diagnose(job.frame())]
    [('compute_straggler', (5,), 'gemm')]
"""

from stepwatch.detectors._analyse import DetectorConfig, Finding, analyse, diagnose
from stepwatch.detectors._evaluate import FaultScore, Score, SuiteSummary, score, summarise
from stepwatch.detectors._frame import JobFrame, list_jobs, read_frame
from stepwatch.detectors._runner import (
    DetectorService,
    IncrementalDetector,
    PassResult,
    detect_job,
    detect_job_findings,
)
from stepwatch.detectors._simulate import (
    Fault,
    SimulatedJob,
    Topology,
    Truth,
    TruthFault,
    send_otlp,
    simulate,
    write_direct,
)
from stepwatch.detectors._sinks import (
    InfluxDiagnosisSink,
    JsonLinesSink,
    MemorySink,
    Sink,
    read_diagnoses,
)
from stepwatch.detectors._stats import (
    ChangePoint,
    OutlierTest,
    benjamini_hochberg,
    change_points,
    cross_rank_outliers,
)

__all__ = [
    "ChangePoint",
    "DetectorConfig",
    "DetectorService",
    "Fault",
    "FaultScore",
    "Finding",
    "IncrementalDetector",
    "InfluxDiagnosisSink",
    "JobFrame",
    "JsonLinesSink",
    "MemorySink",
    "OutlierTest",
    "PassResult",
    "Score",
    "SimulatedJob",
    "Sink",
    "SuiteSummary",
    "Topology",
    "Truth",
    "TruthFault",
    "analyse",
    "benjamini_hochberg",
    "change_points",
    "cross_rank_outliers",
    "detect_job",
    "detect_job_findings",
    "diagnose",
    "list_jobs",
    "read_diagnoses",
    "read_frame",
    "score",
    "send_otlp",
    "simulate",
    "summarise",
    "write_direct",
]

# Sinks and the report written by the operators' side, re-exported when present.
try:
    from stepwatch.detectors._alertmanager import AlertmanagerSink
    from stepwatch.detectors._grafana import GrafanaAnnotationSink

    __all__ += ["AlertmanagerSink", "GrafanaAnnotationSink"]
except ImportError:  # pragma: no cover - those modules are optional parts of the tree
    pass
try:
    from stepwatch.detectors._report import write_report

    __all__ += ["write_report"]
except ImportError:  # pragma: no cover
    pass
