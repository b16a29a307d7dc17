"""Which ops torch 2.13's CommDebugMode counts, the key each is counted under,
and the mappings the compat classes hand out.

torch 2.13 counts the native functional collectives under their legacy
``torch.ops.c10d_functional`` packets (the autograd ``all_to_all_single`` too),
DTensor's ``shard_dim_alltoall`` under its own packet, and fifteen ``c10d`` ops
under their own ``torch.ops.c10d`` packets, apart from the functional ones.
In-place and ``_out`` functional variants, point-to-point ops, ``barrier`` and
``wait_tensor`` are not counted.

The mappings answer lookups the way a ``defaultdict(int)`` does (a missing
key reads 0) without adding the key, and also accept other spellings of an
op: a native packet or any overload reads the count of the key it is counted
under, a canonical name (``"all_reduce"``) the sum over every key of that
kind. A name keyed mapping (module -> ...) answers a name that is not there
with a ``KeyError`` that lists the closest module names that ran.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from commspan.capture.collectives import canonical_name, canonical_names

__all__ = ["ModuleCounts", "NamedDict", "OpCounts", "closest", "counted_ops", "registry"]

# the functional collectives torch counts (native, legacy and their shared key)
_FUNCTIONAL = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
)
# the c10d ops torch counts, each under its own packet
_C10D = (
    "_allgather_base_",
    "_reduce_scatter_base_",
    "allgather_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "allreduce_",
    "allreduce_coalesced_",
    "alltoall_",
    "alltoall_base_",
    "broadcast_",
    "gather_",
    "reduce_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "scatter_",
)

_KEYS: dict[Any, Any] = {}
_REGISTRY: set[Any] = set()


def _packet(namespace: str, name: str) -> Any:
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def _build() -> None:
    try:  # registers the legacy c10d_functional ops and DTensor's ops
        import torch.distributed._functional_collectives  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
    except Exception:  # pragma: no cover - torch built without distributed
        return
    keys: dict[Any, Any] = {}
    registry: set[Any] = set()
    for name in _FUNCTIONAL:
        legacy = _packet("c10d_functional", name)
        native = _packet("_c10d_functional", name)
        for packet in (legacy, native):
            if packet is not None and legacy is not None:
                keys[packet] = legacy
                registry.add(packet)
    autograd = _packet("_c10d_functional_autograd", "all_to_all_single")
    legacy_a2a = _packet("c10d_functional", "all_to_all_single")
    if autograd is not None and legacy_a2a is not None:
        keys[autograd] = legacy_a2a
        registry.add(autograd)
    shard_a2a = _packet("_dtensor", "shard_dim_alltoall")
    if shard_a2a is not None:
        keys[shard_a2a] = shard_a2a
        registry.add(shard_a2a)
    for name in _C10D:
        packet = _packet("c10d", name)
        if packet is not None:
            keys[packet] = packet
    _KEYS.clear()
    _KEYS.update(keys)
    _REGISTRY.clear()
    _REGISTRY.update(registry)


def counted_ops() -> dict[Any, Any]:
    """``{packet: key packet}`` of every op torch 2.13's CommDebugMode counts."""
    if not _KEYS:
        _build()
    return _KEYS


def registry() -> set[Any]:
    """torch's ``comm_registry``: the functional packets (native, legacy, autograd)
    and ``_dtensor.shard_dim_alltoall``; the ``c10d`` ops are counted apart from it."""
    if not _KEYS:
        _build()
    return set(_REGISTRY)


def _key_of(op: Any) -> Any:
    """The key ``op`` (packet or overload) is counted under, or ``None``."""
    packet = getattr(op, "_overloadpacket", op)
    try:
        return counted_ops().get(packet)
    except TypeError:  # unhashable
        return None


