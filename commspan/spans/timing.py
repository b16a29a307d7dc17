"""When each collective completed: the records the capture side fills in.

A :class:`CollectiveTiming` is made when a collective is issued, travels with
its event, and is completed by whoever observes the completion (the dispatch
mode at ``wait_tensor`` or after waiting a synchronous c10d op on the training
thread, a ``Work`` future's callback on a backend thread, CUDA events polled
later). Completing is one attribute store, safe from any thread; everything
else (durations on events, bandwidths, roll-ups) is computed when the span is
built, off the issue path.

A :class:`CollectiveLog` keeps, per process group, the recent collectives of
a rank and every one not completed: what a ``commspan.hang`` record lists.

Example:
    >>> t = CollectiveTiming({"commspan.collective.op": "all_reduce"}, "forward")
    >>> t.finished()
    False
    >>> t.issued = 1_000
    >>> t.complete(2_500)
    >>> t.finished(), t.duration
    (True, 1500)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from commspan import semconv
from commspan._bandwidth import bus_factor, operation_bytes
from commspan._fork import on_fork_in_child

__all__ = ["CollectiveLog", "CollectiveTiming", "add_timing", "hold_timing"]

_perf = time.perf_counter_ns
_DURATION = semconv.COLL_DURATION_NS
_WAIT = semconv.COLL_WAIT_NS
_BYTES = semconv.TENSOR_BYTES
_SIZE = semconv.PG_SIZE
_OP = semconv.COLL_OP
_GROUP = semconv.PG_NAME
_ALGBW = semconv.COLL_ALGBW
_BUSBW = semconv.COLL_BUSBW
_SCALES: dict[tuple[str, int], tuple[int, float]] = {}


def _scales(op: str, size: int) -> tuple[int, float]:
    """``(S / bytes, busbw / algbw)`` of ``op`` on ``size`` ranks, NCCL-tests conventions
    (:mod:`commspan._bandwidth`), computed once per op and size."""
    scale = (operation_bytes(op, 1, size), bus_factor(op, size))
    _SCALES[(op, size)] = scale
    return scale


class CollectiveTiming:
    """One collective from issue to completion: its event's record on its frame.

    Every collective event is recorded as one of these (timed or not: a
    collective not timed keeps ``duration`` ``None`` and nobody waits for it).

    Attributes:
        name: the event's name.
        attrs: the collective event's attributes, the dict the span's event holds
            (:meth:`event_attributes` adds the timing to it in place).
        phase: the phase the collective is counted in.
        issued: ``time.perf_counter_ns()`` when the op was issued (the dispatch
            mode sets it right before the op runs; 0 until then).
        wall: ``time.time_ns()`` of the event (set by the recorder).
        duration: issue to completion in ns, once known; ``None`` before.
        resolve: for completions known only later (CUDA events): called to
            get the duration, ``None`` while not known yet.
        hold: what must stay alive until completion (output tensors waited
            by ``wait_tensor``, the keys they are found by).
        abandoned: its span was emitted without a completion (its trace ended
            first): it is not waited for any more, nor listed as not completed
            in hang records.
        wait_start: ``perf_counter_ns()`` when the ``wait_tensor`` that completed it
            was called (functional collectives on the CPU; 0 otherwise).
        failed: its op raised (given up on, and listed by hang records as failed).
    """

    __slots__ = ("attrs", "phase", "name", "issued", "wall", "duration", "resolve", "hold",
                 "abandoned", "wait_start", "failed")

    def __init__(self, attrs: dict[str, Any], phase: str, name: str = "") -> None:
        self.attrs = attrs
        self.phase = phase
        self.name = name
        self.issued = 0
        self.wall = 0
        self.duration: int | None = None
        self.resolve: Callable[[], int | None] | None = None
        self.hold: Any = None
        self.abandoned = False
        self.wait_start = 0
        self.failed = False

    def abandon(self) -> None:
        """Give up on the completion (the span is emitted without it)."""
        if not self.finished():
            self.abandoned = True
            self.hold = None
            self.resolve = None  # (a Work it polls holds the op's tensors)

    def complete(self, now: int | None = None) -> None:
        """Record the completion, at ``now`` (``perf_counter_ns``) or at once.

        The first completion wins; safe to call from any thread.
        """
        if self.duration is None:
            self.duration = max(0, (_perf() if now is None else now) - self.issued)
            self.hold = None
            self.resolve = None

    def finished(self) -> bool:
        """Whether the completion is known (asks :attr:`resolve` if there is one)."""
        if self.duration is not None:
            return True
        resolve = self.resolve
        if resolve is None:
            return False
        try:
            duration = resolve()
        except Exception:  # a broken resolver never completes, never breaks the caller
            self.resolve = None
            return False
        if duration is None:
            return False
        self.duration = max(0, int(duration))
        self.hold = None
        self.resolve = None  # the Work it asked holds the op's tensors: let them go
        return True

    def event_attributes(self) -> dict[str, Any]:
        """The event's attributes, with ``duration_ns``, ``algbw`` and ``busbw`` added
        once completed, or ``commspan.collective.state`` ``failed`` if its op raised
        (in place: the span is built once, and hang records copy)."""
        duration = self.duration
        attrs = self.attrs
        if duration is None or _DURATION in attrs:
            if self.failed and duration is None:  # its op raised: it never completes
                attrs[semconv.COLL_STATE] = semconv.STATE_FAILED
            return attrs
        attrs[_DURATION] = duration
        start = self.wait_start
        if start:  # the time inside the wait that completed it
            attrs[_WAIT] = max(0, min(duration, self.issued + duration - start))
        nbytes = attrs.get(_BYTES)
        size = attrs.get(_SIZE)
        if duration > 0 and nbytes and size:
            op = attrs.get(_OP, "")
            scale = _SCALES.get((op, size))
            if scale is None:
                scale = _scales(op, size)
            algbw = nbytes * scale[0] / duration  # bytes/ns == GB/s
            attrs[_ALGBW] = algbw
            attrs[_BUSBW] = algbw * scale[1]
        return attrs

    def hang_attributes(self) -> dict[str, Any]:
        """The attributes of this collective on a ``commspan.hang`` record: the event's,
        plus ``commspan.collective.state`` (a copy; safe from any thread)."""
        done = self.finished()
        attrs = dict(self.attrs)
        if done and _DURATION not in attrs and self.duration is not None:
            attrs[_DURATION] = self.duration
        attrs[semconv.COLL_STATE] = (semconv.STATE_COMPLETED if done else
                                     semconv.STATE_FAILED if self.failed else
                                     semconv.STATE_ISSUED)
        return attrs


def _issued(timing: CollectiveTiming) -> int:
    return timing.issued


class CollectiveLog:
    """The rank's recent collectives: per process group the last ``keep`` of its last
    ``size`` collectives, and every collective not completed.

    :meth:`add` runs on the issuing thread (one append to a bounded deque);
    :meth:`snapshot` and :meth:`oldest_pending` may run on any thread (they
    read copies). Collectives older than the last ``size`` that have not
    completed come from ``pending``: whoever waits for their completion knows
    them (the dispatch mode's
    :meth:`~commspan.capture.completion.CompletionTracker.pending`).

    Args:
        keep: collectives listed per group, completed or not.
        size: collectives remembered in all (the groups share them).
        pending: returns the collectives still waited for, however old.
    """

    def __init__(
        self,
        keep: int = 8,
        size: int = 64,
        pending: Callable[[], list[CollectiveTiming]] | None = None,
    ) -> None:
        self._keep = keep
        self._recent: deque[CollectiveTiming] = deque(maxlen=size)
        self.add: Callable[[CollectiveTiming], None] = self._recent.append
        """Log a collective just issued (the deque's own ``append``: no Python frame)."""
        self.pending: Callable[[], list[CollectiveTiming]] = pending or list

    def snapshot(self) -> list[CollectiveTiming]:
        """The collectives a hang record lists: per group (in first-use order), oldest
        first, the last ``keep`` and every one not completed; abandoned ones left out,
        but for those whose op raised."""
        recent = list(self._recent)
        ids = {id(t) for t in recent}
        # waited for and no longer among the recent ones: issued before all of them
        older = {id(t): t for t in self.pending() if id(t) not in ids}
        groups: dict[Any, list[CollectiveTiming]] = {}
        for t in [*sorted(older.values(), key=_issued), *recent]:
            if not t.abandoned or t.failed:  # (a failed op is listed: it never completed)
                groups.setdefault(t.attrs.get(_GROUP, ""), []).append(t)
        out: list[CollectiveTiming] = []
        keep = self._keep
        for timings in groups.values():
            cut = len(timings) - keep
            out.extend(t for i, t in enumerate(timings) if i >= cut or not t.finished())
        return out

    def oldest_pending(self) -> CollectiveTiming | None:
        """The collective issued longest ago that has not completed, if any."""
        stuck = self.not_completed()
        return stuck[0] if stuck else None

    def not_completed(self) -> list[CollectiveTiming]:
        """The collectives issued and not completed (nor given up on), oldest first
        (a copy; safe from any thread). One whose issue time is not set yet (the
        dispatch mode sets it right before the op runs) is not among them."""
        out = [t for t in self.snapshot() if t.issued and not t.failed and not t.finished()]
        out.sort(key=_issued)
        return out

    def clear(self) -> None:
        """Forget everything (the mode's process groups start over)."""
        self._recent.clear()


_HELD = "_commspan_timing"
_held_lock = threading.Lock()


def _new_held_lock() -> None:
    global _held_lock
    _held_lock = threading.Lock()  # the export thread may have held it at fork()


on_fork_in_child(_new_held_lock)


def hold_timing(span: Any, timings: list[CollectiveTiming] | None, events: Any) -> None:
    """Keep on a span just built what its timing attributes are made of, for
    :func:`add_timing` (one attribute store on the training thread).

    Args:
        span: the ``ReadableSpan``, whose attribute and event dicts are the
            recorder's own (written in place later).
        timings: the collectives its module's counts include (comm-time roll-ups).
        events: its frame's events (collectives' records and other events' tuples).
    """
    setattr(span, _HELD, (timings, events))


def add_timing(span: Any) -> None:
    """Write a span's timing attributes: each timed collective event's
    ``duration_ns``, ``algbw`` and ``busbw``, and the span's
    ``commspan.comm_time_ns.<phase>`` roll-ups.

    The recorder holds them back when it builds the span (:func:`hold_timing`),
    so this work is done by whoever needs them first: the export thread before
    an exporter sees the span, or the mode before a processor of the user's
    tracer provider does. Idempotent and safe from any thread; a span built
    elsewhere is left as it is.

    Example:
        >>> from opentelemetry.sdk.trace import Event, ReadableSpan
        >>> t = CollectiveTiming({"commspan.collective.op": "all_reduce",
        ...                       "commspan.tensor.bytes": 1000,
        ...                       "commspan.process_group.size": 2}, "forward")
        >>> t.issued, t.duration = 0, 500
        >>> attrs = {"commspan.module.fqn": "m"}
        >>> span = ReadableSpan("m", attributes=attrs, events=[Event("all_reduce", t.attrs)])
        >>> hold_timing(span, [t], [t])
        >>> add_timing(span)
        >>> span.attributes["commspan.comm_time_ns.forward"]
        500
        >>> span.events[0].attributes["commspan.collective.duration_ns"]
        500
    """
    if getattr(span, _HELD, None) is None:
        return
    with _held_lock:
        held = getattr(span, _HELD, None)
        if held is None:
            return
        setattr(span, _HELD, None)
        timings, events = held
        attrs = span._attributes
        if timings:
            spent: dict[str, int] = {}
            for timing in timings:
                duration = timing.duration
                if duration is not None:
                    spent[timing.phase] = spent.get(timing.phase, 0) + duration
            for phase, ns in spent.items():
                attrs[semconv.comm_time_key(phase)] = ns
        for event in events:
            if type(event) is CollectiveTiming:
                event.event_attributes()
