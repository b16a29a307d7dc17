"""Collective events of the tensor-parallel styles carry placements, process group and tensor facts.

Spans are captured two ways: an in-memory exporter given to
``CommSpanMode(exporters=[...])`` (flushed when the context exits) and an SDK
``TracerProvider`` whose processor feeds an in-memory exporter
(``tracer_provider=``). Each collective event names the redistribution that
issued it (``commspan.redistribute.src`` -> ``.dst``), and the aggregator's
``collectives()`` groups the same facts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import commspan.capture.dispatch
from commspan import CommSpanMode, semconv
from commspan.capture.dispatch import CollectiveDispatchMode
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

Expected = tuple[str, str, str, str]
"""(phase, op, src placements, dst placements) of one collective."""


@dataclasses.dataclass(frozen=True)
class StyleCase:
    """One module under one TP style, its input, and the collectives a step must issue."""

    module: Callable[[], nn.Module]
    style: Callable[[], ParallelStyle]
    inputs: Callable[[int], torch.Tensor]
    expected: Sequence[Expected]


CASES: dict[str, StyleCase] = {
    "colwise": StyleCase(
        lambda: nn.Linear(16, 16),
        ColwiseParallel,
        lambda world: torch.rand(8, 16, requires_grad=True),
        [("backward", "all_reduce", "P(sum)", "R")],
    ),
    "colwise_shard0_input": StyleCase(
        lambda: nn.Linear(16, 16),
        lambda: ColwiseParallel(input_layouts=Shard(0)),
        lambda world: torch.rand(8, 16, requires_grad=True),
        [
            ("forward", "all_gather_into_tensor", "S(0)", "R"),
            ("backward", "reduce_scatter_tensor", "P(sum)", "S(0)"),
        ],
    ),
    "rowwise": StyleCase(
        lambda: nn.Linear(16, 16),
        RowwiseParallel,
        lambda world: torch.rand(8, 16 // world, requires_grad=True),
        [("forward", "all_reduce", "P(sum)", "R")],
    ),
    "rowwise_shard0_output": StyleCase(
        lambda: nn.Linear(16, 16),
        lambda: RowwiseParallel(output_layouts=Shard(0)),
        lambda world: torch.rand(8, 16 // world, requires_grad=True),
        [
            ("forward", "reduce_scatter_tensor", "P(sum)", "S(0)"),
            ("backward", "all_gather_into_tensor", "S(0)", "R"),
        ],
    ),
    "colwise_embedding": StyleCase(
        lambda: nn.Embedding(16, 16),
        ColwiseParallel,
        lambda world: torch.arange(8).reshape(4, 2),
        [],
    ),
    "rowwise_embedding": StyleCase(
        lambda: nn.Embedding(16, 16),
        lambda: RowwiseParallel(input_layouts=Replicate()),
        lambda world: torch.arange(8).reshape(4, 2),
        [("forward", "all_reduce", "P(sum)", "R")],
    ),
    "rowwise_embedding_shard1_output": StyleCase(
        lambda: nn.Embedding(16, 16),
        lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        lambda world: torch.arange(8),
        [
            ("forward", "reduce_scatter_tensor", "P(sum)", "S(1)"),
            ("backward", "all_gather_into_tensor", "S(1)", "R"),
        ],
    ),
    "prepare_module_input": StyleCase(
        nn.Identity,
        lambda: PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
        lambda world: torch.ones(2, 16),
        [("forward", "all_gather_into_tensor", "S(0)", "R")],
    ),
}


# ---------------------------------------------------------------- helpers
def run_case(
    case: StyleCase, mesh: DeviceMesh, **mode_kwargs: Any
) -> tuple[CommSpanMode, list[ReadableSpan]]:
    """One forward + backward of ``case`` under a fresh mode; returns the mode and its spans."""
    model = parallelize_module(case.module(), mesh, case.style())
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter], **mode_kwargs)
    with mode:
        out = model(case.inputs(mesh.size()))
        if out.requires_grad:
            out.sum().backward()
    return mode, list(exporter.get_finished_spans())


def collective_events(spans: Sequence[ReadableSpan]) -> list[tuple[ReadableSpan, dict[str, Any]]]:
    """``(span, event attributes)`` of every collective event, in time order."""
    found = [
        (event.timestamp or 0, span, dict(event.attributes or {}))
        for span in spans
        for event in span.events
        if (event.attributes or {}).get(semconv.COLL_OP) is not None
    ]
    found.sort(key=lambda item: item[0])
    return [(span, attrs) for _, span, attrs in found]


def placements_of(spans: Sequence[ReadableSpan]) -> list[Expected]:
    """(phase, op, src, dst) of every collective event, in time order."""
    return [
        (
            attrs[semconv.PHASE],
            attrs[semconv.COLL_OP],
            attrs.get(semconv.REDIST_SRC, ""),
            attrs.get(semconv.REDIST_DST, ""),
        )
        for _, attrs in collective_events(spans)
    ]


def module_span(spans: Sequence[ReadableSpan], fqn: str, phase: str) -> ReadableSpan:
    """The one span of module ``fqn`` in ``phase``."""
    found = [
        s
        for s in spans
        if (s.attributes or {}).get(semconv.MODULE_FQN) == fqn
        and (s.attributes or {}).get(semconv.PHASE) == phase
    ]
    assert len(found) == 1, (fqn, phase, [s.name for s in spans])
    return found[0]


# ---------------------------------------------------------------- placements
@pytest.mark.parametrize("name", list(CASES))
def test_event_placements(name: str, mesh: DeviceMesh) -> None:
    """Each collective event names the placements before and after its redistribution."""
    _, spans = run_case(CASES[name], mesh)
    assert placements_of(spans) == list(CASES[name].expected)


@pytest.mark.parametrize("name", list(CASES))
def test_aggregator_collectives(name: str, mesh: DeviceMesh) -> None:
    """aggregator.collectives() groups events by module, phase, op and placements, with bytes."""
    case = CASES[name]
    mode, spans = run_case(case, mesh)
    assert mode.aggregator is not None
    summaries = mode.aggregator.collectives()
    fqn = type(case.module()).__name__
    got = [(s.fqn, s.phase, s.op, s.src, s.dst, s.count) for s in summaries]
    assert got == [(fqn, *e, 1) for e in case.expected]
    event_bytes = {
        (a[semconv.PHASE], a[semconv.COLL_OP]): a[semconv.TENSOR_BYTES]
        for _, a in collective_events(spans)
    }
    assert {(s.phase, s.op): s.bytes for s in summaries} == event_bytes
    for phase, op, _, _ in case.expected:
        assert [s.op for s in mode.aggregator.collectives(fqn=fqn, phase=phase, op=op)] == [op]


def test_event_names_what_asked_for_the_redistribution(mesh: DeviceMesh) -> None:
    """``commspan.redistribute.op``: the DTensor op whose sharding propagation asked for
    it, ``redistribute`` for an explicit call, the autograd node in backward."""
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        a = distribute_tensor(torch.randn(8, 8, requires_grad=True), mesh, [Shard(0)])
        b = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
        c = a.redistribute(mesh, [Replicate()])  # explicit
        d = torch.mm(a, b)  # b is gathered for the mm
        (c.sum() + d.sum()).backward()  # the gradients meet in an add
    got = [
        (
            attrs[semconv.PHASE],
            attrs[semconv.COLL_OP],
            attrs.get(semconv.REDIST_SRC),
            attrs.get(semconv.REDIST_DST),
            attrs.get(semconv.REDIST_OP),
        )
        for _, attrs in collective_events(exporter.get_finished_spans())
        if attrs[semconv.COLL_OP] != "scatter"  # distribute_tensor: no redistribution
    ]
    assert got == [
        ("forward", "all_gather_into_tensor", "S(0)", "R", "redistribute"),
        ("forward", "all_gather_into_tensor", "S(0)", "R", "aten.mm.default"),
        ("backward", "all_gather_into_tensor", "S(1)", "S(0)", "aten.add.Tensor"),
    ]
    for name, op in (
        ("colwise", "_FromTorchTensorBackward"),
        ("rowwise_shard0_output", "RedistributeBackward"),
    ):
        _, spans = run_case(CASES[name], mesh)
        backward = [a for _, a in collective_events(spans) if a[semconv.PHASE] == "backward"]
        assert [a.get(semconv.REDIST_OP) for a in backward] == [op], name


def test_mesh_is_learned_from_a_redistribution_without_collectives(fake_pg: None) -> None:
    """A redistribution that only slices still tells commspan its mesh, so a later
    explicit ``redistribute`` (DTensor hands it placements, not the mesh) names the
    mesh dimension of its collective."""
    mesh = init_device_mesh("cpu", (2, 2))
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter], record_params=False)
    with mode:
        a = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
        r = distribute_tensor(torch.randn(8, 8), mesh, [Replicate(), Replicate()])
        b = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Replicate()])
        _ = a + r  # r is sliced to a's placements: no collective
        b.redistribute(mesh, [Replicate(), Replicate()])
    gathers = [
        attrs
        for _, attrs in collective_events(exporter.get_finished_spans())
        if attrs[semconv.COLL_OP] == "all_gather_into_tensor"
    ]
    got = [(a[semconv.MESH_DIM], a[semconv.REDIST_SRC], a[semconv.REDIST_DST]) for a in gathers]
    assert got == [(0, "S(0),R", "R,R")]


def test_undescribable_redistribution_is_counted_logged_and_skipped(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """If placements cannot be described, the collective is still recorded (without
    them), one internal error is counted per redistribution, and the first is logged."""

    def broken(placements: Any) -> str:
        raise RuntimeError("cannot describe")

    monkeypatch.setattr(commspan.capture.dispatch, "placements_str", broken)
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    with caplog.at_level("WARNING", logger="commspan"), mode:
        a = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
        a.redistribute(mesh, [Replicate()])
        a.redistribute(mesh, [Replicate()])
    gathers = [
        attrs
        for _, attrs in collective_events(exporter.get_finished_spans())
        if attrs[semconv.COLL_OP] == "all_gather_into_tensor"
    ]
    assert len(gathers) == 2
    assert all(semconv.REDIST_SRC not in attrs for attrs in gathers)
    assert mode.stats()["internal_errors"] == 2
    warnings = [r for r in caplog.records if "describe a DTensor redistribution" in r.message]
    assert len(warnings) == 1


def test_redistribution_left_out_of_order_leaves_no_record(mesh: DeviceMesh) -> None:
    """However DTensor leaves its redistributions, none stays on the stack to be
    blamed for later collectives."""
    mode = CollectiveDispatchMode(lambda info, attrs: None)
    a = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    r = distribute_tensor(torch.randn(8, 8), mesh, [Replicate()])
    outer = mode.record_redistribute_calls(0, a._spec, r._spec)
    inner = mode.record_redistribute_calls(a, a._spec.placements, r._spec.placements)
    outer.__enter__()
    inner.__enter__()
    assert mode.current_redistribution() == ("S(0)", "R", "")  # the outer's op: none seen
    outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    assert mode.current_redistribution() is None


def test_placements_through_a_tracer_provider(mesh: DeviceMesh) -> None:
    """A TracerProvider's processors receive the same spans and events as commspan's exporters."""
    provider = TracerProvider()
    sdk_exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(sdk_exporter))
    _, spans = run_case(CASES["colwise_shard0_input"], mesh, tracer_provider=provider)
    through_provider = list(sdk_exporter.get_finished_spans())
    assert sorted(s.name for s in through_provider) == sorted(s.name for s in spans)
    assert placements_of(through_provider) == list(CASES["colwise_shard0_input"].expected)
    provider.shutdown()


def test_placements_in_the_transformer(mesh: DeviceMesh) -> None:
    """In the TP Transformer, Colwise backward and Rowwise forward all_reduces (embeddings
    included) go P(sum) -> R, and the vocab head gathers its sharded logits."""
    args = ModelArgs()
    torch.manual_seed(0)
    model = parallelize(Transformer(args), mesh)
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        train_step(model, *make_batch(args))
    assert mode.aggregator is not None
    by_module = {(s.fqn, s.phase, s.op): (s.src, s.dst) for s in mode.aggregator.collectives()}
    for block in ("Transformer.layers.0", "Transformer.layers.1"):
        for leaf in ("attention.wo", "feed_forward.w2"):
            assert by_module[(f"{block}.{leaf}", "forward", "all_reduce")] == ("P(sum)", "R")
        for leaf in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            assert by_module[(f"{block}.{leaf}", "backward", "all_reduce")] == ("P(sum)", "R")
    assert by_module[("Transformer.output", "backward", "all_reduce")] == ("P(sum)", "R")
    for embedding in ("Transformer.tok_embeddings", "Transformer.pos_embeddings"):
        assert by_module[(embedding, "forward", "all_reduce")] == ("P(sum)", "R")
    src, dst = by_module[("Transformer.output", "forward", "all_gather_into_tensor")]
    assert (src, dst) == ("S(2)", "R")  # Shard(-1) of the (batch, seq, vocab) logits


# ---------------------------------------------------------------- other event facts
def test_process_group_attributes(mesh: DeviceMesh) -> None:
    """Events name the mesh's process group (size 4, ranks 0-3, mesh dim 0) and number its
    collectives 1, 2, 3, ... in issue order."""
    case = CASES["colwise_shard0_input"]
    model = parallelize_module(case.module(), mesh, case.style())
    exporter = InMemorySpanExporter()
    with CommSpanMode(exporters=[exporter]):
        for _ in range(2):
            model(case.inputs(mesh.size())).sum().backward()
    events = [a for _, a in collective_events(exporter.get_finished_spans())]
    assert len(events) == 4
    group = mesh.get_group(0)
    for attrs in events:
        assert attrs[semconv.PG_SIZE] == mesh.size() == 4
        assert list(attrs[semconv.PG_RANKS]) == [0, 1, 2, 3]
        assert attrs[semconv.PG_NAME] == group.group_name
        assert attrs[semconv.MESH_DIM] == 0
        assert attrs[semconv.COLL_KIND] == semconv.KIND_COLLECTIVE
    assert [a[semconv.COLL_SEQ] for a in events] == [1, 2, 3, 4]


def test_tensor_attributes(mesh: DeviceMesh) -> None:
    """Events carry the input tensor's shape, dtype, count and bytes, the overload and reduce op."""
    _, spans = run_case(CASES["colwise_shard0_input"], mesh)
    gather, scatter = (a for _, a in collective_events(spans))
    # all_gather of the local (8, 16) Shard(0) input
    assert list(gather[semconv.TENSOR_SHAPE]) == [8, 16]
    assert gather[semconv.TENSOR_DTYPE] == "float32"
    assert gather[semconv.TENSOR_BYTES] == 8 * 16 * 4
    assert gather[semconv.TENSOR_COUNT] == 1
    assert gather[semconv.COLL_OVERLOAD] == "_c10d_functional.all_gather_into_tensor.default"
    assert semconv.COLL_REDUCE_OP not in gather
    # reduce_scatter of the gathered (32, 16) partial input gradient
    assert list(scatter[semconv.TENSOR_SHAPE]) == [8 * mesh.size(), 16]
    assert scatter[semconv.TENSOR_BYTES] == 8 * mesh.size() * 16 * 4
    assert scatter[semconv.COLL_REDUCE_OP] == "sum"
    assert scatter[semconv.COLL_OVERLOAD] == "_c10d_functional.reduce_scatter_tensor.default"

    _, spans = run_case(CASES["rowwise"], mesh)
    ((_, reduce),) = collective_events(spans)
    assert list(reduce[semconv.TENSOR_SHAPE]) == [8, 16]
    assert reduce[semconv.TENSOR_BYTES] == 8 * 16 * 4
    assert reduce[semconv.COLL_REDUCE_OP] == "sum"


