"""OtlpHttpExporter against the real bridge and against small HTTP servers the tests control."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import email.utils
import gzip
import http.server
import random
import selectors
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.core import ConfigError, __version__
from stepwatch.exporters import (
    KernelWindow,
    OtlpHttpExporter,
    WindowBuilder,
    _otlp_http,
    build_resource,
    create_exporter,
    resolve_exporter_config,
)
from stepwatch.exporters._http_connection import resolve_proxy, retry_after_s
from stepwatch.exporters._otlp_protobuf import RequestEncoder

pytest.importorskip("opentelemetry.exporter.otlp.proto.common")
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import (
    encode_metrics,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

PHASES = ("data", "forward", "backward", "optimizer", "communication")


def _window(seed: int = 0) -> MetricsData:
    """A realistic window: 46 steps x 5 phases and 20 kernel classes."""
    rng = random.Random(seed)
    builder = WindowBuilder(build_resource(job_id="otlp-http", rank=3, world_size=8))
    for step in range(46):
        builder.add_step(
            step_index=step,
            duration_s=0.026 * rng.uniform(0.9, 1.1),
            phases_s={phase: rng.uniform(0.001, 0.01) for phase in PHASES},
        )
    builder.add_kernels(
        KernelWindow(
            {
                (f"aten::op{k}", "compute"): [rng.uniform(1e-6, 1e-4) for _ in range(30)]
                for k in range(20)
            }
        )
    )
    now = time.time_ns()
    metrics = builder.build(start_unix_nano=now - 1_000_000_000, end_unix_nano=now)
    assert metrics is not None
    return metrics


WINDOW = _window()


_OPEN_EXPORTERS: list[OtlpHttpExporter] = []


def _exporter(endpoint: str, **options: Any) -> OtlpHttpExporter:
    """An exporter with fast, seeded backoff; shut down after the test."""
    defaults: dict[str, Any] = {
        "timeout_s": 5.0,
        "initial_backoff_s": 0.01,
        "max_backoff_s": 0.05,
        "environ": {},
        "rng": random.Random(7),
    }
    exporter = OtlpHttpExporter(endpoint, **(defaults | options))
    _OPEN_EXPORTERS.append(exporter)
    return exporter


@pytest.fixture(autouse=True)
def _shut_exporters_down() -> Iterator[None]:
    _otlp_http._LOGS.clear()  # rate limits are per endpoint; ports get reused across tests
    yield
    while _OPEN_EXPORTERS:
        _OPEN_EXPORTERS.pop().shutdown()


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.01)


# ---------------------------------------------------------------------- a scripted server


@dataclasses.dataclass(frozen=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytes = b""
    delay_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Received:
    request_line: str
    headers: dict[str, str]
    body: bytes
    client_port: int


class ScriptedServer:
    """An HTTP/1.1 keep-alive server answering from a script (then 200), recording requests."""

    def __init__(self, *, port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.replies: collections.deque[Reply] = collections.deque()
        self.received: list[Received] = []
        self.release = threading.Event()  # ends every delayed reply early (teardown)
        self._connections: set[socket.socket] = set()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                server.received.append(
                    Received(
                        self.requestline,
                        {k.lower(): v for k, v in self.headers.items()},
                        body,
                        self.client_address[1],
                    )
                )
                reply = server.replies.popleft() if server.replies else Reply()
                if reply.delay_s:
                    server.release.wait(reply.delay_s)
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply.body)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request: Any, client_address: Any) -> None:
                server._connections.add(request)
                super().process_request(request, client_address)

            def handle_error(self, request: Any, client_address: Any) -> None:
                return None

        self.server = Server(("127.0.0.1", port), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/metrics"

    def stop(self) -> None:
        """Stop accepting and close every kept-alive connection (as a restart would)."""
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self._connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.stop()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level("INFO", logger="stepwatch.exporters")
    return caplog


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


# ---------------------------------------------------------------------- the real bridge


class ListWriter:
    """A bridge LineWriter keeping every line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def write_lines(self, lines: Any) -> None:
        with self._lock:
            self.lines.extend(str(line) for line in lines)

    def close(self) -> None:
        return None


bridge_module = pytest.importorskip("stepwatch.otel_bridge")


