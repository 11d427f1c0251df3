"""The one exception tree of stepwatch.

Every error stepwatch raises on purpose derives from :class:`StepwatchError`; third-party
errors are translated at the boundary with ``raise ... from exc`` so callers catch one root.
"""

from __future__ import annotations


class StepwatchError(Exception):
    """Root of every error stepwatch raises on purpose."""


class ConfigError(StepwatchError, ValueError):
    """A configuration value is wrong; the message names the argument or variable."""


class InfluxError(StepwatchError):
    """InfluxDB refused a request or could not be reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class InfluxUnavailableError(InfluxError):
    """InfluxDB could not take the request now: worth retrying later.

    Unreachable (connection refused, timeout), a reply broken off, or an answer that says
    "later" (408, 429, 5xx: ``stepwatch.core._http.retryable``).
    """


class TraceFormatError(StepwatchError):
    """A trace file is truncated or malformed; the message names the file and position."""


class ServerStartError(StepwatchError):
    """A managed server (influxd, alertmanager, the bridge) failed to start."""


class DeliveryError(StepwatchError):
    """A sink could not deliver to its server (unreachable or a non-2xx answer).

    The sink keeps no record of what failed, so the next ``publish`` retries it.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
