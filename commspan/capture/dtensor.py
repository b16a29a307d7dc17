"""DTensor helpers: placement strings and a module's parameter summary.

Placements are written the way DTensor prints them: ``S(0)``, ``R``,
``P(sum)``, ``_S(0, 2)`` (a strided shard, as FSDP2 over tensor parallelism makes:
another layout than ``S(0)``); every partial placement, ``_NormPartial`` and
``MaskPartial`` too, is ``P(<reduce op>)``. A multi-dimensional mesh joins them
with commas (``S(0),R``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commspan import semconv

__all__ = ["DTensor", "param_summary", "placements_str", "skip_redistribution_text"]

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


_CACHE: dict[Any, str] = {}


def placements_str(placements: Sequence[Any] | None) -> str:
    """``(Shard(dim=0), Replicate())`` -> ``"S(0),R"``."""
    if not placements:
        return ""
    try:
        return _CACHE[placements]
    except (KeyError, TypeError):
        pass
    text = ",".join(_one(p) for p in placements)
    try:
        if len(_CACHE) < 4096:
            _CACHE[placements] = text
    except TypeError:
        pass
    return text


try:
    from torch.distributed.tensor import Partial as _Partial
except Exception:  # pragma: no cover - older torch
    _Partial = None  # type: ignore[assignment,misc]


def _one(p: Any) -> str:
    if _Partial is not None and isinstance(p, _Partial):  # _MaskPartial, _NormPartial too
        return f"P({p.reduce_op})"
    name = type(p).__name__
    if name == "Shard":
        return f"S({p.dim})"
    if name == "_StridedShard":
        return f"_S({p.dim}, {p.split_factor})"
    if name == "Replicate":
        return "R"
    if name in ("Partial", "_Partial", "_NormPartial", "MaskPartial"):
        return f"P({getattr(p, 'reduce_op', 'sum')})"
    return str(p)


def param_summary(
    module: torch.nn.Module,
    on_mesh: Callable[[Any], None] | None = None,
    sharded: Callable[[torch.nn.Module, str], Any] | None = None,
) -> dict[str, Any]:
    """Span attributes describing ``module``'s direct parameters (empty if none).

    ``on_mesh`` is called with the DeviceMesh of each DTensor parameter. ``sharded``
    gives the sharded form of a parameter FSDP2 manages (``None`` for others): FSDP2
    registers the gathered parameter while a unit runs, and a parameter is described
    as it is kept, whether or not its unit has gathered it.
    """
    names: list[str] = []
    placements: list[str] = []
    shapes: list[str] = []
    for name, param in module._parameters.items():
        if param is None:
            continue
        if sharded is not None:
            kept = sharded(module, name)
            if kept is not None:
                param = kept
        names.append(name)
        # a DTensor parameter is itself a DTensor (``param.data`` would detach it
        # through the dispatcher)
        if DTensor is not None and isinstance(param, DTensor):
            spec = getattr(param, "_spec", None)
            if spec is not None:
                placements.append(placements_str(spec.placements))
                mesh = spec.mesh
            else:
                placements.append(placements_str(param.placements))
                mesh = param.device_mesh
            if on_mesh is not None:
                on_mesh(mesh)
        else:
            placements.append("")
        shapes.append("x".join(str(int(s)) for s in param.shape))
    if not names:
        return {}
    # tuples, as the OpenTelemetry SDK stores sequence attributes
    return {
        semconv.PARAM_NAMES: tuple(names),
        semconv.PARAM_PLACEMENTS: tuple(placements),
        semconv.PARAM_SHAPES: tuple(shapes),
    }


# ------------------------------------------------------------------ redistribution text
# DTensor hands the active DebugMode a text of each redistribution's steps, built by
# DTensorRedistributePlanner.stringify_transform_infos before the mode is called
# (torch 2.13, redistribute_local_tensor): about 450 Python bytecodes each, 63 times a
# medium step, 7% of what tracing adds. commspan's dispatch mode is a DebugMode only
# to learn the placements and never reads that text; while one is entered, the
# planner's method is a stand-in that builds the text for every other caller and
# skips it only for redistribute_local_tensor's call on behalf of a mode that says
# it ignores it (docs/performance.md, "The floor").
try:
    from torch.distributed.tensor import _redistribute as _redistribute_mod
    from torch.utils._debug_mode import get_active_debug_mode as _active_debug_mode

    _Planner: Any = _redistribute_mod.DTensorRedistributePlanner
    _TEXT_CALLER: Any = _redistribute_mod.redistribute_local_tensor.__code__
    _TEXT_NAME = "stringify_transform_infos"
    _TORCH_TEXT: Any = _Planner.__dict__[_TEXT_NAME]
    if not isinstance(_TORCH_TEXT, staticmethod):  # (another layout: leave it alone)
        raise TypeError(_TEXT_NAME)
    _TORCH_TEXT = _TORCH_TEXT.__func__
except Exception:  # pragma: no cover - another torch: the text is built as before
    _Planner = None

_text_lock = threading.Lock()
_text_users = 0
_text_original: Any = None  # the planner's attribute the stand-in replaced
_text_call: Any = None
"""What the stand-in hands other calls to: the planner's method as it was when the
stand-in was set (torch's, or another library's wrapper of it)."""
_handing = threading.local()


def _text_unused(*args: Any, **kwargs: Any) -> Any:
    if sys._getframe(1).f_code is _TEXT_CALLER and getattr(
            type(_active_debug_mode()), "ignores_redistribution_text", False) is True:
        return ""
    if getattr(_handing, "on", False):
        # a wrapper set over the stand-in, then kept as what it hands on to, calls it
        # again: torch's own method ends the loop
        return _TORCH_TEXT(*args, **kwargs)
    _handing.on = True
    try:
        return _text_call(*args, **kwargs)
    finally:
        _handing.on = False


_TEXT_STANDIN = staticmethod(_text_unused)


def skip_redistribution_text() -> Callable[[], None]:
    """Stop DTensor from building the text of its redistributions for a DebugMode
    that ignores it (a class attribute ``ignores_redistribution_text = True``), until
    the returned function is called; other DebugModes and direct callers get the text
    as before. Counted: the stand-in stays while any caller has not undone it.

    Example:
        >>> undo = skip_redistribution_text()
        >>> undo()
    """
    global _text_users, _text_original, _text_call
    if _Planner is None:
        return _nothing
    with _text_lock:
        if _text_users == 0:
            current = _Planner.__dict__.get(_TEXT_NAME)
            if current is not _TEXT_STANDIN:
                try:  # (as the class hands it out: a staticmethod's function, ...)
                    call = current.__get__(None, _Planner)
                except Exception:
                    return _nothing  # not a method we can hand calls to: leave it
                _text_original, _text_call = current, call
                setattr(_Planner, _TEXT_NAME, _TEXT_STANDIN)
        _text_users += 1
    done = False

    def undo() -> None:
        nonlocal done
        global _text_users
        with _text_lock:
            if done:
                return
            done = True
            _text_users -= 1
            if _text_users == 0 and _Planner.__dict__.get(_TEXT_NAME) is _TEXT_STANDIN:
                # (replaced again by someone else since: theirs stays)
                setattr(_Planner, _TEXT_NAME, _text_original)

    return undo


def _nothing() -> None:
    return None
