"""Batching, retrying, spooling delivery of line protocol to a :class:`LineWriter`.

Receivers ``offer()`` the lines of one request: all of them are queued or none (the request
is answered 429 / RESOURCE_EXHAUSTED and the producer retries), so memory is bounded by
``max_queue_lines``. One flush thread takes batches of up to ``batch_max_lines``, writes them
with a few quick retries, and spools a batch that still fails. While the spool holds anything,
new batches go behind it so InfluxDB receives data in arrival order; the spool head is retried
with exponential backoff and, once a write succeeds, replayed until empty.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from stepwatch.core._errors import ConfigError, InfluxError, InfluxUnavailableError
from stepwatch.otel_bridge._metrics import BridgeMetrics
from stepwatch.otel_bridge._spool import Spool
from stepwatch.otel_bridge._writers import LineWriter

_log = logging.getLogger("stepwatch.otel_bridge")


def _retryable(exc: InfluxError) -> bool:
    return isinstance(exc, InfluxUnavailableError) or exc.status in (408, 429)


class Forwarder:
    """Moves accepted lines from receivers to InfluxDB.

    Args:
        writer: sends one batch (InfluxV1Writer, InfluxV2Writer or a test double).
        spool: where failed batches wait (MemorySpool or DiskSpool).
        metrics: the bridge's metrics.
        max_queue_lines: in-memory bound; offers beyond it are refused (backpressure).
        batch_max_lines: largest batch sent in one write.
        flush_interval_s: longest time a line waits for its batch to fill.
        max_retries: quick retries of a failing batch before it is spooled.
        retry_backoff_s: first retry delay; doubles per retry, and for spool replay up to
            ``max_backoff_s``.
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
        ):
            if number <= 0:
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
        self.clock = clock
        self._queue: collections.deque[str] = collections.deque()
        self._condition = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._replay_backoff_s = retry_backoff_s
        self._next_replay_s = 0.0
        self._idle = threading.Event()
        self._idle.set()
        self.metrics.spool_bytes.set(spool.size_bytes)

    @property
    def queued_lines(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.max_queue_lines

    def offer(self, lines: Sequence[str]) -> bool:
        """Queue all ``lines`` or none; False means "over capacity, retry later"."""
        if not lines:
            return True
        with self._condition:
            if self._stopping or len(self._queue) + len(lines) > self.max_queue_lines:
                return False
            self._queue.extend(lines)
            self._idle.clear()
            self.metrics.queue_depth.set(len(self._queue))
            self._condition.notify()
        return True

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name="stepwatch-bridge-forwarder", daemon=True
        )
        self._thread.start()

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Flush what is queued (to InfluxDB or the spool) and stop the thread."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the queue is empty and nothing is in flight (the spool may hold data)."""
        return self._idle.wait(timeout_s)

    def _take(self) -> list[str]:
        with self._condition:
            if not self._queue and not self._stopping:
                self._condition.wait(self._wait_s())
            if len(self._queue) < self.batch_max_lines and not self._stopping:
                # Give a small batch a moment to fill (bounded by flush_interval_s).
                deadline = self.clock() + self.flush_interval_s
                while (
                    0 < len(self._queue) < self.batch_max_lines
                    and not self._stopping
                    and self.clock() < deadline
                ):
                    self._condition.wait(max(0.0, deadline - self.clock()))
            count = min(len(self._queue), self.batch_max_lines)
            batch = [self._queue.popleft() for _ in range(count)]
            self.metrics.queue_depth.set(len(self._queue))
            return batch

    def _wait_s(self) -> float:
        if self.spool.batches:
            return max(0.0, min(self.flush_interval_s, self._next_replay_s - self.clock()))
        return self.flush_interval_s

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch:
                if self.spool.batches:
                    self._spool(batch)  # keep arrival order behind what waits already
                else:
                    self._write_or_spool(batch)
            if self.spool.batches and self.clock() >= self._next_replay_s:
                self._replay()
            with self._condition:
                if not self._queue:
                    self._idle.set()
                if self._stopping and not self._queue:
                    return

    def _write(self, lines: Sequence[str]) -> None:
        started = time.perf_counter()
        try:
            self.writer.write_lines(lines)
        finally:
            self.metrics.write_duration.observe(time.perf_counter() - started)
        self.metrics.written.inc(len(lines))

    def _write_or_spool(self, batch: list[str]) -> None:
        delay_s = self.retry_backoff_s
        for attempt in range(self.max_retries + 1):
            try:
                self._write(batch)
                return
            except InfluxError as exc:
                if not _retryable(exc):
                    self._refused(batch, exc)
                    return
                _log.warning("InfluxDB write failed (attempt %d): %s", attempt + 1, exc)
            if attempt < self.max_retries and not self._stopping:
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, self.max_backoff_s)
        self._spool(batch)
        self._next_replay_s = self.clock() + self._replay_backoff_s

    def _refused(self, batch: Sequence[str], exc: InfluxError) -> None:
        # A 4xx is not transient: retrying would refuse it again. InfluxDB 1.x may have
        # stored the valid points of a "partial write"; count the whole batch as dropped.
        _log.error("InfluxDB refused a batch of %d points: %s", len(batch), exc)
        self.metrics.dropped.labels(reason="influx_refused").inc(len(batch))

    def _spool(self, batch: list[str]) -> None:
        result = self.spool.append(batch)
        if not result.stored:
            self.metrics.dropped.labels(reason="spool_full").inc(len(batch))
        if result.dropped_lines:
            self.metrics.dropped.labels(reason="spool_full").inc(result.dropped_lines)
        self.metrics.spool_bytes.set(self.spool.size_bytes)

    def _replay(self) -> None:
        while True:
            head = self.spool.peek()
            if head is None:
                self._replay_backoff_s = self.retry_backoff_s
                return
            batch_id, lines = head
            try:
                self._write(lines)
            except InfluxError as exc:
                if not _retryable(exc):
                    self._refused(lines, exc)
                    self.spool.remove(batch_id)
                    self.metrics.spool_bytes.set(self.spool.size_bytes)
                    continue
                self._next_replay_s = self.clock() + self._replay_backoff_s
                self._replay_backoff_s = min(self._replay_backoff_s * 2, self.max_backoff_s)
                return
            self.spool.remove(batch_id)
            self.metrics.spool_bytes.set(self.spool.size_bytes)
            with self._condition:
                if len(self._queue) >= self.max_queue_lines // 2:
                    return  # let the queue drain too (into the spool, behind this data)
