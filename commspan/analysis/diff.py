"""Compare the collectives of two runs, or of two steps of one run.

Each side is reduced to a *profile*: per module, phase and op, the collectives
the module issued itself (not its children's, so a change shows once, at the
module that made it), as count and bytes **per step** (summed over the side's
steps and ranks, divided by its number of steps, so a 3-step run and a 5-step
run of the same model compare equal; compared exactly, not as rounded), with
the set of DTensor placements (``src->dst``) they redistributed and the mesh
dimensions (or process groups) they ran on. :func:`diff` then says, per
module, phase and op, what was added (only in B), removed (only in A) or
changed (count, bytes, placements or groups differ: the same collective on
the ``dp`` dimension instead of ``tp`` is a change).

A change of parallelism plan reads as such: turning sequence parallelism on
replaces a row-parallel Linear's forward ``all_reduce`` by a
``reduce_scatter`` and adds an ``all_gather`` in front of the blocks.

Example:
    >>> from commspan.analysis.diff import diff, profile
    >>> result = diff(profile([]), profile([]))
    >>> result.equal, result.counts()
    (True, {'added': 0, 'removed': 0, 'changed': 0, 'same': 0})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

from commspan import semconv
from commspan.analysis.counts import mesh_dim_of
from commspan.analysis.issued import issued, natural_key
from commspan.analysis.summary import cut_short, cut_short_steps
from commspan.otlpjson.records import SpanRecord

__all__ = ["ADDED", "CHANGED", "OUTSIDE_STEPS", "REMOVED", "DiffEntry", "DiffResult", "Profile",
           "Usage", "diff", "profile"]

ADDED = "added"
REMOVED = "removed"
CHANGED = "changed"

_PHASES = {p.value: n for n, p in enumerate(semconv.Phase)}


OUTSIDE_STEPS = " (outside steps)"
"""Appended to the phase of collectives issued outside the numbered steps: they are
compared as totals, not per step."""


@dataclass(frozen=True)
class Usage:
    """One module's collectives of one phase and op, per step.

    Attributes:
        count: collectives per step (an int when whole; rounded to 3 decimals).
        bytes: input bytes per step (likewise).
        placements: the ``src->dst`` DTensor redistributions they served, sorted
            (empty for collectives issued without a redistribution).
        groups: where they ran, with their count per step: the mesh dimension's
            name (``tp x1``), else ``dim <i>``, else ``group <name>`` for a
            process group outside any mesh; sorted.
        total_count: collectives in all, over ``steps`` steps.
        total_bytes: their input bytes in all.
        steps: the steps of the side.
        group_totals: ``(group, collectives in all)`` pairs behind ``groups``.
    """

    count: float
    bytes: float
    placements: tuple[str, ...]
    groups: tuple[str, ...] = ()
    total_count: int = 0
    total_bytes: int = 0
    steps: int = 1
    group_totals: tuple[tuple[str, int], ...] = ()

    def exact(self, name: str) -> Any:
        """``count`` or ``bytes`` per step as an exact fraction (the fields round to
        3 decimals); ``groups`` as the group names, with their exact counts per step
        when there are several (a count change on one group is a ``count`` change)."""
        if name == "groups":  # which groups; with several, how the count splits
            if len(self.group_totals) <= 1:
                return tuple(g for g, _ in self.group_totals)
            return tuple((g, Fraction(n, self.steps)) for g, n in self.group_totals)
        if name in ("count", "bytes"):
            return Fraction(getattr(self, f"total_{name}"), self.steps)
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``count``, ``bytes``, ``placements``, ``groups``, and the
        ``total_count`` and ``total_bytes`` over ``steps`` steps they come from."""
        return {"count": self.count, "bytes": self.bytes, "placements": list(self.placements),
                "groups": list(self.groups), "total_count": self.total_count,
                "total_bytes": self.total_bytes, "steps": self.steps}


