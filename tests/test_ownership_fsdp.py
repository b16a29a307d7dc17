"""FSDP2 (``fully_shard``) collectives are owned by the unit whose parameters they move.

Fake process group of 4 ranks (this process is rank 0). The reference never
looks at commspan's attribution: each FSDP unit has a distinct parameter size,
so the unit a collective serves follows from its size alone (all-gather output
and reduce-scatter input = the unit's padded parameter numel, HSDP all-reduce =
that / shard size), and the phase it serves from when it was issued (before or
after the step's ``backward()`` call).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from commspan import semconv
from commspan.testing import CommCapture, capture

WORLD = 4
STEPS = 2


class Block(torch.nn.Module):
    """Two linears with a residual; optionally under activation checkpointing."""

    def __init__(self, dim: int, hidden: int, ac: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(dim, hidden)
        self.b = torch.nn.Linear(hidden, dim)
        self.ac = ac

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ac:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Net(torch.nn.Module):
    """inp -> blocks.0 -> blocks.1 -> head. The blocks differ in size; head's 3 rows
    do not divide by the shard size, so FSDP pads them."""

    def __init__(self, ac: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList([Block(8, 16, ac), Block(8, 24, ac)])
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass
class Unit:
    """Reference facts of one FSDP unit, computed from the model before sharding."""

    fqn: str  # commspan's name of the unit module
    params: int  # its own parameters (nested units' excluded)
    padded: int  # sum over them of ceil(dim0 / shard) * shard * (other dims)


@dataclass
class Run:
    cap: CommCapture
    units: list[Unit]
    shard: int
    modules: set[str]  # commspan names of the modules that ran
    steps: list[tuple[int, int]] = field(default_factory=list)  # (forward, backward) start ns


def _units(roots: dict[str, list[torch.nn.Module]], shard: int) -> dict[str, Unit]:
    """``roots``: the reference's name of each unit -> the modules sharded as one."""
    nested = {id(m) for ms in roots.values() for m in ms}
    out = {}
    for rel, members in roots.items():
        shapes: list[torch.Size] = []
        todo = list(members)
        while todo:
            cur = todo.pop()
            shapes.extend(p.shape for p in cur._parameters.values() if p is not None)
            todo.extend(c for c in cur._modules.values() if c is not None and id(c) not in nested)
        padded = sum(math.ceil(s[0] / shard) * shard * math.prod(s[1:]) for s in shapes)
        out[rel] = Unit(rel, len(shapes), padded)
    return out


