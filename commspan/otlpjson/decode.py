"""Reading OTLP/JSON: lines of JSONL files, documents, attribute values, spans.

- :class:`LineReader` reads lines, bounded in length, and deals with the ones
  it must skip (raise, report or log);
- :func:`walk` is the one walk over a document (``resourceSpans`` ->
  ``scopeSpans`` -> ``spans``), decoding every attribute or only some keys
  (the aggregator's fast path) with :func:`decode_attributes`;
- :func:`read_spans` and :func:`read_documents` put them together for files.

Example:
    >>> doc = {"resourceSpans": [{"resource": {"attributes": [
    ...     {"key": "commspan.rank", "value": {"intValue": "1"}}]},
    ...     "scopeSpans": [{"spans": [{"name": "s"}]}]}]}
    >>> [(resource, span["name"]) for resource, span, _, _ in walk(doc)]
    [({'commspan.rank': 1}, 's')]
"""

from __future__ import annotations

import logging
import math
import os
import stat
import zlib
from collections.abc import (
    Callable,
    Container,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any

import orjson

from commspan import semconv
from commspan._errors import positive_int
from commspan.otlpjson.encode import paused_gc
from commspan.otlpjson.files import GZIP_MAGIC, MEMBER_FEED, jsonl_files
from commspan.otlpjson.records import (
    DEFAULT_MAX_LINE_BYTES,
    ReadReport,
    SkippedLine,
    SpanRecord,
    rank_value,
)

__all__ = [
    "DECODE_ERRORS",
    "EMPTY_LINE",
    "BadValue",
    "LineReader",
    "check_values",
    "decode_attributes",
    "decode_value",
    "read_documents",
    "read_spans",
    "walk",
    "what_is_wrong",
]

_log = logging.getLogger(__name__)



def decode_value(v: dict[str, Any]) -> Any:
    """Decode one OTLP/JSON ``AnyValue`` (``{"intValue": "3"}`` -> ``3``)."""
    return _decode_value(v)


def _decode_value(v: dict[str, Any]) -> Any:
    for key, val in v.items():
        if key == "stringValue":
            return val
        if key == "intValue":
            # (beyond int64 too, as older files' resources may hold: kept as it is; the
            # views' writers fall back to a JSON encoder that takes it, commspan._json)
            return _int_value(val)
        if key == "doubleValue":
            # "NaN", "Infinity", "-Infinity" as strings; null in files written before
            return float(val) if val is not None else math.nan
        if key == "boolValue":
            return bool(val)
        if key == "arrayValue":
            return [_decode_value(x) for x in val.get("values", [])]
        if key == "kvlistValue":
            return {kv["key"]: _decode_value(kv["value"]) for kv in val.get("values", [])}
        if key == "bytesValue":
            return val
    return None


def _int_value(val: Any) -> int:
    """An OTLP/JSON ``intValue``: a JSON integer, or its decimal text (what the
    exporters write); not a float, a boolean, padded text or other digits, which
    ``int()`` would take.

    Raises:
        BadValue: anything else.
    """
    t = type(val)
    if t is int:
        return val  # type: ignore[no-any-return]
    if t is str and val.isascii() and (val.isdigit() or (val[:1] == "-" and val[1:].isdigit())):
        return int(val)
    raise BadValue(_bad("intValue", val, "an integer (JSON integer or decimal text)"))


def decode_attributes(
    items: Sequence[dict[str, Any]] | None, keys: Container[str] | None = None
) -> dict[str, Any]:
    """Decode an OTLP/JSON attribute list (``[{"key": k, "value": AnyValue}]``).

    Args:
        items: the list (``None`` or empty: ``{}``).
        keys: decode only these keys; ``None`` decodes every attribute.

    Raises:
        KeyError, TypeError, AttributeError, ValueError: a malformed list.
    """
    if not items:
        return {}
    if keys is None:
        return {a["key"]: _decode_value(a.get("value", {})) for a in items}
    out: dict[str, Any] = {}
    for a in items:
        if a["key"] in keys:
            v = a["value"]
            text = v.get("stringValue")
            out[a["key"]] = text if text is not None else _decode_value(v)
    return out


class BadValue(ValueError):
    """A commspan attribute of a type commspan never writes (``commspan.tensor.bytes``
    a string): its line is damaged, as one with a malformed value."""


def _int(v: Any) -> bool:
    return type(v) is int


def _array(v: Any) -> bool:
    return type(v) is list


# the attributes readers convert or walk (int(), for ... in): of another type, a line
# is damaged. Others are read as they come (a string op, a seq of another type: unknown).
_SPAN_TYPES = ((semconv.MODULE_DEPTH, _int, "an integer"),
               (semconv.PARAM_NAMES, _array, "an array"))
# the counts readers sum (``commspan.collectives.*``): integers, never empty. (The
# bytes and comm-time roll-ups are for backends: no reader converts them.)
_INT_PREFIX = semconv.COUNT_PREFIX
_EVENT_TYPES = ((semconv.TENSOR_BYTES, _int, "an integer"),
                (semconv.TENSOR_SHAPE, _array, "an array"),
                (semconv.PG_RANKS, _array, "an array"),
                (semconv.OWNER_CREDIT, _array, "an array of module names"))


def check_values(
    attrs: Mapping[str, Any], events: Iterable[tuple[str, Mapping[str, Any]]]
) -> None:
    """Check the types of the commspan attributes readers convert, of one span.

    Raises:
        BadValue: one is of another type (``None``, an empty value, is none).
    """
    for key, fits, what in _SPAN_TYPES:
        v = attrs.get(key)
        if v is not None and not fits(v):
            raise BadValue(_bad(key, v, what))
    for key, v in attrs.items():
        if type(key) is not str:
            raise BadValue(_bad("an attribute's key", key, "a string"))
        if key.startswith(_INT_PREFIX) and (type(v) is not int or v < 0):
            raise BadValue(_bad(key, v, "an integer" if type(v) is not int else "a count"))
    names = attrs.get(semconv.PARAM_NAMES)
    if names:
        for key in (semconv.PARAM_PLACEMENTS, semconv.PARAM_SHAPES):
            values = attrs.get(key)
            if values and (type(values) is not list or len(values) < len(names)):
                raise BadValue(_bad(key, values, f"an array of {len(names)} values, one per "
                                                 f"name in {semconv.PARAM_NAMES}"))
    for _name, ev in events:
        for key in ev:
            if type(key) is not str:
                raise BadValue(_bad("an event attribute's key", key, "a string"))
        for key, fits, what in _EVENT_TYPES:
            v = ev.get(key)
            if v is not None and not fits(v):
                raise BadValue(_bad(key, v, what))


_IDS = ("traceId", "spanId", "parentSpanId")
_ID_TYPES = (str, type(None))  # JSON null: no id (a root span's parent), as absent


def _bad_ids(span: Mapping[str, Any]) -> str:
    for key in _IDS:
        v = span.get(key, "")
        if type(v) not in _ID_TYPES:
            return _bad(key, v, "a hex string")
    return "the span's ids are hex strings"  # pragma: no cover - called for a bad one


def _bad(key: str, value: Any, what: str) -> str:
    return (f"{key} is {value!r:.80}, not {what} as commspan writes it (a file edited, or "
            "written by another program)")


Decoded = tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[tuple[str, dict[str, Any]]]]
"""``(resource attributes, raw span object, span attributes, [(event name, event attributes)])``."""


