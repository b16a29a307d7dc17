"""Export off the training thread: a bounded queue and one worker per exporter.

:class:`ExportQueue` is a span processor. ``on_end`` appends the span to a
bounded queue and returns; a daemon thread hands batches to the wrapped
:class:`~opentelemetry.sdk.trace.export.SpanExporter`. Nothing here ever
raises into the caller's step, and nothing is lost silently: every span handed
to a queue ends up counted as exactly one of

- ``exported``: an ``export`` call returned ``SUCCESS`` for it;
- ``dropped``: it never reached ``export`` (the queue was full, or stopped, or
  it was still queued when :meth:`ExportQueue.shutdown` ran out of time);
- ``failed``: an ``export`` call raised, returned anything but ``SUCCESS``, or
  was still running when ``shutdown`` ran out of time (the batch is
  *abandoned*: counted as failed and in ``abandoned``, and a late result of
  that call is ignored);

or, until shutdown, ``pending`` (queued) or ``in_flight`` (inside an
``export`` call). So at every moment ``handed == exported + dropped + failed +
pending + in_flight``, and after ``shutdown`` ``pending == in_flight == 0``.
Each kind of loss is logged once per queue, and so is each message the
exporter's own loggers emit on the queue's threads: the OpenTelemetry OTLP
exporters log every retry against a dead endpoint, which buried commspan's
one line under dozens (shown again when those loggers are set to DEBUG).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from typing import Any

from opentelemetry.context import attach, detach, set_value
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from commspan._errors import Once, positive_int, seconds
from commspan.spans.timing import add_timing

__all__ = ["ExportQueue", "ExportStats"]

_log = logging.getLogger(__name__)

try:  # the SDK's key that tells instrumentations not to trace export work
    from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY as _SUPPRESS
except ImportError:  # pragma: no cover
    _SUPPRESS = "suppress_instrumentation"  # type: ignore[assignment]


class ExportStats(dict):  # type: ignore[type-arg]
    """Counters of one exporter, taken together under the queue's lock.

    Keys: ``exporter`` (class name), ``handed`` (spans given to the queue),
    ``queued`` (accepted into it), ``exported``, ``dropped``, ``failed``,
    ``abandoned`` (the part of ``failed`` left inside an export call that had
    not returned when shutdown gave up on it), ``pending`` (waiting in the
    queue), ``in_flight`` (inside an export call), ``healthy`` (see
    :attr:`ExportQueue.healthy`) and ``quieted`` (the exporter's own log records
    not shown: :attr:`ExportQueue.quieted`).

    Always ``handed == exported + dropped + failed + pending + in_flight``;
    after :meth:`ExportQueue.shutdown`, ``pending == in_flight == 0``.
    """

    @property
    def unaccounted(self) -> int:
        """Spans handed to the queue that no counter accounts for (always 0)."""
        return int(
            self["handed"]
            - self["exported"]
            - self["dropped"]
            - self["failed"]
            - self["pending"]
            - self["in_flight"]
        )


class _OnExportThread(threading.local):
    queue: ExportQueue | None = None


_ON_EXPORT_THREAD = _OnExportThread()
"""The queue whose exporter this thread calls (its worker, its shutdown thread)."""


class _QuietRepeats(logging.Filter):
    """On a logger of an exporter's: a record emitted while an export queue calls the
    exporter passes the first time that queue sees its message
    (:meth:`ExportQueue._first_of`); repeats are counted in
    :attr:`ExportQueue.quieted` and not shown. Records of other threads, and every
    record while the logger is enabled for DEBUG, pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        queue = _ON_EXPORT_THREAD.queue
        if queue is None or logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True
        try:
            return queue._first_of(record)
        except Exception:  # (a filter's error would reach the exporter's log call)
            return True


_QUIET = _QuietRepeats()
_ERROR_TEXTS = 3
"""Texts of one error message (format string) an exporter's queue shows at most."""
_QUIET_LOCK = threading.Lock()


