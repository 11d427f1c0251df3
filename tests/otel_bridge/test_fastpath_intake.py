"""The bridge with its C fast path against the bridge without: same spool, outcomes, metrics.

Two bridges (memory spool, forwarder not started) ingest the same bodies, one through
``Intake.ingest_body`` (the fast path, as both receivers do) and one through the Python path
(``fast_path=False``); the spooled lines, every outcome and the metrics must agree, with the
cardinality guard refusing and throttling and the duplicate-rank guard rejecting.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepwatch.core import ConfigError, settings
from stepwatch.core._influx import wait_until
from stepwatch.otel_bridge import Bridge, _fast
from stepwatch.otel_bridge._convert import convert_request
from stepwatch.otel_bridge._decode import parse_protobuf
from stepwatch.otel_bridge._intake import Outcome
from tests.c_extensions import needs
from tests.otel_bridge.otlp_requests import post

needs_c = needs(_fast.AVAILABLE, "the bridge's C fast path")

NOW_NS = time.time_ns()


class _Unsent:
    def write_lines(self, lines: Any) -> None:  # pragma: no cover - never started
        raise RuntimeError("not sending")

    def close(self) -> None:
        pass


class _Recorder:
    """A writer that keeps what it is given (started bridges)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write_lines(self, lines: Any) -> None:
        self.lines.extend(lines)

    def close(self) -> None:
        pass


def _bridge(fast: bool, clock: list[float], **options: Any) -> Bridge:
    bridge = Bridge(
        _Unsent(),  # type: ignore[arg-type]
        grpc_port=None,
        http_port=0,
        registry=CollectorRegistry(),
        fast_path=fast,
        clock_unix_nano=lambda: NOW_NS,
        **options,
    )
    if bridge.guard is not None:
        bridge.guard.clock = lambda: clock[0]
    return bridge


def _ingest(bridge: Bridge, body: bytes) -> tuple[Outcome, bool]:
    outcome = bridge.intake.ingest_body(body)
    if outcome is not None:
        return outcome, True
    return bridge.intake.ingest(parse_protobuf(body)), False


def _spooled(bridge: Bridge) -> list[str]:
    return [line for _, lines in bridge.forwarder.spool.peek_many(1 << 30) for line in lines]


def _metrics(bridge: Bridge) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in bridge.metrics.registry.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            if sample.name.endswith("_created") or "duration" in sample.name:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def _python_lines(body: bytes) -> list[str]:
    return convert_request(parse_protobuf(body)).lines


def _bodies(seed: int, ranks: int, windows: int, kernels: int) -> list[bytes]:
    from bench.storage_bytes import window

    rng = random.Random(seed)
    bodies = []
    for index in range(windows):
        for rank in range(ranks):
            start = NOW_NS - (windows - index + 2) * 10**10
            request, _ = window(
                rng, rank=rank, ranks=ranks, kernels=kernels, start_ns=start, end_ns=start + 10**10
            )
            bodies.append(bytes(request.SerializeToString()))
    return bodies


@pytest.mark.parametrize(
    ("options", "expect"),
    [
        ({}, "reason=duplicate_rank"),
        ({"max_series_per_rank": 4}, "reason=cardinality_limit"),  # refuses kernel series
        ({"max_new_series_per_s": 2.0}, "reason=series_rate"),  # 429
        ({"max_series_total": 50}, "reason=cardinality_limit"),
    ],
)
@needs_c
def test_fast_and_python_bridges_agree(options: dict[str, Any], expect: str) -> None:
    clock = [time.monotonic()]
    fast, python = _bridge(True, clock, **options), _bridge(False, clock, **options)
    bodies = _bodies(3, ranks=4, windows=3, kernels=6)
    # a second producer claiming rank 1 from another host: duplicate_rank
    intruder = parse_protobuf(bodies[1])
    for item in intruder.resource_metrics[0].resource.attributes:
        if item.key == "host.name":
            item.value.string_value = "intruder"
    handled = 0
    for index, body in enumerate([*bodies, intruder.SerializeToString(), *bodies[:4]]):
        clock[0] += 0.5
        fast_outcome, on_fast_path = _ingest(fast, body)
        python_outcome, python_fast = _ingest(python, body)
        assert not python_fast
        handled += on_fast_path
        assert fast_outcome == python_outcome, index
        assert _spooled(fast) == _spooled(python)
        assert len(fast.guard or ()) == len(python.guard or ())
    assert handled == len(bodies) + 5  # every request took the fast path
    metrics = _metrics(fast)
    assert metrics == _metrics(python)
    assert any(expect in key and value > 0 for key, value in metrics.items()), metrics


@needs_c
def test_forced_python_path_never_calls_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwatch.otel_bridge import _fastpath

    def refuse(*args: Any) -> None:
        raise AssertionError("the fast path ran")

    monkeypatch.setattr(_fastpath, "convert", refuse)
    writer = _Recorder()
    bridge = Bridge(writer, grpc_port=None, http_port=0, fast_path=False)  # type: ignore[arg-type]
    assert bridge.intake.fast_path is False
    body = _bodies(1, ranks=1, windows=1, kernels=2)[0]
    assert bridge.intake.ingest_body(body) is None
    with bridge:  # over HTTP: the Python path answers
        status = post(bridge.http_url, body, {"Content-Type": "application/x-protobuf"})[0]
        assert wait_until(lambda: writer.lines == _python_lines(body), timeout_s=10)
    assert status == 200


