"""Exporters that fail, raise or hang never break the training step or hang the mode.

Each exporter gets a background queue (``commspan.exporters.queue.ExportQueue``); these
tests drive it through ``CommSpanMode(exporters=[...])`` with misbehaving
exporters and check the step result, the time the mode takes to leave, the
counters in ``mode.stats()`` and that each kind of trouble is logged once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from _accounting import assert_nothing_lost
from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, get_value
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from torch import nn

from commspan import CommSpanMode
from commspan.exporters.queue import ExportQueue

SLACK_S = 0.5  # scheduling slack on a loaded 2-core machine


class RaisingExporter(SpanExporter):
    """Raises from every export call."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise RuntimeError("collector is down")


class FailingExporter(SpanExporter):
    """Returns FAILURE from every export call."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        return SpanExportResult.FAILURE


class BlockingExporter(SpanExporter):
    """Blocks in export until ``release`` is set (the tests never set it before asserting)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.returned = threading.Event()
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self.entered.set()
        self.release.wait()
        self.returned.set()
        return SpanExportResult.SUCCESS


class RecordingExporter(SpanExporter):
    """Keeps the spans and notes the thread and OTel context each export ran in."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []
        self.threads: set[str] = set()
        self.suppressed: list[Any] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        self.threads.add(threading.current_thread().name)
        self.suppressed.append(get_value(_SUPPRESS_INSTRUMENTATION_KEY))
        return SpanExportResult.SUCCESS


@pytest.fixture()
def blocking() -> Iterator[BlockingExporter]:
    """A blocking exporter, released after the test so its worker thread can end."""
    exporter = BlockingExporter()
    yield exporter
    exporter.release.set()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(mode: CommSpanMode, steps: int, flush_between: bool = False) -> list[float]:
    """Run ``steps`` traced steps inside ``mode`` (already entered); return the losses."""
    model = _model()
    losses = []
    for i in range(steps):
        with mode.step(i):
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            losses.append(float(loss.detach()))
        if flush_between:
            mode.flush(2.0)
    return losses


def _warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING
        and r.name.startswith("commspan")
        and needle in r.getMessage()
    ]


def _reference_losses(steps: int) -> list[float]:
    model = _model()
    out = []
    for _ in range(steps):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        out.append(float(loss.detach()))
    return out


def test_raising_exporter_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """An exporter that always raises: steps run, every span counts as failed, one log line."""
    caplog.set_level(logging.WARNING)
    exporter = RaisingExporter()
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        losses = _train(mode, 3, flush_between=True)
    assert losses == _reference_losses(3)
    stats = mode.stats()
    assert exporter.calls >= 3
    assert stats["spans"] > 0
    assert stats["spans_failed"] == stats["spans"]
    assert stats["exporters"][0]["failed"] == stats["spans"]
    assert stats["exporters"][0]["exported"] == 0
    assert len(_warnings(caplog, "RaisingExporter")) == 1


def test_failing_exporter_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """An exporter that returns FAILURE: steps run, every span counts as failed, one log line."""
    caplog.set_level(logging.WARNING)
    exporter = FailingExporter()
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        losses = _train(mode, 3, flush_between=True)
    assert losses == _reference_losses(3)
    stats = mode.stats()
    assert exporter.calls >= 3
    assert stats["spans_failed"] == stats["spans"] > 0
    assert stats["spans_dropped"] == 0
    assert len(_warnings(caplog, "FailingExporter")) == 1


def test_blocking_exporter_exit_bounded_by_flush_timeout(blocking: BlockingExporter) -> None:
    """With an exporter that never returns, leaving the mode takes about flush_timeout_s."""
    timeout = 0.5
    mode = CommSpanMode(exporters=[blocking], flush_timeout_s=timeout)
    with mode:
        losses = _train(mode, 2)
        t0 = time.monotonic()
        ok = mode.flush(0.2)
        flush_s = time.monotonic() - t0
        assert blocking.entered.wait(5.0)
        t_exit = time.monotonic()
    exit_s = time.monotonic() - t_exit
    assert losses == _reference_losses(2)
    assert ok is False and flush_s < 0.2 + SLACK_S
    assert exit_s < timeout + SLACK_S
    assert mode.flush(0.1) is False
    assert mode.stats()["exporters"][0]["exported"] == 0


def test_two_blocking_exporters_share_one_deadline() -> None:
    """Two hanging exporters: leaving the mode still takes about one flush_timeout_s in total."""
    exporters = [BlockingExporter(), BlockingExporter()]
    timeout = 0.5
    try:
        mode = CommSpanMode(exporters=list(exporters), flush_timeout_s=timeout)
        with mode:
            _train(mode, 1)
            t_exit = time.monotonic()
        assert time.monotonic() - t_exit < timeout + SLACK_S
    finally:
        for e in exporters:
            e.release.set()


def test_full_queue_drops_and_counts(
    blocking: BlockingExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A queue of 4 behind a hung exporter drops the overflow, counts it and logs it once."""
    caplog.set_level(logging.WARNING)
    size = 4
    mode = CommSpanMode(exporters=[blocking], export_queue_size=size, flush_timeout_s=0.2)
    with mode:
        _train(mode, 3)
        mode.flush(0.2)
        _train(mode, 2)
    stats = mode.stats()
    queue = stats["exporters"][0]
    assert stats["spans"] > 2 * size
    assert queue["queued"] + queue["dropped"] == stats["spans"]
    # at most one full queue waits and one batch (taken from it) is in flight
    assert queue["queued"] <= 2 * size
    assert stats["spans_dropped"] == queue["dropped"] >= stats["spans"] - 2 * size
    assert len(_warnings(caplog, "full")) == 1


