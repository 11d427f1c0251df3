"""Fuzz a live bridge with mutated OTLP protobuf and JSON over HTTP and gRPC.

    .venv/bin/python bench/bridge_fuzz.py [--cases 100000] [--seed 1] [--influx]

Seeds are valid export requests of every metric kind; each case mutates one (bit flips,
byte insertions/deletions, truncation, splices, random bytes; for JSON also value and key
replacement, deep nesting, huge numbers) and sometimes gzips it or lies about the content
type. Every case must be answered with a protocol code (HTTP 200/400/413/415, gRPC
OK/INVALID_ARGUMENT) within the timeout: 0 crashes (5xx, dropped connections, handler
exceptions), 0 hangs. With ``--influx`` the bridge writes to a managed influxd and InfluxDB must
accept every line the bridge produces (no ``influx_refused`` drops).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gzip
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bridge_clients import grpc_sender, post_metrics  # noqa: E402

OK_HTTP = {200, 400, 413, 415}
OK_GRPC = {"OK", "INVALID_ARGUMENT"}


@dataclasses.dataclass
class FuzzResult:
    cases: int = 0
    answers: Counter[str] = dataclasses.field(default_factory=Counter)
    crashes: list[str] = dataclasses.field(default_factory=list)
    hangs: int = 0
    seconds: float = 0.0
    handler_exceptions: int = 0

    @property
    def ok(self) -> bool:
        return not self.crashes and self.hangs == 0 and self.handler_exceptions == 0


def seed_requests() -> list[Any]:
    """Valid requests covering every metric kind and attribute type."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.metrics.v1 import metrics_pb2

    def resource(message: Any, rank: int) -> None:
        for key, value in (
            ("stepwatch.job.id", "fuzz"),
            ("stepwatch.rank", rank),
            ("stepwatch.world_size", 8),
            ("host.name", f"node-{rank}"),
        ):
            item = message.resource.attributes.add(key=key)
            if isinstance(value, int):
                item.value.int_value = value
            else:
                item.value.string_value = value

    seeds = []
    for rank in range(3):
        request = ExportMetricsServiceRequest()
        resource_metrics = request.resource_metrics.add()
        resource(resource_metrics, rank)
        scope = resource_metrics.scope_metrics.add()
        scope.scope.name = "fuzz"
        histogram = scope.metrics.add(name="stepwatch.phase.duration", unit="s")
        point = histogram.histogram.data_points.add(
            start_time_unix_nano=1_700_000_000_000_000_000,
            time_unix_nano=1_700_000_001_000_000_000 + rank,
            count=6,
            sum=0.6,
            min=0.01,
            max=0.3,
        )
        point.explicit_bounds.extend([0.05, 0.1, 0.2])
        point.bucket_counts.extend([1, 2, 2, 1])
        point.attributes.add(key="stepwatch.phase").value.string_value = "forward"
        exponential = scope.metrics.add(name="stepwatch.kernel.duration", unit="s")
        expo = exponential.exponential_histogram.data_points.add(
            time_unix_nano=1_700_000_001_000_000_000 + rank,
            count=7,
            sum=0.02,
            scale=3,
            zero_count=1,
        )
        expo.positive.offset = -60
        expo.positive.bucket_counts.extend([1, 0, 3, 2])
        expo.attributes.add(key="stepwatch.kernel.class").value.string_value = "gemm"
        expo.exemplars.add(time_unix_nano=1, as_double=0.1, span_id=b"\x01" * 8)
        gauge = scope.metrics.add(name="stepwatch.step.last")
        gauge.gauge.data_points.add(time_unix_nano=1_700_000_001_000_000_000, as_int=40 + rank)
        total = scope.metrics.add(name="hw.errors")
        total.sum.is_monotonic = True
        total.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
        total.sum.data_points.add(time_unix_nano=1_700_000_001_000_000_000, as_double=2.0)
        summary = scope.metrics.add(name="rpc.latency")
        summary_point = summary.summary.data_points.add(
            time_unix_nano=1_700_000_001_000_000_000, count=3, sum=1.5
        )
        summary_point.quantile_values.add(quantile=0.5, value=0.4)
        seeds.append(request)
    return seeds


