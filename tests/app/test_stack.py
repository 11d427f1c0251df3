"""``stepwatch up`` as a user runs it: a real process tree, stopped by Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stepwatch.core import InfluxClient
from stepwatch.core._durations import parse_duration_s
from stepwatch.core._influx import wait_until
from stepwatch.exporters import StepMonitor


def _read_until(process: subprocess.Popen[str], marker: str, *, timeout_s: float) -> list[str]:
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} not printed within {timeout_s} s; got {lines}")


def test_up_starts_managed_influxdb_and_bridge_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stepwatch",
            "up",
            "--data-dir",
            str(tmp_path),
            "--detect-every",
            "off",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = _read_until(process, "running", timeout_s=60)
        text = "\n".join(lines)
        influx_url = re.search(r"InfluxDB:\s+(\S+)", text)
        otlp_http = re.search(r"OTLP/HTTP:\s+(\S+)/v1/metrics", text)
        assert influx_url and otlp_http, text
        assert (tmp_path / "influxdb" / "influxdb.conf").exists()
        with urllib.request.urlopen(f"{otlp_http.group(1)}/metrics", timeout=5) as response:
            assert b"stepwatch_bridge_datapoints_received_total" in response.read()

        monitor = StepMonitor(
            job_id="up-test", rank=0, world_size=1, endpoint=otlp_http.group(1), start=False
        )
        for _ in range(5):
            with monitor.step(), monitor.phase("forward"):
                pass
        assert monitor.export_now(timeout_s=10)
        monitor.close()
        client = InfluxClient(influx_url.group(1), database="stepwatch")
        assert wait_until(
            lambda: bool(client.query('SELECT "count" FROM "stepwatch.step.duration"')),
            timeout_s=15,
        )
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "stopped" in output
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{influx_url.group(1)}/ping", timeout=2)


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("2m", 120.0), ("1h", 3600.0), ("500ms", 0.5), ("7", 7.0)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration_s(text, argument="--every") == seconds


def test_parse_duration_rejects_garbage() -> None:
    from stepwatch.core import ConfigError

    with pytest.raises(ConfigError, match="--every"):
        parse_duration_s("soon", argument="--every")
    with pytest.raises(ConfigError, match="positive"):
        parse_duration_s("0s", argument="--every")


def test_stepwatch_help_lists_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stepwatch", "--help"], capture_output=True, text=True, check=True
    )
    commands = ("up", "demo", "bridge", "ingest", "detect", "simulate", "evaluate", "report", "top")
    for command in commands:
        assert re.search(rf"\b{command}\b", result.stdout), command


def test_version_and_a_bad_log_level_are_answered() -> None:
    from stepwatch.core import __version__

    version = subprocess.run(
        [sys.executable, "-m", "stepwatch", "--version"], capture_output=True, text=True
    )
    assert (version.returncode, version.stdout.strip()) == (0, f"stepwatch {__version__}")
    bad = subprocess.run(
        [sys.executable, "-m", "stepwatch", "--log-level", "LOUD", "top", "--job", "j"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--log-level" in bad.stderr and "LOUD" in bad.stderr
