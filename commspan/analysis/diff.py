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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, NamedTuple

import orjson

from commspan import semconv
from commspan.analysis.counts import mesh_dim_of
from commspan.analysis.issued import issued_key, natural_key
from commspan.analysis.runs import (
    RunInfo,
    RunTally,
    Selection,
    StepRange,
    _earlier_hangs,
    select,
)
from commspan.analysis.summary import _Unfinished, cut_short_steps, last_steps
from commspan.otlpjson.records import SpanRecord

__all__ = ["ADDED", "CHANGED", "OUTSIDE_STEPS", "REMOVED", "DiffEntry", "DiffResult",
           "FoldedSide", "Profile", "ProfileBuilder", "Usage", "diff", "profile"]

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
    # one run's spans folded per trace, as ProfileBuilder folds a run read file by file
    fold = _RunFold(rank)
    for record in records:
        fold.add(record)
    return _folded_profile(fold.traces, fold.unfinished.cut_short(last_traces),
                           last_traces is not None, steps, rank)


def _folded_profile(
    traces: Mapping[str, _TraceFold], cut: list[tuple[int | None, str, int | None]],
    selected: bool, steps: int | None = None, rank: int | None = None,
) -> Profile:
    """The :class:`Profile` of folded traces: the traces ``cut`` short (a hang; no rank
    span) are left out, on every rank (their collectives are neither a whole step nor
    outside the steps); ``steps`` as :func:`profile` takes it (``None``: the numbered
    steps left, at least 1; those of ``rank`` when one is given, whose file may end
    before the others')."""
    left_out = {trace for _, trace, _ in cut}
    numbered = {t for t, f in traces.items() if f.numbered and (rank is None or rank in f.ranks)}
    # a step cut short on every rank has no rank span: its hang records say its number
    steps_named = numbered | {trace for _, trace, step in cut if step is not None}
    if steps_named and steps_named <= left_out:
        raise _every_step_cut(cut, selected)
    numbered -= left_out
    if steps is None:
        steps = max(1, len(numbered))
    elif not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r} is not valid; pass a number of steps >= 1")
    # what happens once, not every step: a parallel wrapper's set-up, and collectives
    # outside the numbered steps (before the first, evaluation between steps), are
    # compared as they are, not divided by the steps (a 2-step and a 4-step run of
    # one model have the same set-up)
    totals: dict[tuple[str, str, str], list[Any]] = {}
    once: set[tuple[str, str, str]] = set()
    ranks: set[int] = set()
    for trace_id, folded in traces.items():
        if trace_id in left_out:
            continue
        stepped = trace_id in numbered if numbered else True
        for (fqn, phase, op), (c, b, p, per_group) in folded.usage.items():
            if phase != semconv.Phase.SETUP.value and not stepped:
                phase = f"{phase}{OUTSIDE_STEPS}"
            key = (fqn, phase, op)
            if not stepped or phase == semconv.Phase.SETUP.value:
                once.add(key)
            slot = totals.get(key)
            if slot is None:
                slot = totals[key] = [0, 0, set(), {}]
            slot[0] += c
            slot[1] += b
            slot[2].update(p)
            for where, n in per_group.items():
                slot[3][where] = slot[3].get(where, 0) + n
        ranks.update(folded.counted)
    return _profile_of(totals, once, steps, ranks, cut)


def _every_step_cut(cut: list[tuple[int | None, str, int | None]], selected: bool,
                    ) -> ValueError:
    """The error when every numbered step of a side was cut short (``selected``: the
    side is a step selection)."""
    which = cut_short_steps((r, s) for r, _, s in cut)
    return ValueError(
        f"every step {'selected ' if selected else ''}was cut short "
        f"({which}: no commspan.rank span written, a hang or a process stopped "
        "mid-step): no whole step is left to compare; "
        + ("select steps that ended" if selected else "compare a run with a step that ended"))


