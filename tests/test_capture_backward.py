"""capture/backward.py: backward spans inferred from the forward pass, in awkward cases:
in-place modules, deleted modules, inputs without grad, no_grad, activation checkpointing,
and nothing left behind step after step.

Spans are captured synchronously through a ``TracerProvider`` with an in-memory
exporter. Tensor parallelism runs on the fake process group (``mesh`` fixture).
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from _tracing import (
    IN_DIM,
    Boom,
    Holder,
    mlp_step,
    named,
    tp_mlp,
    traced_mode,
)
from opentelemetry.trace import StatusCode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from commspan import semconv
from commspan.testing import assert_well_formed, collective_events
from commspan.testing import span_fqn as fqn
from commspan.testing import span_phase as phase


class _PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.ident = nn.Identity()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ident(self.act(self.lin(x))))


def test_inplace_module_keeps_backward_span_identity_gets_none() -> None:
    """ReLU(inplace=True), which returns its input modified, gets a backward span; Identity none."""
    mode, exporter = traced_mode()
    with mode:
        _PassThrough()(torch.randn(2, 4, requires_grad=True)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    backward = {fqn(s) for s in spans if phase(s) == "backward"}
    assert "_PassThrough.act" in backward
    assert "_PassThrough.ident" not in backward
    assert {"_PassThrough", "_PassThrough.lin", "_PassThrough.out"} <= backward


def test_module_deleted_before_backward(mesh: DeviceMesh) -> None:
    """Backward after the model is deleted and collected still yields named, well-formed spans."""
    mode, exporter = traced_mode()
    model = tp_mlp(mesh)
    ref = weakref.ref(model)
    with mode:
        loss = model(torch.randn(4, IN_DIM, requires_grad=True)).sum()
        del model
        gc.collect()
        assert ref() is None
        loss.backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    backward = {fqn(s) for s in spans if phase(s) == "backward"}
    assert backward == {"MLPModule", "MLPModule.net1", "MLPModule.relu", "MLPModule.net2"}
    assert mode.stats()["internal_errors"] == 0
    assert mode.aggregator is not None
    assert mode.aggregator.module_counts()["MLPModule.net1"] == {"backward": {"all_reduce": 1}}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_inputs_that_do_not_require_grad(mesh: DeviceMesh) -> None:
    """Inputs without grad: counts match torch's CommDebugMode; every module has a backward span."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = tp_mlp(mesh)
    reference = CommDebugMode()
    with reference:
        mlp_step(model, requires_grad=False)
    mode, exporter = traced_mode()
    with mode:
        mlp_step(model, requires_grad=False)
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    forward = {fqn(s) for s in spans if phase(s) == "forward"}
    assert {fqn(s) for s in spans if phase(s) == "backward"} == forward
    assert mode.aggregator is not None
    assert mode.aggregator.total_count() == reference.get_total_counts() >= 1
    assert mode.stats()["internal_errors"] == 0


def test_no_grad_forward_has_no_backward_spans(mesh: DeviceMesh) -> None:
    """Under torch.no_grad only forward spans are recorded, with their collectives."""
    model = tp_mlp(mesh)
    mode, exporter = traced_mode()
    with mode, torch.no_grad():
        model(torch.randn(4, IN_DIM))
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert {phase(s) for s in spans} == {None, "forward"}
    assert mode.aggregator is not None
    assert mode.aggregator.comm_counts("forward") == {"all_reduce": 1}
    assert mode.aggregator.comm_counts("backward") == {}


