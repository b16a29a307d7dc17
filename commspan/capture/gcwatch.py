"""Pauses of the process for Python's garbage collector, seen while a mode is entered.

A full collection walks every object the collector tracks: in a process that
holds torch and a model, hundreds of thousands, for 100 ms or more, during
which no Python code runs on any thread. On one rank of a job, that is a rank
that arrives late at its next collective while the others wait (the usual
reason training loops control the collector themselves). :class:`GcWatch`
notes each full collection, and each younger one that took at least
``min_ns``, with where the traced thread was then; ``CommSpanMode`` writes them
as ``commspan.gc`` events on the rank span of their trace (docs/schema.md), and
``commspan stragglers`` charges them to the late arrivals they explain.

Example:
    >>> import gc
    >>> from commspan.capture.gcwatch import GcWatch
    >>> watch = GcWatch(lambda: (1, "Net.blocks.0", "forward"))
    >>> watch.install()
    >>> _ = gc.collect()
    >>> watch.remove()
    >>> [p.generation for p in watch.take()]
    [2]
"""

from __future__ import annotations

import _thread
import gc
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["MAX_PENDING", "MIN_NS", "GcPause", "GcWatch"]

_REDELIVER_S = 0.01
"""How long after a collection an interrupt swallowed by it is delivered again."""

MIN_NS = 1_000_000
"""Collections of the younger generations shorter than this (1 ms) are not noted."""
MAX_PENDING = 1000
"""Pauses held between two :meth:`GcWatch.take` calls (a trace); more are counted in
:attr:`GcWatch.dropped` (a session trace of hours should not grow without bound)."""

Where = Callable[[], "tuple[int, str | None, str | None] | None"]


class GcPause(NamedTuple):
    """One collection: when it started (wall clock, ns), how long it took, what it did,
    and where the traced thread was (``trace_id``; module fqn and phase of its
    innermost open span, ``None`` outside every module)."""

    trace_id: int
    start_ns: int
    duration_ns: int
    generation: int
    collected: int
    fqn: str | None
    phase: str | None


class GcWatch:
    """Notes the garbage collector's pauses while installed (``gc.callbacks``).

    Args:
        where: called when a collection is noted (on whichever thread ran it):
            ``(trace_id, fqn, phase)`` of the traced thread, or ``None`` when
            nothing is being traced (the pause is then not noted).
        min_ns: the shortest collection of generation 0 or 1 noted; full
            collections are always noted.

    Nothing here ever raises into the collector: a failure is counted in
    :attr:`errors`.
    """

    def __init__(self, where: Where, min_ns: int = MIN_NS) -> None:
        self._where = where
        self.min_ns = min_ns
        # appended by the collector's callback on any thread, drained by take():
        # deque appends and pops are atomic, so a pause is taken now or next time
        self._pending: deque[GcPause] = deque()
        self._start = 0
        self._start_wall = 0
        # only the callback writes these (collections never run two at a time);
        # readers take differences, never reset them
        self.errors = 0
        """Collections that could not be noted (``where`` raised), since installed."""
        self.dropped = 0
        """Collections not held because :data:`MAX_PENDING` were already waiting."""

    def install(self) -> None:
        """Start noting collections (idempotent)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def remove(self) -> None:
        """Stop noting collections (idempotent)."""
        while self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def take(self) -> list[GcPause]:
        """The pauses noted since the last call, oldest first."""
        taken = []
        pending = self._pending
        while True:
            try:
                taken.append(pending.popleft())
            except IndexError:
                return taken

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        try:
            self._note(phase, info)
        except KeyboardInterrupt:
            # a Ctrl-C handled while this callback ran: the collector ignores what its
            # callbacks raise, so the user's interrupt would be lost. Deliver it again
            # from another thread, a moment later: the main thread then meets it once
            # the collection is over (raised here, it would be swallowed again)
            threading.Timer(_REDELIVER_S, _thread.interrupt_main).start()

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
            self._start_wall = time.time_ns()
            return
        if not self._start:  # installed during a collection: its start was not seen
            return
        took = time.perf_counter_ns() - self._start
        self._start = 0
        generation = info.get("generation", 2)
        if generation < 2 and took < self.min_ns:
            return
        try:
            where = self._where()
            if where is None:
                return
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                return
            self._pending.append(
                GcPause(where[0], self._start_wall, took, generation,
                        int(info.get("collected", 0)), where[1], where[2])
            )
        except Exception:  # never into the collector
            self.errors += 1
