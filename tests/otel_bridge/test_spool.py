"""Spool, forwarder and the InfluxDB outage: killed, restarted, 0 lost, 0 duplicated."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path

import pytest

from stepwatch.core import ConfigError, ManagedInfluxDB
from stepwatch.core._influx import count_points, wait_until
from stepwatch.otel_bridge import Bridge, BridgeMetrics, DiskSpool, InfluxV1Writer, MemorySpool
from stepwatch.otel_bridge._forwarder import Forwarder
from stepwatch.otel_bridge._spool import Spool
from tests.otel_bridge.otlp_requests import RecordingWriter, post, window_request


def spools(tmp_path: Path, *, max_bytes: int, overflow: str) -> list[DiskSpool | MemorySpool]:
    return [
        DiskSpool(tmp_path / overflow, max_bytes=max_bytes, overflow=overflow),  # type: ignore[arg-type]
        MemorySpool(max_bytes=max_bytes, overflow=overflow),  # type: ignore[arg-type]
    ]


def test_spool_keeps_order_and_replays_after_restart(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=10_000, overflow="drop_oldest")
    for index in range(3):
        assert spool.append([f"m v={index} {index}", f"m v={index} {index + 10}"]).stored
    with pytest.raises(ConfigError, match="in use by another bridge process"):
        DiskSpool(tmp_path, max_bytes=10_000, overflow="drop_oldest")
    spool.close()
    reopened = DiskSpool(tmp_path, max_bytes=10_000, overflow="drop_oldest")
    assert reopened.batches == 3 and reopened.size_bytes == spool.size_bytes
    seen = []
    while (head := reopened.peek()) is not None:
        seen.append(head[1][0])
        reopened.remove(head[0])
    assert seen == ["m v=0 0", "m v=1 1", "m v=2 2"]
    assert reopened.size_bytes == 0 and not list(tmp_path.glob("*.lp"))


@pytest.mark.parametrize("overflow", ["drop_oldest", "drop_newest"])
def test_spool_overflow_policies(tmp_path: Path, overflow: str) -> None:
    line = "m v=1 " + "1" * 20  # 27 bytes + newline
    for spool in spools(tmp_path, max_bytes=100, overflow=overflow):
        results = [spool.append([line.replace("v=1", f"v={i}")]) for i in range(5)]
        assert spool.size_bytes <= 100 and spool.batches == 3
        head = spool.peek()
        assert head is not None
        if overflow == "drop_oldest":
            assert all(result.stored for result in results)
            assert sum(result.dropped_lines for result in results) == 2
            assert head[1][0].startswith("m v=2")
        else:
            assert [result.stored for result in results] == [True, True, True, False, False]
            assert head[1][0].startswith("m v=0")
        assert not spool.append(["x" * 200]).stored  # larger than the whole spool


def test_spool_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="spool_max_bytes"):
        DiskSpool(tmp_path, max_bytes=0, overflow="drop_oldest")
    with pytest.raises(ConfigError, match="spool_overflow"):
        MemorySpool(max_bytes=10, overflow="sideways")  # type: ignore[arg-type]


def bridge_forwarder(
    writer: RecordingWriter, *, spool: Spool, metrics: BridgeMetrics, **options: float
) -> Forwarder:
    """A Forwarder with a default Bridge's delivery options, but for ``options``."""
    parameters = inspect.signature(Forwarder).parameters
    bridge_defaults = inspect.signature(Bridge).parameters
    delivery = {
        name: options.get(name, bridge_defaults[name].default)
        for name, parameter in parameters.items()
        if parameter.kind is parameter.KEYWORD_ONLY
        and name in bridge_defaults
        and name not in ("spool", "clock")
    }
    return Forwarder(writer, spool=spool, metrics=metrics, **delivery)


