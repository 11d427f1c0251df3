"""CuptiSource's bulk path (numpy) gives exactly the windows of its per-event path.

The per-event path is the reference: one :class:`KernelEvent` per record through
``KernelSummariser.add_events`` / ``add_step``. The bulk path (``summarise_bulk`` on numpy
arrays, ``KernelSummariser.add_bulk``) must give the same class keys in the same order, the
same durations in the same order, the same idle values and the same records carried over to
the next drain, on random records: several devices, overlapping kernels, kernels running past
a boundary, zero and negative durations, records after the last boundary, empty steps, equal
and decreasing boundaries, bounded buffers, several drains.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.exporters import KernelWindow
from stepwatch.exporters.kernels import ActivityRecord, CuptiPythonBackend, CuptiSource, _cupti
from stepwatch.exporters.kernels._cupti_records import (
    ActivityColumns,
    activities_to_columns,
    activity_to_record,
)
from tests.exporters.kernels.test_cupti_source import _Activity

NAMES = (
    "ampere_sgemm_128x64_nn",
    "volta_sgemm_128x32_nt",  # the same class as the one above
    "void at::native::reduce_kernel<512, 1>",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    "Memcpy HtoD",
    "Memset",
)
EPOCH_NS = 1_700_000_000_000_000_000  # CUPTI timestamps are nanoseconds since the epoch
HUNG_NS = 2**61  # a kernel "ending" 73 years later: the bulk path's per-group loop runs

Buffer = tuple[bool, list[ActivityRecord]]  # (delivered as ActivityColumns, records)


@dataclasses.dataclass
class Drain:
    """What happens before one drain: step boundaries, then buffers CUPTI completes."""

    boundaries: list[int]
    buffers: list[Buffer]


class FakeBackend:
    """A :class:`CuptiBackend` on a settable clock; ``flush`` delivers the pending buffers."""

    def __init__(self) -> None:
        self.on_records: Callable[[Sequence[ActivityRecord] | ActivityColumns], None] | None
        self.on_records = None
        self.now_ns = 0
        self.pending: list[Buffer] = []

    def enable(
        self, on_records: Callable[[Sequence[ActivityRecord] | ActivityColumns], None]
    ) -> None:
        self.on_records = on_records

    def flush(self) -> None:
        assert self.on_records is not None
        for columnar, records in self.pending:
            self.on_records(_as_columns(records) if columnar else list(records))
        self.pending = []

    def timestamp_ns(self) -> int:
        return self.now_ns

    def disable(self) -> None:
        pass


def _as_columns(records: Sequence[ActivityRecord]) -> ActivityColumns:
    return ActivityColumns(
        [r.name for r in records],
        [r.start_ns for r in records],
        [r.end_ns for r in records],
        [r.device_id for r in records],
    )


@dataclasses.dataclass
class Run:
    windows: list[KernelWindow]
    source: CuptiSource
    bulk_results: list[bool]  # per summarise_bulk call: did it summarise (not None)?


def run(drains: Sequence[Drain], *, bulk: bool, top_k: int = 48, max_buffered: int = 10**6) -> Run:
    """Feed ``drains`` to a fresh source; ``bulk=False`` forces the per-event path."""
    backend = FakeBackend()
    source = CuptiSource(backend=backend, top_k=top_k, max_buffered_records=max_buffered)
    if not bulk:
        source._bulk = False
    results: list[bool] = []
    real = _cupti.summarise_bulk

    def counting(*args: Any, **kwargs: Any) -> Any:
        summary = real(*args, **kwargs)
        results.append(summary is not None)
        return summary

    windows = []
    step = 0
    with mock.patch.object(_cupti, "summarise_bulk", counting):
        for drain in drains:
            for boundary in drain.boundaries:
                backend.now_ns = boundary
                source.on_step_end(step)
                step += 1
            backend.pending.extend(drain.buffers)
            windows.append(source.drain())
    return Run(windows, source, results)


def assert_same(bulk: Run, reference: Run) -> None:
    assert len(bulk.windows) == len(reference.windows)
    for got, want in zip(bulk.windows, reference.windows, strict=True):
        assert list(got.durations_s) == list(want.durations_s)  # same keys, same order
        for key, durations in want.durations_s.items():
            assert sorted(got.durations_s[key]) == sorted(durations)
            assert got.durations_s[key] == durations  # and the same order inside a class
        assert got.idle_durations_s == want.idle_durations_s
    assert bulk.source._summariser.events == reference.source._summariser.events
    assert bulk.source.dropped_records == reference.source.dropped_records
    assert bulk.source._last_boundary_ns == reference.source._last_boundary_ns
    # The records still waiting for their step: the same, in the same order.
    for field in ("names", "starts", "ends", "devices"):
        assert getattr(bulk.source._columns, field) == getattr(reference.source._columns, field)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Drain], int, int]:
    base = draw(st.sampled_from([1_000, EPOCH_NS]))  # timestamps stay >= 0
    horizon = 12_000
    monotonic = draw(st.booleans())
    drains = []
    clock = 0
    for _ in range(draw(st.integers(1, 4))):
        count = draw(st.integers(0, 4))
        if monotonic:  # CUPTI's clock: gaps of 0 allowed (steps that launched nothing)
            gaps = draw(st.lists(st.integers(0, 3_000), min_size=count, max_size=count))
            boundaries = []
            for gap in gaps:
                clock += gap
                boundaries.append(base + clock)
        else:
            boundaries = [
                base + value
                for value in draw(st.lists(st.integers(0, horizon), min_size=count, max_size=count))
            ]
        buffers: list[Buffer] = []
        for _ in range(draw(st.integers(0, 3))):
            records = [
                ActivityRecord(
                    draw(st.sampled_from(["kernel", "memcpy", "memset"])),
                    draw(st.sampled_from(NAMES)),
                    base + start,
                    base + start + duration,
                    draw(st.integers(0, 3)),
                    draw(st.integers(0, 2)),
                    index,
                )
                for index, (start, duration) in enumerate(
                    draw(
                        st.lists(
                            st.tuples(
                                st.integers(0, horizon),
                                st.integers(-100, 3_500) | st.sampled_from([0, HUNG_NS]),
                            ),
                            max_size=25,
                        )
                    )
                )
            ]
            buffers.append((draw(st.booleans()), records))
        drains.append(Drain(boundaries, buffers))
    top_k = draw(st.sampled_from([1, 2, 48]))
    max_buffered = draw(st.sampled_from([10, 40, 10**6]))
    return drains, top_k, max_buffered


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_bulk_and_per_event_paths_give_the_same_windows(
    scenario: tuple[list[Drain], int, int],
) -> None:
    drains, top_k, max_buffered = scenario
    bulk = run(drains, bulk=True, top_k=top_k, max_buffered=max_buffered)
    reference = run(drains, bulk=False, top_k=top_k, max_buffered=max_buffered)
    assert reference.bulk_results == []
    # Every drain after the first boundary went through summarise_bulk and it summarised.
    drains_enabled = sum(
        1 for index in range(len(drains)) if any(d.boundaries for d in drains[: index + 1])
    )
    assert bulk.bulk_results == [True] * drains_enabled
    assert bulk.source._bulk
    assert_same(bulk, reference)


def _fixed_drains() -> list[Drain]:
    """Two devices, overlaps, a kernel past its boundary, an empty step, a carried record."""
    b = EPOCH_NS

    def rec(name: str, start: int, end: int, device: int) -> ActivityRecord:
        return ActivityRecord("kernel", name, b + start, b + end, device, 7, 0)

    first = [
        rec(NAMES[0], 10, 20, 0),
        rec(NAMES[2], 15, 30, 0),  # overlaps the one above
        rec(NAMES[4], 50, 60, 1),
        rec(NAMES[1], 150, 400, 0),  # runs past the boundary at 300
        rec(NAMES[3], 950, 990, 1),  # after the last boundary: waits for the next drain
    ]
    second = [rec(NAMES[5], 960, 970, 1), rec(NAMES[6], 1_100, 1_150, 0)]
    return [
        Drain([b + 0, b + 100, b + 300, b + 600], [(False, first)]),  # 600: an empty step
        Drain([b + 1_000, b + 1_200], [(True, second)]),
    ]


def test_fixed_case_values() -> None:
    window, second = run(_fixed_drains(), bulk=True).windows
    # Step (0, 100]: device 0 busy [10, 30) → 80 ns idle, device 1 [50, 60) → 90 ns.
    # Step (100, 300]: device 0 busy [150, 400) → span 100..400, idle 50 ns. (300, 600]: empty.
    assert window.idle_durations_s == pytest.approx((80e-9, 90e-9, 50e-9, 300e-9), abs=1e-9)
    assert sum(map(len, window.durations_s.values())) == 4
    assert sum(map(len, second.durations_s.values())) == 3  # the carried record counts now
    # Step (600, 1000]: device 1 busy [950, 990) → 360 ns; (1000, 1200]: device 0 → 150 ns.
    assert second.idle_durations_s == pytest.approx((360e-9, 150e-9), abs=1e-9)


def test_without_numpy_the_per_event_path_gives_the_same(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_numpy = run(_fixed_drains(), bulk=True)
    assert with_numpy.bulk_results == [True, True] and with_numpy.source._bulk
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    with caplog.at_level(logging.DEBUG):
        without = run(_fixed_drains(), bulk=True)
    assert not without.source._bulk
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_same(with_numpy, without)


def test_a_failing_bulk_path_falls_back_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reference = run(_fixed_drains(), bulk=False)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("boom")

    drains = _fixed_drains()
    with caplog.at_level(logging.WARNING):
        backend = FakeBackend()
        source = CuptiSource(backend=backend)
        monkeypatch.setattr(_cupti, "summarise_bulk", broken)
        windows = []
        for step, drain in enumerate(drains + drains[1:]):
            for boundary in drain.boundaries:
                backend.now_ns = boundary + (step // 2) * 10**6
                source.on_step_end(step)
            backend.pending.extend(drain.buffers)
            windows.append(source.drain())
    failures = [r for r in caplog.records if "bulk summary of CUPTI records failed" in r.message]
    assert len(failures) == 1 and not source._bulk
    assert [w.idle_durations_s for w in windows[:2]] == [
        w.idle_durations_s for w in reference.windows
    ]
    assert [w.durations_s for w in windows[:2]] == [w.durations_s for w in reference.windows]


def test_values_beyond_int64_take_the_per_event_path() -> None:
    # An end CUPTI could not stamp (all ones) would overflow int64: the per-event path
    # summarises that drain; the bulk path stays on for the next.
    drains = _fixed_drains()
    broken = ActivityRecord("kernel", NAMES[0], EPOCH_NS + 20, 2**64 - 1, 0, 7, 0)
    drains[0].buffers.append((True, [broken]))
    bulk = run(drains, bulk=True)
    assert bulk.bulk_results == [False, True] and bulk.source._bulk
    assert_same(bulk, run(drains, bulk=False))


def test_a_record_without_timestamps_is_left_out() -> None:
    # A field CUPTI left unfilled (None) fails neither path: the record is left out.
    drains = _fixed_drains()
    unfilled = ActivityColumns([NAMES[0]], [None], [EPOCH_NS + 40], [0])
    backend = FakeBackend()
    source = CuptiSource(backend=backend)
    windows = []
    for step, drain in enumerate(drains):
        for boundary in drain.boundaries:
            backend.now_ns = boundary
            source.on_step_end(step)
        backend.pending.extend(drain.buffers)
        backend.flush()
        source._on_records(unfilled)
        windows.append(source.drain())
    reference = run(drains, bulk=True)
    for got, want in zip(windows, reference.windows, strict=True):
        assert got.durations_s == want.durations_s
        assert got.idle_durations_s == want.idle_durations_s
    assert source._bulk


class _Kind(enum.IntEnum):
    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    MEMCPY2 = 22


class _OpaqueKind:
    """A kind that is no int and hashes unlike one (only ``int()`` gives its value)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


