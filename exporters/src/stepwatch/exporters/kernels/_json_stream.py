"""Streaming a trace document in bounded memory, whatever the file holds.

A Kineto / Chrome trace is one JSON object whose ``traceEvents`` array holds nearly all of its
bytes (or, in Chrome's "JSON array format", just that array). :class:`TraceDocument` reads the
file in chunks (gunzipping on the fly), decodes UTF-8 incrementally and hands out the array's
elements one at a time: each is decoded by the standard library's scanner
(``json.JSONDecoder.raw_decode``) from a sliding text buffer, so the values are exactly what
``json.loads`` would build. The other top-level members are parsed the same way; only the ones
asked for are kept.

Memory is one chunk plus the largest single value, and a value is capped at
``max_value_chars``: a 200 MB string, a run of ``[`` or a document that never closes costs a
few MiB, not the file's size. Python's ``json`` cannot stream (``json.load`` reads the whole
file and builds every object first); a streaming parser from PyPI (ijson) was not needed for
one array of small objects.

Every problem is a :class:`~stepwatch.core.TraceFormatError` whose message names the file and
the position (line, column, byte): truncated or malformed JSON, a value nested deeper than the
interpreter's recursion limit (``json``'s scanner recurses once per level), a number with more
digits than ``int`` converts, text that is not UTF-8, a truncated or corrupt gzip stream.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from types import TracebackType
from typing import cast

from stepwatch.core._errors import TraceFormatError

_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_VALUE_CHARS = 16 << 20
"""Longest single trace event (or other top-level value) read, in characters: Kineto's events
are well under 10 kB; a longer value is refused rather than buffered."""
# The pattern matches the empty string, so match() never returns None.
_skip_blanks = cast("Callable[[str, int], re.Match[str]]", re.compile(r"[ \t\n\r]*").match)
# When the scanner fails this close to the end of the buffer, the value may just be cut by the
# chunk boundary: the longest token it stops in front of is "-Infinity" (9 characters).
_CUT_SLACK = 16
_BOM = codecs.BOM_UTF8


def json_type(value: object) -> str:
    """What a decoded JSON value is, in JSON's words: ``an object``, ``a string`` ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


