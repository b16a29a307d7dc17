"""Text views of counts: the module table, the run summary, the tree as JSON.

Pure functions over the data the analyses return (a module tree from
:meth:`commspan.Aggregator.to_dict`, a summary from
:func:`commspan.analysis.summary.summarize`); each returns text.

Example:
    >>> tree = {"fqn": "Global", "type": "", "counts": {"forward": {"all_reduce": 1}},
    ...         "parameters": {}, "children": []}
    >>> print(module_table(tree, 0), end="")
    Global
      *forward: all_reduce 1
    >>> span_list([0, 1, 2, 3, 7])
    '0-3,7'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from commspan.analysis.runs import format_numbers

__all__ = [
    "human_bytes", "mesh_dim_table", "module_table", "plan_table", "span_list", "summary_table",
    "tree_json",
]


def module_table(
    root: dict[str, Any],
    noise_level: int = 0,
    notes: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The lines of ``root``'s tree, indented by depth, with counts per phase.

    A loop, not recursion: trees can be as deep as the model.

    Args:
        root: a module tree (:meth:`commspan.Aggregator.to_dict`).
        noise_level: ``0`` modules and counts; ``1`` adds module types and
            parameter shapes and placements.
        notes: more lines to show under some modules, by module name (e.g. what
            each issued, from :func:`commspan.render.details.issued_notes`).
    """
    lines: list[str] = []
    todo: list[tuple[dict[str, Any], int]] = [(root, 0)]
    while todo:
        node, depth = todo.pop()
        pad = "  " * depth
        title = node["fqn"]
        if noise_level >= 1 and node["type"]:
            title += f" ({node['type']})"
        lines.append(pad + title)
        if noise_level >= 1:
            for name, p in node["parameters"].items():
                where = p["placements"] or "local"
                lines.append(f"{pad}  - {name}: {p['shape']} {where}")
        for phase, ops in node["counts"].items():
            ops_text = ", ".join(f"{op} {n}" for op, n in ops.items())
            lines.append(f"{pad}  *{phase}: {ops_text}")
        if notes:
            lines.extend(f"{pad}  {note}" for note in notes.get(node["fqn"], ()))
        todo.extend((child, depth + 1) for child in reversed(node["children"]))
    return "\n".join(lines) + "\n"


def tree_json(tree: Any, indent: int = 2) -> str:
    """``json.dumps(tree, indent=indent)`` for a tree of any depth.

    The standard encoder recurses per level of nesting (two per level of a
    module tree), so the tree of a model a few hundred modules deep exceeds
    the recursion limit; this writes the same text with a loop.
    """
    out: list[str] = []
    # work items: a value to encode at a nesting level, or literal text
    todo: list[tuple[Any, int] | str] = [(tree, 0)]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        value, level = item
        if isinstance(value, dict) and value:
            inner = "\n" + " " * (indent * (level + 1))
            parts: list[tuple[Any, int] | str] = ["{"]
            for i, (key, child) in enumerate(value.items()):
                parts.append(("," if i else "") + inner + json.dumps(str(key)) + ": ")
                parts.append((child, level + 1))
            parts.append("\n" + " " * (indent * level) + "}")
            todo.extend(reversed(parts))
        elif isinstance(value, (list, tuple)) and value:
            inner = "\n" + " " * (indent * (level + 1))
            parts = ["["]
            for i, child in enumerate(value):
                parts.append(("," if i else "") + inner)
                parts.append((child, level + 1))
            parts.append("\n" + " " * (indent * level) + "]")
            todo.extend(reversed(parts))
        else:
            out.append(json.dumps(value))
    return "".join(out)


