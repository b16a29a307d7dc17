"""The one table that says what a collective is, and what its arguments mean.

Every op overload of the packets below is a collective (or a point-to-point
op) for commspan; everything else, ``wait_tensor`` included, is not. Native
functional collectives (``_c10d_functional``), the legacy Python ones
(``c10d_functional``), their autograd variants and the ``c10d`` ops all map to
one canonical name, e.g. ``all_reduce``.

Example:
    >>> import torch
    >>> from commspan.capture.collectives import canonical_name
    >>> canonical_name(torch.ops._c10d_functional.all_reduce.default)
    'all_reduce'
    >>> canonical_name(torch.ops.c10d_functional.all_reduce)
    'all_reduce'
    >>> canonical_name(torch.ops.aten.mm.default) is None
    True
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from commspan import semconv

__all__ = [
    "CollectiveInfo",
    "build_overload_table",
    "label_overloads",
    "canonical_name",
    "canonical_names",
    "collective_packets",
    "wait_overloads",
]

_log = logging.getLogger(__name__)

# (namespace, packet name) -> (canonical name, kind)
_TABLE: dict[tuple[str, str], tuple[str, str]] = {}


def _add(ns: str, names: dict[str, str], kind: str = semconv.KIND_COLLECTIVE) -> None:
    for packet, canonical in names.items():
        _TABLE[(ns, packet)] = (canonical, kind)


_FUNCOL = {
    "all_gather_into_tensor": "all_gather_into_tensor",
    "all_gather_into_tensor_out": "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_reduce_coalesced_": "all_reduce_coalesced",
    "all_to_all_single": "all_to_all_single",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_out": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
}
_FUNCOL_P2P = {"isend": "send", "irecv": "recv", "batch_p2p_ops": "batch_p2p"}
_add("_c10d_functional", _FUNCOL)
_add("_c10d_functional", _FUNCOL_P2P, semconv.KIND_P2P)
_add("c10d_functional", _FUNCOL)
_add("c10d_functional", _FUNCOL_P2P, semconv.KIND_P2P)
_add(
    "_c10d_functional_autograd",
    {
        "all_gather_into_tensor": "all_gather_into_tensor",
        "all_to_all_single": "all_to_all_single",
        "reduce_scatter_tensor": "reduce_scatter_tensor",
    },
)
_add(
    "c10d",
    {
        "_allgather_base_": "all_gather_into_tensor",
        "_reduce_scatter_base_": "reduce_scatter_tensor",
        "allgather_": "all_gather",
        "allgather_coalesced_": "all_gather_coalesced",
        "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
        "allreduce_": "all_reduce",
        "allreduce_coalesced_": "all_reduce_coalesced",
        "alltoall_": "all_to_all",
        "alltoall_base_": "all_to_all_single",
        "broadcast_": "broadcast",
        "gather_": "gather",
        "scatter_": "scatter",
        "reduce_": "reduce",
        "reduce_scatter_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    },
)
_add("c10d", {"send": "send", "recv_": "recv", "recv_any_source_": "recv"}, semconv.KIND_P2P)
# barriers move no data of the caller's (the tensor they take is a placeholder): no bytes
_BARRIERS = {"barrier": "barrier", "monitored_barrier_": "monitored_barrier"}
_add("c10d", _BARRIERS)
_add("_dtensor", {"shard_dim_alltoall": "shard_dim_alltoall"})

_BARRIER_NAMES = frozenset(_BARRIERS.values())

# Schema argument names, in order of preference, for each role.
_INPUT_ARGS = ("input_tensors", "input_tensor", "inputs", "input", "input_list", "shard",
               "self", "tensors", "tensor")
_GROUP_ARGS = ("group_name", "process_group")
_REDUCE_ARGS = ("reduce_op", "reduceOp")
_PEER_ARGS = ("dst", "src", "peer_list")
_ROOT_ARGS = ("root_rank", "src")  # (a rank of the op's group, in every schema)
_RANKS_ARGS = ("ranks",)
_ASYNC_ARGS = ("async_op",)
_SPLIT_IN_ARGS = ("input_split_sizes",)
_SPLIT_OUT_ARGS = ("output_split_sizes",)
_FUNCTIONAL_NAMESPACES = ("_c10d_functional.", "c10d_functional.", "_c10d_functional_autograd.")


@dataclass(frozen=True)
class CollectiveInfo:
    """What commspan knows about one collective op overload.

    Attributes:
        name: canonical op name, e.g. ``all_reduce``.
        kind: ``collective`` or ``p2p``.
        overload: full overload name, e.g. ``_c10d_functional.all_reduce.default``.
        packet: the overload's packet (e.g. ``torch.ops._c10d_functional.all_reduce``).
        input_index / group_index / reduce_index / peer_index / ranks_index:
            positions of those arguments in the op schema (``-1`` when absent).
        arg_names: schema argument names, to find arguments passed by keyword.
        peer_is_group_rank: the peer argument is a rank within the op's group
            (``c10d`` ops) rather than a global rank (functional ``isend``/``irecv``).
        functional: a functional collective: it returns its output tensors, and
            ``wait_tensor`` on them is its completion.
        async_index: position of the ``async_op`` argument of a ``c10d`` op
            (``-1`` when absent): ``False`` means the caller waits right away.
        split_in_index / split_out_index: positions of the input and output
            split sizes of an ``all_to_all_single`` (``-1`` when absent).
        tag_index: position of a point-to-point op's ``tag`` (``-1`` when absent).
        root_index: position of the root (a rank of the group) of a collective that
            has one: ``broadcast``, ``gather``, ``scatter``, ``reduce`` (``-1`` otherwise).
        script_indices: positions of the arguments whose schema type is a TorchBind
            class (``c10d`` ops' process group and reduce op), or holds one.
    """

    name: str
    kind: str
    overload: str
    packet: Any
    input_index: int
    group_index: int
    reduce_index: int
    peer_index: int
    ranks_index: int
    arg_names: tuple[str, ...]
    peer_is_group_rank: bool = False
    functional: bool = False
    async_index: int = -1
    split_in_index: int = -1
    split_out_index: int = -1
    tag_index: int = -1
    script_indices: tuple[int, ...] = ()
    root_index: int = -1


def canonical_names() -> list[str]:
    """Every canonical op name commspan can emit, sorted (independent of the torch build)."""
    return sorted({canonical for canonical, _ in _TABLE.values()})


def _packet(ns: str, name: str) -> Any:
    try:
        return getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return None


def collective_packets() -> Iterator[tuple[Any, str, str]]:
    """Yield ``(packet, canonical name, kind)`` for every packet this torch build has."""
    _load_op_libraries()
    for (ns, name), (canonical, kind) in _TABLE.items():
        packet = _packet(ns, name)
        if packet is not None:
            yield packet, canonical, kind


def _index(names: tuple[str, ...], wanted: tuple[str, ...]) -> int:
    for w in wanted:
        if w in names:
            return names.index(w)
    return -1


def _described(canonical: str, names: tuple[str, ...]) -> int:
    """Position of the argument whose tensors an event describes: the inputs, but for
    ``scatter`` the output (only its source has inputs: every rank then describes its
    share, as for ``gather``), and nothing for barriers."""
    if canonical in _BARRIER_NAMES:
        return -1
    if canonical == "scatter":
        return _index(names, ("output_tensors",))
    return _index(names, _INPUT_ARGS)


def _info(overload: Any, canonical: str, kind: str) -> CollectiveInfo:
    names = tuple(a.name for a in overload._schema.arguments)
    peer = _index(names, _PEER_ARGS) if kind == semconv.KIND_P2P else -1
    return CollectiveInfo(
        name=canonical,
        kind=kind,
        overload=str(overload),
        packet=overload.overloadpacket,
        input_index=_described(canonical, names),
        group_index=_index(names, _GROUP_ARGS),
        reduce_index=_index(names, _REDUCE_ARGS),
        peer_index=peer,
        ranks_index=_index(names, _RANKS_ARGS),
        arg_names=names,
        peer_is_group_rank=str(overload).startswith("c10d."),
        functional=str(overload).startswith(_FUNCTIONAL_NAMESPACES),
        async_index=_index(names, _ASYNC_ARGS),
        split_in_index=_index(names, _SPLIT_IN_ARGS),
        split_out_index=_index(names, _SPLIT_OUT_ARGS),
        tag_index=_index(names, ("tag",)) if kind == semconv.KIND_P2P else -1,
        root_index=_index(names, _ROOT_ARGS) if canonical in semconv.ROOTED_OPS else -1,
        script_indices=tuple(i for i, a in enumerate(overload._schema.arguments)
                             if "__torch__.torch.classes." in str(a.type)),
    )


_OVERLOADS: dict[Any, CollectiveInfo] | None = None


def build_overload_table() -> dict[Any, CollectiveInfo]:
    """Map every collective ``OpOverload`` (and its packet) to its :class:`CollectiveInfo`.

    Built once per process (a copy is returned); the dispatch hot path is a
    single dict lookup in it.
    """
    global _OVERLOADS
    if _OVERLOADS is None:
        _OVERLOADS = _build_overload_table()
    return dict(_OVERLOADS)


def _build_overload_table() -> dict[Any, CollectiveInfo]:
    table: dict[Any, CollectiveInfo] = {}
    for packet, canonical, kind in collective_packets():
        first: CollectiveInfo | None = None
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            info = _info(overload, canonical, kind)
            table[overload] = info
            first = first or info
        if first is not None:
            table[packet] = first
    return table


def wait_overloads() -> list[Any]:
    """The ``wait_tensor`` overloads (and packets) of this torch build: the completion
    of a functional collective, not a collective."""
    _load_op_libraries()
    out: list[Any] = []
    for ns in ("_c10d_functional", "c10d_functional"):
        packet = _packet(ns, "wait_tensor")
        if packet is None:
            continue
        out.append(packet)
        out.extend(getattr(packet, name) for name in packet.overloads())
    return out


def label_overloads() -> tuple[list[Any], list[Any]]:
    """``(enter overloads, exit overloads)`` of ``torch.profiler.record_function``.

    With a dispatch mode active, entering ``record_function(name)`` reaches the
    mode as ``profiler._record_function_enter_new(name, args)`` (it returns the
    handle) and leaving it as ``profiler._record_function_exit(handle)``,
    whether a profiler runs or not. Frameworks label their communication this
    way (FSDP2's ``FSDP::all_gather (<unit>)``); the dispatch mode puts these
    overloads in its op table next to the collectives, so telling them apart
    from every other op stays one dict lookup.
    """
    enter: list[Any] = []
    leave: list[Any] = []
    for name, into in (
        ("_record_function_enter_new", enter),
        ("_record_function_enter", enter),  # legacy: a Tensor handle
        ("_record_function_exit", leave),
    ):
        packet = _packet("profiler", name)
        if packet is None:
            continue
        for overload_name in packet.overloads():
            into.append(getattr(packet, overload_name))
    return enter, leave


_CANONICAL: dict[Any, str] | None = None


def canonical_name(op: Any) -> str | None:
    """Canonical collective name of an op overload or packet, or ``None`` if not one.

    Also accepts a canonical name, or the name of a packet or overload as a string
    (``"_c10d_functional.all_reduce.default"``, ``"torch.ops.c10d.allreduce_"``): a
    name in commspan's table resolves whether the installed torch has that op or not
    (ops come and go between torch versions; a name written on one must mean the same
    on another).

    Example:
        >>> canonical_name("c10d_functional.all_reduce_.default")  # (not in torch 2.13)
        'all_reduce'
    """
    global _CANONICAL
    if _CANONICAL is None:
        names: dict[Any, str] = {}
        for key, info in build_overload_table().items():
            names[key] = info.name
            names[info.overload] = info.name
            names[info.overload.rsplit(".", 1)[0]] = info.name
            names[info.name] = info.name
        _CANONICAL = names
    try:
        found = _CANONICAL.get(op)
    except TypeError:
        return None
    if found is None and isinstance(op, str):
        return _named(op)
    return found


def _named(text: str) -> str | None:
    """The canonical name of an op named ``ns.name`` or ``ns.name.overload`` (after an
    optional ``torch.ops.``) in the table, whatever torch is installed."""
    parts = text.removeprefix("torch.ops.").split(".")
    if len(parts) not in (2, 3):
        return None
    hit = _TABLE.get((parts[0], parts[1]))
    return hit[0] if hit is not None else None


_LOADED = False


def _load_op_libraries() -> None:
    """Import the Python modules that register the functional collective ops."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for mod in (
        "torch.distributed._functional_collectives",
        "torch.distributed._functional_collectives_impl",
        "torch.distributed.tensor",
    ):
        try:
            __import__(mod)
        except Exception as exc:  # pragma: no cover - depends on the torch build
            _log.debug("commspan: could not import %s: %s", mod, exc)
