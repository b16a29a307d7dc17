"""A user's exception crossing traced modules: it propagates unchanged, the spans it
crosses end with ERROR, the innermost one carries one ``exception`` event, in forward
and in backward, for built-in exceptions (which take no weak reference) and
``BaseException``s, with or without messages (``record_exception_messages``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _tracing import (
    IN_DIM,
    Boom,
    Holder,
    attrs,
    hook_sizes,
    mlp_step,
    named,
    record_raised,
    tp_mlp,
    traced_mode,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from commspan import CommSpanMode, semconv
from commspan.testing import assert_well_formed
from commspan.testing import span_counts as counts
from commspan.testing import span_fqn as fqn
from commspan.testing import span_phase as phase

SECRET = "tensor([0.1234, 5.6789])"  # what a message can leak


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    """Finished spans by name (each name once in these tests)."""
    spans = list(exporter.get_finished_spans())
    named = {s.name: s for s in spans}
    assert len(named) == len(spans)
    return named


def exception_events(spans: dict[str, ReadableSpan]) -> dict[str, dict[str, Any]]:
    """``{span name: exception event attributes}``; fails if a span has two."""
    out: dict[str, dict[str, Any]] = {}
    for name, span in spans.items():
        events = [e for e in span.events if e.name == semconv.EVENT_EXCEPTION]
        assert len(events) <= 1, name
        if events:
            out[name] = dict(events[0].attributes or {})
    return out


def status(spans: dict[str, ReadableSpan]) -> dict[str, StatusCode]:
    """``{span name: status code}``."""
    return {n: s.status.status_code for n, s in spans.items()}


class _Raises(nn.Module):
    def __init__(self, exc: type[BaseException]) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.exc = exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x)
        raise self.exc(f"bad value {SECRET}")


class _Outer(nn.Module):
    def __init__(self, exc: type[BaseException]) -> None:
        super().__init__()
        self.pre = nn.Linear(2, 2)
        self.bad = _Raises(exc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(self.pre(x))


EXCEPTIONS = [RuntimeError, ValueError, KeyboardInterrupt, Boom]


@pytest.mark.parametrize("use_step", [True, False], ids=["step", "mode-only"])
@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: e.__name__)
def test_forward_exception(exc: type[BaseException], use_step: bool) -> None:
    """A forward raising: the same exception reaches the user; the raiser and its
    ancestors end ERROR, only the raiser has the event; no internal error."""
    model = _Outer(exc)
    mode, exporter = traced_mode()
    raised = record_raised(model.bad)
    with pytest.raises(exc) as info, mode:
        if use_step:
            with mode.step(0):
                model(torch.randn(1, 2))
        else:
            model(torch.randn(1, 2))
    assert info.value is raised[0] and info.value.__context__ is None

    assert mode.stats()["internal_errors"] == 0
    spans = by_name(exporter)
    codes = status(spans)
    for name in ("_Outer.bad forward", "_Outer forward", semconv.SPAN_RANK):
        assert codes[name] is StatusCode.ERROR, name
    for name in ("_Outer.pre forward", "_Outer.bad.lin forward"):
        assert codes[name] is StatusCode.UNSET, name
    assert spans["_Outer.bad forward"].status.description == f"{exc.__name__}: bad value {SECRET}"
    events = exception_events(spans)
    assert list(events) == ["_Outer.bad forward"]
    assert events["_Outer.bad forward"] == {
        semconv.EXCEPTION_TYPE: exc.__qualname__,
        semconv.EXCEPTION_MESSAGE: f"bad value {SECRET}",
    }


def _bad_gradient() -> BaseException:
    return ValueError(f"bad gradient {SECRET}")


class _FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises ``error()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, error: Callable[[], BaseException]) -> torch.Tensor:
        ctx.error = error
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise ctx.error()


class _BwInner(nn.Module):
    """A Linear whose output's backward raises while ``fail[0]`` is true."""

    def __init__(self, dim: int, error: Callable[[], BaseException]) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.error = error
        self.fail = [True]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return _FailingBackward.apply(y, self.error) if self.fail[0] else y


class _BwRoot(nn.Module):
    def __init__(self, dim: int = 2, error: Callable[[], BaseException] = _bad_gradient) -> None:
        super().__init__()
        self.inner = _BwInner(dim, error)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


