"""Fixtures for the operators' view: a real Alertmanager and a webhook receiver.

Alertmanager is Debian's ``prometheus-alertmanager`` binary (core's
:class:`~stepwatch.core.ManagedAlertmanager`), started on free loopback
ports with its own config and storage directory, clustering off, and stopped afterwards; its
notifications go to the :class:`WebhookReceiver` here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from stepwatch.core import ManagedAlertmanager


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
