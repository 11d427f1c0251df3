"""The documented Collector configuration works as written against the bridge's defaults.

No Collector binary is available here, so the test reads the YAML block of docs/deployment.md's
"Through a site's OpenTelemetry Collector" section and checks what a Collector would do with
it: an ``otlp`` receiver feeding a ``metrics`` pipeline whose ``otlphttp`` exporter points at
the bridge's default OTLP/HTTP port; the ``otlphttp`` exporter POSTs to ``endpoint`` +
``/v1/metrics`` (its documented default path) with gzip, which the test then does against a
real bridge (the configured port swapped for the test's free one).
"""

from __future__ import annotations

import gzip
import re
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)

from stepwatch.core import settings
from stepwatch.otel_bridge import Bridge
from tests.otel_bridge.otlp_requests import RecordingWriter, window_request

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
SECTION = "## Through a site's OpenTelemetry Collector"
OTLPHTTP_METRICS_PATH = "/v1/metrics"  # otlphttp exporter: endpoint + "/v1/metrics"


def collector_config() -> dict[str, Any]:
    text = DOC.read_text()
    assert SECTION in text, "docs/deployment.md lost its Collector section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    config = yaml.safe_load(blocks[0])
    assert isinstance(config, dict)
    return config


def test_the_readme_collector_config_is_complete_and_points_at_the_bridge() -> None:
    config = collector_config()
    pipeline = config["service"]["pipelines"]["metrics"]
    for kind in ("receivers", "processors", "exporters"):
        for name in pipeline.get(kind, []):
            assert name in config[kind], f"{kind} {name} used but not defined"
    assert pipeline["receivers"] == ["otlp"]
    protocols = config["receivers"]["otlp"]["protocols"]
    assert set(protocols) == {"grpc", "http"}
    # ranks export to the Collector where stepwatch's exporter sends by default
    assert protocols["http"]["endpoint"].endswith(":4318")
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert "localhost:4318" in settings.OTLP_ENDPOINT.help
    (exporter,) = pipeline["exporters"]
    assert exporter.split("/")[0] == "otlphttp"
    options = config["exporters"][exporter]
    url = urllib.parse.urlsplit(options["endpoint"])
    assert url.scheme == "http" and url.path in ("", "/")
    assert url.port == settings.BRIDGE_HTTP_PORT.default == 4318
    assert options.get("compression", "gzip") == "gzip"


def test_what_the_configured_exporter_sends_is_accepted_by_a_bridge() -> None:
    options = collector_config()["exporters"]["otlphttp/stepwatch"]
    writer = RecordingWriter()
    with Bridge(writer, grpc_port=None, flush_interval_s=0.01) as bridge:
        configured = urllib.parse.urlsplit(options["endpoint"])
        endpoint = configured._replace(netloc=f"127.0.0.1:{bridge.http_port}").geturl()
        body = window_request(job="via-collector", rank=1, world_size=4, window=0)
        request = urllib.request.Request(
            endpoint.rstrip("/") + OTLPHTTP_METRICS_PATH,
            data=gzip.compress(body.SerializeToString()),
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            answer = ExportMetricsServiceResponse.FromString(response.read())
        assert answer.partial_success.rejected_data_points == 0
    stored = [line for batch in writer.batches for line in batch]
    assert stored and all("stepwatch.job.id=via-collector" in line for line in stored)
