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
