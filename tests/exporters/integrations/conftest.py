"""Helpers for the framework-callback tests: what the in-memory exporter received."""

from __future__ import annotations

import dataclasses
from typing import Any

from stepwatch.core import _schema
from stepwatch.exporters import InMemoryExporter


def phase_counts(exporter: InMemoryExporter) -> tuple[int, dict[str, int], dict[str, Any]]:
    """(steps, observations per phase, resource attributes) over every exported window."""
    totals = exported_totals(exporter)
    return totals.steps, totals.phase_counts, totals.resource


@dataclasses.dataclass
class Totals:
    """Every exported window of one monitor added up."""

    steps: int = 0
    step_s: float = 0.0
    phase_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)
    phase_max_s: dict[str, float] = dataclasses.field(default_factory=dict)
    resource: dict[str, Any] = dataclasses.field(default_factory=dict)

    def mean_s(self, phase: str) -> float:
        """Mean time per step in ``phase`` (over the steps that timed it)."""
        return self.phase_s.get(phase, 0.0) / max(self.phase_counts.get(phase, 0), 1)


def exported_totals(exporter: InMemoryExporter) -> Totals:
    totals = Totals()
    for window in exporter.exported:
        resource_metrics = window.resource_metrics[0]
        totals.resource = dict(resource_metrics.resource.attributes)
        for metric in resource_metrics.scope_metrics[0].metrics:
            if metric.name == _schema.STEP_DURATION:
                point = metric.data.data_points[0]
                totals.steps += point.count
                totals.step_s += point.sum
            elif metric.name == _schema.PHASE_DURATION:
                for point in metric.data.data_points:
                    name = str(point.attributes[_schema.PHASE])
                    totals.phase_counts[name] = totals.phase_counts.get(name, 0) + point.count
                    totals.phase_s[name] = totals.phase_s.get(name, 0.0) + point.sum
                    totals.phase_max_s[name] = max(totals.phase_max_s.get(name, 0.0), point.max)
    return totals
