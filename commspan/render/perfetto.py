"""A recorded run in the Chrome Trace Event Format, for ui.perfetto.dev and chrome://tracing.

Layout of the trace (``docs/views.md`` shows it):

- one process per rank: ``pid`` is the rank, named ``rank N`` and sorted by rank;
- in each, one thread (track) per lane: ``steps`` (a slice per step),
  ``forward``, ``backward``, ``recompute`` (the module spans of that phase,
  nested as the modules nest) and ``collectives``. Should the slices of a
  phase ever overlap without nesting, the extra ones go to an overflow lane
  (``backward #2``), so every track's slices nest, as the viewers require;
- module spans are complete (``"X"``) events named after the module (its last
  name component, ``layers.0`` for an item of a container), with the full
  ``fqn``, ``phase``, ``type``, ``step`` and ``rank`` in ``args``;
- collectives are ``"X"`` events named after the op, at the time they were
  issued, as wide as ``commspan.collective.duration_ns`` when the event
  carries it and zero-width otherwise (viewers draw those as instants), with
  ``op``, ``group``, ``seq``, ``bytes``, placements and the issuing module in
  ``args``;
- pauses of the process for Python's garbage collector (``commspan.gc``
  events) are ``"X"`` events on a ``gc`` lane, named ``gc`` and the
  generation (``gc gen 2`` for a full collection), with the module the traced
  thread was in;
- flow arrows (``bind_id`` with ``flow_out`` / ``flow_in``, the form Chrome
  itself writes) join the same collective (run, process group, sequence
  number) on every rank that issued it, in the order the ranks issued it: the
  arrow ends at the last rank to arrive. Each collective has its own id.

Times are microseconds from the earliest record (``otherData`` holds that
origin in Unix ns). Ranks on different hosts are drawn on their own clocks.

Example:
    >>> trace = chrome_trace([])
    >>> trace["traceEvents"], trace["displayTimeUnit"]
    ([], 'ms')
"""

from __future__ import annotations

import gzip
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from commspan import __version__, semconv
from commspan._errors import file_path
from commspan._json import dumps
from commspan.analysis.timeline import (
    Collective,
    ModuleSlice,
    RecordSource,
    StepWindow,
    Timeline,
    assign_lanes,
    build_timeline,
    load_records,
    match_collectives,
)
from commspan.otlpjson.files import refuse_output_clash

__all__ = ["chrome_trace", "write_chrome_trace"]

_log = logging.getLogger(__name__)

STEPS_LANE = "steps"
COLLECTIVES_LANE = "collectives"
GC_LANE = "gc"
_PHASES = [p.value for p in semconv.Phase]
_TIDS_PER_RANK = 1000