def _run(
    *,
    hsdp: bool = False,
    reshard: bool | int = True,
    ac: bool = False,
    root: bool = True,
    grouped: bool = False,
    wrapped: bool = False,
    setup: Callable[[Net], None] | None = None,
) -> Run:
    """Shard ``Net`` (both blocks, and the root unless ``root=False``), train 2 steps.
    ``grouped``: blocks.1 and head are one unit (``fully_shard([blocks.1, head])``),
    which the lowest module holding both, the root, owns. ``wrapped``: each block in
    a ``checkpoint_wrapper``, the wrapper sharded (as torchtitan does), named as the
    block (torch's ``state_dict`` names, which the reference's are)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
        shard = WORLD // 2
    else:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        shard = WORLD
    model = Net(ac)
    roots: dict[str, list[torch.nn.Module]] = {"blocks.0": [model.blocks[0]]}
    if grouped:  # named by hand: the root is the lowest module holding both
        roots[""] = [model.blocks[1], model.head]
        roots["<root>"] = [model]
    else:
        roots["blocks.1"] = [model.blocks[1]]
        if root:
            roots[""] = [model]
    units = _units(roots, shard)
    assert len({u.padded for u in units.values()}) == len(units), "sizes must tell units apart"
    ran = [n for n, m in model.named_modules() if not isinstance(m, torch.nn.ModuleList)]
    if wrapped:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    fully_shard(model.blocks[0], mesh=mesh, reshard_after_forward=reshard)
    if grouped:
        fully_shard([model.blocks[1], model.head], mesh=mesh, reshard_after_forward=reshard)
        units["<root>"].fqn = ""
    else:
        fully_shard(model.blocks[1], mesh=mesh, reshard_after_forward=reshard)
    if root:
        fully_shard(model, mesh=mesh)
    if setup is not None:
        setup(model)
    prefix = type(model).__name__  # fully_shard renames the class: FSDPNet
    for unit in units.values():
        unit.fqn = prefix + ("." + unit.fqn if unit.fqn else "")
    modules = {prefix + ("." + n if n else "") for n in ran}
    steps: list[tuple[int, int]] = []
    with capture() as cap:
        for step in range(STEPS):
            with cap.mode.step(step):
                t_forward = time.time_ns()
                loss = model(torch.randn(4, 6)).sum()
                steps.append((t_forward, time.time_ns()))
                loss.backward()
    return Run(cap, list(units.values()), shard, modules, steps)


def _collectives(run: Run) -> list[tuple[str, int, dict[str, Any]]]:
    """(fqn of the span holding it, time, attributes) of every collective event."""
    out = []
    for span in run.cap.spans:
        for event in span.events:
            if semconv.COLL_OP in event.attributes:
                fqn = span.attributes[semconv.MODULE_FQN]
                out.append((str(fqn), event.timestamp, dict(event.attributes)))
    return out


@dataclass
class Ref:
    unit: Unit
    kind: str
    phase: str
    moved: int  # bytes of the unit's tensors the collective carries


def _reference(run: Run, attrs: dict[str, Any], when: int) -> Ref:
    """What the collective is, from its size and the time it was issued alone."""
    op = attrs[semconv.COLL_OP]
    elements = attrs[semconv.TENSOR_BYTES] // 4  # float32 parameters and gradients
    if op.startswith("all_gather"):  # input: one rank's shard; output: the whole unit
        full, kind, moved = elements * attrs[semconv.PG_SIZE], "unshard", elements * attrs[
            semconv.PG_SIZE
        ]
    elif op.startswith("reduce_scatter"):  # input: the whole unit's gradients
        full, kind, moved = elements, "reduce_grad", elements
    else:  # HSDP: the reduce-scattered shard, all-reduced across replicas
        assert op == "all_reduce", op
        full, kind, moved = elements * run.shard, "all_reduce", elements
    matches = [u for u in run.units if u.padded == full]
    assert len(matches) == 1, (op, elements, run.units)
    step = max(i for i, (t_forward, _) in enumerate(run.steps) if t_forward <= when)
    in_backward = when >= run.steps[step][1]
    phase = "backward" if kind != "unshard" or in_backward else "forward"
    return Ref(matches[0], kind, phase, moved * 4)


def _ancestors(fqn: str, modules: set[str]) -> list[str]:
    """``fqn`` and the modules (that ran) enclosing it by name."""
    out = [fqn]
    head = fqn
    while "." in head:
        head = head.rsplit(".", 1)[0]
        if head in modules:
            out.append(head)
    return out


def _check(run: Run) -> list[dict[str, Any]]:
    """Every collective's owner, kind, phase, size and counts equal the reference;
    returns the collectives' attributes for further checks."""
    expected: dict[str, dict[str, dict[str, int]]] = {}
    seen = []
    for span_fqn, when, attrs in _collectives(run):
        ref = _reference(run, attrs, when)
        got = (
            attrs.get(semconv.OWNER_FQN),
            attrs.get(semconv.OWNER_SOURCE),
            attrs.get(semconv.OWNER_KIND),
            attrs.get(semconv.PHASE),
            attrs.get(semconv.OWNER_PARAMS),
            attrs.get(semconv.OWNER_BYTES),
        )
        assert got == (ref.unit.fqn, "fsdp", ref.kind, ref.phase, ref.unit.params, ref.moved), (
            attrs
        )
        assert attrs[semconv.MODULE_FQN] == span_fqn  # the event stays where it was issued
        op = attrs[semconv.COLL_OP]
        for fqn in [*_ancestors(ref.unit.fqn, run.modules), semconv.GLOBAL_FQN]:
            slot = expected.setdefault(fqn, {}).setdefault(ref.phase, {})
            slot[op] = slot.get(op, 0) + 1
        seen.append(attrs)
    counts = run.cap.aggregator.module_counts()
    assert {f: c for f, c in counts.items() if c} == expected, run.cap.table(0)
    assert run.cap.mode.stats()["internal_errors"] == 0
    return seen


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"reshard": False},
        {"reshard": 2},
        {"hsdp": True},
        {"ac": True},
        {"root": False},
        {"grouped": True},
        {"wrapped": True},
    ],
    ids=["default", "no-reshard", "reshard-2", "hsdp", "checkpointed", "two-roots", "grouped",
         "checkpoint-wrapper"],
)
def test_fsdp_collectives_owned_by_their_unit(fake_pg: None, config: dict[str, Any]) -> None:
    """Each all-gather, reduce-scatter and HSDP all-reduce names the unit whose
    parameters it moves, its kind, phase, parameter count and bytes, and counts for
    that unit, the modules enclosing it by name and Global only."""
    run = _run(**config)
    seen = _check(run)
    kinds = {a[semconv.OWNER_KIND] for a in seen}
    assert kinds == ({"unshard", "reduce_grad", "all_reduce"} if config.get("hsdp")
                     else {"unshard", "reduce_grad"})
    backward_gathers = [
        a for a in seen if a[semconv.OWNER_KIND] == "unshard" and a[semconv.PHASE] == "backward"
    ]
    grouped = [a for a in seen if semconv.FSDP_UNIT_MODULES in a]
    if config.get("grouped"):  # every collective of the grouped unit names its modules
        unit = next(u for u in run.units if u.params == 6)  # blocks.1 (4) + head (2)
        assert grouped and all(a[semconv.OWNER_PARAMS] == unit.params for a in grouped)
        assert len(grouped) == sum(a[semconv.OWNER_PARAMS] == unit.params for a in seen)
        assert {tuple(a[semconv.FSDP_UNIT_MODULES]) for a in grouped} == {
            ("FSDPNet.blocks.1", "FSDPNet.head")}
    else:
        assert grouped == []
    if config.get("wrapped"):  # the spans are the unwrapped model's modules, by its names
        assert {s.attributes[semconv.MODULE_FQN] for s in run.cap.spans
                if semconv.MODULE_FQN in s.attributes} == {
            *run.modules, semconv.GLOBAL_FQN}
    if config.get("reshard") is False:
        assert backward_gathers == []  # nothing was resharded after forward
    else:
        assert backward_gathers, "the blocks are re-gathered for backward"


