"""The span tree commspan emits is well formed, and its counts follow from its events.

One module-scoped run of the tensor-parallel toy Transformer (fake process
group, 3 blocks: block 1 checkpointed without reentrancy, block 2 with it),
two ``mode.step(i)`` steps plus an eval forward outside any step, is captured
synchronously through a ``TracerProvider`` with an in-memory exporter; every
test checks one invariant over all of its spans.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commspan import CommSpanMode, semconv
from commspan.testing import SpanTree, collective_events, span_counts, span_fqn, span_phase
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

ROOT_NAMES = {semconv.SPAN_STEP, semconv.SPAN_SESSION}
PHASES = {p.value for p in semconv.Phase}
STEPS = 2


class Run(SpanTree):
    """Everything one traced run produced: its spans as a tree, and the mode."""

    def __init__(self, spans: list[ReadableSpan], mode: CommSpanMode) -> None:
        super().__init__(spans)
        self.mode = mode


def _key(span: ReadableSpan) -> tuple[int, int]:
    return span.context.trace_id, span.context.span_id


_phase, _fqn, _count_attrs = span_phase, span_fqn, span_counts


def _collective_events(span: ReadableSpan) -> list[tuple[str, str]]:
    """``(phase, op)`` of every collective event attached to ``span``."""
    return [
        (str(attrs[semconv.PHASE]), str(attrs[semconv.COLL_OP]))
        for attrs in (e.attributes or {} for e in collective_events(span))
    ]


@pytest.fixture(scope="module")
def run(fake_pg: None) -> Run:
    """Two traced training steps of the TP Transformer and one untraced-by-step eval forward."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    args = ModelArgs(n_layers=3, checkpoint={1: False, 2: True})
    model = parallelize(Transformer(args), mesh)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    mode = CommSpanMode(tracer_provider=provider, run_id="test-spans")
    with mode:
        for i in range(STEPS):
            with mode.step(i):
                train_step(model, *make_batch(args, seed=i))
        with torch.no_grad(), warnings.catch_warnings():  # outside any step: a session trace
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
            model(make_batch(args)[0])
    return Run(list(exporter.get_finished_spans()), mode)


def test_run_produced_spans_with_checkpointing(run: Run) -> None:
    """The run has forward, backward and recompute module spans and collective events."""
    phases = Counter(_phase(s) for s in run.module_spans())
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["recompute"] > 0
    assert sum(len(_collective_events(s)) for s in run.spans) > 0
    assert run.mode.stats()["internal_errors"] == 0


def test_every_parent_is_present(run: Run) -> None:
    """Every span but a trace root has its parent among the spans, in the same trace."""
    missing = [
        s.name
        for s in run.spans
        if s.parent is not None and (s.context.trace_id, s.parent.span_id) not in run.by_id
    ]
    assert missing == []


def test_trace_roots(run: Run) -> None:
    """Each trace has exactly one root, a step or session span, and it is the rank span's parent."""
    roots: dict[int, list[ReadableSpan]] = defaultdict(list)
    for s in run.spans:
        if s.parent is None:
            roots[s.context.trace_id].append(s)
    traces = {s.context.trace_id for s in run.spans}
    assert set(roots) == traces
    assert all(len(r) == 1 and r[0].name in ROOT_NAMES for r in roots.values())
    assert sorted(r[0].name for r in roots.values()) == sorted(
        [semconv.SPAN_STEP] * STEPS + [semconv.SPAN_SESSION]
    )
    for rank_span in run.rank_spans():
        parent = run.parent(rank_span)
        assert parent is not None and parent.name in ROOT_NAMES
    assert len(run.rank_spans()) == len(traces)


def test_module_spans_hang_under_the_rank_span(run: Run) -> None:
    """Every module span has its trace's rank span among its ancestors, and no root in between."""
    for s in run.module_spans():
        names = [a.name for a in run.ancestors(s)]
        assert names[-2:] == [semconv.SPAN_RANK, names[-1]] and names[-1] in ROOT_NAMES, s.name
        assert semconv.SPAN_RANK not in names[:-2]


def test_child_interval_inside_parent_interval(run: Run) -> None:
    """A span starts no earlier and ends no later than its parent; its events fall inside it."""
    for s in run.spans:
        assert s.start_time is not None and s.end_time is not None
        assert s.start_time <= s.end_time, s.name
        for e in s.events:
            assert s.start_time <= e.timestamp <= s.end_time, (s.name, e.name)
        parent = run.parent(s)
        if parent is not None:
            assert parent.start_time <= s.start_time, s.name  # type: ignore[operator]
            assert s.end_time <= parent.end_time, (s.name, parent.name)  # type: ignore[operator]


def _depth(span: ReadableSpan) -> int:
    value = (span.attributes or {})[semconv.MODULE_DEPTH]
    assert isinstance(value, int), span.name
    return value


def test_module_span_names_and_attributes(run: Run) -> None:
    """A module span is named '<fqn> <phase>' and carries fqn, type, phase and depth."""
    for s in run.module_spans():
        attrs = s.attributes or {}
        assert s.name == f"{_fqn(s)} {_phase(s)}"
        assert str(_fqn(s)).startswith("Transformer")
        assert attrs[semconv.MODULE_TYPE]
        assert _depth(s) >= 1