@pytest.mark.parametrize("use_step", [True, False], ids=["step", "mode-only"])
def test_autograd_function_raising_in_backward(use_step: bool) -> None:
    """A custom autograd Function raising in backward: the open backward spans end
    ERROR, the innermost (the module that applied it) has the event."""
    model = _BwRoot()
    mode, exporter = traced_mode()
    with pytest.raises(ValueError, match="bad gradient") as info, mode:
        if use_step:
            with mode.step(0):
                model(torch.randn(1, 2, requires_grad=True)).sum().backward()
        else:
            model(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert type(info.value) is ValueError and info.value.__context__ is None
    assert mode.stats()["internal_errors"] == 0
    spans = by_name(exporter)
    codes = status(spans)
    for name in ("_BwRoot.inner backward", "_BwRoot backward", semconv.SPAN_RANK):
        assert codes[name] is StatusCode.ERROR, name
    assert codes["_BwRoot.head backward"] is StatusCode.UNSET  # finished before the error
    assert all(c is StatusCode.UNSET for n, c in codes.items() if n.endswith(" forward"))
    events = exception_events(spans)
    assert list(events) == ["_BwRoot.inner backward"]
    assert events["_BwRoot.inner backward"][semconv.EXCEPTION_TYPE] == "ValueError"


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt], ids=lambda e: e.__name__)
def test_backward_hook_raising(exc: type[BaseException]) -> None:
    """A module's backward hook raising: its backward span and the enclosing ones end
    ERROR, it has the event, the user gets the hook's exception."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    error = exc(f"hook {SECRET}")

    def hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        raise error

    model[1].register_full_backward_hook(hook)
    mode, exporter = traced_mode()
    with pytest.raises(exc) as info, mode, mode.step(0):
        model(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert info.value is error
    assert mode.stats()["internal_errors"] == 0
    spans = by_name(exporter)
    codes = status(spans)
    assert codes["Sequential.1 backward"] is StatusCode.ERROR
    assert codes["Sequential backward"] is StatusCode.ERROR
    assert list(exception_events(spans)) == ["Sequential.1 backward"]


def test_backward_error_caught_inside_the_step() -> None:
    """A backward error the user catches inside the step: its open spans still end ERROR
    (the backward did not finish)."""
    model = _BwRoot()
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        try:
            model(torch.randn(1, 2, requires_grad=True)).sum().backward()
        except ValueError:
            pass
    spans = by_name(exporter)
    assert spans["_BwRoot.inner backward"].status.status_code is StatusCode.ERROR
    assert spans["_BwRoot backward"].status.status_code is StatusCode.ERROR
    assert spans[semconv.SPAN_RANK].status.status_code is StatusCode.UNSET
    assert mode.stats()["internal_errors"] == 0


def test_error_outside_any_module_is_on_the_rank_span() -> None:
    """An exception raised outside every module (the loss, say) has its event on the rank span."""
    model = nn.Linear(2, 2)
    mode, exporter = traced_mode()
    with pytest.raises(RuntimeError), mode, mode.step(0):
        model(torch.randn(1, 2))
        raise RuntimeError("bad loss")
    spans = by_name(exporter)
    assert list(exception_events(spans)) == [semconv.SPAN_RANK]
    assert spans["Linear forward"].status.status_code is StatusCode.UNSET


def test_exception_raised_again_in_the_next_step_gets_a_new_event() -> None:
    """The same exception object raised in two steps is recorded in both."""
    error = RuntimeError("again")

    class Raiser(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise error

    model = nn.Sequential(Raiser())
    mode, exporter = traced_mode()
    with mode:
        for i in range(3):
            with pytest.raises(RuntimeError), mode.step(i):
                model(torch.randn(1, 2))
    raisers = [s for s in exporter.get_finished_spans() if s.name == "Sequential.0 forward"]
    assert [sum(e.name == semconv.EVENT_EXCEPTION for e in s.events) for s in raisers] == [1] * 3


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_messages_left_out_on_request(where: str) -> None:
    """``record_exception_messages=False``: status descriptions are the type name, events
    carry the type only, and the message appears nowhere in the spans."""
    mode, exporter = traced_mode(record_exception_messages=False)
    model: nn.Module = _Outer(ValueError) if where == "forward" else _BwRoot()
    with pytest.raises(ValueError, match="tensor"), mode, mode.step(0):
        model(torch.randn(1, 2, requires_grad=True)).sum().backward()
    spans = by_name(exporter)
    errors = [s for s in spans.values() if s.status.status_code is StatusCode.ERROR]
    assert errors and all(s.status.description == "ValueError" for s in errors)
    events = exception_events(spans)
    assert len(events) == 1 and list(events.values()) == [{semconv.EXCEPTION_TYPE: "ValueError"}]
    assert SECRET not in repr([s.to_json() for s in spans.values()])
    assert mode.stats()["internal_errors"] == 0


def test_record_exception_messages_must_be_a_bool() -> None:
    """A non-bool ``record_exception_messages`` is a TypeError naming it."""
    with pytest.raises(TypeError, match="record_exception_messages='no'"):
        CommSpanMode(record_exception_messages="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError], ids=lambda e: e.__name__)
def test_an_exception_without_a_message_is_described_by_its_type(
        exc: type[BaseException]) -> None:
    """A Ctrl-C (``KeyboardInterrupt()``, no text) or a bare ``raise ValueError``: the
    spans it crosses end ERROR described ``"KeyboardInterrupt"``, as its type, not
    ``"KeyboardInterrupt: "`` (which `commspan check` showed as ``it left it on an
    error, KeyboardInterrupt: , raised in ...``)."""

    class Raiser(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise exc()

    mode, exporter = traced_mode()
    with pytest.raises(exc), mode, mode.step(0):
        Raiser()(torch.randn(1, 2))
    spans = by_name(exporter)
    for name in ("Raiser forward", semconv.SPAN_RANK):
        assert spans[name].status.status_code is StatusCode.ERROR
        assert spans[name].status.description == exc.__name__, name
    assert exception_events(spans)["Raiser forward"][semconv.EXCEPTION_MESSAGE] == ""


def test_unprintable_exception_keeps_its_type() -> None:
    """An exception whose ``str()`` raises is still recorded, by type."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    class Raiser(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise Unprintable()

    mode, exporter = traced_mode()
    with pytest.raises(Unprintable), mode, mode.step(0):
        Raiser()(torch.randn(1, 2))
    spans = by_name(exporter)
    assert spans["Raiser forward"].status.status_code is StatusCode.ERROR
    events = exception_events(spans)
    assert events["Raiser forward"][semconv.EXCEPTION_TYPE].endswith("Unprintable")
    assert mode.stats()["internal_errors"] == 0


