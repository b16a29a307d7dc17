"""OTLP/JSON encoding of SDK spans: one ``ExportTraceServiceRequest`` as bytes.

Spans become the OTLP/JSON encoding of the OpenTelemetry protocol (the
``file`` exporter and ``otlpjson`` receiver of the Collector read it), built
as byte fragments and joined once. Module spans repeat the same names, types,
phases and parameters step after step, and collective events the same keys
with values of the same types, so attribute lists are encoded from ``%``
templates (one plan per keys and value types; the strings written in, the
numbers formatted in), and whole attribute lists, arrays, strings and trace
ids are cached, all in bounded module-level dictionaries (plans and templates
stop growing when full; the others are cleared). commspan's own spans and
their events go further: each is one template of the whole span (or event),
its name and attribute strings written in (``_span_own``).
They are module-level on purpose: every exporter of the process shares them,
and they hold only bytes built from attribute values, never spans.

Example:
    >>> from opentelemetry.sdk.trace import ReadableSpan
    >>> encode_spans([ReadableSpan("s")])[:17]
    b'{"resourceSpans":'
"""

from __future__ import annotations

import base64
import contextlib
import gc
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from operator import is_, itemgetter
from typing import Any

import orjson
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Link, SpanContext, SpanKind
from opentelemetry.trace.span import DEFAULT_TRACE_STATE as _NO_STATE
from opentelemetry.trace.status import Status, StatusCode

from commspan import semconv
from commspan._errors import Once

__all__ = [
    "dropped_attributes",
    "dropped_items",
    "encode_lines",
    "encode_spans",
    "paused_gc",
    "resource_and_scope",
    "span_fields",
]

_logger = logging.getLogger(__name__)
_WARNED = Once()  # attributes left out: logged once per key and value type
_SCOPE = semconv.INSTRUMENTATION_SCOPE  # the instrumentation scope of commspan's spans
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic GC while parsing many small dicts (the readers): none of
    them form cycles, and collections triggered by the allocations cost more
    than the work itself. Process-wide: never used on an export thread, which
    runs beside a training loop that may manage the collector itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _value(v: Any) -> dict[str, Any]:
    """An ``AnyValue`` as the OTLP/JSON mapping writes it (the SDK's protobuf encoder,
    then protobuf's JSON mapping): subclasses as their base type, non-finite
    doubles as ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``, bytes in base64.

    Raises:
        ValueError: an int outside int64. TypeError: a value of another type.
        (The attribute is then left out, as the SDK leaves it out.)
    """
    t = type(v)
    if t is str:
        return {"stringValue": v}
    if t is int and _INT64_MIN <= v <= _INT64_MAX:
        return {"intValue": str(v)}
    if t is bool:
        return {"boolValue": v}
    if t is float:
        return {"doubleValue": v if v - v == 0 else _nonfinite(v)}
    if t is list or t is tuple:
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    if v is None:
        return {}
    if isinstance(v, bool):
        return {"boolValue": bool(v)}
    if isinstance(v, str):
        return {"stringValue": str.__str__(v)}  # a str enum: its value, not its name
    if isinstance(v, int):
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError(f"Value out of range: {v}")
        return {"intValue": str(int(v))}
    if isinstance(v, float):
        return _value(float(v))
    if isinstance(v, bytes):
        return {"bytesValue": base64.b64encode(v).decode("ascii")}
    if isinstance(v, Sequence):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    if isinstance(v, Mapping):
        return {"kvlistValue": {"values": [{"key": str(k), "value": _value(x)}
                                           for k, x in v.items()]}}
    raise TypeError(f"Invalid type {type(v)} of value {v}")


def _nonfinite(v: float) -> str:
    return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")


def _double(v: float) -> bytes:
    """A double's JSON: a number, or the mapping's string for NaN and the infinities
    (orjson would write ``null``)."""
    if v - v == 0:
        return _dumps(v)
    return b'"%s"' % _nonfinite(v).encode()


def _checked_entry(k: str, v: Any) -> bytes | None:
    """``{"key":k,"value":...}``, or ``None`` (logged) for a value the mapping has no
    encoding for (an int beyond int64, another type, text with a lone surrogate)."""
    try:
        return _dumps({"key": k, "value": _value(v)})
    except Exception as error:  # as the SDK: the attribute is left out, the rest sent
        _WARNED.warn(_logger, f"{k}\0{type(v).__name__}",
                     "commspan: attribute %r is left out of the OTLP/JSON encoding: %s "
                     "(not logged again for this key and type)", k, error)
        return None


