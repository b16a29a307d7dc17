"""spans/recorder.py: a span keeps every collective event, beyond the SDK's event limit."""

from __future__ import annotations

from typing import Any

import torch
from _tracing import (
    attrs,
    named,
    traced_mode,
)
from torch import nn

from commspan import semconv
from commspan.testing import collective_events
from commspan.testing import span_counts as counts


class _Chatty(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        for _ in range(self.n):
            x = funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
        return x


def test_more_than_128_collectives_in_one_call(fake_pg: None) -> None:
    """A module issuing 300 collectives in one call keeps all 300 events (beyond the SDK's 128)."""
    n = 300
    mode, exporter = traced_mode()
    with mode:
        _Chatty(n)(torch.randn(3))
    span = named(list(exporter.get_finished_spans()), "_Chatty", "forward")[0]
    events = collective_events(span)
    assert len(events) == n
    seqs = [(e.attributes or {})[semconv.COLL_SEQ] for e in events]
    assert seqs == list(range(1, n + 1))
    assert counts(span) == {("forward", "all_reduce"): n}
    assert attrs(span)[semconv.SELF_COUNT] == n
    assert mode.aggregator is not None
    assert mode.aggregator.comm_counts() == {"all_reduce": n}
    assert mode.aggregator.collectives(fqn="_Chatty")[0].count == n


def test_frame_contexts_are_the_sdk_s_own() -> None:
    """A module frame's context (made without SpanContext's constructor when the
    installed OpenTelemetry lays it out as the recorder expects) equals the one the
    constructor makes from the same ids: valid in a trace, and the fallback when the
    layout is not known gives the same."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.trace import SpanContext, TraceFlags

    from commspan.spans import recorder as recorder_mod
    from commspan.spans.recorder import SpanRecorder
    from commspan.spans.traces import TraceOpener

    def contexts(fast: bool) -> list[tuple[SpanContext, SpanContext]]:
        old = recorder_mod._FAST_CONTEXT
        recorder_mod._FAST_CONTEXT = fast
        try:
            spans: list = []
            rec = SpanRecorder(spans.append, Resource({}), "test", traces=TraceOpener())
            rec.ensure_trace()
            frames = [rec.push("M", semconv.Phase.FORWARD, {}),
                      rec.push("M.a", semconv.Phase.FORWARD, {})]
            rec.end()
            return [(f.context, SpanContext(f.context.trace_id, f.span_id, False,
                                            TraceFlags(TraceFlags.SAMPLED)))
                    for f in frames]
        finally:
            recorder_mod._FAST_CONTEXT = old

    assert recorder_mod._FAST_CONTEXT  # this OpenTelemetry: the fast path runs
    for fast in (True, False):
        for made, expected in contexts(fast):
            assert made == expected and type(made) is SpanContext
            assert made.is_valid and made.trace_flags.sampled and not made.is_remote
            assert made.trace_state == expected.trace_state


class _Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_spans_built_without_the_sdk_constructors_are_the_constructors(
        fake_pg: None, monkeypatch: Any) -> None:
    """The recorder sets a span's and its events' fields directly (no constructor
    frames): each span of a step with collectives, an exception event and an error
    status holds exactly what ``ReadableSpan(...)`` and ``Event(...)`` make of the same
    frame, field for field and in the same order."""
    from opentelemetry.sdk.trace import Event, ReadableSpan

    from commspan.spans import recorder as recorder_mod
    from commspan.spans.recorder import SpanRecorder

    assert recorder_mod._FAST_SPAN  # this OpenTelemetry: the fast path runs
    built = SpanRecorder._build
    compared: list[str] = []

    def fields(obj: Any) -> list[tuple[str, Any]]:
        # (the events compared one by one below; the timing held for export aside)
        # (a status made for each span: its code and text)
        return [(k, len(v) if k == "_events" else (v.status_code, v.description)
                 if k == "_status" else v)
                for k, v in vars(obj).items() if not k.startswith("_commspan")]

    def build(self: SpanRecorder, frame: Any) -> ReadableSpan:
        fast = built(self, frame)
        slow = self._build_slowly(frame, frame.attrs)
        assert type(fast) is ReadableSpan
        assert fields(fast) == fields(slow)
        assert [(type(e), fields(e)) for e in fast.events] == [
            (Event, fields(e)) for e in slow.events]
        compared.append(fast.name)
        return fast

    monkeypatch.setattr(SpanRecorder, "_build", build)
    mode, exporter = traced_mode()
    with mode:
        _Chatty(2)(torch.randn(3))
        try:
            _Raises()(torch.randn(3))
        except ValueError:
            pass
    spans = list(exporter.get_finished_spans())
    assert "_Chatty forward" in compared and "_Raises forward" in compared
    raised = named(spans, "_Raises", "forward")[0]
    assert not raised.status.is_ok and [e.name for e in raised.events] == ["exception"]
    assert len(collective_events(named(spans, "_Chatty", "forward")[0])) == 2


def test_spans_built_by_the_constructors_with_another_sdk_layout(
        fake_pg: None, monkeypatch: Any) -> None:
    """An OpenTelemetry whose span is laid out otherwise: the constructors build it."""
    from commspan.spans import recorder as recorder_mod

    monkeypatch.setattr(recorder_mod, "_FAST_SPAN", False)
    mode, exporter = traced_mode()
    with mode:
        _Chatty(2)(torch.randn(3))
    span = named(list(exporter.get_finished_spans()), "_Chatty", "forward")[0]
    assert len(collective_events(span)) == 2
    assert counts(span) == {("forward", "all_reduce"): 2}