def test_forward_depths_follow_nesting(run: Run) -> None:
    """A forward span's depth is 1 under the rank span, else its parent's depth + 1."""
    for s in run.module_spans():
        if _phase(s) != "forward":
            continue
        parent = run.parent(s)
        assert parent is not None
        if parent.name == semconv.SPAN_RANK:
            assert _depth(s) == 1, s.name
        else:
            assert _depth(s) == _depth(parent) + 1, s.name


def test_depth_same_in_every_phase(run: Run) -> None:
    """A module's backward and recompute spans carry the depth its forward spans carry."""
    forward_depths: dict[str, set[int]] = defaultdict(set)
    for s in run.module_spans():
        if _phase(s) == "forward":
            forward_depths[str(_fqn(s))].add(_depth(s))
    wrong = sorted(
        (s.name, _depth(s), sorted(forward_depths[str(_fqn(s))]))
        for s in run.module_spans()
        if _phase(s) != "forward" and _depth(s) not in forward_depths[str(_fqn(s))]
    )
    assert wrong == []


def test_forward_spans_have_only_forward_ancestors(run: Run) -> None:
    """Forward spans nest only in forward spans; recompute spans have a backward ancestor."""
    for s in run.module_spans():
        ancestor_phases = {_phase(a) for a in run.ancestors(s)} - {None}
        if _phase(s) == "forward":
            assert ancestor_phases <= {"forward"}, s.name
        elif _phase(s) == "recompute":
            assert "backward" in ancestor_phases, s.name


def test_collective_events_name_their_span(run: Run) -> None:
    """A collective event's module and phase attributes are those of the span it is on."""
    for s in run.spans:
        for e in s.events:
            attrs = e.attributes or {}
            if semconv.COLL_OP not in attrs:
                continue
            assert e.name == attrs[semconv.COLL_OP]
            if s.name == semconv.SPAN_RANK:
                assert attrs[semconv.MODULE_FQN] == semconv.GLOBAL_FQN
            else:
                assert attrs[semconv.MODULE_FQN] == _fqn(s)
                assert attrs[semconv.PHASE] == _phase(s)


def _expected_counts(run: Run) -> dict[tuple[int, int], Counter[tuple[str, str]]]:
    """Per span, the events of its subtree it counts, by the rules documented on COUNT_PREFIX.

    Walking up from the span an event is on: a module counts the event at its
    innermost span only, and a span of another phase than the event's counts
    it only if its module encloses the issuing module by name. Rank spans
    (no phase) count everything below them.
    """
    expected: dict[tuple[int, int], Counter[tuple[str, str]]] = defaultdict(Counter)
    for span in run.spans:
        events = _collective_events(span)
        if not events:
            continue
        owner = _fqn(span) or ""
        for phase, op in events:
            seen: set[str] = set()
            for node in [span, *run.ancestors(span)]:
                fqn, node_phase = _fqn(node), _phase(node)
                if fqn is None or fqn in seen:
                    continue
                if (
                    node_phase is not None
                    and node_phase != phase
                    and not (owner == fqn or owner.startswith(fqn + "."))
                ):
                    continue
                seen.add(fqn)
                expected[_key(node)][(phase, op)] += 1
    return expected


def test_count_attributes_match_events_in_subtree(run: Run) -> None:
    """commspan.collectives.<phase>.<op> counts the subtree's events by the documented rules."""
    expected_by_span = _expected_counts(run)
    checked = 0
    for s in run.spans:
        if s.name in ROOT_NAMES:
            continue
        expected = expected_by_span.get(_key(s), Counter())
        assert _count_attrs(s) == dict(expected), s.name
        totals: Counter[str] = Counter()
        for (phase, _), n in expected.items():
            totals[phase] += n
        for phase in PHASES:
            key = f"{semconv.COUNT_PREFIX}{phase}.{semconv.COUNT_TOTAL}"
            assert (s.attributes or {}).get(key, 0) == totals[phase], (s.name, phase)
        assert (s.attributes or {}).get(semconv.SELF_COUNT, 0) == len(_collective_events(s))
        checked += bool(expected)
    assert checked > 10


def test_counts_never_exceed_subtree_events(run: Run) -> None:
    """No span counts more collectives of a phase/op than its subtree holds."""
    for s in run.spans:
        if s.name in ROOT_NAMES:
            continue
        subtree: Counter[tuple[str, str]] = Counter()
        stack = [s]
        while stack:
            node = stack.pop()
            subtree.update(_collective_events(node))
            stack.extend(run.children.get(_key(node), []))
        for key, n in _count_attrs(s).items():
            assert n <= subtree[key], (s.name, key)


def test_innermost_rule_is_exercised(run: Run) -> None:
    """Some module is open twice in one chain (a recompute inside its own backward)."""
    nested = [
        s
        for s in run.module_spans()
        if _phase(s) == "recompute" and any(_fqn(a) == _fqn(s) for a in run.ancestors(s))
    ]
    assert nested