# Encoded attribute entries (``{"key":k,"value":{...}}`` as JSON bytes), reused:
# module spans repeat the same names, types and phases step after step.
# Bounded; cleared when full.
_ENTRY_CACHE: dict[tuple[str, Any, type], bytes] = {}
_TEXT_CACHE: dict[str, bytes] = {}
_CACHE_MAX = 1 << 14
_SMALL_INT = 1 << 10
# element types of arrays whose encoding equal arrays share (not float: 0.0 == -0.0;
# not arrays, whose own elements' types a key would not show)
_CACHED_ELEMENTS = frozenset((str, int, bool))
_dumps = orjson.dumps


def _entry(k: str, v: Any) -> bytes | None:
    t = type(v)
    if t is list or t is tuple:  # cached by elements and their types there
        try:
            return b'{"key":%s,"value":%s}' % (_text(k), _array_value(v))
        except Exception:  # an element the mapping cannot encode
            return _checked_entry(k, v)
    if t is int and not -_SMALL_INT < v < _SMALL_INT and _INT64_MIN <= v <= _INT64_MAX:
        # large ints (sequence numbers, byte counts, steps) rarely repeat
        return b'{"key":%s,"value":{"intValue":"%d"}}' % (_text(k), v)
    if t is float:
        return b'{"key":%s,"value":{"doubleValue":%s}}' % (_text(k), _double(v))
    key = (k, v, t)
    try:
        return _ENTRY_CACHE[key]
    except KeyError:
        pass
    except TypeError:  # unhashable value
        return _checked_entry(k, v)
    found = _checked_entry(k, v)
    if found is None:
        return None
    # orjson's result keeps its ~4 kB build buffer: cache an exact-size copy
    entry = bytes(memoryview(found))
    if len(_ENTRY_CACHE) >= _CACHE_MAX:
        _ENTRY_CACHE.clear()
    _ENTRY_CACHE[key] = entry
    return entry


def _entries_one_by_one(attrs: Any) -> bytes:
    # attribute lists :func:`_entries` has no plan for (a value of another type:
    # a str or int subclass, None, a dict)
    get = _ENTRY_CACHE.get
    out = []
    for k, v in attrs.items():
        t = type(v)
        e: bytes | None
        if t is str or t is bool or (t is int and -_SMALL_INT < v < _SMALL_INT):
            e = get((k, v, t))
            if e is None:
                e = _entry(k, v)
        elif t is int and _INT64_MIN <= v <= _INT64_MAX:
            e = b'{"key":%s,"value":{"intValue":"%d"}}' % (_text(k), v)
        else:
            e = _entry(k, v)
        if e is not None:
            out.append(e)
    return b"[" + b",".join(out) + b"]"


# Encoding plans. Spans and events of commspan carry the same keys with values
# of the same types call after call (a collective event: op, group, placements,
# module as strings; seq, bytes, duration as ints), so an attribute list is
# encoded as a ``%`` template: for each (keys, value types) a plan says which
# values are written into the template (strings, bools: they repeat) and which
# are formatted into it on each call (ints as ``%d``, floats and arrays as
# ``%s``). One template per distinct tuple of written values. Bounded: once
# full, what has no plan or template is encoded entry by entry (the same bytes,
# at the speed of the caches of single entries) rather than clearing them all,
# which would rebuild templates over and over for a model with more distinct
# (module, op, placement) combinations than fit.
_PLANS: dict[tuple[tuple[str, ...], tuple[type, ...]], Any] = {}
_PLANS_MAX = 1 << 10
_TEMPLATES_MAX = 1 << 13  # templates of all plans together
_templates = 0
_NO_PLAN: Any = ()  # a value type the plans do not handle: entry by entry
_ARRAYS: dict[tuple[tuple[Any, ...], tuple[type, ...]], bytes] = {}


def _pick(positions: list[int]) -> Any:
    """A function returning the values at ``positions`` of a tuple, as a tuple."""
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda values: (values[i],)
    return itemgetter(*positions)


def _array_value(v: Any) -> bytes:
    """The ``{"arrayValue":...}`` of a list or tuple, cached by its elements and
    their types (``(True,) == (1,) == (1.0,)``)."""
    try:
        types = tuple(map(type, v))
        # 0.0 == -0.0, and nested arrays hide their elements' types from the key:
        # only arrays of str, int and bool are cached (the usual ones)
        if not _CACHED_ELEMENTS.issuperset(types):
            return _dumps(_value(v))
        key = (tuple(v), types)
        out = _ARRAYS.get(key)
    except TypeError:  # an unhashable element
        return _dumps(_value(v))
    if out is None:
        out = bytes(memoryview(_dumps(_value(v))))  # exact-size copy, see _entry
        if len(_ARRAYS) >= _CACHE_MAX:
            _ARRAYS.clear()
        _ARRAYS[key] = out
    return out