def test_every_event_carries_module_and_phase(mesh: DeviceMesh) -> None:
    """Every collective event names the module and phase of the span it is attached to,
    recompute included."""
    args = ModelArgs(checkpoint={1: False})
    torch.manual_seed(0)
    model = parallelize(Transformer(args), mesh)
    exporter = InMemorySpanExporter()
    with CommSpanMode(exporters=[exporter]):
        train_step(model, *make_batch(args))
    events = collective_events(exporter.get_finished_spans())
    assert len(events) == 17
    phases = set()
    for span, attrs in events:
        span_attrs = span.attributes or {}
        assert attrs[semconv.MODULE_FQN] == span_attrs[semconv.MODULE_FQN]
        assert attrs[semconv.PHASE] == span_attrs[semconv.PHASE]
        assert span.name == f"{attrs[semconv.MODULE_FQN]} {attrs[semconv.PHASE]}"
        assert (
            attrs[semconv.COLL_OP] == "all_reduce"
            or attrs[semconv.COLL_OP] == "all_gather_into_tensor"
        )
        phases.add(attrs[semconv.PHASE])
    assert phases == {"forward", "backward", "recompute"}


# ---------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    ("name", "placements"),
    [
        ("colwise", ["S(0)", "S(0)"]),
        ("rowwise", ["S(1)", "R"]),
        ("colwise_embedding", ["S(1)"]),
        ("rowwise_embedding", ["S(0)"]),
    ],
)
def test_parameter_placements(name: str, placements: list[str], mesh: DeviceMesh) -> None:
    """Forward spans, parameter_info() and sharding_info() give each DTensor parameter's layout."""
    case = CASES[name]
    mode, spans = run_case(case, mesh)
    fqn = type(case.module()).__name__
    forward: Mapping[str, Any] = dict(module_span(spans, fqn, "forward").attributes or {})
    names = list(forward[semconv.PARAM_NAMES])
    assert list(forward[semconv.PARAM_PLACEMENTS]) == placements
    assert mode.aggregator is not None
    info = mode.aggregator.parameter_info()[fqn]
    assert [info[n]["placements"] for n in names] == placements
    assert mode.aggregator.sharding_info() == {f"{fqn}.{n}": p for n, p in zip(names, placements)}
    assert info["weight"]["shape"] == "16x16"  # the global shape, not the local shard's