def walk(
    doc: dict[str, Any],
    span_keys: Container[str] | None = None,
    event_keys: Container[str] | None = None,
    int_prefix: str | None = None,
) -> list[Decoded]:
    """The one walk over an OTLP/JSON trace request (``resourceSpans`` ->
    ``scopeSpans`` -> ``spans``), decoding each span's attributes and events.

    Args:
        doc: the parsed request.
        span_keys: decode only these span attributes (and the ``int_prefix``
            ones); ``None`` decodes them all. The resource is always decoded whole.
        event_keys: decode only these event attributes; ``None``: all.
        int_prefix: with ``span_keys``, also decode the span attributes starting
            with it, as ints (the aggregator's count attributes).

    Returns:
        One :data:`Decoded` tuple per span, in document order; the raw span
        object gives its ids, name, times and status.

    Raises:
        KeyError, TypeError, AttributeError, ValueError: a malformed document
            (:class:`BadValue`: a commspan attribute of the wrong type,
            :func:`check_values`); nothing is returned for it.
    """
    out: list[Decoded] = []
    append = out.append
    decode = _decode_value
    for rs in doc["resourceSpans"]:
        resource = decode_attributes(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", ()):
            for s in ss.get("spans", ()):
                items = s.get("attributes")
                if span_keys is None:
                    attrs = decode_attributes(items)
                else:  # the filtered decode, inline: it runs once per span of a file
                    attrs = {}
                    for a in items or ():
                        k = a["key"]
                        if k in span_keys:
                            v = a["value"]
                            text = v.get("stringValue")  # most of them: skip the decoder
                            attrs[k] = text if text is not None else decode(v)
                        elif int_prefix is not None and type(k) is str and \
                                k.startswith(int_prefix):
                            v = a["value"]
                            n = v.get("intValue")
                            try:
                                attrs[k] = _int_value(n) if n is not None else decode(v)
                            except (TypeError, ValueError):  # (check_values names it)
                                attrs[k] = v
                        elif type(k) is not str:
                            raise BadValue(_bad("an attribute's key", k, "a string"))
                events = [
                    (e.get("name", ""), decode_attributes(e.get("attributes"), event_keys))
                    for e in s.get("events") or ()
                ]
                check_values(attrs, events)
                if (type(s.get("traceId", "")) not in _ID_TYPES
                        or type(s.get("spanId", "")) not in _ID_TYPES
                        or type(s.get("parentSpanId", "")) not in _ID_TYPES):
                    raise BadValue(_bad_ids(s))
                if type(s.get("name", "")) is not str:
                    raise BadValue(_bad("name", s["name"], "a string"))
                append((resource, s, attrs, events))
    return out


_MAX_LOGGED = 10


class LineReader:
    """Reads JSONL lines, bounded in length, and deals with the ones it must skip:
    raised (``strict``, damaged lines), recorded in a report, or logged."""

    def __init__(
        self, strict: bool, report: ReadReport | None, max_line_bytes: int, pause_gc: bool
    ) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"strict={strict!r} is not valid; pass True or False")
        if report is not None and not isinstance(report, ReadReport):
            raise TypeError(f"report={report!r} is not valid; pass a ReadReport or None")
        positive_int(
            "max_line_bytes", max_line_bytes,
            f"pass a positive number of bytes (default {DEFAULT_MAX_LINE_BYTES}, 64 MiB)",
        )
        self.strict = strict
        self.report = report
        self.max_line_bytes = max_line_bytes
        self.pause_gc = pause_gc
        self._logged = 0
        self.skipped = 0
        """Lines skipped (not raised), whether recorded in the report or logged."""

    def documents(
        self,
        paths: Sequence[str | os.PathLike[str]],
        regions: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    ) -> Iterator[tuple[Path, int, Any]]:
        """``(file, line number, parsed line)`` for every line that is an OTLP/JSON
        trace request; the others are skipped (or raise).

        ``regions`` maps a path (as given) to the ``(start, stop, lines)`` byte ranges
        to read of it, each starting at a line, ``lines`` being the number of lines
        not read between the previous range and this one (they keep line numbers
        right); paths absent from it are read whole.
        """
        limit = self.max_line_bytes + 1  # the line and its newline
        loads = orjson.loads
        for p in paths:
            path = Path(p)
            ranges = regions.get(os.fspath(p)) if regions is not None else None
            if ranges is None:
                lines: Iterable[tuple[int, bytes]] = _raw_lines(path, limit, self)
            else:
                lines = _ranges(path, limit, self, ranges)
            blank: list[int] = []  # empty lines not yet followed by another line
            for number, raw in _named_errors(path, lines):
                complete = raw[-1:] == b"\n"
                if raw.isspace():  # (no copy, unlike strip())
                    if complete:
                        blank.append(number)
                    continue
                for empty in blank:  # (the exporter never writes one: a line's bytes lost)
                    self.skip(path, empty, "damaged", EMPTY_LINE)
                blank.clear()
                try:
                    if self.pause_gc:
                        with paused_gc():
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
            if blank and ranges and ranges[-1][1] < _size(path):
                # (lines a digest stands for follow them: they are in the middle)
                for empty in blank:
                    self.skip(path, empty, "damaged", EMPTY_LINE)
            # empty lines at the end of the file (``echo >> FILE``, an editor) lost no
            # line: nothing follows them

    def skip(self, path: Path, number: int, kind: str, reason: str) -> None:
        if self.strict and kind != "torn":
            hint = (
                "pass a larger max_line_bytes if the line is genuine"
                if kind == "too_long" else "pass strict=False to skip damaged lines"
            )
            if kind == "damaged" and number == 1:
                # (skipping it may skip the whole file: another format given by mistake;
                # a Chrome trace's reason says what to pass already)
                hint = ("" if "JsonlSpanExporter" in reason else
                        "not a file JsonlSpanExporter wrote (one OTLP/JSON trace request "
                        f"per line)? pass those files, or {hint[5:]}")
            raise ValueError(f"{path}:{number}: {reason}" + (f"; {hint}" if hint else ""))
        self.skipped += 1
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
        self.skip(path, number, "damaged", _reason(doc, exc))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


