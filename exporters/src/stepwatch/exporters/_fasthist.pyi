from collections.abc import Sequence
from typing import Any

from stepwatch.exporters._histogram import ExponentialHistogram

SCALE_FACTORS: dict[int, float]
MIN_NORMAL: float
BOUNDARY_MARGIN: float
UPPER_MARGIN: float
MIN_SCALE: int
MAX_SCALE: int

def record_many(histogram: ExponentialHistogram, values: Sequence[float], /) -> tuple[int, int]: ...
def record_weighted(
    histogram: ExponentialHistogram, values: Sequence[float], weights: Sequence[int], /
) -> tuple[int, int]: ...
def exponential_point(point: object, attributes: bytes, /) -> bytes | None: ...
def self_time(
    spans: Sequence[tuple[object, int, int, int]], event_type: type, /
) -> tuple[list[Any], list[Any]] | None: ...
