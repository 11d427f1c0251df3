"""A logger wrapper that says one thing at most every so often: for failures that repeat.

An exporter whose receiver is down fails every window; a line per failure would flood the
training job's log. :class:`RateLimitedLog` lets one line per key through every
``interval_s`` and says how many it held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """One log line per key at most every ``interval_s``, counting what it suppressed.

    Thread-safe: the training thread, the export thread and ``close()`` may share one.

    Args:
        logger: Where the lines go.
        interval_s: Least time between two lines of the same key.
        clock_s: Monotonic clock in seconds.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        *,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock_s = clock_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(
        self, level: int, key: str, message: str, *args: object, exc_info: bool = False
    ) -> None:
        """Log ``message % args`` at ``level`` unless ``key`` was logged within the interval."""
        now = self._clock_s()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            suppressed = self._suppressed.pop(key, 0)
            self._last[key] = now
        suffix = f" ({suppressed} similar messages suppressed)" if suppressed else ""
        self._logger.log(level, message + suffix, *args, exc_info=exc_info)

    def warning(self, key: str, message: str, *args: object, exc_info: bool = False) -> None:
        """:meth:`log` at WARNING."""
        self.log(logging.WARNING, key, message, *args, exc_info=exc_info)
