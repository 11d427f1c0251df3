"""The transport part of a monitor: where its windows go, and how long one export may take.

:func:`resolve_transport` builds the OTLP exporter from the settings (``endpoint``,
``protocol``, ``headers``, ``compression``, ``timeout_s``: argument >
``OTEL_EXPORTER_OTLP_METRICS_*`` > ``OTEL_EXPORTER_OTLP_*``, ``_config``), or takes the
exporter a caller passes (any SDK ``MetricExporter``). :class:`Transport` sends a window and,
after repeated failures, replaces an exporter it built by a fresh one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from stepwatch.core._errors import ConfigError
from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters._config import DEFAULT_TIMEOUT_S, ExporterConfig, resolve_exporter_config
from stepwatch.exporters._export import Exporter, create_exporter

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData

RECONNECT_AFTER_FAILURES: Final = 2


class Transport:
    """The monitor's exporter, the bound on one export, and its failures in a row.

    Args:
        exporter: Where windows go.
        config: The settings ``exporter`` was built from; None for a caller's exporter,
            which is never replaced.
        timeout_s: Bound on one export, retries included.
    """

    def __init__(self, exporter: Exporter, config: ExporterConfig | None, timeout_s: float):
        self.exporter = exporter
        self.config = config
        self.timeout_s = timeout_s
        self.failures = 0  # exports failed in a row

    def send(self, metrics: MetricsData, timeout_s: float, log: RateLimitedLog) -> bool:
        """Export one window within ``timeout_s``; True when the exporter took it. Never raises."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            result = self.exporter.export(metrics, timeout_millis=timeout_s * 1000.0)
        except Exception:
            result = MetricExportResult.FAILURE
            log.warning("export-raise", "the metric exporter raised", exc_info=True)
        if result is MetricExportResult.SUCCESS:
            self.failures = 0
            return True
        self.failures += 1
        return False

    @property
    def reconnect_due(self) -> bool:
        """Whether the failures in a row ask for a fresh exporter (every second one)."""
        return self.failures > 0 and self.failures % RECONNECT_AFTER_FAILURES == 0

    def reconnect(self, log: RateLimitedLog) -> None:
        """Replace an exporter built from settings by a fresh one (new connections).

        A kept-alive connection can outlive the receiver it was opened to (a restarted
        bridge, a load balancer that moved the backend) and fail every retry; a new exporter
        opens new connections. Injected exporters are left alone.
        """
        if self.config is None:
            return
        try:
            self.exporter.shutdown(timeout_millis=100.0)
        except Exception:
            log.warning("reconnect", "shutting down the old exporter failed", exc_info=True)
        try:
            self.exporter = create_exporter(self.config)
        except Exception:
            log.warning("reconnect", "re-creating the exporter failed", exc_info=True)


def resolve_transport(
    exporter: Exporter | None,
    *,
    endpoint: str | None,
    protocol: str | None,
    headers: Mapping[str, str] | None,
    compression: str | None,
    timeout_s: float | None,
) -> Transport:
    """The transport part: ``exporter`` when given (``timeout_s`` still bounds each export),
    else the OTLP exporter the settings resolve to.

    Raises:
        ConfigError: A setting is invalid or a TLS file is missing (the message names it).
    """
    if exporter is not None:
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        return Transport(exporter, None, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    config = resolve_exporter_config(
        endpoint=endpoint,
        protocol=protocol,
        headers=headers,
        compression=compression,
        timeout_s=timeout_s,
    )
    return Transport(create_exporter(config), config, config.timeout_s)
