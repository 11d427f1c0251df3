"""The managed local stack behind ``stepwatch up`` and ``stepwatch demo``.

An influxd that stepwatch starts itself (or an existing InfluxDB), the OTLP bridge and the
detector service, all in one process tree on loopback, stopped together.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepwatch.core import settings
from stepwatch.core._errors import ConfigError
from stepwatch.core._influx import InfluxClient, ManagedInfluxDB
from stepwatch.core._schema import DEFAULT_DATABASE


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``settings.DATA_DIR``, else ``$XDG_DATA_HOME/stepwatch``, else ~/.local/share/stepwatch."""
    env = os.environ if environ is None else environ
    explicit = settings.DATA_DIR.resolve(None, env)
    if explicit:
        return Path(explicit)
    base = settings.XDG_DATA_HOME.resolve(None, env) or str(Path.home() / ".local" / "share")
    return Path(base) / "stepwatch"


class LocalStack:
    """InfluxDB (managed or given) + bridge (+ detector service), started and stopped together.

    Args:
        data_dir: home of the managed influxd and the bridge's spool.
        influx_url: an existing InfluxDB (v1 API); when given no influxd is started.
        database: the database (or DBRP-mapped bucket) to write and read.
        host: where the bridge listens (loopback unless told otherwise).
        grpc_port: OTLP/gRPC port; 0 picks a free one.
        http_port: OTLP/HTTP port (also serves /metrics); 0 picks a free one.
        detect_every_s: run the detector service at this period; ``None`` disables it.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        influx_url: str | None = None,
        database: str = DEFAULT_DATABASE,
        influx_token: str | None = None,
        host: str = "127.0.0.1",
        grpc_port: int = 0,
        http_port: int = 0,
        detect_every_s: float | None = None,
        sinks: list[Any] | None = None,
    ) -> None:
        if detect_every_s is not None and detect_every_s <= 0:
            raise ConfigError(f"detect_every_s: must be positive, got {detect_every_s}")
        self.data_dir = Path(data_dir)
        self.influx_url = influx_url
        self.database = database
        self.influx_token = influx_token
        self.host = host
        self.grpc_port = grpc_port
        self.http_port = http_port
        self.detect_every_s = detect_every_s
        self.sinks = list(sinks or [])
        self.influxd: ManagedInfluxDB | None = None
        self.client: InfluxClient | None = None
        self.bridge: Any = None
        self.detector_service: Any = None

    @property
    def otlp_http_endpoint(self) -> str:
        return f"http://{self.host}:{self.bridge.http_port}"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://{self.host}:{self.bridge.grpc_port}"

    def start(self) -> LocalStack:
        from stepwatch.otel_bridge import Bridge, InfluxV1Writer

        try:
            if self.influx_url is None:
                self.influxd = ManagedInfluxDB(
                    self.data_dir / "influxdb", database=self.database
                ).start()
                self.client = self.influxd.client()
            else:
                self.client = InfluxClient(
                    self.influx_url, database=self.database, token=self.influx_token
                )
                self.client.create_database()
            writer = InfluxV1Writer(self.client, spool_dir=self.data_dir / "spool")
            self.bridge = Bridge(
                writer, host=self.host, grpc_port=self.grpc_port, http_port=self.http_port
            )
            self.bridge.start()
            if self.detect_every_s is not None:
                self._start_detectors()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_detectors(self) -> None:
        from stepwatch.detectors import DetectorService
        from stepwatch.detectors.sinks import sinks_from_environment

        if self.client is None:
            return
        # Findings always go to InfluxDB (the service's own sink); Alertmanager and Grafana
        # join when ALERTMANAGER_URL / GRAFANA_URL + GRAFANA_TOKEN are set.
        sinks = [*self.sinks, *sinks_from_environment(os.environ, state_client=self.client)]
        self.detector_service = DetectorService(
            self.client, sinks=sinks, interval_s=self.detect_every_s
        )
        self.detector_service.start()

    def stop(self) -> None:
        """Stop in reverse order; the bridge flushes what it holds before InfluxDB stops."""
        if self.detector_service is not None:
            self.detector_service.stop()
            self.detector_service = None
        if self.bridge is not None:
            self.bridge.stop()
            self.bridge = None
        if self.influxd is not None:
            self.influxd.stop()
            self.influxd = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