def _plan(signature: tuple[tuple[str, ...], tuple[type, ...]]) -> Any:
    """``(written values, formatted values, converters, templates, signature, ints,
    may repeat, has floats)`` for attribute lists of these keys and value
    types, or ``_NO_PLAN``.
    "May repeat": no float or list, so a whole list may be kept by :func:`_attrs`
    when its ints are small too."""
    written: list[int] = []
    formatted: list[int] = []
    ints: list[int] = []
    convert: list[tuple[int, Any]] = []
    for i, t in enumerate(signature[1]):
        if t is str or t is bool:
            written.append(i)
        elif t is int:
            ints.append(i)
            formatted.append(i)
        elif t is float:
            convert.append((len(formatted), _dumps))
            formatted.append(i)
        elif t is list or t is tuple:
            convert.append((len(formatted), _array_value))
            formatted.append(i)
        else:
            return _NO_PLAN
    repeats = float not in signature[1] and list not in signature[1]
    # floats: orjson's null for a non-finite one is looked for afterwards (arrays are
    # encoded by _value, which writes the mapping's strings)
    floats = float in signature[1]
    return (_pick(written), _pick(formatted), tuple(convert), {}, signature, _pick(ints), repeats,
            floats)


def _template(plan: Any, written: tuple[Any, ...]) -> bytes:
    global _templates
    keys, types = plan[4]
    values = iter(written)
    parts = []
    for k, t in zip(keys, types):
        head = b'{"key":%s,"value":' % _text(k).replace(b"%", b"%%")
        if t is str:
            body = b'{"stringValue":%s}}' % _text(next(values)).replace(b"%", b"%%")
        elif t is bool:
            body = b'{"boolValue":true}}' if next(values) else b'{"boolValue":false}}'
        elif t is int:
            body = b'{"intValue":"%d"}}'
        elif t is float:
            body = b'{"doubleValue":%s}}'
        else:
            body = b"%s}"
        parts.append(head + body)
    template = b"[" + b",".join(parts) + b"]"
    _templates += 1
    plan[3][written] = template
    return template


def _entries(attrs: Any, check: bool = False) -> bytes:
    """The OTLP/JSON list of ``{"key":...,"value":...}`` of a mapping (``check``: see
    :func:`_encode`)."""
    values = tuple(attrs.values())
    return _encode(attrs, values, tuple(map(type, values)), None, check)


def _encode(
    attrs: Any, values: tuple[Any, ...], types: tuple[type, ...], items: Any, check: bool = False
) -> bytes:
    """:func:`_entries`, given the values and their types; when ``items`` is given, the
    list is also kept in ``_BLOBS`` under it if its values repeat (see ``_attrs``).

    ``check``: the values may hold ints beyond int64, which the mapping has no
    encoding for (they are left out), or NaN and infinities (which orjson would
    write as ``null``). commspan's own span and event attributes hold neither
    (sizes, counts, nanoseconds, step numbers it checks, bandwidths of positive
    durations), so their encoding skips the checks; resources and spans of
    other instrumentation scopes take them."""
    signature = (tuple(attrs), types)
    plan = _PLANS.get(signature)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            return _entries_one_by_one(attrs)
        plan = _PLANS[signature] = _plan(signature)
    if plan is _NO_PLAN:
        return _entries_one_by_one(attrs)
    if check:
        ints = plan[5](values)
        if ints and (min(ints) < _INT64_MIN or max(ints) > _INT64_MAX):
            return _entries_one_by_one(attrs)  # which leaves that attribute out
    written = plan[0](values)
    template = plan[3].get(written)
    if template is None:
        if _templates >= _TEMPLATES_MAX:
            return _entries_one_by_one(attrs)
        template = _template(plan, written)
    if plan[2]:
        formatted = list(plan[1](values))
        for j, convert in plan[2]:
            formatted[j] = convert(formatted[j])
        blob: bytes = template % tuple(formatted)
        if check and plan[7] and b"null" in blob:
            # orjson writes NaN and the infinities as null: those values (and text
            # holding "null", rarely) take the path that writes the mapping's strings
            return _entries_one_by_one(attrs)
    else:
        blob = template % plan[1](values)
    if items is not None and plan[6]:
        ints = plan[5](values)
        if not ints or (-_SMALL_INT < min(ints) and max(ints) < _SMALL_INT):
            elements = _element_types(attrs) if _mixed_arrays(attrs) else None
            # arrays of floats (0.0 == -0.0) or of arrays (their elements' types are
            # not in the key): equal items may encode differently
            if elements is None or all(map(_CACHED_ELEMENTS.issuperset, elements)):
                if len(_BLOBS) >= _BLOBS_MAX:
                    _BLOBS.clear()
                _BLOBS[items] = (types, blob, elements)
    return blob


