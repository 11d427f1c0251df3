"""How a window leaves the rank: the :class:`Exporter` Protocol and the exporter for a config.

:func:`create_exporter` turns resolved settings (:mod:`stepwatch.exporters._config`) into an
exporter; :class:`InMemoryExporter` keeps windows for tests and simulators.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._config import ExporterConfig
from stepwatch.exporters._otlp_http import OtlpHttpExporter

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData


def create_exporter(config: ExporterConfig) -> Exporter:
    """The OTLP exporter for ``config``, every setting passed explicitly.

    ``http/protobuf``: :class:`~stepwatch.exporters.OtlpHttpExporter` (the SDK's wire format on
    one kept-alive ``http.client`` connection; a fraction of the SDK HTTP exporter's CPU per
    window). ``grpc``: the SDK's gRPC exporter, which reads the TLS variables itself. The SDK's
    HTTP exporter stays usable: pass one as ``StepMonitor(exporter=...)``.

    Raises:
        ConfigError: The exporter package for the protocol is not installed.
    """
    if config.protocol == "grpc":
        try:
            import grpc
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "protocol 'grpc' needs opentelemetry-exporter-otlp-proto-grpc "
                "(pip install 'stepwatch[exporters]')"
            ) from exc
        grpc_compression = {
            "none": grpc.Compression.NoCompression,
            "gzip": grpc.Compression.Gzip,
            "deflate": grpc.Compression.Deflate,
        }[config.compression]
        exporter: MetricExporter = GrpcExporter(
            endpoint=config.endpoint,
            insecure=config.endpoint.startswith("http://"),
            headers=dict(config.headers),
            timeout=config.timeout_s,
            compression=grpc_compression,
        )
        return exporter
    return OtlpHttpExporter.from_config(config)


class Exporter(Protocol):
    """What a monitor needs from an exporter: every SDK ``MetricExporter`` satisfies it."""

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        """Send one window; return SUCCESS or FAILURE."""

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Release connections; later exports fail."""


class InMemoryExporter:
    """An :class:`Exporter` keeping every exported window in memory (tests, simulators).

    Attributes:
        exported: Every ``MetricsData`` received, in order.
    """

    def __init__(self) -> None:
        self.exported: list[MetricsData] = []
        self._lock = threading.Lock()
        self._shutdown = False

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000
    ) -> MetricExportResult:
        """Keep ``metrics_data``; FAILURE after :meth:`shutdown`."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        with self._lock:
            if self._shutdown:
                return MetricExportResult.FAILURE
            self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Refuse later exports (what is kept stays readable)."""
        with self._lock:
            self._shutdown = True
