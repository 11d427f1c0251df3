"""The README's Python examples run as written, against a real bridge and influxd.

They name no endpoint, so this also checks that ``OTEL_EXPORTER_OTLP_ENDPOINT`` is honoured.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepwatch.core import InfluxClient
from stepwatch.core._influx import wait_until
from stepwatch.otel_bridge import Bridge, InfluxV1Writer

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.fixture
def bridge(influx: InfluxClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bridge]:
    server = Bridge(InfluxV1Writer(influx))
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.http_port}")
    try:
        yield server
    finally:
        server.stop()


def test_readme_has_the_examples() -> None:
    assert len(BLOCKS) >= 2
    assert "StepMonitor(job_id=" in BLOCKS[0]


# The Lightning example: Lightning 2.6 on torch 2.13 warns about its own pytree use and about
# data-loader workers; those warnings are the framework's, not the example's.
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_and_stores_steps(
    index: int, influx: InfluxClient, bridge: Bridge
) -> None:
    namespace = {"rank": 0, "world_size": 1, "loader": range(7)}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)
    job = re.search(r'job_id="([^"]+)"', BLOCKS[index])
    assert job is not None

    def stored_steps() -> float:
        series = influx.query(
            'SELECT sum("count") FROM "stepwatch.step.duration" '
            f"WHERE \"stepwatch.job.id\" = '{job.group(1)}'"
        )
        return float(series[0].values[0][1]) if series else 0.0

    expected = 7 if index == 0 else 10
    assert wait_until(lambda: stored_steps() == expected, timeout_s=15), stored_steps()
