"""stepwatch.detectors.service: detection over InfluxDB, one-shot or incremental."""

from stepwatch.core._facade import publish
from stepwatch.detectors.service._runner import (
    DetectorService,
    IncrementalDetector,
    PassResult,
    detect_job,
    detect_job_findings,
)

__all__ = [
    "DetectorService",
    "IncrementalDetector",
    "PassResult",
    "detect_job",
    "detect_job_findings",
]

publish(__name__, [globals()[name] for name in __all__])
