"""JSONL span files: one line per exported batch, in OTLP/JSON.

Each line is one ``ExportTraceServiceRequest`` in the OTLP/JSON encoding, the
format the OpenTelemetry Collector's ``file`` exporter writes and its
``otlpjson`` receiver reads, so the files replay into any collector. See
``docs/jsonl.md``.

Example:
    >>> import tempfile, pathlib
    >>> from commspan.exporters import JsonlSpanExporter
    >>> d = tempfile.mkdtemp()
    >>> exporter = JsonlSpanExporter(pathlib.Path(d) / "trace-rank{rank}.jsonl")
    >>> exporter.shutdown()
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind
from opentelemetry.trace.status import StatusCode

from commspan import semconv

__all__ = [
    "JsonlSpanExporter",
    "SpanRecord",
    "decode_value",
    "encode_spans",
    "read_documents",
    "read_spans",
]

_log = logging.getLogger(__name__)
DEFAULT_FILENAME = "commspan-rank{rank}.jsonl"


class JsonlSpanExporter(SpanExporter):
    """Write spans to a JSONL file, one OTLP/JSON request per line.

    Each ``export`` call appends one whole line with a single ``write``, so a
    crash loses at most the spans not yet exported, never part of a line.

    Args:
        path: file to append to, or a directory (the file is then
            ``commspan-rank{rank}.jsonl`` inside it). A path that exists as a
            directory, ends in ``/``, or has neither a suffix nor a ``{rank}``
            field (``"commspan-out"``) is a directory. ``{rank}`` and
            ``{run_id}`` in a file name are filled from the first spans'
            resource, so every rank writes its own file.
        fsync: also ``fsync`` after every line (durable, slower).

    Raises:
        TypeError: ``path`` is not a str or path.

    Example:
        >>> from commspan import CommSpanMode
        >>> from commspan.exporters import JsonlSpanExporter
        >>> mode = CommSpanMode(exporters=[JsonlSpanExporter("/tmp/commspan-doc")])
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"path={path!r} is not valid; pass a file path or a directory (str or Path)"
            )
        self._template = os.fspath(path)
        self._fsync = fsync
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.path: Path | None = None
        self.lines_written = 0
        self.bytes_written = 0

    def _open(self, first: ReadableSpan) -> int:
        res = first.resource.attributes if first.resource is not None else {}
        rank = res.get(semconv.RANK)
        if rank is None:
            rank = _dist_rank()
        run_id = res.get(semconv.RUN_ID, "run")
        template = self._template
        if _is_directory(template):
            template = os.path.join(template, DEFAULT_FILENAME)
        path = Path(template.format(rank=rank, run_id=run_id))
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._fd

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Append one line holding ``spans``."""
        if not spans:
            return SpanExportResult.SUCCESS
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            fd = self._fd if self._fd is not None else self._open(spans[0])
            data = encode_spans(spans) + b"\n"
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self._fsync:
                os.fsync(fd)
            self.lines_written += 1
            self.bytes_written += len(data)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Lines are written unbuffered; nothing to flush."""
        return True

    def shutdown(self) -> None:
        """Close the file; later exports fail."""
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _is_directory(template: str) -> bool:
    """A directory, a path ending in a separator, or a name with neither a
    suffix nor a ``{rank}`` field (``"commspan-out"``) means: one file per rank
    inside it."""
    if template.endswith(("/", os.sep)) or os.path.isdir(template):
        return True
    name = os.path.basename(template)
    return "{" not in name and not os.path.splitext(name)[1]


def _dist_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    return int(os.environ.get("RANK", "0") or 0)


# ------------------------------------------------------------------ encoding
def _value(v: Any) -> dict[str, Any]:
    t = type(v)
    if t is str:
        return {"stringValue": v}
    if t is int:
        return {"intValue": str(v)}
    if t is bool:
        return {"boolValue": v}
    if t is float:
        return {"doubleValue": v}
    if t is list or t is tuple:
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    if isinstance(v, bool):
        return {"boolValue": bool(v)}
    if isinstance(v, int):
        return {"intValue": str(int(v))}
    if isinstance(v, float):
        return {"doubleValue": float(v)}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}