def _mutate_bytes(data: bytes, rng: random.Random, corpus: Sequence[bytes]) -> bytes:
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(7)
        if choice == 0 and buffer:  # bit flip
            index = rng.randrange(len(buffer))
            buffer[index] ^= 1 << rng.randrange(8)
        elif choice == 1:  # insert random bytes
            index = rng.randrange(len(buffer) + 1)
            buffer[index:index] = rng.randbytes(rng.randint(1, 8))
        elif choice == 2 and buffer:  # delete a range
            index = rng.randrange(len(buffer))
            del buffer[index : index + rng.randint(1, 16)]
        elif choice == 3 and buffer:  # truncate
            del buffer[rng.randrange(len(buffer)) :]
        elif choice == 4:  # splice with another seed
            other = rng.choice(corpus)
            cut = rng.randrange(len(buffer) + 1)
            buffer = buffer[:cut] + other[rng.randrange(len(other) + 1) :]
        elif choice == 5 and buffer:  # interesting byte values
            index = rng.randrange(len(buffer))
            buffer[index] = rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x22, 0x5C])
        else:  # duplicate a chunk (repeated fields, overlong lengths)
            if buffer:
                start = rng.randrange(len(buffer))
                chunk = buffer[start : start + rng.randint(1, 32)]
                buffer[start:start] = chunk * rng.randint(1, 4)
    return bytes(buffer)


_WEIRD_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    -(2**64),
    1e308,
    -1e-320,
    "NaN",
    "Infinity",
    "-Infinity",
    "",
    "18446744073709551616",
    "not-a-number",
    "\u0000",
    "a\nb",
    'é,= \\"',
    [],
    {},
    [1, "x"],
    {"stringValue": 3},
    {"intValue": "12a"},
    {"doubleValue": "NaN"},
    {"arrayValue": {}},
    "ff" * 8,
    "zz",
    1.5,
]


def _walk(node: Any, nodes: list[tuple[Any, Any]]) -> None:
    if isinstance(node, dict):
        for key in list(node):
            nodes.append((node, key))
            _walk(node[key], nodes)
    elif isinstance(node, list):
        for index in range(len(node)):
            nodes.append((node, index))
            _walk(node[index], nodes)


def _mutate_json(document: Any, rng: random.Random) -> Any:
    document = copy.deepcopy(document)
    for _ in range(rng.randint(1, 3)):
        nodes: list[tuple[Any, Any]] = []
        _walk(document, nodes)
        if not nodes:
            return copy.deepcopy(rng.choice(_WEIRD_VALUES))
        parent, key = rng.choice(nodes)
        choice = rng.randrange(5)
        if choice == 0:
            parent[key] = copy.deepcopy(rng.choice(_WEIRD_VALUES))
        elif choice == 1 and isinstance(parent, dict):
            del parent[key]
        elif choice == 2:
            nested: Any = parent[key]
            for _ in range(rng.choice([2, 50, 400])):
                nested = [nested]
            parent[key] = nested
            return document  # no further walks through the deep nest
        elif choice == 3 and isinstance(parent, dict):
            parent[rng.choice(["unknownField", "time_unix_nano", "asInt", "bucketCounts"])] = (
                copy.deepcopy(rng.choice(_WEIRD_VALUES))
            )
        elif isinstance(parent[key], list):
            parent[key] = copy.deepcopy(parent[key] * rng.randint(0, 30))
    return document


_WEIRD_FLOATS = [0.0, -0.0, -1.0, 1e-300, 1e300, float("nan"), float("inf"), -float("inf"), 5e-324]
_WEIRD_INTS = [0, 1, -1, 2**31 - 1, -(2**31), 2**62, 7, 1000]
_WEIRD_STRINGS = ["", " ", "a,b=c d", "\\", '"', "\n", "é", "x" * 300, "\u2028", "stepwatch.phase"]


def _is_repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6
    if repeated is not None:
        return bool(repeated)
    return bool(field.label == field.LABEL_REPEATED)


