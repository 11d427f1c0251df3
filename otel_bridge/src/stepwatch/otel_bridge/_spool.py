"""A bounded, ordered spool of line-protocol batches kept while InfluxDB is down.

Each batch is one file ``<sequence>-<lines>.lp`` written to a temporary name and renamed (so a
crash never leaves a half batch under a real name). Batches are replayed oldest first and
deleted only after InfluxDB accepted them. A batch replayed twice (crash between the write
and the delete) does not duplicate data: points carry explicit timestamps, and InfluxDB keeps
one value per (series, field, timestamp).

Overflow policy (``spool_max_bytes`` reached): ``drop_oldest`` (default) deletes the oldest
batches until the new one fits, keeping the most recent data; ``drop_newest`` refuses the new
batch. Either way the dropped points are counted by the caller.
"""

from __future__ import annotations

import collections
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

    def append(self, lines: Sequence[str]) -> SpoolAppend: ...
    def peek(self) -> tuple[int, list[str]] | None: ...
    def remove(self, batch_id: int) -> None: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def batches(self) -> int: ...


def _encode(lines: Sequence[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def _check(max_bytes: int, overflow: str) -> None:
    if max_bytes <= 0:
        raise ConfigError(f"spool_max_bytes: must be positive, got {max_bytes}")
    if overflow not in OVERFLOW_POLICIES:
        raise ConfigError(f"spool_overflow: {overflow!r} is not one of {OVERFLOW_POLICIES}")


class MemorySpool:
    """The spool in memory (no ``spool_dir``): survives InfluxDB outages, not bridge restarts.

    Args:
        max_bytes: bound on the encoded size of all batches.
        overflow: ``drop_oldest`` or ``drop_newest``.
    """

    def __init__(self, *, max_bytes: int, overflow: OverflowPolicy = "drop_oldest") -> None:
        _check(max_bytes, overflow)
        self.max_bytes = max_bytes
        self.overflow = overflow
        self._batches: collections.OrderedDict[int, tuple[list[str], int]] = (
            collections.OrderedDict()
        )
        self._next_id = 0
        self._size_bytes = 0
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def batches(self) -> int:
        return len(self._batches)

    def append(self, lines: Sequence[str]) -> SpoolAppend:
        size = len(_encode(lines))
        dropped = 0
        with self._lock:
            if size > self.max_bytes:
                return SpoolAppend(False, len(lines))
            while self._size_bytes + size > self.max_bytes:
                if self.overflow == "drop_newest":
                    return SpoolAppend(False, len(lines))
                _, (old_lines, old_size) = self._batches.popitem(last=False)
                self._size_bytes -= old_size
                dropped += len(old_lines)
            self._batches[self._next_id] = (list(lines), size)
            self._next_id += 1
            self._size_bytes += size
        return SpoolAppend(True, dropped)

    @property
    def lines(self) -> int:
        """Points held (lost if the process exits: memory is not durable)."""
        with self._lock:
            return sum(len(lines) for lines, _ in self._batches.values())

    def peek(self) -> tuple[int, list[str]] | None:
        with self._lock:
            for batch_id, (lines, _) in self._batches.items():
                return batch_id, list(lines)
        return None

    def remove(self, batch_id: int) -> None:
        with self._lock:
            entry = self._batches.pop(batch_id, None)
            if entry is not None:
                self._size_bytes -= entry[1]


class DiskSpool:
    """The spool as files in ``directory``; batches left by an earlier run are replayed.

    Args:
        directory: created if missing; must be used by one bridge process at a time.
        max_bytes: bound on the total size of the batch files.
        overflow: ``drop_oldest`` or ``drop_newest``.
    """

    _SUFFIX = ".lp"

    def __init__(
        self, directory: str | os.PathLike[str], *, max_bytes: int, overflow: OverflowPolicy
    ) -> None:
        _check(max_bytes, overflow)
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.overflow = overflow
        self._lock = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"spool_dir: cannot create {self.directory}: {exc}") from exc
        # batch id -> (path, lines, bytes), ascending id = arrival order.
        self._index: collections.OrderedDict[int, tuple[Path, int, int]] = collections.OrderedDict()
        for leftover in self.directory.glob("*.tmp"):
            leftover.unlink(missing_ok=True)  # a crash mid-write: never renamed, never acked
        found: list[tuple[int, Path, int, int]] = []
        for path in self.directory.glob(f"*{self._SUFFIX}"):
            try:
                batch_id_text, lines_text = path.stem.split("-", 1)
                found.append((int(batch_id_text), path, int(lines_text), path.stat().st_size))
            except (ValueError, OSError):
                continue  # not ours
        for batch_id, path, lines, size in sorted(found):
            self._index[batch_id] = (path, lines, size)
        self._next_id = max(self._index, default=-1) + 1
        self._size_bytes = sum(size for _, _, size in self._index.values())

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def batches(self) -> int:
        return len(self._index)

    def append(self, lines: Sequence[str]) -> SpoolAppend:
        data = _encode(lines)
        dropped = 0
        with self._lock:
            if len(data) > self.max_bytes:
                return SpoolAppend(False, len(lines))
            while self._size_bytes + len(data) > self.max_bytes:
                if self.overflow == "drop_newest":
                    return SpoolAppend(False, len(lines))
                batch_id = next(iter(self._index))
                dropped += self._index[batch_id][1]
                self._remove_locked(batch_id)
            batch_id = self._next_id
            self._next_id += 1
            path = self.directory / f"{batch_id:020d}-{len(lines)}{self._SUFFIX}"
            temporary = path.with_suffix(".tmp")
            with temporary.open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            temporary.rename(path)
            self._index[batch_id] = (path, len(lines), len(data))
            self._size_bytes += len(data)
        return SpoolAppend(True, dropped)

    def peek(self) -> tuple[int, list[str]] | None:
        with self._lock:
            if not self._index:
                return None
            batch_id = next(iter(self._index))
            path = self._index[batch_id][0]
        text = path.read_text(encoding="utf-8")
        return batch_id, [line for line in text.split("\n") if line]

    def remove(self, batch_id: int) -> None:
        with self._lock:
            self._remove_locked(batch_id)

    def _remove_locked(self, batch_id: int) -> None:
        entry = self._index.pop(batch_id, None)
        if entry is not None:
            entry[0].unlink(missing_ok=True)
            self._size_bytes -= entry[2]
