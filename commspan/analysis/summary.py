"""A run in numbers: spans, traces, ranks, steps and collective totals per phase.

What ``commspan summary`` prints (the text comes from
:func:`commspan.render.table.summary_table`).

Example:
    >>> from commspan import Aggregator
    >>> summarize(Aggregator(), [])["total"]
    0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from commspan import semconv
from commspan.analysis.counts import Aggregator
from commspan.otlpjson.records import SpanRecord

__all__ = ["summarize", "summary_of"]


def summarize(
    aggregator: Aggregator, spans: Iterable[SpanRecord], rank: int | None = None
) -> dict[str, Any]:
    """The summary of a run from its counts and its span records.

    Args:
        aggregator: the run's counts (one rank, or every rank summed).
        spans: the run's span records (e.g. :func:`commspan.exporters.read_spans`).
        rank: count the spans of this rank only (``None``: all).

    Returns:
        ``{"spans", "traces", "ranks", "steps", "collectives": {phase: {op: n}},
        "total"}``; ranks and steps sorted, phases in phase order, ops sorted.
    """
    count = 0
    ranks: set[int] = set()
    steps: set[int] = set()
    traces: set[str] = set()
    for span in spans:
        if rank is not None and span.rank != rank:
            continue
        count += 1
        traces.add(span.trace_id)
        if span.rank is not None:
            ranks.add(span.rank)
        step = span.attributes.get(semconv.STEP)
        if isinstance(step, int) and span.name == semconv.SPAN_RANK:
            steps.add(step)
    return summary_of(aggregator, count, traces, ranks, steps)


def summary_of(
    aggregator: Aggregator, spans: int, traces: set[str], ranks: set[int], steps: set[int]
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
    }