def _profile_of(
    totals: Mapping[tuple[str, str, str], list[Any]], once: set[tuple[str, str, str]],
    steps: int, ranks: set[int], cut: Iterable[tuple[int | None, str, int | None]],
) -> Profile:
    """The :class:`Profile` of ``(fqn, phase, op) -> [count, bytes, placements,
    {group: count}]`` totals (``once``: the keys not divided by ``steps``)."""
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


_STEP_SPANS = frozenset({semconv.SPAN_STEP, semconv.SPAN_RANK, semconv.SPAN_HANG})


class _TraceFold:
    """What :func:`profile` and the command line need of one trace's spans."""

    __slots__ = ("counted", "module_ranks", "numbered", "ranks", "step", "usage")

    def __init__(self) -> None:
        self.step: int | None = None
        """The first step number a step, rank or hang span of it names."""
        self.numbered = False
        """A step or rank span of it names a step (:func:`profile`'s numbered steps)."""
        self.ranks: set[int] = set()
        """The ranks of its spans."""
        self.module_ranks: set[int | None] = set()
        """The ranks of its spans that name a module."""
        self.counted: set[int] = set()
        """The ranks whose collectives of it were counted."""
        self.usage: dict[tuple[str, str, str], list[Any]] = {}
        """``(fqn, phase, op) -> [count, bytes, placements, {group: count}]``."""


class _RunFold:
    """The spans of one run folded per trace as they are read (the hang records kept)."""

    def __init__(self, rank: int | None) -> None:
        self.rank = rank
        self.unfinished = _Unfinished()
        self.traces: dict[str, _TraceFold] = {}
        self.hangs: list[SpanRecord] = []
        # issued_key -> ((fqn, phase, op), placement or None, group label)
        self._keys: dict[tuple[Any, ...], tuple[tuple[str, str, str], str | None, str]] = {}

    def add(self, span: SpanRecord) -> None:
        unfinished = self.unfinished
        unfinished.see(span)
        unfinished.add(span)
        trace = self.traces.get(span.trace_id)
        if trace is None:
            trace = self.traces[span.trace_id] = _TraceFold()
        name, attrs = span.name, span.attributes
        if name in _STEP_SPANS:
            step = attrs.get(semconv.STEP)
            if isinstance(step, int):
                if name != semconv.SPAN_HANG:
                    trace.numbered = True  # (as profile() numbers them)
                if trace.step is None and not isinstance(step, bool):
                    trace.step = step
            if name == semconv.SPAN_HANG:
                self.hangs.append(span)
        rank = span.rank
        if rank is not None:
            trace.ranks.add(rank)
        if semconv.MODULE_FQN not in attrs:
            return
        trace.module_ranks.add(rank)
        fqn = attrs[semconv.MODULE_FQN]
        if fqn is None or not span.events or (self.rank is not None and rank != self.rank):
            return
        keys, usage = self._keys, trace.usage
        for _name, ev in span.events:
            key = issued_key(ev, fqn)
            if key is None:
                continue
            how = keys.get(key)
            if how is None:
                how = keys[key] = _compared(key)
            nbytes = ev.get(semconv.TENSOR_BYTES)
            _count(usage, how, nbytes if isinstance(nbytes, int)
                   and not isinstance(nbytes, bool) else None)
            if rank is not None:
                trace.counted.add(rank)

    def add_part(self, part: Mapping[str, Any],
                 templates: Sequence[tuple[Any, ...]]) -> None:
        """Fold one digest part (:func:`~commspan.analysis.digest.digest_parts`; its
        collective ``templates`` as :func:`~commspan.analysis.digest._template` gives
        them), as :meth:`add` folds the spans it stands for. Digests hold no hang
        record (a line with one is parsed)."""
        self.unfinished.add_part(part, any(
            t[3] == semconv.STATE_FAILED for t in templates))
        trace = self.traces.get(part["trace"])
        if trace is None:
            trace = self.traces[part["trace"]] = _TraceFold()
        if part["step"] is not None:
            trace.numbered = True
            if trace.step is None:
                trace.step = part["step"]
        rank = part["rank"]
        trace.ranks.add(rank)
        if part["commspan_spans"]:
            trace.module_ranks.add(rank)
        if self.rank is not None and rank != self.rank:
            return
        usage, counted = trace.usage, False
        for row in orjson.loads(part["coll"]):
            template = templates[row[0]]
            compared = template[6]
            if compared is None:  # (not on a module's span: diff does not count it)
                continue
            fqn_of, phase, op, placement, where = compared
            _count(usage, ((fqn_of, phase, op), placement, where), template[0][6])
            counted = True
        if counted:
            trace.counted.add(rank)


