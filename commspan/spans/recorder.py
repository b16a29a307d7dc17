"""Plain records of open spans, turned into OpenTelemetry spans when they close.

The capture layer (module hooks, dispatch mode) calls :class:`SpanRecorder`
with cheap operations: open a frame, attach an event, close a frame. Nothing
here touches torch. When a frame closes, the recorder builds an SDK
:class:`~opentelemetry.sdk.trace.ReadableSpan` with explicit ids, parent and
timestamps, and hands it to a sink (the mode's span processors). Spans are
built this way, not through a ``Tracer``, because module spans open and close
on hooks that may run on autograd threads, where the implicit current span
does not follow, and because it keeps the hot path to a list append.

The recorder keeps the tree well formed: a frame's parent is the frame below
it on the stack, and closing a frame first closes every frame opened above it.
It also opens the trace its frames go into: the one the mode began for a step,
or, for activity outside steps, a session trace of its own
(:mod:`commspan.spans.traces`); it never calls back into the mode for that.

Readers outside the capture layer see open frames through one interface,
:meth:`SpanRecorder.open_spans` (the live aggregator uses
:meth:`SpanRecorder.live_spans`, which adds the closed frames not emitted yet).

A frame whose subtree issued collectives that have not completed yet leaves
the stack when it closes but waits, in order, in a queue of closed frames;
it is emitted, with the durations, bandwidths and roll-ups of its
collectives, once they have all completed, or at the end of its trace at
the latest (docs/design.md, "When collectives complete"). Emission takes
one lock, so a hang record written from a watchdog thread
(:meth:`SpanRecorder.emit_hang`) never interleaves with the training
thread's spans.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from commspan import semconv
from commspan._errors import describe_error, error_message
from commspan._fork import renew_after_fork
from commspan.ownership.innermost import counts_for
from commspan.semconv import Phase
from commspan.spans.frames import Frame, OpenSpan
from commspan.spans.timing import CollectiveTiming, hold_timing
from commspan.spans.traces import Trace, TraceOpener

__all__ = ["SpanRecorder", "SpanSink"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_now = time.time_ns
_tuple_new = tuple.__new__
_TRACE_ID_MAX = 2**128 - 1


def _context_parts_match() -> bool:
    """Whether a ``SpanContext`` is the tuple ``(trace_id, span_id, is_remote, flags,
    state, is_valid)``, as this OpenTelemetry's is: a frame's context is then made
    as that tuple, without ``SpanContext.__new__``'s Python frame re-checking ids
    the recorder made valid. (Another layout: the constructor, as before.)"""
    try:
        made = SpanContext(1, 2, False, _SAMPLED)
        return bool(
            _tuple_new(SpanContext, (1, 2, False, _SAMPLED, made.trace_state, True)) == made
            and made.is_valid and not SpanContext(0, 2, False, _SAMPLED).is_valid
            and len(made) == 6 and made[5] is True
        )
    except Exception:  # pragma: no cover - another OpenTelemetry
        return False


_FAST_CONTEXT = _context_parts_match()
_TRACE_STATE = SpanContext(1, 2, False, _SAMPLED).trace_state
_new = object.__new__
_INTERNAL = SpanKind.INTERNAL


def _fast_span(name: Any, context: Any, parent: Any, resource: Any, attrs: Any, events: Any,
               status: Any, start: Any, end: Any, scope: Any) -> ReadableSpan:
    """The ``ReadableSpan`` the constructor makes from these fields (``kind``
    INTERNAL, no links), its fields set directly: without the constructor's
    Python frame and keyword arguments (~40 bytecodes per span). Used only when
    :func:`_span_parts_match` found this OpenTelemetry's span laid out so."""
    span = _new(ReadableSpan)
    span.__dict__ = {
        "_name": name, "_context": context, "_kind": _INTERNAL,
        "_instrumentation_info": None, "_instrumentation_scope": scope,
        "_parent": parent, "_start_time": start, "_end_time": end,
        "_attributes": attrs, "_events": events, "_links": (), "_resource": resource,
        "_status": status,
    }
    return span


def _fast_event(name: Any, attrs: Any, timestamp: Any) -> Event:
    """``Event(name, attrs, timestamp)`` (a timestamp given), its fields set directly."""
    event = _new(Event)
    event.__dict__ = {"_name": name, "_timestamp": timestamp, "_attributes": attrs}
    return event


