"""Kernel times from a sampling source: a few windows in many hold them.

The op histograms' duty cycle records 5 steps every few thousand by default, so one analysis
window in several holds kernel times and the rest hold none; and since each rank's window ends
at its own export, one profiled cycle can land in two adjacent windows, some ranks in each.
The cross-rank tests of kernel series run on those windows one after another
(``_crossrank.kernel_runs``); the frame gives kernel time per recorded step.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest

from stepwatch.core import InfluxClient
from stepwatch.detectors import Fault, JobFrame, diagnose, simulate
from stepwatch.detectors.analysis import _crossrank
from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._context import Basis, Context
from stepwatch.detectors.frame import job_time_range, read_frame
from stepwatch.detectors.simulation import suite
from tests.detectors.test_real_runs import diagnose_run


def _sampled(frame: JobFrame, every: int, *, split: bool = False) -> JobFrame:
    """``frame`` as a sampling source would report it: kernel and idle times in one window
    of ``every`` (``split``: every other rank's a window later), NaN in the others."""
    keep = np.zeros(frame.step_s.shape, dtype=bool)
    keep[::every] = True
    if split:
        keep[:, 1::2] = np.roll(keep[:, 1::2], 1, axis=0)
    return dataclasses.replace(
        frame,
        kernel_s=np.where(keep[:, :, None], frame.kernel_s, np.nan),
        idle_s=np.where(keep, frame.idle_s, np.nan),
        idle_max_s=np.where(keep, frame.idle_max_s, np.nan),
    )


def _kinds(frame: JobFrame) -> list[tuple[str, tuple[int, ...], str | None]]:
    return [(d.kind, d.ranks, d.kernel_class) for d in diagnose(frame)]


@pytest.fixture(scope="module")
def straggler() -> JobFrame:
    job = simulate(32, steps=600, faults=[Fault.parse("compute_straggler@300:5:1.3")], seed=11)
    return job.frame()


@pytest.mark.parametrize(("every", "split"), [(3, False), (5, False), (5, True), (8, True)])
def test_a_slow_class_is_named_from_one_window_in_several(
    straggler: JobFrame, every: int, split: bool
) -> None:
    assert _kinds(straggler) == [("compute_straggler", (5,), "gemm")]  # every window
    sparse = _sampled(straggler, every, split=split)
    assert _kinds(sparse) == [("compute_straggler", (5,), "gemm")]


def test_without_the_runs_the_kernels_go_unseen(straggler: JobFrame) -> None:
    # Tested window by window, a kernel series never persists: the rank's slow forward is
    # all that is seen, and the slow class is lost.
    sparse = _sampled(straggler, 5)
    with mock.patch.object(_crossrank, "kernel_runs", return_value=None):
        assert _kinds(sparse) == [("masked_straggler", (5,), None)]


@pytest.mark.parametrize("seed", range(3))
def test_clean_sampled_runs_raise_nothing(seed: int) -> None:
    job = simulate(64, steps=600, seed=seed, sequence_noise=0.08)
    assert diagnose(_sampled(job.frame(), 5, split=bool(seed % 2))) == []


def test_runs_pool_adjacent_windows_and_flags_cover_what_lies_between() -> None:
    frame = simulate(4, steps=160, seed=1).frame()
    sparse = _sampled(frame, 5, split=True)
    runs = _crossrank.kernel_runs(Basis.of(sparse, DetectorConfig()))
    assert runs is not None
    # A window and the next one hold one observation (each rank in one of them).
    assert (runs.last - runs.first <= 1).all() and (runs.first[1:] - runs.last[:-1] > 1).all()
    pooled = runs.pool(sparse.kernel_s[:, :, 0])
    for index, (first, last) in enumerate(zip(runs.first, runs.last, strict=True)):
        for rank in range(sparse.n_ranks):
            values = sparse.kernel_s[first : last + 1, rank, 0]
            expected = np.nanmean(values) if np.isfinite(values).any() else np.nan
            np.testing.assert_allclose(pooled[index, rank], expected, equal_nan=True)
    flags = np.zeros((runs.first.size, 4, 1), dtype=bool)
    flags[[1, 2], 0, 0] = True  # two runs in a row: the windows between them too
    flags[4, 1, 0] = True  # one run alone: its own windows
    full = runs.spread(flags, frame.n_windows)
    assert np.flatnonzero(full[:, 0, 0]).tolist() == list(range(runs.first[1], runs.last[2] + 1))
    assert np.flatnonzero(full[:, 1, 0]).tolist() == list(range(runs.first[4], runs.last[4] + 1))
    assert not full[:, 2:].any()


def _context(frame: JobFrame) -> Context:
    basis = Basis.of(frame, DetectorConfig())
    return Context.with_metrics(basis, _crossrank.flag_metrics(basis))


def test_a_finding_says_what_its_kernels_showed() -> None:
    frame = simulate(32, steps=600, seed=3).frame()
    compute = np.array([c == "compute" for c in frame.kernel_categories])
    kernel = frame.kernel_s.copy()
    kernel[60:, 5] = np.where(compute, 3.0 * kernel[60:, 5], kernel[60:, 5])
    late = slice(60, 120)
    # Recorded in one window of 20: 3 of them in the span, too few for the tests.
    sparse = _sampled(dataclasses.replace(frame, kernel_s=kernel), 20)
    words = _context(sparse).kernel_words([5], late)
    ratio = float(words.removeprefix("(its compute kernels ").split("x", 1)[0])
    assert 2.7 < ratio < 3.3 and "peers in the 3 windows" in words, words
    assert _context(sparse).kernel_words([6], late) == "with normal kernels"
    unseen = dataclasses.replace(sparse, kernel_s=sparse.kernel_s.copy())
    unseen.kernel_s[late] = np.nan
    expected = "(its kernels were not recorded in these windows)"
    assert _context(unseen).kernel_words([5], late) == expected
    bare = dataclasses.replace(
        frame, kernel_classes=(), kernel_categories=(), kernel_s=frame.kernel_s[:, :, :0]
    )
    assert _context(bare).kernel_words([5], late) == "(no kernel times)"


def test_dense_kernels_are_tested_window_by_window(straggler: JobFrame) -> None:
    assert _crossrank.kernel_runs(Basis.of(straggler, DetectorConfig())) is None


# ---- recorded real runs: torch.profiler 5 steps in every 256 (tests/data/real_runs) -----


def test_the_frame_gives_kernel_time_per_recorded_step(influx: InfluxClient) -> None:
    run, _ = diagnose_run(influx, "none-sampled-kernels-256")
    span = job_time_range(influx, run.job)
    assert span is not None
    frame = read_frame(influx, run.job, start_unix_nano=span[0], end_unix_nano=span[1])
    assert frame.kernel_steps is not None
    recorded = np.isfinite(frame.kernel_s).any(axis=2) & frame.present
    # Most windows hold steps and no kernels; those that do rest on a few recorded steps.
    assert 0 < recorded.sum() < 0.5 * frame.present.sum()
    assert (frame.kernel_steps[recorded] <= 5).all()
    assert (frame.kernel_steps[recorded] < frame.step_count[recorded]).all()
    # Per recorded step, the compute kernels are a share of the step, not a sliver of it.
    compute = frame.category_s("compute")[recorded]
    assert np.nanmedian(compute / frame.step_s[recorded]) > 0.02


def test_a_healthy_sampled_run_has_no_finding(influx: InfluxClient) -> None:
    _, found = diagnose_run(influx, "none-sampled-kernels-256")
    assert found == []


def test_a_sampled_straggler_names_its_slow_class(influx: InfluxClient) -> None:
    run, found = diagnose_run(influx, "straggler-sampled-kernels-256")
    assert [(d.kind, d.ranks, d.phase, d.kernel_class) for d in found] == [
        ("compute_straggler", (run.fault_rank,), "forward", "gemm")
    ]


def test_a_sparser_straggler_is_named_and_its_kernels_never_called_normal(
    influx: InfluxClient,
) -> None:
    # 5 steps in every 512, each cycle split over two windows (some ranks in each): 3
    # observations in the fault. Named a compute straggler here; had the tests not flagged
    # its kernels, the finding must still not claim that they were normal.
    run, found = diagnose_run(influx, "straggler-sampled-kernels-512")
    assert found and all(d.ranks == (run.fault_rank,) and d.phase == "forward" for d in found)
    for diagnosis in found:
        assert diagnosis.kind in {"compute_straggler", "masked_straggler"}
        assert "normal kernels" not in diagnosis.summary, diagnosis.summary


def test_a_sampled_regression_blames_no_rank(influx: InfluxClient) -> None:
    _, found = diagnose_run(influx, "regression-sampled-kernels-256")
    assert [(d.kind, d.ranks) for d in found] == [("job_regression", ())]


def test_a_sparser_sampled_regression_is_one_finding_with_its_class(influx: InfluxClient) -> None:
    # 5 steps in 512: the kernel classes' shift is seen a few windows after the step's. It
    # was a second job_regression ("job slower ... (gemm 15.35x)", costed 1.42x) beside the
    # first (1.88x, forward, no class).
    _, found = diagnose_run(influx, "regression-sampled-kernels-512")
    assert [(d.kind, d.ranks, d.phase, d.kernel_class) for d in found] == [
        ("job_regression", (), "forward", "gemm")
    ]
    assert found[0].slowdown > 1.5


def test_a_sampled_slow_link_is_found_on_its_host(influx: InfluxClient) -> None:
    # The delay sits in rank 2's comm hook, which the CPU profiler charges to the
    # AccumulateGrad op: classed ``other`` (its self time is the gradient hooks), its kernels
    # show no compute straggler, and the late arrival names the host.
    run, found = diagnose_run(influx, "link-sampled-kernels-256")
    assert [(d.kind, d.hosts) for d in found] == [("link_degradation", ("vm-node1",))], found
    assert run.fault_rank in found[0].ranks


def test_dense_kernels_with_a_gap_stay_window_by_window(influx: InfluxClient) -> None:
    # The demo's 5 steps in 25: kernels in nearly every window, with a gap or two. Pooled
    # into runs, those windows would have been one observation, and this run's gemm (4.4x)
    # went unflagged ("too few to confirm", an early version of the runs).
    run, found = diagnose_run(influx, "straggler-sampled-kernels-25")
    assert [(d.kind, d.ranks, d.phase, d.kernel_class) for d in found] == [
        ("compute_straggler", (run.fault_rank,), "forward", "gemm")
    ]
    span = job_time_range(influx, run.job)
    assert span is not None
    frame = read_frame(influx, run.job, start_unix_nano=span[0], end_unix_nano=span[1])
    holding = (np.isfinite(frame.kernel_s).any(axis=2) & frame.present).any(axis=1)
    assert (~holding & frame.present.any(axis=1)).sum() > 0  # the gap
    assert _crossrank.kernel_runs(Basis.of(frame, DetectorConfig())) is None


def test_adjacent_windows_are_one_observation_only_when_they_split_a_cycle() -> None:
    frame = simulate(4, steps=160, seed=1).frame()
    # One window in 5, every rank in the same window: runs of one window each.
    runs = _crossrank.kernel_runs(Basis.of(_sampled(frame, 5), DetectorConfig()))
    assert runs is not None and (runs.first == runs.last).all()
    # Two windows in a row in every 6, every rank in both (two cycles): not merged.
    keep = np.zeros(frame.step_s.shape, dtype=bool)
    keep[::6] = keep[1::6] = True
    both = dataclasses.replace(frame, kernel_s=np.where(keep[:, :, None], frame.kernel_s, np.nan))
    runs = _crossrank.kernel_runs(Basis.of(both, DetectorConfig()))
    assert runs is not None and (runs.first == runs.last).all()


@pytest.mark.parametrize("world", [2, 32])
@pytest.mark.parametrize("split", [False, True])
def test_a_sampled_regression_is_one_finding(world: int, split: bool) -> None:
    # At one window in 8 with kernel times, the kernel classes' change point lands on the
    # first window that holds kernels after the shift, up to 7 windows late: it was grouped
    # apart from the step's and made a second job_regression (no phase, gemm) 4 windows after
    # the first (gemm-less). A kernel series' shift may have begun right after its last
    # window before it (ChangePoint.since), and is grouped from there.
    job = simulate(world, steps=600, faults=[Fault.parse("job_regression@300:all:1.3")], seed=1)
    found = diagnose(_sampled(job.frame(), 8, split=split))
    assert [(d.kind, d.ranks, d.kernel_class, d.phase) for d in found] == [
        ("job_regression", (), "gemm", "backward")
    ]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("every", "split"), [(5, True), (8, True)])