EMPTY_LINE = ("an empty line, not an OTLP/JSON trace request (JsonlSpanExporter never writes "
          "one: the bytes of a line lost or overwritten)")
_TORN = "no trailing newline: a write cut short by a crash, or a file still being written"
_GZ_TORN = ("the file ends inside this compressed line: a write cut short by a crash, "
            "or a file still being written")
_GZ_CUT = ("a compressed line cut short, with more lines after it (a write cut short by "
           "a crash, then a writer that started afresh)")


def _ranges(
    path: Path, limit: int, reader: LineReader, ranges: Sequence[tuple[int, int, int]]
) -> Iterator[tuple[int, bytes]]:
    """The lines of byte ranges of ``path``, numbered as in the whole file."""
    last = 0
    for start, stop, unread in ranges:
        last += unread
        for number, raw in _raw_lines(path, limit, reader, start, stop, last + 1):
            last = number
            yield number, raw


def _named_errors(
    path: Path, lines: Iterable[tuple[int, bytes]]
) -> Iterator[tuple[int, bytes]]:
    """``lines``, an error reading them (a failing disk, a network filesystem, a file
    of ``/proc``) naming the file and what to do."""
    try:
        yield from lines
    except (FileNotFoundError, IsADirectoryError):
        raise  # (named by the code that lists the files)
    except PermissionError as exc:
        raise PermissionError(
            f"{path} cannot be read ({exc.strerror or exc}); give this user read "
            "permission on it, or leave it out of FILES") from None
    except OSError as exc:
        raise OSError(
            exc.errno, f"{path} cannot be read ({exc.strerror or exc}): a failing disk, a "
            "network filesystem or a special file; copy it to a local disk, or leave it "
            "out of FILES") from None