def _compared(key: tuple[Any, ...]) -> tuple[tuple[str, str, str], str | None, str]:
    """What :func:`profile` keeps of a collective's :func:`issued_key`: its ``(fqn,
    phase, op)``, its redistribution's placements (``src->dst``) or ``None``, and
    where it ran (:func:`~commspan.analysis.counts.mesh_dim_of`)."""
    fqn_of, phase, op, group, _, dim, src, dst, dim_name = key
    return ((fqn_of, phase, op), f"{src or '?'}->{dst or '?'}" if src or dst else None,
            mesh_dim_of({semconv.MESH_DIM_NAME: dim_name, semconv.MESH_DIM: dim,
                         semconv.PG_NAME: group}))


def diff_usage(ev: Mapping[str, Any], fqn: Any) -> tuple[Any, ...] | None:
    """What :func:`profile` compares of a collective event ``ev`` on a span of module
    ``fqn``: ``(fqn, phase, op, placements or None, where it ran)``; ``None`` for an
    event that is not a collective (digests keep it: version 7)."""
    key = issued_key(ev, fqn)
    if key is None:
        return None
    (fqn_of, phase, op), placement, where = _compared(key)
    return fqn_of, phase, op, placement, where


def _count(usage: dict[tuple[str, str, str], list[Any]],
           how: tuple[tuple[str, str, str], str | None, str], nbytes: int | None) -> None:
    """One collective added to a trace's ``usage`` (``how``: :func:`_compared`)."""
    slot = usage.get(how[0])
    if slot is None:
        slot = usage[how[0]] = [0, 0, set(), {}]
    slot[0] += 1
    if nbytes is not None:
        slot[1] += nbytes
    if how[1] is not None:
        slot[2].add(how[1])
    slot[3][how[2]] = slot[3].get(how[2], 0) + 1