def test_few_ranks_name_a_sampled_straggler_and_its_class(
    world: int, every: int, split: bool
) -> None:
    # Too few ranks for the peer statistics (analysis/_few_ranks.py): the rank's own level.
    job = simulate(world, steps=600, faults=[Fault.parse("compute_straggler@300:1:1.3")], seed=2)
    assert _kinds(_sampled(job.frame(), every, split=split)) == [
        ("compute_straggler", (1,), "gemm")
    ]
    clean = simulate(world, steps=600, seed=2, sequence_noise=0.08)
    assert diagnose(_sampled(clean.frame(), every, split=split)) == []


def test_the_structure_comes_from_the_runs_at_the_start() -> None:
    # Ten runs at one window in 8 reach far past the frame's baseline (its first ten settled
    # windows); the groups' offsets come from the runs that start within it, at least two.
    frame = simulate(4, steps=400, seed=1).frame()
    sparse = _sampled(frame, 8)
    basis = Basis.of(sparse, DetectorConfig())
    runs = _crossrank.kernel_runs(basis)
    assert runs is not None and runs.first.size >= 10
    chosen = runs.baseline(basis.baseline)
    span = np.flatnonzero(basis.baseline)
    assert chosen.sum() == 2 and (runs.first[chosen] <= span[-1] + 8).all()
    assert not runs.baseline(np.zeros_like(basis.baseline)).any()


