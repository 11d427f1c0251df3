"""Scoring diagnoses against a simulator's ground truth.

A diagnosis *relates* to a fault when it starts no earlier than ``early_windows`` before the
fault and before the fault ended, and it localises to the fault's ranks or hosts (any
job-level diagnosis relates to a job-level fault; a job-level diagnosis starting within
``early_windows`` of a rank-level fault is that fault's echo, counted as extra, not as a
false alarm). Diagnoses relating to no fault are false alarms.

Findings that cost the job less than the detectors' bar are not raised by design, so a
fault is *required* only when its ground-truth cost clearly clears that bar (half as much
again: ``required_margin``); a fault costing less may be reported or not. Kinds without a
cost (``rank_missing``) are always required. The cost error is the reported slowdown over
the fault's ground-truth slowdown, minus one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from stepwatch.core._diagnosis import Diagnosis
from stepwatch.detectors.simulation._truth import Truth, TruthFault


@dataclasses.dataclass(frozen=True)
class FaultScore:
    """How one injected fault was reported.

    Attributes:
        fault: the truth.
        detected: some diagnosis relates to it.
        right_kind: a related diagnosis has the fault's kind.
        localised: a right-kind diagnosis names exactly the fault's ranks (hosts for link
            degradation) and its kernel class when the truth names one.
        latency_windows: windows from fault onset to the first right-kind report (``None``
            when not detected or detection times are unknown).
        diagnosis: the best related diagnosis.
        required: the fault costs enough that it must be reported (see the module).
        reported_slowdown: the cost the right-kind reports give it: their slowdowns
            weighted by how long each lasted (an episodic fault may be reported as several
            stretches), ``None`` without one.
    """

    fault: TruthFault
    detected: bool
    right_kind: bool
    localised: bool
    latency_windows: float | None
    diagnosis: Diagnosis | None
    required: bool = True
    reported_slowdown: float | None = None

    @property
    def cost_error(self) -> float | None:
        """Reported slowdown / true slowdown - 1 for a right-kind report (``None`` else)."""
        if self.reported_slowdown is None or self.fault.kind == "rank_missing":
            return None
        return self.reported_slowdown / self.fault.slowdown - 1.0


@dataclasses.dataclass(frozen=True)
class Score:
    """Scores of one scenario."""

    job: str
    faults: tuple[FaultScore, ...]
    false_alarms: tuple[Diagnosis, ...]
    extra: tuple[Diagnosis, ...]

    @property
    def clean(self) -> bool:
        return not self.faults

    def to_json_dict(self) -> dict[str, object]:
        return {
            "job": self.job,
            "faults": [
                {
                    "kind": item.fault.kind,
                    "ranks": list(item.fault.ranks),
                    "severity": item.fault.severity,
                    "detected": item.detected,
                    "right_kind": item.right_kind,
                    "localised": item.localised,
                    "latency_windows": item.latency_windows,
                    "reported_kind": None if item.diagnosis is None else item.diagnosis.kind,
                    "slowdown": item.fault.slowdown,
                    "reported_slowdown": item.reported_slowdown,
                    "required": item.required,
                }
                for item in self.faults
            ],
            "false_alarms": [d.to_json_dict() for d in self.false_alarms],
            "extra": len(self.extra),
        }


def _relates(diagnosis: Diagnosis, fault: TruthFault, window_ns: int, early_windows: int) -> bool:
    if diagnosis.start_unix_nano < fault.start_unix_nano - early_windows * window_ns:
        return False
    if fault.end_unix_nano is not None and diagnosis.start_unix_nano > fault.end_unix_nano:
        return False
    if fault.kind == "job_regression" or not fault.ranks:
        return True
    if diagnosis.kind == "job_regression":
        return diagnosis.start_unix_nano <= fault.start_unix_nano + early_windows * window_ns
    if set(diagnosis.ranks) & set(fault.ranks):
        return True
    return bool(set(diagnosis.hosts) & set(fault.hosts))


def _localised(diagnosis: Diagnosis, fault: TruthFault) -> bool:
    if fault.kind == "link_degradation":
        if tuple(sorted(diagnosis.hosts)) != tuple(sorted(fault.hosts)):
            return False
    elif tuple(sorted(diagnosis.ranks)) != tuple(sorted(fault.ranks)):
        return False
    if fault.kernel_class is not None and diagnosis.kernel_class != fault.kernel_class:
        return False
    return not (fault.kind == "dataloader_stall" and diagnosis.phase != fault.phase)


def score(
    truth: Truth,
    diagnoses: Sequence[Diagnosis],
    *,
    detected_unix_nano: Mapping[str, int] | None = None,
    early_windows: int = 6,
    min_slowdown: Callable[[str], float] | None = None,
    required_margin: float = 1.5,
) -> Score:
    """Score diagnoses of one job against its truth.

    Args:
        truth: the simulator's ground truth.
        diagnoses: what the detectors reported for the job.
        detected_unix_nano: finding id → when it was first reportable (for latency).
        early_windows: tolerance for a diagnosis starting before the fault.
        min_slowdown: the detectors' cost bar per kind (``DetectorConfig.min_slowdown_for``);
            ``None``: every fault is required.
        required_margin: a fault is required when its cost's excess over 1 is at least
            this many times the bar's.
    """
    window_ns = round(truth.window_s * 1e9)
    mine = [d for d in diagnoses if d.job == truth.job]
    related_any: set[str] = set()
    results = []
    for fault in truth.faults:
        related = [d for d in mine if _relates(d, fault, window_ns, early_windows)]
        related_any.update(d.finding_id for d in related)
        kind = [d for d in related if d.kind == fault.kind]
        exact = [d for d in kind if _localised(d, fault)]
        candidates = exact or kind or related
        # The first report of it (findings come most expensive first; an episodic fault
        # may be reported as several stretches).
        best = min(candidates, key=lambda d: d.start_unix_nano) if candidates else None
        latency = None
        if best is not None and best in kind and detected_unix_nano is not None:
            when = detected_unix_nano.get(best.finding_id)
            if when is not None:
                latency = max(0.0, (when - fault.start_unix_nano) / window_ns)
        reported = None
        if kind:
            reporting = exact or kind
            weights = [
                max((d.end_unix_nano or truth.end_unix_nano) - d.start_unix_nano, 1)
                for d in reporting
            ]
            reported = sum(w * d.slowdown for w, d in zip(weights, reporting, strict=True)) / sum(
                weights
            )
        required = True
        if min_slowdown is not None and fault.kind != "rank_missing":
            bar = min_slowdown(fault.kind)
            required = fault.slowdown - 1.0 >= required_margin * (bar - 1.0)
        results.append(
            FaultScore(
                fault=fault,
                detected=bool(related),
                right_kind=bool(kind),
                localised=bool(exact),
                latency_windows=latency,
                diagnosis=best,
                required=required,
                reported_slowdown=reported,
            )
        )
    chosen = {item.diagnosis.finding_id for item in results if item.diagnosis is not None}
    false_alarms = tuple(d for d in mine if d.finding_id not in related_any)
    extra = tuple(d for d in mine if d.finding_id in related_any and d.finding_id not in chosen)
    return Score(job=truth.job, faults=tuple(results), false_alarms=false_alarms, extra=extra)


@dataclasses.dataclass(frozen=True)
class SuiteSummary:
    """Totals over many scenarios (``bench/score_suite.py``)."""

    scenarios: int
    faults: int
    detected: int
    right_kind: int
    localised: int
    clean_runs: int
    false_alarms_clean: int
    false_alarms_faulty: int
    big_faults: int
    big_within_3: int
    optional: int = 0
    optional_reported: int = 0
    costed: int = 0
    cost_within_10: int = 0


def summarise(scores: Sequence[Score], *, big_slowdown: float = 1.2) -> SuiteSummary:
    """Totals; ``faults``/``detected``/``right_kind``/``localised`` count required faults,
    ``big_*`` faults that slow the job by ``big_slowdown`` or more (ground truth),
    ``costed``/``cost_within_10`` required right-kind reports and those whose cost is
    within ±10% of the ground truth."""
    every = [item for s in scores for item in s.faults]
    faults = [item for item in every if item.required]
    optional = [item for item in every if not item.required]
    big = [
        item
        for item in faults
        if item.fault.slowdown >= big_slowdown and item.fault.kind != "rank_missing"
    ]
    errors = [item.cost_error for item in faults if item.cost_error is not None]
    return SuiteSummary(
        optional=len(optional),
        optional_reported=sum(item.right_kind for item in optional),
        costed=len(errors),
        cost_within_10=sum(abs(error) <= 0.10 for error in errors),
        scenarios=len(scores),
        faults=len(faults),
        detected=sum(item.detected for item in faults),
        right_kind=sum(item.right_kind for item in faults),
        localised=sum(item.localised for item in faults),
        clean_runs=sum(s.clean for s in scores),
        false_alarms_clean=sum(len(s.false_alarms) for s in scores if s.clean),
        false_alarms_faulty=sum(len(s.false_alarms) for s in scores if not s.clean),
        big_faults=len(big),
        big_within_3=sum(
            item.latency_windows is not None and item.latency_windows <= 3 for item in big
        ),
    )
