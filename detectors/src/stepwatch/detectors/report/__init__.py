"""stepwatch.detectors.report: the self-contained HTML report of one job.

:func:`write_report` queries the job's windows and findings from InfluxDB and writes one HTML
page with inline SVG (``stepwatch report``). Inside: ``_data`` (queries and aggregation),
``_svg`` (the plots) and ``_page`` (the HTML page).
"""

from stepwatch.core._facade import publish
from stepwatch.detectors.report._page import write_report

__all__ = [
    "write_report",
]

publish(__name__, [globals()[name] for name in __all__])
