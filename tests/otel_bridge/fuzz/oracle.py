"""What the fast path's fuzzer (``fastpath_fuzzer.c``) checks on every input.

An input is one option byte, then an OTLP request body as it comes off the wire. The byte picks
the converter's options (the tag allowlist, the duration limit, the accepted time window, a
resource check that refuses some ranks); the body goes to the C fast path
(``stepwatch.otel_bridge._fastpath``, built with coverage and sanitizers into the fuzzer).
The fast path must never crash, raise or leak an exception, and where it handles a body it
must agree with the Python path on everything the bridge stores and counts
(``tests.otel_bridge.test_fastpath.compare``: lines, rejected and dropped counts, the resource
checks made, the cardinality guard's keys and budgets); a failed check aborts the fuzzer with
the input saved.
"""

from __future__ import annotations

import time
from typing import Any

from google.protobuf.message import DecodeError

from stepwatch.core import _schema
from stepwatch.otel_bridge._convert import MAX_DURATION_S, TAG_ALLOWLIST
from stepwatch.otel_bridge._decode import RequestError
from tests.otel_bridge.test_fastpath import compare

NOW_NS = time.time_ns()
ALLOWLISTS = (TAG_ALLOWLIST, frozenset({"host.name", _schema.RANK}))
DURATIONS = (MAX_DURATION_S, None, 1e-6, MAX_DURATION_S)
BOUNDS: tuple[tuple[int, int] | None, ...] = (
    None,
    (NOW_NS - 10**13, NOW_NS + 10**12),
    (0, 2**63 - 1),
    (NOW_NS, NOW_NS + 1),
)
REFUSALS: tuple[frozenset[str] | None, ...] = (None, frozenset(), frozenset({"0", "3"}), None)


def options(mode: int) -> dict[str, Any]:
    """The converter's options an input's first byte stands for."""
    return {
        "tag_allowlist": ALLOWLISTS[mode & 1],
        "max_duration_s": DURATIONS[(mode >> 1) & 3],
        "bounds": BOUNDS[(mode >> 3) & 3],
        "refuse": REFUSALS[(mode >> 5) & 3],
    }


def check(data: bytes) -> bool:
    """One input; True when the fast path handled its body (and agreed with the Python
    path). Raises AssertionError where they disagree; a parse error of a body the fast path
    handled is a disagreement too (it must decline what the Python path cannot read)."""
    if not data:
        return False
    try:
        return compare(data[1:], **options(data[0]))
    except (DecodeError, RequestError) as exc:
        raise AssertionError(f"the fast path handled a body Python cannot parse: {exc}") from exc
