"""stepwatch.detectors.frame: one job's windows as arrays (windows × ranks × metrics)."""

from stepwatch.core._facade import publish
from stepwatch.detectors.frame._frame import JobFrame, job_time_range, list_jobs, read_frame

__all__ = [
    "JobFrame",
    "job_time_range",
    "list_jobs",
    "read_frame",
]

publish(__name__, [globals()[name] for name in __all__])
