"""Export off the training thread: a bounded queue and one worker per exporter.

:class:`ExportQueue` is a span processor. ``on_end`` appends the span to a
bounded queue and returns; a daemon thread hands batches to the wrapped
:class:`~opentelemetry.sdk.trace.export.SpanExporter`. A full queue drops the
span and counts it; an exporter that raises or reports failure is logged once
and counted. Nothing here ever raises into the caller's step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from opentelemetry.context import attach, detach, set_value
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["ExportQueue", "ExportStats"]

_log = logging.getLogger(__name__)

try:  # the SDK's key that tells instrumentations not to trace export work
    from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY as _SUPPRESS
except ImportError:  # pragma: no cover
    _SUPPRESS = "suppress_instrumentation"  # type: ignore[assignment]


class ExportStats(dict):  # type: ignore[type-arg]
    """Counters of one exporter: ``queued``, ``exported``, ``dropped``, ``failed``,
    ``pending`` and ``in_flight``; ``queued == exported + dropped-after-queueing +
    failed + pending + in_flight``."""


class ExportQueue(SpanProcessor):
    """Batches spans to ``exporter`` from a background thread.

    Args:
        exporter: any OpenTelemetry ``SpanExporter``.
        max_queue_size: spans held at most; more are dropped and counted.
        max_batch_size: spans per ``export`` call.
        schedule_delay_s: how long the worker waits for a batch to fill.
        export_timeout_s: bound on how long ``force_flush``/``shutdown`` wait.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        max_queue_size: int = 65536,
        max_batch_size: int = 4096,
        schedule_delay_s: float = 0.5,
        export_timeout_s: float = 10.0,
    ) -> None:
        for name, value in (("max_queue_size", max_queue_size),
                            ("max_batch_size", max_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not valid; pass a positive int")
        if schedule_delay_s <= 0 or export_timeout_s <= 0:
            raise ValueError(
                f"schedule_delay_s={schedule_delay_s!r}, export_timeout_s="
                f"{export_timeout_s!r}: both must be positive numbers of seconds"
            )
        self.exporter = exporter
        self._max_queue = max_queue_size
        self._max_batch = max_batch_size
        self._delay = schedule_delay_s
        self._timeout = export_timeout_s
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._flush_requests = 0
        self._flushed = 0
        self._busy = False
        self._stopped = False
        self._worker: threading.Thread | None = None
        self.queued = 0
        self.in_flight = 0
        self.exported = 0
        self.dropped = 0
        self.failed = 0
        self._warned_drop = False
        self._warned_fail = False

    # ------------------------------------------------------------ processor API
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        """Nothing to do when a span starts."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue ``span`` for export; drop and count it if the queue is full."""
        if self._stopped:
            self._drop(1)
            return
        queue = self._queue
        if len(queue) >= self._max_queue:
            self._drop(1)
            return
        queue.append(span)
        self.queued += 1
        if self._worker is None:
            self._start()
        elif len(queue) >= self._max_batch:
            with self._cond:
                self._cond.notify()

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        """Wait until everything queued so far is exported, or the timeout passes."""
        if self._worker is None:
            return True
        timeout = self._timeout if timeout_millis is None else timeout_millis / 1000
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flush_requests += 1
            ticket = self._flush_requests
            self._cond.notify_all()
            while self._flushed < ticket:
                left = deadline - time.monotonic()
                if left <= 0 or not self._worker.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush, stop the worker and shut the exporter down, all within ``timeout_s``.

        A worker stuck in an exporter that never returns is abandoned (it is a
        daemon thread); what is still queued then is counted as dropped.
        """
        if self._stopped:
            return
        timeout = self._timeout if timeout_s is None else max(0.0, timeout_s)
        deadline = time.monotonic() + timeout
        self.force_flush(int(timeout * 1000))
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=max(0.0, deadline - time.monotonic()))
        left = len(self._queue)
        if left:
            self._queue.clear()
            self._drop(left)
        closer = threading.Thread(
            target=self._shutdown_exporter, name="commspan-export-shutdown", daemon=True
        )
        closer.start()
        closer.join(timeout=max(0.05, deadline - time.monotonic()))

    def _shutdown_exporter(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception:
            self._fail(0, "shutdown raised")

    def stats(self) -> ExportStats:
        """Counters: spans queued, exported, dropped (queue full / unflushed), failed,
        pending (still queued) and in_flight (inside an export call that has not returned)."""
        return ExportStats(
            exporter=type(self.exporter).__name__,
            queued=self.queued,
            exported=self.exported,
            dropped=self.dropped,
            failed=self.failed,
            pending=len(self._queue),
            in_flight=self.in_flight,
        )

    # ------------------------------------------------------------ worker
    def _start(self) -> None:
        with self._cond:
            if self._worker is not None:
                return
            self._worker = threading.Thread(
                target=self._run, name=f"commspan-export-{type(self.exporter).__name__}",
                daemon=True,
            )
            self._worker.start()

    def _run(self) -> None:
        token = attach(set_value(_SUPPRESS, True))
        try:
            while True:
                with self._cond:
                    if not self._stopped and len(self._queue) < self._max_batch and (
                        self._flushed >= self._flush_requests
                    ):
                        self._cond.wait(self._delay)
                    if self._stopped:
                        return
                    ticket = self._flush_requests
                self._drain()
                with self._cond:
                    if ticket > self._flushed:
                        self._flushed = ticket
                        self._cond.notify_all()
        finally:
            detach(token)

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            n = min(len(queue), self._max_batch)
            batch = [queue.popleft() for _ in range(n)]
            self.in_flight = len(batch)
            try:
                result = self.exporter.export(batch)
            except Exception:
                self.in_flight = 0
                self._fail(len(batch), "raised")
                continue
            self.in_flight = 0
            if result is SpanExportResult.SUCCESS:
                self.exported += len(batch)
            else:
                self._fail(len(batch), "returned FAILURE")

    def _drop(self, n: int) -> None:
        self.dropped += n
        if not self._warned_drop:
            self._warned_drop = True
            _log.warning(
                "commspan: export queue of %s is full or stopped; dropping spans "
                "(counted in mode.stats(), not logged again)", type(self.exporter).__name__
            )

    def _fail(self, n: int, how: str) -> None:
        self.failed += n
        if not self._warned_fail:
            self._warned_fail = True
            _log.warning(
                "commspan: %s.export %s; %d spans lost (further failures are counted "
                "in mode.stats(), not logged)", type(self.exporter).__name__, how, n,
                exc_info=how == "raised",
            )
