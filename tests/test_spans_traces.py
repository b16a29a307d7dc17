"""spans/traces.py: one trace per step, ids derived from the run id and the step."""

from __future__ import annotations

import torch
from _tracing import (
    attrs,
    traced_mode,
    traces_by_step,
)
from opentelemetry.sdk.trace import ReadableSpan
from torch import nn

from commspan import semconv
from commspan.testing import assert_well_formed
from commspan.testing import span_fqn as fqn
from commspan.testing import span_phase as phase


def _run_steps(run_id: str, steps: int) -> list[ReadableSpan]:
    mode, exporter = traced_mode(run_id=run_id)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with mode:
        for i in range(steps):
            with mode.step(i) as traced:
                assert traced is True
                model(torch.randn(2, 4)).sum().backward()
    return list(exporter.get_finished_spans())




def test_one_trace_per_step() -> None:
    """Each step is one trace: commspan.step root, a Global rank span under it, modules below."""
    spans = _run_steps("run-a", 3)
    assert_well_formed(spans)
    traces = traces_by_step(spans)
    assert sorted(traces) == [0, 1, 2]
    assert len(set(traces.values())) == 3
    for step, trace_id in traces.items():
        in_trace = [s for s in spans if s.context.trace_id == trace_id]
        roots = [s for s in in_trace if s.name == semconv.SPAN_STEP]
        rank_spans = [s for s in in_trace if s.name == semconv.SPAN_RANK]
        assert len(roots) == 1 and len(rank_spans) == 1
        root, rank_span = roots[0], rank_spans[0]
        assert root.parent is None
        assert rank_span.parent is not None and rank_span.parent.span_id == root.context.span_id
        assert fqn(rank_span) == semconv.GLOBAL_FQN
        assert attrs(rank_span)[semconv.STEP] == step
        assert attrs(root)[semconv.RUN_ID] == "run-a" == attrs(rank_span)[semconv.RUN_ID]
        modules = [s for s in in_trace if phase(s) is not None]
        assert {phase(s) for s in modules} == {"forward", "backward"}


def test_trace_ids_derive_from_run_id_and_step() -> None:
    """Runs with one run_id share each step's trace and root span ids; another run_id differs."""
    a1, a2, b = _run_steps("run-a", 2), _run_steps("run-a", 2), _run_steps("run-b", 2)
    assert traces_by_step(a1) == traces_by_step(a2)
    root_ids = [
        {attrs(s)[semconv.STEP]: s.context.span_id for s in spans if s.name == semconv.SPAN_STEP}
        for spans in (a1, a2)
    ]
    assert root_ids[0] == root_ids[1]
    assert set(traces_by_step(a1).values()).isdisjoint(traces_by_step(b).values())


def test_sampled_out_steps_record_nothing() -> None:
    """With sample=2, odd steps yield False and produce no span; even steps are traced."""
    mode, exporter = traced_mode(sample=2)
    model = nn.Linear(4, 4)
    flags = []
    with mode:
        for i in range(4):
            with mode.step(i) as traced:
                flags.append(traced)
                model(torch.randn(2, 4)).sum().backward()
    assert flags == [True, False, True, False]
    assert sorted(traces_by_step(list(exporter.get_finished_spans()))) == [0, 2]
    assert mode.stats()["steps_traced"] == 2 and mode.stats()["steps_skipped"] == 2


def test_a_step_number_used_again_shares_its_root() -> None:
    """Two epochs number their steps 0, 1, 0, 1: each number's trace has one root,
    written at the end of its first use (it got a second root with the same span id,
    which assert_well_formed rejects), and both uses' rank spans hang under it."""
    mode, exporter = traced_mode(run_id="epochs")
    model = nn.Linear(4, 4)
    with mode:
        for step in (0, 1, 0, 1):
            with mode.step(step):
                model(torch.randn(2, 4))
    mode.shutdown()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    roots = [s for s in spans if s.name == semconv.SPAN_STEP]
    assert sorted(attrs(r)[semconv.STEP] for r in roots) == [0, 1]
    for root in roots:
        ranks = [s for s in spans if s.name == semconv.SPAN_RANK
                 and s.parent is not None and s.parent.span_id == root.context.span_id]
        assert len(ranks) == 2


def test_used_step_numbers_are_kept_as_runs() -> None:
    """The set behind it answers as a Python set does, in runs (steps 0..N: one)."""
    import random

    from commspan.spans.traces import _Numbers

    rng = random.Random(7)
    numbers, reference = _Numbers(), set()
    for _ in range(3000):
        n = rng.randrange(-50, 300)
        assert numbers.add(n) == (n not in reference)
        reference.add(n)
    runs = sum(1 for n in reference if n - 1 not in reference)
    assert len(numbers) == runs
    steps = _Numbers()
    for n in range(10_000):
        steps.add(n)
    assert len(steps) == 1
