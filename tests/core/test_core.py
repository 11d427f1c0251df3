"""The core: line protocol, diagnosis record, rate-limited log, InfluxDB client (real influxd)."""

from __future__ import annotations

import logging
import math

import pytest

import stepwatch.core
from stepwatch.core import ConfigError, Diagnosis, InfluxClient, InfluxError
from stepwatch.core._influx import count_points
from stepwatch.core._lineproto import encode_point


def test_all_is_pinned() -> None:
    assert sorted(stepwatch.core.__all__) == [
        "ConfigError",
        "DeliveryError",
        "Diagnosis",
        "InfluxClient",
        "InfluxError",
        "InfluxUnavailableError",
        "ManagedAlertmanager",
        "ManagedInfluxDB",
        "QuerySeries",
        "ServerStartError",
        "StepwatchError",
        "TraceFormatError",
        "__version__",
        "settings",
    ]
    for name in stepwatch.core.__all__:
        assert hasattr(stepwatch.core, name)


def test_line_protocol_escapes_and_types() -> None:
    line = encode_point(
        "stepwatch.phase.duration",
        {"host.name": "node 1", "stepwatch.phase": "a,b=c", "empty": ""},
        {"count": 3, "sum": 0.5, "note": 'say "hi"', "ok": True},
        1_700_000_000_000_000_000,
    )
    assert line == (
        r"stepwatch.phase.duration,host.name=node\ 1,stepwatch.phase=a\,b\=c "
        r'count=3i,sum=0.5,note="say \"hi\"",ok=true 1700000000000000000'
    )


def test_line_protocol_rejects_non_finite() -> None:
    with pytest.raises(ConfigError):
        encode_point("m", {}, {"v": math.nan}, 1)
    with pytest.raises(ConfigError):
        encode_point("m", {}, {}, 1)


def test_diagnosis_json_round_trip_and_identity() -> None:
    diagnosis = Diagnosis(
        job="run-42",
        kind="compute_straggler",
        ranks=(17,),
        hosts=("node-3",),
        phase="backward",
        kernel_class="gemm",
        start_unix_nano=1_795_000_000_000_000_000,
        end_unix_nano=1_795_000_300_000_000_000,
        severity="critical",
        score=3.4,
        summary="rank 17 backward compute 1.31x peers",
        slowdown=1.27,
    )
    data = diagnosis.to_json_dict()
    assert data["start"] == "2026-11-18T11:06:40Z"
    assert list(data) == [
        "job", "kind", "ranks", "hosts", "phase", "kernel_class",
        "start", "end", "severity", "score", "slowdown", "summary",
    ]  # fmt: skip
    assert Diagnosis.from_json_dict(data) == diagnosis
    # A record from before findings carried their cost reads as free; a cost below 1 is refused.
    older = {key: value for key, value in data.items() if key != "slowdown"}
    assert Diagnosis.from_json_dict(older).slowdown == 1.0
    for bad in (0.9, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="slowdown"):
            Diagnosis.from_json_dict({**data, "slowdown": bad})
    moved = Diagnosis.from_json_dict({**data, "ranks": [18]})
    assert moved.finding_id != diagnosis.finding_id
    # Kinds are the detectors' rules' to declare; the record takes any kind name.
    assert Diagnosis.from_json_dict({**data, "kind": "slow"}).kind == "slow"
    with pytest.raises(ConfigError, match="kind"):
        Diagnosis.from_json_dict({**data, "kind": "Slow rank!"})


def test_influx_client_write_query_round_trip(influx: InfluxClient) -> None:
    lines = [
        encode_point("m.x", {"stepwatch.rank": str(rank)}, {"value": float(rank)}, 10**18 + rank)
        for rank in range(4)
    ]
    assert influx.write_lines(lines) > 0
    series = influx.query('SELECT "value" FROM "m.x" GROUP BY "stepwatch.rank"')
    assert sorted(s.tags["stepwatch.rank"] for s in series) == ["0", "1", "2", "3"]
    assert count_points(influx, "m.x") == 4
    assert count_points(influx, "absent") == 0


def test_influx_client_reports_bad_writes_and_bad_urls(influx: InfluxClient) -> None:
    with pytest.raises(InfluxError) as info:
        influx.write_lines(["this is not line protocol"])
    assert info.value.status == 400
    with pytest.raises(ConfigError, match="url"):
        InfluxClient("localhost:8086")
    assert "Token" not in repr(InfluxClient("http://x:1", token="secret"))


def test_line_protocol_refuses_trailing_backslash(influx: InfluxClient) -> None:
    # InfluxDB 1.x rejects such a point whatever the escaping; we say so before sending.
    with pytest.raises(ConfigError, match="backslash"):
        encode_point("m", {"host.name": "node\\"}, {"value": 1.0}, 1)
    influx.write_lines([encode_point("m", {"host.name": "a\\b"}, {"value": 1.0}, 1)])
    (series,) = influx.query('SHOW TAG VALUES FROM "m" WITH KEY = "host.name"')
    assert series.values == [["host.name", "a\\b"]]


def test_line_protocol_backslashes_round_trip(influx: InfluxClient) -> None:
    influx.write_lines(
        [encode_point("m.b", {"host.name": "a\\ b,c"}, {"note": 'x\\"y\\', "v": 1.0}, 1)]
    )
    (series,) = influx.query('SELECT "host.name", "note" FROM "m.b"')
    assert series.values[0][1:] == ["a\\ b,c", 'x\\"y\\']


def test_diagnosis_location_in_words() -> None:
    base = Diagnosis(
        job="j",
        kind="job_regression",
        start_unix_nano=0,
        end_unix_nano=None,
        severity="warning",
        score=1.0,
        summary="s",
    )
    assert base.location == "job-wide"
    located = Diagnosis.from_json_dict(
        {**base.to_json_dict(), "ranks": [3, 17], "hosts": ["n1"], "phase": "backward"}
    )
    assert located.location == "ranks 3, 17; hosts n1; phase backward"


def test_rate_limited_log_says_one_line_per_key_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from stepwatch.core._ratelog import RateLimitedLog

    now = [100.0]
    log = RateLimitedLog(logging.getLogger("stepwatch.test"), 30.0, clock_s=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="stepwatch.test"):
        for _ in range(3):
            log.warning("down", "export failed: %s", "refused")
        log.log(logging.INFO, "other", "another key is not held back")
        now[0] += 29.9
        log.warning("down", "export failed: %s", "refused")
        now[0] += 0.2
        log.warning("down", "export failed: %s", "timeout")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "export failed: refused"),
        (logging.INFO, "another key is not held back"),
        (logging.WARNING, "export failed: timeout (3 similar messages suppressed)"),
    ]
