"""torch.compile: no graph break from commspan, every collective counted once, the
compiled module spanned, and (aot_eager) each collective owned by its submodule.

Fake process group of 4 ranks. References that do not use commspan's
attribution: a dispatch mode of the test's own (an "infra" mode, as commspan's,
so that compile still compiles) counting the collective ops each step runs;
dynamo's own counters (graphs compiled, graph breaks); and, for the owners,
which submodule issues which op in the uncompiled model, from a forward-hook
stack (their backward ops follow from autograd: an all_reduce's gradient is an
all_reduce, an all_gather's a reduce_scatter).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from commspan import semconv
from commspan.testing import capture

DIM = 8
STEPS = 2
_OPS = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor"}
_CANONICAL = {"all_reduce_": "all_reduce"}  # inductor calls the in-place variant


class _Reference(TorchDispatchMode):
    """Counts functional collectives; an infra mode, so dynamo still compiles."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "_c10d_functional" and func._opname in _OPS:
            self.seen[_CANONICAL.get(func._opname, func._opname)] += 1
        return func(*args, **(kwargs or {}))


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.proj(x), "sum", dist.group.WORLD)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = funcol.all_gather_single_autograd(self.fc(x), 0, dist.group.WORLD)
        return gathered[: x.shape[0]]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


def _owner_reference() -> dict[tuple[str, str], str]:
    """(phase, op) -> the submodule that issues it, from the uncompiled model."""
    net, stack, seen = Net(), [], []

    class Hooked(_Reference):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "_c10d_functional" and func._opname in _OPS:
                seen.append((func._opname, stack[-1] if stack else None))
            return func(*args, **(kwargs or {}))

    for name, module in (("Net.attn", net.attn), ("Net.mlp", net.mlp)):
        module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name) and None)
        module.register_forward_hook(lambda m, a, o: stack.pop() and None)
    with Hooked():
        net(torch.randn(4, DIM))
    forward = {("forward", op): owner for op, owner in seen}
    grad_of = {"all_reduce": "all_reduce", "all_gather_into_tensor": "reduce_scatter_tensor"}
    backward = {("backward", grad_of[op]): owner for op, owner in seen}
    return {**forward, **backward}


@pytest.fixture(scope="module")
def owners(fake_pg: None) -> dict[tuple[str, str], str]:
    return _owner_reference()


def _run(backend: str) -> tuple[Any, Counter[str], dict[str, int]]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    compiled = torch.compile(Net(), backend=backend)
    reference = _Reference()
    with capture() as cap:
        for step in range(STEPS):
            with cap.mode.step(step), reference:
                compiled(torch.randn(4, DIM, requires_grad=True)).sum().backward()
    stats = {"graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
             "breaks": sum(torch._dynamo.utils.counters["graph_break"].values())}
    return cap, reference.seen, stats


def _events(cap: Any) -> list[dict[str, Any]]:
    return [dict(e.attributes) for s in cap.spans for e in s.events
            if semconv.COLL_OP in e.attributes]


@pytest.fixture(scope="module", params=["eager", "aot_eager", "inductor"])
def compiled_run(request: pytest.FixtureRequest, fake_pg: None) -> Iterator[Any]:
    yield request.param, *_run(request.param)


def test_compiled_and_counted_once(compiled_run: Any) -> None:
    """The model is compiled into one graph (commspan's hooks do not break it) and
    each collective it runs is one event, as the reference mode counts them."""
    backend, cap, seen, stats = compiled_run
    assert stats["breaks"] == 0, backend
    assert stats["graphs"] >= 1
    events = _events(cap)
    assert Counter(e[semconv.COLL_OP] for e in events) == seen
    assert sum(seen.values()) == 4 * STEPS  # all_reduce, all_gather; their backwards
    assert cap.aggregator.comm_counts() == dict(seen)
    assert cap.mode.stats()["internal_errors"] == 0


def test_the_compiled_module_has_forward_and_backward_spans(compiled_run: Any) -> None:
    """torch.compile(model)'s call is the model's span: forward and backward, named
    as the model; every collective is issued inside one of them."""
    backend, cap, _, _ = compiled_run
    spans = Counter((s.attributes.get(semconv.MODULE_FQN), s.attributes.get(semconv.PHASE))
                    for s in cap.spans if s.attributes.get(semconv.MODULE_FQN) != "Global")
    assert spans[("Net", "forward")] == STEPS and spans[("Net", "backward")] == STEPS, spans
    assert {e[semconv.MODULE_FQN] for e in _events(cap)} == {"Net"}


def test_owners_under_each_backend(compiled_run: Any,
                                   owners: dict[tuple[str, str], str]) -> None:
    """aot_eager: each collective is owned by the submodule that issues it (the
    reference), in its phase. eager and inductor keep no module at run time: the
    compiled module owns them."""
    backend, cap, _, _ = compiled_run
    for e in _events(cap):
        key = (e[semconv.PHASE], e[semconv.COLL_OP])
        if backend == "aot_eager":
            assert (e[semconv.OWNER_FQN], e[semconv.OWNER_SOURCE]) == (owners[key], "compile")
        else:
            assert (e[semconv.OWNER_FQN], e[semconv.OWNER_SOURCE]) == ("Net", "position")
    counts = cap.aggregator.module_counts()
    if backend == "aot_eager":
        assert counts["Net.attn"] == {"forward": {"all_reduce": STEPS},
                                      "backward": {"all_reduce": STEPS}}
        assert counts["Net.mlp"] == {"forward": {"all_gather_into_tensor": STEPS},
                                     "backward": {"reduce_scatter_tensor": STEPS}}


