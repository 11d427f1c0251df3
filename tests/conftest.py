"""Shared fixtures: real servers started on free loopback ports, stopped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from stepwatch.core import InfluxClient, ManagedInfluxDB


@pytest.fixture(scope="session")
def influxd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedInfluxDB]:
    """One real influxd (Debian's influxdb package) for the whole test session."""
    server = ManagedInfluxDB(tmp_path_factory.mktemp("influxd"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def influx(influxd: ManagedInfluxDB) -> InfluxClient:
    """A client on a fresh, empty database of the session's influxd."""
    client = influxd.client(database=f"test_{uuid.uuid4().hex[:12]}")
    client.create_database()
    return client
