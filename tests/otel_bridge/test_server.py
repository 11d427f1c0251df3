"""The Bridge end to end: real OTLP exporters → real Bridge → the real influxd, read back."""

from __future__ import annotations

import gzip
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpExporter,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    InMemoryMetricReader,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client.parser import text_string_to_metric_families

from stepwatch.core import ConfigError, InfluxClient
from stepwatch.core._influx import count_points, wait_until
from stepwatch.otel_bridge import Bridge, decode_buckets
from tests.otel_bridge.otlp_requests import (
    RecordingWriter,
    explicit_histogram,
    gauge,
    post,
    request,
    window_request,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPORT_PATH = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def sdk_metrics(job: str, rank: int = 0) -> MetricsData:
    """Real SDK MetricsData: an exponential step histogram, a phase histogram, a gauge.

    DELTA: a CUMULATIVE first point is a baseline (tests/otel_bridge/test_sdk_temporality.py).
    """
    reader = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource(
            {
                "stepwatch.job.id": job,
                "stepwatch.rank": rank,
                "stepwatch.world_size": 2,
                "host.name": "node-0",
            }
        ),
        views=[
            View(
                instrument_name="stepwatch.step.duration",
                aggregation=ExponentialBucketHistogramAggregation(max_size=40),
            )
        ],
    )
    meter = provider.get_meter("tests")
    step = meter.create_histogram("stepwatch.step.duration", unit="s")
    phase = meter.create_histogram("stepwatch.phase.duration", unit="s")
    for value in (0.11, 0.12, 0.13, 0.5):
        step.record(value)
        phase.record(value / 2, {"stepwatch.phase": "forward", "step": 3})
    meter.create_gauge("stepwatch.step.last").set(41)
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return data


