"""Looking at finished spans in tests: accessors, a tree view, a well-formedness check.

For the spans a mode emitted (``CommCapture.spans``, an in-memory exporter's
``get_finished_spans()``):

- :func:`span_fqn`, :func:`span_phase`, :func:`span_counts` and
  :func:`collective_events` read commspan's attributes and events of one span;
- :class:`SpanTree` indexes spans by trace and id: parents, ancestors,
  children, module spans and rank spans;
- :func:`assert_well_formed` checks the rules every trace commspan writes
  follows (docs/design.md, "Traces, spans and events").

Example:
    >>> import torch
    >>> from commspan.testing import assert_well_formed, capture, span_phase
    >>> with capture() as cap:
    ...     torch.nn.Linear(2, 2)(torch.ones(1, 2, requires_grad=True)).sum().backward()
    >>> assert_well_formed(cap.spans)
    >>> sorted({span_phase(s) for s in cap.spans if span_phase(s)})
    ['backward', 'forward']
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan

from commspan import semconv

__all__ = [
    "SpanTree",
    "assert_well_formed",
    "collective_events",
    "span_counts",
    "span_fqn",
    "span_phase",
]

_ROOTS = (semconv.SPAN_STEP, semconv.SPAN_SESSION)
_PHASES = tuple(p.value for p in semconv.Phase)


def span_fqn(span: ReadableSpan) -> str | None:
    """The span's module name (``Global`` for a rank span, ``None`` for trace roots)."""
    value = (span.attributes or {}).get(semconv.MODULE_FQN)
    return None if value is None else str(value)


def span_phase(span: ReadableSpan) -> str | None:
    """The span's phase, ``None`` for trace roots and rank spans."""
    value = (span.attributes or {}).get(semconv.PHASE)
    return None if value is None else str(value)


def span_counts(span: ReadableSpan) -> dict[tuple[str, str], int]:
    """``{(phase, op): n}`` from the span's count attributes (its subtree's collectives)."""
    out: dict[tuple[str, str], int] = {}
    for key, value in (span.attributes or {}).items():
        parsed = semconv.parse_count_key(key)
        if parsed is not None:
            out[parsed] = int(value)  # type: ignore[arg-type]
    return out


def collective_events(span: ReadableSpan) -> list[Event]:
    """The events of ``span`` that record a collective, in order."""
    return [e for e in span.events if semconv.COLL_OP in (e.attributes or {})]


def _sdk_spans(spans: Iterable[ReadableSpan], where: str) -> list[ReadableSpan]:
    """``spans`` as a list, refused with a TypeError (naming ``spans``, what was given and
    what to pass) unless it is an iterable of OpenTelemetry SDK spans."""
    what = ("pass the SDK spans a mode finished: `cap.spans` after a `with capture() as "
            "cap:` block, or an in-memory exporter's `get_finished_spans()`")
    if isinstance(spans, (str, bytes, ReadableSpan)) or not isinstance(spans, Iterable):
        raise TypeError(f"spans={spans!r} is not valid for {where}: it takes a list of "
                        f"spans, not a {type(spans).__name__}; {what}")
    out = list(spans)
    for i, span in enumerate(out):
        if not isinstance(span, ReadableSpan):
            read_back = (" (a span read back from a JSONL file, which this check does not "
                         "take)" if type(span).__name__ == "SpanRecord" else "")
            raise TypeError(f"spans[{i}] is a {type(span).__name__}{read_back}, not the "
                            f"OpenTelemetry ReadableSpan {where} takes; {what}")
    return out


def _key(span: ReadableSpan) -> tuple[int, int]:
    return span.context.trace_id, span.context.span_id


