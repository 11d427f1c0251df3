"""Rank episodes: runs of flagged windows on one rank, their onset, classified and merged;
and the findings on ranks that only waited for a culprit of their own pipeline, dropped."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np

from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._context import Context, Metrics
from stepwatch.detectors.analysis._rule import (
    EpisodeGroup,
    EpisodeRule,
    Flagged,
    Kind,
    Registry,
    Verdict,
)

#: A rank waited when its communication time is this much above the culprit's.
WAITED_RATIO = 1.1


@dataclasses.dataclass(frozen=True)
class Episode:
    """One rank's run of flagged windows (gaps up to ``config.gap_windows`` inside).

    Attributes:
        rank_index: the rank (index into the frame).
        first: onset: the first flag walked back while the effect stays large.
        last: last flagged window.
        detected: first flagged window.
        flagged: the metrics flagged in the run and in how many windows each.
    """

    rank_index: int
    first: int
    last: int
    detected: int
    flagged: Flagged


#: Metrics that measure a rank's waiting for others: flagged alone, the rank waited longer
#: than its peers (for a culprit elsewhere, or in a rotation of slowest ranks) and did not
#: slow anything down itself.
WAIT_METRICS = frozenset({"phase:communication"})


def find_episodes(metrics: Metrics, config: DetectorConfig) -> list[Episode]:
    """Every rank's episodes, by rank index then time; those that only waited left out."""
    any_flag = np.asarray(metrics.flags.any(axis=2))
    episodes: list[Episode] = []
    for rank_index in np.flatnonzero(any_flag.any(axis=0)):
        windows = np.flatnonzero(any_flag[:, rank_index])
        breaks = np.flatnonzero(np.diff(windows) > config.gap_windows)
        for run in np.split(windows, breaks + 1):
            first_flag, last = int(run[0]), int(run[-1])
            counts = metrics.flags[first_flag : last + 1, rank_index, :].sum(axis=0)
            flagged = {metrics.names[m]: int(counts[m]) for m in np.flatnonzero(counts)}
            if flagged.keys() <= WAIT_METRICS or _misaligned(flagged):
                continue
            episodes.append(
                Episode(
                    rank_index=int(rank_index),
                    first=_onset(metrics, config, int(rank_index), first_flag),
                    last=last,
                    detected=first_flag,
                    flagged=flagged,
                )
            )
    return episodes


#: Windows a rank's step alone may differ from its peers' in and be an artifact: each
#: producer closes its windows at its own instants (OpenTelemetry SDKs: when the rank's
#: process started), so a window that straddles a change of the job's pace holds more slow
#: steps on one rank than on another (for up to three windows when exports lie almost an
#: interval apart). Synchronous ranks' steps end together; a real
#: difference lasts.
MISALIGNED_WINDOWS = 3


def _misaligned(flagged: Flagged) -> bool:
    """Only the step flagged, in at most :data:`MISALIGNED_WINDOWS` windows; or the step
    with the rank's wait and nothing of its own: the longer wait of a window that holds more
    of the slow steps than its peers' windows do (in step with them, a rank cannot take
    longer per step without being late or slow itself)."""
    if "step" not in flagged or not flagged.keys() <= {"step"} | WAIT_METRICS:
        return False
    return flagged.keys() != {"step"} or flagged["step"] <= MISALIGNED_WINDOWS


def _onset(metrics: Metrics, config: DetectorConfig, rank_index: int, first_flag: int) -> int:
    """The window the rank's condition began in, at or before its first flag.

    The metric is the one with the largest z at the first flag. First, walk back while its
    single-window effect stays at least half its median over the first five flagged
    windows. A noisy effect (a small job's rank flags only once it has been slow in 6 of 7
    windows) dips below that before the real start: then the best single step in the
    effect over the lookback (the split that separates the windows before from those after
    most, :func:`_step_start`) dates it, when the windows after it hold the level and those
    before are clearly below. The lookback is the longest scale plus the persistence a flag
    needs.
    """
    hit = np.flatnonzero(metrics.flags[first_flag, rank_index, :])
    metric = int(hit[np.argmax(metrics.z[first_flag, rank_index, hit])])
    series = metrics.effect[:, rank_index, metric]
    lookback = max(config.scales) + config.persistence_windows
    head = series[first_flag : min(first_flag + 5, series.size)]
    if not np.isfinite(head).any():
        return first_flag
    level = float(np.nanmedian(head))
    if level <= 0:
        return first_flag
    onset = first_flag
    for index in range(first_flag - 1, max(-1, first_flag - lookback), -1):
        value = series[index]
        if not np.isfinite(value) or value < 0.5 * level:
            break
        onset = index
    if metrics.names[metric].startswith(_EVENTS):
        return onset  # a one-off event has no level to step up to
    start = max(0, first_flag - lookback)
    stepped = _step_start(series[start : first_flag + 1], level)
    return min(onset, start + stepped) if stepped is not None else onset


