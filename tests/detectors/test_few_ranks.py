"""Jobs of 2 and 3 ranks: too few for the cross-rank tests, yet a straggler is still named.

A single slow rank moves every rank's step in synchronous training; below ``min_ranks`` (4)
the detectors used to call that a ``job_regression`` "on every rank". Each rank compared with
its own level before the shift says who spent it in its own phase and who waited
(``analysis/_few_ranks.py``). The real 2-rank H100 job is in ``test_gpu_runs.py``, a real
2-rank CPU job in ``tests/app/test_demo.py``.
"""

from __future__ import annotations

import pytest

from stepwatch.detectors import DetectorConfig, Fault, analyse, simulate


def _found(world: int, fault: str | None, seed: int) -> list[tuple[str, tuple[int, ...], str]]:
    faults = [] if fault is None else [Fault.parse(fault)]
    frame = simulate(world, steps=150, faults=faults, seed=seed).frame()
    return [(f.diagnosis.kind, f.diagnosis.ranks, str(f.diagnosis.phase)) for f in analyse(frame)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("compute_straggler@60:1:1.5", [("compute_straggler", (1,), "backward")]),
        ("masked_straggler@60:1:1.5", [("masked_straggler", (1,), "backward")]),
        ("dataloader_stall@60:1:1.5", [("dataloader_stall", (1,), "data")]),
        ("job_regression@60:all:1.5", [("job_regression", (), "backward")]),
        (None, []),
    ],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_a_small_job_names_the_rank_that_spent_the_shift(
    world: int, fault: str | None, expected: list[tuple[str, tuple[int, ...], str]], seed: int
) -> None:
    assert _found(world, fault, seed) == expected


def test_from_min_ranks_on_the_cross_rank_tests_decide() -> None:
    """The localisation is for small jobs only: at 4 ranks the peers' statistics decide."""
    frame = simulate(4, steps=150, faults=[Fault.parse("compute_straggler@60:1:1.5")]).frame()
    found = analyse(frame, config=DetectorConfig())
    assert [(f.diagnosis.kind, f.diagnosis.ranks) for f in found] == [("compute_straggler", (1,))]
    assert "compared with itself" not in found[0].diagnosis.summary


def test_the_summary_says_who_waited_and_how_it_was_compared() -> None:
    frame = simulate(2, steps=150, faults=[Fault.parse("masked_straggler@60:1:1.5")]).frame()
    (finding,) = analyse(frame)
    summary = finding.diagnosis.summary
    assert summary.startswith("rank 1 backward ")
    assert "rank 0 waits for it in communication" in summary
    assert "2-rank job: compared with itself, not peers" in summary
    assert finding.diagnosis.slowdown > 1.1
