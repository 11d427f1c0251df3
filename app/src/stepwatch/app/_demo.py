"""``stepwatch demo``: a real DDP job streamed through the bridge into a managed InfluxDB."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepwatch.app._demo_job import FAULT_KINDS, RANK_FAULTS, DemoJobConfig, launch, start
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._errors import StepwatchError
from stepwatch.core._influx import InfluxClient, quote_ident, quote_literal, wait_until
from stepwatch.core._schema import (
    JOB_ID,
    PHASE,
    PHASE_DURATION,
    RANK,
    STEP_DURATION,
    STEP_LAST,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PhaseRow:
    """What InfluxDB holds for one rank and phase of a job."""

    rank: int
    phase: str
    windows: int
    observations: int
    mean_s: float


@dataclasses.dataclass(frozen=True)
class StoredSummary:
    """What a demo run left in InfluxDB."""

    job: str
    rows: tuple[PhaseRow, ...]
    last_step_by_rank: dict[int, int]
    write_bytes: int | None

    def bytes_per_rank_step(self, steps: int) -> float | None:
        ranks = len(self.last_step_by_rank)
        if self.write_bytes is None or ranks == 0 or steps == 0:
            return None
        return self.write_bytes / (ranks * steps)


def influx_write_bytes(client: InfluxClient) -> int | None:
    """Line-protocol bytes the server has accepted on /write (InfluxDB 1.x ``SHOW STATS``)."""
    try:
        series = client.query("SHOW STATS FOR 'httpd'")
    except StepwatchError:
        return None
    for item in series:
        if "writeReqBytes" in item.columns and item.values:
            return int(item.values[0][item.columns.index("writeReqBytes")])
    return None


def last_steps(client: InfluxClient, job: str) -> dict[int, int]:
    """The last step each rank of ``job`` has reported (``stepwatch.step.last``)."""
    series = client.query(
        f"SELECT max({quote_ident('gauge')}) FROM {quote_ident(STEP_LAST)} "
        f"WHERE {quote_ident(JOB_ID)} = {quote_literal(job)} GROUP BY {quote_ident(RANK)}"
    )
    return {
        int(item.tags[RANK]): int(item.values[0][1])
        for item in series
        if item.values and item.values[0][1] is not None
    }


def summarize(client: InfluxClient, job: str, *, write_bytes: int | None = None) -> StoredSummary:
    series = client.query(
        f"SELECT count({quote_ident('count')}), sum({quote_ident('count')}), "
        f"sum({quote_ident('sum')}) FROM {quote_ident(PHASE_DURATION)} "
        f"WHERE {quote_ident(JOB_ID)} = {quote_literal(job)} "
        f"GROUP BY {quote_ident(RANK)}, {quote_ident(PHASE)}"
    )
    rows = []
    for item in series:
        _, windows, observations, total_s = item.values[0]
        rows.append(
            PhaseRow(
                rank=int(item.tags[RANK]),
                phase=item.tags[PHASE],
                windows=int(windows),
                observations=int(observations),
                mean_s=float(total_s) / max(float(observations), 1.0),
            )
        )
    rows.sort(key=lambda row: (row.rank, row.phase))
    return StoredSummary(
        job=job,
        rows=tuple(rows),
        last_step_by_rank=last_steps(client, job),
        write_bytes=write_bytes,
    )


def wait_for_job(
    client: InfluxClient, job: str, *, world_size: int, steps: int, timeout_s: float = 60.0
) -> bool:
    """Poll until every rank's last step has reached InfluxDB."""

    def complete() -> bool:
        found = last_steps(client, job)
        return len(found) == world_size and all(v >= steps - 1 for v in found.values())

    return wait_until(complete, timeout_s=timeout_s, interval_s=0.25)


def run_demo_job(
    client: InfluxClient,
    config: DemoJobConfig,
    *,
    progress: Callable[[str], None] = print,
) -> StoredSummary:
    """Train, wait until every window is stored, and summarise what InfluxDB holds."""
    bytes_before = influx_write_bytes(client)
    started = time.monotonic()
    progress(
        f"training: {config.world_size} ranks x {config.steps} steps (DDP, gloo, CPU), "
        f"job {config.job_id}, fault {config.fault}"
        + (
            f" on rank {config.fault_rank} from step {config.fault_step}"
            if config.fault != "none"
            else ""
        )
    )
    launch(config)
    progress(
        f"training finished in {time.monotonic() - started:.1f} s; waiting for the last windows"
    )
    if not wait_for_job(client, config.job_id, world_size=config.world_size, steps=config.steps):
        logger.warning("not every rank's last window reached InfluxDB within 60 s")
    bytes_after = influx_write_bytes(client)
    write_bytes = (
        None if bytes_before is None or bytes_after is None else bytes_after - bytes_before
    )
    return summarize(client, config.job_id, write_bytes=write_bytes)


