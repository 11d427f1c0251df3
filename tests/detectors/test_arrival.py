"""Arrival order in the collective: a rank late to it waits least (ARGUS).

Synthetic frames shaped like the CPU DDP demo: the allreduce runs inside ``loss.backward()``
(so phases overlap the step), every rank waits out a late peer, and the only per-rank trace of
a slow communication path is *time outside the collective* (step minus communication).
"""

from __future__ import annotations

import numpy as np

from stepwatch.detectors import JobFrame, analyse

WINDOWS, RANKS, ONSET = 24, 4, 8
PHASES = ("data", "forward", "backward", "optimizer", "communication")
HOSTS = ("node-0", "node-0", "node-1", "node-1")


def demo_like_frame(*, seed: int, late_s: float = 0.0, slow_forward_s: float = 0.0) -> JobFrame:
    """Rank 2 is late to the collective by ``late_s`` (its comm path) or computes
    ``slow_forward_s`` longer (a straggler) from window ``ONSET`` on."""
    rng = np.random.default_rng(seed)
    noise = rng.lognormal(0.0, 0.08, size=(WINDOWS, RANKS, 4))
    data, forward, backward, optimizer = (np.array([0.0001, 0.0012, 0.0040, 0.0005]) * noise).T
    data, forward, backward, optimizer = data.T, forward.T, backward.T, optimizer.T  # (W, R)
    forward[ONSET:, 2] += slow_forward_s
    extra = np.zeros((WINDOWS, RANKS))
    extra[ONSET:, 2] = late_s  # in rank 2's comm path before the collective: in no phase
    arrival = data + forward + backward + extra
    transfer = 0.002 * rng.lognormal(0.0, 0.08, size=(WINDOWS, 1))
    wait = arrival.max(axis=1, keepdims=True) - arrival + transfer  # in the collective
    step_s = arrival.max(axis=1, keepdims=True) + transfer + optimizer
    # The allreduce runs inside loss.backward(): backward holds the comm path and the wait.
    phase_s = np.stack([data, forward, backward + extra + wait, optimizer, wait], axis=2)
    ends = 1_795_000_000_000_000_000 + np.arange(1, WINDOWS + 1) * 500_000_000
    return JobFrame(
        job="arrival",
        window_s=0.5,
        window_end_unix_nano=ends,
        ranks=np.arange(RANKS),
        hosts=HOSTS,
        pp_ranks=np.full(RANKS, -1),
        step_count=np.full((WINDOWS, RANKS), 20.0),
        step_s=step_s,
        step_max_s=step_s * 1.3,
        phases=PHASES,
        phase_s=phase_s,
        phase_max_s=phase_s * 1.3,
        kernel_classes=(),
        kernel_categories=(),
        kernel_s=np.zeros((WINDOWS, RANKS, 0)),
        idle_s=np.full((WINDOWS, RANKS), np.nan),
        idle_max_s=np.full((WINDOWS, RANKS), np.nan),
    )


def test_a_rank_late_to_the_collective_is_a_link_finding_on_its_host() -> None:
    for seed in range(3):
        findings = [f.diagnosis for f in analyse(demo_like_frame(seed=seed, late_s=0.008))]
        assert [(d.kind, d.hosts) for d in findings] == [("link_degradation", ("node-1",))]
        assert 2 in findings[0].ranks
        assert "late" in findings[0].summary


def test_a_late_straggler_stays_a_straggler_and_clean_runs_stay_quiet() -> None:
    for seed in range(3):
        straggler = [f.diagnosis for f in analyse(demo_like_frame(seed=seed, slow_forward_s=0.008))]
        assert [(d.kind, d.ranks) for d in straggler] == [("masked_straggler", (2,))]
        assert analyse(demo_like_frame(seed=seed)) == []


def _with_stall(frame: JobFrame, ranks: list[int], *, absent: list[int]) -> JobFrame:
    """A 1.5 s forward stall on ``ranks`` in window ONSET. Every rank waits it out in the next
    collective, so nobody finishes a step in window ONSET - 1 and the ranks in ``absent``
    finish theirs (a long wait) only in window ONSET + 1, as in a demo run on a busy machine.
    """
    import dataclasses

    count = frame.step_count.copy()
    step, step_max = frame.step_s.copy(), frame.step_max_s.copy()
    phase, phase_max = frame.phase_s.copy(), frame.phase_max_s.copy()
    count[ONSET - 1] = 0
    forward = PHASES.index("forward")
    for rank in ranks:
        phase_max[ONSET, rank, forward] = 1.5
        step_max[ONSET, rank] = 1.52
        # The means carry the stall too: 1.5 s over the window's steps.
        phase[ONSET, rank, forward] += 1.5 / count[ONSET, rank]
        step[ONSET, rank] += 1.5 / count[ONSET, rank]
    waited = [PHASES.index("backward"), PHASES.index("communication")]
    for rank in range(RANKS):
        if rank in ranks:
            continue
        window = ONSET + 1 if rank in absent else ONSET  # the others wait it out
        step[window, rank] += 1.5 / count[window, rank]
        phase[window, rank, waited] += 1.5 / count[window, rank]
    for rank in absent:
        count[ONSET, rank] = 0
        step_max[ONSET + 1, rank] = 1.52
    for values in (step, step_max, phase, phase_max):
        values[count == 0] = np.nan
    return dataclasses.replace(
        frame,
        step_count=count,
        step_s=step,
        step_max_s=step_max,
        phase_s=phase,
        phase_max_s=phase_max,
    )


def test_a_one_off_stall_is_found_when_few_peers_report_in_its_window() -> None:
    for seed in range(3):
        frame = _with_stall(demo_like_frame(seed=seed), [2], absent=[0, 3])
        found = [(f.diagnosis.kind, f.diagnosis.ranks) for f in analyse(frame)]
        assert ("jit_stall", (2,)) in found


def test_a_stall_every_rank_shares_blames_no_rank() -> None:
    for seed in range(3):
        frame = _with_stall(demo_like_frame(seed=seed), [0, 1, 2, 3], absent=[])
        assert not any(f.diagnosis.kind == "jit_stall" for f in analyse(frame))
