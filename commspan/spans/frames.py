"""Frames: the plain records of open spans, and the read-only view of them.

A :class:`Frame` is what the capture layer opens and finishes; the
:class:`~commspan.spans.recorder.SpanRecorder` turns it into an OpenTelemetry
span when it closes. :class:`OpenSpan` is the copy of an open frame that
readers outside the recorder get (:meth:`SpanRecorder.open_spans`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from opentelemetry.trace import SpanContext

from commspan.semconv import Phase
from commspan.spans.timing import CollectiveTiming

__all__ = ["Frame", "OpenSpan"]

_now = time.time_ns
_NO_CREDITS: Mapping[tuple[str, str, str], int] = MappingProxyType({})


class Frame:
    """One open span: a module call in one phase, or the per-rank root.

    A frame goes through two states before it is gone:

    - ``finished``: the capture layer has finished with it (the module's call
      or backward is over) while a frame above it is still open; it closes as
      soon as it is on top, so spans nest (a backward frame can finish before
      the frames opened above it, see docs/design.md, "How backward nesting
      is inferred", step 3);
    - ``closed``: it left the stack; its span was built and handed to the sink,
      or, while collectives of its subtree have not completed, waits in the
      recorder's queue of closed frames to be (docs/design.md, "When
      collectives complete").

    Attributes:
        fqn: module name (``Global`` for the rank root).
        phase: phase of a module frame; ``None`` for the root.
        events: the events attached so far: a collective's
            :class:`~commspan.spans.timing.CollectiveTiming` (its record, timed or
            not), or a ``(name, timestamp_ns, attributes)`` tuple for other events.
        counts: ``{(phase, op): n}`` collectives in this frame's subtree.
        nbytes: ``{phase: bytes}`` of the collectives in this frame's subtree
            (``None`` until one has bytes).
        timings: the timings of the collectives in this frame's subtree, counted
            by the rules of :attr:`counts` (``None`` until one is timed).
        own: timings of this frame's own events that it does not count (owned
            by another module); its span waits for them too.
        end: when the frame closed (ns), once ``closed``.
        credits: ``{(module fqn, phase, op): n}`` for collectives of this frame's
            events that count for modules with no open frame when they were
            issued (their events' ``commspan.owner.credit_fqns``); ``None`` if none.
        finished: the capture layer has finished with the frame; it closes when
            the frames above it have closed.
        closed: it left the stack (its span is emitted, or waits for completions).
        task: the autograd graph task a backward or recompute frame belongs to
            (``-1`` for a forward or the root).
    """

    __slots__ = (
        "span_id",
        "context",
        "fqn",
        "phase",
        "name",
        "attrs",
        "parent",
        "start",
        "events",
        "counts",
        "nbytes",
        "timings",
        "timed_upto",
        "own",
        "end",
        "self_count",
        "error",
        "finished",
        "closed",
        "task",
        "credits",
    )

    def __init__(
        self,
        span_id: int,
        context: SpanContext,
        fqn: str,
        phase: Phase | None,
        name: str,
        attrs: dict[str, Any],
        parent: SpanContext | None,
        task: int = -1,
    ) -> None:
        self.span_id = span_id
        self.context = context
        self.fqn = fqn
        self.phase = phase
        self.name = name
        self.attrs = attrs
        self.parent = parent
        self.start = _now()
        self.events: list[CollectiveTiming | tuple[str, int, dict[str, Any]]] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.nbytes: dict[str, int] | None = None
        self.timings: list[CollectiveTiming] | None = None
        self.timed_upto = 0  # timings[:timed_upto] are known to have finished
        self.own: list[CollectiveTiming] | None = None  # its events' timings it does not count
        self.end = 0
        self.self_count = 0
        self.error: str | None = None  # status description; never the exception itself
        self.finished = False
        self.closed = False
        self.task = task
        self.credits: dict[tuple[str, str, str], int] | None = None

    def ready(self) -> bool:
        """Whether every collective of the subtree, and of its own events, has completed
        (or none is timed)."""
        own = self.own
        if own is not None:
            if not all(t.finished() for t in own):
                return False
            self.own = None
        timings = self.timings
        if timings is None:
            return True
        i = self.timed_upto
        for timing in timings[i:] if i else timings:
            if timing.duration is None and not timing.finished():
                self.timed_upto = i
                return False
            i += 1
        self.timed_upto = i
        return True

    def __repr__(self) -> str:
        return f"Frame({self.name!r}, finished={self.finished}, closed={self.closed})"


class OpenSpan(NamedTuple):
    """A copy of one open frame, for readers of spans still in progress.

    The live :class:`~commspan.Aggregator` adds these to the counts of the
    spans that have ended, so ``mode.aggregator`` answers inside the ``with``
    block too.

    Attributes:
        fqn: module name (``Global`` for the rank span).
        attributes: the span's attributes so far (module type, depth, ...).
        counts: ``{(phase, op): n}`` collectives in the frame's subtree so far.
        finished: the capture layer has finished with it (see :class:`Frame`).
        credits: ``{(module fqn, phase, op): n}``: collectives of the frame's
            events that count for other modules, which had no open span (see
            :meth:`~commspan.spans.SpanRecorder.add_event`).
        events: ``(name, attributes)`` of the frame's own events so far (its
            collectives and their op, owner, bytes and placements).
        start: when the frame opened (ns since the epoch; 0 if not known).
    """

    fqn: str
    attributes: Mapping[str, Any]
    counts: Mapping[tuple[str, str], int]
    finished: bool
    credits: Mapping[tuple[str, str, str], int] = _NO_CREDITS
    events: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    start: int = 0
