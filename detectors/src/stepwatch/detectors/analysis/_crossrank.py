"""L2: every rank against its peers, per metric, at several time scales; one-off stalls.

The metrics are step, device idle, each phase, ``arrival`` (time outside the collective),
each kernel category, burstiness (longest / mean), each compute class's share of compute
time and the SM clock. Each is tested with :func:`multiscale_outliers` (BH FDR across the
ranks of each window), needs a minimum effect and persistence, or a sustained run of small
single-window excesses (:func:`sustained_outliers`); host-side stalls need one window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from stepwatch.detectors.analysis._arrival import collectives, is_short, late_flags
from stepwatch.detectors.analysis._context import Basis, Metrics
from stepwatch.detectors.analysis._split import structure
from stepwatch.detectors.frame._frame import COMMUNICATION_CATEGORY
from stepwatch.detectors.stats._stats import (
    BoolArray,
    FloatArray,
    multiscale_outliers,
    nanmedian,
    persistent,
    safe_log,
    sustained_outliers,
)

#: Metric name of the pooled small compute kernel classes.
MINOR_CLASSES = "(minor classes)"
#: Derived metric: step time minus time in the collective (see :func:`_series`).
ARRIVAL = "arrival"
#: Host-side phases that never contain waiting for peers (one-off stalls show there).
STALL_PHASES = ("data", "forward", "optimizer")
#: The ``stall:`` metric of a stall outside every phase (between them).
OUTSIDE = "outside"

_ArrayT = TypeVar("_ArrayT", FloatArray, BoolArray)


class _Series(NamedTuple):
    """One metric to test: its name, ``(W, R)`` values and how its threshold is set."""

    name: str
    values: FloatArray
    threshold: str  # "time", "share", "burst" or "clock" (see _thresholds)


def _series(basis: Basis) -> list[_Series]:
    frame = basis.frame
    series = [_Series("step", frame.step_s, "time")]
    for index, phase in enumerate(frame.phases):
        series.append(_Series(f"phase:{phase}", np.asarray(frame.phase_s[:, :, index]), "time"))
    if basis.split.waiting_phase is not None:
        # The time before the final wait (:mod:`._split`): the rank that reaches the
        # collective last spends the most time outside it and waits least in it (arrival
        # order, ARGUS). Unlike step or communication time, waiting for a late peer does
        # not inflate it.
        series.append(_Series(ARRIVAL, basis.split.lead_s, "time"))
    # The waiters are the long ones in overlapping series: no blame from them.
    series = [s for s in series if s.name not in basis.overlap_waiting]
    with np.errstate(invalid="ignore", divide="ignore"):
        series.append(_Series("burst:step", frame.step_max_s / frame.step_s, "burst"))
        if frame.sm_clock_hz is not None:
            series.append(_Series("clock", 1.0 / frame.sm_clock_hz, "clock"))
        # The kernel source's series last: they are tested on the windows that hold kernel
        # times (:func:`kernel_runs`), which may be a few of them.
        if "idle" not in basis.overlap_waiting:
            series.append(_Series("idle", frame.idle_s, "time"))
        series.append(_Series("burst:idle", frame.idle_max_s / frame.idle_s, "burst"))
        for category in sorted(set(frame.kernel_categories)):
            series.append(_Series(f"category:{category}", frame.category_s(category), "time"))
        compute = basis.compute_s
        for index in basis.major_classes:
            share = np.asarray(frame.kernel_s[:, :, index]) / compute
            series.append(_Series(f"share:{frame.kernel_classes[index]}", share, "share"))
        if basis.minor_classes:
            minor = np.asarray(frame.kernel_s[:, :, basis.minor_classes].sum(axis=2))
            series.append(_Series(f"share:{MINOR_CLASSES}", minor / compute, "share"))
    return series


def is_kernel_series(name: str) -> bool:
    """Whether metric ``name`` comes from the kernel source (a category, a class's share,
    device idle and its burstiness)."""
    return name in ("idle", "burst:idle") or name.startswith(("category:", "share:"))


#: Kernel times in at least this share of the windows with steps are tested window by window.
DENSE_KERNELS = 0.75
BASELINE_RUNS = 2
"""Fewest kernel runs that define the groups' structural offsets (:meth:`KernelRuns.baseline`)."""


