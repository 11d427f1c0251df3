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


_READS = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[\"']")
_STEPWATCH_NAME = re.compile("[\"'](STEPWATCH_[A-Z0-9_]+)[\"']")


def test_no_component_names_its_own_variable_or_reads_one_outside_the_settings() -> None:
    """A ``STEPWATCH_*`` name, or ``os.environ.get``/``os.getenv``, only in settings.py: every
    variable is a Setting (documented, parsed, tested), read through ``resolve``/``lookup``."""
    repo = Path(__file__).resolve().parents[2]
    offenders = []
    for path in repo.glob("*/src/stepwatch/**/*.py"):
        if path.name == "settings.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _STEPWATCH_NAME.search(line) or _READS.search(line):
                offenders.append(f"{path.relative_to(repo)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    "setting", [settings.EXPORTERS_NO_C, settings.REQUIRE_C], ids=lambda s: s.variable
)
def test_switches_read_the_usual_spellings_and_name_the_variable_otherwise(
    setting: settings.Setting[bool],
) -> None:
    assert setting.resolve(None, {}) is False
    for text in ("1", "true", "Yes", " ON "):
        assert setting.resolve(None, {setting.variable: text}) is True, text
    for text in ("0", "false", "No", "off", ""):
        assert setting.resolve(None, {setting.variable: text}) is False, text
    assert setting.resolve(True, {setting.variable: "0"}) is True  # an argument wins
    with pytest.raises(ConfigError, match=setting.variable):
        setting.resolve(None, {setting.variable: "2"})


def test_the_backward_mark_is_the_engine_or_a_tensor_hook() -> None:
    mark = settings.BACKWARD_MARK
    assert mark.resolve(None, {}) == "engine"
    assert mark.resolve(None, {mark.variable: "Tensor_Hook"}) == "tensor-hook"
    assert mark.resolve(None, {mark.variable: "tensor-hook"}) == "tensor-hook"
    assert mark.resolve(None, {mark.variable: "engine"}) == "engine"
    with pytest.raises(ConfigError, match="STEPWATCH_BACKWARD_MARK"):
        mark.resolve(None, {mark.variable: "hooks"})
