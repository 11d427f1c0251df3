"""One settings module: every variable documented, precedence argument > variable > default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stepwatch.core import ConfigError, settings

_QUOTED = re.compile("[\"']([A-Z][A-Z0-9_]{3,})[\"']")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_precedence_argument_then_variables_in_order_then_default() -> None:
    setting = settings.INFLUX_TOKEN
    both = {"STEPWATCH_INFLUX_TOKEN": "a", "INFLUX_TOKEN": "b"}
    assert setting.resolve("arg", both) == "arg"
    assert setting.resolve(None, both) == "a"
    assert setting.resolve(None, {"INFLUX_TOKEN": "b"}) == "b"
    assert setting.resolve(None, {"STEPWATCH_INFLUX_TOKEN": "  "}) is None
    assert settings.BRIDGE_GRPC_PORT.lookup({"STEPWATCH_BRIDGE_GRPC_PORT": "7"}) == (
        7,
        "STEPWATCH_BRIDGE_GRPC_PORT",
    )


def test_milliseconds_variables_become_seconds_and_bad_text_names_the_variable() -> None:
    interval = settings.METRIC_EXPORT_INTERVAL_S
    assert interval.resolve(None, {"OTEL_METRIC_EXPORT_INTERVAL": "250"}) == 0.25
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT"):
        settings.OTLP_TIMEOUT_S.resolve(None, {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match="OTEL_METRIC_EXPORT_INTERVAL"):
        settings.METRIC_EXPORT_INTERVAL_S.resolve(None, {"OTEL_METRIC_EXPORT_INTERVAL": "-5"})


def test_every_variable_is_unique_and_documented() -> None:
    variables = [v for s in settings.all_settings() for v in s.variables]
    assert len(variables) == len(set(variables))
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", DOCS.read_text()))
    assert set(variables) <= documented, set(variables) - documented


def test_no_component_reads_the_environment_behind_the_settings_back() -> None:
    """Only settings.py names variables; other modules pass ``environ`` to a Setting."""
    repo = Path(__file__).resolve().parents[2]
    names = {v for s in settings.all_settings() for v in s.variables}
    offenders = []
    for path in repo.glob("*/src/stepwatch/**/*.py"):
        if path.name == "settings.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in _QUOTED.findall(line):
                if name in names:
                    offenders.append(f"{path.relative_to(repo)}:{number}: {name}")
    assert not offenders, "\n".join(offenders)