def _prefetch_both_ways(model: Net) -> None:
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])


def test_prefetched_unshards_are_marked_and_owned_by_their_unit(fake_pg: None) -> None:
    """An unshard issued by another unit's hook (explicit forward prefetch,
    implicit and explicit backward prefetch) is marked prefetched and owned by
    the unit it gathers, although it sits on the span that was open then; the
    unit's own unshards are not marked."""
    run = _run(setup=_prefetch_both_ways)
    seen = _check(run)
    gathers = [a for a in seen if a[semconv.OWNER_KIND] == "unshard"]
    blocks1 = "FSDPNet.blocks.1"
    forward_prefetch = [a for a in gathers if a[semconv.OWNER_FQN] == blocks1
                        and a[semconv.PHASE] == "forward"]
    assert len(forward_prefetch) == STEPS
    for attrs in forward_prefetch:  # issued by blocks.0's pre-forward, for blocks.1
        assert attrs[semconv.OWNER_PREFETCH] is True
        assert attrs[semconv.MODULE_FQN] == "FSDPNet.blocks.0"
    for attrs in gathers:
        # a unit's own pre-forward gathers inside its own span; any other
        # position means another unit's hook fetched it ahead of time
        inside = attrs[semconv.MODULE_FQN] == attrs[semconv.OWNER_FQN] or attrs[
            semconv.MODULE_FQN].startswith(attrs[semconv.OWNER_FQN] + ".")
        assert attrs[semconv.OWNER_PREFETCH] is (not inside), attrs


def test_default_backward_gathers_are_prefetches_outside_their_unit(fake_pg: None) -> None:
    """With default settings FSDP2 gathers every block for backward from the hook
    of the module after it: the event sits where it was issued (another module's
    span, or Global), the unit owns and counts it; credit_fqns names the owners
    that had no open span."""
    run = _run()
    seen = _check(run)
    backward = [a for a in seen if a[semconv.OWNER_KIND] == "unshard"
                and a[semconv.PHASE] == "backward"]
    assert backward and all(a[semconv.OWNER_PREFETCH] for a in backward)
    for attrs in backward:
        assert attrs[semconv.MODULE_FQN] != attrs[semconv.OWNER_FQN]
        assert attrs[semconv.OWNER_FQN] in attrs[semconv.OWNER_CREDIT]