# Whole encoded attribute lists, keyed by the attributes' items: a module's
# span carries the same attributes (name, type, phase, depth, parameters,
# collective counts) step after step. The value keeps the types of the values
# too, since ``True == 1 == 1.0`` would otherwise let a bool hit an int's
# entry. Lists (unhashable) and values that rarely repeat (floats, large ints:
# step numbers, sequence numbers, byte counts) are not stored.
# items -> (the values' types, the encoded list, the array elements' types when an
# array holds anything but strings, else None)
_BLOBS: dict[tuple[Any, ...], tuple[tuple[type, ...], bytes, tuple[Any, ...] | None]] = {}
_BLOBS_MAX = 1 << 12


def _attrs(attrs: Any, check: bool = False) -> bytes:
    if not attrs:
        return b"[]"
    items: Any = tuple(attrs.items())
    types = tuple(map(type, attrs.values()))
    try:
        hit = _BLOBS.get(items)
    except TypeError:  # a list value
        hit = items = None
    if hit is not None and hit[0] == types and (hit[2] is None or hit[2] == _element_types(attrs)):
        return hit[1]
    return _encode(attrs, tuple(attrs.values()), types, items, check)


def _mixed_arrays(attrs: Any) -> bool:
    """Whether an array value holds anything but strings: ``True == 1 == 1.0``, so a
    cached list of those must also match the element types it was encoded with."""
    return any(
        type(v) is tuple and any(type(x) is not str for x in v) for v in attrs.values()
    )


def _element_types(attrs: Any) -> tuple[Any, ...]:
    return tuple(tuple(map(type, v)) for v in attrs.values() if type(v) is tuple)


def _text(value: str) -> bytes:
    try:
        return _TEXT_CACHE[value]
    except KeyError:
        pass
    out = bytes(memoryview(_dumps(value)))  # exact-size copy, see _entry
    if len(_TEXT_CACHE) >= _CACHE_MAX:
        _TEXT_CACHE.clear()
    _TEXT_CACHE[value] = out
    return out


_UNSET = StatusCode.UNSET
_INTERNAL = SpanKind.INTERNAL
_STATUS = {code: code.value for code in StatusCode}
_KIND = {kind: kind.value + 1 for kind in SpanKind}  # OTLP numbers kinds from 1
_HEX32: dict[int, bytes] = {}
_LOCAL = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_REMOTE = 0x300  # ... | SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def _trace_hex(trace_id: int) -> bytes:
    # every span of a step shares its trace id: format it once
    try:
        return _HEX32[trace_id]
    except KeyError:
        pass
    out = b"%032x" % trace_id
    if len(_HEX32) >= 256:
        _HEX32.clear()
    _HEX32[trace_id] = out
    return out


def span_fields(span: ReadableSpan) -> tuple[Any, ...]:
    """``(context, parent, name, kind, start, end, attributes, events, links, status)``
    of a span, for the encoders.

    ReadableSpan's public properties are Python calls that wrap attributes and
    events in new objects on every access: the stored fields of SDK spans are read
    directly, the properties of anything else.
    """
    try:
        return (span._context, span._parent, span._name, span._kind, span._start_time,
                span._end_time, span._attributes, span._events, span._links, span._status)
    except AttributeError:
        return (span.context, span.parent, span.name, span.kind, span.start_time,
                span.end_time, span.attributes, span.events, span.links, span.status)


def dropped_attributes(attrs: Any) -> int:
    """What the SDK's ``dropped_attributes`` says of an attribute mapping (an ABC's
    isinstance is slow: the common types are told apart first)."""
    t = type(attrs)
    if t is BoundedAttributes:
        return attrs.dropped  # type: ignore[no-any-return]
    if attrs is None or t is dict:
        return 0
    return attrs.dropped if isinstance(attrs, BoundedAttributes) else 0


def dropped_items(items: Any) -> int:
    """What the SDK's ``dropped_events`` and ``dropped_links`` say of a span's events
    or links."""
    t = type(items)
    if t is tuple or t is list or items is None:
        return 0
    return items.dropped if isinstance(items, BoundedList) else 0


def resource_and_scope(span: ReadableSpan) -> tuple[Any, Any]:
    """A span's resource and instrumentation scope (stored fields, as :func:`span_fields`)."""
    try:
        return span._resource, span._instrumentation_scope
    except AttributeError:
        return span.resource, span.instrumentation_scope


