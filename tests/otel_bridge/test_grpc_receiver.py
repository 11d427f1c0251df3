"""The OTLP/gRPC receiver on gRPC's asyncio server: its answers, limits and deadlines.

The OpenTelemetry SDK's gRPC exporter against it is covered where the bridge is
(test_server.py); grpc-js's in tests/interop; hostile clients in test_attacks.py.
"""

from __future__ import annotations

import os
import socket
import time

import grpc
import hpack
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from stepwatch.core._influx import wait_until
from stepwatch.otel_bridge import Bridge
from stepwatch.otel_bridge._grpc_receiver import GrpcLimits, server_options
from tests.otel_bridge import attacks
from tests.otel_bridge.otlp_requests import RecordingWriter, window_request

EXPORT_PATH = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def test_answers_follow_the_otlp_specification() -> None:
    """OK (also gzip), INVALID_ARGUMENT, UNIMPLEMENTED, UNAUTHENTICATED, RESOURCE_EXHAUSTED
    for a message above the limit (also once decompressed); every answer but the last two,
    which gRPC gives itself, is counted."""
    writer = RecordingWriter()
    with Bridge(writer, http_port=None, auth_token="s3cret", max_request_bytes=64 * 1024) as bridge:
        channel = grpc.insecure_channel(bridge.grpc_endpoint)
        token = (("authorization", "Bearer s3cret"),)
        export = channel.unary_unary(EXPORT_PATH)
        other = channel.unary_unary(EXPORT_PATH.replace("Export", "Import"))
        window = window_request(job="codes", rank=0, world_size=1, window=0).SerializeToString()
        calls = [
            lambda: export(window, metadata=token, timeout=10),
            lambda: export(window, metadata=token, timeout=10, compression=grpc.Compression.Gzip),
            lambda: export(b"\xff\xff\xff", metadata=token, timeout=10),
            lambda: export(window, timeout=10),
            lambda: other(window, metadata=token, timeout=10),
            lambda: export(os.urandom(65 * 1024), metadata=token, timeout=10),
            lambda: export(
                b"\0" * (1 << 20), metadata=token, timeout=10, compression=grpc.Compression.Gzip
            ),
        ]
        codes = []
        for call in calls:
            try:
                assert call() == b""  # a full success: the empty ExportMetricsServiceResponse
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)
        channel.close()
        assert wait_until(lambda: len(writer.lines) == 6, timeout_s=10)  # 2 windows stored
        counted = sorted(
            sample.labels["code"]
            for metric in bridge.metrics.registry.collect()
            if metric.name == "stepwatch_bridge_requests"
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels["protocol"] == "grpc"
        )
    assert codes == ["OK", "OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "UNIMPLEMENTED",
                     "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]  # fmt: skip
    assert counted == ["INVALID_ARGUMENT", "OK", "UNAUTHENTICATED"]


def test_a_refusal_carries_retry_info_to_a_grpcio_client() -> None:
    """OTLP clients retry UNAVAILABLE and RESOURCE_EXHAUSTED when RetryInfo says when."""
    with Bridge(RecordingWriter(), http_port=None) as bridge:
        bridge.forwarder.stop(timeout_s=1)  # a bridge that cannot store: UNAVAILABLE
        channel = grpc.insecure_channel(bridge.grpc_endpoint)
        export = channel.unary_unary(EXPORT_PATH)
        body = window_request(job="busy", rank=0, world_size=1, window=0).SerializeToString()
        with pytest.raises(grpc.RpcError) as raised:
            export(body, timeout=10)
        channel.close()
    error = raised.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    details = dict(error.trailing_metadata())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(details)
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.retry_delay.seconds == 1


def test_a_message_not_received_in_time_is_deadline_exceeded() -> None:
    """A call whose message stalls is answered DEADLINE_EXCEEDED after ``request_timeout_s``
    (from the bridge: gRPC calls a unary handler only once the message is complete)."""
    with Bridge(RecordingWriter(), http_port=None, request_timeout_s=0.5) as bridge:
        assert bridge.grpc_port is not None
        with socket.create_connection(("127.0.0.1", bridge.grpc_port), timeout=10) as sock:
            sock.sendall(
                attacks.PREFACE + attacks.settings() + attacks.frame(attacks.SETTINGS, 1, 0)
            )
            block = attacks.call_headers(hpack.Encoder(), "stall")
            sock.sendall(attacks.frame(attacks.HEADERS, attacks.END_HEADERS, 1, block)
                         + attacks.frame(attacks.DATA, 0, 1, b"\0\0\0\1\0abc"))  # fmt: skip
            started = time.monotonic()
            received = b""
            decoder = hpack.Decoder()
            status = None
            while status is None and time.monotonic() - started < 10:
                received += sock.recv(65536)
                while len(received) >= 9:
                    length = int.from_bytes(received[:3], "big")
                    if len(received) < 9 + length:
                        break
                    kind, payload = received[3], received[9 : 9 + length]
                    received = received[9 + length :]
                    if kind == attacks.HEADERS:
                        for name, value in decoder.decode(payload):
                            if name in ("grpc-status", b"grpc-status"):
                                status = value.decode() if isinstance(value, bytes) else value
        elapsed = time.monotonic() - started
    assert status == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    assert 0.4 < elapsed < 5.0


def test_the_server_options_are_the_limits() -> None:
    options = dict(server_options(GrpcLimits(), max_message_bytes=1 << 20, reuse_port=False))
    assert options["grpc.max_concurrent_streams"] == 32
    assert options["grpc.max_allowed_incoming_connections"] == 4096
    assert options["grpc.server_handshake_timeout_ms"] == 5_000
    assert options["grpc.max_connection_idle_ms"] == 120_000
    assert options["grpc.max_connection_age_ms"] == 300_000
    assert options["grpc.absolute_max_metadata_size"] == 16 * 1024
    assert options["grpc.max_receive_message_length"] == 1 << 20


def test_silent_connections_at_the_bound_make_room_after_the_handshake_timeout() -> None:
    """gRPC refuses connections beyond ``max_connections``; silent ones are closed after
    ``handshake_timeout_s``, so a new client waits that long at most, then gets in."""
    body = window_request(job="room", rank=0, world_size=1, window=0).SerializeToString()
    with Bridge(
        RecordingWriter(), http_port=None, max_connections=10, handshake_timeout_s=1.0
    ) as bridge:
        assert bridge.grpc_port is not None
        silent = [socket.create_connection(("127.0.0.1", bridge.grpc_port)) for _ in range(20)]
        try:
            time.sleep(0.3)
            started = time.monotonic()
            with grpc.insecure_channel(bridge.grpc_endpoint) as channel:
                export = channel.unary_unary(EXPORT_PATH)
                assert export(body, timeout=15, wait_for_ready=True) == b""
            assert time.monotonic() - started < 10
        finally:
            for sock in silent:
                sock.close()