def summary_table(summary: dict[str, Any]) -> str:
    """The text of a run summary: one header line, then one row per phase and op.

    Args:
        summary: :func:`commspan.analysis.summary.summarize`'s result.
    """
    ranks = span_list(summary["ranks"])
    world = summary.get("world_size")
    if world and len(summary["ranks"]) != world:  # (a rank sample, a rank lost)
        ranks += f" of {world}"
    if summary.get("rank_sample"):
        from commspan.analysis.records import sample_rule

        ranks += f" (traced: {sample_rule(summary['rank_sample'])})"
    lines = [
        (f"spans: {summary['spans']}   traces: {summary['traces']}   "
         f"ranks: {ranks}   steps: {span_list(summary['steps'])}"),
    ]
    rows = [(ph, op, n) for ph, ops in summary["collectives"].items() for op, n in ops.items()]
    width = max([len("backward")] + [len(op) for _, op, _ in rows])
    lines.append(f"{'phase':<10}{'op':<{width + 2}}{'count':>7}")
    lines.extend(f"{ph:<10}{op:<{width + 2}}{n:>7}" for ph, op, n in rows)
    lines.append(f"{'total':<10}{'':<{width + 2}}{summary['total']:>7}")
    return "\n".join(lines)


def span_list(values: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"``; ``"-"`` when empty."""
    return format_numbers(values)


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: bytes in binary units, one decimal.

    Example:
        >>> human_bytes(512), human_bytes(3 * 1024 ** 3)
        ('512 B', '3.0 GiB')
    """
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def plan_table(plan: Mapping[str, Any]) -> str:
    """One rank's step per mesh dimension, then per module
    (:meth:`commspan.session.plan.StepPlan.to_dict`): counts and input bytes.

    Example:
        >>> print(plan_table({"world_size": 4, "rank": 0, "seconds": 0.1,
        ...     "totals": {"tp": {"all_reduce": {"count": 2, "bytes": 2048}}},
        ...     "modules": [{"fqn": "Net.l1",
        ...                  "mesh_dims": {"tp": {"all_reduce": {"count": 2, "bytes": 2048}}}}]}))
        rank 0 of 4, one step (0.1 s)
        mesh dim  op          count    bytes
        tp        all_reduce      2  2.0 KiB
        <BLANKLINE>
        module  mesh dim  op          count    bytes
        Net.l1  tp        all_reduce      2  2.0 KiB
    """
    head = f"rank {plan['rank']} of {plan['world_size']}, one step ({plan['seconds']} s)"
    return head + "\n" + mesh_dim_table(plan["totals"], plan["modules"])


def mesh_dim_table(totals: Mapping[str, Any], modules: Sequence[Mapping[str, Any]]) -> str:
    """Collectives per mesh dimension, then per module and mesh dimension: each
    op's count and input bytes.

    Args:
        totals: ``{mesh dim: {op: {"count", "bytes"}}}`` over the whole rank.
        modules: ``[{"fqn", "mesh_dims": {mesh dim: {op: {"count", "bytes"}}}}]``, in
            the order to show (:meth:`commspan.Aggregator.mesh_dim_counts` per owner).

    Example:
        >>> print(mesh_dim_table({"dp": {"all_gather": {"count": 1, "bytes": 64}}}, []))
        mesh dim  op          count  bytes
        dp        all_gather      1   64 B
        <BLANKLINE>
        module  mesh dim  op  count  bytes
    """
    rows = [(dim, op, v["count"], v["bytes"])
            for dim, ops in sorted(totals.items()) for op, v in sorted(ops.items())]
    per_module = [(m["fqn"], dim, op, v["count"], v["bytes"])
                  for m in modules for dim, ops in sorted(m["mesh_dims"].items())
                  for op, v in sorted(ops.items())]
    if not rows:
        return "no collectives"
    return "\n".join([*_columns(["mesh dim", "op", "count", "bytes"], rows), "",
                      *_columns(["module", "mesh dim", "op", "count", "bytes"], per_module)])


def _columns(names: list[str], rows: Sequence[tuple[Any, ...]]) -> list[str]:
    """Text columns: the last two (count, bytes) right-aligned, bytes in binary units."""
    cells = [[str(c) for c in row[:-1]] + [human_bytes(row[-1])] for row in rows]
    widths = [max([len(names[i]), *(len(r[i]) for r in cells)]) for i in range(len(names))]
    right = {len(names) - 2, len(names) - 1}

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return [fmt(names), *(fmt(r) for r in cells)]
