"""The streaming trace reader: json.loads' values and error positions, in bounded memory."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.core._errors import TraceFormatError
from stepwatch.exporters.kernels import read_trace
from stepwatch.exporters.kernels._json_stream import TraceDocument

# A small trace with non-ASCII names, so character and byte positions differ.
_SMALL = json.dumps(
    {
        "schemaVersion": 1,
        "distributedInfo": {"rank": 0, "world_size": 2},
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 50},
            {"ph": "X", "cat": "kernel", "name": "k_é_\u4e2d", "ts": 1.5, "dur": 2e1},
            {"ph": "i", "name": "x", "ts": -1, "args": {"a": [True, False, None, "\\n"]}},
        ],
        "traceName": "é",
    },
    indent=1,
    ensure_ascii=False,
)


def _events(path: Path, **options: int) -> tuple[list[object], dict[str, object], int]:
    with TraceDocument(path, keep=("distributedInfo", "traceName"), **options) as document:
        events = list(document.events())
    return events, document.members, document.size_bytes


def _peak_traced_bytes(function: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        function()
    except TraceFormatError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("chunk_bytes", [4, 7, 997, 1 << 20])
def test_events_are_what_json_loads_gives(
    chunk_bytes: int, cpu_trace: Path, hta_traces: list[Path], tmp_path: Path
) -> None:
    for path in (cpu_trace, hta_traces[0]) if chunk_bytes > 7 else (cpu_trace,):
        data = gzip.decompress(path.read_bytes())
        document = json.loads(data)
        events, members, size = _events(path, chunk_bytes=chunk_bytes)
        assert events == document["traceEvents"]
        assert members == {
            key: document[key] for key in ("distributedInfo", "traceName") if key in document
        }
        assert size == len(data)
    small = tmp_path / "small.json"
    small.write_bytes(b"\xef\xbb\xbf" + _SMALL.encode())  # a BOM, as json.loads(bytes) allows
    events, members, _ = _events(small, chunk_bytes=chunk_bytes)
    assert events == json.loads(_SMALL)["traceEvents"]
    assert members == {"distributedInfo": {"rank": 0, "world_size": 2}, "traceName": "é"}


def test_chrome_array_format_streams(tmp_path: Path) -> None:
    path = tmp_path / "array.json"
    path.write_text(json.dumps(json.loads(_SMALL)["traceEvents"]))
    assert _events(path, chunk_bytes=5)[0] == json.loads(_SMALL)["traceEvents"]


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    cut=st.integers(min_value=0, max_value=len(_SMALL) - 1),
    replacement=st.sampled_from([None, *'{}[],:"\\ 0-.eEtnNI\n']),
    chunk_bytes=st.sampled_from([4, 5, 13, 4096]),
)
def test_errors_are_where_json_loads_puts_them(
    tmp_path: Path, cut: int, replacement: str | None, chunk_bytes: int
) -> None:
    # Truncate the document at ``cut``, or replace the character there.
    text = _SMALL[:cut] if replacement is None else _SMALL[:cut] + replacement + _SMALL[cut + 1 :]
    path = tmp_path / "cut.json"
    path.write_bytes(text.encode())
    try:
        expected = json.loads(text)
    except json.JSONDecodeError as exc:
        byte = len(text[: exc.pos].encode())
        with pytest.raises(TraceFormatError) as info:
            _events(path, chunk_bytes=chunk_bytes)
        message = str(info.value)
        if exc.msg == "Extra data" and "not a trace" in message:
            return  # what came before the extra data already was no trace
        assert message.startswith(f"{path}: malformed or truncated JSON at ")
        assert f"line {exc.lineno} column {exc.colno} (byte {byte}" in message
        assert message.endswith(f": {exc.msg}")
        assert "\n" not in message
    else:
        if isinstance(expected, dict) and isinstance(expected.get("traceEvents"), list):
            assert _events(path, chunk_bytes=chunk_bytes)[0] == expected["traceEvents"]
        else:
            with pytest.raises(TraceFormatError, match="not a trace"):
                _events(path, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"traceEvents": [], "traceEvents": []}', "more than one 'traceEvents' member"),
        (b'{"traceEvents": {"a": 1}}', "not a trace ('traceEvents' is an object, not an array)"),
        (b'{"traceEvents": []} []', "line 1 column 21 (byte 20): Extra data"),
        (b'{"traceEvents": [1,]}', "line 1 column 20 (byte 19 of 21): Expecting value"),
        (b'{"traceEvents": [1' + b"0" * 5000 + b"]}", "number too long"),
        (
            '{"traceEvents": ["é", "\udcff"]}'.encode("utf-8", "surrogateescape"),
            "not UTF-8 text at byte 24",
        ),
        (b"", "line 1 column 1 (byte 0 of 0): Expecting value"),
    ],
)
def test_document_errors_name_file_and_position(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    for chunk_bytes in (4, 1 << 20):
        with pytest.raises(TraceFormatError) as info:
            _events(path, chunk_bytes=chunk_bytes)
        assert str(info.value).startswith(f"{path}: ")
        assert message in str(info.value)


def test_a_long_value_is_refused_after_reading_only_it(tmp_path: Path) -> None:
    path = tmp_path / "long.json"
    path.write_text('{"traceEvents": [], "junk": "' + "a" * (40 << 20) + '"}')
    limit = 1 << 20

    def read() -> None:
        with pytest.raises(TraceFormatError, match=r"junk|longer than 1,048,576 characters"):
            _events(path, max_value_chars=limit)

    assert _peak_traced_bytes(read) < 8 * limit
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value) == (
        f"{path}: a value at line 1 column 29 (byte 28) is longer than 16,777,216 characters "
        "(a trace event is a few hundred); not a trace, or malformed"
    )


def test_padding_and_unused_events_cost_no_memory(dlrm_rank0: Path, tmp_path: Path) -> None:
    # 16 MB of whitespace and 50,000 events step splitting does not keep, gzipped: read as a
    # stream, they cost what the trace itself costs (reading it whole cost ~5x the file).
    document = json.loads(gzip.decompress(dlrm_rank0.read_bytes()))
    padded = tmp_path / "rank-0.json.gz"
    text = json.dumps(document)
    head, tail = text.split('"traceEvents": [', 1)
    with gzip.open(padded, "wt", compresslevel=1) as out:
        out.write(head + '"traceEvents": [' + " " * (16 << 20))
        out.write('{"ph": "i", "name": "unused", "ts": 1, "pid": 1, "tid": 1},\n' * 50_000)
        out.write(tail)
    baseline = _peak_traced_bytes(lambda: read_trace(dlrm_rank0))
    assert _peak_traced_bytes(lambda: read_trace(padded)) < baseline + (4 << 20)
    assert read_trace(padded).steps == read_trace(dlrm_rank0).steps
