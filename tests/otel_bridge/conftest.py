"""Fixtures for the bridge tests: a Bridge on free loopback ports writing to the real influxd."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stepwatch.core import InfluxClient
from stepwatch.otel_bridge import Bridge, InfluxV1Writer


@pytest.fixture
def bridge(influx: InfluxClient) -> Iterator[Bridge]:
    """A started Bridge (gRPC + HTTP) writing to a fresh database of the session influxd."""
    server = Bridge(InfluxV1Writer(influx), flush_interval_s=0.02).start()
    try:
        yield server
    finally:
        server.stop()