def test_forwarder_spools_then_replays_in_order_exactly_once() -> None:
    writer = RecordingWriter()
    metrics = BridgeMetrics()
    forwarder = bridge_forwarder(
        writer,
        spool=MemorySpool(max_bytes=1 << 20),
        metrics=metrics,
        batch_max_lines=3,
        flush_interval_s=0.01,
        max_retries=1,
        retry_backoff_s=0.01,
        max_backoff_s=0.05,
    )
    forwarder.start()
    try:
        sent = [f"m v={index} {index}" for index in range(30)]
        assert forwarder.offer(sent[:6])
        assert wait_until(lambda: len(writer.lines) == 6, timeout_s=10)
        writer.available = False
        for start in range(6, 24, 3):
            assert forwarder.offer(sent[start : start + 3])
        assert wait_until(lambda: forwarder.spool.batches > 0, timeout_s=10)
        writer.available = True
        assert forwarder.offer(sent[24:])
        assert wait_until(lambda: len(writer.lines) == 30, timeout_s=10)
        assert writer.lines == sent  # arrival order, nothing twice
        assert forwarder.spool.batches == 0
        assert metrics.written._value.get() == 30
    finally:
        forwarder.stop()


def test_forwarder_counts_refused_batches_as_dropped() -> None:
    writer = RecordingWriter()
    writer.refuse = True
    metrics = BridgeMetrics()
    forwarder = bridge_forwarder(
        writer, spool=MemorySpool(max_bytes=1000), metrics=metrics, flush_interval_s=0.01
    )
    forwarder.start()
    try:
        assert forwarder.offer(["m v=1 1", "m v=2 2"])
        assert wait_until(
            lambda: metrics.dropped.labels(reason="influx_refused")._value.get() == 2,
            timeout_s=10,
        )
        # A 4xx is not retried as it was: the batch is split, each line refused on its own.
        assert writer.attempts == 3
    finally:
        forwarder.stop()


def test_influxdb_killed_and_restarted_while_streaming(tmp_path: Path) -> None:
    """Windows stream over OTLP/HTTP while influxd is SIGKILLed and restarted."""
    influxd = ManagedInfluxDB(tmp_path / "influxd").start()
    client = influxd.client(database="outage")
    bridge = Bridge(
        InfluxV1Writer(client),
        spool_dir=tmp_path / "spool",
        flush_interval_s=0.02,
        batch_max_lines=50,
        max_retries=1,
        retry_backoff_s=0.05,
        max_backoff_s=0.2,
    ).start()
    ranks, windows = 4, 30
    sent_points = 0
    outage_done = threading.Event()
    try:
        for window in range(windows):
            if window == 8:
                influxd.stop(kill=True)
            for rank in range(ranks):
                message = window_request(job="outage", rank=rank, world_size=ranks, window=window)
                body = message.SerializeToString()
                assert (
                    post(bridge.http_url, body, {"Content-Type": "application/x-protobuf"})[0]
                    == 200
                )
                sent_points += 3
            if window == 20:
                # InfluxDB is down: the data must be on disk (after the quick retries).
                assert wait_until(lambda: bridge.forwarder.spool.batches > 0, timeout_s=10)
                assert any((tmp_path / "spool").glob("*.lp"))
                influxd.start()
                outage_done.set()
        assert outage_done.is_set()

        def everything_written() -> bool:
            return (
                count_points(client, "stepwatch.step.last")
                + count_points(client, "stepwatch.step.duration")
                + count_points(client, "stepwatch.phase.duration")
                == sent_points
            )

        assert wait_until(everything_written, timeout_s=60)
        # a batch leaves the spool once its write has returned: just after InfluxDB has it
        assert wait_until(lambda: bridge.forwarder.spool.batches == 0, timeout_s=10)
        metrics = bridge.metrics
        assert metrics.received._value.get() == sent_points
        # Exactly once: InfluxDB holds sent_points, and the bridge wrote each line once.
        assert metrics.written._value.get() == sent_points
        assert metrics.registry.get_sample_value("stepwatch_bridge_spool_bytes") == 0
        assert not list((tmp_path / "spool").glob("*.lp"))
        last = client.query('SELECT max("gauge") FROM "stepwatch.step.last"')[0].values[0][1]
        assert last == (windows - 1) * 4 + 3
    finally:
        bridge.stop()
        influxd.stop()
