"""CPU per CUPTI record in CuptiSource: the buffer callback's conversion and the export thread's
summary, the old per-record code vs the columns + numpy code, side by side in one run.

CUPTI hands each completed activity buffer to a callback (its worker thread, or the export
thread inside ``activity_flush_all``); both hold the GIL, so every microsecond per record is
taken from the training thread at the record rate (10,000 kernels/s is a modest LLM step).

- ``callback``: converting one buffer's activity objects. Old: one :class:`ActivityRecord` per
  record (``activity_to_record``: seven attribute reads, six ``int()`` calls, a NamedTuple).
  New: ``activities_to_columns`` (five attribute reads, four list appends). The activity
  objects here are plain ``__slots__`` objects shaped like cupti-python's (``kind``, ``start``,
  ``end``, ``device_id``, ``stream_id``, ``correlation_id``, ``name``, ``copy_kind``); the real
  ones read their attributes through Cython properties, dearer per read, so the real gap per
  record is larger in absolute terms (an H100 measured 2.1 us per record for the old code).
- ``summarise``: ``CuptiSource.drain()`` of the buffered records (steps, classes, quantised
  durations, per-device idle; then the summariser's fold). Old: the code before the bulk path,
  copied below (sort ActivityRecords, one KernelEvent each, ``add_step`` per step). New: the
  source on columns with numpy (``summarise_bulk`` + ``KernelSummariser.add_bulk``). Also the
  new per-event fallback (what the source does without numpy).

The workload is the one the H100 run used: tiny kernels back to back (5 us every 6 us), five
names (GEMM, elementwise, reduce, NCCL, memcpy), 1,000 records per step. Each row is the
median of ``--repeat`` runs (thread CPU; the arms alternate) after one warm-up, which also pays
numpy's one-time import; the windows of the three summary paths are checked identical.

Usage: ``.venv/bin/python bench/cupti_cost.py [--records 20000,200000] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from stepwatch.exporters import KernelWindow
from stepwatch.exporters.kernels import ActivityRecord, CuptiSource, KernelEvent, KernelSummariser
from stepwatch.exporters.kernels._cupti_records import activities_to_columns, activity_to_record

NAMES = (
    "ampere_sgemm_128x64_nn",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
    "void at::native::reduce_kernel<512, 1>",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    None,  # a memcpy (HtoD)
)
PER_STEP = 1_000


class Activity:
    """Shaped like a cupti-python activity object."""

    __slots__ = (
        "copy_kind",
        "correlation_id",
        "device_id",
        "end",
        "kind",
        "name",
        "start",
        "stream_id",
    )

    def __init__(self, kind: int, name: str, start: int, correlation_id: int) -> None:
        self.kind = kind
        self.name = name
        self.start = start
        self.end = start + 5_000
        self.device_id = 0
        self.stream_id = 7
        self.correlation_id = correlation_id
        self.copy_kind = 1


def activities(count: int) -> tuple[list[Activity], list[int]]:
    """``count`` activity objects and the step boundaries (one per PER_STEP records)."""
    base = 1_700_000_000_000_000_000
    objects = []
    boundaries = []
    for index in range(count):
        name = NAMES[index % len(NAMES)]
        start = base + index * 6_000
        objects.append(Activity(1 if name is None else 10, name or "", start, index))
        if index % PER_STEP == PER_STEP - 1:
            boundaries.append(start + 5_500)
    return objects, boundaries


def old_callback(buffer: Sequence[Any]) -> list[ActivityRecord]:
    """The buffer callback before the columns: one ActivityRecord per record."""
    records = []
    for activity in buffer:
        record = activity_to_record(activity)
        if record is not None:
            records.append(record)
    return records


def old_drain(records: list[ActivityRecord], boundaries: Sequence[int]) -> KernelWindow:
    """``CuptiSource._summarise`` + the summariser's drain before the bulk path (verbatim)."""
    summariser = KernelSummariser()
    last_boundary_ns: int | None = boundaries[0] - 6_000 * PER_STEP
    records.sort(key=lambda record: record.start_ns)
    position = 0
    for boundary_ns in boundaries:
        step_start = last_boundary_ns
        events: list[KernelEvent] = []
        while position < len(records) and records[position].start_ns <= boundary_ns:
            record = records[position]
            events.append(
                KernelEvent(
                    record.name,
                    record.start_ns,
                    max(0, record.end_ns - record.start_ns),
                    record.device_id,
                )
            )
            position += 1
        if step_start is None:
            summariser.add_events(events)
        else:
            summariser.add_step(events, start_ns=step_start, end_ns=boundary_ns)
        last_boundary_ns = boundary_ns
    return summariser.drain()