ACTIVITIES = [
    _Activity(10, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL", start=5, end=9),
    _Activity(_Kind.CONCURRENT_KERNEL, name="volta_sgemm_128x32_nt", device_id=3),
    _Activity(3, name="ampere_sgemm_128x64_nn"),
    _Activity(_OpaqueKind(10), name="void at::native::reduce_kernel<512, 1>", start=11),
    _Activity(_OpaqueKind(2), end=300),
    _Activity(_OpaqueKind(5)),
    _Activity(1, copy_kind=1, start=7),
    _Activity(_Kind.MEMCPY, copy_kind=8),
    _Activity(1, copy_kind=99),  # unknown copy kind
    _Activity(22, end=999),
    _Activity(2, device_id=0),
    _Activity(5),  # RUNTIME: ignored
    _Activity(_Kind.RUNTIME),
]


def _expected_columns(activities: Sequence[Any], **kwargs: Any) -> ActivityColumns:
    records = [r for a in activities if (r := activity_to_record(a, **kwargs)) is not None]
    return _as_columns(records)


def test_activities_to_columns_matches_activity_to_record() -> None:
    got = activities_to_columns(ACTIVITIES)
    want = _expected_columns(ACTIVITIES)
    assert len(got) == len(want) == 10
    for field in ("names", "starts", "ends", "devices"):
        assert getattr(got, field) == getattr(want, field)


def test_the_real_backend_delivers_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuptiPythonBackend on a stand-in ``cupti`` module: its buffer callback hands the source
    columns, and the source summarises them as it summarises ActivityRecords."""
    state: dict[str, Any] = {"enabled": [], "now": 0}

    def register(requested: Callable[[], Any], completed: Callable[[Any], None]) -> None:
        state["completed"] = completed

    def flush_all(_forced: int) -> None:
        state["completed"](ACTIVITIES)

    fake = types.SimpleNamespace(
        ActivityKind=_Kind,
        activity_register_callbacks=register,
        activity_enable=state["enabled"].append,
        activity_disable=state["enabled"].remove,
        activity_flush_all=flush_all,
        get_timestamp=lambda: state["now"],
    )
    module = types.ModuleType("cupti")
    module.cupti = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupti", module)
    source = CuptiSource(backend=CuptiPythonBackend())
    source.on_step_end(0)
    state["now"] = 500
    source.on_step_end(1)
    window = source.drain()
    assert source.active and source._bulk
    assert len(state["enabled"]) == 4

    reference_backend = FakeBackend()
    reference = CuptiSource(backend=reference_backend)
    reference.on_step_end(0)
    reference_backend.now_ns = 500
    reference.on_step_end(1)
    records = [r for a in ACTIVITIES if (r := activity_to_record(a)) is not None]
    reference_backend.pending.append((False, records))
    reference._bulk = False
    want = reference.drain()
    assert (
        window.durations_s == want.durations_s and window.idle_durations_s == want.idle_durations_s
    )
    assert sum(map(len, window.durations_s.values())) == 10
    source.close()
    assert state["enabled"] == []
