"""Helpers shared by the tests that trace small models and look at every span.

:func:`traced_mode` gives a ``CommSpanMode`` whose spans also land,
synchronously, in an in-memory exporter (unlike ``commspan.testing.capture``,
which runs a block and yields its counts, this returns the mode to use in any
way a test needs: several entries, steps, other threads). Span accessors and
the well-formedness check are public: :mod:`commspan.testing.spans`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.modules.module as module_globals
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from commspan import CommSpanMode, semconv
from commspan.testing import span_fqn, span_phase
from commspan.testing.models import MLPModule, parallelize_mlp

__all__ = [
    "IN_DIM",
    "AllReduceNet",
    "Boom",
    "Holder",
    "attrs",
    "hook_sizes",
    "mlp_step",
    "named",
    "quiet",
    "record_raised",
    "tp_mlp",
    "traced_mode",
    "traces_by_step",
]

IN_DIM = 10  # MLPModule: Linear(10, 16) -> ReLU -> Linear(16, 10)


def traced_mode(**kwargs: Any) -> tuple[CommSpanMode, InMemorySpanExporter]:
    """A CommSpanMode whose spans also land, synchronously, in an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return CommSpanMode(tracer_provider=provider, **kwargs), exporter


def tp_mlp(mesh: DeviceMesh) -> MLPModule:
    """MLPModule with net1 column-wise and net2 row-wise over ``mesh``."""
    return parallelize_mlp(MLPModule(), mesh)  # type: ignore[return-value]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    """The span's attributes as a plain dict."""
    return dict(span.attributes or {})


def named(spans: list[ReadableSpan], module: str, in_phase: str) -> list[ReadableSpan]:
    """Spans of module ``module`` in phase ``in_phase``, in end order."""
    return [s for s in spans if span_fqn(s) == module and span_phase(s) == in_phase]


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


def quiet(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()



def traces_by_step(spans: list[ReadableSpan]) -> dict[int, int]:
    """``{step: trace id}`` from the ``commspan.step`` roots among ``spans``."""
    return {
        int(attrs(s)[semconv.STEP]): s.context.trace_id
        for s in spans
        if s.name == semconv.SPAN_STEP
    }


class AllReduceNet(nn.Module):
    """``Linear(4, 4)`` whose output is all-reduced: one ``all_reduce`` per call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        dist.all_reduce(y)
        return y


class Boom(Exception):
    """A user-defined exception (takes weak references, unlike built-in ones)."""


class _RaisesAtOnce(nn.Module):
    """Raises ``Boom("again")`` from its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise Boom("again")


class _Holder(nn.Module):
    """Holds a ``_RaisesAtOnce`` as ``bad`` and calls it (spans: ``_Holder.bad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad = _RaisesAtOnce()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(x)


Holder = _Holder
"""The module whose child raises; its spans are named after the class, ``_Holder``."""


def record_raised(module: nn.Module) -> list[BaseException]:
    """Make ``module`` (this instance) note every exception leaving its forward.

    Returns:
        The list the exceptions are appended to, in order.
    """
    raised: list[BaseException] = []
    original = type(module).forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except BaseException as error:
            raised.append(error)
            raise

    module.forward = forward.__get__(module)  # type: ignore[method-assign]
    return raised