def _mutate_message(message: Any, rng: random.Random) -> None:
    """Set one field somewhere in ``message`` to a hostile but well-typed value."""
    from google.protobuf.descriptor import FieldDescriptor

    fields: list[tuple[Any, Any]] = []

    def collect(node: Any) -> None:
        for field in node.DESCRIPTOR.fields:
            fields.append((node, field))
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if _is_repeated(field):
                    for child in getattr(node, field.name):
                        collect(child)
                elif node.HasField(field.name):
                    collect(getattr(node, field.name))

    collect(message)
    node, field = rng.choice(fields)
    repeated = _is_repeated(field)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        container = getattr(node, field.name)
        if repeated:
            if len(container) and rng.random() < 0.5:
                del container[rng.randrange(len(container))]
            else:
                container.add()
        else:
            container.SetInParent()
        return
    kind = field.cpp_type
    if kind in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        value: Any = rng.choice(_WEIRD_FLOATS)
    elif kind == FieldDescriptor.CPPTYPE_STRING:
        value = rng.choice(_WEIRD_STRINGS)
        if field.type == FieldDescriptor.TYPE_BYTES:
            value = value.encode()
    elif kind == FieldDescriptor.CPPTYPE_BOOL:
        value = rng.random() < 0.5
    elif kind == FieldDescriptor.CPPTYPE_ENUM:
        value = rng.choice([0, 1, 2, 3])
    else:
        value = (
            abs(rng.choice(_WEIRD_INTS))
            if "UINT" in str(kind)
            or kind
            in (
                FieldDescriptor.CPPTYPE_UINT32,
                FieldDescriptor.CPPTYPE_UINT64,
            )
            else rng.choice(_WEIRD_INTS)
        )
        if kind == FieldDescriptor.CPPTYPE_INT32 or kind == FieldDescriptor.CPPTYPE_UINT32:
            value = max(
                min(value, 2**31 - 1), -(2**31) if kind == FieldDescriptor.CPPTYPE_INT32 else 0
            )
    try:
        if repeated:
            container = getattr(node, field.name)
            if len(container) and rng.random() < 0.5:
                container[rng.randrange(len(container))] = value
            else:
                container.append(value)
        else:
            setattr(node, field.name, value)
    except (TypeError, ValueError):
        pass  # a value the type cannot hold: leave the field as it was


def fuzz_cases(seed: int, count: int) -> Iterator[tuple[str, str, dict[str, str], bytes]]:
    """(transport, description, headers, body) for ``count`` deterministic cases."""
    from google.protobuf import json_format

    rng = random.Random(seed)
    requests = seed_requests()
    binary = [request.SerializeToString() for request in requests]
    documents = [json.loads(json_format.MessageToJson(request)) for request in requests]
    for index in range(count):
        kind = rng.random()
        headers = {"Content-Type": "application/x-protobuf"}
        if kind < 0.3:  # well-formed messages with hostile values, both transports
            message = copy.deepcopy(rng.choice(requests))
            for _ in range(rng.randint(1, 4)):
                _mutate_message(message, rng)
            if rng.random() < 0.3:
                transport = "http"
                headers = {"Content-Type": "application/json"}
                body = json_format.MessageToJson(message).encode()
            else:
                transport = rng.choice(["grpc", "http"])
                body = message.SerializeToString()
            description = f"{transport}-semantic"
        elif kind < 0.4:
            transport = "grpc"
            body = _mutate_bytes(rng.choice(binary), rng, binary)
            description = "grpc-protobuf"
        elif kind < 0.6:
            transport = "http"
            body = _mutate_bytes(rng.choice(binary), rng, binary)
            description = "http-protobuf"
        elif kind < 0.9:
            transport = "http"
            headers = {"Content-Type": "application/json"}
            if rng.random() < 0.7:
                document = _mutate_json(rng.choice(documents), rng)
                body = json.dumps(document).encode()
            else:
                body = _mutate_bytes(json.dumps(rng.choice(documents)).encode(), rng, binary)
            description = "http-json"
        else:
            transport = "http"
            body = _mutate_bytes(rng.choice(binary), rng, binary)
            headers = {
                "Content-Type": rng.choice(
                    ["text/plain", "application/x-protobuf; charset=x", "", "application/JSON"]
                )
            }
            description = "http-headers"
        if transport == "http" and rng.random() < 0.15:
            body = gzip.compress(body)
            if rng.random() < 0.3:
                body = _mutate_bytes(body, rng, binary)
            headers["Content-Encoding"] = "gzip"
        del index
        yield transport, description, headers, body


