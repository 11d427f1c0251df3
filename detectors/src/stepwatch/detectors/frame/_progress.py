"""Where each rank of a job is now, read back from InfluxDB: what the hang probe looks at.

A rank's exporter sends, every export interval, either a window of finished steps or, when no
step finished, its progress gauges (docs/schema.md): the step in progress, the time since it
last finished one, and the phase it is in. :func:`read_progress` reads the latest of each per
rank in one request of seven InfluxQL ``last()`` statements (the seventh: which phases the
job times), a few rows per rank whatever the job's history, so it is cheap enough to run
every few seconds.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Final

from stepwatch.core import _schema
from stepwatch.core._influx import InfluxClient, QuerySeries, quote_ident, quote_literal
from stepwatch.detectors.frame._frame import WAIT_HOLDING_PHASE, JobFrame

#: How far back the latest progress gauges are looked for: a job none of whose ranks reported
#: for this long is over (killed, or it ended), not hung.
PROGRESS_LOOKBACK_S: Final = 300.0
#: How far back a rank's last window of finished steps is looked for (its last progress and
#: its usual step time, also during a long hang).
STEP_HISTORY_S: Final = 6 * 3600.0
#: The phase in which a rank waits for its peers (docs/schema.md).
COMMUNICATION: Final = "communication"


@dataclasses.dataclass(frozen=True)
class RankProgress:
    """Where one rank is, as of its latest report.

    Attributes:
        rank: global rank.
        host: its ``host.name`` (``""`` when unknown).
        last_report_unix_nano: its latest window of any kind.
        last_progress_unix_nano: the end of the last step it is known to have finished (the
            start of its monitor when none), from its windows and its progress gauges.
        step: the step in progress (``None`` when unknown).
        phase: the phase it was in at its latest report; ``None`` between phases, or when its
            latest report was a window of finished steps (it was moving then).
        phase_since_unix_nano: when it entered ``phase``.
        closed: its monitor was closed (its last window said so): its silence is an exit.
        step_s: mean step time of its last window with steps (``None`` before any).
        export_window_s: the longer of its last two windows with steps: its export cadence
            (a hang or a pause cuts the last one short; ``None`` before any).
        speaks_progress: it has sent progress gauges (a monitor that also says when it
            closes; every stepwatch monitor's first window carries them).
    """

    rank: int
    host: str
    last_report_unix_nano: int
    last_progress_unix_nano: int
    step: int | None = None
    phase: str | None = None
    phase_since_unix_nano: int | None = None
    closed: bool = False
    step_s: float | None = None
    export_window_s: float | None = None
    speaks_progress: bool = False


@dataclasses.dataclass(frozen=True)
class JobProgress:
    """Every rank's :class:`RankProgress` at one moment.

    Attributes:
        job: the job id.
        now_unix_nano: the moment it was read for.
        ranks: by rank.
        phases: the phases the job's ranks timed in their recent windows (``None``: not
            read; taken as a job that times its collectives as ``communication``).
    """

    job: str
    now_unix_nano: int
    ranks: tuple[RankProgress, ...]
    phases: frozenset[str] | None = None

    @property
    def wait_phase(self) -> str:
        """The phase in which a rank of this job waits for its peers: ``communication``, or,
        for a job that times no communication phase but ``backward``, ``backward`` (the
        phase that holds DDP's all-reduce and the wait in it: the README's own loop)."""
        phases = self.phases
        if phases is not None and COMMUNICATION not in phases and WAIT_HOLDING_PHASE in phases:
            return WAIT_HOLDING_PHASE
        return COMMUNICATION

    def waits(self, rank: RankProgress) -> bool:
        """Whether ``rank`` was waiting for its peers at its latest report."""
        return rank.phase == self.wait_phase

    @property
    def usual_step_s(self) -> float | None:
        """The job's usual step time: the median over ranks of their last windows' mean step."""
        steps = [r.step_s for r in self.ranks if r.step_s is not None and r.step_s > 0]
        return statistics.median(steps) if steps else None

    @property
    def export_interval_s(self) -> float | None:
        """The ranks' median export cadence (``export_window_s``; ``None`` before any)."""
        lengths = [r.export_window_s for r in self.ranks if r.export_window_s]
        return statistics.median(lengths) if lengths else None

    def silent(self, *, min_s: float) -> list[RankProgress]:
        """The live ranks without a report for max(``min_s``, 3 export cadences), or for
        max(``min_s``, 1.5 cadences) once a peer has reported a cadence after them (they missed
        a report: with 10 s windows, 3 cadences would leave a frozen rank named stuck at its
        stale last report for 30 s)."""
        live, now = self.live, self.now_unix_nano
        if not live:
            return []
        cadence_s = self.export_interval_s or 1.0
        newest = max(r.last_report_unix_nano for r in live)

        def quiet(r: RankProgress) -> bool:
            age_s = (now - r.last_report_unix_nano) / 1e9
            missed = (newest - r.last_report_unix_nano) / 1e9 >= cadence_s
            return age_s >= max(min_s, 3.0 * cadence_s) or (
                missed and age_s >= max(min_s, 1.5 * cadence_s)
            )

        return [r for r in live if quiet(r)]

    @property
    def live(self) -> list[RankProgress]:
        """The ranks that have not closed their monitors."""
        return [r for r in self.ranks if not r.closed]

    def lagging(
        self, ranks: Sequence[RankProgress], *, min_gap_s: float
    ) -> tuple[list[RankProgress], str]:
        """Of ``ranks``, those a step behind the others or that entered their phase last.

        "Last" means after a gap of at least ``min_gap_s`` that splits off a minority (ARGUS's
        arrival order: the collective waits for whoever arrives last). The group counts only
        when it fills at least half of each of its hosts (a node or its link); else empty.

        Returns:
            The group and how it lags, in words (empty and ``""`` when none).
        """
        per_host: dict[str, int] = {}
        for rank in self.ranks:
            per_host[rank.host] = per_host.get(rank.host, 0) + 1

        def fills_hosts(group: Sequence[RankProgress]) -> bool:
            counts: dict[str, int] = {}
            for rank in group:
                counts[rank.host] = counts.get(rank.host, 0) + 1
            return all(host and 2 * n >= per_host[host] for host, n in counts.items())

        steps = [r.step for r in ranks if r.step is not None]
        if len(set(steps)) > 1:
            group = [r for r in ranks if r.step == min(steps)]
            if 2 * len(group) < len(ranks) and fills_hosts(group):
                return group, "a step behind"
        entered = sorted(
            (r for r in ranks if r.phase_since_unix_nano is not None),
            key=lambda r: r.phase_since_unix_nano or 0,
        )
        times = [r.phase_since_unix_nano or 0 for r in entered]
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        if gaps:
            cut = max(range(len(gaps)), key=gaps.__getitem__)
            late = entered[cut + 1 :]
            if gaps[cut] >= min_gap_s * 1e9 and 2 * len(late) < len(entered) and fills_hosts(late):
                return late, "arrived last"
        return [], ""