def test_each_collective_names_its_own_process_group(fake_pg: None) -> None:
    """c10d ops receive a freshly boxed process group on every call, so the memory
    of one box is soon reused by another group's: events must still name the group
    the collective ran on (and count sequence numbers per group)."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    groups = [None, pair] * 100
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        for group in groups:
            dist.all_reduce(torch.ones(2), group=group)
    events = [attrs for _, attrs in collective_events(exporter.get_finished_spans())]
    want = [[0, 1, 2, 3] if g is None else [0, 1] for g in groups]
    assert [list(a[semconv.PG_RANKS]) for a in events] == want
    names = {a[semconv.PG_NAME] for a in events}
    assert len(names) == 2
    for name in names:
        seqs = [a[semconv.COLL_SEQ] for a in events if a[semconv.PG_NAME] == name]
        assert seqs == list(range(seqs[0], seqs[0] + 100))


def test_a_new_mesh_at_a_dead_mesh_address_is_learned() -> None:
    """Meshes are remembered by identity, not by an id a later mesh can reuse."""
    import weakref

    from commspan.capture.groups import ProcessGroups

    class Group:
        def __init__(self, name: str) -> None:
            self.group_name = name

    class Mesh:
        ndim = 1

        def __init__(self, name: str) -> None:
            self.group = Group(name)

        def get_group(self, dim: int) -> Group:
            return self.group

    cache = ProcessGroups()
    dead, new = Mesh("dead"), Mesh("new")
    cache.add_mesh(dead)
    # what the cache holds once ``dead`` is gone and ``new`` took its address
    cache._meshes[id(new)] = weakref.ref(dead)
    cache.add_mesh(new)
    assert cache.mesh_dims == {"dead": 0, "new": 0}


def test_a_named_mesh_met_only_through_its_collectives_names_their_dimensions(
    fake_pg: None,
) -> None:
    """No module holds a DTensor of the mesh: ``distribute_tensor``'s scatters, an
    explicit redistribution and an implicit one (a matmul's) are the first commspan
    hears of it. Their collectives still carry the dimension names the mesh gives
    its groups (reference: ``mesh.get_group(name)``), and the counts per dimension
    use them."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "cols"))
    names = {mesh.get_group(d).group_name: d for d in ("rows", "cols")}
    from commspan.testing import capture

    with capture() as cap:
        with cap.mode.step(0):
            d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
            d.redistribute(mesh, [Replicate(), Replicate()])
            a = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()])
            b = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(1)])
            (a @ b).full_tensor()
    seen = [(e.attributes[semconv.PG_NAME], e.attributes.get(semconv.MESH_DIM_NAME))
            for s in cap.spans for e in s.events if semconv.COLL_OP in e.attributes]
    assert len(seen) >= 4 and all(names[group] == dim for group, dim in seen), (seen, names)
    assert set(cap.aggregator.mesh_dim_counts()[semconv.GLOBAL_FQN]) == {"rows", "cols"}


