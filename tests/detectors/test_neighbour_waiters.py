"""A rank slowed a little beside a straggler still waits for it: it is not blamed with it.

Seen in CI on the real 4-rank demo (2 cores): rank 2's forward did extra work and rank 3,
scheduled beside it, came out slower too, so the finding named ranks (2, 3). Every rank waits
for the slowest in the all-reduce; a rank whose wait lies most of the way to its unflagged
peers' is a waiter (``_episodes._narrow_data_parallel``). A second straggler half as slow as
the first waits little and stays named.
"""

from __future__ import annotations

import pytest

from stepwatch.detectors import Fault, analyse, simulate


def _named(world: int, second: float, seed: int) -> list[tuple[str, tuple[int, ...]]]:
    faults = [
        Fault.parse("masked_straggler@60:2:1.6"),
        Fault.parse(f"masked_straggler@60:3:{second}"),
    ]
    frame = simulate(world, steps=150, faults=faults, seed=seed).frame()
    return [(f.diagnosis.kind, f.diagnosis.ranks) for f in analyse(frame)]


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_neighbour_slowed_a_little_is_not_blamed(world: int, seed: int) -> None:
    assert _named(world, 1.1, seed) == [("masked_straggler", (2,))]


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("second", [1.2, 1.3])
def test_a_second_straggler_half_as_slow_stays_named(world: int, second: float) -> None:
    assert _named(world, second, 1) == [("masked_straggler", (2, 3))]


def test_two_stragglers_alike_are_named_together() -> None:
    frame = simulate(8, steps=150, faults=[Fault.parse("masked_straggler@60:2,3:1.5")]).frame()
    assert [(f.diagnosis.kind, f.diagnosis.ranks) for f in analyse(frame)] == [
        ("masked_straggler", (2, 3))
    ]