def _span(span: ReadableSpan, check: bool = False) -> bytes:
    try:  # span_fields, inlined: this runs for every span
        ctx, parent, name, kind, start, end, attrs, events, links, status = (
            span._context, span._parent, span._name, span._kind, span._start_time,
            span._end_time, span._attributes, span._events, span._links, span._status)
    except AttributeError:
        ctx, parent, name, kind, start, end, attrs, events, links, status = span_fields(span)
    tail = b',"events":[%s]' % _events(events, check) if events else b""
    if links:
        tail += b',"links":[%s]' % b",".join(
            [
                b'{"traceId":"%032x","spanId":"%016x","attributes":%s%s,"flags":%d}'
                % (
                    link.context.trace_id,
                    link.context.span_id,
                    _attrs(link.attributes, True),
                    _dropped_json(dropped_attributes(link.attributes)),
                    _REMOTE if link.context.is_remote else _LOCAL,
                )
                for link in links
            ]
        )
    if check:  # what the SDK's limits left out, if any (commspan's spans have no limits)
        tail += _dropped_json(dropped_attributes(attrs))
        n = dropped_items(events)
        if n:
            tail += b',"droppedEventsCount":%d' % n
        n = dropped_items(links)
        if n:
            tail += b',"droppedLinksCount":%d' % n
    if type(ctx) is SpanContext:  # a tuple: index it rather than call properties
        trace_id, span_id, trace_state = ctx[0], ctx[1], ctx[4]
    elif ctx is not None:
        trace_id, span_id, trace_state = ctx.trace_id, ctx.span_id, ctx.trace_state
    else:
        trace_id, span_id, trace_state = 0, 0, None
    if trace_state is not None and trace_state is not _NO_STATE and len(trace_state):
        tail += b',"traceState":%s' % _dumps(trace_state.to_header())
    if parent is None:
        parent_json, flags = b"", _LOCAL
    elif type(parent) is SpanContext:
        parent_json = b'"parentSpanId":"%016x",' % parent[1]
        flags = _REMOTE if parent[2] else _LOCAL
    else:
        parent_json = b'"parentSpanId":"%016x",' % parent.span_id
        flags = _REMOTE if parent.is_remote else _LOCAL
    try:
        code = status._status_code
    except AttributeError:
        code = status.status_code
    if code is _UNSET:
        status_json = b"{}"
    elif status.description:
        status_json = b'{"code":%d,"message":%s}' % (_STATUS[code], _dumps(status.description))
    else:
        status_json = b'{"code":%d}' % _STATUS[code]
    return _SPAN % (
        _trace_hex(trace_id),
        span_id,
        parent_json,
        _text(name),
        1 if kind is _INTERNAL else _KIND.get(kind, 1),
        start or 0,
        end or 0,
        _attrs(attrs, check),
        tail,
        # SpanFlags: whether the parent is remote is known (and whether it is)
        flags,
        status_json,
    )


# commspan's own spans (their scope's; ``check`` off, see :func:`_encode`), each
# in a single ``%``: a module's span repeats its name, keys, strings and
# parameter tuples step after step, and its collective events their keys and
# strings, so a whole span (or event) is a template with its name and the
# attributes' strings and bools written in, and the ids, times, ints, floats
# and lists formatted in. One plan per (keys, value types), one template per
# tuple of the values written in. Unlike ``_PLANS``, tuples are written in
# too: a module's parameter names, placements and shapes are the same tuple
# objects every step, and a template serves the very tuples it was built from
# (by identity: equal tuples may hold values of other types, ``(1,) ==
# (True,)``; and only tuples of values that cannot change are written in).
# Internal spans of local contexts with a parent, an unset status and no
# links take this path; anything else (a root span, another value type, other
# tuple objects, full tables) takes :func:`_span`, which writes the same bytes.
# Bounded as the plans are: once full, they stop growing.
_SPAN_PLANS: dict[tuple[tuple[str, ...], tuple[type, ...]], Any] = {}
_EVENT_PLANS: dict[tuple[tuple[str, ...], tuple[type, ...]], Any] = {}
_own_templates = 0
_IMMUTABLE = frozenset((str, int, bool, float))
_HEADS: dict[int, bytes] = {}  # trace id -> b'{"traceId":"...","spanId":"'
_SPAN_HEAD = b'%s%016x","parentSpanId":"%016x","name":'
_SPAN_TIMES = b',"kind":1,"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":'
_SPAN_TAIL = b'%s,"flags":256,"status":{}}'
_EVENT_HEAD = b'{"timeUnixNano":"%d","name":'
_EVENT_TAIL = b"}"


def _own_plan(signature: tuple[tuple[str, ...], tuple[type, ...]]) -> Any:
    """``(pick written values, templates, converters, pick formatted values, pick
    tuples, signature)`` for a name (value 0) and attributes of these keys and
    value types, or ``_NO_PLAN``."""
    written: list[int] = [0]
    formatted: list[int] = []
    tuples: list[int] = []
    convert: list[tuple[int, Any]] = []
    if signature[1][0] is not str:
        return _NO_PLAN
    for i, t in enumerate(signature[1][1:], 1):
        if t is str or t is bool:
            written.append(i)
        elif t is tuple:
            written.append(i)
            tuples.append(i)
        elif t is int:
            formatted.append(i)
        elif t is float:
            convert.append((len(formatted), _dumps))
            formatted.append(i)
        elif t is list:
            convert.append((len(formatted), _array_value))
            formatted.append(i)
        else:
            return _NO_PLAN
    return (_pick(written), {}, tuple(convert), _pick(formatted),
            _pick(tuples) if tuples else None, signature)


