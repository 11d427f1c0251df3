"""Helpers for the framework-callback tests: what the in-memory exporter received."""

from __future__ import annotations

from typing import Any

from stepwatch.core import _schema
from stepwatch.exporters import InMemoryExporter


def phase_counts(exporter: InMemoryExporter) -> tuple[int, dict[str, int], dict[str, Any]]:
    """(steps, observations per phase, resource attributes) over every exported window."""
    steps = 0
    phases: dict[str, int] = {}
    resource: dict[str, Any] = {}
    for window in exporter.exported:
        resource_metrics = window.resource_metrics[0]
        resource = dict(resource_metrics.resource.attributes)
        for metric in resource_metrics.scope_metrics[0].metrics:
            if metric.name == _schema.STEP_DURATION:
                steps += metric.data.data_points[0].count
            elif metric.name == _schema.PHASE_DURATION:
                for point in metric.data.data_points:
                    name = str(point.attributes[_schema.PHASE])
                    phases[name] = phases.get(name, 0) + point.count
    return steps, phases, resource