class _Checkpointed(nn.Module):
    """Two TP MLPs; the second runs under activation checkpointing."""

    def __init__(self, mesh: DeviceMesh, use_reentrant: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([tp_mlp(mesh), tp_mlp(mesh)])
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        return checkpoint(self.layers[1], x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recompute_spans_nest_under_backward(
    mesh: DeviceMesh, use_reentrant: bool
) -> None:
    """Checkpointed blocks get recompute spans, each with a backward span among its ancestors."""
    model = _Checkpointed(mesh, use_reentrant)
    mode, exporter = traced_mode()
    with mode:
        for i in range(2):
            with mode.step(i):
                mlp_step(model)
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    by_id = {(s.context.trace_id, s.context.span_id): s for s in spans}
    recompute = [s for s in spans if phase(s) == "recompute"]
    assert len(named(spans, "_Checkpointed.layers.1", "recompute")) == 2
    assert all(str(fqn(s)).startswith("_Checkpointed.layers.1") for s in recompute)
    for s in recompute:
        ancestors = []
        cur = s
        while cur.parent is not None:
            cur = by_id[(cur.context.trace_id, cur.parent.span_id)]
            ancestors.append(cur)
        assert any(phase(a) == "backward" for a in ancestors), s.name
    assert len(named(spans, "_Checkpointed.layers.1", "backward")) == 2


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_step_has_no_error_spans(mesh: DeviceMesh, use_reentrant: bool) -> None:
    """A successful checkpointed step has no ERROR span or exception event (early stop)."""
    model = _Checkpointed(mesh, use_reentrant)
    mode, exporter = traced_mode()
    with mode:
        mlp_step(model)
    spans = list(exporter.get_finished_spans())
    errors = [s.name for s in spans if s.status.status_code is StatusCode.ERROR]
    exceptions = [s.name for s in spans for e in s.events if e.name == semconv.EVENT_EXCEPTION]
    assert errors == [] and exceptions == []


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_totals_match_commdebugmode(mesh: DeviceMesh, use_reentrant: bool) -> None:
    """With checkpointing, the total over all phases equals torch's CommDebugMode total."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = _Checkpointed(mesh, use_reentrant)
    cdm = CommDebugMode()
    with cdm:
        mlp_step(model)
    mode, _ = traced_mode()
    with mode:
        mlp_step(model)
    assert mode.aggregator is not None
    assert mode.aggregator.total_count() == cdm.get_total_counts() >= 4


def _live_objects() -> Counter[str]:
    """Live commspan frames and calls, and live tensors, after a full garbage collection."""
    from commspan.capture.backward import _Call
    from commspan.spans.frames import Frame

    gc.collect()
    live: Counter[str] = Counter()
    tensor = torch.Tensor
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that may call a module's __getattr__
        if kind is Frame:
            live["Frame"] += 1
        elif kind is _Call:
            live["_Call"] += 1
        elif issubclass(kind, tensor):
            live["Tensor"] += 1
    return live


def test_nothing_accumulates_over_steps(mesh: DeviceMesh) -> None:
    """Over many checkpointed steps, some failing, live frames, calls and tensors stay flat."""
    models = [_Checkpointed(mesh, use_reentrant=False), _Checkpointed(mesh, use_reentrant=True)]
    failing = Holder()
    mode, _ = traced_mode()
    samples = []
    with mode:
        for i in range(16):
            with mode.step(i):
                for model in models:
                    mlp_step(model)
                if i % 3 == 0:
                    try:
                        failing(torch.randn(2, IN_DIM))
                    except Boom:
                        pass
            if i in (3, 15):
                samples.append(_live_objects())
    first, last = samples
    assert last["Frame"] <= first["Frame"] and last["_Call"] <= first["_Call"]
    assert last["Tensor"] <= first["Tensor"]


def test_a_second_backward_through_a_retained_graph_has_its_spans(mesh: DeviceMesh) -> None:
    """``backward(retain_graph=True)`` then ``backward()`` again: each pass opens the
    modules' backward spans, nested as in the first, and charges its collectives to
    them (the second pass's went to the rank span); counts equal torch's
    CommDebugMode per module."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from commspan.compat import CommDebugMode
    from commspan.testing.models import MLPModule

    def plan() -> dict[str, Any]:  # sharded input and output: backward all-gathers
        return {"net1": ColwiseParallel(input_layouts=Shard(0)),
                "net2": RowwiseParallel(output_layouts=Shard(0))}

    def run(cdm: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        model = parallelize_module(MLPModule(), mesh, plan())
        with cdm:
            y = model(torch.rand(8, 10))
            y.sum().backward(retain_graph=True)
            y.sum().backward()
        return {f: {ph: {str(op): n for op, n in ops.items() if n} for ph, ops in p.items()}
                for f, p in cdm.comm_module_counts.items()}

    expected = run(TorchCommDebugMode())
    assert expected["MLPModule.net2"]["backward"] == {
        "c10d_functional.all_gather_into_tensor": 2}
    assert run(CommDebugMode()) == expected

    model = parallelize_module(MLPModule(), mesh, plan())
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        y = model(torch.rand(8, 10))
        y.sum().backward(retain_graph=True)
        y.sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    for name in ("MLPModule", "MLPModule.net1", "MLPModule.net2"):
        assert len(named(spans, name, "backward")) == 2, name
    by_id = {s.context.span_id: s for s in spans}
    for s in named(spans, "MLPModule.net2", "backward"):
        assert s.parent is not None and fqn(by_id[s.parent.span_id]) == "MLPModule"


class _PhysicsInformed(nn.Module):
    """A forward that runs a backward itself: the output uses du/dx of a sub-network
    (physics-informed nets, forces as the gradient of an energy)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()
        u = self.net(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return self.head(du) + u


def test_a_backward_inside_a_forward_nests_in_it() -> None:
    """autograd.grad inside a forward: the sub-network's backward spans nest under the
    running forward, and the running module does not get a backward span of its own
    there (it used to get one, under its own forward: two per step); its real backward
    comes with the step's. Results are bitwise those of the untraced model."""
    torch.manual_seed(0)
    model = _PhysicsInformed()
    inputs = [torch.randn(4, 2) for _ in range(2)]
    reference = []
    for x in inputs:
        model.zero_grad()
        model(x.clone()).sum().backward()
        reference.append([p.grad.clone() for p in model.parameters()])
    mode, exporter = traced_mode()
    with mode:
        for step, x in enumerate(inputs):
            with mode.step(step):
                model.zero_grad()
                model(x.clone()).sum().backward()
                assert all(torch.equal(p.grad, r) for p, r in
                           zip(model.parameters(), reference[step]))
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert mode.stats()["internal_errors"] == 0
    names = Counter(s.name for s in spans)
    assert names["_PhysicsInformed backward"] == 2  # one per step
    assert names["_PhysicsInformed.net backward"] == 4  # in the forward, and in the step's
    by_id = {s.context.span_id: s for s in spans}
    parents = Counter(by_id[s.parent.span_id].name for s in spans
                      if s.name == "_PhysicsInformed.net backward" and s.parent)
    assert parents == {"_PhysicsInformed forward": 2, "_PhysicsInformed backward": 2}


class _GradInBlock(nn.Module):
    """The backward runs in a nested forward: ``block`` differentiates ``net``'s
    output, then runs a Linear of its own."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
            return self.lin(du)

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
        self.block = _GradInBlock.Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()
        u = self.net(x)
        return self.block(u, x) + u


def test_a_backward_inside_a_nested_forward_cuts_no_forward_short() -> None:
    """The backward of ``net`` runs inside ``block``'s forward, itself inside the model's:
    it nests under ``block``'s forward (the one running it), which stays open, so
    ``block.lin`` still nests under ``block``."""
    torch.manual_seed(0)
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        _GradInBlock()(torch.randn(3, 2)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    by_id = {s.context.span_id: s for s in spans}

    def parent_of(name: str) -> list[str]:
        return sorted(by_id[s.parent.span_id].name for s in spans
                      if s.name == name and s.parent)

    assert parent_of("_GradInBlock.block.lin forward") == ["_GradInBlock.block forward"]
    # in block's forward, and again in the step's backward (create_graph)
    assert parent_of("_GradInBlock.net backward") == ["_GradInBlock backward",
                                                      "_GradInBlock.block forward"]


class _WithPosition(nn.Module):
    """A leaf input that requires grad, and a module that returns its parameter (a
    position table): both put commspan's hooks on leaf tensors, which keep them."""

    class Position(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(2, 4))

        def forward(self) -> torch.Tensor:
            return self.table

    def __init__(self) -> None:
        super().__init__()
        self.pos = self.Position()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.pos())


def _tree(spans: list[Any]) -> Counter[tuple[str, str, str]]:
    """(module, phase, parent module) of every module span."""
    by_id = {s.context.span_id: s for s in spans}
    return Counter(
        (fqn(s), phase(s), fqn(by_id[s.parent.span_id]) if s.parent and s.parent.span_id
         in by_id else "") for s in spans if fqn(s))


def test_forwards_without_backward_leave_no_hooks_growing_on_leaves() -> None:
    """A mode held open without steps, running forwards with grad enabled and no
    backward (an evaluation without ``no_grad``): the hooks commspan leaves on leaf
    tensors (a leaf input; a parameter a module returns) stay bounded instead of one
    more per call, and a backward afterwards has the spans, and the post-backward
    callbacks, of one forward and backward in a fresh mode (the stale hooks used to
    fire in it)."""
    from commspan.compat import ModTracker

    def run(forwards: int) -> tuple[Counter[tuple[str, str, str]], Counter[str], int, int]:
        torch.manual_seed(0)
        model = _WithPosition()
        x = torch.randn(2, 4, requires_grad=True)
        mode, exporter = traced_mode()
        post_bw: Counter[str] = Counter()
        tracker = ModTracker()
        tracker.register_user_hooks(post_bw_hook=lambda m, g: post_bw.update(
            [type(m).__name__]))
        with mode, tracker:
            for _ in range(forwards):
                model(x)
            on_input, on_table = len(x._backward_hooks or {}), len(
                model.pos.table._backward_hooks or {})
            exporter.clear()
            model(x).sum().backward()
        spans = list(exporter.get_finished_spans())
        assert_well_formed(spans)
        return _tree(spans), post_bw, on_input, on_table

    expected, expected_post_bw, _, _ = run(0)
    assert any(k[:2] == ("_WithPosition.pos", "backward") for k in expected)
    tree, post_bw, on_input, on_table = run(3000)
    assert tree == expected
    assert post_bw == expected_post_bw
    assert on_input < 600, on_input  # 2 per forward before (6,000)
    assert on_table <= 1100, on_table  # 1 per forward before (3,000)


def test_a_parameter_returning_module_keeps_its_backward_across_top_level_calls() -> None:
    """``y = head(model(x))``: two top-level modules, the first holding a module that
    returns its parameter. The second one's forward does not cost the first one's
    submodule its backward span (it did when any top-level forward dropped the calls
    only leaf hooks watch), as when the two run as one model."""

    class Both(nn.Module):
        def __init__(self, model: nn.Module, head: nn.Module) -> None:
            super().__init__()
            self.model, self.head = model, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.model(x))

    def run(composed: bool) -> Counter[tuple[str, str]]:
        torch.manual_seed(0)
        model, head = _WithPosition(), nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        mode, exporter = traced_mode()
        with mode:
            y = Both(model, head)(x) if composed else head(model(x))
            y.sum().backward()
        spans = list(exporter.get_finished_spans())
        assert_well_formed(spans)
        return Counter((fqn(s).split(".", 1)[-1] if composed else fqn(s), phase(s))
                       for s in spans if fqn(s) and phase(s) == "backward"
                       and "pos" in fqn(s))

    separate = run(composed=False)
    assert separate == {("_WithPosition.pos", "backward"): 1}
    assert sum(run(composed=True).values()) == 1


class _HookedLayer(nn.Module):
    """Puts a gradient hook on its output that changes the gradient (× 2)."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        out.register_hook(lambda g: (self.order.append("inner"), g * 2)[1])
        return out


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _HookedOuter(nn.Module):
    """Returns the same tensor as the hooked layer two levels down, with a hook of its
    own on it (+ 1): autograd runs the layer's first, as registered."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.wrap = _Wrapper(_HookedLayer(order))
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.wrap(x)
        out.register_hook(lambda g: (self.order.append("outer"), g + 1)[1])
        return out


def test_users_gradient_hooks_on_a_shared_output_keep_their_order() -> None:
    """Nested modules returning one tensor, each with a gradient hook of the user's on
    it: commspan's own hooks go first, and the user's run in the order they were
    registered, so the gradients are the untraced ones, bit for bit."""

    def run(traced: bool) -> tuple[torch.Tensor, list[str]]:
        torch.manual_seed(0)
        order: list[str] = []
        model = _HookedOuter(order)
        x = torch.randn(2, 4, requires_grad=True)
        if traced:
            mode, exporter = traced_mode()
            with mode:
                model(x).sum().backward()
            spans = list(exporter.get_finished_spans())
            assert_well_formed(spans)
            backward = {fqn(s) for s in spans if phase(s) == "backward"}
            assert {"_HookedOuter", "_HookedOuter.wrap", "_HookedOuter.wrap.inner"} <= backward
        else:
            model(x).sum().backward()
        bias = model.wrap.inner.lin.bias.grad
        assert bias is not None
        return bias.clone(), order

    plain, plain_order = run(False)
    traced, traced_order = run(True)
    assert plain_order == ["inner", "outer"]
    assert traced_order == plain_order
    assert torch.equal(traced, plain)


class _PopsItsInput(nn.Module):
    """Takes its input from a list and pops it (U-Net's skips): the popped tensor is
    freed during the forward, and the output often gets its Python ``id``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, skips: list[torch.Tensor]) -> torch.Tensor:
        h = skips.pop() * 2
        return h * self.w


class _Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(4, 4)
        self.up = _PopsItsInput()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up([self.down(x)])


def test_an_output_with_the_id_of_a_freed_input_still_starts_the_backward() -> None:
    """An output that took the ``id`` of an input freed during the forward is not that
    input handed back: the module gets its backward span every time (the reference,
    a forward hook of our own, tells when the ids collided; they must, at least once)."""
    collided = lost = 0
    for _ in range(30):
        model = _Skips()
        seen: dict[str, Any] = {}
        model.up.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.__setitem__("in", {id(t) for t in args[0]}))
        model.up.register_forward_hook(
            lambda m, args, out, seen=seen: seen.__setitem__("same_id", id(out) in seen["in"]))
        mode, exporter = traced_mode()
        with mode:
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        backward = {fqn(s) for s in exporter.get_finished_spans() if phase(s) == "backward"}
        collided += seen["same_id"]
        lost += "_Skips.up" not in backward
    assert collided > 0, "the ids never collided: the test shows nothing"
    assert lost == 0


class _SyncGrad(torch.autograd.Function):
    """The enclosing module's own backward communication: an all_reduce of the
    gradient, issued from a known place (this Function's backward)."""

    ran_at: list[int] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _SyncGrad.ran_at.append(time.time_ns())
        g = g.clone()
        torch.distributed.all_reduce(g)
        return g


class _IgnoresAnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None,
                also: torch.Tensor | None = None) -> torch.Tensor:
        if also is not None:  # used only through .detach(): no gradient either
            x = x + also.detach()
        return self.lin(x)  # `extra` is not used


class _SyncsAroundIgnorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.a = _IgnoresAnInput()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        h = _SyncGrad.apply(self.pre(x))
        return self.out(self.a(h, extra, also=self.pre(x)))


def test_an_input_that_gets_no_gradient_does_not_keep_the_backward_open(
        fake_pg: None) -> None:
    """A module given inputs that require grad but get none from it (one unused, one
    used only through .detach()) ends its backward when its work is done: the parent's
    own all_reduce, issued from its Function's backward after the child's backward,
    is the parent's."""
    torch.manual_seed(0)
    model = _SyncsAroundIgnorer()
    ran_a: list[int] = []  # reference: when the child's last backward node ran
    model.a.lin.register_full_backward_hook(lambda *_: ran_a.append(time.time_ns()))
    _SyncGrad.ran_at.clear()
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        extra = torch.randn(4, requires_grad=True)  # a leaf the child ignores
        model(torch.randn(2, 4), extra).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    [sync] = _SyncGrad.ran_at
    assert ran_a and ran_a[-1] < sync  # the child's backward work was over before it
    where = [s.name for s in spans for e in collective_events(s)]
    assert where == ["_SyncsAroundIgnorer backward"]
    [child] = named(spans, "_SyncsAroundIgnorer.a", "backward")
    assert child.end_time is not None and child.end_time <= sync
    assert mode.stats()["internal_errors"] == 0
