"""stepwatch.detectors.frame: one job's windows as arrays (windows × ranks × metrics)."""

from stepwatch.core._facade import publish
from stepwatch.detectors.frame._frame import JobFrame, job_time_range, list_jobs, read_frame
from stepwatch.detectors.frame._progress import (
    JobProgress,
    ProgressFrame,
    RankProgress,
    list_reporting_jobs,
    read_progress,
    with_progress,
)

__all__ = [
    "JobFrame",
    "JobProgress",
    "ProgressFrame",
    "RankProgress",
    "job_time_range",
    "list_jobs",
    "list_reporting_jobs",
    "read_frame",
    "read_progress",
    "with_progress",
]

publish(__name__, [globals()[name] for name in __all__])
