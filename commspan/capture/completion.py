"""How the training process observes that a collective completed.

Each collective the dispatch mode sees gets a
:class:`~commspan.spans.timing.CollectiveTiming`; this module completes it
the way the op's own caller learns of its completion (docs/design.md, "When
collectives complete"):

- **functional collectives** (``_c10d_functional.*``, DTensor, tensor
  parallelism, FSDP2): the op returns its output at once; ``wait_tensor`` on
  that output (or an alias of its memory) is the completion, timed on the
  training thread when ``wait_tensor`` returns. Outputs are found by their
  data pointer: DTensor waits on aliases of the output, not on the object
  the op returned.
- **c10d ops called synchronously** (``async_op=False``: ``dist.all_reduce(t)``
  and the other blocking calls): the caller waits on the returned ``Work``
  right after the op returns. The dispatch mode waits on it first (releasing
  the GIL, as the caller's wait does) and times the completion there; the
  caller's own wait then returns at once, or raises the op's error as before.
- **ops that return their result done** (DTensor's ``shard_dim_alltoall``, which
  waits inside, and ``monitored_barrier``, which returns nothing): their return.
- **other c10d ops** (``async_op=True``, ``send``/``recv``, whose blocking or
  not is the caller's choice): a done-callback on the ``Work``'s future. It
  runs on the backend's thread and needs the GIL, so it can be late by up
  to the interpreter's switch interval (5 ms) when the training thread is
  busy in Python at that moment. A ``Work`` without a future (gloo's
  ``send``/``recv``) says it completed only once its caller has waited on it:
  commspan asks it when it next looks (the next collective issued or waited
  on asks the oldest outstanding and a few more in turn, a span closing asks
  its own, the watchdog), so such a duration is an upper bound.
- **CUDA tensors**: host times say when work was enqueued, not when it ran.
  A CUDA event is recorded on the current stream when the op is issued and
  another where the completion is observed (after ``wait_tensor``, after a
  synchronous op, in the future's callback); the duration is the time
  between them on the device, read once the second event has completed.

Nothing here raises into the training step: the dispatch mode counts any
error as an internal one.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from commspan import semconv
from commspan.capture.collectives import CollectiveInfo
from commspan.spans.timing import CollectiveTiming

_GROUP = semconv.PG_NAME

__all__ = ["CompletionTracker"]

_perf = time.perf_counter_ns
_SYNCHRONOUS = frozenset({"shard_dim_alltoall"})
"""Ops that are not functional collectives and return their output done (DTensor's
``shard_dim_alltoall`` waits inside)."""
_POLL_AHEAD = 4  # Works without a future asked per collective (poll_some)
_Tensor = torch.Tensor
_ScriptObject = torch.ScriptObject

try:
    _Work: Any = torch._C._distributed_c10d.Work  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - torch built without distributed
    _Work = None


def _elapsed_ns(start: Any, end: Any) -> int | None:
    """Device time between two CUDA events, once the second has completed."""
    if not end.query():
        return None
    return int(start.elapsed_time(end) * 1_000_000)


class CompletionTracker:
    """Completes the timings of the collectives one dispatch mode issues.

    Args:
        max_outstanding: functional outputs remembered while waiting for their
            ``wait_tensor``; beyond it the oldest is forgotten (its collective
            gets no duration) and counted in :attr:`forgotten`.
    """

    def __init__(self, max_outstanding: int = 4096) -> None:
        self.outputs: dict[int, CollectiveTiming] = {}
        """Functional outputs not waited yet, by data pointer: the dispatch mode stores
        and pops them itself on its fast path (CPU, one output)."""
        self._max = max_outstanding
        self.sweep_at = 256
        """Past this many :attr:`outputs`, :meth:`sweep` them."""
        self.polled: deque[CollectiveTiming] = deque()
        """Timings of ``Work`` s without a future, oldest first: a few are asked at
        each collective (:meth:`poll_some`), each when a span that holds it closes."""
        self._cursor = 0  # the last of polled asked by poll_some
        self._compact_at = 256  # len(polled) at which poll_some compacts it
        self.futures: dict[int, CollectiveTiming] = {}
        """Timings whose ``Work`` future has not called back yet, by ``id``."""
        self.no_future: dict[str, set[tuple[Any, bool]]] = {}
        """Overload -> ``(process group, on CUDA)`` whose ``Work`` had no future
        (gloo's send and recv): asking raises a C++ error with its backtrace,
        15-40 µs a time, so the next ones are polled without asking. (By overload
        first: an op that always has a future costs one lookup.)"""
        self.failed = 0
        """Collectives given up on when issued: the op raised, a blocking op's wait
        raised, or it returned nothing to wait on. No duration; counted by the mode
        in ``collectives_untimed``."""
        self.devices: list[CollectiveTiming] = []
        """Timings of collectives on CUDA tensors, completed by their CUDA events
        (the finished ones are dropped now and then)."""
        self._devices_at = 256  # len(devices) that drops them (doubles, amortised)
        self.forgotten = 0
        self.cuda = torch.cuda.is_available()
        """CUDA is available: collectives on CUDA tensors are timed with CUDA events."""

    # ------------------------------------------------------------ issue
    def start(self, info: CollectiveInfo, timing: CollectiveTiming, args: Any,
              kwargs: Any) -> Any:
        """Right before the op runs: the issue time (and, for CUDA tensors, a CUDA
        event on the current stream). Returns what :meth:`issued` needs back."""
        if self.polled:
            self.poll_some()
        event = None
        if self.cuda and _on_cuda(info, args, kwargs):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            devices = self.devices
            if len(devices) >= self._devices_at:  # amortised: the threshold doubles
                devices[:] = [t for t in devices if not t.finished() and not t.abandoned]
                self._devices_at = max(256, 2 * len(devices))
            devices.append(timing)
        timing.issued = _perf()
        return event

    def issued(self, info: CollectiveInfo, timing: CollectiveTiming, args: Any,
               kwargs: Any, out: Any, cuda_start: Any) -> None:
        """Right after the op returned: arrange to learn of its completion."""
        if info.functional:
            # (one output on the CPU, the usual case, the dispatch mode stores itself)
            self._remember(timing, out, cuda_start)
            return
        if out is None or info.name in _SYNCHRONOUS:
            # a blocking op that returns nothing (monitored_barrier) or its output: done
            if cuda_start is not None:
                _finish_cuda(timing, cuda_start)  # (it ran on the current stream)
            else:
                timing.duration = max(0, _perf() - timing.issued)
            return
        work = out[-1] if type(out) is tuple and out else out
        if _Work is None or not isinstance(work, _ScriptObject):
            self.give_up(timing)  # nothing to wait on
            return
        handle = _Work.unbox(work)
        index = info.async_index
        if index >= 0 and (
            args[index] if index < len(args)
            else (kwargs.get(info.arg_names[index], True) if kwargs else True)
        ) is False:
            # the caller waits right after this returns: wait first, and time it
            if cuda_start is not None:
                _finish_cuda(timing, cuda_start)  # a blocking op ran on the current stream
            else:
                self.wait_blocking(timing, handle)
            return
        self.watch(info, timing, handle, cuda_start)

    def wait_blocking(self, timing: CollectiveTiming, handle: Any) -> None:
        """A blocking c10d op on the CPU, whose caller waits on its ``Work`` ``handle``
        right after it returns: wait first (releasing the GIL, as the caller's wait
        does), and time the completion."""
        try:
            handle.wait()
        except Exception:
            # the op failed (the caller's own wait raises it again): it has no
            # completion to wait for, and is counted as emitted without one
            self.give_up(timing, failed=True)
            return
        timing.duration = max(0, _perf() - timing.issued)

    def watch(self, info: CollectiveInfo, timing: CollectiveTiming, handle: Any,
              cuda_start: Any) -> None:
        """Arrange to learn when the ``Work`` ``handle`` of a c10d op the caller may not
        wait on at once completes: by its future's callback, or by asking it later."""
        # a backend's Work for one op has a future always or never; the group and the
        # device pick the backend
        no_future = self.no_future
        if no_future and info.overload in no_future and (
                timing.attrs.get(_GROUP), cuda_start is not None) in no_future[info.overload]:
            future = None
        else:
            try:
                future = handle.get_future()
            except RuntimeError:  # no future (gloo's send/recv): ask the Work later
                future = None
                no_future.setdefault(info.overload, set()).add(
                    (timing.attrs.get(_GROUP), cuda_start is not None))
        if future is None:
            timing.resolve = partial(_poll_work, handle, timing, cuda_start, self)
            self.polled.append(timing)
            return
        if cuda_start is not None:
            future.add_done_callback(partial(_cuda_done, timing, cuda_start, self))
        else:
            self.futures[id(timing)] = timing
            future.add_done_callback(partial(self._future_done, timing))

    def give_up(self, timing: CollectiveTiming, failed: bool = False) -> None:
        """Nothing will complete ``timing`` (its op raised: ``failed``, or it returned
        nothing to wait on): its span does not wait for it, and it is counted in
        :attr:`failed`. Hang records list one whose op raised as failed (it never
        completed, and a peer may wait for it), and not the others."""
        if not timing.finished():
            timing.abandon()
            timing.failed = failed
            self.failed += 1

    def _future_done(self, timing: CollectiveTiming, future: Any) -> None:
        """A ``Work``'s future completed (on the backend's thread): complete its timing,
        then stop counting it as outstanding (in that order, for :meth:`settled`). A
        future that completed with an error (a backend's timeout, a peer that died)
        is a failed op: no duration, listed failed."""
        if _failed(future):
            self.give_up(timing, failed=True)
        else:
            timing.complete()
        self.futures.pop(id(timing), None)

    def pending(self) -> list[CollectiveTiming]:
        """The collectives still waited for: functional outputs not waited, ``Work`` s
        whose future has not called back or not yet polled, CUDA events not yet
        completed (a copy; safe from any thread)."""
        for _ in range(3):
            try:
                return [*self.outputs.values(), *self.polled, *self.futures.values(),
                        *(t for t in self.devices if not t.finished())]
            except RuntimeError:  # changed size while copied (another thread): again
                continue
        return []

    def settled(self) -> bool:
        """Whether every collective timed so far has its completion (or was given
        up): no functional output waits for its ``wait_tensor``, no ``Work`` for its
        future or for a poll, and no CUDA events are in use. Spans then need not check
        their collectives one by one before they are emitted. Safe from any thread."""
        return not (self.outputs or self.polled or self.futures or self.cuda)

    def poll(self) -> None:
        """Ask the ``Work`` s without a future whether they have completed."""
        self.polled = deque(t for t in self.polled if not t.finished() and not t.abandoned)
        self._cursor = 0

    def poll_some(self) -> None:
        """Ask a few ``Work`` s without a future whether they have completed: the
        oldest, then the next few in turn (a cursor goes round all of them, so each
        is asked once every ``len / 4`` collectives), and forget the completed ones
        at the front; the whole queue is compacted once it has doubled. Constant
        work per collective, amortised, however many are outstanding (asking all
        of them at each collective made a step of thousands of isends quadratic);
        a span closing asks its own."""
        polled = self.polled
        while polled and (polled[0].finished() or polled[0].abandoned):
            polled.popleft()
        n = len(polled)
        if n > 1:
            at = self._cursor
            for _ in range(min(_POLL_AHEAD, n - 1)):
                at = at + 1 if at + 1 < n else 1
                polled[at].finished()
            self._cursor = at
        if n >= self._compact_at:  # amortised: the threshold doubles
            self.poll()
            self._compact_at = max(256, 2 * len(self.polled))

    def _remember(self, timing: CollectiveTiming, out: Any, cuda_start: Any) -> None:
        outputs: Sequence[Any] = out if isinstance(out, (list, tuple)) else (out,)
        keys = []
        table = self.outputs
        for t in outputs:
            if isinstance(t, _Tensor):
                key = t.data_ptr() or id(t)
                table[key] = timing
                keys.append(key)
        if not keys:
            self.give_up(timing)  # no output to be waited
            return
        timing.hold = (outputs, keys, cuda_start)
        if len(table) > self.sweep_at:
            self.sweep()

    def sweep(self) -> None:
        """Forget outputs whose collective is settled (completed, or given up at the end
        of its trace), then the oldest beyond ``max_outstanding``."""
        table = self.outputs
        for key in [k for k, t in table.items() if t.duration is not None or t.abandoned]:
            del table[key]
        while len(table) > self._max:
            del table[next(iter(table))]
            self.forgotten += 1
        self.sweep_at = max(256, 2 * len(table))

    # ------------------------------------------------------------ completion
    def waited(self, tensor: Any, now: int, start: int = 0) -> None:
        """``wait_tensor`` on ``tensor``, called at ``start``, returned at ``now``: complete
        the collective that produced it, if one is waiting."""
        if self.polled:
            self.poll_some()
        timing = self.outputs.pop(tensor.data_ptr() or id(tensor), None)
        if timing is not None:
            timing.wait_start = start
            self.finish(timing, now)

    def finish(self, timing: CollectiveTiming, now: int) -> None:
        """Complete ``timing``, just popped from :attr:`outputs` by a ``wait_tensor`` that
        returned at ``now`` (its other outputs' keys go too)."""
        hold = timing.hold
        if hold is not None:
            _outputs, keys, cuda_start = hold
            for key in keys:
                if self.outputs.get(key) is timing:
                    del self.outputs[key]
            if cuda_start is not None:
                timing.wait_start = 0  # device time: a host wait says nothing of it
                _finish_cuda(timing, cuda_start)
                return
        timing.complete(now)

    def clear(self) -> None:
        """Forget every output and ``Work`` still waiting (the mode is left)."""
        self.outputs.clear()
        self.polled = deque()
        self._cursor = 0
        self.futures.clear()
        self.devices = []

    @property
    def outstanding(self) -> int:
        """Functional outputs issued and not waited yet."""
        return len(self.outputs)


def _arg(info: CollectiveInfo, args: Any, kwargs: Any, index: int, default: Any) -> Any:
    if index < len(args):
        return args[index]
    if kwargs:
        return kwargs.get(info.arg_names[index], default)
    return default


def _poll_work(handle: Any, timing: CollectiveTiming, cuda_start: Any,
               tracker: CompletionTracker) -> int | None:
    """The duration of a ``Work`` without a future, once it says it has completed.

    A ``Work`` that failed (a backend's timeout: gloo's send and receive) says it has
    completed too, and its caller's ``wait()`` raises. Whether it succeeded is asked
    only while an exception is being handled on this thread (a span closing on the
    error its module raised: the caller's ``wait()`` raised it), since asking prints
    a deprecation warning of torch's once per process; then a failed op is given up
    on (no duration, listed failed)."""
    if not handle.is_completed():
        return None
    if sys.exc_info()[0] is not None:
        try:
            ok = handle.is_success()
        except Exception:  # not implemented by a backend: as completed
            ok = True
        if not ok:
            timing.resolve = None  # (give_up asks finished(), which would call this)
            tracker.give_up(timing, failed=True)
            return None
    if cuda_start is not None:
        _finish_cuda(timing, cuda_start)
        return None  # the CUDA events resolve it from now on
    return max(0, _perf() - timing.issued)


def _on_cuda(info: CollectiveInfo, args: Any, kwargs: Any) -> bool:
    if info.input_index < 0:
        return False
    value = _arg(info, args, kwargs, info.input_index, None)
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return isinstance(value, _Tensor) and value.is_cuda


def _finish_cuda(timing: CollectiveTiming, start: Any) -> None:
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    timing.hold = None
    timing.resolve = partial(_elapsed_ns, start, end)


def _cuda_done(timing: CollectiveTiming, start: Any, tracker: CompletionTracker,
               future: Any) -> None:
    """A CUDA op's ``Work`` future completed: its end event goes on the stream, unless
    the op failed (a NCCL timeout or abort: no duration, listed failed)."""
    if _failed(future):
        tracker.give_up(timing, failed=True)
        return
    _finish_cuda(timing, start)


def _failed(future: Any) -> bool:
    """Whether a completed ``Work`` future completed with the op's error."""
    try:
        future.value()  # (already there: raises the op's error, if it failed)
    except Exception:
        return True
    return False
