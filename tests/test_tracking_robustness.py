"""Module tracking under awkward conditions: reuse, containers, deletion, errors, compile,
re-entry, nesting with CommDebugMode, checkpointing, many collectives, steps, bad arguments.

Spans are captured synchronously through a ``TracerProvider`` with an in-memory
exporter. Tensor parallelism runs on the fake process group (``mesh`` fixture).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_globals
from models import MLPModule
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from commspan import CommSpanMode, semconv

IN_DIM = 10  # MLPModule: Linear(10, 16) -> ReLU -> Linear(16, 10)


# ---------------------------------------------------------------- helpers
def capture(**kwargs: Any) -> tuple[CommSpanMode, InMemorySpanExporter]:
    """A CommSpanMode whose spans also land, synchronously, in an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return CommSpanMode(tracer_provider=provider, **kwargs), exporter


def tp_mlp(mesh: DeviceMesh) -> MLPModule:
    """MLPModule with net1 column-wise and net2 row-wise over ``mesh``."""
    return parallelize_module(  # type: ignore[return-value]
        MLPModule(), mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    )


def attrs(span: ReadableSpan) -> dict[str, Any]:
    """The span's attributes as a plain dict."""
    return dict(span.attributes or {})


def fqn(span: ReadableSpan) -> str | None:
    """The span's module name (``Global`` for the rank span, ``None`` for trace roots)."""
    value = attrs(span).get(semconv.MODULE_FQN)
    return None if value is None else str(value)


def phase(span: ReadableSpan) -> str | None:
    """The span's phase, ``None`` for root and rank spans."""
    value = attrs(span).get(semconv.PHASE)
    return None if value is None else str(value)


def named(spans: list[ReadableSpan], module: str, in_phase: str) -> list[ReadableSpan]:
    """Spans of module ``module`` in phase ``in_phase``, in end order."""
    return [s for s in spans if fqn(s) == module and phase(s) == in_phase]


def counts(span: ReadableSpan) -> dict[tuple[str, str], int]:
    """``{(phase, op): n}`` from the span's count attributes."""
    out = {}
    for key, value in attrs(span).items():
        parsed = semconv.parse_count_key(key)
        if parsed is not None:
            out[parsed] = int(value)
    return out


def collective_events(span: ReadableSpan) -> list[Any]:
    """Events of ``span`` that describe a collective."""
    return [e for e in span.events if semconv.COLL_OP in (e.attributes or {})]


def assert_well_formed(spans: list[ReadableSpan]) -> None:
    """Every parent present in the same trace, children inside parents, one root per trace."""
    by_id = {(s.context.trace_id, s.context.span_id): s for s in spans}
    roots: Counter[int] = Counter()
    for s in spans:
        assert s.end_time is not None and s.start_time is not None
        assert s.start_time <= s.end_time, s.name
        if s.parent is None:
            assert s.name in (semconv.SPAN_STEP, semconv.SPAN_SESSION), s.name
            roots[s.context.trace_id] += 1
            continue
        parent = by_id.get((s.context.trace_id, s.parent.span_id))
        assert parent is not None, f"{s.name}: parent missing"
        assert parent.start_time <= s.start_time, s.name  # type: ignore[operator]
        assert s.end_time <= parent.end_time, s.name  # type: ignore[operator]
    assert set(roots) == {s.context.trace_id for s in spans}
    assert all(n == 1 for n in roots.values())


def hook_sizes(*modules: nn.Module) -> dict[str, int]:
    """Sizes of torch's global module-hook registries and of each module's own hook dicts."""
    sizes = {
        name: len(getattr(module_globals, name))
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_forward_hooks_always_called",
            "_global_forward_hooks_with_kwargs",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
        if hasattr(module_globals, name)
    }
    for root in modules:
        for name, sub in root.named_modules():
            for kind in (
                "_forward_hooks",
                "_forward_pre_hooks",
                "_backward_hooks",
                "_backward_pre_hooks",
                "_forward_hooks_always_called",
            ):
                sizes[f"{type(root).__name__}.{name}.{kind}"] = len(getattr(sub, kind))
    return sizes