def test_a_mesh_without_names_names_no_dimension(fake_pg: None) -> None:
    """A mesh whose dimensions have no names: torch describes its groups as
    ``mesh_dim_0`` and ``mesh_dim_1``; commspan gives their collectives no dimension
    name (``commspan.mesh.dim_name`` absent), as before it knew the descriptions."""
    from commspan.testing import capture

    mesh = init_device_mesh("cpu", (2, 2))
    with capture() as cap:
        with cap.mode.step(0):
            t = torch.ones(4)
            torch.distributed.all_reduce(t, group=mesh.get_group(1))
            d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
            d.redistribute(mesh, [Replicate(), Replicate()])
    events = [e.attributes for s in cap.spans for e in s.events
              if semconv.COLL_OP in e.attributes]
    assert events and not [a for a in events if semconv.MESH_DIM_NAME in a]


@pytest.mark.parametrize("how", ["redistribute", "full_tensor"])
def test_an_explicit_redistribution_names_its_mesh_dimension(fake_pg: None, how: str) -> None:
    """An explicit redistribution (no module with DTensor parameters ran, no implicit
    one before it): each collective names the mesh dimension whose group it ran on
    (the reference: the mesh's own groups per dimension)."""
    from commspan.testing import capture

    mesh = init_device_mesh("cpu", (2, 2))
    dim_of = {mesh.get_group(d).group_name: d for d in range(2)}
    d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
    with capture() as cap:
        with cap.mode.step(0):
            if how == "redistribute":
                d.redistribute(mesh, [Replicate(), Replicate()])
            else:
                d.full_tensor()
    events = [e.attributes for s in cap.spans for e in s.events
              if semconv.COLL_OP in (e.attributes or {})]
    assert len(events) == 2
    for attrs in events:
        assert attrs.get(semconv.MESH_DIM) == dim_of[str(attrs[semconv.PG_NAME])]


