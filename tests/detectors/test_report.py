"""``stepwatch report``: the HTML is self-contained and renders in a real headless Chromium."""

from __future__ import annotations

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
    load_report_data,
    most_deviant,
    read_findings,
)
from stepwatch.detectors.report._page import render_html
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
    assert "Median step time went from" in page


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
