"""Findings as Alertmanager alerts (``POST /api/v2/alerts``).

Alertmanager's client contract (https://prometheus.io/docs/alerting/latest/clients/): a client
re-sends every alert that still holds, periodically, with ``endsAt`` in the future; when the
condition clears it sends the alert once more with ``endsAt`` set to when it ended. Alerts are
identified by their label set, so re-sending the same finding never duplicates it: the
``finding`` label (``Diagnosis.finding_id``) makes every finding its own alert.

``startsAt`` of an open finding is when this sink first sent it (Prometheus's convention: the
time the alert fired), not when the condition began; that time is in the description. The
reason is grouping: Alertmanager flushes a new group at once when its first alert's
``startsAt + group_wait`` is already past, so back-dated alerts posted together reach the
receiver split over notifications ``group_interval`` apart (5 min by default). With the
firing time, ``group_wait`` holds and all findings of one pass arrive in one notification.
API: https://github.com/prometheus/alertmanager/blob/main/api/v2/openapi.yaml

Labels follow Prometheus's conventions (https://prometheus.io/docs/practices/alerting/ and the
monitoring-mixins' ``severity`` of ``critical``/``warning``/``info``): every label holds one
value a route can match exactly, and none reuses a label Prometheus gives a meaning. ``job`` is
Prometheus's scrape-job label (the bridge's own alerts carry ``job="stepwatch-bridge"``), so
the training run is ``training_job``. A finding that blames one rank (one host) has a ``rank``
(``host``) label; one that blames several has none, and the full lists are the ``ranks`` and
``hosts`` annotations. One alert per finding, not per rank: the finding is what opens, is
re-sent and resolves, and a job-wide finding over 64 ranks would otherwise page 64 times.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from stepwatch.core import settings
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._errors import ConfigError
from stepwatch.core._http import HttpClient, HttpTransport, check_base_url, send_json

logger = logging.getLogger(__name__)

ALERTNAME = "StepwatchFinding"


def rfc3339(time_unix_nano: int) -> str:
    """RFC 3339 UTC with millisecond precision, as Alertmanager's API takes times."""
    moment = datetime.fromtimestamp(time_unix_nano / 1e9, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def finding_labels(finding: Diagnosis) -> dict[str, str]:
    """Alert labels, one value each: what routes and groups it; ``finding`` makes the identity.

    ``rank`` and ``host`` only when the finding blames exactly one (the lists are annotations).
    """
    labels = {
        "alertname": ALERTNAME,
        "severity": finding.severity,  # info, warning or critical (Diagnosis checks it)
        "training_job": finding.job,
        "kind": finding.kind,
        "finding": finding.finding_id,
    }
    if len(finding.ranks) == 1:
        labels["rank"] = str(finding.ranks[0])
    if len(finding.hosts) == 1:
        labels["host"] = finding.hosts[0]
    if finding.phase:
        labels["phase"] = finding.phase
    if finding.kernel_class:
        labels["kernel_class"] = finding.kernel_class
    return labels


def cost_text(finding: Diagnosis) -> str:
    """``~1.27x the job's step time``, or ``not estimated`` (a kind without a cost model,
    or a finding stored before findings carried their cost)."""
    if finding.slowdown > 1.0:
        return f"~{finding.slowdown:.2f}x the job's step time"
    return "not estimated"


def describe(finding: Diagnosis) -> str:
    """A few lines of plain text: what, where, what it costs, since when, how sure."""
    lines = [
        f"{finding.kind.replace('_', ' ')} in job {finding.job} ({finding.severity}, "
        f"score {finding.score:.2f})",
        f"where: {finding.location}",
        f"cost: {cost_text(finding)}",
        f"since: {rfc3339(finding.start_unix_nano)}",
    ]
    if finding.end_unix_nano is not None:
        lines.append(f"ended: {rfc3339(finding.end_unix_nano)}")
    return "\n".join(lines)


def dashboard_link(
    base_url: str, finding: Diagnosis, *, now_unix_nano: int, margin_s: float = 900.0
) -> str:
    """``base_url`` with Grafana's ``var-job``/``from``/``to`` query set around the finding."""
    start_ms = finding.start_unix_nano // 1_000_000 - int(margin_s * 1000)
    end_unix_nano = finding.end_unix_nano if finding.end_unix_nano is not None else now_unix_nano
    end_ms = end_unix_nano // 1_000_000 + int(margin_s * 1000)
    params = [("var-job", finding.job), ("from", str(start_ms)), ("to", str(end_ms))]
    params += [("var-rank", str(rank)) for rank in finding.ranks]
    separator = "&" if "?" in base_url else "?"
    return base_url + separator + urllib.parse.urlencode(params)


@dataclasses.dataclass
class _Sent:
    at_monotonic_s: float
    resolved: bool
    starts_unix_nano: int


class AlertmanagerSink:
    """Publishes findings to Alertmanager's v2 API, one alert per finding.

    Open findings are (re-)sent at most every ``resend_interval_s`` with
    ``endsAt = now + 4 × resend_interval_s``, so Alertmanager resolves them by itself if the
    detector dies; a finding that closed is sent once more with ``endsAt`` = its end.
    Publishing the same findings again is idempotent (Alertmanager merges by label set).

    Args:
        url: Alertmanager base URL, e.g. ``http://alertmanager:9093``.
        dashboard_url: a Grafana dashboard URL; each alert links to it with the job and the
            finding's time range filled in (``annotations.dashboard_url``).
        timeout_s: per-request timeout.
        transport: the HTTP transport (default: stepwatch's ``HttpClient``).
        resend_interval_s: how often an open finding is re-sent.
        clock: wall clock in Unix nanoseconds (default ``time.time_ns``).
        monotonic: monotonic clock in seconds for the resend schedule.

    Raises:
        ConfigError: a bad URL or a non-positive interval (names the argument), or an
            unusable proxy setting for the URL.
    """

    def __init__(
        self,
        url: str,
        *,
        dashboard_url: str | None = None,
        timeout_s: float = 5.0,
        transport: HttpTransport | None = None,
        resend_interval_s: float = 60.0,
        clock: Callable[[], int] | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self.url = check_base_url(url, "url")
        self.dashboard_url = (
            None if dashboard_url is None else check_base_url(dashboard_url, "dashboard_url")
        )
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be positive, got {timeout_s}")
        if resend_interval_s <= 0:
            raise ConfigError(f"resend_interval_s: must be positive, got {resend_interval_s}")
        self.timeout_s = timeout_s
        self.resend_interval_s = resend_interval_s
        if transport is None:
            transport = HttpClient()
            transport.check(self.url)
        self._transport = transport
        self._clock = clock or time.time_ns
        self._monotonic = monotonic or time.monotonic
        self._sent: dict[str, _Sent] = {}

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str],
        *,
        url: str | None = None,
        dashboard_url: str | None = None,
        transport: HttpTransport | None = None,
    ) -> AlertmanagerSink | None:
        """The sink configured by ``settings.ALERTMANAGER_URL`` (None when unset).

        ``settings.DASHBOARD_URL`` (optional) is the Grafana dashboard alerts link to. An
        argument given here wins over its variable.
        """
        url = settings.ALERTMANAGER_URL.resolve(url, environ)
        if not url:
            return None
        dashboard_url = settings.DASHBOARD_URL.resolve(dashboard_url, environ)
        return cls(url, dashboard_url=dashboard_url, transport=transport)

    def alert(
        self, finding: Diagnosis, *, now_unix_nano: int, starts_unix_nano: int | None = None
    ) -> dict[str, Any]:
        """The ``postableAlert`` object for ``finding``.

        ``starts_unix_nano`` is the alert's ``startsAt`` (default: the finding's start);
        ``publish`` passes the time the finding first fired.
        """
        starts = finding.start_unix_nano if starts_unix_nano is None else starts_unix_nano
        if finding.end_unix_nano is None:
            ends = now_unix_nano + int(4 * self.resend_interval_s * 1e9)
        else:
            ends = finding.end_unix_nano
        # The cost is an annotation, never a label: labels identify the alert, and the cost
        # of an open finding moves from pass to pass.
        annotations = {
            "summary": finding.summary,
            "description": describe(finding),
            "slowdown": f"{finding.slowdown:.2f}",
        }
        if finding.ranks:
            annotations["ranks"] = ",".join(str(rank) for rank in finding.ranks)
        if finding.hosts:
            annotations["hosts"] = ",".join(finding.hosts)
        alert: dict[str, Any] = {
            "labels": finding_labels(finding),
            "annotations": annotations,
            "startsAt": rfc3339(starts),
            "endsAt": rfc3339(max(ends, starts)),
        }
        if self.dashboard_url is not None:
            link = dashboard_link(self.dashboard_url, finding, now_unix_nano=now_unix_nano)
            annotations["dashboard_url"] = link
            alert["generatorURL"] = link
        return alert

    def publish(self, findings: Sequence[Diagnosis]) -> None:
        """Send what is new, changed, or due for a resend; one request for all of them.

        Raises:
            DeliveryError: Alertmanager unreachable or refused; nothing is recorded as sent,
                so the next call retries.
        """
        now_unix_nano = self._clock()
        now_s = self._monotonic()
        due = [finding for finding in findings if self._is_due(finding, now_s=now_s)]
        if due:
            starts = [self._starts_at(finding, now_unix_nano=now_unix_nano) for finding in due]
            payload = [
                self.alert(finding, now_unix_nano=now_unix_nano, starts_unix_nano=start)
                for finding, start in zip(due, starts, strict=True)
            ]
            send_json(
                self._transport,
                "POST",
                f"{self.url}/api/v2/alerts",
                payload,
                timeout_s=self.timeout_s,
            )
            for finding, start in zip(due, starts, strict=True):
                resolved = finding.end_unix_nano is not None
                self._sent[finding.finding_id] = _Sent(now_s, resolved, start)
            logger.debug("alertmanager: sent %d alerts", len(due))
        self._forget_old(now_s)

    def _starts_at(self, finding: Diagnosis, *, now_unix_nano: int) -> int:
        """When the finding first fired here: kept across resends and its resolution.

        A finding already closed when first seen never fired; it keeps its own start.
        """
        sent = self._sent.get(finding.finding_id)
        if sent is not None:
            return sent.starts_unix_nano
        if finding.end_unix_nano is not None:
            return finding.start_unix_nano
        return max(now_unix_nano, finding.start_unix_nano)

    def _is_due(self, finding: Diagnosis, *, now_s: float) -> bool:
        """New, changed state (open → resolved), or open and not sent for a resend interval."""
        resolved = finding.end_unix_nano is not None
        sent = self._sent.get(finding.finding_id)
        if sent is None or sent.resolved != resolved:
            return True
        return not resolved and now_s - sent.at_monotonic_s >= self.resend_interval_s

    def _forget_old(self, now_s: float) -> None:
        # A resolved alert needs no resend; forget it after a day to bound memory.
        horizon_s = max(86_400.0, 10 * self.resend_interval_s)
        stale = [
            key
            for key, sent in self._sent.items()
            if sent.resolved and now_s - sent.at_monotonic_s > horizon_s
        ]
        for key in stale:
            del self._sent[key]
