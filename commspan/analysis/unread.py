"""Which steps of which rank a damaged line may have held.

A JSONL line is one export batch: the spans that ended since the line before, so
one rank's step can be spread over several lines. A damaged line (skipped by the
lenient readers: not JSON, cut, of the wrong shape) takes with it part of the
steps that were in progress when it was written: what that rank issued there is
*unknown*, not *different*, and the readers must not compare it as if the rank
had issued less.

:class:`LineTally` is fed every line read (file, line number, its span records)
and :meth:`LineTally.locate` places each damaged line among its file's other lines:

- the line's rank and run are those of the lines read nearest it in its file
  (the line before it and the line after); of a file holding several ranks'
  lines (one exporter writing for several ranks, files concatenated), every rank
  with lines both before and after it may have written it too: each of those is
  a rank the line may have held collectives of, the steps below found for each;
- a trace of that run is *closed before* the line when the rank's rank span of
  it (``commspan.rank``: it ends after every other span of the rank in the step)
  is in an earlier line of the file: the trace's spans were written before; it is
  *begun after* it when a trace earlier in the run has its rank span in a later
  line: the rank was still in that earlier trace when the damaged line was
  written, so the line held nothing of this one;
- of the traces in between, one whose rank span was read and counts every
  collective event read of the rank there (its ``commspan.collectives.<phase>.total``
  added up) lost no collective: what the line held of it (module spans) is nothing
  a check compares or a count adds up.
- a step number used again shares its trace, whose rank spans may then lie both
  before and after the line: it may have held part of a later use, which its
  counts say (every collective counted was read, or not), and the run's order of
  traces, by step number, is not the file's there.

The rest are :class:`Unread`: ``commspan check`` leaves that rank out of those
steps' comparisons and says so (a finding of kind ``unread``); the other commands
say their counts of those steps may be short.

Example:
    >>> LineTally().locate([])
    []
"""

from __future__ import annotations

import bisect
import os
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from commspan import semconv
from commspan.analysis.records import Run, Unread
from commspan.analysis.runs import _run_of, format_numbers
from commspan.otlpjson.records import SkippedLine, SpanRecord, record_rank

__all__ = ["LineTally", "Unread", "steps_words", "unread_note"]

_TOTAL_SUFFIX = f".{semconv.COUNT_TOTAL}"
_LINE_BITS = 40  # a place read: the file's index above these bits, the line number below
_LINE_MASK = (1 << _LINE_BITS) - 1