def test_fsdp2_with_compiled_blocks_keeps_unit_owners(fake_pg: None) -> None:
    """FSDP2 units whose blocks are compiled in place (aot_eager): FSDP's hooks run
    eagerly, so each all-gather and reduce-scatter is still owned by its unit; the
    reference counts them per step, and the units are told apart by size. Each
    block's call is its span, forward and backward (it had none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (4,))
    blocks = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Linear(16, DIM))
    for block in blocks:
        fully_shard(block, mesh=mesh)
        block.compile(backend="aot_eager")
    reference = _Reference()
    with capture() as cap:
        for step in range(STEPS):
            with cap.mode.step(step), reference:
                blocks(torch.randn(4, DIM)).sum().backward()
    events = [e for e in _events(cap) if e[semconv.COLL_OP] != "all_reduce"]
    assert events and all(e[semconv.OWNER_SOURCE] == "fsdp" for e in events)
    sizes = {"Sequential.0": (16 * DIM + 16) * 4, "Sequential.1": (DIM * 16 + DIM) * 4}
    for e in events:  # the whole padded unit: the all-gather's output, the scatter's input
        assert e[semconv.OWNER_BYTES] == sizes[e[semconv.OWNER_FQN]], e
    spans = Counter((s.attributes.get(semconv.MODULE_FQN), s.attributes.get(semconv.PHASE))
                    for s in cap.spans)
    for fqn in sizes:  # each block called once a step
        assert spans[(fqn, "forward")] == spans[(fqn, "backward")] == STEPS, spans
    assert cap.mode.stats()["internal_errors"] == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_tensor_parallel_mlp_compiled(fake_pg: None, backend: str) -> None:
    """A DTensor tensor-parallel MLP, compiled: one graph, each all_reduce counted
    once; under aot_eager owned per submodule and phase as torch's own
    CommDebugMode counts them on the uncompiled model."""
    from torch.distributed.tensor.debug import CommDebugMode

    from commspan.testing import fake_mesh
    from commspan.testing.models import MLPModule, parallelize_mlp

    mesh = fake_mesh(4)
    x = torch.randn(8, 10, requires_grad=True)
    plain = parallelize_mlp(MLPModule(), mesh)
    torch_cdm = CommDebugMode()
    with torch_cdm:
        plain(x).sum().backward()
    per_module = torch_cdm.comm_module_counts  # {fqn: {phase: {op: n}}}, leaves direct
    expected: Counter[tuple[str, str]] = Counter()
    for fqn, phases in per_module.items():
        if fqn in ("Global", "MLPModule"):  # the sums of the leaves'
            continue
        for phase in ("forward", "backward"):
            for n in phases.get(phase, {}).values():
                expected[(fqn, phase)] += n
    assert expected, per_module

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(parallelize_mlp(MLPModule(), mesh), backend=backend)
    with capture() as cap:
        with cap.mode.step(0):
            compiled(x).sum().backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    events = _events(cap)
    assert len(events) == sum(expected.values())
    if backend == "aot_eager":
        got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in events)
        assert got == expected
    else:
        assert {e[semconv.OWNER_FQN] for e in events} == {"MLPModule"}
    assert cap.mode.stats()["internal_errors"] == 0


def test_a_compiled_region_left_by_an_exception_does_not_outlive_its_step(
    fake_pg: None,
) -> None:
    """A compiled region that raised never says it ended: the module stack it
    reported is forgotten when the step ends, so the next step's eager
    collectives are owned by their own span, not by the stale submodule."""
    net = Net()
    with capture() as cap:
        with cap.mode.step(0):
            net(torch.randn(4, DIM))  # names the modules
            dispatch = cap.mode._dispatch
            assert dispatch is not None
            dispatch.operators.append(type("Enter", (), {"tag": "enter"})())
            dispatch._handle_fx_nn_module_stack([], {str(id(net.mlp)): ("L['self'].mlp", MLP)},
                                                None)
            assert dispatch.compiled_module() == (id(net.mlp), True, "mlp")  # as in a region
        with cap.mode.step(1):
            assert dispatch.compiled_module() is None
            net.attn(torch.randn(4, DIM))
    last = [e for e in _events(cap)][-1]
    assert (last[semconv.OWNER_FQN], last[semconv.OWNER_SOURCE]) == ("Net.attn", "position")


def test_unknown_module_ids_do_not_rebuild_the_id_map(fake_pg: None) -> None:
    """A compiled graph's module the tracker never named (``model.compile()`` in
    place) is unknown at the cost of a lookup: the id map is rebuilt only after
    the tracker has named new modules."""
    first = Net()
    with capture() as cap:
        with cap.mode.step(0):
            first(torch.randn(4, DIM))
        tracker = cap.mode._tracker
        assert tracker is not None
        assert tracker.fqn_of_id(12345) is None
        built = dict(tracker._by_id)
        assert built  # the first model's modules
        tracker._by_id.clear()  # a rebuild would fill it again
        assert tracker.fqn_of_id(54321) is None and tracker._by_id == {}
        net = Net()
        with cap.mode.step(1):
            net(torch.randn(4, DIM))
        assert tracker.fqn_of_id(id(net.mlp)) == "Net.mlp"
        assert len(tracker._by_id) > len(built) / 2


def test_compiled_code_running_under_the_mode_never_compiles_the_mode(
    fake_pg: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dispatch mode keeps Dynamo out of its own frames (instead of torch's wrapper on
    every op): ops run eagerly from compiled code (a frame Dynamo leaves alone, its frame
    callback still set) go through the Dynamo-disabled dispatch, so Dynamo never
    compiles the dispatch (it does when the guard hands such ops to the plain dispatch:
    the control), and the collective is counted once, owned by the module."""
    import commspan.capture.dispatch as dispatch
    from commspan.capture.dispatch import CollectiveDispatchMode

    compiled_for = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    code = dispatch.describe.__code__  # called by the dispatch for a collective

    def eager(y: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(y + 1, "sum", dist.group.WORLD))

    # a frame Dynamo runs as it is, from compiled code: its frame callback stays set
    eager_ops = torch.compiler.disable(eager, recursive=False)

    class Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return eager_ops(x * 2)

    def run() -> Any:
        torch._dynamo.reset()
        model = torch.compile(Broken(), backend="eager")
        with capture() as cap:
            model(torch.ones(4))
        return cap

    guarded: list[int] = []
    disabled = CollectiveDispatchMode._dispatch_without_dynamo

    def counting(self: Any, *args: Any) -> Any:
        guarded.append(1)
        return disabled(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(CollectiveDispatchMode, "_dispatch_without_dynamo", counting)
        cap = run()
    assert guarded, "no op ran with Dynamo's frame callback set: the test proves nothing"
    assert compiled_for(code) == []
    assert sum(cap.counts("Global", "forward").values()) == 1
    assert cap.counts("Broken", "forward") == {"all_reduce": 1}
    with monkeypatch.context() as patch:  # the control: no guard, Dynamo compiles it
        patch.setattr(dispatch, "_dynamo_callback", lambda: None)
        run()
    assert compiled_for(code) != []
    torch._dynamo.reset()


class _CheckpointsNet(torch.nn.Module):
    def __init__(self, use_reentrant: bool, in_place: bool) -> None:
        super().__init__()
        self.net = Net()
        if in_place:
            self.net.compile(backend="eager")
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.net, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_module_compiled_in_place_recomputes_in_phase_recompute(
        fake_pg: None, use_reentrant: bool) -> None:
    """``net.compile()`` under activation checkpointing: the collectives its re-run
    issues are phase recompute, as many as the uncompiled model issues inside
    ``net``'s forward while autograd runs (the test's own mode and a forward-hook
    flag), owned by ``net``, whose re-run is a recompute span (they were counted as
    backward, then in the parent's span: the module compiled in place had none)."""
    torch.manual_seed(0)
    eager = _CheckpointsNet(use_reentrant, in_place=False)
    inside: list[bool] = []
    eager.net.register_forward_pre_hook(lambda m, a: inside.append(True) and None)
    eager.net.register_forward_hook(lambda m, a, o: inside.pop() and None, always_call=True)
    rerun: Counter[str] = Counter()

    class Rerun(_Reference):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "_c10d_functional" and func._opname in _OPS and inside \
                    and torch._C._current_graph_task_id() != -1:
                rerun[_CANONICAL.get(func._opname, func._opname)] += 1
            return func(*args, **(kwargs or {}))

    with Rerun():
        eager(torch.randn(4, DIM, requires_grad=True)).sum().backward()
    assert rerun["all_reduce"] >= 1, rerun

    torch._dynamo.reset()
    model = _CheckpointsNet(use_reentrant, in_place=True)
    with capture() as cap:
        with cap.mode.step(0):
            model(torch.randn(4, DIM, requires_grad=True)).sum().backward()
    assert cap.aggregator.module_counts()["_CheckpointsNet"]["recompute"] == dict(rerun)
    assert cap.aggregator.module_counts()["_CheckpointsNet.net"]["recompute"] == dict(rerun)
    spans = Counter((s.attributes.get(semconv.MODULE_FQN), s.attributes.get(semconv.PHASE))
                    for s in cap.spans)
    assert spans[("_CheckpointsNet.net", "recompute")] == 1, spans


def test_a_submodule_called_twice_keeps_its_owner(fake_pg: None) -> None:
    """Dynamo names a module's second call in one forward ``<id>@1``: its collectives
    are still owned by that module (they fell back to the compiled root), as eagerly."""

    class Gather(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = funcol.all_gather_tensor_autograd(self.fc(x), 0, dist.group.WORLD)
            return g.view(4, -1, 8).sum(0)

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g = Gather()
            self.other = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.g(self.other(self.g(x)))  # the same module, twice

    def owners(compiled: bool) -> Counter[tuple[str, str, str]]:
        torch.manual_seed(0)
        model = Shared()
        target = torch.compile(model, backend="aot_eager") if compiled else model
        with capture() as cap:
            with cap.mode.step(0):
                target(torch.randn(2, 8)).sum().backward()
        return Counter((a[semconv.COLL_OP], a[semconv.OWNER_FQN], a[semconv.PHASE])
                       for a in _events(cap))

    eager = owners(False)
    assert eager == {("all_gather_into_tensor", "Shared.g", "forward"): 2,
                     ("reduce_scatter_tensor", "Shared.g", "backward"): 2}
    assert owners(True) == eager


class _Holder(torch.nn.Module):
    """A parent holding a (possibly compiled) tensor-parallel MLP, as torchtitan holds
    its compiled blocks."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_a_compiled_child_is_named_as_the_module_it_wraps(fake_pg: None) -> None:
    """``torch.compile(child)`` registered in a parent (aot_eager): the owners are
    the names torch's CommDebugMode gives on the uncompiled parent
    (``_Holder.mlp.net2``), not ``_Holder.mlp._orig_mod.net2``."""
    from torch.distributed.tensor.debug import CommDebugMode

    from commspan.testing import fake_mesh
    from commspan.testing.models import MLPModule, parallelize_mlp

    mesh = fake_mesh(4)
    x = torch.randn(8, 10, requires_grad=True)
    torch_cdm = CommDebugMode()
    with torch_cdm:
        _Holder(parallelize_mlp(MLPModule(), mesh))(x).sum().backward()
    expected: Counter[tuple[str, str]] = Counter()
    for fqn, phases in torch_cdm.comm_module_counts.items():
        if fqn.count(".") == 2:  # the leaves (the others hold their sums)
            for phase in ("forward", "backward"):
                expected[(fqn, phase)] += sum(phases.get(phase, {}).values())
    assert +expected, torch_cdm.comm_module_counts

    torch._dynamo.reset()
    model = _Holder(torch.compile(parallelize_mlp(MLPModule(), mesh), backend="aot_eager"))
    with capture() as cap:
        with cap.mode.step(0):
            model(x).sum().backward()
    got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in _events(cap))
    assert got == +expected
    names = {s.attributes.get(semconv.MODULE_FQN) for s in cap.spans}
    assert "_Holder.mlp" in names and not any("_orig_mod" in str(n) for n in names)
    assert cap.mode.stats()["internal_errors"] == 0


class _BreakingNet(Net):
    """``Net`` whose forward breaks Dynamo's graph between its two submodules (the
    same ops uncompiled)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x)
        torch._dynamo.graph_break()
        return self.mlp(x)


