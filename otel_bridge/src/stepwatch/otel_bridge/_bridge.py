"""The bridge: OTLP/gRPC and OTLP/HTTP receivers feeding one forwarder to InfluxDB.

Who does what: each receiver (``_grpc_receiver``, ``_http_receiver``) speaks its protocol and
hands decoded requests to the shared :class:`Intake` (authorise, convert, guard, queue); the
:class:`Forwarder` batches, writes, retries and spools. :class:`Bridge` builds them from one
set of arguments, starts and stops them in order, and says where they listen.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepwatch.core._errors import ConfigError
from stepwatch.otel_bridge import _fast
from stepwatch.otel_bridge._cardinality import CardinalityGuard
from stepwatch.otel_bridge._convert import MAX_DURATION_S, TAG_ALLOWLIST
from stepwatch.otel_bridge._cumulative import CumulativeState
from stepwatch.otel_bridge._fields import LAYOUT_COMPACT
from stepwatch.otel_bridge._forwarder import Forwarder
from stepwatch.otel_bridge._grpc_receiver import GrpcLimits, GrpcReceiver
from stepwatch.otel_bridge._http_receiver import HTTP_PATH, HttpReceiver
from stepwatch.otel_bridge._identity import RankIdentityGuard
from stepwatch.otel_bridge._intake import ClockSkew, Intake, Outcome, ReceiverContext
from stepwatch.otel_bridge._metrics import BridgeMetrics
from stepwatch.otel_bridge._spool import DiskSpool, MemorySpool, OverflowPolicy, Spool
from stepwatch.otel_bridge._writers import LineWriter

if TYPE_CHECKING:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

_log = logging.getLogger("stepwatch.otel_bridge")


def _read_secret(path: str | os.PathLike[str], argument: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{argument}: cannot read {path}: {exc}") from exc


class Bridge:
    """An in-process OTLP → InfluxDB bridge (gRPC and HTTP receivers, forwarder, /metrics).

    Args:
        writer: where batches go (:class:`InfluxV1Writer`, :class:`InfluxV2Writer`).
        host: interface to listen on; loopback by default.
        grpc_port: OTLP/gRPC port (0: a free one; None: no gRPC receiver).
        http_port: OTLP/HTTP port, also serving ``/metrics`` and ``/healthz`` (0: a free one).
        registry: prometheus ``CollectorRegistry`` for the bridge's metrics (fresh when None).
        tag_allowlist: attribute keys stored as tags.
        spool_dir: directory of the disk spool: every request is in it, fsync'd, before it is
            answered 200 (docs/storage.md, "Delivery"); in memory when None (a weaker
            guarantee: what is not yet written is lost if the process dies).
        spool: a spool to use instead of building one from ``spool_dir``,
            ``spool_max_bytes`` and ``spool_overflow`` (any :class:`Spool`).
        spool_max_bytes: bound on the spool.
        spool_overflow: ``drop_oldest`` or ``drop_newest`` (refuse with 429) when the spool
            is full.
        max_queue_lines: backlog (accepted, not yet written) beyond which requests get
            429/RESOURCE_EXHAUSTED while InfluxDB answers; during an outage the spool bound
            applies instead.
        batch_max_lines: points per InfluxDB write.
        flush_interval_s: longest a point waits for its batch.
        max_retries: failed writes in a row before InfluxDB counts as down.
        retry_backoff_s: first retry delay (doubles, up to ``max_backoff_s``).
        max_backoff_s: longest delay between write attempts.
        commit_timeout_s: longest a request waits for its spool commit (then 503).
        stall_timeout_s: a writer making no progress for this long (stuck, or failing on
            something other than InfluxDB) fails ``/healthz`` and the receivers answer 503.
        max_request_bytes: largest request body (after decompression); larger is 413.
        max_series_per_measurement: cardinality guard per (job, measurement); None disables.
        max_series_per_rank: cardinality guard per (job, measurement, rank): one producer
            flooding new tag values is stopped here long before the per-measurement cap.
        max_series_total: series this process remembers at once (all jobs); beyond it new
            series are rejected. None: no total.
        max_new_series_per_s: new series per second for this process (bursts of 10 s); a
            request bringing new series faster is refused with 429 (retryable). None: no rate.
        series_ttl_s: a series silent this long is forgotten by the guard.
        auth_token: when set, both receivers require ``Authorization: Bearer <token>``.
        tls_cert_file: PEM certificate; with ``tls_key_file`` both receivers use TLS.
        tls_key_file: PEM private key.
        reuse_port: set SO_REUSEPORT so several bridge processes can share the ports.
        grpc_workers: threads that run gRPC calls whose intake may block; by default 8 with a
            disk spool (a call waits for its fsync'd group commit) and 1 with a memory spool
            (unused: calls are handled on the server's event loop, never blocking).
        grpc_max_concurrent_rpcs: gRPC calls being handled at once (their message received);
            beyond it RESOURCE_EXHAUSTED with RetryInfo, which OTLP clients retry.
        grpc_max_concurrent_streams: HTTP/2 streams per gRPC connection, advertised; a
            stream whose answer waits for the client's flow-control window still counts.
        max_concurrent_requests: OTLP/HTTP requests processed at once (each fully read
            first); beyond it 503 + ``Retry-After`` (with the queue bound this bounds the
            bridge's memory).
        max_connections: connections open at once, per receiver. OTLP/HTTP: at the bound a
            new connection is admitted by closing the connection idle longest (one that never
            sent a request first); gRPC: beyond it new connections are closed.
        request_timeout_s: deadline for one request's headers and body (HTTP 408) or one
            call's message (DEADLINE_EXCEEDED), counted from its first byte, never restarted.
        idle_timeout_s: a connection without a request or call in progress is closed after
            this (PINGs do not count as activity).
        handshake_timeout_s: a new gRPC connection must finish TLS and its HTTP/2 preface and
            SETTINGS within this.
        max_connection_age_s: a gRPC connection is sent GOAWAY after this and closed 30 s
            later with whatever it still holds (clients reconnect, spreading over processes).
        max_header_bytes: request line and header fields (HTTP, 431 beyond) or a call's header
            list (gRPC, counted while decoding) at most this many bytes.
        retry_after_s: the ``Retry-After`` / RetryInfo delay under backpressure.
        max_future_skew_s: points stamped further than this ahead of the receive time are
            rejected (``clock_skew``); None accepts any future time.
        max_past_skew_s: points stamped further than this behind the receive time are
            rejected (``clock_skew``); None (the default: backfills and replays are
            legitimate) accepts any past time. Production sites set e.g. 7 days.
        max_duration_s: duration histograms whose max or mean exceed this are rejected
            (``implausible_duration``); None disables the check.
        duplicate_rank_takeover_s: a second producer of a live (job, rank) is rejected
            (``duplicate_rank``) until the first has been silent this long; None disables the
            duplicate-rank guard (docs/storage.md, "Duplicate ranks").
        clock_unix_nano: the receive-time clock (injected in tests).
        max_cumulative_series: CUMULATIVE series whose last point is remembered, to store
            per-window deltas (docs/storage.md, "Cumulative temporality"); the least recently
            seen is forgotten first, and one silent for ``series_ttl_s`` is forgotten.
        histogram_layout: ``compact`` (default: a histogram's buckets in one ``buckets``
            string field, so every measurement has a fixed set of columns) or ``per_bound``
            (one field per bucket bound, the columns of a Collector's influxdb exporter);
            docs/storage.md, "Histogram layouts".
        fast_path: convert requests with the C fast path where it applies (the default;
            byte-identical output, about a tenth of the CPU per point; docs/deployment.md,
            "Bridge vs influxd CPU"); False: always the Python path. Without the compiled
            extension the Python path runs and the bridge says so once when it starts.
    """

    def __init__(
        self,
        writer: LineWriter,
        *,
        host: str = "127.0.0.1",
        grpc_port: int | None = 0,
        http_port: int | None = 0,
        registry: Any = None,
        tag_allowlist: frozenset[str] = TAG_ALLOWLIST,
        spool_dir: str | os.PathLike[str] | None = None,
        spool: Spool | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        spool_overflow: OverflowPolicy = "drop_oldest",
        max_queue_lines: int = 200_000,
        batch_max_lines: int = 5_000,
        flush_interval_s: float = 0.2,
        max_retries: int = 2,
        retry_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        max_request_bytes: int = 16 * 1024 * 1024,
        max_series_per_measurement: int | None = 2_000_000,
        max_series_per_rank: int = 1024,
        max_series_total: int | None = 1_000_000,
        max_new_series_per_s: float | None = 2_000.0,
        series_ttl_s: float = 3600.0,
        auth_token: str | None = None,
        tls_cert_file: str | os.PathLike[str] | None = None,
        tls_key_file: str | os.PathLike[str] | None = None,
        reuse_port: bool = False,
        grpc_workers: int | None = None,
        grpc_max_concurrent_rpcs: int = 256,
        grpc_max_concurrent_streams: int = 32,
        max_concurrent_requests: int = 64,
        max_connections: int = 4096,
        request_timeout_s: float = 30.0,
        idle_timeout_s: float = 120.0,
        handshake_timeout_s: float = 5.0,
        max_connection_age_s: float = 300.0,
        max_header_bytes: int = 16 * 1024,
        commit_timeout_s: float = 10.0,
        stall_timeout_s: float = 60.0,
        retry_after_s: int = 1,
        max_future_skew_s: float | None = 600.0,
        max_past_skew_s: float | None = None,
        max_duration_s: float | None = MAX_DURATION_S,
        duplicate_rank_takeover_s: float | None = 30.0,
        clock_unix_nano: Callable[[], int] = time.time_ns,
        max_cumulative_series: int = 100_000,
        histogram_layout: str = LAYOUT_COMPACT,
        fast_path: bool = True,
    ) -> None:
        for name, port in (("grpc_port", grpc_port), ("http_port", http_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{name}: {port} is not a TCP port")
        if http_port is None and grpc_port is None:
            raise ConfigError("grpc_port, http_port: at least one receiver is needed")
        if max_request_bytes <= 0:
            raise ConfigError(f"max_request_bytes: must be positive, got {max_request_bytes}")
        if retry_after_s <= 0:
            raise ConfigError(f"retry_after_s: must be positive, got {retry_after_s}")
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ConfigError("tls_cert_file, tls_key_file: give both or neither")
        self.host = host
        self.metrics = BridgeMetrics(registry)
        self._requested_grpc_port = grpc_port
        self._requested_http_port = http_port
        tls: tuple[bytes, bytes] | None = None
        tls_files = None
        if tls_cert_file is not None and tls_key_file is not None:
            tls_files = (tls_cert_file, tls_key_file)
            tls = (
                _read_secret(tls_cert_file, "tls_cert_file"),
                _read_secret(tls_key_file, "tls_key_file"),
            )
        self._tls = tls is not None
        if spool_dir is None:  # a writer may carry the site's spool directory
            spool_dir = getattr(writer, "spool_dir", None)
        if spool is not None:
            chosen: Spool = spool
        elif spool_dir is None:
            chosen = MemorySpool(max_bytes=spool_max_bytes, overflow=spool_overflow)
        else:
            chosen = DiskSpool(
                spool_dir,
                max_bytes=spool_max_bytes,
                overflow=spool_overflow,
                cache_lines=max_queue_lines,
            )
        self.forwarder = Forwarder(
            writer,
            spool=chosen,
            metrics=self.metrics,
            max_queue_lines=max_queue_lines,
            batch_max_lines=batch_max_lines,
            flush_interval_s=flush_interval_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            max_backoff_s=max_backoff_s,
            commit_timeout_s=commit_timeout_s,
            stall_timeout_s=stall_timeout_s,
        )
        self.guard = (
            None
            if max_series_per_measurement is None
            else CardinalityGuard(
                max_series=max_series_per_measurement,
                max_series_per_rank=max_series_per_rank,
                max_series_total=max_series_total,
                max_new_series_per_s=max_new_series_per_s,
                series_ttl_s=series_ttl_s,
            )
        )
        self.identity = (
            None
            if duplicate_rank_takeover_s is None
            else RankIdentityGuard(takeover_after_s=duplicate_rank_takeover_s)
        )
        self._fast_path_requested = fast_path
        self.intake = Intake(
            self.forwarder,
            metrics=self.metrics,
            guard=self.guard,
            identity=self.identity,
            tag_allowlist=tag_allowlist,
            max_duration_s=max_duration_s,
            histogram_layout=histogram_layout,
            fast_path=fast_path,
            skew=ClockSkew(max_past_s=max_past_skew_s, max_future_s=max_future_skew_s),
            auth_token=auth_token,
            clock_unix_nano=clock_unix_nano,
            cumulative=CumulativeState(
                max_series=max_cumulative_series,
                ttl_s=series_ttl_s,
                on_evict=lambda reason, count: self.metrics.cumulative_evicted.labels(
                    reason=reason
                ).inc(count),
            ),
        )
        context = ReceiverContext(
            self.intake, self.metrics, max_request_bytes, retry_after_s, reuse_port
        )
        if grpc_workers is None:
            grpc_workers = 8 if self.forwarder.spool.durable else 1
        self._grpc = GrpcReceiver(
            context,
            workers=grpc_workers,
            max_concurrent_rpcs=grpc_max_concurrent_rpcs,
            tls=tls,
            limits=GrpcLimits(
                max_connections=max_connections,
                max_concurrent_streams=grpc_max_concurrent_streams,
                request_timeout_s=request_timeout_s,
                idle_timeout_s=idle_timeout_s,
                handshake_timeout_s=handshake_timeout_s,
                max_connection_age_s=max_connection_age_s,
                max_header_bytes=max_header_bytes,
            ),
        )
        self._http = HttpReceiver(
            context,
            max_concurrent_requests=max_concurrent_requests,
            max_connections=max_connections,
            request_timeout_s=request_timeout_s,
            idle_timeout_s=idle_timeout_s,
            max_header_bytes=max_header_bytes,
            tls_files=tls_files,
        )
        self.grpc_port: int | None = None
        self.http_port: int | None = None

    def __repr__(self) -> str:  # never show the token
        return f"Bridge(host={self.host!r}, grpc_port={self.grpc_port}, http_port={self.http_port})"

    @property
    def scheme(self) -> str:
        return "https" if self._tls else "http"

    @property
    def metrics_url(self) -> str:
        return f"{self.scheme}://{self._url_host}:{self.http_port}/metrics"

    @property
    def http_url(self) -> str:
        """The OTLP/HTTP metrics endpoint."""
        return f"{self.scheme}://{self._url_host}:{self.http_port}{HTTP_PATH}"

    @property
    def grpc_endpoint(self) -> str:
        return f"{self._url_host}:{self.grpc_port}"

    @property
    def _url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def start(self) -> Bridge:
        """Bind the ports and start serving; returns self."""
        _fast.announce(
            self.intake.fast_path, requested=self._fast_path_requested, metrics=self.metrics
        )
        self.forwarder.start()
        try:
            if self._requested_http_port is not None:
                self.http_port = self._http.start(self.host, self._requested_http_port)
            if self._requested_grpc_port is not None:
                self.grpc_port = self._grpc.start(f"{self._url_host}:{self._requested_grpc_port}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop accepting, write what InfluxDB takes within ``timeout_s``, release the ports.

        Whatever is not written by then stays in a disk spool for the next start; in a memory
        spool it is lost and counted (``dropped{reason="shutdown"}``).
        """
        self._grpc.stop(timeout_s=timeout_s)
        self._http.stop(timeout_s=timeout_s)
        self.forwarder.stop(timeout_s=timeout_s)
        spool = self.forwarder.spool
        if isinstance(spool, MemorySpool) and spool.batches:
            lost = spool.lines
            _log.warning("bridge stopped with %d points in its memory spool: lost", lost)
            self.metrics.dropped.labels(reason="shutdown").inc(lost)
            while (head := spool.peek()) is not None:
                spool.remove(head[0])
        elif spool.batches:
            _log.warning(
                "bridge stopped with %d points in its spool %s: written at the next start",
                spool.lines,
                getattr(spool, "directory", ""),
            )
        spool.close()

    def __enter__(self) -> Bridge:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def ingest(self, request: ExportMetricsServiceRequest) -> Outcome:
        """Convert, guard and queue one request, as the receivers do (in-process producers)."""
        return self.intake.ingest(request)
