"""stepwatch.detectors.simulation: seeded synthetic jobs with ground truth, and their score."""

from stepwatch.core._facade import publish
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

__all__ = [
    "Fault",
    "FaultScore",
    "Score",
    "SimulatedJob",
    "SuiteSummary",
    "Topology",
    "Truth",
    "TruthFault",
    "score",
    "send_otlp",
    "simulate",
    "summarise",
    "write_direct",
]

publish(__name__, [globals()[name] for name in __all__])
