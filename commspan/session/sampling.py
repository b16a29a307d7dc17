"""Which ranks of a job trace: a byte budget for big jobs.

On a job of thousands of ranks, tracing every rank multiplies the bytes of a
step by the world size, while the ranks of a tensor- or data-parallel group
mostly issue the same collectives. ``CommSpanMode(ranks=...)`` traces some
ranks only; the others run every step as a sampled-out step (commspan's hooks
removed, nothing recorded or exported). Each traced rank's resource says how
ranks were chosen (``commspan.sampling.ranks``), so ``commspan check`` does
not count the ranks left out as missing.

Example:
    >>> RankSample.fraction(0.25).chosen(16)
    [0, 4, 8, 12]
    >>> RankSample.of([0, 5]).traces(5, 8), RankSample.all().description
    (True, 'all')
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from commspan._errors import whole_number

__all__ = ["RankSample", "rank_sample"]


class RankSample:
    """A rule that says whether a rank traces.

    Build one with :meth:`all`, :meth:`of`, :meth:`fraction` or
    :meth:`one_per_group`; ``CommSpanMode(ranks=...)`` also takes a set of
    ranks or a fraction directly.

    Attributes:
        description: the rule in words, written into traced ranks' resources.
    """

    def __init__(self, choose: Callable[[int, int], bool], description: str,
                 lists_ranks: bool = False) -> None:
        self._choose = choose
        self.description = description
        self._lists_ranks = lists_ranks or description == "all"

    def describe(self, world_size: int) -> str:
        """What a traced rank's resource says (``commspan.sampling.ranks``): the rule,
        and, for a rule that does not name its ranks itself (a fraction, one per
        group), the ranks it chooses in a world of ``world_size``: ``"fraction 0.5
        (ranks 0,2)"``. A reader then knows which ranks traced, so one that wrote
        nothing stopped.

        Example:
            >>> RankSample.fraction(0.25).describe(16)
            'fraction 0.25 (ranks 0,4,8,12)'
        """
        if self._lists_ranks:
            return self.description
        from commspan.analysis.runs import format_numbers

        return f"{self.description} (ranks {format_numbers(self.chosen(world_size))})"

    def traces(self, rank: int, world_size: int) -> bool:
        """Whether ``rank`` of ``world_size`` ranks traces."""
        return bool(self._choose(rank, world_size))

    def chosen(self, world_size: int) -> list[int]:
        """The ranks that trace in a world of ``world_size``."""
        return [r for r in range(world_size) if self._choose(r, world_size)]

    def __repr__(self) -> str:
        return f"RankSample({self.description!r})"

    @classmethod
    def all(cls) -> RankSample:
        """Every rank traces (the default)."""
        return cls(lambda rank, world: True, "all")

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSample:
        """These ranks trace.

        Raises:
            ValueError: a rank is not an int >= 0, or none is given.
        """
        chosen = set()
        for r in ranks:
            rank = whole_number(r)  # numpy's ints too (ranks=np.arange(0, 8, 2))
            if rank is None or rank < 0:
                raise ValueError(f"ranks: {r!r} is not a rank; pass ints >= 0")
            chosen.add(rank)
        if not chosen:
            raise ValueError("ranks is empty; pass at least one rank (or None for all)")
        frozen = frozenset(chosen)
        return cls(lambda rank, world: rank in frozen,
                   "ranks " + ",".join(str(r) for r in sorted(frozen)), lists_ranks=True)

    @classmethod
    def fraction(cls, share: float) -> RankSample:
        """About ``share`` of the ranks, evenly spread, rank 0 always among them:
        rank ``r`` traces when ``floor(r * share)`` steps up at ``r`` (``share=0.25``:
        ranks 0, 4, 8, ...). Deterministic: every rank decides alone, the same way.

        Raises:
            ValueError: ``share`` is not in (0, 1].
        """
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (
            0 < share <= 1
        ):
            raise ValueError(f"ranks={share!r} is not a valid fraction; pass 0 < share <= 1")

        def choose(rank: int, world: int) -> bool:
            return rank == 0 or math.floor(rank * share + 1e-9) > math.floor(
                (rank - 1) * share + 1e-9)

        return cls(choose, f"fraction {share:g}")

    @classmethod
    def one_per_group(cls, mesh: Any, dim: str | int) -> RankSample:
        """One rank per group of mesh dimension ``dim``: the ranks at coordinate 0
        along it (``one_per_group(mesh, "tp")`` on a (dp 64, tp 8) mesh: 64 ranks,
        one per tensor-parallel group).

        Args:
            mesh: a ``torch.distributed.DeviceMesh``.
            dim: the dimension's name (``mesh_dim_names``) or index.

        Raises:
            ValueError: ``dim`` is not a dimension of ``mesh``.
        """
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if isinstance(dim, str):
            if dim not in names:
                raise ValueError(f"dim={dim!r} is not a dimension of the mesh; it has "
                                 f"{list(names) or 'no names'}")
            index = names.index(dim)
        else:
            index = int(dim)
        ranks = mesh.mesh
        if not 0 <= index < ranks.dim():
            raise ValueError(f"dim={dim!r} is not a dimension of a {ranks.dim()}-D mesh")
        chosen = frozenset(int(r) for r in ranks.select(index, 0).flatten().tolist())
        label = names[index] if names else f"dim {index}"
        return cls(lambda rank, world: rank in chosen, f"one per {label} group")


def rank_sample(value: RankSample | Iterable[int] | float | None) -> RankSample:
    """``CommSpanMode(ranks=...)`` as a :class:`RankSample`.

    Raises:
        TypeError: ``value`` is none of the accepted kinds.
        ValueError: a bad fraction or rank (see the constructors).
    """
    if value is None:
        return RankSample.all()
    if isinstance(value, RankSample):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, (numbers.Integral, bool)):
        value = float(value)  # numpy's float32 too
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        if isinstance(value, int):
            raise TypeError(f"ranks={value!r} is not valid; pass a set of ranks ([{value}]), "
                            "a fraction, a RankSample or None")
        return RankSample.fraction(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"ranks={value!r} is not valid; pass a set of ranks, a fraction "
                        "(0 < f <= 1), RankSample.one_per_group(mesh, dim) or None")
    return RankSample.of(value)
