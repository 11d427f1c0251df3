"""``stepwatch demo`` with no arguments tells the whole story, from a REAL 4-rank DDP job.

One default run (healthy, then rank 2 becomes a compute straggler whose peers wait for it in
the all-reduce) through the CLI against the session's influxd: the closing lines name the
finding (kind, rank, phase) and its cost, print the report's path and what to run next; the
report has data in every section and renders in a real headless Chromium. One ``--fault none``
run says healthy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import io
import json
import os
import re
import subprocess
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepwatch.app._cli import main as stepwatch_main
from stepwatch.app._demo import by_cost, closing_lines
from stepwatch.app._demo_job import DEMO_FAULT, FAULT_KINDS, DemoJobConfig
from stepwatch.core import ManagedInfluxDB
from stepwatch.core._diagnosis import Diagnosis
from tests.detectors.test_report import CHROMIUM, png_pixels

# A rerun on an overloaded host is reported in pytest's warnings summary, not an error.
pytestmark = pytest.mark.filterwarnings("always:demo run missed:UserWarning")

STRAGGLER_KINDS = {"compute_straggler", "masked_straggler"}
SECTIONS = (
    "Findings",
    "Step time",
    "Step time by rank",
    "Compute kernel time by rank, relative to the median rank",
    "Phase breakdown",
    "Kernels that moved",
)


@dataclass(frozen=True)
class DemoRun:
    output: str
    diagnoses: list[Diagnosis]
    report: Path | None


def run_demo(influxd: ManagedInfluxDB, data_dir: Path, *extra: str) -> DemoRun:
    """``stepwatch demo`` as typed, against the session's influxd (its own database)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = stepwatch_main(
            [
                "demo",
                "--influx-url",
                influxd.url,
                "--database",
                f"story_{uuid.uuid4().hex[:8]}",
                "--data-dir",
                str(data_dir),
                "--json",
                *extra,
            ]
        )
    output = stdout.getvalue()
    assert code == 0, output
    diagnoses = [
        Diagnosis.from_json_dict(json.loads(line))
        for line in output.splitlines()
        if line.startswith("{")
    ]
    report = re.search(r"^report:\s+(\S+)", output, flags=re.MULTILINE)
    return DemoRun(output, diagnoses, Path(report.group(1)) if report else None)


def _named_alone(run: DemoRun) -> bool:
    """The straggler found, on rank 2, and nothing else."""
    return bool(run.diagnoses) and all(
        d.kind in STRAGGLER_KINDS and d.ranks == (2,) for d in run.diagnoses
    )


def _rerun_warning(run: DemoRun) -> None:
    load, cores = os.getloadavg()[0], os.cpu_count()
    warnings.warn(
        f"demo run missed its expected outcome at load {load:.1f} on {cores} cores; "
        "ran it again:\n" + run.output,
        stacklevel=2,
    )


