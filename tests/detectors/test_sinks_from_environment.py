"""``stepwatch detect`` and ``stepwatch up`` pick their Alertmanager/Grafana sinks one way."""

from __future__ import annotations

import pytest

from stepwatch.core import ConfigError
from stepwatch.detectors.sinks import (
    AlertmanagerSink,
    GrafanaAnnotationSink,
    sinks_from_environment,
)


def test_nothing_configured_means_no_extra_sinks() -> None:
    assert sinks_from_environment({}) == []


def test_environment_and_arguments() -> None:
    environ = {"ALERTMANAGER_URL": "http://am:9093", "GRAFANA_URL": "http://g:3000"}
    with pytest.raises(ConfigError, match="GRAFANA_TOKEN"):
        sinks_from_environment(environ)
    sinks = sinks_from_environment({**environ, "GRAFANA_TOKEN": "glsa_x"})
    assert [type(sink) for sink in sinks] == [AlertmanagerSink, GrafanaAnnotationSink]
    # An argument replaces its variable.
    (alertmanager,) = sinks_from_environment({}, alertmanager_url="http://other:9093")
    assert isinstance(alertmanager, AlertmanagerSink)
    assert "other" in repr(vars(alertmanager))
