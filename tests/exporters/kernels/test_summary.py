"""The summariser: busy/idle intervals, top-K folding, bounded cardinality."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core._errors import ConfigError
from stepwatch.exporters import KernelWindow
from stepwatch.exporters.kernels import KernelEvent, KernelSummariser
from stepwatch.exporters.kernels._summary import busy_ns, quantised_seconds, step_idle_s

intervals = st.lists(
    st.tuples(st.integers(0, 1000), st.integers(0, 200)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=40,
)


@settings(deadline=None, derandomize=True)  # reproducible, and never flaky on a loaded CI box
@given(intervals, st.integers(0, 600), st.integers(0, 600))
def test_busy_equals_brute_force_union(pairs: list[tuple[int, int]], a: int, b: int) -> None:
    start, end = min(a, b), max(a, b) + 1
    covered = {t for lo, hi in pairs for t in range(lo, hi) if start <= t < end}
    assert busy_ns(pairs, start_ns=start, end_ns=end) == len(covered)


@settings(deadline=None, derandomize=True)  # reproducible, and never flaky on a loaded CI box
@given(intervals)
def test_busy_ignores_order(pairs: list[tuple[int, int]]) -> None:
    shuffled = list(pairs)
    random.Random(0).shuffle(shuffled)
    assert busy_ns(shuffled, start_ns=0, end_ns=2000) == busy_ns(pairs, start_ns=0, end_ns=2000)


def test_idle_is_span_minus_union_per_device() -> None:
    events = [
        KernelEvent("a", 100, 100, 0),  # [100, 200)
        KernelEvent("b", 150, 100, 0),  # [150, 250) overlaps: counted once
        KernelEvent("c", 400, 100, 0),  # [400, 500)
        KernelEvent("d", 0, 1000, 1),  # device 1 busy for the whole step
    ]
    idle = step_idle_s(events, start_ns=0, end_ns=1000)
    assert idle[0] == pytest.approx((1000 - 250) / 1e9, abs=1e-9)
    assert idle[1] == 0.0


def test_idle_span_extends_to_kernels_finishing_after_the_host_step() -> None:
    events = [KernelEvent("a", 900, 300, 0)]  # ends at 1200, host step ended at 1000
    assert step_idle_s(events, start_ns=0, end_ns=1000)[0] == pytest.approx(900 / 1e9, abs=1e-9)


def test_quantised_seconds_is_close_and_has_a_short_mantissa() -> None:
    value = quantised_seconds(123_456)
    assert value == pytest.approx(123_456e-9, abs=1e-9)
    assert (value * 2**30).is_integer()


def test_top_k_folds_rare_classes_into_other_of_the_same_category() -> None:
    summariser = KernelSummariser(top_k=2)
    events = [
        KernelEvent("volta_sgemm_128x32_nt", 0, 5000),  # gemm, most time
        KernelEvent("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 4000),  # second
        KernelEvent("Memcpy HtoD (Pinned -> Device)", 0, 10),  # memory, folded
        KernelEvent("Memset (Device)", 0, 20),  # memory, folded
        KernelEvent("aten::relu", 0, 30),  # compute, folded
    ]
    summariser.add_step(events, start_ns=0, end_ns=10_000)
    window = summariser.drain()
    assert set(window.durations_s) == {
        ("gemm", "compute"),
        ("nccl_allreduce", "communication"),
        ("other", "memory"),
        ("other", "compute"),
    }
    assert len(window.durations_s[("other", "memory")]) == 2
    assert sum(len(v) for v in window.durations_s.values()) == len(events)
    assert len(window.idle_durations_s) == 1


def test_drain_resets_the_window_and_keeps_the_ranking() -> None:
    summariser = KernelSummariser(top_k=1)
    summariser.add_events([KernelEvent("aten::mm", 0, 1000), KernelEvent("aten::relu", 0, 1)])
    assert set(summariser.drain().durations_s) == {("gemm", "compute"), ("other", "compute")}
    assert summariser.drain() == KernelWindow(durations_s={}, idle_durations_s=())
    # relu alone now: still folded, gemm's total keeps its place.
    summariser.add_events([KernelEvent("aten::relu", 0, 1)])
    assert set(summariser.drain().durations_s) == {("other", "compute")}


def test_step_without_kernels_is_all_idle() -> None:
    summariser = KernelSummariser()
    summariser.add_step([], start_ns=0, end_ns=2_000_000)
    assert summariser.drain().idle_durations_s == (pytest.approx(0.002),)


@settings(deadline=None, derandomize=True)  # reproducible, and never flaky on a loaded CI box
@given(st.lists(st.integers(0, 500), max_size=300), st.integers(1, 20))
def test_series_count_is_bounded_by_top_k_plus_categories(names: list[int], top_k: int) -> None:
    summariser = KernelSummariser(top_k=top_k)
    rng = random.Random(0)
    summariser.add_events(
        KernelEvent(f"custom_kernel_family_{n}_impl", 0, rng.randint(1, 10_000)) for n in names
    )
    window = summariser.drain()
    assert len(window.durations_s) <= top_k + 4
    assert sum(len(v) for v in window.durations_s.values()) == len(names)


def test_initial_totals_decide_the_kept_classes() -> None:
    summariser = KernelSummariser(top_k=1, initial_totals_s={("relu", "compute"): 100.0})
    summariser.add_events([KernelEvent("aten::mm", 0, 10_000), KernelEvent("aten::relu", 0, 1)])
    assert set(summariser.drain().durations_s) == {("relu", "compute"), ("other", "compute")}


@pytest.mark.parametrize("top_k", [0, -1, True])
def test_top_k_must_be_positive(top_k: int) -> None:
    with pytest.raises(ConfigError, match="top_k"):
        KernelSummariser(top_k=top_k)
