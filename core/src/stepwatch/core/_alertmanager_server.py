"""A local Alertmanager that stepwatch starts on free loopback ports (tests and benches).

Debian's ``prometheus-alertmanager`` binary, run in its own data directory with its own
config and storage, clustering off, and stopped afterwards — the counterpart of
:class:`~stepwatch.core.ManagedInfluxDB`. Alerts go to a webhook when one is given, else
nowhere (a receiver with no integrations); either way they are visible in ``/api/v2/alerts``.
API: https://github.com/prometheus/alertmanager/blob/main/api/v2/openapi.yaml
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepwatch.core._errors import ConfigError, ServerStartError
from stepwatch.core._http import HttpClient, send_json
from stepwatch.core._net import free_port, wait_http_ready

# Short timings so grouping and resolution are seen within seconds. group_wait must still
# cover Alertmanager ingesting one POST's alerts on a loaded 2-core machine (at 300 ms a CI
# run once flushed the group with one of its two alerts).
_CONFIG = """\
route:
  receiver: webhook
  group_by: [alertname, training_job]
  group_wait: 1500ms
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: webhook
"""
_WEBHOOK = """\
    webhook_configs:
      - url: {webhook_url}
        send_resolved: true
"""


class ManagedAlertmanager:
    """An Alertmanager (from PATH) in its own data directory, on a free loopback port.

    Args:
        data_dir: where config, storage and log live; created if missing.
        webhook_url: where notifications are posted (none are when ``None``).
        alertmanager: the binary; ``prometheus-alertmanager`` or ``alertmanager`` from PATH
            when ``None``.
        start_timeout_s: how long :meth:`start` waits for ``/-/ready``.

    Raises:
        ConfigError: no Alertmanager binary.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        webhook_url: str | None = None,
        alertmanager: str | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        binary = (
            alertmanager or shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        )
        if binary is None:
            raise ConfigError(
                "alertmanager: not found on PATH; install Debian's prometheus-alertmanager "
                "package (scripts/setup.sh does)"
            )
        self.binary = binary
        self.data_dir = Path(data_dir).resolve()
        self.port = free_port()
        self.webhook_url = webhook_url
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "alertmanager.log"

    def start(self) -> ManagedAlertmanager:
        """Write the config, start the process and wait until it is ready.

        Raises:
            ServerStartError: it did not answer ``/-/ready`` in time (the log's tail says why).
        """
        if self._process is not None and self._process.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.data_dir / "alertmanager.yml"
        webhook = "" if self.webhook_url is None else _WEBHOOK.format(webhook_url=self.webhook_url)
        config_path.write_text(_CONFIG + webhook)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config_path}",
                    f"--storage.path={self.data_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--cluster.listen-address=",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, not alertmanager
            )
        if not wait_http_ready(f"{self.url}/-/ready", timeout_s=self.start_timeout_s):
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise ServerStartError(f"alertmanager did not get ready on {self.url}; log:\n{tail}")
        return self

    def stop(self) -> None:
        """SIGTERM and wait; SIGKILL when it does not exit within 10 s."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        for stop_signal in (signal.SIGTERM, signal.SIGKILL):
            process.send_signal(stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
                return

    def __enter__(self) -> ManagedAlertmanager:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def alerts(self, labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts`` (active, silenced and inhibited) matching ``labels`` exactly."""
        query = urllib.parse.urlencode(
            [("filter", f'{key}="{value}"') for key, value in (labels or {}).items()]
            + [("active", "true"), ("silenced", "true"), ("inhibited", "true")]
        )
        client = HttpClient()
        try:
            reply = send_json(client, "GET", f"{self.url}/api/v2/alerts?{query}", None, timeout_s=5)
        finally:
            client.close()
        result: list[dict[str, Any]] = reply.json()
        return result
