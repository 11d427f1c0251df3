"""The CUPTI source, driven by activity records recorded in the public Kineto traces.

Kineto writes CUPTI's kernel / memcpy / memset records into its trace (``kernel``,
``gpu_memcpy``, ``gpu_memset`` events with device, stream and correlation id), so the traces
are recorded CUPTI output; :class:`RecordedCupti` replays them through the real callback
protocol: buffers complete asynchronously and only records that have ended are delivered.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from stepwatch.core import _schema
from stepwatch.exporters.kernels import (
    ActivityRecord,
    CuptiSource,
    KernelEvent,
    KernelSummariser,
    classify_kernel,
)
from stepwatch.exporters.kernels._cupti_records import MEMCPY_KIND_NAMES, activity_to_record

_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def recorded_activity(path: Path) -> tuple[list[ActivityRecord], list[tuple[int, int, int]]]:
    """CUPTI records and (step, start_ns, end_ns) host spans from a Kineto trace."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    records = []
    steps = []
    for event in events:
        if event.get("ph") != "X":
            continue
        start = int(event["ts"] * 1000)
        end = start + int(event.get("dur", 0) * 1000)
        if event.get("cat") in _KINDS:
            args = event.get("args", {})
            records.append(
                ActivityRecord(
                    _KINDS[event["cat"]],
                    event["name"],
                    start,
                    end,
                    int(args.get("device", 0)),
                    int(args.get("stream", 0)),
                    int(args.get("correlation", 0)),
                )
            )
        elif str(event.get("name", "")).startswith("ProfilerStep#"):
            steps.append((int(event["name"].split("#")[1]), start, end))
    return records, sorted(steps, key=lambda step: step[1])


class RecordedCupti:
    """A real :class:`CuptiBackend` replaying recorded records on a simulated clock."""

    def __init__(self, records: Sequence[ActivityRecord], *, buffer_records: int = 64) -> None:
        self.pending = sorted(records, key=lambda record: record.end_ns)
        self.now_ns = 0
        self.buffer_records = buffer_records
        self.on_records: Callable[[Sequence[ActivityRecord]], None] | None = None
        self.enabled = False

    def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
        self.on_records = on_records
        self.enabled = True

    def flush(self) -> None:
        # Deliver every record that has completed by now, in buffers, from another thread.
        done = [record for record in self.pending if record.end_ns <= self.now_ns]
        self.pending = [record for record in self.pending if record.end_ns > self.now_ns]
        assert self.on_records is not None
        callback = self.on_records
        buffers = [
            done[i : i + self.buffer_records] for i in range(0, len(done), self.buffer_records)
        ]
        worker = threading.Thread(target=lambda: [callback(buffer) for buffer in buffers])
        worker.start()
        worker.join()

    def timestamp_ns(self) -> int:
        return self.now_ns

    def disable(self) -> None:
        self.enabled = False


def test_hta_trace_replayed_through_cupti_source(hta_traces: list[Path]) -> None:
    records, steps = recorded_activity(hta_traces[0])
    backend = RecordedCupti(records)
    source = CuptiSource(backend=backend)
    (_, first_start, _), (_, _, last_end) = steps[0], steps[-1]
    backend.now_ns = first_start
    source.on_step_end(550)  # collection starts at the first ProfilerStep
    for index, _start, end in steps:
        backend.now_ns = end
        source.on_step_end(index)
    backend.now_ns = last_end + 10**9  # everything has completed on the device
    window = source.drain()
    expected = [r for r in records if first_start < r.start_ns <= last_end]
    assert sum(len(v) for v in window.durations_s.values()) == len(expected)
    classes = {classify_kernel(r.name) for r in expected}
    assert set(window.durations_s) == {(c.name, c.category) for c in classes}
    assert len(window.idle_durations_s) == 2  # one per step after the first boundary
    for idle, (_index, start, end) in zip(window.idle_durations_s, steps, strict=True):
        assert 0 <= idle <= (end - start) / 1e9 + 1.0
    # Same summary as summarising the records directly.
    reference = KernelSummariser()
    reference.add_events(_event(r) for r in sorted(expected, key=lambda record: record.start_ns))
    ref = reference.drain()
    for key, durations in ref.durations_s.items():
        assert sorted(window.durations_s[key]) == sorted(durations)
    source.close()
    assert not backend.enabled


def _event(record: ActivityRecord) -> KernelEvent:
    return KernelEvent(record.name, record.start_ns, record.end_ns - record.start_ns, 0)


def test_records_of_a_running_step_wait_for_the_next_drain(dlrm_rank0: Path) -> None:
    records, ((_, start, end),) = recorded_activity(dlrm_rank0)
    backend = RecordedCupti(records)
    source = CuptiSource(backend=backend)
    backend.now_ns = start
    source.on_step_end(9)
    middle = (start + end) // 2
    backend.now_ns = middle  # the step is still running: nothing is summarised
    assert source.drain().durations_s == {}
    backend.now_ns = end
    source.on_step_end(10)
    backend.now_ns = end + 10**9
    window = source.drain()
    assert sum(len(v) for v in window.durations_s.values()) == sum(
        1 for r in records if start < r.start_ns <= end
    )