# ---------------------------------------------------------------- under tensor parallelism
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
    mode, _ = traced_mode()
    with mode:
        mlp_step(model)
    assert mode.aggregator is not None
    return mode.aggregator.module_counts()


def test_exception_propagates_unchanged_and_marks_spans(mesh: DeviceMesh) -> None:
    """The exception propagates as is; raiser and ancestors end ERROR; the raiser has the event."""
    model = _Raiser(mesh)
    mode, exporter = traced_mode()
    raised = record_raised(model.mid.bad)
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
    mode, exporter = traced_mode()
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
    fresh, _ = traced_mode()
    with pytest.raises(Boom), fresh:
        mlp_step(model)
    model.armed[0] = False
    with fresh:
        mlp_step(model)
    assert fresh.aggregator is not None
    assert fresh.aggregator.module_counts() == expected
    assert not fresh.active


def test_every_exception_gets_its_own_event() -> None:
    """A forward raising in each of several steps gets a fresh exception event every time."""
    model = Holder()
    mode, exporter = traced_mode()
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


def test_tracker_unwinds_after_backward_exception() -> None:
    """After a backward raised (no steps), the next forward nests under the rank span."""
    model = _BwRoot(4, lambda: Boom("bad backward"))
    mode, exporter = traced_mode()
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
    mode, exporter = traced_mode()
    with pytest.raises(Boom), mode:
        mlp_step(model)
    assert not mode.active
    assert hook_sizes(model) == before
    assert_well_formed(list(exporter.get_finished_spans()))