def _frozen(v: Any) -> bool:
    """Whether a tuple holds only values that cannot change (so the same tuple object
    always encodes the same)."""
    for x in v:
        t = type(x)
        if t not in _IMMUTABLE and not (t is tuple and _frozen(x)):
            return False
    return True


def _escaped(b: bytes) -> bytes:
    return b.replace(b"%", b"%%")


def _own_template(plan: Any, written: tuple[Any, ...], values: tuple[Any, ...],
                  head: bytes, mid: bytes, tail: bytes) -> Any:
    """``(template, the tuples written into it)`` for these written values (the
    name first), or ``None`` (full, or a tuple that may change or that the mapping
    cannot encode)."""
    global _own_templates
    if _own_templates >= _TEMPLATES_MAX:
        return None
    keys, types = plan[5]
    tuples = plan[4](values) if plan[4] is not None else ()
    if not all(map(_frozen, tuples)):
        return None
    it = iter(written)
    parts = []
    try:
        name = _escaped(_text(next(it)))
        for k, t in zip(keys, types[1:]):
            key = b'{"key":%s,"value":' % _escaped(_text(k))
            if t is str:
                body = b'{"stringValue":%s}}' % _escaped(_text(next(it)))
            elif t is bool:
                body = b'{"boolValue":true}}' if next(it) else b'{"boolValue":false}}'
            elif t is tuple:
                body = _escaped(_array_value(next(it))) + b"}"
            elif t is int:
                body = b'{"intValue":"%d"}}'
            elif t is float:
                body = b'{"doubleValue":%s}}'
            else:
                body = b"%s}"
            parts.append(key + body)
    except Exception:  # an element the mapping cannot encode: _span decides
        return None
    hit = (head + name + mid + b"[" + b",".join(parts) + b"]" + tail, tuples)
    _own_templates += 1
    plan[1][written] = hit
    return hit


def _head(trace_id: int) -> bytes:
    out = b'{"traceId":"%032x","spanId":"' % trace_id
    if len(_HEADS) >= 256:
        _HEADS.clear()
    _HEADS[trace_id] = out
    return out


def _span_own(span: ReadableSpan) -> bytes:
    """:func:`_span` of a span of commspan's scope (unchecked): the same bytes."""
    try:
        ctx, parent, name, kind, start, end, attrs, events, links, code = (
            span._context, span._parent, span._name, span._kind, span._start_time,
            span._end_time, span._attributes, span._events, span._links,
            span._status._status_code)
    except AttributeError:
        return _span(span)
    if (type(ctx) is not SpanContext or type(parent) is not SpanContext or parent[2] or links
            or kind is not _INTERNAL or code is not _UNSET):
        return _span(span)
    state = ctx[4]
    if state is not _NO_STATE and state is not None and len(state):
        return _span(span)
    if attrs:
        values = (name, *attrs.values())
        signature = (tuple(attrs), tuple(map(type, values)))
    else:
        values = (name,)
        signature = ((), (type(name),))
    plan = _SPAN_PLANS.get(signature)
    if plan is None:
        if len(_SPAN_PLANS) >= _PLANS_MAX:
            return _span(span)
        plan = _SPAN_PLANS[signature] = _own_plan(signature)
    if plan is _NO_PLAN:
        return _span(span)
    written = plan[0](values)
    try:
        hit = plan[1].get(written)
    except TypeError:  # a tuple holding a list
        return _span(span)
    if hit is None:
        hit = _own_template(plan, written, values, _SPAN_HEAD, _SPAN_TIMES, _SPAN_TAIL)
        if hit is None:
            return _span(span)
    if hit[1] and not all(map(is_, plan[4](values), hit[1])):
        return _span(span)  # equal tuples, not the ones the template was built from
    tail = b',"events":[%s]' % b",".join([_event_own(e) for e in events]) if events else b""
    if plan[2]:
        formatted = list(plan[3](values))
        for j, convert in plan[2]:
            formatted[j] = convert(formatted[j])
    else:
        formatted = plan[3](values)
    trace_id = ctx[0]
    return hit[0] % (  # type: ignore[no-any-return]
        _HEADS.get(trace_id) or _head(trace_id), ctx[1], parent[1], start or 0, end or 0,
        *formatted, tail)


