"""Fixtures for the operators' view: a real Alertmanager and a webhook receiver.

Alertmanager is Debian's ``prometheus-alertmanager`` binary, started on free loopback ports
with its own config and storage directory, clustering off, and stopped afterwards.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stepwatch.core._net import free_port, wait_http_ready


class WebhookReceiver:
    """An HTTP server recording every Alertmanager webhook payload it receives."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(length))
                with receiver._changed:
                    receiver.payloads.append(payload)
                    receiver._changed.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                del format, args

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float
    ) -> dict[str, Any]:
        """The first payload matching ``predicate``, waiting up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for payload in self.payloads:
                    if predicate(payload):
                        return payload
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"no matching webhook within {timeout_s}s; got {self.payloads!r}"
                    )
                self._changed.wait(remaining)


ALERTMANAGER_CONFIG = """\
# Test config: short timings so grouping and resolution are seen within seconds. group_wait
# must still cover Alertmanager ingesting one POST's alerts on a loaded 2-core machine (at
# 300 ms a CI run once flushed the group with one of its two alerts).
route:
  receiver: webhook
  group_by: [alertname, job]
  group_wait: 1500ms
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: webhook
    webhook_configs:
      - url: {webhook_url}
        send_resolved: true
"""


class ManagedAlertmanager:
    def __init__(self, data_dir: Path, *, webhook_url: str) -> None:
        binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        if binary is None:
            raise RuntimeError("prometheus-alertmanager not installed (scripts/setup.sh)")
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = data_dir / "alertmanager.yml"
        self.config_path.write_text(ALERTMANAGER_CONFIG.format(webhook_url=webhook_url))
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedAlertmanager:
        log = (self.data_dir / "alertmanager.log").open("ab")
        try:
            self._process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config_path}",
                    f"--storage.path={self.data_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--cluster.listen-address=",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        if not wait_http_ready(f"{self.url}/-/ready", timeout_s=30):
            self.stop()
            tail = (self.data_dir / "alertmanager.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"alertmanager did not get ready; log:\n{tail}")
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def alerts(self, **label_filters: str) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts`` filtered by exact label matches."""
        import urllib.parse
        import urllib.request

        query = urllib.parse.urlencode(
            [("filter", f'{key}="{value}"') for key, value in label_filters.items()]
            + [("active", "true"), ("silenced", "true"), ("inhibited", "true")]
        )
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts?{query}", timeout=5) as reply:
            result: list[dict[str, Any]] = json.loads(reply.read())
        return result


@pytest.fixture(scope="session")
def webhook() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="session")
def alertmanager(
    tmp_path_factory: pytest.TempPathFactory, webhook: WebhookReceiver
) -> Iterator[ManagedAlertmanager]:
    server = ManagedAlertmanager(tmp_path_factory.mktemp("alertmanager"), webhook_url=webhook.url)
    server.start()
    try:
        yield server
    finally:
        server.stop()
