"""One trace event's fields, checked, and the small records step splitting keeps of it.

Trace files are input from anywhere: a field step splitting needs may be missing, of the wrong
JSON type, NaN, infinite, negative or beyond the int64 nanosecond range that times have
downstream (OTLP's ``fixed64 time_unix_nano``, InfluxDB). Each check raises :class:`BadEvent`
with a message naming the field; the caller skips and counts that event.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

from stepwatch.exporters.kernels._json_stream import json_type

MAX_NS = 2**63 - 1
"""Largest time or duration, in nanoseconds (int64)."""
_MAX_US = MAX_NS // 1000


def optional_int(value: object) -> int | None:
    """``value`` when it is an integer or a string of ASCII digits, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        # ASCII digits only (str.isdigit() also passes '²', which int() refuses), and few
        # enough of them for int() (Python refuses strings of more than 4300 digits).
        if text.isascii() and text.isdigit() and len(text) <= 20:
            return int(text)
    return None


class BadEvent(Exception):
    """Why one trace event is skipped (the message names the field)."""


def time_ns(event: Mapping[str, Any], key: str, *, default: int | None = None) -> int:
    """``event[key]`` (microseconds; ``default`` when absent) as int64 nanoseconds."""
    value = event.get(key, default)
    # Integer µs stay exact (epoch-µs timestamps exceed float64's integer range once in ns).
    if type(value) is int and -_MAX_US <= value <= _MAX_US:
        return value * 1000
    if type(value) is float and -_MAX_US <= value <= _MAX_US:  # NaN compares False
        return round(value * 1000)
    if key not in event:
        raise BadEvent(f"no '{key}'")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadEvent(f"'{key}' is {json_type(value)}, not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadEvent(f"'{key}' is {value!r}")
    text = repr(value)  # a float's is short; an int's may have 4300 digits
    shown = text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"
    raise BadEvent(f"'{key}' is {shown}, outside the int64 nanosecond range")


def hashable_field(event: Mapping[str, Any], key: str) -> Hashable:
    """``event[key]`` when it can be compared and hashed (an id, pid or tid)."""
    value = event.get(key)
    try:
        hash(value)
    except TypeError:
        raise not_scalar(key, value) from None
    return value


def not_scalar(key: str, value: object) -> BadEvent:
    """The error for an id, pid or tid that is an array or an object."""
    return BadEvent(f"'{key}' is {json_type(value)}, not a number or a string")


class Span(NamedTuple):
    """A complete (``ph: X``) event: name, start, end (ns on the trace clock), pid, tid."""

    name: str
    start: int
    end: int
    pid: Hashable
    tid: Hashable


class Kernel(NamedTuple):
    """A device event with the ids that tie it to its launch."""

    span: Span
    correlation: int | None
    device: int


class Marker(NamedTuple):
    """A phase annotation (``## forward ##`` ...)."""

    start: int
    end: int
    pid: Hashable
    tid: Hashable
    phase: str