@dataclass(frozen=True)
class Profile:
    """The collectives of one side of a comparison.

    Attributes:
        usage: ``(fqn, phase, op) -> Usage``.
        steps: number of steps the totals were divided by (at least 1).
        ranks: the ranks summed.
        cut_short: the ``(rank, step)`` of the traces cut short (a hang, a process
            stopped mid-step: no ``commspan.rank`` span written), sorted; their
            steps are left out of the profile, on every rank.
    """

    usage: dict[tuple[str, str, str], Usage]
    steps: int
    ranks: tuple[int, ...]
    cut_short: tuple[tuple[int | None, int | None], ...] = ()

    def note(self, label: str = "") -> str | None:
        """The stderr note saying which steps were left out as cut short, or ``None``.

        Args:
            label: put before the steps (``"B: "``).
        """
        if not self.cut_short:
            return None
        return (f"commspan: {label}{cut_short_steps(self.cut_short)} was cut short (no "
                "commspan.rank span written: a hang or a process stopped mid-step): diff "
                "leaves such a step out on every rank, and counts per step over the "
                f"{self.steps} step(s) left (commspan check shows where each rank was)")


class DiffEntry(NamedTuple):
    """One module, phase and op that differs between A and B.

    Attributes:
        status: ``added`` (only in B), ``removed`` (only in A) or ``changed``.
        a: A's usage (``None`` when added).
        b: B's usage (``None`` when removed).
        fields: for ``changed``: which of ``count``, ``bytes``, ``placements``,
            ``groups`` differ (counts and bytes compared exactly, per step).
    """

    fqn: str
    phase: str
    op: str
    status: str
    a: Usage | None
    b: Usage | None
    fields: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``fqn``, ``phase``, ``op``, ``status``, ``a``, ``b``, ``fields``."""
        return {
            "fqn": self.fqn,
            "phase": self.phase,
            "op": self.op,
            "status": self.status,
            "a": None if self.a is None else self.a.to_dict(),
            "b": None if self.b is None else self.b.to_dict(),
            "fields": list(self.fields),
        }


@dataclass(frozen=True)
class DiffResult:
    """What :func:`diff` found.

    Attributes:
        entries: the differences, by module name, then phase and op.
        same: how many (module, phase, op) were equal on both sides.
        a: profile of side A.
        b: profile of side B.
    """

    entries: list[DiffEntry]
    same: int
    a: Profile = field(repr=False)
    b: Profile = field(repr=False)

    @property
    def equal(self) -> bool:
        """``True`` when nothing differs."""
        return not self.entries

    def counts(self) -> dict[str, int]:
        """``{"added": n, "removed": n, "changed": n, "same": n}``."""
        out = {ADDED: 0, REMOVED: 0, CHANGED: 0}
        for e in self.entries:
            out[e.status] += 1
        return {**out, "same": self.same}

    def to_dict(self) -> dict[str, Any]:
        """``{"equal", "counts", "entries"}``, ready for ``json.dumps``."""
        return {
            "equal": self.equal,
            "counts": self.counts(),
            "entries": [e.to_dict() for e in self.entries],
        }


def _per_step(total: int, steps: int) -> float:
    value = round(total / steps, 3)
    return int(value) if value == int(value) else value


def profile(
    records: Iterable[SpanRecord], *, rank: int | None = None, steps: int | None = None,
    last_traces: Mapping[int | None, str] | None = None,
) -> Profile:
    """Reduce span records to the per-step collectives of each module, phase and op.

    Args:
        records: one side's span records (one run, or the steps compared).
        rank: only this rank; ``None`` sums every rank.
        steps: divide the totals by this; ``None``: by the number of numbered
            steps in the records (1 when there is none), not counting the steps
            cut short (a hang; see :attr:`Profile.cut_short`), which are left out
            on every rank. A parallel wrapper's
            set-up (phase ``setup``) and collectives outside the numbered steps
            (their phase gets :data:`OUTSIDE_STEPS`) are not divided: they happen
            once, however many steps the run has.

    Returns:
        The :class:`Profile`.

    Raises:
        ValueError: ``steps`` is not a positive int, or every numbered step of the
            records was cut short (nothing whole to compare).
    """
    records = list(records)
    # a step cut short (a hang; no rank span) is left out, on every rank: its collectives
    # are neither a whole step nor outside the steps
    cut = cut_short(records, last_traces)
    left_out = {trace for _, trace, _ in cut}
    numbered = {
        r.trace_id for r in records
        if r.name in (semconv.SPAN_RANK, semconv.SPAN_STEP)
        and isinstance(r.attributes.get(semconv.STEP), int)
    }
    # a step cut short on every rank has no rank span: its hang records say its number
    steps_named = numbered | {trace for _, trace, step in cut if step is not None}
    if steps_named and steps_named <= left_out:
        which = cut_short_steps((r, s) for r, _, s in cut)
        raise ValueError(
            f"every step {'selected ' if last_traces is not None else ''}was cut short "
            f"({which}: no commspan.rank span written, a hang or a process stopped "
            "mid-step): no whole step is left to compare; "
            + ("select steps that ended" if last_traces is not None else
               "compare a run with a step that ended"))
    numbered -= left_out
    records = [r for r in records if r.trace_id not in left_out]
    if steps is None:
        steps = max(1, len(numbered))
    elif not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r} is not valid; pass a number of steps >= 1")
    # what happens once, not every step: a parallel wrapper's set-up, and collectives
    # outside the numbered steps (before the first, evaluation between steps), are
    # compared as they are, not divided by the steps (a 2-step and a 4-step run of
    # one model have the same set-up)
    in_steps = [r for r in records if r.trace_id in numbered] if numbered else records
    outside = [r for r in records if r.trace_id not in numbered] if numbered else []
    totals: dict[tuple[str, str, str], list[Any]] = {}
    once: set[tuple[str, str, str]] = set()
    ranks: set[int] = set()
    for part, stepped in ((in_steps, True), (outside, False)):
        for row in issued(part, rank=rank):
            phase = row.phase
            if phase != semconv.Phase.SETUP.value and not stepped:
                phase = f"{phase}{OUTSIDE_STEPS}"
            key = (row.fqn, phase, row.op)
            if not stepped or phase == semconv.Phase.SETUP.value:
                once.add(key)
            slot = totals.setdefault(key, [0, 0, set(), {}])
            slot[0] += row.count
            slot[1] += row.bytes
            if row.src or row.dst:
                slot[2].add(f"{row.src or '?'}->{row.dst or '?'}")
            where = _group_label(row)
            slot[3][where] = slot[3].get(where, 0) + row.count
            ranks.update(row.ranks)
    usage = {}
    for key, (c, b, p, per_group) in totals.items():
        n = 1 if key in once else steps
        usage[key] = Usage(
            _per_step(c, n), _per_step(b, n), tuple(sorted(p)),
            tuple(f"{g} x{_per_step(k, n)}" for g, k in sorted(per_group.items())),
            c, b, n, tuple(sorted(per_group.items())),
        )
    return Profile(usage, steps, tuple(sorted(ranks)),
                   tuple(sorted({(r, st) for r, _, st in cut},
                                key=lambda p: (p[1] is None, p[1] or 0, p[0] is None, p[0] or 0))))


def _group_label(row: Any) -> str:
    """Where a row's collectives ran, the same on every rank and in every run of a
    program, named as :func:`~commspan.analysis.counts.mesh_dim_of` names it."""
    return mesh_dim_of({semconv.MESH_DIM_NAME: row.mesh_dim_name,
                        semconv.MESH_DIM: row.mesh_dim, semconv.PG_NAME: row.group})


def diff(a: Profile, b: Profile) -> DiffResult:
    """Compare two profiles per module, phase and op.

    Returns:
        The differences (added, removed, changed) and how many were the same.
    """
    entries: list[DiffEntry] = []
    same = 0
    for key in sorted(set(a.usage) | set(b.usage),
                      key=lambda k: (natural_key(k[0]), _PHASES.get(k[1], 9), k[2])):
        ua, ub = a.usage.get(key), b.usage.get(key)
        if ua is None:
            entries.append(DiffEntry(*key, ADDED, None, ub))
        elif ub is None:
            entries.append(DiffEntry(*key, REMOVED, ua, None))
        else:
            fields = tuple(f for f in ("count", "bytes", "placements", "groups")
                           if ua.exact(f) != ub.exact(f))
            if fields:
                entries.append(DiffEntry(*key, CHANGED, ua, ub, fields))
            else:
                same += 1
    return DiffResult(entries, same, a, b)
