"""Span-file entries to an OTLP/HTTP receiver: the protobuf export request written from the
entries directly, and posted where the standard ``OTEL_EXPORTER_OTLP_*`` variables say.

The SDK's exporter takes ReadableSpans: rebuilding one from an entry and encoding it through the
SDK's encoder cost about 70 us a span here, about 1.7 ms of CPU a request at the mesh's ~21
spans, on the cores the request path runs on. Building the same messages with the protobuf
library's classes halves that (the cost is in building a message a field at a time from Python);
writing their wire format directly, as here, takes about 9 us a span. The format is protobuf's
(tag, varint length, bytes), for the few OTLP messages a span needs; the result is the library's
serialization byte for byte (tests/test_trace_shipper.py parses it with the library and compares
it with the SDK's own encoding of the same spans). It differs from the SDK's only in the span
flags: an entry does not say whether its parent was remote, so those bits stay unset (unknown).
"""

from __future__ import annotations

import functools
import gzip
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote

import httpx
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.sdk.resources import Resource

from services.mesh.tracing import EXPORT_TIMEOUT_S

# Field tags (field number << 3 | wire type) of opentelemetry/proto/trace/v1/trace.proto and
# common.proto, written out: wire type 0 varint, 1 fixed 64 bits, 2 length-delimited.
_TRACE_ID = b"\x0a\x10"  # Span.trace_id = 1, 16 bytes (Link's too)
_SPAN_ID = b"\x12\x08"  # Span.span_id = 2, 8 bytes (Link's too)
_PARENT_ID = b"\x22\x08"  # Span.parent_span_id = 4, 8 bytes
_NAME = b"\x2a"  # Span.name = 5
_START = b"\x39"  # Span.start_time_unix_nano = 7, fixed64
_END = b"\x41"  # Span.end_time_unix_nano = 8, fixed64
_SPAN_ATTRIBUTE = b"\x4a"  # Span.attributes = 9
_LINK = b"\x6a"  # Span.links = 13
_LINK_ATTRIBUTE = b"\x22"  # Link.attributes = 4
# Span.kind = 6 (varint), by the span files' SpanKind names; OTLP's enum is SpanKind's value + 1.
_KINDS = {
    "INTERNAL": b"\x30\x01",
    "SERVER": b"\x30\x02",
    "CLIENT": b"\x30\x03",
    "PRODUCER": b"\x30\x04",
    "CONSUMER": b"\x30\x05",
}
# Span.status = 15 holding Status.code = 3: always present, as the SDK writes it.
_STATUSES = {"UNSET": b"\x7a\x00", "OK": b"\x7a\x02\x18\x01", "ERROR": b"\x7a\x02\x18\x02"}
_REPEATED = b"\x0a"  # field 1, length-delimited: KeyValue.key, ArrayValue.values, KeyValueList.values, ...
_KEY_VALUE_VALUE = b"\x12"  # KeyValue.value = 2
# AnyValue's oneof: string_value = 1, bool_value = 2, int_value = 3, double_value = 4,
# array_value = 5, kvlist_value = 6.
_STRING, _TRUE, _FALSE, _INT, _DOUBLE, _ARRAY, _KVLIST = (
    b"\x0a",
    b"\x10\x01",
    b"\x10\x00",
    b"\x18",
    b"\x21",
    b"\x2a",
    b"\x32",
)
_RESOURCE, _SCOPE_SPANS, _SCOPE, _SPANS = b"\x0a", b"\x12", b"\x0a", b"\x12"  # ResourceSpans, ScopeSpans
_RESOURCE_SPANS = b"\x0a"  # ExportTraceServiceRequest.resource_spans = 1
_INT64 = (-(2**63), 2**63)
_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack
_ONE_BYTE = [bytes((n,)) for n in range(128)]


def encode_span(entry: Mapping[str, Any]) -> bytes:
    """One span-file entry (`services.mesh.tracing.span_to_dict`) as a serialized OTLP Span.
    Raises KeyError, ValueError or TypeError on an entry that is not one."""
    parts = [_TRACE_ID + _id(entry["trace_id"], 16), _SPAN_ID + _id(entry["span_id"], 8)]
    parent_id = entry.get("parent_id")
    if parent_id:
        parts.append(_PARENT_ID + _id(parent_id, 8))
    parts.append(_field(_NAME, str(entry["name"]).encode()))
    parts.append(_KINDS[entry.get("kind") or "INTERNAL"])
    start, end = int(entry["start_ns"]), int(entry["end_ns"])
    if not (0 <= start < 2**64 and 0 <= end < 2**64):
        raise ValueError(f"span times outside unsigned 64 bits: {start}, {end}")
    if start:
        parts.append(_START + _fixed64(start))
    if end:
        parts.append(_END + _fixed64(end))
    parts.append(_attributes(_SPAN_ATTRIBUTE, entry.get("attributes") or {}))
    for link in entry.get("links") or ():
        body = (
            _TRACE_ID
            + _id(link["trace_id"], 16)
            + _SPAN_ID
            + _id(link["span_id"], 8)
            + _attributes(_LINK_ATTRIBUTE, link.get("attributes") or {})
        )
        parts.append(_field(_LINK, body))
    parts.append(_STATUSES[entry.get("status") or "UNSET"])
    return b"".join(parts)


