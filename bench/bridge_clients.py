"""What the bridge benchmarks share (bridge_load, bridge_fuzz, scale_sim): OTLP senders over
one keep-alive HTTP connection or one gRPC channel, nearest-rank quantiles, /proc figures.

Standard library at import; grpc is imported by :func:`grpc_sender`.
"""

from __future__ import annotations

import http.client
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

EXPORT_PATH = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
PROTOBUF_HEADERS = {"Content-Type": "application/x-protobuf"}
ACCEPTED = ("http:200", "grpc:OK")

Sender = Callable[[bytes], tuple[str, bytes]]
"""Sends one serialized ExportMetricsServiceRequest; ``("http:200", answer)``,
``("grpc:RESOURCE_EXHAUSTED", b"")``, ``("http:error", b"")`` (connection failed)."""


def post_metrics(
    connection: http.client.HTTPConnection, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    """POST one OTLP/HTTP export on a keep-alive connection: the status and the answer.

    Closes the connection when the bridge says ``Connection: close`` (the next request
    reconnects); connection errors propagate.
    """
    connection.request("POST", "/v1/metrics", body=body, headers=headers)
    response = connection.getresponse()
    answer = response.read()
    if response.getheader("Connection", "").lower() == "close":
        connection.close()
    return response.status, answer


def http_sender(endpoint: str, *, timeout_s: float = 30) -> tuple[Sender, Callable[[], None]]:
    """A sender over one keep-alive connection to ``host:port``, and its close."""
    host, port = endpoint.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)

    def send(body: bytes) -> tuple[str, bytes]:
        try:
            status, answer = post_metrics(connection, body, PROTOBUF_HEADERS)
        except (OSError, http.client.HTTPException):
            connection.close()
            return "http:error", b""
        return f"http:{status}", answer

    return send, connection.close


def grpc_sender(endpoint: str, *, timeout_s: float = 30) -> tuple[Sender, Callable[[], None]]:
    """A sender over one gRPC channel to ``host:port``, and its close."""
    import grpc

    channel = grpc.insecure_channel(endpoint)
    export = channel.unary_unary(EXPORT_PATH)

    def send(body: bytes) -> tuple[str, bytes]:
        try:
            return "grpc:OK", export(body, timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"grpc:{exc.code().name}", b""

    return send, channel.close


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile; NaN when there are no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used (user + system), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mib(pid: int) -> tuple[float, float]:
    """A process's resident memory now and at its peak (VmHWM), MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    return rss / 1024, hwm / 1024
