"""The interop tests' fixtures: the bridge tests' real bridge on the session's influxd."""

from tests.otel_bridge.conftest import bridge

__all__ = ["bridge"]