def _quiet_repeats_of(exporter: Any) -> None:
    """Put :data:`_QUIET` on the loggers ``exporter`` logs with: those of the
    OpenTelemetry modules its class comes from (the OTLP/gRPC exporter's retries) and
    a ``_logger`` of its own or of its ``_client`` (the OTLP/HTTP client's)."""
    loggers = [logging.getLogger(cls.__module__) for cls in type(exporter).__mro__
               if cls.__module__.startswith("opentelemetry.")]
    for holder in (exporter, getattr(exporter, "_client", None)):
        logger = getattr(holder, "_logger", None)
        if isinstance(logger, logging.Logger):
            loggers.append(logger)
    with _QUIET_LOCK:  # (two queues made at once on two threads: one filter each)
        for logger in loggers:
            if _QUIET not in logger.filters:
                logger.addFilter(_QUIET)


# every queue of the process, for the fork handler below
_LIVE: weakref.WeakSet[ExportQueue] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for queue in list(_LIVE):
        queue._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_EXIT_SLICE_S = 2.5
"""At exit, a queue whose exporter finishes no batch in this long is given up on (long
enough for one export call with the SDK's first retry after a transient error, whose
back-off is about a second)."""


def _at_exit() -> None:
    """At interpreter exit, shut down the queues nobody shut down: the export threads
    are daemons and die with the interpreter, so their spans would vanish uncounted.
    Each queue gets its ``export_timeout_s`` to finish, as long as its exporter keeps
    finishing batches (a slow one does, a dead backend does not: it is given up on
    after :data:`_EXIT_SLICE_S`). What is left is counted and logged."""
    for queue in list(_LIVE):
        if queue._forked:  # the parent's queue, copied into a child: the parent's to close
            continue
        try:
            queue._settle_at_exit()
        except Exception:  # pragma: no cover - nothing may stop the interpreter's exit
            _log.debug("commspan: shutting an export queue down at exit raised",
                       exc_info=True)


atexit.register(_at_exit)  # runs before the daemon threads are stopped


