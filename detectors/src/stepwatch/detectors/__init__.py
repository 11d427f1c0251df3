"""stepwatch.detectors: progressive diagnosis of distributed training jobs.

Reads windows back from InfluxDB (:func:`read_frame`), tests them coarse to fine (job-level
change points, cross-rank robust outliers with FDR control, kernel and link localisation),
classifies findings into the kinds of docs/schema.md (:func:`analyse`, :func:`detect_job`),
runs incrementally and restart-safe (:class:`IncrementalDetector`, :class:`DetectorService`),
publishes to sinks (:class:`Sink`, :class:`InfluxDiagnosisSink`, :class:`AlertmanagerSink`,
:class:`GrafanaAnnotationSink`) and writes an HTML report (:func:`write_report`).
:func:`simulate` and :func:`score` generate and score seeded scenarios. Needs the
``[detectors]`` extra.

The rooms, each a public subpackage with more of its own: ``frame``, ``stats``,
``analysis``, ``service``, ``sinks``, ``report``, ``simulation``.

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
    from stepwatch.detectors.analysis import DetectorConfig, Finding, analyse, diagnose
    from stepwatch.detectors.frame import JobFrame, list_jobs, read_frame
    from stepwatch.detectors.report import write_report
    from stepwatch.detectors.service import (
        DetectorService,
        IncrementalDetector,
        PassResult,
        detect_job,
        detect_job_findings,
    )
    from stepwatch.detectors.simulation import (
        Fault,
        FaultScore,
        Score,
        SimulatedJob,
        SuiteSummary,
        Topology,
        Truth,
        TruthFault,
        score,
        simulate,
        summarise,
    )
    from stepwatch.detectors.sinks import (
        AlertmanagerSink,
        GrafanaAnnotationSink,
        InfluxDiagnosisSink,
        JsonLinesSink,
        MemorySink,
        Sink,
        read_diagnoses,
    )
    from stepwatch.detectors.stats import (
        ChangePoint,
        OutlierTest,
        benjamini_hochberg,
        change_points,
        cross_rank_outliers,
    )

# Lazy façade (PEP 562): ``import stepwatch.app._detect_commands`` (the CLI) must not pull in
# numpy, so each public name is imported on first use from its room (subpackage). Type
# checkers and linters read the names only from the imports above and a literal ``__all__``
# below; this map is what the lazy import needs. ``test_the_facade_lists_agree`` keeps the three
# the same, so a name added to one and not the others fails there.
_EXPORTS: dict[str, str] = {
    "DetectorConfig": "analysis",
    "Finding": "analysis",
    "analyse": "analysis",
    "diagnose": "analysis",
    "JobFrame": "frame",
    "list_jobs": "frame",
    "read_frame": "frame",
    "write_report": "report",
    "DetectorService": "service",
    "IncrementalDetector": "service",
    "PassResult": "service",
    "detect_job": "service",
    "detect_job_findings": "service",
    "Fault": "simulation",
    "FaultScore": "simulation",
    "Score": "simulation",
    "SimulatedJob": "simulation",
    "SuiteSummary": "simulation",
    "Topology": "simulation",
    "Truth": "simulation",
    "TruthFault": "simulation",
    "score": "simulation",
    "simulate": "simulation",
    "summarise": "simulation",
    "AlertmanagerSink": "sinks",
    "GrafanaAnnotationSink": "sinks",
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
    "simulate",
    "summarise",
    "write_report",
]


def __getattr__(name: str) -> Any:
    room = _EXPORTS.get(name)
    if room is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{room}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