@dataclasses.dataclass(frozen=True, eq=False)
class ProgressFrame(JobFrame):
    """A :class:`JobFrame` with where each rank is at its end (what the ``hang`` rule reads).

    Attributes:
        progress: the ranks' latest progress, read for the frame's last instant.
    """

    progress: JobProgress | None = None


def with_progress(frame: JobFrame, progress: JobProgress) -> ProgressFrame:
    """``frame`` carrying ``progress`` (the same arrays, not copied)."""
    fields = {field.name: getattr(frame, field.name) for field in dataclasses.fields(JobFrame)}
    return ProgressFrame(**fields, progress=progress)


def read_progress(
    client: InfluxClient,
    job: str,
    *,
    now_unix_nano: int,
    lookback_s: float = PROGRESS_LOOKBACK_S,
    history_s: float = STEP_HISTORY_S,
) -> JobProgress:
    """Where each rank of ``job`` is as of ``now_unix_nano`` (one request, seven statements).

    Args:
        client: InfluxDB client on the stepwatch database.
        job: value of ``stepwatch.job.id``.
        now_unix_nano: the moment looked at (nothing later is read).
        lookback_s: how far back progress gauges are read.
        history_s: how far back windows of finished steps (and the closed marker) are read.

    Raises:
        InfluxError: the query failed.
    """
    job_filter = f"{quote_ident(_schema.JOB_ID)} = {quote_literal(job)}"

    def since(seconds: float) -> str:
        start = now_unix_nano - round(seconds * 1e9)
        return f"{job_filter} AND time > {start} AND time <= {now_unix_nano}"

    recent, history = since(lookback_s), since(history_s)
    rank, host, phase = (quote_ident(k) for k in (_schema.RANK, _schema.HOST_NAME, _schema.PHASE))
    statements = [
        f'SELECT last("gauge") FROM {quote_ident(_schema.STEP_ELAPSED)} WHERE {recent} '
        f"GROUP BY {rank}, {host}, {phase}",
        f'SELECT last("gauge") FROM {quote_ident(_schema.PHASE_ELAPSED)} WHERE {recent} '
        f"GROUP BY {rank}, {phase}",
        f'SELECT last("gauge") FROM {quote_ident(_schema.STEP_CURRENT)} WHERE {history} '
        f"GROUP BY {rank}",
        # the newest window's mean step is sum / count (the compact layout stores no mean);
        # the one before it says how long a whole window is (the newest may be cut short)
        f'SELECT "sum", "count", "start_time_unix_nano" '
        f"FROM {quote_ident(_schema.STEP_DURATION)} "
        f"WHERE {history} GROUP BY {rank}, {host} ORDER BY time DESC LIMIT 2",
        f'SELECT last("gauge") FROM {quote_ident(_schema.STEP_LAST)} WHERE {history} '
        f"GROUP BY {rank}",
        f'SELECT last("gauge") FROM {quote_ident(_schema.MONITOR_CLOSED)} WHERE {history} '
        f"GROUP BY {rank}",
        # which phases the job times (where its ranks wait: communication, else backward)
        f'SELECT last("count") FROM {quote_ident(_schema.PHASE_DURATION)} WHERE {recent} '
        f"GROUP BY {phase}",
    ]
    return progress_from_series(job, client.query("; ".join(statements)), now_unix_nano)


