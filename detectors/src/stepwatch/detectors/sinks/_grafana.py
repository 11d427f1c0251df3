"""Findings as Grafana region annotations through Grafana's HTTP API.

API: https://grafana.com/docs/grafana/latest/developers/http_api/annotations/
(``POST /api/annotations`` → ``{"id": n}``; ``PATCH /api/annotations/:id`` updates only the
given fields; ``GET /api/annotations?tags=a&tags=b`` finds annotations carrying all tags;
times in epoch milliseconds; a service-account token goes in ``Authorization: Bearer``.)

Dashboards already show findings through an InfluxDB annotation query on
``stepwatch.diagnosis`` with no Grafana credentials; this sink is for sites that want them as
native Grafana annotations (searchable, visible on any dashboard, editable by people).

Never duplicating: the sink remembers ``finding_id → annotation id``. A restarted detector
finds the id again in InfluxDB (measurement ``stepwatch.grafana_annotation``, when a
``state_client`` is given) or, failing that, in Grafana itself by the ``finding:<id>`` tag.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stepwatch.core import settings
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._errors import ConfigError, DeliveryError, InfluxError
from stepwatch.core._http import HttpClient, HttpTransport, check_base_url, send_json
from stepwatch.core._influx import InfluxClient, quote_ident, quote_literal
from stepwatch.core._lineproto import encode_point
from stepwatch.detectors.sinks._alertmanager import describe

logger = logging.getLogger(__name__)

STATE_MEASUREMENT = "stepwatch.grafana_annotation"


def annotation_tags(finding: Diagnosis) -> list[str]:
    """Tags: a fixed ``stepwatch`` tag, then kind, job, severity, ranks, hosts, identity."""
    tags = [
        "stepwatch",
        f"kind:{finding.kind}",
        f"job:{finding.job}",
        f"severity:{finding.severity}",
    ]
    tags += [f"rank:{rank}" for rank in finding.ranks]
    tags += [f"host:{host}" for host in finding.hosts]
    tags.append(f"finding:{finding.finding_id}")
    return tags


@dataclasses.dataclass
class _Known:
    annotation_id: int
    closed: bool
    patched_at_monotonic_s: float


class GrafanaAnnotationSink:
    """Publishes each finding as one region annotation, updated while open, closed once.

    An open finding spans ``[start, now]`` and its end is moved forward at most every
    ``update_interval_s``; when the finding ends, the region is patched to its real end and
    the text marked ended, then left alone.

    Args:
        url: Grafana base URL, e.g. ``http://grafana:3000``.
        token: a service-account token with ``annotations:write`` (Bearer).
        state_client: InfluxDB client where ``finding_id → annotation id`` is persisted, so a
            restarted detector does not post again. Without it the sink asks Grafana by tag.
        dashboard_uid: attach annotations to this dashboard (organisation-wide when None).
        timeout_s: per-request timeout.
        transport: the HTTP transport (default: stepwatch's ``HttpClient``).
        update_interval_s: how often an open finding's region end is moved forward.
        clock: wall clock in Unix nanoseconds. monotonic: seconds, for the update schedule.

    Raises:
        ConfigError: a bad URL, empty token or non-positive interval (names the argument).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        state_client: InfluxClient | None = None,
        dashboard_uid: str | None = None,
        timeout_s: float = 5.0,
        transport: HttpTransport | None = None,
        update_interval_s: float = 60.0,
        clock: Callable[[], int] | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self.url = check_base_url(url, "url")
        if not token:
            raise ConfigError("token: a Grafana service-account token is required")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be positive, got {timeout_s}")
        if update_interval_s <= 0:
            raise ConfigError(f"update_interval_s: must be positive, got {update_interval_s}")
        self.dashboard_uid = dashboard_uid
        self.timeout_s = timeout_s
        self.update_interval_s = update_interval_s
        self._headers = {"Authorization": f"Bearer {token}"}
        self._state = state_client
        if transport is None:
            transport = HttpClient()
            transport.check(self.url)
        self._transport = transport
        self._clock = clock or time.time_ns
        self._monotonic = monotonic or time.monotonic
        self._known: dict[str, _Known] = {}

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str],
        *,
        url: str | None = None,
        state_client: InfluxClient | None = None,
        transport: HttpTransport | None = None,
    ) -> GrafanaAnnotationSink | None:
        """The sink configured by ``settings.GRAFANA_URL`` + ``GRAFANA_TOKEN`` (None: no URL).

        ``settings.GRAFANA_DASHBOARD_UID`` optionally ties annotations to a dashboard. A
        ``url`` given here wins over its variable.

        Raises:
            ConfigError: a URL without a token (names the missing variable).
        """
        url = settings.GRAFANA_URL.resolve(url, environ)
        if not url:
            return None
        token = settings.GRAFANA_TOKEN.resolve(None, environ)
        if not token:
            raise ConfigError(
                f"{' or '.join(settings.GRAFANA_TOKEN.variables)}: a Grafana service-account "
                "token is required with a Grafana URL"
            )
        return cls(
            url,
            token=token,
            state_client=state_client,
            dashboard_uid=settings.GRAFANA_DASHBOARD_UID.resolve(None, environ),
            transport=transport,
        )

    def __repr__(self) -> str:  # never show the token
        return f"GrafanaAnnotationSink(url={self.url!r})"

    def publish(self, findings: Sequence[Diagnosis]) -> None:
        """Create, extend or close one annotation per finding; never a duplicate.

        Raises:
            DeliveryError: Grafana unreachable or refused (e.g. 401 for a bad token). What
                succeeded before the failure is remembered; the rest is retried next call.
            InfluxError: the state database could not be read or written.
        """
        now_ms = self._clock() // 1_000_000
        for finding in findings:
            known = self._known.get(finding.finding_id) or self._recall(finding)
            if known is None:
                self._create(finding, now_ms=now_ms)
            elif not known.closed:
                self._update(finding, known, now_ms=now_ms)

    def _body(self, finding: Diagnosis, *, now_ms: int) -> dict[str, Any]:
        start_ms = finding.start_unix_nano // 1_000_000
        summary = f"<b>{html.escape(finding.summary)}</b>"
        if finding.end_unix_nano is None:
            end_ms = max(now_ms, start_ms)
        else:
            end_ms = max(finding.end_unix_nano // 1_000_000, start_ms)
            summary += " (ended)"
        details = html.escape(describe(finding)).replace("\n", "<br>")
        return {
            "time": start_ms,
            "timeEnd": end_ms,
            "tags": annotation_tags(finding),
            "text": f"{summary}<br>{details}",
        }

    def _create(self, finding: Diagnosis, *, now_ms: int) -> None:
        body = self._body(finding, now_ms=now_ms)
        if self.dashboard_uid is not None:
            body["dashboardUID"] = self.dashboard_uid
        response = send_json(
            self._transport,
            "POST",
            f"{self.url}/api/annotations",
            body,
            timeout_s=self.timeout_s,
            headers=self._headers,
        )
        reply = response.json()
        if not isinstance(reply, dict) or not isinstance(reply.get("id"), int):
            raise DeliveryError(f"POST {self.url}/api/annotations: no id in {reply!r}")
        known = _Known(reply["id"], finding.end_unix_nano is not None, self._monotonic())
        self._remember(finding, known)

    def _update(self, finding: Diagnosis, known: _Known, *, now_ms: int) -> None:
        closing = finding.end_unix_nano is not None
        due = self._monotonic() - known.patched_at_monotonic_s >= self.update_interval_s
        if not closing and not due:
            return
        try:
            send_json(
                self._transport,
                "PATCH",
                f"{self.url}/api/annotations/{known.annotation_id}",
                self._body(finding, now_ms=now_ms),
                timeout_s=self.timeout_s,
                headers=self._headers,
            )
        except DeliveryError as exc:
            if exc.status != 404:
                raise
            # Someone deleted it in Grafana: post it again rather than fail forever.
            logger.info("grafana: annotation %d is gone; posting again", known.annotation_id)
            self._create(finding, now_ms=now_ms)
            return
        self._remember(finding, _Known(known.annotation_id, closing, self._monotonic()))

    def _remember(self, finding: Diagnosis, known: _Known) -> None:
        self._known[finding.finding_id] = known
        if self._state is None:
            return
        # One point per finding at the finding's start: a rewrite overwrites it.
        line = encode_point(
            STATE_MEASUREMENT,
            {"finding": finding.finding_id, "stepwatch.job.id": finding.job},
            {"annotation_id": known.annotation_id, "closed": known.closed},
            finding.start_unix_nano,
        )
        self._state.write_lines([line])

    def _recall(self, finding: Diagnosis) -> _Known | None:
        """The annotation posted for ``finding`` by an earlier run, if any."""
        known = self._recall_from_state(finding) if self._state is not None else None
        if known is None:
            known = self._recall_from_grafana(finding)
        if known is not None:
            self._known[finding.finding_id] = known
        return known

    def _recall_from_state(self, finding: Diagnosis) -> _Known | None:
        client = self._state
        if client is None:
            return None
        try:
            series = client.query(
                f'SELECT "annotation_id", "closed" FROM {quote_ident(STATE_MEASUREMENT)} '
                f'WHERE "finding" = {quote_literal(finding.finding_id)}'
            )
        except InfluxError as exc:
            if "database not found" in str(exc):
                return None
            raise
        for item in series:
            for row in item.values:
                return _Known(int(row[1]), bool(row[2]), float("-inf"))
        return None

    def _recall_from_grafana(self, finding: Diagnosis) -> _Known | None:
        query = urllib.parse.urlencode(
            [("tags", f"finding:{finding.finding_id}"), ("type", "annotation"), ("limit", "10")]
        )
        response = send_json(
            self._transport,
            "GET",
            f"{self.url}/api/annotations?{query}",
            None,
            timeout_s=self.timeout_s,
            headers=self._headers,
        )
        found = response.json()
        if not isinstance(found, list) or not found:
            return None
        first = min(found, key=lambda item: int(item.get("id", 0)))
        closed = "(ended)" in str(first.get("text", ""))
        return _Known(int(first["id"]), closed, float("-inf"))