class ExportQueue(SpanProcessor):
    """Batches spans to ``exporter`` from a background thread; every wait is bounded.

    Why not the SDK's ``BatchSpanProcessor``: in the SDK releases commspan
    supports (``opentelemetry-sdk>=1.30``) its shutdown joins the worker thread
    without a timeout up to 1.32 (an export stuck on an endpoint that accepts
    and never answers then hangs the training process at exit), and from 1.33
    its ``force_flush`` exports on the calling thread (the training step) and
    ignores its timeout. In all of them ``exporter.shutdown()`` runs unbounded
    on the caller's thread, a ``FAILURE`` result is not counted, and there are
    no counters to show that no span was lost silently. This queue keeps every
    wait within its timeout, counts every span (see the module docstring) and
    knows whether its exporter is :attr:`healthy`, so that leaving a
    ``CommSpanMode`` does not wait again and again for a dead backend.

    The worker exports when a batch is full, every ``schedule_delay_s``, and when
    flushed (``flush(0.0)`` only asks it to start: ``CommSpanMode`` does so at the
    end of every trace).

    All durations of this class's own API are in seconds (``flush``,
    ``shutdown``, the constructor). ``force_flush(timeout_millis)`` keeps the
    ``SpanProcessor`` signature, in milliseconds, and calls :meth:`flush`.

    Args:
        exporter: any OpenTelemetry ``SpanExporter``.
        max_queue_size: spans held at most; more are dropped and counted.
        max_batch_size: spans per ``export`` call.
        schedule_delay_s: how long the worker waits for a batch to fill.
        export_timeout_s: default bound, in seconds, on how long ``flush``,
            ``force_flush`` and ``shutdown`` wait when given no timeout.

    Raises:
        ValueError: a size is not a positive int, or a duration is not positive.

    Example:
        >>> from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        ...     InMemorySpanExporter)
        >>> from commspan.exporters.queue import ExportQueue
        >>> queue = ExportQueue(InMemorySpanExporter())
        >>> queue.flush(1.0)
        True
        >>> queue.shutdown(1.0)
        >>> stats = queue.stats()
        >>> stats["handed"], stats["in_flight"], stats.unaccounted
        (0, 0, 0)
    """

    def __init__(
        self,
        exporter: SpanExporter,
        max_queue_size: int = 65536,
        max_batch_size: int = 4096,
        schedule_delay_s: float = 0.5,
        export_timeout_s: float = 10.0,
    ) -> None:
        positive_int("max_queue_size", max_queue_size, "pass a positive int")
        positive_int("max_batch_size", max_batch_size, "pass a positive int")
        schedule_delay_s = seconds("schedule_delay_s", schedule_delay_s)
        export_timeout_s = seconds("export_timeout_s", export_timeout_s)
        self.exporter = exporter
        self._name = type(exporter).__name__
        self._max_queue = max_queue_size
        self._max_batch = max_batch_size
        self._delay = schedule_delay_s
        self._timeout = export_timeout_s
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        # One lock guards the queue, every counter and the worker's state, so
        # a snapshot of the counters always adds up. It is taken with ``with
        # self._lock`` (a C lock entered by the with statement itself), never
        # ``with self._cond``: Condition.__enter__ is Python code, where a signal
        # handler (Ctrl-C caught by a training loop) can raise right after the lock
        # was taken and before the with block holds it, leaving it held for good:
        # every later span, flush, shutdown and the exit handler then hung. An RLock,
        # whose wait/re-acquire helpers are C too, for the same reason in wait().
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._flush_requests = 0
        self._flushed = 0
        self._stopped = False
        self._forked = False  # this object was copied into a forked child process
        self._closing = False
        self._closed = threading.Event()  # set when the first shutdown() has finished
        self._worker: threading.Thread | None = None
        self._batch = 0  # number of the batch inside export (0: none)
        self._abandoned_batch = 0  # batch given up on by shutdown
        self._healthy = True
        self.handed = 0
        self.queued = 0
        self.in_flight = 0
        self.exported = 0
        self.dropped = 0
        self.failed = 0
        self.abandoned = 0
        self._logged = Once()  # each kind of loss is logged once: "drop", "fail", "slow"
        self.quieted = 0
        """Records of the exporter's own loggers not shown: repeats of a message it
        logged before on this queue's threads (the SDK's retries against a dead
        endpoint). Set those loggers to DEBUG to see every one."""
        # (logger, format string) of the exporter's records shown -> the texts shown
        # of it, for errors (:meth:`_first_of`)
        self._shown: dict[tuple[str, str], set[str]] = {}
        try:
            _quiet_repeats_of(exporter)
        except Exception:  # pragma: no cover - an exporter's odd attributes: show all
            _log.debug("commspan: could not find the loggers of %s", self._name,
                       exc_info=True)
        _LIVE.add(self)

    # ------------------------------------------------------------ processor API
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        """Nothing to do when a span starts."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue ``span`` for export; drop and count it if the queue is full or stopped."""
        with self._lock:
            self.handed += 1
            queue = self._queue
            if self._stopped or len(queue) >= self._max_queue:
                self.dropped += 1
                warn = self._logged.first("drop")
                if warn and self._forked:
                    _log.warning(
                        "commspan: a span ended in a process forked from the one that "
                        "entered the mode; %s does not export from forked processes "
                        "(enter a CommSpanMode in the child to trace it); dropping and "
                        "counting them in mode.stats(), not logged again", self._name)
                    warn = False
            else:
                warn = False
                queue.append(span)
                self.queued += 1
                if self._worker is None:
                    self._start()
                elif len(queue) == self._max_batch:
                    self._cond.notify()
        if warn:
            _log.warning(
                "commspan: export queue of %s is full or stopped; dropping spans "
                "(counted in mode.stats(), not logged again)", self._name
            )

    @property
    def healthy(self) -> bool:
        """``False`` after an export failed or a flush timed out, until an export succeeds.

        ``flush(wait_if_unhealthy=False)`` (what leaving a ``CommSpanMode`` does)
        does not wait for an unhealthy queue.
        """
        return self._healthy

    def flush(self, timeout_s: float | None = None, *, wait_if_unhealthy: bool = True) -> bool:
        """Wait until every span queued so far has been through ``export``, or ``timeout_s``.

        A flush that waited and timed out makes the queue unhealthy.

        Args:
            timeout_s: bound on the wait, in seconds; default ``export_timeout_s``.
                ``0`` only asks the worker to export now.
            wait_if_unhealthy: ``False`` to only ask the worker to flush, without
                waiting, when the queue is not :attr:`healthy` (its last export
                failed or a flush timed out, and no export succeeded since).

        Returns:
            ``True`` if everything queued before the call has been through
            ``export`` (whatever its result); ``False`` on timeout, after a
            flush that did not wait, or if the worker is gone.
        """
        timeout = self._timeout if timeout_s is None else seconds("timeout_s", timeout_s,
                                                                    zero=True)
        deadline = time.monotonic() + timeout
        with self._lock:
            if not self._queue and not self.in_flight:
                return True
            if self._stopped:
                return False
            if self._worker is None:  # its thread could not be started so far: try again
                self._start()
            worker = self._worker
            if worker is None:
                return False
            self._flush_requests += 1
            ticket = self._flush_requests
            self._cond.notify_all()
            if timeout == 0 or (not wait_if_unhealthy and not self._healthy):
                return False
            while self._flushed < ticket:
                left = deadline - time.monotonic()
                if self._stopped:
                    return False
                if self._worker is not worker or not worker.is_alive():
                    # the worker ended (an exporter's SystemExit, KeyboardInterrupt or
                    # CancelledError, logged there): nothing will export these now
                    return False
                if left <= 0:
                    self._healthy = False
                    warn = self._logged.first("slow")
                    break
                try:
                    self._cond.wait(left)
                except BaseException:  # a signal's exception (Ctrl-C) on the training
                    # thread, maybe between wait() releasing the lock and taking it
                    # back: held again, so leaving the with block releases it
                    if not self._lock._is_owned():  # type: ignore[attr-defined]
                        self._lock.acquire()
                    raise
            else:
                return True
        if warn:
            _log.warning(
                "commspan: %s did not finish exporting within %.2f s; leaving the mode "
                "no longer waits for it until an export succeeds (spans keep being "
                "exported in the background and counted in mode.stats())",
                self._name, timeout,
            )
        return False

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        """``SpanProcessor.force_flush``: :meth:`flush` with a timeout in milliseconds."""
        if timeout_millis is not None and (
                isinstance(timeout_millis, bool) or not isinstance(timeout_millis, (int, float))
                or not timeout_millis >= 0):
            raise ValueError(f"timeout_millis={timeout_millis!r} is not valid; pass a number "
                             "of milliseconds, 0 or more")
        return self.flush(None if timeout_millis is None else timeout_millis / 1000)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush, stop the worker and shut the exporter down, all within ``timeout_s``.

        Afterwards nothing is pending or in flight: spans still queued are
        counted as dropped, and a batch inside an export call that has not
        returned is abandoned (its daemon thread is left to finish) and counted
        as failed. Either loss is logged once. Calling it again, or from
        another thread while the first call runs, waits for the first call to
        finish (at most its own ``timeout_s``) and does nothing more. At
        interpreter exit the queues nobody shut down are flushed, within
        ``export_timeout_s`` and while their exporter keeps finishing batches
        (a dead backend is given up on after 2.5 s without progress), and shut down.

        Args:
            timeout_s: bound on the whole shutdown, in seconds; default
                ``export_timeout_s``.
        """
        timeout = self._timeout if timeout_s is None else seconds("timeout_s", timeout_s,
                                                                    zero=True)
        with self._lock:
            closing = self._closing
            self._closing = True
            self._logged.mark("slow")  # a slow flush here is reported as shutdown's loss
        if closing:  # another call is shutting down: it settles everything, wait for it
            self._closed.wait(timeout)
            return
        try:
            self._shutdown(timeout)
        finally:
            self._closed.set()

    def _shutdown(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        with self._lock:
            self._stopped = True
            unsent = len(self._queue)
            self._queue.clear()
            self.dropped += unsent
            self._cond.notify_all()
        worker = self._worker
        if worker is not None:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        closer = threading.Thread(
            target=self._shutdown_exporter, name=f"commspan-shutdown-{self._name}", daemon=True
        )
        try:
            closer.start()
        except RuntimeError:  # no new threads at interpreter exit (Python 3.12.0-3.12.2)
            self._shutdown_exporter()
        else:
            closer.join(timeout=max(0.05, deadline - time.monotonic()))
        if closer.is_alive():
            _log.warning(
                "commspan: %s.shutdown() did not return within the %.2f s shutdown "
                "budget; it is left running in a daemon thread", self._name, timeout,
            )
        if worker is not None:  # shutting the exporter down may have ended a stuck export
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            abandoned = self.in_flight
            if abandoned:
                self._abandoned_batch = self._batch
                self.in_flight = 0
                self.failed += abandoned
                self.abandoned += abandoned
        if abandoned or unsent:
            _log.warning(
                "commspan: shutting %s down within %.2f s lost %d spans inside an export "
                "call that did not return (counted as failed) and %d spans not yet sent "
                "(counted as dropped); see mode.stats()", self._name, timeout, abandoned, unsent,
            )

    def _settle_at_exit(self) -> None:
        """:func:`_at_exit` for this queue: flush while batches keep finishing, within
        ``export_timeout_s``, then shut down at once."""
        deadline = time.monotonic() + self._timeout
        while not self._closing:
            with self._lock:
                done = self.exported + self.failed
                if not self._queue and not self.in_flight:
                    break
            left = deadline - time.monotonic()
            if left <= 0 or self.flush(min(left, _EXIT_SLICE_S)):
                break
            with self._lock:
                if self.exported + self.failed == done:  # nothing finished: a dead end
                    break
        self.shutdown(0.0)

    def _shutdown_exporter(self) -> None:
        outer = _ON_EXPORT_THREAD.queue  # (the caller's thread when no thread could start)
        _ON_EXPORT_THREAD.queue = self
        try:
            self.exporter.shutdown()
        except Exception:
            _log.warning("commspan: %s.shutdown() raised", self._name, exc_info=True)
        finally:
            _ON_EXPORT_THREAD.queue = outer

    def _first_of(self, record: logging.LogRecord) -> bool:
        """Whether ``record``, emitted by the exporter on this queue's threads, is the
        first of its message (else it is counted in :attr:`quieted`). Messages are
        told apart by their format string, and errors also by their text, up to
        :data:`_ERROR_TEXTS` texts per format string: a later failure of another kind
        (an endpoint up again that answers 401, gRPC's UNAUTHENTICATED after
        UNAVAILABLE) is shown too, and texts that differ every time (addresses,
        times) do not flood."""
        text = None
        if record.levelno >= logging.ERROR:
            try:
                text = record.getMessage()
            except Exception:  # (arguments its format does not take: shown once)
                pass
        key = (record.name, str(record.msg))
        with self._lock:  # (its worker and its shutdown thread may both log)
            texts = self._shown.get(key)
            if texts is None:
                self._shown[key] = {text} if text is not None else set()
                return True
            if text is not None and text not in texts and len(texts) < _ERROR_TEXTS:
                texts.add(text)
                return True
            self.quieted += 1
            return False

    def stats(self) -> ExportStats:
        """Counters of this queue, taken together (see :class:`ExportStats`).

        Returns:
            A snapshot in which ``handed == exported + dropped + failed +
            pending + in_flight``.
        """
        with self._lock:
            return ExportStats(
                exporter=self._name,
                handed=self.handed,
                queued=self.queued,
                exported=self.exported,
                dropped=self.dropped,
                failed=self.failed,
                abandoned=self.abandoned,
                pending=len(self._queue),
                in_flight=self.in_flight,
                healthy=self._healthy,
                quieted=self.quieted,
            )

    def _after_fork_in_child(self) -> None:
        """In a child forked from the process that made this queue: its worker thread
        and lock holder did not come along. The spans still queued are the parent's
        (which exports them): forgotten here, and no longer counted. The child
        exports nothing; what it records is dropped and counted."""
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._logged = Once()  # (its lock may have been held by a thread left behind)
        gone = len(self._queue) + self.in_flight
        self._queue.clear()
        self.handed -= gone
        self.queued -= gone
        self.in_flight = 0
        self._batch = 0
        self._worker = None
        self._stopped = True
        self._forked = True
        self._flushed = self._flush_requests

    # ------------------------------------------------------------ worker
    def _start(self) -> None:
        """Start the worker (called with the lock held). When no thread can be
        started (a thread limit, an interpreter shutting down), the spans stay
        queued, counted as pending, and the next span or flush tries again."""
        worker = threading.Thread(
            target=self._run, name=f"commspan-export-{self._name}", daemon=True
        )
        try:
            worker.start()
        except RuntimeError:
            if self._logged.first("thread"):
                _log.warning(
                    "commspan: could not start the export thread of %s; its spans stay "
                    "queued (pending in mode.stats()) and starting it is tried again "
                    "with the next span", self._name, exc_info=True)
            return
        self._worker = worker

    def _run(self) -> None:
        token = attach(set_value(_SUPPRESS, True))
        _ON_EXPORT_THREAD.queue = self
        try:
            while True:
                with self._lock:
                    if not self._stopped and len(self._queue) < self._max_batch and (
                        self._flushed >= self._flush_requests
                    ):
                        self._cond.wait(self._delay)
                    if self._stopped:
                        return
                    ticket = self._flush_requests
                    todo = len(self._queue)
                if not self._drain(todo):
                    return
                with self._lock:
                    if ticket > self._flushed:
                        self._flushed = ticket
                        self._cond.notify_all()
        finally:
            detach(token)
            _ON_EXPORT_THREAD.queue = None
            with self._lock:  # ended (stopped, or an exporter's SystemExit): the next
                # span or flush starts a new worker unless the queue is stopped; a flush
                # waiting on this one learns it at once
                if self._worker is threading.current_thread():
                    self._worker = None
                self._cond.notify_all()

    def _drain(self, todo: int) -> bool:
        """Export ``todo`` spans from the queue's head; ``False`` once stopped."""
        while todo > 0:
            with self._lock:
                if self._stopped:
                    return False
                n = min(todo, len(self._queue), self._max_batch)
                if n == 0:
                    return True
                batch = [self._queue.popleft() for _ in range(n)]
                self._batch += 1
                number = self._batch
                self.in_flight = n
            todo -= n
            try:
                for span in batch:  # held back at build, off the training thread
                    add_timing(span)
                result = self.exporter.export(batch)
            except BaseException as exc:
                self._settle(number, n, "raised", exc)
                if not isinstance(exc, Exception):  # SystemExit & co end the thread
                    if self._logged.first("exit"):
                        _log.warning(
                            "commspan: %s.export raised %s, which ends its export thread; "
                            "a new one starts with the next span or flush (not logged "
                            "again)", self._name, type(exc).__name__)
                    # ended here, not by raising on: logged above, and no traceback of
                    # the thread's on the user's stderr
                    return False
                continue
            if result is SpanExportResult.SUCCESS:
                self._settle(number, n, "", rejected=self._take_rejected(n))
            else:
                self._settle(number, n, f"returned {getattr(result, 'name', result)}")
        return True

    def _take_rejected(self, n: int) -> tuple[int, str]:
        """Spans of the batch just exported that the backend rejected (an exporter with
        ``take_rejected``: commspan's OTLP/HTTP one reads OTLP partial success)."""
        take = getattr(self.exporter, "take_rejected", None)
        if take is None:
            return 0, ""
        try:
            count, message = take()
            return max(0, min(n, int(count))), str(message)
        except Exception:
            return 0, ""

    def _settle(self, number: int, n: int, how: str, exc: BaseException | None = None,
                rejected: tuple[int, str] = (0, "")) -> None:
        """Count the result of batch ``number`` (``how`` empty: SUCCESS, of which the
        backend may have ``rejected`` some spans, counted as failed)."""
        with self._lock:
            if number == self._abandoned_batch:
                # shutdown already counted it as failed; a late result changes nothing
                _log.debug("commspan: an abandoned %s.export returned late (%s)",
                           self._name, how or "SUCCESS")
                return
            self.in_flight = 0
            if not how:
                self.exported += n - rejected[0]
                self.failed += rejected[0]
                self._healthy = True
                warn = rejected[0] > 0 and self._logged.first("rejected")
            else:
                self.failed += n
                self._healthy = False
                warn = self._logged.first("fail")
        if not how:
            if warn:
                _log.warning(
                    "commspan: the backend of %s accepted a batch but rejected %d of its %d "
                    "spans (OTLP partial success: %s); they are counted as failed in "
                    "mode.stats() (further rejections are counted, not logged)",
                    self._name, rejected[0], n, rejected[1] or "no message")
            return
        if warn:
            _log.warning(
                "commspan: %s.export %s; %d spans lost (further failures are counted "
                "in mode.stats(), not logged, and repeats of the exporter's own messages "
                "are not shown; leaving the mode no longer waits for this exporter until "
                "an export succeeds)", self._name, how, n, exc_info=exc,
            )