class ProfileBuilder:
    """:func:`profile` of one run and steps of files read one span at a time, holding
    no span (but hang records): each run's spans are folded per trace as they are
    added, and a side of a comparison is chosen once every span is read
    (:meth:`select`, as :func:`~commspan.analysis.runs.select` chooses). What a
    thousand-rank run needs: every span of it held takes some 11 GB.

    ``profile(select(spans, run=run, steps=steps).records, rank=rank,
    last_traces=...)`` and ``builder.select(run, steps).profile()`` after every span
    was added are the same :class:`Profile`.

    Example:
        >>> builder = ProfileBuilder()
        >>> builder.select(None, None).profile().usage
        {}
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
        self.tally = RunTally()
        self._runs: dict[str, _RunFold] = {}
        self._part_runs: list[RunInfo] | None = None

    def add_parts(self, parts: Sequence[dict[str, Any]]) -> None:
        """Fold the digest parts of every file of a side
        (:func:`~commspan.analysis.digest.load_parts`), as :meth:`add` folds the spans
        they stand for; a builder takes parts once, or spans."""
        from commspan.analysis.digest import _template, list_part_runs

        self._part_runs = list_part_runs(parts)
        cache: dict[str, tuple[Any, ...]] = {}
        for part in parts:
            fold = self._runs.get(part["run"])
            if fold is None:
                fold = self._runs[part["run"]] = _RunFold(self.rank)
            fold.add_part(part, [_template(text, cache) for text in part["tmpls"]])

    def add(self, span: SpanRecord) -> None:
        """Fold one span (spans in the order read)."""
        run = self.tally.add(span)
        fold = self._runs.get(run)
        if fold is None:
            fold = self._runs[run] = _RunFold(self.rank)
        fold.add(span)

    def hold(self, spans: Iterable[SpanRecord]) -> None:
        """:meth:`add` one file's spans (a reader's ``hold``)."""
        for span in spans:
            self.add(span)

    def select(self, run: str | None, steps: StepRange | None) -> FoldedSide:
        """The run and steps :func:`~commspan.analysis.runs.select` would keep of the
        spans added, folded.

        Raises:
            SelectionError: as :func:`~commspan.analysis.runs.select`.
        """
        every = self.tally.runs() if self._part_runs is None else self._part_runs
        sel = select([], run=run, steps=steps, every=every)
        fold = self._runs.get(sel.run.run_id) if sel.run is not None else None
        if fold is None:
            return FoldedSide(sel, frozenset(), None, None)
        if steps is None:
            return FoldedSide(sel, frozenset(fold.traces), fold, None)
        trace_steps = {t: f.step for t, f in fold.traces.items() if f.step is not None}
        chosen = frozenset(t for t, s in trace_steps.items() if s in steps)
        # a rank's hang record from before the steps (it never got to them), as select
        # keeps it; folded apart: select keeps that span only, not the rest of its trace
        earlier = _earlier_hangs(fold.hangs, [h for h in fold.hangs if h.trace_id in chosen],
                                 trace_steps, sel.steps)
        extra = None
        if earlier:
            extra = _RunFold(self.rank)
            for span in earlier:
                extra.add(span)
        last = {rank: trace for rank, (_, trace) in fold.unfinished.latest.items()}
        return FoldedSide(replace(sel, last_traces=last), chosen, fold, extra)


@dataclass(frozen=True)
class FoldedSide:
    """One side of a comparison that :class:`ProfileBuilder` folded: what its spans
    say, without them.

    Attributes:
        selection: the run and steps chosen (its ``records`` empty).
        chosen: the traces of the run (and steps) chosen.
    """

    selection: Selection
    chosen: frozenset[str]
    _fold: _RunFold | None = field(repr=False)
    _extra: _RunFold | None = field(repr=False)

    def _traces(self) -> dict[str, _TraceFold]:
        if self._fold is None:
            return {}
        folded = self._fold.traces
        out = {t: folded[t] for t in self.chosen}
        if self._extra is not None:
            out.update(self._extra.traces)
        return out

    @property
    def traces(self) -> frozenset[str]:
        """The trace ids of the spans the selection keeps (with a rank's hang record
        from before the steps, as :func:`~commspan.analysis.runs.select` keeps it)."""
        return frozenset(self._traces())

    def ranks(self) -> set[int]:
        """The ranks of the spans kept."""
        return set().union(*(t.ranks for t in self._traces().values()))

    def module_ranks(self) -> set[int | None]:
        """The ranks of the spans kept that name a module (``None``: without a rank)."""
        return set().union(*(t.module_ranks for t in self._traces().values()))

    def last_steps(self) -> dict[int, int]:
        """:func:`~commspan.analysis.summary.last_steps` of the spans kept."""
        return last_steps((rank, trace_id, t.step) for trace_id, t in self._traces().items()
                          for rank in (t.ranks or (None,)))

    def profile(self) -> Profile:
        """:func:`profile` of the spans kept (of the rank the builder was given).

        Raises:
            ValueError: as :func:`profile`.
        """
        if self._fold is None:
            return profile([])
        last_traces = self.selection.last_traces
        cut = [c for c in self._fold.unfinished.cut_short(last_traces) if c[1] in self.chosen]
        if self._extra is not None:
            cut += self._extra.unfinished.cut_short(last_traces)
            cut.sort(key=lambda p: (p[0] is None, p[0] or 0, p[1]))
        rank = self._fold.rank if self._fold is not None else None
        return _folded_profile(self._traces(), cut, last_traces is not None, rank=rank)


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