#: Metrics of one-off events (stalls, bursts, a late arrival in one step).
_EVENTS = ("stall:", "burst:", "late:")


def _step_start(values: np.ndarray, level: float) -> int | None:
    """The index where ``values`` steps up to about ``level``: the split maximising the
    two-sample statistic of the windows before and after it, when the mean after is at
    least half ``level`` and the mean before under a quarter of it; else ``None``."""
    finite = np.isfinite(values)
    if finite.sum() < 4:
        return None
    x = np.where(finite, values, 0.0)
    n_before = np.cumsum(finite)[:-1]  # windows before the split at 1 .. n-1
    s_before = np.cumsum(x)[:-1]
    n_after = finite.sum() - n_before
    s_after = x.sum() - s_before
    with np.errstate(invalid="ignore", divide="ignore"):
        before, after = s_before / n_before, s_after / n_after
        statistic = (after - before) * np.sqrt(n_before * n_after / (n_before + n_after))
    usable = (n_before >= 2) & (n_after >= 2) & (after >= 0.5 * level) & (before < 0.25 * level)
    if not usable.any():
        return None
    return int(np.argmax(np.where(usable, statistic, -np.inf))) + 1


def merge_episodes(
    episodes: list[Episode], registry: Registry
) -> list[tuple[EpisodeRule, EpisodeGroup]]:
    """Classify each episode, then merge those of one kind that overlap or touch in time.

    Kinds come in the order of their first episode; groups of a kind by start.
    """
    by_rule: dict[str, tuple[EpisodeRule, list[Episode]]] = {}
    for episode in episodes:
        rule = registry.classify(episode.flagged)
        by_rule.setdefault(rule.kind, (rule, []))[1].append(episode)
    result: list[tuple[EpisodeRule, EpisodeGroup]] = []
    for rule, members in by_rule.values():
        members.sort(key=lambda e: e.first)
        merged: list[list[Episode]] = []
        for episode in members:
            if merged and episode.first <= max(e.last for e in merged[-1]) + 1:
                merged[-1].append(episode)
            else:
                merged.append([episode])
        for group in merged:
            indices = tuple(sorted({e.rank_index for e in group}))
            first = min(e.first for e in group)
            last = max(e.last for e in group)
            detected = min(e.detected for e in group)
            own = tuple((e.rank_index, e.first, e.last, e.detected) for e in group)
            result.append((rule, EpisodeGroup(indices, first, last, detected, own)))
    return result


def drop_waiters(context: Context, verdicts: list[Verdict], registry: Registry) -> list[Verdict]:
    """The verdicts without those on ranks that only waited for a culprit in their replica.

    In a pipeline, the stages of one data-parallel replica wait for each other: when one
    rank is slow, the other stages of its replica idle or spin in their point-to-point
    kernels for the same windows, and look slow too. Of two findings on disjoint ranks of
    the same replicas (``stepwatch.dp_rank``) whose windows overlap (or follow within
    ``gap_windows``), the one whose ranks spent more time in communication waited
    (arrival order within the pipeline: the late rank waits least); it is dropped. Without
    communication data, a finding of a waiting kind yields to one of a culprit kind.
    Needs data-parallel coordinates; without them nothing is dropped.
    """
    groups = context.groups
    if not groups.replicas_known or groups.n_groups < 2:
        return verdicts
    wait = _wait(context)
    slack = context.config.gap_windows
    ranked = [v for v in verdicts if v.description.indices]
    kept = []
    for verdict in verdicts:
        mine = set(verdict.description.indices)
        waited = mine and any(
            other is not verdict
            and other.first <= verdict.last + slack
            and verdict.first <= other.last + slack
            and not mine & set(other.description.indices)
            and _replicas(context, mine) <= _replicas(context, other.description.indices)
            and _waited_for(context, registry, wait, verdict, other)
            for other in ranked
        )
        if not waited:
            kept.append(verdict)
    return kept