def format_summary(summary: StoredSummary, *, steps: int) -> str:
    lines = [f"stored for job {summary.job} (measurement {PHASE_DURATION}):"]
    lines.append(f"  {'rank':>4}  {'phase':<14}{'windows':>8}{'steps':>8}{'mean ms':>10}")
    for row in summary.rows:
        lines.append(
            f"  {row.rank:>4}  {row.phase:<14}{row.windows:>8}{row.observations:>8}"
            f"{row.mean_s * 1e3:>10.2f}"
        )
    per_step = summary.bytes_per_rank_step(steps)
    if per_step is not None:
        lines.append(
            f"  line protocol written: {summary.write_bytes} bytes"
            f" = {per_step:.0f} bytes per rank per step"
        )
    return "\n".join(lines)


def median_step_s(client: InfluxClient, job: str) -> float | None:
    """The median over the job's windows of each window's median step time (seconds)."""
    series = client.query(
        f"SELECT median({quote_ident('p50')}) FROM {quote_ident(STEP_DURATION)} "
        f"WHERE {quote_ident(JOB_ID)} = {quote_literal(job)}"
    )
    if not series or not series[0].values or series[0].values[0][1] is None:
        return None
    return float(series[0].values[0][1])


def by_cost(diagnoses: list[Diagnosis]) -> list[Diagnosis]:
    """Most expensive first (the finding's ``slowdown``), then the earliest."""
    return sorted(diagnoses, key=lambda d: (-d.slowdown, d.start_unix_nano, d.kind))


#: Demo "faults" after which a healthy job is the right answer: none, and an evaluation pass
#: (a long but normal step on every rank).
HEALTHY_FAULTS = ("none", "eval")


def matches_fault(config: DemoJobConfig, diagnosis: Diagnosis) -> bool:
    """Whether a finding blames what was injected: the faulty rank (or its host) for a
    rank fault, anything for a job-wide one, nothing for ``none`` and ``eval``."""
    if config.fault in HEALTHY_FAULTS:
        return False
    if config.fault not in RANK_FAULTS:
        return True
    host_suffix = f"-node{config.fault_rank // 2}"  # _demo_job.demo_host
    return config.fault_rank in diagnosis.ranks or any(
        host.endswith(host_suffix) for host in diagnosis.hosts
    )


def intro(config: DemoJobConfig) -> str | None:
    """What the default story's job will do, said before it runs (None for other faults)."""
    if config.fault != "straggler":
        return None
    return (
        f"the story: {config.world_size} ranks train healthy for {config.fault_step} steps; "
        f"then rank {config.fault_rank}'s forward pass does extra matrix multiplies (a compute "
        "straggler). Its peers wait for it in the all-reduce, so every rank's step slows; "
        f"stepwatch should blame rank {config.fault_rank}'s forward, not the waiters."
    )


def closing_lines(
    config: DemoJobConfig,
    diagnoses: list[Diagnosis],
    *,
    report: Path | None,
    median_step: float | None,
) -> list[str]:
    """The demo's closing lines: what was found, what it costs, where the report is and what
    to run next. ``diagnoses`` most expensive first (:func:`by_cost`)."""
    lines = []
    injected = (
        "no fault was injected"
        if config.fault == "none"
        else f"an evaluation pass on every rank at step {config.fault_step}, not a fault"
        if config.fault == "eval"
        else f"injected: --fault {config.fault}"
        + (f" on rank {config.fault_rank}" if config.fault in RANK_FAULTS else " on every rank")
        + f" from step {config.fault_step}"
    )
    step_text = "" if median_step is None else f"; median step time {median_step * 1e3:.1f} ms"
    if not diagnoses:
        verdict = "healthy" if config.fault in HEALTHY_FAULTS else "NOT FOUND"
        lines.append(f"verdict:  {verdict}: no finding ({injected}{step_text})")
        if config.fault not in HEALTHY_FAULTS:
            load = os.getloadavg()[0]
            lines.append(
                f"          load average {load:.1f} on {os.cpu_count()} cores: bursts of other "
                "work on a busy host can break the run of slow windows a finding needs; "
                "run it again"
            )
    else:
        top = diagnoses[0]
        where = (top.blamed or "the whole job") + (f", phase {top.phase}" if top.phase else "")
        if top.kernel_class:
            where += f", kernel class {top.kernel_class}"
        lines.append(f"finding:  {top.kind.replace('_', ' ')} ({top.kind}) on {where}")
        cost = (
            f"costs the job {top.slowdown:.2f}x step time"
            if top.slowdown > 1.0
            else "its cost is not estimated for this kind"
        )
        lines.append(f"cost:     it {cost}{step_text}")
        matched = matches_fault(config, top)
        lines.append(
            f"verdict:  {'matches' if matched else 'does NOT match'} what was injected ({injected})"
        )
        if len(diagnoses) > 1:
            lines.append(f"          and {len(diagnoses) - 1} more finding(s), listed above")
    if report is not None:
        lines.append(f"report:   {report}  (open it in a browser; self-contained HTML)")
    others = "|".join(kind for kind in FAULT_KINDS if kind != config.fault)
    lines += [
        "next:",
        f"  stepwatch demo --fault {{{others}}}",
        "  stepwatch up    the stack for your own job (prints the OTLP endpoint for your ranks)",
        "  stepwatch top --job JOB   live ranks x phases of a running job, open findings",
        "  Grafana:        copy grafana/provisioning into your Grafana (docs/operators.md)",
    ]
    return lines