class _Blocks(torch.nn.Module):
    """Blocks of one class, each possibly compiled on its own (torchtitan's
    ``model.layers[i] = torch.compile(block)``, or ``block.compile(backend=in_place)``):
    dynamo runs one graph for all. ``breaks``: blocks that break Dynamo's graph."""

    def __init__(self, compiled: bool, copies: bool = False, in_place: str | None = None,
                 breaks: bool = False) -> None:
        super().__init__()
        blocks: list[torch.nn.Module] = [(_BreakingNet if breaks else Net)() for _ in range(3)]
        if compiled:
            blocks = [torch.compile(b, backend="aot_eager") for b in blocks]
        if in_place is not None:
            for b in blocks:
                b.compile(backend=in_place)
        if copies:  # a compiled block that ran, deep-copied: its graph is shared too
            blocks[0](torch.randn(4, DIM)).sum().backward()
            blocks[1:] = [copy.deepcopy(blocks[0]) for _ in blocks[1:]]
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _blocks_reference(x: torch.Tensor, breaks: bool = False) -> Counter[tuple[str, str]]:
    """(leaf, phase) -> collectives, as torch's CommDebugMode counts them on the
    uncompiled ``_Blocks`` (``_Blocks.blocks.<i>.<attn|mlp>``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    torch_cdm = CommDebugMode()
    with torch_cdm:
        _Blocks(compiled=False, breaks=breaks)(x).sum().backward()
    expected: Counter[tuple[str, str]] = Counter()
    for fqn, phases in torch_cdm.comm_module_counts.items():
        if fqn.count(".") == 3:  # _Blocks.blocks.<i>.<attn|mlp>: the leaves
            for phase in ("forward", "backward"):
                expected[(fqn, phase)] += sum(phases.get(phase, {}).values())
    assert len(expected) == 12, torch_cdm.comm_module_counts
    return expected


def _block_calls(model: torch.nn.Module, x: torch.Tensor,
                 top: bool = False) -> Counter[tuple[str, str]]:
    """(block, phase) -> calls of the uncompiled ``model``'s three blocks
    (``<Model>.blocks.<i>``; and, ``top``, of the model itself), forward and backward,
    as torch's ModTracker sees them."""
    from torch.distributed._tools.mod_tracker import ModTracker

    calls: Counter[tuple[str, str]] = Counter()
    tracker = ModTracker()

    def count(phase: str) -> Any:
        def hook(module: torch.nn.Module, *_: Any) -> None:
            fqn = tracker.get_known_fqn(module)
            if fqn.count(".") == 2 or (top and module is model):
                calls[(fqn, phase)] += 1
        return hook

    tracker.register_user_hooks(pre_fw_hook=count("forward"), pre_bw_hook=count("backward"))
    with tracker:
        model(x).sum().backward()
    assert len(calls) == (8 if top else 6), calls
    return calls


