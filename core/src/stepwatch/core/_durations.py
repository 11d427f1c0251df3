"""Durations as people type them on a command line: ``30s``, ``15m``, ``1h``, ``250ms``."""

from __future__ import annotations

import re

from stepwatch.core._errors import ConfigError

_DURATION_RE = re.compile(r"^(?P<value>\d+(?:\.\d+)?)(?P<unit>ms|s|m|h|d)?$")
_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str, *, argument: str) -> float:
    """Seconds in ``30s``, ``15m``, ``1h``, ``2d``, ``250ms`` or a plain number of seconds.

    Raises:
        ConfigError: not a positive duration (the message names ``argument``).
    """
    match = _DURATION_RE.match(text.strip().lower())
    if match is None:
        raise ConfigError(f"{argument}: {text!r} is not a duration like 30s, 15m or 1h")
    seconds = float(match["value"]) * _UNITS_S[match["unit"] or "s"]
    if seconds <= 0:
        raise ConfigError(f"{argument}: must be positive, got {text!r}")
    return seconds