def _bridge(writer: ListWriter, **options: Any) -> Any:
    settings: dict[str, Any] = {"grpc_port": None, "http_port": 0, "flush_interval_s": 0.02}
    return bridge_module.Bridge(writer, **(settings | options)).start()


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_windows_reach_the_bridge_and_convert(compression: str) -> None:
    writer = ListWriter()
    bridge = _bridge(writer)
    try:
        exporter = create_exporter(
            resolve_exporter_config(endpoint=bridge.http_url, compression=compression, environ={})
        )
        assert isinstance(exporter, OtlpHttpExporter)
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
        assert exporter.export(_window(1)) is MetricExportResult.SUCCESS
        _wait_for(lambda: any("stepwatch.kernel.duration" in line for line in writer.lines))
        measurements = {line.split(",", 1)[0] for line in writer.lines}
        assert {
            "stepwatch.step.duration",
            "stepwatch.phase.duration",
            "stepwatch.kernel.duration",
        } <= measurements
        stats = exporter.stats
        assert (stats.requests, stats.retries, stats.failures, stats.reconnects) == (2, 0, 0, 0)
        exporter.shutdown()
    finally:
        bridge.stop()


def test_a_restarted_bridge_costs_no_window() -> None:
    writer = ListWriter()
    bridge = _bridge(writer)
    port = bridge.http_port
    exporter = _exporter(bridge.http_url)
    try:
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
        bridge.stop()  # closes the kept-alive connection
        bridge = _bridge(writer, http_port=port)
        assert exporter.export(_window(2)) is MetricExportResult.SUCCESS
        stats = exporter.stats
        assert stats.reconnects == 1
        assert stats.retries == 0  # resent at once, no backoff
        assert stats.failures == 0
    finally:
        exporter.shutdown()
        bridge.stop()


# ---------------------------------------------------------------------- wire format


@pytest.mark.parametrize(
    ("compression", "decode"),
    [
        ("none", lambda body: body),
        ("gzip", gzip.decompress),  # one valid gzip member
        ("deflate", zlib.decompress),  # a zlib stream, as the SDK sends it
    ],
)
def test_body_is_the_sdk_encoding_and_headers_are_set(
    server: ScriptedServer, compression: str, decode: Any
) -> None:
    exporter = _exporter(server.url, compression=compression, headers={"x-tenant": "a b"})
    assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    (received,) = server.received
    assert received.request_line == "POST /v1/metrics HTTP/1.1"
    assert decode(received.body) == encode_metrics(WINDOW).SerializeToString()
    assert received.headers["content-type"] == "application/x-protobuf"
    assert received.headers.get("content-encoding", "none") == compression
    assert received.headers["x-tenant"] == "a b"
    assert received.headers["user-agent"].startswith(f"stepwatch/{__version__} ")
    assert int(received.headers["content-length"]) == len(received.body)


def test_the_connection_is_kept_alive(server: ScriptedServer) -> None:
    exporter = _exporter(server.url)
    for _ in range(3):
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    assert len({r.client_port for r in server.received}) == 1


@pytest.mark.parametrize("level", [1, 6, 9])
def test_gzip_levels_round_trip(server: ScriptedServer, level: int) -> None:
    exporter = _exporter(server.url, compression="gzip", gzip_level=level)
    body = exporter.encode(WINDOW)
    assert gzip.decompress(body) == encode_metrics(WINDOW).SerializeToString()


# ---------------------------------------------------------------------- OTLP/HTTP answers


def test_503_then_200_is_retried(server: ScriptedServer) -> None:
    server.replies.append(Reply(503))
    exporter = _exporter(server.url)
    assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    assert len(server.received) == 2
    assert server.received[0].body == server.received[1].body
    assert exporter.stats.retries == 1


def test_429_honours_retry_after(server: ScriptedServer) -> None:
    server.replies.append(Reply(429, headers={"Retry-After": "0.3"}))
    exporter = _exporter(server.url)
    started = time.monotonic()
    assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    assert time.monotonic() - started >= 0.3
    assert len(server.received) == 2


def test_retry_after_past_the_deadline_fails_at_once(
    server: ScriptedServer, logs: pytest.LogCaptureFixture
) -> None:
    server.replies.append(Reply(503, headers={"Retry-After": "30"}))
    exporter = _exporter(server.url, timeout_s=2.0)
    started = time.monotonic()
    assert exporter.export(WINDOW) is MetricExportResult.FAILURE
    assert time.monotonic() - started < 1.0
    assert len(server.received) == 1
    assert any("HTTP 503" in m and "deadline" in m for m in _warnings(logs))


