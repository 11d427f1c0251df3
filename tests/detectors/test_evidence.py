"""No raised finding rests on evidence within noise of 1.00x (issue 44), on the seeded suite.

A warning or critical finding on ranks says "these ranks differ from their peers by this
much"; its own evidence ratio (:attr:`Finding.evidence`) must show it. The real cases are
scanned by tests/detectors/test_instrumentation_matrix.py; this scans the simulator's suite
(every fault kind, clean runs, producers without a communication phase) as
bench/score_suite.py does at full size.
"""

from __future__ import annotations

import pytest

from stepwatch.detectors import analyse
from stepwatch.detectors.simulation import Scenario, producer_scenarios, suite

#: Within 3% of 1.00x is noise (bench/score_suite.py, the instrumentation matrix).
MIN_EVIDENCE = 1.03
#: Kinds that rest on presence (a rank silent or stuck), not on a ratio.
PRESENCE_KINDS = ("rank_missing", "hang")

SCENARIOS = [
    *suite(48, max_world_size=64),
    *producer_scenarios(16, start=48, max_world_size=64),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_raised_findings_show_their_own_evidence(scenario: Scenario) -> None:
    weak = []
    for finding in analyse(scenario.simulate().frame()):
        diagnosis = finding.diagnosis
        if diagnosis.severity == "info" or not diagnosis.ranks:
            continue
        if diagnosis.kind in PRESENCE_KINDS:
            continue
        if max(finding.evidence, 1.0 / finding.evidence) < MIN_EVIDENCE:
            weak.append(f"{finding.evidence:.3f}: {diagnosis.summary}")
    assert not weak, weak