class LineTally:
    """Where each rank's traces are in the lines of its file, and how many of its
    collectives each rank span counts and the lines hold: what :meth:`locate` needs.
    Holds a few numbers per line and per (rank, trace), never a span record."""

    def __init__(self) -> None:
        # path -> the number of each line read holding a ranked span, and its (rank,
        # run) pairs (one tuple object per distinct set: files of one span per line
        # have millions of lines, and the tally must stay a few bytes per line)
        self._lines: dict[str, tuple[array[int], list[tuple[tuple[int, str], ...]]]] = {}
        self._pair_sets: dict[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]] = {}
        self._traces: dict[str, str] = {}  # one string object per trace id
        # path -> (rank, run) -> [first, last] line numbers holding its spans there
        self._extent: dict[str, dict[tuple[int, str], list[int]]] = {}
        # (path, rank, trace) -> line numbers of the rank spans of it there
        self._closed: dict[tuple[str, int, str], list[int]] = {}
        self._events: Counter[tuple[int, str]] = Counter()
        self._totals: dict[tuple[int, str], int] = {}
        self._steps: dict[str, int] = {}
        self._start: dict[str, int] = {}
        self._runs: dict[str, str] = {}  # trace -> run
        self._presence: dict[str, set[int]] = {}
        # (rank, trace) -> span id of each rank span of it, and of its first span in
        # a line -> where it was first read: (index in _paths) << _LINE_BITS | line
        self._written: dict[tuple[int, str], dict[str, int]] = {}
        self._paths: list[str] = []
        self._path_index: dict[str, int] = {}
        self.copies: list[tuple[int, str, tuple[str, int], tuple[str, int]]] = []
        """Spans read twice: ``(rank, trace, (path, line) first, (path, line) again)``,
        one per rank and trace of a line. A span is written once; read again, its line
        was copied (a file holding some lines of another, a line appended twice) and
        what that line holds of the step (its spans, its collectives) is counted
        twice. Found by the rank span of the step and by the first span of each rank
        and trace in a line, so a copied line holding module spans only is found too
        (a line is copied whole: a part of one is a damaged line)."""

    def add(self, path: str | os.PathLike[str], number: int,
            records: Sequence[SpanRecord]) -> None:
        """What line ``number`` of ``path`` holds (``read_spans_in``'s ``on_line``)."""
        key = os.fspath(path)
        pairs: dict[tuple[int, str], None] = {}  # (an ordered set)
        # the spans that say whether this line was read before: (rank, trace, span id)
        # -> None, the first span of each rank and trace, and the rank spans
        marks: dict[tuple[int, str, str], None] = {}
        firsts: set[tuple[int, str]] = set()
        traces = self._traces
        for rec in records:
            rank = record_rank(rec)
            trace = traces.setdefault(rec.trace_id, rec.trace_id)
            step = rec.attributes.get(semconv.STEP)
            if rec.name in (semconv.SPAN_STEP, semconv.SPAN_RANK, semconv.SPAN_HANG) \
                    and type(step) is int:
                self._steps[trace] = step
            run = _run_of(rec)
            self._runs.setdefault(trace, run)
            if rank is None or rec.name == semconv.SPAN_STEP:
                continue  # (the step root says nothing of the rank that wrote it)
            pairs[(rank, run)] = None
            self._presence.setdefault(trace, set()).add(rank)
            start = self._start.get(trace)
            if start is None or rec.start_time < start:
                self._start[trace] = rec.start_time
            if (rank, trace) not in firsts and rec.name != semconv.SPAN_SESSION:
                # (a session's root has the id of its key, as a step's: two jobs under
                # one run id, each numbering its sessions from 1, write the same)
                firsts.add((rank, trace))
                marks[(rank, trace, rec.span_id)] = None
            if rec.name == semconv.SPAN_HANG:
                continue  # (its collectives are a snapshot, not events of the step)
            events = sum(1 for _name, attrs in rec.events if semconv.COLL_OP in attrs)
            if events:
                self._events[(rank, trace)] += events
            if rec.name == semconv.SPAN_RANK:
                self._closed.setdefault((key, rank, trace), []).append(number)
                marks[(rank, trace, rec.span_id)] = None
                total = sum(v for k, v in rec.attributes.items()
                            if k.startswith(semconv.COUNT_PREFIX) and k.endswith(_TOTAL_SUFFIX)
                            and type(v) is int)
                self._totals[(rank, trace)] = self._totals.get((rank, trace), 0) + total
        if marks:
            index = self._path_index.get(key)
            if index is None:
                index = self._path_index[key] = len(self._paths)
                self._paths.append(key)
            here = index << _LINE_BITS | number
            copied: set[tuple[int, str]] = set()
            written = self._written
            for rank, trace, span_id in marks:
                spans = written.get((rank, trace))
                if spans is None:
                    spans = written[(rank, trace)] = {}
                first = spans.setdefault(span_id, here)
                if first != here and (rank, trace) not in copied:
                    copied.add((rank, trace))
                    self.copies.append((rank, trace, self._where(first), (key, number)))
        if pairs:
            held = tuple(pairs)
            held = self._pair_sets.setdefault(held, held)
            lines = self._lines.get(key)
            if lines is None:
                lines = self._lines[key] = (array("q"), [])
            lines[0].append(number)
            lines[1].append(held)
            extent = self._extent.setdefault(key, {})
            for pair in pairs:
                seen = extent.get(pair)
                if seen is None:
                    extent[pair] = [number, number]
                else:
                    seen[1] = number

    def new_read(self) -> None:
        """Files read from here on are compared for copies among themselves only (``diff``
        reads two runs, one perhaps a copy of the other: that is no copy of a line)."""
        self._written.clear()

    def _where(self, packed: int) -> tuple[str, int]:
        """``(path, line)`` of a place :attr:`_written` holds."""
        return self._paths[packed >> _LINE_BITS], packed & _LINE_MASK

    def locate(self, damaged: Iterable[SkippedLine]) -> list[Unread]:
        """The steps of a rank each damaged line may have held collectives of (see the
        module docstring), in the files' order; torn last lines are left out (the
        step they cut is one the rank never finished: the readers treat it so)."""
        out: list[Unread] = []
        orders: dict[str, list[str]] = {}
        for skipped in damaged:
            if skipped.kind == "torn":
                continue
            # (nothing of the file read: no rank to name)
            for rank, run in self._writers(skipped.path, skipped.line):
                order = orders.get(run)
                if order is None:
                    order = orders[run] = self._order(run)
                out.extend(self._unread(skipped, rank, run, order))
        return out

    def _unread(self, skipped: SkippedLine, rank: int, run: str,
                order: Sequence[str]) -> Iterator[Unread]:
        """The traces of ``rank`` (of ``run``, in the ``order`` the run went through
        them) that the damaged line may have held collectives of, were it the rank's."""
        closed_after = False
        for trace in order:
            lines = self._closed.get((skipped.path, rank, trace), ())
            key = (rank, trace)
            whole = key in self._totals and self._totals[key] == self._events[key]
            before = any(n < skipped.line for n in lines)
            if before and any(n > skipped.line for n in lines):
                # a step number used again (its trace ended before the line and
                # again after it): the run's order of traces is not the file's
                # here, it neither closes nor ends the stretch the line lies in
                if not whole:
                    yield Unread(rank, trace, self._steps.get(trace), skipped.path,
                                 skipped.line, skipped.reason, run)
                continue
            if before:
                continue  # written whole before the damaged line
            if closed_after:
                break  # the rank was still in an earlier trace after the line
            closed_after = any(n > skipped.line for n in lines)
            if whole:
                continue  # every collective its rank span counts was read
            yield Unread(rank, trace, self._steps.get(trace), skipped.path, skipped.line,
                         skipped.reason, run)

    def _writers(self, path: str, number: int) -> list[tuple[int, str]]:
        """``(rank, run)`` of every rank that may have written line ``number`` of
        ``path``: those of the lines read nearest it (the one before, the one after),
        and each with lines of its both before and after it (a file holding several
        ranks' lines); in the order their lines first appear. Empty when nothing of
        the file was read."""
        lines = self._lines.get(path)
        if not lines:
            return []
        numbers, held = lines
        at = bisect.bisect_left(numbers, number)
        found: dict[tuple[int, str], None] = {}
        for near in held[max(0, at - 1):at + 1]:
            found.update(dict.fromkeys(near))
        for pair, (first, last) in self._extent[path].items():
            if first < number < last:
                found[pair] = None
        return sorted(found, key=lambda pair: self._extent[path][pair][0])

    def _order(self, run: str) -> list[str]:
        """The traces of ``run`` in the order the run went through them
        (:meth:`~commspan.analysis.records.Run.traces`)."""
        traces = [t for t, r in self._runs.items() if r == run and t in self._presence]
        return Run(trace_steps={t: self._steps.get(t) for t in traces},
                   presence={t: self._presence[t] for t in traces},
                   trace_start={t: self._start.get(t, 0) for t in traces}).traces()


