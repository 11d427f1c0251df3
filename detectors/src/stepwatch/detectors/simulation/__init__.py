"""stepwatch.detectors.simulation: seeded synthetic jobs with ground truth, and their score.

:func:`simulate` generates a job of any size and topology with injected :class:`Fault` s and
a :class:`Truth`; :func:`score` grades diagnoses against it, and :func:`suite` is the seeded
scenario suite ``bench/score_suite.py`` scores. Replaying a simulated job through the real
exporter and bridge code (``stepwatch simulate --write-direct`` / ``--endpoint``) is the
app's: it joins components, which a component never does.
"""

from stepwatch.core._facade import publish
from stepwatch.detectors.simulation._evaluate import (
    FaultScore,
    Score,
    SuiteSummary,
    score,
    summarise,
)
from stepwatch.detectors.simulation._job import RankPlacement, RankWindow, SimulatedJob, StepTiming
from stepwatch.detectors.simulation._simulate import simulate
from stepwatch.detectors.simulation._suite import Scenario, producer_scenarios, suite
from stepwatch.detectors.simulation._topology import Topology
from stepwatch.detectors.simulation._truth import Fault, Truth, TruthFault

__all__ = [
    "Fault",
    "FaultScore",
    "RankPlacement",
    "RankWindow",
    "Scenario",
    "Score",
    "SimulatedJob",
    "StepTiming",
    "SuiteSummary",
    "Topology",
    "Truth",
    "TruthFault",
    "producer_scenarios",
    "score",
    "simulate",
    "suite",
    "summarise",
]

publish(__name__, [globals()[name] for name in __all__])
