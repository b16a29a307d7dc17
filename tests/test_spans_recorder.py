"""spans/recorder.py: a span keeps every collective event, beyond the SDK's event limit."""

from __future__ import annotations

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
