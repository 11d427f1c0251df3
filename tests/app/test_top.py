"""``stepwatch top``: drawn from a real influxd, and watched in a real terminal (tmux)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from stepwatch.app._replay import write_direct
from stepwatch.app._top import RankRow, Snapshot, costliest_first, read_snapshot, render
from stepwatch.core import Diagnosis, InfluxClient
from stepwatch.core._influx import wait_until
from stepwatch.detectors import Fault, InfluxDiagnosisSink, detect_job, simulate

WINDOW_S = 5


def write_job(influx: InfluxClient, job: str, *, ranks: int = 8, steps: int = 400) -> None:
    """A simulated job with a straggler on its second-to-last rank, ending about now."""
    window_ns = WINDOW_S * 10**9
    duration_ns = steps // 5 * window_ns
    start = (time.time_ns() - duration_ns) // window_ns * window_ns
    simulated = simulate(
        ranks,
        steps=steps,
        job=job,
        start_unix_nano=start,
        faults=[Fault.parse(f"compute_straggler@150:{ranks - 3}:1.6")],
    )
    write_direct(simulated, influx)
    span = (start, start + duration_ns + window_ns)
    InfluxDiagnosisSink(influx).publish(
        detect_job(influx, job, start_unix_nano=span[0], end_unix_nano=span[1])
    )


def test_snapshot_marks_the_straggler_and_lists_its_finding(influx: InfluxClient) -> None:
    job = f"top-{uuid.uuid4().hex[:6]}"
    write_job(influx, job)
    snapshot = read_snapshot(influx, job, lookback_s=600)
    assert [row.rank for row in snapshot.ranks] == list(range(8))
    assert {"forward", "backward", "communication"} <= set(snapshot.phases)
    assert [f.kind for f in snapshot.findings] == ["compute_straggler"]
    screen = render(snapshot, width=200, height=40, interval_s=5.0, color=False)
    marked = [line for line in screen.splitlines() if line.endswith("◀")]
    assert [int(line.split()[0]) for line in marked] == [5], screen
    assert "compute_straggler" in screen and "rank 5" in screen
    # Too small a screen: the ranks that stand out stay, the rest are summarised.
    small = render(snapshot, width=200, height=9, interval_s=5.0, color=False)
    rows = [line for line in small.splitlines() if line[:5].strip().isdigit()]
    assert 5 in [int(line.split()[0]) for line in rows]
    assert "more ranks closer to the median" in small


def test_a_silent_rank_is_flagged() -> None:
    now = 1_800_000_000 * 10**9

    def row(rank: int, seen_s_ago: float) -> RankRow:
        return RankRow(
            rank=rank,
            host="h",
            stage="",
            step_s=0.1,
            phases_s={"forward": 0.04},
            last_step=100,
            seen_unix_nano=now - round(seen_s_ago * 1e9),
        )

    snapshot = Snapshot(
        job="j",
        now_unix_nano=now,
        ranks=[row(0, 1), row(1, 1), row(2, 30)],
        phases=["forward"],
        findings=[],
    )
    screen = render(snapshot, width=200, height=40, interval_s=1.0, color=False)
    flagged = [line.split()[0] for line in screen.splitlines() if line.endswith("silent")]
    assert flagged == ["2"]
    assert "open findings: none" in screen


@pytest.fixture
def tmux_session() -> Iterator[str]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup.sh installs it)")
    name = f"stepwatch-top-{uuid.uuid4().hex[:6]}"
    try:
        yield name
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True, check=False)


def test_live_in_a_terminal_redraws_and_quits_on_ctrl_c(
    influx: InfluxClient, tmux_session: str
) -> None:
    job = f"top-{uuid.uuid4().hex[:6]}"
    write_job(influx, job, ranks=4)
    # The tmux server may predate this test: pass the environment the command needs.
    command = [
        "env",
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}",
        sys.executable,
        "-m",
        "stepwatch",
        "top",
        "--job",
        job,
        "--interval",
        "0.3s",
        "--influx-url",
        influx.url,
        "--database",
        influx.database,
    ]
    # A shell prints the exit status into the pane (tmux 3.3 sometimes loses a dead pane's
    # status when the pty closes first).
    shell = f'{shlex.join(command)}; echo "top exited with status $?"; sleep 60'
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", tmux_session, "-x", "180", "-y", "40", shell],
        check=True,
    )

    def pane() -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", tmux_session],
            capture_output=True,
            text=True,
            check=False,
        ).stdout

    assert wait_until(lambda: f"job {job}" in pane() and "4 ranks" in pane(), timeout_s=30), pane()
    # A rank joins: the next redraw shows it without a restart.
    influx.write_lines(
        [
            f"stepwatch.step.duration,stepwatch.job.id={job},stepwatch.rank=4,host.name=late "
            f"count=1,sum=0.2,mean=0.2 {time.time_ns()}"
        ]
    )
    assert wait_until(lambda: "5 ranks" in pane(), timeout_s=15), pane()
    subprocess.run(["tmux", "send-keys", "-t", tmux_session, "C-c"], check=True)

    assert wait_until(lambda: "top exited with status" in pane(), timeout_s=10), pane()
    assert "top exited with status 0" in pane(), pane()  # Ctrl-C quits cleanly


def test_no_job_data_says_so(influx: InfluxClient) -> None:
    snapshot = read_snapshot(influx, "nobody", lookback_s=60)
    screen = render(snapshot, width=120, height=20, interval_s=1.0, color=False)
    assert "no windows from this job yet" in screen


def test_findings_are_ordered_by_cost_then_severity() -> None:
    def finding(kind: str, slowdown: float, severity: str) -> Diagnosis:
        return Diagnosis(
            job="j",
            kind=kind,
            start_unix_nano=0,
            end_unix_nano=None,
            severity=severity,
            score=1.0,
            summary=kind,
            slowdown=slowdown,
        )

    ordered = costliest_first(
        [
            finding("jit_stall", 1.1, "warning"),
            finding("rank_missing", 1.9, "critical"),
            finding("compute_straggler", 1.9, "warning"),
            finding("dataloader_stall", 1.5, "warning"),
        ]
    )
    assert [f.kind for f in ordered] == [
        "rank_missing",
        "compute_straggler",
        "dataloader_stall",
        "jit_stall",
    ]
    snapshot = Snapshot(job="j", now_unix_nano=0, ranks=[], phases=[], findings=ordered)
    screen = render(snapshot, width=120, height=20, interval_s=1.0, color=False)
    assert screen.index("rank_missing") < screen.index("jit_stall")


def test_influxdb_down_is_said_on_screen_and_the_view_keeps_trying() -> None:
    import io

    from stepwatch.app._top import run_top
    from stepwatch.core._net import free_port

    client = InfluxClient(f"http://127.0.0.1:{free_port()}", database="nowhere")
    out = io.StringIO()
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt

    status = run_top(
        client,
        "j",
        interval_s=0.5,
        lookback_s=60,
        once=False,
        out=out,
        color=False,
        size=lambda: (120, 30),
        sleep=sleep,
    )
    assert status == 0 and naps == [0.5, 0.5, 0.5]
    assert out.getvalue().count("retrying every 0.5 s") == 3