def test_owner_from_labels_matches_the_parameter_group_on_the_stack(fake_pg: None) -> None:
    """FSDP's labels (what commspan reads) and its parameter group on the Python
    stack name the same unit for every FSDP collective, HSDP included: a torch
    upgrade that renames or drops the labels fails here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commspan.capture.dispatch import CollectiveDispatchMode
    from commspan.capture.parallel import ParallelModules
    from commspan.ownership.fsdp import parse_labels

    parallel = ParallelModules()
    found: list[tuple[str | None, str | None]] = []

    class Spy(CollectiveDispatchMode):
        def __init__(self) -> None:
            super().__init__(self._seen)

        def _seen(self, info: Any, attrs: Any) -> None:
            label = parse_labels(self.labels())
            unit = parallel.fsdp_unit_on_stack()
            found.append((label.unit if label else None, unit.fqn if unit else None))

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    parallel.learn([("FSDPNet" + ("." + n if n else ""), m) for n, m in model.named_modules()])
    with Spy():
        model(torch.randn(4, 6)).sum().backward()
    assert len(found) == 11  # 3 gathers, 2 re-gathers, 3 reduce-scatters, 3 all-reduces
    for label_unit, stack_unit in found:
        assert label_unit is not None and stack_unit is not None
        assert ("FSDPNet." + label_unit if label_unit else "FSDPNet") == stack_unit


def test_live_and_jsonl_tables_agree(fake_pg: None, tmp_path: Any) -> None:
    """The live aggregator, Aggregator.from_jsonl and the spans' count attributes plus
    credits give the same per-module counts, table and collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commspan import Aggregator
    from commspan.exporters import JsonlSpanExporter

    mesh = init_device_mesh("cpu", (WORLD,))
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with capture(exporters=[JsonlSpanExporter(tmp_path / "rank{rank}.jsonl")]) as cap:
        for step in range(STEPS):
            with cap.mode.step(step):
                model(torch.randn(4, 6)).sum().backward()
    offline = Aggregator.from_jsonl(tmp_path)
    live = cap.aggregator
    assert offline.module_counts() == live.module_counts()
    assert offline.table(1) == live.table(1)
    assert offline.collectives() == live.collectives()
    # from the spans alone: count attributes + the events' credits
    by_span: dict[str, dict[str, dict[str, int]]] = {}
    for span in cap.spans:
        fqn = span.attributes.get(semconv.MODULE_FQN)
        if fqn is None:
            continue
        for key, value in span.attributes.items():
            parsed = semconv.parse_count_key(key)
            if parsed is not None:
                slot = by_span.setdefault(str(fqn), {}).setdefault(parsed[0], {})
                slot[parsed[1]] = slot.get(parsed[1], 0) + int(value)
        for event in span.events:
            for credited in event.attributes.get(semconv.OWNER_CREDIT, ()):
                ph, op = event.attributes[semconv.PHASE], event.attributes[semconv.COLL_OP]
                slot = by_span.setdefault(credited, {}).setdefault(ph, {})
                slot[op] = slot.get(op, 0) + 1
    assert by_span == live.module_counts()
    # the command line's per-module details (--show, diff) group by owner too
    from commspan.analysis.issued import issued
    from commspan.exporters import read_spans

    records = read_spans(*tmp_path.glob("*.jsonl"))
    details = {(i.fqn, i.phase, i.op): i.count for i in issued(records)}
    assert details == {(c.fqn, c.phase, c.op): c.count for c in live.collectives()}
    assert {fqn for fqn, _, _ in details} == {"FSDPNet", "FSDPNet.blocks.0", "FSDPNet.blocks.1"}


