"""Hostile trace files: each costs only itself, with one line naming it; bad events are counted."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from stepwatch.core._errors import ConfigError, TraceFormatError
from stepwatch.exporters.kernels import ingest_traces, read_trace

_MARK = 987654321.125  # stands for a raw JSON token json.dumps cannot write (1e400, NaN ...)


class CountingExporter:
    """A real :class:`MetricsExporter` that accepts and counts every window."""

    def __init__(self) -> None:
        self.windows = 0

    def export(self, metrics_data: MetricsData, /) -> MetricExportResult:
        self.windows += 1
        return MetricExportResult.SUCCESS


@pytest.fixture(scope="module")
def rank0_document(dlrm_rank0: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(gzip.decompress(dlrm_rank0.read_bytes()))
    return document


def _with_token(
    document: dict[str, Any], path: Path, *, cat: str, key: str, token: str, name: str = ""
) -> int:
    """Write ``document`` to ``path`` with ``key`` of its first ``cat`` event (named ``name``
    when given) set to the raw JSON ``token``; the event's index in ``traceEvents``."""
    changed = copy.deepcopy(document)
    events = changed["traceEvents"]
    index = next(
        position
        for position, event in enumerate(events)
        if event.get("cat") == cat and (not name or event.get("name") == name)
    )
    events[index][key] = _MARK
    text = json.dumps(changed)
    assert text.count(repr(_MARK)) == 1
    path.write_text(text.replace(repr(_MARK), token))
    return index


@pytest.mark.parametrize(
    "text",
    [
        "[" * 200_000,
        '{"traceEvents": [' + "[" * 200_000,
        '{"traceEvents": [{"ph": "X", "args": ' + "[" * 100_000 + "]" * 100_000 + "}]}",
    ],
    ids=["top-level", "in-traceEvents", "in-args"],
)
def test_deep_nesting_costs_only_its_file(
    text: str, dlrm_traces: list[Path], tmp_path: Path
) -> None:
    hostile = tmp_path / "rank-5.json"
    hostile.write_text(text)
    exporter = CountingExporter()
    result = ingest_traces(
        [dlrm_traces[0], hostile, dlrm_traces[1]],
        job_id="j",
        exporter=exporter,
        time_origin_unix_nano=0,
    )
    assert [trace.rank for trace in result.traces] == [0, 1]
    assert exporter.windows == 2
    (failure,) = result.failures
    assert failure.path == str(hostile)
    assert failure.message.startswith(
        f"{hostile}: JSON nested deeper than Python's recursion limit at line 1 column "
    )
    assert failure.message.endswith("; a trace event is a flat object")


def test_an_infinite_duration_is_skipped_and_counted(
    rank0_document: dict[str, Any], dlrm_traces: list[Path], tmp_path: Path
) -> None:
    hostile = tmp_path / "rank-0.json"
    index = _with_token(rank0_document, hostile, cat="kernel", key="dur", token="1e400")
    exporter = CountingExporter()
    messages: list[str] = []
    result = ingest_traces(
        [hostile, *dlrm_traces[1:3]],
        job_id="j",
        exporter=exporter,
        time_origin_unix_nano=0,
        progress=messages.append,
    )
    assert result.ok and exporter.windows == 3
    first = result.traces[0]
    assert (first.path, first.skipped_events) == (str(hostile), 1)
    assert first.first_skipped == f"traceEvents[{index}]: 'dur' is inf"
    assert first.kernels == 261 - 1
    assert [trace.skipped_events for trace in result.traces[1:]] == [0, 0]
    assert any(
        message.startswith(f"{hostile}: ") and "skipped 1 malformed event(s)" in message
        for message in messages
    )


@pytest.mark.parametrize(
    ("cat", "key", "token", "reason", "kernels_lost"),
    [
        ("kernel", "dur", "NaN", "'dur' is nan", 1),
        ("kernel", "dur", "-Infinity", "'dur' is -inf", 1),
        ("kernel", "dur", "-5", "'dur' is negative (-5)", 1),
        ("kernel", "dur", "1e300", "'dur' is 1e+300, outside the int64 nanosecond range", 1),
        ("kernel", "dur", "1" + "0" * 400, "'dur' is 100000000000... (401 digits), outside", 1),
        ("kernel", "dur", '"12"', "'dur' is a string, not a number", 1),
        ("kernel", "dur", "null", "'dur' is null, not a number", 1),
        ("kernel", "ts", '"abc"', "'ts' is a string, not a number", 1),
        ("kernel", "ts", "true", "'ts' is a boolean, not a number", 1),
        ("kernel", "ts", '{"a": [1]}', "'ts' is an object, not a number", 1),
        ("kernel", "pid", "[1, 2]", "'pid' is an array, not a number or a string", 1),
        ("kernel", "name", "{}", "'name' is an object, not a string", 1),
        ("cuda_runtime", "ts", "NaN", "'ts' is nan", 0),
        ("ac2g", "id", "[7]", "'id' is an array, not a number or a string", 0),
        ("ac2g", "ts", "Infinity", "'ts' is inf", 0),
    ],
)
def test_unusable_events_are_skipped_and_counted(
    rank0_document: dict[str, Any],
    dlrm_rank0: Path,
    tmp_path: Path,
    cat: str,
    key: str,
    token: str,
    reason: str,
    kernels_lost: int,
) -> None:
    path = tmp_path / "rank-0.json"
    index = _with_token(rank0_document, path, cat=cat, key=key, token=token)
    trace = read_trace(path)
    assert trace.skipped_events == 1
    assert trace.first_skipped is not None
    assert trace.first_skipped.startswith(f"traceEvents[{index}]: {reason}")
    clean = read_trace(dlrm_rank0)
    assert len(trace.steps[0].kernels) == len(clean.steps[0].kernels) - kernels_lost
    assert trace.steps[0].phases_s == clean.steps[0].phases_s