def _event_own(e: Any) -> bytes:
    """One event of :func:`_span_own`: the bytes :func:`_events` writes.

    Its plan and template lookup repeats :func:`_span_own`'s inline, on purpose:
    both run once per span or event on the export thread, where a shared helper
    would add a Python call to each (the path exists for throughput)."""
    try:
        ts, name, attrs = e._timestamp, e._name, e._attributes
    except AttributeError:
        ts, name, attrs = e.timestamp, e.name, e.attributes
    if attrs:
        values = (name, *attrs.values())
        signature = (tuple(attrs), tuple(map(type, values)))
    else:
        values = (name,)
        signature = ((), (type(name),))
    plan = _EVENT_PLANS.get(signature)
    if plan is None:
        if len(_EVENT_PLANS) >= _PLANS_MAX:
            return _events((e,))
        plan = _EVENT_PLANS[signature] = _own_plan(signature)
    if plan is _NO_PLAN:
        return _events((e,))
    written = plan[0](values)
    try:
        hit = plan[1].get(written)
    except TypeError:
        return _events((e,))
    if hit is None:
        hit = _own_template(plan, written, values, _EVENT_HEAD, b',"attributes":', _EVENT_TAIL)
        if hit is None:
            return _events((e,))
    if hit[1] and not all(map(is_, plan[4](values), hit[1])):
        return _events((e,))
    if plan[2]:
        formatted = list(plan[3](values))
        for j, convert in plan[2]:
            formatted[j] = convert(formatted[j])
        return hit[0] % (ts, *formatted)  # type: ignore[no-any-return]
    return hit[0] % (ts, *plan[3](values))  # type: ignore[no-any-return]


def _span_other(span: ReadableSpan) -> bytes:
    """:func:`_span` of a span of another scope, checked."""
    return _span(span, True)


def _events(events: Any, check: bool = False) -> bytes:
    # events rarely repeat whole (a collective's sequence number differs each
    # time): no blob cache, the attribute plans only
    out = []
    for e in events:
        try:
            ts, name, attrs = e._timestamp, e._name, e._attributes
        except AttributeError:
            ts, name, attrs = e.timestamp, e.name, e.attributes
        out.append(
            b'{"timeUnixNano":"%d","name":%s,"attributes":%s%s}'
            % (ts, _text(name), _entries(attrs, check) if attrs else b"[]",
               _dropped_json(dropped_attributes(attrs)) if check else b"")
        )
    return b",".join(out)


def _dropped_json(n: int) -> bytes:
    return b',"droppedAttributesCount":%d' % n if n else b""


_SURROGATES = re.compile("[\ud800-\udfff]")


