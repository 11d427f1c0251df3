"""Reading Kineto traces: step split, kernel assignment, phases, and clear format errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from stepwatch.core._errors import TraceFormatError
from stepwatch.exporters.kernels import parse_trace, read_trace
from stepwatch.exporters.kernels._trace import phase_of_annotation, rank_from_file_name


def test_dlrm_rank0_fixture(dlrm_rank0: Path) -> None:
    trace = read_trace(dlrm_rank0)
    assert (trace.rank, trace.world_size, trace.device_kind) == (0, 8, "gpu")
    assert trace.base_time_unix_nano is None
    assert [step.index for step in trace.steps] == [10]
    step = trace.steps[0]
    assert step.duration_s == pytest.approx(14455e-6, abs=1e-9)
    # 245 kernels + 16 memcpys, all launched inside ProfilerStep#10 (by correlation id).
    assert len(step.kernels) == 261
    assert {"forward", "backward", "optimizer", "data", "other"} <= set(step.phases_s)
    assert sum(step.phases_s.values()) == pytest.approx(step.duration_s, abs=1e-8)


def test_all_dlrm_ranks_and_hta(dlrm_traces: list[Path], hta_traces: list[Path]) -> None:
    ranks = [read_trace(path).rank for path in dlrm_traces]
    assert ranks == list(range(8))
    for path in hta_traces:
        trace = read_trace(path)
        assert trace.world_size == 128
        assert [step.index for step in trace.steps] == [551, 552]
        for step in trace.steps:
            assert step.kernels
            # Every kernel was launched from inside its step.
            assert all(event.duration_ns >= 0 for event in step.kernels)


def test_cpu_only_trace_uses_self_times_and_base_time(cpu_trace: Path) -> None:
    trace = read_trace(cpu_trace)
    assert trace.device_kind == "cpu"
    assert trace.base_time_unix_nano is not None
    assert [step.index for step in trace.steps] == [1, 2, 3]
    names = {event.name for step in trace.steps for event in step.kernels}
    assert {"aten::addmm", "aten::linear", "aten::relu"} <= names
    for step in trace.steps:
        assert {"forward", "backward", "optimizer"} <= set(step.phases_s)
        assert all(step.start_ns <= event.start_ns <= step.end_ns for event in step.kernels)
        # Self times never double count: they add up to the top-level ops' time.
        assert step.busy is not None
        own = sum(event.duration_ns for event in step.kernels)
        top = sum(event.duration_ns for event in step.busy)
        assert own == top
        assert top <= step.end_ns - step.start_ns


def test_flows_assign_kernels_when_correlation_ids_are_missing() -> None:
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "ProfilerStep#1",
            "pid": 1,
            "tid": 1,
            "ts": 0,
            "dur": 100,
        },
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "ProfilerStep#2",
            "pid": 1,
            "tid": 1,
            "ts": 100,
            "dur": 100,
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 1,
            "tid": 1,
            "ts": 90,
            "dur": 5,
        },
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 7, "pid": 1, "tid": 1, "ts": 90},
        # Runs during step 2 on the device, but was launched in step 1.
        {
            "ph": "X",
            "cat": "kernel",
            "name": "volta_sgemm_128x32_nt",
            "pid": 0,
            "tid": 7,
            "ts": 150,
            "dur": 20,
            "args": {"device": 0},
        },
        {
            "ph": "f",
            "cat": "ac2g",
            "name": "ac2g",
            "id": 7,
            "pid": 0,
            "tid": 7,
            "ts": 150,
            "bp": "e",
        },
    ]
    trace = parse_trace({"traceEvents": events})
    assert [len(step.kernels) for step in trace.steps] == [1, 0]


def test_phase_markers() -> None:
    assert phase_of_annotation("## forward ##") == "forward"
    assert phase_of_annotation("## zero_grad ##") == "optimizer"
    assert phase_of_annotation("Optimizer.step#Adagrad.step") == "optimizer"
    assert (
        phase_of_annotation("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__") == "data"
    )
    assert phase_of_annotation("## alltoall_fwd_single ##") is None
    assert phase_of_annotation("nccl:all_reduce") is None


def test_rank_from_file_name() -> None:
    assert rank_from_file_name("sampled_rank-1.json.gz") == 1
    assert rank_from_file_name("/x/worker7_step_12.1694128201553.pt.trace.json") == 7
    assert rank_from_file_name("trace.json") is None


def test_truncated_json_names_file_and_position(tmp_path: Path, dlrm_rank0: Path) -> None:
    data = gzip.decompress(dlrm_rank0.read_bytes())
    path = tmp_path / "rank-3.json"
    path.write_bytes(data[:100_000])
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    message = str(info.value)
    assert str(path) in message
    assert "line" in message and "column" in message
    assert "of 100000)" in message


def test_truncated_gzip_names_file(tmp_path: Path, dlrm_rank0: Path) -> None:
    path = tmp_path / "rank-3.json.gz"
    path.write_bytes(dlrm_rank0.read_bytes()[:20_000])
    with pytest.raises(TraceFormatError, match=r"rank-3\.json\.gz: gzip stream truncated"):
        read_trace(path)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("[1, 2", "malformed or truncated JSON"),
        ('"text"', "top level is a string"),
        ('{"schemaVersion": 1}', "no 'traceEvents' array"),
        (
            '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1}]}',
            "no ProfilerStep#N spans",
        ),
        (
            '{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1"}]}',
            "malformed trace event",
        ),
    ],
)
def test_malformed_documents(tmp_path: Path, document: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(document)
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "absent.json")


def test_progress_reports_large_reads(tmp_path: Path, dlrm_rank0: Path) -> None:
    path = tmp_path / "rank-0.json"
    path.write_bytes(gzip.decompress(dlrm_rank0.read_bytes()))
    messages: list[str] = []
    read_trace(path, progress=messages.append, progress_every_bytes=100_000)
    assert messages and all(str(path) in message for message in messages)


def test_chrome_array_format(dlrm_rank0: Path) -> None:
    events = json.loads(gzip.decompress(dlrm_rank0.read_bytes()))["traceEvents"]
    trace = parse_trace(events)
    assert trace.rank is None and len(trace.steps) == 1