def _span_parts_match() -> bool:
    """Whether this OpenTelemetry's ``ReadableSpan`` and ``Event`` are what their
    constructors make of the fields :func:`_fast_span` and :func:`_fast_event` set
    (the same fields, in the same order, nothing else); else the recorder calls
    the constructors, as before."""
    try:
        parts = [object() for _ in range(9)]
        name, context, parent, resource, attrs, events, status, start, end = parts
        scope = InstrumentationScope("commspan-check", "0")
        made = ReadableSpan(name, context, parent, resource, attrs, events,  # type: ignore[arg-type]
                            kind=SpanKind.INTERNAL, status=status,  # type: ignore[arg-type]
                            start_time=start, end_time=end,  # type: ignore[arg-type]
                            instrumentation_scope=scope)
        fast = _fast_span(name, context, parent, resource, attrs, events, status, start,
                          end, scope)
        event = Event("e", attrs, 5)  # type: ignore[arg-type]
        return (
            list(vars(made).items()) == list(vars(fast).items())
            and list(vars(event).items()) == list(vars(_fast_event("e", attrs, 5)).items())
        )
    except Exception:  # pragma: no cover - another OpenTelemetry
        return False


_FAST_SPAN = _span_parts_match()


SpanSink = Callable[[ReadableSpan], None]


def _unknown() -> bool:
    return False


