"""AlertmanagerSink against a real Alertmanager with a webhook receiver, and its resend rule."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from stepwatch.core import ConfigError, Diagnosis, ManagedAlertmanager
from stepwatch.core._errors import DeliveryError
from stepwatch.core._http import HttpResponse
from stepwatch.detectors.sinks._alertmanager import AlertmanagerSink, rfc3339
from tests.detectors.conftest import WebhookReceiver


def finding(job: str, *, rank: int, start_s: float, end_s: float | None = None) -> Diagnosis:
    return Diagnosis(
        job=job,
        kind="compute_straggler",
        start_unix_nano=int(start_s * 1e9),
        end_unix_nano=None if end_s is None else int(end_s * 1e9),
        severity="critical",
        score=3.4,
        summary=f"rank {rank} backward compute 1.31x peers",
        ranks=(rank,),
        hosts=(f"node-{rank // 8}",),
        phase="backward",
        kernel_class="gemm",
    )


def test_delivered_grouped_and_resolved(
    alertmanager: ManagedAlertmanager, webhook: WebhookReceiver
) -> None:
    job = f"run-{uuid.uuid4().hex[:8]}"
    start_s = time.time() - 60
    sink = AlertmanagerSink(alertmanager.url, dashboard_url="http://grafana:3000/d/stepwatch-job")
    open_findings = [finding(job, rank=3, start_s=start_s), finding(job, rank=17, start_s=start_s)]
    sink.publish(open_findings)
    sink.publish(open_findings)  # idempotent: no duplicate alert

    def for_job(status: str) -> Any:
        return lambda p: p["groupLabels"].get("training_job") == job and p["status"] == status

    firing = webhook.wait_for(for_job("firing"), timeout_s=20)
    # Two findings of one job → one notification carrying both alerts. The findings began a
    # minute ago; had startsAt said so, Alertmanager would flush the group on the first alert
    # and the second would follow a group_interval later (a race this test once lost in CI).
    assert firing["groupLabels"] == {"alertname": "StepwatchFinding", "training_job": job}
    assert sorted(a["labels"]["rank"] for a in firing["alerts"]) == ["17", "3"]
    labels = firing["alerts"][0]["labels"]
    assert labels["kind"] == "compute_straggler"
    assert labels["severity"] == "critical"
    assert labels["finding"] in {f.finding_id for f in open_findings}
    annotations = firing["alerts"][0]["annotations"]
    assert annotations["summary"].startswith("rank ")
    assert "var-job=" + job in annotations["dashboard_url"]
    assert len(alertmanager.alerts({"training_job": job})) == 2
    assert "since: " + rfc3339(open_findings[0].start_unix_nano) in annotations["description"]

    end_s = time.time()
    closed = [dataclass_with_end(f, end_s) for f in open_findings]
    sink.publish(closed)
    resolved = webhook.wait_for(for_job("resolved"), timeout_s=20)
    assert len(resolved["alerts"]) == 2
    assert all(a["status"] == "resolved" for a in resolved["alerts"])
    ends = {a["endsAt"][:19] for a in resolved["alerts"]}
    assert ends == {time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(end_s)))}
    firing_for_job = [p for p in webhook.payloads if for_job("firing")(p)]
    assert len(firing_for_job) == 1, "re-publishing must not notify twice"


def test_labels_hold_one_value_each_and_route_one_rank(
    alertmanager: ManagedAlertmanager, webhook: WebhookReceiver
) -> None:
    """Issue 13: no ``job`` overload, ``rank``/``host`` only for one blamed rank/host."""
    import dataclasses

    job = f"run-{uuid.uuid4().hex[:8]}"
    one = finding(job, rank=9, start_s=time.time() - 30)
    several = dataclasses.replace(
        one, kind="workload_imbalance", severity="warning", ranks=(2, 9), hosts=("n-0", "n-1")
    )
    AlertmanagerSink(alertmanager.url).publish([one, several])
    firing = webhook.wait_for(
        lambda p: p["groupLabels"].get("training_job") == job and len(p["alerts"]) == 2,
        timeout_s=20,
    )
    by_kind = {alert["labels"]["kind"]: alert for alert in firing["alerts"]}
    single = by_kind["compute_straggler"]["labels"]
    assert (single["rank"], single["host"]) == ("9", "node-1")
    assert "job" not in single and single["training_job"] == job
    multi = by_kind["workload_imbalance"]
    assert "rank" not in multi["labels"] and "host" not in multi["labels"]
    assert multi["annotations"]["ranks"] == "2,9"
    assert multi["annotations"]["hosts"] == "n-0,n-1"
    for alert in firing["alerts"]:
        assert all("," not in value for value in alert["labels"].values())
        assert alert["labels"]["severity"] in ("critical", "warning", "info")
    # Alertmanager's own matcher finds the one-rank finding by its rank.
    matched = alertmanager.alerts({"training_job": job, "rank": "9"})
    assert [a["labels"]["kind"] for a in matched] == ["compute_straggler"]


def dataclass_with_end(item: Diagnosis, end_s: float) -> Diagnosis:
    import dataclasses

    return dataclasses.replace(item, end_unix_nano=int(end_s * 1e9))


class RecordingTransport:
    """A real HttpTransport that records requests and answers with a fixed status."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[tuple[str, str, Any]] = []

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_s: float,
    ) -> HttpResponse:
        del headers, timeout_s
        self.requests.append((method, url, json.loads(body) if body else None))
        return HttpResponse(self.status, b"{}")