def _wait(context: Context) -> np.ndarray | None:
    frame = context.frame
    kernels = frame.category_s("communication")
    if np.isfinite(kernels).any():
        return kernels
    return frame.phase("communication")


def _replicas(context: Context, indices: Sequence[int] | set[int]) -> set[int]:
    return {int(context.groups.replicas[i]) for i in indices}


def _waited_for(
    context: Context,
    registry: Registry,
    wait: np.ndarray | None,
    waiter: Verdict,
    culprit: Verdict,
) -> bool:
    """``waiter``'s ranks spent clearly more time in communication than ``culprit``'s;
    without communication data, ``waiter`` is of a waiter's kind and ``culprit`` of a
    culprit's (``Kind.role``)."""
    if wait is None:
        roles = (
            registry.kind(waiter.description.kind).role,
            registry.kind(culprit.description.kind).role,
        )
        return roles == ("waiter", "culprit")
    span = slice(min(waiter.first, culprit.first), max(waiter.last, culprit.last) + 1)
    with np.errstate(invalid="ignore"):
        theirs = float(np.nanmean(wait[span][:, list(waiter.description.indices)]))
        ours = float(np.nanmean(wait[span][:, list(culprit.description.indices)]))
    return bool(theirs > WAITED_RATIO * ours)


def narrow_to_late(context: Context, declared: Kind, group: EpisodeGroup) -> EpisodeGroup:
    """Keep, in each pipeline replica, only the ranks that waited least in communication.

    The stages of a replica wait for its slow rank in their point-to-point kernels (which
    spin), so over the episode the culprit spends the least time in communication of its
    replica's flagged ranks; the others only waited (arrival order within the pipeline).
    Needs data-parallel coordinates and communication data; otherwise the group as is.
    """
    groups = context.groups
    if declared.narrows_neighbours and not (groups.replicas_known and groups.n_groups > 1):
        return _narrow_data_parallel(context, group)
    if not declared.narrows_replicas or not groups.replicas_known or groups.n_groups < 2:
        return group
    wait = _wait(context)
    if wait is None:
        return group
    with np.errstate(invalid="ignore"):
        mean = np.nanmean(wait[group.span][:, list(group.indices)], axis=0)
    by_replica: dict[int, list[tuple[float, int]]] = {}
    for value, index in zip(mean.tolist(), group.indices, strict=True):
        by_replica.setdefault(int(groups.replicas[index]), []).append((value, index))
    kept = []
    for members in by_replica.values():
        lowest = min(value for value, _ in members)
        kept += [i for value, i in members if not value > WAITED_RATIO * lowest]
    return group.narrowed(sorted(kept)) if kept else group


#: A rank flagged beside a straggler in a data-parallel job (``Kind.narrows_neighbours``) is
#: dropped when its wait is past this share of the way to the peers' wait.
WAITER_SHARE = 0.75


def _narrow_data_parallel(context: Context, group: EpisodeGroup) -> EpisodeGroup:
    """Keep the ranks that waited like the straggler, not like its peers.

    Every rank waits for the slowest in the all-reduce. A rank slowed less than the straggler
    (on a shared host, the neighbour of a CPU-hungry rank) is flagged beside it, but it still
    waits for it: its wait lies between the straggler's and the unflagged peers'. Ranks whose
    mean wait over the episode is past ``WAITER_SHARE`` of the way from the group's least to
    the peers' median (slowed by less than about a quarter of the straggler's excess) are
    dropped; ranks slowed alike, or a second straggler half as slow, wait alike and stay.
    Needs a communication series and peers.
    """
    if len(group.indices) < 2 or any(name.startswith("late:") for name in context.flagged(group)):
        return group  # single-step arrival order names each collective's late ranks itself
    wait = _wait(context)
    if wait is None:
        return group
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(np.where(context.present, wait, np.nan)[group.span], axis=0)
    mine = np.zeros(mean.shape[0], dtype=bool)
    mine[list(group.indices)] = True
    peers = mean[~mine & np.isfinite(mean)]
    own = mean[list(group.indices)]
    if not peers.size or not np.isfinite(own).all():
        return group
    lowest, typical = float(own.min()), float(np.median(peers))
    if not typical > lowest:
        return group
    bar = lowest + WAITER_SHARE * (typical - lowest)
    kept = [i for i, value in zip(group.indices, own.tolist(), strict=True) if value <= bar]
    return group.narrowed(kept) if kept else group