def _block_spans(cap: Any, top: str | None = None) -> Counter[tuple[str, str]]:
    """(block, phase) -> spans (and of the model named ``top``)."""
    return Counter((str(s.attributes[semconv.MODULE_FQN]), str(s.attributes[semconv.PHASE]))
                   for s in cap.spans
                   if str(s.attributes.get(semconv.MODULE_FQN)).count(".") == 2 or (
                       top is not None and s.attributes.get(semconv.MODULE_FQN) == top))


def _owners_at(expected: Counter[tuple[str, str]], dots: int,
               steps: int = STEPS) -> Counter[tuple[str, str]]:
    """CommDebugMode's counts of one step (``expected``: ``<Model>.blocks.<i>.<leaf>``,
    or a block's own) charged to the module at most ``dots`` dots deep on each
    module's path (3: the leaf, 2: its block, 0: the model), for ``steps`` steps."""
    out: Counter[tuple[str, str]] = Counter()
    for (fqn, phase), n in expected.items():
        out[(".".join(fqn.split(".")[:dots + 1]), phase)] += n * steps
    return out


@pytest.mark.parametrize("copies", [False, True], ids=["compiled-each", "deep-copied"])
def test_blocks_compiled_one_by_one_own_their_collectives(fake_pg: None, copies: bool) -> None:
    """Three blocks of one class, each ``torch.compile``d (aot_eager): every block's
    submodules own their own collectives, as torch's CommDebugMode counts them on
    the uncompiled model. (All were charged to the first block's submodules: the
    graph names the modules it was traced on.)"""
    x = torch.randn(4, DIM, requires_grad=True)
    expected = _blocks_reference(x)

    torch._dynamo.reset()
    model = _Blocks(compiled=True, copies=copies)
    with capture() as cap:
        with cap.mode.step(0):
            model(x).sum().backward()
    got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in _events(cap))
    assert got == expected
    assert {e[semconv.OWNER_SOURCE] for e in _events(cap)} == {"compile"}
    assert cap.mode.stats()["internal_errors"] == 0


