"""stepwatch.detectors.sinks: where findings go (InfluxDB, Alertmanager, Grafana, JSON lines)."""

from stepwatch.core._facade import publish
from stepwatch.detectors.sinks._alertmanager import AlertmanagerSink
from stepwatch.detectors.sinks._grafana import GrafanaAnnotationSink
from stepwatch.detectors.sinks._sinks import (
    InfluxDiagnosisSink,
    JsonLinesSink,
    MemorySink,
    Sink,
    read_diagnoses,
)

__all__ = [
    "AlertmanagerSink",
    "GrafanaAnnotationSink",
    "InfluxDiagnosisSink",
    "JsonLinesSink",
    "MemorySink",
    "Sink",
    "read_diagnoses",
]

publish(__name__, [globals()[name] for name in __all__])
