"""stepwatch.core: what every stepwatch component shares, with no third-party package.

The errors (one tree under :class:`StepwatchError`), the diagnosis record, the InfluxDB client
and a managed local influxd, and :mod:`stepwatch.core.settings` (every environment variable).
The components are portions of the same ``stepwatch`` namespace, each a distribution of its
own: ``stepwatch.exporters``, ``stepwatch.otel_bridge``, ``stepwatch.detectors``; the
``stepwatch`` command is ``stepwatch.app``.
"""

from stepwatch.core import settings
from stepwatch.core._alertmanager_server import ManagedAlertmanager
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
from stepwatch.core._facade import publish
from stepwatch.core._influx import InfluxClient, ManagedInfluxDB, QuerySeries

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DeliveryError",
    "Diagnosis",
    "InfluxClient",
    "InfluxError",
    "InfluxUnavailableError",
    "ManagedAlertmanager",
    "ManagedInfluxDB",
    "QuerySeries",
    "ServerStartError",
    "StepwatchError",
    "TraceFormatError",
    "__version__",
    "settings",
]

publish(__name__, [globals()[name] for name in __all__])
