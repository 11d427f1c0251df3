"""Decoding OTLP/HTTP request bodies: binary protobuf or OTLP/JSON, optionally gzip or deflate.

OTLP/HTTP: https://opentelemetry.io/docs/specs/otlp/#otlphttp. OTLP/JSON is the proto3 JSON
mapping with two exceptions the receiver must honour: ``traceId``/``spanId`` are hex (not
base64) and enum values may be integers; unknown fields are ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class RequestError(Exception):
    """A request the receiver refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def gunzip(body: bytes, *, max_bytes: int) -> bytes:
    """Decompress a gzip body, refusing one that inflates beyond ``max_bytes`` (413)."""
    return _inflate(body, wbits=16 + zlib.MAX_WBITS, name="gzip", max_bytes=max_bytes)


def inflate(body: bytes, *, max_bytes: int) -> bytes:
    """Decompress a ``Content-Encoding: deflate`` body (413 beyond ``max_bytes``).

    HTTP's ``deflate`` is a zlib stream (RFC 9110 8.4.1.2; what the OpenTelemetry SDKs and
    stepwatch send); some clients send raw deflate instead, so a body without a zlib header
    is read as raw deflate.
    """
    looks_zlib = len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
    wbits = zlib.MAX_WBITS if looks_zlib else -zlib.MAX_WBITS
    return _inflate(body, wbits=wbits, name="deflate", max_bytes=max_bytes)


def _inflate(body: bytes, *, wbits: int, name: str, max_bytes: int) -> bytes:
    inflater = zlib.decompressobj(wbits=wbits)
    try:
        data = inflater.decompress(body, max_bytes + 1)
        if len(data) > max_bytes or inflater.unconsumed_tail:
            raise RequestError(413, f"decompressed body exceeds {max_bytes} bytes")
        data += inflater.flush()
    except zlib.error as exc:
        raise RequestError(400, f"invalid {name} body: {exc}") from exc
    if len(data) > max_bytes:
        raise RequestError(413, f"decompressed body exceeds {max_bytes} bytes")
    if not inflater.eof:
        raise RequestError(400, f"truncated {name} body")
    return data


def _hex_ids_to_base64(node: Any) -> None:
    """OTLP/JSON encodes trace/span ids in hex; protobuf's JSON parser expects base64."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("traceId", "spanId", "trace_id", "span_id") and isinstance(value, str):
                try:
                    node[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
                except ValueError as exc:
                    raise RequestError(400, f"{key} is not hex") from exc
            else:
                _hex_ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids_to_base64(item)


def decompressed_body(
    body: bytes, *, content_type: str | None, content_encoding: str | None, max_bytes: int
) -> bytes:
    """The first half of :func:`decode_body`: the content type checked, the body decompressed.

    Raises:
        RequestError: 415 unsupported content type or encoding, 413 too large after
            decompression, 400 malformed compression.
    """
    kind = media_type(content_type)
    if kind not in (PROTOBUF, JSON):
        raise RequestError(415, f"unsupported content type {content_type!r}")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        body = gunzip(body, max_bytes=max_bytes)
    elif encoding == "deflate":
        body = inflate(body, max_bytes=max_bytes)
    elif encoding not in ("identity", ""):
        raise RequestError(415, f"unsupported content encoding {content_encoding!r}")
    return body


def parse_protobuf(body: bytes) -> ExportMetricsServiceRequest:
    """A binary protobuf ``ExportMetricsServiceRequest``.

    Raises:
        RequestError: 400 malformed.
    """
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    request = ExportMetricsServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise RequestError(400, f"invalid protobuf: {exc}") from exc
    return request


def decode_body(
    body: bytes, *, content_type: str | None, content_encoding: str | None, max_bytes: int
) -> ExportMetricsServiceRequest:
    """Decode one OTLP/HTTP metrics request body.

    Raises:
        RequestError: 415 unsupported content type or encoding, 413 too large after
            decompression, 400 malformed.
    """
    from google.protobuf import json_format
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    body = decompressed_body(
        body, content_type=content_type, content_encoding=content_encoding, max_bytes=max_bytes
    )
    if media_type(content_type) == PROTOBUF:
        return parse_protobuf(body)
    request = ExportMetricsServiceRequest()
    try:
        document = json.loads(body)
        _hex_ids_to_base64(document)
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except RequestError:
        raise
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise RequestError(400, f"invalid OTLP/JSON: {str(exc)[:200]}") from exc
    except (binascii.Error, AttributeError) as exc:
        raise RequestError(400, f"invalid OTLP/JSON: {str(exc)[:200]}") from exc
    return request
