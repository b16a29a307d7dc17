"""Build synthetic span records, as ``read_spans`` yields them, for the analysis tests.

A :class:`SpanBuilder` holds a run; ``b.rank(r, step)`` gives one rank's step,
to which collectives (events on a module span named after their module) and
module spans are added. Sequence numbers count per rank and group across
steps, as commspan's do; each rank has its own clock (1 µs per collective).

    b = SpanBuilder(world=4)
    for step in range(2):
        for r in range(4):
            s = b.rank(r, step)
            s.coll("all_reduce", fqn="Net.blocks.0")
    spans = b.spans()
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from commspan import semconv
from commspan.exporters import SpanRecord

WORLD_GROUP = "0"


def trace_of(step: int | None, session: int = 0) -> str:
    """The trace id of a step (all ranks share it), or of a session outside steps."""
    return f"{step + 1:032x}" if step is not None else f"{0xFFFF0000 + session:032x}"


@dataclass
class _Span:
    name: str
    trace_id: str
    span_id: str
    parent: str
    start: int
    end: int
    attrs: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    times: list[int] = field(default_factory=list)
    status: tuple[int, str] = (0, "")  # (OTLP status code, message)


class RankStepBuilder:
    """One rank's spans for one step."""

    def __init__(
        self, b: SpanBuilder, rank: int, step: int | None, trace_id: str, finished: bool = True
    ) -> None:
        self.b = b
        self.rank = rank
        self.step = step
        self.trace_id = trace_id
        start = b.clock[rank]
        attrs: dict[str, Any] = {
            semconv.MODULE_FQN: semconv.GLOBAL_FQN,
            semconv.RANK: rank,
            semconv.WORLD_SIZE: b.world,
        }
        if step is not None:
            attrs[semconv.STEP] = step
        self.root = _Span(semconv.SPAN_RANK, trace_id, b.new_id(), "", start, start, attrs)
        if finished:  # an unfinished step's rank span is never written
            b.add(rank, self.root)
        self._modules: dict[tuple[str, str], _Span] = {}

    def _tick(self, ns: int = 1000) -> int:
        self.b.clock[self.rank] += ns
        now = self.b.clock[self.rank]
        self.root.end = max(self.root.end, now + 1)
        return now

    def module(
        self, fqn: str, phase: str = "forward", *, start: int, end: int, parent: str | None = None
    ) -> str:
        """Add a module span with explicit times (ns); returns its span id."""
        span = _Span(
            semconv.module_span_name(fqn, semconv.Phase(phase)),
            self.trace_id,
            self.b.new_id(),
            parent if parent is not None else self.root.span_id,
            start,
            end,
            {semconv.MODULE_FQN: fqn, semconv.PHASE: phase},
        )
        self.b.add(self.rank, span)
        self.root.start = min(self.root.start, start)
        self.root.end = max(self.root.end, end)
        return span.span_id

    def raised(self, message: str, fqn: str | None = None, phase: str = "forward") -> None:
        """An exception left the step: the rank span's status ERROR with ``message``
        (``"ValueError: bad"``), its ``exception`` event on a span of module ``fqn``
        (on the rank span for ``None``), as commspan records one."""
        now = self._tick()
        kind, _, text = message.partition(": ")
        event = {semconv.EXCEPTION_TYPE: kind, semconv.EXCEPTION_MESSAGE: text}
        span = self.root
        if fqn is not None:
            span = self._module_span(fqn, phase, now)
        span.events.append((semconv.EVENT_EXCEPTION, event))
        span.times.append(now)
        self.root.status = (2, message)

    def _module_span(self, fqn: str, phase: str, t: int) -> _Span:
        """The rank's span of module ``fqn`` in ``phase`` this step (made at ``t``)."""
        key = (fqn, phase)
        span = self._modules.get(key)
        if span is None:
            span = _Span(
                semconv.module_span_name(fqn, semconv.Phase(phase)),
                self.trace_id,
                self.b.new_id(),
                self.root.span_id,
                t,
                t,
                {semconv.MODULE_FQN: fqn, semconv.PHASE: phase},
            )
            self._modules[key] = span
            self.b.add(self.rank, span)
        return span

    def set_times(self, start: int, end: int) -> None:
        """Set the rank span's start and end (ns)."""
        self.root.start, self.root.end = start, end

    def coll(
        self,
        op: str = "all_reduce",
        *,
        fqn: str = "Net",
        phase: str = "forward",
        group: str = WORLD_GROUP,
        ranks: Sequence[int] | None = None,
        shape: Sequence[int] | None = (16,),
        dtype: str | None = "float32",
        reduce_op: str | None = "sum",
        kind: str = semconv.KIND_COLLECTIVE,
        peer: int | list[int] | None = None,
        duration_ns: int | None = None,
        nbytes: int | None = None,
        wait_ns: int | None = None,
        owner: str | None = None,
    ) -> int:
        """Issue a collective on this rank: an event on the module span ``fqn``; returns its
        seq (a point-to-point op's number per peer, with ``SpanBuilder(schema=3)``).
        ``owner``: its ``commspan.owner.fqn`` (none written when not given)."""
        ranks = list(range(self.b.world)) if ranks is None else list(ranks)
        p2p_seq = None
        if kind == semconv.KIND_P2P and self.b.schema >= 3:
            key: Any = (self.rank, group, op, tuple(peer) if isinstance(peer, list) else peer)
            self.b.seq[key] += 1
            seq = p2p_seq = self.b.seq[key]
        else:
            self.b.seq[(self.rank, group)] += 1
            seq = self.b.seq[(self.rank, group)]
        attrs = self.b.event_attrs(
            op, fqn=fqn, phase=phase, group=group, ranks=ranks, shape=shape, dtype=dtype,
            reduce_op=reduce_op, kind=kind, peer=peer, seq=None if p2p_seq else seq,
            p2p_seq=p2p_seq, duration_ns=duration_ns, nbytes=nbytes, wait_ns=wait_ns,
        )
        if owner is not None:
            attrs[semconv.OWNER_FQN] = owner
        t = self._tick()
        span = self._module_span(fqn, phase, t)
        span.events.append((op, attrs))
        span.times.append(t)
        span.end = t + 500
        self.root.end = max(self.root.end, span.end + 1)
        return seq

    def gc(
        self, duration_ns: int, *, generation: int = 2, fqn: str | None = None,
        phase: str | None = None,
    ) -> tuple[int, int]:
        """A garbage-collector pause on this rank now: a ``commspan.gc`` event on the rank
        span; the clock moves past it. Returns its (start, end)."""
        start = self._tick()
        attrs: dict[str, Any] = {
            semconv.GC_GENERATION: generation,
            semconv.GC_DURATION_NS: duration_ns,
            semconv.GC_COLLECTED: 0,
        }
        if fqn is not None:
            attrs[semconv.MODULE_FQN] = fqn
            attrs[semconv.PHASE] = phase or "forward"
        self.root.events.append((semconv.EVENT_GC, attrs))
        self.root.times.append(start)
        self._tick(duration_ns)
        return start, start + duration_ns

    def skip(self, group: str = WORLD_GROUP, n: int = 1) -> None:
        """Advance the rank's sequence number as if ``n`` collectives ran untraced."""
        self.b.seq[(self.rank, group)] += n


