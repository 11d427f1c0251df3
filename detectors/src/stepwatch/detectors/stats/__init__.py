"""stepwatch.detectors.stats: change points, robust cross-rank outliers, FDR control."""

from stepwatch.core._facade import publish
from stepwatch.detectors.stats._fdr import benjamini_hochberg
from stepwatch.detectors.stats._stats import (
    ChangePoint,
    OutlierTest,
    change_points,
    cross_rank_outliers,
)

__all__ = [
    "ChangePoint",
    "OutlierTest",
    "benjamini_hochberg",
    "change_points",
    "cross_rank_outliers",
]

publish(__name__, [globals()[name] for name in __all__])
