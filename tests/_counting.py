"""The two counting front ends of the tests ported from torch's CommDebugMode tests.

The ported reference tests run once through ``commspan.compat.CommDebugMode``
(the reference API, keyed by legacy ``torch.ops.c10d_functional`` packets) and
once through the native API (``CommSpanMode`` + its ``Aggregator``, keyed by
canonical names). :class:`CompatCounts` and :class:`NativeCounts` put both
behind one small interface so each test body is written once. The models
they run are in :mod:`commspan.testing.models`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
from typing_extensions import Self

from commspan import CommSpanMode
from commspan.compat import CommDebugMode

__all__ = ["API_NAMES", "CompatCounts", "NativeCounts", "make_counter"]

API_NAMES = ("compat", "native")
"""The two ways the ported tests read counts: ``commspan.compat`` and the native API."""


class _Counter:
    """Enters and leaves the context manager it reads counts from."""

    _context: Any

    def __enter__(self) -> Self:
        self._context.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._context.__exit__(exc_type, exc, tb)


class CompatCounts(_Counter):
    """Reads counts through ``commspan.compat.CommDebugMode``, the reference way.

    Ops are looked up by the legacy ``torch.ops.c10d_functional`` packet, as the
    reference tests do.
    """

    api = "compat"

    def __init__(self) -> None:
        self.comm_mode = self._context = CommDebugMode()

    @staticmethod
    def _packet(op: str) -> Any:
        return getattr(torch.ops.c10d_functional, op)

    def total(self) -> int:
        """All collectives seen in the context."""
        return self.comm_mode.get_total_counts()

    def count(self, op: str) -> int:
        """Collectives of canonical kind ``op`` seen in the context."""
        return self.comm_mode.get_comm_counts()[self._packet(op)]

    def module_count(self, fqn: str, op: str, phase: str | None = None) -> int:
        """``op`` collectives in module ``fqn``: one phase or all (backward includes recompute)."""
        per_module = self.comm_mode.comm_module_counts.get(fqn)
        if per_module is None:  # like the reference, modules without collectives are absent
            return 0
        if phase is None:
            return per_module[self._packet(op)]
        return per_module[phase][self._packet(op)]

    def module_depths(self) -> dict[str, int]:
        """``{fqn: depth}`` of every module seen, ``Global`` included."""
        return dict(self.comm_mode.advanced_module_tracker.module_depth_dict)

    def parameter_keys(self) -> list[tuple[str, str]]:
        """``(module fqn, parameter name)`` of every parameter seen, in order."""
        return _nested_keys(self.comm_mode.get_parameter_info())

    def sharding_keys(self) -> list[str]:
        """``"<fqn>.<param>"`` of every DTensor parameter seen, in order."""
        return list(self.comm_mode.get_sharding_info())


class NativeCounts(_Counter):
    """Reads counts through ``CommSpanMode`` and its aggregator (canonical op names)."""

    api = "native"

    def __init__(self) -> None:
        self.mode = self._context = CommSpanMode()

    @property
    def _agg(self) -> Any:
        assert self.mode.aggregator is not None
        return self.mode.aggregator

    def total(self) -> int:
        """All collectives seen in the context."""
        return self._agg.total_count()

    def count(self, op: str) -> int:
        """Collectives of canonical kind ``op`` seen in the context."""
        return self._agg.comm_counts().get(op, 0)

    def module_count(self, fqn: str, op: str, phase: str | None = None) -> int:
        """``op`` collectives in module ``fqn``: one phase or all (backward includes recompute)."""
        phases = self._agg.module_counts().get(fqn, {})
        wanted = {None: phases, "forward": ["forward"], "backward": ["backward", "recompute"]}
        return sum(phases.get(p, {}).get(op, 0) for p in wanted[phase])

    def module_depths(self) -> dict[str, int]:
        """``{fqn: depth}`` of every module seen, ``Global`` (depth 0) included."""
        depths = {"Global": 0}

        def walk(node: dict[str, Any], depth: int) -> None:
            for child in node["children"]:
                depths[child["fqn"]] = depth
                walk(child, depth + 1)

        walk(self._agg.to_dict(), 1)
        return depths

    def parameter_keys(self) -> list[tuple[str, str]]:
        """``(module fqn, parameter name)`` of every parameter seen, in order."""
        return _nested_keys(self._agg.parameter_info())

    def sharding_keys(self) -> list[str]:
        """``"<fqn>.<param>"`` of every DTensor parameter seen, in order."""
        return list(self._agg.sharding_info())


Counts = CompatCounts | NativeCounts


def make_counter(api: str) -> Counts:
    """A fresh counting front end: ``"compat"`` or ``"native"``."""
    if api == "compat":
        return CompatCounts()
    if api == "native":
        return NativeCounts()
    raise ValueError(f"api={api!r} is not one of {API_NAMES}")


def _nested_keys(nested: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    return [(outer, inner) for outer, values in nested.items() for inner in values]
