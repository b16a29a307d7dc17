"""Digests: a small side file that lets thousand-rank runs be read in seconds.

A JSONL line holds every span of an export batch, about 1 kB per span; reading
a run back means parsing all of it. ``JsonlSpanExporter(digest=True)`` also
appends, for each line it writes, one *digest line* to ``<file>.digest``: what
the offline readers need from that line, already folded per rank and trace:

* the aggregator's counts, module records, per-owner sums and mesh-dimension
  sums (:meth:`commspan.Aggregator.from_jsonl`, ``commspan summary``/``table``);
* one row per collective event with the fields of a
  :class:`~commspan.analysis.records.CollectiveRecord` (``commspan check``);
* the rank spans, span counts, first start and last end, step and run of each
  trace (run and step selection, ``summary``).

The JSONL stays the record: a digest line names the byte offset, length and a
checksum of the start of the line it stands for, and a reader uses it only when
the JSONL file still holds that line there. Lines without a valid digest (a
crash between the two writes, a digest that could not be written, a line holding
a hang record, spans without a rank) are parsed from the JSONL as usual, so a
run with digests gives the same answers as without them (docs/jsonl.md,
"Digests"). The digest is plain JSON lines, also beside a compressed file: what
repeats (a module's counts, a collective's group, shapes and module) is written
once per file and named, so it stays a few kB per step.

Example:
    >>> from commspan.analysis.digest import digest_path
    >>> str(digest_path("run/commspan-rank0.jsonl"))
    'run/commspan-rank0.jsonl.digest'
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import orjson

from commspan import semconv
from commspan.analysis.counts import Aggregator
from commspan.analysis.diff import diff_usage
from commspan.analysis.records import (
    _STATUS_ERROR,
    MAX_WORLD_SIZE,
    CollectiveRecord,
    GcRecord,
    ModuleSpan,
    RankStep,
    Run,
    SpanTimes,
    _collective,
    _raised_where,
    _times,
    gc_event_fields,
)
from commspan.analysis.runs import (
    RunInfo,
    StepRange,
    choose,
    commspan_runs,
    last_traces_of,
    runs_of,
    writer_of,
)
from commspan.analysis.summary import _Unfinished, part_last_start, summary_of
from commspan.otlpjson.decode import (
    DECODE_ERRORS,
    EMPTY_LINE,
    GZIP_MAGIC,
    FileWindow,
    decompress_member,
    read_spans_in,
    request_spans,
    what_is_wrong,
)
from commspan.otlpjson.encode import resource_and_scope, span_fields
from commspan.otlpjson.files import starts_compressed
from commspan.otlpjson.records import (
    DEFAULT_MAX_LINE_BYTES,
    ReadReport,
    SkippedLine,
    SpanRecord,
    rank_value,
)

__all__ = [
    "DIGEST_SUFFIX",
    "DIGEST_VERSION",
    "DigestPart",
    "DigestTexts",
    "FileDigest",
    "PartMerger",
    "PartSelection",
    "aggregate_parts",
    "check_digestible",
    "list_part_runs",
    "load_parts",
    "older_digests",
    "select_parts",
    "summarize_parts",
    "write_digest",
    "digest_line",
    "digest_parts",
    "digest_path",
    "read_digest",
    "span_records",
    "span_times_of_parts",
]

DIGEST_SUFFIX = ".digest"
"""Appended to a JSONL file's name to name its digest."""
DIGEST_VERSION = 8
"""The version written in every digest line (``"digest"``). Readers use lines of
this version only and parse the JSONL lines of any other: version 1 had no
collective's owner (the module that owns a collective issued by another, as FSDP2's
unit does), version 2 no point-to-point tag (``commspan.p2p.tag``), and answers read
from them would differ from the lines' (an owner charged to the issuer, a tagged send
not matched with its receive), version 3 no rank's error (the rank span's ERROR
status and where it was raised), version 4 only the rank span that ended last of a
step number used again (``RankStep.repeats``, its start and duration), version 5 no
module spans and collector pauses (``commspan stragglers`` parsed every line for
them), version 6 what ``commspan diff`` compares of each collective (its mesh
dimension's name, its redistribution's placements: ``diff`` parsed every line),
version 7 an all-to-all's split sizes and a rooted collective's root (``commspan
check`` compares them across the group). ``commspan digest DIR`` rewrites a run's digests."""
_READ_VERSIONS = (DIGEST_VERSION,)
_SAMPLE = 64  # bytes at the middle and end of a line whose CRC-32 the digest keeps
_HEAD = 2048  # and at its start: the resource, whose run id tells two runs' lines apart

DigestPart = dict[str, Any]
"""The digest of one (rank, trace) of one line: see :func:`digest_parts`."""


_STREAM_DIRS = ("/dev/", "/proc/")
"""Where the paths of streams live (``/dev/stdin``, ``/dev/fd/N``, ``/proc/self/fd/N``):
no digest is written beside them."""


def digest_path(path: str | os.PathLike[str]) -> Path:
    """The digest file of a JSONL file: its name with ``.digest`` appended."""
    return Path(os.fspath(path) + DIGEST_SUFFIX)


def older_digests(files: Iterable[str | os.PathLike[str]]) -> dict[int, int]:
    """``version -> number of files`` whose digest was written by another version of
    commspan (its first line's ``"digest"``): readers parse such files' lines, until
    ``commspan digest`` rewrites their digests.

    Example:
        >>> older_digests(["no-such-file.jsonl"])
        {}
    """
    out: dict[int, int] = {}
    for f in files:
        try:
            with open(digest_path(f), "rb") as fh:
                head = fh.read(24)
        except OSError:
            continue
        if not head.startswith(b'{"digest":'):
            continue
        number = head[10:].split(b",", 1)[0]
        if number.isdigit() and int(number) != DIGEST_VERSION:
            out[int(number)] = out.get(int(number), 0) + 1
    return out