def test_placement_strings_are_dtensors_own() -> None:
    """Shards, strided shards (FSDP2 over tensor parallelism) and replicas are written
    as DTensor prints them (the reference: ``str`` of each placement), so a strided
    shard is not mistaken for the plain shard of the same dim."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from commspan.capture.dtensor import placements_str

    for placements in [(Shard(0), Replicate()), (_StridedShard(0, split_factor=2), Shard(1)),
                       (Replicate(), _StridedShard(1, split_factor=4))]:
        assert placements_str(placements) == ",".join(str(p) for p in placements)


# ---------------------------------------------------------------- the redistribution text
class _CountingText:
    """Stands in for DTensor's ``stringify_transform_infos`` (installed before a mode is
    entered, so that commspan's stand-in delegates to it): counts the texts built."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torch.distributed.tensor._redistribute import DTensorRedistributePlanner

        self.planner = DTensorRedistributePlanner
        original = DTensorRedistributePlanner.__dict__["stringify_transform_infos"].__func__
        self.calls: list[tuple[Any, ...]] = []

        def counting(*args: Any, **kwargs: Any) -> str:
            self.calls.append((args, kwargs))
            return original(*args, **kwargs)

        self.installed = staticmethod(counting)
        monkeypatch.setattr(DTensorRedistributePlanner, "stringify_transform_infos", self.installed)

    def current(self) -> Any:
        return self.planner.__dict__["stringify_transform_infos"]


