"""The module tree: modules nested by name, with their counts and parameters.

Built with loops, not recursion: a tree is as deep as the model
(docs/design.md, "Deep models").

Example:
    >>> tree = module_tree({"Global": {"forward": {"all_reduce": 2}}}, {})
    >>> tree["fqn"], tree["counts"], tree["children"]
    ('Global', {'forward': {'all_reduce': 2}}, [])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from commspan import semconv

__all__ = ["Counts", "ModuleRecord", "PHASE_ORDER", "module_tree", "parent_fqn"]

Counts = dict[str, dict[str, dict[str, int]]]
"""``{module fqn: {phase: {op: count}}}``."""

PHASE_ORDER = [p.value for p in semconv.Phase]
"""Phases in the order tables list them."""


class ModuleRecord:
    """What the spans said of one module: its type, depth, when it first ran,
    and its parameters (``{name: (shape, placements)}``)."""

    __slots__ = ("fqn", "type", "depth", "first_seen", "params")

    def __init__(self, fqn: str, mtype: str, depth: int, first_seen: int) -> None:
        self.fqn = fqn
        self.type = mtype
        self.depth = depth
        self.first_seen = first_seen
        self.params: dict[str, tuple[str, str]] = {}


def parent_fqn(fqn: str, known: Mapping[str, Any]) -> str:
    """The nearest enclosing module of ``fqn`` in ``known`` (by name), else ``Global``."""
    head = fqn
    while "." in head:
        head = head.rsplit(".", 1)[0]
        if head in known:
            return head
    return semconv.GLOBAL_FQN


def module_tree(counts: Counts, modules: Mapping[str, ModuleRecord]) -> dict[str, Any]:
    """The tree rooted at ``Global``, children in the order they first ran.

    Each node: ``{"fqn", "type", "counts": {phase: {op: n}}, "parameters",
    "children": [...]}``.
    """

    def node(fqn: str, mtype: str, params: dict[str, tuple[str, str]]) -> dict[str, Any]:
        ph = counts.get(fqn, {})
        return {
            "fqn": fqn,
            "type": mtype,
            "counts": {p: dict(sorted(ph[p].items())) for p in PHASE_ORDER if ph.get(p)},
            "parameters": {n: {"shape": s, "placements": pl} for n, (s, pl) in params.items()},
            "children": [],
        }

    root = node(semconv.GLOBAL_FQN, "", {})
    nodes: dict[str, dict[str, Any]] = {semconv.GLOBAL_FQN: root}
    ordered = sorted(modules.values(), key=lambda m: m.first_seen)
    for m in ordered:
        nodes[m.fqn] = node(m.fqn, m.type, m.params)
    for m in ordered:
        nodes[parent_fqn(m.fqn, nodes)]["children"].append(nodes[m.fqn])
    return root
