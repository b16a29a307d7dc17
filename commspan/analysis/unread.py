"""Which steps of which rank a damaged line may have held.

A JSONL line is one export batch: the spans that ended since the line before, so
one rank's step can be spread over several lines. A damaged line (skipped by the
lenient readers: not JSON, cut, of the wrong shape) takes with it part of the
steps that were in progress when it was written: what that rank issued there is
*unknown*, not *different*, and the readers must not compare it as if the rank
had issued less.

:class:`LineTally` is fed every line read (file, line number, its span records)
and :meth:`LineTally.locate` places each damaged line among its file's other lines:

- the line's rank and run are those of the lines read nearest it in its file;
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

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from commspan import semconv
from commspan.analysis.records import Run, Unread
from commspan.analysis.runs import _run_of, format_numbers
from commspan.otlpjson.records import SkippedLine, SpanRecord, record_rank

__all__ = ["LineTally", "Unread", "unread_note"]

_TOTAL_SUFFIX = f".{semconv.COUNT_TOTAL}"


class LineTally:
    """Where each rank's traces are in the lines of its file, and how many of its
    collectives each rank span counts and the lines hold: what :meth:`locate` needs.
    Holds a few numbers per line and per (rank, trace), never a span record."""

    def __init__(self) -> None:
        # path -> (line number, rank, run) of each line read holding a ranked span
        self._lines: dict[str, list[tuple[int, int, str]]] = {}
        # (path, rank, trace) -> line numbers of the rank spans of it there
        self._closed: dict[tuple[str, int, str], list[int]] = {}
        self._events: Counter[tuple[int, str]] = Counter()
        self._totals: dict[tuple[int, str], int] = {}
        self._steps: dict[str, int] = {}
        self._start: dict[str, int] = {}
        self._runs: dict[str, str] = {}  # trace -> run
        self._presence: dict[str, set[int]] = {}

    def add(self, path: str | os.PathLike[str], number: int,
            records: Sequence[SpanRecord]) -> None:
        """What line ``number`` of ``path`` holds (``read_spans_in``'s ``on_line``)."""
        key = os.fspath(path)
        first: tuple[int, str] | None = None
        for rec in records:
            rank = record_rank(rec)
            trace = rec.trace_id
            step = rec.attributes.get(semconv.STEP)
            if rec.name in (semconv.SPAN_STEP, semconv.SPAN_RANK, semconv.SPAN_HANG) \
                    and type(step) is int:
                self._steps[trace] = step
            run = _run_of(rec)
            self._runs.setdefault(trace, run)
            if rank is None or rec.name == semconv.SPAN_STEP:
                continue  # (the step root says nothing of the rank that wrote it)
            if first is None:
                first = (rank, run)
            self._presence.setdefault(trace, set()).add(rank)
            start = self._start.get(trace)
            if start is None or rec.start_time < start:
                self._start[trace] = rec.start_time
            if rec.name == semconv.SPAN_HANG:
                continue  # (its collectives are a snapshot, not events of the step)
            events = sum(1 for _name, attrs in rec.events if semconv.COLL_OP in attrs)
            if events:
                self._events[(rank, trace)] += events
            if rec.name == semconv.SPAN_RANK:
                self._closed.setdefault((key, rank, trace), []).append(number)
                total = sum(v for k, v in rec.attributes.items()
                            if k.startswith(semconv.COUNT_PREFIX) and k.endswith(_TOTAL_SUFFIX)
                            and type(v) is int)
                self._totals[(rank, trace)] = self._totals.get((rank, trace), 0) + total
        if first is not None:
            self._lines.setdefault(key, []).append((number, *first))

    def locate(self, damaged: Iterable[SkippedLine]) -> list[Unread]:
        """The steps of a rank each damaged line may have held collectives of (see the
        module docstring), in the files' order; torn last lines are left out (the
        step they cut is one the rank never finished: the readers treat it so)."""
        out: list[Unread] = []
        orders: dict[str, list[str]] = {}
        for skipped in damaged:
            if skipped.kind == "torn":
                continue
            near = self._near(skipped.path, skipped.line)
            if near is None:
                continue  # nothing of the file was read: no rank to name
            rank, run = near
            order = orders.get(run)
            if order is None:
                order = orders[run] = self._order(run)
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
                        out.append(Unread(rank, trace, self._steps.get(trace),
                                          skipped.path, skipped.line, skipped.reason, run))
                    continue
                if before:
                    continue  # written whole before the damaged line
                if closed_after:
                    break  # the rank was still in an earlier trace after the line
                closed_after = any(n > skipped.line for n in lines)
                if whole:
                    continue  # every collective its rank span counts was read
                out.append(Unread(rank, trace, self._steps.get(trace), skipped.path,
                                  skipped.line, skipped.reason, run))
        return out

    def _near(self, path: str, number: int) -> tuple[int, str] | None:
        """``(rank, run)`` of the line read nearest line ``number`` of ``path`` (the one
        before it, else the one after)."""
        lines = self._lines.get(path)
        if not lines:
            return None
        before = [line for line in lines if line[0] < number]
        _, rank, run = before[-1] if before else lines[0]
        return rank, run

    def _order(self, run: str) -> list[str]:
        """The traces of ``run`` in the order the run went through them
        (:meth:`~commspan.analysis.records.Run.traces`)."""
        traces = [t for t, r in self._runs.items() if r == run and t in self._presence]
        return Run(trace_steps={t: self._steps.get(t) for t in traces},
                   presence={t: self._presence[t] for t in traces},
                   trace_start={t: self._start.get(t, 0) for t in traces}).traces()


def unread_note(unread: Sequence[Unread], label: str = "") -> list[str]:
    """stderr lines for the commands that count: per damaged line, the rank and steps
    whose counts may be short (``label``: ``"A: "`` of ``diff``)."""
    by_line: dict[tuple[str, int], list[Unread]] = {}
    for u in unread:
        by_line.setdefault((u.path, u.line), []).append(u)
    out = []
    for (path, line), items in by_line.items():
        steps = _steps_words([u.step for u in items])
        out.append(f"commspan: {label}{Path(path)}:{line} is damaged: rank {items[0].rank}'s "
                   f"collectives of {steps} may be missing from what follows (counts of "
                   "that rank there may be short)")
    return out


def _steps_words(steps: Sequence[int | None]) -> str:
    numbered = sorted({s for s in steps if s is not None})
    words = []
    if numbered:
        words.append(("step " if len(numbered) == 1 else "steps ") + format_numbers(numbered))
    if any(s is None for s in steps):
        words.append("work outside steps")
    return " and ".join(words)