def test_shutdown_bounded_by_timeout(blocking: BlockingExporter) -> None:
    """mode.shutdown(timeout_s) returns within about timeout_s even if an exporter hangs."""
    mode = CommSpanMode(exporters=[blocking], flush_timeout_s=0.2)
    with mode:
        _train(mode, 1)
    assert blocking.entered.wait(5.0)
    t0 = time.monotonic()
    mode.shutdown(timeout_s=0.2)
    assert time.monotonic() - t0 < 0.2 + SLACK_S


def test_exporter_runs_off_the_step_thread_with_instrumentation_suppressed() -> None:
    """Export runs on a worker thread with OTel's suppress key set, and every span arrives."""
    exporter = RecordingExporter()
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        _train(mode, 2)
    stats = mode.stats()
    assert len(exporter.spans) == stats["spans"] == stats["exporters"][0]["exported"] > 0
    assert threading.current_thread().name not in exporter.threads
    assert exporter.suppressed and all(v is True for v in exporter.suppressed)


class _RaisingProcessor(SpanProcessor):
    def __init__(self) -> None:
        self.calls = 0

    def on_end(self, span: ReadableSpan) -> None:
        self.calls += 1
        raise ValueError("processor bug")


def test_raising_span_processor_never_breaks_step(caplog: pytest.LogCaptureFixture) -> None:
    """A TracerProvider processor that always raises: steps run, errors counted, one log line."""
    caplog.set_level(logging.WARNING)
    processor = _RaisingProcessor()
    provider = TracerProvider()
    provider.add_span_processor(processor)
    mode = CommSpanMode(tracer_provider=provider)
    with mode:
        losses = _train(mode, 2)
    assert losses == _reference_losses(2)
    stats = mode.stats()
    assert processor.calls == stats["spans"] > 0
    assert stats["processor_errors"] == stats["spans"]
    assert len(_warnings(caplog, "processor")) == 1
    assert mode.aggregator is not None and mode.aggregator.modules()


# ------------------------------------------------------------------ more exporters
class SlowExporter(RecordingExporter):
    """Succeeds after ``delay_s`` per export call."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        time.sleep(self.delay_s)
        return super().export(spans)


class HangingShutdownExporter(RecordingExporter):
    """Exports at once; ``shutdown`` blocks until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def shutdown(self) -> None:
        self.release.wait()