def run_fuzz(
    bridge: Any, *, cases: int, seed: int, timeout_s: float = 10.0, progress: bool = False
) -> FuzzResult:
    """Send ``cases`` mutated requests to a started Bridge; classify every answer."""
    result = FuzzResult()
    failures: list[str] = []
    previous_hook = threading.excepthook

    def hook(args: Any) -> None:
        failures.append(f"{args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    connection = http.client.HTTPConnection("127.0.0.1", bridge.http_port, timeout=timeout_s)
    export, close_channel = grpc_sender(bridge.grpc_endpoint, timeout_s=timeout_s)
    started = time.perf_counter()
    try:
        for transport, description, headers, body in fuzz_cases(seed, cases):
            result.cases += 1
            if transport == "grpc":
                answer, _ = export(body)
                code = answer.removeprefix("grpc:")
                if code == "DEADLINE_EXCEEDED":
                    result.hangs += 1
                elif code not in OK_GRPC:
                    result.crashes.append(f"{description}: gRPC {code}")
                result.answers[answer] += 1
                continue
            try:
                status, _ = post_metrics(connection, body, headers)
            except TimeoutError:
                result.hangs += 1
                connection.close()
                continue
            except (OSError, http.client.HTTPException) as exc:
                result.crashes.append(f"{description}: {type(exc).__name__} {exc}")
                connection.close()
                continue
            result.answers[f"http:{status}"] += 1
            if status not in OK_HTTP:
                result.crashes.append(f"{description}: HTTP {status}")
            if progress and result.cases % 10_000 == 0:
                rate = result.cases / (time.perf_counter() - started)
                print(f"  {result.cases} cases, {rate:.0f}/s", flush=True)
    finally:
        result.seconds = time.perf_counter() - started
        connection.close()
        close_channel()
        threading.excepthook = previous_hook
    result.handler_exceptions = len(failures)
    result.crashes.extend(failures[:20])
    return result


class _NullWriter:
    def __init__(self) -> None:
        self.lines = 0

    def write_lines(self, lines: Sequence[str]) -> None:
        self.lines += len(lines)

    def close(self) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--influx", action="store_true", help="write to a managed influxd")
    args = parser.parse_args(argv)

    from stepwatch.core import ManagedInfluxDB
    from stepwatch.otel_bridge import Bridge, InfluxV1Writer

    with tempfile.TemporaryDirectory() as directory:
        influxd = ManagedInfluxDB(directory).start() if args.influx else None
        writer: Any = InfluxV1Writer(influxd.client()) if influxd else _NullWriter()
        bridge = Bridge(writer, max_request_bytes=1 << 20, flush_interval_s=0.05).start()
        try:
            print(f"fuzzing {bridge.http_url} and {bridge.grpc_endpoint}: {args.cases} cases")
            result = run_fuzz(bridge, cases=args.cases, seed=args.seed, progress=True)
            bridge.forwarder.wait_idle(30)
            refused = bridge.metrics.dropped.labels(reason="influx_refused")._value.get()
            written = bridge.metrics.written._value.get()
        finally:
            bridge.stop()
            if influxd is not None:
                influxd.stop()
    print(
        f"cases: {result.cases} in {result.seconds:.1f} s ({result.cases / result.seconds:.0f}/s)"
    )
    print(
        "answers: " + ", ".join(f"{key}={value}" for key, value in sorted(result.answers.items()))
    )
    print(
        f"crashes: {len(result.crashes)}  hangs: {result.hangs}  "
        f"handler exceptions: {result.handler_exceptions}"
    )
    print(f"points written: {written:.0f}  refused by InfluxDB: {refused:.0f}")
    for crash in result.crashes[:20]:
        print(f"  {crash}")
    return 0 if result.ok and refused == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
