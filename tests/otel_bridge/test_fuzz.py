"""A bounded slice of bench/bridge_fuzz.py against a live bridge writing to the real influxd.

Every mutated OTLP request (protobuf and JSON, HTTP and gRPC, gzip, hostile field values) must
be answered with a protocol code, and InfluxDB must accept every line the bridge produces.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from stepwatch.core import InfluxClient
from stepwatch.otel_bridge import Bridge, InfluxV1Writer, convert_request
from tests.otel_bridge.otlp_requests import gauge, request

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bridge_fuzz.py"


def load_fuzzer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bridge_fuzz", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fuzz_slice_answers_every_case(influx: InfluxClient) -> None:
    fuzzer = load_fuzzer()
    bridge = Bridge(InfluxV1Writer(influx), max_request_bytes=1 << 20, flush_interval_s=0.02)
    bridge.start()
    try:
        result = fuzzer.run_fuzz(bridge, cases=1_000, seed=20261121)
        assert bridge.forwarder.wait_idle(30)
    finally:
        bridge.stop()
    assert result.cases == 1_000
    assert result.crashes == [] and result.hangs == 0 and result.handler_exceptions == 0
    assert result.answers["http:200"] + result.answers["grpc:OK"] > 100  # not all rejected
    assert bridge.metrics.dropped.labels(reason="influx_refused")._value.get() == 0
    assert bridge.metrics.written._value.get() > 0


def test_trailing_backslash_is_rejected_not_sent() -> None:
    """InfluxDB cannot parse a name or tag value that ends in a backslash."""
    conversion = convert_request(
        request(
            [
                gauge("hw.power", 1.0, attrs={"hw.id": "GPU\\"}),
                gauge("hw.power\\", 1.0),
                gauge("hw.power", 2.0, attrs={"hw.id": "a\\b"}),
            ]
        )
    )
    assert conversion.rejected == {"unrepresentable": 2}
    assert conversion.accepted_points == 1