def metrics_values(bridge: Bridge) -> dict[str, float]:
    with urllib.request.urlopen(bridge.metrics_url, timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def proto_headers() -> dict[str, str]:
    return {"Content-Type": "application/x-protobuf"}


def test_sdk_exporters_http_gzip_grpc_into_influxdb(bridge: Bridge, influx: InfluxClient) -> None:
    assert HttpExporter(endpoint=bridge.http_url).export(sdk_metrics("http")) == (
        MetricExportResult.SUCCESS
    )
    gzip_exporter = HttpExporter(endpoint=bridge.http_url, compression=Compression.Gzip)
    assert gzip_exporter.export(sdk_metrics("gzip")) == MetricExportResult.SUCCESS
    grpc_exporter = GrpcExporter(endpoint=bridge.grpc_endpoint, insecure=True)
    assert grpc_exporter.export(sdk_metrics("grpc")) == MetricExportResult.SUCCESS
    grpc_exporter.shutdown()

    def stored() -> bool:
        return count_points(influx, "stepwatch.step.last") == 3

    assert wait_until(stored, timeout_s=10)
    for job in ("http", "gzip", "grpc"):
        rows = influx.query(
            'SELECT "count", "sum", "p50", "max", "buckets" FROM "stepwatch.step.duration" '
            f"WHERE \"stepwatch.job.id\" = '{job}'"
        )[0].records()
        assert len(rows) == 1
        assert rows[0]["count"] == 4 and decode_buckets(rows[0]["buckets"]).cumulative[-1] == 4
        assert rows[0]["sum"] == pytest.approx(0.86)
        # nearest rank 2 of [0.11, 0.12, 0.13, 0.5] is 0.12; max_size=40 keeps buckets narrow
        assert rows[0]["p50"] == pytest.approx(0.12, rel=0.05)
        assert rows[0]["max"] == 0.5
    tags = influx.query('SHOW TAG KEYS FROM "stepwatch.phase.duration"')[0].values
    assert sorted(row[0] for row in tags) == [
        "host.name",
        "stepwatch.job.id",
        "stepwatch.phase",
        "stepwatch.rank",
        "stepwatch.world_size",
    ]
    # the writer counts a batch once InfluxDB answered, a moment after the points are readable
    assert wait_until(
        lambda: metrics_values(bridge)["stepwatch_bridge_datapoints_written_total"] == 9,
        timeout_s=10,
    )
    values = metrics_values(bridge)
    assert values["stepwatch_bridge_datapoints_received_total"] == 9
    assert values["stepwatch_bridge_attributes_dropped_total"] == 3  # "step", per point
    assert values["stepwatch_bridge_requests_total{code=200,protocol=http}"] == 2
    assert values["stepwatch_bridge_requests_total{code=OK,protocol=grpc}"] == 1
    assert values["stepwatch_bridge_write_duration_seconds_count"] >= 1


def test_http_json_and_partial_success(bridge: Bridge, influx: InfluxClient) -> None:
    message = request(
        [
            explicit_histogram(
                "stepwatch.step.duration", bounds=[0.1], counts=[1, 1], total=0.3, count=7
            ),
            gauge("stepwatch.step.last", 9),
        ]
    )
    body = json_format.MessageToJson(message).encode()
    status, headers, answer = post(bridge.http_url, body, {"Content-Type": "application/json"})
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    response = json.loads(answer)
    assert response["partialSuccess"]["rejectedDataPoints"] == "1"
    assert "count_mismatch=1" in response["partialSuccess"]["errorMessage"]
    assert wait_until(lambda: count_points(influx, "stepwatch.step.last") == 1, timeout_s=10)
    assert count_points(influx, "stepwatch.step.duration") == 0
    assert (
        metrics_values(bridge)["stepwatch_bridge_datapoints_rejected_total{reason=count_mismatch}"]
        == 1
    )

    channel = grpc.insecure_channel(bridge.grpc_endpoint)
    export = channel.unary_unary(EXPORT_PATH)
    reply = ExportMetricsServiceResponse.FromString(export(message.SerializeToString(), timeout=5))
    assert reply.partial_success.rejected_data_points == 1
    channel.close()


def test_bad_input_is_answered_and_the_bridge_keeps_serving(influx: InfluxClient) -> None:
    with Bridge(RecordingWriter(), max_request_bytes=4096, flush_interval_s=0.02) as bridge:
        url = bridge.http_url
        good = request([gauge("stepwatch.step.last", 1)]).SerializeToString()
        assert post(url, b"\xff\x00garbage", proto_headers())[0] == 400
        assert post(url, b"{not json", {"Content-Type": "application/json"})[0] == 400
        assert post(url, b'{"resourceMetrics": 3}', {"Content-Type": "application/json"})[0] == 400
        assert post(url, good, {"Content-Type": "text/plain"})[0] == 415
        assert post(url, good, {**proto_headers(), "Content-Encoding": "br"})[0] == 415
        assert post(url, b"x" * 5000, proto_headers())[0] == 413
        bomb = gzip.compress(b"\x00" * 1_000_000)
        assert post(url, bomb, {**proto_headers(), "Content-Encoding": "gzip"})[0] == 413
        deflate_bomb = zlib.compress(b"\x00" * 1_000_000)
        assert post(url, deflate_bomb, {**proto_headers(), "Content-Encoding": "deflate"})[0] == 413
        assert (
            post(url, b"x\x9cnot deflate", {**proto_headers(), "Content-Encoding": "deflate"})[0]
            == 400
        )
        # HTTP's deflate is a zlib stream; raw deflate (no header) is accepted as well.
        raw = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
        for body in (zlib.compress(good), raw.compress(good) + raw.flush()):
            assert post(url, body, {**proto_headers(), "Content-Encoding": "deflate"})[0] == 200
        assert (
            post(url, b"\x1f\x8bnot gzip", {**proto_headers(), "Content-Encoding": "gzip"})[0]
            == 400
        )
        assert post(url.replace("/v1/metrics", "/v1/traces"), good, proto_headers())[0] == 404
        status, _, body = post(url, b"\xff\x00garbage", proto_headers())
        assert status == 400
        assert status_pb2.Status.FromString(body).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

        channel = grpc.insecure_channel(bridge.grpc_endpoint)
        export = channel.unary_unary(EXPORT_PATH)
        with pytest.raises(grpc.RpcError) as caught:
            export(b"\xff\x00garbage", timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert export(good, timeout=5) == b""
        channel.close()

        assert post(url, good, proto_headers())[0] == 200
        with urllib.request.urlopen(url.replace("/v1/metrics", "/healthz"), timeout=5) as r:
            assert r.status == 200
        values = metrics_values(bridge)
        assert values["stepwatch_bridge_requests_total{code=400,protocol=http}"] == 6
        assert values["stepwatch_bridge_requests_total{code=413,protocol=http}"] == 3
        assert values["stepwatch_bridge_requests_total{code=415,protocol=http}"] == 2
        assert values["stepwatch_bridge_requests_total{code=INVALID_ARGUMENT,protocol=grpc}"] == 1


def test_backpressure_answers_429_and_resource_exhausted() -> None:
    writer = RecordingWriter()
    writer.gate.clear()  # InfluxDB "hangs": the forwarder blocks on its first batch
    with Bridge(
        writer, max_queue_lines=6, batch_max_lines=2, flush_interval_s=0.01, retry_after_s=2
    ) as bridge:
        body = window_request(job="bp", rank=0, world_size=1, window=0).SerializeToString()
        statuses = [post(bridge.http_url, body, proto_headers()) for _ in range(5)]
        codes = [status for status, _, _ in statuses]
        assert codes[0] == 200 and 429 in codes
        refused = next(item for item in statuses if item[0] == 429)
        assert refused[1]["Retry-After"] == "2"
        channel = grpc.insecure_channel(bridge.grpc_endpoint)
        export = channel.unary_unary(EXPORT_PATH)
        with pytest.raises(grpc.RpcError) as caught:
            export(body, timeout=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = dict(caught.value.trailing_metadata())["grpc-status-details-bin"]
        status = status_pb2.Status.FromString(details)
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and info.retry_delay.seconds == 2
        with pytest.raises(grpc.RpcError) as again:  # answered from the built statuses
            export(body, timeout=5)
        assert dict(again.value.trailing_metadata())["grpc-status-details-bin"] == details
        channel.close()
        assert bridge.forwarder.queued_lines <= 6
        writer.gate.set()
        assert bridge.forwarder.wait_idle(10)
        accepted = codes.count(200) * 3
        assert wait_until(lambda: len(writer.lines) == accepted, timeout_s=10)


def test_grpc_handler_threads_follow_the_spool(tmp_path: Path) -> None:
    # A memory spool never blocks: calls are handled on the server's loop (one idle thread);
    # a disk spool's call waits for its fsync'd group commit in one of eight.
    memory = Bridge(RecordingWriter())
    disk = Bridge(RecordingWriter(), spool_dir=tmp_path / "spool")
    chosen = Bridge(RecordingWriter(), grpc_workers=3)
    assert (memory._grpc.workers, disk._grpc.workers, chosen._grpc.workers) == (1, 8, 3)
    with pytest.raises(ConfigError, match="grpc_workers"):
        Bridge(RecordingWriter(), grpc_workers=0)


def test_cardinality_guard_caps_series_per_measurement_per_job() -> None:
    writer = RecordingWriter()
    with Bridge(writer, max_series_per_measurement=5, flush_interval_s=0.01) as bridge:
        phases = [f"step-{index}" for index in range(12)]
        body = window_request(job="card", rank=0, world_size=1, window=0, phases=phases)
        status, _, answer = post(bridge.http_url, body.SerializeToString(), proto_headers())
        assert status == 200
        reply = ExportMetricsServiceResponse.FromString(answer)
        assert reply.partial_success.rejected_data_points == 7
        # Known series keep flowing; another job has its own budget.
        again = window_request(job="card", rank=0, world_size=1, window=1, phases=phases[:5])
        assert post(bridge.http_url, again.SerializeToString(), proto_headers())[0] == 200
        other = window_request(job="other", rank=0, world_size=1, window=0, phases=phases[:5])
        answer = post(bridge.http_url, other.SerializeToString(), proto_headers())[2]
        assert (
            ExportMetricsServiceResponse.FromString(answer).partial_success.rejected_data_points
            == 0
        )
        assert bridge.forwarder.wait_idle(10)
        assert wait_until(lambda: len(writer.lines) == 7 + 7 + 7, timeout_s=10)
        assert (
            metrics_values(bridge)[
                "stepwatch_bridge_datapoints_rejected_total{reason=cardinality_limit}"
            ]
            == 7
        )


def test_cardinality_guard_budgets_each_rank() -> None:
    # One rank flooding new tag values is stopped by its own budget; its peers, whose series
    # legitimately grow the job's total, are not refused.
    writer = RecordingWriter()
    with Bridge(writer, max_series_per_rank=5, flush_interval_s=0.01) as bridge:
        flood = [f"step-{index}" for index in range(12)]
        body = window_request(job="ranks", rank=0, world_size=4, window=0, phases=flood)
        answer = post(bridge.http_url, body.SerializeToString(), proto_headers())[2]
        # The budget is per (job, measurement, rank): 5 of rank 0's 12 phase series pass (its
        # step.duration and step.last series are in other measurements).
        rejected = ExportMetricsServiceResponse.FromString(answer)
        assert rejected.partial_success.rejected_data_points == 12 - 5
        for rank in (1, 2, 3):
            peer = window_request(job="ranks", rank=rank, world_size=4, window=0, phases=flood[:2])
            reply = post(bridge.http_url, peer.SerializeToString(), proto_headers())[2]
            assert (
                ExportMetricsServiceResponse.FromString(reply).partial_success.rejected_data_points
                == 0
            )


def test_bearer_token_on_both_receivers() -> None:
    writer = RecordingWriter()
    with Bridge(writer, auth_token="s3cret", flush_interval_s=0.01) as bridge:
        body = request([gauge("stepwatch.step.last", 1)]).SerializeToString()
        status, headers, _ = post(bridge.http_url, body, proto_headers())
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        wrong = {**proto_headers(), "Authorization": "Bearer nope"}
        assert post(bridge.http_url, body, wrong)[0] == 401
        right = {**proto_headers(), "Authorization": "Bearer s3cret"}
        assert post(bridge.http_url, body, right)[0] == 200

        assert (
            GrpcExporter(endpoint=bridge.grpc_endpoint, insecure=True).export(sdk_metrics("auth"))
            == MetricExportResult.FAILURE
        )
        exporter = GrpcExporter(
            endpoint=bridge.grpc_endpoint, insecure=True, headers={"authorization": "Bearer s3cret"}
        )
        assert exporter.export(sdk_metrics("auth")) == MetricExportResult.SUCCESS
        exporter.shutdown()
        assert "s3cret" not in repr(bridge)


def make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls_on_both_receivers(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    writer = RecordingWriter()
    with Bridge(writer, tls_cert_file=cert, tls_key_file=key, flush_interval_s=0.01) as bridge:
        assert bridge.http_url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        body = request([gauge("stepwatch.step.last", 1)]).SerializeToString()
        assert post(bridge.http_url, body, proto_headers(), context=context)[0] == 200
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        channel = grpc.secure_channel(bridge.grpc_endpoint, credentials)
        assert channel.unary_unary(EXPORT_PATH)(body, timeout=10) == b""
        channel.close()
        assert bridge.forwarder.wait_idle(10)
        assert wait_until(lambda: len(writer.lines) == 2, timeout_s=10)
    with pytest.raises(ConfigError, match="tls_key_file"):
        Bridge(writer, tls_cert_file=cert)


def test_reuse_port_lets_two_bridges_share_ports() -> None:
    first = Bridge(RecordingWriter(), reuse_port=True).start()
    try:
        second = Bridge(
            RecordingWriter(),
            reuse_port=True,
            grpc_port=first.grpc_port,
            http_port=first.http_port,
        ).start()
        assert (second.grpc_port, second.http_port) == (first.grpc_port, first.http_port)
        second.stop()
    finally:
        first.stop()


def test_config_errors_name_the_argument() -> None:
    with pytest.raises(ConfigError, match="grpc_port"):
        Bridge(RecordingWriter(), grpc_port=70000)
    with pytest.raises(ConfigError, match="spool_overflow"):
        Bridge(RecordingWriter(), spool_overflow="drop_all")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_queue_lines"):
        Bridge(RecordingWriter(), max_queue_lines=0)


def test_cli_runs_until_sigterm(influx: InfluxClient, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("cli-token\n")
    env = {
        **os.environ,
        "STEPWATCH_INFLUX_URL": influx.url,
        "STEPWATCH_INFLUX_DATABASE": "ignored-by-argument",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stepwatch",
            "bridge",
            "--database",
            influx.database,
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--auth-token-file",
            str(token_file),
            "--spool-dir",
            str(tmp_path / "spool"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO_ROOT,
        text=True,
    )
    try:
        assert process.stdout is not None
        endpoints: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while "writing" not in endpoints and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            kind, _, value = line.partition(": ")[2].partition(" ")
            endpoints[kind if kind != "writing" else "writing"] = value.strip()
        assert "OTLP/HTTP" in endpoints, process.stderr.read() if process.stderr else ""
        assert f"database {influx.database}" in endpoints["writing"]
        body = request([gauge("stepwatch.step.last", 5)]).SerializeToString()
        headers = {**proto_headers(), "Authorization": "Bearer cli-token"}
        assert post(endpoints["OTLP/HTTP"], body, headers)[0] == 200
        assert wait_until(lambda: count_points(influx, "stepwatch.step.last") == 1, timeout_s=10)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)  # reaps and closes the pipes


def test_stop_closes_keep_alive_connections(influx: InfluxClient) -> None:
    # An SDK exporter reuses its HTTP connection; after stop() that connection must end, not
    # keep being answered by a bridge that no longer forwards anything.
    import http.client

    from stepwatch.otel_bridge import InfluxV1Writer

    bridge = Bridge(InfluxV1Writer(influx), grpc_port=None)
    bridge.start()
    connection = http.client.HTTPConnection("127.0.0.1", bridge.http_port, timeout=5)
    try:
        body = request([gauge("stepwatch.step.last", 3.0)]).SerializeToString()
        connection.request("POST", "/v1/metrics", body=body, headers=proto_headers())
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        bridge.stop()
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            connection.request("POST", "/v1/metrics", body=body, headers=proto_headers())
            connection.getresponse().read()
    finally:
        connection.close()
        bridge.stop()