def test_retry_after_forms() -> None:
    assert retry_after_s("2") == 2.0
    assert retry_after_s(" 0 ") == 0.0
    assert retry_after_s("-3") == 0.0
    assert retry_after_s("soon") is None
    assert retry_after_s(None) is None
    date = email.utils.formatdate(1_000_010.0, usegmt=True)
    assert retry_after_s(date, now_unix_s=1_000_000.0) == 10.0
    assert retry_after_s(date, now_unix_s=2_000_000.0) == 0.0


def test_400_fails_at_once_and_logs_status_and_message(
    server: ScriptedServer, logs: pytest.LogCaptureFixture
) -> None:
    from google.rpc import status_pb2  # type: ignore[import-untyped]

    status = status_pb2.Status(code=3, message="metric name too long")
    server.replies.append(Reply(400, body=status.SerializeToString()))
    exporter = _exporter(server.url)
    assert exporter.export(WINDOW) is MetricExportResult.FAILURE
    assert len(server.received) == 1
    assert exporter.stats.retries == 0
    (message,) = _warnings(logs)
    assert "HTTP 400" in message
    assert "metric name too long" in message


def test_partial_success_is_logged_once_per_message(
    server: ScriptedServer, logs: pytest.LogCaptureFixture
) -> None:
    answer = ExportMetricsServiceResponse()
    answer.partial_success.rejected_data_points = 3
    answer.partial_success.error_message = "3 points outside the clock-skew window"
    body = answer.SerializeToString()
    server.replies.extend([Reply(body=body), Reply(body=body)])
    exporter = _exporter(server.url)
    assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    assert len(server.received) == 2  # partial success is never retried
    assert exporter.stats.rejected_data_points == 6
    (message,) = _warnings(logs)
    assert "rejected 3 data points" in message
    assert "clock-skew" in message


# ---------------------------------------------------------------------- connections


def test_a_restarted_server_costs_no_window(server: ScriptedServer) -> None:
    exporter = _exporter(server.url)
    assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    server.stop()
    restarted = ScriptedServer(port=server.port)
    try:
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
        assert len(restarted.received) == 1
        assert exporter.stats.reconnects == 1
    finally:
        restarted.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_connection_refused_fails_within_the_deadline(logs: pytest.LogCaptureFixture) -> None:
    exporter = _exporter(f"http://127.0.0.1:{_free_port()}/v1/metrics", timeout_s=0.5)
    started = time.monotonic()
    assert exporter.export(WINDOW) is MetricExportResult.FAILURE
    elapsed = time.monotonic() - started
    assert elapsed <= 0.5 + 0.2
    assert exporter.stats.retries >= 1  # connection errors are retried with backoff
    assert any("ConnectionRefusedError" in m for m in _warnings(logs))


def test_a_slow_server_cannot_hold_the_export_past_its_deadline(server: ScriptedServer) -> None:
    server.replies.append(Reply(delay_s=10.0))
    exporter = _exporter(server.url, timeout_s=10.0)
    started = time.monotonic()
    assert exporter.export(WINDOW, timeout_millis=300) is MetricExportResult.FAILURE
    assert time.monotonic() - started < 0.3 + 0.3


def test_shutdown_interrupts_an_export_and_later_exports_do_no_io(
    server: ScriptedServer,
) -> None:
    server.replies.append(Reply(delay_s=10.0))
    exporter = _exporter(server.url, timeout_s=10.0)
    results: list[MetricExportResult] = []
    worker = threading.Thread(target=lambda: results.append(exporter.export(WINDOW)))
    worker.start()
    _wait_for(lambda: len(server.received) == 1)
    started = time.monotonic()
    exporter.shutdown(timeout_millis=2_000)
    worker.join(timeout=5.0)
    assert time.monotonic() - started < 1.0
    assert results == [MetricExportResult.FAILURE]
    assert exporter.export(WINDOW) is MetricExportResult.FAILURE
    assert len(server.received) == 1
    exporter.shutdown()  # twice is fine


# ---------------------------------------------------------------------- proxies


