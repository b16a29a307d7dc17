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
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from commspan import semconv
from commspan.semconv import Phase

__all__ = ["Frame", "SpanRecorder", "derive_ids", "describe_error"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_now = time.time_ns


def derive_ids(run_id: str, key: str) -> tuple[int, int]:
    """Deterministic ``(trace_id, root_span_id)`` for one trace of a run.

    Every rank derives the same ids from the same run id and key (e.g.
    ``"step/7"``), so all ranks' spans of a step join one trace without any
    communication.
    """
    digest = hashlib.blake2b(f"{run_id}/{key}".encode(), digest_size=24).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:], "big") or 1
    return trace_id, span_id


class Frame:
    """One open span: a module call in one phase, or the per-rank root.

    Attributes:
        fqn: module name (``Global`` for the rank root).
        phase: phase of a module frame; ``None`` for the root.
        events: ``(name, timestamp_ns, attributes)`` tuples attached so far.
        counts: ``{(phase, op): n}`` collectives in this frame's subtree.
        done: the capture layer has finished with the frame but a frame above
            it is still open; it closes as soon as it is on top.
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
        "self_count",
        "error",
        "done",
        "closed",
        "task",
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
        self.events: list[tuple[str, int, dict[str, Any]]] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.self_count = 0
        self.error: str | None = None  # status description; never the exception itself
        self.done = False
        self.closed = False
        self.task = task

    def __repr__(self) -> str:
        return f"Frame({self.name!r}, done={self.done}, closed={self.closed})"


SpanSink = Callable[[ReadableSpan], None]


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
        self, sink: SpanSink, resource: Resource, version: str, record_messages: bool = True
    ) -> None:
        self._sink = sink
        self.record_messages = record_messages
        self.resource = resource
        self._scope = InstrumentationScope(
            semconv.INSTRUMENTATION_SCOPE, version, semconv.SCHEMA_URL
        )
        self._rng = random.Random(os.urandom(16))
        self.stack: list[Frame] = []
        self.trace_id = 0
        self.root: Frame | None = None
        self.on_empty: Callable[[], None] | None = None
        """Called when a frame or event arrives while no trace is open."""

    # ------------------------------------------------------------ trace root
    def begin(
        self, trace_id: int, parent_span_id: int | None, attrs: dict[str, Any]
    ) -> Frame:
        """Open the per-rank root frame of a new trace."""
        if self.root is not None:
            self.end()
        self.trace_id = trace_id
        parent = (
            SpanContext(trace_id, parent_span_id, False, _SAMPLED)
            if parent_span_id is not None
            else None
        )
        span_id = self._new_id()
        root = Frame(
            span_id,
            SpanContext(trace_id, span_id, False, _SAMPLED),
            semconv.GLOBAL_FQN,
            None,
            semconv.SPAN_RANK,
            attrs,
            parent,
        )
        self.root = root
        self.stack = [root]
        return root

    def end(self, error: BaseException | None = None) -> None:
        """Close every open frame and the root (with ERROR status if ``error``)."""
        if self.root is None:
            return
        desc = self.describe(error)
        if desc is not None:
            self.root.error = desc
        self._close_from(0, desc, _now())
        self.root = None
        self.stack = []

    def emit_span(
        self,
        name: str,
        span_id: int,
        parent_span_id: int | None,
        start: int,
        end: int,
        attrs: dict[str, Any],
        error: BaseException | None = None,
    ) -> None:
        """Emit a span that was never on the stack (the cross-rank step root)."""
        parent = (
            SpanContext(self.trace_id, parent_span_id, False, _SAMPLED)
            if parent_span_id is not None
            else None
        )
        self._sink(
            ReadableSpan(
                name,
                SpanContext(self.trace_id, span_id, False, _SAMPLED),
                parent,
                self.resource,
                attrs,
                (),
                kind=SpanKind.INTERNAL,
                status=_status(self.describe(error)),
                start_time=start,
                end_time=end,
                instrumentation_scope=self._scope,
            )
        )

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
        if not stack and self.on_empty is not None:
            self.on_empty()
            stack = self.stack
        if under is not None and not under.closed:
            idx = _index(stack, under)
            if idx >= 0 and idx + 1 < len(stack):
                self._close_from(idx + 1, None, _now())
        parent = stack[-1] if stack else None
        span_id = self._new_id()
        frame = Frame(
            span_id,
            SpanContext(self.trace_id, span_id, False, _SAMPLED),
            fqn,
            phase,
            name or semconv.module_span_name(fqn, phase),
            attrs,
            parent.context if parent is not None else None,
            task,
        )
        stack.append(frame)
        return frame

    def pop(self, frame: Frame, error: BaseException | None = None) -> None:
        """Finish ``frame``: close it now if on top, else once the frames above close."""
        if frame.closed:
            return
        if error is not None and frame.error is None:
            frame.error = self.describe(error)
        stack = self.stack
        if stack and stack[-1] is frame:
            self._close_top(_now())
            while len(stack) > 1 and stack[-1].done:
                self._close_top(_now())
        else:
            frame.done = True

    def close_now(self, frame: Frame, error: BaseException | None = None) -> None:
        """Close ``frame`` and everything above it immediately.

        With ``error``, the frames above ``frame`` (their calls never finished:
        the error crossed them) end with it too.
        """
        if frame.closed:
            return
        idx = _index(self.stack, frame)
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
    def add_event(self, name: str, op: str, phase: str, attrs: dict[str, Any]) -> None:
        """Attach a collective event to the innermost frame and count it up the chain.

        The event counts once per module name (at its innermost frame), for the
        root, and for every frame of the same phase; a frame of another phase
        (a backward frame around a recompute) counts it only when its module
        encloses the event's module by name, so a recompute triggered inside
        one module's backward is not charged to that module.
        """
        stack = self.stack
        if not stack:
            if self.on_empty is None:
                return
            self.on_empty()
            stack = self.stack
        top = stack[-1]
        top.events.append((name, _now(), attrs))
        top.self_count += 1
        key = (phase, op)
        owner = top.fqn
        seen: set[str] = set()
        for frame in reversed(stack):
            fqn = frame.fqn
            if fqn in seen:
                continue
            frame_phase = frame.phase
            if (
                frame_phase is not None
                and frame_phase.value != phase
                and owner != fqn
                and not owner.startswith(fqn + ".")
            ):
                continue
            seen.add(fqn)
            counts = frame.counts
            counts[key] = counts.get(key, 0) + 1

    def add_plain_event(self, frame: Frame, name: str, attrs: dict[str, Any]) -> None:
        """Attach a non-collective event to ``frame``."""
        frame.events.append((name, _now(), attrs))

    def add_exception(self, frame: Frame, error: BaseException) -> None:
        """Attach an ``exception`` event for ``error`` to ``frame`` (its message
        only if :attr:`record_messages`)."""
        attrs: dict[str, Any] = {semconv.EXCEPTION_TYPE: type(error).__qualname__}
        if self.record_messages:
            attrs[semconv.EXCEPTION_MESSAGE] = _message(error)
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
        # the span is built before the frame leaves the stack: if building
        # fails, the frame stays open and a later close emits it
        frame = self.stack[-1]
        attrs = frame.attrs
        if frame.counts:
            totals: dict[str, int] = {}
            for (phase, op), n in frame.counts.items():
                attrs[semconv.count_key(phase, op)] = n
                totals[phase] = totals.get(phase, 0) + n
            for phase, n in totals.items():
                attrs[f"{semconv.COUNT_PREFIX}{phase}.{semconv.COUNT_TOTAL}"] = n
        if frame.self_count:
            attrs[semconv.SELF_COUNT] = frame.self_count
        events: Iterable[Event] = (
            tuple(Event(n, a, t) for n, t, a in frame.events) if frame.events else ()
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
            end_time=max(now, frame.start),
            instrumentation_scope=self._scope,
        )
        self.stack.pop()
        frame.closed = True
        self._sink(span)


def describe_error(error: BaseException | None, message: bool = True) -> str | None:
    """``"ValueError: boom"`` (``"ValueError"`` without ``message``); ``None``
    for no error.

    Frames keep this string, never the exception (its traceback would keep the
    step's tensors and autograd graph alive).
    """
    if error is None:
        return None
    if not message:
        return type(error).__name__
    return f"{type(error).__name__}: {_message(error)}"


def _message(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # a user's __str__ that raises: keep the type, lose the text
        return "<str() of the exception raised>"


def _status(desc: str | None) -> Status:
    if desc is None:
        return _UNSET
    return Status(StatusCode.ERROR, desc)


def _index(stack: list[Frame], frame: Frame) -> int:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is frame:
            return i
    return -1