class SpanTree:
    """Finished spans indexed by ``(trace id, span id)``.

    Args:
        spans: the SDK spans (``ReadableSpan``), in any order.

    Raises:
        TypeError: ``spans`` is not an iterable of ``ReadableSpan`` (e.g. the
            ``SpanRecord`` objects ``read_spans`` returns).

    Attributes:
        spans: the spans, as given.
        by_id: ``{(trace id, span id): span}``.
        children: ``{(trace id, span id): [child spans]}``.
    """

    def __init__(self, spans: Iterable[ReadableSpan]) -> None:
        self.spans = _sdk_spans(spans, "SpanTree")
        self.by_id = {_key(s): s for s in self.spans}
        self.children: dict[tuple[int, int], list[ReadableSpan]] = defaultdict(list)
        for s in self.spans:
            if s.parent is not None:
                self.children[(s.context.trace_id, s.parent.span_id)].append(s)

    def parent(self, span: ReadableSpan) -> ReadableSpan | None:
        """The parent span; ``None`` for a trace root, and for the rank span of a
        rank other than 0 (its parent, the step's root, is rank 0's to write).

        Raises:
            KeyError: the parent is not among the spans.
        """
        if span.parent is None:
            return None
        parent = self.by_id.get((span.context.trace_id, span.parent.span_id))
        if parent is None:
            if _root_elsewhere(span):
                return None
            raise KeyError((span.context.trace_id, span.parent.span_id))
        return parent

    def ancestors(self, span: ReadableSpan) -> Iterator[ReadableSpan]:
        """Parent, grandparent, ... up to the trace root."""
        cur = self.parent(span)
        while cur is not None:
            yield cur
            cur = self.parent(cur)

    def module_spans(self) -> list[ReadableSpan]:
        """Spans of module calls (every span but trace roots and rank spans)."""
        return [s for s in self.spans if span_phase(s) in _PHASES]

    def rank_spans(self) -> list[ReadableSpan]:
        """The ``commspan.rank`` spans (one per trace and rank)."""
        return [s for s in self.spans if s.name == semconv.SPAN_RANK]


def _root_elsewhere(span: ReadableSpan) -> bool:
    """``span`` is the rank span of a rank other than 0, whose parent, the step's (or
    session's) root, rank 0 writes: its parent is not among one process's spans."""
    return span.name == semconv.SPAN_RANK and (span.attributes or {}).get(
        semconv.RANK, 0) != 0


def _fail(rule: str, span: ReadableSpan, *more: str) -> None:
    """A broken rule: the rule, the span and what else the message needs."""
    raise AssertionError(f"{rule}: {span.name!r}" + "".join(f"; {m}" for m in more))


def _times(span: ReadableSpan) -> tuple[int, int]:
    if span.start_time is None or span.end_time is None:
        _fail("every span has ended (is the mode still entered? read the spans after "
              "the `with` block)", span)
    return span.start_time, span.end_time  # type: ignore[return-value]


def assert_well_formed(spans: Iterable[ReadableSpan]) -> None:
    """Assert the rules every trace commspan writes follows.

    - there are spans: an empty list is refused (an exporter that never flushed,
      a mode still entered);
    - ids are unique; each trace has one root, a ``commspan.step`` or
      ``commspan.session`` span, and every other span's parent is a span of
      the same trace (on a rank other than 0, whose rank spans hang under a
      root rank 0 writes, the rank spans stand for the root);
    - a span starts before it ends, inside its parent's interval (but the rank
      spans of a step number used again: its root is written at the end of its
      first use), and its events happen while it is open;
    - a module span is named ``"<fqn> <phase>"``; a forward span nests under a
      forward span or the rank span, a backward span under a backward span or
      the rank span (or under a forward span that ran the backward itself,
      ``torch.autograd.grad`` in a forward, when the running module is neither
      the backward's module nor one enclosing it), a recompute span under a
      backward or recompute span with a backward span above it;
    - a collective event carries the module and phase of the span it is on,
      but one a checkpointed function re-runs outside every recomputed module
      (in the backward span that needed its activations) is ``recompute``.

    The checks are explicit (``python -O`` keeps them).

    It checks the OpenTelemetry SDK spans (``ReadableSpan``) of one process: a
    capture's (``cap.spans`` after a ``with capture() as cap:`` block; not
    ``commspan_capture.spans`` inside the test, whose traces end with the test) or
    an in-memory exporter's ``get_finished_spans()``. The ``SpanRecord`` objects
    :func:`commspan.exporters.read_spans` returns are not taken (the files of
    other ranks hold rank spans whose step root only rank 0 writes).

    Args:
        spans: every span of the traces to check (a trace's root included).

    Raises:
        AssertionError: a rule is broken; the message names the rule and the span.
        TypeError: ``spans`` is not an iterable of ``ReadableSpan``.
    """
    tree = SpanTree(_sdk_spans(spans, "assert_well_formed"))
    if not tree.spans:
        raise AssertionError("no spans to check: read them after the mode's `with` block "
                             "has ended (and its exporters flushed)")
    if len(tree.by_id) != len(tree.spans):
        seen: Counter[tuple[int, int]] = Counter(
            (s.context.trace_id, s.context.span_id) for s in tree.spans)
        twice = [s for s in tree.spans if seen[(s.context.trace_id, s.context.span_id)] > 1]
        _fail("span ids are unique (a span exported twice?)", twice[0])
    uses: Counter[tuple[int, Any]] = Counter(  # a step number used again: 2 per rank
        (s.context.trace_id, (s.attributes or {}).get(semconv.RANK))
        for s in tree.spans if s.name == semconv.SPAN_RANK)
    roots: Counter[int] = Counter()
    remote_roots: set[int] = set()  # traces whose root another rank writes
    for span in tree.spans:
        start, end = _times(span)
        if start > end:
            _fail("a span starts before it ends", span, f"start {start}, end {end}")
        for event in span.events:
            if not start <= event.timestamp <= end:
                _fail("events happen while their span is open", span,
                      f"event {event.name!r} at {event.timestamp}, span {start}-{end}")
        if span.parent is None:
            if span.name not in _ROOTS:
                _fail("a trace's root is a step or session span", span)
            roots[span.context.trace_id] += 1
            continue
        parent = tree.by_id.get((span.context.trace_id, span.parent.span_id))
        if parent is None:
            if _root_elsewhere(span):  # another process's span
                remote_roots.add(span.context.trace_id)
                continue
            _fail("every span's parent is a span of its trace (parent missing: not "
                  "exported, or the mode not left yet)", span)
            continue
        parent_start, parent_end = _times(parent)
        if span.name == semconv.SPAN_RANK and uses[(span.context.trace_id, (
                span.attributes or {}).get(semconv.RANK))] > 1:
            continue  # a later use of the step number, after its root was written
        if not (parent_start <= start and end <= parent_end):
            _fail("a span lies inside its parent's interval", span,
                  f"parent {parent.name!r} {parent_start}-{parent_end}, span {start}-{end}")
    for trace_id in {s.context.trace_id for s in tree.spans} - set(roots) - remote_roots:
        _fail("every trace has its root", next(
            s for s in tree.spans if s.context.trace_id == trace_id))
    for trace_id, n in roots.items():
        if n != 1:
            _fail(f"a trace has one root (this one has {n})", next(
                s for s in tree.spans if s.context.trace_id == trace_id and s.parent is None))
    for span in tree.module_spans():
        _check_module_span(tree, span)