def test_http_through_a_proxy_sends_the_absolute_uri(server: ScriptedServer) -> None:
    environ = {"HTTP_PROXY": f"http://user:secret@127.0.0.1:{server.port}"}
    exporter = _exporter("http://collector.invalid:4318/v1/metrics", environ=environ)
    assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
    (received,) = server.received
    assert received.request_line == "POST http://collector.invalid:4318/v1/metrics HTTP/1.1"
    assert received.headers["host"] == "collector.invalid:4318"
    assert received.headers["proxy-authorization"] == "Basic dXNlcjpzZWNyZXQ="


def test_proxy_resolution_follows_the_environment_rules() -> None:
    url = "http://bridge.example:4318/v1/metrics"
    assert resolve_proxy(url, environ={}) is None
    assert resolve_proxy(url, environ={"http_proxy": "http://p:3128"}) == "http://p:3128"
    assert resolve_proxy(url, environ={"ALL_PROXY": "http://a:1"}) == "http://a:1"
    both = {"HTTP_PROXY": "http://upper:1", "http_proxy": "http://lower:1"}
    assert resolve_proxy(url, environ=both) == "http://lower:1"
    assert resolve_proxy(url, environ={"https_proxy": "http://p:3128"}) is None
    bypass = {"http_proxy": "http://p:3128", "no_proxy": "localhost,.example"}
    assert resolve_proxy(url, environ=bypass) is None
    assert resolve_proxy(url, environ={"http_proxy": "http://p:1", "NO_PROXY": "*"}) is None
    with pytest.raises(ConfigError, match="only http:// proxies"):
        _exporter(url, environ={"http_proxy": "socks5://p:1080"})


# ---------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 (openssl CLI)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
                *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
                *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make a self-signed certificate: no usable openssl CLI ({exc})")
    return cert, key


