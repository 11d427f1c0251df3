"""OTLP export: settings precedence, real exporters, a receiver that is down or restarts."""

from __future__ import annotations

import gzip
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from stepwatch.core import ConfigError, _schema
from stepwatch.exporters import StepMonitor, resolve_exporter_config

OTLP_VARIABLES = [
    f"OTEL_EXPORTER_OTLP_{signal}{name}"
    for signal in ("", "METRICS_")
    for name in ("ENDPOINT", "PROTOCOL", "HEADERS", "COMPRESSION", "TIMEOUT")
]


@pytest.fixture(autouse=True)
def clean_otlp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [*OTLP_VARIABLES, "OTEL_METRIC_EXPORT_INTERVAL"]:
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture(autouse=True)
def quiet_exporter_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("CRITICAL", logger="stepwatch.exporters")
    caplog.set_level("CRITICAL", logger="opentelemetry")


# ---------------------------------------------------------------- precedence
def test_defaults() -> None:
    config = resolve_exporter_config(environ={})
    assert config.protocol == "http/protobuf"
    assert config.endpoint == "http://localhost:4318/v1/metrics"
    assert (dict(config.headers), config.compression, config.timeout_s) == ({}, "gzip", 10.0)
    grpc = resolve_exporter_config(protocol="grpc", environ={})
    assert grpc.endpoint == "http://localhost:4317"


