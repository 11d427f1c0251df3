"""Accepted lines: committed to the spool before the answer, then written to InfluxDB.

Every accepted point passes through the spool (the bridge's write-ahead log). ``offer()`` puts a
request's lines in the spool all-or-nothing and returns only once they are there: with a
:class:`DiskSpool` a committer thread writes everything staged since its last commit as one
batch file and fsyncs it (group commit: one fsync for all the requests that arrived meanwhile),
so a 200 / OK is never answered for a point a SIGKILL could lose. A writer thread sends the
spool's oldest batches to InfluxDB (up to ``batch_max_lines`` per write) and deletes them only
once InfluxDB accepted them; a failing write is retried with exponential backoff, for as long
as it takes, while the spool absorbs what arrives.

Neither thread dies: every exception is caught, counted, logged and backed off. What the
receivers are told follows from it (:meth:`Forwarder.refusal`, :meth:`Forwarder.offer`): 429 /
RESOURCE_EXHAUSTED when the backlog exceeds ``max_queue_lines`` while InfluxDB is merely slow,
or the spool is full under ``drop_newest``; 503 / UNAVAILABLE when the spool cannot store
(disk full, I/O error) or the writer cannot make progress (:meth:`Forwarder.health`).

A batch InfluxDB refuses (4xx: a field-type conflict, a ``partial write`` past
``max-values-per-tag``) is split in halves and the halves written again, down to the single
lines InfluxDB refuses, so the innocent lines of a batch are never dropped with the guilty.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from stepwatch.core._errors import ConfigError, InfluxError, InfluxUnavailableError
from stepwatch.core._http import retryable
from stepwatch.otel_bridge._metrics import BridgeMetrics
from stepwatch.otel_bridge._spool import Spool, SpoolAppend
from stepwatch.otel_bridge._writers import LineWriter

_log = logging.getLogger("stepwatch.otel_bridge")
_DROPPED = re.compile(r"dropped=(\d+)")  # InfluxDB 1.x: "partial write: ... dropped=N"


class Admission(NamedTuple):
    """Whether lines were accepted; if not, whether to answer 503 (unavailable) or 429."""

    accepted: bool
    unavailable: bool
    message: str
    reason: str = ""  # the ``reason`` label of stepwatch_bridge_requests_refused_total


ACCEPTED = Admission(True, False, "")
QUEUE_FULL = Admission(False, False, "bridge queue full, retry later", "queue_full")
SPOOL_FULL = Admission(False, False, "bridge spool full, retry later", "spool_full")


def _unavailable(message: str) -> Admission:
    return Admission(False, True, f"bridge unavailable ({message}), retry later", "unavailable")


class Health(NamedTuple):
    """Whether the bridge can accept durably, and why not (``/healthz``)."""

    ok: bool
    message: str


def _retryable(exc: InfluxError) -> bool:
    if isinstance(exc, InfluxUnavailableError):
        return True
    return exc.status is not None and retryable(exc.status)


def _all_refused(exc: InfluxError, lines: int) -> bool:
    """InfluxDB 1.x says how many points of a partial write it dropped: all of them?"""
    match = _DROPPED.search(str(exc))
    return match is not None and int(match.group(1)) >= lines


class _Group:
    """Lines staged for one spool commit, and how the commit went."""

    __slots__ = ("done", "lines", "refusal")

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.done = threading.Event()
        self.refusal: Admission | None = None


class Forwarder:
    """Moves accepted lines from receivers through the spool to InfluxDB.

    Args:
        writer: sends one batch (InfluxV1Writer, InfluxV2Writer or a test double).
        spool: where accepted lines wait for InfluxDB (DiskSpool or MemorySpool).
        metrics: the bridge's metrics.
        max_queue_lines: backlog (accepted, not yet written) beyond which requests get 429
            while InfluxDB answers; during an outage the spool's own bound applies instead.
        batch_max_lines: largest batch sent in one write.
        flush_interval_s: longest time a line waits for its batch to fill.
        max_retries: failed writes in a row before the bridge counts InfluxDB as down (and
            lets the spool, rather than ``max_queue_lines``, bound what it accepts).
        retry_backoff_s: first retry delay; doubles per failure up to ``max_backoff_s``.
        max_backoff_s: longest delay between write attempts.
        commit_timeout_s: longest a request waits for its spool commit (then 503).
        stall_timeout_s: a writer that has not come round its loop (or has failed on
            something other than InfluxDB) for this long makes the bridge unhealthy.
        clock: monotonic clock (seconds); injected for tests.

    The defaults are :class:`~stepwatch.otel_bridge.Bridge`'s, its only builder.
    """

    def __init__(
        self,
        writer: LineWriter,
        *,
        spool: Spool,
        metrics: BridgeMetrics,
        max_queue_lines: int,
        batch_max_lines: int,
        flush_interval_s: float,
        max_retries: int,
        retry_backoff_s: float,
        max_backoff_s: float,
        commit_timeout_s: float = 10.0,
        stall_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("max_queue_lines", max_queue_lines),
            ("batch_max_lines", batch_max_lines),
        ):
            if value <= 0:
                raise ConfigError(f"{name}: must be positive, got {value}")
        for name, number in (
            ("flush_interval_s", flush_interval_s),
            ("retry_backoff_s", retry_backoff_s),
            ("max_backoff_s", max_backoff_s),
            ("commit_timeout_s", commit_timeout_s),
            ("stall_timeout_s", stall_timeout_s),
        ):
            if not number > 0:
                raise ConfigError(f"{name}: must be positive, got {number}")
        if max_retries < 0:
            raise ConfigError(f"max_retries: must be >= 0, got {max_retries}")
        self.writer = writer
        self.spool = spool
        self.metrics = metrics
        self.max_queue_lines = max_queue_lines
        self.batch_max_lines = batch_max_lines
        self.flush_interval_s = flush_interval_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_backoff_s = max_backoff_s
        self.commit_timeout_s = commit_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self._condition = threading.Condition()
        self._staging = _Group()
        self._staged_lines = 0
        self._stopping = False
        self._committer: threading.Thread | None = None
        self._writer_thread: threading.Thread | None = None
        self._first_unwritten_s: float | None = clock() if spool.batches else None
        self._failures = 0  # failed writes in a row
        self._next_attempt_s = 0.0
        self._backoff_s = retry_backoff_s
        self._outage = False
        self._commit_error: str | None = None
        self._writer_error: tuple[str, float] | None = None  # (what, since)
        self._heartbeat_s = clock()
        self._writing = False
        self._idle = threading.Event()
        # Read when the metrics are collected (a scrape), not kept current on every request:
        # setting three gauges and evaluating health() per request was ~10 % of the fast
        # path's CPU per point (bench/bridge_cpu.py).
        metrics.spool_bytes.set_function(lambda: self.spool.size_bytes)
        metrics.queue_depth.set_function(lambda: self.spool.lines)
        metrics.healthy.set_function(lambda: 1 if self.health().ok else 0)

    # ---- what receivers see ---------------------------------------------------------------
    @property
    def backlog_lines(self) -> int:
        """Accepted lines not yet written to InfluxDB (staged or spooled)."""
        return self._staged_lines + self.spool.lines

    queued_lines = backlog_lines

    @property
    def full(self) -> bool:
        return self.backlog_lines >= self.max_queue_lines and not self._outage

    @property
    def outage(self) -> bool:
        """InfluxDB failed the last ``max_retries + 1`` writes in a row."""
        return self._outage

    def health(self) -> Health:
        """Whether accepted points can be made durable and the writer makes progress."""
        now = self.clock()
        for name, thread in (("committer", self._committer), ("writer", self._writer_thread)):
            if thread is not None and not thread.is_alive() and not self._stopping:
                return Health(False, f"the bridge's {name} thread is not running")
        if self._commit_error is not None:
            return Health(False, f"the spool cannot store: {self._commit_error}")
        if self._writer_thread is not None and now - self._heartbeat_s > self.stall_timeout_s:
            return Health(
                False, f"the writer is stuck (no progress for {now - self._heartbeat_s:.0f} s)"
            )
        if self._writer_error is not None and now - self._writer_error[1] > self.stall_timeout_s:
            return Health(False, f"the writer keeps failing: {self._writer_error[0]}")
        if self._outage:
            return Health(
                True, f"degraded: InfluxDB unavailable, {self.spool.lines} points spooled"
            )
        return Health(True, "ok")

    def refusal(self) -> Admission | None:
        """Why a request would be refused now (checked before converting it); None: admit."""
        with self._condition:
            return self._refusal_locked(1)

    def _refusal_locked(self, lines: int) -> Admission | None:
        if self._stopping:
            return _unavailable("stopping")
        health = self.health()
        if not health.ok and self._commit_error is None:  # a commit may succeed again: try it
            return _unavailable(health.message)
        if not self._outage and self.backlog_lines + lines > self.max_queue_lines:
            return QUEUE_FULL
        return None

    def offer(self, lines: Sequence[str]) -> Admission:
        """Put all ``lines`` in the spool or none; returns once they are there (or refused)."""
        if not lines:
            return ACCEPTED
        started = time.perf_counter()
        with self._condition:
            refusal = self._refusal_locked(len(lines))
            if refusal is not None:
                return refusal
            self._idle.clear()
            if not self.spool.durable:  # memory: nothing to wait for
                return self._commit(list(lines))
            group = self._staging
            group.lines.extend(lines)
            self._staged_lines += len(lines)
            self._condition.notify_all()
        if not group.done.wait(self.commit_timeout_s):
            return _unavailable("spool commit timed out")
        self.metrics.commit_duration.observe(time.perf_counter() - started)
        return group.refusal or ACCEPTED

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._writer_thread is not None:
            return
        self._stopping = False
        self._heartbeat_s = self.clock()
        if self.spool.durable:
            self._committer = threading.Thread(
                target=self._run_committer, name="stepwatch-bridge-committer", daemon=True
            )
            self._committer.start()
        self._writer_thread = threading.Thread(
            target=self._run_writer, name="stepwatch-bridge-writer", daemon=True
        )
        self._writer_thread.start()

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Commit what is staged, write what InfluxDB takes within ``timeout_s``, stop.

        What is left stays in the spool: on disk for the next start, or (memory spool) for
        the caller to count as lost.
        """
        deadline = self.clock() + timeout_s
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        for thread in (self._committer, self._writer_thread):
            if thread is not None:
                thread.join(max(0.0, deadline - self.clock()))
        self._committer = self._writer_thread = None

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until everything accepted is written (or dropped); False on timeout."""
        return self._idle.wait(timeout_s)

    # ---- committing -------------------------------------------------------------------------
    def _run_committer(self) -> None:
        while True:
            with self._condition:
                while not self._staging.lines and not self._stopping:
                    self._condition.wait()
                group = self._staging
                if not group.lines:
                    return
                self._staging = _Group()
            try:
                group.refusal = self._commit(group.lines)  # the fsync: outside the lock
            except BaseException as exc:  # never leave a request waiting
                group.refusal = _unavailable(f"error: {exc}")
                raise
            finally:
                with self._condition:
                    self._staged_lines -= len(group.lines)
                group.done.set()

    def _commit(self, lines: list[str]) -> Admission:
        """Append one batch to the spool and account for it."""
        try:
            result = self.spool.append(lines)
        except Exception as exc:  # disk full, I/O error: nothing stored, nothing accepted
            self.metrics.spool_failures.inc()
            with self._condition:
                if self._commit_error is None:
                    _log.error("bridge spool cannot store (answering 503): %s", exc)
                self._commit_error = str(exc)
            return _unavailable(f"cannot store: {exc}")
        with self._condition:
            return self._committed(result)

    def _committed(self, result: SpoolAppend) -> Admission:
        if self._commit_error is not None:
            _log.warning("bridge spool stores again")
            self._commit_error = None
        if result.dropped_lines and result.stored:
            self.metrics.dropped.labels(reason="spool_full").inc(result.dropped_lines)
        if not result.stored:
            return SPOOL_FULL
        if self._first_unwritten_s is None:
            self._first_unwritten_s = self.clock()
        self._condition.notify_all()
        return ACCEPTED

    # ---- writing ----------------------------------------------------------------------------
    def _run_writer(self) -> None:
        while True:
            try:
                if not self._write_next():
                    return
                if self._writer_error is not None:
                    _log.warning("bridge writer recovered")
                    self._writer_error = None
            except Exception as exc:  # the writer never dies: count, back off, go on
                self.metrics.write_failures.labels(reason="error").inc()
                if self._writer_error is None:
                    _log.exception("bridge writer failed; retrying with backoff")
                    self._writer_error = (f"{type(exc).__name__}: {exc}", self.clock())
                self._back_off()
            finally:
                self._writing = False

    def _wait_s(self, now: float) -> float | None:
        """How long until the next write is due; None: nothing to write."""
        if not self.spool.batches:
            return None
        if now < self._next_attempt_s:
            return self._next_attempt_s - now
        if self._stopping or self.spool.lines >= self.batch_max_lines:
            return 0.0
        first = self._first_unwritten_s if self._first_unwritten_s is not None else now
        return max(0.0, first + self.flush_interval_s - now)

    def _write_next(self) -> bool:
        """Write the oldest batches once; False when stopped."""
        with self._condition:
            while True:
                now = self.clock()
                self._heartbeat_s = now
                wait_s = self._wait_s(now)
                if wait_s is None and not self._staged_lines:
                    self._idle.set()
                if self._stopping and (wait_s is None or self._outage or wait_s > 0):
                    return False  # what is left stays in the spool
                if wait_s == 0.0:
                    break
                self._condition.wait(min(wait_s or 1.0, 1.0))
            self._writing = True
        batches = self.spool.peek_many(self.batch_max_lines)
        lines = [line for _, batch in batches for line in batch]
        if lines and not self._deliver(lines):
            return True
        with self._condition:
            for batch_id, _ in batches:
                self.spool.remove(batch_id)
            self._first_unwritten_s = self.clock() if self.spool.batches else None
        return True

    def _deliver(self, lines: Sequence[str]) -> bool:
        """Write ``lines`` (splitting refused batches); False: retry later."""
        try:
            try:
                self._write(lines)
            except InfluxError as exc:
                if _retryable(exc):
                    raise
                self.metrics.write_failures.labels(reason="refused").inc()
                self._split_refused(lines, exc)
        except InfluxError as exc:
            self.metrics.write_failures.labels(reason="unavailable").inc()
            self._write_failed(exc)
            return False
        except Exception as exc:  # a writer raising anything else: same treatment, counted
            self.metrics.write_failures.labels(reason="error").inc()
            self._write_failed(exc)
            return False
        if self._failures:
            _log.warning("InfluxDB writes succeed again after %d failures", self._failures)
        self._failures = 0
        self._backoff_s = self.retry_backoff_s
        self._next_attempt_s = 0.0
        self._outage = False
        return True

    def _write(self, lines: Sequence[str]) -> None:
        started = time.perf_counter()
        try:
            self.writer.write_lines(lines)
        finally:
            self.metrics.write_duration.observe(time.perf_counter() - started)
        self.metrics.written.inc(len(lines))

    def _write_failed(self, exc: Exception) -> None:
        self._failures += 1
        if self._failures > self.max_retries and not self._outage:
            self._outage = True
            _log.warning("InfluxDB unavailable; spooling until it answers: %s", exc)
        elif self._failures <= self.max_retries + 1:
            _log.warning("InfluxDB write failed (attempt %d): %s", self._failures, exc)
        self._back_off()

    def _back_off(self) -> None:
        with self._condition:
            self._next_attempt_s = self.clock() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)

    def _split_refused(self, lines: Sequence[str], exc: InfluxError) -> None:
        """Write what InfluxDB takes of a refused batch, halving it down to single lines.

        Rewriting lines InfluxDB already stored (1.x stores the valid points of a partial
        write) is harmless: same series, field and timestamp. A retryable failure on the way
        propagates: the whole batch stays in the spool and is retried.
        """
        refused: list[str] = []
        pending: list[Sequence[str]] = []
        if len(lines) == 1 or _all_refused(exc, len(lines)):
            refused.extend(lines)
        else:
            middle = len(lines) // 2
            pending = [lines[middle:], lines[:middle]]
        while pending:
            part = pending.pop()
            try:
                self._write(part)
            except InfluxError as part_exc:
                if _retryable(part_exc):
                    raise
                if len(part) == 1 or _all_refused(part_exc, len(part)):
                    refused.extend(part)
                else:
                    middle = len(part) // 2
                    pending.extend((part[middle:], part[:middle]))
        if refused:
            _log.error(
                "InfluxDB refused %d of %d points of a batch (%s); first refused: %.200s",
                len(refused),
                len(lines),
                str(exc)[:300],
                refused[0],
            )
            self.metrics.dropped.labels(reason="influx_refused").inc(len(refused))
