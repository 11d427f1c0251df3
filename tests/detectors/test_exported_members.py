"""The public surface of stepwatch.detectors and the CLI's import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest

import stepwatch.detectors
from stepwatch.app._cli import build_parser
from stepwatch.app._times import parse_moment
from stepwatch.core import ConfigError
from stepwatch.core._durations import parse_duration_s
from stepwatch.detectors import Fault, Topology, Truth, simulate


def test_all_is_pinned() -> None:
    assert sorted(stepwatch.detectors.__all__) == sorted(
        [
            "AlertmanagerSink",
            "ChangePoint",
            "DetectorConfig",
            "DetectorService",
            "Fault",
            "FaultScore",
            "Finding",
            "GrafanaAnnotationSink",
            "IncrementalDetector",
            "InfluxDiagnosisSink",
            "JobFrame",
            "JsonLinesSink",
            "MemorySink",
            "OutlierTest",
            "PassResult",
            "Score",
            "SimulatedJob",
            "Sink",
            "SuiteSummary",
            "Topology",
            "Truth",
            "TruthFault",
            "analyse",
            "benjamini_hochberg",
            "change_points",
            "cross_rank_outliers",
            "detect_job",
            "detect_job_findings",
            "diagnose",
            "list_jobs",
            "read_diagnoses",
            "read_frame",
            "score",
            "simulate",
            "summarise",
            "write_report",
        ]
    )
    for name in stepwatch.detectors.__all__:
        assert getattr(stepwatch.detectors, name) is not None
    with pytest.raises(AttributeError):
        _ = stepwatch.detectors.no_such_name  # type: ignore[attr-defined]


def test_the_facade_lists_agree() -> None:
    """The façade's typing imports, its lazy map and ``__all__`` name the same things, each
    from the room that exports it."""
    import ast
    import importlib
    from pathlib import Path

    source = Path(stepwatch.detectors.__file__).read_text()
    typed: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "stepwatch.detectors."
        ):
            for alias in node.names:
                typed[alias.name] = (node.module or "").rsplit(".", 1)[1]
    lazy = stepwatch.detectors._EXPORTS
    assert typed == lazy
    assert sorted(lazy) == sorted(stepwatch.detectors.__all__)
    for name, room in lazy.items():
        assert name in importlib.import_module(f"stepwatch.detectors.{room}").__all__, name


def test_cli_module_imports_only_the_standard_library() -> None:
    code = (
        "import sys, stepwatch.app._detect_commands, stepwatch.app._cli;"
        "stepwatch.app._cli.build_parser();"
        "heavy = {'numpy', 'scipy', 'statsmodels', 'opentelemetry'} & {m.split('.')[0] "
        "for m in sys.modules}; print(sorted(heavy))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert output.strip() == "[]"


def test_subcommands_are_registered() -> None:
    parser = build_parser()
    for argv in (
        ["detect", "--job", "j", "--since", "15m"],
        ["simulate", "--ranks", "8"],
        ["evaluate", "--truth", "t.json"],
    ):
        assert callable(parser.parse_args(argv).handler)


def test_durations() -> None:
    assert parse_duration_s("30s", argument="--every") == 30.0
    assert parse_duration_s("15m", argument="--since") == 900.0
    assert parse_duration_s("250ms", argument="--every") == 0.25
    with pytest.raises(ConfigError, match="--every"):
        parse_duration_s("soon", argument="--every")


def test_moments_one_grammar_for_every_command() -> None:
    """RFC 3339, now, now-15m, -6h and Unix nanoseconds, for detect, simulate and report."""
    now = 1_800_000_000 * 10**9
    assert parse_moment("now", argument="--to", now_unix_nano=now) == now
    assert parse_moment("now-1m", argument="--from", now_unix_nano=120 * 10**9) == 60 * 10**9
    assert parse_moment("now-30m", argument="--from", now_unix_nano=now) == now - 1800 * 10**9
    assert parse_moment("-6h", argument="--from", now_unix_nano=now) == now - 6 * 3600 * 10**9
    assert parse_moment("-250ms", argument="--from", now_unix_nano=now) == now - 250 * 10**6
    assert parse_moment("2026-11-21T20:00:00Z", argument="--from", now_unix_nano=0) == (
        1_795_291_200 * 10**9
    )
    assert parse_moment("2027-01-15T08:00:00Z", argument="--from", now_unix_nano=0) == now
    assert parse_moment(str(now), argument="--start", now_unix_nano=0) == now
    with pytest.raises(ConfigError, match="--from"):
        parse_moment("yesterday", argument="--from", now_unix_nano=now)
    with pytest.raises(ConfigError, match="--to"):
        parse_moment("now-soon", argument="--to", now_unix_nano=now)


def test_fault_and_topology_parsing() -> None:
    fault = Fault.parse("link_degradation@120:8-10,12:30%")
    assert (fault.kind, fault.start_step, fault.ranks) == ("link_degradation", 120, (8, 9, 10, 12))
    assert fault.severity == pytest.approx(1.3)
    assert Fault.parse("job_regression@5:all:3x").severity == 3.0
    assert Fault.parse("rank_missing@5:3").ranks == (3,)
    assert Topology.parse("8x2x4") == Topology(8, 2, 4)
    assert Topology.parse("8x2x4").pp_rank(17) == 1
    with pytest.raises(ConfigError, match="topology"):
        Topology.parse("8xx")
    with pytest.raises(ConfigError, match="severity"):
        Fault.parse("jit_stall@5:1:0.5")
    with pytest.raises(ConfigError, match="rank 99"):
        simulate(8, steps=10, faults=[Fault.parse("jit_stall@5:99")])


def test_truth_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    job = simulate(32, steps=20, faults=[Fault.parse("link_degradation@10:9:1.5")], seed=1, job="t")
    path = tmp_path / "truth.json"
    job.truth.write(path)
    again = Truth.read(path)
    assert again == job.truth
    (fault,) = again.faults
    assert fault.hosts == ("node-0001",)
    assert fault.ranks == tuple(range(8, 16))
    with pytest.raises(ConfigError, match="truth"):
        Truth.from_json_dict({"job": "x"})


def test_json_lines_sink_prints_each_state_once() -> None:
    import dataclasses
    import io
    import json

    from stepwatch.core import Diagnosis
    from stepwatch.detectors import JsonLinesSink, MemorySink

    diagnosis = Diagnosis(
        job="j",
        kind="rank_missing",
        ranks=(3,),
        start_unix_nano=1_795_291_200_000_000_000,
        end_unix_nano=None,
        severity="critical",
        score=1.0,
        summary="rank 3 stopped reporting at 20:00:00 (the others still report)",
    )
    closed = dataclasses.replace(diagnosis, end_unix_nano=diagnosis.start_unix_nano + 10**10)
    stream = io.StringIO()
    sink = JsonLinesSink(stream)
    memory = MemorySink()
    for batch in ([diagnosis], [diagnosis], [closed], [closed]):
        sink.publish(batch)
        memory.publish(batch)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["end"] for line in lines] == [None, "2026-11-21T20:00:10Z"]
    assert list(memory.findings.values()) == [closed]
    table = io.StringIO()
    JsonLinesSink(table, json_lines=False).publish([closed])
    assert "rank_missing" in table.getvalue() and "critical" in table.getvalue()