class TraceDocument:
    """One trace file, read as a stream: ``with TraceDocument(path) as doc: doc.events()``.

    Args:
        path: The file, plain or gzip-compressed (recognised by its magic bytes).
        keep: Top-level members (other than ``traceEvents``) to keep in :attr:`members`.
        max_value_chars: Longest single value (an event, a member) accepted.
        progress: Called with a one-line message every ``progress_every_bytes`` read.
        progress_every_bytes: Progress granularity (decompressed bytes).
        chunk_bytes: Bytes read (decompressed) at a time; at least 4.

    Attributes:
        members: The top-level members named in ``keep`` that the document has, filled in as
            they are read (complete once :meth:`events` is exhausted).
        size_bytes: Bytes of the (decompressed) document read so far; its size at the end.
    """

    def __init__(
        self,
        path: Path,
        *,
        keep: Collection[str] = (),
        max_value_chars: int = DEFAULT_MAX_VALUE_CHARS,
        progress: Callable[[str], None] | None = None,
        progress_every_bytes: int = 64 << 20,
        chunk_bytes: int = _CHUNK_BYTES,
    ) -> None:
        self.members: dict[str, object] = {}
        self.size_bytes = 0
        self._path = path
        self._keep = frozenset(keep)
        self._max_value_chars = max_value_chars
        self._progress = progress
        self._progress_every_bytes = progress_every_bytes
        self._chunk_bytes = chunk_bytes
        self._raw: io.BufferedReader | None = None
        self._decoder = json.JSONDecoder()
        self._chunks: Iterator[str] = iter(())
        self._buffer = ""
        self._pos = 0
        self._eof = False
        # Where the buffer starts in the whole document, for messages.
        self._dropped_chars = 0
        self._dropped_bytes = 0
        self._dropped_lines = 0
        self._line_start_char = 0

    def __enter__(self) -> TraceDocument:
        try:
            self._raw = self._path.open("rb")
        except OSError as exc:
            raise TraceFormatError(f"{self._path}: cannot read: {exc}") from exc
        self._chunks = self._text_chunks(self._raw)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._raw is not None:
            self._raw.close()

    def events(self) -> Iterator[object]:
        """The elements of ``traceEvents`` (or of the top-level array), in file order.

        Raises:
            TraceFormatError: The document is not a JSON object with a ``traceEvents`` array
                (or a JSON array), is cut short, malformed, or holds a value too large or
                nested too deeply.
        """
        first = self._skip_whitespace()
        if first == "[":  # Chrome's "JSON array format": the document is the event list
            self._pos += 1
            yield from self._array()
        elif first == "{":
            self._pos += 1
            yield from self._object()
        else:
            top = self._value()
            raise TraceFormatError(f"{self._path}: not a trace (top level is {json_type(top)})")
        if self._skip_whitespace():
            raise self._error(self._pos, "Extra data")

    def _object(self) -> Iterator[object]:
        has_events = False
        if self._skip_whitespace() == "}":
            self._pos += 1
            more = False
        else:
            more = True
        while more:
            if self._skip_whitespace() != '"':
                raise self._error(self._pos, "Expecting property name enclosed in double quotes")
            key = self._value()
            self._expect(":", "Expecting ':' delimiter")
            if key == "traceEvents":
                if has_events:
                    raise TraceFormatError(f"{self._path}: more than one 'traceEvents' member")
                has_events = True
                if self._skip_whitespace() != "[":
                    found = self._value()
                    raise TraceFormatError(
                        f"{self._path}: not a trace ('traceEvents' is {json_type(found)}, "
                        "not an array)"
                    )
                self._pos += 1
                yield from self._array()
            else:
                self._skip_whitespace()
                value = self._value()
                if key in self._keep:
                    self.members[str(key)] = value
            more = self._more("}")
        if not has_events:
            raise TraceFormatError(f"{self._path}: not a trace (no 'traceEvents' array)")

    def _array(self) -> Iterator[object]:
        if self._skip_whitespace() == "]":
            self._pos += 1
            return
        scan = self._decoder.scan_once  # type: ignore[attr-defined]  # raw_decode's own call
        skip = _skip_blanks
        while True:
            # Fast path (nearly every element): the element and the separator after it are in
            # the buffer. Anything else (a chunk boundary, a syntax error, a value nested too
            # deeply) takes the careful path below, which reads on or reports the error.
            buffer, pos = self._buffer, self._pos
            size = len(buffer)
            while True:
                try:
                    value, end = scan(buffer, pos)
                except (StopIteration, ValueError, RecursionError):
                    break
                if end < size and buffer[end] != ",":
                    end = skip(buffer, end).end()
                if end >= size:
                    break
                if buffer[end] == ",":
                    pos = self._pos = skip(buffer, end + 1).end()
                    yield value
                elif buffer[end] == "]":
                    self._pos = end + 1
                    yield value
                    return
                else:
                    break
            self._skip_whitespace()
            yield self._value()
            if not self._more("]"):
                return
            self._skip_whitespace()

    def _more(self, close: str) -> bool:
        """After a member or element: True past a ``,``, False past ``close``, else an error."""
        after = self._skip_whitespace()
        if after not in (",", close):
            raise self._error(self._pos, "Expecting ',' delimiter")
        self._pos += 1
        return after == ","

    def _expect(self, char: str, message: str) -> None:
        if self._skip_whitespace() != char:
            raise self._error(self._pos, message)
        self._pos += 1

    def _skip_whitespace(self) -> str:
        """Skip whitespace; the next character, or ``""`` at the end of the document."""
        while True:
            self._pos = _skip_blanks(self._buffer, self._pos).end()
            if self._pos < len(self._buffer):
                return self._buffer[self._pos]
            if not self._fill(1):
                return ""

    def _value(self) -> object:
        """Decode the JSON value at the current position (whitespace already skipped)."""
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buffer, self._pos)
            except json.JSONDecodeError as exc:
                cut = exc.msg.startswith("Unterminated string") or (
                    exc.pos >= len(self._buffer) - _CUT_SLACK
                )
                if self._eof or not cut:
                    raise self._error(exc.pos, exc.msg) from exc
            except RecursionError as exc:
                raise TraceFormatError(
                    f"{self._path}: JSON nested deeper than Python's recursion limit at "
                    f"{self._where(self._pos)}; a trace event is a flat object"
                ) from exc
            except ValueError as exc:  # int() refuses numbers of more than 4300 digits
                raise self._error(self._pos, f"number too long ({exc})") from exc
            else:
                # A value that reaches the end of the buffer may go on (a number's digits).
                if end < len(self._buffer) or self._eof:
                    self._pos = end
                    return value
            pending = len(self._buffer) - self._pos
            if pending >= self._max_value_chars:
                raise TraceFormatError(
                    f"{self._path}: a value at {self._where(self._pos)} is longer than "
                    f"{self._max_value_chars:,} characters (a trace event is a few hundred); "
                    "not a trace, or malformed"
                )
            # Doubling what is read keeps re-decoding a long value linear in its length.
            self._fill(min(max(2 * pending, 1), self._max_value_chars + 1))

    def _fill(self, available: int) -> bool:
        """Read until ``available`` characters follow the position; False at the end first."""
        missing = available - (len(self._buffer) - self._pos)
        if missing <= 0:
            return True
        chunks: list[str] = []
        while missing > 0 and not self._eof:
            chunk = next(self._chunks, None)
            if chunk is None:
                self._eof = True
            else:
                chunks.append(chunk)
                missing -= len(chunk)
        if chunks:
            self._drop_consumed(chunks)
        return missing <= 0

    def _drop_consumed(self, chunks: list[str]) -> None:
        """Forget the text before the position (keeping its counts) and append ``chunks``."""
        pos, buffer = self._pos, self._buffer
        newline = buffer.rfind("\n", 0, pos)
        if newline >= 0:
            self._dropped_lines += buffer.count("\n", 0, pos)
            self._line_start_char = self._dropped_chars + newline + 1
        self._dropped_bytes += pos if buffer.isascii() else len(buffer[:pos].encode())
        self._dropped_chars += pos
        self._buffer = "".join([buffer[pos:], *chunks])
        self._pos = 0

    def _where(self, pos: int) -> str:
        """``line L column C (byte B[ of N])`` of buffer position ``pos``."""
        buffer = self._buffer
        line = self._dropped_lines + buffer.count("\n", 0, pos) + 1
        newline = buffer.rfind("\n", 0, pos)
        if newline >= 0:
            column = pos - newline
        else:
            column = self._dropped_chars + pos - self._line_start_char + 1
        byte = self._dropped_bytes + (pos if buffer.isascii() else len(buffer[:pos].encode()))
        total = f" of {self.size_bytes}" if self._eof else ""
        return f"line {line} column {column} (byte {byte}{total})"

    def _error(self, pos: int, message: str) -> TraceFormatError:
        return TraceFormatError(
            f"{self._path}: malformed or truncated JSON at {self._where(pos)}: {message}"
        )

    def _text_chunks(self, raw: io.BufferedReader) -> Iterator[str]:
        read = gzip.GzipFile(fileobj=raw).read if raw.peek(2)[:2] == b"\x1f\x8b" else raw.read
        decoder = codecs.getincrementaldecoder("utf-8")()
        reported = 0
        while True:
            try:
                data = read(self._chunk_bytes)
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                raise TraceFormatError(
                    f"{self._path}: gzip stream truncated or corrupt after {self.size_bytes} "
                    f"decompressed bytes: {exc}"
                ) from exc
            except OSError as exc:
                raise TraceFormatError(f"{self._path}: cannot read: {exc}") from exc
            start = self.size_bytes
            self.size_bytes += len(data)
            if start == 0 and data.startswith(_BOM):  # json.loads(bytes) accepts a BOM too
                data = data[len(_BOM) :]
                start = len(_BOM)
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                raise TraceFormatError(
                    f"{self._path}: not UTF-8 text at byte {start - pending + exc.start}"
                ) from exc
            if self._progress is not None and self.size_bytes - reported >= (
                self._progress_every_bytes
            ):
                reported = self.size_bytes
                self._progress(f"{self._path}: read {self.size_bytes / 1e6:.0f} MB")
            if text:
                yield text
            if not data:
                return
