"""What each module issued itself: collectives grouped by module, phase, op, process
group and placements, with counts, bytes and (when recorded) time.

:class:`~commspan.Aggregator` counts per module and phase, subtree-inclusive;
this module keeps what the counts leave out — the process group and its mesh
dimension, the DTensor placements, the bytes and the time — per group of
identical collectives, for the command line's ``--show`` columns and for
``commspan diff``.

Example:
    >>> from commspan.analysis.issued import issued
    >>> issued([])
    []
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from commspan import semconv
from commspan.otlpjson.records import SpanRecord

__all__ = ["Issued", "issued", "issued_key", "natural_key"]


@dataclass(frozen=True)
class Issued:
    """Identical collectives one module issued itself, summed.

    Attributes:
        fqn: the module that issued them (``Global`` outside any module), or for
            framework communication (FSDP2, DDP) the module that owns them, as the
            counts do (``commspan.owner.fqn``, docs/parallelisms.md).
        phase: ``forward``, ``backward`` or ``recompute``.
        op: canonical op name.
        group: process group name (``""`` when unknown).
        group_ranks: global ranks of that group.
        mesh_dim: the DeviceMesh dimension of the group, when known.
        src: DTensor placements before the redistribution (``""`` if none).
        dst: placements after it.
        count: how many.
        bytes: input bytes, summed.
        duration_ns: issue-to-completion time, summed over the ``timed`` ones.
        timed: how many of them carry a duration.
        ranks: the ranks whose collectives are summed here.
        mesh_dim_name: the DeviceMesh's name for that dimension (``"tp"``), when
            known, else ``""``.
    """

    fqn: str
    phase: str
    op: str
    group: str
    group_ranks: tuple[int, ...]
    mesh_dim: int | None
    src: str
    dst: str
    count: int
    bytes: int
    duration_ns: int
    timed: int
    ranks: tuple[int, ...]
    mesh_dim_name: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form; ``duration_ns`` is ``null`` when no collective here was timed."""
        out = asdict(self)
        out["group_ranks"] = list(self.group_ranks)
        out["ranks"] = list(self.ranks)
        if not self.timed:
            out["duration_ns"] = None
        return out


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def issued(records: Iterable[SpanRecord], *, rank: int | None = None) -> list[Issued]:
    """Group the collective events of ``records`` by module, phase, op, group and placements.

    Args:
        records: span records (``read_spans``), any number of ranks.
        rank: only this rank's collectives; ``None`` sums every rank.

    Returns:
        One :class:`Issued` per group, sorted by module, phase, op, group.
    """
    acc: dict[tuple[Any, ...], list[Any]] = {}
    for rec in records:
        fqn = rec.attributes.get(semconv.MODULE_FQN)
        if fqn is None or not rec.events:
            continue
        r = rec.rank
        if rank is not None and r != rank:
            continue
        for _name, ev in rec.events:
            key = issued_key(ev, fqn)
            if key is None:
                continue
            slot = acc.get(key)
            if slot is None:
                slot = acc[key] = [0, 0, 0, 0, set()]
            slot[0] += 1
            slot[1] += _int(ev.get(semconv.TENSOR_BYTES)) or 0
            duration = _int(ev.get(semconv.COLL_DURATION_NS))
            if duration is not None and duration >= 0:
                slot[2] += duration
                slot[3] += 1
            if r is not None:
                slot[4].add(r)
    out = [
        Issued(fqn=k[0], phase=k[1], op=k[2], group=k[3], group_ranks=k[4], mesh_dim=k[5],
               src=k[6], dst=k[7], count=s[0], bytes=s[1], duration_ns=s[2], timed=s[3],
               ranks=tuple(sorted(s[4])), mesh_dim_name=k[8])
        for k, s in acc.items()
    ]
    out.sort(key=lambda i: (natural_key(i.fqn), _PHASES.get(i.phase, 9), i.op, i.group, i.src,
                            i.dst))
    return out


_PHASES = {p.value: n for n, p in enumerate(semconv.Phase)}


def issued_key(ev: Mapping[str, Any], fqn: Any) -> tuple[Any, ...] | None:
    """What :func:`issued` groups a collective event by (``ev``: its attributes, on a
    span of module ``fqn``): ``(fqn, phase, op, group, group ranks, mesh dim, src, dst,
    mesh dim name)``, the fields of :class:`Issued` in that order; ``None`` for an
    event that is not a collective (no op name)."""
    op = ev.get(semconv.COLL_OP)
    if op is None:
        return None
    pg_ranks = ev.get(semconv.PG_RANKS)
    return (
        # the owner, as the counts: the module that issued it, or the one
        # framework communication serves (docs/parallelisms.md)
        str(ev.get(semconv.OWNER_FQN) or ev.get(semconv.MODULE_FQN, fqn)),
        str(ev.get(semconv.PHASE, "")),
        str(op),
        str(ev.get(semconv.PG_NAME, "")),
        tuple(x for x in pg_ranks if isinstance(x, int)) if isinstance(pg_ranks, list)
        else (),
        _int(ev.get(semconv.MESH_DIM)),
        str(ev.get(semconv.REDIST_SRC, "")),
        str(ev.get(semconv.REDIST_DST, "")),
        str(ev.get(semconv.MESH_DIM_NAME) or ""),
    )


def natural_key(fqn: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key of a module name in which numbers sort as numbers.

    Example:
        >>> sorted(["m.layers.10", "m.layers.2", "m"], key=natural_key)
        ['m', 'm.layers.2', 'm.layers.10']
    """
    # (the text breaks ties: "01" and "1" are two names; isdecimal: int() takes it)
    return tuple((0, int(p), p) if p.isdecimal() and p.isascii() else (1, 0, p)
                 for p in fqn.split("."))
