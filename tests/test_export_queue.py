"""Exporters that fail, raise or hang never break the training step or hang the mode.

Each exporter gets a background queue (``commspan.export.ExportQueue``); these
tests drive it through ``CommSpanMode(exporters=[...])`` with misbehaving
exporters and check the step result, the time the mode takes to leave, the
counters in ``mode.stats()`` and that each kind of trouble is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, get_value
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from torch import nn

from commspan import CommSpanMode

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
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self.entered.set()
        self.release.wait()
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