def _clean_text(text: Any) -> str:
    """``text`` as a str UTF-8 can encode (a lone surrogate becomes U+FFFD)."""
    text = str(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _SURROGATES.sub("\ufffd", text)  # one U+FFFD for each
    return text


def _clean_value(value: Any) -> Any:
    """``value`` with :func:`_clean_text` applied to it, or to its elements, if text."""
    t = type(value)
    if t is str:
        return _clean_text(value)
    if (t is list or t is tuple) and any(type(x) is str for x in value):
        return t(_clean_text(x) if type(x) is str else x for x in value)
    return value


def _clean_attrs(attrs: Any) -> BoundedAttributes:
    """The attributes the OTLP/JSON mapping can encode, text with U+FFFD for what UTF-8
    cannot encode; the others are left out (and logged), as the SDK's encoder leaves
    them out. What the SDK's limits dropped
    before stays counted."""
    kept = {}
    for k, v in (attrs.items() if attrs else ()):
        # text UTF-8 cannot encode (a module name with a lone surrogate) is kept with
        # U+FFFD there, the same in every attribute, so readers still join them
        k, v = _clean_text(k), _clean_value(v)
        if _checked_entry(k, v) is not None:
            kept[k] = v
    out = BoundedAttributes(maxlen=None, attributes=kept, immutable=False)
    out.dropped = dropped_attributes(attrs)
    return out


def _counted(kept: list[Any], items: Any) -> Any:
    """``kept`` (cleaned copies of a span's events or links) as a list that still
    counts what the SDK's limits dropped from ``items``."""
    out: BoundedList[Any] = BoundedList(None)
    out.extend(kept)
    out.dropped = dropped_items(items)
    return out


def _span_checked(span: ReadableSpan) -> bytes:
    """:func:`_span` of a span one of whose values the fast path could not encode
    (an int beyond int64, text with a lone surrogate, a value of another type):
    those attributes left out, names and messages with U+FFFD for what UTF-8
    cannot encode, the rest as :func:`_span` writes it."""
    ctx, parent, name, kind, start, end, attrs, events, links, status = span_fields(span)
    res, scope = resource_and_scope(span)
    if status is not None and status.description:
        status = Status(status.status_code, _clean_text(status.description))
    copy = ReadableSpan(
        name=_clean_text(name),
        context=ctx,
        parent=parent,
        resource=res,
        attributes=_clean_attrs(attrs),
        events=_counted([Event(_clean_text(e.name), _clean_attrs(e.attributes), e.timestamp)
                         for e in events or ()], events),
        links=_counted([Link(link.context, _clean_attrs(link.attributes))
                        for link in links or ()], links),
        kind=kind,
        instrumentation_scope=scope,
        status=status,
        start_time=start,
        end_time=end,
    )
    return _span(copy, True)


_SPAN = (
    b'{"traceId":"%s","spanId":"%016x",%s"name":%s,"kind":%d,'
    b'"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":%s%s,'
    b'"flags":%d,"status":%s}'
)


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """Encode spans as one OTLP/JSON ``ExportTraceServiceRequest`` (no newline)."""
    return encode_lines(spans, b"")


def encode_lines(spans: Sequence[ReadableSpan], end: bytes) -> bytes:
    """:func:`encode_spans` followed by ``end`` (``b"\\n"`` for a JSONL line), in
    one buffer. Exporters call it on their thread beside the training loop, so it
    leaves the garbage collector alone (unlike the readers, :func:`paused_gc`)."""
    # spans grouped by resource, then by instrumentation scope (by identity:
    # commspan's spans share one resource and one scope object)
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    # the resource and scope of the previous span, its list's append and its encoder
    last_res: Any = None
    last_scope: Any = None
    append: Any = None
    encode: Any = None
    for span in spans:
        try:
            res, scope = span._resource, span._instrumentation_scope
        except AttributeError:
            res, scope = span.resource, span.instrumentation_scope
        if append is None or last_res is not res or last_scope is not scope:
            slot = groups.get(id(res))
            if slot is None:
                slot = groups[id(res)] = (res, {})
            scoped = slot[1].get(id(scope))
            if scoped is None:
                scoped = slot[1][id(scope)] = (scope, [])
            last_res, last_scope, append = res, scope, scoped[1].append
            # commspan's spans carry no int beyond int64 (see _encode): unchecked
            encode = (_span_other if scope is None or getattr(scope, "name", None) != _SCOPE
                      else _span_own)
        try:
            body = encode(span)
        except Exception:  # a value the fast path cannot encode: that value left out
            body = _span_checked(span)
        append(body)
    # one list of fragments and a single join: a batch of thousands of spans
    # is megabytes, and every intermediate join or concatenation copies it
    parts = [b'{"resourceSpans":[']
    for r, (res, scopes) in enumerate(groups.values()):
        merged: dict[tuple[str, str, str], tuple[Any, list[bytes]]] = {}
        for scope, encoded in scopes.values():
            key = (
                scope.name if scope else "",
                (scope.version or "") if scope else "",
                (scope.schema_url or "") if scope else "",
            )
            merged.setdefault(key, (scope, []))[1].extend(encoded)
        parts.append(b',{"resource":{"attributes":%s%s},%s"scopeSpans":[' if r else
                     b'{"resource":{"attributes":%s%s},%s"scopeSpans":[')
        res_attrs = res.attributes if res else {}
        schema = getattr(res, "schema_url", "") if res else ""
        try:
            res_json, schema_json = _attrs(res_attrs, True), _dumps(schema)
        except Exception:  # text UTF-8 cannot encode: U+FFFD, as in _span_checked
            res_json = _attrs(_clean_attrs(res_attrs), True)
            schema_json = _dumps(_clean_text(schema))
        parts[-1] %= (res_json, _dropped_json(dropped_attributes(res_attrs)),
                      b'"schemaUrl":%s,' % schema_json if schema else b"")
        for i, ((n, v, u), (scope, encoded)) in enumerate(merged.items()):
            scope_attrs = getattr(scope, "attributes", None) if scope else None
            try:
                scope_json = _scope_json(n, v, u, scope_attrs)
            except Exception:  # as the resource's
                scope_json = _scope_json(_clean_text(n), _clean_text(v), _clean_text(u),
                                         _clean_attrs(scope_attrs) if scope_attrs else None)
            parts.append(b'%s{"scope":%s,"spans":[' % (b"," if i else b"", scope_json))
            separated = [b","] * (2 * len(encoded) - 1)
            separated[0::2] = encoded
            parts.extend(separated)
            parts.append(b"]}")
        parts.append(b"]}")
    parts.append(b"]}")
    parts.append(end)
    return b"".join(parts)


def _scope_json(name: str, version: str, schema_url: str, attrs: Any) -> bytes:
    """``{"name":...,"version":...[,"attributes":[...]]},"schemaUrl":...`` of a scope."""
    out = _dumps({"name": name, "version": version})
    if attrs:
        out = out[:-1] + b',"attributes":%s}' % _attrs(attrs, True)
    return out + b',"schemaUrl":' + _dumps(schema_url)