def test_https_to_the_bridge_with_a_self_signed_certificate(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    writer = ListWriter()
    bridge = _bridge(writer, tls_cert_file=cert, tls_key_file=key)
    try:
        url = f"https://localhost:{bridge.http_port}"
        config = resolve_exporter_config(
            endpoint=url, environ={"OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert)}
        )
        assert config.certificate_file == str(cert)
        exporter = create_exporter(config)
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
        exporter.shutdown()
        _wait_for(lambda: len(writer.lines) > 0)
        # Without the CA the certificate is refused (never sent in the clear).
        untrusting = _exporter(config.endpoint, timeout_s=0.3)
        assert untrusting.export(WINDOW) is MetricExportResult.FAILURE
    finally:
        bridge.stop()


def test_mutual_tls_sends_the_client_certificate(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cert)
    tls_server = ScriptedServer(tls=context)
    try:
        url = f"https://127.0.0.1:{tls_server.port}/v1/metrics"
        exporter = _exporter(
            url,
            certificate_file=str(cert),
            client_certificate_file=str(cert),
            client_key_file=str(key),
        )
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
        anonymous = _exporter(url, certificate_file=str(cert), timeout_s=0.3)
        assert anonymous.export(WINDOW) is MetricExportResult.FAILURE
        assert len(tls_server.received) == 1
    finally:
        tls_server.stop()


class ConnectProxy:
    """A CONNECT-only forward proxy: records each request line, then pipes bytes both ways."""

    def __init__(self) -> None:
        self.request_lines: list[str] = []
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = self.request.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                request_line = head.split(b"\r\n", 1)[0].decode()
                proxy.request_lines.append(request_line)
                method, target, _ = request_line.split(" ")
                if method != "CONNECT":
                    self.request.sendall(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                    return
                host, port = target.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=5) as upstream:
                    self.request.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    _pipe(self.request, upstream)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pipe(client: socket.socket, upstream: socket.socket) -> None:
    with selectors.DefaultSelector() as selector:
        selector.register(client, selectors.EVENT_READ, upstream)
        selector.register(upstream, selectors.EVENT_READ, client)
        while True:
            ready = selector.select(timeout=5.0)
            if not ready:
                return
            for key, _ in ready:
                try:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
                except OSError:
                    return


def test_https_through_a_proxy_tunnels_with_connect(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    tls_server = ScriptedServer(tls=context)
    proxy = ConnectProxy()
    try:
        environ = {"HTTPS_PROXY": f"127.0.0.1:{proxy.port}", "NO_PROXY": "example.com"}
        url = f"https://localhost:{tls_server.port}/v1/metrics"
        exporter = _exporter(url, certificate_file=str(cert), environ=environ)
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS
        assert exporter.export(WINDOW) is MetricExportResult.SUCCESS  # same tunnel, kept alive
        # http.client's tunnel speaks HTTP/1.0 to the proxy on 3.11, HTTP/1.1 from 3.12
        connect = f"CONNECT localhost:{tls_server.port} HTTP/1."
        assert proxy.request_lines in ([connect + "0"], [connect + "1"]), proxy.request_lines
        (first, second) = tls_server.received
        assert first.request_line == second.request_line == "POST /v1/metrics HTTP/1.1"
        assert first.client_port == second.client_port
    finally:
        for exporter in _OPEN_EXPORTERS:
            exporter.shutdown()
        proxy.stop()
        tls_server.stop()


def test_tls_files_follow_the_precedence_and_must_exist(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    environ = {
        "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/generic.pem",
        "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE": str(cert),
        "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(key),
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE": str(cert),
    }
    config = resolve_exporter_config(environ=environ)
    assert config.certificate_file == str(cert)  # the metrics variable wins
    assert config.client_key_file == str(key)
    assert config.client_certificate_file == str(cert)
    assert resolve_exporter_config(certificate_file=str(key), environ=environ).certificate_file
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_CLIENT_KEY"):
        resolve_exporter_config(environ={"OTEL_EXPORTER_OTLP_CLIENT_KEY": "/nonexistent.pem"})
    with pytest.raises(ConfigError, match="certificate_file"):
        resolve_exporter_config(certificate_file="/nonexistent.pem", environ={})


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"compression": "br"}, "compression"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"gzip_level": 0}, "gzip_level"),
        ({"initial_backoff_s": 1.0, "max_backoff_s": 0.5}, "initial_backoff_s"),
    ],
)
def test_bad_options_raise_config_error_naming_them(options: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        _exporter("http://127.0.0.1:4318/v1/metrics", **options)
    with pytest.raises(ConfigError, match="endpoint"):
        _exporter("ftp://127.0.0.1/v1/metrics")


def test_repr_hides_headers() -> None:
    exporter = _exporter("http://127.0.0.1:4318/v1/metrics", headers={"authorization": "x"})
    assert "authorization" not in repr(exporter)


# ---------------------------------------------------------------------- direct encoding


_uint64 = st.integers(0, 2**64 - 1)
_int64 = st.integers(-(2**63), 2**63 - 1)
_text = st.text(max_size=12)
_attribute_value = st.one_of(_text, st.booleans(), _int64, st.floats(allow_nan=False))
_attributes_strategy = st.dictionaries(_text, _attribute_value, max_size=4)
_string_attributes = st.dictionaries(
    st.sampled_from(["stepwatch.phase", "stepwatch.kernel.class", "k"]), _text, max_size=2
)


@st.composite
def _metrics_data(draw: st.DrawFn) -> MetricsData:
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Buckets,  # type: ignore[attr-defined]
        ExponentialHistogram,
        ExponentialHistogramDataPoint,
        Gauge,
        Histogram,
        HistogramDataPoint,
        Metric,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    temporality = st.sampled_from(list(AggregationTemporality))
    point_attributes = st.one_of(_string_attributes, _attributes_strategy)
    buckets = st.builds(
        Buckets,
        offset=st.integers(-(2**31), 2**31 - 1),
        bucket_counts=st.lists(st.one_of(st.integers(0, 200), _uint64), max_size=8),
    )
    exponential_point = st.builds(
        ExponentialHistogramDataPoint,
        attributes=point_attributes,
        start_time_unix_nano=_uint64,
        time_unix_nano=_uint64,
        count=_uint64,
        sum=st.one_of(st.none(), st.floats()),
        scale=st.integers(-10, 20),
        zero_count=_uint64,
        positive=buckets,
        negative=buckets,
        flags=st.integers(0, 1),
        min=st.one_of(st.none(), st.floats()),
        max=st.one_of(st.none(), st.floats()),
        exemplars=st.just([]),
    )
    explicit_point = st.builds(
        HistogramDataPoint,
        attributes=point_attributes,
        start_time_unix_nano=_uint64,
        time_unix_nano=_uint64,
        count=_uint64,
        sum=st.one_of(st.none(), st.floats()),
        bucket_counts=st.lists(st.one_of(st.integers(0, 200), _uint64), max_size=8),
        explicit_bounds=st.lists(st.floats(), max_size=8),
        min=st.one_of(st.none(), st.floats()),
        max=st.one_of(st.none(), st.floats()),
        exemplars=st.just([]),
    )
    number_point = st.builds(
        NumberDataPoint,
        attributes=point_attributes,
        start_time_unix_nano=_uint64,
        time_unix_nano=_uint64,
        value=st.one_of(_int64, st.floats()),
        exemplars=st.just([]),
    )
    data = st.one_of(
        st.builds(
            ExponentialHistogram,
            data_points=st.lists(exponential_point, max_size=3),
            aggregation_temporality=temporality,
        ),
        st.builds(
            Histogram,
            data_points=st.lists(explicit_point, max_size=3),
            aggregation_temporality=temporality,
        ),
        st.builds(
            Sum,
            data_points=st.lists(number_point, max_size=3),
            aggregation_temporality=temporality,
            is_monotonic=st.booleans(),
        ),
        st.builds(Gauge, data_points=st.lists(number_point, max_size=3)),
    )
    metric = st.builds(
        Metric, name=_text, description=st.one_of(st.none(), _text), unit=_text, data=data
    )
    scope = st.builds(
        InstrumentationScope,
        name=_text,
        version=st.one_of(st.none(), _text),
        schema_url=_text,
        attributes=st.one_of(st.none(), _attributes_strategy),
    )
    scope_metrics = st.builds(
        ScopeMetrics, scope=scope, metrics=st.lists(metric, max_size=3), schema_url=_text
    )
    resource = st.builds(Resource, attributes=_attributes_strategy, schema_url=_text)
    resource_metrics = st.builds(
        ResourceMetrics,
        resource=resource,
        scope_metrics=st.lists(scope_metrics, max_size=2),
        schema_url=_text,
    )
    return MetricsData(resource_metrics=draw(st.lists(resource_metrics, min_size=1, max_size=2)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metrics_data=_metrics_data())
def test_direct_encoding_is_byte_identical_to_the_sdk(metrics_data: MetricsData) -> None:
    encoder = RequestEncoder()
    direct = encoder.encode(metrics_data)
    assert direct is not None
    assert direct == encode_metrics(metrics_data).SerializeToString()
    assert encoder.encode(metrics_data) == direct  # the caches change nothing


def test_direct_encoding_of_real_windows_and_the_fallback() -> None:
    exporter = _exporter("http://127.0.0.1:4318/v1/metrics")
    sdk_only = _exporter("http://127.0.0.1:4318/v1/metrics", direct_encoding=False)
    for seed in range(5):
        window = _window(seed)
        assert RequestEncoder().encode(window) is not None
        assert exporter.serialize(window) == encode_metrics(window).SerializeToString()
        assert sdk_only.serialize(window) == exporter.serialize(window)
    # Explicit-bucket histograms are written directly too; an array attribute is not: the SDK
    # encodes that window.
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Histogram,
        HistogramDataPoint,
        Metric,
        ResourceMetrics,
        ScopeMetrics,
    )

    point = HistogramDataPoint(
        attributes={},
        start_time_unix_nano=1,
        time_unix_nano=2,
        count=1,
        sum=1.0,
        bucket_counts=[0, 1],
        explicit_bounds=[0.5],
        min=1.0,
        max=1.0,
        exemplars=[],
    )
    resource_metrics = WINDOW.resource_metrics[0]
    scope = resource_metrics.scope_metrics[0].scope

    def window_of(histogram_point: HistogramDataPoint) -> MetricsData:
        metric = Metric(
            name="h",
            description="",
            unit="s",
            data=Histogram(
                data_points=[histogram_point],
                aggregation_temporality=AggregationTemporality.DELTA,
            ),
        )
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=resource_metrics.resource,
                    scope_metrics=[ScopeMetrics(scope=scope, metrics=[metric], schema_url="")],
                    schema_url="",
                )
            ]
        )

    direct = window_of(point)
    assert RequestEncoder().encode(direct) == encode_metrics(direct).SerializeToString()
    explicit = window_of(dataclasses.replace(point, attributes={"k": ("a", "b")}))
    assert RequestEncoder().encode(explicit) is None
    assert exporter.serialize(explicit) == encode_metrics(explicit).SerializeToString()
