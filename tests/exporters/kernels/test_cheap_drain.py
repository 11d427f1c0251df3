"""The op histograms' drain on the export thread (issue 15, twenty-second round): the self-time
pass in C (``_fasthist.self_time``) and the profile read with the accessors it needs only.

The C pass must give :func:`self_time_events_python`'s result element for element (the same
events, the same order, ties included) or hand the spans back to it; the lean reader must read
from a real CPU profile exactly the ops the fully checked reader does.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.exporters import _cext
from stepwatch.exporters.kernels import KernelEvent
from stepwatch.exporters.kernels._summary import self_time_events, self_time_events_python
from stepwatch.exporters.kernels._torch_backend import (
    OpRecord,
    read_kineto_ops,
    read_kineto_ops_checked,
)

_span = st.tuples(
    st.sampled_from(["aten::mm", "aten::add_", "aten::t", "aten::linear", "x"]),
    st.integers(0, 60),
    st.integers(-10, 40),  # added to the start: an end before its start too
    st.sampled_from([1, 2, 2, 9]),
)


_fasthist = _cext.fasthist
needs_c = pytest.mark.skipif(_fasthist is None, reason="the C extension _fasthist is not built")


@needs_c
@settings(max_examples=400, deadline=None)
@given(st.lists(_span, max_size=40))
def test_the_c_pass_gives_the_python_result_element_for_element(
    raw: list[tuple[str, int, int, int]],
) -> None:
    spans = [OpRecord(name, start, start + length, thread) for name, start, length, thread in raw]
    c_result = _fasthist.self_time(spans, KernelEvent)
    assert c_result is not None
    own, top = c_result
    expected_own, expected_top = self_time_events_python(spans)
    assert own == expected_own and top == expected_top
    assert all(type(event) is KernelEvent for event in own + top)
    assert self_time_events(tuple(spans)) == (expected_own, expected_top)


def test_ties_keep_the_input_order_and_threads_their_first_appearance() -> None:
    spans = [
        ("b", 10, 20, 7),
        ("a", 10, 20, 3),  # the same span on another thread, first seen later
        ("c", 10, 20, 7),  # a tie with "b" on the same thread: after it
        ("d", 0, 5, 3),
        ("e", 12, 15, 7),
    ]
    own, top = self_time_events(spans)
    assert (own, top) == self_time_events_python(spans)
    assert [event.name for event in top] == ["d", "b", "a"]
    # "c" nests in "b" (same start and end: the earlier one is the parent), "e" in "c".
    assert {event.name: event.duration_ns for event in own} == {
        "a": 10,
        "b": 0,
        "c": 7,
        "d": 5,
        "e": 3,
    }


@needs_c
@pytest.mark.parametrize(
    "spans",
    [
        [("x", 1 << 70, 5, 1)],  # a start past 64 bits
        [("x", 1, 5.0, 1)],  # a float end
        [("x", 1, 5, "thread")],  # a thread that is not an int
        [("x", 1, 5)],  # three fields
        [("x", 1, 5, True)],  # a bool is not an int here
    ],
)
def test_unusual_spans_go_back_to_the_python(spans: list[tuple[object, ...]]) -> None:
    assert _fasthist.self_time(spans, KernelEvent) is None


def test_the_python_handles_what_the_c_gives_back() -> None:
    spans = [("x", 1 << 70, (1 << 70) + 9, 1), ("y", (1 << 70) + 2, (1 << 70) + 4, 1)]
    own, top = self_time_events(spans)
    assert [(e.name, e.duration_ns) for e in own] == [("x", 7), ("y", 2)]
    assert [(e.name, e.duration_ns) for e in top] == [("x", 9)]
    generator = (span for span in spans)  # not a list or tuple: the Python loop
    assert self_time_events(generator) == (own, top)


def test_a_large_random_cycle_matches() -> None:
    rng = random.Random(5)
    spans = []
    for _ in range(3_000):
        start = rng.randrange(10**18, 10**18 + 10**7)
        spans.append(OpRecord("op", start, start + rng.randrange(0, 10**5), rng.choice([5, 6])))
    assert self_time_events(spans) == self_time_events_python(spans)


def test_the_lean_reader_reads_what_the_checked_one_does_from_a_real_profile() -> None:
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = profile(activities=[ProfilerActivity.CPU])
    profiler.start()
    for _ in range(3):
        with record_function("user-range"):  # a user annotation: skipped by both
            loss = model(torch.randn(4, 16)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        profiler.step()  # a ProfilerStep#N annotation: skipped by both
    profiler.stop()
    results = profiler.profiler.kineto_results
    lean = read_kineto_ops(results)
    checked = read_kineto_ops_checked(results)
    assert len(lean) > 20
    assert lean == checked
    assert all(type(op) is OpRecord for op in lean)
    names = {op.name for op in lean}
    assert "aten::addmm" in names
    assert "user-range" not in names and not any(n.startswith("ProfilerStep#") for n in names)