class FakeClocks:
    def __init__(self) -> None:
        self.wall_ns = 1_800_000_000 * 10**9
        self.mono_s = 100.0

    def advance(self, seconds: float) -> None:
        self.wall_ns += int(seconds * 1e9)
        self.mono_s += seconds


def test_resend_schedule_and_ends_at() -> None:
    transport = RecordingTransport()
    clocks = FakeClocks()
    sink = AlertmanagerSink(
        "http://am:9093/",
        transport=transport,
        resend_interval_s=30,
        clock=lambda: clocks.wall_ns,
        monotonic=lambda: clocks.mono_s,
    )
    item = finding("j", rank=1, start_s=clocks.wall_ns / 1e9 - 10)
    sink.publish([item])
    assert len(transport.requests) == 1
    method, url, body = transport.requests[0]
    assert (method, url) == ("POST", "http://am:9093/api/v2/alerts")
    # endsAt = now + 4 × resend interval while the finding holds.
    assert body[0]["endsAt"] == "2027-01-15T08:02:00.000Z"
    clocks.advance(10)
    sink.publish([item])
    assert len(transport.requests) == 1, "not due yet"
    clocks.advance(25)
    sink.publish([item])
    assert len(transport.requests) == 2, "due for a resend"
    sink.publish([dataclass_with_end(item, clocks.wall_ns / 1e9)])
    assert len(transport.requests) == 3, "resolution sent at once"
    assert transport.requests[2][2][0]["endsAt"] == "2027-01-15T08:00:35.000Z"
    clocks.advance(1000)
    sink.publish([dataclass_with_end(item, clocks.wall_ns / 1e9 - 1000)])
    assert len(transport.requests) == 3, "a resolved alert is not re-sent"
    # startsAt is when the finding first fired, the same on every send, resolution included.
    fired = "2027-01-15T08:00:00.000Z"
    assert [request[2][0]["startsAt"] for request in transport.requests] == [fired] * 3


def test_starts_at_is_the_firing_time_unless_closed_when_first_seen() -> None:
    transport = RecordingTransport()
    clocks = FakeClocks()
    sink = AlertmanagerSink(
        "http://am:9093",
        transport=transport,
        clock=lambda: clocks.wall_ns,
        monotonic=lambda: clocks.mono_s,
    )
    began_s = clocks.wall_ns / 1e9 - 300
    closed = dataclass_with_end(finding("j", rank=1, start_s=began_s), began_s + 100)
    sink.publish([closed, finding("j", rank=2, start_s=began_s)])
    closed_alert, open_alert = transport.requests[0][2]
    # Never fired: keeps its own span, so Alertmanager records it as resolved.
    assert closed_alert["startsAt"] == rfc3339(int(began_s * 1e9))
    assert closed_alert["endsAt"] == rfc3339(int((began_s + 100) * 1e9))
    assert open_alert["startsAt"] == rfc3339(clocks.wall_ns)
    # A finding ending before its firing time (detection lag) still has endsAt >= startsAt.
    clocks.advance(5)
    late_end = dataclass_with_end(finding("j", rank=2, start_s=began_s), began_s + 1)
    sink.publish([late_end])
    resolved = transport.requests[1][2][0]
    assert resolved["endsAt"] == resolved["startsAt"] == open_alert["startsAt"]


def test_refusal_is_a_delivery_error_and_is_retried() -> None:
    transport = RecordingTransport(status=400)
    sink = AlertmanagerSink("http://am:9093", transport=transport)
    item = finding("j", rank=1, start_s=1_800_000_000)
    with pytest.raises(DeliveryError, match="400"):
        sink.publish([item])
    transport.status = 200
    sink.publish([item])
    assert len(transport.requests) == 2


def test_unreachable_is_a_delivery_error() -> None:
    from stepwatch.core._net import free_port

    sink = AlertmanagerSink(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(DeliveryError):
        sink.publish([finding("j", rank=1, start_s=1_800_000_000)])


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"url": "am:9093"}, "url"),
        ({"url": "http://am", "dashboard_url": "grafana"}, "dashboard_url"),
        ({"url": "http://am", "timeout_s": 0}, "timeout_s"),
        ({"url": "http://am", "resend_interval_s": -1}, "resend_interval_s"),
    ],
)
def test_config_errors_name_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    url = kwargs.pop("url")
    with pytest.raises(ConfigError, match=argument):
        AlertmanagerSink(url, **kwargs)


def test_from_environment() -> None:
    assert AlertmanagerSink.from_environment({}) is None
    sink = AlertmanagerSink.from_environment(
        {"STEPWATCH_ALERTMANAGER_URL": "http://am:9093", "STEPWATCH_DASHBOARD_URL": "http://g/d/x"}
    )
    assert sink is not None and sink.url == "http://am:9093"
    assert sink.dashboard_url == "http://g/d/x"
    plain = AlertmanagerSink.from_environment({"ALERTMANAGER_URL": "http://other:9093"})
    assert plain is not None and plain.url == "http://other:9093"