@pytest.mark.parametrize("order", ["shard_then_compile", "compile_then_shard"])
def test_fsdp2_units_of_compiled_blocks_keep_their_names(fake_pg: None, order: str) -> None:
    """FSDP2 units on blocks compiled with ``torch.compile(block)`` and registered in
    the model: either order of wrapping, the all-gathers and reduce-scatters are
    FSDP's, owned by units named as the blocks (FSDP's own label says
    ``blocks.0._orig_mod``); sizes from the blocks' parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (4,))
    blocks = [torch.nn.Linear(DIM, 16), torch.nn.Linear(16, DIM)]
    model = torch.nn.Sequential()
    for i, block in enumerate(blocks):
        if order == "shard_then_compile":
            fully_shard(block, mesh=mesh)
            model.add_module(str(i), torch.compile(block, backend="aot_eager"))
        else:
            wrapped = torch.compile(block, backend="aot_eager")
            fully_shard(wrapped, mesh=mesh)
            model.add_module(str(i), wrapped)
    with capture() as cap:
        for step in range(STEPS):
            with cap.mode.step(step):
                model(torch.randn(4, DIM)).sum().backward()
    events = [e for e in _events(cap) if e[semconv.COLL_OP] != "all_reduce"]
    assert events and {e[semconv.OWNER_SOURCE] for e in events} == {"fsdp"}
    sizes = {f"Sequential.{i}": sum(p.numel() for p in b.parameters()) * 4
             for i, b in enumerate(blocks)}
    for e in events:  # padding: both blocks' sizes divide by 4
        assert e[semconv.OWNER_BYTES] == sizes[e[semconv.OWNER_FQN]], e
    names = {str(s.attributes.get(semconv.MODULE_FQN)) for s in cap.spans}
    assert not any("_orig_mod" in n for n in names), names
    assert cap.mode.stats()["internal_errors"] == 0


@pytest.mark.parametrize("backend", ["aot_eager", "eager", "force_eager"])
def test_blocks_compiled_in_place_have_spans_and_own_their_collectives(
        fake_pg: None, backend: str) -> None:
    """Three blocks of one class, each compiled in place (``block.compile()``): each
    block's call is its span, forward and backward, as torch's ModTracker sees the
    uncompiled blocks; under aot_eager each block's submodules own their collectives
    as torch's CommDebugMode counts them uncompiled, under eager each block owns its
    own. One graph, no graph break. (The blocks had no span: aot_eager charged every
    block's collectives to the first block's submodules, eager to the parent.)
    ``force_eager`` (Dynamo runs the compiled call eagerly): one span per call too."""
    x = torch.randn(4, DIM, requires_grad=True)
    expected = _blocks_reference(x)
    calls = _block_calls(_Blocks(compiled=False), x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _Blocks(compiled=False, in_place="aot_eager" if backend == "force_eager" else backend)
    originals = [b._compiled_call_impl for b in model.blocks]
    stance = torch.compiler.set_stance("force_eager" if backend == "force_eager" else "default")
    with stance, capture() as cap:
        for step in range(STEPS):
            with cap.mode.step(step):
                model(x).sum().backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    if backend != "force_eager":
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert _block_spans(cap) == Counter({k: n * STEPS for k, n in calls.items()})
    events = _events(cap)
    got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in events)
    if backend == "aot_eager":
        assert got == Counter({k: n * STEPS for k, n in expected.items()})
        assert {e[semconv.OWNER_SOURCE] for e in events} == {"compile"}
    else:  # no module at run time: the block (force_eager: its submodules, eagerly)
        depth = 3 if backend == "force_eager" else 2
        per_owner: Counter[tuple[str, str]] = Counter()
        for (fqn, phase), n in expected.items():
            per_owner[(".".join(fqn.split(".")[:depth + 1]), phase)] += n * STEPS
        assert got == per_owner
        assert {e[semconv.OWNER_SOURCE] for e in events} == {"position"}
    assert [b._compiled_call_impl for b in model.blocks] == originals  # (restored)
    assert cap.mode.stats()["internal_errors"] == 0


def test_blocks_compiled_in_place_inside_a_compiled_model(fake_pg: None) -> None:
    """``torch.compile(model)`` around blocks compiled in place (aot_eager): the
    submodules own their collectives as CommDebugMode counts them uncompiled; a mode
    entered around some steps and not others compiles the model as often as one
    entered around every step, no graph break; the blocks' compiled calls are
    theirs again after each mode."""
    x = torch.randn(4, DIM, requires_grad=True)
    expected = _blocks_reference(x)

    def graphs(pattern: list[bool]) -> tuple[int, Any]:
        made = []

        def make() -> Any:
            inner = _Blocks(compiled=False, in_place="aot_eager")
            made.append((inner, [b._compiled_call_impl for b in inner.blocks]))
            return torch.compile(inner, backend="aot_eager")

        compiled, breaks, caps = _run_steps(make, x, pattern)
        (inner, originals), = made
        assert [b._compiled_call_impl for b in inner.blocks] == originals  # (restored)
        assert sum(breaks.values()) == 0
        return compiled, caps[-1] if caps else None

    untraced, _ = graphs([False, False])
    always, _ = graphs([True, True, True])
    mixed, cap = graphs([True, False, True, False, True])
    assert always == untraced and mixed <= untraced + 1, (untraced, always, mixed)
    got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in _events(cap))
    assert got == expected


def test_blocks_compiled_in_place_after_the_mode_named_them(fake_pg: None) -> None:
    """Blocks compiled in place after the mode first saw them: from their first
    compiled call on (the same step) each block has its span and its submodules own
    their collectives as CommDebugMode counts them uncompiled, never a sibling
    block's (aot_eager's graph names the first block's submodules). (Until the next
    step they had no span, their backward collectives the parent's: the blocks' own
    hooks ran compiled.)"""
    x = torch.randn(4, DIM, requires_grad=True)
    expected = _blocks_reference(x)
    torch._dynamo.reset()
    model = _Blocks(compiled=False)
    with capture() as cap:
        with cap.mode.step(0):
            model(x).sum().backward()  # named, uncompiled
            for block in model.blocks:
                block.compile(backend="aot_eager")
            model(x).sum().backward()
        first = _events(cap)
        with cap.mode.step(1):
            model(x).sum().backward()
    for events in (first[len(first) // 2:], _events(cap)[len(first):]):
        got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in events)
        assert got == expected
        assert {e[semconv.OWNER_SOURCE] for e in events} == {"compile"}
    assert cap.mode.stats()["internal_errors"] == 0


class _Fail(Exception):
    pass


_FAILING: list[bool] = []


@torch.compiler.disable
def _fail_if_asked(x: torch.Tensor) -> torch.Tensor:
    if _FAILING:
        raise _Fail("asked to fail")
    return x


class _Raises(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_module_compiled_in_place_gets_its_own_call_back(fake_pg: None) -> None:
    """The spanned call is in the module's attribute only while a mode traces: its
    own compiled call is back during a sampled-out step, after the mode is left with
    the user's exception (raised inside the compiled call; it propagates unchanged,
    the span ending ERROR), and a compiled call the user set while the mode was in
    (``compile()`` again) is kept."""
    torch._dynamo.reset()
    model = _Raises()
    model.net.forward = lambda x: _fail_if_asked(Net.forward(model.net, x))  # type: ignore[method-assign]
    model.net.compile(backend="eager")
    original = model.net._compiled_call_impl
    seen = []
    with pytest.raises(_Fail) as raised, capture(sample=2) as cap:
        for step in range(3):
            with cap.mode.step(step):
                model(torch.randn(4, DIM))
                seen.append(model.net._compiled_call_impl is original)
        with cap.mode.step(4):
            _FAILING.append(True)
            try:
                model(torch.randn(4, DIM))
            finally:
                _FAILING.clear()
    assert seen == [False, True, False]  # spanned, its own (sampled out), spanned
    assert str(raised.value) == "asked to fail"
    assert model.net._compiled_call_impl is original
    failed = [s for s in cap.spans if s.attributes.get(semconv.MODULE_FQN) == "_Raises.net"
              and not s.status.is_ok]
    assert len(failed) == 1 and failed[0].attributes[semconv.PHASE] == "forward"
    assert [e.attributes["exception.type"] for e in failed[0].events
            if e.name == "exception"] == ["_Fail"]
    assert cap.mode.stats()["internal_errors"] == 0
    with capture() as cap:
        model(torch.randn(4, DIM))
        model.net.compile(backend="eager")
        recompiled = model.net._compiled_call_impl
    assert recompiled is not original and model.net._compiled_call_impl is recompiled


def test_modules_compiled_in_place_are_not_kept_alive(fake_pg: None) -> None:
    """A model whose blocks are compiled in place is freed when the user drops it,
    while the mode is in and after it left (commspan keeps the spanned calls out of
    place weakly), as without the mode."""
    import gc
    import weakref

    def dropped() -> Any:
        model = _Blocks(compiled=False, in_place="eager")
        model(torch.randn(4, DIM, requires_grad=True)).sum().backward()
        return weakref.ref(model.blocks[1])

    torch._dynamo.reset()
    gone = dropped()
    gc.collect()
    assert gone() is None  # the reference: untraced
    with capture() as cap:
        with cap.mode.step(0):
            gone = dropped()
        gc.collect()
        assert gone() is None
        with cap.mode.step(1):
            gone = dropped()
    gc.collect()
    assert gone() is None


def test_compat_mod_tracker_calls_hooks_of_blocks_compiled_in_place_as_torch_does(
        fake_pg: None) -> None:
    """commspan.compat's ModTracker calls the user's hooks for blocks compiled in
    place, forward and backward, as torch's ModTracker does (it called them for the
    parent only)."""
    from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker

    from commspan.compat import ModTracker

    def seen(cls: Any) -> list[tuple[str, str]]:
        torch._dynamo.reset()
        model = _Blocks(compiled=False, in_place="eager")
        calls: list[tuple[str, str]] = []
        tracker = cls()

        def hook(phase: str) -> Any:
            return lambda module, *_: calls.append((tracker.get_known_fqn(module), phase))

        tracker.register_user_hooks(pre_fw_hook=hook("forward"), pre_bw_hook=hook("backward"))
        with tracker:
            model(torch.randn(4, DIM, requires_grad=True)).sum().backward()
        return calls

    expected = seen(TorchModTracker)
    assert ("_Blocks.blocks.1", "backward") in expected, expected
    assert Counter(seen(ModTracker)) == Counter(expected)  # (backward: torch's own order)


def test_a_model_compiled_in_place_after_an_uncompiled_step_is_spanned_at_once(
        fake_pg: None) -> None:
    """A model that ran uncompiled under the mode (named), then compiled in place
    (``model.compile()``) and called at top level: in the next step its submodules own
    their collectives (aot_eager), forward and backward, as they issue them in the
    uncompiled model."""
    torch._dynamo.reset()
    net = Net()
    with capture() as cap:
        with cap.mode.step(0):
            net(torch.randn(4, DIM, requires_grad=True)).sum().backward()
        net.compile(backend="aot_eager")
        with cap.mode.step(1):
            net(torch.randn(4, DIM, requires_grad=True)).sum().backward()
        second = _events(cap)[4:]
    assert Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in second) == Counter(
        {(fqn, phase): 1 for (phase, _), fqn in _owner_reference().items()})
    assert cap.mode.stats()["internal_errors"] == 0


def _run_steps(make: Any, x: torch.Tensor,
               pattern: list[bool]) -> tuple[int, int, list[Any]]:
    """A fresh model from ``make`` run one step per entry of ``pattern``, traced (a
    mode of its own) or not: (graphs Dynamo compiled, graph breaks, the captures)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = make()
    caps = []
    for step, traced in enumerate(pattern):
        if not traced:
            model(x).sum().backward()
            continue
        with capture() as cap:
            with cap.mode.step(step):
                model(x).sum().backward()
        assert cap.mode.stats()["internal_errors"] == 0
        caps.append(cap)
    counters = torch._dynamo.utils.counters
    return int(counters["stats"]["unique_graphs"]), Counter(counters["graph_break"]), caps


