"""The bridge's fast path: a request body straight to line protocol in C (``_fastpath``).

The C converter (otel_bridge/csrc/fastpath.c) reads an ``ExportMetricsServiceRequest`` from
the protobuf wire format and writes the lines the Python converter would write for it, in the
same order, for what stepwatch's exporters send: delta exponential histograms with positive
buckets, gauges, sums, compact layout. It declines anything else (cumulative temporality,
explicit-bounds histograms, summaries, negative or zero buckets, arrays in attributes, a point
the Python path would reject, anything malformed or unknown), and the request then takes the
Python path unchanged. docs/deployment.md, "Bridge vs influxd CPU".

Without a C compiler the package installs without the extension: :data:`AVAILABLE` is False
and the bridge says so when it starts (:func:`announce`: a warning, and
``stepwatch_bridge_fast_path`` 0 on ``/metrics``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from stepwatch.core import settings
from stepwatch.core._errors import ConfigError

if TYPE_CHECKING:
    from stepwatch.otel_bridge._metrics import BridgeMetrics

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


def announce(in_use: bool, *, requested: bool, metrics: BridgeMetrics) -> None:
    """At the bridge's start: refuse to start without the extension where
    ``STEPWATCH_REQUIRE_C`` asks for it, say which path converts (one log line; a warning when
    the extension is missing) and set ``stepwatch_bridge_fast_path``.

    Raises:
        ConfigError: ``STEPWATCH_REQUIRE_C`` is on and the extension is not built.
    """
    if IMPORT_ERROR is not None and settings.REQUIRE_C.resolve(None, os.environ):
        raise ConfigError(
            f"STEPWATCH_REQUIRE_C=1 but the bridge's C fast path is not built ({IMPORT_ERROR}): "
            "reinstall stepwatch-otel-bridge with a C compiler present"
        )
    metrics.fast_path.set(1 if in_use else 0)
    if in_use:
        _log.info("bridge: converting with the C fast path")
    elif IMPORT_ERROR is not None and requested:
        _log.warning(
            "bridge C fast path unavailable (%s): converting in Python, ~10x the CPU per "
            "point; reinstall stepwatch-otel-bridge with a C compiler present",
            IMPORT_ERROR,
        )
    else:
        _log.info("bridge: converting in Python (fast_path=False)")
