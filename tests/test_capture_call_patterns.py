"""Module calls in the shapes real models use: tensors passed by keyword, outputs
that are registered dataclasses, modules called from gradient hooks, and modules
returning ``None`` inside an ``except`` block.

References that do not use commspan's attribution: the same model written the
plain way (positional argument, tuple output) must be traced identically; a
dispatch mode of the test's own records, for each collective, whether autograd
was executing and what the gradient hooks had seen by then; and which call raised
is known from the test's construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils._pytree as pytree
from _tracing import traced_mode
from opentelemetry.trace import StatusCode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.modules.module import register_module_full_backward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from commspan import semconv
from commspan.capture.backward import recomputing
from commspan.testing import assert_well_formed
from commspan.testing import span_fqn as fqn
from commspan.testing import span_phase as phase


class _Log(TorchDispatchMode):
    """The test's own record of collectives: op name, whether autograd was
    executing, and the marks the test's gradient hooks had left by then."""

    def __init__(self, marks: list[str]) -> None:
        super().__init__()
        self.marks = marks
        self.seen: list[tuple[str, bool, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._opname
        if func.namespace == "_c10d_functional" and name != "wait_tensor" \
                and not name.startswith("_"):
            in_autograd = torch._C._current_graph_task_id() != -1
            self.seen.append((name, in_autograd, tuple(self.marks)))
        return func(*args, **(kwargs or {}))


def _gather_in_backward(h: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """No communication forward (Replicate -> Shard(0) keeps a chunk); an
    all_gather in backward (Shard(0) -> Replicate)."""
    return DTensor.from_local(h, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()


class _Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Parent(nn.Module):
    """Its own code issues a backward all_gather on the tensor it hands its child."""

    def __init__(self, mesh: DeviceMesh, by_keyword: bool, marks: list[str]) -> None:
        super().__init__()
        self.mesh, self.by_keyword, self.marks = mesh, by_keyword, marks
        self.pre = nn.Linear(8, 8)
        self.child = _Child()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _gather_in_backward(self.pre(x), self.mesh)
        h.register_hook(lambda g: self.marks.append("child input grad"))
        return self.child(x=h) if self.by_keyword else self.child(h)


def _counts(mode: Any, module: str, in_phase: str) -> dict[str, int]:
    return dict(mode.aggregator.module_counts().get(module, {}).get(in_phase, {}))


def _owners(spans: list[Any], op: str) -> list[tuple[str, str, str]]:
    """(owner, phase, span fqn) of each ``op`` event."""
    return [
        (e.attributes[semconv.OWNER_FQN], e.attributes[semconv.PHASE], fqn(s))
        for s in spans for e in s.events if e.name == op
    ]


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_tensor_passed_by_keyword_ends_the_childs_backward(
    mesh: DeviceMesh, by_keyword: bool
) -> None:
    """A child called as ``child(x=h)`` finishes its backward when ``h``'s gradient
    is computed, as ``child(h)`` does: the parent's own all_gather that follows is
    the parent's, not the child's."""
    marks: list[str] = []
    model = _Parent(mesh, by_keyword, marks)
    log = _Log(marks)
    mode, exporter = traced_mode()
    with mode, log:
        model(torch.randn(8, 8)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    # reference: the all_gather ran in backward, after the child's input gradient
    assert log.seen == [("all_gather_into_tensor", True, ("child input grad",))]
    assert _owners(spans, "all_gather_into_tensor") == [("_Parent", "backward", "_Parent")]
    assert mode.stats()["internal_errors"] == 0


def test_keyword_inputs_do_not_leave_hooks_behind(mesh: DeviceMesh) -> None:
    """The forward hook that sees keyword inputs is registered ``with_kwargs``: torch
    keeps such hooks in a table of its own, which removing the hook must clear."""
    table = torch.nn.modules.module._global_forward_hooks_with_kwargs
    before = dict(table)
    mode, _ = traced_mode()
    with mode:
        for step in range(3):
            with mode.step(step):
                _Parent(mesh, True, [])(torch.randn(8, 8)).sum().backward()
    assert dict(table) == before


@dataclasses.dataclass
class _Out:
    y: torch.Tensor


pytree.register_dataclass(_Out)


class _Gathering(nn.Module):
    """Issues its own backward all_gather; returns a dataclass or a tuple."""

    def __init__(self, mesh: DeviceMesh, as_dataclass: bool) -> None:
        super().__init__()
        self.mesh, self.as_dataclass = mesh, as_dataclass
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> Any:
        y = _gather_in_backward(x @ self.w, self.mesh)
        return _Out(y) if self.as_dataclass else (y,)


class _Holder(nn.Module):
    def __init__(self, mesh: DeviceMesh, as_dataclass: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = _Gathering(mesh, as_dataclass)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(self.pre(x))
        return out.y if isinstance(out, _Out) else out[0]


def _trace_holder(mesh: DeviceMesh, as_dataclass: bool) -> list[Any]:
    mode, exporter = traced_mode()
    with mode:
        _Holder(mesh, as_dataclass)(torch.randn(8, 8)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    return spans


def test_dataclass_output_gets_its_backward_span(mesh: DeviceMesh) -> None:
    """A module returning a pytree-registered dataclass is traced as one returning a
    tuple of the same tensors: a backward span, owning its own all_gather."""
    reference = _trace_holder(mesh, as_dataclass=False)
    spans = _trace_holder(mesh, as_dataclass=True)

    def shape(spans: list[Any]) -> list[tuple[str, str]]:
        return sorted((fqn(s), phase(s)) for s in spans if semconv.MODULE_FQN in s.attributes)

    assert shape(spans) == shape(reference)
    assert ("_Holder.inner", "backward") in shape(spans)
    assert _owners(spans, "all_gather_into_tensor") == _owners(
        reference, "all_gather_into_tensor") == [
        ("_Holder.inner", "backward", "_Holder.inner")]


class _GradSync(nn.Module):
    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(g, "sum", dist.group.WORLD)


class _Hooked(nn.Module):
    """A gradient-sync module called from a parameter's gradient hook."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sync = _GradSync()
        self.lin.weight.register_hook(lambda g: self.sync(g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_module_called_from_a_gradient_hook_is_backward_work(fake_pg: None) -> None:
    """Not activation checkpointing: the module's span and its all_reduce are
    backward, counted in the step's backward totals."""
    log = _Log([])
    mode, exporter = traced_mode()
    with mode, log:
        _Hooked()(torch.randn(2, 4)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert log.seen == [("all_reduce", True, ())]  # reference: issued in backward
    assert ("_Hooked.sync", "backward") in {(fqn(s), phase(s)) for s in spans}
    assert not [s for s in spans if phase(s) == "recompute"]
    assert _counts(mode, "Global", "backward") == {"all_reduce": 1}
    assert _owners(spans, "all_reduce") == [("_Hooked.sync", "backward", "_Hooked.sync")]


class _Reducing(nn.Module):
    """Marks its forward running (the test's own record); relu saves the
    all_reduce's result, so a recompute re-runs the all_reduce."""

    def __init__(self, marks: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.marks = marks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.marks.append("block forward")
        try:
            return funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD).relu()
        finally:
            self.marks.remove("block forward")


class _Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool, marks: list[str]) -> None:
        super().__init__()
        self.block = _Reducing(marks)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recompute_stays_recompute(fake_pg: None, use_reentrant: bool) -> None:
    """What checkpointing re-runs is still a recompute: as many recompute
    all_reduces as the test's own mode saw issued while autograd executed."""
    marks: list[str] = []
    log = _Log(marks)
    mode, exporter = traced_mode()
    with mode, log:
        _Checkpointed(use_reentrant, marks)(torch.randn(2, 4, requires_grad=True)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    # reference: all_reduces issued by the block's forward while autograd executed
    rerun = sum(1 for _, running, seen in log.seen if running and "block forward" in seen)
    assert rerun == 1
    assert _counts(mode, "Global", "recompute") == {"all_reduce": rerun}
    assert ("_Checkpointed.block", "recompute") in {(fqn(s), phase(s)) for s in spans}


class _CheckpointsItsOwnCode(nn.Module):
    """Checkpoints a method of its own that issues an all_reduce (no module call
    around it), then calls a child; the method marks itself running (the test's
    own record). A non-reentrant recompute starts in the child's backward."""

    def __init__(self, use_reentrant: bool, marks: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.child = nn.Linear(4, 4)
        self.use_reentrant = use_reentrant
        self.marks = marks

    def reduce(self, h: torch.Tensor) -> torch.Tensor:
        self.marks.append("reduce")
        try:
            reduced = funcol.all_reduce(h, "sum", dist.group.WORLD).relu()
        finally:
            self.marks.remove("reduce")
        return self.child(reduced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.reduce, self.lin(x), use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_functions_own_collective_is_a_recompute(
        fake_pg: None, use_reentrant: bool) -> None:
    """A collective that checkpointing re-runs with no module call around it (a
    checkpointed method's own all_reduce) is a recompute of the module whose method
    it is, not backward work, nor the child's whose backward needed it; the
    all_reduce that autograd runs for its gradient stays backward. (It was charged
    to backward, of the span open then.)"""
    marks: list[str] = []
    log = _Log(marks)
    mode, exporter = traced_mode()
    model = _CheckpointsItsOwnCode(use_reentrant, marks)
    with mode, log:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    # reference: the test's own record of which all_reduces the method issued
    rerun = sum(1 for op, running, seen in log.seen
                if op == "all_reduce" and running and "reduce" in seen)
    forward = sum(1 for op, running, seen in log.seen
                  if op == "all_reduce" and not running and "reduce" in seen)
    gradient = sum(1 for op, running, seen in log.seen
                   if op == "all_reduce" and running and "reduce" not in seen)
    assert (forward, rerun) == (1, 1)
    name = "_CheckpointsItsOwnCode"
    assert _counts(mode, name, "forward") == {"all_reduce": forward}
    assert _counts(mode, name, "recompute") == {"all_reduce": rerun}
    assert _counts(mode, name, "backward") == ({"all_reduce": gradient} if gradient else {})
    assert _counts(mode, "Global", "recompute") == {"all_reduce": rerun}
    assert _counts(mode, f"{name}.child", "recompute") == {}
    assert _counts(mode, f"{name}.child", "backward") == {}



class _Core(nn.Module):
    """A child whose method the parent checkpoints directly (not a module call)."""

    def __init__(self, marks: list[str]) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.marks = marks

    def core(self, h: torch.Tensor) -> torch.Tensor:
        self.marks.append("core")
        try:
            return funcol.all_reduce(h, "sum", dist.group.WORLD).relu()
        finally:
            self.marks.remove("core")


class _ChecksAChildsMethod(nn.Module):
    """Checkpoints a method of its child (``checkpoint(self.attn.core, h)``), then
    calls another child; its module-call stack is the test's own record."""

    def __init__(self, use_reentrant: bool, marks: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.attn = _Core(marks)
        self.child = nn.Linear(4, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.attn.core, self.lin(x), use_reentrant=self.use_reentrant)
        return self.child(h)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_childs_method_is_recomputed_where_it_ran_forward(
        fake_pg: None, use_reentrant: bool) -> None:
    """``checkpoint(self.attn.core, h)``: the child's method runs inside the parent's
    forward with no call of the child, so its forward all_reduce is the parent's (the
    innermost module call open, by the test's own hooks); its re-run is the parent's
    recompute too. It was charged to the child, which never ran forward: a recompute
    count on a module without the forward it re-runs."""
    marks: list[str] = []
    log = _Log(marks)
    model = _ChecksAChildsMethod(use_reentrant, marks)
    calls: list[str] = []
    names = {m: n for n, m in model.named_modules()}
    owners: list[str] = []  # innermost module call open at each forward all_reduce

    def pre(m: nn.Module, args: Any) -> None:
        calls.append(names[m])

    def post(m: nn.Module, args: Any, out: Any) -> None:
        calls.pop()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]

    class _Owner(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func._opname == "all_reduce" and torch._C._current_graph_task_id() == -1:
                owners.append(calls[-1])
            return func(*args, **(kwargs or {}))

    mode, exporter = traced_mode()
    try:
        with mode, log, _Owner():
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    finally:
        for h in handles:
            h.remove()
    assert_well_formed(list(exporter.get_finished_spans()))
    rerun = sum(1 for op, running, seen in log.seen
                if op == "all_reduce" and running and "core" in seen)
    assert owners == [""] and rerun == 1  # the root module's call: the parent
    name = "_ChecksAChildsMethod"
    assert _counts(mode, name, "forward") == {"all_reduce": 1}
    assert _counts(mode, name, "recompute") == {"all_reduce": rerun}
    assert _counts(mode, f"{name}.attn", "forward") == {}
    assert _counts(mode, f"{name}.attn", "recompute") == {}
    assert _counts(mode, f"{name}.child", "recompute") == {}

class _ReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


class _BackwardReducer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_ReduceInBackward.apply(x))


def test_backward_collectives_stay_backward_without_the_recompute_probes(
        fake_pg: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch build without the probes recomputing() reads (or with one that fails)
    cannot tell a recompute: a module call is then taken for one, as before the probes,
    but a collective a module's backward issues stays backward (asked with
    unknown=False it was not: every backward collective became a recompute's)."""
    import commspan.capture.backward as backward_mod

    monkeypatch.setattr(backward_mod, "_current_node", None)
    mode, _ = traced_mode()
    with mode:
        _BackwardReducer()(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert _counts(mode, "_BackwardReducer", "backward") == {"all_reduce": 1}
    assert _counts(mode, "Global", "recompute") == {}


def test_recomputing_probe() -> None:
    """recomputing() itself: no outside autograd and in a gradient hook; yes inside
    both kinds of checkpoint's recompute."""
    seen: list[tuple[str, bool]] = []

    class Probe(nn.Module):
        def __init__(self, label: str) -> None:
            super().__init__()
            self.label = label
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((self.label, recomputing()))
            return self.lin(x).relu()

    x = torch.randn(2, 4, requires_grad=True)
    for reentrant in (False, True):
        checkpoint(Probe(f"reentrant={reentrant}"), x, use_reentrant=reentrant).sum().backward()
    hooked = nn.Linear(4, 4)
    in_hook = Probe("hook")
    hooked.weight.register_hook(lambda g: in_hook(g) * 0 + g)
    hooked(x).sum().backward()
    assert seen == [
        ("reentrant=False", False), ("reentrant=False", True),
        ("reentrant=True", False), ("reentrant=True", True),
        ("hook", False),
    ]


class _ReturnsNone(nn.Module):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> None:
        self.avg.mul_(0.9).add_(x.mean(0), alpha=0.1)
        if self.fail:
            raise ValueError("bad batch")


def _status(spans: list[Any], name: str) -> list[tuple[StatusCode, int]]:
    return [(s.status.status_code, sum(e.name == "exception" for e in s.events))
            for s in spans if s.name == name]


def test_none_returning_call_inside_except_block_is_not_an_error() -> None:
    """A module that returns None, called successfully while the caller handles an
    exception, ends OK; one that raises there ends with ERROR and its exception."""
    mode, exporter = traced_mode()
    raised = []
    with mode:
        _ReturnsNone()(torch.randn(2, 4))
        try:
            raise KeyError("retry with a smaller batch")
        except KeyError:
            _ReturnsNone()(torch.randn(2, 4))  # returns normally
            try:
                _ReturnsNone(fail=True)(torch.randn(2, 4))  # raises while handling
            except ValueError as exc:
                raised.append(exc)
    spans = list(exporter.get_finished_spans())
    assert len(raised) == 1
    assert _status(spans, "_ReturnsNone forward") == [
        (StatusCode.UNSET, 0), (StatusCode.UNSET, 0), (StatusCode.ERROR, 1)]
    event = next(e for s in spans for e in s.events if e.name == "exception")
    assert event.attributes["exception.type"] == "ValueError"


def test_reraising_the_handled_exception_is_an_error() -> None:
    """A forward that re-raises the exception being handled (a bare ``raise``) did raise."""

    class Reraise(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            raise

    mode, exporter = traced_mode()
    with mode, pytest.raises(KeyError):
        try:
            raise KeyError("original")
        except KeyError:
            Reraise()(torch.randn(2, 4))
    spans = list(exporter.get_finished_spans())
    assert _status(spans, "Reraise forward") == [(StatusCode.ERROR, 1)]


class _ScaleInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mul_(self.w)  # its input, changed in place: its own backward


class _Outer(nn.Module):
    def __init__(self, by_keyword: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = _ScaleInPlace()
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 1.0
        return self.scale(h=h) if self.by_keyword else self.scale(h)


def test_keyword_input_changed_in_place_keeps_its_backward_span() -> None:
    """A keyword input the module changes in place and returns is the module's work,
    as with a positional one (its version is read only when the call ends)."""
    def backward_spans(by_keyword: bool) -> set[str]:
        mode, exporter = traced_mode()
        with mode:
            _Outer(by_keyword)(torch.randn(2, 4)).sum().backward()
        return {fqn(s) for s in exporter.get_finished_spans() if phase(s) == "backward"}

    assert "_Outer.scale" in backward_spans(False)
    assert backward_spans(True) == backward_spans(False)


class _ReRunFromHook(nn.Module):
    """A checkpoint of its own, as Megatron's CheckpointWithoutOutput does it: the
    block's forward is re-run from a gradient hook during backward (no checkpoint
    node runs, no saved-tensor hooks are set)."""

    def __init__(self, marks: list[str]) -> None:
        super().__init__()
        self.block = _Reducing(marks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)

        def re_run(grad: torch.Tensor) -> None:
            with torch.enable_grad():
                self.block(x.detach())

        out.register_hook(re_run)
        return out


def test_a_module_re_run_in_backward_by_other_checkpointing_is_a_recompute(
    fake_pg: None,
) -> None:
    """A module that already ran forward in the step and runs again while autograd
    executes is a recompute, whatever re-ran it; one called there for the first
    time (a gradient hook's module, above) is backward work."""
    marks: list[str] = []
    log = _Log(marks)
    mode, exporter = traced_mode()
    with mode, log:
        _ReRunFromHook(marks)(torch.randn(2, 4, requires_grad=True)).sum().backward()
    # (not assert_well_formed: a tensor hook runs before the module's backward opens,
    # so this recompute sits under the rank span, not under a backward span)
    spans = list(exporter.get_finished_spans())
    rerun = sum(1 for _, running, seen in log.seen if running and "block forward" in seen)
    assert rerun == 1  # reference: the test's own record
    assert _counts(mode, "Global", "recompute") == {"all_reduce": rerun}
    assert ("_ReRunFromHook.block", "recompute") in {(fqn(s), phase(s)) for s in spans}


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _register_pre_hook(target: nn.Module, hook: Any, how: str) -> Any:
    """``hook`` as ``target``'s full backward pre-hook: registered on it, or globally
    (``register_module_full_backward_pre_hook``, for ``target``'s calls only)."""
    if how == "module":
        return target.register_full_backward_pre_hook(hook)

    def for_target(module: nn.Module, grad_output: Any) -> Any:
        return hook(module, grad_output) if module is target else None

    return register_module_full_backward_pre_hook(for_target)


@pytest.mark.parametrize("how", ["module", "global"])
@pytest.mark.parametrize("where", ["child", "top"])
def test_full_backward_pre_hook_runs_in_the_modules_backward(
        fake_pg: None, where: str, how: str) -> None:
    """torch runs a module's full backward pre-hook when its backward starts, one
    registered on the module and a global one alike: what the hook issues is in that
    module's backward span, from the first call under the mode on (the reference: the
    hook itself, which knows whose it is); commspan's own hook is gone once the mode
    is left."""
    model = _Pair()
    target, name = (model.second, "_Pair.second") if where == "child" else (model, "_Pair")
    issued: list[str] = []

    def pre_hook(module: nn.Module, grad_output: Any) -> None:
        issued.append(name)
        funcol.all_reduce(grad_output[0], "sum", dist.group.WORLD)

    handle = _register_pre_hook(target, pre_hook, how)
    mode, exporter = traced_mode()
    try:
        with mode:
            for step in range(2):
                with mode.step(step):
                    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        if how == "module":
            assert list(target._backward_pre_hooks.values()) == [pre_hook]
    finally:
        handle.remove()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert issued == [name, name]
    on = [(fqn(s), phase(s)) for s in spans for e in s.events if e.name == "all_reduce"]
    assert on == [(name, "backward")] * 2
    assert mode.stats()["internal_errors"] == 0


@pytest.mark.parametrize("how", ["module", "global"])
def test_exception_in_a_full_backward_pre_hook_is_on_the_modules_backward(how: str) -> None:
    """A full backward pre-hook that raises (registered on the module or globally): the
    error reaches the caller and its event is on the module's backward span, ERROR."""

    def pre_hook(module: nn.Module, grad_output: Any) -> None:
        raise ValueError("bad gradient")

    model = _Pair()
    handle = _register_pre_hook(model.second, pre_hook, how)
    mode, exporter = traced_mode()
    try:
        with pytest.raises(ValueError, match="bad gradient"), mode:
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    spans = list(exporter.get_finished_spans())
    with_event = [(fqn(s), phase(s)) for s in spans for e in s.events
                  if e.name == semconv.EVENT_EXCEPTION]
    assert with_event == [("_Pair.second", "backward")]
    (second,) = [s for s in spans if (fqn(s), phase(s)) == ("_Pair.second", "backward")]
    assert second.status.status_code is StatusCode.ERROR


class _Branch(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)


class _TwoBranches(nn.Module):
    """One Linear (with a backward hook of the user's) called from two branches; only
    the first branch's output reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(4, 4)
        shared.register_full_backward_hook(lambda m, gi, go: None)
        self.a, self.b = _Branch(shared), _Branch(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        self.b(x)  # computed, not trained
        return out


def test_a_hooked_module_called_twice_gets_the_backward_of_the_call_that_ran_it() -> None:
    """A module with backward hooks of its own, called from two parents: its backward
    span is the call's whose output reached the loss, under that call's parent (the
    reference: the test's model, where only branch ``a`` is trained), once."""
    mode, exporter = traced_mode()
    with mode:
        for step in range(2):
            with mode.step(step):
                _TwoBranches()(torch.randn(2, 4, requires_grad=True)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    by_id = {s.context.span_id: s for s in spans if s.context is not None}
    backward = [(fqn(s), fqn(by_id[s.parent.span_id]) if s.parent else None)
                for s in spans if phase(s) == "backward"]
    assert sorted(backward) == sorted([("_TwoBranches.a.shared", "_TwoBranches.a"),
                                       ("_TwoBranches.a", "_TwoBranches")] * 2
                                      + [("_TwoBranches", "Global")] * 2)
