"""OTLP/protobuf encoding of SDK spans: one ``ExportTraceServiceRequest`` as bytes.

The bytes are those the OpenTelemetry SDK's OTLP/HTTP exporter sends
(``encode_spans(spans).SerializePartialToString()`` of
``opentelemetry-exporter-otlp-proto-common``): same grouping by resource, then
by instrumentation scope, same fields in the same order, so a collector cannot
tell them apart. The SDK builds one protobuf message object per span, event,
attribute and value, in Python, on the export thread; here the wire format
(varints, length-delimited fields, fixed64 times, fixed32 flags) is written
directly from byte fragments, and the fragments that repeat step after step
(encoded attribute entries, whole span attribute lists, span names with their
kind, attribute keys, trace ids) are cached in bounded module-level
dictionaries, cleared when full, as :mod:`commspan.otlpjson.encode` does for
OTLP/JSON. The caches hold only bytes built from attribute values, never spans.

Pure Python and the standard library: no protobuf runtime is needed to encode.

Example:
    >>> from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ...     ExportTraceServiceRequest)
    >>> from opentelemetry.sdk.trace import ReadableSpan
    >>> from opentelemetry.trace import SpanContext
    >>> span = ReadableSpan("step", SpanContext(1, 2, False), attributes={"n": -1},
    ...                     start_time=10, end_time=20)
    >>> data = encode_spans_protobuf([span])
    >>> decoded = ExportTraceServiceRequest.FromString(data)
    >>> decoded.resource_spans[0].scope_spans[0].spans[0].attributes[0].value.int_value
    -1
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from struct import Struct
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind

from commspan.otlpjson.encode import _clean_text, resource_and_scope, span_fields
from commspan.otlpjson.encode import dropped_attributes as _dropped
from commspan.otlpjson.encode import dropped_items as _dropped_items

__all__ = ["encode_spans_protobuf"]

_logger = logging.getLogger(__name__)

# ------------------------------------------------------------------ wire format
# Field tags (field number << 3 | wire type) of opentelemetry-proto's messages,
# as one byte each (every field number here is below 16, except Span.flags).
# ExportTraceServiceRequest.resource_spans = 1; ResourceSpans: resource = 1,
# scope_spans = 2, schema_url = 3; ScopeSpans: scope = 1, spans = 2,
# schema_url = 3; Resource.attributes = 1; InstrumentationScope: name = 1,
# version = 2, attributes = 3.
_F1_LEN = b"\x0a"
_F2_LEN = b"\x12"
_F3_LEN = b"\x1a"
# Span: trace_id 1, span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6,
# start 7 (fixed64), end 8 (fixed64), attributes 9, dropped_attributes_count 10,
# events 11, dropped_events_count 12, links 13, dropped_links_count 14,
# status 15, flags 16 (fixed32)
_SPAN_ATTRS = b"\x4a"
_SPAN_EVENT = b"\x5a"
_SPAN_LINK = b"\x6a"
_SPAN_STATUS = b"\x7a"
_SPAN_FLAGS = b"\x85\x01"  # field 16, fixed32: a two-byte tag
# Span.Event: time_unix_nano 1 (fixed64), name 2, attributes 3, dropped 4
# Span.Link: trace_id 1, span_id 2, attributes 4, dropped 5, flags 6 (fixed32)
_LINK_ATTRS = b"\x22"
_LOCAL = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_REMOTE = 0x300  # ... | SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK

_BYTE = [bytes((i,)) for i in range(256)]
_ID = Struct(">BBQ")  # tag, length 8, a span id
_TIMES = Struct("<BQBQ")  # start and end, fixed64
_FIXED64 = Struct("<BQ")
_DOUBLE = Struct("<Bd")  # AnyValue.double_value (field 4, fixed64)
_FLAGS = {False: _SPAN_FLAGS + Struct("<I").pack(_LOCAL),
          True: _SPAN_FLAGS + Struct("<I").pack(_REMOTE)}
_LINK_FLAGS = {False: b"\x35" + Struct("<I").pack(_LOCAL),
               True: b"\x35" + Struct("<I").pack(_REMOTE)}
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _varint(n: int) -> bytes:
    """Base-128 varint; a negative int64 takes ten bytes (two's complement)."""
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return _BYTE[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: ``tag``, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _text(tag: bytes, value: str | None) -> bytes:
    """A string field, omitted when empty (proto3 leaves default values out)."""
    if not value:
        return b""
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: U+FFFD, as the OTLP/JSON encoder writes
        raw = _clean_text(value).encode("utf-8")
    return _field(tag, raw)


def _count(tag: bytes, n: int) -> bytes:
    return tag + _varint(n) if n else b""


# ------------------------------------------------------------------ values
def _any(v: Any) -> bytes:
    """An ``AnyValue``'s content, in the order of the SDK's ``_encode_value``."""
    if v is None:
        return b""
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, str):
        try:
            raw = v.encode("utf-8")
        except UnicodeEncodeError:  # as in _text
            raw = _clean_text(v).encode("utf-8")
        return _field(b"\x0a", raw)
    if isinstance(v, int):
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError(f"Value out of range: {v}")
        return b"\x18" + _varint(int(v))
    if isinstance(v, float):
        return _DOUBLE.pack(0x21, v)
    if isinstance(v, bytes):
        return _field(b"\x3a", v)
    if isinstance(v, Sequence):  # ArrayValue (field 5) of AnyValue (field 1)
        return _field(b"\x2a", b"".join([_field(b"\x0a", _any(x)) for x in v]))
    if isinstance(v, Mapping):  # KeyValueList (field 6) of KeyValue (field 1)
        return _field(b"\x32", b"".join([_field(b"\x0a", _key_value(str(k), x))
                                         for k, x in v.items()]))
    raise TypeError(f"Invalid type {type(v)} of value {v}")


def _key_value(k: str, v: Any) -> bytes:
    """A ``KeyValue``'s content: key (field 1, omitted if empty), value (field 2)."""
    return _key(k) + _field(b"\x12", _any(v))


# Encoded attribute entries: a KeyValue's length and content, without the tag
# (span, event, link, resource and scope attributes have different tags). Keyed
# by (key, value, type): ``True == 1`` must not share an entry; arrays also by
# their elements' types. Floats are not cached (0.0 == -0.0) and neither are
# large ints (sequence numbers, byte counts: they rarely repeat). Bounded;
# cleared when full.
_ENTRY_CACHE: dict[tuple[Any, ...], bytes] = {}
_KEY_CACHE: dict[str, bytes] = {}
_CACHE_MAX = 1 << 14
_SMALL_INT = 1 << 10
_CACHEABLE_ITEMS = frozenset((str, bool, int))


def _key(k: str) -> bytes:
    try:
        return _KEY_CACHE[k]
    except KeyError:
        pass
    out = _text(_F1_LEN, k)
    if len(_KEY_CACHE) >= _CACHE_MAX:
        _KEY_CACHE.clear()
    _KEY_CACHE[k] = out
    return out


def _encode_entry(k: str, v: Any) -> bytes | None:
    try:
        kv = _key_value(k, v)
    except Exception as error:  # as the SDK: the attribute is left out, the rest sent
        _logger.warning("Failed to encode attribute %r: %s", k, error)
        return None
    return _varint(len(kv)) + kv


def _entry(k: str, v: Any) -> bytes | None:
    t = type(v)
    key: tuple[Any, ...]
    if t is str or t is bool or t is int:
        key = (k, v, t)
    elif (t is tuple or t is list) and _CACHEABLE_ITEMS.issuperset(map(type, v)):
        key = (k, tuple(v), t, tuple(map(type, v)))
    else:
        return _encode_entry(k, v)
    try:
        return _ENTRY_CACHE[key]
    except KeyError:
        pass
    entry = _encode_entry(k, v)
    if entry is not None:
        if len(_ENTRY_CACHE) >= _CACHE_MAX:
            _ENTRY_CACHE.clear()
        _ENTRY_CACHE[key] = entry
    return entry


def _entries(attrs: Any) -> list[bytes]:
    """The encoded entries of ``attrs`` (a mapping), failed ones left out."""
    # _entry inlined for the common values: this runs ~20 times per collective
    get = _ENTRY_CACHE.get
    out = []
    for k, v in attrs.items():
        t = type(v)
        if t is str or t is bool or (t is int and -_SMALL_INT < v < _SMALL_INT):
            e = get((k, v, t))
            if e is None:
                e = _entry(k, v)
        elif t is int and _INT64_MIN <= v <= _INT64_MAX:
            # a large int: the key's fragment is cached, the value encoded here
            n = _varint(v)
            kv = _KEY_CACHE.get(k) or _key(k)
            kv += b"\x12" + _BYTE[len(n) + 1] + b"\x18" + n
            e = _varint(len(kv)) + kv
        else:
            e = _entry(k, v)
        if e is not None:
            out.append(e)
    return out


def _attr_field(tag: bytes, attrs: Any) -> bytes:
    """``attrs`` as repeated KeyValue field ``tag``; ``b""`` if there are none."""
    if not attrs:
        return b""
    entries = _entries(attrs)
    return tag + tag.join(entries) if entries else b""


# Whole encoded span attribute lists, keyed by the attributes' items: a module's
# span carries the same attributes step after step. The value keeps the
# values' types too (``True == 1``). Only lists of strings, bools, small ints
# and tuples of strings are stored.
_BLOBS: dict[tuple[Any, ...], tuple[tuple[type, ...], bytes]] = {}
_BLOBS_MAX = 1 << 12


def _span_attrs(attrs: Any) -> bytes:
    if not attrs:
        return b""
    items = tuple(attrs.items())
    try:
        hit = _BLOBS.get(items)
    except TypeError:  # an unhashable value (a list)
        return _attr_field(_SPAN_ATTRS, attrs)
    types = tuple(map(type, attrs.values()))
    if hit is not None and hit[0] == types:
        return hit[1]
    blob = _attr_field(_SPAN_ATTRS, attrs)
    for t, v in zip(types, attrs.values()):
        if t is int:
            if not -_SMALL_INT < v < _SMALL_INT:
                return blob
        elif t is tuple:
            if any(type(x) is not str for x in v):
                return blob
        elif t is not str and t is not bool:
            return blob
    if len(_BLOBS) >= _BLOBS_MAX:
        _BLOBS.clear()
    _BLOBS[items] = (types, blob)
    return blob


# ------------------------------------------------------------------ spans
_KIND = {kind: kind.value + 1 for kind in SpanKind}  # OTLP numbers kinds from 1
# Span name (field 5) and kind (field 6), together: a module's spans repeat both
_NAMES: dict[tuple[str, Any], bytes] = {}
_TRACE_IDS: dict[int, bytes] = {}
_STATUS: dict[tuple[Any, Any], bytes] = {}


def _name_kind(name: str, kind: Any) -> bytes:
    try:
        return _NAMES[(name, kind)]
    except KeyError:
        pass
    out = _text(b"\x2a", name) + b"\x30" + _varint(_KIND[kind])
    if len(_NAMES) >= _CACHE_MAX:
        _NAMES.clear()
    _NAMES[(name, kind)] = out
    return out


def _trace_id(trace_id: int) -> bytes:
    # every span of a step shares its trace id
    try:
        return _TRACE_IDS[trace_id]
    except KeyError:
        pass
    out = b"\x0a\x10" + trace_id.to_bytes(16, "big")
    if len(_TRACE_IDS) >= 256:
        _TRACE_IDS.clear()
    _TRACE_IDS[trace_id] = out
    return out


def _status(status: Any) -> bytes:
    if status is None:
        return b""
    key = (status.status_code, status.description)
    try:
        return _STATUS[key]
    except KeyError:
        pass
    # Status: message (field 2), code (field 3, an enum: varint)
    body = _text(_F2_LEN, status.description) + _count(b"\x18", status.status_code.value)
    out = _field(_SPAN_STATUS, body)
    if len(_STATUS) >= 64:
        _STATUS.clear()
    _STATUS[key] = out
    return out


def _trace_state(state: Any) -> bytes:
    if not state:
        return b""
    return _text(b"\x1a", ",".join([f"{k}={v}" for k, v in state.items()]))


def _event(e: Any) -> bytes:
    attrs = e.attributes
    body = b"".join((
        _FIXED64.pack(0x09, e.timestamp) if e.timestamp else b"",
        _text(_F2_LEN, e.name),
        _attr_field(_F3_LEN, attrs),
        _count(b"\x20", _dropped(attrs)),
    ))
    return _field(_SPAN_EVENT, body)


def _link(link: Any) -> bytes:
    ctx = link.context
    attrs = link.attributes
    body = b"".join((
        _trace_id(ctx.trace_id),
        _ID.pack(0x12, 8, ctx.span_id),
        _attr_field(_LINK_ATTRS, attrs),
        _count(b"\x28", _dropped(attrs)),
        _LINK_FLAGS[bool(ctx.is_remote)],
    ))
    return _field(_SPAN_LINK, body)


def _span(span: ReadableSpan) -> bytes:
    """A ``Span``'s content (fields in number order, as protobuf writes them)."""
    ctx, parent, name, kind, start, end, attrs, events, links, status = span_fields(span)
    if type(ctx) is SpanContext:  # a tuple: index it rather than call properties
        head = _trace_id(ctx[0]) + _ID.pack(0x12, 8, ctx[1])
        if ctx[4]:
            head += _trace_state(ctx[4])
    elif ctx is None:  # the SDK's encoder cannot encode it either
        raise ValueError(f"span {name!r} has no SpanContext")
    else:
        head = _trace_id(ctx.trace_id) + _ID.pack(0x12, 8, ctx.span_id)
        head += _trace_state(ctx.trace_state)
    if parent is None:
        flags = _FLAGS[False]
    else:
        is_remote = parent[2] if type(parent) is SpanContext else parent.is_remote
        head += _ID.pack(0x22, 8, parent[1] if type(parent) is SpanContext else parent.span_id)
        flags = _FLAGS[bool(is_remote)]
    if start and end:
        times = _TIMES.pack(0x39, start, 0x41, end)
    else:
        times = (_FIXED64.pack(0x39, start) if start else b"") + (
            _FIXED64.pack(0x41, end) if end else b"")
    tail = b""
    if events:
        tail = b"".join([_event(e) for e in events])
    dropped = _dropped_items(events)
    if dropped:
        tail += b"\x60" + _varint(dropped)
    if links:
        tail += b"".join([_link(link) for link in links])
    dropped = _dropped_items(links)
    if dropped:
        tail += b"\x70" + _varint(dropped)
    return b"".join((
        head,
        _NAMES.get((name, kind)) or _name_kind(name, kind),
        times,
        _span_attrs(attrs),
        _count(b"\x50", _dropped(attrs)),
        tail,
        _STATUS.get((status.status_code, status.description)) or _status(status)
        if status is not None else b"",
        flags,
    ))


# ------------------------------------------------------------------ request
def _scope(scope: Any) -> bytes:
    """An ``InstrumentationScope``'s content; empty for no scope."""
    if scope is None:
        return b""
    return (_text(_F1_LEN, scope.name) + _text(_F2_LEN, scope.version)
            + _attr_field(_F3_LEN, scope.attributes))


class _Group:
    """Spans of one resource (by equality, as the SDK groups them), by scope."""

    __slots__ = ("by_id", "by_value", "resource", "scopes")

    def __init__(self, resource: Any) -> None:
        self.resource = resource
        self.by_id: dict[int, list[bytes]] = {}
        self.by_value: dict[Any, list[bytes]] = {}
        self.scopes: list[tuple[Any, list[bytes]]] = []

    def spans_of(self, scope: Any) -> list[bytes]:
        try:
            return self.by_id[id(scope)]
        except KeyError:
            pass
        key = scope or None  # as the SDK keys them
        parts = self.by_value.get(key)
        if parts is None:
            parts = self.by_value[key] = []
            self.scopes.append((key, parts))
        self.by_id[id(scope)] = parts
        return parts


def encode_spans_protobuf(spans: Sequence[ReadableSpan]) -> bytes:
    """Encode spans as one serialized OTLP ``ExportTraceServiceRequest`` (protobuf).

    The result equals the SDK's ``encode_spans(spans).SerializePartialToString()``;
    an attribute the SDK cannot encode (a value of another type, an int outside
    int64) is left out with a warning, as the SDK does. Text UTF-8 cannot encode
    (a lone surrogate in a span's name, status message, an attribute), on which
    the SDK raises for the whole batch or leaves the attribute out, is written
    with U+FFFD in its place, as the OTLP/JSON encoder writes it. A span the SDK
    cannot encode (no context, an unknown kind, a negative time) raises.

    Example:
        >>> from opentelemetry.sdk.trace import ReadableSpan
        >>> from opentelemetry.trace import SpanContext
        >>> encode_spans_protobuf([]), len(encode_spans_protobuf(
        ...     [ReadableSpan("s", SpanContext(1, 2, False))])) > 0
        (b'', True)
    """
    # runs on the export thread: the collector stays as the training loop set it
    return _encode(spans)


def _encode(spans: Sequence[ReadableSpan]) -> bytes:
    # spans grouped by resource, then by instrumentation scope, both by value
    # in first-seen order like the SDK; commspan's spans share one resource
    # and one scope object, so each object is looked up by identity first
    groups: list[_Group] = []
    by_id: dict[int, _Group] = {}
    by_value: dict[Any, _Group] = {}
    for span in spans:
        res, scope = resource_and_scope(span)
        group = by_id.get(id(res))
        if group is None:
            group = by_value.get(res)
            if group is None:
                group = by_value[res] = _Group(res)
                groups.append(group)
            by_id[id(res)] = group
        parts = group.by_id.get(id(scope))
        if parts is None:
            parts = group.spans_of(scope)
        body = _span(span)
        parts.append(_F2_LEN + _varint(len(body)))
        parts.append(body)
    # one list of fragments and a single join: a batch of thousands of spans
    # is megabytes, and every intermediate join copies it
    out: list[bytes] = []
    for group in groups:
        res = group.resource
        chunks: list[bytes] = []
        for scope, parts in group.scopes:
            head = _field(_F1_LEN, _scope(scope))
            tail = _text(_F3_LEN, scope.schema_url if scope else None)
            chunks.append(_F2_LEN + _varint(len(head) + sum(map(len, parts)) + len(tail)))
            chunks.append(head)
            chunks.extend(parts)
            chunks.append(tail)
        head = _field(_F1_LEN, _attr_field(_F1_LEN, res.attributes))
        tail = _text(_F3_LEN, res.schema_url)
        out.append(_F1_LEN + _varint(len(head) + sum(map(len, chunks)) + len(tail)))
        out.append(head)
        out.extend(chunks)
        out.append(tail)
    return b"".join(out)
