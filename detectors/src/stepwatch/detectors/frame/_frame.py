"""Windows of one job as dense numpy arrays, read back from InfluxDB with InfluxQL.

Ranks export windows independently, so their timestamps never coincide. The reader bins
window end times into fixed analysis windows aligned on the Unix epoch (so two incremental
passes over overlapping ranges see the same bins) and adds histogram sums and counts per
bin: per-step means stay exact whatever the number of exports per bin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.core._influx import InfluxClient, QuerySeries, quote_ident, quote_literal
from stepwatch.detectors.frame import _bins, _sampled
from stepwatch.detectors.stats._stats import BoolArray, FloatArray

#: Kernel categories whose time counts as "compute" for straggler blame.
COMPUTE_CATEGORY = "compute"
COMMUNICATION_CATEGORY = "communication"
#: Phases whose wall time is host/device compute (not waiting in a collective).
COMPUTE_PHASES = ("forward", "backward", "optimizer")
#: Without a communication phase, the phase that holds the gradient all-reduce and the wait
#: for the last rank in it: DDP, FSDP and Horovod start the all-reduce from backward hooks,
#: so every producer that times ``loss.backward()`` (Lightning's and HF Trainer's timers, a
#: hand-written ``with phase("backward")``, a device timer over backward) records it there.
WAIT_HOLDING_PHASE = "backward"


@dataclasses.dataclass(frozen=True, eq=False)
class JobFrame:
    """One job's windows × ranks [× phases | kernel classes], per-step means in seconds.

    Attributes:
        job: the job id.
        window_s: analysis window length.
        window_end_unix_nano: ``(W,)`` end of each analysis window.
        ranks: ``(R,)`` global ranks, sorted.
        hosts: host name of each rank (``""`` when unknown).
        pp_ranks: ``(R,)`` pipeline stage of each rank, -1 when unknown.
        step_count: ``(W, R)`` steps finished in the window (0 = rank silent).
        step_s: ``(W, R)`` mean step wall time (NaN when silent).
        step_max_s: ``(W, R)`` longest step.
        phases: phase names, the last axis of ``phase_s``.
        phase_s: ``(W, R, P)`` time per step in each phase.
        phase_max_s: ``(W, R, P)`` longest single phase occurrence.
        kernel_classes: kernel class names, the last axis of ``kernel_s``.
        kernel_categories: category of each kernel class.
        kernel_s: ``(W, R, K)`` kernel time per step of each class: per step whose kernels
            were recorded (:attr:`kernel_steps`); NaN where the rank reported no kernel
            time in the window (a sampling source between its cycles), 0 for a class that
            did not run while others did.
        idle_s: ``(W, R)`` device-idle time per step (per recorded step, as ``kernel_s``).
        idle_max_s: ``(W, R)`` longest per-step idle time.
        sm_clock_hz: ``(W, R)`` mean SM clock (GPU health) or ``None`` when not reported.
        dp_ranks: ``(R,)`` data-parallel replica of each rank, -1 when unknown (``None``: none
            reported).
        tp_ranks: ``(R,)`` tensor-parallel rank of each rank, -1 when unknown (``None``: none
            reported).
        phase_min_s: ``(W, R, P)`` shortest single phase occurrence (the histograms' ``min``),
            or ``None`` when not read. The shortest time a rank spent in its collective in a
            window is the collective with (almost) no waiting: the transfer itself.
        phase_step_s: ``(W, R)`` mean duration of the steps ``phase_s`` rests on, when the
            exporter sampled phases (``None``: every step was timed: ``step_s``). Compare
            phase times with this, not ``step_s`` (:attr:`phase_step`; :mod:`._sampled`).
        phase_steps: ``(W, R)`` how many timed steps ``phase_s`` rests on, when sampled
            (``None``: ``step_count``). A rank's window with fewer than
            ``_sampled.MIN_TIMED_STEPS`` takes its phase times from it and its windows
            just before it.
        phase_every_step: ``(W, R, P)`` where the rank's window timed the phase on every
            step although its other phases were sampled (``stepwatch.phase.every_step``: the
            collective wait, ``phase()`` contexts), or ``None`` when none did. Such a phase
            time is the window's own (not pooled) and compares with ``step_s``
            (:meth:`phase_base`).
        kernel_steps: ``(W, R)`` how many steps ``kernel_s`` and ``idle_s`` rest on, where
            the kernel source recorded some steps of the window only (``None``: every
            step, or not known). A source reports one device-idle value per step it
            recorded (docs/schema.md), so this is the count of the window's idle
            histogram, at most its steps: a duty-cycled profiler's 5 steps of a window's
            500 give their own kernel time per step, not a five-hundredth of it.
        phase_occurrences: ``(W, R, P)`` how many times per step the phase was timed (its
            histogram's count over the steps: a loop that times each micro-batch's forward,
            or each point-to-point wait, times it several times a step), or ``None`` when
            not read (once a step). ``phase_min_s`` is then one occurrence, not a step's.
    """

    job: str
    window_s: float
    window_end_unix_nano: np.ndarray
    ranks: np.ndarray
    hosts: tuple[str, ...]
    pp_ranks: np.ndarray
    step_count: FloatArray
    step_s: FloatArray
    step_max_s: FloatArray
    phases: tuple[str, ...]
    phase_s: FloatArray
    phase_max_s: FloatArray
    kernel_classes: tuple[str, ...]
    kernel_categories: tuple[str, ...]
    kernel_s: FloatArray
    idle_s: FloatArray
    idle_max_s: FloatArray
    sm_clock_hz: FloatArray | None = None
    dp_ranks: np.ndarray | None = None
    tp_ranks: np.ndarray | None = None
    phase_min_s: FloatArray | None = None
    phase_step_s: FloatArray | None = None
    phase_steps: FloatArray | None = None
    phase_every_step: BoolArray | None = None
    kernel_steps: FloatArray | None = None
    phase_occurrences: FloatArray | None = None

    @property
    def phase_step(self) -> FloatArray:
        """``(W, R)`` the step time phase times compare with: the sampled steps' mean when
        phases were sampled, else ``step_s``."""
        return self.step_s if self.phase_step_s is None else self.phase_step_s

    def phase_base(self, index: int) -> FloatArray:
        """``(W, R)`` the step time phase ``index``'s time compares with: :attr:`phase_step`,
        or ``step_s`` where that phase was timed on every step."""
        every = self.phase_every_step
        if every is None:
            return self.phase_step
        return np.where(every[:, :, index], self.step_s, self.phase_step)

    def phase_rests_on(self, index: int) -> FloatArray | None:
        """``(W, R)`` how many timed steps phase ``index``'s time rests on when phases were
        sampled (:attr:`phase_steps`, or the window's steps where that phase was timed on
        every step); ``None`` when every step was timed."""
        timed = self.phase_steps
        every = self.phase_every_step
        if timed is None or every is None:
            return timed
        return np.where(every[:, :, index], self.step_count, timed)

    @property
    def n_windows(self) -> int:
        return int(self.window_end_unix_nano.shape[0])

    @property
    def n_ranks(self) -> int:
        return int(self.ranks.shape[0])

    @property
    def present(self) -> BoolArray:
        """``(W, R)``: the rank reported at least one step in the window."""
        return self.step_count > 0

    def window_start_unix_nano(self, index: int) -> int:
        return int(self.window_end_unix_nano[index]) - round(self.window_s * 1e9)

    def category_s(self, category: str) -> FloatArray:
        """``(W, R)`` kernel time per step of every class in ``category`` (NaN if none)."""
        names = sorted(set(self.kernel_categories))
        if category not in names:
            return np.full(self.step_s.shape, np.nan)
        cache = self.__dict__.setdefault("_category_cache", {})
        if not cache:  # one pass over the (W, R, K) array for every category
            one_hot = np.array(
                [[float(c == name) for name in names] for c in self.kernel_categories]
            )
            totals = self.kernel_s @ one_hot
            for column, name in enumerate(names):
                cache[name] = np.ascontiguousarray(totals[:, :, column])
        return np.asarray(cache[category])

    def phase(self, name: str) -> FloatArray | None:
        if name not in self.phases:
            return None
        return np.asarray(self.phase_s[:, :, self.phases.index(name)])


#: Empty analysis windows kept after a job's last data: a frame ends at the window holding
#: ``end_unix_nano`` or this many windows after the last data, whichever comes first, so a
#: range far past the data (``--to 2030``) costs nothing, while a job that went silent
#: still ends in enough empty windows to close its findings (``gap_windows`` is 6).
TRAILING_EMPTY_WINDOWS = 64


def read_frame(
    client: InfluxClient,
    job: str,
    *,
    start_unix_nano: int,
    end_unix_nano: int,
    window_s: float | None = None,
) -> JobFrame:
    """Read one job's windows in ``[start, end]`` into a :class:`JobFrame`.

    The frame spans the windows that hold data, not the request: from the first window
    with data (or the one holding ``start``, when later) to the one holding ``end`` or
    :data:`TRAILING_EMPTY_WINDOWS` after the last data. A job with no data in the range
    gives a frame of no windows and no ranks.

    Args:
        client: InfluxDB client on the stepwatch database.
        job: value of ``stepwatch.job.id``.
        start_unix_nano: first instant read (rounded down to a window boundary).
        end_unix_nano: last instant read (inclusive).
        window_s: analysis window; export windows whose end falls in it are merged. When
            ``None``, derived from the data's export window (:func:`export_window_s`).

    Raises:
        ConfigError: bad range or window.
        InfluxError: the query failed.
    """
    if window_s is not None and window_s <= 0:
        raise ConfigError(f"window_s: must be positive, got {window_s}")
    if end_unix_nano <= start_unix_nano:
        raise ConfigError("end_unix_nano: must be after start_unix_nano")
    # Read from one maximal window earlier so the first bin is complete once aligned.
    where = (
        f"{quote_ident(_schema.JOB_ID)} = {quote_literal(job)} "
        f"AND time >= {start_unix_nano - round((window_s or 60.0) * 1e9)} "
        f"AND time <= {end_unix_nano}"
    )
    rank_tag = quote_ident(_schema.RANK)
    coordinates = ", ".join(
        quote_ident(tag)
        for tag in (_schema.HOST_NAME, _schema.PP_RANK, _schema.DP_RANK, _schema.TP_RANK)
    )
    statements = [
        f'SELECT "sum", "count", "max", "start_time_unix_nano" FROM '
        f"{quote_ident(_schema.STEP_DURATION)} WHERE {where} "
        f"GROUP BY {rank_tag}, {coordinates}",
        f'SELECT "sum", "count", "max", "min" FROM {quote_ident(_schema.PHASE_DURATION)} '
        f"WHERE {where} GROUP BY {rank_tag}, {quote_ident(_schema.PHASE)}",
        f'SELECT "sum", "count", "max" FROM {quote_ident(_schema.KERNEL_DURATION)} '
        f"WHERE {where} GROUP BY {rank_tag}, {quote_ident(_schema.KERNEL_CLASS)}, "
        f"{quote_ident(_schema.KERNEL_CATEGORY)}",
        f'SELECT "sum", "count", "max" FROM {quote_ident(_schema.DEVICE_IDLE_DURATION)} '
        f"WHERE {where} GROUP BY {rank_tag}",
        f'SELECT "gauge" FROM {quote_ident(_schema.GPU_SM_CLOCK)} WHERE {where} '
        f"GROUP BY {rank_tag}",
        f'SELECT "sum", "count" FROM {quote_ident(_schema.SAMPLED_STEP_DURATION)} '
        f"WHERE {where} GROUP BY {rank_tag}",
        f'SELECT "counter" FROM {quote_ident(_schema.SAMPLED_STEPS)} WHERE {where} '
        f"GROUP BY {rank_tag}",
        f'SELECT "counter" FROM {quote_ident(_schema.PHASE_EVERY_STEP)} WHERE {where} '
        f"GROUP BY {rank_tag}, {quote_ident(_schema.PHASE)}",
    ]
    results = client.query("; ".join(statements))
    if window_s is None:
        window_s = export_window_s(results)
    window_ns = round(window_s * 1e9)
    span = _data_span(results)
    if span is None:  # nothing stored in the range: no windows, no ranks
        return frame_from_series(
            job, [], origin_unix_nano=start_unix_nano, n_bins=0, window_s=window_s
        )
    first, last = span
    origin = (max(start_unix_nano, first) // window_ns) * window_ns
    stop = min(end_unix_nano, last + TRAILING_EMPTY_WINDOWS * window_ns)
    n_bins = max(1, (stop - origin) // window_ns + 1)
    return frame_from_series(
        job, results, origin_unix_nano=origin, n_bins=n_bins, window_s=window_s
    )


def _data_span(results: Sequence[QuerySeries]) -> tuple[int, int] | None:
    """The earliest and latest row time of any ranked series (``None``: no rows)."""
    times = [
        int(row[0])
        for series in results
        if _bins.series_rank(series) is not None
        for row in series.values
        if row and isinstance(row[0], int | float)
    ]
    return (min(times), max(times)) if times else None


def export_window_s(results: Sequence[QuerySeries]) -> float:
    """Analysis window for the data's median export window (``time - start_time_unix_nano``).

    Exports of 1 s or more: the export window rounded to whole seconds. Sub-second exports
    (a demo, a short job) drift by a large fraction of their length on a loaded host, so
    a bin of exactly one export window would often hold none of a rank's exports and
    another two: those are binned at twice the export window rounded to 50 ms (at most 1 s).
    10 s when the data carries no export window.
    """
    lengths: list[int] = []
    for series in results:
        if series.name != _schema.STEP_DURATION or "start_time_unix_nano" not in series.columns:
            continue
        position = series.columns.index("start_time_unix_nano")
        for row in series.values:
            start = row[position]
            if isinstance(start, int | float) and start > 0:
                lengths.append(int(row[0]) - int(start))
    if not lengths:
        return 10.0
    median_s = float(np.median(lengths)) / 1e9
    if median_s >= 1.0:
        return float(round(median_s))
    return min(1.0, 2.0 * max(0.05, round(median_s * 20.0) / 20.0))


def frame_from_series(
    job: str,
    results: Sequence[QuerySeries],
    *,
    origin_unix_nano: int,
    n_bins: int,
    window_s: float,
) -> JobFrame:
    """Build a :class:`JobFrame` from the series of :func:`read_frame`'s statements."""
    window_ns = round(window_s * 1e9)
    who = _bins.identity(results)
    bins = _bins.bin_series(
        results, who, origin_unix_nano=origin_unix_nano, n_bins=n_bins, window_ns=window_ns
    )
    n_ranks = len(who.ranks)
    step_total, step_count, step_peak, _ = bins.step.arrays(n_ranks)
    steps = step_count[:, :, 0]
    step_s = step_total[:, :, 0] * _per(steps)
    return JobFrame(
        job=job,
        window_s=window_s,
        window_end_unix_nano=origin_unix_nano
        + window_ns * np.arange(1, n_bins + 1, dtype=np.int64),
        ranks=np.array(who.ranks, dtype=np.int64),
        hosts=tuple(who.hosts.get(rank, "") for rank in who.ranks),
        pp_ranks=np.array(
            [who.coordinates[_schema.PP_RANK].get(rank, -1) for rank in who.ranks],
            dtype=np.int64,
        ),
        step_count=steps,
        step_s=step_s,
        step_max_s=np.where(steps > 0, step_peak[:, :, 0], np.nan),
        sm_clock_hz=_mean_gauge(bins.clock, n_ranks),
        dp_ranks=who.coordinate(_schema.DP_RANK),
        tp_ranks=who.coordinate(_schema.TP_RANK),
        **_phase_fields(bins, steps, step_total[:, :, 0], step_s),
        **_kernel_fields(bins, steps),
    )


def _per(counts: FloatArray) -> FloatArray:
    """``1 / counts`` where positive, NaN elsewhere."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, 1.0 / np.where(counts > 0, counts, 1.0), np.nan)


def _mean_gauge(gauge: _bins.Accumulator, n_ranks: int) -> FloatArray | None:
    if not gauge.keys:
        return None
    total, count, _, _ = gauge.arrays(n_ranks)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count[:, :, 0] > 0, total[:, :, 0] / count[:, :, 0], np.nan)


def _phase_fields(
    bins: _bins.Bins, steps: FloatArray, step_total: FloatArray, step_s: FloatArray
) -> dict[str, Any]:
    """The frame's phase arrays, in the schema's phase order; sampled phases pooled."""
    n_bins, n_ranks = steps.shape
    per_step = _per(steps)
    phase_names = tuple(bins.phase.keys)
    phase_total, phase_count, phase_peak, phase_low = bins.phase.arrays(n_ranks)
    order = sorted(range(len(phase_names)), key=lambda i: _phase_rank(phase_names[i]))
    phase_s = phase_total * per_step[:, :, None]
    phase_step_s: FloatArray | None = None
    phase_steps: FloatArray | None = None
    if bins.sampled.keys:  # phases timed on a sample of steps
        sampled_total, sampled_count, _, _ = bins.sampled.arrays(n_ranks)
        timed, stood_for, timed_total = _sampled.timed_steps(
            steps,
            step_total,
            bins.sampled_steps.arrays(n_ranks)[0][:, :, 0],
            sampled_count[:, :, 0],
            sampled_total[:, :, 0],
        )
        phase_s, phase_step_s, phase_steps = _sampled.pool(
            phase_total, steps, timed, stood_for, timed_total
        )
        phase_step_s = np.where(np.isfinite(phase_step_s), phase_step_s, step_s)
    phase_every_step: BoolArray | None = None
    if bins.every_step.keys and phase_names:
        # Phases timed on every step while the others were sampled: the window's own time.
        marked, _, _, _ = bins.every_step.arrays(n_ranks)
        phase_every_step = np.zeros(phase_total.shape, dtype=bool)
        for name, column in bins.every_step.keys.items():
            if name in phase_names:
                phase_every_step[:, :, phase_names.index(name)] = marked[:, :, column] > 0
        phase_every_step &= (steps > 0)[:, :, None]
        phase_s = np.where(phase_every_step, phase_total * per_step[:, :, None], phase_s)
        phase_every_step = phase_every_step[:, :, order]
    empty = np.zeros((n_bins, n_ranks, 0))
    return {
        "phases": tuple(phase_names[i] for i in order),
        "phase_s": phase_s[:, :, order] if phase_names else empty,
        "phase_max_s": phase_peak[:, :, order] if phase_names else empty,
        "phase_min_s": phase_low[:, :, order] if phase_names else empty,
        "phase_step_s": phase_step_s,
        "phase_steps": phase_steps,
        "phase_every_step": phase_every_step,
        "phase_occurrences": (phase_count * per_step[:, :, None])[:, :, order]
        if phase_names
        else None,
    }


def _kernel_fields(bins: _bins.Bins, steps: FloatArray) -> dict[str, Any]:
    """The frame's kernel-class and device-idle arrays, per step they rest on.

    A source that recorded some steps of the window (a profiler's duty cycle) sends one idle
    value for each of them: kernel and idle times are divided by those steps.
    """
    n_bins, n_ranks = steps.shape
    kernel_names = tuple(bins.kernel.keys)
    kernel_total, kernel_count, _, _ = bins.kernel.arrays(n_ranks)
    idle_total, idle_count, idle_peak, _ = bins.idle.arrays(n_ranks)
    idle_counted = idle_count[:, :, 0]
    covered = np.where(idle_counted > 0, np.minimum(idle_counted, steps), steps)
    kernel_steps: FloatArray | None = None
    if bins.idle.keys and bool(((covered < steps) & (steps > 0)).any()):
        kernel_steps = covered
    per_covered = _per(covered)
    reported = (kernel_count > 0).any(axis=2) | (idle_counted > 0)
    order = sorted(range(len(kernel_names)), key=lambda i: kernel_names[i])
    no_idle = np.full(steps.shape, np.nan)
    return {
        "kernel_classes": tuple(kernel_names[i] for i in order),
        "kernel_categories": tuple(bins.categories[kernel_names[i]] for i in order),
        "kernel_s": np.where(reported[:, :, None], kernel_total * per_covered[:, :, None], np.nan)[
            :, :, order
        ]
        if kernel_names
        else np.zeros((n_bins, n_ranks, 0)),
        "idle_s": np.where(idle_counted > 0, idle_total[:, :, 0] * per_covered, np.nan)
        if bins.idle.keys
        else no_idle,
        "idle_max_s": np.where(steps > 0, idle_peak[:, :, 0], np.nan)
        if bins.idle.keys
        else no_idle,
        "kernel_steps": kernel_steps,
    }


def _phase_rank(name: str) -> tuple[int, str]:
    known: Mapping[str, int] = {phase: index for index, phase in enumerate(_schema.PHASES)}
    return (known.get(name, len(known)), name)


def list_jobs(client: InfluxClient) -> list[str]:
    """Every job id that has step windows stored."""
    series = client.query(
        f"SHOW TAG VALUES FROM {quote_ident(_schema.STEP_DURATION)} "
        f"WITH KEY = {quote_ident(_schema.JOB_ID)}"
    )
    jobs: set[str] = set()
    for item in series:
        for row in item.values:
            if len(row) >= 2:
                jobs.add(str(row[1]))
    return sorted(jobs)


def job_time_range(client: InfluxClient, job: str) -> tuple[int, int] | None:
    """The span of a job's data: its first window's start and its last window's end.

    Args:
        client: the InfluxDB holding the job.
        job: the ``stepwatch.job.id``.

    Returns:
        ``(start, end)`` in Unix nanoseconds, or ``None`` when the job has no windows.
    """
    where = f"{quote_ident(_schema.JOB_ID)} = {quote_literal(job)}"
    measurement = quote_ident(_schema.STEP_DURATION)
    series = client.query(
        f"SELECT min({quote_ident('start_time_unix_nano')}) FROM {measurement} WHERE {where}; "
        f'SELECT last("count") FROM {measurement} WHERE {where}'
    )
    if len(series) < 2 or not series[0].values or not series[1].values:
        return None
    first_start, last_end = series[0].values[0][1], series[1].values[0][0]
    if first_start is None or last_end is None:
        return None
    return int(first_start), int(last_end)
