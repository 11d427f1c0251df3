"""stepwatch.detectors.analysis: progressive diagnosis of a frame; rules name each kind."""

from stepwatch.core._facade import publish
from stepwatch.detectors.analysis._analyse import Finding, analyse, diagnose
from stepwatch.detectors.analysis._config import DetectorConfig

__all__ = [
    "DetectorConfig",
    "Finding",
    "analyse",
    "diagnose",
]

publish(__name__, [globals()[name] for name in __all__])