def test_bounded_buffer_counts_drops(dlrm_rank0: Path) -> None:
    records, _ = recorded_activity(dlrm_rank0)
    backend = RecordedCupti(records)
    source = CuptiSource(backend=backend, max_buffered_records=100)
    source.on_step_end(0)
    backend.now_ns = 2**62
    source.drain()
    assert source.dropped_records == len(records) - 100


def test_without_cupti_the_source_is_a_quiet_no_op(caplog: pytest.LogCaptureFixture) -> None:
    # cupti-python is not installed here: the real backend's first call fails.
    source = CuptiSource()
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            source.on_step_end(step)
        window = source.drain()
    assert not source.active
    assert window.durations_s == {} and window.idle_durations_s == ()
    assert sum("CUPTI enable failed" in record.message for record in caplog.records) == 1
    source.close()


@dataclasses.dataclass
class _Activity:
    """Shaped like cupti-python's activity objects (``kind``: an int, an enum member, ...)."""

    kind: Any
    start: int = 100
    end: int = 250
    device_id: int = 1
    stream_id: int = 7
    correlation_id: int = 42
    name: str = ""
    copy_kind: int = 0


@pytest.mark.parametrize(
    ("activity", "expected"),
    [
        (
            _Activity(10, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
            ("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
        ),
        (_Activity(3, name="volta_sgemm_128x32_nt"), ("kernel", "volta_sgemm_128x32_nt")),
        (_Activity(1, copy_kind=1), ("memcpy", "Memcpy HtoD")),
        (_Activity(1, copy_kind=8), ("memcpy", "Memcpy DtoD")),
        (_Activity(22), ("memcpy", "Memcpy PtoP")),
        (_Activity(2), ("memset", "Memset")),
    ],
)
def test_activity_to_record(activity: _Activity, expected: tuple[str, str]) -> None:
    record = activity_to_record(activity)
    assert record == ActivityRecord(*expected, 100, 250, 1, 7, 42)
    assert classify_kernel(record.name).category in ("compute", "communication", "memory")


def test_ignored_kinds_and_memcpy_names() -> None:
    assert activity_to_record(_Activity(5)) is None  # RUNTIME
    assert {classify_kernel(name).name for name in MEMCPY_KIND_NAMES.values()} >= {
        "memcpy_htod",
        "memcpy_dtoh",
        "memcpy_dtod",
        "memcpy_ptop",
    }


class EnabledFromCupti(RecordedCupti):
    """As real CUPTI: activities that began before ``enable`` are never recorded."""

    def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
        super().enable(on_records)
        self.pending = [record for record in self.pending if record.start_ns >= self.now_ns]


class _Clock:
    def __init__(self) -> None:
        self.now_ns = 1_000_000_000

    def monotonic_ns(self) -> int:
        return self.now_ns

    def time_ns(self) -> int:
        return self.now_ns


def test_the_first_steps_kernels_are_recorded_from_the_monitors_start(dlrm_rank0: Path) -> None:
    # The source used to enable CUPTI at the first step's end, so that step's kernels were
    # never recorded (seen on an H100). Made with the monitor, it records them: they count in
    # the first window, and that step's idle time (its start unknown to CUPTI) does not.
    from stepwatch.exporters import InMemoryExporter, StepMonitor

    records, ((_, start, end),) = recorded_activity(dlrm_rank0)
    backend = EnabledFromCupti(records)
    backend.now_ns = start - 1
    source = CuptiSource(backend=backend)
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="cupti", rank=0, world_size=1, exporter=exporter, kernel_source=source,
        clock=_Clock(), start=False,
    )  # fmt: skip
    assert backend.enabled
    with monitor.step():
        backend.now_ns = end
    backend.now_ns = end + 10**9
    monitor.close()
    metrics = {
        metric.name: metric.data
        for window in exporter.exported
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
    }
    kernels = metrics[_schema.KERNEL_DURATION].data_points
    expected = sum(1 for record in records if start <= record.start_ns <= end)
    assert expected > 100
    assert sum(point.count for point in kernels) == expected
    assert _schema.DEVICE_IDLE_DURATION not in metrics
    assert not backend.enabled


def test_a_source_that_fails_to_start_leaves_the_monitor_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from stepwatch.exporters import InMemoryExporter, StepMonitor

    class Broken(RecordedCupti):
        def enable(self, on_records: Callable[[Sequence[ActivityRecord]], None]) -> None:
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    exporter = InMemoryExporter()
    with caplog.at_level(logging.WARNING):
        monitor = StepMonitor(
            job_id="cupti", rank=0, world_size=1, exporter=exporter,
            kernel_source=CuptiSource(backend=Broken([])), clock=_Clock(), start=False,
        )  # fmt: skip
        with monitor.step():
            pass
        monitor.close()
    assert monitor.stats.steps_recorded == 1
    assert sum("CUPTI enable failed" in record.message for record in caplog.records) == 1