def progress_from_series(
    job: str, results: Sequence[QuerySeries], now_unix_nano: int
) -> JobProgress:
    """Build a :class:`JobProgress` from the series of :func:`read_progress`'s statements."""
    # Per rank: (time, value, tags) of the latest row of each measurement (and phase).
    latest: dict[str, dict[int, tuple[int, float, dict[str, str]]]] = {}
    by_phase: dict[int, dict[str, tuple[int, float]]] = {}
    window_span: dict[int, int] = {}
    phases: set[str] = set()
    for series in results:
        if series.name == _schema.PHASE_DURATION:
            if series.values and series.tags.get(_schema.PHASE):
                phases.add(series.tags[_schema.PHASE])
            continue
        rank_text = series.tags.get(_schema.RANK, "")
        if not rank_text.lstrip("-").isdigit() or not series.values:
            continue
        rank = int(rank_text)
        row = series.values[0]
        if row[0] is None or not isinstance(row[1], int | float):
            continue
        time_unix_nano, value = int(row[0]), float(row[1])
        if series.name == _schema.STEP_DURATION:
            count = row[2] if len(row) > 2 else None
            if not isinstance(count, int | float) or count <= 0:
                continue
            value /= count
            row = [row[0], row[1], *row[3:]]  # then [time, sum, start] as before
        if series.name == _schema.PHASE_ELAPSED:
            phase = series.tags.get(_schema.PHASE, "")
            by_phase.setdefault(rank, {})[phase] = (time_unix_nano, value)
            continue
        slot = latest.setdefault(series.name, {})
        if rank not in slot or time_unix_nano > slot[rank][0]:
            slot[rank] = (time_unix_nano, value, dict(series.tags))
            if series.name == _schema.STEP_DURATION:
                spans = [
                    int(r[0]) - int(r[3])
                    for r in series.values
                    if len(r) > 3
                    and isinstance(r[0], int | float)
                    and isinstance(r[3], int | float)
                    and 0 < r[3] < r[0]
                ]
                if spans:
                    window_span[rank] = max(spans)
                else:
                    window_span.pop(rank, None)
    ranks = sorted({rank for slot in latest.values() for rank in slot})
    return JobProgress(
        job=job,
        now_unix_nano=now_unix_nano,
        ranks=tuple(
            _rank_progress(rank, latest, by_phase.get(rank, {}), window_span.get(rank))
            for rank in ranks
        ),
        phases=frozenset(phases),
    )


