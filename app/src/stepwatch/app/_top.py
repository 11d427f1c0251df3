"""``stepwatch top``: a live ranks × phases view of one job, the window you keep open.

Each refresh reads, per rank, the newest window stored in InfluxDB (step and phase means,
the last step) and the job's open findings, and draws one screen: the ranks that stand out
first, the cells that stand out marked, silent ranks flagged, findings by cost at the bottom.
Standard library only; the queries are InfluxQL on the stored layout (docs/storage.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from stepwatch.app._influx_options import add_influx_arguments, influx_client
from stepwatch.core import Diagnosis, InfluxClient, InfluxUnavailableError
from stepwatch.core._durations import parse_duration_s
from stepwatch.core._influx import quote_ident, quote_literal
from stepwatch.core._schema import (
    HOST_NAME,
    JOB_ID,
    PHASE,
    PHASE_DURATION,
    PHASES,
    PP_RANK,
    RANK,
    STEP_DURATION,
    STEP_LAST,
)

#: A cell this much above its column's median is marked (the rank stands out there).
SLOW_RATIO = 1.25
#: A rank whose newest window is older than this many refresh intervals is called silent.
SILENT_INTERVALS = 5.0

_BOLD_RED = "\x1b[1;31m"
_BOLD = "\x1b[1m"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"
_HOME_CLEAR = "\x1b[H\x1b[J"


@dataclasses.dataclass(frozen=True)
class RankRow:
    """One rank's newest window."""

    rank: int
    host: str
    stage: str
    step_s: float
    phases_s: dict[str, float]
    last_step: int | None
    seen_unix_nano: int


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one screen shows."""

    job: str
    now_unix_nano: int
    ranks: list[RankRow]
    phases: list[str]
    findings: list[Diagnosis]

    @property
    def median_step_s(self) -> float:
        steps = [row.step_s for row in self.ranks if math.isfinite(row.step_s)]
        return statistics.median(steps) if steps else math.nan


def _latest_by(
    client: InfluxClient, measurement: str, field: str, job: str, lookback_s: float, *by: str
) -> dict[tuple[str, ...], tuple[int, float]]:
    """``(tag values...) -> (time, value)`` of the newest point per series in the lookback.

    ``field="mean"`` reads the newest window's ``sum / count`` (no stored ``mean`` needed:
    the compact layout and a Collector's data have none).
    """
    group = ", ".join(quote_ident(tag) for tag in by)
    selected = 'last("sum"), "count"' if field == "mean" else f"last({quote_ident(field)})"
    series = client.query(
        f"SELECT {selected} FROM {quote_ident(measurement)} "
        f"WHERE {quote_ident(JOB_ID)} = {quote_literal(job)} "
        f"AND time > now() - {max(1, round(lookback_s))}s GROUP BY {group}"
    )
    found: dict[tuple[str, ...], tuple[int, float]] = {}
    for item in series:
        if not item.values or item.values[0][1] is None:
            continue
        row = item.values[0]
        value = float(row[1])
        if field == "mean":
            if not isinstance(row[2], int | float) or row[2] <= 0:
                continue
            value /= float(row[2])
        key = tuple((item.tags or {}).get(tag, "") for tag in by)
        found[key] = (int(row[0]), value)
    return found


def read_snapshot(
    client: InfluxClient, job: str, *, lookback_s: float, now_unix_nano: int | None = None
) -> Snapshot:
    """The newest window of every rank of ``job`` seen in the last ``lookback_s`` seconds."""
    steps = _latest_by(client, STEP_DURATION, "mean", job, lookback_s, RANK, HOST_NAME, PP_RANK)
    phases = _latest_by(client, PHASE_DURATION, "mean", job, lookback_s, RANK, PHASE)
    last = _latest_by(client, STEP_LAST, "gauge", job, lookback_s, RANK)
    names = sorted({phase for _, phase in phases}, key=_phase_order)
    rows = []
    for (rank, host, stage), (seen, step_s) in steps.items():
        if not rank.lstrip("-").isdigit():
            continue
        last_step = last.get((rank,))
        rows.append(
            RankRow(
                rank=int(rank),
                host=host,
                stage=stage,
                step_s=step_s,
                phases_s={p: phases[(rank, p)][1] for p in names if (rank, p) in phases},
                last_step=None if last_step is None else int(last_step[1]),
                seen_unix_nano=seen,
            )
        )
    from stepwatch.detectors.sinks import read_diagnoses  # numpy-free; lazy for --help

    findings = costliest_first(
        diagnosis for diagnosis, _ in read_diagnoses(client, job, state="open")
    )
    return Snapshot(
        job=job,
        now_unix_nano=time.time_ns() if now_unix_nano is None else now_unix_nano,
        ranks=sorted(rows, key=lambda row: row.rank),
        phases=names,
        findings=findings,
    )


def costliest_first(findings: Iterable[Diagnosis]) -> list[Diagnosis]:
    """By cost (``slowdown``), then critical first, then oldest first."""
    return sorted(
        findings, key=lambda d: (-d.slowdown, d.severity != "critical", d.start_unix_nano)
    )


def _phase_order(phase: str) -> tuple[int, str]:
    return (PHASES.index(phase) if phase in PHASES else len(PHASES), phase)


def _deviation(row: RankRow, medians: dict[str, float]) -> float:
    """How far the rank's slowest column is above its median (1.0 = typical)."""
    ratios = [row.step_s / medians["step"]] if medians.get("step") else []
    for phase, value in row.phases_s.items():
        if medians.get(phase):
            ratios.append(value / medians[phase])
    return max(ratios, default=1.0)


