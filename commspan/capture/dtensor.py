"""DTensor helpers: placement strings and a module's parameter summary.

Placements are written the way DTensor prints them: ``S(0)``, ``R``,
``P(sum)``, ``_S(0, 2)`` (a strided shard, as FSDP2 over tensor parallelism makes:
another layout than ``S(0)``); every partial placement, ``_NormPartial`` and
``MaskPartial`` too, is ``P(<reduce op>)``. A multi-dimensional mesh joins them
with commas (``S(0),R``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from commspan import semconv

__all__ = ["DTensor", "param_summary", "placements_str"]

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