def _check_module_span(tree: SpanTree, span: ReadableSpan) -> None:
    phase, fqn = span_phase(span), span_fqn(span)
    if span.name != f"{fqn} {phase}":
        _fail("a module span is named '<fqn> <phase>'", span, f"fqn {fqn!r}, phase {phase!r}")
    parent = tree.parent(span)
    if parent is None:
        _fail("every module span has a parent", span)
        return
    parent_phase = span_phase(parent)
    under = f"under {parent.name!r}"
    if parent_phase is None:  # directly under the rank span
        if parent.name != semconv.SPAN_RANK:
            _fail("a top-level module span is under the rank span", span, under)
        if phase not in ("forward", "backward"):
            _fail("a span under the rank span is a forward or backward", span)
    elif phase == "backward" and parent_phase == "forward":
        # a backward run inside a forward: of modules that ran before it, never the
        # running module or one enclosing it (their backward comes later)
        running = str(span_fqn(parent))
        if running == fqn or running.startswith(f"{fqn}."):
            _fail("a backward inside a forward is not of the running module or one "
                  "enclosing it", span, under)
    elif phase in ("forward", "backward"):
        if parent_phase != phase:
            _fail(f"a {phase} span nests under a {phase} span", span, under)
    else:  # recompute: inside a backward, possibly under an enclosing recompute
        if parent_phase not in ("backward", "recompute"):
            _fail("a recompute span nests under a backward or recompute span", span, under)
        ancestor: Any = parent
        while span_phase(ancestor) == "recompute":
            ancestor = tree.parent(ancestor)
        if span_phase(ancestor) != "backward":
            _fail("a recompute has a backward span above it", span,
                  f"under {getattr(ancestor, 'name', None)!r}")
    for event in collective_events(span):
        attrs = event.attributes or {}
        served = attrs.get(semconv.PHASE)
        if (served != phase and not (served == "recompute" and phase == "backward")) or (
                attrs.get(semconv.MODULE_FQN) != fqn):
            _fail("a collective event carries its span's module and phase (or recompute "
                  "on a backward span)", span,
                  f"event {event.name!r}: {attrs.get(semconv.MODULE_FQN)!r} "
                  f"{attrs.get(semconv.PHASE)!r}")