# ------------------------------------------------------------------ interrupts in commspan
def _interrupt_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Make ``owner.name`` raise KeyboardInterrupt on its first call (a Ctrl-C landing
    inside commspan's own code); returns the call counter."""
    original = getattr(owner, name)
    calls = [0]

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return calls


def _global_hooks() -> tuple[int, int]:
    import torch.nn.modules.module as module_module

    return (len(module_module._global_forward_pre_hooks),
            len(module_module._global_forward_hooks))


@pytest.mark.parametrize("where", ["trace", "pause"])
def test_an_interrupt_while_a_step_is_entered_leaves_the_next_steps_traced(
    monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    """A Ctrl-C landing while ``mode.step(i)`` sets the step up (a traced step opening
    its trace, a sampled-out step pausing the hooks) reaches the user, and the next
    steps are traced as usual: the mode is not left believing a step is open."""
    from commspan.spans.traces import TraceOpener

    mode, exporter = traced_mode(sample=2)  # steps 0, 2, ... traced; 1, 3, ... sampled out
    if where == "trace":
        calls = _interrupt_once(monkeypatch, TraceOpener, "step")
    else:
        calls = _interrupt_once(monkeypatch, mode, "_pause")
    model = nn.Linear(2, 2)
    first = 0 if where == "trace" else 1
    with mode:
        with pytest.raises(KeyboardInterrupt):
            with mode.step(first):
                model(torch.ones(1, 2))
        for i in (2, 3, 4):
            with mode.step(i):
                model(torch.ones(1, 2))
    mode.shutdown()
    assert calls[0] >= 2
    forward = [s for s in exporter.get_finished_spans() if s.name == "Linear forward"]
    assert len(forward) == 2  # steps 2 and 4
    assert mode.stats()["internal_errors"] == 0


def test_an_interrupt_while_the_mode_is_left_still_removes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C landing while the mode closes its trace on exit reaches the user; the
    global hooks and the dispatch mode are gone all the same, and the next use of the
    mode traces as usual."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from commspan.spans.recorder import SpanRecorder

    before = (_global_hooks(), len(_get_current_dispatch_mode_stack()))
    mode, exporter = traced_mode()
    model = nn.Linear(2, 2)
    _interrupt_once(monkeypatch, SpanRecorder, "end")
    with pytest.raises(KeyboardInterrupt):
        with mode:
            model(torch.ones(1, 2))
    assert not mode.active
    assert (_global_hooks(), len(_get_current_dispatch_mode_stack())) == before
    with mode:
        with mode.step(0):
            model(torch.ones(1, 2))
    mode.shutdown()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("Linear forward") == 2 and "commspan.step" in names


def test_a_module_whose_own_forward_hook_raises_ends_with_error() -> None:
    """The forward returned, then one of the module's own forward hooks raised (a
    tensor-parallel output hook whose collective failed): the error is that call's,
    so its span ends ERROR with the exception event, not its parent's."""
    mode, exporter = traced_mode()
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    def broken(module: nn.Module, args: Any, output: Any) -> None:
        raise ValueError("the output hook failed")

    model[1].register_forward_hook(broken)
    with mode:
        with pytest.raises(ValueError, match="output hook failed"):
            with mode.step(0):
                model(torch.ones(1, 2))
    mode.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    inner, outer = spans["Sequential.1 forward"], spans["Sequential forward"]
    assert inner.status.status_code is StatusCode.ERROR
    assert [e.name for e in inner.events] == ["exception"]
    assert not [e for e in outer.events if e.name == "exception"]
    assert spans["Sequential.0 forward"].status.status_code is not StatusCode.ERROR
    assert mode.stats()["internal_errors"] == 0


def test_an_interrupt_while_a_span_is_handed_on_still_exports_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C landing in the aggregator while it takes a span reaches the user; the
    other processors still get that span, so every span counted reaches them."""
    mode, exporter = traced_mode()
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert mode.aggregator is not None
    _interrupt_once(monkeypatch, mode.aggregator, "on_end")
    with mode:
        with pytest.raises(KeyboardInterrupt):
            with mode.step(0):
                model(torch.ones(1, 2))
        with mode.step(1):
            model(torch.ones(1, 2))
    mode.shutdown()
    assert mode.stats()["spans"] == len(exporter.get_finished_spans())


class _Interrupted(nn.Module):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x)
        raise self.error("stop")


class _AroundInterrupted(nn.Module):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.a = _Interrupted(error)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(x))


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_a_base_exception_caught_inside_the_step_ends_the_spans_it_crossed_with_error(
        error: type[BaseException]) -> None:
    """A KeyboardInterrupt or SystemExit that leaves module calls and is caught by the
    loop inside the step (no module hook sees it): the spans of the calls it crossed
    end with ERROR, the others OK. Reference: try/finally around each forward, which
    records the calls that did not return."""
    model = _AroundInterrupted(error)
    returned: dict[str, bool] = {}
    for name, module in model.named_modules():
        def forward(*args: Any, _forward: Any = module.forward,
                    _name: str = f"_AroundInterrupted.{name}".rstrip("."),
                    **kwargs: Any) -> Any:
            returned[_name] = False
            out = _forward(*args, **kwargs)
            returned[_name] = True
            return out
        module.forward = forward  # type: ignore[method-assign]
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        try:
            model(torch.randn(2, 4))
        except error:
            pass  # the loop handles it (saves a checkpoint) and finishes the step
    spans = {fqn(s): s for s in exporter.get_finished_spans() if phase(s) == "forward"}
    assert set(spans) == set(returned)
    for name, ok in returned.items():
        code = spans[name].status.status_code
        assert code is (StatusCode.UNSET if ok else StatusCode.ERROR), name
    assert not returned["_AroundInterrupted.a"] and returned["_AroundInterrupted.a.lin"]
    assert mode.stats()["internal_errors"] == 0
