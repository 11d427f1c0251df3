"""``stepwatch demo``: a real DDP job streamed through the bridge into a managed InfluxDB."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepwatch.app._demo_job import DemoJobConfig, launch
from stepwatch.core._errors import StepwatchError
from stepwatch.core._influx import InfluxClient, quote_ident, quote_literal, wait_until
from stepwatch.core._schema import JOB_ID, PHASE, PHASE_DURATION, RANK, STEP_LAST

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
