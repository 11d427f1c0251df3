"""A fault's ground truth: the pipeline job's own step times over paired blocks of steps
with and without the fault (``stepwatch.app._pipeline_job``)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from stepwatch.app._pipeline_config import PipelineJobConfig, block_faulty
from stepwatch.core._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Truth:
    """A fault's cost measured by the job's own clock over paired blocks of steps.

    Attributes:
        ratio: mean step time in the blocks with the fault / in the blocks without.
        ratio_se: standard error of the mean of the pairs' ratios (their spread / √pairs).
        ratio_min, ratio_max: the lowest and highest pair's ratio.
        pairs: each pair's ``(mean step without, mean step with)`` in seconds.
        lost_s: mean over the pairs of (a block with the fault - one without), in seconds:
            the time the fault cost one block (a one-off stall's cost).
    """

    ratio: float
    ratio_se: float
    ratio_min: float
    ratio_max: float
    pairs: tuple[tuple[float, float], ...]
    lost_s: float


def paired_truth(blocks: Sequence[tuple[bool, Sequence[float]]]) -> Truth:
    """The fault's cost from consecutive blocks ``(with the fault, step times in s)``.

    Blocks pair up in order (0 with 1, 2 with 3, ...); each pair holds one block of each
    arm (for an A/A comparison, the second block counts as the one "with").
    """
    if len(blocks) < 2 or len(blocks) % 2:
        raise ConfigError(f"blocks: need pairs of blocks, got {len(blocks)}")
    pairs = []
    lost = []
    for index in range(0, len(blocks), 2):
        (first_on, first), (_, second) = blocks[index], blocks[index + 1]
        off, on = (second, first) if first_on else (first, second)
        pairs.append((statistics.fmean(off), statistics.fmean(on)))
        lost.append(math.fsum(on) - math.fsum(off))
    ratios = [on / off for off, on in pairs]
    spread = statistics.stdev(ratios) if len(ratios) > 1 else math.nan
    return Truth(
        ratio=statistics.fmean(on for _, on in pairs) / statistics.fmean(off for off, _ in pairs),
        ratio_se=spread / math.sqrt(len(ratios)),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        pairs=tuple(pairs),
        lost_s=statistics.fmean(lost),
    )


#: :func:`drift`'s chunks of consecutive steps.
DRIFT_CHUNK_STEPS = 25


def drift(steps: Sequence[float], chunk: int = DRIFT_CHUNK_STEPS) -> float | None:
    """The largest mean step time of ``chunk`` consecutive steps over the smallest (the last
    chunk, if shorter, left out); None with fewer than two chunks."""
    means = [
        statistics.fmean(steps[start : start + chunk])
        for start in range(0, len(steps) - chunk + 1, chunk)
    ]
    return max(means) / min(means) if len(means) > 1 else None


def results_of(config: PipelineJobConfig, timings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the job measured, from every rank's ``_Worker.timings()`` (in rank order).

    ``recorded``: the mean step time (over ranks) of the recorded steps before and from the
    fault's onset, and each stage's forward + backward time (``stage_compute_s``) and the
    device time in it (``stage_device_s``) per step before the onset (the first steps left
    out: warm-up), and how far the step time drifted before and after the onset
    (:func:`drift`: a load that came or went on the host). ``truth``: :class:`Truth` over the
    ranks' mean step time in each block of the ``fault`` series (absent without truth
    blocks); ``truth_even_head`` (``healthy`` only): the same over the ``even-head`` series,
    the job as it is over the same job with its loss head's device time spread evenly over
    the stages.
    """
    steps = [t["step_s"] for t in timings]
    mean_step = [statistics.fmean(values) for values in zip(*steps, strict=True)]
    onset = config.onset_step if config.onset_step is not None else config.steps
    warm = min(5, onset - 1)

    def per_stage(key: str) -> list[float | None]:
        return [
            statistics.fmean(
                statistics.fmean(timings[config.rank_of(stage, r)][key][warm:onset])
                for r in range(config.dp)
            )
            if onset > warm
            else None
            for stage in range(config.pp)
        ]

    recorded: dict[str, Any] = {
        "mean_step_s_before": statistics.fmean(mean_step[warm:onset]) if onset > warm else None,
        "mean_step_s_after": (
            statistics.fmean(mean_step[onset : config.steps]) if onset < config.steps else None
        ),
        "stage_compute_s": per_stage("compute_s"),
        "stage_device_s": per_stage("device_s"),
        "step_drift_before": drift(mean_step[warm:onset]),
        "step_drift_after": drift(mean_step[onset : config.steps]),
    }
    results: dict[str, Any] = {"recorded": recorded}
    if not config.truth_pairs:
        return results
    size = config.truth_block_steps
    for number, series in enumerate(config.truth_series):
        first = number * config.series_blocks
        blocks = [
            (
                block_faulty(config, index),
                mean_step[config.steps + index * size : config.steps + (index + 1) * size],
            )
            for index in range(first, first + config.series_blocks)
        ]
        key = "truth" if series == "fault" else f"truth_{series.replace('-', '_')}"
        results[key] = dataclasses.asdict(paired_truth(blocks))
    return results
