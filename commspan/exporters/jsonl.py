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
import errno
import gc
import logging
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind
from opentelemetry.trace.span import DEFAULT_TRACE_STATE as _NO_STATE
from opentelemetry.trace.status import StatusCode

from commspan import semconv

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "JsonlSpanExporter",
    "ReadReport",
    "SkippedLine",
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

    Each ``export`` call appends one whole line with a single ``write``. The
    file never gets a line appended after a partial one: a file that does not
    end in a newline when opened (an earlier writer crashed mid-line) gets a
    newline first, and a write cut short (a full disk) is truncated back to
    where its line began. The file is checked once per batch: if it was
    deleted or replaced (its directory removed mid-run), it is created again
    and the event logged once. An export that did not write its whole line
    returns ``FAILURE``, so its spans are counted as failed, never exported.

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
        ValueError: ``path`` has a field other than ``{rank}`` and
            ``{run_id}`` (``"trace-{rnak}.jsonl"``) or an unpaired brace.

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
        _check_template(self._template)
        self._fsync = fsync
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._file_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file held open
        self._size = 0  # where the next line starts, as last seen
        self._fresh_line = False  # the next line must begin with a newline
        self._warned: set[str] = set()
        self.path: Path | None = None
        self._path_str = ""
        self.lines_written = 0
        self.bytes_written = 0

    def _path_for(self, first: ReadableSpan) -> Path:
        res = first.resource.attributes if first.resource is not None else {}
        rank = res.get(semconv.RANK)
        if rank is None:
            rank = _dist_rank()
        run_id = res.get(semconv.RUN_ID, "run")
        template = self._template
        if _is_directory(template):
            template = os.path.join(template, DEFAULT_FILENAME)
        return Path(template.format(rank=rank, run_id=run_id))

    def _open(self, first: ReadableSpan) -> int | None:
        """Open (or create again) the file; ``None``, logged once, if it cannot be."""
        try:
            path = self.path if self.path is not None else self._path_for(first)
            self.path, self._path_str = path, str(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except (OSError, ValueError, KeyError, IndexError, AttributeError, TypeError) as exc:
            self._warn_once(
                "open", "commspan: JsonlSpanExporter cannot open %s (%s: %s); its spans are "
                "counted as failed until it can (not logged again)",
                self.path if self.path is not None else self._template, type(exc).__name__, exc,
            )
            return None
        st = os.fstat(fd)
        self._fd = fd
        self._file_id = (st.st_dev, st.st_ino)
        self._size = st.st_size
        self._fresh_line = st.st_size > 0 and not _ends_in_newline(path, st.st_size)
        if self._fresh_line:
            _log.warning(
                "commspan: %s does not end in a newline (an earlier writer stopped "
                "mid-line); appending from a new line, readers report the partial line "
                "as damaged", path,
            )
        return fd

    def _file_is_there(self) -> bool:
        """Whether the path still names the file held open (one ``stat`` per batch);
        also notes where the next line starts."""
        try:
            st = os.stat(self._path_str)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:  # cannot tell (a directory made unreadable): keep writing
            return True
        if (st.st_dev, st.st_ino) != self._file_id:
            return False
        self._size = st.st_size
        return True

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Append one line holding ``spans``.

        Returns:
            ``SUCCESS`` once the whole line is written; ``FAILURE`` after
            ``shutdown``, or when the file cannot be opened or the line was not
            (wholly) written: nothing of that line is left in the file.
        """
        if not spans:
            return SpanExportResult.SUCCESS
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            fd = self._fd
            if fd is not None and not self._file_is_there():
                self._warn_once(
                    "gone", "commspan: %s was deleted or replaced while being written; "
                    "writing to a new file at that path (lines written before went with "
                    "the old file; not logged again)", self.path,
                )
                self._close_fd()
                fd = None
            if fd is None:
                fd = self._open(spans[0])
                if fd is None:
                    return SpanExportResult.FAILURE
            with _no_gc():
                data = _encode(spans, b"\n")
            if self._fresh_line:
                data = b"\n" + data
            start = self._size
            written = 0
            try:
                view = memoryview(data)
                while written < len(data):
                    n = os.write(fd, view[written:])
                    if n <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    written += n
                if self._fsync:
                    os.fsync(fd)
            except OSError as exc:
                if written < len(data):
                    self._undo(fd, start, written)
                else:  # whole line written, fsync failed
                    self._fresh_line = False
                self._warn_once(
                    "write", "commspan: writing %s failed (%s); the line was %s and its "
                    "spans are counted as failed (further failures are counted, not logged)",
                    self.path, exc,
                    "not fsynced" if written == len(data) else "removed from the file",
                )
                return SpanExportResult.FAILURE
            self._fresh_line = False
            self._size = start + written
            self.lines_written += 1
            self.bytes_written += len(data)
        return SpanExportResult.SUCCESS

    def _undo(self, fd: int, start: int, written: int) -> None:
        """After a short write, cut the file back to where the line began; if that is
        not certain to remove only this line's bytes, start the next line afresh."""
        if written == 0:
            return
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size == start + written:
                os.ftruncate(fd, start)
                return
        except OSError:
            pass
        self._fresh_line = True

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            _log.warning(message, *args)

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Lines are written unbuffered; nothing to flush."""
        return True

    def shutdown(self) -> None:
        """Close the file; later exports fail."""
        with self._lock:
            self._closed = True
            self._close_fd()


_FIELDS = ("rank", "run_id")


def _check_template(template: str) -> None:
    """Reject a path whose fields ``_open`` could not fill, before any span is lost."""
    try:
        template.format(rank=0, run_id="run")
    except KeyError as exc:
        problem = f"unknown field {{{exc.args[0]}}}"
    except IndexError:
        problem = "a positional field ({} or {0})"
    except (ValueError, AttributeError, TypeError) as exc:
        problem = str(exc)
    else:
        return
    raise ValueError(
        f"path={template!r} is not a valid file-name template: {problem}; the fields are "
        "{rank} and {run_id} (write {{ or }} for a literal brace)"
    )


def _ends_in_newline(path: Path, size: int) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # cannot tell: a spare newline only makes an empty line
        return False
    try:
        return os.pread(fd, 1, size - 1) == b"\n"
    except OSError:
        return False
    finally:
        os.close(fd)


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
    elif t is int and not -_SMALL_INT < v < _SMALL_INT:
        # large ints (sequence numbers, byte counts, steps) rarely repeat
        return b'{"key":%s,"value":{"intValue":"%d"}}' % (_text(k), v)
    elif t is float:
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


def _entries(attrs: Any) -> bytes:
    # _entry inlined for the common hashable values: this runs ~20 times per
    # collective event
    get = _ENTRY_CACHE.get
    out = []
    for k, v in attrs.items():
        t = type(v)
        if t is str or t is bool or (t is int and -_SMALL_INT < v < _SMALL_INT):
            e = get((k, v, t))
            out.append(e if e is not None else _entry(k, v))
        elif t is int:
            out.append(b'{"key":%s,"value":{"intValue":"%d"}}' % (_text(k), v))
        else:
            out.append(_entry(k, v))
    return b"[" + b",".join(out) + b"]"


# Whole encoded attribute lists, keyed by the attributes' items: a module's
# span carries the same attributes (name, type, phase, depth, parameters,
# collective counts) step after step. The value keeps the types of the values
# too, since ``True == 1 == 1.0`` would otherwise let a bool hit an int's
# entry. Lists (unhashable) and values that rarely repeat (floats, large ints:
# step numbers, sequence numbers, byte counts) are not stored.
_BLOBS: dict[tuple[Any, ...], tuple[tuple[type, ...], bytes]] = {}
_BLOBS_MAX = 1 << 12
_REPEATING = (str, bool, tuple)


def _attrs(attrs: Any) -> bytes:
    if not attrs:
        return b"[]"
    items = tuple(attrs.items())
    try:
        hit = _BLOBS.get(items)
    except TypeError:  # a list value
        return _entries(attrs)
    types = tuple(map(type, attrs.values()))
    if hit is not None and hit[0] == types:
        return hit[1]
    blob = _entries(attrs)  # join() results are exact-size: safe to keep
    for t, v in zip(types, attrs.values()):
        if t is int:
            if not -_SMALL_INT < v < _SMALL_INT:
                return blob
        elif t not in _REPEATING:
            return blob
    if len(_BLOBS) >= _BLOBS_MAX:
        _BLOBS.clear()
    _BLOBS[items] = (types, blob)
    return blob


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


def _span(span: ReadableSpan) -> bytes:
    # ReadableSpan's public properties are Python calls, and wrap attributes
    # and events in new objects on every access: read the stored fields of SDK
    # spans directly, the properties of anything else.
    try:
        ctx = span._context
        parent = span._parent
        name = span._name
        kind = span._kind
        start = span._start_time
        end = span._end_time
        attrs = span._attributes
        events = span._events
        links = span._links
        status = span._status
    except AttributeError:
        ctx, parent, name, kind = span.context, span.parent, span.name, span.kind
        start, end, attrs, events = span.start_time, span.end_time, span.attributes, span.events
        links, status = span.links, span.status
    tail = b""
    if events:
        tail = b',"events":[%s]' % b",".join(
            [
                b'{"timeUnixNano":"%d","name":%s,"attributes":%s}'
                # events rarely repeat whole (a collective's sequence number
                # differs each time): encode entry by entry, skip the blob cache
                % (e.timestamp, _text(e.name), _entries(e.attributes) if e.attributes else b"[]")
                for e in events
            ]
        )
    if links:
        tail += b',"links":[%s]' % b",".join(
            [
                b'{"traceId":"%032x","spanId":"%016x","attributes":%s,"flags":%d}'
                % (
                    link.context.trace_id,
                    link.context.span_id,
                    _attrs(link.attributes),
                    _REMOTE if link.context.is_remote else _LOCAL,
                )
                for link in links
            ]
        )
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
        _attrs(attrs),
        tail,
        # SpanFlags: whether the parent is remote is known (and whether it is)
        flags,
        status_json,
    )


_SPAN = (
    b'{"traceId":"%s","spanId":"%016x",%s"name":%s,"kind":%d,'
    b'"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":%s%s,'
    b'"flags":%d,"status":%s}'
)


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
        return _encode(spans, b"")


def _encode(spans: Sequence[ReadableSpan], end: bytes) -> bytes:
    # spans grouped by resource, then by instrumentation scope (by identity:
    # commspan's spans share one resource and one scope object)
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        try:
            res = span._resource
            scope = span._instrumentation_scope
        except AttributeError:
            res, scope = span.resource, span.instrumentation_scope
        slot = groups.get(id(res))
        if slot is None:
            slot = groups[id(res)] = (res, {})
        scoped = slot[1].get(id(scope))
        if scoped is None:
            scoped = slot[1][id(scope)] = (scope, [])
        scoped[1].append(_span(span))
    # one list of fragments and a single join: a batch of thousands of spans
    # is megabytes, and every intermediate join or concatenation copies it
    parts = [b'{"resourceSpans":[']
    for r, (res, scopes) in enumerate(groups.values()):
        merged: dict[tuple[str, str, str], list[bytes]] = {}
        for scope, encoded in scopes.values():
            key = (
                scope.name if scope else "",
                (scope.version or "") if scope else "",
                (scope.schema_url or "") if scope else "",
            )
            merged.setdefault(key, []).extend(encoded)
        parts.append(b',{"resource":{"attributes":%s},"scopeSpans":[' if r else
                     b'{"resource":{"attributes":%s},"scopeSpans":[')
        parts[-1] %= _attrs(res.attributes if res else {})
        for i, ((n, v, u), encoded) in enumerate(merged.items()):
            parts.append(
                b'%s{"scope":%s,"schemaUrl":%s,"spans":['
                % (b"," if i else b"", _dumps({"name": n, "version": v}), _dumps(u))
            )
            separated = [b","] * (2 * len(encoded) - 1)
            separated[0::2] = encoded
            parts.extend(separated)
            parts.append(b"]}")
        parts.append(b"]}")
    parts.append(b"]}")
    parts.append(end)
    return b"".join(parts)


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


DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024


class SkippedLine(NamedTuple):
    """A line of a JSONL file that a read left out.

    Attributes:
        path: the file.
        line: its line number (from 1).
        kind: ``"torn"`` (a last line without a trailing newline: a write cut
            short, or a file still being written), ``"damaged"`` (a complete
            line that is not an OTLP/JSON trace request) or ``"too_long"``
            (longer than ``max_line_bytes``; the rest of that file is not read).
        reason: what is wrong with it, for people.
    """

    path: str
    line: int
    kind: str
    reason: str


@dataclass
class ReadReport:
    """What a read of JSONL files found and what it skipped.

    Pass one as ``report=`` to :func:`read_spans`, :func:`read_documents` or
    :meth:`commspan.Aggregator.from_jsonl`; skipped lines are then recorded
    here instead of logged.

    Attributes:
        lines: lines read and used.
        spans: spans in those lines (counted by ``read_spans`` and ``from_jsonl``).
        commspan_spans: those carrying ``commspan.module.fqn`` (commspan's
            module and rank spans, what counts are made of), counted by
            ``read_spans`` and ``from_jsonl``.
        ranks: ``commspan.rank`` of the resources of commspan spans (``None``
            for spans without one).
        skipped: every line left out, in the order met.

    Example:
        >>> from commspan.exporters import ReadReport, read_spans
        >>> report = ReadReport()
        >>> spans = list(read_spans(strict=False, report=report))  # pass the files of a run
        >>> report.damaged
        []
    """

    lines: int = 0
    spans: int = 0
    commspan_spans: int = 0
    ranks: set[Any] = field(default_factory=set)
    skipped: list[SkippedLine] = field(default_factory=list)

    @property
    def damaged(self) -> list[SkippedLine]:
        """Skipped lines other than torn last lines: data that was in the file and is lost."""
        return [s for s in self.skipped if s.kind != "torn"]

    @property
    def torn(self) -> list[SkippedLine]:
        """Last lines without a trailing newline (a write cut short or still under way)."""
        return [s for s in self.skipped if s.kind == "torn"]


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


_MAX_LOGGED = 10


class _Reader:
    """Reads JSONL lines, bounded in length, and deals with the ones it must skip:
    raised (``strict``, damaged lines), recorded in a report, or logged."""

    def __init__(
        self, strict: bool, report: ReadReport | None, max_line_bytes: int, pause_gc: bool
    ) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"strict={strict!r} is not valid; pass True or False")
        if report is not None and not isinstance(report, ReadReport):
            raise TypeError(f"report={report!r} is not valid; pass a ReadReport or None")
        if (
            not isinstance(max_line_bytes, int)
            or isinstance(max_line_bytes, bool)
            or max_line_bytes < 1
        ):
            raise ValueError(
                f"max_line_bytes={max_line_bytes!r} is not valid; pass a positive number "
                f"of bytes (default {DEFAULT_MAX_LINE_BYTES}, 64 MiB)"
            )
        self.strict = strict
        self.report = report
        self.max_line_bytes = max_line_bytes
        self.pause_gc = pause_gc
        self._logged = 0

    def documents(self, paths: Sequence[str | os.PathLike[str]]) -> Iterator[tuple[Path, int, Any]]:
        """``(file, line number, parsed line)`` for every line that is an OTLP/JSON
        trace request; the others are skipped (or raise)."""
        limit = self.max_line_bytes + 1  # the line and its newline
        loads = orjson.loads
        for p in paths:
            path = Path(p)
            with path.open("rb") as fh:
                readline = fh.readline
                number = 0
                while True:
                    raw = readline(limit)
                    if not raw:
                        break
                    number += 1
                    complete = raw[-1:] == b"\n"
                    if not complete and len(raw) == limit:
                        self.skip(path, number, "too_long", _too_long(self.max_line_bytes))
                        break  # reading on would need the rest of the line in memory
                    if raw.isspace():  # (no copy, unlike strip())
                        continue
                    try:
                        if self.pause_gc:
                            with _no_gc():
                                doc = loads(raw)
                        else:
                            doc = loads(raw)
                    except orjson.JSONDecodeError as exc:
                        if complete:
                            self.skip(path, number, "damaged", f"not a JSON line ({exc})")
                        else:
                            self.skip(path, number, "torn", _TORN)
                        continue
                    if type(doc) is not dict or type(doc.get("resourceSpans")) is not list:
                        self.skip(path, number, "damaged", _not_a_request(doc))
                        continue
                    raw = b""  # hold neither the line nor its document longer than needed
                    yield path, number, doc
                    doc = None

    def skip(self, path: Path, number: int, kind: str, reason: str) -> None:
        if self.strict and kind != "torn":
            hint = (
                "pass a larger max_line_bytes if the line is genuine"
                if kind == "too_long" else "pass strict=False to skip damaged lines"
            )
            raise ValueError(f"{path}:{number}: {reason}; {hint}")
        if self.report is not None:
            self.report.skipped.append(SkippedLine(str(path), number, kind, reason))
            return
        self._logged += 1
        if self._logged > _MAX_LOGGED:
            if self._logged == _MAX_LOGGED + 1:
                _log.warning("commspan: more lines skipped, not logged (pass report= to "
                             "collect them all)")
            return
        if kind == "torn":
            _log.warning("commspan: %s: skipping truncated last line %d (%s)", path, number,
                         _TORN)
        else:
            _log.warning("commspan: %s:%d: skipping a damaged line: %s", path, number, reason)

    def bad_request(self, path: Path, number: int, doc: Any, exc: Exception) -> None:
        """A parsed line whose content could not be decoded."""
        reason = _explain(doc) or f"cannot be decoded ({type(exc).__name__}: {exc})"
        self.skip(path, number, "damaged", reason)


_TORN = "no trailing newline: a write cut short by a crash, or a file still being written"
_DECODE_ERRORS = (TypeError, KeyError, AttributeError, ValueError)


def _too_long(limit: int) -> str:
    return (f"line longer than {limit} bytes ({limit / 2**20:g} MiB); the rest of the file "
            "is not read")


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _not_a_request(doc: Any) -> str:
    if type(doc) is not dict:
        return (f"{_json_kind(doc)}, not an OTLP/JSON trace request "
                "(an object with resourceSpans)")
    if "resourceSpans" not in doc:
        keys = ", ".join(sorted(map(str, doc))[:5]) or "none"
        return f"an object without resourceSpans (keys: {keys}), not an OTLP/JSON trace request"
    return f"resourceSpans is {_json_kind(doc['resourceSpans'])}, expected an array"


def _explain(doc: Any) -> str | None:
    """The first thing in ``doc`` that does not fit OTLP/JSON trace requests, or ``None``.
    Run only after decoding failed, to say where."""

    def obj(v: Any, where: str) -> str | None:
        return None if isinstance(v, dict) else f"{where} is {_json_kind(v)}, expected an object"

    def arr(v: Any, where: str) -> str | None:
        return None if isinstance(v, list) else f"{where} is {_json_kind(v)}, expected an array"

    def attrs(items: Any, where: str) -> str | None:
        if items is None:
            return None
        if (bad := arr(items, where)) is not None:
            return bad
        for n, a in enumerate(items):
            at = f"{where}[{n}]"
            if (bad := obj(a, at)) is not None:
                return bad
            if "key" not in a:
                return f"{at} has no key"
            if not isinstance(a["key"], str):
                return f"{at}.key is {_json_kind(a.get('key'))}, expected a string"
            value = a.get("value", {})
            if (bad := obj(value, f"{at}.value")) is not None:
                return bad
            try:
                _decode_value(value)
            except _DECODE_ERRORS as exc:
                return f"{at}.value is not an OTLP AnyValue ({type(exc).__name__}: {exc})"
        return None

    def number(v: Any, where: str) -> str | None:
        try:
            int(v)
        except _DECODE_ERRORS:
            return f"{where} is {v!r}, expected an integer"
        return None

    if (bad := obj(doc, "the line")) is not None:
        return bad
    if (bad := arr(doc.get("resourceSpans"), "resourceSpans")) is not None:
        return bad
    for i, rs in enumerate(doc["resourceSpans"]):
        w = f"resourceSpans[{i}]"
        if (bad := obj(rs, w)) is not None:
            return bad
        resource = rs.get("resource", {})
        bad = obj(resource, f"{w}.resource") or attrs(
            resource.get("attributes"), f"{w}.resource.attributes")
        if bad is not None:
            return bad
        if (bad := arr(rs.get("scopeSpans", []), f"{w}.scopeSpans")) is not None:
            return bad
        for j, ss in enumerate(rs.get("scopeSpans", [])):
            w2 = f"{w}.scopeSpans[{j}]"
            if (bad := obj(ss, w2) or arr(ss.get("spans", []), f"{w2}.spans")) is not None:
                return bad
            for k, s in enumerate(ss.get("spans", [])):
                w3 = f"{w2}.spans[{k}]"
                if (bad := obj(s, w3)) is not None:
                    return bad
                for key in ("startTimeUnixNano", "endTimeUnixNano"):
                    if (bad := number(s.get(key, 0), f"{w3}.{key}")) is not None:
                        return bad
                if (bad := attrs(s.get("attributes"), f"{w3}.attributes")) is not None:
                    return bad
                status = s.get("status") or {}
                if (bad := obj(status, f"{w3}.status")) is not None:
                    return bad
                if (bad := number(status.get("code", 0) or 0, f"{w3}.status.code")) is not None:
                    return bad
                events = s.get("events") or []
                if (bad := arr(events, f"{w3}.events")) is not None:
                    return bad
                for m, e in enumerate(events):
                    w4 = f"{w3}.events[{m}]"
                    bad = obj(e, w4) or number(e.get("timeUnixNano", 0), f"{w4}.timeUnixNano")
                    if bad is None:
                        bad = attrs(e.get("attributes"), f"{w4}.attributes")
                    if bad is not None:
                        return bad
    return None


def read_documents(
    *paths: str | os.PathLike[str],
    pause_gc: bool = True,
    strict: bool = True,
    report: ReadReport | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[dict[str, Any]]:
    """Yield each line of JSONL files as a parsed OTLP/JSON request.

    See :func:`read_spans` for how torn, damaged and over-long lines are handled.

    Args:
        pause_gc: pause the cyclic GC while each line is parsed (a caller that
            pauses it around the whole read passes ``False``).
        strict: raise on a damaged line (default) or skip it.
        report: collects what was read and skipped (skipped lines are then
            not logged).
        max_line_bytes: longest line read (default 64 MiB).

    Raises:
        ValueError: a damaged or over-long line and ``strict``, naming file and line.
    """
    reader = _Reader(strict, report, max_line_bytes, pause_gc)
    for _path, _number, doc in reader.documents(paths):
        if report is not None:
            report.lines += 1
        yield doc


def read_spans(
    *paths: str | os.PathLike[str],
    strict: bool = True,
    report: ReadReport | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[SpanRecord]:
    """Yield every span in JSONL files written by :class:`JsonlSpanExporter`.

    A last line without a trailing newline is a torn write (a crash, or a
    file still being written): it is skipped with a warning, in any mode. A
    complete line that is not an OTLP/JSON trace request (not JSON, ``null``,
    a list, wrong types inside) is damaged: with ``strict=True`` (the
    default) it raises ``ValueError`` naming file and line; with
    ``strict=False`` it is skipped and every complete line around it is read.
    A line longer than ``max_line_bytes`` raises, or with ``strict=False``
    ends the reading of that file. Skipped lines are recorded in ``report``
    when one is given, else logged as warnings.

    Args:
        paths: JSONL files.
        strict: raise on a damaged line (default) or skip it.
        report: a :class:`ReadReport` that collects what was read and skipped.
        max_line_bytes: longest line read (default 64 MiB); bounds memory.

    Raises:
        ValueError: a damaged or over-long line and ``strict``, naming file and
            line; ``max_line_bytes`` not a positive int.
        TypeError: ``strict`` not a bool, ``report`` not a ``ReadReport``.
        OSError: a file cannot be read.

    Example:
        >>> from commspan.exporters import read_spans
        >>> spans = list(read_spans())  # pass the files of a run
        >>> spans
        []
    """
    reader = _Reader(strict, report, max_line_bytes, True)
    for path, number, doc in reader.documents(paths):
        try:
            records = list(_records(doc))
        except _DECODE_ERRORS as exc:
            reader.bad_request(path, number, doc, exc)
            continue
        if report is not None:
            report.lines += 1
            report.spans += len(records)
            for r in records:
                if semconv.MODULE_FQN in r.attributes:
                    report.commspan_spans += 1
                    report.ranks.add(r.rank)
        yield from records


def _records(doc: dict[str, Any]) -> Iterator[SpanRecord]:
    for rs in doc["resourceSpans"]:
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
