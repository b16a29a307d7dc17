"""Which trace a rank's spans go into: one per step, one per stretch outside steps.

A step (``with mode.step(i):``) is one trace. Every rank derives the trace id
and the id of the step's root span from the run id and the trace's key
(``step/<i>``), so all ranks' spans of a step land in one trace without
exchanging a message (docs/design.md, "Traces, spans and events"). Activity
outside any step (a collective or a module call inside ``with mode:`` but
outside ``mode.step``) opens a *session* trace (``session/<n>``) that lasts
until the next step or the end of the mode.

Each rank writes a ``commspan.rank`` span as the root of its part of the
trace; rank 0 also writes the cross-rank root (``commspan.step`` or
``commspan.session``), the parent of every rank's ``commspan.rank`` span.

Example:
    >>> opener = TraceOpener()
    >>> opener.identify("run-1", rank=0, world_size=2)
    >>> trace = opener.step(3)
    >>> trace.key, trace.trace_id == derive_ids("run-1", "step/3")[0]
    ('step/3', True)
"""

from __future__ import annotations

import bisect
import hashlib
import time
from typing import Any

from commspan import semconv

__all__ = ["Trace", "TraceOpener", "derive_ids"]


def derive_ids(run_id: str, key: str) -> tuple[int, int]:
    """Deterministic ``(trace_id, root_span_id)`` for one trace of a run.

    Every rank derives the same ids from the same run id and key (e.g.
    ``"step/7"``), so all ranks' spans of a step join one trace without any
    communication. A run id UTF-8 cannot encode (a lone surrogate) is hashed
    with its surrogates as UTF-8 sequences (``surrogatepass``), never raising.
    """
    digest = hashlib.blake2b(
        f"{run_id}/{key}".encode("utf-8", "surrogatepass"), digest_size=24).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:], "big") or 1
    return trace_id, span_id


class Trace:
    """One trace of this rank, from when it opens until the recorder ends it.

    Attributes:
        key: ``step/<i>`` or ``session/<n>``.
        name: name of the cross-rank root span (``commspan.step`` or ``commspan.session``).
        trace_id: shared by every rank.
        root_span_id: id of the cross-rank root span, the parent of each rank's span.
        start: when this rank opened it (ns).
        root_attributes: attributes of the cross-rank root span.
        rank_attributes: attributes of this rank's ``commspan.rank`` span.
        writes_root: whether this rank writes the cross-rank root (rank 0 does).
    """

    __slots__ = (
        "key",
        "name",
        "trace_id",
        "root_span_id",
        "start",
        "root_attributes",
        "rank_attributes",
        "writes_root",
    )

    def __init__(
        self, key: str, name: str, opener: TraceOpener, attrs: dict[str, Any]
    ) -> None:
        self.key = key
        self.name = name
        self.trace_id, self.root_span_id = derive_ids(opener.run_id, key)
        self.start = time.time_ns()
        self.root_attributes = {
            semconv.RUN_ID: opener.run_id,
            **attrs,
            semconv.WORLD_SIZE: opener.world_size,
        }
        self.rank_attributes: dict[str, Any] = {
            semconv.MODULE_FQN: semconv.GLOBAL_FQN,
            semconv.RANK: opener.rank,
            semconv.WORLD_SIZE: opener.world_size,
            semconv.RUN_ID: opener.run_id,
            semconv.SCHEMA: semconv.SCHEMA_VERSION,
            **attrs,
        }
        self.writes_root = opener.rank == 0


class TraceOpener:
    """Makes the :class:`Trace` s of one mode: steps by index, sessions numbered.

    One opener serves a mode for its whole life, so the session traces of a
    mode entered twice are numbered on (their ids never repeat within a run).
    """

    def __init__(self) -> None:
        self.run_id = ""
        self.rank = 0
        self.world_size = 1
        self._sessions = 0
        self._rooted = _Numbers()  # steps whose root this rank wrote (rank 0)

    def identify(self, run_id: str, rank: int, world_size: int) -> None:
        """Set the run id and the rank the next traces belong to."""
        self.run_id, self.rank, self.world_size = run_id, rank, world_size

    def step(self, index: int) -> Trace:
        """The trace of step ``index``. A step number used again shares the trace of
        its first use and its root, which is written once, at the end of the first
        use (a second one had the same span id)."""
        trace = self.step_trace(index)
        if trace.writes_root and not self._rooted.add(index):
            trace.writes_root = False
        return trace

    def step_trace(self, index: int) -> Trace:
        """The trace of step ``index``, as every rank derives it, without :meth:`step`'s
        account of the roots written (a hang record in a step ``sample=`` leaves out
        goes in it, and the step has no root)."""
        return Trace(f"step/{index}", semconv.SPAN_STEP, self, {semconv.STEP: index})

    def session(self) -> Trace:
        """A new trace for activity outside any step."""
        self._sessions += 1
        return Trace(f"session/{self._sessions}", semconv.SPAN_SESSION, self, {})


class _Numbers:
    """A set of ints kept as sorted, disjoint ``[first, last]`` runs: steps numbered
    0, 1, 2, ... take one run however many there are."""

    __slots__ = ("_firsts", "_lasts")

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._lasts: list[int] = []

    def add(self, n: int) -> bool:
        """Add ``n``; ``False`` if it was in already."""
        firsts, lasts = self._firsts, self._lasts
        i = bisect.bisect_right(firsts, n) - 1  # the run starting at or before n
        if i >= 0 and n <= lasts[i]:
            return False
        joins_left = i >= 0 and lasts[i] == n - 1
        joins_right = i + 1 < len(firsts) and firsts[i + 1] == n + 1
        if joins_left and joins_right:
            lasts[i] = lasts[i + 1]
            del firsts[i + 1], lasts[i + 1]
        elif joins_left:
            lasts[i] = n
        elif joins_right:
            firsts[i + 1] = n
        else:
            firsts.insert(i + 1, n)
            lasts.insert(i + 1, n)
        return True

    def __len__(self) -> int:
        """How many runs."""
        return len(self._firsts)
