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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepwatch.detectors.analysis._analyse import (
        DetectorConfig,
        Finding,
        analyse,
        diagnose,
    )
    from stepwatch.detectors.frame._frame import (
        JobFrame,
        list_jobs,
        read_frame,
    )
    from stepwatch.detectors.report import write_report
    from stepwatch.detectors.service._runner import (
        DetectorService,
        IncrementalDetector,
        PassResult,
        detect_job,
        detect_job_findings,
    )
    from stepwatch.detectors.simulation._evaluate import (
        FaultScore,
        Score,
        SuiteSummary,
        score,
        summarise,
    )
    from stepwatch.detectors.simulation._simulate import (
        Fault,
        SimulatedJob,
        Topology,
        Truth,
        TruthFault,
        send_otlp,
        simulate,
        write_direct,
    )
    from stepwatch.detectors.sinks._alertmanager import AlertmanagerSink
    from stepwatch.detectors.sinks._grafana import GrafanaAnnotationSink
    from stepwatch.detectors.sinks._sinks import (
        InfluxDiagnosisSink,
        JsonLinesSink,
        MemorySink,
        Sink,
        read_diagnoses,
    )
    from stepwatch.detectors.stats._stats import (
        ChangePoint,
        OutlierTest,
        benjamini_hochberg,
        change_points,
        cross_rank_outliers,
    )

# Lazy façade (PEP 562): ``import stepwatch.app._detect_commands`` (the CLI) must not pull in
# numpy, so the public names are imported on first use from their private modules.
_EXPORTS: dict[str, str] = {
    "DetectorConfig": "analysis",
    "Finding": "analysis",
    "analyse": "analysis",
    "diagnose": "analysis",
    "FaultScore": "simulation",
    "Score": "simulation",
    "SuiteSummary": "simulation",
    "score": "simulation",
    "summarise": "simulation",
    "JobFrame": "frame",
    "list_jobs": "frame",
    "read_frame": "frame",
    "DetectorService": "service",
    "IncrementalDetector": "service",
    "PassResult": "service",
    "detect_job": "service",
    "detect_job_findings": "service",
    "Fault": "simulation",
    "SimulatedJob": "simulation",
    "Topology": "simulation",
    "Truth": "simulation",
    "TruthFault": "simulation",
    "send_otlp": "simulation",
    "simulate": "simulation",
    "write_direct": "simulation",
    "InfluxDiagnosisSink": "sinks",
    "JsonLinesSink": "sinks",
    "MemorySink": "sinks",
    "Sink": "sinks",
    "read_diagnoses": "sinks",
    "ChangePoint": "stats",
    "OutlierTest": "stats",
    "benjamini_hochberg": "stats",
    "change_points": "stats",
    "cross_rank_outliers": "stats",
    # Sinks and the report written by the operators' side of detectors/.
    "AlertmanagerSink": "sinks",
    "GrafanaAnnotationSink": "sinks",
    "write_report": "report",
}

__all__ = [
    "AlertmanagerSink",
    "ChangePoint",
    "DetectorConfig",
    "DetectorService",
    "Fault",
    "FaultScore",
    "Finding",
    "GrafanaAnnotationSink",
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
    "write_report",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