class StuckThenHealthyExporter(RecordingExporter):
    """The first export blocks until ``release`` is set; every export then succeeds."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait()
        return super().export(spans)


def _blocks(mode: CommSpanMode, blocks: int) -> list[float]:
    """Run one step in each of ``blocks`` separate ``with mode:`` blocks; return the
    seconds each exit took."""
    model = _model()
    exits = []
    for i in range(blocks):
        with mode:
            with mode.step(i):
                model(torch.ones(2, 4)).sum().backward()
            t0 = time.monotonic()
        exits.append(time.monotonic() - t0)
    return exits


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ------------------------------------------------------------------ nothing lost silently
FAULTS = ["healthy", "raising", "failure", "hanging", "slow_full_queue", "shutdown_hangs"]


@pytest.mark.parametrize("fault", FAULTS)
def test_every_span_is_exported_dropped_or_failed_after_shutdown(fault: str) -> None:
    """Under each exporter fault, after shutdown: handed == exported + dropped + failed,
    nothing pending or in flight, and the totals in mode.stats() add up."""
    exporter: SpanExporter
    queue_size = 65536
    if fault == "healthy":
        exporter = RecordingExporter()
    elif fault == "raising":
        exporter = RaisingExporter()
    elif fault == "failure":
        exporter = FailingExporter()
    elif fault == "hanging":
        exporter = BlockingExporter()
    elif fault == "slow_full_queue":
        exporter, queue_size = SlowExporter(0.05), 4
    else:
        exporter = HangingShutdownExporter()
    try:
        mode = CommSpanMode(
            exporters=[exporter], export_queue_size=queue_size, flush_timeout_s=0.3
        )
        _blocks(mode, 4)
        t0 = time.monotonic()
        mode.shutdown(timeout_s=0.5)
        assert time.monotonic() - t0 < 0.5 + SLACK_S
        st = assert_nothing_lost(mode)
    finally:
        if hasattr(exporter, "release"):
            exporter.release.set()
    (exp,) = st["exporters"]
    assert st["spans"] > 0
    if fault in ("healthy", "shutdown_hangs"):
        assert exp["exported"] == st["spans"] == len(exporter.spans)  # type: ignore[attr-defined]
    elif fault in ("raising", "failure"):
        assert exp["failed"] == st["spans"]
    elif fault == "hanging":
        assert exp["exported"] == 0 and exp["abandoned"] > 0
        assert exp["failed"] == exp["abandoned"] and exp["dropped"] == st["spans"] - exp["failed"]
    else:
        assert exp["dropped"] > 0 and exp["exported"] == len(exporter.spans) > 0  # type: ignore[attr-defined]


def test_stuck_export_is_counted_as_failed_at_shutdown_and_logged_once(
    blocking: BlockingExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """An export that never returns is abandoned by shutdown: its spans count as failed
    (and abandoned), in_flight is 0, one warning says so, and a late result changes nothing."""
    caplog.set_level(logging.WARNING)
    mode = CommSpanMode(exporters=[blocking], flush_timeout_s=0.2)
    with mode:
        _train(mode, 2)
    assert blocking.entered.wait(5.0)
    mode.shutdown(timeout_s=0.2)
    st = assert_nothing_lost(mode)
    (exp,) = st["exporters"]
    assert exp["in_flight"] == 0 and exp["abandoned"] > 0
    assert st["spans_failed"] + st["spans_dropped"] == st["spans"]
    assert len(_warnings(caplog, "did not return")) == 1
    caplog.set_level(logging.DEBUG, logger="commspan.exporters.queue")
    blocking.release.set()  # the abandoned call now returns SUCCESS, too late to count
    assert _wait_for(lambda: any("returned late (SUCCESS)" in r.getMessage()
                                 for r in caplog.records))
    assert mode.stats()["exporters"][0] == exp
    mode.shutdown(timeout_s=0.2)  # a second shutdown changes nothing and logs nothing
    assert mode.stats()["exporters"][0] == exp
    assert len(_warnings(caplog, "did not return")) == 1


def test_exporter_whose_shutdown_hangs_is_left_behind_within_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """exporter.shutdown() that never returns: mode.shutdown still returns in its budget,
    says so once, and every span is counted as exported."""
    caplog.set_level(logging.WARNING)
    exporter = HangingShutdownExporter()
    try:
        mode = CommSpanMode(exporters=[exporter], flush_timeout_s=1.0)
        with mode:
            _train(mode, 2)
        t0 = time.monotonic()
        mode.shutdown(timeout_s=0.3)
        assert time.monotonic() - t0 < 0.3 + SLACK_S
        st = assert_nothing_lost(mode)
        assert st["spans_exported"] == st["spans"] == len(exporter.spans)
        assert len(_warnings(caplog, "shutdown() did not return")) == 1
    finally:
        exporter.release.set()


def test_counters_add_up_with_spans_from_many_threads_and_a_racing_shutdown() -> None:
    """Spans ended on 4 threads at once into a small queue while the worker exports and
    shutdown stops it: every span is counted exactly once, and ``exported`` is exactly
    what the exporter received."""
    exporter = SlowExporter(0.001)
    queue = ExportQueue(exporter, max_queue_size=64, max_batch_size=16, schedule_delay_s=0.01)
    per_thread = 3000
    started = threading.Barrier(5)

    def produce() -> None:
        started.wait()
        for _ in range(per_thread):
            queue.on_end(object())  # type: ignore[arg-type]

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)
    queue.shutdown(0.2)  # races the producers: later spans are dropped as "stopped"
    for t in threads:
        t.join()
    st = queue.stats()
    assert st["handed"] == 4 * per_thread
    assert st.unaccounted == 0 and st["pending"] == 0 and st["in_flight"] == 0
    assert st["exported"] == len(exporter.spans) > 0
    assert st["dropped"] > 0


# ------------------------------------------------------------------ leaving the mode
def test_exit_does_not_wait_again_for_a_stuck_exporter_until_it_recovers() -> None:
    """A stuck export makes the first exit wait flush_timeout_s, not the following ones;
    once an export succeeds, leaving the mode waits for the exporter again."""
    exporter = StuckThenHealthyExporter()
    timeout = 1.0
    try:
        mode = CommSpanMode(exporters=[exporter], flush_timeout_s=timeout)
        exits = _blocks(mode, 4)
        assert exits[0] >= timeout * 0.9  # the first exit waited: the exporter was healthy
        # today each exit waits flush_timeout_s again: 3 s for these three
        assert sum(exits[1:]) < timeout, exits
        assert mode.stats()["exporters"][0]["healthy"] is False
    finally:
        exporter.release.set()
    assert _wait_for(lambda: mode.stats()["exporters"][0]["healthy"])
    _blocks(mode, 1)
    st = mode.stats()["exporters"][0]
    assert st["exported"] == st["handed"] == len(exporter.spans)  # the exit flushed
    mode.shutdown(timeout_s=1.0)
    assert_nothing_lost(mode)


def test_exit_after_export_failures_does_not_wait() -> None:
    """After an export returned FAILURE, leaving the mode only asks for a flush."""
    exporter = FailingExporter()
    mode = CommSpanMode(exporters=[exporter], flush_timeout_s=1.0)
    _blocks(mode, 1)
    assert mode.stats()["exporters"][0]["healthy"] is False
    with mode:
        _train(mode, 1)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < SLACK_S
    assert mode.flush(1.0) is True  # an explicit flush still waits
    mode.shutdown(timeout_s=1.0)
    assert assert_nothing_lost(mode)["spans_failed"] == mode.stats()["spans"]


def test_exit_waits_for_a_slow_healthy_exporter() -> None:
    """A slow but working exporter: every span is exported by the time each exit returns."""
    exporter = SlowExporter(0.2)
    mode = CommSpanMode(exporters=[exporter], flush_timeout_s=5.0)
    model = _model()
    for i in range(3):
        with mode, mode.step(i):
            model(torch.ones(2, 4)).sum().backward()
        assert len(exporter.spans) == mode.stats()["spans"]
    mode.shutdown(timeout_s=1.0)
    assert_nothing_lost(mode)


def test_flush_in_seconds_force_flush_in_milliseconds(blocking: BlockingExporter) -> None:
    """ExportQueue.flush takes seconds; force_flush keeps the SpanProcessor signature in ms."""
    queue = ExportQueue(blocking, schedule_delay_s=0.01)
    queue.on_end(object())  # type: ignore[arg-type]
    assert blocking.entered.wait(5.0)
    for call in (lambda: queue.flush(0.3), lambda: queue.force_flush(300)):
        t0 = time.monotonic()
        assert call() is False
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 0.3 + SLACK_S
    assert queue.healthy is False
    blocking.release.set()
    assert _wait_for(lambda: queue.healthy)
    queue.shutdown(1.0)
    assert queue.stats()["exported"] == 1


def test_a_hung_exporter_does_not_cost_another_its_spans_at_shutdown(
    blocking: BlockingExporter,
) -> None:
    """Shutdown with a hung exporter listed first: the second exporter still gets every
    span (its worker is started at once, not after the first one's budget is spent)."""
    recording = RecordingExporter()
    mode = CommSpanMode(exporters=[blocking, recording], flush_timeout_s=5.0)
    model = _model()
    with mode:
        with mode.step(0):
            model(torch.ones(2, 4)).sum().backward()
        # shut down before leaving, so no exit flush has sent anything yet
        mode.shutdown(timeout_s=0.3)
    st = assert_nothing_lost(mode)
    hung, ok = st["exporters"]
    assert ok["exported"] == len(recording.spans) == st["spans"], st
    assert hung["failed"] + hung["dropped"] == st["spans"]


def test_flush_without_waiting_exports_what_is_queued_without_the_schedule() -> None:
    """``flush(0.0)`` has the worker export what is queued at once, without waiting for
    the schedule (here a minute) or in the caller; spans queued after it wait."""
    from opentelemetry.trace import SpanContext

    exporter = RecordingExporter()
    queue = ExportQueue(exporter, schedule_delay_s=60.0)
    try:
        queue.flush(0.0)  # before the worker exists: nothing to do, nothing breaks
        for i in range(3):
            queue.on_end(ReadableSpan(f"a{i}", SpanContext(1, 1 + i, False)))
        time.sleep(0.3)
        assert exporter.spans == []  # the schedule would take a minute
        t0 = time.monotonic()
        queue.flush(0.0)
        assert time.monotonic() - t0 < 0.5  # the caller does not wait for the export
        assert _wait_for(lambda: len(exporter.spans) == 3, timeout_s=5.0)
        queue.on_end(ReadableSpan("b", SpanContext(1, 9, False)))
        time.sleep(0.3)
        assert len(exporter.spans) == 3
        queue.flush(0.0)
        assert _wait_for(lambda: len(exporter.spans) == 4, timeout_s=5.0)
        assert [s.name for s in exporter.spans] == ["a0", "a1", "a2", "b"]
    finally:
        queue.shutdown(1.0)
    assert queue.stats().unaccounted == 0


def test_a_step_is_exported_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CommSpanMode`` starts its export queues when a trace ends: a step's spans reach
    the exporter without a flush, though the queue's schedule is a minute."""
    import functools

    from commspan.session import mode as mode_module

    monkeypatch.setattr(mode_module, "ExportQueue",
                        functools.partial(ExportQueue, schedule_delay_s=60.0))
    exporter = RecordingExporter()
    mode = CommSpanMode(exporters=[exporter])
    model = _model()
    with mode:
        with mode.step(0):
            model(torch.randn(2, 4))
        assert _wait_for(lambda: any(s.parent is None for s in exporter.spans), timeout_s=5.0)
        n = len(exporter.spans)
        assert n == mode.stats()["spans"] > 1
    mode.shutdown()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_drops_and_counts_what_it_records() -> None:
    """The export thread does not survive fork: a child's spans used to wait forever
    (pending), and the parent's queued spans would have been exported twice. The
    child forgets the parent's, drops its own with a count, and its flush returns."""
    import json
    import os

    exporter = RecordingExporter()
    queue = ExportQueue(exporter, schedule_delay_s=30.0)
    queue.on_end(ReadableSpan("before fork"))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no torch, only the queue
        code = 1
        try:
            queue.on_end(ReadableSpan("in the child"))
            flushed = queue.flush(1.0)
            stats = dict(queue.stats())
            os.write(write_end, json.dumps({"flushed": flushed, **stats}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        child = json.loads(fh.read())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child["flushed"] is True
    assert (child["handed"], child["dropped"], child["pending"], child["in_flight"]) == (
        1, 1, 0, 0)
    assert child["handed"] == (child["exported"] + child["dropped"] + child["failed"]
                               + child["pending"] + child["in_flight"])
    queue.shutdown(5.0)
    assert [s.name for s in exporter.spans] == ["before fork"]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_child_forked_while_other_threads_hold_commspan_locks_does_not_block(
    tmp_path: Any,
) -> None:
    """fork() copies the forking thread only: a lock another thread held then (the
    export thread writing, a watchdog's hang record, a reader of the counts) stayed
    held in the child, and the child's next traced step blocked forever (a
    DataLoader worker forked inside the mode). The child gets unheld locks."""
    import json
    import os

    from commspan.exporters import JsonlSpanExporter
    from commspan.spans import timing

    exporter = JsonlSpanExporter(tmp_path / "t.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    model = _model()
    child_only = torch.nn.Identity()
    x = torch.randn(2, 4)
    held, release = threading.Event(), threading.Event()
    with mode:
        with mode.step(0):
            model(x)
        assert mode.aggregator is not None
        modules = mode.aggregator.modules()
        locks = {
            "recorder": mode._recorder._emit_lock,
            "jsonl": exporter._lock,
            "aggregator": mode.aggregator._lock,
            "timing": timing._held_lock,
        }

        def hold() -> None:
            for lock in locks.values():
                lock.acquire()
            held.set()
            release.wait(30)
            for lock in locks.values():
                lock.release()

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with mode.step(1):
                    model(x)
                    child_only(x)  # a module the parent never ran: the child traced
                ran = mode.aggregator.modules()
                free = {
                    "recorder": mode._recorder._emit_lock.acquire(timeout=5),
                    "jsonl": exporter._lock.acquire(timeout=5),
                    "aggregator": mode.aggregator._lock.acquire(timeout=5),
                    "timing": timing._held_lock.acquire(timeout=5),
                }
                os.write(write_end, json.dumps({"free": free, "ran": ran}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child blocked on a lock held by a thread of the parent")
            with os.fdopen(read_end, "rb") as fh:
                child = json.loads(fh.read())
        finally:
            release.set()
            holder.join(10)
    mode.shutdown()
    assert os.waitstatus_to_exitcode(status) == 0
    assert child["free"] == dict.fromkeys(locks, True)
    assert child["ran"] == [*modules, "Identity"]  # the child's step was traced


def test_a_bad_shutdown_timeout_leaves_the_queue_usable() -> None:
    """shutdown(-1) raises before it starts closing: a later shutdown still exports."""
    exporter = RecordingExporter()
    queue = ExportQueue(exporter, schedule_delay_s=30.0)
    queue.on_end(ReadableSpan("s"))
    with pytest.raises(ValueError, match=r"\btimeout_s=-1"):
        queue.shutdown(-1)
    with pytest.raises(ValueError, match=r"\btimeout_millis=-5"):
        queue.force_flush(-5)
    queue.shutdown(5.0)
    assert [s.name for s in exporter.spans] == ["s"]
    assert queue.stats()["pending"] == 0


def test_an_export_thread_that_cannot_start_is_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first attempt to start the export thread fails (a thread limit): the span
    stays queued and counted once (pending, no processor error), the failure is logged
    once, the next span starts the thread, and everything is exported; shutdown works."""
    from opentelemetry.trace import SpanContext

    real_start = threading.Thread.start
    refused: list[str] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("commspan-export") and not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    exporter = RecordingExporter()
    queue = ExportQueue(exporter)
    with caplog.at_level(logging.WARNING, logger="commspan"):
        queue.on_end(ReadableSpan("a", SpanContext(1, 1, False)))
        stats = queue.stats()
        assert refused and (stats["handed"], stats["pending"], stats.unaccounted) == (1, 1, 0)
        queue.on_end(ReadableSpan("b", SpanContext(1, 2, False)))
        assert queue.flush(5.0)
    queue.shutdown(5.0)
    assert [s.name for s in exporter.spans] == ["a", "b"]
    stats = queue.stats()
    assert (stats["exported"], stats["pending"], stats.unaccounted) == (2, 0, 0)
    assert len(_warnings(caplog, "could not start the export thread")) == 1


def test_a_second_shutdown_waits_for_the_first() -> None:
    """shutdown() from another thread while the first is still exporting returns only
    when the first has settled everything: nothing pending or in flight afterwards."""
    from opentelemetry.trace import SpanContext

    exporter = SlowExporter(0.3)
    queue = ExportQueue(exporter, max_batch_size=1)
    for i in range(3):
        queue.on_end(ReadableSpan(f"s{i}", SpanContext(1, 1 + i, False)))
    first = threading.Thread(target=queue.shutdown, args=(10.0,))
    first.start()
    time.sleep(0.1)
    queue.shutdown(10.0)
    stats = queue.stats()
    assert (stats["pending"], stats["in_flight"], stats["exported"], stats.unaccounted) == (
        0, 0, 3, 0)
    first.join(10)


_AT_EXIT = """
import sys, time
import torch
from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter

class Slow(JsonlSpanExporter):
    def export(self, spans):
        time.sleep(0.05)
        return super().export(spans)

mode = CommSpanMode(exporters=[Slow(sys.argv[1])], flush_timeout_s=0.01)
model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
with mode:
    for i in range(20):
        with mode.step(i):
            model(torch.randn(1, 2)).sum().backward()
stats = mode.stats()
print(stats["spans"], stats["spans_exported"])
# no mode.shutdown(): the interpreter exits with spans still queued
"""


def test_spans_queued_at_interpreter_exit_are_exported(tmp_path: Any) -> None:
    """A script that never calls mode.shutdown() (as the README's loop) exits while a
    slow exporter still has spans queued: they reach the file before the process ends
    (the export thread is a daemon, killed at exit, and they used to vanish)."""
    import subprocess
    import sys

    from commspan.exporters import read_spans

    out = tmp_path / "trace.jsonl"
    script = tmp_path / "at_exit.py"
    script.write_text(_AT_EXIT)
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                          text=True, timeout=120, check=True)
    spans, exported_before_exit = map(int, done.stdout.split())
    assert exported_before_exit < spans  # the exit did have spans to save
    assert len(list(read_spans(out))) == spans


_AT_EXIT_DEAD = """
import atexit, sys, threading, time
ended = []
# registered before commspan's own handlers, so it runs after them (last in, first out)
atexit.register(lambda: print(f"exit took {time.monotonic() - ended[0]:.3f} s", file=sys.stderr))
import torch
from opentelemetry.sdk.trace.export import SpanExporter
from commspan import CommSpanMode

class Dead(SpanExporter):  # a backend that accepts and never answers
    def export(self, spans):
        threading.Event().wait()

mode = CommSpanMode(exporters=[Dead()], flush_timeout_s=0.01)
with mode:
    for i in range(5):
        with mode.step(i):
            torch.nn.Linear(2, 2)(torch.randn(1, 2))
ended.append(time.monotonic())
"""


def test_a_dead_exporter_at_interpreter_exit_costs_a_few_seconds_and_is_logged(
    tmp_path: Any,
) -> None:
    """At exit a hung exporter finishes no batch: it is given up on after 2.5 s without
    progress (not its export_timeout_s of 10 s), and the loss is logged with its counts."""
    import subprocess
    import sys

    script = tmp_path / "dead.py"
    script.write_text(_AT_EXIT_DEAD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert "shutting Dead down within 0.00 s lost" in done.stderr, done.stderr
    # the time from the script's end to the interpreter's last exit handler (not
    # torch's import): the 2.5 s slice, not the exporter's 10 s timeout
    took = re.search(r"exit took ([0-9.]+) s", done.stderr)
    assert took is not None, done.stderr
    assert 2.0 < float(took.group(1)) < 8.0, done.stderr


class _EndsThreadOnce(RecordingExporter):
    """Raises ``error`` (a BaseException: an exporter calling sys.exit, one running
    asyncio inside that is cancelled) from its first export call, after ``delay_s``;
    then records."""

    def __init__(self, error: BaseException | None = None, delay_s: float = 0.0) -> None:
        super().__init__()
        self.calls = 0
        self.error = error if error is not None else SystemExit(3)
        self.delay_s = delay_s

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.delay_s)
            raise self.error
        return super().export(spans)


def test_an_exporter_ending_its_thread_does_not_stop_the_export(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SystemExit from one export call ends the export thread (that batch is counted
    as failed); the spans after it are exported by a new thread, without waiting for
    a shutdown, and the log says the thread ended."""
    exporter = _EndsThreadOnce()
    queue = ExportQueue(exporter, schedule_delay_s=60)
    provider = TracerProvider()
    provider.add_span_processor(queue)
    tracer = provider.get_tracer("t")
    with caplog.at_level(logging.WARNING, logger="commspan"):
        for batch in range(3):
            for i in range(2):
                tracer.start_span(f"s{batch}.{i}").end()
            queue.flush(5.0)
    stats = queue.stats()
    assert (stats["exported"], stats["failed"], stats["pending"]) == (4, 2, 0)
    assert len(exporter.spans) == 4
    assert "ends its export thread" in caplog.text
    queue.shutdown(1.0)
    assert queue.stats().unaccounted == 0


def test_a_flush_waiting_on_a_thread_an_exporter_ends_returns_at_once(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A flush without a time limit, waiting while the exporter's call ends the thread
    (CancelledError): it used to wait on a thread that had ended, for ever. It returns
    False as soon as the thread is gone, the thread prints no traceback of its own,
    and a later flush exports the rest with a new thread."""
    import asyncio

    exporter = _EndsThreadOnce(asyncio.CancelledError(), delay_s=0.2)
    queue = ExportQueue(exporter, schedule_delay_s=60)
    provider = TracerProvider()
    provider.add_span_processor(queue)
    tracer = provider.get_tracer("t")
    tracer.start_span("first").end()
    done: list[bool] = []
    waiter = threading.Thread(target=lambda: done.append(queue.flush(float("inf"))))
    waiter.start()
    waiter.join(30)  # a bound for the test only: the flush has none
    assert done == [False]
    tracer.start_span("second").end()
    assert queue.flush(5.0) is True and [s.name for s in exporter.spans] == ["second"]
    assert "Exception in thread" not in capfd.readouterr().err
    queue.shutdown(1.0)
    assert queue.stats().unaccounted == 0


_AT_EXIT_SLOW = """
import atexit
import time
import torch
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# registered before commspan's handler, so it runs after it (last in, first out)
atexit.register(lambda: print("sent", Slow.sent))
from commspan import CommSpanMode

class Slow(SpanExporter):  # a backend that answers each batch after 1.5 s
    sent = 0
    def export(self, spans):
        time.sleep(1.5)
        Slow.sent += len(spans)
        return SpanExportResult.SUCCESS

mode = CommSpanMode(exporters=[Slow()], flush_timeout_s=0.01)
with mode:
    for i in range(2):
        with mode.step(i):
            torch.nn.Linear(2, 2)(torch.randn(1, 2))
        mode.flush(0.0)  # a batch per step
"""


def test_a_slow_exporter_at_interpreter_exit_gets_its_spans_out(tmp_path: Any) -> None:
    """An exporter taking 1.5 s per call (a backend answering slowly, or the SDK's
    retry after a transient error) is not given up on at exit: every span is sent."""
    import subprocess
    import sys

    script = tmp_path / "slow.py"
    script.write_text(_AT_EXIT_SLOW)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "sent 6", done.stderr  # 3 spans per step
    assert "lost" not in done.stderr


def _interrupted_at(point: int, call: Any, where: Any) -> BaseException | None:
    """Run ``call`` with a KeyboardInterrupt raised at its ``point``-th place where
    CPython 3.11 runs a signal handler (so where a Ctrl-C's KeyboardInterrupt can land)
    in code ``where(code)`` accepts: a function's start (its ``call`` event), a loop's jump back
    (a JUMP_BACKWARD instruction) and the return of a call (a Python function's
    ``return`` event, a builtin's ``c_return``; a call of a type gives no event and is
    left out). Returns what ``call`` raised, or ``None`` once ``point`` lies beyond its
    end."""
    import dis
    import sys

    seen = 0

    def hit(frame: Any) -> None:
        nonlocal seen
        if not where(frame.f_code):
            return
        seen += 1
        if seen == point:
            raise KeyboardInterrupt

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event in ("call", "return") or (
                event == "opcode"
                and dis.opname[frame.f_code.co_code[frame.f_lasti]] == "JUMP_BACKWARD"):
            hit(frame)
        return tracer

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return":
            hit(frame)

    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        call()
    except BaseException as exc:  # what the interrupt became
        return exc
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return None


def _held_by_someone(lock: Any) -> bool:
    """Whether ``lock`` is held, as another thread finds it."""
    got: list[bool] = []

    def probe() -> None:
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return not got[0]


def test_a_caught_ctrl_c_anywhere_in_the_queue_leaves_its_lock_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt landing at any point of on_end, stats or a waiting flush on
    the training thread (a loop that catches Ctrl-C and goes on) leaves the queue's lock
    free and becomes nothing but that KeyboardInterrupt: it could land right after the
    lock was taken inside Condition.__enter__ and leave it held for good, so every later
    span, flush, shutdown and the exit handler hung."""
    blocking = BlockingExporter()
    queue = ExportQueue(blocking, max_batch_size=1)
    lock = queue._cond._lock  # type: ignore[attr-defined]
    span = ReadableSpan("s")
    queue.on_end(span)  # the worker starts and blocks in export: flush has to wait
    assert blocking.entered.wait(10)
    import types

    import commspan.exporters.queue as queue_module

    clock: list[float] = []  # the queue's clock: flush waits once (1 ms), then times out
    monkeypatch.setattr(queue_module, "time", types.SimpleNamespace(
        monotonic=lambda: clock.pop() if clock else 1.0))

    def flush() -> None:
        clock[:] = [0.0, 0.0]
        queue.flush(0.001)

    calls = {"on_end": lambda: queue.on_end(span), "stats": queue.stats, "flush": flush}
    # in the queue's code and the Condition's (not Thread.is_alive's: interrupted there,
    # it takes a running thread for stopped, CPython's own matter)
    conditions = {f.__code__ for f in vars(threading.Condition).values()
                  if isinstance(f, types.FunctionType)}

    def where(code: Any) -> bool:
        return code.co_filename == queue_module.__file__ or code in conditions
    leaks, others = [], []
    for name, call in calls.items():
        for point in range(1, 10_000):
            raised = _interrupted_at(point, call, where)
            if _held_by_someone(lock):
                leaks.append((name, point))
                while _held_by_someone(lock):  # free it, or the test's exit would hang
                    lock.release()
            if raised is None:
                break
            if not isinstance(raised, KeyboardInterrupt):
                others.append((name, point, repr(raised)))
    assert leaks == [] and others == []
    blocking.release.set()
    queue.shutdown(10)
    assert queue.stats()["pending"] == 0


class ChattyExporter(SpanExporter):
    """Fails every export and logs, as the OpenTelemetry exporters log each retry
    against a dead endpoint, with a logger of its own (``_logger``, as the OTLP/HTTP
    exporter's client holds it); its error text differs from batch to batch."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self._logger.warning("retrying batch %d in %.2fs", self.calls, 0.5)
        self._logger.error("gave up on batch %d", self.calls)
        self._logger.error("endpoint %s unreachable", "127.0.0.1")
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._logger.warning("shut down after %d calls", self.calls)


def _export_batches(queue: ExportQueue, batches: int) -> None:
    """Hand ``queue`` one span per batch, each flushed before the next."""
    provider = TracerProvider()
    provider.add_span_processor(queue)
    tracer = provider.get_tracer("chatty")
    for i in range(batches):
        with tracer.start_as_current_span(f"span-{i}"):
            pass
        assert queue.flush(5.0)


def test_an_exporters_repeated_messages_are_shown_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dead OTLP endpoint made the SDK log every retry of every batch (dozens of
    lines per rank burying commspan's one line): each message the exporter logs on the
    queue's threads is shown the first time, its repeats counted in ``quieted``; the
    same logger used on another thread is left alone."""
    logger = logging.getLogger("tests.chatty.repeats")
    caplog.set_level(logging.WARNING)
    exporter = ChattyExporter(logger)
    queue = ExportQueue(exporter)
    _export_batches(queue, 4)
    for _ in range(3):  # the user's (or another library's) own use of the logger
        logger.warning("retrying batch %d in %.2fs", 0, 0.5)
    queue.shutdown(5.0)
    assert exporter.calls == 4
    shown = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert shown.count("retrying batch 1 in 0.50s") == 1
    assert shown.count("retrying batch 0 in 0.50s") == 3
    assert shown.count("shut down after 4 calls") == 1  # (on the shutdown's thread)
    assert not any(m.startswith("retrying batch 2") for m in shown)
    # an error's texts are told apart (another kind of failure is shown), up to 3
    assert [m for m in shown if m.startswith("gave up")] == [
        "gave up on batch 1", "gave up on batch 2", "gave up on batch 3"]
    assert shown.count("endpoint 127.0.0.1 unreachable") == 1  # the same text: once
    assert queue.quieted == queue.stats()["quieted"] == 3 + 1 + 3
    assert queue.stats()["failed"] == 4  # the spans are counted as ever
    (fail,) = _warnings(caplog, "ChattyExporter.export returned FAILURE")
    assert "repeats of the exporter's own messages are not shown" in fail.getMessage()


def test_an_exporters_logger_at_debug_shows_every_repeat(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Set to DEBUG, the exporter's logger shows every retry again."""
    logger = logging.getLogger("tests.chatty.debug")
    logger.setLevel(logging.DEBUG)
    try:
        caplog.set_level(logging.WARNING)
        queue = ExportQueue(ChattyExporter(logger))
        _export_batches(queue, 3)
        queue.shutdown(5.0)
    finally:
        logger.setLevel(logging.NOTSET)
    shown = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert [m for m in shown if m.startswith("gave up")] == [
        "gave up on batch 1", "gave up on batch 2", "gave up on batch 3"]
    assert queue.quieted == 0