class KernelRuns(NamedTuple):
    """Runs of consecutive windows that hold kernel times, each tested as one observation.

    Attributes:
        first: ``(N,)`` the first window of each run.
        last: ``(N,)`` its last window.
    """

    first: npt.NDArray[np.intp]
    last: npt.NDArray[np.intp]

    def pool(self, values: FloatArray) -> FloatArray:
        """``(N, R)``: each rank's mean over each run's windows (NaN where it has none)."""
        finite = np.isfinite(values)
        rows = np.concatenate(
            [np.arange(a, b + 1) for a, b in zip(self.first, self.last, strict=True)]
        )
        starts = np.concatenate([[0], np.cumsum(self.last - self.first + 1)[:-1]])
        sums = np.add.reduceat(np.where(finite, values, 0.0)[rows], starts, axis=0)
        counts = np.add.reduceat(finite[rows].astype(np.int32), starts, axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)

    def spread(self, flags: BoolArray, n_windows: int) -> BoolArray:
        """Flags tested on the runs (``(N, R, M)``), on every window.

        A run's flag covers its windows. A flag on two runs in a row also covers the windows
        between them: the condition held at both observations and nothing between says
        otherwise. A flag on one run alone stays on its windows.
        """
        full = np.zeros((n_windows, *flags.shape[1:]), dtype=bool)
        for index, (first, last) in enumerate(zip(self.first, self.last, strict=True)):
            full[first : last + 1] = flags[index]
        both = flags[:-1] & flags[1:]
        for gap in np.flatnonzero(both.any(axis=(1, 2))):
            full[self.last[gap] + 1 : self.first[gap + 1]] |= both[gap]
        return full

    def baseline(self, windows: BoolArray) -> BoolArray:
        """``(N,)`` the runs that define the job's structure (the groups' offsets): those that
        start within the span of the frame's baseline ``windows``, and at least the first
        :data:`BASELINE_RUNS` that start in or after it.

        Not the first ``BASELINE_WINDOWS`` runs: a run is one window in several, so ten runs
        reached far past the baseline, at one window in 8 over the whole of a simulated
        pipeline job, its fault included. A stage's offset then took in half of its fault,
        and its communication kernels were flagged from the job's start.
        """
        span = np.flatnonzero(windows)
        chosen = np.zeros(self.first.size, dtype=bool)
        if span.size == 0:
            return chosen
        chosen[(self.first >= span[0]) & (self.first <= span[-1])] = True
        chosen[np.flatnonzero(self.first >= span[0])[:BASELINE_RUNS]] = True
        return chosen

    def place(self, target: FloatArray, values: FloatArray) -> None:
        """Write each run's ``(N, R, M)`` values on the run's windows of ``target``."""
        for index, (first, last) in enumerate(zip(self.first, self.last, strict=True)):
            target[first : last + 1] = values[index]


def kernel_runs(basis: Basis) -> KernelRuns | None:
    """The runs of windows that hold kernel times, when some windows with steps hold none.

    A sampling kernel source (the op histograms' duty cycle: 5 profiled steps every few
    thousand by default) fills one window in several; the others hold steps but no kernels.
    Tested window by window, a kernel series would then never persist, and its trailing
    means and pooled scale would rest on one or two observations: a slow class would never
    be named. Its tests run on these runs instead, one after another (see
    :func:`flag_metrics`). Two adjacent windows are one observation when few ranks hold
    kernel times in both (fewer than half of the smaller side): every rank records the same
    steps, but each rank's window ends at its own export, so one cycle lands in two analysis
    windows, some ranks in each. ``None`` when at least :data:`DENSE_KERNELS` of the windows
    with steps hold kernel times (CUPTI, a duty cycle shorter than a window: tested window by
    window, their gaps bridged by the trailing means) or none does.
    """
    frame = basis.frame
    if not frame.kernel_classes:
        return None
    holding = basis.present & np.isfinite(frame.kernel_s).any(axis=2)
    rows = np.flatnonzero(holding.any(axis=1))
    if rows.size == 0 or rows.size >= DENSE_KERNELS * int(basis.present.any(axis=1).sum()):
        return None
    before, after = holding[rows[:-1]], holding[rows[1:]]
    shared = (before & after).sum(axis=1)
    split = 2 * shared < np.minimum(before.sum(axis=1), after.sum(axis=1))
    breaks = np.flatnonzero((np.diff(rows) > 1) | ~split)
    first = rows[np.concatenate([[0], breaks + 1])]
    last = rows[np.concatenate([breaks, [rows.size - 1]])]
    return KernelRuns(first=first.astype(np.intp), last=last.astype(np.intp))


