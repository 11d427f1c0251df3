"""The ingest path both receivers share: authorise, convert, guard, queue one request.

A receiver decodes a request and hands it to :meth:`Intake.ingest`; the :class:`Outcome` says
whether it was accepted (the receiver answers 200 / OK, with ``partial_success`` counting the
points refused) or not: 429 / RESOURCE_EXHAUSTED (queue or spool full, new series too fast)
or 503 / UNAVAILABLE (the bridge cannot store durably now); both are retryable and the
producer keeps the data. Whatever decides what is accepted, and so what "accepted" promises,
lives here: an accepted request's points are in the spool (on disk, fsync'd, with a disk
spool) before :meth:`Intake.ingest` returns. Delivery is the forwarder's.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge import _fast
from stepwatch.otel_bridge._cardinality import CardinalityGuard
from stepwatch.otel_bridge._convert import convert_to_points
from stepwatch.otel_bridge._cumulative import CumulativeState, Pending
from stepwatch.otel_bridge._fields import LAYOUT_COMPACT, LAYOUTS
from stepwatch.otel_bridge._forwarder import Admission, Forwarder
from stepwatch.otel_bridge._identity import RankIdentityGuard, Verdict
from stepwatch.otel_bridge._metrics import BridgeMetrics
from stepwatch.otel_bridge._reasons import REASON_CARDINALITY, REASON_DUPLICATE_RANK

if TYPE_CHECKING:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
        ExportMetricsServiceResponse,
    )

_log = logging.getLogger("stepwatch.otel_bridge")
_SERIES_RATE = Admission(False, False, "too many new series, retry later", "series_rate")


class Outcome(NamedTuple):
    """What ingesting one request did."""

    accepted: bool  # False: refused, retry later (429, or 503 when ``unavailable``)
    rejected_points: int
    message: str
    unavailable: bool = False  # refused because the bridge cannot store now (503/UNAVAILABLE)

    def response_bytes(self) -> bytes:
        """:meth:`response` serialized; a full success is the empty message, ``b""``."""
        if not self.rejected_points:
            return b""
        return bytes(self.response().SerializeToString())

    def response(self) -> ExportMetricsServiceResponse:
        """The OTLP answer to an accepted request (``partial_success`` when points were refused)."""
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceResponse,
        )

        response = ExportMetricsServiceResponse()
        if self.rejected_points:
            response.partial_success.rejected_data_points = self.rejected_points
            response.partial_success.error_message = self.message
        return response


class ReceiverContext(NamedTuple):
    """What the OTLP/gRPC and OTLP/HTTP receivers share."""

    intake: Intake  # where decoded requests go
    metrics: BridgeMetrics  # requests{protocol, code}; the HTTP receiver also serves /metrics
    max_request_bytes: int  # largest body or message, also after decompression
    retry_after_s: int  # the Retry-After / RetryInfo delay under backpressure
    reuse_port: bool  # SO_REUSEPORT, so several bridge processes share the ports


class ClockSkew(NamedTuple):
    """How far a point's ``time_unix_nano`` may lie from the receive time (None: any)."""

    max_past_s: float | None
    max_future_s: float | None

    def bounds_unix_nano(self, now_unix_nano: int) -> tuple[int, int] | None:
        """The accepted ``(earliest, latest)`` around ``now_unix_nano``; None: no bound."""
        if self.max_future_s is None and self.max_past_s is None:
            return None
        earliest = 0 if self.max_past_s is None else now_unix_nano - int(self.max_past_s * 1e9)
        latest = (
            2**64 if self.max_future_s is None else now_unix_nano + int(self.max_future_s * 1e9)
        )
        return earliest, latest


