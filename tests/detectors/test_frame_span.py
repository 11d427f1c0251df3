"""Frames span the windows that hold data, not the range asked for (issue 17, item 7).

``stepwatch detect --from 2000-01-01T00:00:00Z --to 2030-01-01T00:00:00Z`` on a job of a
few windows once sized its arrays by the request (30 years of 0.5 s windows: 564 GiB).
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest

from stepwatch.app._cli import main
from stepwatch.app._replay import write_direct
from stepwatch.core import InfluxClient
from stepwatch.core._diagnosis import parse_time
from stepwatch.detectors import Fault, SimulatedJob, read_frame, simulate
from stepwatch.detectors.frame._frame import TRAILING_EMPTY_WINDOWS

FROM, TO = "2000-01-01T00:00:00Z", "2030-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def short_job() -> SimulatedJob:
    """8 windows of 1 s, 8 ranks, a data-loader stall: decades of such windows are ~400 GB."""
    return simulate(
        8,
        steps=80,
        steps_per_window=10,
        step_s=0.1,
        faults=[Fault.parse("dataloader_stall@20:4:3")],
        seed=4,
        job="short-job",
    )


def test_a_wide_range_gives_the_frame_of_the_data(
    influx: InfluxClient, short_job: SimulatedJob
) -> None:
    write_direct(short_job, influx)
    frame = read_frame(
        influx, "short-job", start_unix_nano=parse_time(FROM), end_unix_nano=parse_time(TO)
    )
    assert short_job.n_windows == 8
    assert 8 <= frame.n_windows <= 8 + TRAILING_EMPTY_WINDOWS + 1
    assert frame.present.any(axis=1).sum() == 8
    memory = short_job.frame()
    first = int(np.flatnonzero(frame.present.any(axis=1))[0])
    np.testing.assert_allclose(
        frame.step_s[first : first + 8], memory.step_s, rtol=1e-9, equal_nan=True
    )


def test_a_job_without_data_gives_an_empty_frame(influx: InfluxClient) -> None:
    frame = read_frame(
        influx, "no-such-job", start_unix_nano=parse_time(FROM), end_unix_nano=parse_time(TO)
    )
    assert (frame.n_windows, frame.n_ranks) == (0, 0)


def test_detect_over_decades_finds_the_fault_and_no_data_is_an_error(
    influx: InfluxClient, short_job: SimulatedJob
) -> None:
    write_direct(short_job, influx)
    common = ["--influx-url", influx.url, "--database", influx.database]
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["detect", "--job", "short-job", "--from", FROM, "--to", TO, "--json", *common])
    assert code == 0
    assert '"kind": "dataloader_stall"' in out.getvalue()
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main(["detect", "--job", "no-such-job", "--from", FROM, "--to", TO, *common])
    assert code == 1
    assert "no data stored for job 'no-such-job'" in err.getvalue()
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main(["detect", "--job", "short-job", "--from", FROM, "--to", "2001-01-01", *common])
    assert code == 1
    assert "no data for job 'short-job' between 2000-01-01T00:00:00Z and 2001" in err.getvalue()