class SpanBuilder:
    """A synthetic run of ``world`` ranks; ``schema``: 3 numbers point-to-point ops per
    peer and direction (``commspan.p2p.seq``) as commspan does now, 2 with the group's
    collectives as older files do."""

    def __init__(self, world: int = 4, schema: int = 2) -> None:
        self.world = world
        self.schema = schema
        self.clock: Counter[int] = Counter()
        self.seq: Counter[Any] = Counter()
        self._ids = itertools.count(1)
        self._spans: list[tuple[int, _Span]] = []
        self.resource_extra: dict[str, Any] = {}  # more resource attributes of every rank

    def new_id(self) -> str:
        return f"{next(self._ids):016x}"

    def add(self, rank: int, span: _Span) -> None:
        self._spans.append((rank, span))

    def rank(
        self, rank: int, step: int | None, *, session: int = 0, finished: bool = True
    ) -> RankStepBuilder:
        """Start rank ``rank``'s spans of ``step`` (``None``: a session outside steps);
        ``finished=False``: the step never ended (no rank span is written)."""
        return RankStepBuilder(self, rank, step, trace_of(step, session), finished)

    def event_attrs(
        self,
        op: str,
        *,
        fqn: str,
        phase: str,
        group: str,
        ranks: Sequence[int],
        seq: int | None,
        shape: Sequence[int] | None = (16,),
        dtype: str | None = "float32",
        reduce_op: str | None = "sum",
        kind: str = semconv.KIND_COLLECTIVE,
        peer: int | list[int] | None = None,
        duration_ns: int | None = None,
        nbytes: int | None = None,
        state: str | None = None,
        p2p_seq: int | None = None,
        wait_ns: int | None = None,
    ) -> dict[str, Any]:
        """The attributes of a collective event, as commspan writes them."""
        attrs: dict[str, Any] = {
            semconv.COLL_OP: op,
            semconv.COLL_KIND: kind,
            semconv.PG_NAME: group,
            semconv.PG_SIZE: len(ranks),
            semconv.PG_RANKS: list(ranks),
            semconv.MODULE_FQN: fqn,
            semconv.PHASE: phase,
        }
        if seq is not None:
            attrs[semconv.COLL_SEQ] = seq
        if p2p_seq is not None:
            attrs[semconv.P2P_SEQ] = p2p_seq
        if shape is not None:
            attrs[semconv.TENSOR_SHAPE] = list(shape)
        if dtype is not None:
            attrs[semconv.TENSOR_DTYPE] = dtype
        if nbytes is not None:
            attrs[semconv.TENSOR_BYTES] = nbytes
        if reduce_op is not None and kind == semconv.KIND_COLLECTIVE:
            attrs[semconv.COLL_REDUCE_OP] = reduce_op
        if peer is not None:
            attrs[semconv.COLL_PEER] = peer
        if duration_ns is not None:
            attrs[semconv.COLL_DURATION_NS] = duration_ns
        if wait_ns is not None:
            attrs[semconv.COLL_WAIT_NS] = wait_ns
        if state is not None:
            attrs[semconv.COLL_STATE] = state
        return attrs

    def hang(
        self,
        rank: int,
        step: int | None,
        *,
        stack: Sequence[tuple[str, str]],
        collectives: Sequence[dict[str, Any]],
        reason: str = semconv.HANG_REASON_TIMEOUT,
        time_ns: int | None = None,
        times: Sequence[int] | None = None,
    ) -> None:
        """Add a ``commspan.hang`` span; ``collectives`` are ``event_attrs(...)`` dicts,
        issued at ``times`` (default: 1 µs apart, just before the record)."""
        now = time_ns if time_ns is not None else self.clock[rank] + 10_000_000
        attrs: dict[str, Any] = {
            semconv.RANK: rank,
            semconv.HANG_REASON: reason,
            semconv.HANG_STACK_FQNS: [f for f, _ in stack],
            semconv.HANG_STACK_PHASES: [p for _, p in stack],
        }
        if step is not None:
            attrs[semconv.STEP] = step
        span = _Span(semconv.SPAN_HANG, trace_of(step), self.new_id(), "", now - 1, now, attrs)
        for i, c in enumerate(collectives):
            span.events.append((c[semconv.COLL_OP], c))
            span.times.append(now - 1000 * (len(collectives) - i) if times is None else times[i])
        self.add(rank, span)

    def spans(self, *, ranks: Sequence[int] | None = None) -> list[SpanRecord]:
        """The span records of the run (of ``ranks`` only, if given)."""
        out = []
        for rank, s in self._spans:
            if ranks is not None and rank not in ranks:
                continue
            out.append(
                SpanRecord(
                    name=s.name,
                    trace_id=s.trace_id,
                    span_id=s.span_id,
                    parent_span_id=s.parent,
                    start_time=s.start,
                    end_time=s.end,
                    attributes=dict(s.attrs),
                    events=list(s.events),
                    event_times=list(s.times),
                    status_code=s.status[0],
                    status_message=s.status[1],
                    rank=rank,
                    resource={semconv.RANK: rank, semconv.WORLD_SIZE: self.world,
                              **self.resource_extra},
                )
            )
        return out
