"""stepwatch: always-on performance diagnosis for large distributed training.

The core imports with no third-party package. Components live in subpackages, each behind
its own extra: ``stepwatch.exporters`` (``[exporters]``), ``stepwatch.otel_bridge``
(``[bridge]``), ``stepwatch.detectors`` (``[detectors]``).
"""

from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._errors import (
    ConfigError,
    DeliveryError,
    InfluxError,
    InfluxUnavailableError,
    ServerStartError,
    StepwatchError,
    TraceFormatError,
)
from stepwatch.core._influx import InfluxClient, ManagedInfluxDB, QuerySeries

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DeliveryError",
    "Diagnosis",
    "InfluxClient",
    "InfluxError",
    "InfluxUnavailableError",
    "ManagedInfluxDB",
    "QuerySeries",
    "ServerStartError",
    "StepwatchError",
    "TraceFormatError",
    "__version__",
]