def _compiles_as_untraced(make: Any, x: torch.Tensor) -> list[Any]:
    """Traced steps compile as many graphs, with the same graph breaks, as untraced
    ones; traced steps between untraced ones compile at most once more each (the
    global hooks' two states; a frame compiled again breaks again where the model
    breaks, nowhere else). The captures of two traced steps."""
    untraced = _run_steps(make, x, [False, False])[:2]
    graphs, breaks, caps = _run_steps(make, x, [True, True])
    mixed, mixed_breaks, _ = _run_steps(make, x, [True, False, True])
    assert (graphs, breaks) == untraced, (untraced, graphs, breaks)
    assert mixed <= 2 * untraced[0], (untraced, mixed)
    assert set(mixed_breaks) == set(untraced[1]), (untraced, mixed_breaks)
    return caps


@pytest.mark.parametrize(("backend", "breaks"),
                         [("aot_eager", False), ("eager", False), ("aot_eager", True)],
                         ids=["aot_eager", "eager", "aot_eager-graph-breaks"])
def test_a_model_compiled_in_place_at_top_level_has_its_span_from_its_first_call(
        fake_pg: None, backend: str, breaks: bool) -> None:
    """A model compiled in place (``model.compile()``) and called at top level,
    never seen uncompiled: from its first call its call is its span, forward and
    backward, as torch's ModTracker sees the uncompiled model's (blocks that break
    the graph: theirs too); under aot_eager the submodules own their collectives
    as torch's CommDebugMode counts them uncompiled, under eager the model owns them
    (nothing at run time names a module of the compiled region). No graph break, no
    recompile of commspan's; its compiled call is its own after each mode. (Its first
    step had no span of it: Dynamo compiled commspan's hooks, which its
    ``_call_impl`` runs eagerly, into frames that returned at once; that step's
    collectives were ``Global``'s.)"""
    x = torch.randn(4, DIM, requires_grad=True)
    expected = _blocks_reference(x, breaks)
    calls = _block_calls(_Blocks(compiled=False, breaks=breaks), x, top=True)
    made: list[_Blocks] = []

    def make() -> torch.nn.Module:
        model = _Blocks(compiled=False, breaks=breaks)
        model.compile(backend=backend)
        made.append(model)
        return model

    for cap in _compiles_as_untraced(make, x):
        spans = _block_spans(cap, top="_Blocks")
        assert spans == Counter({k: n for k, n in calls.items() if breaks or k[0] == "_Blocks"})
        got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in _events(cap))
        assert got == _owners_at(expected, 3 if backend == "aot_eager" else 0, steps=1)
    assert all(type(m.__dict__["_compiled_call_impl"]).__name__ != "_SpannedCall" for m in made)