def check_digestible(path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` unless ``path`` is a regular file of its own, one a digest
    can be written beside (not ``/dev/stdin``, ``/dev/fd/N``, a pipe or a device)."""
    if not os.path.abspath(path).startswith(_STREAM_DIRS) and Path(path).is_file():
        return
    # /dev/stdin of a redirected file is a regular file, but its digest would be
    # /dev/stdin.digest, beside no file of the run, standing for whatever the next
    # standard input is
    raise ValueError(
        f"{os.fspath(path)}: not a regular file of its own (standard input, a pipe or a "
        f"device): its digest would go to {digest_path(path)}, where no later read of the "
        "file finds it; pass the JSONL file's own path")


def _sample_ranges(length: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the bytes of a line of ``length`` bytes whose CRC-32 stands
    for the line: its first 2 KiB (the resource, with the run id: a file replaced by
    another run's of the same program has lines of the same lengths and shapes), its
    middle and its end (span ids and times)."""
    mid = max(0, length // 2 - _SAMPLE // 2)
    return [(0, min(_HEAD, length)), (mid, min(_SAMPLE, length - mid)),
            (max(0, length - _SAMPLE), min(_SAMPLE, length))]


def _sample_crc(line: bytes | memoryview) -> int:
    crc = 0
    for start, size in _sample_ranges(len(line)):
        crc = zlib.crc32(line[start:start + size], crc)
    return crc


def span_records(spans: Sequence[Any]) -> list[SpanRecord]:
    """SDK spans as the :class:`~commspan.otlpjson.records.SpanRecord` s a reader would
    get back from their JSONL line, as far as digests read them: ids as hex, event
    array values as lists; span attributes stay the SDK's mapping (arrays as tuples)."""
    out: list[SpanRecord] = []
    append = out.append
    # (per export batch, usually one step: one resource, one trace, a few statuses)
    resources: dict[int, tuple[dict[str, Any], int | None]] = {}
    traces: dict[int, str] = {}
    statuses: dict[int, tuple[int, str]] = {}
    for span in spans:
        try:  # span_fields and resource_and_scope, inlined: this runs for every span
            ctx, parent, name, start, end, attrs, events, status, resource = (
                span._context, span._parent, span._name, span._start_time, span._end_time,
                span._attributes, span._events, span._status, span._resource)
        except AttributeError:
            ctx, parent, name, _, start, end, attrs, events, _, status = span_fields(span)
            resource = resource_and_scope(span)[0]
        known = resources.get(id(resource))
        if known is None:
            res = _plain(resource.attributes if resource else None)
            known = resources[id(resource)] = (res, rank_value(res.get(semconv.RANK)))
        if ctx is not None:
            trace_id = traces.get(ctx.trace_id)
            if trace_id is None:
                trace_id = traces[ctx.trace_id] = f"{ctx.trace_id:032x}"
            span_id = f"{ctx.span_id:016x}"
        else:
            trace_id = span_id = ""
        if status is None:
            code, message = 0, ""
        else:
            # the status as the line holds it (a rank span's error, digest version 4)
            found = statuses.get(id(status))
            if found is None:
                found = statuses[id(status)] = (
                    status.status_code.value, status.description or "")
            code, message = found
        append(
            SpanRecord(
                name,
                trace_id,
                span_id,
                f"{parent.span_id:016x}" if parent is not None else "",
                start or 0,
                end or 0,
                attrs if attrs is not None else {},
                [(e.name, _plain(e.attributes)) for e in events] if events else [],
                [e.timestamp for e in events] if events else [],
                code,
                message,
                known[1],
                known[0],
            )
        )
    return out


def _plain(attrs: Any) -> dict[str, Any]:
    if not attrs:
        return {}
    return {k: list(v) if type(v) is tuple else v for k, v in attrs.items()}


def _hashable(v: Any) -> Any:
    return tuple(v) if type(v) is list else v


_AGG_SPAN_KEYS = frozenset({
    semconv.MODULE_TYPE, semconv.MODULE_DEPTH, semconv.PARAM_NAMES, semconv.PARAM_PLACEMENTS,
    semconv.PARAM_SHAPES, semconv.PHASE,
})
_AGG_EVENT_KEYS = frozenset({
    semconv.COLL_OP, semconv.OWNER_CREDIT, semconv.PHASE, semconv.OWNER_FQN,
    semconv.MODULE_FQN, semconv.REDIST_SRC, semconv.REDIST_DST, semconv.TENSOR_BYTES,
    semconv.MESH_DIM_NAME, semconv.MESH_DIM, semconv.PG_NAME,
})
_CONTRIBUTIONS: dict[Any, str] = {}
_CONTRIBUTIONS_MAX = 1 << 14


_SELECTED: dict[tuple[str, ...], tuple[str, ...]] = {}
"""Attribute keys of a span or event (in their order) -> those :func:`_contribution`'s
cache key holds: the same few key tuples step after step."""


def _selected(keys: tuple[str, ...], wanted: frozenset[str], prefix: str) -> tuple[str, ...]:
    sel = _SELECTED.get(keys)
    if sel is None:
        sel = tuple([k for k in keys if k in wanted or (prefix and k.startswith(prefix))])
        if len(_SELECTED) >= _CONTRIBUTIONS_MAX:
            _SELECTED.clear()
        _SELECTED[keys] = sel
    return sel


def _contribution(fqn: str, rec: SpanRecord) -> str:
    """What one commspan span adds to an :class:`Aggregator`, as JSON text
    (:func:`_agg_state`); the same for a module's span of one kind step after step,
    so kept in a bounded cache keyed by what the aggregator reads of the span."""
    attrs = rec.attributes
    op_key = semconv.COLL_OP
    keys = tuple(attrs)
    sel = _selected(keys, _AGG_SPAN_KEYS, semconv.COUNT_PREFIX)
    events = []
    for _name, ev in rec.events:
        if op_key in ev:
            ev_sel = _selected(tuple(ev), _AGG_EVENT_KEYS, "")
            events.append((ev_sel, tuple([ev[k] for k in ev_sel])))
    key: Any = (fqn, sel, tuple([attrs[k] for k in sel]), tuple(events))
    try:
        text = _CONTRIBUTIONS.get(key)
    except TypeError:  # a list among the values (a line read back): as tuples
        key = (fqn, sel, tuple([_hashable(attrs[k]) for k in sel]),
               tuple([(ks, tuple([_hashable(v) for v in vs])) for ks, vs in events]))
        try:
            text = _CONTRIBUTIONS.get(key)
        except TypeError:  # a value that cannot be a key (a nested list): no caching
            key, text = None, None
    if text is None:
        one = Aggregator()
        one._add(fqn, attrs, rec.start_time, rec.events)
        text = _agg_state(one)
        if key is not None:
            if len(_CONTRIBUTIONS) >= _CONTRIBUTIONS_MAX:
                _CONTRIBUTIONS.clear()
            _CONTRIBUTIONS[key] = text
    return text


# ------------------------------------------------------------------ building
def digest_parts(records: Iterable[SpanRecord]) -> list[DigestPart] | None:
    """The digest of the spans of one line, one part per (run, rank, trace) in order of
    first appearance; ``None`` when the line holds what a digest does not carry (a
    hang record, a span without a rank, an int beyond 64 bits, which orjson reads
    back as a float): readers then parse the line itself.

    Each part is a dict: ``run``, ``rank``, ``world_size``, ``sample``, ``writer``
    (``"host:pid"`` of the process that wrote it, or ``None``), ``trace``,
    ``spans`` (spans of the trace), ``present`` (spans other than the step root),
    ``commspan_spans``, ``start``/``end`` (earliest start and latest end of every
    span), ``present_start`` (earliest start of the spans counted in ``present``),
    ``step`` (from a step, rank or hang span), ``rank_step`` (the rank span's
    ``[span_id, start, end, step]``, its status message fifth when ERROR; of a step
    number used again, the use that ended last), ``repeats`` (``[span_id, start,
    end]`` of the part's other rank spans: the other uses of a step number used
    again), ``raised`` (``[time, fqn, phase]``
    of the part's latest ``exception`` event, or ``None``), ``aggs`` (what each
    commspan span adds to an :class:`Aggregator`, as JSON text: :func:`_agg_state`)
    with ``first`` (when each started, after ``start``), and the collectives:
    ``tmpls`` (what stays the same step after step, as JSON text) and ``coll``
    (JSON text of ``[template index,
    seq, issued_ns, duration_ns]`` rows, with ``p2p_seq`` fifth for a point-to-point
    op numbered per peer, and ``wait_ns`` sixth when recorded, ``p2p_seq`` then
    ``null`` for a collective); from version 6, ``mtmpls`` (each module span's
    ``[fqn, phase]`` as JSON text), ``mods`` (JSON text of a ``[template index, span
    id, parent, start after the part's start, duration]`` row per module span, the
    parent the index of its row when it is one of the part's, else its span id) and
    ``gc`` (``[time, attributes]`` of each ``commspan.gc`` event).
    """
    try:
        return _digest_parts(records)
    except TypeError as exc:
        if "64-bit" not in str(exc):
            raise
        return None


def _digest_parts(records: Iterable[SpanRecord]) -> list[DigestPart] | None:
    parts: dict[tuple[str, int, str], _Part] = {}
    resources: dict[int, tuple[str, int | None, str | None, str | None]] = {}
    span_step, span_rank, span_hang = semconv.SPAN_STEP, semconv.SPAN_RANK, semconv.SPAN_HANG
    fqn_key, step_key, op_key = semconv.MODULE_FQN, semconv.STEP, semconv.COLL_OP
    exception, gc_event, phase_key = semconv.EVENT_EXCEPTION, semconv.EVENT_GC, semconv.PHASE
    for rec in records:
        rank = rec.rank
        name = rec.name
        if rank is None or name == span_hang:
            return None
        attrs = rec.attributes
        res = rec.resource
        known = resources.get(id(res))
        if known is None:
            run = res.get(semconv.RUN_ID)
            world = res.get(semconv.WORLD_SIZE)
            sample = res.get(semconv.SAMPLING_RANKS)
            known = resources[id(res)] = (
                str(run) if run else "",
                world if isinstance(world, int) and not isinstance(world, bool)
                and 0 < world <= MAX_WORLD_SIZE
                else None,
                str(sample) if sample else None,
                writer_of(res),
            )
        run = known[0]
        if not run and attrs.get(semconv.RUN_ID):
            run = str(attrs[semconv.RUN_ID])
        key = (run, rank, rec.trace_id)
        part = parts.get(key)
        if part is None:
            part = parts[key] = _Part(run, rank, rec.trace_id, rec.start_time, rec.end_time)
            part.world_size, part.sample, part.writer = known[1], known[2], known[3]
        start = rec.start_time
        part.spans += 1
        if start < part.start:
            part.start = start
        if start > part.last_start:
            part.last_start = start
        if rec.end_time > part.end:
            part.end = rec.end_time
        if semconv.WORLD_SIZE in attrs and known[1] is None:
            world = attrs[semconv.WORLD_SIZE]
            if isinstance(world, int) and 0 < world <= MAX_WORLD_SIZE:
                part.world_size = max(part.world_size or 0, world)
        if name == span_step or name == span_rank:
            step = attrs.get(step_key)
            if isinstance(step, bool):
                return None  # (a step the lines' readers take in some places only)
            if type(step) is not int:
                step = None
            if part.step is None:
                part.step = step
            if name == span_step:
                continue
            # of a step number used again, the use that ended last (RankStep.error); the
            # others in ``repeats`` (version 5: RankStep.repeats, its duration)
            if part.rank_step is None or rec.end_time >= part.rank_step[2]:
                if part.rank_step is not None:
                    part.repeats.append(part.rank_step[:3])
                part.rank_step = [rec.span_id, start, rec.end_time, step]
                if rec.status_code == _STATUS_ERROR:  # (version 4) its error, fifth
                    part.rank_step.append(rec.status_message or "error")
            else:
                part.repeats.append([rec.span_id, start, rec.end_time])
        part.present += 1
        if part.present_start is None or start < part.present_start:
            part.present_start = start
        fqn = attrs.get(fqn_key)
        if fqn is not None:
            part.commspan_spans += 1
            part.aggs.append(_contribution(str(fqn), rec))
            part.first.append(start)
            phase = attrs.get(phase_key)
            if name != span_rank and type(fqn) is str and type(phase) is str:
                # (version 6) a module span, as build_run keeps it (stragglers' step times)
                part.mods.append((fqn, phase, rec.span_id, rec.parent_span_id, start,
                                  rec.end_time))
        if rec.events:
            for (_name, ev), t in zip(rec.events, _times(rec)):
                if op_key in ev:
                    c = _collective(rank, None, rec.trace_id, t, ev)
                    compared = None
                    if fqn is not None:  # (version 7) what commspan diff compares of it
                        compared = diff_usage(ev, fqn)
                        if compared is not None and c is None:
                            return None  # (an op name that is not a text: parse the line)
                    if c is not None:
                        row: list[Any] = list(c[3:])
                        row.append(list(compared) if compared is not None else None)
                        part.coll.append(row)
                elif _name == gc_event:  # (version 6) a collector's pause
                    part.gc.append([t, _plain(ev)])
                elif _name == exception and (part.raised is None or t >= part.raised[0]):
                    # (version 4) where an error was raised: the part's latest; the
                    # rank span may be in another line's part (run_from_parts)
                    part.raised = [t, *_raised_where(name, attrs)]
    return [part.done() for part in parts.values()]


class _Part:
    """A part being built (:func:`digest_parts`)."""

    __slots__ = ("run", "rank", "trace", "world_size", "sample", "writer", "spans",
                 "present", "commspan_spans", "start", "end", "present_start", "step",
                 "rank_step", "repeats", "raised", "aggs", "first", "coll", "mods", "gc",
                 "last_start")

    def __init__(self, run: str, rank: int, trace: str, start: int, end: int) -> None:
        self.run, self.rank, self.trace = run, rank, trace
        self.world_size: int | None = None
        self.sample: str | None = None
        self.writer: str | None = None
        self.spans = self.present = self.commspan_spans = 0
        self.start, self.end = start, end
        self.last_start = start  # (version 7) the latest start: the rank's latest trace
        self.present_start: int | None = None
        self.step: int | None = None
        self.rank_step: list[Any] | None = None
        self.repeats: list[list[Any]] = []
        self.raised: list[Any] | None = None
        self.aggs: list[str] = []
        self.first: list[int] = []
        self.coll: list[list[Any]] = []
        self.mods: list[tuple[str, str, str, str, int, int]] = []
        self.gc: list[list[Any]] = []

    def done(self) -> DigestPart:
        part = {name: getattr(self, name) for name in self.__slots__}
        # a collective is its template (what stays the same step after step: group,
        # op, shapes, module, ...) and what changes (sequence number, time, duration);
        # the rows as JSON text: only check reads them, and a string costs the other
        # readers one copy instead of thousands of objects
        templates: dict[str, int] = {}
        rows = []
        for row in self.coll:
            compared = row.pop()
            root = row.pop()
            splits = row.pop()
            tag = row.pop()
            owner = row.pop()
            wait = row.pop()
            seq, issued, duration, p2p_seq = row[2], row[12], row[13], row.pop()
            row[2] = row[12] = row[13] = None
            more = splits is not None or root is not None
            if owner is not None or tag is not None or compared is not None or more:
                row.append(owner)  # (version 2) a 16th field, only where it says more
            if tag is not None or compared is not None or more:
                row.append(tag)  # (version 3) a point-to-point op's tag, 17th
            if compared is not None or more:  # (version 7) what diff compares, 18th, on
                row.append(compared)  # a module's span: [owner or module, phase, op,
                # placements "src->dst" or null, mesh dimension or group]
            if more:  # (version 8) an all-to-all's [input splits, output splits], 19th,
                row.append([list(splits[0]), list(splits[1])] if splits else None)
                row.append(root)  # and the root of a collective that has one, 20th
            text = orjson.dumps(row).decode()
            index = templates.setdefault(text, len(templates))
            # a point-to-point op's number per peer (schema 3) comes fifth, a functional
            # collective's wait (commspan.collective.wait_ns) sixth
            if wait is not None:
                rows.append([index, seq, issued, duration, p2p_seq, wait])
            elif p2p_seq is not None:
                rows.append([index, seq, issued, duration, p2p_seq])
            else:
                rows.append([index, seq, issued, duration])
        part["tmpls"] = list(templates)
        part["coll"] = orjson.dumps(rows).decode()
        # (version 6) the module spans: their module and phase once per file (``mtmpls``),
        # and per span ``[template index, span id, parent, start after the part's start,
        # duration]``, as JSON text (only stragglers reads them); the parent is the
        # index of its row when it is one of the part's module spans (most are: 17 of
        # the row's 60 bytes), else its span id
        names: dict[str, int] = {}
        first = self.start
        rows_of = {mod[2]: i for i, mod in enumerate(self.mods)}
        spans = [[names.setdefault(orjson.dumps([fqn, phase]).decode(), len(names)),
                  span_id, rows_of.get(parent, parent), start - first, end - start]
                 for fqn, phase, span_id, parent, start, end in self.mods]
        part["mtmpls"] = list(names)
        part["mods"] = orjson.dumps(spans).decode()
        return part


def _agg_state(agg: Aggregator) -> str:
    """What an aggregator holds, as JSON text without the times modules first ran (the
    text is then the same step after step for a module's span; readers fold each
    distinct text once: :class:`PartMerger`)."""
    return orjson.dumps({
        "counts": agg._counts,
        "modules": [
            [m.fqn, m.type, m.depth, [[n, s, p] for n, (s, p) in m.params.items()]]
            for m in agg._modules.values()
        ],
        "summaries": [[*k, *v] for k, v in agg._summaries.items()],
        "by_dim": [[*k, *v] for k, v in agg._by_dim.items()],
        "global": agg._seen_global,
        "phases": {fqn: sorted(phases) for fqn, phases in agg._phases.items()},
    }).decode()


class PartMerger:
    """Folds the aggregator states of digest parts into an :class:`Aggregator`.

    Parts of the same modules doing the same thing carry the same state text; each
    distinct text is decoded and folded once, times the number of parts carrying it,
    with the earliest time each module first ran.

    Args:
        agg: the aggregator to fold into (on :meth:`finish`).
        rank: fold the parts of this rank only (``None``: every rank).
        run: fold the parts of this run only (``None``: every run).
    """

    def __init__(self, agg: Aggregator, rank: int | None, run: str | None = None) -> None:
        self.agg = agg
        self.rank = rank
        self.run = run
        self.ranks: set[int] = set()
        """Ranks of the parts that hold commspan spans, whether folded or not."""
        self.runs: set[str] = set()
        """Run ids of the parts that hold commspan spans, whether folded or not."""
        self._pending: dict[str, list[Any]] = {}  # text -> [times, earliest start]
        # id(table) -> (a digest's texts by number, how many times each was used)
        self._tables: dict[int, tuple[dict[int, Any], Counter[int]]] = {}

    def add(self, parts: Iterable[DigestPart]) -> None:
        """Note the parts of one line."""
        for part in parts:
            if not part["commspan_spans"]:
                continue
            r = part["rank"]
            run = str(part.get("run") or "")
            self.runs.add(run)
            if self.run is not None and run != self.run:
                continue
            self.ranks.add(r)
            if self.rank is not None and r != self.rank:
                continue
            table = part.get("table")
            if table is not None:  # read from a digest: numbers of its texts
                slot = self._tables.get(id(table))
                if slot is None:
                    slot = self._tables[id(table)] = (table, Counter())
                slot[1].update(part["aggs"])
                continue
            pending = self._pending
            for text, first in zip(part["aggs"], part["first"]):
                known = pending.get(text)
                if known is None:
                    pending[text] = [1, first]
                else:
                    known[0] += 1
                    known[1] = min(known[1], first)

    def finish(self) -> Aggregator:
        """Fold everything noted into the aggregator and return it."""
        pending = self._pending
        for table, counts in self._tables.values():
            for number, times in counts.items():
                text, first = table[number]
                known = pending.get(text)
                if known is None:
                    pending[text] = [times, first]
                else:
                    known[0] += times
                    known[1] = min(known[1], first)
        for text, (times, first) in pending.items():
            _merge_agg(self.agg, orjson.loads(text), times, first)
        pending.clear()
        self._tables.clear()
        return self.agg


def _merge_agg(agg: Aggregator, state: dict[str, Any], times: int, first: int) -> None:
    """Fold a part's aggregator state, ``times`` over, into ``agg``."""
    from commspan.analysis.tree import ModuleRecord

    counts = agg._counts
    for fqn, phases in state["counts"].items():
        mine = counts.setdefault(fqn, {})
        for phase, ops in phases.items():
            slot = mine.setdefault(phase, {})
            for op, n in ops.items():
                slot[op] = slot.get(op, 0) + n * times
    modules = agg._modules
    seen = first
    for fqn, mtype, depth, params in state["modules"]:
        rec = modules.get(fqn)
        if rec is None:
            rec = modules[fqn] = ModuleRecord(fqn, mtype, depth, seen)
        elif not rec.type and mtype:  # known from a credit only (as Aggregator._note_module)
            rec.type, rec.depth = mtype, depth
            rec.first_seen = seen
        elif seen < rec.first_seen and (mtype or not rec.type):  # (a credit's time: not
            rec.first_seen, rec.depth = seen, depth                # a typed module's)
        elif rec.params:
            continue
        for name, shape, placement in params:
            rec.params[name] = (shape, placement)
    tables: tuple[tuple[dict[Any, list[int]], list[list[Any]]], ...] = (
        (agg._summaries, state["summaries"]), (agg._by_dim, state["by_dim"]))
    for table, rows in tables:
        for row in rows:
            key = tuple(row[:-2])
            sums = table.get(key)
            if sums is None:
                table[key] = [row[-2] * times, row[-1] * times]
            else:
                sums[0] += row[-2] * times
                sums[1] += row[-1] * times
    if state["global"]:
        agg._seen_global = True
    for fqn, phases in state.get("phases", {}).items():  # (every version-4 digest has it)
        agg._phases.setdefault(fqn, set()).update(phases)


class DigestTexts:
    """The texts (aggregator states, collective templates) a digest file already
    holds: a writer keeps one per file and writes each text once, then its number.
    Numbers belong to a random token of the writer, so that a later writer
    appending to the file cannot be mistaken for this one."""

    MAX = 1 << 14

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}
        self.token = os.urandom(4).hex()
        self.next = 0

    def number(self, text: str, defs: dict[str, Any], first: int | None = None) -> int:
        """The number of ``text``, adding it to ``defs`` the first time (with ``first``,
        when the span it comes from started: the earliest in the file, since a module's
        spans of one kind follow each other)."""
        number = self.numbers.get(text)
        if number is None:
            if len(self.numbers) >= self.MAX:  # bounded: forget, numbers stay unique
                self.numbers.clear()
            number = self.numbers[text] = self.next
            self.next += 1
            defs[str(number)] = text if first is None else [text, first]
        return number


def digest_line(
    records: Iterable[SpanRecord], line: bytes | memoryview, offset: int, spans: int,
    texts: DigestTexts | None = None,
) -> bytes:
    """One digest line for the JSONL line ``line`` written at byte ``offset``.

    The line is a JSON object, a space, its CRC-32 (8 hex digits), a space, a JSON
    array of its parts' module spans (no space in it), a space and the array's
    CRC-32: a digest line whose object is damaged is not used; one whose array is
    damaged is not used by the readers of module spans.

    Args:
        records: the line's spans.
        line: the bytes written (compressed, if the file is).
        offset: where they start in the file.
        spans: how many spans the line holds.
        texts: the texts already written to this digest file (kept by the writer
            across lines; ``None``: this line defines every text it uses).
    """
    parts = digest_parts(records)
    texts = texts if texts is not None else DigestTexts()
    defs: dict[str, str] = {}
    mods: list[bytes] = []
    if parts is not None:
        number = texts.number
        for part in parts:
            names = orjson.dumps([number(t, defs) for t in part.pop("mtmpls")])
            mods.append(b"[%s,%s]" % (names, part.pop("mods").encode()))
            part["aggs"] = [number(t, defs, f) for t, f in zip(part["aggs"], part["first"])]
            del part["first"]
            part["tmpls"] = [number(t, defs) for t in part["tmpls"]]
    head = {"digest": DIGEST_VERSION, "offset": offset, "length": len(line),
            "sample": _sample_crc(line), "spans": spans, "token": texts.token, "defs": defs}
    try:
        body = orjson.dumps({**head, "parts": parts})
    except TypeError as exc:  # an int beyond 64 bits (a rank, a time): the line is parsed
        if "64-bit" not in str(exc):
            raise
        body, mods = orjson.dumps({**head, "parts": None}), []
    # (version 6) the parts' module spans after the object and its checksum, with their
    # own: only stragglers reads them, and the other readers neither check, parse nor
    # hold them (more than half of the line). A JSON array, per part, of its module
    # templates' numbers and its rows, which hold no space.
    blob = b"[%s]" % b",".join(mods)
    return b"%s %08x %s %08x\n" % (body, zlib.crc32(body), blob, zlib.crc32(blob))


def write_digest(path: str | os.PathLike[str], report: ReadReport | None = None) -> int:
    """Write the digest of a JSONL file written without one (``commspan digest``).

    Every complete line that is an OTLP/JSON request gets its digest line; the
    others (damaged, cut short) get none, and readers parse them as before. The
    digest replaces any ``<file>.digest`` there was, in one rename; a file none of
    whose lines gets one (empty, or of another format: a Chrome trace, a README)
    is left without a digest, as an empty one would stand for nothing.

    Args:
        path: a JSONL file (plain or compressed).
        report: if given, counts the lines, spans and commspan spans digested,
            and records each damaged line (``SkippedLine``, kind ``damaged``).

    Returns:
        The number of lines the digest stands for.

    Raises:
        OSError: the file cannot be read or the digest written.
        ValueError: ``path`` is not a regular file of its own (``/dev/stdin``, a
            pipe, a device): its digest would go where no later read finds it.

    Example:
        >>> import pathlib, tempfile
        >>> empty = pathlib.Path(tempfile.mkdtemp()) / "commspan-rank0.jsonl"
        >>> _ = empty.write_bytes(b"")
        >>> write_digest(empty)
        0
    """
    path = Path(path)
    side = digest_path(path)
    check_digestible(path)
    tmp = side.with_name(side.name + ".tmp")
    texts = DigestTexts()
    written = 0
    try:  # (the temporary file goes, whatever stops the writing: an error, Ctrl-C)
        with path.open("rb") as fh, tmp.open("wb") as out:
            data = fh.read()
            level = 1 if data[:3] == GZIP_MAGIC else 0
            number = 0  # of the last line read: decompressed lines, as the readers count
            content_end = -1  # (plain: where the file's trailing empty lines begin)
            for offset, stored, text in _stored_lines(data, level):
                if not level and text.isspace():
                    if content_end < 0:
                        content_end = len(data.rstrip())
                    if offset < content_end:  # an empty line followed by others: damaged
                        number += 1  # (the readers name it; no digest line stands for it)
                        if report is not None:
                            report.skipped.append(SkippedLine(
                                os.fspath(path), number, "damaged", EMPTY_LINE))
                        continue
                if stored is None:  # a member that cannot be decompressed: one line
                    number += 1
                    if report is not None:
                        report.skipped.append(SkippedLine(
                            os.fspath(path), number, "damaged",
                            f"a compressed line that cannot be decompressed ({text.decode()})"))
                    continue
                records: list[SpanRecord] = []
                line = b""
                lines = text.split(b"\n")
                if not lines[-1]:
                    lines.pop()  # (after the last newline)
                at = number + 1  # the line being parsed
                number += len(lines)
                try:
                    for line in lines:
                        if line.strip():
                            records.extend(request_spans(orjson.loads(line)))
                        at += 1
                except (orjson.JSONDecodeError, *DECODE_ERRORS) as exc:
                    if report is not None:
                        report.skipped.append(SkippedLine(
                            os.fspath(path), at, "damaged", what_is_wrong(line, exc)))
                    continue
                out.write(digest_line(records, stored, offset, len(records), texts))
                written += 1
                if report is not None:
                    report.lines += 1
                    report.spans += len(records)
                    report.commspan_spans += sum(
                        1 for r in records if semconv.MODULE_FQN in r.attributes)
        if not written:  # nothing to stand for: leave no empty .digest beside the file
            tmp.unlink()
            side.unlink(missing_ok=True)
            return 0
        os.replace(tmp, side)
        return written
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _stored_lines(
    data: bytes, level: int
) -> Iterator[tuple[int, memoryview | None, bytes]]:
    """``(offset, stored bytes, text)`` of each complete line (plain) or member
    (compressed) of a JSONL file's bytes; ``(offset, None, zlib's error)`` for a
    member that cannot be decompressed (one damaged line to the readers)."""
    view = memoryview(data)
    src = FileWindow.of(data)
    pos, size = 0, len(data)
    while pos < size:
        if not level:
            end = data.find(b"\n", pos)
            if end < 0:
                return  # cut short: no digest
            yield pos, view[pos:end + 1], data[pos:end + 1]
            pos = end + 1
            continue
        try:
            d, text, end = decompress_member(src, pos, size)
        except zlib.error as exc:
            yield pos, None, str(exc).encode()
        else:
            if d.eof:
                yield pos, view[pos:end], text
                pos = end
                continue
        # damaged, or cut short by the file's end (torn: no line)
        pos = data.find(GZIP_MAGIC, pos + 1)
        if pos < 0:
            return


# ------------------------------------------------------------------ reading
class FileDigest:
    """The usable digest of one JSONL file.

    Attributes:
        parts: the parts of every line the digest stands for, in file order;
            ``None`` in place of a line's parts when that line must be parsed.
        covered: ``(offset, end)`` byte ranges of the JSONL file the digest
            stands for, in order (``parts`` has one entry per range).
        lines: spans of each covered line (``ReadReport.spans``).
    """

    def __init__(self, size: int) -> None:
        self.parts: list[list[DigestPart] | None] = []
        self.covered: list[tuple[int, int]] = []
        self.lines: list[int] = []
        self.size = size
        """The JSONL file's size when the digest was checked against it."""

    def used(self, report: ReadReport | None) -> Iterator[list[DigestPart]]:
        """The parts of each line the digest stands for, counted in ``report`` as the
        lines, spans and ranks read (as if the lines had been)."""
        for parts, spans in zip(self.parts, self.lines):
            if parts is None:
                continue
            if report is not None:
                report.lines += 1
                report.spans += spans
                for part in parts:
                    if part["commspan_spans"]:
                        report.commspan_spans += part["commspan_spans"]
                        report.ranks.add(part["rank"])
            yield parts

    def gaps(self) -> list[tuple[int, int, int]]:
        """``(start, stop, lines)`` byte ranges of the file to parse: what the digest
        does not stand for, and the lines it says must be parsed; ``lines`` counts the
        lines the digest stands for between the previous range and this one (so that
        the lines parsed keep their numbers)."""
        size = self.size
        out: list[list[int]] = []
        pos, skipped = 0, 0
        for (start, end), parts in zip(self.covered, self.parts):
            if start > pos:
                out.append([pos, start, skipped])
                skipped = 0
            if parts is None:
                if out and out[-1][1] == start:
                    out[-1][1] = end
                else:
                    out.append([start, end, skipped])
                    skipped = 0
            else:
                skipped += 1
            pos = max(pos, end)
        if size > pos:
            if out and out[-1][1] == pos and not skipped:
                out[-1][1] = size
            else:
                out.append([pos, size, skipped])
        return [(a, b, n) for a, b, n in out]


def read_digest(path: str | os.PathLike[str], module_spans: bool = False,
                ) -> FileDigest | None:
    """The digest of JSONL file ``path``, checked line by line against the file, or
    ``None`` when it has none (no ``.digest`` file, or not one line of it usable).
    ``module_spans``: also read each part's module spans (``part["mods"]``, the rows
    :func:`run_from_parts` reads; ``None`` otherwise).

    A digest line is used only if it parses, has this version, and the JSONL file
    holds, at its offset, a line of its length whose start has its checksum; lines
    must follow each other. Anything else leaves that part of the file to be parsed.
    """
    side = digest_path(path)
    try:
        data = side.read_bytes()
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        result = FileDigest(size)
        end = 0
        # writer token -> (number -> (text, when its first span started, for states),
        # the numbers of aggregator states)
        defs: dict[str, tuple[dict[int, tuple[str, int | None]], set[int]]] = {}
        view = memoryview(data)
        find, rfind = data.find, data.rfind
        nl = -1
        while nl < len(data):
            # each line: the object, its CRC, the module spans, their CRC; cut out of the
            # file without a copy (the module spans are most of it: the readers that do
            # not want them only skip them)
            start = nl + 1
            nl = find(b"\n", start)
            if nl < 0:
                nl = len(data)
            s3 = rfind(b" ", start, nl)
            s2 = rfind(b" ", start, s3) if s3 > start else -1
            s1 = rfind(b" ", start, s2) if s2 > start else -1
            if s1 < start:
                continue  # cut short or not a digest line
            body, stamp = view[start:s1], data[s1 + 1:s2]
            blob, blob_stamp = view[s2 + 1:s3], data[s3 + 1:nl]
            if len(stamp) != 8 or b"%08x" % zlib.crc32(body) != stamp:
                continue  # damaged
            try:
                doc = orjson.loads(body)
                if type(doc) is not dict or doc.get("digest") not in _READ_VERSIONS:
                    continue
                offset, length = doc["offset"], doc["length"]
                parts, spans, sample = doc["parts"], doc["spans"], doc["sample"]
                table, states = defs.setdefault(doc["token"], ({}, set()))
                for key, value in doc["defs"].items():
                    if type(value) is str:
                        table[int(key)] = (value, None)
                    else:
                        text, first = value
                        table[int(key)] = (str(text), int(first))
                        states.add(int(key))
                if isinstance(parts, list):
                    mods = None
                    if module_spans:
                        if b"%08x" % zlib.crc32(blob) != blob_stamp:
                            continue  # its module spans damaged: the line is parsed
                            # (the texts it defines are kept: later lines use them)
                        # checked now (their shape, every template they name defined:
                        # else the line is parsed, as for the object's texts), kept as
                        # text and parsed again by run_from_parts a line at a time: the
                        # rows of a thousand ranks would otherwise all be held at once
                        mods = _LineModules(bytes(blob), table, len(parts))
                        try:
                            mods.parse()
                        except ValueError:
                            continue
                    for i, part in enumerate(parts):
                        if not _valid(part) or not states.issuperset(part["aggs"]):
                            raise TypeError("not a digest part")
                        part["tmpls"] = [table[n][0] for n in part["tmpls"]]
                        part["mods"] = (mods, i) if mods is not None else None
                        part["mtmpls"] = None
                        part["table"] = table
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                continue  # (a text used but not defined: its line is parsed)
            if not (isinstance(offset, int) and isinstance(length, int) and offset >= end
                    and length > 0 and offset + length <= size):
                continue
            crc = 0
            for start, count in _sample_ranges(length):
                crc = zlib.crc32(os.pread(fd, count, offset + start), crc)
            if crc != sample:
                continue  # the file holds another line there: parse it
            result.covered.append((offset, offset + length))
            result.parts.append(parts if isinstance(parts, list) else None)
            result.lines.append(spans if isinstance(spans, int) else 0)
            end = offset + length
    finally:
        os.close(fd)
    return result if result.covered else None


_PART_KEYS = frozenset({
    "run", "rank", "trace", "world_size", "sample", "spans", "present", "commspan_spans",
    "start", "end", "present_start", "step", "rank_step", "repeats", "raised", "aggs", "coll",
    "tmpls", "gc",
})


def _valid(part: Any) -> bool:
    """Whether a part read back has the fields readers use. (Its line's checksum says
    it is what a writer of this version wrote; a part of another shape is not used:
    its line is parsed instead.)"""
    return type(part) is dict and _PART_KEYS <= part.keys() and type(part["aggs"]) is list


# ------------------------------------------------------------------ assembling
def run_from_parts(parts: Sequence[DigestPart],
                   module_spans: bool | Literal["folded"] = False) -> Run:
    """The :class:`~commspan.analysis.records.Run` the parts stand for, as
    :func:`~commspan.analysis.records.build_run` would build it from their spans
    (``module_spans``: with its module spans, which ``commspan stragglers`` needs for
    the step times, as ``build_run(..., module_spans=True)``; ``"folded"``: those
    folded a rank at a time into :attr:`Run.span_times` instead, as
    :func:`span_times_of_parts`, the parts read with their module spans)."""
    if module_spans == "folded":
        run = run_from_parts(parts)
        run.span_times = span_times_of_parts(parts)
        return run
    run = Run()
    # (rank, trace) -> [time, fqn, phase] of its latest exception event, over its parts
    raised: dict[tuple[int, str], list[Any]] = {}
    # (rank, trace) -> (span id, start, end) of every rank span (a step number used again
    # has several), and the start of the one that ended last (where its error is)
    uses: dict[tuple[int, str], list[tuple[str, int, int]]] = {}
    last_start: dict[tuple[int, str], int] = {}
    for part in parts:
        world = part["world_size"]
        if world:
            run.world_size = max(run.world_size or 0, world)
        if part["sample"]:
            run.rank_sample = part["sample"]
        trace, rank = part["trace"], part["rank"]
        if part["step"] is not None:
            run.trace_steps[trace] = part["step"]
        run.ranks.add(rank)
        if not part["present"]:
            continue
        run.presence.setdefault(trace, set()).add(rank)
        start = run.trace_start.get(trace)
        if start is None or part["present_start"] < start:
            run.trace_start[trace] = part["present_start"]
        if part["raised"] is not None:
            seen = raised.get((rank, trace))
            if seen is None or part["raised"][0] >= seen[0]:
                raised[(rank, trace)] = part["raised"]
        if part["rank_step"] is not None:
            key = (rank, trace)
            span_id, s, e = part["rank_step"][:3]
            uses.setdefault(key, []).extend(
                [(span_id, s, e), *((u[0], u[1], u[2]) for u in part["repeats"])])
            seen_step = run.rank_steps.get(key)
            if seen_step is None or e >= seen_step.end_ns:  # the use that ended last
                run.rank_steps[key] = RankStep(
                    rank, None, trace, span_id, s, e, (), *part["rank_step"][4:5])
                last_start[key] = s
    for key, rs in run.rank_steps.items():
        where = raised.get(key)
        # where it was raised: the latest exception event of the use (as build_run)
        if rs.error is not None and where is not None and where[0] >= last_start[key]:
            rs = rs._replace(error_fqn=where[1], error_phase=where[2])
        # the first use's span, the others in repeats by start (as build_run)
        first, *later = sorted(uses[key], key=lambda u: (u[1], u[2], u[0]))
        run.rank_steps[key] = rs._replace(
            span_id=first[0], start_ns=first[1], end_ns=first[2],
            repeats=tuple(sorted(later, key=lambda u: u[1])))
    cache: dict[str, tuple[Any, ...]] = {}
    modules = _PartModules(parts if module_spans else ())
    for part in parts:
        trace, rank = part["trace"], part["rank"]
        step = run.trace_steps.get(trace)
        made = [_template(text, cache) for text in part["tmpls"]]
        append = run.collectives.append
        for row in orjson.loads(part["coll"]):
            head, fqn, phase, state, owner, tag, _, splits, root = made[row[0]]
            group, members, op, kind, dtype, shape, nbytes, reduce_op, peer = head
            append(CollectiveRecord(rank, step, trace, group, members, row[1], op, kind,
                                    dtype, shape, nbytes, reduce_op, peer, fqn, phase, row[2],
                                    row[3], state, row[4] if len(row) > 4 else None,
                                    row[5] if len(row) > 5 else None, owner, tag, splits,
                                    root))
        for t, attrs in part["gc"]:
            pause = gc_event_fields(attrs)
            if pause is None:
                run.skipped["garbage-collection events without a duration"] += 1
            else:
                run.gc_pauses.append(GcRecord(rank, step, trace, t, *pause))
        if module_spans:
            modules.add(part, run.module_spans)
    run.rank_steps = {
        key: rs._replace(step=run.trace_steps.get(rs.trace_id))
        for key, rs in run.rank_steps.items()
    }
    return run


def span_times_of_parts(parts: Sequence[DigestPart]) -> SpanTimes:
    """The module spans of ``parts`` (read with ``module_spans=True``) folded for the
    step-time view a rank at a time: what ``run_from_parts(parts, module_spans=True)``
    gives ``step_breakdown``, without holding every module span of the run at once.

    Raises:
        ValueError: parts read without their module spans.
    """
    by_rank: dict[int, list[DigestPart]] = {}
    for part in parts:
        by_rank.setdefault(part["rank"], []).append(part)
    times = SpanTimes()
    modules = _PartModules(parts)
    for ranked in by_rank.values():
        spans: list[ModuleSpan] = []
        for part in ranked:
            modules.add(part, spans)
        times.add(spans)
    return times


class _PartModules:
    """Makes the :class:`~commspan.analysis.records.ModuleSpan` rows of ``parts``, in
    any order, parsing each digest line's module spans once (kept until the last of
    its parts is made: a line of one rank's file goes at once, a line holding many
    ranks' parts, a merged file's, stays while they are made a rank at a time) and
    each module template's text once."""

    __slots__ = ("parsed", "left", "names")

    def __init__(self, parts: Iterable[DigestPart]) -> None:
        self.parsed: dict[int, list[tuple[list[str], list[list[Any]]]]] = {}
        # id of a digest line -> its parts not made yet
        self.left: Counter[int] = Counter(
            id(p["mods"][0]) for p in parts if type(p["mods"]) is tuple)
        self.names: dict[str, tuple[Any, ...]] = {}

    def add(self, part: DigestPart, out: list[ModuleSpan]) -> None:
        """Append the module spans of ``part`` to ``out``."""
        rows = part["mods"]
        if rows is None:
            raise ValueError("parts read without their module spans: pass "
                             "module_spans=True to load_parts")
        if type(rows) is str:  # (parts digested here, not read from a digest)
            texts, rows = part["mtmpls"], orjson.loads(rows)
        else:  # (a digest line's: its module spans parsed once, for its parts)
            line, index = rows
            key = id(line)
            parsed = self.parsed.get(key)
            if parsed is None:
                parsed = self.parsed[key] = line.parse()
            self.left[key] -= 1
            if self.left[key] <= 0:
                del self.parsed[key]
            texts, rows = parsed[index]
        names = [_module_template(text, self.names) for text in texts]
        rank, trace, first = part["rank"], part["trace"], part["start"]
        add = out.append
        for index, span_id, parent, start, duration in rows:
            fqn, phase = names[index]
            if type(parent) is int:  # the row of a module span of the part
                parent = rows[parent][1]
            add(ModuleSpan(rank, trace, span_id, parent, fqn, phase, first + start,
                           first + start + duration))


class _LineModules:
    """The module spans of a digest line, as read (JSON text): :meth:`parse` gives,
    per part, the texts of its module templates and its rows."""

    __slots__ = ("blob", "table", "parts")

    def __init__(self, blob: bytes, table: Mapping[int, tuple[str, int | None]],
                 parts: int) -> None:
        self.blob, self.table, self.parts = blob, table, parts

    def parse(self) -> list[tuple[list[str], list[list[Any]]]]:
        """``[(module template texts, rows)]`` per part; ``ValueError`` when the text is
        not the parts' (its checksum held, so a writer of another shape wrote it)."""
        try:
            mods = orjson.loads(self.blob)
            if type(mods) is not list or len(mods) != self.parts:
                raise TypeError
            table = self.table
            return [([table[n][0] for n in names], rows) for names, rows in mods]
        except (orjson.JSONDecodeError, TypeError, ValueError, KeyError) as exc:
            raise ValueError("a digest line's module spans are not its parts'") from exc


def _module_template(text: str, cache: dict[str, tuple[Any, ...]]) -> tuple[Any, ...]:
    """A module span's ``(fqn, phase)``, kept once per text."""
    made = cache.get(text)
    if made is None:
        made = cache[text] = tuple(orjson.loads(text))
    return made


def _template(text: str, cache: dict[str, tuple[Any, ...]]) -> tuple[Any, ...]:
    """A collective template's fields, as :class:`CollectiveRecord` holds them."""
    made = cache.get(text)
    if made is None:
        fields = orjson.loads(text)
        (group, ranks, _, op, kind, dtype, shape, nbytes, reduce_op, peer, fqn, phase, _,
         _, state) = fields[:15]
        head = (group, tuple(ranks), op, kind, dtype,
                tuple(shape) if shape is not None else None, nbytes, reduce_op,
                tuple(peer) if isinstance(peer, list) else peer)
        splits = fields[18] if len(fields) > 18 else None
        made = cache[text] = (head, fqn, phase, state, fields[15] if len(fields) > 15 else None,
                              fields[16] if len(fields) > 16 else None,
                              fields[17] if len(fields) > 17 else None,
                              (tuple(splits[0]), tuple(splits[1])) if splits else None,
                              fields[19] if len(fields) > 19 else None)
    return made


# ------------------------------------------------------------------ runs of parts
def load_parts(
    files: Sequence[Path],
    report: ReadReport | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    module_spans: bool = False,
) -> list[DigestPart] | None:
    """The parts of every line of ``files``, from their digests, and the lines the
    digests do not cover parsed and digested here (all of a file's lines when it has
    no digest, or none of this version: digested in memory, not written); ``None``
    when a line is longer than ``max_line_bytes``, or an uncovered line holds what
    parts cannot (a hang record): read the spans then.

    What was read is added to ``report`` only when parts are returned. Damaged lines
    are skipped (``strict=False``). ``module_spans``: read each part's module spans
    too (``commspan stragglers``; :func:`run_from_parts` with ``module_spans=True``).
    """
    digests: list[tuple[Path, FileDigest]] = []
    whole: set[str] = set()  # files without a digest: every line parsed, below
    for f in files:
        digest = read_digest(f, module_spans)
        if digest is None:
            whole.add(os.fspath(f))
            continue
        digests.append((f, digest))
        if any(end - start > max_line_bytes for start, end in digest.covered):
            return None  # a line longer than the limit: the lines' reader stops there
        if max_line_bytes < DEFAULT_MAX_LINE_BYTES and starts_compressed(f):
            # a tighter limit than the default, on lines whose decompressed length the
            # digest does not know (it holds their compressed length)
            return None
    scratch = ReadReport()
    parts: list[DigestPart] = []
    regions: dict[str, list[tuple[int, int, int]]] = {}
    for path, digest in digests:
        for line_parts in digest.used(scratch):
            parts.extend(line_parts)
        gaps = digest.gaps()
        if gaps:
            regions[os.fspath(path)] = gaps
    if regions or whole:
        # digested a line at a time, as the digests are: a line and its copy stay two
        # parts (found below), not one part of both
        extra: list[DigestPart] | None = []

        def per_line(_path: Path, _number: int, records: Sequence[SpanRecord]) -> None:
            nonlocal extra
            if extra is None or not records:
                return
            got = digest_parts(records)
            if got is None:
                extra = None  # (what a part cannot hold: the lines are read instead)
            else:
                extra.extend(got)

        for _ in read_spans_in(
            [f for f in files if os.fspath(f) in regions or os.fspath(f) in whole],
            strict=False, report=scratch,
            max_line_bytes=max_line_bytes, regions=regions, on_line=per_line,
        ):
            if extra is None:
                return None  # (no need to parse the rest: the lines' reader will)
        if extra is None:
            return None
        parts.extend(extra)
    # a line copied (a file holding some lines of another): two parts of one rank and
    # trace alike (their spans, earliest start, latest end), or a rank span in two;
    # the lines' reader names the copy (LineTally.copies). (Two lines of a rank's step
    # are never alike: each span is in one. Were they, the lines would only be parsed.)
    seen: set[tuple[Any, ...]] = set()
    for part in parts:
        marks: list[tuple[Any, ...]] = [
            (part["rank"], part["trace"], part["spans"], part["start"], part["end"])]
        if part["rank_step"] is not None:
            marks.append((part["rank"], part["trace"], part["rank_step"][0]))
        for key in marks:
            if key in seen:
                return None
            seen.add(key)
    if report is not None:
        report.add(scratch)
    return parts


def list_part_runs(parts: Sequence[DigestPart]) -> list[RunInfo]:
    """:func:`~commspan.analysis.runs.list_runs` of the spans the parts stand for."""
    trace_steps = _trace_steps(parts)
    return runs_of(
        (p["run"], p["rank"], trace_steps.get(p["trace"]), p["spans"], p["start"], p["end"],
         p.get("writer"),  # (not in digests written before it was)
         p["sample"], p["world_size"])
        for p in parts
    )


def _trace_steps(parts: Iterable[DigestPart]) -> dict[str, int]:
    """``trace -> step`` of the parts that know their trace's step (the first says)."""
    steps: dict[str, int] = {}
    for part in parts:
        if part["step"] is not None:
            steps.setdefault(part["trace"], part["step"])
    return steps


class PartSelection(NamedTuple):
    """What :func:`select_parts` kept: as :class:`~commspan.analysis.runs.Selection`,
    with parts for records."""

    parts: list[DigestPart]
    run: RunInfo | None
    runs: tuple[RunInfo, ...]
    steps: tuple[int, ...]
    note: str | None = None
    last_traces: Mapping[int | None, str] | None = None
    run_parts: Sequence[DigestPart] = ()
    """The parts of the run chosen, of every step (``parts`` when no step was selected)."""


def select_parts(
    parts: Sequence[DigestPart], *, run: str | None = None, steps: StepRange | None = None
) -> PartSelection:
    """:func:`~commspan.analysis.runs.select` on parts: the same choice, the same errors."""
    runs = commspan_runs(list_part_runs(parts))
    if not runs:
        return PartSelection([], None, (), ())
    chosen, kept_steps, note = choose(runs, run, steps)
    kept = [p for p in parts if p["run"] == chosen.run_id] if len(runs) > 1 else list(parts)
    whole = kept
    last_traces = None
    if steps is not None:
        last_traces = last_traces_of((p["rank"], part_last_start(p), p["trace"])
                                     for p in kept)
        traces = {t for t, s in _trace_steps(kept).items() if s in steps}
        kept = [p for p in kept if p["trace"] in traces]
    return PartSelection(kept, chosen, runs, kept_steps, note, last_traces, whole)


def summarize_parts(
    agg: Aggregator, parts: Sequence[DigestPart], rank: int | None,
    last_traces: Mapping[int | None, str] | None = None,
) -> dict[str, Any]:
    """:func:`~commspan.analysis.summary.summarize` of the spans the parts stand for
    (``last_traces``: as :attr:`PartSelection.last_traces`)."""
    count = 0
    ranks: set[int] = set()
    steps: set[int] = set()
    traces: set[str] = set()
    # which traces were cut short, as summarize finds them (a trace's spans may span
    # lines: no line of it holds its rank span, and a collective of it failed on some
    # rank or the rank wrote later traces), over every rank's parts
    unfinished = _Unfinished()
    cache: dict[str, tuple[Any, ...]] = {}
    for part in parts:
        unfinished.add_part(part, part["trace"] not in unfinished.failed and any(
            _template(text, cache)[3] == semconv.STATE_FAILED for text in part["tmpls"]))
        if rank is not None and part["rank"] != rank:
            continue
        count += part["spans"]
        traces.add(part["trace"])
        ranks.add(part["rank"])
        if part["rank_step"] is not None and part["rank_step"][3] is not None:
            steps.add(part["rank_step"][3])
    partial = [(r, step) for r, _, step in unfinished.cut_short(last_traces)
               if rank is None or r == rank]
    steps.update(step for _, step in partial if step is not None)
    return summary_of(agg, count, traces, ranks, steps, partial)


def aggregate_parts(parts: Iterable[DigestPart], rank: int | None) -> Aggregator:
    """An :class:`Aggregator` of the parts' counts (of ``rank`` only, unless ``None``)."""
    merger = PartMerger(Aggregator(), rank)
    merger.add(parts)
    return merger.finish()
