"""The bounded, ordered spool every accepted point passes through on its way to InfluxDB.

The spool is the bridge's write-ahead log: a request is answered 200 / OK only once its lines
are in the spool (for :class:`DiskSpool`: on disk and fsync'd), and lines leave it only once
InfluxDB accepted them. Batches are replayed oldest first, so InfluxDB receives data in
arrival order.

:class:`DiskSpool` keeps each batch as one file ``<sequence>-<lines>.lp``, written to a
temporary name, fsync'd, renamed, and the directory fsync'd (so neither a SIGKILL nor a power
loss leaves a half batch under a real name, and an acknowledged batch survives both). A batch
replayed twice (crash between the write and the delete) does not duplicate data: points
carry explicit timestamps, and InfluxDB keeps one value per (series, field, timestamp).
:class:`MemorySpool` keeps batches in memory: it rides out InfluxDB outages, not a restart.

Overflow policy (``spool_max_bytes`` reached): ``drop_oldest`` (default) deletes the oldest
batches until the new one fits, keeping the most recent data; ``drop_newest`` refuses the new
batch (the bridge then answers 429 and the producer keeps it). Dropped points are counted by
the caller.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from stepwatch.core._errors import ConfigError

OverflowPolicy = Literal["drop_oldest", "drop_newest"]
OVERFLOW_POLICIES: tuple[OverflowPolicy, ...] = ("drop_oldest", "drop_newest")


class SpoolAppend(NamedTuple):
    """What an append did: whether the batch was stored and how many lines were dropped."""

    stored: bool
    dropped_lines: int


class Spool(Protocol):
    """Ordered batches waiting for InfluxDB."""

    durable: bool  # survives a crash of the process

    def append(self, lines: Sequence[str]) -> SpoolAppend:
        """Store a batch; raises OSError when the storage fails (nothing stored)."""

    def peek(self) -> tuple[int, list[str]] | None: ...
    def peek_many(self, max_lines: int) -> list[tuple[int, list[str]]]: ...
    def remove(self, batch_id: int) -> None: ...
    def fits(self, size_bytes: int) -> bool: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def batches(self) -> int: ...
    @property
    def lines(self) -> int: ...
    def close(self) -> None: ...


def encode(lines: Sequence[str]) -> bytes:
    """A batch as stored: newline-terminated UTF-8 lines."""
    return ("\n".join(lines) + "\n").encode("utf-8")


def _check(max_bytes: int, overflow: str) -> None:
    if max_bytes <= 0:
        raise ConfigError(f"spool_max_bytes: must be positive, got {max_bytes}")
    if overflow not in OVERFLOW_POLICIES:
        raise ConfigError(f"spool_overflow: {overflow!r} is not one of {OVERFLOW_POLICIES}")


class _Index:
    """Batch id → (line count, bytes), in arrival order, with running totals."""

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()
        self.lines = 0
        self.size_bytes = 0

    def add(self, batch_id: int, lines: int, size: int) -> None:
        self.entries[batch_id] = (lines, size)
        self.lines += lines
        self.size_bytes += size

    def pop(self, batch_id: int) -> tuple[int, int] | None:
        entry = self.entries.pop(batch_id, None)
        if entry is not None:
            self.lines -= entry[0]
            self.size_bytes -= entry[1]
        return entry

    def evict(self, size: int, max_bytes: int, overflow: str) -> list[int] | None:
        """The oldest batch ids to drop so ``size`` more bytes fit; None: refuse the batch."""
        if size > max_bytes:
            return None
        victims: list[int] = []
        freed = 0
        for batch_id, (_, batch_bytes) in self.entries.items():
            if self.size_bytes - freed + size <= max_bytes:
                break
            if overflow == "drop_newest":
                return None
            victims.append(batch_id)
            freed += batch_bytes
        return victims

    def head(self, max_lines: int) -> list[int]:
        """The oldest batch ids holding at most ``max_lines`` lines (at least one batch)."""
        chosen: list[int] = []
        total = 0
        for batch_id, (lines, _) in self.entries.items():
            if chosen and total + lines > max_lines:
                break
            chosen.append(batch_id)
            total += lines
        return chosen


class _Bounded:
    """What both spools share: the index of batches, its totals, the bound."""

    _index: _Index
    max_bytes: int

    @property
    def size_bytes(self) -> int:
        return self._index.size_bytes

    @property
    def batches(self) -> int:
        return len(self._index.entries)

    @property
    def lines(self) -> int:
        """Points held."""
        return self._index.lines

    def fits(self, size_bytes: int) -> bool:
        """Whether a batch of ``size_bytes`` would be stored without dropping anything."""
        return self._index.size_bytes + size_bytes <= self.max_bytes

    def peek(self) -> tuple[int, list[str]] | None:
        """The oldest batch."""
        batches = self.peek_many(1)
        return batches[0] if batches else None

    def peek_many(self, max_lines: int) -> list[tuple[int, list[str]]]:
        raise NotImplementedError


class MemorySpool(_Bounded):
    """The spool in memory (no ``spool_dir``): survives InfluxDB outages, not bridge restarts.

    Args:
        max_bytes: bound on the encoded size of all batches.
        overflow: ``drop_oldest`` or ``drop_newest``.
    """

    durable = False

    def __init__(self, *, max_bytes: int, overflow: OverflowPolicy = "drop_oldest") -> None:
        _check(max_bytes, overflow)
        self.max_bytes = max_bytes
        self.overflow = overflow
        self._index = _Index()
        self._batches: dict[int, list[str]] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    def append(self, lines: Sequence[str]) -> SpoolAppend:
        size = sum(map(len, lines)) + len(lines)  # ASCII-dominated: close enough
        dropped = 0
        with self._lock:
            victims = self._index.evict(size, self.max_bytes, self.overflow)
            if victims is None:
                return SpoolAppend(False, len(lines))
            for oldest in victims:
                dropped += self._index.entries[oldest][0]
                self._index.pop(oldest)
                del self._batches[oldest]
            self._batches[self._next_id] = list(lines)
            self._index.add(self._next_id, len(lines), size)
            self._next_id += 1
        return SpoolAppend(True, dropped)

    def peek_many(self, max_lines: int) -> list[tuple[int, list[str]]]:
        """The oldest batches, together at most ``max_lines`` lines (or one larger batch)."""
        with self._lock:
            return [(batch_id, self._batches[batch_id]) for batch_id in self._index.head(max_lines)]

    def remove(self, batch_id: int) -> None:
        with self._lock:
            if self._index.pop(batch_id) is not None:
                del self._batches[batch_id]

    def close(self) -> None:
        """Nothing to release."""


class DiskSpool(_Bounded):
    """The spool as files in ``directory``; batches left by an earlier run are replayed.

    Args:
        directory: created if missing; locked (``flock``) so one process uses it at a time.
        max_bytes: bound on the total size of the batch files.
        overflow: ``drop_oldest`` or ``drop_newest``.
        cache_lines: lines of recent batches also kept in memory, so the writer need not read
            them back from disk.

    Raises:
        ConfigError: the directory cannot be created, or another process holds it.
    """

    durable = True
    _SUFFIX = ".lp"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int,
        overflow: OverflowPolicy,
        cache_lines: int = 200_000,
    ) -> None:
        _check(max_bytes, overflow)
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.overflow = overflow
        self.cache_lines = cache_lines
        self._lock = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"spool_dir: cannot create {self.directory}: {exc}") from exc
        self._lock_directory()
        self._directory_fd = os.open(self.directory, os.O_RDONLY)
        self._index = _Index()
        self._cache: dict[int, list[str]] = {}
        self._cached_lines = 0
        for leftover in self.directory.glob("*.tmp"):
            leftover.unlink(missing_ok=True)  # a crash mid-write: never renamed, never acked
        found: list[tuple[int, int, int]] = []
        for path in self.directory.glob(f"*{self._SUFFIX}"):
            try:
                batch_id_text, lines_text = path.stem.split("-", 1)
                found.append((int(batch_id_text), int(lines_text), path.stat().st_size))
            except (ValueError, OSError):
                continue  # not ours
        for batch_id, lines, size in sorted(found):
            self._index.add(batch_id, lines, size)
        self._next_id = max(self._index.entries, default=-1) + 1

    def _lock_directory(self) -> None:
        import fcntl

        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise ConfigError(
                f"spool_dir: {self.directory} is in use by another bridge process "
                "(each process needs its own spool directory)"
            ) from exc

    def _path(self, batch_id: int, lines: int) -> Path:
        return self.directory / f"{batch_id:020d}-{lines}{self._SUFFIX}"

    def append(self, lines: Sequence[str]) -> SpoolAppend:
        """Write, fsync and rename one batch file, then fsync the directory.

        Raises:
            OSError: the file could not be written (disk full, I/O error); nothing stored.
        """
        data = encode(lines)
        dropped = 0
        with self._lock:
            victims = self._index.evict(len(data), self.max_bytes, self.overflow)
            if victims is None:
                return SpoolAppend(False, len(lines))
            for oldest in victims:
                dropped += self._index.entries[oldest][0]
                self._remove_locked(oldest)
            batch_id = self._next_id
            path = self._path(batch_id, len(lines))
            temporary = path.with_suffix(".tmp")
            try:
                with temporary.open("wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                temporary.rename(path)
                os.fsync(self._directory_fd)  # the rename itself survives a power loss
            except OSError:
                with contextlib.suppress(OSError):
                    temporary.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                raise
            self._next_id += 1
            self._index.add(batch_id, len(lines), len(data))
            if self._cached_lines + len(lines) <= self.cache_lines:
                self._cache[batch_id] = list(lines)
                self._cached_lines += len(lines)
        return SpoolAppend(True, dropped)

    def peek_many(self, max_lines: int) -> list[tuple[int, list[str]]]:
        """The oldest batches, together at most ``max_lines`` lines (or one larger batch).

        Raises:
            OSError: a batch file cannot be read.
        """
        with self._lock:
            chosen = [
                (batch_id, self._index.entries[batch_id][0], self._cache.get(batch_id))
                for batch_id in self._index.head(max_lines)
            ]
        result: list[tuple[int, list[str]]] = []
        for batch_id, count, cached in chosen:
            if cached is None:
                text = self._path(batch_id, count).read_bytes().decode("utf-8", "replace")
                cached = [line for line in text.split("\n") if line]
            result.append((batch_id, cached))
        return result

    def remove(self, batch_id: int) -> None:
        with self._lock:
            self._remove_locked(batch_id)

    def _remove_locked(self, batch_id: int) -> None:
        entry = self._index.pop(batch_id)
        if entry is None:
            return
        cached = self._cache.pop(batch_id, None)
        if cached is not None:
            self._cached_lines -= len(cached)
        self._path(batch_id, entry[0]).unlink(missing_ok=True)

    def close(self) -> None:
        """Release the directory lock (the files stay for the next start)."""
        for fd in (self._directory_fd, self._lock_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
