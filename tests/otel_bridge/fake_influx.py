"""A fake InfluxDB v1 ``/write`` (http.server) that misbehaves on demand: the test double for
failure modes a real influxd will not produce on cue (hanging, breaking off its reply,
refusing a whole batch for one bad line)."""

from __future__ import annotations

import http.server
import random
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class FakeInflux:
    """Stores what it accepts in ``lines``; ``mode`` says how it answers a write.

    Modes: ``ok`` (204); ``hang`` (never answers); ``flaky`` (with probability
    ``failure_rate`` one of: close without a reply, close after storing the batch, headers
    promising a body that never comes, a garbage status line); ``poison`` (a batch with a line
    containing ``poison`` is refused whole, 400 "partial write ... dropped=N", as InfluxDB
    2.x/3.x or a proxy may do).
    """

    def __init__(self, mode: str = "ok", *, failure_rate: float = 0.3, seed: int = 1) -> None:
        self.mode = mode
        self.failure_rate = failure_rate
        self.rng = random.Random(seed)
        self.lines: set[str] = set()
        self.writes = 0
        self.failures = 0
        self.release = threading.Event()
        self._lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path.startswith("/query"):
                    self._answer(200, b'{"results":[{"statement_id":0}]}')
                    return
                fake.answer_write(self, body.decode("utf-8").split("\n"))

            def _answer(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer_write(self, handler: Any, lines: list[str]) -> None:
        lines = [line for line in lines if line]
        with self._lock:
            self.writes += 1
        if self.mode == "hang":
            self.release.wait(600)
            handler.close_connection = True
            return
        if self.mode == "flaky" and self.rng.random() < self.failure_rate:
            with self._lock:
                self.failures += 1
            self._misbehave(handler, lines, self.rng.choice(("close", "stored", "short", "junk")))
            return
        if self.mode == "poison":
            bad = [line for line in lines if "poison" in line]
            if bad:
                message = f'{{"error":"partial write: field type conflict dropped={len(bad)}"}}'
                handler._answer(400, message.encode())
                return
        with self._lock:
            self.lines.update(lines)
        handler._answer(204)

    def _misbehave(self, handler: Any, lines: list[str], how: str) -> None:
        if how == "stored":  # stored, then the reply is lost: the bridge must retry
            with self._lock:
                self.lines.update(lines)
        elif how == "short":  # IncompleteRead
            handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nxx")
        elif how == "junk":  # BadStatusLine
            handler.wfile.write(b"HTTP/1.1 2\r\n\r\n")
        handler.wfile.flush()
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> FakeInflux:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def dead_port() -> Iterator[str]:
    """A URL on which nothing listens (connection refused) for as long as the block runs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