# Encoded attribute entries (``{"key":k,"value":{...}}`` as JSON bytes), reused:
# module spans repeat the same names, types and phases step after step.
# Bounded; cleared when full.
_ENTRY_CACHE: dict[tuple[str, Any, type], bytes] = {}
_TEXT_CACHE: dict[str, bytes] = {}
_CACHE_MAX = 1 << 14
_SMALL_INT = 1 << 10
_dumps = orjson.dumps


def _entry(k: str, v: Any) -> bytes:
    t = type(v)
    if t is list:
        hv: Any = tuple(v)
    elif t is float or (t is int and not -_SMALL_INT < v < _SMALL_INT):
        # large ints (sequence numbers, byte counts, steps) rarely repeat
        return _dumps({"key": k, "value": _value(v)})
    else:
        hv = v
    key = (k, hv, t)
    try:
        return _ENTRY_CACHE[key]
    except KeyError:
        pass
    except TypeError:  # unhashable value
        return _dumps({"key": k, "value": _value(v)})
    # orjson's result keeps its ~4 kB build buffer: cache an exact-size copy
    entry = bytes(memoryview(_dumps({"key": k, "value": _value(v)})))
    if len(_ENTRY_CACHE) >= _CACHE_MAX:
        _ENTRY_CACHE.clear()
    _ENTRY_CACHE[key] = entry
    return entry


def _attrs(attrs: Any) -> bytes:
    if not attrs:
        return b"[]"
    return b"[" + b",".join([_entry(k, v) for k, v in attrs.items()]) + b"]"


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


_STATUS = {code: code.value for code in StatusCode}
_KIND = {kind: kind.value + 1 for kind in SpanKind}  # OTLP numbers kinds from 1


def _span(span: ReadableSpan) -> bytes:
    ctx = span.context
    parent = span.parent
    # ReadableSpan's public properties wrap attributes and events in new
    # objects on every access; read the stored values when they are there.
    attrs = getattr(span, "_attributes", None)
    if attrs is None:
        attrs = span.attributes
    events = getattr(span, "_events", None)
    if events is None:
        events = span.events
    out = b'{"traceId":"%032x","spanId":"%016x",%s"name":%s,"kind":%d,' % (
        ctx.trace_id if ctx else 0,
        ctx.span_id if ctx else 0,
        b'"parentSpanId":"%016x",' % parent.span_id if parent is not None else b"",
        _text(span.name),
        _KIND.get(span.kind, 1),
    )
    out += b'"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":%s' % (
        span.start_time or 0,
        span.end_time or 0,
        _attrs(attrs),
    )
    if events:
        out += b',"events":[%s]' % b",".join(
            [
                b'{"timeUnixNano":"%d","name":%s,"attributes":%s}'
                % (e.timestamp, _text(e.name), _attrs(e.attributes))
                for e in events
            ]
        )
    status = span.status
    code = _STATUS[status.status_code]
    if not code:
        return out + b',"status":{}}'
    if status.description:
        return out + b',"status":{"code":%d,"message":%s}}' % (code, _dumps(status.description))
    return out + b',"status":{"code":%d}}' % code


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC while building or parsing many small dicts: none of
    them form cycles, and collections triggered by the allocations cost more
    than the work itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """Encode spans as one OTLP/JSON ``ExportTraceServiceRequest`` (no newline)."""
    with _no_gc():
        return _encode(spans)


def _encode(spans: Sequence[ReadableSpan]) -> bytes:
    groups: dict[int, tuple[Any, dict[tuple[str, str, str], list[bytes]]]] = {}
    for span in spans:
        res = span.resource
        slot = groups.get(id(res))
        if slot is None:
            slot = groups[id(res)] = (res, {})
        scope = span.instrumentation_scope
        key = (
            scope.name if scope else "",
            (scope.version or "") if scope else "",
            (scope.schema_url or "") if scope else "",
        )
        slot[1].setdefault(key, []).append(_span(span))
    resource_spans = []
    for res, scopes in groups.values():
        scope_spans = [
            b'{"scope":%s,"schemaUrl":%s,"spans":[%s]}'
            % (_dumps({"name": n, "version": v}), _dumps(u), b",".join(encoded))
            for (n, v, u), encoded in scopes.items()
        ]
        resource_spans.append(
            b'{"resource":{"attributes":%s},"scopeSpans":[%s]}'
            % (_attrs(res.attributes if res else {}), b",".join(scope_spans))
        )
    return b'{"resourceSpans":[' + b",".join(resource_spans) + b"]}"