def test_hooks_are_left_to_dynamo_where_torch_cannot_mark_their_frames(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A torch without ``set_code_exec_strategy`` (commspan marks its hook frames
    with it at import): the marking logs at debug level and returns; nothing
    raises."""
    import logging

    from commspan.capture import modules

    monkeypatch.delattr(torch._dynamo.eval_frame, "set_code_exec_strategy")
    with caplog.at_level(logging.DEBUG, logger=modules.__name__):
        modules._run_as_is(_run_block.__code__)
    assert "could not keep Dynamo out of the module hooks" in caplog.text


def test_compat_comm_debug_mode_counts_compiled_blocks_as_uncompiled(fake_pg: None) -> None:
    """commspan.compat's CommDebugMode around blocks compiled one by one (torchtitan's
    ``model.layers[i] = torch.compile(block)``; Dynamo runs their frames eagerly under
    a mode that is not compile infrastructure): its per-module counts are torch's
    CommDebugMode's on the uncompiled model. (The blocks' submodules were skipped,
    their collectives the blocks', as torch's own class skips them.)"""
    from torch.distributed.tensor.debug import CommDebugMode

    from commspan.compat import CommDebugMode as CompatCommDebugMode

    x = torch.randn(4, DIM, requires_grad=True)
    torch_cdm = CommDebugMode()
    with torch_cdm:
        _Blocks(compiled=False)(x).sum().backward()
    torch._dynamo.reset()
    compat_cdm = CompatCommDebugMode()
    with compat_cdm:
        _Blocks(compiled=True)(x).sum().backward()
    assert compat_cdm.comm_module_counts == torch_cdm.comm_module_counts
    assert any(fqn.count(".") == 3 for fqn in compat_cdm.comm_module_counts)


def test_a_user_hook_raising_after_a_block_compiled_in_place_leaves_the_mode_as_uncompiled(
        fake_pg: None) -> None:
    """commspan.compat's ModTracker nested in a mode, its user post-hook raising for
    a block compiled in place: the mode's span of the block closes as in the
    uncompiled model (the forward returned: UNSET), and a later uncompiled call of
    the block nests as there (the mode's call was left open, its span ERROR, and
    the block's own hook skipped after). Reference: the same run uncompiled."""
    from commspan.compat import ModTracker as CompatModTracker

    class _Boom(Exception):
        pass

    def run(in_place: bool) -> list[tuple[Any, str]]:
        torch._dynamo.reset()
        model = _Blocks(compiled=False, in_place="eager" if in_place else None)
        first = model.blocks[0]

        def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
            if mod is first:
                raise _Boom()

        with capture() as cap:
            with cap.mode.step(0):
                tracker = CompatModTracker()
                tracker.register_user_hooks(post_fw_hook=post)
                with pytest.raises(_Boom), tracker:
                    model(torch.randn(4, DIM))
                first._compiled_call_impl = None  # (uncompiled from here on)
                model(torch.randn(4, DIM))
        assert cap.mode.stats()["internal_errors"] == 0
        return [(s.attributes.get(semconv.MODULE_FQN), s.status.status_code.name,
                 s.parent is not None) for s in cap.spans
                if str(s.attributes.get(semconv.MODULE_FQN, "")).count(".") <= 2]

    assert run(in_place=True) == run(in_place=False)


def _own_counts(model: torch.nn.Module, x: torch.Tensor) -> Counter[tuple[str, str]]:
    """(module, phase) -> collectives the module issues itself (not its submodules),
    from torch's CommDebugMode on the uncompiled ``model`` (which counts each
    module's own and its submodules')."""
    from torch.distributed.tensor.debug import CommDebugMode

    torch_cdm = CommDebugMode()
    with torch_cdm:
        model(x).sum().backward()
    total = {(fqn, phase): sum(ops.values())
             for fqn, phases in torch_cdm.comm_module_counts.items()
             for phase, ops in phases.items() if fqn != "Global"}
    own: Counter[tuple[str, str]] = Counter(total)
    for (fqn, phase), n in total.items():
        parent = fqn
        while "." in parent:  # the nearest module above it that CommDebugMode lists
            parent = parent.rsplit(".", 1)[0]
            if (parent, phase) in total:
                own[(parent, phase)] -= n
                break
    assert total and all(n >= 0 for n in own.values()), total
    return +own


class _Block(torch.nn.Module):
    """An Attn, then (``brk``) a graph break, then an all-reduce of its own."""

    def __init__(self, brk: bool = False) -> None:
        super().__init__()
        self.attn = Attn()
        self.fc = torch.nn.Linear(DIM, DIM)
        self.brk = brk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x)
        if self.brk:
            torch._dynamo.graph_break()
        return funcol.all_reduce(self.fc(x), "sum", dist.group.WORLD)