class Intake:
    """Admits decoded requests into the forwarder's queue, all of a request's points or none.

    Args:
        forwarder: the queue accepted lines go to.
        metrics: the bridge's metrics (received, rejected, dropped attributes, conflicts).
        guard: the cardinality guard; None: no guard.
        identity: the duplicate-rank guard; None: no guard.
        tag_allowlist: attribute keys stored as tags.
        max_duration_s: duration histograms whose max or mean exceed this are rejected.
        skew: points further from the receive time are rejected (``clock_skew``).
        auth_token: when set, requests must carry ``Authorization: Bearer <token>``.
        clock_unix_nano: the receive-time clock.
        cumulative: the per-series state turning CUMULATIVE points into deltas; advanced only
            when a request is accepted. None: a fresh one.
        histogram_layout: ``compact`` or ``per_bound`` (docs/storage.md, "Histogram layouts").
        fast_path: convert request bodies with the C fast path when it is available
            (:meth:`ingest_body`); False: always the Python path.

    Each is documented, with its default, on :class:`~stepwatch.otel_bridge.Bridge`.
    """

    def __init__(
        self,
        forwarder: Forwarder,
        *,
        metrics: BridgeMetrics,
        guard: CardinalityGuard | None,
        identity: RankIdentityGuard | None,
        tag_allowlist: frozenset[str],
        max_duration_s: float | None,
        skew: ClockSkew,
        auth_token: str | None,
        clock_unix_nano: Callable[[], int],
        cumulative: CumulativeState | None = None,
        histogram_layout: str = LAYOUT_COMPACT,
        fast_path: bool = True,
    ) -> None:
        if histogram_layout not in LAYOUTS:
            raise ConfigError(f"histogram_layout: {histogram_layout!r} is not one of {LAYOUTS}")
        if auth_token is not None and not auth_token.strip():
            raise ConfigError("auth_token: must not be empty")
        for name, bound in (
            ("max_future_skew_s", skew.max_future_s),
            ("max_past_skew_s", skew.max_past_s),
            ("max_duration_s", max_duration_s),
        ):
            if bound is not None and not bound > 0:
                raise ConfigError(f"{name}: must be positive or None, got {bound}")
        self.forwarder = forwarder
        self.metrics = metrics
        self.guard = guard
        if guard is not None:  # read at a scrape, not set per request
            metrics.series.set_function(lambda: len(guard))
        self.identity = identity
        self.tag_allowlist = frozenset(tag_allowlist)
        self.max_duration_s = max_duration_s
        self.skew = skew
        self.clock_unix_nano = clock_unix_nano
        self.cumulative = cumulative if cumulative is not None else CumulativeState()
        self.histogram_layout = histogram_layout
        self.fast_path = fast_path and _fast.AVAILABLE
        self._logged_conflicts: set[tuple[str, str]] = set()
        self._auth = None if auth_token is None else f"Bearer {auth_token.strip()}".encode()

    def authorized(self, header: str | bytes | None) -> bool:
        """The ``Authorization`` header (or gRPC metadata) matches the token, if one is set."""
        if self._auth is None:
            return True
        if header is None:
            return False
        value = header.encode("latin-1", "replace") if isinstance(header, str) else header
        return hmac.compare_digest(value.strip(), self._auth)

    def ingest(self, request: ExportMetricsServiceRequest) -> Outcome:
        """Convert, guard and spool one request; returns once it is accepted or refused."""
        refusal = self.forwarder.refusal()
        if refusal is not None:  # refuse before spending CPU on a request we cannot take
            return self._refused(refusal)
        now_unix_nano = self.clock_unix_nano()
        batch = convert_to_points(
            request,
            tag_allowlist=self.tag_allowlist,
            max_duration_s=self.max_duration_s,
            time_bounds_unix_nano=self.skew.bounds_unix_nano(now_unix_nano),
            resource_check=None if self.identity is None else self._identity_check(now_unix_nano),
            cumulative=self.cumulative,
            histogram_layout=self.histogram_layout,
        )
        points = batch.points
        rejected = batch.rejected
        if self.guard is not None and points:
            guarded = self.guard.filter(points)
            if guarded.throttled:
                return self._refused(_SERIES_RATE)
            points = guarded.points
            if guarded.refused:
                rejected[REASON_CARDINALITY] += guarded.refused
        lines = [point.encode() for point in points]
        return self._admit(lines, rejected, batch.dropped_attributes, batch.pending)

    def ingest_body(self, body: bytes) -> Outcome | None:
        """:meth:`ingest` of a serialized request (protobuf, decompressed) on the fast path:
        the C converter (``_fast``), the same guards, spool and metrics, the same outcome.

        Returns None when the fast path does not handle the request (it is off, the layout is
        not compact, the forwarder refuses requests now, or the converter declines this one):
        the caller parses the body and calls :meth:`ingest`, exactly as without a fast path.
        """
        if not self.fast_path or self.histogram_layout != LAYOUT_COMPACT:
            return None
        if self.forwarder.refusal() is not None:
            return None  # refused by ingest() after the body is parsed, as it always was
        now_unix_nano = self.clock_unix_nano()
        batch = _fast.convert(
            body,
            tag_allowlist=self.tag_allowlist,
            max_duration_s=self.max_duration_s,
            time_bounds_unix_nano=self.skew.bounds_unix_nano(now_unix_nano),
            resource_check=None if self.identity is None else self._identity_check(now_unix_nano),
        )
        if batch is None:
            return None
        lines = batch.lines
        rejected = dict(batch.rejected)
        if self.guard is not None and lines:
            refused, throttled = self.guard.filter_hashed(
                batch.hashes, batch.descs_index, batch.descs
            )
            if throttled:
                return self._refused(_SERIES_RATE)
            if refused:
                skip = set(refused)
                lines = [line for index, line in enumerate(lines) if index not in skip]
                rejected[REASON_CARDINALITY] = rejected.get(REASON_CARDINALITY, 0) + len(refused)
        return self._admit(lines, rejected, batch.dropped_attributes, [])

    def _admit(
        self,
        lines: list[str],
        rejected: Mapping[str, int],
        dropped_attributes: int,
        pending: list[Pending],
    ) -> Outcome:
        """Spool a converted request's lines (all or none), then count it."""
        admission = self.forwarder.offer(lines)
        if not admission.accepted:
            return self._refused(admission)  # the cumulative state stays: the retry diffs alike
        if pending:
            self.cumulative.commit(pending)
            self.metrics.cumulative_series.set(len(self.cumulative))
        total_rejected = sum(rejected.values())
        self.metrics.received.inc(len(lines) + total_rejected)
        for reason, count in rejected.items():
            self.metrics.rejected.labels(reason=reason).inc(count)
        if dropped_attributes:
            self.metrics.attributes_dropped.inc(dropped_attributes)
        message = ""
        if total_rejected:
            message = "rejected data points: " + ", ".join(
                f"{reason}={count}" for reason, count in sorted(rejected.items())
            )
        return Outcome(True, total_rejected, message)

    def _refused(self, admission: Admission) -> Outcome:
        self.metrics.refused.labels(reason=admission.reason).inc()
        return Outcome(False, 0, admission.message, admission.unavailable)

    def _identity_check(self, now_unix_nano: int) -> Callable[[Mapping[str, str]], str | None]:
        guard = self.identity
        if guard is None:  # pragma: no cover - only called with a guard
            raise RuntimeError("no duplicate-rank guard")

        def check(attributes: Mapping[str, str]) -> str | None:
            verdict = guard.observe(attributes, now_unix_nano=now_unix_nano)
            if verdict is Verdict.TAKEOVER:
                self.metrics.rank_conflicts.labels(outcome="taken_over").inc()
                return None
            if verdict is not Verdict.CONFLICT:
                return None
            self.metrics.rank_conflicts.labels(outcome="rejected").inc()
            key = (attributes.get(_schema.JOB_ID, ""), attributes.get(_schema.RANK, ""))
            if key not in self._logged_conflicts:  # once per (job, rank): exporters repeat
                if len(self._logged_conflicts) >= 4096:
                    self._logged_conflicts.clear()
                self._logged_conflicts.add(key)
                _log.warning(
                    "duplicate rank: job %s rank %s claimed by %s while %s is live; rejected",
                    key[0],
                    key[1],
                    "/".join(attributes.get(name, "") for name in guard.identity_keys).rstrip("/"),
                    "/".join(guard.owner(*key) or ()).rstrip("/"),
                )
            return REASON_DUPLICATE_RANK

        return check
