"""capture/modules.py: module spans under awkward conditions: a module called twice,
containers, torch.compile.

Spans are captured synchronously through a ``TracerProvider`` with an in-memory
exporter. Tensor parallelism runs on the fake process group (``mesh`` fixture).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from _tracing import (
    IN_DIM,
    attrs,
    mlp_step,
    named,
    quiet,
    tp_mlp,
    traced_mode,
    traces_by_step,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from commspan import CommSpanMode, semconv
from commspan.testing import assert_well_formed
from commspan.testing import span_counts as counts
from commspan.testing import span_fqn as fqn
from commspan.testing import span_phase as phase


class _Tied(nn.Module):
    """Calls ``block`` twice, then a head kept in a ModuleDict."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.head = nn.ModuleDict({"out": nn.Linear(IN_DIM, IN_DIM)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head["out"](self.block(self.block(x)))


def test_module_called_twice_gets_two_spans_and_counts_add(mesh: DeviceMesh) -> None:
    """A module called twice in one forward gets two spans per phase, and its counts double."""
    single, _ = traced_mode()
    model = _Tied(tp_mlp(mesh))
    with single:
        mlp_step(model.block)
    assert single.aggregator is not None
    once = single.aggregator.module_counts()["MLPModule"]
    assert once["forward"]["all_reduce"] >= 1 and once["backward"]["all_reduce"] >= 1

    mode, exporter = traced_mode()
    with mode:
        mlp_step(model)
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    for in_phase in ("forward", "backward"):
        block_spans = named(spans, "_Tied.block", in_phase)
        assert len(block_spans) == 2
        assert len(named(spans, "_Tied.block.net2", in_phase)) == 2
        for s in block_spans:
            assert counts(s) == {(in_phase, op): n for op, n in once[in_phase].items()}
    assert mode.aggregator is not None
    got = mode.aggregator.module_counts()
    doubled = {p: {op: 2 * n for op, n in ops.items()} for p, ops in once.items()}
    assert got["_Tied.block"] == doubled
    assert got["_Tied"] == doubled
    assert got["Global"] == doubled


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.ModuleDict({"inp": nn.Linear(4, 4), "out": nn.Linear(4, 4)})
        self.act = nn.Sequential(nn.ReLU(), nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj["out"](self.act(self.proj["inp"](x)))


class _Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_container_names() -> None:
    """ModuleList/ModuleDict children are named like Root.layers.0.proj.inp; containers get none."""
    mode, exporter = traced_mode()
    with mode:
        _Containers()(torch.randn(2, 4, requires_grad=True)).sum().backward()
    spans = list(exporter.get_finished_spans())
    forward_names = {fqn(s) for s in spans if phase(s) == "forward"}
    expected = {"_Containers"}
    for i in range(2):
        expected |= {
            f"_Containers.layers.{i}",
            f"_Containers.layers.{i}.proj.inp",
            f"_Containers.layers.{i}.proj.out",
            f"_Containers.layers.{i}.act",
            f"_Containers.layers.{i}.act.0",
            f"_Containers.layers.{i}.act.1",
        }
    assert forward_names == expected
    assert {fqn(s) for s in spans if phase(s) == "backward"} <= expected
    assert "_Containers.layers.0.proj.inp" in {fqn(s) for s in spans if phase(s) == "backward"}
    depth = {fqn(s): attrs(s)[semconv.MODULE_DEPTH] for s in spans if phase(s) == "forward"}
    assert depth["_Containers"] == 1
    assert depth["_Containers.layers.1"] == 2
    assert depth["_Containers.layers.1.proj.out"] == 3
    assert depth["_Containers.layers.1.act.0"] == 4
    assert_well_formed(spans)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.inner = torch.compile(_Inner(), backend="eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


def test_compiled_submodule_inside_mode() -> None:
    """A torch.compile'd submodule runs under the mode without errors; outer modules get spans."""
    model = _Outer()
    x = torch.randn(2, 4)
    expected = quiet(lambda: model(x)).detach()
    mode, exporter = traced_mode()
    with mode:
        for _ in range(2):
            out = quiet(lambda: model(x.clone().requires_grad_()))
            out.sum().backward()
    assert torch.allclose(out.detach(), expected)
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    names = {fqn(s) for s in spans if phase(s) is not None}
    assert {"_Outer", "_Outer.pre"} <= names
    assert all(n.startswith("_Outer") for n in names if n)
    assert len(named(spans, "_Outer", "forward")) == 2
    assert mode.stats()["internal_errors"] == 0


def test_compiled_tp_module_collectives_still_counted(mesh: DeviceMesh) -> None:
    """A compiled (eager backend) TP MLP runs under the mode and its collectives are counted."""
    eager_mode, _ = traced_mode()
    eager = tp_mlp(mesh)
    with eager_mode:
        mlp_step(eager)
    compiled: Any = torch.compile(tp_mlp(mesh), backend="eager")
    mode, exporter = traced_mode()
    with mode:
        quiet(lambda: mlp_step(compiled))
    assert_well_formed(list(exporter.get_finished_spans()))
    assert mode.aggregator is not None and eager_mode.aggregator is not None
    assert mode.aggregator.comm_counts() == eager_mode.aggregator.comm_counts()
    assert mode.stats()["internal_errors"] == 0


@pytest.mark.parametrize("fullgraph", [False, True])
def test_entering_a_mode_every_step_does_not_recompile_compiled_code(fullgraph: bool) -> None:
    """torch.compile'd code guards on torch's global forward-hook tables. A mode
    entered around every step (and a new mode after one exited) used to register new
    global hooks each time: a recompile per step, eager code past the recompile limit,
    and FailOnRecompileLimitHit with fullgraph=True. It compiles as often as untraced."""
    import torch._dynamo

    steps = torch._dynamo.config.recompile_limit + 3

    def compiles(traced: bool) -> int:
        torch._dynamo.reset()
        graphs: list[Any] = []

        def backend(gm: Any, example_inputs: Any) -> Any:
            graphs.append(gm)
            return gm.forward

        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        step = torch.compile(lambda x: model(x).sum(), backend=backend, fullgraph=fullgraph)
        for i in range(steps):
            if not traced:
                step(torch.ones(2, 4) * i).backward()
                continue
            mode, _ = traced_mode() if i % 2 else (modes[0], None)  # a new mode, or the same
            with mode, mode.step(i):
                step(torch.ones(2, 4) * i).backward()
            assert mode.stats()["internal_errors"] == 0
        return len(graphs)

    modes = [traced_mode()[0]]
    untraced = compiles(False)
    assert untraced == 1
    assert compiles(True) == untraced
    torch._dynamo.reset()


def double(module: nn.Module, args: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """A forward hook of the user's (module-level: pickled with the model)."""
    return output * 2.0


def test_a_model_with_hooks_of_its_own_can_be_copied_saved_and_scripted_in_the_mode(
    tmp_path: Any,
) -> None:
    """commspan closes the span of a module with forward hooks of its own from a hook of
    its own, run after them. That hook used to stay on the module between calls, so
    copy.deepcopy (EMA and SWA models), torch.save(model) and torch.jit.script failed
    inside the mode (the hook holds the tracker). It now comes off after each call;
    the user's hook still runs, and its span still holds what its hooks did."""
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model[0].register_forward_hook(double)
    x = torch.randn(2, 4)
    expected = model(x)
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        out = model(x)
        out.sum().backward()
        assert torch.equal(out, expected)
        assert list(model[0]._forward_hooks.values()) == [double]
        copied = copy.deepcopy(model)
        pickle.loads(pickle.dumps(model))
        torch.save(model, tmp_path / "model.pt")
        scripted = torch.jit.script(model)
        assert torch.equal(copied(x), expected) and torch.equal(scripted(x), expected)
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert mode.stats()["internal_errors"] == 0
    # the model's call and its copy's (the scripted one runs no Python hooks)
    assert [fqn(s) for s in spans if phase(s) == "forward"].count("Sequential.0") == 2


def test_a_module_called_inside_itself_closes_each_call_after_its_own_hooks() -> None:
    """A module with a forward hook of its own that calls itself (a recursive net):
    each call's span closes at the end of that call, after its own hooks: three nested
    spans, the hook run three times."""
    seen: list[int] = []

    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
            if depth:
                x = self(x, depth - 1)
            return self.lin(x)

    model = Recursive()
    model.register_forward_hook(lambda m, a, o: seen.append(a[1]))
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        model(torch.randn(1, 3), 2).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert seen == [0, 1, 2] and mode.stats()["internal_errors"] == 0
    forward = sorted((s for s in spans if fqn(s) == "Recursive" and phase(s) == "forward"),
                     key=lambda s: s.start_time or 0)
    assert len(forward) == 3
    for outer, inner in zip(forward, forward[1:]):
        assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
        assert (outer.start_time or 0) < (inner.start_time or 0)
        assert (inner.end_time or 0) < (outer.end_time or 0)


def test_another_threads_call_does_not_close_this_calls_span_early() -> None:
    """The owner thread is inside a module with a hook of its own (the hook runs a
    submodule) when another thread, not traced, calls the same module: the other
    call's hooks must not use up this call's closing hook, so the submodule the hook
    runs still nests under the module's span."""
    import threading

    inside, done = threading.Event(), threading.Event()

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.lin2 = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if threading.current_thread() is threading.main_thread():
                inside.set()
                assert done.wait(10)
            return self.lin(x)

    model = M()
    model.register_forward_hook(lambda m, a, o: m.lin2(o))

    def other() -> None:
        assert inside.wait(10)
        model(torch.randn(1, 2))
        done.set()

    thread = threading.Thread(target=other)
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        thread.start()
        model(torch.randn(1, 2))
    thread.join(10)
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    by_id = {s.context.span_id: s for s in spans}
    (lin2,) = [s for s in spans if fqn(s) == "M.lin2"]
    assert lin2.parent is not None and by_id[lin2.parent.span_id].name == "M forward"


@pytest.mark.parametrize("raises", [False, True])
def test_another_thread_calling_the_module_never_fails_because_of_the_trace(
    raises: bool,
) -> None:
    """A module with a forward hook of its own, called by a traced thread and by
    another thread at once. commspan used to add and remove a closing hook on the
    module for each traced call, so the other thread's call got the hook without its
    kwargs (TypeError) or, walking the hooks after its forward raised, "OrderedDict
    mutated during iteration" instead of its own exception. The module's hook tables
    are no longer changed per call: the other thread only sees its own outcomes."""
    import sys
    import threading
    import time

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
            y = self.lin(x)
            if fail:
                raise ValueError("user error")
            return y

    model = M()
    model.register_forward_hook(lambda m, a, o: time.sleep(0), always_call=True)  # releases the GIL
    hooks = dict(model._forward_hooks)
    outcomes: dict[str, int] = {}
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad():
                    model(torch.randn(2, 4), fail=raises)
                outcome = "ok"
            except ValueError as e:
                outcome = "its ValueError" if str(e) == "user error" else repr(e)
            except Exception as e:
                outcome = repr(e)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=other)
    mode, exporter = traced_mode()
    try:
        thread.start()
        with mode, mode.step(0):
            for _ in range(300):
                model(torch.randn(2, 4)).sum().backward()
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
    assert set(outcomes) == {"its ValueError" if raises else "ok"}
    assert mode.stats()["internal_errors"] == 0
    assert dict(model._forward_hooks) == hooks
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert len(named(spans, "M", "forward")) == 300


def test_a_hook_registered_during_a_traced_call_of_its_module_can_be_removed() -> None:
    """While a traced call of a module with hooks of its own runs, its hook tables are
    copies (with commspan's closing hook): a hook registered then, on that module,
    is on the module after the call, and its handle removes it."""
    handles: list[Any] = []
    seen: list[str] = []

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not handles:
                handles.append(self.register_forward_hook(
                    lambda m, a, o: seen.append("late"), prepend=True))
            return self.lin(x)

    def run(mode: Any) -> list[str]:
        handles.clear()
        seen.clear()
        model = M()
        model.register_forward_hook(lambda m, a, o: seen.append("own"))
        with mode, mode.step(0):
            model(torch.randn(1, 2))
            model(torch.randn(1, 2))
        assert len(model._forward_hooks) == 2 and type(model._forward_hooks) is OrderedDict
        handles[0].remove()
        assert len(model._forward_hooks) == 1
        with mode, mode.step(1):
            model(torch.randn(1, 2))
        return list(seen)

    class Untraced:
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: Any) -> None:
            pass

        def step(self, i: int) -> Untraced:
            return self

    expected = run(Untraced())
    assert expected == ["late", "own", "late", "own", "own"]
    mode, exporter = traced_mode()
    assert run(mode) == expected
    assert mode.stats()["internal_errors"] == 0
    assert_well_formed(list(exporter.get_finished_spans()))


def test_a_model_called_inside_an_except_block_can_be_copied() -> None:
    """A retry after a caught error calls the model inside the ``except`` block (an
    out-of-memory retry): its closing hook still comes off, and the model can be
    deep-copied and pickled right after."""
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model[0].register_forward_hook(double)
    mode, _ = traced_mode()
    with mode, mode.step(0):
        try:
            model(torch.randn(2, 5))  # the wrong width: raises inside the Linear
        except RuntimeError:
            model(torch.randn(2, 4))
            copy.deepcopy(model)
            pickle.dumps(model)
    assert list(model[0]._forward_hooks.values()) == [double]


class _Swappable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_submodule_assigned_after_the_first_trace_is_named_by_its_path() -> None:
    """A submodule assigned after the model was first traced (a new head, a swapped
    block, one inside a ModuleList) is named by its path in the model, the name
    torch's own named_modules() gives it then (the reference), in every later step;
    a module shared under a second name keeps the name it was first seen under."""
    model = _Swappable()
    expected: dict[int, set[str]] = {}
    mode, exporter = traced_mode()
    with mode:
        for step in range(5):
            with mode.step(step):
                if step == 1:
                    model.head = nn.Linear(4, 3)  # fine-tuning: a new head
                if step == 2:
                    model.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
                    model.blocks[1] = nn.Linear(4, 4)
                if step == 4:
                    model.blocks[0] = model.body[0]  # shared: first seen as body.0
                model(torch.randn(2, 4)).sum().backward()
            expected[step] = {f"_Swappable.{n}" if n else "_Swappable"
                              for n, m in model.named_modules()
                              if not isinstance(m, nn.ModuleList)}  # (never called)
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    for step, trace in traces_by_step(spans).items():
        seen = {fqn(s) for s in spans if s.context.trace_id == trace
                and phase(s) in ("forward", "backward")}
        if step == 4:
            assert "_Swappable.blocks.0" not in seen  # (named_modules() gives body.0 too)
        assert seen == expected[step], step
    assert mode.stats()["internal_errors"] == 0


def _hook_changes_mid_call(how: str, traced: bool) -> tuple[list[str], str, int]:
    """A module with two forward hooks whose forward changes its hook table (``how``)
    at its first call; called three times. Returns which hooks ran, in order, the
    type of its hook table after the calls and how many hooks it holds."""
    ran: list[str] = []

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.h1 = self.register_forward_hook(lambda *_: ran.append("h1"))
            self.register_forward_hook(lambda *_: ran.append("h2"))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 1:
                if how == "handle":
                    self.h1.remove()
                elif how == "pop":
                    self._forward_hooks.pop(self.h1.id)
                elif how == "clear":
                    self._forward_hooks.clear()
                elif how == "add":
                    self.register_forward_hook(lambda *_: ran.append("h3"))
            return self.lin(x)

    m = M()
    mode = CommSpanMode(aggregator=False) if traced else None
    if mode is not None:
        with mode, mode.step(0):
            for _ in range(3):
                m(torch.ones(1, 2))
        mode.shutdown()
    else:
        for _ in range(3):
            m(torch.ones(1, 2))
    return ran, type(m._forward_hooks).__name__, len(m._forward_hooks)


@pytest.mark.parametrize("how", ["handle", "pop", "clear", "add"])
def test_hooks_changed_during_a_traced_call_act_as_untraced(how: str) -> None:
    """A module's forward removes one of its hooks (by handle, ``pop``), clears them or
    adds one during a traced call: the hooks that run at that call's end and after,
    and the module's hook table afterwards, are those of the untraced run. (The
    call's view of the table was a copy: a removed hook still ran once, a cleared
    table left the copy on the module, and its copy or pickle brought the hook back.)"""
    untraced = _hook_changes_mid_call(how, traced=False)
    traced = _hook_changes_mid_call(how, traced=True)
    assert traced[0] == untraced[0] and traced[1:] == untraced[1:] == (
        "OrderedDict", untraced[2])


def _hooks_changed_between_calls(mode: CommSpanMode | None) -> tuple[list[str], int]:
    """A module with forward hooks of its own, called three times after each change
    of its hook tables made between calls (register, prepend, always-called, with
    kwargs, remove, replace a hook under its id, reorder, replace or clear a table,
    a forward that raises, one that registers a hook and removes it). Returns the
    hooks that ran, in order, each with what it was called with and the tables as
    it saw them, and how many times the hook issuing an all_reduce ran."""
    import torch.distributed as dist

    ran: list[str] = []
    reduced = [0]
    lin = nn.Linear(2, 2)
    fail = [False]
    original_forward = lin.forward

    during = [False]  # the next call's forward registers a hook and removes it

    def forward(x: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            raise ValueError("forward failed")
        if during[0]:
            lin.register_forward_hook(hook("x")).remove()
        return original_forward(x)

    lin.forward = forward  # type: ignore[method-assign]

    def stored(table: Any) -> list[str]:
        """The hooks or flags the table holds as code below Python reads it (its
        OrderedDict storage), without commspan's closers (their ids are below 0)."""
        return [getattr(v, "label", str(v)) for k, v in OrderedDict.items(table) if k >= 0]

    def hook(name: str) -> Any:
        def run(*args: Any) -> None:
            # (3 arguments: (m, args, out); 4: with kwargs)
            ran.append(f"{name}/{len(args)}")
            if not during[0]:  # (that call's view has the hook: a copy below Python)
                ran.append(f"{stored(lin._forward_hooks)} "
                           f"{stored(lin._forward_hooks_with_kwargs)} "
                           f"{stored(lin._forward_hooks_always_called)}")
        run.label = name  # type: ignore[attr-defined]
        return run

    def reducing(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        ran.append("reduce")
        reduced[0] += 1
        dist.all_reduce(out.detach().clone())

    reducing.label = "reduce"  # type: ignore[attr-defined]
    handles: dict[str, Any] = {}
    changes: list[Any] = [
        lambda: handles.update(a=lin.register_forward_hook(hook("a"))),
        lambda: handles.update(r=lin.register_forward_hook(reducing)),
        lambda: handles.update(b=lin.register_forward_hook(hook("b"), with_kwargs=True)),
        lambda: handles.update(c=lin.register_forward_hook(hook("c"), prepend=True)),
        lambda: handles.update(d=lin.register_forward_hook(hook("d"), always_call=True)),
        lambda: handles["b"].remove(),
        lambda: lin._forward_hooks.__setitem__(handles["a"].id, hook("a2")),
        lambda: lin._forward_hooks.move_to_end(handles["a"].id),
        lambda: lin._forward_hooks_with_kwargs.__setitem__(handles["a"].id, True),
        lambda: lin._forward_hooks_always_called.pop(handles["d"].id),
        lambda: fail.__setitem__(0, True),
        lambda: (fail.__setitem__(0, False), lin._forward_hooks_always_called.__setitem__(
            handles["d"].id, True)),
        lambda: setattr(lin, "_forward_hooks", OrderedDict(reversed(lin._forward_hooks.items()))),
        lambda: lin._forward_hooks.clear(),
        lambda: handles.update(e=lin.register_forward_hook(hook("e"))),
        lambda: during.__setitem__(0, True),
    ]

    def calls() -> None:
        for change in changes:
            change()
            ran.append("|")
            for _ in range(3):
                try:
                    lin(torch.ones(1, 2))
                except ValueError:
                    ran.append("raised")
                during[0] = False

    if mode is None:
        calls()
    else:
        with mode, mode.step(0):
            calls()
    return ran, reduced[0]


def test_hooks_changed_between_traced_calls_run_as_untraced(fake_pg: None) -> None:
    """commspan keeps a module's views of its hook tables from one call to the next:
    hooks changed between calls in every way torch allows (and by writing to the
    tables) run as untraced, in torch's order, with the same arguments, the tables
    hold what they hold untraced (also as read below Python), and the all_reduce
    one of the hooks issues is the module's at each call."""
    untraced, reduced = _hooks_changed_between_calls(None)
    assert reduced > 0 and "raised" in untraced
    mode = CommSpanMode()
    traced, traced_reduced = _hooks_changed_between_calls(mode)
    mode.shutdown()
    assert traced == untraced and traced_reduced == reduced
    assert mode.aggregator.module_counts()["Linear"]["forward"] == {"all_reduce": reduced}
    assert mode.stats()["internal_errors"] == 0


def test_a_traced_model_whose_hooks_hold_it_is_freed_while_the_mode_lives() -> None:
    """A module's forward hook that refers to the model (a bound method, an FSDP2
    state): once the model is deleted, nothing commspan keeps between calls holds
    it, while the mode lives and after it shut down (the module's kept views of its
    hook tables held the hook, so the model, for the life of the mode)."""
    import gc
    import weakref

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.lin.register_forward_hook(self.hook)  # (bound: refers to the model)
            self.register_forward_hook(lambda mod, args, out: self.hook(mod, args, out))

        def hook(self, mod: nn.Module, args: Any, out: Any) -> Any:
            return out + 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    mode = CommSpanMode(aggregator=False)
    model = Hooked()
    with mode:
        for step in range(2):
            with mode.step(step):
                model(torch.ones(1, 2))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the model outlived its last reference while the mode lives"
    mode.shutdown()


def test_an_fsdp2_model_is_freed_while_the_mode_lives(fake_pg: None) -> None:
    """FSDP2's forward hooks hold its state, which holds the module: a traced
    ``fully_shard`` model is freed once deleted, while the mode lives."""
    import gc
    import weakref

    from torch.distributed.fsdp import fully_shard

    mode = CommSpanMode(aggregator=False)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    with mode:
        for step in range(2):
            with mode.step(step):
                model(torch.ones(2, 4)).sum().backward()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the model outlived its last reference while the mode lives"
    mode.shutdown()