@pytest.mark.parametrize(
    ("key", "token", "reason"),
    [("ts", "Infinity", "'ts' is inf"), ("dur", "1e400", "'dur' is inf"), ("ts", "[]", "array")],
)
def test_an_unusable_step_span_is_named_in_the_error(
    rank0_document: dict[str, Any], tmp_path: Path, key: str, token: str, reason: str
) -> None:
    path = tmp_path / "rank-0.json"
    index = _with_token(
        rank0_document, path, cat="user_annotation", key=key, token=token, name="ProfilerStep#10"
    )
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    message = str(info.value)
    assert message.startswith(
        f"{path}: no ProfilerStep#N spans; cannot split into steps (1 malformed trace event "
        f"skipped; first: traceEvents[{index}]: "
    )
    assert reason in message


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ({"baseTimeNanoseconds": 10**40}, f"baseTimeNanoseconds is {10**40}; expected 0.."),
        ({"baseTimeNanoseconds": -1}, "baseTimeNanoseconds is -1; expected 0.."),
        (
            {"distributedInfo": {"rank": 2**40, "world_size": 8}},
            "distributedInfo.rank is 1099511627776; expected 0..2147483647",
        ),
        (
            {"distributedInfo": {"rank": 0, "world_size": -3}},
            "distributedInfo.world_size is -3; expected 1..2147483648",
        ),
        ({"host_name": "h" * 1000}, "host_name is 1,000 characters long (at most 255)"),
    ],
)
def test_header_values_out_of_range_are_errors(
    rank0_document: dict[str, Any], tmp_path: Path, members: dict[str, Any], message: str
) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({**rank0_document, **members}))
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value) == f"{path}: {message}" or str(info.value).startswith(
        f"{path}: {message}"
    )


@pytest.mark.parametrize("rank", ["²", "1" * 5000, True, [1], -0.5])
def test_header_values_that_are_no_integers_are_ignored(
    rank0_document: dict[str, Any], tmp_path: Path, rank: object
) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({**rank0_document, "distributedInfo": {"rank": rank}}))
    assert read_trace(path).rank is None


def test_max_events_bounds_what_a_trace_keeps(dlrm_rank0: Path, tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError) as info:
        read_trace(dlrm_rank0, max_events=100)
    assert str(info.value) == (
        f"{dlrm_rank0}: more than 100 kernel, runtime, flow and step events to keep; refused "
        "(raise max_events, or stepwatch ingest --max-events, to ingest it)"
    )
    assert len(read_trace(dlrm_rank0, max_events=2_000).steps) == 1
    result = ingest_traces(
        [dlrm_rank0], job_id="j", exporter=CountingExporter(), max_events=100, clock_unix_nano=int
    )
    assert not result.traces and "more than 100" in result.failures[0].message
    with pytest.raises(ConfigError, match="max_events"):
        ingest_traces([dlrm_rank0], job_id="j", exporter=CountingExporter(), max_events=0)


def test_every_hostile_file_is_one_line_and_the_valid_ones_are_ingested(
    dlrm_traces: list[Path], tmp_path: Path
) -> None:
    hostile = {
        "empty.json": b"",
        "deep.json": b"[" * 100_000,
        "garbage.bin": bytes(range(256)) * 64,
        "truncated.json": dlrm_traces[2].read_bytes()[:100_000],
        "truncated.json.gz": gzip.compress(dlrm_traces[2].read_bytes())[:20_000],
        "spaces.json": b'{"traceEvents": [' + b" " * 1_000_000,
        "string.json": b'{"traceEvents": [], "x": "' + b"a" * (17 << 20),
        "not-a-trace.json": b'{"traceEvents": "no"}',
        "number.json": b"1e400",
    }
    paths = []
    for name, data in hostile.items():
        path = tmp_path / name
        path.write_bytes(data)
        paths.append(path)
    result = ingest_traces(
        [*paths, tmp_path / "missing.json", *dlrm_traces[:2]],
        job_id="j",
        exporter=CountingExporter(),
        time_origin_unix_nano=0,
    )
    assert [trace.rank for trace in result.traces] == [0, 1]
    assert [failure.path for failure in result.failures] == [
        *map(str, paths),
        str(tmp_path / "missing.json"),
    ]
    for failure in result.failures:
        assert failure.message.startswith(f"{failure.path}: ")
        assert "\n" not in failure.message and len(failure.message) < 300
