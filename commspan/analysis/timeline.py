"""Per-rank, per-step timelines of module spans and collectives, as plain records.

The views (``commspan.render.html``, ``commspan.render.perfetto``) draw what
this module prepares from the span records of a run (read back from JSONL
files by :func:`commspan.exporters.read_spans`): no torch, no OpenTelemetry
objects, only :class:`~commspan.exporters.SpanRecord` in and NamedTuples out.

- a **step** is one trace: ``mode.step(i)`` opens one trace shared by all
  ranks, each rank adding a ``commspan.rank`` span that carries the step
  number; the module spans of a rank in that trace belong to the step;
- a **module slice** is one module span (``fqn``, phase, start, end);
- a **collective** is one collective event, at the time it was issued, with
  its duration when the event carries ``commspan.collective.duration_ns``;
- collectives of several ranks are **the same collective** when their run,
  process group and sequence number agree (:func:`match_collectives`).

:func:`assign_lanes` places intervals on lanes so that the intervals of a lane
nest (no partial overlap): what a trace viewer needs to draw them as a stack.

Example:
    >>> from commspan.analysis.timeline import assign_lanes
    >>> assign_lanes([(0, 10), (2, 5), (4, 12)])  # the third overlaps the first partially
    [(0, 0), (0, 1), (1, 0)]
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Union

from commspan import semconv
from commspan.analysis.records import _STATUS_ERROR, gc_event_fields, p2p_pair
from commspan.otlpjson.decode import LineReader, read_spans
from commspan.otlpjson.files import jsonl_files
from commspan.otlpjson.records import (
    DEFAULT_MAX_LINE_BYTES,
    ReadReport,
    SpanRecord,
    no_commspan_span,
    record_rank,
)

__all__ = [
    "Collective",
    "GcSlice",
    "ModuleSlice",
    "RecordSource",
    "StepWindow",
    "Timeline",
    "assign_lanes",
    "build_timeline",
    "load_records",
    "match_collectives",
]

RecordSource = Union[str, os.PathLike, Iterable[Union[str, os.PathLike, SpanRecord]]]
"""A JSONL file or directory, a list of them, or span records already read."""


class StepWindow(NamedTuple):
    """One step (one trace) of a run, as the ranks saw it.

    Attributes:
        position: where it is in :attr:`Timeline.steps`.
        run_id: ``commspan.run_id`` of the run ("" if unknown).
        step: the step number given to ``mode.step(i)``; ``None`` for a trace
            recorded without steps (a plain ``with mode:`` block).
        trace_id: the trace's id (hex).
        label: ``"step 3"``, or ``"trace 1a2b3c4d"`` without a step number;
            prefixed with the run id when the records hold several runs.
        start_ns: earliest start of the step over its ranks (Unix ns).
        end_ns: latest end.
        ranks: ``(rank, start_ns, end_ns)`` of each rank's part, by rank.
    """

    position: int
    run_id: str
    step: int | None
    trace_id: str
    label: str
    start_ns: int
    end_ns: int
    ranks: tuple[tuple[int, int, int], ...]


class ModuleSlice(NamedTuple):
    """One module span: a module's forward, backward or recompute on one rank.

    Attributes:
        window: position of its step's :class:`StepWindow` in :attr:`Timeline.steps`.
        error: the span's status message when it ended with an error, else "".
    """

    window: int
    rank: int
    fqn: str
    module_type: str
    phase: str
    start_ns: int
    end_ns: int
    error: str


class GcSlice(NamedTuple):
    """A pause of one rank's process for Python's garbage collector (a ``commspan.gc``
    event): when it started, how long, which generation, and the module the
    traced thread was in (``""`` outside every module)."""

    window: int
    rank: int
    start_ns: int
    duration_ns: int
    generation: int
    fqn: str
    phase: str


class Collective(NamedTuple):
    """One collective event of one rank.

    Attributes:
        window: position of its step's :class:`StepWindow` in :attr:`Timeline.steps`.
        time_ns: when it was issued (the event's timestamp, Unix ns).
        duration_ns: issue to completion, when recorded; ``None`` otherwise.
        fqn: the module that issued it (``Global`` outside any module).
        group: process group name ("" if unknown).
        seq: per-rank, per-group sequence number of a collective (``None`` if unknown,
            and for point-to-point ops since schema 3).
        bytes: input bytes of the op.
        src: DTensor placements before the redistribution that issued it ("" if none).
        dst: placements after it.
        redistribute_op: the DTensor op that needed the redistribution ("" if none).
        p2p_seq: a point-to-point op's number per peer and direction (``None`` if
            unknown).
        pending: not completed when the rank wrote a hang record (it waited in it,
            inside a span never written): taken from that record.
        unwritten: taken from a hang record, not from a span: it was issued inside a
            span never written (completed there, or ``pending``), so the counts
            (``Aggregator``, ``issued``) leave it out.
        owner: the module that owns it (``commspan.owner.fqn``: an FSDP unit, a DDP
            bucket's module) when that is not :attr:`fqn`, else ``""``.
    """

    window: int
    rank: int
    run_id: str
    time_ns: int
    duration_ns: int | None
    fqn: str
    phase: str
    op: str
    kind: str
    group: str
    group_size: int | None
    group_ranks: tuple[int, ...]
    mesh_dim: int | None
    seq: int | None
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    reduce_op: str
    peer: int | None
    src: str
    dst: str
    redistribute_op: str
    p2p_seq: int | None = None
    pending: bool = False
    owner: str = ""
    unwritten: bool = False

    @property
    def key(self) -> tuple[str, int, str, Any]:
        """``(run_id, window, group, seq)``: the same on every rank that took part in it;
        for a point-to-point op, ``(run_id, window, group, (sender, receiver,
        p2p_seq))``: the same on the send and the receive that matches it. The step
        is part of it: two jobs under one run id each number from 1."""
        pair = self.pair
        if pair is not None:
            return (self.run_id, self.window, self.group, (*pair, self.p2p_seq))
        return (self.run_id, self.window, self.group, self.seq)

    @property
    def pair(self) -> tuple[int, int] | None:
        """``(sender, receiver)`` of a point-to-point op numbered per peer (schema 3),
        else ``None``."""
        if self.p2p_seq is None or self.peer is None:
            return None
        return p2p_pair(self.op, self.rank, self.peer)

    @property
    def end_ns(self) -> int:
        """Completion time when recorded, else the issue time."""
        return self.time_ns + (self.duration_ns or 0)


@dataclass(frozen=True)
class Timeline:
    """Everything the views draw, sorted.

    Attributes:
        ranks: the ranks present, ascending.
        steps: the steps in the order they started.
        slices: module spans, by rank, then start time (outer spans first).
        collectives: collective events, by rank, then issue time.
        run_ids: the runs present, in the order they started.
        origin_ns: the earliest time in the records (Unix ns): the views count
            time from here.
        processes: ``{rank: (host name, process id)}`` from the records'
            resources ("" and ``None`` when not recorded).
        gc_pauses: garbage-collector pauses, by rank, then start time.
        unfinished: ``(window, rank)`` of each rank's part of a step whose
            ``commspan.rank`` span was never written (cut short by a hang or a
            process stopped mid-step, or still running when read): the counts
            (``Aggregator``) leave its collectives out; sorted.
    """

    ranks: tuple[int, ...]
    steps: tuple[StepWindow, ...]
    slices: tuple[ModuleSlice, ...]
    collectives: tuple[Collective, ...]
    run_ids: tuple[str, ...]
    origin_ns: int
    processes: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    gc_pauses: tuple[GcSlice, ...] = ()
    unfinished: tuple[tuple[int, int], ...] = ()


# ------------------------------------------------------------------ loading
def load_records(source: RecordSource) -> list[SpanRecord]:
    """Read span records from JSONL files or directories, or pass records through.

    Args:
        source: a JSONL file, a directory holding ``*.jsonl`` files, a list of
            those, or an iterable of :class:`~commspan.exporters.SpanRecord`.

    Returns:
        The records, files in the order given (a directory's files by name).

    Raises:
        FileNotFoundError: a path does not exist, or a directory holds no ``*.jsonl``.
        TypeError: an item is neither a path nor a ``SpanRecord``.
        ValueError: a file holds a line that is not JSON (names file and line), or
            the files hold no commspan span (empty files, another program's spans).

    Example:
        >>> load_records([])
        []
    """
    items: Iterable[Any]
    if isinstance(source, (str, os.PathLike)):
        items = [source]
    elif isinstance(source, (bytes, bytearray)) or not isinstance(source, Iterable):
        raise TypeError(
            f"source={source!r} is not valid; pass a JSONL file or directory path (str or "
            "Path), a list of them, or SpanRecords from commspan.exporters.read_spans"
        )
    else:
        items = source
    records: list[SpanRecord] = []
    files: list[Path] = []
    read = ReadReport()
    for item in items:
        if isinstance(item, SpanRecord):
            records.append(item)
        elif isinstance(item, (str, os.PathLike)):
            named = jsonl_files(item, param="source")
            files.extend(named)
            records.extend(read_spans(*named, report=read))
        else:
            raise TypeError(
                f"source item {item!r} is not valid; pass JSONL file or directory paths, "
                "or SpanRecords from commspan.exporters.read_spans"
            )
    logger = LineReader(True, None, DEFAULT_MAX_LINE_BYTES, False)
    for skipped in read.skipped:  # (torn last lines: logged, as read_spans does)
        logger.skip(Path(skipped.path), skipped.line, skipped.kind, skipped.reason)
    if files and not read.commspan_spans:  # (an empty report or trace, whatever ran)
        raise no_commspan_span("source", files, read.lines, read.spans, len(read.skipped))
    return records


# ------------------------------------------------------------------ building
def build_timeline(records: Iterable[SpanRecord]) -> Timeline:
    """Sort the module spans and collective events of a run into steps and ranks.

    Module spans are the records with a ``commspan.module.fqn`` attribute; the
    per-rank ``commspan.rank`` span gives a rank's step number and extent (when
    it is missing, e.g. the rank died mid-step, the step's module spans give
    the extent). Step and session roots are not drawn. A record without a rank
    counts as rank 0.

    Args:
        records: span records, e.g. ``read_spans(*paths)`` or :func:`load_records`.

    Returns:
        The :class:`Timeline`; empty if no record is a commspan module or rank span.

    Example:
        >>> tl = build_timeline([])
        >>> tl.ranks, tl.steps
        ((), ())
    """
    step_of: dict[str, int] = {}
    module_records: list[tuple[int, str, SpanRecord]] = []
    hangs: list[tuple[int, SpanRecord]] = []
    rank_extent: dict[tuple[str, int], tuple[int, int]] = {}
    run_of_trace: dict[str, str] = {}
    processes: dict[int, tuple[str, int | None]] = {}
    for rec in records:
        attrs = rec.attributes
        step = attrs.get(semconv.STEP)
        if isinstance(step, int) and rec.trace_id not in step_of:
            step_of[rec.trace_id] = step
        if rec.name in (semconv.SPAN_STEP, semconv.SPAN_SESSION):
            continue
        if rec.name == semconv.SPAN_HANG:
            hangs.append((_rank(rec), rec))
            continue
        fqn = attrs.get(semconv.MODULE_FQN)
        if fqn is None:
            continue
        rank = _rank(rec)
        run_of_trace.setdefault(rec.trace_id, _run_id(rec))
        if rank not in processes:
            host = rec.resource.get(semconv.HOST_NAME)
            processes[rank] = (
                str(host) if host else "",
                _int_or_none(rec.resource.get(semconv.PROCESS_PID)),
            )
        if rec.name == semconv.SPAN_RANK:
            key = (rec.trace_id, rank)
            start, end = rec.start_time, max(rec.end_time, rec.start_time)
            had = rank_extent.get(key)
            if had is not None:  # a step number used twice (each epoch from 0): both
                start, end = min(start, had[0]), max(end, had[1])
            rank_extent[key] = (start, end)
        module_records.append((rank, str(fqn), rec))

    # extent of each (trace, rank): its rank span, else its module spans
    extents: dict[tuple[str, int], list[int]] = {}
    for rank, _fqn, rec in module_records:
        key = (rec.trace_id, rank)
        if key in rank_extent:
            continue
        slot = extents.get(key)
        end = max(rec.end_time, rec.start_time)
        if slot is None:
            extents[key] = [rec.start_time, end]
        else:
            slot[0] = min(slot[0], rec.start_time)
            slot[1] = max(slot[1], end)
    # a hang record: the step it cut short reaches its stuck collectives
    for rank, rec in hangs:
        key = (rec.trace_id, rank)
        slot = extents.get(key)
        if slot is not None and key not in rank_extent:
            slot[0] = min(slot[0], rec.start_time)
            slot[1] = max(slot[1], rec.end_time)
    for key, (start, end) in rank_extent.items():
        extents[key] = [start, end]

    by_trace: dict[str, list[tuple[int, int, int]]] = {}
    for (trace_id, rank), (start, end) in extents.items():
        by_trace.setdefault(trace_id, []).append((rank, start, end))
    order = sorted(by_trace, key=lambda t: (min(s for _, s, _ in by_trace[t]), t))
    run_ids = list(dict.fromkeys(run_of_trace[t] for t in order))
    several_runs = len(run_ids) > 1
    steps: list[StepWindow] = []
    index_of: dict[str, int] = {}
    for trace_id in order:
        parts = tuple(sorted(by_trace[trace_id]))
        step = step_of.get(trace_id)
        run_id = run_of_trace[trace_id]
        label = f"step {step}" if step is not None else f"trace {trace_id[:8]}"
        if several_runs:
            label = f"run {run_id[:8]} {label}"
        index_of[trace_id] = len(steps)
        steps.append(
            StepWindow(
                len(steps),
                run_id,
                step,
                trace_id,
                label,
                min(s for _, s, _ in parts),
                max(e for _, _, e in parts),
                parts,
            )
        )

    slices: list[ModuleSlice] = []
    collectives: list[Collective] = []
    pauses: list[GcSlice] = []
    for rank, fqn, rec in module_records:
        index = index_of[rec.trace_id]
        if rec.name != semconv.SPAN_RANK:
            attrs = rec.attributes
            slices.append(
                ModuleSlice(
                    index,
                    rank,
                    fqn,
                    str(attrs.get(semconv.MODULE_TYPE, "")),
                    str(attrs.get(semconv.PHASE, "")),
                    rec.start_time,
                    max(rec.end_time, rec.start_time),
                    rec.status_message if rec.status_code == _STATUS_ERROR else "",
                )
            )
        run_id = run_of_trace[rec.trace_id]
        for (name, ev), when in zip(rec.events, rec.event_times):
            if semconv.COLL_OP in ev:
                collectives.append(_collective(index, rank, run_id, when, fqn, ev))
            elif name == semconv.EVENT_GC:
                pause = gc_event_fields(ev)
                if pause is not None:
                    took, gen, in_fqn, phase = pause
                    pauses.append(GcSlice(index, rank, when, took, gen, in_fqn or "", phase or ""))

    collectives.extend(_stuck(hangs, index_of, run_of_trace, collectives, steps))
    slices.sort(key=lambda s: (s.rank, s.start_ns, -s.end_ns))
    collectives.sort(key=lambda c: (c.rank, c.time_ns))
    ranks = tuple(sorted({r for _, r in extents}))
    origin = min((w.start_ns for w in steps), default=0)
    if collectives:
        origin = min(origin, min(c.time_ns for c in collectives))
    if slices:
        origin = min(origin, min(s.start_ns for s in slices))
    pauses.sort(key=lambda g: (g.rank, g.start_ns))
    return Timeline(
        ranks, tuple(steps), tuple(slices), tuple(collectives), tuple(run_ids), origin,
        {r: processes[r] for r in ranks if r in processes}, tuple(pauses),
        tuple(sorted((index_of[t], r) for t, r in extents if (t, r) not in rank_extent)),
    )


def _stuck(
    hangs: Sequence[tuple[int, SpanRecord]], index_of: Mapping[str, int],
    run_of_trace: Mapping[str, str], drawn: Sequence[Collective],
    steps: Sequence[StepWindow],
) -> list[Collective]:
    """The collectives hang records list in the step of the record that no written span
    holds, each once, marked ``unwritten``: those not completed (a rank waits in them,
    inside a span never written; also marked ``pending``), and those completed inside
    a span still open when the record was written. A record also lists collectives of
    earlier steps: a completed one is drawn only when issued after the rank's part of
    the step before ended."""
    seen = {(c.rank, c.key) for c in drawn}
    out = []
    for rank, rec in sorted(hangs, key=lambda h: h[1].end_time):
        index = index_of.get(rec.trace_id)
        if index is None:
            continue
        run_id = run_of_trace.get(rec.trace_id, _run_id(rec))
        after = _before(steps, index, rank)
        for (_name, ev), when in zip(rec.events, rec.event_times):
            if semconv.COLL_OP not in ev:
                continue
            done = ev.get(semconv.COLL_STATE) == semconv.STATE_COMPLETED
            if done and (after is None or when <= after):
                continue  # (or of a step before: drawn there, from its span)
            c = _collective(index, rank, run_id, when, str(ev.get(semconv.MODULE_FQN, "")), ev)
            if (rank, c.key) in seen:
                continue
            seen.add((rank, c.key))
            if done:
                out.append(c._replace(unwritten=True))
            else:
                out.append(c._replace(duration_ns=None, pending=True, unwritten=True))
    return out


def _before(steps: Sequence[StepWindow], index: int, rank: int) -> int | None:
    """When ``rank``'s part of the steps before step ``index`` ended (its latest end),
    or ``None`` when the rank has no part in step ``index``; the earliest time there
    is when none came before."""
    start = next((s for r, s, _ in steps[index].ranks if r == rank), None)
    if start is None:
        return None
    return max((e for w in steps if w.position != index for r, s, e in w.ranks
                if r == rank and s < start), default=-1)


def _rank(rec: SpanRecord) -> int:
    rank = record_rank(rec)
    return 0 if rank is None else rank


def _run_id(rec: SpanRecord) -> str:
    run = rec.resource.get(semconv.RUN_ID) or rec.attributes.get(semconv.RUN_ID)
    return str(run) if run else ""


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _collective(
    window: int, rank: int, run_id: str, when: int, fqn: str, ev: dict[str, Any]
) -> Collective:
    shape = ev.get(semconv.TENSOR_SHAPE) or ()
    ranks = ev.get(semconv.PG_RANKS) or ()
    duration = _int_or_none(ev.get(semconv.COLL_DURATION_NS))
    issuer = str(ev.get(semconv.MODULE_FQN, fqn))
    owner = ev.get(semconv.OWNER_FQN)
    return Collective(
        window=window,
        rank=rank,
        run_id=run_id,
        time_ns=when,
        duration_ns=duration if duration is None or duration >= 0 else None,
        fqn=issuer,
        phase=str(ev.get(semconv.PHASE, "")),
        op=str(ev[semconv.COLL_OP]),
        kind=str(ev.get(semconv.COLL_KIND, "")),
        group=str(ev.get(semconv.PG_NAME, "")),
        group_size=_int_or_none(ev.get(semconv.PG_SIZE)),
        group_ranks=tuple(int(r) for r in ranks if isinstance(r, int)),
        mesh_dim=_int_or_none(ev.get(semconv.MESH_DIM)),
        seq=_int_or_none(ev.get(semconv.COLL_SEQ)),
        bytes=_int_or_none(ev.get(semconv.TENSOR_BYTES)) or 0,
        dtype=str(ev.get(semconv.TENSOR_DTYPE, "")),
        shape=tuple(int(d) for d in shape if isinstance(d, int)),
        reduce_op=str(ev.get(semconv.COLL_REDUCE_OP, "")),
        peer=_int_or_none(ev.get(semconv.COLL_PEER)),
        src=str(ev.get(semconv.REDIST_SRC, "")),
        dst=str(ev.get(semconv.REDIST_DST, "")),
        redistribute_op=str(ev.get(semconv.REDIST_OP, "")),
        p2p_seq=_int_or_none(ev.get(semconv.P2P_SEQ)),
        owner=owner if isinstance(owner, str) and owner != issuer else "",
    )


# ------------------------------------------------------------------ queries
def match_collectives(
    collectives: Iterable[Collective],
) -> dict[tuple[str, int, str, Any], list[Collective]]:
    """Group the collectives of all ranks by :attr:`Collective.key` (run, step, group, seq;
    a send with the receive that matches it).

    Collectives without a sequence number are left out (they cannot be matched), as
    are point-to-point ops of files of schema 2 (numbered with their group's
    collectives, so a send and its receive had unrelated numbers).

    Returns:
        ``{key: [collective of each rank]}``, each list ordered by issue time
        (then rank): the first rank to issue it comes first.
    """
    out: dict[tuple[str, int, str, Any], list[Collective]] = {}
    for c in collectives:
        if c.kind == semconv.KIND_P2P:
            if c.p2p_seq is None or c.peer is None:
                # schema 2 numbered them with the group's collectives (their peer's
                # number meant another op); one from any source has no pair
                continue
        elif c.seq is None:
            continue
        out.setdefault(c.key, []).append(c)
    for members in out.values():
        members.sort(key=lambda c: (c.time_ns, c.rank))
    return out


def assign_lanes(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Place intervals on lanes so that on every lane any two nest or are disjoint.

    Intervals are taken by start time, longest first; each goes on the first
    lane where it fits inside the innermost interval still open there (or
    where nothing is open), at that nesting depth. Intervals that already
    nest, such as one rank's module spans, all land on lane 0.

    Args:
        intervals: ``(start, end)`` pairs with ``start <= end``; touching
            intervals (one ends where the next starts) count as disjoint.

    Returns:
        ``(lane, depth)`` for each interval, in input order.

    Raises:
        ValueError: an interval ends before it starts.
    """
    for i, (start, end) in enumerate(intervals):
        if end < start:
            raise ValueError(f"intervals[{i}] = {(start, end)!r} ends before it starts")
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1], i))
    lanes: list[list[int]] = []  # per lane: end times of the open intervals, outermost first
    out: list[tuple[int, int]] = [(0, 0)] * len(intervals)
    for i in order:
        start, end = intervals[i]
        for lane_no, stack in enumerate(_lanes_then_new(lanes)):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                out[i] = (lane_no, len(stack))
                stack.append(end)
                break
    return out


def _lanes_then_new(lanes: list[list[int]]) -> Iterator[list[int]]:
    yield from lanes
    lanes.append([])
    yield lanes[-1]