def chrome_trace(source: RecordSource | Timeline, notes: Sequence[str] = ()) -> dict[str, Any]:
    """Build the Chrome trace of a run.

    Args:
        source: JSONL files or directories written by ``JsonlSpanExporter``,
            span records (``commspan.exporters.read_spans``), or a
            :class:`~commspan.analysis.timeline.Timeline` built from them.
        notes: sentences saying what ``source`` leaves out of the run read
            (``commspan perfetto --max-ranks``: the ranks not in the trace), kept
            as ``otherData["notes"]`` (Perfetto shows it under Info and stats,
            metadata).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``,
        events sorted by time; ``json.dumps`` it or use :func:`write_chrome_trace`.

    Raises:
        FileNotFoundError: a path does not exist or a directory holds no ``*.jsonl``.
        ValueError: a file holds a line that is not JSON.

    Example:
        >>> chrome_trace([])["otherData"]["ranks"]
        []
    """
    timeline = source if isinstance(source, Timeline) else build_timeline(load_records(source))
    origin = timeline.origin_ns
    events: list[dict[str, Any]] = []
    metadata: list[dict[str, Any]] = []
    lanes_of_rank: dict[int, list[str]] = {r: [] for r in timeline.ranks}

    def tid(rank: int, lane: str) -> int:
        names = lanes_of_rank.setdefault(rank, [])
        if lane not in names:
            names.append(lane)
        # unique over the whole trace: viewers key threads by tid alone in places
        return (rank + 1) * _TIDS_PER_RANK + names.index(lane) + 1

    # steps first, so the lanes come out in a stable order
    parts: dict[int, list[tuple[StepWindow, int, int]]] = {}
    for window in timeline.steps:
        for rank, start, end in window.ranks:
            parts.setdefault(rank, []).append((window, start, end))
    for rank, windows in parts.items():
        # steps never overlap, unless a step number was used twice (each epoch counting
        # from 0: its window spans both): then the overlapping ones go to "steps #2"
        placed = assign_lanes([(start, end) for _, start, end in windows])
        for (window, start, end), (lane_no, _depth) in zip(windows, placed):
            lane = STEPS_LANE if lane_no == 0 else f"{STEPS_LANE} #{lane_no + 1}"
            events.append(_complete(
                window.label, "step", rank, tid(rank, lane), start - origin, end - start,
                {"step": window.step, "run_id": window.run_id, "rank": rank},
            ))
    for rank, lane, s in _lanes(timeline.slices):
        events.append(_complete(
            _short_name(s.fqn), s.phase, rank, tid(rank, lane), s.start_ns - origin,
            s.end_ns - s.start_ns, _slice_args(s, timeline),
        ))
    flows = _flow_marks(timeline.collectives)
    by_rank: dict[int, list[Collective]] = {}
    for c in timeline.collectives:
        by_rank.setdefault(c.rank, []).append(c)
    for rank, items in by_rank.items():
        placed = assign_lanes([(c.time_ns, c.end_ns) for c in items])
        for c, (lane_no, _depth) in zip(items, placed):
            lane = COLLECTIVES_LANE if lane_no == 0 else f"{COLLECTIVES_LANE} #{lane_no + 1}"
            event = _complete(
                c.op, "collective", rank, tid(rank, lane), c.time_ns - origin,
                c.duration_ns or 0, _collective_args(c, timeline),
            )
            mark = flows.get(id(c))
            if mark is not None:
                event["bind_id"] = mark[0]
                if mark[1]:
                    event["flow_in"] = True
                if mark[2]:
                    event["flow_out"] = True
            events.append(event)

    for g in timeline.gc_pauses:
        events.append(_complete(
            f"gc gen {g.generation}", "gc", g.rank, tid(g.rank, GC_LANE), g.start_ns - origin,
            g.duration_ns,
            {"generation": g.generation, "duration_ns": g.duration_ns,
             "module": g.fqn, "phase": g.phase, "rank": g.rank},
        ))
    hosts = _hosts(timeline)
    for rank in sorted(lanes_of_rank):
        metadata.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        metadata.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        if rank in hosts:
            metadata.append(_meta("process_labels", rank, 0, {"labels": hosts[rank]}))
        for index, lane in enumerate(_lane_order(lanes_of_rank[rank])):
            t = tid(rank, lane)
            metadata.append(_meta("thread_name", rank, t, {"name": lane}))
            metadata.append(_meta("thread_sort_index", rank, t, {"sort_index": index}))
    # by time, outer slices before the slices they contain; flow steps in issue order
    events.sort(key=lambda e: (e["ts"], -e["dur"], e["pid"]))
    recorded = sum(1 for c in timeline.collectives if c.duration_ns is not None)
    other: dict[str, Any] = {
        "generator": f"commspan {__version__}",
        "time_origin_unix_ns": origin,
        "ranks": list(timeline.ranks),
        "run_ids": list(timeline.run_ids),
        "steps": len(timeline.steps),
        "collectives": len(timeline.collectives),
        "collectives_with_duration": recorded,
    }
    if notes:
        other["notes"] = [n.removeprefix("commspan: ") for n in notes]
    return {"traceEvents": metadata + events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(source: RecordSource | Timeline, out_path: str | os.PathLike[str],
                       notes: Sequence[str] = ()) -> Path:
    """Write the Chrome trace of a run to a file (gzip-compressed if it ends in ``.gz``).

    Open the file in https://ui.perfetto.dev (Open trace file) or chrome://tracing.

    Args:
        source: as for :func:`chrome_trace`.
        out_path: the file to write; its directory is created if missing.
        notes: as for :func:`chrome_trace`.

    Returns:
        The path written.

    Raises:
        FileNotFoundError: a source path does not exist or a directory holds no ``*.jsonl``.
        ValueError: a source file holds a line that is not JSON; ``out_path`` is one of
            the JSONL files ``source`` names (writing it would replace that rank's
            spans) or a new ``*.jsonl`` file in a folder ``source`` names.
        TypeError: ``out_path`` is not a path.
        IsADirectoryError: ``out_path`` is a directory, or ends with ``/``.

    Example:
        >>> import tempfile, pathlib
        >>> out = write_chrome_trace([], pathlib.Path(tempfile.mkdtemp()) / "trace.json")
        >>> out.name
        'trace.json'
    """
    path = file_path("out_path", out_path, "trace.json")
    refuse_output_clash(source, out_path, "trace.json")
    data = dumps(chrome_trace(source, notes))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=6)
    path.write_bytes(data)
    _log.info("commspan: wrote %s (%d bytes)", path, len(data))
    return path


# ------------------------------------------------------------------ helpers
def _us(ns: int) -> float:
    """Nanoseconds as the format's microseconds.

    A quarter nanosecond is added so that readers that scale by 1000 and
    truncate (older Perfetto) and readers that round (newer Perfetto) both
    get back the exact nanosecond: slices that end together still nest.
    """
    return (ns + 0.25) / 1000.0


def _complete(
    name: str, cat: str, pid: int, tid: int, start_ns: int, dur_ns: int, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": _us(start_ns),
        "dur": _us(dur_ns) if dur_ns > 0 else 0,
        "args": args,
    }


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": args}