def _thresholds(
    basis: Basis,
    series: list[_Series],
    map_columns: Callable[
        [Callable[[_Series], FloatArray], list[_Series]], Iterable[FloatArray]
    ] = map,
) -> FloatArray:
    """``(W, M)`` smallest log effect worth reporting per window and metric.

    ``map_columns`` maps the per-metric computation (a thread pool's ``map``: the medians
    release the GIL); any map gives the same result.
    """
    config = basis.config
    n_windows = basis.frame.n_windows

    def column(item: _Series) -> FloatArray:
        if item.threshold == "burst":
            return np.full(n_windows, math.log(config.burst_min_ratio))
        if item.threshold == "clock":
            return np.full(n_windows, math.log1p(config.clock_min_drop))
        value = item.values
        if item.threshold == "share":
            value = value * basis.compute_s  # the class's own time per step
        median = nanmedian(np.where(basis.present, value, np.nan), axis=1)[:, 0]
        with np.errstate(invalid="ignore", divide="ignore"):
            result: FloatArray = np.log1p(config.min_step_fraction * basis.step_median / median)
        return result

    result = np.stack(list(map_columns(column, series)), axis=1)
    return np.where(np.isfinite(result), result, np.inf)


def flag_metrics(basis: Basis) -> Metrics:
    """Flag every rank, window and metric slower than the peers (L2).

    Args:
        basis: the frame and its derived arrays.

    Returns:
        The stacked :class:`Metrics`: the tested metrics, then the ``stall:<phase>`` ones.

    Notes:
        At each scale in ``config.scales`` a flag needs a BH rejection at ``config.fdr_q``,
        a log effect above the metric's threshold (:func:`_thresholds`: ``min_step_fraction``
        of the job's step, ``burst_min_ratio``, ``clock_min_drop``), the last ``min(3,
        max(scales))`` windows still showing half of it, and ``persistence_windows``
        consecutive windows. A rank also flags when slower than its peers in
        ``sustained_windows`` consecutive single windows (:func:`sustained_outliers`).
        Metric blocks are tested on ``config.workers`` threads; the result does not depend
        on their number.

    References:
        Benjamini and Hochberg (1995), JRSS B 57; Rousseeuw and Croux (1993), JASA 88.
    """
    # Disjoint metric blocks on worker threads: numpy releases the GIL in the heavy
    # kernels (partition, cumsum, ufuncs), so a big job uses every core it is given.
    # The serial preparation uses them too: the stalls (independent of the series) run
    # beside the series, and the thresholds' medians run one metric per thread.
    with ThreadPoolExecutor(max_workers=max(1, basis.config.workers)) as pool:
        return _flag_metrics(basis, pool)


