"""``stepwatch report``: the HTML is self-contained and renders in a real headless Chromium."""

from __future__ import annotations

import dataclasses
import html
import re
import shutil
import statistics
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.app._cli import main as stepwatch_main
from stepwatch.core import ConfigError, InfluxClient
from stepwatch.detectors.report import write_report
from stepwatch.detectors.report._data import (
    MAX_HEATMAP_RANKS,
    ReportData,
    load_report_data,
    most_deviant,
    read_findings,
)
from stepwatch.detectors.report._page import NO_KERNELS, render_html
from stepwatch.detectors.report._svg import NO_PHASES, format_seconds, stamp
from tests.detectors.demo_data import DemoJob, write_demo

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def demo(influxd: Any) -> Iterator[tuple[InfluxClient, DemoJob]]:
    client = influxd.client(database="operators_report")
    client.create_database()
    now_ns = time.time_ns()
    yield client, write_demo(client, job="report-job", end_unix_nano=now_ns - now_ns % 10**9)


def test_report_is_self_contained_and_says_what_happened(
    demo: tuple[InfluxClient, DemoJob], tmp_path: Path
) -> None:
    client, job = demo
    path = write_report(
        client,
        job.job,
        start_unix_nano=job.start_unix_nano,
        end_unix_nano=job.end_unix_nano,
        out_path=tmp_path / "nested" / "report.html",
    )
    page = path.read_text()
    # Nothing loaded from anywhere: no URLs, scripts, external styles, images or fonts.
    assert not re.search(r"https?://|<script|<link|<img|@import|url\(", page)
    assert page.count("<svg") >= 5
    assert "rank 5 compute 1.40x peers" in page, "the finding in words"
    assert "still open" in page
    # The kernel that moved most is gemm, localised to the straggler rank.
    data = load_report_data(
        client, job.job, start_unix_nano=job.start_unix_nano, end_unix_nano=job.end_unix_nano
    )
    top = data.kernels[0]
    assert top.category == "compute" or top.kernel_class == "nccl_all_reduce"
    gemm = next(k for k in data.kernels if k.kernel_class == "gemm")
    assert gemm.outlier_rank == str(job.straggler_rank)
    assert gemm.outlier_ratio is not None and 1.3 < gemm.outlier_ratio < 1.5
    assert data.change_unix_nano == job.change_unix_nano
    # The headline is the top finding (both planted ones have no cost estimate: the earliest,
    # then by kind), never a before/after ratio of the median step time.
    lead = re.search(r"<p class='lead'>(.*?)</p>", page)
    assert lead is not None
    assert lead.group(1).startswith(f"Compute straggler in backward on rank {job.straggler_rank}")
    assert "its cost is not estimated" in lead.group(1) and "1 more finding below" in lead.group(1)
    # Kernel classes that moved most weighted by their share of kernel time come first.
    impacts = [k.impact for k in data.kernels]
    assert impacts == sorted(impacts, reverse=True)
    assert abs(sum(k.share for k in data.kernels) - 1.0) < 1e-9


def _lead(data: ReportData) -> str:
    found = re.search(r"<p class='lead'>(.*?)</p>", render_html(data))
    assert found is not None
    return html.unescape(found.group(1))


def test_headline_says_what_the_costliest_finding_did(
    demo: tuple[InfluxClient, DemoJob],
) -> None:
    client, job = demo
    straggler, regression = job.findings
    findings = [
        dataclasses.replace(straggler, slowdown=1.25),
        dataclasses.replace(regression, slowdown=1.6),
    ]
    data = load_report_data(
        client,
        job.job,
        start_unix_nano=job.start_unix_nano,
        end_unix_nano=job.end_unix_nano,
        findings=findings,
    )
    # Most expensive first, in the list and in the headline.
    assert [f.kind for f in data.findings] == ["job_regression", "compute_straggler"]
    assert _lead(data) == (
        f"The whole job slowed 1.60× from {stamp(regression.start_unix_nano)} "
        "(job regression in backward). (1 more finding below.)"
    )
    data = dataclasses.replace(data, findings=[findings[0]])
    assert _lead(data) == (
        f"Rank {job.straggler_rank} slowed the job 1.25× from "
        f"{stamp(straggler.start_unix_nano)} (compute straggler in backward)."
    )


def test_a_healthy_job_says_so_with_its_median_step_time(
    demo: tuple[InfluxClient, DemoJob],
) -> None:
    client, job = demo
    data = load_report_data(
        client,
        job.job,
        start_unix_nano=job.start_unix_nano,
        end_unix_nano=job.end_unix_nano,
        findings=[],
    )
    typical = statistics.median(v for v in data.step_median if v is not None)
    assert _lead(data) == (
        "Healthy: the detectors found nothing wrong in this range; median step time "
        f"{format_seconds(typical)} over {job.ranks} ranks."
    )
    assert "No findings: the detectors found nothing wrong" in render_html(data)


def test_sections_without_data_say_why(demo: tuple[InfluxClient, DemoJob]) -> None:
    client, job = demo
    data = load_report_data(
        client, job.job, start_unix_nano=job.start_unix_nano, end_unix_nano=job.end_unix_nano
    )
    # A job that reported steps only: no kernel source, no phases.
    bare = dataclasses.replace(data, kernels=[], compute_by_rank={}, phases={})
    page = render_html(bare)
    reasons = [html.unescape(r) for r in re.findall(r'<p class="empty">(.*?)</p>', page)]
    assert reasons == [NO_KERNELS, NO_PHASES, NO_KERNELS], reasons
    assert "No data" not in page
    full = render_html(data)
    assert 'class="empty"' not in full, "the demo job has data in every section"


