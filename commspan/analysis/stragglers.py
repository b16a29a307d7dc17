"""Who arrives last at each collective, the wait it causes, and where each rank's step goes.

Two questions, one analyzer each, over a :class:`~commspan.analysis.records.Run`:

- :func:`straggler_report`: for each collective (group, step, position in the
  step), the rank that arrived last is the one that waited least: the one
  with the shortest ``commspan.collective.duration_ns``. No clock alignment
  across hosts is needed, only each rank's own durations. The wait it caused
  is the sum over the other ranks of (their duration - its duration), for a
  functional collective at most their ``commspan.collective.wait_ns`` (the time
  blocked in ``wait_tensor``); if it waited late itself (its duration holds its
  own work after issuing), that is a lower bound (``checked["late_last"]``).
  Aggregated per step, module and phase and per rank, sorted by the rank's own
  lateness: the wait it caused less the part it passed on, having itself waited
  that long for other ranks at collectives of other groups since the ranks last
  met on this group (``passed_on_ns``: a rank of a 2-D mesh late at its
  data-parallel collective for having waited for a slow tensor-parallel peer
  comes after that peer). The module is the one
  the collective is counted in, as ``commspan summary`` counts it: its owner
  (``commspan.owner.fqn``: the FSDP unit whose parameters a reduce-scatter
  moves, the module holding a DDP bucket), else the module that issued it.
- :func:`step_breakdown`: per rank and step, the time in forward, backward
  and recompute module spans (each instant counted once, for the innermost
  span open then), outside any module, and in collectives (the sum of their
  durations, which overlaps the others).

Python's garbage collector stops a rank's process for as long as a collection
takes (``commspan.gc`` events, ``CommSpanMode(record_gc=True)``). A row's
``gc_ns`` is the collector's time on the late rank between its previous
collective of the step and each late arrival: the part of the lateness the
collector explains. Step times and per-rank totals carry the rank's
collector time too.

Collectives are matched across ranks as ``commspan check`` matches them: by
position within the step, per group; a (group, step) whose ranks issued
different sequences, by check's rule (an all-to-all's uneven splits are no
difference), is left out (``checked["inconsistent"]``), as are
collectives some rank has no duration for (``checked["without_duration"]``)
and those some member of their group has no record of
(``checked["incomplete"]``: a rank whose file is missing, or that a rank
sample left out): the rank that arrived last may be that one, and every
recorded rank's duration then holds the wait it caused.
Point-to-point ops (``checked["point_to_point"]``) are not matched: a send and
its receive do not wait for each other the way a group's ranks do. Nor are
collectives with a root (``checked["rooted"]``: broadcast, scatter, gather,
reduce): their ranks do not all wait for the last one (a gather's root waits
for every rank, the others for nobody; who a broadcast waits for depends on
the backend's algorithm), so the shortest duration does not tell who arrived
last. Nor is a functional collective that a rank other than the one with the
shortest duration waited for only once it had completed
(``checked["late_wait"]``: its ``commspan.collective.wait_ns`` under a
twentieth of its duration): that rank did other work between issuing and
waiting, its duration holds that work, and the others' durations alone
cannot say whether it arrived last. A collective whose last rank itself
waited late is matched, and counted in ``checked["late_last"]``: its duration
holds its own work after issuing, so each other rank's duration less its own
(at most their ``wait_ns``) is a lower bound of the wait it caused, which may be
up to their time blocked in ``wait_tensor``. ``checked`` counts collectives (one
per group, step and position), point-to-point ops per rank.

Example:
    >>> from commspan.analysis.stragglers import analyze
    >>> from commspan.analysis.records import build_run
    >>> analyze(build_run([])).to_dict()["stragglers"]
    []
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from commspan import semconv
from commspan.analysis.records import (
    CollectiveRecord,
    Run,
    RunPaths,
    SpanTimes,
    _check_steps,
    _keep_steps,
    differing_fields,
    load_run,
    require_steps,
)
from commspan.otlpjson.decode import DEFAULT_MAX_LINE_BYTES, ReadReport

__all__ = [
    "RankWaits",
    "StepTime",
    "StragglerResult",
    "StragglerRow",
    "analyze",
    "matched_collectives",
    "step_breakdown",
    "straggler_report",
    "stragglers",
    "totals_by_rank",
]


class StragglerRow(NamedTuple):
    """A rank that arrived last at collectives of one module in one step.

    Attributes:
        step: the step (``None`` outside steps).
        fqn: module those collectives are counted in (their owner, else the module
            the last rank issued them in).
        phase: their phase.
        rank: the rank that arrived last.
        times_last: how many of them it arrived last at.
        collectives: how many collectives of this step, module and phase were
            matched across ranks (whoever was last).
        wait_ns: time the other ranks spent waiting for it, summed.
        max_wait_ns: the largest wait it caused at one collective.
        groups: process groups of those collectives.
        seqs: their sequence numbers (the rank's own).
        gc_ns: the garbage collector's time on that rank between its previous
            collective (or the start of its step) and each of these, summed: how
            much of its lateness the collector explains (0 when none ran).
        passed_on_ns: the part of ``wait_ns`` it passed on: it had itself waited
            that long for other ranks, at collectives of other groups since these
            ranks last met on this group (or since its step started, before the
            group's first collective) (an estimate: each other rank's wait,
            at most the last rank's own waits there less that rank's own). A
            rank of a 2-D mesh held up on its tensor-parallel group by a slow
            peer arrives late at its data-parallel collective without being slow
            itself: ``wait_ns - passed_on_ns`` is its own lateness, by which rows
            are sorted.
    """

    step: int | None
    fqn: str
    phase: str
    rank: int
    times_last: int
    collectives: int
    wait_ns: int
    max_wait_ns: int
    groups: tuple[str, ...]
    seqs: tuple[int, ...]
    gc_ns: int = 0
    passed_on_ns: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form (lists for the tuples)."""
        out = self._asdict()
        out["groups"] = list(self.groups)
        out["seqs"] = list(self.seqs)
        return out


class RankWaits(NamedTuple):
    """One rank over the whole run: how often it arrived last, the wait it caused, its
    garbage collector's time over the run (``gc_ns``), and the part of the wait it
    passed on (``passed_on_ns``, :attr:`StragglerRow.passed_on_ns`). The wait is each
    other rank's time spent waiting for it, collectives in flight together (DDP's
    buckets, all waiting for the same late rank) counted once: unlike the rows, one
    per module, whose waits then each hold the same time."""

    rank: int
    times_last: int
    wait_ns: int
    gc_ns: int = 0
    passed_on_ns: int = 0


class StepTime(NamedTuple):
    """Where one rank's step went (ns).

    ``forward_ns + backward_ns + recompute_ns + outside_ns`` is ``total_ns``
    when the module spans nest without overlapping; ``collectives_ns`` is the
    sum of the step's collective durations (``None`` when no duration is
    recorded): collectives in flight together (async point-to-point ops, an
    all-gather prefetched under another) each count in full, so it can exceed
    ``total_ns``;
    ``gc_ns`` the part the garbage collector held the process (``commspan.gc``
    events; 0 when none was recorded).
    """

    rank: int
    step: int | None
    total_ns: int
    forward_ns: int
    backward_ns: int
    recompute_ns: int
    outside_ns: int
    collectives_ns: int | None
    gc_ns: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return self._asdict()


@dataclass(frozen=True)
class StragglerResult:
    """What :func:`analyze` found.

    Attributes:
        stragglers: rows per step, module, phase and last rank, the rank's own
            lateness first (``wait_ns - passed_on_ns``), then the wait.
        ranks: per rank, over the run, in the same order.
        step_times: per rank and step, in rank then step order.
        checked: ``collectives`` (matched across ranks), ``with_wait`` (a last
            rank that made the others wait), ``without_duration``,
            ``inconsistent`` (collectives of (group, step) pairs left out).
    """

    stragglers: list[StragglerRow]
    ranks: list[RankWaits]
    step_times: list[StepTime]
    checked: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{"stragglers": [...], "ranks": [...], "step_times": [...], "checked": {...}}``."""
        return {
            "stragglers": [r.to_dict() for r in self.stragglers],
            "ranks": [r._asdict() for r in self.ranks],
            "step_times": [s.to_dict() for s in self.step_times],
            "checked": dict(self.checked),
        }


# ------------------------------------------------------------------ entry points
def stragglers(
    paths: RunPaths,
    *,
    steps: Iterable[int] | None = None,
    strict: bool = True,
    report: ReadReport | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    run: str | None = None,
) -> StragglerResult:
    """Read the JSONL files of a run and say who arrives last, and where steps go
    (from their digests where every file has one, as
    :func:`~commspan.analysis.records.load_run` reads).

    Args:
        paths: the run's JSONL files (see :data:`~commspan.analysis.records.RunPaths`).
        steps: only these step numbers; ``None`` for all.
        strict, report, max_line_bytes: how damaged and over-long lines are
            handled, as for :func:`~commspan.exporters.read_spans` (``strict=False``
            skips a damaged line, as ``commspan stragglers`` does).
        run: the run to read when the files hold several: as for
            :func:`~commspan.analysis.records.load_run` (default: the latest, with
            a warning; runs are never summed).

    Returns:
        Straggler rows, per-rank totals, step-time breakdown and counts.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: no path, a directory without ``*.jsonl`` files, a line that
            is not JSON and ``strict`` (names file and line), or bad ``steps`` (not
            ints, or none of them a step of the run).

    Example:
        >>> from commspan.analysis import stragglers
        >>> result = stragglers("commspan-out")  # doctest: +SKIP
        >>> result.stragglers[0]  # doctest: +SKIP
        StragglerRow(step=3, fqn='Net.blocks.1', phase='forward', rank=2, times_last=1, ...)
    """
    if steps is None:
        return analyze(load_run(paths, module_spans="folded", strict=strict, report=report,
                                max_line_bytes=max_line_bytes, run=run))
    wanted = _check_steps(steps)
    # the steps selected, with the whole run for the waits passed on from before them:
    # the run built once, the selection a copy of it cut to the steps (as build_run's)
    whole = load_run(paths, module_spans="folded", strict=strict, report=report,
                     max_line_bytes=max_line_bytes, run=run)
    require_steps(wanted, (s for s in whole.trace_steps.values() if s is not None))
    selected = replace(whole)
    _keep_steps(selected, wanted or frozenset())
    return analyze(selected, context=whole)


def analyze(run: Run, context: Run | None = None) -> StragglerResult:
    """:func:`straggler_report` and :func:`step_breakdown` of ``run`` in one result
    (``context``: the whole run when ``run`` holds some of its steps, as for
    :func:`straggler_report`)."""
    rows, ranks, checked = straggler_report(run, context)
    return StragglerResult(rows, ranks, step_breakdown(run), checked)


# ------------------------------------------------------------------ stragglers


def matched_collectives(
    run: Run, checked: Counter[str] | None = None
) -> list[dict[int, CollectiveRecord]]:
    """Collectives matched across the ranks of their group: one ``rank -> record`` per
    collective, by position within (group, step), where the ranks agree on the ops
    and on their sequence numbers (ranks that number their steps apart put other
    collectives in the same step: not one collective, not compared)."""
    counts = checked if checked is not None else Counter()
    rooted: set[tuple[str, str, int | None, str]] = set()
    table: dict[tuple[str, str], dict[int, list[CollectiveRecord]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for rec in run.collectives:
        if rec.kind == semconv.KIND_P2P:
            counts["point_to_point"] += 1
            continue
        if rec.op in semconv.ROOTED_OPS:  # (their ranks do not all wait for the last to arrive)
            rooted.add((rec.group, rec.trace_id, rec.seq, rec.op))
            continue
        if not rec.group:
            continue
        table[(rec.group, rec.trace_id)][rec.rank].append(rec)
    out = []
    for (_group, _trace), per_rank in table.items():
        lists = [sorted(v, key=lambda c: (c.seq or 0, c.issued_ns)) for v in per_rank.values()]
        lengths = {len(v) for v in lists}
        if len(lengths) != 1 or any(
                differing_fields(column)
                or len({c.seq for c in column if c.seq is not None}) > 1
                for column in zip(*lists)):
            # (check's rule: a column that differs is a mismatch there)
            counts["inconsistent"] += max(lengths)
            continue
        for column in zip(*lists):
            out.append({c.rank: c for c in column})
    counts["rooted"] += len(rooted)
    return out


def _waited_late(rec: CollectiveRecord) -> bool:
    """Whether the rank called ``wait_tensor`` on a functional collective only once it
    had (about) completed: it spent under a twentieth of the duration in the wait, the
    rest doing other work. Its duration then ends at its wait, not at the collective's
    completion, and says nothing of when it arrived."""
    wait, duration = rec.wait_ns, rec.duration_ns
    return wait is not None and duration is not None and wait * 20 < duration


def _waits_for(last: int, match: Mapping[int, CollectiveRecord],
               durations: Mapping[int, int]) -> dict[int, int]:
    """The wait rank ``last`` caused each other rank of a matched collective: their
    duration less its own, at most the time they spent in ``wait_tensor`` (a
    functional collective's ``wait_ns``: a rank that worked between issuing and
    waiting was blocked only that long). If ``last`` itself waited late, its duration
    holds its own work after issuing, so the same difference is a lower bound (the
    caused wait may be up to the others' time blocked in ``wait_tensor``, which also
    holds the collective's own transfer): what is certain is charged
    (``checked["late_last"]`` counts such collectives)."""
    d_last = durations[last]
    waits = {}
    for r, d in durations.items():
        if r == last:
            continue
        blocked = match[r].wait_ns
        wait = d - d_last
        if blocked is not None:
            wait = min(wait, blocked)
        waits[r] = max(0, wait)
    return waits


def straggler_report(
    run: Run, context: Run | None = None,
) -> tuple[list[StragglerRow], list[RankWaits], dict[str, int]]:
    """Who arrived last at each matched collective and the wait it caused.

    Args:
        run: the run (or the steps of it) to report on.
        context: the whole run, when ``run`` holds some of its steps only: the waits
            a rank passed on (``passed_on_ns``) go back to where the group's ranks
            last met, which can be in a step before those selected.

    Returns:
        Rows per (step, module, phase, last rank), the rank's own lateness first
        (``wait_ns - passed_on_ns``), then the wait; per-rank totals, in the same
        order; counts of what was looked at.
    """
    checked: Counter[str] = Counter()
    per_key: dict[tuple[int | None, str, str], int] = Counter()
    acc: dict[tuple[int | None, str, str, int], dict[str, Any]] = {}
    per_rank: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    gc_before = _GcBefore(run)
    timed = _timed(run, checked)
    waited_before = (_WaitedBefore(context, _timed(context, Counter()))
                     if context is not None else _WaitedBefore(run, timed))
    # (last rank, waiting rank) -> when the waiting rank waited for it, on its clock:
    # collectives in flight together (DDP's buckets) wait for one late rank at once
    spells: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for match, last, waits in timed:
        wait = sum(waits.values())
        rec = match[last]
        d_last = rec.duration_ns or 0
        for r, w in waits.items():
            if w > 0:  # it waited until the last rank arrived: its end less d_last
                other = match[r]
                end = other.issued_ns + (other.duration_ns or 0) - d_last
                spells[(last, r)].append((end - w, end))
        key = (rec.step, rec.charged, rec.phase)
        per_key[key] += 1
        if wait <= 0:
            continue
        checked["with_wait"] += 1
        # what the last rank passed on: its own waits on other groups since these ranks
        # last met on this group, beyond each other rank's own
        own_waits = waited_before(rec)
        passed = sum(min(w, max(0, own_waits - waited_before(match[r])))
                     for r, w in waits.items() if w > 0) if own_waits else 0
        slot = acc.setdefault(
            (*key, last),
            {"times": 0, "wait": 0, "max": 0, "groups": set(), "seqs": [], "gc": 0,
             "passed": 0},
        )
        slot["times"] += 1
        slot["wait"] += wait
        slot["passed"] += passed
        slot["gc"] += gc_before(rec)
        slot["max"] = max(slot["max"], max(waits.values()))
        slot["groups"].add(rec.group)
        if rec.seq is not None:
            slot["seqs"].append(rec.seq)
        per_rank[last][0] += 1
        per_rank[last][2] += passed
    for (last, _r), times in spells.items():
        per_rank[last][1] += _covered(times)
    for counts_ in per_rank.values():  # (what it passed on is part of what it caused)
        counts_[2] = min(counts_[2], counts_[1])
    rows = [
        StragglerRow(
            step,
            fqn,
            phase,
            rank,
            s["times"],
            per_key[(step, fqn, phase)],
            s["wait"],
            s["max"],
            tuple(sorted(s["groups"])),
            tuple(sorted(s["seqs"])),
            s["gc"],
            s["passed"],
        )
        for (step, fqn, phase, rank), s in acc.items()
    ]
    # the rank's own lateness first: a rank late only for having waited for another
    # (on another group) comes after the one it waited for
    rows.sort(key=lambda r: (-(r.wait_ns - r.passed_on_ns), -r.wait_ns, _step_key(r.step),
                             r.fqn, r.phase, r.rank))
    gc_total: Counter[int] = Counter()
    for g in run.gc_pauses:
        gc_total[g.rank] += g.duration_ns
    ranks = sorted(
        (RankWaits(r, n, w, gc_total[r], passed) for r, (n, w, passed) in per_rank.items()),
        key=lambda x: (-(x.wait_ns - x.passed_on_ns), -x.wait_ns, x.rank),
    )
    counts = {
        "collectives": checked["collectives"],
        "with_wait": checked["with_wait"],
        "without_duration": checked["without_duration"],
        "inconsistent": checked["inconsistent"],
        "incomplete": checked["incomplete"],
        "point_to_point": checked["point_to_point"],
        "rooted": checked["rooted"],
        "late_wait": checked["late_wait"],
        "late_last": checked["late_last"],
    }
    return rows, ranks, counts


def _covered(spans: Sequence[tuple[int, int]]) -> int:
    """The time ``(start, end)`` spans cover, overlaps counted once.

    Example:
        >>> _covered([(0, 10), (5, 15), (20, 25)])
        20
    """
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _step_key(step: int | None) -> tuple[bool, int]:
    return (step is None, step if step is not None else 0)


def _timed(
    run: Run, checked: Counter[str]
) -> list[tuple[dict[int, CollectiveRecord], int, dict[int, int]]]:
    """The matched collectives of ``run`` whose ranks' durations say who came last:
    ``(match, last rank, the wait it caused each other rank)`` (``checked`` counts
    what was left out, and why)."""
    timed: list[tuple[dict[int, CollectiveRecord], int, dict[int, int]]] = []
    for match in matched_collectives(run, checked):
        members = next(iter(match.values())).group_ranks
        if members and len(match) < len(members):
            # (one rank's record alone too: the others' files are missing)
            checked["incomplete"] += 1
            continue
        if len(match) < 2:
            continue  # a group of one
        durations: dict[int, int] = {}
        for r, c in match.items():
            if c.duration_ns is not None:
                durations[r] = c.duration_ns
        if len(durations) < len(match):
            checked["without_duration"] += 1
            continue
        last = min(sorted(durations), key=durations.__getitem__)  # ties: lowest rank
        if any(_waited_late(c) for r, c in match.items() if r != last):
            # another rank waited for it only once it had completed: that rank's
            # duration holds its own work and may hide its being last
            checked["late_wait"] += 1
            continue
        checked["collectives"] += 1
        if _waited_late(match[last]):
            # its duration holds its own work: the waits charged are lower bounds
            checked["late_last"] += 1
        timed.append((match, last, _waits_for(last, match, durations)))
    return timed


class _GcBefore:
    """The garbage collector's time on a collective's rank between that rank's previous
    collective of the trace (or the start of its rank span) and its issue."""

    def __init__(self, run: Run) -> None:
        self._pauses: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
        for g in run.gc_pauses:
            self._pauses[(g.rank, g.trace_id)].append((g.start_ns, g.start_ns + g.duration_ns))
        self._issued: dict[tuple[int, str], list[int]] = {}
        if self._pauses:
            issued: dict[tuple[int, str], list[int]] = defaultdict(list)
            for c in run.collectives:
                if (c.rank, c.trace_id) in self._pauses:
                    issued[(c.rank, c.trace_id)].append(c.issued_ns)
            self._issued = {k: sorted(v) for k, v in issued.items()}
        self._starts = {k: rs.start_ns for k, rs in run.rank_steps.items()}
        self._charged: set[tuple[int, str, int]] = set()

    def __call__(self, rec: CollectiveRecord) -> int:
        key = (rec.rank, rec.trace_id)
        pauses = self._pauses.get(key)
        if not pauses:
            return 0
        issue = (rec.rank, rec.trace_id, rec.issued_ns)
        if issue in self._charged:  # another collective issued at the same instant
            return 0
        self._charged.add(issue)
        times = self._issued.get(key, [])
        i = bisect_left(times, rec.issued_ns)
        since = times[i - 1] if i > 0 else self._starts.get(key, -(1 << 62))
        return sum(
            max(0, min(end, rec.issued_ns) - max(start, since)) for start, end in pauses
        )


class _WaitedBefore:
    """A rank's own waits (at matched collectives, as the wait its last rank caused it)
    at collectives of other groups, issued between its previous collective of a
    collective's group (in any step: where the group's ranks last met; for the
    group's first, the start of the rank's step) and that collective."""

    def __init__(
        self, run: Run, timed: Iterable[tuple[dict[int, CollectiveRecord], int, dict[int, int]]]
    ) -> None:
        waited: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
        for match, _last, waits in timed:
            for r, w in waits.items():
                if w > 0:
                    waited[r].append((match[r].issued_ns, match[r].group, w))
        self._waited = {r: sorted(v) for r, v in waited.items()}
        self._times = {r: [t for t, _, _ in v] for r, v in self._waited.items()}
        issued: dict[tuple[int, str], list[int]] = defaultdict(list)
        if self._waited:
            for c in run.collectives:
                if c.rank in self._waited and c.group:
                    issued[(c.rank, c.group)].append(c.issued_ns)
        self._issued = {k: sorted(v) for k, v in issued.items()}
        self._starts = {k: rs.start_ns for k, rs in run.rank_steps.items()}

    def __call__(self, rec: CollectiveRecord) -> int:
        entries = self._waited.get(rec.rank)
        if not entries:
            return 0
        times = self._issued.get((rec.rank, rec.group), [])
        i = bisect_left(times, rec.issued_ns)
        if i > 0:
            since = times[i - 1]
        else:  # the group's first collective: since its step started
            start = self._starts.get((rec.rank, rec.trace_id))
            if start is None:
                return 0
            since = start - 1
        at = self._times[rec.rank]
        lo, hi = bisect_right(at, since), bisect_left(at, rec.issued_ns)
        return sum(w for _, group, w in entries[lo:hi] if group != rec.group)


# ------------------------------------------------------------------ step breakdown
def step_breakdown(run: Run) -> list[StepTime]:
    """Per rank and step: time in forward / backward / recompute module spans, outside
    modules, and in collectives.

    A module span's own time is its duration minus its child spans' (clipped
    at 0), so nested spans are counted once, for the innermost; the rank span's
    own time is the time outside any module. The module spans are read from
    :attr:`~commspan.analysis.records.Run.span_times` where the run kept them
    folded, from :attr:`~commspan.analysis.records.Run.module_spans` otherwise.
    """
    times = run.span_times if run.span_times is not None else SpanTimes.of(run.module_spans)
    phase_time, under = times.own, times.under
    comm: dict[tuple[int, str], int] = Counter()
    collector: dict[tuple[int, str], int] = Counter()
    for g in run.gc_pauses:
        collector[(g.rank, g.trace_id)] += g.duration_ns
    timed: set[tuple[int, str]] = set()
    for c in run.collectives:
        if c.duration_ns is not None:
            comm[(c.rank, c.trace_id)] += c.duration_ns
            timed.add((c.rank, c.trace_id))
    out = []
    for (rank, trace), rs in run.rank_steps.items():
        total = rs.duration_ns  # a step number used again: its uses added up
        phases = phase_time.get((rank, trace), Counter())
        out.append(
            StepTime(
                rank=rank,
                step=rs.step,
                total_ns=total,
                forward_ns=phases[semconv.Phase.FORWARD.value],
                backward_ns=phases[semconv.Phase.BACKWARD.value],
                recompute_ns=phases[semconv.Phase.RECOMPUTE.value],
                outside_ns=max(0, total - sum(under.get((rank, span), 0)
                                              for span in rs.span_ids)),
                collectives_ns=comm[(rank, trace)] if (rank, trace) in timed else None,
                gc_ns=collector[(rank, trace)],
            )
        )
    out.sort(key=lambda s: (s.rank, _step_key(s.step), s.total_ns))
    return out


def totals_by_rank(times: Iterable[StepTime]) -> Mapping[int, dict[str, int]]:
    """Sum :class:`StepTime` rows per rank (``collectives_ns`` counts timed steps only).
    Time outside steps (a trace without a step number: set-up in the mode before the
    first step) is left out when the rank has steps, so the means are per step."""
    times = list(times)
    stepped = {t.rank for t in times if t.step is not None}
    out: dict[int, dict[str, int]] = {}
    for t in times:
        if t.step is None and t.rank in stepped:
            continue
        slot = out.setdefault(
            t.rank,
            {"steps": 0, "total_ns": 0, "forward_ns": 0, "backward_ns": 0,
             "recompute_ns": 0, "outside_ns": 0, "collectives_ns": 0, "gc_ns": 0},
        )
        slot["steps"] += 1
        for name in ("total_ns", "forward_ns", "backward_ns", "recompute_ns", "outside_ns",
                     "gc_ns"):
            slot[name] += getattr(t, name)
        slot["collectives_ns"] += t.collectives_ns or 0
    return out