def test_a_sparse_pipeline_bubble_starts_with_its_fault() -> None:
    # A 4-stage pipeline (128 ranks) whose stage 2 idles from 200 s, kernel times in one
    # window in 8: with the first ten runs as the structure (the fault's half included),
    # stage 2's communication kernels were flagged from 40 s and the bubble dated from there
    # (a false alarm by the suite's score).
    scenario = next(
        s for s in suite(228, max_world_size=256) if s.name == "166-pipeline_bubble-128r-1.5"
    )
    job = scenario.simulate()
    found = diagnose(_sampled(job.frame(), 8, split=True))
    assert [(d.kind, d.ranks[:2]) for d in found] == [("pipeline_bubble", (64, 65))]
    assert found[0].start_unix_nano >= job.truth.faults[0].start_unix_nano


def test_a_late_seen_kernel_shift_joins_the_steps_not_an_earlier_one() -> None:
    # A small communication shift 4 windows before the regression took the kernel shift (seen
    # late, one window in 8) and made a second job_regression, "communication moved most".
    scenario = next(
        s for s in suite(228, max_world_size=256) if s.name == "170-job_regression-16r-1.5"
    )
    job = scenario.simulate()
    found = diagnose(_sampled(job.frame(), 8, split=True))
    assert [(d.kind, d.phase, d.kernel_class) for d in found] == [
        ("job_regression", "backward", "gemm")
    ]