@pytest.mark.skipif(not commspan.capture.dispatch.REDISTRIBUTE_HOOK,
                    reason="this torch reports no redistribution to a DebugMode")
def test_dtensor_builds_no_redistribution_text_for_commspan(
        mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """DTensor builds a text of every redistribution for the active DebugMode; commspan's
    never reads it, so none is built while commspan's mode receives the redistributions
    (the placements are recorded as before), and torch's own method is back after."""
    from torch.utils._debug_mode import DebugMode

    text = _CountingText(monkeypatch)
    case = CASES["colwise_shard0_input"]
    # the reference: torch's own DebugMode is given a text per redistribution
    model = parallelize_module(case.module(), mesh, case.style())
    with DebugMode():
        model(case.inputs(mesh.size())).sum().backward()
    built_for_torch = len(text.calls)
    assert built_for_torch >= len(case.expected) > 0

    text.calls.clear()
    mode, spans = run_case(case, mesh)
    assert text.calls == []
    assert placements_of(spans) == list(case.expected)
    assert text.current() is text.installed  # given back
    assert mode.stats()["internal_errors"] == 0


@pytest.mark.skipif(not commspan.capture.dispatch.REDISTRIBUTE_HOOK,
                    reason="this torch reports no redistribution to a DebugMode")
def test_other_debug_modes_and_direct_callers_still_get_the_redistribution_text(
        mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DebugMode of the program's entered before commspan's receives DTensor's
    redistributions, text included; a direct call of the planner's method during a
    traced step returns the text it returns outside."""
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner
    from torch.utils._debug_mode import DebugMode

    text = _CountingText(monkeypatch)
    case = CASES["colwise"]
    model = parallelize_module(case.module(), mesh, case.style())
    with DebugMode() as theirs, CommSpanMode(exporters=[InMemorySpanExporter()]):
        model(case.inputs(mesh.size())).sum().backward()
    assert len(text.calls) >= len(case.expected)  # (and redistributions without one)
    args, kwargs = text.calls[-1]
    built = text.planner.__dict__["stringify_transform_infos"].__func__(*args, **kwargs)
    assert built and built in theirs.debug_string()

    text.calls.clear()
    with CommSpanMode(exporters=[InMemorySpanExporter()]):
        direct = DTensorRedistributePlanner.stringify_transform_infos(*args, **kwargs)
    assert direct == built
    assert len(text.calls) == 1
    assert text.current() is text.installed


def test_the_redistribution_text_stand_in_is_counted_per_entry() -> None:
    """Modes entered together (nested, paused and resumed) share the stand-in; torch's
    method is back once the last has left, and an undo called twice counts once."""
    from commspan.capture import dtensor

    if dtensor._Planner is None:
        pytest.skip("this torch has no redistribution planner")
    own = dtensor._Planner.__dict__["stringify_transform_infos"]
    first = dtensor.skip_redistribution_text()
    second = dtensor.skip_redistribution_text()
    try:
        assert dtensor._Planner.__dict__["stringify_transform_infos"] is dtensor._TEXT_STANDIN
        first()
        first()
        assert dtensor._Planner.__dict__["stringify_transform_infos"] is dtensor._TEXT_STANDIN
    finally:
        first()
        second()
    assert dtensor._Planner.__dict__["stringify_transform_infos"] is own


@pytest.mark.skipif(not commspan.capture.dispatch.REDISTRIBUTE_HOOK,
                    reason="this torch reports no redistribution to a DebugMode")
def test_a_wrapper_set_over_the_redistribution_text_stand_in_does_not_loop(
        mesh: DeviceMesh) -> None:
    """Another library wraps the planner's method while commspan's stand-in is set; the
    wrapper outlives the mode, and the next mode's stand-in hands calls to it: the
    wrapper's call back into the stand-in gets torch's text instead of looping until
    RecursionError, and a DebugMode of the program's gets its text."""
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner
    from torch.utils._debug_mode import DebugMode

    own = DTensorRedistributePlanner.__dict__["stringify_transform_infos"]
    wrapped: list[int] = []
    case = CASES["colwise"]
    model = parallelize_module(case.module(), mesh, case.style())
    try:
        with CommSpanMode(exporters=[InMemorySpanExporter()]):
            inner = DTensorRedistributePlanner.__dict__["stringify_transform_infos"].__func__

            def wrapper(*args: Any, **kwargs: Any) -> str:
                wrapped.append(1)
                return inner(*args, **kwargs)

            DTensorRedistributePlanner.stringify_transform_infos = staticmethod(wrapper)
        assert DTensorRedistributePlanner.__dict__["stringify_transform_infos"].__func__ \
            is wrapper  # theirs stays
        exporter = InMemorySpanExporter()
        with DebugMode() as theirs, CommSpanMode(exporters=[exporter]):
            model(case.inputs(mesh.size())).sum().backward()
        assert wrapped and "->" in theirs.debug_string()
    finally:
        DTensorRedistributePlanner.stringify_transform_infos = own


def test_the_redistribution_text_stand_in_leaves_when_leaving_the_mode_fails() -> None:
    """A dispatch mode whose exit raises (taken off the mode stack behind its back)
    still gives torch's method back."""
    from torch.utils._python_dispatch import _pop_mode

    from commspan.capture import dtensor

    if dtensor._Planner is None:
        pytest.skip("this torch has no redistribution planner")
    own = dtensor._Planner.__dict__["stringify_transform_infos"]
    mode = CollectiveDispatchMode(lambda info, attrs: None)
    mode.__enter__()
    assert dtensor._Planner.__dict__["stringify_transform_infos"] is dtensor._TEXT_STANDIN
    _pop_mode()
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises for it
        mode.__exit__(None, None, None)
    assert dtensor._Planner.__dict__["stringify_transform_infos"] is own
