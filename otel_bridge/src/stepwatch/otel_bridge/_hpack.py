"""HPACK (RFC 7541): the header compression of HTTP/2, as the gRPC server needs it.

Decoding is complete (indexed fields, the three literal forms, dynamic table size updates,
eviction); Huffman-coded strings are decoded by the ``hpack`` package's decoder (MIT), each
distinct short string once per connection. Encoding is minimal: the server's few answers use
static-table entries or literals without indexing, so its own dynamic table stays empty and
the client's ``SETTINGS_HEADER_TABLE_SIZE`` never matters.

Cost: a gRPC request's header block (10 fields, one new ``grpc-timeout`` each call) decodes
in a few microseconds, against ~28 us for the ``hpack`` package's own decoder.
"""

from __future__ import annotations

from hpack.huffman_table import decode_huffman

#: RFC 7541 Appendix A: the static table, index 1..61.
STATIC_TABLE: tuple[tuple[str, str], ...] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)
_STATIC = len(STATIC_TABLE)
_ENTRY_OVERHEAD = 32  # RFC 7541 4.1: an entry's size is its name, its value and 32
_HUFFMAN_CACHE = 256  # distinct Huffman strings remembered per decoder
_HUFFMAN_CACHED_BYTES = 256  # longer ones are decoded each time


class HpackError(Exception):
    """A header block that cannot be decoded: a COMPRESSION_ERROR for the connection."""


class Decoder:
    """One direction's decoding context (a connection's requests).

    Args:
        max_table_size: ``SETTINGS_HEADER_TABLE_SIZE`` this side announced (4,096 unless
            changed): the most a dynamic table size update may ask for.
    """

    def __init__(self, max_table_size: int = 4096) -> None:
        self.max_table_size = max_table_size
        self.table_size = max_table_size
        self._entries: list[tuple[str, str]] = []  # newest first: index 62 is entries[0]
        self._size = 0
        self._huffman: dict[bytes, str] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The header fields of one complete header block, in order.

        Raises:
            HpackError: a malformed block, an index out of range, a table size update above
                the announced maximum or not at the block's start.
        """
        fields: list[tuple[str, str]] = []
        append = fields.append
        entries = self._entries
        end = len(block)
        pos = 0
        try:
            while pos < end:
                byte = block[pos]
                if byte & 0x80:  # 6.1 indexed header field
                    index, pos = _integer(block, pos, 7)
                    append(self._field(index, entries))
                elif byte & 0x40:  # 6.2.1 literal with incremental indexing
                    index, pos = _integer(block, pos, 6)
                    name, pos = (
                        (self._field(index, entries)[0], pos) if index else self._string(block, pos)
                    )
                    value, pos = self._string(block, pos)
                    append((name, value))
                    self._add(name, value)
                    entries = self._entries
                elif byte & 0x20:  # 6.3 dynamic table size update
                    if fields:
                        raise HpackError("table size update after a header field")
                    size, pos = _integer(block, pos, 5)
                    if size > self.max_table_size:
                        raise HpackError(f"table size {size} above {self.max_table_size}")
                    self.table_size = size
                    self._evict(0)
                else:  # 6.2.2 without indexing, 6.2.3 never indexed: same form, 4-bit prefix
                    index, pos = _integer(block, pos, 4)
                    name, pos = (
                        (self._field(index, entries)[0], pos) if index else self._string(block, pos)
                    )
                    value, pos = self._string(block, pos)
                    append((name, value))
        except IndexError:
            raise HpackError("header block truncated") from None
        return fields

    def _field(self, index: int, entries: list[tuple[str, str]]) -> tuple[str, str]:
        if 0 < index <= _STATIC:
            return STATIC_TABLE[index - 1]
        dynamic = index - _STATIC - 1
        if index == 0 or dynamic >= len(entries):
            raise HpackError(f"header table index {index} out of range")
        return entries[dynamic]

    def _string(self, block: bytes, pos: int) -> tuple[str, int]:
        huffman = block[pos] & 0x80
        length, pos = _integer(block, pos, 7)
        end = pos + length
        if end > len(block):
            raise HpackError("header string truncated")
        raw = block[pos:end]
        if not huffman:
            return raw.decode("latin-1"), end
        text = self._huffman.get(raw)
        if text is None:
            try:
                text = decode_huffman(raw).decode("latin-1")
            except Exception as exc:  # hpack's own HPACKDecodingError and friends
                raise HpackError(f"bad Huffman string: {exc}") from None
            if len(raw) <= _HUFFMAN_CACHED_BYTES:  # a bounded cache: at most 64 kB a decoder
                if len(self._huffman) >= _HUFFMAN_CACHE:
                    self._huffman.clear()
                self._huffman[raw] = text
        return text, end

    def _add(self, name: str, value: str) -> None:
        size = len(name) + len(value) + _ENTRY_OVERHEAD
        if size > self.table_size:  # 4.4: an entry larger than the table empties it
            self._entries = []
            self._size = 0
            return
        self._evict(size)
        self._entries.insert(0, (name, value))
        self._size += size

    def _evict(self, room: int) -> None:
        entries = self._entries
        while entries and self._size + room > self.table_size:
            name, value = entries.pop()
            self._size -= len(name) + len(value) + _ENTRY_OVERHEAD


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """RFC 7541 5.1: the integer at ``pos`` with an N-bit prefix, and the position after it."""
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if value > 0xFFFFFFFF:  # no length, index or size here comes near 2**32
            raise HpackError("header integer too large")
        if not byte & 0x80:
            return value, pos
        shift += 7


_STATIC_INDEX: dict[tuple[str, str], int] = {}
_STATIC_NAMES: dict[str, int] = {}
for _index, (_name, _value) in enumerate(STATIC_TABLE, 1):
    _STATIC_INDEX.setdefault((_name, _value), _index)
    _STATIC_NAMES.setdefault(_name, _index)


def encode(fields: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> bytes:
    """A header block of ``fields``: static-table matches indexed, the rest literal without
    indexing (the encoder's dynamic table stays empty), no Huffman coding."""
    out = bytearray()
    for name, value in fields:
        index = _STATIC_INDEX.get((name, value))
        if index is not None:
            out += _encode_integer(index, 7, 0x80)
            continue
        name_index = _STATIC_NAMES.get(name)
        if name_index is not None:
            out += _encode_integer(name_index, 4, 0x00)
        else:
            out.append(0x00)
            out += _encode_string(name.encode("latin-1"))
        out += _encode_string(value.encode("latin-1"))
    return bytes(out)


def _encode_string(raw: bytes) -> bytes:
    return _encode_integer(len(raw), 7, 0x00) + raw


def _encode_integer(value: int, prefix: int, flags: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((flags | value,))
    out = bytearray((flags | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