def test_findings_round_trip_from_storage(demo: tuple[InfluxClient, DemoJob]) -> None:
    client, job = demo
    found = read_findings(
        client, job.job, start_unix_nano=job.start_unix_nano, end_unix_nano=job.end_unix_nano
    )
    by_kind = {f.kind: f for f in found}
    assert set(by_kind) == {f.kind for f in job.findings}
    for planted in job.findings:
        stored = by_kind[planted.kind]
        assert stored.ranks == planted.ranks and stored.hosts == planted.hosts
        assert stored.start_unix_nano == planted.start_unix_nano
        expected_end = planted.end_unix_nano
        assert stored.end_unix_nano == (None if expected_end is None else expected_end)
        assert stored.finding_id == planted.finding_id


def test_unknown_job_is_a_config_error(demo: tuple[InfluxClient, DemoJob], tmp_path: Path) -> None:
    client, job = demo
    with pytest.raises(ConfigError, match="job"):
        write_report(
            client,
            "no-such-job",
            start_unix_nano=job.start_unix_nano,
            end_unix_nano=job.end_unix_nano,
            out_path=tmp_path / "r.html",
        )


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat, header = 8, b"", b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour_type in (2, 6) and interlace == 0
    channels = 3 if colour_type == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    position = 0
    for _ in range(height):
        filter_type = raw[position]
        line = bytearray(raw[position + 1 : position + 1 + stride])
        position += 1 + stride
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if filter_type == 1:
                line[i] = (line[i] + left) & 0xFF
            elif filter_type == 2:
                line[i] = (line[i] + up) & 0xFF
            elif filter_type == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif filter_type == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        previous = line
    return width, channels, rows


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (scripts/setup.sh)")
def test_report_renders_in_headless_chromium(
    demo: tuple[InfluxClient, DemoJob], tmp_path: Path
) -> None:
    client, job = demo
    report = tmp_path / "report.html"
    assert (
        stepwatch_main(
            [
                "report",
                "--job",
                job.job,
                "--influx-url",
                client.url,
                "--database",
                client.database,
                "--out",
                str(report),
            ]
        )
        == 0
    )
    assert CHROMIUM is not None
    screenshot = tmp_path / "report.png"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    subprocess.run(
        [
            CHROMIUM,
            *flags,
            f"--screenshot={screenshot}",
            "--window-size=1100,2600",
            report.as_uri(),
        ],
        capture_output=True,
        timeout=90,
        check=True,
    )
    width, channels, rows = png_pixels(screenshot)
    assert width == 1100 and len(rows) == 2600
    colours = set()
    for row in rows[::7]:
        for x in range(0, width * channels, channels * 5):
            colours.add(row[x : x + 3])
    # Text, axes, heatmap scale and phase colours: a blank or error page has a handful.
    assert len(colours) > 200, f"only {len(colours)} distinct colours in the screenshot"
    # The SVG really was drawn: the straggler's bright heatmap cells (top of the scale) and
    # the phase bars' backward orange are on screen.
    every_pixel = {
        row[x : x + 3] for row in rows[::3] for x in range(0, width * channels, channels)
    }
    assert bytes((253, 231, 37)) in every_pixel, "no top-of-scale heatmap cell rendered"
    assert bytes.fromhex("f58518") in every_pixel, "no backward-phase bar rendered"


def test_report_command_reports_a_missing_job(demo: tuple[InfluxClient, DemoJob]) -> None:
    client, _ = demo
    code = stepwatch_main(
        [
            "report",
            "--job",
            "nope",
            "--influx-url",
            client.url,
            "--database",
            client.database,
            "--out",
            "/nonexistent/never-written.html",
        ]
    )
    assert code == 1


def test_many_ranks_show_the_most_deviant(influxd: Any, tmp_path: Path) -> None:
    client = influxd.client(database="operators_report_wide")
    client.create_database()
    now_ns = time.time_ns()
    job = write_demo(
        client,
        job="wide-job",
        end_unix_nano=now_ns - now_ns % 10**9,
        ranks=70,
        windows=6,
        straggler_rank=66,
        straggler_from_window=2,
    )
    data = load_report_data(
        client, job.job, start_unix_nano=job.start_unix_nano, end_unix_nano=job.end_unix_nano
    )
    assert data.total_ranks == 70 and len(data.ranks) == MAX_HEATMAP_RANKS
    assert "66" in data.ranks
    assert set(data.step_by_rank) == set(data.compute_by_rank) == set(data.ranks)
    page = render_html(data)
    assert f"the {MAX_HEATMAP_RANKS} ranks farthest from the median of 70" in page


@given(st.dictionaries(st.integers(0, 5000).map(str), st.floats(0, 10), max_size=150))
def test_most_deviant_keeps_the_extremes(means: dict[str, float]) -> None:
    ranks = sorted(means, key=int)
    chosen = most_deviant(means, ranks)
    assert len(chosen) == min(len(ranks), MAX_HEATMAP_RANKS)
    assert chosen == sorted(chosen, key=int) and set(chosen) <= set(ranks)
    if ranks:
        centre = statistics.median(means.values())
        farthest = max(abs(v - centre) for v in means.values())
        assert any(abs(means[r] - centre) == farthest for r in chosen)
