"""OpenTelemetry SDK variables and torchrun's identity variables, as StepMonitor reads them.

One test per variable (issue 13); semantics cited in ``stepwatch.exporters._sdk_env`` and
``_config``. Every monitor here exports into memory, so what reaches the wire is checked.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from typing import Any

import pytest

from stepwatch.core import ConfigError, _schema
from stepwatch.exporters import InMemoryExporter, StepMonitor, resolve_exporter_config
from stepwatch.exporters._sdk_env import parse_resource_attributes

VARIABLES = (
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_METRICS_INSECURE",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def _monitor(**options: Any) -> tuple[StepMonitor, InMemoryExporter]:
    exporter = InMemoryExporter()
    arguments: dict[str, Any] = {"job_id": "run-1", "rank": 0, "world_size": 1, "host_name": "n0"}
    arguments.update(options)
    monitor = StepMonitor(exporter=exporter, start=False, health=False, **arguments)
    return monitor, exporter


def _sent_resource(**options: Any) -> dict[str, Any]:
    """The resource attributes of the first window the monitor exports."""
    monitor, exporter = _monitor(**options)
    with monitor.step():
        pass
    assert monitor.export_now()
    monitor.close()
    return dict(exporter.exported[0].resource_metrics[0].resource.attributes)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---------------------------------------------------------------- identity (torchrun)
def test_torchrun_variables_name_the_rank_and_arguments_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    sent = _sent_resource(job_id=None, rank=None, world_size=None)
    assert sent[_schema.JOB_ID] == "elastic-7"
    assert (sent[_schema.RANK], sent[_schema.WORLD_SIZE], sent[_schema.LOCAL_RANK]) == (5, 8, 1)
    explicit = _sent_resource(job_id="mine", rank=2, world_size=4, local_rank=0)
    assert explicit[_schema.JOB_ID] == "mine"
    assert (explicit[_schema.RANK], explicit[_schema.WORLD_SIZE]) == (2, 4)
    assert explicit[_schema.LOCAL_RANK] == 0


def test_identity_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    single = _sent_resource(rank=None, world_size=None)
    assert (single[_schema.RANK], single[_schema.WORLD_SIZE]) == (0, 1)
    assert _schema.LOCAL_RANK not in single
    with pytest.raises(ConfigError, match="TORCHELASTIC_RUN_ID"):
        _monitor(job_id=None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv-id
    with pytest.raises(ConfigError, match="TORCHELASTIC_RUN_ID"):
        _monitor(job_id=None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="RANK"):
        _monitor(rank=None, world_size=None)
    monkeypatch.setenv("RANK", "four")
    with pytest.raises(ConfigError, match="RANK"):
        _monitor(rank=None, world_size=None)


# ---------------------------------------------------------------- OTEL_SDK_DISABLED
def test_sdk_disabled_is_a_no_op_that_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "TRUE")  # case-insensitive
    exporter = InMemoryExporter()
    monitor = StepMonitor(job_id="", rank=-3, world_size=0, exporter=exporter, buffer_steps=0)
    for _ in range(3):
        with monitor.step(), monitor.phase("forward"), monitor.phase(""):
            pass
    assert monitor.export_now() is False
    hooks = monitor.instrument(object(), object())
    hooks.remove()
    monitor.close()
    assert exporter.exported == []
    assert monitor.stats.steps_recorded == 0 and monitor.stats.windows_built == 0
    assert monitor.exporter_config is None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    with pytest.raises(ConfigError):
        StepMonitor(job_id="", rank=0, world_size=1, exporter=exporter)


def test_sdk_disabled_other_values_are_false_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "yes")
    monitor, exporter = _monitor()
    with monitor.step():
        pass
    assert monitor.export_now()
    monitor.close()
    assert len(exporter.exported) >= 1
    assert any("OTEL_SDK_DISABLED" in message for message in _warnings(caplog))


# ---------------------------------------------------------------- resource
def test_service_name_wins_over_resource_attributes_and_loses_to_the_argument(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _sent_resource()[_schema.SERVICE_NAME] == "stepwatch"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes")
    assert _sent_resource()[_schema.SERVICE_NAME] == "from-attributes"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer")
    assert _sent_resource()[_schema.SERVICE_NAME] == "trainer"
    assert _sent_resource(service_name="explicit")[_schema.SERVICE_NAME] == "explicit"


def test_resource_attributes_are_parsed_and_merged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        " deployment.environment = prod%20eu ,team=ml%2Cinfra,host.name=node-9,"
        "stepwatch.rank=7,k8s.pod.name=p%3D1",
    )
    sent = _sent_resource(host_name=None)
    assert sent["deployment.environment"] == "prod eu"  # trimmed, percent-decoded
    assert sent["team"] == "ml,infra"
    assert sent["k8s.pod.name"] == "p=1"
    assert sent[_schema.HOST_NAME] == "node-9"  # used when host_name is not given
    assert sent[_schema.RANK] == 0  # stepwatch.* from the environment never override
    assert any("stepwatch.rank" in message for message in _warnings(caplog))
    assert _sent_resource(host_name="given")[_schema.HOST_NAME] == "given"


@pytest.mark.parametrize("bad", ["a=1,novalue", "=1", "a=%zz", "a=%e9"])
def test_a_bad_resource_attributes_value_is_discarded_whole(
    bad: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError):
        parse_resource_attributes(bad)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", bad)
    sent = _sent_resource()
    assert "a" not in sent  # the valid member before the bad one is discarded too
    warnings = [m for m in _warnings(caplog) if "OTEL_RESOURCE_ATTRIBUTES" in m]
    assert len(warnings) == 1


def test_service_instance_id_is_a_uuid4_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _sent_resource()["service.instance.id"]
    assert uuid.UUID(first).version == 4
    assert _sent_resource()["service.instance.id"] == first  # one per process
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from stepwatch.exporters._sdk_env import instance_id; print(instance_id())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert uuid.UUID(child).version == 4 and child != first
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-3")
    assert _sent_resource()["service.instance.id"] == "pod-3"


# ---------------------------------------------------------------- exporter configuration
def _temporalities(exporter: InMemoryExporter) -> set[Any]:
    return {
        metric.data.aggregation_temporality
        for window in exporter.exported
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
        if hasattr(metric.data, "aggregation_temporality")
    }


def test_temporality_preference_cumulative_is_honoured_delta_and_lowmemory_stay_delta(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    def exported() -> set[Any]:
        monitor, exporter = _monitor()
        with monitor.step(), monitor.phase("forward"):
            pass
        assert monitor.export_now()
        monitor.close()
        return _temporalities(exporter)

    assert exported() == {AggregationTemporality.DELTA}  # unset: delta (docs/exporters.md)
    for value in ("delta", "lowmemory", "LowMemory", " DELTA "):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", value)
        assert exported() == {AggregationTemporality.DELTA}, value
    for value in ("cumulative", "Cumulative"):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", value)
        assert exported() == {AggregationTemporality.CUMULATIVE}, value
    assert not _warnings(caplog)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "sometimes")
    assert exported() == {AggregationTemporality.DELTA}  # unknown: warned, treated as unset
    (warning,) = _warnings(caplog)
    assert "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE" in warning and "sometimes" in warning


def test_metrics_endpoint_variable_is_used_as_is() -> None:
    environ = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4318"}
    assert resolve_exporter_config(environ=environ).endpoint == "http://collector:4318"
    generic = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert resolve_exporter_config(environ=generic).endpoint == "http://collector:4318/v1/metrics"


def test_grpc_endpoint_without_scheme_is_accepted() -> None:
    config = resolve_exporter_config(protocol="grpc", endpoint="collector:4317", environ={})
    assert config.endpoint == "https://collector:4317"  # TLS unless insecure
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    assert resolve_exporter_config(environ=environ).endpoint == "https://collector:4317"
    with pytest.raises(ConfigError, match="endpoint"):  # OTLP/HTTP needs a URL
        resolve_exporter_config(endpoint="collector:4318", environ={})


def test_insecure_means_plaintext_for_a_scheme_less_grpc_endpoint() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    generic = resolve_exporter_config(environ={**base, "OTEL_EXPORTER_OTLP_INSECURE": "true"})
    assert generic.endpoint == "http://collector:4317"
    both = {
        **base,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_EXPORTER_OTLP_METRICS_INSECURE": "false",
    }
    assert resolve_exporter_config(environ=both).endpoint == "https://collector:4317"
    with_scheme = {**base, "OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317"}
    with_scheme["OTEL_EXPORTER_OTLP_INSECURE"] = "true"  # a scheme says it all: ignored
    assert resolve_exporter_config(environ=with_scheme).endpoint == "https://c:4317"


def test_http_json_falls_back_to_http_protobuf_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    monitor = StepMonitor(job_id="j", rank=0, world_size=1, start=False, health=False)
    monitor.close(timeout_s=0.1)
    assert monitor.exporter_config is not None
    assert monitor.exporter_config.protocol == "http/protobuf"
    assert monitor.exporter_config.endpoint == "http://localhost:4318/v1/metrics"
    warnings = [m for m in _warnings(caplog) if "http/json" in m]
    assert len(warnings) == 1 and "OTEL_EXPORTER_OTLP_PROTOCOL" in warnings[0]