def test_rank_span_counts_equal_aggregator(run: Run) -> None:
    """The rank spans' counts, summed over traces, are the aggregator's Global and comm counts."""
    agg = run.mode.aggregator
    assert agg is not None
    summed: Counter[tuple[str, str]] = Counter()
    for s in run.rank_spans():
        summed.update(_count_attrs(s))
    by_phase: dict[str, dict[str, int]] = defaultdict(dict)
    per_op: Counter[str] = Counter()
    for (phase, op), n in summed.items():
        by_phase[phase][op] = n
        per_op[op] += n
    assert agg.module_counts()[semconv.GLOBAL_FQN] == dict(by_phase)
    assert agg.comm_counts() == dict(per_op)
    for phase in PHASES:
        assert agg.comm_counts(phase) == by_phase.get(phase, {})
    assert (
        agg.total_count()
        == sum(len(_collective_events(s)) for s in run.spans)
        == run.mode.stats()["collectives"]
    )


def test_module_counts_are_sums_over_spans(run: Run) -> None:
    """aggregator.module_counts()[fqn] is the sum of the count attributes of fqn's spans."""
    agg = run.mode.aggregator
    assert agg is not None
    summed: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for s in run.module_spans():
        summed[str(_fqn(s))].update(_count_attrs(s))
    expected: dict[str, dict[str, dict[str, int]]] = {}
    for fqn, counts in summed.items():
        for (phase, op), n in counts.items():
            expected.setdefault(fqn, {}).setdefault(phase, {})[op] = n
    got = {k: v for k, v in agg.module_counts().items() if k != semconv.GLOBAL_FQN}
    assert got == expected


def test_aggregator_counts_spans_of_the_same_keys_and_of_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The aggregator reads a span's count attributes by the plan of its attribute keys
    (kept per tuple of keys): spans with the same keys and other values add up, a span
    without a per-phase total is not folded, and a full plan cache starts over; every
    sum is checked against the attributes added up here."""
    from commspan.analysis import counts as counts_mod

    monkeypatch.setattr(counts_mod, "_MAX_PLANS", 2)
    monkeypatch.setattr(counts_mod, "_PLANS", {})
    agg = counts_mod.Aggregator()
    fw, bw = semconv.Phase.FORWARD, semconv.Phase.BACKWARD
    total = f"{semconv.COUNT_PREFIX}{{}}.{semconv.COUNT_TOTAL}"
    spans = [
        {semconv.MODULE_FQN: "M.a", semconv.count_key(fw, "all_reduce"): 2,
         total.format("forward"): 2},
        {semconv.MODULE_FQN: "M.a", semconv.count_key(fw, "all_reduce"): 3,
         total.format("forward"): 3},
        {semconv.MODULE_FQN: "M.b", semconv.MODULE_DEPTH: 2,
         semconv.count_key(bw, "all_gather"): 1, semconv.count_key(fw, "all_reduce"): 4,
         total.format("backward"): 1, total.format("forward"): 4},
        {semconv.MODULE_FQN: "M.c", semconv.count_key(fw, "all_reduce"): 7},  # no total
        {semconv.MODULE_FQN: "M.a", semconv.count_key(fw, "all_reduce"): 1,
         total.format("forward"): 1},
    ]
    for i, attrs in enumerate(spans):
        agg.on_end(ReadableSpan(name=f"s{i}", attributes=attrs, start_time=i + 1))
    assert agg.module_counts() == {
        "M.a": {"forward": {"all_reduce": 6}},
        "M.b": {"backward": {"all_gather": 1}, "forward": {"all_reduce": 4}},
    }
    assert len(counts_mod._PLANS) <= 2


def test_aggregator_reads_spans_without_the_sdk_s_stored_fields() -> None:
    """A span that is not the SDK's (only the ReadableSpan properties) counts as the
    SDK's span with the same content does."""
    from opentelemetry.sdk.trace import Event

    from commspan.analysis.counts import Aggregator

    total = f"{semconv.COUNT_PREFIX}forward.{semconv.COUNT_TOTAL}"
    attrs = {semconv.MODULE_FQN: "M.a", semconv.MODULE_TYPE: "Linear",
             semconv.count_key(semconv.Phase.FORWARD, "all_reduce"): 1, total: 1}
    events = (Event("all_reduce", {semconv.COLL_OP: "all_reduce", semconv.PHASE: "forward",
                                   semconv.TENSOR_BYTES: 64}, 5),)
    sdk = ReadableSpan(name="M.a forward", attributes=attrs, events=events, start_time=3)

    class Plain:
        def __init__(self) -> None:
            self.attributes, self.events, self.start_time = attrs, events, 3
            self.resource = None

    got = []
    for span in (sdk, Plain()):
        agg = Aggregator()
        agg.on_end(span)  # type: ignore[arg-type]
        got.append((agg.module_counts(), agg.collectives(), agg.modules()))
    assert got[0] == got[1] and got[0][0] == {"M.a": {"forward": {"all_reduce": 1}}}
