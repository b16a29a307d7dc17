"""The ways a block of training steps is run: without tracing, with a do-nothing
dispatch mode (alone, as a DebugMode, with do-nothing module hooks, or with
torch's ModTracker), with torch's CommDebugMode, and with commspan configured four ways.

A variant runs a *block* of consecutive steps. The benchmark times the whole
block, so everything a variant costs is counted: entering and leaving its
context (commspan's leave waits for its exporters to flush), and the CPU of
commspan's background export threads (``time.process_time`` counts every
thread of the process).
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ALL_VARIANTS",
    "LABELS",
    "SPLIT_VARIANTS",
    "PassThroughDebugMode",
    "PassThroughMode",
    "Variant",
    "available",
    "make_variant",
]

_DTensor: Any
try:
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - torch without distributed
    _DTensor = None

_DebugModeBase: Any
try:
    from torch.utils._debug_mode import DebugMode as _DebugModeBase
except Exception:  # pragma: no cover - torch without DebugMode
    _DebugModeBase = TorchDispatchMode

StepFn = Callable[[], Any]

# key -> label; the order is the order of the table
LABELS: dict[str, str] = {
    "none": "no mode",
    "none_aa": "no mode again (A/A noise check)",
    "floor": "pass-through dispatch mode (floor)",
    "floor_dm_hooks": "floor as a DebugMode + hooks doing nothing",
    "cdm": "torch CommDebugMode (fresh per step)",
    "cs_agg": "commspan, aggregator only",
    "cs_jsonl": "commspan + JSONL",
    "cs_otlp": "commspan + OTLP/HTTP (local receiver)",
    "cs_sampled_out": "commspan, sampled-out step",
}
ALL_VARIANTS: tuple[str, ...] = tuple(LABELS)

# variants of the one-process split only (profile section, which labels its rows):
# what module tracking costs through torch's hooks before anything is recorded
SPLIT_VARIANTS: tuple[str, ...] = ("floor_hooks", "floor_modtracker", "kernels_hooks")
_KNOWN: tuple[str, ...] = ALL_VARIANTS + SPLIT_VARIANTS

# sample=N traces steps 0, N, 2N, ...; the benchmark numbers steps from 1, so none is traced
SAMPLED_OUT_N = 1_000_000_000


class PassThroughMode(TorchDispatchMode):
    """The floor: a dispatch mode that only runs each op.

    Like any mode that must work with DTensor, it returns ``NotImplemented``
    when a tensor subclass is involved, so DTensor runs first and its local
    ops come back through the mode.
    """

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if _DTensor is not None:
            for t in types:
                if issubclass(t, _DTensor):
                    return NotImplemented
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)


class Variant:
    """Runs a block of steps one way; ``close()`` releases what it holds."""

    key = ""

    def run_block(self, step: StepFn, indices: Sequence[int]) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class _NoMode(Variant):
    def run_block(self, step: StepFn, indices: Sequence[int]) -> None:
        for _ in indices:
            step()


class _Floor(Variant):
    def run_block(self, step: StepFn, indices: Sequence[int]) -> None:
        with PassThroughMode():
            for _ in indices:
                step()


def _noop(*_: Any) -> None:
    return None


def _hook_grads(obj: Any) -> None:
    """A do-nothing hook on the grad_fn of every tensor in ``obj`` that has one."""
    if isinstance(obj, torch.Tensor):
        node = obj.grad_fn
        if node is not None:
            node.register_prehook(_noop)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _hook_grads(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            _hook_grads(item)


def _pre_hook(module: Any, args: Any) -> None:
    if torch.is_grad_enabled():
        _hook_grads(args)


def _post_hook(module: Any, args: Any, output: Any) -> None:
    if torch.is_grad_enabled():
        _hook_grads(output)


class _FloorHooks(Variant):
    """The floor plus the hooks any module tracer with backward spans registers, each
    doing nothing: global forward pre- and post-hooks (so every module call takes
    ``nn.Module``'s hook path) and a gradient hook on the inputs and outputs of each
    call (so autograd calls back into Python around every module's backward). What
    torch's hook machinery costs before a single record is made. With
    ``mode=PassThroughDebugMode``: the least a tracer of module spans with DTensor
    placements can cost."""

    def __init__(self, mode: Callable[[], Any]) -> None:
        self._mode = mode

    def run_block(self, step: StepFn, indices: Sequence[int]) -> None:
        handles = [
            register_module_forward_pre_hook(_pre_hook),
            register_module_forward_hook(_post_hook, always_call=True),
        ]
        try:
            with self._mode():
                for _ in indices:
                    step()
        finally:
            for h in handles:
                h.remove()


class CollectiveKernels:
    """Collectives seen without any dispatch mode: a pass-through Python kernel
    registered (``torch.library``) at the ``AutogradCPU`` key of every collective op
    commspan knows, so only collectives call into Python; every other op of the step
    runs as with no mode. What such a design could save below the floor: ``seen``
    counts the collectives its kernels ran (the DTensor placements a DebugMode
    learns, and ``record_function`` labels, are not available this way)."""

    def __init__(self) -> None:
        self.seen = 0
        self._libs: list[Any] = []

    def __enter__(self) -> CollectiveKernels:
        from commspan.capture.collectives import build_overload_table

        below = torch._C._AutoDispatchBelowAutograd
        libs: dict[str, Any] = {}
        for overload in {id(o): o for o in build_overload_table() if hasattr(o, "_schema")
                         }.values():
            ns = overload.namespace
            if ns.endswith("_autograd"):  # differentiable variants keep their kernels
                continue
            lib = libs.get(ns)
            if lib is None:
                lib = libs[ns] = torch.library.Library(ns, "IMPL")

            def kernel(*args: Any, _op: Any = overload, **kwargs: Any) -> Any:
                self.seen += 1
                with below():
                    return _op(*args, **kwargs)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                lib.impl(overload, kernel, "AutogradCPU")
        self._libs = list(libs.values())
        return self

    def __exit__(self, *_: Any) -> None:
        for lib in self._libs:
            lib._destroy()
        self._libs = []


class PassThroughDebugMode(_DebugModeBase):  # type: ignore[misc,valid-type]
    """The floor of a tracer that learns DTensor placements: a pass-through mode
    that is a ``DebugMode``, so DTensor looks it up on every DTensor op and
    describes every redistribution to it, and it ignores all of that."""

    record_torchfunction = False
    record_nn_module = False
    record_stack_trace = False
    record_output = False

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)  # none of DebugMode's own recording

    def __getattr__(self, name: str) -> Any:
        if name.startswith("record_"):  # flags newer DebugModes probe
            return False
        raise AttributeError(name)

    __torch_dispatch__ = PassThroughMode.__dict__["__torch_dispatch__"]

    def record_redistribute_calls(self, *args: Any, **kwargs: Any) -> Any:
        return contextlib.nullcontext()

    def record_output_placements(self, *args: Any, **kwargs: Any) -> None:
        return None


class _FloorModTracker(Variant):
    """The floor plus torch's ``ModTracker`` (the module tracker CommDebugMode is
    built on), recording nothing of its own."""

    def run_block(self, step: StepFn, indices: Sequence[int]) -> None:
        from torch.distributed._tools.mod_tracker import ModTracker

        with PassThroughMode(), ModTracker():
            for _ in indices:
                step()


class _CommDebug(Variant):
    """torch's CommDebugMode, a fresh context per step (one context cannot span two
    steps in torch 2.13: it raises IndexError)."""

    def __init__(self) -> None:
        from torch.distributed.tensor.debug import CommDebugMode

        self._cls = CommDebugMode
        self.collectives = 0

    def run_block(self, step: StepFn, indices: Sequence[int]) -> None:
        for _ in indices:
            mode = self._cls()
            with mode:
                step()
            self.collectives = mode.get_total_counts()

    def stats(self) -> dict[str, Any]:
        return {"collectives_last_step": self.collectives}


class _CommSpan(Variant):
    """One ``CommSpanMode`` per variant, entered once per block, ``mode.step(i)`` per step."""

    def __init__(self, exporters: list[Any], sample: int | None = None) -> None:
        from commspan import CommSpanMode

        self.mode = CommSpanMode(exporters=exporters, sample=sample)
        self._exporters = exporters

    def run_block(self, step: StepFn, indices: Sequence[int]) -> None:
        mode = self.mode
        with mode:
            for i in indices:
                with mode.step(i):
                    step()

    def stats(self) -> dict[str, Any]:
        s = self.mode.stats()
        return {k: v for k, v in s.items() if isinstance(v, (int, float, str, list))}

    def close(self) -> None:
        self.mode.shutdown()


def available(keys: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The variants this machine can run, and why the others cannot."""
    ok: list[str] = []
    missing: dict[str, str] = {}
    for key in keys:
        if key not in _KNOWN:
            raise ValueError(f"variant {key!r} is not one of {_KNOWN}")
        if key == "cdm":
            try:
                import numpy  # noqa: F401  # CommDebugMode imports it
                from torch.distributed.tensor.debug import CommDebugMode  # noqa: F401
            except Exception as exc:
                missing[key] = f"{type(exc).__name__}: {exc} (pip install numpy)"
                continue
        ok.append(key)
    return ok, missing