def test_argument_beats_metrics_variable_beats_generic_variable() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4318",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://metrics:4318/custom/path",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-generic=1",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-tenant=team%20a,Authorization=Bearer%20t",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "deflate",
        "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "7000",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "2500",
    }
    from_metrics = resolve_exporter_config(environ=environ)
    assert from_metrics.protocol == "http/protobuf"
    assert from_metrics.endpoint == "http://metrics:4318/custom/path"  # used as given
    assert dict(from_metrics.headers) == {"x-tenant": "team a", "authorization": "Bearer t"}
    assert from_metrics.compression == "gzip"
    assert from_metrics.timeout_s == 2.5  # milliseconds, as the specification says

    generic_only = {k: v for k, v in environ.items() if "_METRICS_" not in k}
    generic = resolve_exporter_config(environ=generic_only)
    assert generic.protocol == "grpc"
    assert generic.endpoint == "http://generic:4318"
    assert dict(generic.headers) == {"x-generic": "1"}
    assert generic.compression == "deflate"
    assert generic.timeout_s == 7.0

    generic_http = resolve_exporter_config(protocol="http/protobuf", environ=generic_only)
    assert generic_http.endpoint == "http://generic:4318/v1/metrics"  # base URL + signal path

    arguments = resolve_exporter_config(
        endpoint="http://arg:9999",
        protocol="http/protobuf",
        headers={"x-arg": "yes"},
        compression="none",
        timeout_s=0.5,
        environ=environ,
    )
    assert arguments.endpoint == "http://arg:9999/v1/metrics"  # no path: signal path added
    assert dict(arguments.headers) == {"x-arg": "yes"}
    assert (arguments.compression, arguments.timeout_s) == ("none", 0.5)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"protocol": "http/xml"}, "protocol"),
        ({"endpoint": "localhost:4318"}, "endpoint"),
        ({"compression": "zstd"}, "compression"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"certificate_file": "/no/such/ca.pem"}, "certificate_file"),
    ],
)
def test_bad_arguments_raise_and_name_the_argument(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        resolve_exporter_config(environ={}, **arguments)


@pytest.mark.parametrize(
    ("environ", "field", "default"),
    [
        ({"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "udp"}, "protocol", "http/protobuf"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost"},
            "endpoint",
            "http://localhost:4318/v1/metrics",
        ),
        ({"OTEL_EXPORTER_OTLP_COMPRESSION": "br"}, "compression", "gzip"),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "ten"}, "timeout_s", 10.0),
        ({"OTEL_EXPORTER_OTLP_METRICS_HEADERS": "a=1,novalue"}, "headers", {}),
    ],
)
def test_bad_variables_warn_name_themselves_and_count_as_unset(
    environ: dict[str, str], field: str, default: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """OTel specification, "Environment Variable Specification": warn and ignore."""
    caplog.set_level("WARNING", logger="stepwatch.exporters")
    config = resolve_exporter_config(environ=environ)
    value = getattr(config, field)
    assert (dict(value) if field == "headers" else value) == default
    (variable,) = environ
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and variable in warnings[0]


def test_monitor_reads_the_environment_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "1500")
    monitor = StepMonitor(job_id="j", rank=0, world_size=1, start=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://elsewhere:2")  # too late
    monitor.close(timeout_s=0.1)
    assert monitor.exporter_config is not None
    assert monitor.exporter_config.endpoint == "http://127.0.0.1:1/v1/metrics"
    assert monitor.exporter_config.timeout_s == 1.5
    grpc = StepMonitor(job_id="j", rank=0, world_size=1, protocol="grpc", start=False)
    grpc.close(timeout_s=0.1)
    assert grpc.exporter_config is not None
    assert grpc.exporter_config.endpoint == "http://elsewhere:2"  # the generic base, as is


# ---------------------------------------------------------------- real receivers
class OtlpReceiver:
    """A minimal OTLP/HTTP metrics receiver on a loopback port; can be stopped and restarted."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.lock = threading.Lock()
        self.port = port
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":  # the default (issue 13)
                    body = gzip.decompress(body)
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    receiver.requests.append(request)
                payload = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def steps_received(self) -> int:
        total = 0
        with self.lock:
            for request in self.requests:
                for resource_metrics in request.resource_metrics:
                    for scope_metrics in resource_metrics.scope_metrics:
                        for metric in scope_metrics.metrics:
                            if metric.name == _schema.STEP_DURATION:
                                total += sum(
                                    p.count for p in metric.exponential_histogram.data_points
                                )
        return total


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_steps(monitor: StepMonitor, count: int) -> list[int]:
    """Steps of ~0.2 ms busy work; returns the hot-path cost (ns) of each step."""
    costs = []
    for _ in range(count):
        started = time.perf_counter_ns()
        with monitor.step():
            hot = time.perf_counter_ns() - started
            with monitor.phase("forward"):
                work_end = time.perf_counter() + 0.0002
                while time.perf_counter() < work_end:
                    pass
            before_exit = time.perf_counter_ns()
        costs.append(hot + time.perf_counter_ns() - before_exit)
    return costs


def _wait_for(predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.01)


def test_http_export_to_a_real_receiver(receiver: OtlpReceiver) -> None:
    monitor = StepMonitor(
        job_id="run-42", rank=0, world_size=1, endpoint=receiver.url, export_interval_s=0.05
    )
    _run_steps(monitor, 30)
    monitor.close()
    assert monitor.stats.steps_exported == 30
    assert receiver.steps_received() == 30
    resource = receiver.requests[0].resource_metrics[0].resource
    attributes = {a.key: a.value for a in resource.attributes}
    assert attributes[_schema.JOB_ID].string_value == "run-42"


def test_bridge_down_never_slows_or_breaks_the_steps() -> None:
    monitor = StepMonitor(
        job_id="j",
        rank=0,
        world_size=1,
        endpoint=f"http://127.0.0.1:{_closed_port()}",
        export_interval_s=0.02,
        timeout_s=0.3,
        buffer_steps=200,
    )
    costs = _run_steps(monitor, 1500)
    _wait_for(lambda: monitor.stats.export_failures >= 2)
    started = time.monotonic()
    monitor.close(timeout_s=2.0)
    assert time.monotonic() - started < 4.0  # bounded flush
    stats = monitor.stats
    assert stats.steps_exported == 0
    assert stats.steps_recorded == 1500
    assert stats.steps_dropped == 1500  # failed windows, full buffer or unflushed: all counted
    costs.sort()
    assert costs[len(costs) // 2] < 50_000  # median hot-path cost per step under 50 µs


def test_receiver_killed_and_restarted_while_training() -> None:
    receiver = OtlpReceiver()
    receiver.start()
    port = receiver.port
    monitor = StepMonitor(
        job_id="j",
        rank=0,
        world_size=1,
        endpoint=receiver.url,
        export_interval_s=0.02,
        timeout_s=0.5,
        buffer_steps=100,
    )
    try:
        _run_steps(monitor, 50)
        _wait_for(lambda: receiver.steps_received() == 50)
        receiver.stop()
        down_costs = []
        while monitor.stats.export_failures < 2:
            down_costs += _run_steps(monitor, 20)
        restarted = OtlpReceiver(port)
        restarted.start()
        try:
            _run_steps(monitor, 50)
            _wait_for(lambda: restarted.steps_received() > 0)
            monitor.close(timeout_s=5.0)
            stats = monitor.stats
            assert stats.steps_recorded == stats.steps_exported + stats.steps_dropped
            assert stats.steps_dropped > 0
            assert stats.steps_exported == receiver.steps_received() + restarted.steps_received()
            assert stats.windows_exported >= 2
        finally:
            restarted.stop()
    finally:
        monitor.close(timeout_s=1.0)
        receiver.stop()
    down_costs.sort()
    assert down_costs[len(down_costs) // 2] < 50_000