# ------------------------------------------------------------------ reading
@dataclass
class SpanRecord:
    """A span read back from a JSONL file.

    Attributes:
        events: ``(name, attributes)`` pairs, in order.
        event_times: timestamps of those events (ns).
        rank: ``commspan.rank`` of the span's resource, if any.
    """

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_time: int
    end_time: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    event_times: list[int] = field(default_factory=list)
    status_code: int = 0
    status_message: str = ""
    rank: int | None = None
    resource: dict[str, Any] = field(default_factory=dict)


def decode_value(v: dict[str, Any]) -> Any:
    """Decode one OTLP/JSON ``AnyValue`` (``{"intValue": "3"}`` -> ``3``)."""
    return _decode_value(v)


def _decode_value(v: dict[str, Any]) -> Any:
    for key, val in v.items():
        if key == "stringValue":
            return val
        if key == "intValue":
            return int(val)
        if key == "doubleValue":
            return float(val)
        if key == "boolValue":
            return bool(val)
        if key == "arrayValue":
            return [_decode_value(x) for x in val.get("values", [])]
        if key == "kvlistValue":
            return {kv["key"]: _decode_value(kv["value"]) for kv in val.get("values", [])}
        if key == "bytesValue":
            return val
    return None


def _decode_attrs(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    if not items:
        return {}
    return {a["key"]: _decode_value(a.get("value", {})) for a in items}


def read_documents(
    *paths: str | os.PathLike[str], pause_gc: bool = True
) -> Iterator[dict[str, Any]]:
    """Yield each line of JSONL files as a parsed OTLP/JSON request.

    A truncated last line (a crash mid-write) is skipped with a warning; any
    other line that is not valid JSON raises ``ValueError`` naming file and line.

    Args:
        pause_gc: pause the cyclic GC while each line is parsed (a caller that
            pauses it around the whole read passes ``False``).
    """
    for p in paths:
        path = Path(p)
        with path.open("rb") as fh:
            pending: bytes | None = None
            number = 0
            for raw in fh:
                if pending is not None:
                    yield _parse(pending, path, number, False, pause_gc)
                number += 1
                pending = raw if raw.strip() else None
            if pending is not None:
                doc = _parse(pending, path, number, True, pause_gc)
                if doc is not None:
                    yield doc


def _parse(
    line: bytes, path: Path, number: int, last: bool, pause_gc: bool
) -> Any:
    try:
        if pause_gc:
            with _no_gc():
                return orjson.loads(line)
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        if last:
            _log.warning("commspan: %s: skipping truncated last line %d", path, number)
            return None
        raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from None


def read_spans(*paths: str | os.PathLike[str]) -> Iterator[SpanRecord]:
    """Yield every span in JSONL files written by :class:`JsonlSpanExporter`.

    A truncated last line (a crash mid-write) is skipped with a warning; any
    other line that is not valid JSON raises ``ValueError`` naming file and line.

    Example:
        >>> from commspan.exporters import read_spans
        >>> spans = list(read_spans())  # pass the files of a run
        >>> spans
        []
    """
    for doc in read_documents(*paths):
        yield from _records(doc)


def _records(doc: dict[str, Any]) -> Iterator[SpanRecord]:
    for rs in doc.get("resourceSpans", ()):
        res = _decode_attrs(rs.get("resource", {}).get("attributes"))
        rank = res.get(semconv.RANK)
        rank = int(rank) if isinstance(rank, int) else None
        for ss in rs.get("scopeSpans", ()):
            for s in ss.get("spans", ()):
                events = s.get("events") or ()
                status = s.get("status") or {}
                yield SpanRecord(
                    name=s.get("name", ""),
                    trace_id=s.get("traceId", ""),
                    span_id=s.get("spanId", ""),
                    parent_span_id=s.get("parentSpanId", ""),
                    start_time=int(s.get("startTimeUnixNano", 0)),
                    end_time=int(s.get("endTimeUnixNano", 0)),
                    attributes=_decode_attrs(s.get("attributes")),
                    events=[(e.get("name", ""), _decode_attrs(e.get("attributes")))
                            for e in events],
                    event_times=[int(e.get("timeUnixNano", 0)) for e in events],
                    status_code=int(status.get("code", 0) or 0),
                    status_message=status.get("message", ""),
                    rank=rank,
                    resource=res,
                )
