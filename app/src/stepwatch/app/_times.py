"""Moments as people type them on a command line, for every ``--from``/``--to``/``--start``.

One grammar for all commands: RFC 3339 (``2026-11-21T20:00:00Z``), ``now``, ``now-15m`` or
``-6h`` (a duration before now, as ``30s``, ``15m``, ``1h``, ``2d``, ``250ms``), or Unix
nanoseconds (``1795291200000000000``).
"""

from __future__ import annotations

from stepwatch.core._diagnosis import parse_time
from stepwatch.core._durations import parse_duration_s
from stepwatch.core._errors import ConfigError


def parse_moment(text: str, *, argument: str, now_unix_nano: int) -> int:
    """The moment ``text`` names, in Unix nanoseconds.

    Args:
        text: RFC 3339, ``now``, ``now-DURATION``, ``-DURATION`` or Unix nanoseconds.
        argument: the option being parsed, named in errors (``--from``).
        now_unix_nano: what ``now`` is.

    Raises:
        ConfigError: none of those forms (the message names ``argument``).
    """
    value = text.strip()
    if value == "now":
        return now_unix_nano
    for prefix in ("now-", "-"):
        if value.startswith(prefix):
            before_s = parse_duration_s(value[len(prefix) :], argument=argument)
            return now_unix_nano - round(before_s * 1e9)
    if value.isdigit():
        return int(value)
    try:
        return parse_time(value)
    except ValueError as exc:
        raise ConfigError(
            f"{argument}: {text!r} is not a time (RFC 3339, now, now-15m, -6h or Unix nanoseconds)"
        ) from exc
