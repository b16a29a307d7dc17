"""torch 2.13's CommDebugMode reports, from the data the compat class records.

Pure functions: the text table (``generate_comm_debug_tracing_table``) and the
JSON tree (``generate_json_dump``) at noise levels 0-3.

What each level shows:

* 0: modules and their collectives per phase;
* 1: also each module's type and DTensor parameters, and the ops it ran on
  DTensors, except trivial ones (detach, t, view, _to_copy, as_strided,
  transpose);
* 2: also the non-trivial ops on plain tensors;
* 3: every op.

An op is listed under the module that was current when it ran (not under
its ancestors); collectives count for the module and every ancestor.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TRIVIAL_OPS", "json_tree", "noise_level", "table"]

TRIVIAL_OPS = frozenset({
    "aten.detach.default",
    "aten.t.default",
    "aten.view.default",
    "aten._to_copy.default",
    "aten.as_strided.default",
    "aten.transpose.int",
})
"""Ops listed only at noise level 3."""

_YELLOW = "\033[1;33m"
_RED = "\033[1;31m"
_RESET = "\033[0m"

Record = Mapping[str, Any]


_LEVELS = (
    "0 (collectives), 1 (+ module types, parameters, DTensor ops), 2 (+ other ops), "
    "3 (+ trivial ops)"
)


def noise_level(value: Any) -> int:
    """``value`` as a level 0-3, by torch's comparisons (``> 0``, ``> 1``, ``> 2``):
    below 0 acts as 0, above 3 as 3, and a fraction as the level above it (0.5 as
    1, 1.5 as 2, 2.5 as 3). Any real number torch compares so is taken (an int, a
    float, a NumPy number, ``True``).

    Raises:
        TypeError: ``value`` is not a number (a string, ``None``, a complex).
        ValueError: ``value`` is NaN (torch reads it as 0, every comparison false).
    """
    try:
        level = 3 if value > 2 else 2 if value > 1 else 1 if value > 0 else 0
        unordered = level == 0 and not value <= 0
    except (TypeError, ValueError, RuntimeError):  # (an array or tensor of many: ambiguous)
        raise TypeError(
            f"noise_level={value!r} is not valid; pass a number: {_LEVELS}"
        ) from None
    if unordered:
        raise ValueError(
            f"noise_level={value!r} is not valid: NaN is neither above nor at or below 0 "
            f"(torch takes it as 0); pass a number: {_LEVELS}"
        )
    return level


def _shown(op: Record, level: int) -> bool:
    """Whether the op is listed at ``level`` (>= 1)."""
    if level >= 3:
        return True
    if str(op["name"]) in TRIVIAL_OPS:
        return False
    return level >= 2 or bool(op["input_shape"])


def _phases(ops: Sequence[Record]) -> tuple[list[Record], list[Record], list[Record]]:
    """(forward, backward, recompute) ops: recompute ops are not backward ops."""
    forward = [op for op in ops if not op["is_bw"]]
    backward = [op for op in ops if op["is_bw"] and not op["is_activation_checkpointing"]]
    recompute = [op for op in ops if op["is_activation_checkpointing"]]
    return forward, backward, recompute


def _ops_of(op_counts: Mapping[str, Any], fqn: str, level: int) -> tuple[list[Record], ...]:
    if level < 1 or fqn not in op_counts:
        return [], [], []
    return _phases(op_counts[fqn]["operations_list"])


def _collectives(counts: Mapping[str, Any], fqn: str) -> tuple[Mapping[Any, int], ...]:
    if fqn not in counts:
        return {}, {}
    entry = counts[fqn]
    return entry["forward"], entry["backward"]


def _section(
    lines: list[str],
    title: str,
    collectives: Mapping[Any, int],
    ops: list[Record],
    depth: int,
    level: int,
) -> None:
    """A phase header, its collectives, then the ops the level lists (with DTensor details)."""
    item_pad = " " * (4 * depth + 4)
    detail_pad = " " * (4 * depth + 6)
    lines.append(" " * (4 * depth + 2) + title)
    for op, n in collectives.items():
        lines.append(f"{_YELLOW}{item_pad}*{op}: {n}{_RESET}")
    for op in ops:
        if not _shown(op, level):
            continue
        lines.append(f"{_YELLOW}{item_pad}**{op['name']}{_RESET}")
        if op["input_shape"]:
            lines.append(f"{_RED}{detail_pad}shape: {op['input_shape']}{_RESET}")
            lines.append(f"{_RED}{detail_pad}sharding: {op['input_sharding']}{_RESET}")
            lines.append(f"{_RED}{detail_pad}device mesh: {op['device_mesh']}{_RESET}")


def table(
    helper: Mapping[str, Mapping[str, Any]],
    counts: Mapping[str, Any],
    op_counts: Mapping[str, Any],
    level: int,
) -> str:
    """The module table, one module after another in first-call order.

    Args:
        helper: ``module_helper_dict`` (depth, type, DTensor parameters).
        counts: ``comm_module_counts``.
        op_counts: ``comm_module_operation_counts``.
        level: noise level 0-3.

    Returns:
        The text, every line ending in a newline; collectives and ops are
        coloured with ANSI escapes.
    """
    lines: list[str] = []
    for fqn, info in helper.items():
        depth = int(info["depth"])
        pad = " " * (4 * depth)
        lines.append(f"{pad}{fqn}")
        if level >= 1:
            if "module_type" in info:
                lines.append(f"{pad}*module type: {info['module_type']}")
            if "parameters" in info:
                lines.append(f"{pad}*Parameter List")
                lines.extend(f"{pad} *{p}: {where}" for p, where in info["parameters"].items())
        fw_coll, bw_coll = _collectives(counts, fqn)
        fw_ops, bw_ops, re_ops = _ops_of(op_counts, fqn, level)
        # a phase gets its header when anything was recorded in it, even ops
        # the level does not list
        if fw_coll or fw_ops:
            _section(lines, "FORWARD PASS", fw_coll, fw_ops, depth, level)
        if bw_coll or bw_ops:
            _section(lines, "BACKWARD PASS", bw_coll, bw_ops, depth, level)
        if re_ops:
            _section(lines, "ACTIVATION CHECKPOINTING", {}, re_ops, depth, level)
    return "".join(line + "\n" for line in lines)


def _copied_str(value: Any) -> str:
    """``str`` of a copy of ``value``, as torch writes the JSON dump (it deep-copies the
    op records first: a copy of ``_NormPartial(2.0)`` prints ``_NormPartial(2)``)."""
    try:
        return str(copy.deepcopy(value))
    except Exception:  # not copyable: as it is
        return str(value)


def _op_json(op: Record) -> dict[str, Any]:
    return {
        "name": str(op["name"]),
        "input_shape": [str(s) for s in op["input_shape"]],
        "input_sharding": [_copied_str(p) for p in op["input_sharding"]],
        "device_mesh": op["device_mesh"],
        "is_bw": op["is_bw"],
        "is_activation_checkpointing": op["is_activation_checkpointing"],
    }


def json_tree(
    helper: Mapping[str, Mapping[str, Any]],
    parent_dict: Mapping[str, Sequence[str]],
    counts: Mapping[str, Any],
    op_counts: Mapping[str, Any],
    level: int,
) -> dict[str, Any]:
    """The tree torch's browser visualizer reads, rooted at ``Global``.

    Each node has ``fqn``, ``module_type``, ``parameters``, ``children``,
    ``collectives_forward``, ``collectives_backward``, ``operations_forward``,
    ``operations_backward`` and ``operations_checkpointing``, at every level.
    Children follow the calls (``parent_dict``): a module called from two
    modules is a child of both.
    """

    def node(fqn: str, path: frozenset[str]) -> dict[str, Any]:
        info = helper.get(fqn, {})
        out: dict[str, Any] = {"fqn": fqn, "module_type": "", "parameters": [], "children": []}
        if level >= 1 and "module_type" in info:
            out["module_type"] = info["module_type"]
            out["parameters"] = [[p, where] for p, where in info.get("parameters", {}).items()]
        fw_coll, bw_coll = _collectives(counts, fqn)
        out["collectives_forward"] = [[str(op), n] for op, n in fw_coll.items()]
        out["collectives_backward"] = [[str(op), n] for op, n in bw_coll.items()]
        fw_ops, bw_ops, re_ops = _ops_of(op_counts, fqn, level)
        out["operations_forward"] = [_op_json(op) for op in fw_ops if _shown(op, level)]
        out["operations_backward"] = [_op_json(op) for op in bw_ops if _shown(op, level)]
        out["operations_checkpointing"] = [_op_json(op) for op in re_ops if _shown(op, level)]
        inner = path | {fqn}
        out["children"] = [
            node(child, inner) for child in parent_dict.get(fqn, ()) if child not in inner
        ]
        return out

    return node("Global", frozenset())