@pytest.fixture(scope="module")
def story(influxd: ManagedInfluxDB, tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    run = run_demo(influxd, tmp_path_factory.mktemp("story"))
    if not _named_alone(run):
        # On this shared 2-core host, bursts of other work (load average 3.7-11) made 7 runs
        # in 25 miss the straggler or blame a burst instead (bench/demo_faults.py; README):
        # one more run, reported in the warnings summary; the tests below judge that one.
        _rerun_warning(run)
        run = run_demo(influxd, tmp_path_factory.mktemp("story-again"))
    return run


def test_default_demo_names_the_straggler_its_cost_the_report_and_what_next(
    story: DemoRun,
) -> None:
    out, found = story.output, story.diagnoses
    described = [(d.kind, d.ranks, d.phase, round(d.slowdown, 2)) for d in found]
    assert f"fault {DEMO_FAULT} on rank 2 from step 240" in out
    # The slow rank and phase, never the ranks that wait for it in the all-reduce.
    assert found and {d.kind for d in found} <= STRAGGLER_KINDS, described
    assert all(d.ranks == (2,) for d in found), described
    top = found[0]
    assert top.phase == "forward", described
    assert [d.slowdown for d in found] == sorted((d.slowdown for d in found), reverse=True)
    # Rank 2's forward does ~8 extra 256x256 matrix products per step: a real cost.
    assert top.slowdown > 1.1, described
    assert f"finding:  {top.kind.replace('_', ' ')} ({top.kind}) on rank 2, phase forward" in out
    # The same cost as the JSON line, which rounds it to 3 decimals (1.2855 prints 1.29 but
    # reads back 1.285, which formats as 1.28): compare the numbers, not the strings.
    cost = re.search(r"cost:     it costs the job (\d+\.\d\d)x step time", out)
    assert cost is not None, out
    assert abs(float(cost.group(1)) - top.slowdown) <= 0.0056, (cost.group(0), top.slowdown)
    assert "verdict:  matches what was injected" in out
    assert story.report is not None and story.report.is_file(), out
    # What to run next: every other fault, the stack, Grafana.
    others = "|".join(kind for kind in FAULT_KINDS if kind != DEMO_FAULT)
    assert f"stepwatch demo --fault {{{others}}}" in out
    assert "stepwatch up" in out and "Grafana" in out


def _sections(page: str) -> dict[str, str]:
    """Each ``<h2>`` title and the HTML up to the next one."""
    parts = re.split(r"<h2>(.*?)</h2>", page)
    return {
        html.unescape(title): body for title, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def test_default_demo_report_has_data_in_every_section(story: DemoRun) -> None:
    assert story.report is not None
    page = story.report.read_text()
    top = story.diagnoses[0]
    lead = re.search(r"<p class='lead'>(.*?)</p>", page)
    assert lead is not None
    headline = re.match(r"Rank 2 slowed the job (\d+\.\d\d)×", html.unescape(lead.group(1)))
    assert headline is not None, lead.group(1)
    assert abs(float(headline.group(1)) - top.slowdown) <= 0.0056, (headline.group(0), top)
    sections = _sections(page)
    assert tuple(sections) == SECTIONS
    assert 'class="empty"' not in page, "a section without data"
    assert html.escape(top.summary) in sections["Findings"]
    lines = re.findall(r'<polyline points="([^"]*)"', sections["Step time"])
    assert len(lines) == 2 and all(len(points.split()) >= 5 for points in lines), lines
    for title in SECTIONS[2:5]:  # heatmap cells and phase bars, each with its value
        assert len(re.findall(r"<rect [^>]*><title>", sections[title])) > 10, title
    # Every rank has compute-kernel cells (the demo's profiler cycles), and after the fault
    # rank 2's compute is the largest relative to the median rank.
    cells = re.findall(
        r"<title>rank (\d+) \d\d:\d\d:\d\d: ([\d.]+)×</title>",
        sections["Compute kernel time by rank, relative to the median rank"],
    )
    assert {rank for rank, _ in cells} == {"0", "1", "2", "3"}
    brightest = max(cells, key=lambda cell: float(cell[1]))
    assert brightest[0] == "2" and float(brightest[1]) > 1.5, brightest
    rows = re.findall(r"<tr><td><code>(.*?)</code>(.*?)</tr>", sections["Kernels that moved"])
    assert len(rows) >= 5
    # The extra matrix products are gemm: among the top movers (with the all-reduce its peers
    # now wait in longer), and most different on rank 2, slower than the median rank.
    top_classes = [name for name, _ in rows[:3]]
    assert "gemm" in top_classes, top_classes
    gemm = rows[top_classes.index("gemm")][1]
    outlier = re.search(r"<td>rank (\d+) ([\d.]+)×</td>", gemm)
    assert outlier is not None and outlier.group(1) == "2" and float(outlier.group(2)) > 1.2, gemm


CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (scripts/setup.sh)")
def test_default_demo_report_screenshot_in_headless_chromium(
    story: DemoRun, tmp_path: Path
) -> None:
    assert CHROMIUM is not None and story.report is not None
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    screenshot = tmp_path / "report.png"
    subprocess.run(
        [
            CHROMIUM,
            *flags,
            f"--screenshot={screenshot}",
            "--window-size=1100,2600",
            story.report.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    width, channels, rows = png_pixels(screenshot)
    assert (width, len(rows)) == (1100, 2600)
    counts = Counter(
        row[x : x + 3] for row in rows[::2] for x in range(0, width * channels, channels * 2)
    )
    total = sum(counts.values())
    # Not blank, not an error page: white is the background, not most of the page.
    assert counts[b"\xff\xff\xff"] / total < 0.8, counts.most_common(3)
    assert len(counts) > 200, f"only {len(counts)} distinct colours"
    # The plots were drawn: phase bars (forward, backward, communication) and the heatmaps'
    # top-of-scale cells (the straggler's compute) cover real area.
    for colour in ("4c78a8", "f58518", "e45756", "fde725"):
        assert counts[bytes.fromhex(colour)] / total > 0.0003, colour
    # The DOM Chromium built from the file: the headline and every section, with data.
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", story.report.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "Rank 2 slowed the job" in dom
    assert tuple(_sections(dom)) == SECTIONS
    assert dom.count("<svg") >= 5 and 'class="empty"' not in dom


def test_demo_without_a_fault_says_healthy(influxd: ManagedInfluxDB, tmp_path: Path) -> None:
    run = run_demo(influxd, tmp_path / "first", "--fault", "none")
    if run.diagnoses:
        # A real burst on an overloaded host: 1 clean run in 12 at load average ~5 on 2 cores
        # had a 1.02x jit_stall (a rank descheduled). One more run, reported; judge that one.
        _rerun_warning(run)
        run = run_demo(influxd, tmp_path / "again", "--fault", "none")
    assert run.diagnoses == [], run.output
    assert "verdict:  healthy: no finding (no fault was injected; median step time" in run.output
    assert run.report is not None
    lead = re.search(r"<p class='lead'>(.*?)</p>", run.report.read_text())
    assert lead is not None and lead.group(1).startswith("Healthy: the detectors found nothing")


def _finding(kind: str, ranks: tuple[int, ...], slowdown: float) -> Diagnosis:
    return Diagnosis(
        job="j",
        kind=kind,
        start_unix_nano=1_800_000_000_000_000_000,
        end_unix_nano=None,
        severity="critical",
        score=5.0,
        summary="s",
        ranks=ranks,
        phase="forward",
        slowdown=slowdown,
    )


def test_the_closing_lines_judge_the_finding_against_what_was_injected() -> None:
    config = DemoJobConfig(job_id="j", fault="straggler", fault_rank=2)
    found = by_cost([_finding("jit_stall", (2,), 1.05), _finding("masked_straggler", (2,), 1.4)])
    lines = closing_lines(config, found, report=Path("/r.html"), median_step=0.0142)
    assert lines[0] == "finding:  masked straggler (masked_straggler) on rank 2, phase forward"
    assert lines[1] == "cost:     it costs the job 1.40x step time; median step time 14.2 ms"
    assert lines[2].startswith("verdict:  matches what was injected (injected: --fault straggler")
    assert "and 1 more finding(s)" in lines[3] and lines[4].startswith("report:   /r.html")
    # A waiter blamed is not the straggler; nothing found is said, with the host's load.
    waiter = closing_lines(
        config, [_finding("masked_straggler", (1,), 1.3)], report=None, median_step=None
    )
    assert waiter[2].startswith("verdict:  does NOT match what was injected")
    missed = closing_lines(config, [], report=None, median_step=None)
    assert missed[0].startswith("verdict:  NOT FOUND: no finding") and "load average" in missed[1]
    # No fault, or an evaluation pass: no finding is the right answer.
    for fault in ("none", "eval"):
        healthy = closing_lines(
            dataclasses.replace(config, fault=fault), [], report=None, median_step=0.015
        )
        assert healthy[0].startswith("verdict:  healthy: no finding"), healthy
        assert "median step time 15.0 ms" in healthy[0] and "load average" not in healthy[1]