def _raw_lines(
    path: Path, limit: int, reader: LineReader, start: int = 0, stop: int | None = None,
    first: int = 1,
) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each line of ``path``, compressed or not, from byte
    ``start`` (a line's start, numbered ``first``) to ``stop``; lines the reader must
    skip whole (too long, an undecodable compressed line) go to it."""
    with path.open("rb") as fh:
        if start:  # compressed or not is the file's, told by its start (a range's
            # start may be a cut line)
            compressed = fh.read(3) == GZIP_MAGIC
            fh.seek(start)
        else:
            compressed = fh.peek(3)[:3] == GZIP_MAGIC  # (peek: a FIFO cannot seek back)
        if compressed:
            yield from _gzip_lines(path, fh, limit, reader, start, stop, first)
            return
        readline = fh.readline
        number = first - 1
        pos = start
        while stop is None or pos < stop:
            raw = readline(limit)
            if not raw:
                return
            pos += len(raw)
            number += 1
            if raw[-1:] != b"\n" and len(raw) == limit:
                reader.skip(path, number, "too_long", _too_long(limit - 1))
                return  # reading on would need the rest of the line in memory
            yield number, raw


def _gzip_lines(
    path: Path, fh: Any, limit: int, reader: LineReader, start: int = 0,
    stop: int | None = None, first: int = 1,
) -> Iterator[tuple[int, bytes]]:
    """The lines of a file of gzip members (one per exported line, docs/jsonl.md; or
    one holding every line, ``gzip FILE``'s).

    A member that cannot be decoded is skipped as ``damaged`` (or ``torn`` when the
    file ends inside it) and reading resumes at the next member, as a damaged line
    of a plain file is skipped; the line numbers count members' lines.
    """
    src = FileWindow(fh, start)
    size = src.size if stop is None else min(stop, src.size)  # (a range's end, perhaps)
    pos, number = start, first - 1
    while pos < size:
        head = src.view(pos, 3)[:3]
        if not head:
            return  # the file was cut short here while being read, after a whole line
        if head != GZIP_MAGIC:
            if len(head) < 3 and GZIP_MAGIC.startswith(head):
                kind, reason = "torn", _GZ_TORN  # the file ends inside a header
            else:
                kind, reason = "damaged", "not a compressed line"
        else:
            try:  # the whole member, checksum checked, before any of its lines
                d, out, at = decompress_member(src, pos, size, limit)
            except zlib.error as exc:
                kind = "damaged"
                reason = f"a compressed line that cannot be decompressed ({exc})"
            else:
                if d.eof:
                    pos = at
                    for line in _lines_of(out):
                        number += 1
                        yield number, line
                    continue
                # the member goes on past ``limit`` bytes of output (a file gzipped
                # whole), or the file ends inside it: line by line
                pos, number = yield from _member_lines(
                    path, src, at, size, d, out, limit, reader, number)
                if pos < 0:
                    return
                continue
        number += 1
        reader.skip(path, number, kind, reason)
        pos = src.find(GZIP_MAGIC, pos + 1, size)  # the next line (a writer may start afresh)
        if pos < 0:
            return


def decompress_member(
    src: FileWindow, pos: int, size: int, limit: int = 0
) -> tuple[Any, bytes, int]:
    """Decompress the gzip member at byte ``pos`` of ``src`` (input before ``size``):
    whole, so that zlib checks its checksum before any of its lines is used, or up to
    ``limit`` bytes of output (``0``: no bound), or up to the input's end (a member cut
    short). Input goes in slices that grow from MEMBER_FEED: what follows a member's
    end in its last slice is copied (``unused_data``), for every member.

    Returns:
        The decompressor (``eof``: the member is whole; else it goes on from the input
        returned), the output, and where the input stopped.

    Raises:
        zlib.error: the member cannot be decompressed (damaged, or its checksum fails).
    """
    d = zlib.decompressobj(31)
    parts = []
    got = 0
    at, feed = pos, MEMBER_FEED
    while True:
        chunk = src.view(at, feed)[:min(feed, size - at)]
        if not chunk:
            break  # the input ends inside the member
        out = d.decompress(chunk, limit - got if limit else 0)
        parts.append(out)
        got += len(out)
        at += len(chunk) - len(d.unused_data if d.eof else d.unconsumed_tail)
        if d.eof or (limit and got >= limit):
            break
        feed = min(2 * feed, _STEP)
    return d, b"".join(parts), at


def _lines_of(data: bytes) -> list[bytes]:
    """``data``'s lines, each with its newline (the last may have none), split at
    ``\\n`` only as a plain file's lines are (``bytes.splitlines`` splits at a bare
    ``\\r`` too, which JSON allows between values)."""
    if b"\r" not in data:
        return data.splitlines(keepends=True)
    lines = [line + b"\n" for line in data.split(b"\n")]
    last = lines.pop()[:-1]
    if last:
        lines.append(last)
    return lines


_BLOCK = 4 << 20  # bytes read from a file at a time


class FileWindow:
    """The bytes of an open file, read forward a block at a time as its reader moves
    on, from byte ``start`` (:meth:`of` bytes already read: those).

    Not an ``mmap``: a file cut short while mapped (the exporter trims a line cut
    by a full disk; a user truncates a file being read) kills the process with
    SIGBUS. A file that shrinks while read here ends early instead, its last line
    read as torn or damaged. A pipe is read whole.
    """

    def __init__(self, fh: Any, start: int) -> None:
        self._fh = fh
        self._base = start  # the file offset of _buf[0]
        self._buf = b""
        try:
            regular = stat.S_ISREG(os.fstat(fh.fileno()).st_mode)
        except (OSError, ValueError, AttributeError):
            regular = False
        if regular:
            fh.seek(0, os.SEEK_END)
            self.size = fh.tell()
            fh.seek(start)
        else:  # a pipe: read whole (from its start, peeked at only)
            self._buf = fh.read()
            self.size = start + len(self._buf)
        self._eof = not regular

    @classmethod
    def of(cls, data: bytes) -> FileWindow:
        """A window on ``data``, all of it held (no copy)."""
        window = cls.__new__(cls)
        window._fh, window._base, window._buf = None, 0, data
        window.size, window._eof = len(data), True
        return window

    def _load(self, a: int, want: int) -> None:
        """Hold the file from byte ``a`` on: at least ``want`` bytes of it, unless it
        ends sooner."""
        base, buf = self._base, self._buf
        if a < base or a > base + len(buf):  # (backwards, or a jump ahead: re-read)
            self._fh.seek(a)
            base, buf, self._eof = a, b"", False
        have = base + len(buf) - a
        if have >= want or self._eof:
            return
        more = self._fh.read(max(want - have, _BLOCK))
        if len(more) < max(want - have, _BLOCK):
            self._eof = True  # (the file's end, or it shrank while being read)
        self._buf = buf[a - base:] + more
        self._base = a

    def view(self, a: int, want: int) -> memoryview:
        """The bytes from ``a`` on that are held, at least ``want`` of them (fewer
        only at the file's end): no copy."""
        self._load(a, want)
        return memoryview(self._buf)[a - self._base:]

    def find(self, sub: bytes, a: int, b: int) -> int:
        """The offset of the first ``sub`` in bytes ``[a, b)``, or -1."""
        while a < b:
            self._load(a, min(_BLOCK, b - a))
            base, buf = self._base, self._buf
            stop = min(b, base + len(buf))
            found = buf.find(sub, a - base, stop - base)
            if found >= 0:
                return base + found
            if stop >= b or self._eof:
                return -1
            a = max(a + 1, stop - len(sub) + 1)  # (sub may straddle the blocks)
        return -1


def _cut(at_end: bool) -> tuple[str, str]:
    """How a compressed line cut short is skipped: ``torn`` when the file ends inside
    it, else ``damaged`` (the file goes on: a writer started afresh)."""
    return ("torn", _GZ_TORN) if at_end else ("damaged", _GZ_CUT)


_STEP = 1 << 20


def _member_lines(
    path: Path, src: FileWindow, pos: int, size: int, d: Any, out: bytes,
    limit: int, reader: LineReader, number: int,
) -> Generator[tuple[int, bytes], None, tuple[int, int]]:
    """The lines of a gzip member that goes on past its first ``limit`` bytes, ``out``
    (``gzip FILE`` writes one member of every line), or that the file ends inside;
    ``d`` decompresses it on from input byte ``pos``. ``limit`` bounds each line, as
    in a plain file. The whole lines before a cut or damaged place are read; the line
    holding it is skipped. Returns where the next member starts (``-1``: none) and
    the last line number."""
    step = min(_STEP, limit)  # (a line inside one output is then short enough)
    head: list[bytes] = []  # the start of a line that goes on in the next output
    held = 0
    whole = False  # a line of it was read whole
    while True:
        cut = out.rfind(b"\n") + 1
        if cut:
            if head:
                first = out.find(b"\n") + 1
                head.append(out[:first])
                line = b"".join(head)
                head, held = [], 0
                if len(line) > limit:
                    reader.skip(path, number + 1, "too_long", _too_long(limit - 1))
                    return -1, number
                number += 1
                yield number, line
                out, cut = out[first:], cut - first
            for line in _lines_of(out[:cut]):
                number += 1
                yield number, line
            out = out[cut:]
            whole = True
        if out:
            head.append(out)
            held += len(out)
            if held >= limit:
                reader.skip(path, number + 1, "too_long", _too_long(limit - 1))
                return -1, number
        if d.eof:
            if head:  # a last line without its newline
                number += 1
                yield number, b"".join(head)
            # (the input after the member's end: with a max_length, CPython keeps it
            # in unconsumed_tail as well as in unused_data, and pos stopped before it)
            return pos + len(d.unconsumed_tail) - len(d.unused_data), number
        chunk = src.view(pos, _STEP)[:min(_STEP, size - pos)]
        try:
            out = d.decompress(chunk, step)
        except zlib.error as exc:
            kind = "damaged"
            reason = f"a compressed line that cannot be decompressed ({exc})"
        else:
            pos += len(chunk) - len(d.unconsumed_tail)
            if out or d.eof or len(d.unconsumed_tail) < len(chunk):
                continue
            if whole and not head:  # cut after a line's end (in the gzip trailer)
                return -1, number
            kind, reason = _cut(size == src.size)
        number += 1
        reader.skip(path, number, kind, reason)
        return src.find(GZIP_MAGIC, pos, size), number  # the next line (a writer may start afresh)


DECODE_ERRORS = (TypeError, KeyError, AttributeError, ValueError)


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
        what = f"an object without resourceSpans (keys: {keys}), not an OTLP/JSON trace request"
        if "traceEvents" in doc:  # (a view of a run given back as its input)
            what += (": a Chrome trace (what `commspan perfetto` and write_chrome_trace "
                     "write); pass the JSONL files JsonlSpanExporter wrote")
        return what
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
            except DECODE_ERRORS as exc:
                return f"{at}.value is not an OTLP AnyValue ({type(exc).__name__}: {exc})"
        return None

    def number(v: Any, where: str) -> str | None:
        try:
            int(v)
        except DECODE_ERRORS:
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
                for key in _IDS:
                    if type(v := s.get(key, "")) not in _ID_TYPES:
                        return f"{w3}.{key} is {v!r:.80}, expected a hex string"
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
                try:
                    check_values(decode_attributes(s.get("attributes")), [
                        ("", decode_attributes(e.get("attributes"))) for e in events])
                except BadValue as exc:
                    return f"{w3} ({s.get('name')!r:.80}): {exc}"
    return None


def what_is_wrong(line: bytes, exc: Exception) -> str:
    """Why ``line`` is no OTLP/JSON trace request, as the readers say it; ``exc`` is what
    parsing it (``orjson.JSONDecodeError``) or decoding its spans raised."""
    if isinstance(exc, orjson.JSONDecodeError):
        return f"not a JSON line ({exc})"
    doc = orjson.loads(line)
    if type(doc) is not dict or type(doc.get("resourceSpans")) is not list:
        return _not_a_request(doc)
    return _reason(doc, exc)


def _reason(doc: Any, exc: Exception) -> str:
    """Why a parsed line could not be decoded: where, and what."""
    return _explain(doc) or (
        str(exc) if isinstance(exc, BadValue) else
        f"cannot be decoded ({type(exc).__name__}: {exc})")


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
    reader = LineReader(strict, report, max_line_bytes, pause_gc)
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
    complete line that is not an OTLP/JSON trace request (empty with lines after it,
    not JSON, ``null``,
    a list, wrong types inside) is damaged: with ``strict=True`` (the
    default) it raises ``ValueError`` naming file and line; with
    ``strict=False`` it is skipped and every complete line around it is read.
    A line longer than ``max_line_bytes`` raises, or with ``strict=False``
    ends the reading of that file. Skipped lines are recorded in ``report``
    when one is given, else logged as warnings.

    Args:
        paths: JSONL files, or directories standing for their ``*.jsonl`` and
            ``*.jsonl.gz`` files (:func:`commspan.otlpjson.files.jsonl_files`).
        strict: raise on a damaged line (default) or skip it.
        report: a :class:`ReadReport` that collects what was read and skipped.
        max_line_bytes: longest line read (default 64 MiB); bounds memory.

    Raises:
        ValueError: a damaged or over-long line and ``strict``, naming file and
            line; ``max_line_bytes`` not a positive int.
        TypeError: ``strict`` not a bool, ``report`` not a ``ReadReport``.
        FileNotFoundError: a path does not exist, or a directory holds no JSONL file.
        OSError: a file cannot be read.

    Example:
        >>> from commspan.exporters import read_spans
        >>> spans = list(read_spans())  # pass the files (or the directory) of a run
        >>> spans
        []
    """
    files = jsonl_files(paths) if paths else []
    yield from read_spans_in(files, strict=strict, report=report, max_line_bytes=max_line_bytes)


def read_spans_in(
    paths: Sequence[str | os.PathLike[str]],
    *,
    strict: bool = True,
    report: ReadReport | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    regions: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    on_line: Callable[[Path, int, Sequence[SpanRecord]], None] | None = None,
) -> Iterator[SpanRecord]:
    """:func:`read_spans` of parts of files: ``regions`` maps a path (as given) to the
    ``(start, stop, lines not read before it)`` byte ranges to read of it (each
    starting at a line); a path absent from it is read whole. ``on_line(path, line
    number, records)`` is called for each line read, before its records are yielded
    (where a damaged line lies among the others: :mod:`commspan.analysis.unread`)."""
    reader = LineReader(strict, report, max_line_bytes, True)
    for path, number, doc in reader.documents(paths, regions):
        try:
            records = list(_records(doc))
        except DECODE_ERRORS as exc:
            reader.bad_request(path, number, doc, exc)
            continue
        if on_line is not None:
            on_line(path, number, records)
        if report is not None:
            report.lines += 1
            report.spans += len(records)
            for r in records:
                if semconv.MODULE_FQN in r.attributes:
                    report.commspan_spans += 1
                    report.ranks.add(r.rank)
        yield from records


def request_spans(doc: dict[str, Any]) -> list[SpanRecord]:
    """The span records of one parsed OTLP/JSON request (one JSONL line).

    Raises:
        KeyError, TypeError, AttributeError, ValueError: a malformed request.
    """
    return list(_records(doc))


def span_time(obj: Mapping[str, Any], key: str) -> int:
    """A timestamp of a span or event (``0`` when absent), as :func:`_int_value` reads
    an integer.

    Raises:
        BadValue: anything else (``1.5``, ``true``, ``" 12"``, which ``int()`` took).
    """
    v = obj.get(key, 0)
    if type(v) is int or type(v) is str and v.isascii() and v.isdigit():
        return int(v)
    raise BadValue(_bad(key, v, "an integer (nanoseconds)"))


def resource_rank(resource: Mapping[str, Any], attrs: Mapping[str, Any]) -> int | None:
    """The ``commspan.rank`` of a span's resource (``None``: none, as another program's
    spans have).

    Raises:
        BadValue: a commspan span (one naming a module) with no rank in its resource nor
            its own attributes: commspan writes it in every resource, and the readers
            that go by rank would drop the span while the others count it.
    """
    rank = rank_value(resource.get(semconv.RANK))
    if rank is None and semconv.MODULE_FQN in attrs and \
            rank_value(attrs.get(semconv.RANK)) is None:
        raise BadValue(_bad(semconv.RANK, resource.get(semconv.RANK),
                            "a rank, in the resource of a commspan span"))
    return rank


def _records(doc: dict[str, Any]) -> Iterator[SpanRecord]:
    for res, s, attributes, events in walk(doc):
        status = s.get("status") or {}
        rank = resource_rank(res, attributes)
        yield SpanRecord(
            name=s.get("name", ""),
            trace_id=s.get("traceId") or "",
            span_id=s.get("spanId") or "",
            parent_span_id=s.get("parentSpanId") or "",
            start_time=span_time(s, "startTimeUnixNano"),
            end_time=span_time(s, "endTimeUnixNano"),
            attributes=attributes,
            events=events,
            event_times=[span_time(e, "timeUnixNano") for e in s.get("events") or ()],
            status_code=int(status.get("code", 0) or 0),
            status_message=status.get("message", ""),
            rank=rank,
            resource=res,
        )