def write_outputs(
    client: InfluxClient, job: str, *, out_dir: Path, start_unix_nano: int, end_unix_nano: int
) -> tuple[list[Any], Path | None]:
    """Run the detectors over the job and write the HTML report, when those parts exist."""
    diagnoses: list[Any] = []
    try:
        from stepwatch.detectors import InfluxDiagnosisSink, detect_job, write_report
    except ImportError as exc:
        logger.warning("detectors unavailable: %s", exc)
        return diagnoses, None
    diagnoses = list(
        detect_job(client, job, start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano)
    )
    # Stored like the detector service stores them: the report, Grafana's annotation query
    # and a later `stepwatch detect` all read stepwatch.diagnosis.
    InfluxDiagnosisSink(client).publish(diagnoses)
    report_path = Path(
        write_report(
            client,
            job,
            start_unix_nano=start_unix_nano,
            end_unix_nano=end_unix_nano,
            out_path=out_dir / f"report-{job}.html",
            findings=diagnoses,
        )
    )
    return diagnoses, report_path


@dataclasses.dataclass(frozen=True)
class HangDemo:
    """What ``stepwatch demo --fault hang|freeze`` saw.

    Attributes:
        finding: the open ``hang`` finding (None: none within the timeout).
        onset_unix_nano: when the faulty rank stopped (its own clock), if it said.
        found_after_s: from the onset to the moment the finding was read back.
        closed: the finding once the job was killed (None: still open when we stopped looking).
        process_group: the job's process group (killed).
    """

    finding: Diagnosis | None
    onset_unix_nano: int | None
    found_after_s: float | None
    closed: Diagnosis | None
    process_group: int


def _hang_findings(client: InfluxClient, job: str, state: str) -> list[Diagnosis]:
    from stepwatch.detectors import read_diagnoses

    return [d for d, _ in read_diagnoses(client, job, state=state) if d.kind == "hang"]


def _poll(predicate: Callable[[], Any], *, timeout_s: float, interval_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def run_hang_demo(
    client: InfluxClient,
    config: DemoJobConfig,
    *,
    timeout_s: float = 120.0,
    progress: Callable[[str], None] = print,
    while_hung: Callable[[], None] | None = None,
) -> HangDemo:
    """Start a job that hangs, wait for the detector service's finding, kill the job.

    The stack's detector service must be running (``stepwatch up``'s defaults find a hang
    within ~15 s of its onset). The job runs in its own session and is killed whole, found or
    not; then the finding should close (the job ended). ``while_hung`` runs once the finding
    is seen, before the kill (a one-shot ``stepwatch detect`` of the hung job, say).
    """
    with tempfile.TemporaryDirectory(prefix="stepwatch-hang-") as scratch:
        onset_file = Path(scratch) / "onset"
        job = start(dataclasses.replace(config, onset_file=str(onset_file)))
        progress(
            f"training: {config.world_size} ranks (DDP, gloo, CPU), job {config.job_id}, fault "
            f"{config.fault} on rank {config.fault_rank} from step {config.fault_step}; "
            f"waiting up to {timeout_s:.0f} s for the hang to be found"
        )
        try:
            found = _poll(
                lambda: _hang_findings(client, config.job_id, "open"), timeout_s=timeout_s
            )
            seen_unix_nano = time.time_ns()
            onset = int(onset_file.read_text()) if onset_file.exists() else None
            if found and while_hung is not None:
                while_hung()
        finally:
            job.kill()
    progress(f"job killed (process group {job.process.pid})")
    finding = found[0] if found else None
    closed = None
    if finding is not None:
        closed_now = _poll(
            lambda: [
                d
                for d in _hang_findings(client, config.job_id, "closed")
                if d.finding_id == finding.finding_id
            ],
            timeout_s=30.0,
        )
        closed = closed_now[0] if closed_now else None
    return HangDemo(
        finding=finding,
        onset_unix_nano=onset,
        found_after_s=None if onset is None or not found else (seen_unix_nano - onset) / 1e9,
        closed=closed,
        process_group=job.process.pid,
    )
