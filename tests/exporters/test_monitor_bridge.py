"""StepMonitor → real Bridge (OTLP gRPC and HTTP) → real influxd, including a bridge restart."""

from __future__ import annotations

import time
from typing import Any

import pytest

from stepwatch.core import InfluxClient, _schema
from stepwatch.exporters import StepMonitor

bridge_module = pytest.importorskip("stepwatch.otel_bridge")


@pytest.fixture(autouse=True)
def quiet_exporter_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("CRITICAL", logger="stepwatch.exporters")
    caplog.set_level("CRITICAL", logger="opentelemetry")


def _bridge(influx: InfluxClient, **ports: Any) -> Any:
    options: dict[str, Any] = {"grpc_port": 0, "http_port": 0, "flush_interval_s": 0.05} | ports
    return bridge_module.Bridge(bridge_module.InfluxV1Writer(influx), **options).start()


def _stored_steps(influx: InfluxClient, job_id: str) -> int:
    series = influx.query(
        f'SELECT sum("count") FROM "{_schema.STEP_DURATION}" '
        f"WHERE \"{_schema.JOB_ID}\" = '{job_id}'"
    )
    return int(series[0].values[0][1]) if series else 0


def _wait_for(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.05)


def _steps(monitor: StepMonitor, count: int) -> None:
    for _ in range(count):
        with monitor.step():
            with monitor.phase("forward"):
                pass
            with monitor.phase("backward"):
                pass


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_windows_reach_influxdb_through_the_bridge(influx: InfluxClient, protocol: str) -> None:
    bridge = _bridge(influx)
    try:
        endpoint = (
            f"http://127.0.0.1:{bridge.http_port}"
            if protocol == "http/protobuf"
            else f"http://127.0.0.1:{bridge.grpc_port}"
        )
        job_id = f"e2e-{protocol.replace('/', '-')}"
        monitor = StepMonitor(
            job_id=job_id,
            rank=1,
            world_size=2,
            endpoint=endpoint,
            protocol=protocol,
            export_interval_s=0.05,
        )
        _steps(monitor, 40)
        monitor.close()
        assert monitor.stats.steps_exported == 40
        _wait_for(lambda: _stored_steps(influx, job_id) == 40)
        phases = influx.query(
            f'SELECT sum("count") FROM "{_schema.PHASE_DURATION}" '
            f'WHERE "{_schema.JOB_ID}" = \'{job_id}\' GROUP BY "{_schema.PHASE}"'
        )
        assert {s.tags[_schema.PHASE]: s.values[0][1] for s in phases} == {
            "forward": 40,
            "backward": 40,
        }
    finally:
        bridge.stop()


def test_bridge_killed_and_restarted_while_training(influx: InfluxClient) -> None:
    bridge = _bridge(influx, grpc_port=None)
    port = bridge.http_port
    job_id = "restart"
    monitor = StepMonitor(
        job_id=job_id,
        rank=0,
        world_size=1,
        endpoint=f"http://127.0.0.1:{port}",
        export_interval_s=0.05,
        timeout_s=0.5,
        buffer_steps=500,
    )
    restarted = None
    try:
        _steps(monitor, 30)
        _wait_for(lambda: monitor.stats.steps_exported == 30)
        bridge.stop()
        started = time.perf_counter()
        while monitor.stats.export_failures < 2:
            _steps(monitor, 10)
            time.sleep(0.001)
        _steps(monitor, 10)
        assert time.perf_counter() - started < 30.0
        restarted = _bridge(influx, grpc_port=None, http_port=port)
        exported_before = monitor.stats.steps_exported
        _steps(monitor, 30)
        _wait_for(lambda: monitor.stats.steps_exported > exported_before)
        monitor.close(timeout_s=5.0)
        stats = monitor.stats
        assert stats.steps_recorded == stats.steps_exported + stats.steps_dropped
        assert stats.steps_dropped > 0
        _wait_for(lambda: _stored_steps(influx, job_id) == stats.steps_exported)
    finally:
        monitor.close(timeout_s=1.0)
        bridge.stop()
        if restarted is not None:
            restarted.stop()