def encode_request(spans_by_service: Mapping[str, Sequence[bytes]]) -> bytes:
    """The serialized export request for these spans (`encode_span`'s), one resource per
    service, as the SDK groups them."""
    return b"".join(
        _field(
            _RESOURCE_SPANS,
            _field(_RESOURCE, _resource(service))
            + _field(
                _SCOPE_SPANS, _field(_SCOPE, _scope()) + b"".join(_field(_SPANS, span) for span in spans)
            ),
        )
        for service, spans in spans_by_service.items()
    )


def _varint(number: int) -> bytes:
    if number < 0x80:
        return _ONE_BYTE[number]
    out = bytearray()
    while number >= 0x80:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + _varint(len(payload)) + payload


def _id(hex_id: str, size: int) -> bytes:
    raw = bytes.fromhex(hex_id)
    if len(raw) != size:
        raise ValueError(f"an id of {size} bytes expected, got {hex_id!r}")
    return raw


@functools.lru_cache(maxsize=4096)
def _key(key: str) -> bytes:
    # A few dozen attribute names, each written thousands of times.
    return _field(_REPEATED, key.encode())


def _attributes(tag: bytes, attributes: Mapping[str, Any]) -> bytes:
    return b"".join([_field(tag, _key_value(key, value)) for key, value in attributes.items()])


def _key_value(key: str, value: Any) -> bytes:
    return _key(str(key)) + _field(_KEY_VALUE_VALUE, _any_value(value))


def _any_value(value: Any) -> bytes:
    kind = type(value)  # the JSON decoder's own types
    if kind is str:
        return _field(_STRING, value.encode())
    if kind is bool:
        return _TRUE if value else _FALSE
    if kind is int:
        if not _INT64[0] <= value < _INT64[1]:
            raise ValueError(f"an integer attribute outside int64: {value}")
        return _INT + _varint(value & 0xFFFFFFFFFFFFFFFF)  # a negative one as two's complement
    if kind is float:
        return _DOUBLE + _double(value)
    if kind is list or kind is tuple:
        return _field(_ARRAY, b"".join(_field(_REPEATED, _any_value(v)) for v in value))
    if kind is dict:
        return _field(_KVLIST, b"".join(_field(_REPEATED, _key_value(k, v)) for k, v in value.items()))
    if value is None:
        return b""
    raise TypeError(f"an attribute value of type {kind.__name__}")


@functools.cache
def _resource(service: str) -> bytes:
    # As a service's own provider describes itself (tracing.setup_tracing), SDK attributes included.
    attributes = Resource.create({"service.name": service, "service.namespace": "ripplemesh"}).attributes
    resource = PbResource(
        attributes=[
            KeyValue(key=key, value=AnyValue(string_value=str(value))) for key, value in attributes.items()
        ]
    )
    serialized: bytes = resource.SerializeToString()
    return serialized


@functools.cache
def _scope() -> bytes:
    serialized: bytes = InstrumentationScope(name="ripplemesh").SerializeToString()  # the services' tracer
    return serialized


# ------------------------------------------------------------ sending


def _setting(name: str, env: Mapping[str, str]) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}") or None


def traces_endpoint(env: Mapping[str, str] = os.environ) -> str:
    """Where traces go, as the OTLP exporter configuration specifies: the traces endpoint as it
    is, else the base endpoint with ``/v1/traces``, else the local default."""
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


def _headers(env: Mapping[str, str]) -> dict[str, str]:
    """``key=value,key2=value2`` (values URL-encoded), as the specification writes them."""
    headers: dict[str, str] = {}
    for item in (_setting("HEADERS", env) or "").split(","):
        key, equals, value = item.partition("=")
        if equals and key.strip():
            headers[unquote(key.strip()).lower()] = unquote(value.strip())
    return headers


class OtlpHttpSender:
    """Posts serialized export requests to the traces endpoint. It reads what the SDK's OTLP/HTTP
    exporter reads: endpoint, headers, timeout (seconds, as the Python SDK reads it),
    compression (gzip or none), the server's CA certificate and a client certificate and key.
    A refused or unanswered post is a False: the shipper tries the same spans again next round."""

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        self.endpoint = traces_endpoint(env)
        timeout = _setting("TIMEOUT", env)
        self._gzip = (_setting("COMPRESSION", env) or "none").strip().lower() == "gzip"
        headers = {"content-type": "application/x-protobuf", **_headers(env)}
        if self._gzip:
            headers["content-encoding"] = "gzip"
        client_cert, client_key = _setting("CLIENT_CERTIFICATE", env), _setting("CLIENT_KEY", env)
        self._client = httpx.Client(
            headers=headers,
            timeout=float(timeout) if timeout else EXPORT_TIMEOUT_S,
            verify=_setting("CERTIFICATE", env) or True,
            cert=(client_cert, client_key) if client_cert and client_key else client_cert,
        )

    def __call__(self, body: bytes) -> bool:
        try:
            response = self._client.post(self.endpoint, content=gzip.compress(body) if self._gzip else body)
        except httpx.HTTPError:
            return False
        return response.is_success

    def close(self) -> None:
        self._client.close()