def copies_note(tally: LineTally, label: str = "", since: int = 0) -> str | None:
    """What to say of the spans :class:`LineTally` read twice (``None``: none), from
    its ``since``-th copy on (those of the files read last): the lines that hold them
    are counted twice in what is shown."""
    copies = tally.copies[since:]
    if not copies:
        return None
    shown = "; ".join(
        f"rank {rank}'s step {tally._steps.get(trace, 'outside steps')}: {a}:{la} and "
        f"{b}:{lb}" for rank, trace, (a, la), (b, lb) in copies[:3])
    more = f" and {len(copies) - 3} more" if len(copies) > 3 else ""
    return (f"commspan: {label}spans read twice ({shown}{more}): a file holds a copy of "
            "some lines of another (or a line was appended twice), so what follows counts "
            "what those lines hold of those steps twice; remove the copy, or pass the files "
            "without it")


def unread_note(unread: Sequence[Unread], label: str = "") -> list[str]:
    """stderr lines for the commands that count: per damaged line, the ranks and steps
    whose counts may be short (``label``: ``"A: "`` of ``diff``)."""
    by_line: dict[tuple[str, int], list[Unread]] = {}
    for u in unread:
        by_line.setdefault((u.path, u.line), []).append(u)
    out = []
    for (path, line), items in by_line.items():
        per_rank: dict[int, list[int | None]] = {}
        for u in items:
            per_rank.setdefault(u.rank, []).append(u.step)
        if len(per_rank) == 1:
            ((rank, steps),) = per_rank.items()
            whose = f"rank {rank}'s collectives of {steps_words(steps)}"
            who = "that rank"
        else:  # (a file of several ranks' lines: any of them may have written it)
            whose = "collectives " + " and ".join(
                f"of rank {rank} in {steps_words(steps)}" for rank, steps in per_rank.items())
            who = "those ranks"
        out.append(f"commspan: {label}{Path(path)}:{line} is damaged: {whose} may be missing "
                   f"from what follows (counts of {who} there may be short)")
    return out


def steps_words(steps: Sequence[int | None]) -> str:
    """``"steps 1-3, 5 and work outside steps"``: the steps a damaged line may have held,
    in the words of both the stderr note (:func:`unread_note`) and ``check``'s ``unread``
    finding (``None``: work outside steps; the numbers sorted, ranges joined).

    Example:
        >>> steps_words([2, None, 1, 3, 5])
        'steps 1-3, 5 and work outside steps'
        >>> steps_words([4])
        'step 4'
    """
    numbered = sorted({s for s in steps if s is not None})
    words = []
    if numbered:
        words.append(("step " if len(numbered) == 1 else "steps ") + format_numbers(numbered, ", "))
    if any(s is None for s in steps):
        words.append("work outside steps")
    return " and ".join(words)
