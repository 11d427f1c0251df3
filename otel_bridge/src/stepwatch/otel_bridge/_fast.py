"""The bridge's fast path: a request body straight to line protocol in C (``_fastpath``).

The C converter (otel_bridge/csrc/fastpath.c) reads an ``ExportMetricsServiceRequest`` from
the protobuf wire format and writes the lines the Python converter would write for it, in the
same order, for what stepwatch's exporters send: delta exponential histograms with positive
buckets, gauges, sums, compact layout. It declines anything else (cumulative temporality,
explicit-bounds histograms, summaries, negative or zero buckets, arrays in attributes, a point
the Python path would reject, anything malformed or unknown), and the request then takes the
Python path unchanged. docs/deployment.md, "Bridge vs influxd CPU".

Without a C compiler the package installs without the extension: :data:`AVAILABLE` is False
and the bridge says so once when it starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple

_log = logging.getLogger("stepwatch.otel_bridge")

try:
    from stepwatch.otel_bridge import _fastpath
except ImportError as exc:  # pragma: no cover - exercised where the extension is not built
    _fastpath = None  # type: ignore[assignment]
    IMPORT_ERROR: str | None = str(exc)
else:
    IMPORT_ERROR = None

AVAILABLE: bool = _fastpath is not None
"""The C extension is importable (built when the package was installed)."""

_INT64 = (-(2**63), 2**63 - 1)


class FastBatch(NamedTuple):
    """One request converted by the fast path, before the cardinality guard."""

    lines: list[str]
    hashes: bytes  # hash() of each line's series key, int64 each (the guard's keys)
    descs_index: bytes  # int32 each: the line's (job, measurement, rank) in ``descs``
    descs: list[tuple[str, str, str]]
    rejected: dict[str, int]  # only duplicate-rank style refusals of the resource check
    dropped_attributes: int


def convert(
    body: bytes,
    *,
    tag_allowlist: frozenset[str],
    max_duration_s: float | None,
    time_bounds_unix_nano: tuple[int, int] | None,
    resource_check: Callable[[Mapping[str, str]], str | None] | None,
) -> FastBatch | None:
    """The fast path's conversion of a request body (compact layout), or None when it does
    not handle this request (the caller parses it and takes the Python path)."""
    if _fastpath is None:
        return None
    earliest = latest = None
    if time_bounds_unix_nano is not None:  # clipped: a stored time is within 1 .. 2**63 - 2
        earliest = min(max(time_bounds_unix_nano[0], -1), _INT64[1])
        latest = min(max(time_bounds_unix_nano[1], -1), _INT64[1])
    result = _fastpath.convert(
        body,
        tag_allowlist,
        None if max_duration_s is None else float(max_duration_s),
        earliest,
        latest,
        resource_check,
    )
    return None if result is None else FastBatch(*result)


def log_unavailable() -> None:
    """One line at the bridge's start when the extension is missing."""
    if IMPORT_ERROR is not None:
        _log.warning(
            "bridge C fast path unavailable (%s): converting in Python, ~10x the CPU per "
            "point; reinstall stepwatch-otel-bridge with a C compiler present",
            IMPORT_ERROR,
        )