def _rank_progress(
    rank: int,
    latest: dict[str, dict[int, tuple[int, float, dict[str, str]]]],
    phases: dict[str, tuple[int, float]],
    window_span_ns: int | None,
) -> RankProgress:
    def get(name: str) -> tuple[int, float, dict[str, str]] | None:
        return latest.get(name, {}).get(rank)

    elapsed, window, last_step = (
        get(_schema.STEP_ELAPSED),
        get(_schema.STEP_DURATION),
        get(_schema.STEP_LAST),
    )
    current, closed = get(_schema.STEP_CURRENT), get(_schema.MONITOR_CLOSED)
    reports = [item[0] for item in (elapsed, window, closed) if item is not None]
    last_report = max(reports) if reports else 0
    progress_times = [window[0]] if window is not None else []
    if elapsed is not None:
        progress_times.append(elapsed[0] - round(elapsed[1] * 1e9))
    host = next(
        (item[2].get(_schema.HOST_NAME, "") for item in (elapsed, window) if item is not None), ""
    )
    step: int | None = None
    phase: str | None = None
    phase_since: int | None = None
    # The phase is known when the latest report is a progress window (no step finished since).
    if elapsed is not None and (window is None or elapsed[0] >= window[0]):
        phase = elapsed[2].get(_schema.PHASE, "") or None
        if current is not None and current[0] == elapsed[0]:
            step = int(current[1])
        in_phase = phases.get(phase or "")
        if phase is not None and in_phase is not None and in_phase[0] == elapsed[0]:
            phase_since = elapsed[0] - round(in_phase[1] * 1e9)
    elif last_step is not None:
        step = int(last_step[1]) + 1
    step_s = window[1] if window is not None and math.isfinite(window[1]) else None
    speaks = current is not None or closed is not None
    return RankProgress(
        rank=rank,
        host=host,
        last_report_unix_nano=last_report,
        last_progress_unix_nano=max(progress_times) if progress_times else last_report,
        step=step,
        phase=phase,
        phase_since_unix_nano=phase_since,
        closed=closed is not None and closed[0] >= last_report,
        step_s=step_s,
        export_window_s=window_span_ns / 1e9
        if window is not None and window_span_ns is not None
        else None,
        speaks_progress=speaks,
    )


def list_reporting_jobs(
    client: InfluxClient, *, now_unix_nano: int, lookback_s: float = PROGRESS_LOOKBACK_S
) -> list[str]:
    """Jobs with a window (of steps or of progress) in the last ``lookback_s``.

    ``SHOW TAG VALUES`` ignores time in InfluxDB 1.x, so this asks for the latest point per
    job instead.
    """
    since = f"time > {now_unix_nano - round(lookback_s * 1e9)} AND time <= {now_unix_nano}"
    job = quote_ident(_schema.JOB_ID)
    series = client.query(
        f'SELECT last("gauge") FROM {quote_ident(_schema.STEP_ELAPSED)} WHERE {since} '
        f"GROUP BY {job}; "
        f'SELECT last("count") FROM {quote_ident(_schema.STEP_DURATION)} WHERE {since} '
        f"GROUP BY {job}"
    )
    return sorted({item.tags[_schema.JOB_ID] for item in series if item.tags.get(_schema.JOB_ID)})
