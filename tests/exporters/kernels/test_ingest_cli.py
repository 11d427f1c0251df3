"""``stepwatch ingest`` end to end against a real bridge and InfluxDB (HTTP and gRPC)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from stepwatch.app._cli import main
from stepwatch.app._ingest_command import parse_time_origin
from stepwatch.core import InfluxClient
from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge import Bridge, InfluxV1Writer


def _count(influx: InfluxClient, job: str) -> int:
    series = influx.query(
        f'SELECT count("count") FROM "stepwatch.step.duration" WHERE "stepwatch.job.id" = \'{job}\''
    )
    return int(series[0].values[0][1]) if series else 0


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_ingest_command(
    influx: InfluxClient,
    hta_traces: list[Path],
    tmp_path: Path,
    protocol: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    truncated = tmp_path / "rank-2.json.gz"
    truncated.write_bytes(hta_traces[0].read_bytes()[:30_000])
    job = f"cli-{protocol.replace('/', '-')}"
    bridge = Bridge(InfluxV1Writer(influx), grpc_port=0, http_port=0).start()
    try:
        endpoint = (
            bridge.http_url if protocol == "http/protobuf" else f"http://{bridge.grpc_endpoint}"
        )
        code = main(
            [
                "ingest",
                *map(str, hta_traces),
                str(truncated),
                "--job",
                job,
                "--endpoint",
                endpoint,
                "--protocol",
                protocol,
                "--time-origin",
                "2026-11-21T20:00:00Z",
            ]
        )
    finally:
        bridge.stop()
    err = capsys.readouterr().err
    assert code == 1  # one file failed, the others were ingested
    assert f"{truncated}: gzip stream truncated" in err
    assert "ingested 2 of 3 traces, exported 4 windows" in err
    assert "1 trace(s) failed" in err
    assert _count(influx, job) == 4  # 2 ranks x 2 steps


def test_ingest_command_success_exit_code(
    influx: InfluxClient, cpu_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bridge = Bridge(InfluxV1Writer(influx), grpc_port=None, http_port=0).start()
    try:
        code = main(["ingest", str(cpu_trace), "--job", "cli-ok", "--endpoint", bridge.http_url])
    finally:
        bridge.stop()
    assert code == 0
    assert "exported 3 windows" in capsys.readouterr().err
    assert _count(influx, "cli-ok") == 3


def test_hostile_files_are_one_line_each_and_cost_only_themselves(
    influx: InfluxClient, hta_traces: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "rank-2.json"
    deep.write_text("[" * 200_000)
    infinite = tmp_path / "rank-1.json"
    text = gzip.decompress(hta_traces[1].read_bytes()).decode()
    kernel = text.index('"cat": "kernel"')
    duration = text.index('"dur": ', kernel)
    end = text.index(",", duration)
    infinite.write_text(text[:duration] + '"dur": 1e400' + text[end:])
    bridge = Bridge(InfluxV1Writer(influx), grpc_port=None, http_port=0).start()
    try:
        code = main(
            [
                "ingest",
                str(hta_traces[0]),
                str(deep),
                str(infinite),
                "--job",
                "cli-hostile",
                "--endpoint",
                bridge.http_url,
                "--max-events",
                "1000000",
            ]
        )
    finally:
        bridge.stop()
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    assert "ingested 2 of 3 traces, exported 4 windows" in err
    (failed,) = [line for line in err.splitlines() if line.startswith("failed: ")]
    assert failed.startswith(f"failed: {deep}: JSON nested deeper than Python's recursion limit")
    (warning,) = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(f"warning: {infinite}: skipped 1 malformed trace event(s) (first: ")
    assert warning.endswith(": 'dur' is inf)")
    assert _count(influx, "cli-hostile") == 4  # 2 ranks x 2 steps


def test_time_origin_forms() -> None:
    assert parse_time_origin("1700000000") == 1_700_000_000_000_000_000
    assert parse_time_origin("2023-11-14T22:13:20Z") == 1_700_000_000_000_000_000
    with pytest.raises(ConfigError, match="--time-origin"):
        parse_time_origin("yesterday")
    with pytest.raises(ConfigError, match="time zone"):
        parse_time_origin("2023-11-14T22:13:20")
