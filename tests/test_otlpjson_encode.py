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
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext

from commspan.otlpjson import encode


def _reference_value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(int(v))}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_reference_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _reference(attrs: dict[str, Any]) -> bytes:
    return orjson.dumps([{"key": k, "value": _reference_value(v)} for k, v in attrs.items()])


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
            assert encode._entries(attrs) == want, attrs
            assert encode._attrs(attrs) == want, attrs


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
            assert encode._attrs(attrs) == _reference(attrs), attrs
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
