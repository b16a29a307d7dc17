"""The OTLP/JSON attribute encoder's caches (plans, templates, whole lists) against a
reference built value by value with orjson, which uses none of them: the same bytes
for every value type, for values that compare equal across types (``True == 1 ==
1.0``, ``0.0 == -0.0``), for text that holds the template's own ``%``, and once the
caches are full."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import SpanContext

from commspan.otlpjson import encode


def _reference_value(v: Any) -> dict[str, Any]:
    """The OTLP/JSON mapping of a value (as the SDK's encoder, then protobuf's JSON
    mapping, write it); raises for what has none (the attribute is left out)."""
    if v is None:
        return {}
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, str):
        return {"stringValue": "".join(v)}  # a str subclass: its characters
    if isinstance(v, int):
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(v)
        return {"intValue": str(int(v))}
    if isinstance(v, float):
        if math.isnan(v):
            return {"doubleValue": "NaN"}
        if math.isinf(v):
            return {"doubleValue": "Infinity" if v > 0 else "-Infinity"}
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_reference_value(x) for x in v]}}
    raise TypeError(v)


def _reference(attrs: dict[str, Any]) -> bytes:
    entries = []
    for k, v in attrs.items():
        try:
            entries.append({"key": k, "value": _reference_value(v)})
        except (TypeError, ValueError):
            continue
    return orjson.dumps(entries)


class _Color(enum.IntEnum):
    RED = 1


class _Name(str):
    pass


_LISTS: list[dict[str, Any]] = [
    # one shape, values of the same types: one plan, the strings written in
    {"op": "all_reduce", "seq": 7, "bytes": 1 << 40, "ok": True, "bw": 0.25},
    {"op": "all_gather", "seq": 8, "bytes": 3, "ok": False, "bw": 1e300},
    # the same keys, other types at the same places (True == 1 == 1.0)
    {"op": "all_reduce", "seq": True, "bytes": 1.0, "ok": 1, "bw": 0},
    {"op": "all_reduce", "seq": 1.0, "bytes": True, "ok": 1.0, "bw": False},
    # what a template must not read as a format: % in keys and text
    {"100%": "50%d of %s", "%(x)s": "%%", "n": 5},
    {"100%": "50%d of %s", "%(x)s": "%%", "n": -(1 << 70)},
    # text JSON must escape
    {"q": 'a "quoted"\\ \n\t\x00 é ☃ \ud7ff', "u": "𝄞"},
    # arrays: element types kept apart, lists and tuples, empty and nested-free
    {"shape": [8, 64, 256], "ranks": (0, 1, 2, 3), "names": ("w", "b")},
    {"shape": [True, False], "ranks": (1, 0), "names": ()},
    {"shape": [1.0, 0.0], "ranks": (True, False), "names": ("w",)},
    {"shape": [], "ranks": (1.5, -0.0), "names": ("1",)},
    # non-finite floats and negative zero, alone and in arrays (0.0 == -0.0 as keys)
    {"x": math.inf, "y": -math.inf, "z": math.nan, "w": -0.0},
    {"x": 0.0, "arr": (0.0, 1), "lst": [0.0]},
    {"x": -0.0, "arr": (-0.0, 1), "lst": [-0.0]},
    {"other": [-0.0], "t": (-0.0,)},
    # nested arrays (the SDK refuses them; hand-made spans may carry them)
    {"nested": ((1,), (2,))},
    {"nested": ((True,), (False,))},
    {"n": ((1,),), "s": "x"},
    {"n": ((True,),), "s": "x"},
    # types the plans leave to the value-by-value path
    {"enum": _Color.RED, "sub": _Name("fqn"), "plain": "fqn"},
    {"none": None, "n": 1},  # type: ignore[dict-item]
    {"unhashable": [[1], [2]], "n": 2},
    # one key, no key
    {"only": "one"},
    {},
]


def _all_lists() -> Iterator[dict[str, Any]]:
    yield from _LISTS
    # the same shapes with new values, so that templates are written again
    for i in range(3):
        yield {"op": f"op{i}%", "seq": i, "bytes": i << 33, "ok": bool(i % 2), "bw": i / 3}
        yield {"100%": f"{i}%", "%(x)s": "%", "n": i}


def test_entries_match_value_by_value_encoding() -> None:
    for _ in range(3):  # cold caches, warm ones, and warm again
        for attrs in _all_lists():
            want = _reference(attrs)
            assert encode._entries(attrs, check=True) == want, attrs
            assert encode._attrs(attrs, check=True) == want, attrs


def test_full_caches_stay_bounded_and_encode_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode, "_PLANS_MAX", 3)
    monkeypatch.setattr(encode, "_TEMPLATES_MAX", 4)
    monkeypatch.setattr(encode, "_BLOBS_MAX", 2)
    monkeypatch.setattr(encode, "_CACHE_MAX", 5)
    for name in ("_PLANS", "_BLOBS", "_ARRAYS", "_ENTRY_CACHE", "_TEXT_CACHE"):
        monkeypatch.setattr(encode, name, {})  # start empty; the module's own come back
    monkeypatch.setattr(encode, "_templates", 0)
    for _ in range(3):
        for attrs in _all_lists():
            assert encode._attrs(attrs, check=True) == _reference(attrs), attrs
            assert len(encode._PLANS) <= 3
            assert sum(len(p[3]) for p in encode._PLANS.values() if p) <= 4
            assert len(encode._BLOBS) <= 2
            assert len(encode._ARRAYS) <= 5 and len(encode._TEXT_CACHE) <= 5


def test_spans_and_events_encode_their_attributes_as_the_reference() -> None:
    """Through the whole encoder: a span's attributes and its events' attributes."""
    ctx = SpanContext(1, 2, False)
    spans = [
        ReadableSpan(
            f"s{i}", ctx, attributes=dict(attrs),
            events=[Event("e", attributes=dict(attrs), timestamp=5)],
        )
        for i, attrs in enumerate(_LISTS)
        if "none" not in attrs and "unhashable" not in attrs  # not attribute values
    ]
    for _ in range(2):
        doc = orjson.loads(encode.encode_spans(spans))
        got = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
        for span, out in zip(spans, got):
            assert span.attributes is not None
            want = orjson.loads(_reference(dict(span.attributes)))
            assert out["attributes"] == want
            assert out["events"][0]["attributes"] == orjson.loads(
                _reference(dict(span.events[0].attributes or {}))
            )


class _Phase(str, enum.Enum):
    FORWARD = "forward"


def _ids_to_base64(obj: Any) -> Any:
    """OTLP/JSON writes ids in hex; protobuf's own JSON mapping wants base64."""
    import base64

    if isinstance(obj, dict):
        return {
            k: base64.b64encode(bytes.fromhex(v)).decode()
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
            else _ids_to_base64(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_ids_to_base64(x) for x in obj]
    return obj


def _sdk_cases(bad: str = "\ud800") -> dict[str, ReadableSpan]:
    """The cases, with ``bad`` where text UTF-8 cannot encode goes (``"\ufffd"``: what
    commspan writes in its place)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanKind, TraceFlags
    from opentelemetry.trace.status import Status, StatusCode

    resource = Resource({"service.name": "x", "commspan.rank": 1}, "https://r")
    scope = InstrumentationScope("other.library", "0.1", "https://s")  # checked values

    def span(attrs: Any = None, events: Any = (), **kw: Any) -> ReadableSpan:
        ctx = SpanContext(0x0123456789ABCDEF0123456789ABCDEF, 0x0123456789ABCDEF, False,
                          trace_flags=TraceFlags(1))
        return ReadableSpan(
            kw.pop("name", "s"), ctx, parent=kw.pop("parent", None),
            resource=kw.pop("resource", resource),
            attributes=attrs, events=events if isinstance(events, BoundedList) else list(events),
            start_time=1, end_time=2**63 - 1,
            kind=kw.pop("kind", SpanKind.INTERNAL),
            status=kw.pop("status", Status(StatusCode.UNSET)),
            instrumentation_scope=kw.pop("scope", scope), links=kw.pop("links", ()),
        )

    def limited(values: dict[str, Any], maxlen: int) -> BoundedAttributes:
        return BoundedAttributes(maxlen=maxlen, attributes=values, immutable=False)

    events = BoundedList(1)
    for i in range(3):
        events.append(Event(f"e{i}", limited({"x": i, "bad": bad, "y": 1}, 2), i))

    return {
        # the SDK's limits dropped some, and a value the fast path cannot encode
        "limits and a bad value": span(
            limited({"a": 1, "bad": "a" + bad, "c": 2**64, "d": 4}, 3), events),
        "plain": span({"a": "x", "b": 7, "c": True, "d": 1.5, "e": ("a", "b"), "f": (1, 2)}),
        "non-finite": span({"n": math.nan, "i": math.inf, "m": -math.inf}),
        "non-finite in arrays": span({"d": (1.0, math.nan, -math.inf)}),
        "beyond int64": span({"big": 2**63, "u": 2**64 - 1, "keep": 1}),
        "int64 bounds": span({"m": 2**63 - 1, "n": -(2**63)}),
        "bytes": span({"b": b"\x00\xff"}),
        "None in an array": span({"n": ("a", None)}),
        "str enum": span({"p": _Phase.FORWARD}),
        "mapping": span({"kv": {"x": 1, "y": "z"}}),
        "lone surrogate": span({"bad": f"a{bad}b", "good": "ok", "many": ("x", bad)}),
        "event values": span({}, [Event("coll", {"seq": 10**12, "f": math.nan, "x": 2**64},
                                        timestamp=5)]),
        "link": span({}, links=[Link(SpanContext(3, 4, True), {"l": 1})]),
        "status": span({}, status=Status(StatusCode.ERROR, "boom \u2603")),
        "scope attributes": span(
            {}, scope=InstrumentationScope("lib", "1", None, {"sa": 1})),
        # str and int values take the resource's template path, which raised for the
        # whole batch
        "resource text": span({}, resource=Resource(
            {"service.name": f"trainer{bad}", f"k{bad}": "v", "commspan.rank": 1},
            f"https://r{bad}")),
        "scope text": span({}, scope=InstrumentationScope(
            f"lib{bad}", f"1{bad}", f"https://s{bad}", {"sa": f"x{bad}", "n": 1})),
    }


@pytest.mark.parametrize("case", sorted(_sdk_cases()))
def test_encoding_is_the_official_mapping_of_the_sdk_message(case: str) -> None:
    """commspan's OTLP/JSON, parsed by protobuf's strict JSON parser, is the message
    the SDK's own protobuf encoder builds: non-finite doubles as "NaN" / "Infinity",
    ints beyond int64 left out (the batch survives),
    bytes, mappings and str enums as their values, resource schema URL and scope
    attributes kept. Text UTF-8 cannot encode (a lone surrogate), which the SDK
    leaves out, is kept with U+FFFD in its place: the SDK's message of that text."""
    import json
    import logging

    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    span = _sdk_cases()[case]
    logging.disable(logging.CRITICAL)  # both encoders log what they leave out
    try:
        expected = sdk([_sdk_cases("\ufffd")[case]])
        ours = encode.encode_spans([span])
    finally:
        logging.disable(logging.NOTSET)
    parsed = json_format.ParseDict(_ids_to_base64(json.loads(ours)), ExportTraceServiceRequest())
    assert json_format.MessageToDict(parsed) == json_format.MessageToDict(expected)
    assert parsed == expected


def test_non_finite_doubles_read_back(tmp_path: Any) -> None:
    """A NaN or infinity written by commspan reads back as itself; a ``null`` double
    (files written before they were strings) reads as NaN instead of failing the line."""
    from commspan.otlpjson.decode import decode_value

    for v in (math.nan, math.inf, -math.inf):
        raw = orjson.loads(encode.encode_spans([ReadableSpan("s", attributes={"v": v})]))
        value = raw["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"][0]["value"]
        back = decode_value(value)
        assert (math.isnan(back) and math.isnan(v)) or back == v
    assert math.isnan(decode_value({"doubleValue": None}))


def _own_spans() -> list[ReadableSpan]:
    """Spans of commspan's scope (the unchecked path, :func:`encode._span_own`): the
    cases it encodes itself and those it hands to :func:`encode._span`."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanKind
    from opentelemetry.trace.span import TraceState
    from opentelemetry.trace.status import Status, StatusCode

    from commspan import semconv

    resource = Resource({"service.name": "x", "commspan.rank": 0})
    scope = InstrumentationScope(semconv.INSTRUMENTATION_SCOPE, "0.1", semconv.SCHEMA_URL)
    ctx = SpanContext(0x00F1E9BB0EDE73BF6F489EA9BB01BD61, 0x302080911327B798, False)
    parent = SpanContext(ctx.trace_id, 0x0000000000000001, False)
    shared = ("weight", "bias")  # the same tuple object in several spans, as modules do
    nested = ((1, 2), ("a", 1.5))
    spans = []

    def span(name: Any = "m forward", attrs: Any = None, events: Any = (), **kw: Any) -> None:
        spans.append(ReadableSpan(
            name, kw.pop("context", ctx), parent=kw.pop("parent", parent), resource=resource,
            attributes=attrs, events=events, links=kw.pop("links", ()),
            kind=kw.pop("kind", SpanKind.INTERNAL), instrumentation_scope=scope,
            status=kw.pop("status", Status(StatusCode.UNSET)),
            start_time=kw.pop("start", 1_790_000_000_000_000_000), end_time=2**63 - 1,
        ))

    module = {"commspan.module.fqn": "layers.0.wq", "commspan.module.type": "Linear",
              "commspan.phase": "forward", "commspan.module.depth": 4,
              "commspan.module.param_names": shared, "commspan.bytes.forward": 1 << 40}
    coll = {"commspan.collective.op": "all_reduce", "commspan.tensor.shape": [8, 64, 256],
            "commspan.collective.seq": 61, "commspan.collective.algbw": 0.33,
            "commspan.pg.ranks": [0, 1, 2, 3], "commspan.ok": True, "nested": nested}
    for i in range(2):  # templates written, then used
        span(attrs=dict(module, **{"commspan.collective.seq": i}))
        span(attrs=dict(module), events=[Event("all_reduce", dict(coll), timestamp=5 + i)])
    span(attrs={"t": (1, 2)})
    span(attrs={"t": (True, 2)})  # equal to (1, 2), another object: not its template
    span(attrs={"t": (1.0, 2)})
    span(attrs={"t": shared, "n": nested})
    span(attrs={"t": ("weight", "bias")})  # equal to shared, another object
    span(attrs={"t": ([1], 2)})  # a tuple holding a list: no template (unhashable)
    span(attrs={"x": True}), span(attrs={"x": 1}), span(attrs={"x": 1.0}), span(attrs={"x": -0.0})
    span(attrs={"d": (1.0, math.nan, -math.inf), "e": ()})
    span(attrs={"m": 2**63 - 1, "n": -(2**63), "l": [True, 1, 1.0]})
    # text: non-ASCII, JSON escapes, the templates' own %
    span("模块 ☃ 100% %s %d forward", {"100%": "50%d of %s", "q": 'a "q"\\ \n\x00 é 𝄞'})
    span("% %% %(x)s", {"%(x)s": ("%", "%%"), "n": 7}, [Event("%d", {"%s": "%"}, 3)])
    # empty attributes, events with and without attributes
    span(attrs={}), span(attrs=None)
    span(attrs={"a": 1}, events=[Event("e", None, 1), Event("f", {}, 2),
                                 Event("g", {"s": "x", "f": 2.5, "l": ["a"]}, 3)])
    span(attrs=BoundedAttributes(maxlen=None, attributes={"b": "bounded"}))
    # what _span_own hands to _span (the same bytes either way)
    span(attrs={"a": 1}, parent=None)
    span(attrs={"a": 1}, parent=SpanContext(ctx.trace_id, 9, True))
    span(attrs={"a": 1}, kind=SpanKind.CLIENT)
    span(attrs={"a": 1}, links=[Link(SpanContext(3, 4, True), {"l": 1})])
    span(attrs={"a": 1}, status=Status(StatusCode.ERROR, "boom \u2603 %s"))
    span(attrs={"a": 1}, status=Status(StatusCode.OK))
    span(attrs={"a": 1}, context=SpanContext(ctx.trace_id, 5, False,
                                             trace_state=TraceState([("k", "v")])))
    span(_Name("sub"), {"p": _Phase.FORWARD, "s": _Name("x"), "b": b"\x00"})
    span(attrs={"e": _Color.RED, "n": None})
    # what the fast path cannot encode: the checked path leaves it out
    span(attrs={"big": 2**64, "keep": 1})
    span(attrs={"t": (1, 2**64)})
    span("bad \ud800", {"bad": "a\ud800", "many": ("x", "\udfff")},
         [Event("e\ud800", {"v": "\ud800"}, 1)])
    return spans


def _general(monkeypatch: pytest.MonkeyPatch, spans: list[ReadableSpan]) -> bytes:
    """What :func:`encode._span` writes for ``spans``: the fast path turned off."""
    with monkeypatch.context() as m:
        m.setattr(encode, "_span_own", lambda span: encode._span(span))
        return encode.encode_spans(spans)


@pytest.mark.parametrize("limits", [False, True])
def test_own_spans_encode_as_the_general_path(monkeypatch: pytest.MonkeyPatch,
                                              limits: bool) -> None:
    """commspan's spans, whole templates each, give the bytes of the span-by-span
    encoder: alone and together, with cold, warm and full caches."""
    import logging

    for name in ("_SPAN_PLANS", "_EVENT_PLANS", "_HEADS"):
        monkeypatch.setattr(encode, name, {})
    monkeypatch.setattr(encode, "_own_templates", 0)
    if limits:
        monkeypatch.setattr(encode, "_PLANS_MAX", 3)
        monkeypatch.setattr(encode, "_TEMPLATES_MAX", 4)
    spans = _own_spans()
    logging.disable(logging.CRITICAL)  # the checked path logs what it leaves out
    try:
        for _ in range(3):
            assert encode.encode_spans(spans) == _general(monkeypatch, spans)
            for span in spans:
                assert encode.encode_spans([span]) == _general(monkeypatch, [span]), span.name
    finally:
        logging.disable(logging.NOTSET)
    assert len(encode._SPAN_PLANS) <= encode._PLANS_MAX
    assert encode._own_templates <= encode._TEMPLATES_MAX


def _reference_span(span: ReadableSpan) -> dict[str, Any]:
    """A span of finite values as OTLP/JSON, value by value with orjson."""
    def attrs(values: Any) -> list[dict[str, Any]]:
        return [{"key": k, "value": _reference_value(v)} for k, v in (values or {}).items()]

    assert span.context is not None
    out: dict[str, Any] = {"traceId": f"{span.context.trace_id:032x}",
                           "spanId": f"{span.context.span_id:016x}"}
    if span.parent is not None:
        out["parentSpanId"] = f"{span.parent.span_id:016x}"
    out.update(name=span.name, kind=1, startTimeUnixNano=str(span.start_time),
               endTimeUnixNano=str(span.end_time), attributes=attrs(span.attributes))
    if span.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name,
                          "attributes": attrs(e.attributes)} for e in span.events]
    out.update(flags=0x100, status={})
    return out


def test_own_spans_encode_as_the_reference() -> None:
    """The spans the fast path writes itself, finite values: byte for byte what orjson
    writes for the mapping built value by value."""
    spans = [s for s in _own_spans()[:22] if s.name != "bad \ud800"]
    spans = [s for s in spans if not any(  # NaN, infinities: see the general path test
        isinstance(v, tuple) and any(isinstance(x, float) and not math.isfinite(x) for x in v)
        for v in (s.attributes or {}).values())]
    for _ in range(2):
        for span in spans:
            got = encode.encode_spans([span])
            body = got[got.index(b'"spans":[') + 9:-6]  # the span alone
            assert body == orjson.dumps(_reference_span(span)), span.name
