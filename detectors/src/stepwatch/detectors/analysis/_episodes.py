"""Rank episodes: runs of flagged windows on one rank, their onset, classified and merged."""

from __future__ import annotations

import dataclasses

import numpy as np

from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._context import Metrics
from stepwatch.detectors.analysis._rule import EpisodeGroup, EpisodeRule, Flagged, Registry


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


def find_episodes(metrics: Metrics, config: DetectorConfig) -> list[Episode]:
    """Every rank's episodes, by rank index then time."""
    any_flag = np.asarray(metrics.flags.any(axis=2))
    episodes: list[Episode] = []
    for rank_index in np.flatnonzero(any_flag.any(axis=0)):
        windows = np.flatnonzero(any_flag[:, rank_index])
        breaks = np.flatnonzero(np.diff(windows) > config.gap_windows)
        for run in np.split(windows, breaks + 1):
            first_flag, last = int(run[0]), int(run[-1])
            counts = metrics.flags[first_flag : last + 1, rank_index, :].sum(axis=0)
            flagged = {metrics.names[m]: int(counts[m]) for m in np.flatnonzero(counts)}
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


def _onset(metrics: Metrics, config: DetectorConfig, rank_index: int, first_flag: int) -> int:
    """Walk back from the first flag while the single-window effect stays large.

    The metric is the one with the largest z at the first flag; the walk stops at the first
    window whose effect is below half its median over the first five flagged windows, or
    after the longest scale plus the persistence a flag needs.
    """
    hit = np.flatnonzero(metrics.flags[first_flag, rank_index, :])
    metric = int(hit[np.argmax(metrics.z[first_flag, rank_index, hit])])
    series = metrics.effect[:, rank_index, metric]
    lookback = max(config.scales) + config.persistence_windows
    level = np.nanmedian(series[first_flag : min(first_flag + 5, series.size)])
    if not np.isfinite(level) or level <= 0:
        return first_flag
    onset = first_flag
    for index in range(first_flag - 1, max(-1, first_flag - lookback), -1):
        value = series[index]
        if not np.isfinite(value) or value < 0.5 * level:
            break
        onset = index
    return onset


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
            result.append((rule, EpisodeGroup(indices, first, last, detected)))
    return result