@pytest.mark.parametrize("world", [8, 32])
def test_a_regression_names_its_class_from_too_few_windows_to_test(world: int) -> None:
    # One window in 16: two or three windows with kernel times after the shift, too few for
    # a change point (3 a side). The class that moved most is named with what it rests on.
    job = simulate(world, steps=400, faults=[Fault.parse("job_regression@200:all:1.3")], seed=1)
    found = diagnose(_sampled(job.frame(), 16))
    assert [(d.kind, d.kernel_class) for d in found] == [("job_regression", "gemm")]
    assert "windows since that recorded kernels" in found[0].summary
    assert found[0].slowdown == pytest.approx(diagnose(job.frame())[0].slowdown, rel=0.02)


def test_a_thin_shift_only_where_no_test_could_run() -> None:
    from stepwatch.detectors.analysis._shifts import thin_shift

    series = np.full(40, np.nan)
    series[[4, 20, 36]] = [1.0, 1.0, 1.5]  # one window after the shift at 30
    found = thin_shift("kernel:gemm", series, 30, min_ratio=1.03, min_excess=0.01)
    assert found is not None and (found.ratio, found.thin) == (1.5, 1)
    assert thin_shift("kernel:gemm", series, 30, min_ratio=1.6, min_excess=0.01) is None
    dense = np.where(np.arange(40) < 30, 1.0, 1.5)  # change_points' to test, not this
    assert thin_shift("kernel:gemm", dense, 30, min_ratio=1.03, min_excess=0.01) is None
    assert thin_shift("kernel:gemm", series, 3, min_ratio=1.03, min_excess=0.01) is None