def mlp_step(model: nn.Module, requires_grad: bool = True) -> None:
    """One forward + backward of an MLPModule-shaped model."""
    model(torch.randn(4, IN_DIM, requires_grad=requires_grad)).sum().backward()


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


# ---------------------------------------------------------------- reuse, names, deletion
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
    single, _ = capture()
    model = _Tied(tp_mlp(mesh))
    with single:
        mlp_step(model.block)
    assert single.aggregator is not None
    once = single.aggregator.module_counts()["MLPModule"]
    assert once["forward"]["all_reduce"] >= 1 and once["backward"]["all_reduce"] >= 1

    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture()
    with mode, torch.no_grad():
        model(torch.randn(4, IN_DIM))
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert {phase(s) for s in spans} == {None, "forward"}
    assert mode.aggregator is not None
    assert mode.aggregator.comm_counts("forward") == {"all_reduce": 1}
    assert mode.aggregator.comm_counts("backward") == {}


# ---------------------------------------------------------------- exceptions
class Boom(Exception):
    """The user's exception."""


class _Bad(nn.Module):
    def __init__(self, armed: list[bool]) -> None:
        super().__init__()
        self.lin = nn.Linear(IN_DIM, IN_DIM)
        self.armed = armed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.armed[0]:
            raise Boom("bad forward")
        return y


