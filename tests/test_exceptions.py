"""A user's exception crossing traced modules: it propagates unchanged, the spans it
crosses end with ERROR, the innermost one carries one ``exception`` event, in forward
and in backward, for built-in exceptions (which take no weak reference) and
``BaseException``s, with or without messages (``record_exception_messages``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from torch import nn

from commspan import CommSpanMode, semconv

SECRET = "tensor([0.1234, 5.6789])"  # what a message can leak


class Boom(Exception):
    """A user-defined exception (takes weak references, unlike built-in ones)."""


def capture(**kwargs: Any) -> tuple[CommSpanMode, InMemorySpanExporter]:
    """A mode whose spans also land, synchronously, in an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return CommSpanMode(tracer_provider=provider, **kwargs), exporter


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
    mode, exporter = capture()
    raised: list[BaseException] = []
    original = _Raises.forward

    def forward(self: _Raises, x: torch.Tensor) -> torch.Tensor:
        try:
            return original(self, x)
        except BaseException as error:
            raised.append(error)
            raise

    model.bad.forward = forward.__get__(model.bad)  # type: ignore[method-assign]
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


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"bad gradient {SECRET}")


class _BwInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(self.lin(x))


class _BwRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _BwInner()
        self.head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


@pytest.mark.parametrize("use_step", [True, False], ids=["step", "mode-only"])
def test_autograd_function_raising_in_backward(use_step: bool) -> None:
    """A custom autograd Function raising in backward: the open backward spans end
    ERROR, the innermost (the module that applied it) has the event."""
    model = _BwRoot()
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture()
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
    mode, exporter = capture(record_exception_messages=False)
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


def test_unprintable_exception_keeps_its_type() -> None:
    """An exception whose ``str()`` raises is still recorded, by type."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    class Raiser(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise Unprintable()

    mode, exporter = capture()
    with pytest.raises(Unprintable), mode, mode.step(0):
        Raiser()(torch.randn(1, 2))
    spans = by_name(exporter)
    assert spans["Raiser forward"].status.status_code is StatusCode.ERROR
    events = exception_events(spans)
    assert events["Raiser forward"][semconv.EXCEPTION_TYPE].endswith("Unprintable")
    assert mode.stats()["internal_errors"] == 0
