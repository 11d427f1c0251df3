"""Windows that do not line up never make a finding on their own.

A stock OpenTelemetry SDK closes each rank's window on its own timer (up to an export
interval apart across ranks), so at a change of the job's pace one rank's window holds more
slow steps than another's. Here a synchronous 4-rank job whose rank 2 slows down is
exported with the ranks' windows 0.3 s apart in a 1 s interval, in each layout a producer
may send, through the bridge's conversion into a real InfluxDB.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from stepwatch.app._replay import write_direct
from stepwatch.core import InfluxClient
from stepwatch.detectors import detect_job
from tests.detectors.timeline_job import START_UNIX_NANO, TimelineJob, in_layout, masked_straggler

OFFSETS = (0.0, 0.3, 0.6, 0.9)
ONSET = 700


@pytest.mark.parametrize("layout", ["auto", "no-communication", "steps"])
@pytest.mark.parametrize("seed", [0, 2])
def test_misaligned_windows_add_nothing_to_the_diagnosis(
    influx: InfluxClient, layout: str, seed: int
) -> None:
    step, phases, phase_s = masked_straggler(steps=2000, slow_from=ONSET, factor=3.0, seed=seed)
    healthy, _, _ = masked_straggler(steps=2000, slow_from=ONSET, factor=1.0, seed=seed)
    truth = float(step.max(axis=1)[ONSET:].mean() / healthy.max(axis=1)[ONSET:].mean())
    phases, phase_s = in_layout(phases, phase_s, layout)
    job = TimelineJob(f"misaligned-{uuid.uuid4().hex[:6]}", step, phases, phase_s, 1.0, OFFSETS)
    write_direct(job, influx)
    found = detect_job(
        influx,
        job.job_id,
        start_unix_nano=START_UNIX_NANO - 10**10,
        end_unix_nano=START_UNIX_NANO + round((job.n_windows + 10) * 1e9),
    )
    # With phases, the rank that is slow; with step times alone, only that the job is slower.
    expected = [("job_regression", ())] if layout == "steps" else [("masked_straggler", (2,))]
    assert [(d.kind, d.ranks) for d in found] == expected, found
    assert found[0].slowdown == pytest.approx(truth, rel=0.15)
    assert np.isclose(truth, 1.6, atol=0.1)  # the fixture: forward 3x, ~30% of a step
