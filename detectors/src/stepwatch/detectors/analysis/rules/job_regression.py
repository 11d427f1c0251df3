"""``job_regression``: the whole job got slower, and no rank-level finding explains it (L1).

A job rule, run after the others: change points (:func:`change_points`) of the job's median
step, phase and kernel-class times per window; upward shifts of at least
``config.min_shift`` and ``config.min_step_fraction`` of a step, away from every earlier
finding, grouped when within 3 windows (a series with windows of no values, kernel times from
a sampling source, joins by its span: ``_shifts``). A group seen only in series that hold
waiting in collectives is not a regression. Localisation: the phase and kernel class that
moved most; in a job too small for the cross-rank tests, the ranks whose own work carries it
while the others wait (``_few_ranks``). Cost: the step's own shift, else the largest
non-waiting one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._few_ranks import localise
from stepwatch.detectors.analysis._rule import Description, JobRule, Kind, Verdict, severity_of
from stepwatch.detectors.analysis._shifts import Shift, group_shifts, thin_shift
from stepwatch.detectors.analysis._split import STEPS
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY
from stepwatch.detectors.stats._stats import FloatArray, change_points, nanmedian


def _job_series(context: Context) -> dict[str, FloatArray]:
    """The job's median (over ranks) step, phase and major kernel-class times per window."""
    frame = context.frame
    # A rank's first window holds its warm-up (lazy initialisation, caches): not a shift.
    present = context.present & (np.cumsum(context.present, axis=0) > 1)

    def median(values: FloatArray) -> FloatArray:
        return nanmedian(np.where(present, values, np.nan), axis=1)[:, 0]

    series = {"step": median(frame.step_s)}
    for index, phase in enumerate(frame.phases):
        series[f"phase:{phase}"] = median(np.asarray(frame.phase_s[:, :, index]))
    keep = [i for i in range(len(frame.kernel_classes)) if i not in context.minor_classes]
    if frame.n_ranks and keep:
        kernel = np.asarray(frame.kernel_s[:, :, keep])
        medians = nanmedian(np.where(present[:, :, None], kernel, np.nan), axis=1)[:, 0, :]
        for column, index in enumerate(keep):
            series[f"kernel:{frame.kernel_classes[index]}"] = medians[:, column]
    return series


def _waiting_series(context: Context) -> set[str]:
    """Job-level series that hold waiting in collectives (not evidence on their own):
    communication phases and kernels, plus ``context.overlap_waiting`` (a host slowed by
    other work slows its collectives and those series: not a regression of the job's code)."""
    kernels = {f"kernel:{name}" for name in context.communication_classes()}
    return {f"phase:{COMMUNICATION_CATEGORY}"} | kernels | context.overlap_waiting


def _find(context: Context, earlier: Sequence[Verdict]) -> list[Verdict]:
    frame = context.frame
    config = context.config
    if frame.n_windows < 6:
        return []
    step = context.job_step_s
    if step <= 0:
        return []
    window_ns = round(frame.window_s * 1e9)
    origin = int(frame.window_end_unix_nano[0])
    explained = [
        (
            (frame.window_start_unix_nano(v.first) - origin) // window_ns,
            (int(frame.window_end_unix_nano[v.last]) - origin) // window_ns,
        )
        for v in earlier
        if v.description.kind != "stage_imbalance"  # structure: there from the start
    ]
    shifts: list[Shift] = []
    job_series = _job_series(context)
    for name, series in job_series.items():
        for point in change_points(series, min_shift=config.min_shift, alpha=config.change_alpha):
            excess = point.after - point.before
            if point.ratio < 1 or excess < config.min_step_fraction * step:
                continue
            if any(low - 6 <= point.index <= high + 1 for low, high in explained):
                continue
            shifts.append(Shift(point.index, name, excess, point.ratio, point.since))
    waiting = _waiting_series(context)
    # Collective time is mostly waiting for the last rank: its median is an extreme-value
    # statistic, too jumpy to call a job regression on its own.
    groups = [g for g in group_shifts(shifts) if any(s.series not in waiting for s in g)]
    for group in groups:  # no kernel shift tested: a sparse kernel series' move, if any
        index = min(s.window for s in group)
        thin = [
            found
            for name, series in job_series.items()
            if name.startswith("kernel:") and name not in waiting
            and (found := thin_shift(name, series, index, min_ratio=1 + config.min_shift,
                                     min_excess=config.min_step_fraction * step))
        ]  # fmt: skip
        if thin and not any(s.series.startswith("kernel:") for s in group):
            group.append(max(thin, key=lambda s: s.excess_s))
    return [_verdict(context, group, waiting) for group in groups]


def _cost(context: Context, group: list[Shift], waiting: set[str]) -> float:
    """The job's step after the shift over before (see the module)."""
    own = [s for s in group if s.series == "step"]
    if own:
        return max(1.0, own[0].ratio)
    before = context.step_median[: min(s.window for s in group)]
    base = float(np.nanmedian(before)) if np.isfinite(before).any() else context.job_step_s
    excess = max((s.excess_s for s in group if s.series not in waiting), default=0.0)
    return 1.0 + excess / base if base > 0 else 1.0


def _verdict(context: Context, group: list[Shift], waiting: set[str]) -> Verdict:
    frame = context.frame
    index = min(s.window for s in group)
    phases = [s for s in group if s.series.startswith("phase:")]
    kernels = [s for s in group if s.series.startswith("kernel:")]
    steps = [s for s in group if s.series == "step"]
    phases = [s for s in phases if s.series not in waiting] or phases  # own work first
    phase = max(phases, key=lambda s: s.excess_s).series.split(":", 1)[1] if phases else None
    top_kernel = max(kernels, key=lambda s: s.excess_s) if kernels else None
    kernel_class = top_kernel.series.split(":", 1)[1] if top_kernel else None
    tested = [s for s in group if not s.thin]  # a thin kernel move names, never costs
    ratio = steps[0].ratio if steps else max(s.ratio for s in tested)
    detail = [f"{phase} moved most"] if phase else []
    if top_kernel:
        detail.append(f"{kernel_class} {top_kernel.ratio:.2f}x")
        if top_kernel.thin:  # no change point: a ratio over the few windows with kernels
            detail[-1] += f" in the {top_kernel.thin} windows since that recorded kernels"
    head = f"job step time {ratio:.2f}x" if steps else "job slower"
    summary = f"{head} since {context.since(index)} on every rank" + (
        f" ({', '.join(detail)})" if detail else ""
    )
    summary += _lacks(context, phase)
    description = localise(context, index) or Description(
        RULE.kind, summary, ratio, phase, kernel_class, slowdown=_cost(context, tested, waiting)
    )
    return Verdict(
        description=description,
        first=index,
        last=frame.n_windows - 1,
        detected=min(index + 2, frame.n_windows - 1),
        open=True,
        severity=severity_of(description.ratio),
        score=float(max(s.ratio for s in tested)),
    )


def _lacks(context: Context, phase: str | None) -> str:
    """What the data cannot tell about the shift, said in the summary (empty: nothing)."""
    if context.split.evidence == STEPS:
        return "; the data holds step times alone: which rank or phase cannot be told"
    if phase is not None and phase == context.split.waiting_phase != COMMUNICATION_CATEGORY:
        return (
            f"; {phase} holds the collective and its wait: without a communication phase, "
            "a slower collective or a late rank cannot be told from slower compute"
        )
    return ""


KIND = Kind(
    name="job_regression",
    shows="the whole job slower from a point in time, no rank to blame",
    localised="phase and kernel class that moved",
    simulated=6,
)


RULE = JobRule(declared=KIND, order=90, find=_find)