def test_missing_extension_logs_once_and_uses_python(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(settings.REQUIRE_C.variable, raising=False)
    monkeypatch.setattr(_fast, "_fastpath", None)
    monkeypatch.setattr(_fast, "AVAILABLE", False)
    monkeypatch.setattr(_fast, "IMPORT_ERROR", "No module named '_fastpath'")
    writer = _Recorder()
    bridge = Bridge(writer, grpc_port=None, http_port=0)  # type: ignore[arg-type]
    assert bridge.intake.fast_path is False
    body = _bodies(1, ranks=1, windows=1, kernels=2)[0]
    with caplog.at_level(logging.WARNING, logger="stepwatch.otel_bridge"), bridge:
        status = post(bridge.http_url, body, {"Content-Type": "application/x-protobuf"})[0]
        assert wait_until(lambda: writer.lines == _python_lines(body), timeout_s=10)
    assert status == 200
    messages = [r.getMessage() for r in caplog.records if "fast path unavailable" in r.getMessage()]
    assert len(messages) == 1
    assert bridge.metrics.registry.get_sample_value("stepwatch_bridge_fast_path") == 0
    monkeypatch.setenv(settings.REQUIRE_C.variable, "1")  # CI: a missing extension is an error
    with pytest.raises(ConfigError, match="STEPWATCH_REQUIRE_C"):
        Bridge(writer, grpc_port=None, http_port=0).start()  # type: ignore[arg-type]


@needs_c
def test_the_bridge_says_which_path_converts(caplog: pytest.LogCaptureFixture) -> None:
    for fast, expected, words in ((True, 1, "C fast path"), (False, 0, "fast_path=False")):
        bridge = Bridge(_Recorder(), grpc_port=None, http_port=0, fast_path=fast)  # type: ignore[arg-type]
        with caplog.at_level(logging.INFO, logger="stepwatch.otel_bridge"), bridge:
            pass
        assert bridge.metrics.registry.get_sample_value("stepwatch_bridge_fast_path") == expected
        assert any(words in record.getMessage() for record in caplog.records)


@needs_c
def test_http_fast_path_answers_as_before() -> None:
    """Malformed bodies still get 400 (parsed after the fast path declines), gzip works."""
    import gzip

    body = _bodies(2, ranks=1, windows=1, kernels=2)[0]
    writer = _Recorder()
    with Bridge(writer, grpc_port=None, http_port=0) as bridge:  # type: ignore[arg-type]
        headers = {"Content-Type": "application/x-protobuf"}
        assert post(bridge.http_url, b"\xff\xff\xff", headers)[0] == 400
        status = post(
            bridge.http_url, gzip.compress(body), {**headers, "Content-Encoding": "gzip"}
        )[0]
        assert status == 200
        assert wait_until(lambda: writer.lines == _python_lines(body), timeout_s=10)
        assert bridge.intake.fast_path


def test_state_gauges_are_read_at_the_scrape() -> None:
    """Queue depth, spool bytes, series and health are computed when the metrics are
    collected (not set per request): they follow the spool and the guard between requests."""
    writer = _Recorder()
    bridge = Bridge(
        writer,  # type: ignore[arg-type]
        grpc_port=None,
        http_port=0,
        registry=CollectorRegistry(),
        clock_unix_nano=lambda: NOW_NS,
    )
    registry = bridge.metrics.registry

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name)  # type: ignore[no-any-return]

    for body in _bodies(4, ranks=2, windows=2, kernels=3):
        outcome, _ = _ingest(bridge, body)
        assert outcome.accepted
    spooled = len(_spooled(bridge))
    assert spooled > 0
    assert sample("stepwatch_bridge_queue_depth") == spooled
    assert sample("stepwatch_bridge_spool_bytes") == bridge.forwarder.spool.size_bytes > 0
    assert sample("stepwatch_bridge_series") == len(bridge.guard or ()) > 0
    assert sample("stepwatch_bridge_healthy") == 1
    with bridge:  # the writer drains the spool: no request in between, the gauges follow
        assert wait_until(lambda: len(writer.lines) == spooled, timeout_s=10)
        assert wait_until(lambda: sample("stepwatch_bridge_queue_depth") == 0, timeout_s=10)
        assert sample("stepwatch_bridge_spool_bytes") == 0


@pytest.mark.parametrize("fast", [pytest.param(True, marks=needs_c), False])
def test_silent_series_are_forgotten_after_the_ttl(fast: bool) -> None:
    """A series is forgotten after series_ttl_s without a point (up to 1/64 of it sooner:
    its time is refreshed at that granularity, on both paths); a series that keeps coming
    is never forgotten, however long the job runs."""
    clock = [1000.0]
    bridge = _bridge(fast, clock, series_ttl_s=640.0, max_new_series_per_s=None)  # 10 s grain
    guard = bridge.guard
    assert guard is not None
    quiet, busy = _bodies(5, ranks=2, windows=1, kernels=2)  # rank 0 stops, rank 1 goes on
    assert _ingest(bridge, busy)[0].accepted
    busy_lines = len(_spooled(bridge))
    assert _ingest(bridge, quiet)[1] is fast
    both = len(guard)
    assert both == len(_spooled(bridge)) and both > busy_lines
    for _ in range(70):  # 700 s: rank 1 every 10 s, rank 0 silent
        clock[0] += 10.0
        assert _ingest(bridge, busy)[0].accepted
    assert len(guard) == busy_lines  # rank 0's series forgotten, rank 1's all kept
    clock[0] += 640.0 - 10.0 - 10.0  # rank 1 silent for just under the ttl minus 1/64
    _ingest(bridge, quiet)
    assert len(guard) == both  # rank 1 still known; rank 0's series are new again
    clock[0] += 640.0 + 0.5
    _ingest(bridge, quiet)
    assert len(guard) == both - busy_lines  # rank 1 silent for longer than the ttl: gone
