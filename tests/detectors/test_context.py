"""The helpers rules describe findings with: rank text, severity, host and stage groups."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from stepwatch.detectors import DetectorConfig, Fault, Topology, simulate
from stepwatch.detectors.analysis._context import Basis, Context, held_wait_phase
from stepwatch.detectors.analysis._cost import step_excess
from stepwatch.detectors.analysis._crossrank import flag_metrics
from stepwatch.detectors.analysis._rule import EpisodeGroup, severity_of


def _context(*, ranks: int = 32, topology: Topology | None = None) -> Context:
    frame = simulate(ranks, steps=40, topology=topology, seed=3).frame()
    basis = Basis.of(frame, DetectorConfig())
    return Context.with_metrics(basis, flag_metrics(basis))


@pytest.fixture(scope="module")
def context() -> Context:
    return _context(topology=Topology(4, 2, 4))  # hosts and pipeline stages of 8 ranks


@pytest.mark.parametrize(
    ("indices", "text"),
    [
        ((5,), "rank 5"),
        ((0, 1, 2, 3, 8), "ranks 0-3,8"),
        ((3, 1, 2), "ranks 1-3"),
        ((), ""),
        (tuple(range(0, 32, 2)), "ranks 0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30"),
    ],
)
def test_rank_text_joins_ranges(context: Context, indices: tuple[int, ...], text: str) -> None:
    assert context.rank_text(indices) == text


def test_rank_text_is_cut_at_sixty_characters() -> None:
    text = _context(ranks=64).rank_text(range(0, 64, 3))
    assert text.startswith("ranks 0,3,6,") and text.endswith("...")
    assert len(text) == len("ranks ") + 60


@pytest.mark.parametrize(
    ("ratio", "severity"),
    [(1.3, "critical"), (1 / 1.3, "critical"), (1.1, "warning"), (1.0, "info"), (0.0, "info")],
)
def test_severity_is_symmetric_in_the_ratio(ratio: float, severity: str) -> None:
    assert severity_of(ratio) == severity
    assert severity_of(math.nan) == "info"


def test_host_group_takes_hosts_at_least_half_flagged(context: Context) -> None:
    assert context.host_group([8, 9, 10, 11]) == (list(range(8, 16)), ("node-0001",))
    assert context.host_group([8, 17]) == ([8, 17], ("node-0001", "node-0002"))


def test_stage_group_needs_the_whole_stage_and_a_pipeline(context: Context) -> None:
    assert context.stage_group(list(range(8, 16))) == list(range(8, 16))
    # Half a stage is not the stage: one slow worker (of two replicas) is never a stage.
    assert context.stage_group([8, 9, 10, 11]) is None
    assert context.stage_group([8, 9, 10]) is None
    assert _context().stage_group(list(range(8, 16))) is None  # one stage: no pipeline


def test_a_clean_job_has_no_flags_and_no_effect(context: Context) -> None:
    assert not context.metrics.flags.any()
    assert context.score([5], 0, context.frame.n_windows - 1) == 0.0
    assert context.ratio("no such metric", [5], 0, 3) == 1.0


def test_top_share_and_top_phase_name_what_moved() -> None:
    faults = [Fault.parse("compute_straggler@150:5:1.5")]
    frame = simulate(32, steps=300, faults=faults, seed=3).frame()
    basis = Basis.of(frame, DetectorConfig())
    context = Context.with_metrics(basis, flag_metrics(basis))
    last = frame.n_windows - 1
    kernel_class, ratio = context.top_share([5], 32, last)
    assert kernel_class == "gemm" and ratio == pytest.approx(1.5, rel=0.1)
    assert context.top_phase([5], slice(32, last + 1), ("forward", "backward")) == "backward"


def test_a_finding_on_every_rank_has_no_step_excess() -> None:
    # Every rank named (a link finding on a whole pp 4 x dp 1 pipeline): no peers to be
    # above, no excess, and no warning of an empty median.

    step = np.full((5, 4), 0.1)
    context = SimpleNamespace(
        present=np.ones((5, 4), dtype=bool), frame=SimpleNamespace(step_s=step)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        excess = step_excess(context, (0, 1, 2, 3), slice(0, 5))  # type: ignore[arg-type]
    assert excess.tolist() == [0.0] * 5
    assert step_excess(context, (1,), slice(0, 5)).tolist() == [0.0] * 5  # type: ignore[arg-type]


@pytest.mark.parametrize(("stages", "untimed", "held"), [
    ((0, 0, 0, 0), 0.3, "backward"),  # data parallel: backward holds the all-reduce
    ((0, 1, 2, 3), 0.3, None),  # a pipeline idling for its neighbours in no phase
    ((0, 1, 2, 3), 0.02, "backward"),  # a pipeline whose backward holds its waits
])  # fmt: skip
def test_backward_holds_the_wait_unless_a_pipeline_waits_in_no_phase(
    stages: tuple[int, ...], untimed: float, held: str | None
) -> None:

    phases = ("forward", "backward", "optimizer")
    shares = np.array([0.3, 0.6, 0.1]) * (1.0 - untimed)
    frame = SimpleNamespace(
        phases=phases,
        pp_ranks=np.array(stages),
        phase_step=np.full((6, 4), 0.1),
        phase_s=np.broadcast_to(0.1 * shares, (6, 4, 3)).copy(),
    )
    assert held_wait_phase(frame) == held  # type: ignore[arg-type]


def test_a_narrowed_group_keeps_its_ranks_own_windows() -> None:
    # Rank 3, flagged a minute before the stall of rank 9 it merged with, is dropped: the
    # group's onset is rank 9's again. Ranks that are not the group's own (a stage the
    # finding widens to) keep the group's windows.
    group = EpisodeGroup((3, 9), 10, 40, 12, ((3, 10, 25, 12), (9, 22, 40, 24)))
    assert group.narrowed([9]) == EpisodeGroup((9,), 22, 40, 24, ((9, 22, 40, 24),))
    assert group.narrowed([3, 9]) == group
    widened = group.narrowed([8, 9])
    assert (widened.indices, widened.first, widened.last) == ((8, 9), 10, 40)