def make_variant(
    key: str, *, otlp_endpoint: str | None = None, tmpdir: str | None = None
) -> Variant:
    """Build variant ``key`` (JSONL files go to ``tmpdir``)."""
    if key in ("none", "none_aa"):
        v: Variant = _NoMode()
    elif key == "floor":
        v = _Floor()
    elif key == "floor_dm_hooks":
        v = _FloorHooks(PassThroughDebugMode)
    elif key == "floor_hooks":
        v = _FloorHooks(PassThroughMode)
    elif key == "floor_modtracker":
        v = _FloorModTracker()
    elif key == "kernels_hooks":
        v = _FloorHooks(CollectiveKernels)
    elif key == "cdm":
        v = _CommDebug()
    elif key == "cs_agg":
        v = _CommSpan([])
    elif key in ("cs_jsonl", "cs_sampled_out"):
        from commspan.exporters import JsonlSpanExporter

        out = tmpdir or tempfile.mkdtemp(prefix="commspan-bench-")
        exporter = JsonlSpanExporter(f"{out}/{key}-rank{{rank}}.jsonl")
        v = _CommSpan([exporter], sample=SAMPLED_OUT_N if key == "cs_sampled_out" else None)
    elif key == "cs_otlp":
        if otlp_endpoint is None:
            raise ValueError("variant cs_otlp needs otlp_endpoint")
        from commspan.exporters import otlp_exporter

        v = _CommSpan([otlp_exporter(protocol="http/protobuf", endpoint=otlp_endpoint)])
    else:
        raise ValueError(f"variant {key!r} is not one of {_KNOWN}")
    v.key = key
    return v
