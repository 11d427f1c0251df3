"""Phase times from sampled steps (``StepMonitor(phase_sampling=...)``, issue 15).

With phase sampling, auto mode times a window's phases on a sample of its steps, each
weighted so that ``sum / steps`` is the mean over the sample (docs/schema.md). Two things
then differ from a window where every step was timed, and the frame corrects both:

- **How many steps a phase time rests on.** A window mean of 3 sampled steps spreads about
  3x as much as one of 30. The cross-rank rules were tuned on windows of tens of steps, so a
  rank's window that rests on fewer than :data:`MIN_TIMED_STEPS` timed steps takes its
  phase times from it and the rank's windows just before it (at most
  :data:`MAX_POOLED_WINDOWS`): the ratio of their phase time to their steps.
- **Which step time they compare with.** The step histogram holds every step; the phases
  only the sampled ones, each weighted for the steps it stands for. Their difference (the
  time before the final collective, the time outside a phase) then carries the sample's
  noise and not its pairing: a rank's collective wait is long on the steps where it
  arrived first. So the exporter also sends the sampled steps' own durations, weighted as
  their phases (``stepwatch.step.sampled.duration``), and how many there were
  (``stepwatch.step.sampled``); :attr:`JobFrame.phase_step_s` is their weighted mean,
  pooled like the phases.

A rank's windows before its first sampled-step point are taken as fully timed (auto mode
times every step until its first export); from then on a window of that rank with steps but
no sampled-step point had none timed (its steps' phase times went to the next sampled step).
"""

from __future__ import annotations

import numpy as np

from stepwatch.detectors.stats._stats import FloatArray

#: Fewest timed steps a sampled phase time rests on (see the module docstring). At the
#: ``auto`` stride (sampled steps >= 50 ms apart) a 1 s window holds 10-20: pooling is for
#: short windows (the demo's 0.5 s) and sparse fixed strides. On 17 stored sampled demo
#: runs with a straggler, 4 and 8 named it every time; 16 missed it once and, keeping a
#: healthy rank's one-window hiccup alive over the windows pooled after it, named that rank
#: too once. 8: between the two (a window mean of 8 spreads 0.7x as much as one of 4).
MIN_TIMED_STEPS = 8
#: Most windows (the window itself included) a sampled phase time is pooled over.
MAX_POOLED_WINDOWS = 8


def timed_steps(
    steps: FloatArray,
    step_total: FloatArray,
    sampled: FloatArray,
    sampled_count: FloatArray,
    sampled_total: FloatArray,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """``(W, R)`` each window's steps timed, the steps they stand for and their (weighted)
    total duration.

    Args:
        steps: ``(W, R)`` steps finished (the step histogram's count).
        step_total: ``(W, R)`` their total duration.
        sampled: ``(W, R)`` ``stepwatch.step.sampled`` (0 where none).
        sampled_count: ``(W, R)`` the sampled-step histogram's count: the steps they stand
            for (0 where none).
        sampled_total: ``(W, R)`` its sum.
    """
    # From a rank's first sampled-step point on; fully timed before it.
    sampling = np.maximum.accumulate(sampled_count > 0, axis=0)
    return (
        np.where(sampling, sampled, steps),
        np.where(sampling, sampled_count, steps),
        np.where(sampling, sampled_total, step_total),
    )


def pool(
    phase_total: FloatArray,
    steps: FloatArray,
    timed: FloatArray,
    stood_for: FloatArray,
    timed_total: FloatArray,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Phase time per step, the timed steps' mean duration, and the timed steps they rest
    on, each window's from at least :data:`MIN_TIMED_STEPS` timed steps where it has fewer
    than that and fewer than its steps (see the module docstring).

    Args:
        phase_total: ``(W, R, P)`` phase time in each window (weighted sums).
        steps: ``(W, R)`` steps finished.
        timed: ``(W, R)`` steps whose phases were timed (:func:`timed_steps`).
        stood_for: ``(W, R)`` the steps they stand for (their weights).
        timed_total: ``(W, R)`` their weighted total duration.

    Returns:
        ``phase_s`` ``(W, R, P)``, ``phase_step_s`` ``(W, R)`` and ``phase_steps``
        ``(W, R)``; NaN where the rank is silent, and ``phase_s`` and ``phase_step_s`` NaN
        where no step within reach was timed.
    """
    n_windows = steps.shape[0]
    zero_2d = np.zeros((1, *steps.shape[1:]))
    cum_phase = np.concatenate([np.zeros((1, *phase_total.shape[1:])), np.cumsum(phase_total, 0)])
    cum_steps = np.concatenate([zero_2d, np.cumsum(steps, axis=0)])
    cum_timed = np.concatenate([zero_2d, np.cumsum(timed, axis=0)])
    cum_timed_total = np.concatenate([zero_2d, np.cumsum(timed_total, axis=0)])
    cum_stood = np.concatenate([zero_2d, np.cumsum(stood_for, axis=0)])
    phase_s = np.full(phase_total.shape, np.nan)
    step_s = np.full(steps.shape, np.nan)
    rests_on = np.full(steps.shape, np.nan)
    # A window with enough timed steps, or with every step timed, stands alone.
    pending = steps > 0
    ends = np.arange(1, n_windows + 1)
    for span in range(1, MAX_POOLED_WINDOWS + 1):
        starts = np.maximum(ends - span, 0)
        counted = cum_timed[ends] - cum_timed[starts]
        enough = (counted >= MIN_TIMED_STEPS) | (timed >= steps)
        last = (span == MAX_POOLED_WINDOWS) | (starts == 0)
        take = pending & (enough | last[:, None])
        if take.any():
            with np.errstate(invalid="ignore", divide="ignore"):
                window_steps = cum_steps[ends] - cum_steps[starts]
                per_step = (cum_phase[ends] - cum_phase[starts]) / window_steps[:, :, None]
                stood = cum_stood[ends] - cum_stood[starts]
                mean_step = (cum_timed_total[ends] - cum_timed_total[starts]) / stood
            # No timed step in reach (a frame starting in a run of untimed windows): unknown,
            # not zero.
            phase_s[take] = np.where((counted > 0)[:, :, None], per_step, np.nan)[take]
            step_s[take] = np.where(stood > 0, mean_step, np.nan)[take]
            rests_on[take] = counted[take]
            pending &= ~take
        if not pending.any():
            break
    return phase_s, step_s, rests_on
