"""InfluxV2Writer against a small real HTTP server implementing ``POST /api/v2/write``.

No InfluxDB 2.x can be installed here (Debian ships 1.6; no internet beyond package
registries), so this server implements the documented write contract
(https://docs.influxdata.com/influxdb/v2/api/#operation/PostWrite): ``org``, ``bucket`` and
``precision`` query parameters, ``Authorization: Token <token>``, a line-protocol body, 204 on
success, 401 for a bad token, 404 for an unknown bucket, 503/429 when overloaded.
"""

from __future__ import annotations

import http.server
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from stepwatch.core import ConfigError, InfluxError, InfluxUnavailableError
from stepwatch.core._influx import wait_until
from stepwatch.otel_bridge import Bridge, InfluxV2Writer
from tests.otel_bridge.otlp_requests import post, window_request

TOKEN = "v2-token"


class FakeInfluxV2(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _V2Handler)
        self.lines: list[str] = []
        self.requests: list[dict[str, Any]] = []
        self.fail_with: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _V2Handler(http.server.BaseHTTPRequestHandler):
    server: FakeInfluxV2

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        parsed = urllib.parse.urlparse(self.path)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.requests.append({"path": parsed.path, "query": query})
        if self.server.fail_with is not None:
            status = self.server.fail_with
        elif parsed.path != "/api/v2/write":
            status = 404
        elif self.headers.get("Authorization") != f"Token {TOKEN}":
            status = 401
        elif query.get("org") != "site" or query.get("bucket") != "stepwatch":
            status = 404
        elif query.get("precision") != "ns":
            status = 400
        else:
            self.server.lines.extend(body.decode().splitlines())
            status = 204
        if status == 204:
            self.send_response(204)
            self.end_headers()
            return
        payload = b'{"code":"invalid","message":"refused by the fake"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def fake_v2() -> Iterator[FakeInfluxV2]:
    server = FakeInfluxV2()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_v2_writer_follows_the_write_contract(fake_v2: FakeInfluxV2) -> None:
    writer = InfluxV2Writer(fake_v2.url, token=TOKEN, org="site", bucket="stepwatch")
    try:
        writer.write_lines(["m,t=a v=1 1", "m,t=b v=2 2"])
        assert fake_v2.lines == ["m,t=a v=1 1", "m,t=b v=2 2"]
        assert TOKEN not in repr(writer)
        fake_v2.fail_with = 503
        with pytest.raises(InfluxUnavailableError):
            writer.write_lines(["m v=3 3"])
        fake_v2.fail_with = 429
        with pytest.raises(InfluxUnavailableError):
            writer.write_lines(["m v=3 3"])
        fake_v2.fail_with = None
    finally:
        writer.close()
    wrong = InfluxV2Writer(fake_v2.url, token="nope", org="site", bucket="stepwatch")
    try:
        with pytest.raises(InfluxError) as caught:
            wrong.write_lines(["m v=1 1"])
        assert caught.value.status == 401
        assert not isinstance(caught.value, InfluxUnavailableError)
    finally:
        wrong.close()


def test_v2_writer_unreachable_is_retryable() -> None:
    writer = InfluxV2Writer("http://127.0.0.1:9", token=TOKEN, org="site", bucket="b")
    try:
        with pytest.raises(InfluxUnavailableError):
            writer.write_lines(["m v=1 1"])
    finally:
        writer.close()


def test_v2_writer_config_errors() -> None:
    with pytest.raises(ConfigError, match="token"):
        InfluxV2Writer("http://127.0.0.1:8086", token="", org="o", bucket="b")
    with pytest.raises(ConfigError, match="url"):
        InfluxV2Writer("localhost:8086", token="t", org="o", bucket="b")


def test_bridge_through_v2_writer(fake_v2: FakeInfluxV2) -> None:
    writer = InfluxV2Writer(fake_v2.url, token=TOKEN, org="site", bucket="stepwatch")
    with Bridge(writer, grpc_port=None, flush_interval_s=0.01) as bridge:
        body = window_request(job="v2", rank=1, world_size=2, window=0).SerializeToString()
        assert post(bridge.http_url, body, {"Content-Type": "application/x-protobuf"})[0] == 200
        assert wait_until(lambda: len(fake_v2.lines) == 3, timeout_s=10)
    writer.close()
    assert all("stepwatch.job.id=v2" in line for line in fake_v2.lines)