def render(
    snapshot: Snapshot,
    *,
    width: int,
    height: int,
    interval_s: float,
    color: bool,
) -> str:
    """One screen of text (ANSI-styled when ``color``)."""

    def style(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    medians = {"step": snapshot.median_step_s}
    for phase in snapshot.phases:
        values = [row.phases_s[phase] for row in snapshot.ranks if phase in row.phases_s]
        medians[phase] = statistics.median(values) if values else math.nan
    clock = time.strftime("%H:%M:%S", time.gmtime(snapshot.now_unix_nano / 1e9))
    lines = [
        style(f"stepwatch top — job {snapshot.job}", _BOLD)
        + f"   {len(snapshot.ranks)} ranks   median step {_ms(medians['step'])} ms"
        + f"   {clock} UTC"
    ]
    if not snapshot.ranks:
        lines.append("no windows from this job yet (is it running, and is the bridge up?)")
    columns = ["rank", "host", "stage", "step ms", *(f"{p} ms" for p in snapshot.phases)]
    columns += ["last step", "seen"]
    widths = [5, 18, 5, 9, *(max(9, len(p) + 4) for p in snapshot.phases), 10, 8]
    lines.append(" ".join(name.rjust(w) for name, w in zip(columns, widths, strict=True)))
    # The ranks that stand out first; the rest summarised when the screen is too small.
    room = max(1, height - 6 - min(len(snapshot.findings), 8))
    ordered = sorted(snapshot.ranks, key=lambda row: -_deviation(row, medians))
    shown = sorted(ordered[:room], key=lambda row: row.rank)
    silent_after_ns = SILENT_INTERVALS * interval_s * 1e9
    for row in shown:
        age_s = (snapshot.now_unix_nano - row.seen_unix_nano) / 1e9
        cells = [str(row.rank), row.host[-18:], row.stage or "-"]
        marks = [False, False, False]
        cells.append(_ms(row.step_s))
        marks.append(row.step_s >= SLOW_RATIO * medians["step"])
        for phase in snapshot.phases:
            value = row.phases_s.get(phase, math.nan)
            cells.append(_ms(value))
            marks.append(math.isfinite(value) and value >= SLOW_RATIO * medians[phase])
        cells.append("-" if row.last_step is None else str(row.last_step))
        marks.append(False)
        silent = snapshot.now_unix_nano - row.seen_unix_nano > silent_after_ns
        cells.append(f"{age_s:.0f}s ago")
        marks.append(silent)
        text = []
        for cell, mark, w in zip(cells, marks, widths, strict=True):
            padded = cell.rjust(w)
            text.append(style(padded, _BOLD_RED) if mark else padded)
        flag = " ◀" if any(marks) else ""
        lines.append(" ".join(text) + (style(" silent", _BOLD_RED) if silent else flag))
    hidden = len(snapshot.ranks) - len(shown)
    if hidden > 0:
        lines.append(style(f"… {hidden} more ranks closer to the median", _DIM))
    lines.append("")
    if snapshot.findings:
        lines.append(style(f"open findings ({len(snapshot.findings)}), costliest first:", _BOLD))
        for finding in snapshot.findings[:8]:
            head = f"{finding.severity:<8} {finding.slowdown:.2f}x {finding.kind}"
            lines.append(style(head, _BOLD_RED if finding.severity == "critical" else _BOLD))
            lines.append("    " + finding.summary)
    else:
        lines.append("open findings: none")
    return "\n".join(line[:width] if not color else line for line in lines) + "\n"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if math.isfinite(seconds) else "-"


def run_top(
    client: InfluxClient,
    job: str,
    *,
    interval_s: float,
    lookback_s: float,
    once: bool,
    out: TextIO,
    color: bool,
    size: Callable[[], tuple[int, int]],
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Draw the screen every ``interval_s`` until interrupted (Ctrl-C: exit status 0)."""
    try:
        while True:
            width, height = size()
            try:
                snapshot = read_snapshot(client, job, lookback_s=lookback_s)
            except InfluxUnavailableError as exc:
                if once:
                    raise
                # A live view outlives a restart of InfluxDB: say so and keep trying.
                screen = f"stepwatch top — job {job}\n{exc}; retrying every {interval_s:g} s\n"
            else:
                screen = render(
                    snapshot, width=width, height=height, interval_s=interval_s, color=color
                )
            out.write(screen if once else _HOME_CLEAR + screen)
            out.flush()
            if once:
                return 0
            sleep(interval_s)
    except KeyboardInterrupt:  # wherever it lands: a query, a redraw or the wait
        return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "top",
        help="live view of one job: ranks x phases, silent ranks, open findings",
        description="Redraw, every window, each rank's newest step and phase times (the ranks "
        "that stand out first, their slow cells marked), ranks that went silent, and the "
        "job's open findings ordered by cost. Ctrl-C quits.",
    )
    parser.add_argument("--job", required=True, help="the stepwatch.job.id to watch")
    parser.add_argument("--interval", default="1s", help="refresh period (default 1s)")
    parser.add_argument(
        "--lookback", default="2m", help="ranks silent longer than this are dropped (default 2m)"
    )
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="ANSI colours (default: when writing to a terminal)",
    )
    add_influx_arguments(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    interval_s = parse_duration_s(args.interval, argument="--interval")
    lookback_s = parse_duration_s(args.lookback, argument="--lookback")
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())

    def size() -> tuple[int, int]:
        columns, lines = shutil.get_terminal_size((160, 50))
        return columns, lines

    return run_top(
        influx_client(args, os.environ),
        args.job,
        interval_s=interval_s,
        lookback_s=lookback_s,
        once=args.once,
        out=sys.stdout,
        color=color,
        size=size,
    )
