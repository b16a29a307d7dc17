"""A run in numbers: spans, traces, ranks, steps and collective totals per phase.

What ``commspan summary`` prints (the text comes from
:func:`commspan.render.table.summary_table`).

Example:
    >>> from commspan import Aggregator
    >>> summarize(Aggregator(), [])["total"]
    0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from commspan import semconv
from commspan.analysis.counts import Aggregator
from commspan.analysis.runs import format_numbers
from commspan.otlpjson.records import SpanRecord

__all__ = ["cut_short", "cut_short_steps", "partial_list", "partial_note", "summarize",
           "summary_of"]

_STEP_NAMES = frozenset({semconv.SPAN_RANK, semconv.SPAN_STEP, semconv.SPAN_HANG})


def summarize(
    aggregator: Aggregator, spans: Iterable[SpanRecord], rank: int | None = None,
    last_traces: Mapping[int | None, str] | None = None,
) -> dict[str, Any]:
    """The summary of a run from its counts and its span records.

    Args:
        aggregator: the run's counts (one rank, or every rank summed).
        spans: the run's span records (e.g. :func:`commspan.exporters.read_spans`).
        rank: count the spans of this rank only (``None``: all).

    Returns:
        ``{"spans", "traces", "ranks", "steps", "collectives": {phase: {op: n}},
        "total", "partial"}``; ranks and steps sorted, phases in phase order, ops
        sorted. ``partial`` lists the ``{"rank", "step"}`` of traces cut short: a
        rank wrote module spans of the trace but never its ``commspan.rank`` span,
        and a hang record names the trace, a collective of it failed on some rank,
        or the rank wrote later ones (else its last trace may still be running);
        ``step`` is ``None`` when no span of the trace says it. ``total`` and
        ``collectives`` come from the rank spans, so they leave those out.
    """
    count = 0
    ranks: set[int] = set()
    steps: set[int] = set()
    traces: set[str] = set()
    unfinished = _Unfinished()
    for span in spans:
        unfinished.see(span)  # (a collective of any rank that failed cuts a step short)
        if rank is not None and span.rank != rank:
            continue
        count += 1
        traces.add(span.trace_id)
        if span.rank is not None:
            ranks.add(span.rank)
        step = unfinished.add(span)
        if step is not None:
            steps.add(step)
    partial = [(r, s) for r, _, s in unfinished.cut_short(last_traces)]
    # a step cut short is one of the rank's steps, though only another rank's span of
    # it may say its number (as the digests' summary has it)
    steps.update(s for _, s in partial if s is not None)
    return summary_of(aggregator, count, traces, ranks, steps, partial)


def cut_short(
    spans: Iterable[SpanRecord], last_traces: Mapping[int | None, str] | None = None,
) -> list[tuple[int | None, str, int | None]]:
    """The ``(rank, trace id, step)`` of the traces cut short, as :func:`summarize`'s
    ``partial`` finds them (``step`` ``None`` when no span of the trace says it).
    ``last_traces``: each rank's last trace in the whole run, when ``spans`` are some
    steps of it (:attr:`~commspan.analysis.runs.Selection.last_traces`).

    Example:
        >>> cut_short([])
        []
    """
    unfinished = _Unfinished()
    for span in spans:
        unfinished.see(span)
        unfinished.add(span)
    return unfinished.cut_short(last_traces)


def part_last_start(part: Mapping[str, Any]) -> int:
    """When the latest span of a digest part started (``last_start``, version 7):
    what says a rank's latest trace, as the lines' readers take it (a step number
    used again begins its trace before the steps between its uses)."""
    started = part.get("last_start")
    return started if isinstance(started, int) else int(part["start"])


class _Unfinished:
    """Which traces a rank began (wrote module spans of) but never ended (wrote no
    ``commspan.rank`` span of), and which of those were cut short."""

    def __init__(self) -> None:
        self.trace_step: dict[str, int] = {}
        self.rooted: set[tuple[int | None, str]] = set()
        self.modules: set[tuple[int | None, str]] = set()
        self.hung: set[tuple[int | None, str]] = set()
        self.failed: set[str] = set()  # traces where some rank's collective failed
        self.latest: dict[int | None, tuple[int, str]] = {}  # rank -> (start, trace) of its last

    def see(self, span: SpanRecord) -> None:
        """Note a span of any rank: the step of its trace (a step, rank or hang span
        says it), and whether a collective of its trace failed."""
        if span.name in _STEP_NAMES:
            step = span.attributes.get(semconv.STEP)
            if isinstance(step, int) and not isinstance(step, bool):
                self.trace_step.setdefault(span.trace_id, step)
        if span.events and span.trace_id not in self.failed and any(
                attrs.get(semconv.COLL_STATE) == semconv.STATE_FAILED
                for _, attrs in span.events):
            self.failed.add(span.trace_id)

    def add(self, span: SpanRecord) -> int | None:
        """Note one span; returns the step it names (a step, rank or hang span's)."""
        name = span.name
        last = self.latest.get(span.rank)
        if last is None or span.start_time > last[0]:
            self.latest[span.rank] = (span.start_time, span.trace_id)
        if name == semconv.SPAN_HANG:
            self.hung.add((span.rank, span.trace_id))
        if name in _STEP_NAMES:
            if name == semconv.SPAN_RANK:
                self.rooted.add((span.rank, span.trace_id))
            step = span.attributes.get(semconv.STEP)
            if isinstance(step, int) and not isinstance(step, bool):
                self.trace_step.setdefault(span.trace_id, step)
                return step
        elif semconv.MODULE_FQN in span.attributes:
            self.modules.add((span.rank, span.trace_id))
        return None

    def add_part(self, part: Mapping[str, Any], failed: bool) -> None:
        """:meth:`see` and :meth:`add` of the spans a digest part stands for
        (:func:`~commspan.analysis.digest.digest_parts`; ``failed``: a collective of
        it failed): the rank's latest trace is that of the span that started last
        (:func:`part_last_start`). Digests hold no hang record."""
        rank, trace = part["rank"], part["trace"]
        if part["step"] is not None:
            self.trace_step.setdefault(trace, part["step"])
        if failed:
            self.failed.add(trace)
        last = self.latest.get(rank)
        started = part_last_start(part)
        if last is None or started > last[0]:
            self.latest[rank] = (started, trace)
        if part["rank_step"] is not None:
            self.rooted.add((rank, trace))
        if part["present"] and part["commspan_spans"]:
            self.modules.add((rank, trace))

    def cut_short(self, last_traces: Mapping[int | None, str] | None = None,
                  ) -> list[tuple[int | None, str, int | None]]:
        """A trace without its rank span was cut short when a hang record names it,
        when a collective of it failed on some rank (its op raised: a peer died, a
        backend timed out; the job broke there), or when the rank wrote a later
        trace; otherwise its last trace may still be running (files of a job in
        progress), so that one is not. ``last_traces``: each rank's last trace in the
        whole run, when the spans noted are some steps of it."""
        out = []
        for rank, trace in self.modules - self.rooted:
            if last_traces is not None:
                last_trace = last_traces.get(rank)
            else:
                latest = self.latest.get(rank)
                last_trace = latest[1] if latest is not None else None
            if (rank, trace) in self.hung or trace in self.failed or (
                    last_trace is not None and last_trace != trace):
                out.append((rank, trace, self.trace_step.get(trace)))
        return sorted(out, key=lambda p: (p[0] is None, p[0] or 0, p[1]))


def summary_of(
    aggregator: Aggregator, spans: int, traces: set[str], ranks: set[int], steps: set[int],
    partial: Iterable[tuple[int | None, int | None]] = (),
) -> dict[str, Any]:
    """The summary's dict (see :func:`summarize`) from what was counted of the spans."""
    per_phase = {phase.value: aggregator.comm_counts(phase.value) for phase in semconv.Phase}
    return {
        "spans": spans,
        "traces": len(traces),
        "ranks": sorted(ranks),
        "steps": sorted(steps),
        "collectives": {ph: dict(sorted(ops.items())) for ph, ops in per_phase.items() if ops},
        "total": aggregator.total_count(),
        "partial": partial_list(partial),
    }


def partial_list(partial: Iterable[tuple[int | None, int | None]]) -> list[dict[str, Any]]:
    """``(rank, step)`` pairs of traces cut short as :func:`summarize`'s ``partial``
    lists them: once each, by step, then rank (``None`` last).

    Example:
        >>> partial_list([(1, 2), (0, 2), (0, None), (1, 2)])
        [{'rank': 0, 'step': 2}, {'rank': 1, 'step': 2}, {'rank': 0, 'step': None}]
    """
    return [{"rank": r, "step": s} for r, s in sorted(
        set(partial), key=lambda p: (p[1] is None, p[1] or 0, p[0] is None, p[0] or 0))]


_COUNTS_LEFT_OUT = ("Global and the modules still open then do not count its collectives, "
                    "the modules that finished do")


def partial_note(partial: list[dict[str, Any]], consequence: str = _COUNTS_LEFT_OUT,
                 ) -> str | None:
    """The stderr note for :func:`summarize`'s ``partial``, or ``None`` when empty;
    ``consequence``: what a step cut short means for the command's output (by
    default, for counts).

    Example:
        >>> partial_note([{"rank": 0, "step": 2}, {"rank": 1, "step": 2}])[:38]
        'commspan: step 2 of ranks 0-1 was cut '
    """
    if not partial:
        return None
    what = cut_short_steps((p["rank"], p["step"]) for p in partial)
    return (f"commspan: {what} was cut short (no commspan.rank span written: a hang or a "
            f"process stopped mid-step): {consequence} (commspan check shows "
            "where each rank was, when a hang record was written)")


def last_steps(items: Iterable[tuple[int | None, str, int | None]]) -> dict[int, int]:
    """Each rank's last step, from ``(rank, trace, step)`` of its spans (or digest
    parts; ``step`` ``None`` when that one does not say its trace's, another may)."""
    trace_step: dict[str, int] = {}
    seen: set[tuple[int, str]] = set()
    for rank, trace, step in items:
        if step is not None:
            trace_step.setdefault(trace, step)
        if rank is not None:
            seen.add((rank, trace))
    last: dict[int, int] = {}
    for rank, trace in seen:
        step = trace_step.get(trace)
        if step is not None and step > last.get(rank, step - 1):
            last[rank] = step
    return last


def ends_note(last: Mapping[int, int]) -> str | None:
    """The stderr note when some ranks' spans end at an earlier step than the others'
    (``last``: :func:`last_steps`): the counts of the steps after leave them out.

    Example:
        >>> ends_note({0: 4, 1: 2, 2: 4})[:62]
        "commspan: rank 1's spans end at step 2, the other ranks' at st"
    """
    if not last:
        return None
    end = max(last.values())
    early: dict[int, list[int]] = {}
    for rank, step in sorted(last.items()):
        if step < end:
            early.setdefault(step, []).append(rank)
    if not early:
        return None
    parts = []
    for step, ranks in sorted(early.items()):
        who = f"rank {ranks[0]}'s" if len(ranks) == 1 else f"ranks {format_numbers(ranks)}'"
        parts.append(f"{who} spans end at step {step}")
    after = min(early) + 1
    steps = f"step {end}" if after == end else f"steps {format_numbers(range(after, end + 1))}"
    return (f"commspan: {'; '.join(parts)}, the other ranks' at step {end} (a rank that "
            "stopped, or whose file was cut or is still being written): the counts of "
            f"{steps} leave those ranks out")


def cut_short_steps(partial: Iterable[tuple[int | None, int | None]]) -> str:
    """``(rank, step)`` pairs of traces cut short in words, by step.

    Example:
        >>> cut_short_steps([(0, 2), (1, 2), (3, None)])
        'step 2 of ranks 0-1; a step of rank 3'
    """
    by_step: dict[Any, list[int | None]] = {}
    for rank, step in partial:
        by_step.setdefault(step, []).append(rank)
    return "; ".join(
        ("a step" if step is None else f"step {step}")
        + f" of rank{'s' if len(rs) > 1 else ''} "
        + format_numbers(r for r in rs if r is not None)
        for step, rs in by_step.items()
    )