def _lanes(slices: Iterable[ModuleSlice]) -> list[tuple[int, str, ModuleSlice]]:
    """``(rank, lane name, slice)``: one lane per phase, overflow lanes if needed."""
    groups: dict[tuple[int, str], list[ModuleSlice]] = {}
    for s in slices:
        groups.setdefault((s.rank, s.phase), []).append(s)
    out: list[tuple[int, str, ModuleSlice]] = []
    for (rank, phase), items in groups.items():
        placed = assign_lanes([(s.start_ns, s.end_ns) for s in items])
        overflow = 0
        for s, (lane_no, _depth) in zip(items, placed):
            overflow = max(overflow, lane_no)
            out.append((rank, phase if lane_no == 0 else f"{phase} #{lane_no + 1}", s))
        if overflow:
            _log.info(
                "commspan: rank %d: %s spans overlap without nesting; drawn on %d lanes",
                rank, phase, overflow + 1,
            )
    return out


def _lane_order(lanes: list[str]) -> list[str]:
    def key(lane: str) -> tuple[int, str]:
        base = lane.split(" #", 1)[0]
        if base == STEPS_LANE:
            return (0, lane)
        if base in _PHASES:
            return (1 + _PHASES.index(base), lane)
        if base == COLLECTIVES_LANE:
            return (len(_PHASES) + 2, lane)
        if base == GC_LANE:
            return (len(_PHASES) + 3, lane)
        return (len(_PHASES) + 1, lane)

    return sorted(lanes, key=key)


def _short_name(fqn: str) -> str:
    """``wq`` for ``Transformer.layers.0.attention.wq``; ``layers.0`` for a container item."""
    parts = fqn.split(".")
    if len(parts) > 1 and parts[-1].isdigit():
        return ".".join(parts[-2:])
    return parts[-1]


def _slice_args(s: ModuleSlice, timeline: Timeline) -> dict[str, Any]:
    args: dict[str, Any] = {
        "fqn": s.fqn,
        "phase": s.phase,
        "type": s.module_type,
        "step": timeline.steps[s.window].step,
        "rank": s.rank,
    }
    if s.error:
        args["error"] = s.error
    return args


def _collective_args(c: Collective, timeline: Timeline) -> dict[str, Any]:
    args: dict[str, Any] = {
        "op": c.op,
        "group": c.group,
        "seq": c.seq if c.p2p_seq is None else c.p2p_seq,
        "bytes": c.bytes,
        "fqn": c.fqn,
        "phase": c.phase,
        "step": timeline.steps[c.window].step,
        "rank": c.rank,
    }
    if c.owner:
        args["owner"] = c.owner  # counted there (an FSDP unit, a DDP bucket's module)
    if c.pending:
        args["pending"] = "not completed: the rank waited in it (hang record)"
    elif c.unwritten:
        args["unwritten"] = "completed in a span never written (hang record)"
    if c.duration_ns is not None:
        args["duration_ns"] = c.duration_ns
    if c.src or c.dst:
        args["placements"] = f"{c.src} -> {c.dst}"
        args["redistribute_op"] = c.redistribute_op
    optional = {
        "kind": c.kind,
        "dtype": c.dtype,
        "shape": list(c.shape) if c.shape else None,
        "group_size": c.group_size,
        "group_ranks": list(c.group_ranks) if c.group_ranks else None,
        "mesh_dim": c.mesh_dim,
        "reduce_op": c.reduce_op,
        "peer": c.peer,
    }
    args.update({k: v for k, v in optional.items() if v not in (None, "")})
    return args


def _flow_marks(collectives: Iterable[Collective]) -> dict[int, tuple[int, bool, bool]]:
    """``{id(collective): (flow id, flow_in, flow_out)}`` for collectives seen on 2+ ranks.

    The ranks are chained in issue order: the first only starts the flow, the
    last only ends it, the ones between do both (a flow step).
    """
    marks: dict[int, tuple[int, bool, bool]] = {}
    next_id = 1
    for members in match_collectives(collectives).values():
        if len(members) < 2:
            continue
        # in the order the events are written (by time, the longer first, then rank):
        # a flow's start must come before its steps and end in the file
        members = sorted(members, key=lambda c: (c.time_ns, -(c.duration_ns or 0), c.rank))
        last = len(members) - 1
        for i, c in enumerate(members):
            marks[id(c)] = (next_id, i > 0, i < last)
        next_id += 1
    return marks


def _hosts(timeline: Timeline) -> dict[int, str]:
    """``{rank: "host vm, pid 5671"}`` for the ranks whose host or pid is known."""
    out: dict[int, str] = {}
    for rank, (host, pid) in timeline.processes.items():
        parts = ([f"host {host}"] if host else []) + ([f"pid {pid}"] if pid is not None else [])
        if parts:
            out[rank] = ", ".join(parts)
    return out