class OpCounts(dict):  # type: ignore[type-arg]
    """``{key packet: count}``, read like torch's ``defaultdict(int)``.

    A missing key reads 0 and is not added. ``counts[op]`` also accepts the
    native packet or an overload of a counted op, and a canonical name such
    as ``"all_reduce"`` (the sum over every key of that kind, functional and
    ``c10d`` alike).
    """

    def __missing__(self, key: Any) -> int:
        if isinstance(key, str):
            return sum(
                n for k, n in self.items() if canonical_name(k) == key or str(k) == key
            )
        mapped = _key_of(key)
        if mapped is not None and mapped is not key:
            return int(dict.get(self, mapped, 0))
        return 0

    def __contains__(self, key: object) -> bool:
        try:
            if dict.__contains__(self, key):
                return True
        except TypeError:
            return False
        if isinstance(key, str):
            return any(canonical_name(k) == key or str(k) == key for k in self)
        mapped = _key_of(key)
        return mapped is not None and dict.__contains__(self, mapped)

    def get(self, key: Any, default: Any = None) -> Any:
        """``self[key]`` if ``key`` (in any spelling) is present, else ``default``."""
        return self[key] if key in self else default


class ModuleCounts(dict):  # type: ignore[type-arg]
    """One module's counts: ``{"forward": OpCounts, "backward": OpCounts}``.

    Iterating it yields the two phases, as torch's does. ``[op]`` (any
    spelling, not a phase name) reads the sum over both phases.
    """

    def __init__(self) -> None:
        super().__init__(forward=OpCounts(), backward=OpCounts())

    def __missing__(self, key: Any) -> int:
        if isinstance(key, str) and key not in _op_names() and canonical_name(key) is None:
            # a misspelt phase ("forwards") must not read as an op with no count
            raise KeyError(f"{key!r} is neither a phase nor a collective: the phases are "
                           "'forward' and 'backward' (an op name, e.g. 'all_reduce', sums "
                           "both)")
        return int(self["forward"][key]) + int(self["backward"][key])

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self["forward"] or key in self["backward"]


_OP_NAMES: frozenset[str] | None = None


def _op_names() -> frozenset[str]:
    global _OP_NAMES
    if _OP_NAMES is None:
        _OP_NAMES = frozenset(canonical_names())
    return _OP_NAMES


def closest(name: str, names: Iterable[str]) -> list[str]:
    """Up to three of ``names`` near ``name``: same trailing parts first, then by spelling."""
    pool = list(dict.fromkeys(names))
    suffix = [n for n in pool if n.endswith("." + name)]
    by_lower: dict[str, str] = {}
    for n in pool:
        by_lower.setdefault(n.lower(), n)
    spelled = [by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=3)]
    return list(dict.fromkeys(suffix + spelled))[:3]


class NamedDict(dict):  # type: ignore[type-arg]
    """A dict keyed by module name whose missing keys raise a helpful ``KeyError``.

    Args:
        what: how the message calls the mapping, e.g. ``"comm_module_counts"``.
        known: returns the names of the modules that ran.
        absent_means: why a module that ran may have no entry.
    """

    def __init__(
        self,
        what: str = "",
        known: Callable[[], Iterable[str]] | None = None,
        absent_means: str = "",
    ) -> None:
        super().__init__()
        self._what = what
        self._known = known
        self._absent_means = absent_means

    def __missing__(self, key: Any) -> Any:
        ran = list(self._known()) if self._known is not None else []
        where = f" of {self._what}" if self._what else ""
        if isinstance(key, str) and key in ran:
            message = f"{key!r} is not a key{where}: {self._absent_means}"
        elif isinstance(key, str):
            close = closest(key, [*self, *ran])
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            shown = ", ".join(ran[:20]) or "none"
            if len(ran) > 20:
                shown += f", ... ({len(ran) - 20} more)"
            message = f"no module named {key!r} ran{hint} (modules that ran: {shown})"
        else:
            message = f"{key!r} is not a key{where}; keys are module names (str)"
        raise KeyError(message)

    def __reduce__(self) -> Any:  # copies and pickles as a plain dict
        return (dict, (dict(self),))
