"""HPACK decoding (the bridge's own gRPC server): RFC 7541's worked examples, and every
block the ``hpack`` package's encoder makes, over a connection's sequence of blocks."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.otel_bridge._hpack import STATIC_TABLE, Decoder, HpackError, encode

# RFC 7541 Appendix C.3 (requests without Huffman coding) and C.4 (the same with it): three
# requests on one connection, the later ones indexing what the earlier ones added.
_REQUESTS = [
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")],
    [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
        ("cache-control", "no-cache"),
    ],
    [
        (":method", "GET"),
        (":scheme", "https"),
        (":path", "/index.html"),
        (":authority", "www.example.com"),
        ("custom-key", "custom-value"),
    ],
]
_C3 = [
    "828684410f7777772e6578616d706c652e636f6d",
    "828684be58086e6f2d6361636865",
    "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565",
]
_C4 = [
    "828684418cf1e3c2e5f23a6ba0ab90f4ff",
    "828684be5886a8eb10649cbf",
    "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
]


@pytest.mark.parametrize("blocks", [_C3, _C4], ids=["C.3 plain", "C.4 Huffman"])
def test_the_rfc_examples_decode_in_sequence(blocks: list[str]) -> None:
    decoder = Decoder()
    assert [decoder.decode(bytes.fromhex(block)) for block in blocks] == _REQUESTS
    # C.3.3 / C.4.3: the dynamic table, newest first, as the RFC lists it (164 bytes)
    assert decoder._entries == [
        ("custom-key", "custom-value"),
        ("cache-control", "no-cache"),
        (":authority", "www.example.com"),
    ]
    assert decoder._size == 164


_NAMES = st.sampled_from(
    [name for name, _ in STATIC_TABLE[:20]] + ["grpc-timeout", "x-a", "authorization"]
)
_FIELDS = st.lists(
    st.tuples(_NAMES, st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(_FIELDS, min_size=1, max_size=8),
    huffman=st.booleans(),
    table_size=st.sampled_from([None, 0, 64, 256, 4096]),
)
def test_whatever_the_hpack_package_encodes_decodes_to_the_same_fields(
    blocks: list[list[tuple[str, str]]], huffman: bool, table_size: int | None
) -> None:
    """Incremental indexing, eviction under small tables, size updates, Huffman strings."""
    encoder = hpack.Encoder()
    decoder = Decoder()
    for number, fields in enumerate(blocks):
        if table_size is not None and number == 1:
            encoder.header_table_size = table_size  # a size update opens the next block
        block = encoder.encode(fields, huffman=huffman)
        assert decoder.decode(block) == fields


def test_our_answers_decode_with_the_hpack_package() -> None:
    fields = [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", "8"),
        ("grpc-message", "x" * 300),  # a length past the 7-bit prefix
    ]
    assert hpack.Decoder().decode(encode(fields)) == fields


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ("be", "index 62 out of range"),  # the dynamic table is empty
        ("80", "index 0 out of range"),
        ("410f7777", "truncated"),  # a string longer than the block
        ("ff", "truncated"),  # an integer without its continuation
        ("3fe21f", "table size 4097 above 4096"),  # 31 + 0x62 + (0x1f << 7)
        ("823f01", "after a header field"),
        ("ffffffffff7f", "too large"),
    ],
)
def test_malformed_blocks_are_refused(block: str, error: str) -> None:
    with pytest.raises(HpackError, match=error):
        Decoder().decode(bytes.fromhex(block))


@settings(max_examples=2000, deadline=None)
@given(blocks=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_any_bytes_decode_or_raise_hpack_error_only(blocks: list[bytes]) -> None:
    """Untrusted header blocks: fields or a COMPRESSION_ERROR, never another exception."""
    decoder = Decoder()
    for block in blocks:
        try:
            fields = decoder.decode(block)
        except HpackError:
            continue
        assert all(isinstance(name, str) and isinstance(value, str) for name, value in fields)