class SpanRecorder:
    """Stack of open frames for one trace at a time; emits spans as frames close.

    Args:
        sink: called with each finished span (child spans before parents).
        resource: resource of every span.
        version: commspan version, recorded on the instrumentation scope.
        record_messages: put ``str(exception)`` in status descriptions and
            ``exception`` events; ``False`` keeps the exception type only.
    """

    def __init__(
        self,
        sink: SpanSink,
        resource: Resource,
        version: str,
        record_messages: bool = True,
        traces: TraceOpener | None = None,
    ) -> None:
        self._sink = sink
        self.record_messages = record_messages
        self.resource = resource
        self._scope = InstrumentationScope(
            semconv.INSTRUMENTATION_SCOPE, version, semconv.SCHEMA_URL
        )
        self._rng = random.Random(os.urandom(16))
        self._traces = traces
        self.stack: list[Frame] = []
        self.trace_id = 0
        self._trace_valid = False  # whether trace_id is a valid OpenTelemetry trace id
        self.trace: Trace | None = None
        self.root: Frame | None = None
        self.last_trace: Trace | None = None
        self._closed: deque[Frame] = deque()  # closed, waiting for completions
        self._emit_lock = threading.Lock()
        renew_after_fork(self, "_emit_lock")  # a watchdog's hang record may hold it
        self.forced = 0
        """Collectives emitted without a completion (their trace ended first)."""
        self.before_root: Callable[[Frame], None] | None = None
        """Called with the rank frame of a trace just before it is built (it may add
        events and move its end later); must not raise."""
        self.settled: Callable[[], bool] = _unknown
        """Asked before a span waits for its collectives one by one: ``True`` when
        every collective recorded so far has completed (the dispatch mode's
        :meth:`~commspan.capture.completion.CompletionTracker.settled`)."""

    # ------------------------------------------------------------ traces
    def begin(self, trace: Trace) -> Frame:
        """Open ``trace``: its ``commspan.rank`` frame becomes the root of the stack.

        A trace still open is ended first.
        """
        if self.root is not None:
            self.end()
        self.trace = self.last_trace = trace
        self.trace_id = trace_id = trace.trace_id
        self._trace_valid = 0 < trace_id <= _TRACE_ID_MAX
        span_id = self._new_id()
        root = Frame(
            span_id,
            SpanContext(trace_id, span_id, False, _SAMPLED),
            semconv.GLOBAL_FQN,
            None,
            semconv.SPAN_RANK,
            trace.rank_attributes,
            SpanContext(trace_id, trace.root_span_id, False, _SAMPLED),
        )
        self.root = root
        self.stack = [root]
        return root

    def ensure_trace(self) -> None:
        """Open a session trace if no trace is open (activity outside any step).

        Without a :class:`TraceOpener` the recorder records nothing outside a
        trace someone began.
        """
        if self.root is None and self._traces is not None:
            self.begin(self._traces.session())

    def end(self, error: BaseException | None = None) -> None:
        """End the open trace: close every open frame and the rank frame (with
        ERROR status if ``error``); on rank 0, then emit the cross-rank root."""
        if self.root is None:
            return
        desc = self.describe(error)
        if desc is not None:
            self.root.error = desc
        self._close_from(0, desc, _now())
        self.root = None
        self.stack = []
        trace, self.trace = self.trace, None
        if self._closed:
            if not self._closed[-1].ready():
                time.sleep(0)  # let completion callbacks waiting for the GIL run
            self.emit_closed(force=True)
        if trace is not None and trace.writes_root:
            with self._emit_lock:
                self._emit_trace_root(trace, desc)

    def _emit_trace_root(self, trace: Trace, error: str | None) -> None:
        """The cross-rank root: a span that was never on the stack."""
        self._sink(
            ReadableSpan(
                trace.name,
                SpanContext(trace.trace_id, trace.root_span_id, False, _SAMPLED),
                None,
                self.resource,
                trace.root_attributes,
                (),
                kind=SpanKind.INTERNAL,
                status=_status(error),
                start_time=trace.start,
                end_time=_now(),
                instrumentation_scope=self._scope,
            )
        )

    # ------------------------------------------------------------ open frames
    def open_spans(self) -> tuple[OpenSpan, ...]:
        """Copies of the open frames, outermost (the rank frame) first.

        The one view of spans in progress that readers outside the capture
        layer get: the live :class:`~commspan.Aggregator` adds their counts to
        those of the spans that have ended. Safe to call from any thread; the
        copies do not change afterwards.
        """
        return tuple(
            OpenSpan(f.fqn, dict(f.attrs), dict(f.counts), f.finished, dict(f.credits or {}),
                     _event_copies(f), f.start)
            for f in list(self.stack)
        )

    def live_spans(self) -> tuple[OpenSpan, ...]:
        """:meth:`open_spans`, preceded by the frames that closed but wait for their
        collectives to complete before they are emitted (``finished`` is ``True``
        for those): every span of the trace not handed to the sink yet."""
        waiting = tuple(
            OpenSpan(f.fqn, dict(f.attrs), dict(f.counts), True, dict(f.credits or {}),
                     _event_copies(f), f.start)
            for f in list(self._closed)
        )
        return waiting + self.open_spans()

    # ------------------------------------------------------------ module frames
    def push(
        self,
        fqn: str,
        phase: Phase,
        attrs: dict[str, Any],
        task: int = -1,
        under: Frame | None = None,
        name: str | None = None,
    ) -> Frame:
        """Open a module frame on top of the stack.

        Args:
            under: if given, first close every frame above it, so the new frame
                becomes its child (used when backward nesting is inferred).
        """
        stack = self.stack
        if not stack:
            self.ensure_trace()
            stack = self.stack
        if under is not None and not under.closed:
            idx = _index(stack, under)
            if idx >= 0 and idx + 1 < len(stack):
                self._close_from(idx + 1, None, _now())
        parent = stack[-1] if stack else None
        span_id = self._rng.getrandbits(64) or 1  # (_new_id, inline)
        frame = Frame(
            span_id,
            # (span_id is valid: the context is valid when the trace id is)
            _tuple_new(SpanContext, (self.trace_id, span_id, False, _SAMPLED, _TRACE_STATE,
                                     self._trace_valid))
            if _FAST_CONTEXT else SpanContext(self.trace_id, span_id, False, _SAMPLED),
            fqn,
            phase,
            name or semconv.module_span_name(fqn, phase),
            attrs,
            parent.context if parent is not None else None,
            task,
        )
        stack.append(frame)
        return frame

    def finish(self, frame: Frame, error: BaseException | None = None) -> None:
        """The capture layer is done with ``frame``: close it now if it is on
        top, else mark it ``finished`` and close it once the frames above it
        have closed (docs/design.md, "How backward nesting is inferred", step 3)."""
        if frame.closed:
            return
        if error is not None and frame.error is None:
            frame.error = self.describe(error)
        stack = self.stack
        if stack and stack[-1] is frame:
            self._close_top(_now())
            while len(stack) > 1 and stack[-1].finished:
                self._close_top(_now())
        else:
            frame.finished = True

    def close_now(self, frame: Frame, error: BaseException | None = None) -> None:
        """Close ``frame`` and everything above it immediately.

        With ``error``, the frames above ``frame`` (their calls never finished:
        the error crossed them) end with it too.
        """
        if frame.closed:
            return
        stack = self.stack
        if stack and stack[-1] is frame:  # the usual case: nothing above it
            if error is not None and frame.error is None:
                frame.error = self.describe(error)
            self._close_top(_now())
            return
        idx = _index(stack, frame)
        if idx < 0:
            return
        self._close_from(idx, self.describe(error), _now())

    def close_task(self, task: int, error: str | None = None) -> None:
        """Close every frame opened for autograd graph task ``task`` (end of backward).

        Args:
            error: status description for the frames closed, if the task failed.
        """
        stack = self.stack
        for idx in range(1, len(stack)):
            if stack[idx].task == task:
                self._close_from(idx, error, _now())
                return

    @property
    def top(self) -> Frame | None:
        return self.stack[-1] if self.stack else None

    # ------------------------------------------------------------ events
    def add_event(
        self,
        name: str,
        op: str,
        phase: str,
        attrs: dict[str, Any],
        counted: tuple[str, ...] = (),
        timing: CollectiveTiming | None = None,
    ) -> None:
        """Attach a collective event to the innermost frame and count it up the chain.

        The event's record on the frame is ``timing`` when the collective is
        timed (its span then waits for the completion), else a record made here.

        The event stays on the innermost frame (where it was issued) whoever
        owns it. It counts once per module name (at its innermost frame):

        - owned by the innermost frame (``counted`` empty): for the frames
          :func:`commspan.ownership.innermost.counts_for` names: the root,
          every frame of the same phase, and a frame of another phase (a
          backward frame around a recompute) only when its module encloses the
          event's module by name;
        - owned by another module (``counted``: the owner and the modules
          enclosing it by name, :func:`commspan.ownership.counted_names`): for
          the root and the open frames of those modules, in any phase. Those of
          them with no open frame are named in the event's
          ``commspan.owner.credit_fqns``, and readers add the event to their
          counts (:class:`~commspan.spans.OpenSpan` ``credits`` while open).

        Its bytes and ``timing`` (whose duration is known later) roll up to the
        frames that count it.
        """
        stack = self.stack
        if not stack:
            self.ensure_trace()
            stack = self.stack
            if not stack:
                return
        top = stack[-1]
        if timing is not None:
            record = timing
        else:  # not timed: nobody waits for it, no hang record lists it
            record = CollectiveTiming(attrs, phase, name)
            record.abandoned = True
        record.wall = _now()
        top.events.append(record)
        top.self_count += 1
        nbytes = attrs.get(semconv.TENSOR_BYTES)
        key = (phase, op)
        if counted:
            top_counts = self._count_owned(stack, key, attrs, counted, nbytes, timing)
        else:
            top_counts = False
            owner = top.fqn
            seen: set[str] = set()
            for frame in reversed(stack):
                fqn = frame.fqn
                if fqn in seen:
                    continue
                frame_phase = frame.phase
                # the same phase always counts; another phase asks the rule (a Phase
                # is a str: it equals its value, without the Enum's property)
                if (
                    frame_phase is not None
                    and frame_phase != phase
                    and not counts_for(fqn, frame_phase, owner, phase)
                ):
                    continue
                seen.add(fqn)
                counts = frame.counts
                counts[key] = counts.get(key, 0) + 1
                if nbytes or timing is not None:  # (_roll_up, inline)
                    if nbytes:
                        sizes = frame.nbytes
                        if sizes is None:
                            frame.nbytes = {phase: nbytes}
                        else:
                            sizes[phase] = sizes.get(phase, 0) + nbytes
                    if timing is not None:
                        timings = frame.timings
                        if timings is None:
                            frame.timings = [timing]
                        else:
                            timings.append(timing)
                    top_counts = top_counts or frame is top
        if timing is not None and not top_counts:  # its span still waits for it
            if top.own is None:
                top.own = [timing]
            else:
                top.own.append(timing)

    @staticmethod
    def _count_owned(
        stack: list[Frame],
        key: tuple[str, str],
        attrs: dict[str, Any],
        counted: tuple[str, ...],
        nbytes: Any = None,
        timing: CollectiveTiming | None = None,
    ) -> bool:
        """Count an event for the root and the open frames of the modules in
        ``counted``; credit the others on the event (and, while open, its frame).
        Returns whether the innermost frame counts it."""
        seen: set[str] = set()
        top = stack[-1]
        top_counts = False
        for frame in reversed(stack):
            fqn = frame.fqn
            if frame.phase is not None and (fqn in seen or fqn not in counted):
                continue
            seen.add(fqn)
            counts = frame.counts
            counts[key] = counts.get(key, 0) + 1
            if nbytes or timing is not None:
                _roll_up(frame, key[0], nbytes, timing)
            top_counts = top_counts or frame is top
        missing = [fqn for fqn in counted if fqn not in seen]
        if missing:
            attrs[semconv.OWNER_CREDIT] = missing
            top = stack[-1]
            credits = top.credits
            if credits is None:
                credits = top.credits = {}
            for fqn in missing:
                slot = (fqn, *key)
                credits[slot] = credits.get(slot, 0) + 1
        return top_counts

    def add_plain_event(
        self, frame: Frame, name: str, attrs: dict[str, Any], at: int | None = None
    ) -> None:
        """Attach a non-collective event to ``frame``, timestamped ``at`` (ns since the
        epoch; default now)."""
        frame.events.append((name, _now() if at is None else at, attrs))

    def add_exception(self, frame: Frame, error: BaseException) -> None:
        """Attach an ``exception`` event for ``error`` to ``frame`` (its message
        only if :attr:`record_messages`)."""
        attrs: dict[str, Any] = {semconv.EXCEPTION_TYPE: type(error).__qualname__}
        if self.record_messages:
            attrs[semconv.EXCEPTION_MESSAGE] = error_message(error)
        frame.events.append((semconv.EVENT_EXCEPTION, _now(), attrs))

    def describe(self, error: BaseException | None) -> str | None:
        """Status description of a span ``error`` crossed (see :func:`describe_error`)."""
        return describe_error(error, self.record_messages)

    # ------------------------------------------------------------ internals
    def _new_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def _close_from(self, idx: int, error: str | None, now: int) -> None:
        stack = self.stack
        while len(stack) > idx:
            if error is not None and stack[-1].error is None:
                stack[-1].error = error
            self._close_top(now)

    def _close_top(self, now: int) -> None:
        frame = self.stack[-1]
        frame.end = max(now, frame.start)
        if frame is self.root and self.before_root is not None:
            self.before_root(frame)
        if not self._closed and (
            (frame.timings is None and frame.own is None) or self.settled() or frame.ready()
        ):
            # the span is built before the frame leaves the stack: if building
            # fails, the frame stays open and a later close emits it
            span = self._build(frame)
            self.stack.pop()
            frame.closed = True
            with self._emit_lock:
                self._sink(span)
            return
        self.stack.pop()
        frame.closed = True
        self._closed.append(frame)
        self.emit_closed()

    def emit_closed(
        self, force: bool = False, timeout_s: float = -1, *, abandon: bool = True
    ) -> bool:
        """Emit the closed frames whose collectives have all completed, in the order
        they closed (children before parents); with ``force``, all of them (their
        collectives not completed go out without a duration, counted in :attr:`forced`).

        Args:
            force: emit every closed frame now.
            timeout_s: how long to wait for the emission lock (``-1``: as long as
                it takes); a hang record written from another thread bounds it.
            abandon: with ``force``, stop waiting for the collectives emitted without
                a completion (the end of a trace); ``False`` keeps them in hang
                records (a hang record emits what waits, but the collectives may
                still be stuck).

        Returns:
            ``False`` if the lock could not be had in time.
        """
        closed = self._closed
        if not closed:
            return True
        if not self._emit_lock.acquire(timeout=timeout_s):
            return False
        try:
            settled = force or self.settled()
            while closed:
                head = closed[0]
                if not settled and not head.ready():
                    break
                closed.popleft()  # first: a frame that cannot be built is not retried forever
                if force:
                    for timing in head.events:
                        if (
                            type(timing) is CollectiveTiming
                            and not timing.abandoned
                            and not timing.finished()
                        ):
                            if abandon:
                                timing.abandon()
                            self.forced += 1
                self._sink(self._build(head))
        finally:
            self._emit_lock.release()
        return True

    def _build(self, frame: Frame) -> ReadableSpan:
        attrs = frame.attrs
        if frame.counts:
            totals: dict[str, int] = {}
            for (phase, op), n in frame.counts.items():
                attrs[semconv.count_key(phase, op)] = n
                totals[phase] = totals.get(phase, 0) + n
            for phase, n in totals.items():
                key = _TOTAL_KEYS.get(phase)
                if key is None:
                    key = f"{semconv.COUNT_PREFIX}{phase}.{semconv.COUNT_TOTAL}"
                attrs[key] = n
        if frame.self_count:
            attrs[semconv.SELF_COUNT] = frame.self_count
        if frame.nbytes:
            for phase, n in frame.nbytes.items():
                attrs[semconv.bytes_key(phase)] = n
        if not _FAST_SPAN:
            return self._build_slowly(frame, attrs)
        # _fast_span and _fast_event, inline (a frame less per span and per event)
        events: Iterable[Event] = ()
        if frame.events:
            made = []
            for e in frame.events:  # (a loop: a generator is a frame of its own)
                event = _new(Event)
                if isinstance(e, CollectiveTiming):
                    event.__dict__ = {"_name": e.name, "_timestamp": e.wall, "_attributes": e.attrs}
                else:
                    event.__dict__ = {"_name": e[0], "_timestamp": e[1], "_attributes": e[2]}
                made.append(event)
            events = tuple(made)
        error = frame.error
        span = _new(ReadableSpan)
        span.__dict__ = {
            "_name": frame.name, "_context": frame.context, "_kind": _INTERNAL,
            "_instrumentation_info": None, "_instrumentation_scope": self._scope,
            "_parent": frame.parent, "_start_time": frame.start, "_end_time": frame.end,
            "_attributes": attrs, "_events": events, "_links": (), "_resource": self.resource,
            "_status": _UNSET if error is None else _status(error),
        }
        if frame.timings is not None or frame.events:
            # durations, bandwidths and comm-time roll-ups are written off the
            # training thread, before the span is exported (add_timing)
            hold_timing(span, frame.timings, frame.events)
        return span

    def _build_slowly(self, frame: Frame, attrs: dict[str, Any]) -> ReadableSpan:
        """:meth:`_build`'s span and events made by their constructors (another
        OpenTelemetry than :func:`_span_parts_match` knows)."""
        events: Iterable[Event] = (
            tuple(
                Event(e.name, e.attrs, e.wall) if isinstance(e, CollectiveTiming)
                else Event(e[0], e[2], e[1])
                for e in frame.events
            )
            if frame.events
            else ()
        )
        span = ReadableSpan(
            frame.name,
            frame.context,
            frame.parent,
            self.resource,
            attrs,
            events,  # type: ignore[arg-type]
            kind=SpanKind.INTERNAL,
            status=_status(frame.error),
            start_time=frame.start,
            end_time=frame.end,
            instrumentation_scope=self._scope,
        )
        if frame.timings is not None or frame.events:
            # durations, bandwidths and comm-time roll-ups are written off the
            # training thread, before the span is exported (add_timing)
            hold_timing(span, frame.timings, frame.events)
        return span

    # ------------------------------------------------------------ hang records
    def hang_span(
        self,
        reason: str,
        collectives: Sequence[CollectiveTiming],
        timeout_s: float | None = None,
        untraced_step: int | None = None,
    ) -> ReadableSpan:
        """A ``commspan.hang`` span: what this rank is doing now.

        Safe to call from any thread: it reads copies of the stack.

        Args:
            reason: ``timeout``, ``dump`` or ``signal``.
            collectives: the rank's recent collectives (a
                :meth:`~commspan.spans.timing.CollectiveLog.snapshot`).
            timeout_s: the hang timeout in force, recorded for reason ``timeout``.
            untraced_step: the step in progress, when ``sample=`` leaves it out: the
                record goes in that step's trace, with its number, and says the step
                is not traced (``commspan.hang.step_traced`` false); without it, it
                would claim the last traced step.
        """
        now = _now()
        stack = list(self.stack)
        attrs: dict[str, Any] = {}
        if untraced_step is not None and self._traces is not None:
            trace: Trace | None = self._traces.step_trace(untraced_step)
            attrs[semconv.HANG_STEP_TRACED] = False
        else:
            trace = self.trace or self.last_trace
        if trace is not None:
            trace_id = trace.trace_id
            parent = (
                stack[0].context
                if stack and stack[0].phase is None
                else SpanContext(trace_id, trace.root_span_id, False, _SAMPLED)
            )
            for key in (semconv.RANK, semconv.WORLD_SIZE, semconv.RUN_ID, semconv.STEP):
                if key in trace.rank_attributes:
                    attrs[key] = trace.rank_attributes[key]
        else:
            trace_id = self._rng.getrandbits(128) or 1
            parent = None
            if self._traces is not None:
                attrs[semconv.RANK] = self._traces.rank
                attrs[semconv.WORLD_SIZE] = self._traces.world_size
                attrs[semconv.RUN_ID] = self._traces.run_id
        modules = [f for f in stack if f.phase is not None]
        attrs[semconv.HANG_REASON] = reason
        if reason == semconv.HANG_REASON_TIMEOUT and timeout_s is not None:
            attrs[semconv.HANG_TIMEOUT] = float(timeout_s)
        attrs[semconv.HANG_STACK_FQNS] = [f.fqn for f in modules]
        attrs[semconv.HANG_STACK_PHASES] = [f.phase.value for f in modules if f.phase]
        events = []
        start = now
        for timing in collectives:
            ev = timing.hang_attributes()
            wall = timing.wall or now
            if ev[semconv.COLL_STATE] == semconv.STATE_ISSUED:
                start = min(start, wall)
            events.append(Event(str(ev.get(semconv.COLL_OP, "collective")), ev, wall))
        span_id = self._new_id()
        return ReadableSpan(
            semconv.SPAN_HANG,
            SpanContext(trace_id, span_id, False, _SAMPLED),
            parent,
            self.resource,
            attrs,
            tuple(events),  # type: ignore[arg-type]
            kind=SpanKind.INTERNAL,
            status=_UNSET,
            start_time=start,
            end_time=max(now, start),
            instrumentation_scope=self._scope,
        )

    def emit_hang(
        self, span: ReadableSpan, timeout_s: float = 2.0, *, emit_waiting: bool = True
    ) -> None:
        """Hand a hang record to the sink, after every closed frame still waiting
        (so what closed before the hang is written too, should the job be killed);
        with ``emit_waiting`` false (a dump asked for on a run that may be healthy),
        after those that are ready only: the others wait for their completions,
        and keep the durations.

        If the emission lock is not free within ``timeout_s`` (the training
        thread is stuck inside a span processor), the record is handed over anyway.
        """
        emitted = self.emit_closed(force=emit_waiting, timeout_s=timeout_s, abandon=False)
        if emitted and self._emit_lock.acquire(timeout=timeout_s):
            try:
                self._sink(span)
            finally:
                self._emit_lock.release()
        else:
            self._sink(span)


_TOTAL_KEYS = {p.value: f"{semconv.COUNT_PREFIX}{p.value}.{semconv.COUNT_TOTAL}"
               for p in Phase}


def _roll_up(frame: Frame, phase: str, nbytes: Any, timing: CollectiveTiming | None) -> None:
    """Add a collective's bytes and timing to a frame that counts it."""
    if nbytes:
        sizes = frame.nbytes
        if sizes is None:
            frame.nbytes = {phase: nbytes}
        else:
            sizes[phase] = sizes.get(phase, 0) + nbytes
    if timing is not None:
        timings = frame.timings
        if timings is None:
            frame.timings = [timing]
        else:
            timings.append(timing)


def _status(desc: str | None) -> Status:
    if desc is None:
        return _UNSET
    return Status(StatusCode.ERROR, desc)


def _index(stack: list[Frame], frame: Frame) -> int:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is frame:
            return i
    return -1


def _event_copies(frame: Frame) -> tuple[tuple[str, dict[str, Any]], ...]:
    """``(name, attributes)`` copies of a frame's events, for :class:`OpenSpan`."""
    return tuple(
        (e.name, dict(e.attrs)) if isinstance(e, CollectiveTiming) else (e[0], dict(e[2]))
        for e in list(frame.events)
    )