def _flag_metrics(basis: Basis, pool: ThreadPoolExecutor) -> Metrics:
    """:func:`flag_metrics` with its worker threads."""
    config = basis.config
    frame = basis.frame
    stalls = pool.submit(_stalls, basis) if config.workers > 1 else None
    series = _series(basis)
    thresholds = _thresholds(basis, series, pool.map)
    # One-off stalls take the last columns (filled here, not tested across scales), then,
    # on frames too short for the statistics (a profiler trace), late arrivals.
    stall_names, stall_flags, stall_effect = _stalls(basis) if stalls is None else stalls.result()
    if is_short(basis.present, min_ranks=config.min_ranks, windows=config.sustained_windows):
        found = collectives(frame, basis.step_median, min_ranks=config.min_ranks)
        late = late_flags(found, basis.present)
        stall_names = [*stall_names, *late[0]]
        stall_flags = np.concatenate([stall_flags, late[1]], axis=2)
        stall_effect = np.concatenate([stall_effect, late[2]], axis=2)
    tested = len(series)
    shape = (frame.n_windows, frame.n_ranks, tested + len(stall_names))
    metrics = Metrics(
        names=(*(item.name for item in series), *stall_names),
        flags=np.zeros(shape, dtype=bool),
        effect=np.full(shape, np.nan, dtype=basis.dtype),
        z=np.zeros(shape),
    )
    if stall_names:
        metrics.flags[:, :, tested:] = stall_flags
        metrics.effect[:, :, tested:] = stall_effect
        np.copyto(metrics.z[:, :, tested:], np.nan_to_num(stall_effect), where=stall_flags)
    runs = kernel_runs(basis)
    dense = (
        tested
        if runs is None
        else next((m for m, item in enumerate(series) if is_kernel_series(item.name)), tested)
    )
    test_block = _BlockTest(basis, [item.values for item in series], thresholds, runs, metrics)
    blocks: list[tuple[int, int, bool]] = []
    for first, stop, compact in ((0, dense, False), (dense, tested, True)):
        workers = max(1, min(config.workers, stop - first))
        size = max(1, -(-(stop - first) // workers))
        blocks.extend(
            (start, min(start + size, stop), compact) for start in range(first, stop, size)
        )
    if len(blocks) == 1:
        test_block(*blocks[0])
    else:
        for future in [pool.submit(test_block, *block) for block in blocks]:
            future.result()
    return metrics


class _BlockTest:
    """Tests a block of series and writes its flags, z and effects into the metrics' arrays.

    Blocks are disjoint column ranges, so several run at once on worker threads.
    """

    def __init__(
        self,
        basis: Basis,
        values: list[FloatArray],
        thresholds: FloatArray,
        runs: KernelRuns | None,
        out: Metrics,
    ) -> None:
        self.basis = basis
        self.values = values
        self.thresholds = thresholds
        self.runs = runs
        self.run_baseline = None if runs is None else runs.baseline(basis.baseline)
        self.out = out

    def __call__(self, start: int, stop: int, compact: bool) -> None:
        """Test series ``start:stop``, on every window or (``compact``) on the kernel runs."""
        config = self.basis.config
        picked = self.runs if compact else None
        n_windows = self.basis.frame.n_windows if picked is None else picked.first.size
        # Gate for every scale: the last few windows must still show the effect, so a long
        # trailing mean cannot keep a finding open after the condition cleared.
        # (A frame of one or two windows has no 3-window scale: the gate is what it has.)
        gate_scale = max(1, min(3, max(config.scales), n_windows))
        scales = [
            scale
            for scale in sorted({1, gate_scale, *config.scales})
            if scale == 1 or scale <= n_windows
        ]
        logs = self._logs(start, stop, picked, n_windows)
        limit = (self.thresholds if picked is None else self.thresholds[picked.first])[
            :, None, start:stop
        ]
        tests = multiscale_outliers(
            logs,
            metric="block",
            scales=scales,
            fdr_q=config.fdr_q,
            min_scale=config.min_scale,
            min_ranks=config.min_ranks,
            reference=self.basis.reference,
            exact_p_values=False,  # only reject, z and log_effect are used here
        )
        if picked is None:  # the frame's own arrays, written in place
            flags = self.out.flags[:, :, start:stop]
            zmax = self.out.z[:, :, start:stop]
            effect = self.out.effect[:, :, start:stop]
        else:
            flags = np.zeros(logs.shape, dtype=bool)
            zmax = np.zeros(logs.shape)
            effect = np.full(logs.shape, np.nan, dtype=self.basis.dtype)
        recent = tests[gate_scale].log_effect
        for scale, test in tests.items():
            if scale not in config.scales:
                continue
            hit = _effect_holds(test.reject, test.log_effect, recent, limit)
            _mark(flags, zmax, persistent(hit, windows=config.persistence_windows), test.z)
            if scale == 1:
                effect[...] = test.log_effect
        single = tests[1]
        hit = sustained_outliers(
            single,
            windows=config.sustained_windows,
            q=config.fdr_q,
            min_log_effect=np.maximum(limit, math.log(config.sustained_min_ratio)),
        )
        _mark(flags, zmax, hit, single.z)
        if picked is not None:
            self.out.flags[:, :, start:stop] = picked.spread(flags, self.basis.frame.n_windows)
            picked.place(self.out.z[:, :, start:stop], zmax)
            picked.place(self.out.effect[:, :, start:stop], effect)

    def _logs(self, start: int, stop: int, picked: KernelRuns | None, n_windows: int) -> FloatArray:
        """Log values of series ``start:stop``, each rank centred on its group."""
        basis = self.basis
        # Straight into the test dtype: the same values as stacking, then converting, with
        # no (W, R, M) float64 intermediate (an exact widening first changes nothing).
        block: FloatArray = np.empty(
            (n_windows, basis.frame.n_ranks, stop - start), dtype=basis.dtype
        )
        for column, series_values in enumerate(self.values[start:stop]):
            block[:, :, column] = series_values if picked is None else picked.pool(series_values)
        logs = safe_log(block, dtype=basis.dtype)  # silent ranks are NaN already
        del block
        # Each rank against its own group: the groups' structural offsets taken out.
        baseline = (
            basis.baseline if self.run_baseline is None or picked is None else self.run_baseline
        )
        return basis.groups.centre(logs, baseline)


def _effect_holds(
    reject: BoolArray, log_effect: FloatArray, recent: FloatArray, limit: FloatArray
) -> BoolArray:
    """The rejected cells whose effect reaches the limit and still shows in the last windows.

    A flag needs a BH rejection, which few cells have: the effect conditions are evaluated on
    those cells alone instead of on every (window, rank, metric). The last windows must still
    show at least half of the long-run excess.
    """
    cells = _cells(reject)
    cell_limit = limit[cells[0], 0, cells[2]]
    cell_effect = log_effect[cells]
    current = recent[cells] >= np.maximum(cell_limit, 0.5 * cell_effect)
    kept = (cell_effect >= cell_limit) & current
    hit = np.zeros(reject.shape, dtype=bool)
    hit[tuple(index[kept] for index in cells)] = True
    return hit


def _mark(flags: BoolArray, zmax: FloatArray, hit: BoolArray, z: FloatArray) -> None:
    """Set ``flags`` and raise ``zmax`` to ``z`` (NaN ignored) at the cells ``hit``.

    Flags are sparse: touching only the hit cells of the strided ``(W, R, M)`` slices
    costs a fraction of a masked pass over every cell.
    """
    cells = _cells(hit)
    flags[cells] = True
    zmax[cells] = np.fmax(zmax[cells], z[cells])


def _cells(mask: BoolArray) -> tuple[npt.NDArray[np.intp], ...]:
    """``np.nonzero(mask)``, an order of magnitude faster on sparse 3-D masks."""
    return np.unravel_index(np.flatnonzero(mask), mask.shape)


def _stalls(basis: Basis) -> tuple[list[str], BoolArray, FloatArray]:
    """One-off host-side stalls: ``stall:<phase>`` flags and log ratios ``(W, R, S)``.

    A single window suffices (a stall is one event): the rank's longest occurrence of
    the phase must exceed the peers' median longest occurrence by ``stall_min_steps``
    job median steps and by a factor ``stall_min_ratio``.

    The peers' baseline comes from the same window when at least ``min_ranks`` ranks
    report in it, which keeps a stall every rank shares (a job-wide pause) from flagging
    anyone. Otherwise it pools the windows on either side: a long stall holds every
    rank in the next collective, so no rank finishes a step for a while and the
    stalled step can land in a window that few peers report in.
    """
    frame = basis.frame
    config = basis.config
    phases = [p for p in STALL_PHASES if p in frame.phases]
    step = basis.job_step_s
    shape = (frame.n_windows, frame.n_ranks, len(phases))
    flags = np.zeros(shape, dtype=bool)
    effect = np.full(shape, np.nan)
    if not phases or step <= 0:
        return [], flags, effect
    for column, phase in enumerate(phases):
        longest = np.where(
            basis.present, frame.phase_max_s[:, :, frame.phases.index(phase)], np.nan
        )
        reported = np.isfinite(longest)
        peers = basis.peers(longest)
        before, after = _shifted(peers, 1), _shifted(peers, -1)
        pooled = nanmedian(np.concatenate([before, peers, after], axis=1), axis=1)
        around = (reported | _shifted(reported, 1) | _shifted(reported, -1)).sum(axis=1)
        same = nanmedian(peers, axis=1)
        enough_same = reported.sum(axis=1, keepdims=True) >= config.min_ranks
        peer = np.where(enough_same, same, pooled)
        enough = enough_same | (around[:, None] >= config.min_ranks)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = longest / peer
            hit = (
                (longest - peer >= config.stall_min_steps * step)
                & (ratio >= config.stall_min_ratio)
                & enough
            )
            effect[:, :, column] = np.where(np.isfinite(ratio) & (ratio > 0), np.log(ratio), np.nan)
        flags[:, :, column] = hit
    names = [f"stall:{phase}" for phase in phases]
    outside = _outside_stalls(basis)
    if outside is not None:
        names.append(f"stall:{OUTSIDE}")
        flags = np.concatenate([flags, outside[0][:, :, None]], axis=2)
        effect = np.concatenate([effect, outside[1][:, :, None]], axis=2)
    return names, flags, effect


def outside_gap_s(basis: Basis) -> FloatArray | None:
    """``(W, R)`` time outside every phase in each rank's longest step, at least: its longest
    step minus the longest occurrence of each phase (the communication phase left out when
    the phases overlap it: it lies inside another). ``None`` without phases."""
    frame = basis.frame
    if not frame.phases:
        return None
    overlap = f"phase:{COMMUNICATION_CATEGORY}" in basis.overlap_waiting
    columns = [
        i for i, p in enumerate(frame.phases) if not (overlap and p == COMMUNICATION_CATEGORY)
    ]
    longest = np.where(
        np.isfinite(frame.phase_max_s[:, :, columns]), frame.phase_max_s[:, :, columns], 0.0
    )
    inside = longest.sum(axis=2)
    every = frame.phase_every_step
    if overlap and every is not None:
        # The wait timed on every step, the phase holding it on a sample: a wait longer than
        # any sampled phase was in a step whose phases were not timed, inside the phase that
        # holds it there. (With every step timed, the holding phase is at least as long.)
        index = frame.phases.index(COMMUNICATION_CATEGORY)
        wait = frame.phase_max_s[:, :, index]
        beyond = np.where(np.isfinite(wait), wait - longest.max(axis=2, initial=0.0), 0.0)
        inside += np.where(every[:, :, index], np.clip(beyond, 0.0, None), 0.0)
    return np.where(basis.present, frame.step_max_s - inside, np.nan)


def _outside_stalls(basis: Basis) -> tuple[BoolArray, FloatArray] | None:
    """Stalls outside every phase: ``(W, R)`` flags and log ratios, ``None`` without phases.

    The time outside the phases of a rank's longest step (:func:`outside_gap_s`) shows a
    rank that stopped between phases (a GC pause,
    a checkpoint write, a compile) has a long step whose phases look normal; the peers that
    waited for it have long steps too, but the wait is inside their collective. So a flag
    needs that gap to reach ``config.stall_outside_min_steps`` job median steps and
    ``config.stall_min_ratio`` times the peers' gap, *and* the peers to have waited for
    at least half of it in the same window or one next to it (their longest collective;
    their longest step without one, or when it was sampled): a pause every rank takes at once (a
    synchronous checkpoint) makes no one wait and is not a stall of one rank. A gap
    shorter than ``stall_min_steps`` counts only on a rank with at least two more in the
    frame: once or twice, it is the noise of a shared host (a healthy rank of the 4-rank
    demo, descheduled twice in 40 windows on a loaded 2-core CI host, was named at 1.03x);
    recurring, it is a rank that keeps stopping (unless the window's phases were timed on a
    sample: then a short gap is as likely a phase that ran long on an untimed step).
    """
    frame = basis.frame
    config = basis.config
    step = basis.job_step_s
    gap = outside_gap_s(basis)
    if gap is None or step <= 0:
        return None
    # Structure is not a stall: what a rank's group spends outside its phases from the
    # frame's first windows on (a pipeline stage idling for its neighbours with no op
    # timed, every step) is its baseline; only the time beyond it can be a pause.
    # (Phases that overlap, send/recv beside compute, leave a negative gap: none outside.)
    gap = np.clip(gap, 0.0, None)
    gap = gap - structure(gap, basis.groups, basis.baseline)[None, :]
    # The peers' gap as in _stalls: from the windows on either side when few ranks report
    # in the stalled step's own (its peers, held in the next collective, finish no step).
    peers = basis.peers(gap)
    enough_same = np.isfinite(peers).sum(axis=1, keepdims=True) >= config.min_ranks
    pooled = nanmedian(np.concatenate([_shifted(peers, 1), peers, _shifted(peers, -1)], 1), axis=1)
    peer_gap = np.maximum(np.where(enough_same, nanmedian(peers, axis=1), pooled), 0.0)
    if COMMUNICATION_CATEGORY in frame.phases:
        index = frame.phases.index(COMMUNICATION_CATEGORY)
        held = frame.phase_max_s[:, :, index]
        if frame.phase_steps is not None:
            # Sampled collectives: the step the peers waited in may be untimed, unless the
            # wait was timed on every step (stepwatch.phase.every_step).
            every = frame.phase_every_step
            timed_every_step = every[:, :, index] if every is not None else False
            held = np.where(timed_every_step, held, frame.step_max_s)
    else:  # no collective times
        held = frame.step_max_s
    held = np.where(basis.present, held, np.nan)
    # The peers' wait for the same step may be stored a window earlier or later than the
    # stalled rank's step (each rank's windows end at its own exports).
    waited = np.fmax(
        nanmedian(basis.peers(held), axis=1),
        np.fmax(
            nanmedian(basis.peers(_shifted(held, -1)), axis=1),
            nanmedian(basis.peers(_shifted(held, 1)), axis=1),
        ),
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        hit = (
            (gap >= config.stall_outside_min_steps * step)
            & (gap >= config.stall_min_ratio * peer_gap)
            & (waited >= 0.5 * gap)
        )
        ratio = gap / np.maximum(peer_gap, 1e-3 * step)
        effect = np.where(np.isfinite(ratio) & (ratio > 0), np.log(ratio), np.nan)
        hit &= np.isfinite(gap)
        # A pause of a few steps happens once to any rank of a shared host (descheduled,
        # a page fault): short ones count only on a rank that keeps stopping.
        short = hit & (gap < config.stall_min_steps * step)
        recurring = hit.sum(axis=0, keepdims=True) >= 3
        if frame.phase_steps is not None:
            # With phases timed on a sample, a gap of a few steps is as likely a phase that
            # ran long on an untimed step (a straggler's noisy forward): only long ones count.
            recurring = recurring & ~(frame.phase_steps < frame.step_count)
    return hit & (~short | recurring), effect


def _shifted(values: _ArrayT, by: int) -> _ArrayT:
    """``values`` moved ``by`` windows later along axis 0 (``-by``: earlier), padded.

    NaN padding for floats, ``False`` for booleans.
    """
    out = np.full_like(values, False if values.dtype == bool else np.nan)
    if by > 0:
        out[by:] = values[:-by]
    elif by < 0:
        out[:by] = values[-by:]
    else:
        out[:] = values
    return out
