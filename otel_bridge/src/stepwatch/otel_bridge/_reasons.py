"""Why a data point is refused: the ``reason`` label of
``stepwatch_bridge_datapoints_rejected_total`` (the table in docs/storage.md)."""

from __future__ import annotations

REASON_NON_FINITE = "non_finite"
REASON_NEGATIVE_DURATION = "negative_duration"
REASON_COUNT_MISMATCH = "count_mismatch"
REASON_BUCKET_LAYOUT = "bucket_layout"
REASON_MISSING_RESOURCE = "missing_resource_attribute"
REASON_RANK_RANGE = "rank_out_of_range"
REASON_MISSING_TIME = "missing_time"
REASON_TIME_RANGE = "time_out_of_range"
REASON_INVALID_NAME = "invalid_name"
REASON_NO_VALUE = "no_value"
REASON_CARDINALITY = "cardinality_limit"
REASON_CLOCK_SKEW = "clock_skew"
REASON_IMPLAUSIBLE_DURATION = "implausible_duration"
REASON_DUPLICATE_RANK = "duplicate_rank"
# InfluxDB's line-protocol parser reads a trailing backslash as escaping the delimiter after
# it, so a name or tag value ending in "\\" cannot be written (found by bench/bridge_fuzz.py).
REASON_UNREPRESENTABLE = "unrepresentable"
# CUMULATIVE sums and histograms are stored as per-window deltas (_cumulative.py): the first
# point of a series (and the first after a reset) is a baseline, not a window.
REASON_CUMULATIVE_BASELINE = "cumulative_baseline"
REASON_CUMULATIVE_RESET = "cumulative_reset"
REASON_CUMULATIVE_OUT_OF_ORDER = "cumulative_out_of_order"


class Rejected(ValueError):
    """A data point fails validation; carries the reason label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
