"""The ``hang`` rule on where ranks are (synthetic progress): who holds it, and what is not one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.detectors import DetectorConfig, analyse, simulate
from stepwatch.detectors.analysis.rules.hang import find_hangs
from stepwatch.detectors.frame import JobProgress, RankProgress, with_progress

NOW = 1_795_000_000_000_000_000
S = 1_000_000_000


def rank(
    number: int,
    phase: str | None = "communication",
    *,
    stalled_s: float = 12.0,
    report_s: float = 0.3,
    host: str | None = None,
    step: int = 120,
    in_phase_s: float | None = None,
    closed: bool = False,
    step_s: float = 0.02,
    speaks: bool = True,
) -> RankProgress:
    """A rank that last finished a step ``stalled_s`` ago and last reported ``report_s`` ago."""
    since = None if in_phase_s is None else NOW - round(in_phase_s * S)
    return RankProgress(
        rank=number,
        host=host if host is not None else f"node{number // 2}",
        last_report_unix_nano=NOW - round(report_s * S),
        last_progress_unix_nano=NOW - round(stalled_s * S),
        step=step,
        phase=phase,
        phase_since_unix_nano=since,
        closed=closed,
        step_s=step_s,
        export_window_s=0.25,
        speaks_progress=speaks,
    )


def hangs(
    *ranks: RankProgress,
    steps: float = 10.0,
    min_s: float = 10.0,
    phases: frozenset[str] | None = None,
) -> list:
    progress = JobProgress(job="j", now_unix_nano=NOW, ranks=tuple(ranks), phases=phases)
    return find_hangs(progress, hang_steps=steps, hang_min_s=min_s)


#: The phases of the README's loop: no communication phase (DDP's all-reduce in backward).
HAND = frozenset({"data", "forward", "backward", "optimizer"})


def test_without_a_communication_phase_ranks_in_backward_wait() -> None:
    (hang,) = hangs(
        rank(0, "backward"), rank(1, "backward"), rank(2, "data"), rank(3, "backward"), phases=HAND
    )
    assert (hang.ranks, hang.phase) == ((2,), "data")
    assert "while ranks 0-1,3 wait in backward (which holds the collective)" in hang.summary
    # The same ranks in a job that times communication: backward is work, not a wait.
    assert (
        hangs(
            rank(0, "backward"),
            rank(1, "backward"),
            rank(2, "data"),
            rank(3, "backward"),
            phases=HAND | {"communication"},
        )
        == []
    )


def test_without_a_communication_phase_every_rank_in_backward_is_a_collective_hang() -> None:
    (hang,) = hangs(*(rank(r, "backward", in_phase_s=12.0) for r in range(4)), phases=HAND)
    assert (hang.ranks, hang.phase) == ((), "backward")
    assert hang.summary.startswith("every rank waits in backward (which holds the collective)")


def test_without_a_communication_phase_an_evaluation_pass_is_not_a_hang() -> None:
    assert hangs(*(rank(r, "eval", in_phase_s=12.0) for r in range(4)), phases=HAND) == []


def test_a_rank_stuck_outside_communication_is_named_with_its_phase() -> None:
    (hang,) = hangs(rank(0), rank(1), rank(2, "data", stalled_s=12.1), rank(3))
    assert (hang.ranks, hang.phase, hang.hosts) == ((2,), "data", ("node1",))
    assert hang.summary.startswith("rank 2 stuck in data at step 120 while ranks 0-1,3 wait")
    assert hang.onset_unix_nano == NOW - 12 * S  # the job's last progress: the peers' last step
    assert hang.slowdown == pytest.approx(1 + 12.0 / 0.02)
    assert hang.score == pytest.approx(1.2)


def test_a_rank_stuck_between_phases_is_named_without_one() -> None:
    (hang,) = hangs(rank(0), rank(1), rank(2, None), rank(3))
    assert (hang.ranks, hang.phase) == ((2,), None)
    assert "rank 2 stuck outside any phase" in hang.summary


def test_a_silent_rank_while_its_peers_wait_is_named() -> None:
    frozen = rank(2, "forward", report_s=11.0)
    (hang,) = hangs(rank(0), rank(1), frozen, rank(3))
    assert (hang.ranks, hang.phase) == ((2,), "forward")  # its last known phase
    assert "rank 2 silent since" in hang.summary


def test_a_frozen_rank_is_silent_once_it_misses_a_report_its_peers_made() -> None:
    # 10 s windows: rank 2 froze 3.8 s after its last report; its peers' windows since say
    # they wait. 18 s into the hang it has missed a report (1.5 cadences): silent, not
    # "stuck outside any phase" at its stale step (30 s, 3 cadences, is for a whole job).
    def ten_s(r: RankProgress) -> RankProgress:
        return dataclasses.replace(r, export_window_s=10.0)

    peers = [ten_s(rank(r, stalled_s=18.0, report_s=6.0)) for r in (0, 1, 3)]
    frozen = ten_s(rank(2, None, stalled_s=18.0, report_s=21.8, step=1073))
    (hang,) = hangs(*peers, frozen)
    assert hang.ranks == (2,)
    assert "rank 2 silent since" in hang.summary
    # Before it has missed one (its next report may still come): not yet silent.
    early = dataclasses.replace(frozen, last_report_unix_nano=NOW - round(14.0 * S))
    (hang,) = hangs(*peers, early)
    assert "rank 2 stuck outside any phase" in hang.summary


def test_a_rank_that_exited_while_its_peers_wait_is_named_as_exited() -> None:
    (hang,) = hangs(rank(0), rank(1), rank(2, None, report_s=30.0, closed=True), rank(3))
    assert hang.ranks == (2,)
    assert "rank 2 exited" in hang.summary


def test_every_rank_in_communication_is_a_communication_hang() -> None:
    (hang,) = hangs(*(rank(r, in_phase_s=12.0) for r in range(4)))
    assert (hang.ranks, hang.hosts, hang.phase) == ((), (), "communication")
    assert hang.summary.startswith("every rank waits in communication at step 120")


def test_a_host_whose_ranks_reached_the_collective_last_is_named() -> None:
    ranks = [rank(r, in_phase_s=12.0) for r in range(6)] + [rank(r, in_phase_s=8.0) for r in (6, 7)]
    (hang,) = hangs(*ranks)
    assert (hang.ranks, hang.hosts) == ((6, 7), ("node3",))
    assert "arrived last" in hang.summary


def test_a_host_a_step_behind_is_named() -> None:
    ranks = [rank(r, step=121) for r in range(6)] + [rank(r, step=120) for r in (6, 7)]
    (hang,) = hangs(*ranks)
    assert (hang.ranks, hang.hosts) == ((6, 7), ("node3",))
    assert "a step behind" in hang.summary


def test_a_lone_late_rank_on_a_shared_host_is_not_a_host_group() -> None:
    ranks = [rank(r, in_phase_s=12.0, host=f"n{r // 4}") for r in range(7)]
    ranks.append(rank(7, in_phase_s=8.0, host="n1"))  # one of four on its host
    (hang,) = hangs(*ranks)
    assert hang.ranks == ()


def test_every_rank_silent_while_it_was_moving_is_a_job_level_hang() -> None:
    (hang,) = hangs(*(rank(r, None, stalled_s=12.0, report_s=11.9) for r in range(4)))
    assert (hang.ranks, hang.hosts, hang.phase) == ((), (), None)
    assert hang.summary.startswith("every rank stopped reporting")


@pytest.mark.parametrize(
    ("case", "ranks"),
    [
        ("below the threshold", [rank(0), rank(1, "data", stalled_s=9.5)]),
        ("long normal step on every rank: an evaluation pass", [rank(r, "eval") for r in range(4)]),
        ("checkpoint on every rank, between phases", [rank(r, None) for r in range(4)]),
        (
            "a rank that exited while the others keep going",
            [rank(0, stalled_s=0.1), rank(1, stalled_s=0.1), rank(2, None, closed=True)],
        ),
        ("the end of the job", [rank(r, None, report_s=20.0, closed=True) for r in range(4)]),
        (
            "a job killed after it had stalled",
            [rank(r, stalled_s=40.0, report_s=20.0) for r in range(4)],
        ),
        (
            "a producer that never says it closed (no progress gauges): its end",
            [rank(r, None, report_s=11.9, speaks=False) for r in range(4)],
        ),
        ("most ranks still busy", [rank(0), rank(1, "data"), rank(2, "data"), rank(3, "data")]),
        ("silent for minutes: over", [rank(r, stalled_s=400.0, report_s=350.0) for r in range(2)]),
        ("no step finished yet", [dataclasses.replace(rank(0, "data"), step_s=None)]),
    ],
)
def test_not_a_hang(case: str, ranks: list[RankProgress]) -> None:
    assert hangs(*ranks) == [], case


def test_the_threshold_follows_the_usual_step() -> None:
    # 2 s steps: 10 steps = 20 s > the 10 s floor.
    assert (
        hangs(rank(0, step_s=2.0, stalled_s=15.0), rank(1, "data", step_s=2.0, stalled_s=15.0))
        == []
    )
    (hang,) = hangs(
        rank(0, step_s=2.0, stalled_s=21.0), rank(1, "data", step_s=2.0, stalled_s=21.0)
    )
    assert hang.threshold_s == pytest.approx(20.0)
    # The settings move it: 3 steps, at least 2 s.
    (hang,) = hangs(rank(0, stalled_s=3.0), rank(1, "data", stalled_s=3.0), steps=3, min_s=2)
    assert hang.threshold_s == pytest.approx(2.0)


@settings(max_examples=40, deadline=None)
@given(world=st.integers(2, 12), stuck=st.data(), shift=st.integers(0, 10_000))
def test_the_stuck_rank_is_named_whatever_the_numbering(
    world: int, stuck: st.DataObject, shift: int
) -> None:
    culprit = stuck.draw(st.integers(0, world - 1))
    ranks = [rank(r + shift, "data" if r == culprit else "communication") for r in range(world)]
    (hang,) = hangs(*ranks)
    assert hang.ranks == (culprit + shift,) and hang.phase == "data"


def test_the_engine_gives_the_same_verdict_for_a_frame_with_progress() -> None:
    job = simulate(4, steps=60, seed=3, job="j")
    frame = job.frame()
    ends = frame.window_end_unix_nano
    now = int(ends[-1])
    shifted = [
        dataclasses.replace(
            rank(r, "data" if r == 2 else "communication"),
            last_report_unix_nano=now - S // 3,
            last_progress_unix_nano=now - 12 * S,
        )
        for r in range(4)
    ]
    progress = JobProgress(job="j", now_unix_nano=now, ranks=tuple(shifted))
    findings = [f for f in analyse(with_progress(frame, progress)) if f.diagnosis.kind == "hang"]
    (finding,) = findings
    diagnosis = finding.diagnosis
    assert (diagnosis.ranks, diagnosis.phase, diagnosis.severity) == ((2,), "data", "critical")
    assert diagnosis.end_unix_nano is None
    onset_window = int(np.searchsorted(ends, now - 12 * S))
    assert diagnosis.start_unix_nano == frame.window_start_unix_nano(onset_window)
    # Without progress (or with a stricter threshold) the engine finds no hang.
    assert not [f for f in analyse(frame) if f.diagnosis.kind == "hang"]
    strict = DetectorConfig(hang_min_s=60.0)
    assert not [
        f
        for f in analyse(with_progress(frame, progress), config=strict)
        if f.diagnosis.kind == "hang"
    ]