def _run_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


class _Stack(torch.nn.Module):
    """Three ``_Block``s, each called directly or through ``run(block, x)``."""

    def __init__(self, brk: bool = False, run: Any = None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(brk) for _ in range(3)])
        self.run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.run is None else self.run(block, x)
        return x


def test_a_compiled_function_called_with_each_block_charges_the_block_that_ran(
        fake_pg: None) -> None:
    """A function compiled once (aot_eager) and called with each of three blocks of
    one class (``run(block, x)``): Dynamo runs one graph for all, which names the
    first block's modules. Forward collectives are owned by the block that ran (and
    its submodules), as CommDebugMode counts them on the uncompiled model; backward
    ones by the span open around the call (the model's: which block's graph ran
    only the forward's frame knows), never by the first block. (Every collective
    was charged to ``_Stack.blocks.0``'s modules.) The blocks have no spans (Dynamo
    traces their calls). No recompile under the mode."""
    x = torch.randn(4, DIM, requires_grad=True)
    own = _own_counts(_Stack(), x)
    forward = Counter({k: n for k, n in own.items() if k[1] == "forward"})
    backward = sum(n for (_, phase), n in own.items() if phase == "backward")
    assert len(forward) == 6 and backward == 6, own

    def make() -> torch.nn.Module:
        return _Stack(run=torch.compile(_run_block, backend="aot_eager"))

    for cap in _compiles_as_untraced(make, x):
        got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in _events(cap))
        assert got == forward + Counter({("_Stack", "backward"): backward})
        assert _block_spans(cap) == Counter()


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_blocks_breaking_the_graph_of_a_compiled_model_have_spans_and_own_their_collectives(
        fake_pg: None, backend: str) -> None:
    """``torch.compile(model)`` around three blocks of one class whose forward breaks
    the graph (after their ``attn``; then an all-reduce of their own): Dynamo calls
    each block eagerly and compiles its frame, one graph for all three, which names
    the first block's modules. Each block's call is its span, forward and backward,
    as torch's ModTracker sees the uncompiled model's, and the model has one span
    per call (the wrapper's; its own call inside is not a second one). Under
    aot_eager every module owns the collectives it issues itself (the block that
    ran, never the first; a block's own, whose graph nodes after the break have no
    module, too), forward and backward, as torch's CommDebugMode counts them on the
    uncompiled model; under eager each block (the innermost module with a span).
    No graph break, no recompile of commspan's, and Dynamo never compiles
    commspan's hooks. (The blocks had no span, their collectives the model's:
    Dynamo compiled the hooks into frames that returned at once, and commspan
    ignored every module call inside a compiled module.)"""
    from commspan.capture import modules

    x = torch.randn(4, DIM, requires_grad=True)
    own = _own_counts(_Stack(brk=True), x)
    assert len(own) == 12, own  # (each block's and its attn's, forward and backward)
    calls = _block_calls(_Stack(brk=True), x, top=True)

    def make() -> torch.nn.Module:
        return torch.compile(_Stack(brk=True), backend=backend)

    for cap in _compiles_as_untraced(make, x):
        assert _block_spans(cap, top="_Stack") == calls
        got = Counter((e[semconv.OWNER_FQN], e[semconv.PHASE]) for e in _events(cap))
        assert got == _owners_at(own, 3 if backend == "aot_eager" else 2, steps=1)
    compiled_for = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    for hook in (modules._global_pre_fw, modules._global_post_fw, modules._Closer.__call__):
        assert compiled_for(hook.__code__) == []