class _Mid(nn.Module):
    def __init__(self, armed: list[bool]) -> None:
        super().__init__()
        self.bad = _Bad(armed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(x)


class _Raiser(nn.Module):
    """A TP MLP, then a module whose grandchild raises while ``armed[0]`` is true."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.armed = [True]
        self.pre = tp_mlp(mesh)
        self.mid = _Mid(self.armed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mid(self.pre(x))


def _clean_step_reference(mesh: DeviceMesh) -> dict[str, Any]:
    model = _Raiser(mesh)
    model.armed[0] = False
    mode, _ = capture()
    with mode:
        mlp_step(model)
    assert mode.aggregator is not None
    return mode.aggregator.module_counts()


def test_exception_propagates_unchanged_and_marks_spans(mesh: DeviceMesh) -> None:
    """The exception propagates as is; raiser and ancestors end ERROR; the raiser has the event."""
    model = _Raiser(mesh)
    mode, exporter = capture()
    raised: list[BaseException] = []

    original = _Bad.forward

    def forward(self: _Bad, x: torch.Tensor) -> torch.Tensor:
        try:
            return original(self, x)
        except Boom as exc:
            raised.append(exc)
            raise

    model.mid.bad.forward = forward.__get__(model.mid.bad)  # type: ignore[method-assign]
    with mode, pytest.raises(Boom) as info, mode.step(0):
        mlp_step(model)
    assert raised and info.value is raised[0]
    assert str(info.value) == "bad forward" and type(info.value) is Boom

    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    status = {s.name: s.status.status_code for s in spans}
    for name in ("_Raiser.mid.bad forward", "_Raiser.mid forward", "_Raiser forward"):
        assert status[name] is StatusCode.ERROR, name
    for name in ("_Raiser.mid.bad.lin forward", "_Raiser.pre forward", "_Raiser.pre.net2 forward"):
        assert status[name] is not StatusCode.ERROR, name
    with_exception = {
        s.name: e for s in spans for e in s.events if e.name == semconv.EVENT_EXCEPTION
    }
    assert list(with_exception) == ["_Raiser.mid.bad forward"]
    event_attrs = dict(with_exception["_Raiser.mid.bad forward"].attributes or {})
    assert event_attrs[semconv.EXCEPTION_TYPE] == "Boom"
    assert event_attrs[semconv.EXCEPTION_MESSAGE] == "bad forward"
    bad = named(spans, "_Raiser.mid.bad", "forward")[0]
    assert "bad forward" in (bad.status.description or "")


def test_tracker_unwinds_after_exception(mesh: DeviceMesh) -> None:
    """After a forward raised, a later step of the same context and a new context are correct."""
    expected = _clean_step_reference(mesh)
    model = _Raiser(mesh)
    mode, exporter = capture()
    with mode:
        with pytest.raises(Boom), mode.step(0):
            mlp_step(model)
        failed = {s.context.trace_id for s in exporter.get_finished_spans()}
        model.armed[0] = False
        with mode.step(1):
            mlp_step(model)
    step1 = [s for s in exporter.get_finished_spans() if s.context.trace_id not in failed]
    assert_well_formed(step1)
    assert all(s.status.status_code is not StatusCode.ERROR for s in step1)
    assert {fqn(s) for s in step1 if phase(s) == "forward"} == {
        "_Raiser",
        "_Raiser.pre",
        "_Raiser.pre.net1",
        "_Raiser.pre.relu",
        "_Raiser.pre.net2",
        "_Raiser.mid",
        "_Raiser.mid.bad",
        "_Raiser.mid.bad.lin",
    }
    depth = {fqn(s): attrs(s)[semconv.MODULE_DEPTH] for s in step1 if phase(s) == "forward"}
    assert depth["_Raiser"] == 1 and depth["_Raiser.mid.bad.lin"] == 4
    rank_span = next(s for s in step1 if s.name == semconv.SPAN_RANK)
    assert counts(rank_span) == {
        (p, op): n for p, ops in expected["Global"].items() for op, n in ops.items()
    }

    model.armed[0] = True
    fresh, _ = capture()
    with pytest.raises(Boom), fresh:
        mlp_step(model)
    model.armed[0] = False
    with fresh:
        mlp_step(model)
    assert fresh.aggregator is not None
    assert fresh.aggregator.module_counts() == expected
    assert not fresh.active


class _RaisesAtOnce(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise Boom("again")


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bad = _RaisesAtOnce()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(x)


def test_every_exception_gets_its_own_event() -> None:
    """A forward raising in each of several steps gets a fresh exception event every time."""
    model = _Holder()
    mode, exporter = capture()
    caught = 0
    with mode:
        for i in range(5):
            try:  # as user code does: each exception is freed before the next step
                with mode.step(i):
                    model(torch.randn(2, IN_DIM))
            except Boom:
                caught += 1
    assert caught == 5
    bad_spans = named(list(exporter.get_finished_spans()), "_Holder.bad", "forward")
    assert len(bad_spans) == 5
    assert all(s.status.status_code is StatusCode.ERROR for s in bad_spans)
    assert [sum(e.name == semconv.EVENT_EXCEPTION for e in s.events) for s in bad_spans] == [1] * 5


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("bad backward")


class _BwInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = [True]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return _FailingBackward.apply(y) if self.fail[0] else y


class _BwRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _BwInner()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_tracker_unwinds_after_backward_exception() -> None:
    """After a backward raised (no steps), the next forward nests under the rank span."""
    model = _BwRoot()
    mode, exporter = capture()
    with mode:
        with pytest.raises(Boom):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        model.inner.fail[0] = False
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    by_id = {(s.context.trace_id, s.context.span_id): s for s in spans}

    def ancestors(s: ReadableSpan) -> list[ReadableSpan]:
        out = []
        while s.parent is not None:
            s = by_id[(s.context.trace_id, s.parent.span_id)]
            out.append(s)
        return out

    roots = named(spans, "_BwRoot", "forward")
    assert len(roots) == 2
    for root in roots:
        assert ancestors(root)[0].name == semconv.SPAN_RANK
    for s in spans:
        if phase(s) == "forward":
            assert {phase(a) for a in ancestors(s)} <= {"forward", None}, s.name
    assert len(named(spans, "_BwRoot", "backward")) == 2


def test_exception_leaving_the_mode_removes_hooks(mesh: DeviceMesh) -> None:
    """An exception that leaves ``with mode:`` propagates, and the mode leaves no hook behind."""
    model = _Raiser(mesh)
    before = hook_sizes(model)
    mode, exporter = capture()
    with pytest.raises(Boom), mode:
        mlp_step(model)
    assert not mode.active
    assert hook_sizes(model) == before
    assert_well_formed(list(exporter.get_finished_spans()))


# ---------------------------------------------------------------- torch.compile
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
    expected = _quiet(lambda: model(x)).detach()
    mode, exporter = capture()
    with mode:
        for _ in range(2):
            out = _quiet(lambda: model(x.clone().requires_grad_()))
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
    eager_mode, _ = capture()
    eager = tp_mlp(mesh)
    with eager_mode:
        mlp_step(eager)
    compiled: Any = torch.compile(tp_mlp(mesh), backend="eager")
    mode, exporter = capture()
    with mode:
        _quiet(lambda: mlp_step(compiled))
    assert_well_formed(list(exporter.get_finished_spans()))
    assert mode.aggregator is not None and eager_mode.aggregator is not None
    assert mode.aggregator.comm_counts() == eager_mode.aggregator.comm_counts()
    assert mode.stats()["internal_errors"] == 0


# ---------------------------------------------------------------- re-entry
def test_enter_exit_many_times_leaves_no_hooks(mesh: DeviceMesh) -> None:
    """Entering and leaving modes 50 times leaves global and per-module hooks unchanged."""
    model = tp_mlp(mesh)
    x = torch.randn(4, IN_DIM, requires_grad=True)
    before = hook_sizes(model)
    reused, _ = capture()
    seen: list[Any] = []
    for i in range(50):
        mode = reused if i % 2 else capture()[0]
        with mode, mode.step(i):
            model(x).sum().backward()
        assert hook_sizes(model) == before, i
        assert not x._backward_hooks, i
        assert mode.aggregator is not None
        seen.append(mode.aggregator.module_counts())
    assert all(c == seen[0] for c in seen)
    assert seen[0]["Global"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def test_reentered_mode_keeps_sequence_numbers_and_redescribes_new_parameters(
    mesh: DeviceMesh,
) -> None:
    """A mode entered again continues each group's sequence numbers, and a module
    whose parameters were replaced between (or within) blocks is described anew."""
    model = tp_mlp(mesh)
    x = torch.randn(4, IN_DIM, requires_grad=True)
    mode, exporter = capture()
    for i in range(3):
        with mode, mode.step(i):
            model(x).sum().backward()
    spans = list(exporter.get_finished_spans())
    seqs = [
        (e.attributes or {})[semconv.COLL_SEQ]
        for s in sorted(spans, key=lambda s: s.start_time or 0)
        for e in collective_events(s)
    ]
    assert len(seqs) == 6 and seqs == sorted(seqs) and len(set(seqs)) == 6, seqs

    plain = nn.Linear(4, 4)
    with mode, mode.step(3):
        plain(torch.randn(2, 4))
        plain.weight = nn.Parameter(torch.randn(3, 4))
        plain.bias = nn.Parameter(torch.randn(3))
        plain(torch.randn(2, 4))
    with mode, mode.step(4):
        plain(torch.randn(2, 4))
    forwards = sorted(named(list(exporter.get_finished_spans()), "Linear", "forward"),
                      key=lambda s: s.start_time or 0)
    shapes = [tuple(attrs(s)[semconv.PARAM_SHAPES]) for s in forwards]
    assert shapes == [("4x4", "4"), ("3x4", "3"), ("3x4", "3")]


def test_sampled_out_step_runs_without_global_hooks() -> None:
    """During a sampled-out step no global module hook and no commspan dispatch mode
    is installed; both are back for the next traced step."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode, exporter = capture(sample=2)
    model = nn.Linear(4, 4)
    before = (len(module_globals._global_forward_pre_hooks),
              len(module_globals._global_forward_hooks))
    seen = []
    with mode:
        for i in range(3):
            with mode.step(i):
                seen.append((
                    len(module_globals._global_forward_pre_hooks),
                    len(module_globals._global_forward_hooks),
                    len(_get_current_dispatch_mode_stack()),
                ))
                model(torch.randn(2, 4)).sum().backward()
    traced = (before[0] + 1, before[1] + 1, 1)
    assert seen == [traced, (*before, 0), traced]
    assert sorted(_traces_by_step(list(exporter.get_finished_spans()))) == [0, 2]


def test_entering_an_active_mode_raises() -> None:
    """Entering a mode that is already active raises a clear RuntimeError and leaves it working."""
    model = nn.Linear(4, 4)
    before = hook_sizes(model)
    mode, exporter = capture()
    with mode:
        with pytest.raises(RuntimeError, match="already active"):
            mode.__enter__()
        assert mode.active
        model(torch.randn(2, 4))
    assert not mode.active
    assert hook_sizes(model) == before
    assert [fqn(s) for s in exporter.get_finished_spans() if phase(s) == "forward"] == ["Linear"]


# ---------------------------------------------------------------- CommDebugMode
def _cdm_counts(cdm: Any) -> tuple[int, dict[str, int], dict[str, dict[str, dict[str, int]]]]:
    module_counts = {
        m: {p: {str(op): n for op, n in ops.items()} for p, ops in phases.items()}
        for m, phases in cdm.comm_module_counts.items()
    }
    return (
        cdm.get_total_counts(),
        {str(op): n for op, n in cdm.get_comm_counts().items()},
        module_counts,
    )


@pytest.mark.parametrize(
    "commspan_outside", [True, False], ids=["commspan-outside", "commspan-inside"]
)
def test_nesting_with_torch_commdebugmode(mesh: DeviceMesh, commspan_outside: bool) -> None:
    """CommSpanMode around or inside torch's CommDebugMode (fresh per step) changes no counts."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = tp_mlp(mesh)
    alone = []
    for _ in range(2):
        cdm = CommDebugMode()
        with cdm:
            mlp_step(model)
        alone.append(_cdm_counts(cdm))
    solo, _ = capture()
    with solo:
        for i in range(2):
            with solo.step(i):
                mlp_step(model)
    assert solo.aggregator is not None

    nested, _ = capture()
    together = []
    if commspan_outside:
        with nested:
            for i in range(2):
                cdm = CommDebugMode()
                with nested.step(i), cdm:
                    mlp_step(model)
                together.append(_cdm_counts(cdm))
    else:
        for _ in range(2):
            cdm = CommDebugMode()
            with cdm, nested:
                mlp_step(model)
            together.append(_cdm_counts(cdm))
    assert together == alone
    assert alone[0][0] == 2
    assert nested.aggregator is not None
    if commspan_outside:
        assert nested.aggregator.module_counts() == solo.aggregator.module_counts()
    else:  # a fresh context per step: compare with one step alone
        one, _ = capture()
        with one:
            mlp_step(model)
        assert one.aggregator is not None
        assert nested.aggregator.module_counts() == one.aggregator.module_counts()


def test_sampled_out_steps_with_commdebugmode_around_or_inside(mesh: DeviceMesh) -> None:
    """Sampled-out steps record nothing, with torch's CommDebugMode around or inside the step."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = tp_mlp(mesh)
    for cdm_outside in (True, False):
        mode, _ = capture(sample={0, 2})
        seen = []
        with mode:
            for i in range(4):
                cdm = CommDebugMode()
                if cdm_outside:
                    with cdm, mode.step(i):
                        mlp_step(model)
                else:
                    with mode.step(i), cdm:
                        mlp_step(model)
                assert mode.aggregator is not None
                seen.append((cdm.get_total_counts(), mode.aggregator.total_count()))
        assert seen == [(2, 2), (2, 2), (2, 4), (2, 4)], cdm_outside
        assert mode.stats()["collectives"] == 4


# ---------------------------------------------------------------- checkpointing
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
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, _ = capture()
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
    failing = _Holder()
    mode, _ = capture()
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


# ---------------------------------------------------------------- many collectives
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
    mode, exporter = capture()
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


# ---------------------------------------------------------------- steps
def _run_steps(run_id: str, steps: int) -> list[ReadableSpan]:
    mode, exporter = capture(run_id=run_id)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with mode:
        for i in range(steps):
            with mode.step(i) as traced:
                assert traced is True
                model(torch.randn(2, 4)).sum().backward()
    return list(exporter.get_finished_spans())


def _traces_by_step(spans: list[ReadableSpan]) -> dict[int, int]:
    return {
        int(attrs(s)[semconv.STEP]): s.context.trace_id
        for s in spans
        if s.name == semconv.SPAN_STEP
    }


def test_one_trace_per_step() -> None:
    """Each step is one trace: commspan.step root, a Global rank span under it, modules below."""
    spans = _run_steps("run-a", 3)
    assert_well_formed(spans)
    traces = _traces_by_step(spans)
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
    assert _traces_by_step(a1) == _traces_by_step(a2)
    root_ids = [
        {attrs(s)[semconv.STEP]: s.context.span_id for s in spans if s.name == semconv.SPAN_STEP}
        for spans in (a1, a2)
    ]
    assert root_ids[0] == root_ids[1]
    assert set(_traces_by_step(a1).values()).isdisjoint(_traces_by_step(b).values())


def test_sampled_out_steps_record_nothing() -> None:
    """With sample=2, odd steps yield False and produce no span; even steps are traced."""
    mode, exporter = capture(sample=2)
    model = nn.Linear(4, 4)
    flags = []
    with mode:
        for i in range(4):
            with mode.step(i) as traced:
                flags.append(traced)
                model(torch.randn(2, 4)).sum().backward()
    assert flags == [True, False, True, False]
    assert sorted(_traces_by_step(list(exporter.get_finished_spans()))) == [0, 2]
    assert mode.stats()["steps_traced"] == 2 and mode.stats()["steps_skipped"] == 2


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    ("kwargs", "error", "parameter"),
    [
        ({"exporters": object()}, TypeError, "exporters"),
        ({"exporters": [object()]}, TypeError, "exporters"),
        ({"tracer_provider": object()}, TypeError, "tracer_provider"),
        ({"sample": 0}, ValueError, "sample"),
        ({"sample": True}, TypeError, "sample"),
        ({"flush_timeout_s": 0}, ValueError, "flush_timeout_s"),
        ({"export_queue_size": 0}, ValueError, "export_queue_size"),
        ({"run_id": ""}, TypeError, "run_id"),
        ({"aggregator": "yes"}, TypeError, "aggregator"),
    ],
    ids=[
        "exporters-object",
        "exporters-list-of-object",
        "tracer_provider",
        "sample-0",
        "sample-bool",
        "flush_timeout_s",
        "export_queue_size",
        "run_id-empty",
        "aggregator-str",
    ],
)
def test_bad_constructor_arguments(
    kwargs: dict[str, Any], error: type[Exception], parameter: str
) -> None:
    """A bad constructor argument raises a clear error naming the parameter."""
    with pytest.raises(error, match=rf"\b{parameter}="):
        CommSpanMode(**kwargs)


def test_export_queue_size_checked_with_exporters() -> None:
    """export_queue_size=0 with an exporter raises ValueError naming export_queue_size."""
    with pytest.raises(ValueError, match=r"\bexport_queue_size="):
        CommSpanMode(exporters=[InMemorySpanExporter()], export_queue_size=0)


def test_step_with_non_int_index() -> None:
    """mode.step('x') raises TypeError naming the index."""
    mode = CommSpanMode()
    bad: Any = "x"
    with mode, pytest.raises(TypeError, match=r"index='x'"), mode.step(bad):
        pass


def test_step_outside_mode() -> None:
    """mode.step() outside ``with mode:`` raises RuntimeError saying so."""
    mode = CommSpanMode()
    with pytest.raises(RuntimeError, match="outside"), mode.step(0):
        pass


def test_nested_step() -> None:
    """A step inside another step raises RuntimeError; the outer step still ends cleanly."""
    mode, exporter = capture()
    with mode:
        with mode.step(0), pytest.raises(RuntimeError, match="nest"), mode.step(1):
            pass
        with mode.step(1):
            pass
    assert sorted(_traces_by_step(list(exporter.get_finished_spans()))) == [0, 1]