def test_a_second_model_with_the_same_names_is_one_owner(fake_pg: None) -> None:
    """A model built again (same classes, same names) replaces the units of the first
    in the registry: the relative name stays unambiguous, so its collectives are
    owned from the labels alone, not by walking the stack."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commspan.capture.parallel import ParallelModules

    mesh = init_device_mesh("cpu", (WORLD,))
    parallel = ParallelModules()
    for _ in range(2):
        model = Net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        parallel.learn([("FSDPNet" + ("." + n if n else ""), m) for n, m in model.named_modules()])
    assert [u.fqn for u in parallel.fsdp_units("")] == ["FSDPNet"]
    assert [u.fqn for u in parallel.fsdp_units("blocks.1")] == ["FSDPNet.blocks.1"]
    assert parallel.fsdp_units("blocks.1")[0].params == 4


def test_a_tied_parameter_counts_once_in_its_unit(fake_pg: None) -> None:
    """An embedding and a head sharing one weight: FSDP's unit holds it once, and so
    does ``commspan.owner.params`` (it counted it once per module holding it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Linear(8, 8, bias=False)
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
            self.head = torch.nn.Linear(8, 8, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(self.emb(x)))

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    model = Tied()
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with capture() as cap:
        with cap.mode.step(0):
            model(torch.randn(2, 8)).sum().backward()
    reference = {  # FSDP's own parameter groups
        "FSDPTied": len(model._get_fsdp_state()._fsdp_param_group.fsdp_params),
        "FSDPTied.block": len(model.block._get_fsdp_state()._fsdp_param_group.fsdp_params),
    }
    assert reference == {"FSDPTied": 1, "FSDPTied.block": 4}
    seen = {}
    for span in cap.spans:
        for event in span.events:
            attrs = event.attributes or {}
            if attrs.get(semconv.OWNER_SOURCE) == "fsdp":
                seen.setdefault(attrs[semconv.OWNER_FQN], set()).add(attrs[semconv.OWNER_PARAMS])
    assert seen == {fqn: {n} for fqn, n in reference.items()}


class _EmbedNormOut(torch.nn.Module):
    """torchtitan's root unit: an embedding, then a sequence-parallel norm."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(32, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.tok(tokens)))


def test_a_collective_from_fsdps_final_callback_is_not_the_embeddings() -> None:
    """FSDP2 root unit with an embedding (whose input needs no gradient, so nothing
    ends its backward but the end of the graph) and a sequence-parallel norm: the
    norm's gradient all-reduces run in FSDP's final backward callback, after the
    embedding's backward kernel (a dispatch mode of the test's own sees both). They
    are not the embedding's: its backward is over by then."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.utils._python_dispatch import TorchDispatchMode

    from commspan.testing import fake_mesh, fake_process_group

    class Order(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func._opname
            if name in ("embedding_dense_backward", "all_reduce"):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    with fake_process_group(world_size=4):
        mesh = fake_mesh((2, 2), names=("dpx", "tpx"))
        torch.manual_seed(0)
        model = _EmbedNormOut()
        parallelize_module(model, mesh["tpx"], {
            "norm": SequenceParallel(), "out": ColwiseParallel(input_layouts=Shard(1))})
        fully_shard(model, mesh=mesh["dpx"])
        order = Order()
        with capture() as cap:
            with cap.mode.step(0), order:
                model(torch.randint(0, 32, (2, 8))).sum().backward()
    late = order.seen[order.seen.index("embedding_dense_backward") + 1:]
    assert late.count("all_reduce") == 2, order.seen
    owners = [e.attributes[semconv.OWNER_FQN] for s in cap.spans for e in s.events
              if e.attributes.get(semconv.COLL_OP) == "all_reduce"
              and e.attributes.get(semconv.PHASE) == "backward"]
    assert len(owners) == 2 and not any(o.endswith(".tok") for o in owners), owners
    assert cap.counts("FSDP_EmbedNormOut.tok", "backward") == {}


class _NormBlock(torch.nn.Module):
    """A torchtitan block in small: a sequence-parallel norm, then a tensor-parallel MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(8)
        self.up = torch.nn.Linear(8, 16, bias=False)  # as torchtitan's: no biases
        self.down = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _NormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_NormBlock(), _NormBlock()])
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def test_a_tensor_parallel_gradient_all_reduce_in_fsdps_post_backward_is_its_units() -> None:
    """FSDP2 over tensor parallelism, as torchtitan shards a model: the norms are
    sequence-parallel, so their parameters are replicated over ``tp`` and their
    gradients are partial sums. FSDP2's post-backward all-reduces each such gradient
    over ``tp`` while it collects its unit's gradients for the reduce-scatter (with
    gradient accumulation, once per optimizer step, not per microbatch). Each is its
    unit's: the blocks' norms' their block's, the final norm's the root's, wherever
    FSDP's hook happened to run (after a block's backward span ended; for the root, in
    FSDP's final callback, outside every module). Reference: the parameters replicated
    over ``tp`` in each unit (their placements and local sizes), one all-reduce each of
    the gradient's size; the test's own dispatch mode sees those all-reduces."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.utils._python_dispatch import TorchDispatchMode

    from commspan.testing import fake_mesh, fake_process_group

    class Sizes(TorchDispatchMode):  # the tp all-reduces' input bytes, in backward
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor first: its collectives come back here
            if func._opname == "all_reduce":
                self.seen.append(args[0].numel() * args[0].element_size())
            return func(*args, **(kwargs or {}))

    with fake_process_group(world_size=4):
        mesh = fake_mesh((2, 2), names=("dp", "tp"))
        torch.manual_seed(0)
        model = _NormNet()
        tp = mesh["tp"]
        parallelize_module(model, tp, {
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        for block in model.blocks:
            parallelize_module(block, tp, {
                "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1))})
        # reference: each unit's own parameters replicated over tp, by local bytes
        blocks = {id(p) for block in model.blocks for p in block.parameters()}

        def replicated(params: Any) -> list[int]:
            return sorted(p.to_local().numel() * 4 for p in params
                          if p.placements == (Replicate(),))

        expected = {f"FSDP_NormNet.blocks.{i}": replicated(block.parameters())
                    for i, block in enumerate(model.blocks)}
        expected["FSDP_NormNet"] = replicated(
            p for p in model.parameters() if id(p) not in blocks)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        sizes = Sizes()
        with capture() as cap:
            for step in range(STEPS):
                with cap.mode.step(step), sizes:
                    for micro in range(2):  # gradient accumulation: sync on the last
                        model.set_requires_gradient_sync(micro == 1)
                        model(torch.randn(2, 4, 8)).sum().backward()
    assert sorted(sizes.seen) == sorted(STEPS * sum(expected.values(), [])), sizes.seen
    owned: dict[str, list[int]] = {}
    for span in cap.spans:
        for event in span.events:
            attrs = event.attributes
            if attrs.get(semconv.COLL_OP) == "all_reduce":
                assert attrs[semconv.PHASE] == "backward", dict(attrs)
                owned.setdefault(str(attrs[semconv.OWNER_FQN]), []).append(
                    int(attrs[semconv.TENSOR_BYTES]))
    assert {fqn: sorted(b) for fqn, b in owned.items()} == {
        fqn: sorted(STEPS * b) for fqn, b in expected.items()}
    for fqn, b in expected.items():  # the unit's own row counts them (and Global's)
        own = cap.counts(fqn, "backward").get("all_reduce", 0)
        inner = sum(len(v) for k, v in expected.items() if k.startswith(fqn + "."))
        assert own == STEPS * (len(b) + inner), (fqn, own)


class _ScaledBlock(torch.nn.Module):
    """A tensor-parallel MLP whose hidden activation (sharded over ``tp`` on its last
    dim) is scaled by a parameter replicated over ``tp``: DTensor gives that parameter
    a gradient sharded over ``tp``, which FSDP2 all-gathers to its placement while it
    collects the unit's gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.down = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        h = DTensor.from_local(self.up(x), self.scale.device_mesh, [Shard(2)])
        return x + self.down((h * self.scale).to_local())


def test_a_tensor_parallel_gradient_gathered_in_fsdps_post_backward_carries_its_bytes() -> None:
    """A redistribute_grad all-gather's owner bytes are the gradient's (its output, as an
    unshard's are), not one rank's shard of it. Reference: the parameter's size."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from commspan.testing import fake_mesh, fake_process_group

    with fake_process_group(world_size=4):
        mesh = fake_mesh((2, 2), names=("dp", "tp"))
        torch.manual_seed(0)
        model = _ScaledBlock()
        tp = mesh["tp"]
        parallelize_module(model, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        model.scale = torch.nn.Parameter(distribute_tensor(model.scale.data, tp, [Replicate()]))
        gradient = model.scale.to_local().numel() * 4  # the whole gradient, on every rank
        fully_shard(model, mesh=mesh["dp"])
        with capture() as cap, cap.mode.step(0):
            model(torch.randn(2, 4, 8)).sum().backward()
    gathers = [e.attributes for s in cap.spans for e in s.events
               if e.attributes.get(semconv.OWNER_KIND) == "redistribute_grad"]
    assert [(a[semconv.COLL_OP], a[semconv.OWNER_FQN], a[semconv.PHASE]) for a in gathers] == [
        ("all_gather_into_tensor", "FSDP_ScaledBlock", "backward")], gathers
    assert gathers[0][semconv.OWNER_BYTES] == gradient, gathers


def test_a_units_gradient_reduction_counts_its_trainable_parameters() -> None:
    """Fine-tuning: a unit's first layer is frozen. Its all-gathers move every
    parameter; its reduce-scatter only the trainable ones' gradients, and says so in
    ``commspan.owner.params`` (reference: ``requires_grad`` of the unit's parameters)."""
    from torch.distributed.fsdp import fully_shard

    from commspan.testing import fake_mesh, fake_process_group

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.relu(self.a(x)))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(x))

    with fake_process_group(world_size=4):
        mesh = fake_mesh(4)
        model = Net()
        model.block.a.requires_grad_(False)
        every = len(list(model.block.parameters()))
        trainable = sum(p.requires_grad for p in model.block.parameters())
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with capture() as cap:
            with cap.mode.step(0):
                model(torch.randn(2, 8)).sum().backward()
    seen = {(e.attributes[semconv.OWNER_KIND], e.attributes[semconv.OWNER_PARAMS])
            for s in cap.spans for e in s.events
            if e.attributes.get(semconv.OWNER_FQN) == "FSDPNet.block"}
    assert seen == {("unshard", every), ("reduce_grad", trainable)}
    assert trainable < every


def _unshard_by_hand(model: Net) -> None:
    """No implicit backward prefetch; blocks.1's backward pre-hook unshards blocks.0
    itself (what FSDP2's ``unshard()`` is for)."""
    for block in model.blocks:
        block.set_modules_to_backward_prefetch([])
    model.blocks[1].register_full_backward_pre_hook(
        lambda _m, _g: model.blocks[0].unshard())


def test_an_unshard_issued_from_a_backward_hook_serves_the_backward(fake_pg: None) -> None:
    """A user's ``unshard()`` during backward, without activation checkpointing, is the
    unit's backward all-gather (it was counted a recompute: nothing is recomputed)."""
    run = _run(setup=_unshard_by_hand)
    seen = _check(run)
    assert not [a for a in seen if a[semconv.PHASE] == "recompute"]


def test_parameters_fsdp2_manages_are_described_as_it_keeps_them(fake_pg: None) -> None:
    """FSDP2 registers a unit's gathered (plain) parameters while the unit runs: the
    root unit's own `norm` ran gathered, and was described `local` with the gathered
    shape, where the child units' parameters (described before their own gather) said
    S(0). Every parameter is now described by the sharded form FSDP2 keeps, in every
    step: the reference is torch's own DTensor parameters after the step."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.up = torch.nn.Linear(16, 64)
            self.down = torch.nn.Linear(64, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.relu(self.up(self.norm(x))))

    def words(p: Any) -> str:  # the test's own rendering of a placement
        return f"S({p.dim})" if type(p).__name__ == "Shard" else type(p).__name__[0]

    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (4,))
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for _ in range(2):
        with capture() as cap:
            model(torch.randn(4, 16)).sum().backward()
        expected = {
            f"{type(model).__name__}.{name}": {pname: {"shape": "x".join(map(str, p.shape)),
                                    "placements": ", ".join(map(words, p.placements))}
                            for pname, p in module.named_parameters(recurse=False)}
            for name, module in model.named_children()
        }
        assert all(isinstance(p, torch.distributed.tensor.DTensor)
                   for p in model.parameters())
        assert cap.aggregator.parameter_info() == expected
