"""stepwatch.detectors.sinks: where findings go (InfluxDB, Alertmanager, Grafana, JSON lines).

Every sink has ``publish(findings)`` (:class:`Sink`) and is idempotent: publishing a finding
again never duplicates it downstream. :func:`sinks_from_environment` builds the Alertmanager
and Grafana sinks from arguments, else :mod:`stepwatch.core.settings`.
"""

from stepwatch.core._facade import publish
from stepwatch.detectors.sinks._alertmanager import AlertmanagerSink
from stepwatch.detectors.sinks._configured import sinks_from_environment
from stepwatch.detectors.sinks._grafana import GrafanaAnnotationSink
from stepwatch.detectors.sinks._sinks import (
    InfluxDiagnosisSink,
    JsonLinesSink,
    MemorySink,
    Sink,
    format_table,
    read_diagnoses,
)

__all__ = [
    "AlertmanagerSink",
    "GrafanaAnnotationSink",
    "InfluxDiagnosisSink",
    "JsonLinesSink",
    "MemorySink",
    "Sink",
    "format_table",
    "read_diagnoses",
    "sinks_from_environment",
]

publish(__name__, [globals()[name] for name in __all__])
