"""stepwatch.detectors.report: the self-contained HTML report of one job."""

from stepwatch.core._facade import publish
from stepwatch.detectors.report._report import write_report

__all__ = [
    "write_report",
]

publish(__name__, [globals()[name] for name in __all__])