class _Clock:
    """A CuptiBackend whose clock the bench sets; records are delivered by the bench."""

    def __init__(self) -> None:
        self.now_ns = 0

    def enable(self, on_records: Callable[..., None]) -> None:
        pass

    def flush(self) -> None:
        pass

    def timestamp_ns(self) -> int:
        return self.now_ns

    def disable(self) -> None:
        pass


def new_drain(buffer: Sequence[Any], boundaries: Sequence[int], *, bulk: bool) -> tuple[float, Any]:
    """Seconds of ``CuptiSource.drain()`` over the columns of ``buffer`` (setup not timed)."""
    clock = _Clock()
    source = CuptiSource(backend=clock, max_buffered_records=len(buffer) + 1)
    source._bulk = bulk
    clock.now_ns = boundaries[0] - 6_000 * PER_STEP
    source.on_step_end(0)
    for step, boundary in enumerate(boundaries, start=1):
        clock.now_ns = boundary
        source.on_step_end(step)
    source._on_records(activities_to_columns(buffer))
    start = time.thread_time()
    window = source.drain()
    elapsed = time.thread_time() - start
    assert source._bulk == bulk  # the bulk arm really ran on numpy
    return elapsed, window


def _medians(arms: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Median seconds of each arm; the arms alternate run by run (drift hits all alike)."""
    for run in arms.values():
        run()  # warm-up (numpy's import, caches)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeat):
        for name, run in arms.items():
            times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def _timed(call: Callable[[], Any]) -> float:
    start = time.thread_time()
    call()
    return time.thread_time() - start


def _same(first: KernelWindow, second: KernelWindow) -> bool:
    return (
        dict(first.durations_s) == dict(second.durations_s)
        and first.idle_durations_s == second.idle_durations_s
    )


def measure(count: int, repeat: int) -> list[tuple[int, str, float, float]]:
    """Rows ``(records, stage, old seconds, new seconds)`` for ``count`` records."""
    buffer, boundaries = activities(count)
    records = old_callback(buffer)
    old_window = old_drain(list(records), boundaries)
    _, bulk_window = new_drain(buffer, boundaries, bulk=True)
    _, event_window = new_drain(buffer, boundaries, bulk=False)
    assert _same(old_window, bulk_window) and _same(old_window, event_window)
    median = _medians(
        {
            "convert_old": lambda: _timed(lambda: old_callback(buffer)),
            "convert_new": lambda: _timed(lambda: activities_to_columns(buffer)),
            "summarise_old": lambda: _timed(lambda: old_drain(list(records), boundaries)),
            "summarise_new": lambda: new_drain(buffer, boundaries, bulk=True)[0],
            "summarise_events": lambda: new_drain(buffer, boundaries, bulk=False)[0],
        },
        repeat,
    )
    return [
        (count, "callback (convert)", median["convert_old"], median["convert_new"]),
        (count, "export (summarise)", median["summarise_old"], median["summarise_new"]),
        (count, "export, no numpy", median["summarise_old"], median["summarise_events"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default="20000,200000", help="comma-separated counts")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = [row for value in args.records.split(",") for row in measure(int(value), args.repeat)]
    print("thread CPU per record, microseconds (medians of alternating runs; old = the per-record")
    print("code before the columns, new = columns + numpy; 'no numpy': the new per-event fallback)")
    header = f"{'records':>8} {'stage':20} {'old us':>8} {'new us':>8} {'old/new':>8}"
    print(header)
    print("-" * len(header))
    for count, stage, old, new in rows:
        print(
            f"{count:8d} {stage:20} {old * 1e6 / count:8.3f} {new * 1e6 / count:8.3f} "
            f"{old / new:7.1f}x"
        )
    for count in sorted({row[0] for row in rows}):
        by_stage = {row[1]: row for row in rows if row[0] == count}
        old = by_stage["callback (convert)"][2] + by_stage["export (summarise)"][2]
        new = by_stage["callback (convert)"][3] + by_stage["export (summarise)"][3]
        print(
            f"{count}: callback + summary {old * 1e6 / count:.2f} -> {new * 1e6 / count:.2f} us "
            f"per record ({old / new:.1f}x); at 10,000 records/s: {old * 1e6 / count:.1f}% -> "
            f"{new * 1e6 / count:.1f}% of a core"
        )


if __name__ == "__main__":
    main()
