"""Cross-rank consistency: did the ranks of each process group issue the same collectives?

Three questions, one function each, all over a :class:`~commspan.analysis.records.Run`:

- :func:`sequence_findings`: for every process group and step, the ranks of
  the group issued the same sequence of collectives (op, dtype, shape, reduce
  op). Ranks are matched by *position* within the step: the n-th collective
  of the group in step s on one rank against the n-th on another, so a rank
  that skipped tracing a step, or point-to-point ops interleaved on the group
  (files of schema 2 numbered them with the collectives), do not shift the
  comparison. The first
  divergence of each group is reported, with later steps that also diverge
  listed, never a cascade.
- :func:`p2p_findings`: each ``send`` from rank a to rank b on a group, in a
  step, matches the ``recv`` from a on b in order, with the same dtype and
  shape. Batched p2p (``batch_p2p``) and receives from any source are not
  checked (counted in ``checked["p2p_unchecked"]``).
- :func:`missing_findings`: a rank that wrote no span for a step others wrote
  (ranks expected: ``range(world_size)`` and every rank seen).
- :func:`hang_findings`: the ``commspan.hang`` records turned into "group G,
  seq N: ranks 0, 2, 3 are in X forward all_reduce; rank 1 never issued it",
  and, for a send or receive that did not complete, "rank 1 -> rank 2 #5:
  rank 1 is in X forward send to rank 2; rank 2 never issued the matching
  recv": the k-th send from a rank to a peer matches the peer's k-th receive
  from it (``commspan.p2p.seq``).
- :func:`untraced_findings`: ranks whose latest hang record is in a step that
  ``sample=`` leaves out, where nothing says what they wait in.
- :func:`unread_findings`: steps of a rank that a damaged line of its file may
  have held collectives of (:attr:`Run.unread`); that rank is left out of their
  comparisons (its collectives there are unknown, not different) and of the
  missing ranks, and a hang finding does not say it never issued an op its
  record of which such a step may have held (state ``unread``).

A step that a hang interrupted (a hang record, and a rank without its rank
span) is left to :func:`hang_findings`: its spans are incomplete by nature.

:func:`check_run` reads files and runs them all; :func:`check` does the same
on a :class:`Run` already loaded.

Example:
    >>> from commspan.analysis.check import check
    >>> from commspan.analysis.records import build_run
    >>> result = check(build_run([]))
    >>> result.ok, result.to_dict()["findings"], result.checked["groups"]
    (True, [], 0)
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from commspan import semconv
from commspan.analysis.records import (
    CollectiveRecord,
    HangRecord,
    RankStep,
    Run,
    RunPaths,
    Unread,
    differing_fields,
    field_value,
    load_run,
    p2p_pair,
    split_disagreement,
)
from commspan.analysis.unread import steps_words
from commspan.otlpjson.decode import DEFAULT_MAX_LINE_BYTES, ReadReport

__all__ = [
    "CheckResult",
    "Finding",
    "KIND_HANG",
    "KIND_MISMATCH",
    "KIND_MISSING",
    "KIND_UNREAD",
    "KIND_UNTRACED",
    "check",
    "check_run",
    "hang_findings",
    "interrupted_traces",
    "missing_findings",
    "p2p_findings",
    "sequence_findings",
    "unread_findings",
    "untraced_findings",
]

KIND_MISMATCH = "mismatch"
"""Ranks of a group issued different collectives at the same place."""
KIND_MISSING = "missing"
"""A rank wrote nothing for a step, or issued nothing on a group others used in a step."""
KIND_HANG = "hang"
"""A collective some ranks of a group issued and did not complete (from hang records,
or events that say its op raised: a backend's timeout, a peer that died)."""
KIND_UNTRACED = "untraced"
"""Ranks whose latest hang record is in a step ``sample=`` leaves out: nothing of the
step was recorded, so where they are in it (waiting, or not) is unknown."""

KIND_UNREAD = "unread"
"""A rank's collectives of a step are unknown: a damaged line of its file may have held
some of them (:mod:`commspan.analysis.unread`); the step was compared without that rank."""

_NOT_ISSUED = "not issued"
_NO_RECORD = "no record"  # a rank that wrote nothing at all: whether it issued it is unknown
_UNREAD = "unread"  # a damaged line may have held the rank's record of it: unknown too


@dataclass(frozen=True)
class Finding:
    """One thing ``check`` found.

    Attributes:
        kind: ``mismatch``, ``missing``, ``hang``, ``untraced`` or ``unread``.
        group: process group name (``None`` for a rank missing from a whole step).
        seq: the group's sequence number where it happened (``None`` if not at one).
        step: the step (``None`` outside steps or not at one).
        ranks: rank -> what that rank did there: ``op``, ``fqn``, ``phase``,
            ``seq`` and the fields that differ (``op`` ``None``: issued nothing there).
        message: one line saying it.
        details: more keys of the JSON form (``group_ranks``, ``fields``,
            ``steps``, ``later_steps``, ...).
    """

    kind: str
    group: str | None
    seq: int | None
    step: int | None
    ranks: Mapping[int, Mapping[str, Any]]
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``kind``, ``group``, ``seq``, ``step``, ``ranks`` (keys are
        rank numbers as strings), ``message``, then ``details`` (the ``counts`` of
        ``count_by_module`` keyed by rank numbers as strings too)."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "group": self.group,
            "seq": self.seq,
            "step": self.step,
            "ranks": {str(r): dict(v) for r, v in sorted(self.ranks.items())},
            "message": self.message,
        }
        out.update(self.details)
        if "count_by_module" in out:
            out["count_by_module"] = [
                {**entry, "counts": {str(r): n for r, n in entry["counts"].items()}}
                for entry in out["count_by_module"]]
        return out


@dataclass(frozen=True)
class CheckResult:
    """What :func:`check` found and how much it looked at.

    Attributes:
        findings: hangs first, then the others in step order.
        checked: counts: ``ranks``, ``groups``, ``steps`` (numbered steps looked
            at), ``outside_steps`` (traces outside steps looked at: a plain
            ``with mode:`` block, set-up, a checkpoint save),
            ``collectives`` (collectives compared), ``p2p`` (sends and receives
            matched), ``p2p_unchecked``, ``hang_records``, ``steps_interrupted``
            (steps a hang cut short, left out of the comparisons),
            ``outside_interrupted`` (the same of traces outside steps: a hang
            after the loop, in a plain ``with mode:`` block), ``unread`` (steps of
            a rank left out because a damaged line may have held their
            collectives, :func:`unread_findings`).
    """

    findings: list[Finding]
    checked: dict[str, int]

    @property
    def ok(self) -> bool:
        """``True`` when nothing was found."""
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        """``{"findings": [...], "checked": {...}}``, ready for ``json.dumps``."""
        return {"findings": [f.to_dict() for f in self.findings], "checked": dict(self.checked)}


# ------------------------------------------------------------------ entry points
def check_run(
    paths: RunPaths,
    *,
    steps: Iterable[int] | None = None,
    strict: bool = True,
    report: ReadReport | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    run: str | None = None,
) -> CheckResult:
    """Check the JSONL files of a run for cross-rank consistency (from their digests
    where every file has one, as :func:`~commspan.analysis.records.load_run` reads).

    Args:
        paths: the run's JSONL files (see :data:`~commspan.analysis.records.RunPaths`).
        steps: check only these step numbers; ``None`` checks every step.
        strict, report, max_line_bytes: how damaged and over-long lines are
            handled, as for :func:`~commspan.exporters.read_spans` (``strict=False``
            skips a damaged line, as ``commspan check`` does, and ``report``
            collects what was skipped).
        run: the run to read when the files hold several: as for
            :func:`~commspan.analysis.records.load_run` (default: the latest, with
            a warning; runs are never summed).

    Returns:
        The findings and what was checked.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: no path, a directory without ``*.jsonl`` files, a line that
            is not JSON and ``strict`` (the message names file and line), or bad
            ``steps`` (not ints, or none of them a step of the run).

    Example:
        >>> from commspan.analysis import check_run
        >>> result = check_run("commspan-out")  # doctest: +SKIP
        >>> for finding in result.findings:  # doctest: +SKIP
        ...     print(finding.message)
    """
    return check(load_run(paths, steps=steps, module_spans=False, strict=strict,
                          report=report, max_line_bytes=max_line_bytes, run=run))


def check(run: Run) -> CheckResult:
    """Run every check over ``run``; see the module docstring."""
    checked: Counter[str] = Counter()
    interrupted = interrupted_traces(run)
    others = [
        *missing_findings(run, skip=interrupted),
        *sequence_findings(run, skip=interrupted, checked=checked),
        *p2p_findings(run, skip=interrupted, checked=checked),
        *unread_findings(run),
    ]
    diverged = {f.group for f in others if f.group is not None}
    hangs = [*hang_findings(run, diverged=diverged), *untraced_findings(run)]
    order = {t: i for i, t in enumerate(run.traces())}
    others.sort(key=lambda f: (order.get(f.details.get("trace_id", ""), -1), f.kind))
    counts = {
        "ranks": len(run.expected_ranks()),
        # every group with a collective or a send or receive (sequence_findings
        # counts those with collectives)
        "groups": len({rec.group for rec in run.collectives if rec.group}),
        "steps": sum(1 for t in run.traces()
                     if t not in interrupted and run.trace_steps.get(t) is not None),
        # traces outside steps (a plain ``with mode:`` block, setup, checkpoints)
        "outside_steps": sum(1 for t in run.traces()
                             if t not in interrupted and run.trace_steps.get(t) is None),
        "collectives": checked["collectives"],
        "p2p": checked["p2p"],
        "p2p_unchecked": checked["p2p_unchecked"],
        "hang_records": len(run.hangs),
        # numbered steps; work outside steps some rank did not finish, apart
        "steps_interrupted": sum(1 for t in interrupted if run.trace_steps.get(t) is not None),
        "outside_interrupted": sum(1 for t in interrupted if run.trace_steps.get(t) is None),
        # (rank, step) pairs a damaged line may have held collectives of: not compared
        "unread": len(run.unread),
    }
    return CheckResult([*hangs, *others], counts)


def interrupted_traces(run: Run) -> set[str]:
    """Steps some rank never finished, whose spans are incomplete by nature: a rank
    wrote spans of the step but not its rank span, and either a hang record is in the
    step or the rank wrote nothing in a later step (it hung, died, was stopped in it,
    or is still in it); or a collective of the step failed on some rank (its op
    raised: a peer died, a backend timed out). Comparing them would call the
    collectives it had not yet reached a mismatch."""
    last: dict[int, int] = {}
    for trace, ranks in run.presence.items():
        step = run.trace_steps.get(trace)
        if step is not None:
            for r in ranks:
                if step > last.get(r, -1):
                    last[r] = step
    out = set()
    for trace, ranks in run.presence.items():
        step = run.trace_steps.get(trace)
        if step is not None and any(
            (r, trace) not in run.rank_steps and last.get(r) == step
            and (r, trace) not in run.unread for r in ranks
        ):
            out.add(trace)
    for h in run.hangs:
        present = run.presence.get(h.trace_id, set())
        if any((r, h.trace_id) not in run.rank_steps for r in present):
            out.add(h.trace_id)
    for rec in run.collectives:
        if rec.state == semconv.STATE_FAILED and run.trace_steps.get(rec.trace_id) is not None:
            out.add(rec.trace_id)  # its op raised: the rank's step was cut short there
    return out


# ------------------------------------------------------------------ untraced steps
def untraced_findings(run: Run) -> list[Finding]:
    """Ranks whose latest hang record was written in a step ``sample=`` leaves out
    (``commspan.hang.step_traced`` false): one finding per such step. Nothing of the
    step was recorded (no collective, no module), so the record cannot say whether
    the rank waits there; a hang in it is not ruled out, nor is it shown."""
    by_step: dict[str, list[HangRecord]] = defaultdict(list)
    for h in run.latest_hangs().values():
        if not h.step_traced:
            by_step[h.trace_id].append(h)
    findings = []
    for trace, records in by_step.items():
        records.sort(key=lambda h: h.rank)
        who = [h.rank for h in records]
        step = records[0].step
        reasons = sorted({h.reason for h in records})
        one = len(who) == 1
        message = (
            f"{_step_words(step)}: {_who(who)} wrote {'a hang record' if one else 'hang records'}"
            f" ({', '.join(reasons)}) in this step, which `sample=` does not trace: nothing "
            f"of it was recorded, so where {'it is' if one else 'they are'} in it is unknown "
            "(a hang there is neither shown nor ruled out; trace every step to see it)"
        )
        ranks = {h.rank: {"op": None, "fqn": None, "phase": None, "seq": None,
                          "state": "not traced", "hang_record": h.reason} for h in records}
        findings.append(Finding(KIND_UNTRACED, None, None, step, ranks, message,
                                {"trace_id": trace}))
    return findings


# ------------------------------------------------------------------ damaged lines
def unread_findings(run: Run) -> list[Finding]:
    """One finding per damaged line that may have held collectives of a rank
    (:attr:`Run.unread`): the steps it may have held, not compared for that rank (the
    other ranks of those steps are, with each other), and why the line was not read.
    A line of a file holding several ranks' lines may have been any of theirs: the
    finding names each rank it may have held collectives of, with its steps."""
    by_line: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for u in run.unread.values():
        by_line[(u.path, u.line)].append(u)
    order = {t: i for i, t in enumerate(run.traces())}
    findings = []
    for (path, line), items in by_line.items():
        items.sort(key=lambda u: (order.get(u.trace_id, -1), u.rank))
        first = items[0]
        per_rank: dict[int, list[int | None]] = defaultdict(list)
        for u in items:
            per_rank[u.rank].append(u.step)
        alike: dict[tuple[int | None, ...], list[int]] = defaultdict(list)
        for r in sorted(per_rank):
            alike[tuple(per_rank[r])].append(r)
        who = sorted(per_rank)
        several = " (the file holds lines of several ranks)" if len(who) > 1 else ""
        message = (
            f"{'; '.join(f'{_who(rs)}, {steps_words(st)}' for st, rs in alike.items())}"
            f": not compared: {path}:{line} is damaged ({first.reason}); it may have held "
            f"collectives of {_who(who)} there{several}, which are unknown (the other ranks "
            "were compared with each other)")
        ranks = {r: {"op": None, "fqn": None, "phase": None, "seq": None,
                     "state": "unread", "steps": per_rank[r]} for r in who}
        steps = list(dict.fromkeys(u.step for u in items))
        findings.append(Finding(
            KIND_UNREAD, None, None, first.step, ranks, message,
            {"steps": steps, "file": path, "line": line, "reason": first.reason,
             "trace_id": first.trace_id}))
    return findings


# ------------------------------------------------------------------ missing ranks
def missing_findings(run: Run, *, skip: Iterable[str] = ()) -> list[Finding]:
    """Ranks that wrote no span for a step other ranks wrote; one finding per set of
    missing ranks, listing the steps. A rank that stopped unfinished in an earlier
    step of ``skip`` (it hung or died there) is not missing from the later ones,
    unless another rank completed a collective with it in one (it was there: its
    records of that step were lost, a file cut by a kill while it was written)."""
    skipped = set(skip)
    expected = run.expected_ranks()
    # the step each rank stopped in, unfinished (it hung or died there: the hang
    # findings say so); its absence from the steps after it is no other finding
    stuck: dict[int, int] = {}
    for trace in skipped:
        step = run.trace_steps.get(trace)
        if step is not None:
            for r in run.presence.get(trace, ()):
                if (r, trace) not in run.rank_steps and step < stuck.get(r, step + 1):
                    stuck[r] = step
    alive = _seen_alive(run, stuck)
    by_missing: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for trace in run.traces():
        step = run.trace_steps.get(trace)
        if trace in skipped or step is None:
            continue  # traces outside steps need not exist on every rank
        present = run.presence.get(trace, set())
        missing = tuple(r for r in expected
                        if r not in present and (r, trace) not in run.unread
                        and not (r in stuck and step > stuck[r] and (r, trace) not in alive))
        if missing:
            by_missing[missing].append(trace)
    findings = []
    for missing, traces in by_missing.items():
        steps = [s for s in (run.trace_steps[t] for t in traces) if s is not None]
        # the ranks that wrote these steps (not every rank not missing: one that
        # stopped in an earlier step wrote none of them)
        wrote = [run.presence.get(t, set()) for t in traces]
        others = sorted(set.intersection(*wrote) or set.union(*wrote))
        ranks: dict[int, dict[str, Any]] = {}
        for r in missing:
            before = [
                s
                for t, s in run.trace_steps.items()
                if s is not None and s < steps[0] and r in run.presence.get(t, ())
            ]
            ranks[r] = {
                "op": None,
                "fqn": None,
                "phase": None,
                "seq": None,
                "last_step": max(before) if before else None,
            }
        what = f"step {steps[0]}" if len(steps) == 1 else f"steps {_list(steps)}"
        message = (
            f"{what}: {_who(missing)} wrote no span "
            f"({_who(others) if others else 'no rank'} did)"
        )
        findings.append(
            Finding(
                KIND_MISSING,
                None,
                None,
                steps[0],
                ranks,
                message,
                {"steps": steps, "trace_id": traces[0]},
            )
        )
    return findings


def _seen_alive(run: Run, stuck: Mapping[int, int]) -> set[tuple[int, str]]:
    """``(rank, trace)`` of the ranks of ``stuck`` (rank -> the step it stopped in,
    unfinished) that another rank completed a collective with in a later step: the
    rank was there, whatever its file says."""
    if not stuck:
        return set()
    first = min(stuck.values())
    members: dict[tuple[int, ...], frozenset[int]] = {}
    alive: set[tuple[int, str]] = set()
    for rec in run.collectives:
        if rec.state != semconv.STATE_COMPLETED or rec.step is None or rec.step <= first:
            continue
        group = members.get(rec.group_ranks)
        if group is None:
            group = members[rec.group_ranks] = frozenset(rec.group_ranks)
        for r, step in stuck.items():
            if rec.step > step and r != rec.rank and r in group:
                alive.add((r, rec.trace_id))
    return alive


# ------------------------------------------------------------------ collective sequences
def _members(records: Iterable[CollectiveRecord]) -> tuple[int, ...]:
    seen: Counter[tuple[int, ...]] = Counter(r.group_ranks for r in records if r.group_ranks)
    if seen:
        return seen.most_common(1)[0][0]
    return ()


def _order_key(rec: CollectiveRecord) -> tuple[int, int]:
    return (rec.seq if rec.seq is not None else 0, rec.issued_ns)


def sequence_findings(
    run: Run, *, skip: Iterable[str] = (), checked: Counter[str] | None = None
) -> list[Finding]:
    """The first divergence of each process group's collective sequences across its ranks.

    Args:
        run: the run's records.
        skip: trace ids to leave out (steps a hang interrupted).
        checked: counts to add to (``groups``, ``collectives``).
    """
    skipped = set(skip)
    counts = checked if checked is not None else Counter()
    table: dict[str, dict[str, dict[int, list[CollectiveRecord]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for rec in run.collectives:
        if rec.kind == semconv.KIND_P2P or not rec.group:
            continue
        table[rec.group][rec.trace_id][rec.rank].append(rec)
    order = {t: i for i, t in enumerate(run.traces())}
    findings = []
    for group in sorted(table):
        by_trace = table[group]
        members = _members(r for per in by_trace.values() for rs in per.values() for r in rs)
        if not members:
            members = tuple(sorted({r for per in by_trace.values() for r in per}))
        counts["groups"] += 1

        def problems(
            group: str = group, by_trace: Any = by_trace, members: tuple[int, ...] = members
        ) -> Iterator[tuple[str, Finding | None]]:
            for trace in sorted(by_trace, key=lambda t: order.get(t, -1)):
                if trace in skipped:
                    continue
                present = run.presence.get(trace, set())
                per_rank = {
                    r: sorted(by_trace[trace].get(r, []), key=_order_key)
                    for r in members
                    if r in present and (r, trace) not in run.unread
                }
                counts["collectives"] += sum(len(v) for v in per_rank.values())
                yield trace, _compare(run, group, members, trace, per_rank)

        finding = _first_with_later_steps(run, problems())
        if finding is not None:
            findings.append(finding)
    return findings


def _first_with_later_steps(
    run: Run, problems: Iterable[tuple[str, Finding | None]]
) -> Finding | None:
    """The first problem of a group (or pair of ranks), traces in run order; the steps
    of the traces with a problem after it go to ``details["later_steps"]``."""
    first: Finding | None = None
    later: list[int | None] = []
    for trace, problem in problems:
        if problem is None:
            continue
        if first is None:
            first = problem
        else:
            later.append(run.trace_steps.get(trace))
    if first is None:
        return None
    return dataclasses.replace(first, details={**first.details, "later_steps": later})


def _num(rec: CollectiveRecord) -> int | None:
    """A point-to-point op's number per peer (schema 3), else its ``seq``."""
    return rec.p2p_seq if rec.p2p_seq is not None else rec.seq


def _num_words(rec: CollectiveRecord) -> str:
    """``seq N`` of a collective, ``p2p_seq N`` of a point-to-point op numbered per peer."""
    return f"seq {rec.seq}" if rec.p2p_seq is None else f"p2p_seq {rec.p2p_seq}"


def _entry(rec: CollectiveRecord, fields: Iterable[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"op": rec.op, "fqn": rec.fqn, "phase": rec.phase, "seq": rec.seq}
    if rec.owner is not None:
        out["owner"] = rec.owner
    if rec.p2p_seq is not None:
        out["p2p_seq"] = rec.p2p_seq
    if rec.tag is not None:
        out["tag"] = rec.tag
    for name in fields:
        if name not in ("op", "count"):  # a count is the step's, not a field of the record
            out[name] = field_value(rec, name)
    return out


def _absent(last: CollectiveRecord | None) -> dict[str, Any]:
    out: dict[str, Any] = {"op": None, "fqn": None, "phase": None, "seq": None}
    if last is not None:
        out["last_seen"] = _entry(last)
    return out


def _compare(
    run: Run,
    group: str,
    members: tuple[int, ...],
    trace: str,
    per_rank: dict[int, list[CollectiveRecord]],
) -> Finding | None:
    step = run.trace_steps.get(trace)
    where = _step_words(step)
    label = _group_label(group, members)
    # ranks whose step an exception left (its rank span's error): why they issued less
    errors = {r: ended for r in per_rank
              if (ended := run.rank_steps.get((r, trace))) is not None
              and ended.error is not None}
    empty = [r for r, recs in per_rank.items() if not recs]
    if empty and len(empty) < len(per_rank):
        issuing = {r: recs for r, recs in per_rank.items() if recs}
        ranks: dict[int, dict[str, Any]] = {r: _entry(recs[0]) for r, recs in issuing.items()}
        for r in empty:
            ranks[r] = _absent(_last_before(run, r, group, trace))
        _add_errors(ranks, errors)
        firsts = [recs[0] for recs in issuing.values()]
        head = firsts[0]
        counts = sorted({len(v) for v in issuing.values()})
        seq = _common([f.seq for f in firsts])
        left = "".join(f"; {_who([r])} left the step on an error, {_error_words(e)}"
                       for r, e in sorted(errors.items()) if r in empty)
        message = (
            f"{label}, {where}: {_who(empty)} issued no collective on the group; "
            f"{_who(sorted(issuing))} issued {_list(counts)}, the first {head.op} in "
            f"{head.where()} (seq {seq}){left}"
        )
        return Finding(
            KIND_MISSING,
            group,
            seq,
            step,
            ranks,
            message,
            {"group_ranks": list(members), "fields": ["count"], "trace_id": trace},
        )
    longest = max((len(v) for v in per_rank.values()), default=0)
    for i in range(longest):
        at = {r: (recs[i] if i < len(recs) else None) for r, recs in per_rank.items()}
        present = [rec for rec in at.values() if rec is not None]
        fields = differing_fields(present)
        if len(present) == len(at) and not fields:
            continue
        if len(present) < len(at):
            fields = ["count", *fields]
        ranks = {}
        for r, rec in at.items():
            ranks[r] = _entry(rec, fields) if rec is not None else _absent(per_rank[r][-1])
        _add_errors(ranks, errors)
        seq = _common([rec.seq for rec in present])
        parts = []
        for text, who in _grouped(at, fields, errors).items():
            parts.append(f"{_who(who)} {text}")
        message = f"{label}, {where}, seq {seq}: {_differ(fields)}: " + "; ".join(parts)
        if "splits" in fields:
            message += _splits_words(present)
        details: dict[str, Any] = {"group_ranks": list(members), "fields": fields,
                                   "trace_id": trace}
        if "count" in fields:
            by_module = _counts_by_module(per_rank)
            details["count_by_module"] = by_module
            message += _count_by_module_words(by_module)
        return Finding(KIND_MISMATCH, group, seq, step, ranks, message, details)
    return None


def _counts_by_module(per_rank: Mapping[int, Sequence[CollectiveRecord]]) -> list[dict[str, Any]]:
    """Where the ranks' counts of a step differ, per module and phase that issued them
    (in the order first issued): ``[{"fqn", "phase", "counts": {rank: n}}]``. Matching
    by position says only that some rank issued more; an extra collective early in the
    step shifts every later one, so the position where the sequences part is at the
    step's end, while the module that issued one more (or fewer) is where it was."""
    tallies = {r: Counter((rec.fqn, rec.phase) for rec in recs) for r, recs in per_rank.items()}
    keys = list(dict.fromkeys((rec.fqn, rec.phase)
                              for recs in per_rank.values()
                              for rec in sorted(recs, key=_order_key)))
    out = []
    for fqn, phase in keys:
        counts = {r: tallies[r][(fqn, phase)] for r in sorted(per_rank)}
        if len(set(counts.values())) > 1:
            out.append({"fqn": fqn, "phase": phase, "counts": counts})
    return out


def _count_by_module_words(by_module: Sequence[Mapping[str, Any]], shown: int = 3) -> str:
    """``; the counts differ in `Net.a` forward (rank 2: 1, rank 3: 2)``."""
    if not by_module:
        return ""
    texts = []
    for entry in by_module[:shown]:
        groups: dict[int, list[int]] = {}
        for r, n in entry["counts"].items():
            groups.setdefault(n, []).append(r)
        each = ", ".join(f"{_who(who)}: {n}" for n, who in groups.items())
        module = f"`{entry['fqn']}` {entry['phase']}" if entry["fqn"] else "no module"
        texts.append(f"{module} ({each})")
    more = len(by_module) - shown
    tail = f" and {more} more" if more > 0 else ""
    return "; the counts differ in " + ", ".join(texts) + tail


def _describe(rec: CollectiveRecord, fields: Iterable[str]) -> str:
    bits = [rec.op]
    for name in fields:
        if name in ("op", "count"):
            continue
        value = field_value(rec, name)
        if name == "shape":
            bits.append("[" + ", ".join(map(str, value)) + "]" if value is not None else "[?]")
        elif name == "reduce_op":
            bits.append(f"({value})")
        elif name == "root_rank":
            bits.append(f"with root rank {value}" if value is not None else "(root unknown)")
        elif name == "splits":
            bits.append(f"sending {value['input']}, receiving {value['output']}"
                        if value is not None else "(splits unknown)")
        else:
            bits.append(str(value))
    return f"issued {' '.join(bits)} in {rec.where()}"


def _grouped(
    at: Mapping[int, CollectiveRecord | None], fields: Sequence[str],
    errors: Mapping[int, RankStep] | None = None,
) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r, rec in sorted(at.items()):
        if rec is not None:
            text = _describe(rec, fields)
        elif errors and r in errors:
            text = f"issued nothing more in the step: it left it on an error, " \
                   f"{_error_words(errors[r])}"
        else:
            text = "issued nothing more in the step"
        out.setdefault(text, []).append(r)
    return out


def _last_before(run: Run, rank: int, group: str, trace: str) -> CollectiveRecord | None:
    order = {t: i for i, t in enumerate(run.traces())}
    limit = order.get(trace, 0)
    best = None
    for rec in run.collectives:
        if rec.rank == rank and rec.group == group and order.get(rec.trace_id, -1) < limit:
            if best is None or _order_key(rec) > _order_key(best):
                best = rec
    return best


# ------------------------------------------------------------------ point-to-point
def p2p_findings(
    run: Run, *, skip: Iterable[str] = (), checked: Counter[str] | None = None
) -> list[Finding]:
    """Sends without their receive (or the reverse), or with another dtype or shape;
    the first per group and ordered pair of ranks.

    A rank that received from any source, or sent or received in a batch
    (``batch_isend_irecv``), in a group and trace has p2p ops whose peer or
    direction is unknown: the pairs it is part of there are not compared (they
    count as ``p2p_unchecked``), since any of their sends may be one of those
    receives."""
    skipped = set(skip)
    counts = checked if checked is not None else Counter()
    sends: dict[tuple[str, int, int], dict[str, list[CollectiveRecord]]] = defaultdict(
        lambda: defaultdict(list)
    )
    recvs: dict[tuple[str, int, int], dict[str, list[CollectiveRecord]]] = defaultdict(
        lambda: defaultdict(list)
    )
    # (group, rank, trace) -> the peers an op of unknown direction or source there may
    # have received from (None: any) or sent to
    maybe_recv: dict[tuple[str, int, str], set[int] | None] = {}
    maybe_send: dict[tuple[str, int, str], set[int]] = {}
    for rec in run.collectives:
        if rec.kind != semconv.KIND_P2P:
            continue
        peer = rec.peer
        if rec.op == "send" and isinstance(peer, int) and peer >= 0:
            sends[(rec.group, rec.rank, peer)][rec.trace_id].append(rec)
        elif rec.op == "recv" and isinstance(peer, int) and peer >= 0:
            recvs[(rec.group, peer, rec.rank)][rec.trace_id].append(rec)
        else:
            counts["p2p_unchecked"] += 1
            where = (rec.group, rec.rank, rec.trace_id)
            peers = _peers(peer)
            if rec.op == "recv" or peers is None:  # a receive from any source
                maybe_recv[where] = None
            else:  # batched: each peer's op a send or a receive
                could = maybe_recv.setdefault(where, set())
                if could is not None:  # (None: any source already)
                    could.update(peers)
                maybe_send.setdefault(where, set()).update(peers)
    order = {t: i for i, t in enumerate(run.traces())}
    findings = []
    for key in sorted(set(sends) | set(recvs)):

        def problems(key: tuple[str, int, int] = key) -> Iterator[tuple[str, Finding | None]]:
            group, src, dst = key
            traces = set(sends[key]) | set(recvs[key])
            for trace in sorted(traces, key=lambda t: order.get(t, -1)):
                present = run.presence.get(trace, set())
                if trace in skipped or src not in present or dst not in present \
                        or (src, trace) in run.unread or (dst, trace) in run.unread:
                    continue
                s = sorted(sends[key].get(trace, []), key=_order_key)
                r = sorted(recvs[key].get(trace, []), key=_order_key)
                into = (group, dst, trace)
                could = maybe_recv.get(into, set())
                if could is None or src in could or dst in maybe_send.get((group, src, trace), ()):
                    counts["p2p_unchecked"] += len(s) + len(r)
                    continue
                counts["p2p"] += len(s) + len(r)
                yield trace, _compare_p2p(run, group, src, dst, trace, s, r)

        finding = _first_with_later_steps(run, problems())
        if finding is not None:
            findings.append(finding)
    return findings


def _peers(peer: Any) -> set[int] | None:
    """The ranks a p2p op's ``peer`` attribute names; ``None`` when unknown."""
    if isinstance(peer, int) and not isinstance(peer, bool) and peer >= 0:
        return {peer}
    if isinstance(peer, (list, tuple)):
        found = {p for p in peer if isinstance(p, int) and not isinstance(p, bool) and p >= 0}
        return found if len(found) == len(peer) else None
    return None


def _compare_p2p(
    run: Run,
    group: str,
    src: int,
    dst: int,
    trace: str,
    sends: list[CollectiveRecord],
    recvs: list[CollectiveRecord],
) -> Finding | None:
    step = run.trace_steps.get(trace)
    members = _members([*sends, *recvs])
    where = f"{_group_label(group or '?', members)}, {_step_words(step)}"
    for i in range(max(len(sends), len(recvs))):
        s = sends[i] if i < len(sends) else None
        r = recvs[i] if i < len(recvs) else None
        if s is not None and r is not None:
            fields = [
                name
                for name in ("dtype", "shape")
                if field_value(s, name) is not None
                and field_value(r, name) is not None
                and field_value(s, name) != field_value(r, name)
            ]
            if not fields:
                continue
            ranks = {src: _entry(s, fields), dst: _entry(r, fields)}
            message = (
                f"{where}, {_num_words(s)}: {_differ(fields)}: rank {src} "
                f"{_describe(s, fields)} to rank {dst}; rank {dst} "
                f"{_describe(r, fields)} from rank {src}"
            )
            seq = _num(s)
        else:
            fields = ["count"]
            if s is not None:
                ranks = {src: _entry(s), dst: _absent(recvs[-1] if recvs else None)}
                message = (
                    f"{where}, {_num_words(s)}: rank {src} sent {len(sends)} to rank {dst}, "
                    f"rank {dst} received {len(recvs)} from rank {src}: the send in "
                    f"{s.where()} has no matching recv"
                )
                seq = _num(s)
            else:
                assert r is not None
                ranks = {src: _absent(sends[-1] if sends else None), dst: _entry(r)}
                message = (
                    f"{where}, {_num_words(r)}: rank {dst} received {len(recvs)} from rank {src}, "
                    f"rank {src} sent {len(sends)} to rank {dst}: the recv in {r.where()} "
                    "has no matching send"
                )
                seq = _num(r)
        details: dict[str, Any] = {"group_ranks": list(members), "fields": fields, "src": src,
                                   "dst": dst, "trace_id": trace}
        first = s if s is not None else r
        if first is not None and first.p2p_seq is not None:  # numbered per peer (schema 3)
            details["p2p"] = {"sender": src, "receiver": dst, "p2p_seq": first.p2p_seq}
        return Finding(KIND_MISMATCH, group, seq, step, ranks, message, details)
    return None


# ------------------------------------------------------------------ hangs
def hang_findings(run: Run, *, diverged: Iterable[str] | None = None) -> list[Finding]:
    """For each group a hang record shows stuck, or where a collective's op raised on
    some rank (``commspan.collective.state`` ``failed`` on its event: a backend's
    timeout, a peer that died): the lowest sequence number some rank issued and had
    not completed, and what every rank of the group was doing; for each
    send or receive not completed or failed, what its peer did about the matching op
    (a step with an op that failed is left out of the comparisons: these findings are
    what reports it). Findings
    that name a rank waiting on nothing come first (a rank that never issued its part
    because it is itself blocked is rarely the cause).

    ``diverged``: the groups :func:`check`'s other findings name (a mismatch in an
    earlier step), which a rank that ended the step without the op is referred to;
    ``None``: not known, and it is referred to them as if there were some."""
    latest = run.latest_hangs()
    failed = [rec for rec in run.collectives
              if rec.state == semconv.STATE_FAILED and rec.group and not _per_peer(rec)]
    failed_p2p = [rec for rec in run.collectives
                  if rec.state == semconv.STATE_FAILED and _per_peer(rec)]
    if not latest and not failed and not failed_p2p:
        return []
    latest = _superseded_dropped(run, latest)
    from_hangs: dict[str, dict[int, list[CollectiveRecord]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for h in latest.values():
        for rec in h.collectives:
            if rec.group and not _per_peer(rec):  # point-to-point ops: below
                from_hangs[rec.group][h.rank].append(rec)
    for rec in failed:  # its op raised (a backend's timeout), with or without a record
        from_hangs[rec.group][rec.rank].append(rec)
    errors = _errors_by_rank(run)
    exported: dict[tuple[str, int], list[CollectiveRecord]] = defaultdict(list)
    last_any: dict[int, CollectiveRecord] = {}
    for rec in run.collectives:
        exported[(rec.group, rec.rank)].append(rec)
        if rec.rank not in last_any or rec.issued_ns >= last_any[rec.rank].issued_ns:
            last_any[rec.rank] = rec
    findings = []
    for group in sorted(from_hangs):
        per_rank = from_hangs[group]
        pending = [
            rec.seq
            for recs in per_rank.values()
            for rec in recs
            if rec.state != semconv.STATE_COMPLETED and rec.seq is not None
        ]
        if not pending:
            continue
        seq = min(pending)
        members = _members(rec for recs in per_rank.values() for rec in recs) or tuple(
            sorted(per_rank)
        )
        findings.append(
            _hang_finding(run, group, seq, members, per_rank, exported, last_any, latest,
                          diverged=None if diverged is None else group in set(diverged),
                          errors=errors)
        )
    findings.extend(_p2p_hang_findings(run, latest, last_any, failed_p2p, errors))
    findings = _deadlocks(findings, latest, last_any)
    # a rank that is itself stuck waiting is rarely the cause: findings that name a
    # rank that never issued its part and waits on nothing come first
    findings.sort(key=lambda f: (not f.details.get("root", True),
                                 f.details.get("issued_ns", 0)))
    return findings


def _blocked_in(r: int, hang: HangRecord | None,
                last_any: Mapping[int, CollectiveRecord]) -> tuple[Any, ...] | None:
    """What rank ``r`` is blocked in (:func:`_waited_on`): the oldest op its hang
    record shows not completed, else its last exported op when that failed (as
    :func:`_waits_in` and :func:`_blocked_by_failure` say it); ``None`` when it is
    blocked in none."""
    stuck = _stuck_in(hang)
    if stuck is not None:
        return _waited_on(stuck, r)
    if _blocked_by_failure(r, hang, last_any):
        return _waited_on(last_any[r], r)
    return None


def _stuck_in(hang: HangRecord | None) -> CollectiveRecord | None:
    """The op a hang record shows its rank blocked in: the oldest it shows not
    completed, but a send only when nothing else is pending (gloo reports an ``isend``
    never waited on as not completed whatever became of it: a rank that posted one and
    went on is blocked in what it issued next). ``None`` when it waits in none."""
    stuck = [c for c in (hang.collectives if hang is not None else ())
             if c.state != semconv.STATE_COMPLETED]
    if not stuck:
        return None
    others = [c for c in stuck if c.op != "send"]
    return min(others or stuck, key=lambda c: c.issued_ns)


def _waited_on(rec: CollectiveRecord, rank: int) -> tuple[Any, ...] | None:
    """What a hang finding is about, as a rank blocked in op ``rec`` waits on it: a
    group's collectives (``("group", G)``), or one send or receive numbered per peer
    (``("p2p", G, sender, receiver, number)``)."""
    if _per_peer(rec):
        if not isinstance(rec.peer, int) or rec.op not in _P2P_MATCH:
            return None
        sender, receiver = p2p_pair(rec.op, rank, rec.peer)
        return ("p2p", rec.group, sender, receiver, rec.p2p_seq)
    return ("group", rec.group) if rec.group else None


def _finding_key(f: Finding) -> tuple[Any, ...] | None:
    """:func:`_waited_on` of the op hang finding ``f`` is about; ``None`` for a send or
    receive without a number per peer (a receive from any source), which no rank's
    wait names."""
    p2p = f.details.get("p2p")
    if p2p is not None:
        return ("p2p", f.group, p2p["sender"], p2p["receiver"], p2p["p2p_seq"])
    if f.seq is None:  # (_unmatched_p2p_finding: no sequence number in its group)
        return None
    return ("group", f.group)


def _deadlocks(findings: list[Finding], latest: Mapping[int, HangRecord],
               last_any: Mapping[int, CollectiveRecord]) -> list[Finding]:
    """Mark the collectives' hang findings that wait on each other in a cycle: the
    ranks that never issued a group's op are blocked in another group's, whose missing
    ranks are blocked, in the end, in the first (a subgroup only some of its ranks
    entered, two groups entered in another order, a send whose receiver skipped the
    receive and waits in a collective the sender never reaches). Each such finding
    names a rank
    that waits in another op, which alone would make it no cause (``root`` false) and
    list it after the findings it waits for; in a cycle nothing else is the cause:
    they are the root (``root`` true, a ``deadlock`` key with the cycle's groups and
    ranks) and say so, and come first."""
    by_key = {key: i for i, f in enumerate(findings)
              if f.kind == KIND_HANG and (key := _finding_key(f)) is not None}
    edges: dict[int, set[int]] = {}
    for i, f in enumerate(findings):
        targets = set()
        for r in f.details.get("never_issued", ()) if f.kind == KIND_HANG else ():
            key = _blocked_in(r, latest.get(r), last_any)
            if key is not None and key in by_key and by_key[key] != i:
                targets.add(by_key[key])
        edges[i] = targets

    def reach(i: int) -> set[int]:
        seen: set[int] = set()
        todo = list(edges[i])
        while todo:
            j = todo.pop()
            if j not in seen:
                seen.add(j)
                todo.extend(edges[j])
        return seen

    reached = {i: reach(i) for i in edges}
    in_cycle = [i for i in edges if i in reached[i]]
    if not in_cycle:
        return findings
    out = list(findings)
    for i in in_cycle:
        cycle = sorted(j for j in reached[i] if i in reached[j])
        groups = list(dict.fromkeys(findings[j].group for j in cycle))
        ranks = sorted({r for j in cycle for r in findings[j].details["never_issued"]})
        f = findings[i]
        details = dict(f.details)
        details.update(root=True, deadlock={"groups": groups, "ranks": ranks})
        out[i] = dataclasses.replace(
            f, details=details,
            message=f"{f.message}; a deadlock: ranks {_list(ranks)} wait for each other "
                    f"on group{'s' if len(groups) > 1 else ''} "
                    f"{', '.join(str(g) for g in groups)}")
    return out


def _superseded_dropped(run: Run, latest: Mapping[int, HangRecord]) -> dict[int, HangRecord]:
    """The hang records, less the collectives they list as not completed that are known
    to have completed: a record written while a collective was slow (a straggler
    longer than ``hang_timeout_s``, a ``mode.dump()`` during a wait) says nothing of a
    hang once the collective completed. Known completed: the same rank's spans,
    written later, show it completed; or (a collective without a root) some rank of
    its group completed the same op at that sequence number, which none can before
    every rank took part (a rank other than the root of a gather, a broadcast, ...
    can: its part done, the root may still wait; another op at that number is a
    mismatch, not a completion); or the same rank
    completed a later collective on the same group; or (a send or receive numbered
    per peer) the peer completed the matching receive or send, the one of the same
    number and tag (a send never waited on, whose ``Work`` gloo reports completed only
    once waited; gloo matches by peer and tag). A collective whose
    op failed is kept: its failure is what the finding reports."""
    done: set[tuple[Any, ...]] = set()
    # (rank, group, op, peer, p2p_seq, tag) of a send or receive completed: gloo
    # matches by peer and tag, so the peer's op of another tag is not the match
    done_p2p: set[tuple[Any, ...]] = set()
    anywhere: set[tuple[str, int, str]] = set()  # (group, seq, op) some rank completed
    upto: dict[tuple[int, str], int] = {}  # (rank, group) -> highest seq it completed
    last_issued: dict[int, int] = {}

    def completed(rec: CollectiveRecord) -> None:
        done.add(_op_key(rec))
        if rec.p2p_seq is not None:
            done_p2p.add((*_op_key(rec), rec.tag))
        if rec.p2p_seq is None and rec.seq is not None and rec.group:
            if rec.op not in semconv.ROOTED_OPS:
                anywhere.add((rec.group, rec.seq, rec.op))
            key = (rec.rank, rec.group)
            if rec.seq > upto.get(key, -1):
                upto[key] = rec.seq

    for rec in run.collectives:
        if rec.duration_ns is not None or rec.state == semconv.STATE_COMPLETED:
            completed(rec)
        if rec.issued_ns > last_issued.get(rec.rank, -1):
            last_issued[rec.rank] = rec.issued_ns
    for hang in latest.values():
        for rec in hang.collectives:
            if rec.state == semconv.STATE_COMPLETED:
                completed(rec)

    def superseded(rec: CollectiveRecord) -> bool:
        if rec.state == semconv.STATE_COMPLETED or rec.state == semconv.STATE_FAILED:
            return False
        if _op_key(rec) in done:
            return True
        if rec.p2p_seq is not None:
            # its peer completed the matching op (same number, same tag): the pair's
            # data went across, so this side is done too (gloo's send says so only
            # once waited on)
            return (rec.op in _P2P_MATCH and isinstance(rec.peer, int)
                    and (rec.peer, rec.group, _P2P_MATCH[rec.op], rec.rank,
                         rec.p2p_seq, rec.tag) in done_p2p)
        if rec.seq is None or not rec.group:
            return False
        return ((rec.group, rec.seq, rec.op) in anywhere
                or rec.seq < upto.get((rec.rank, rec.group), -1))

    out: dict[int, HangRecord] = {}
    for rank, hang in latest.items():
        kept = [rec for rec in hang.collectives if not superseded(rec)]
        if len(kept) == len(hang.collectives):
            out[rank] = hang
            continue
        if not any(rec.state != semconv.STATE_COMPLETED for rec in kept) and \
                last_issued.get(rank, -1) > hang.time_ns:
            continue  # the rank went on past it: what it says of the rank is out of date
        out[rank] = hang._replace(collectives=tuple(kept))
    return out


def _op_key(rec: CollectiveRecord) -> tuple[Any, ...]:
    """What names one collective (or point-to-point op) of one rank across its spans
    and its hang records."""
    if rec.p2p_seq is not None:
        return (rec.rank, rec.group, rec.op, rec.peer, rec.p2p_seq)
    if _per_peer(rec):  # no number at all (a receive from any source): its issue time
        return (rec.rank, rec.group, rec.op, rec.peer, None, rec.issued_ns)
    return (rec.rank, rec.group, rec.seq)


def _p2p_hang_findings(
    run: Run, latest: Mapping[int, HangRecord], last_any: Mapping[int, CollectiveRecord],
    failed: Sequence[CollectiveRecord] = (),
    errors: Mapping[int, Sequence[tuple[int, RankStep]]] | None = None,
) -> list[Finding]:
    """Each send or receive a hang record shows not completed, or whose op raised
    (``failed``: its peer died, the backend timed out; with or without a record),
    against its peer: the matching op there has the same number per peer and
    direction (``p2p_seq``), so a stalled pipeline stage is named by the stages
    waiting for it."""
    known: dict[int, dict[tuple[str, str, int, int, int | None], CollectiveRecord]] = \
        defaultdict(dict)
    for rec in run.collectives:
        if rec.p2p_seq is not None and isinstance(rec.peer, int):
            known[rec.rank][(rec.group, rec.op, rec.peer, rec.p2p_seq, rec.tag)] = rec
    waiting: dict[int, list[CollectiveRecord]] = defaultdict(list)
    for h in latest.values():
        for rec in h.collectives:
            if rec.state != semconv.STATE_COMPLETED:
                waiting[h.rank].append(rec)
            if rec.p2p_seq is not None and isinstance(rec.peer, int):
                known[h.rank][(rec.group, rec.op, rec.peer, rec.p2p_seq, rec.tag)] = rec
    from_record = {_op_key(w) for recs in waiting.values() for w in recs}
    for rec in failed:  # its op raised: reported as a hang record's pending op is
        if _op_key(rec) not in from_record:
            waiting[rec.rank].append(rec)
    findings = []
    for r in sorted(waiting):
        for rec in waiting[r]:
            # the record that shows it pending (none for a failed op only the spans show)
            hang = latest.get(r) if _op_key(rec) in from_record else None
            if not _per_peer(rec):
                continue  # a collective, or schema 2: the group's path
            if not isinstance(rec.peer, int) or rec.op not in _P2P_MATCH or (
                    rec.p2p_seq is None):
                findings.append(_unmatched_p2p_finding(rec, r, hang))
                continue
            peer = rec.peer
            sender, receiver = p2p_pair(rec.op, r, peer)
            # the matching op: the same number per peer and the same tag
            match = known[peer].get((rec.group, _P2P_MATCH[rec.op], r, rec.p2p_seq, rec.tag))
            if rec.op == "recv" and any(
                    w.op == "send" and w.peer == r and w.group == rec.group
                    and w.p2p_seq == rec.p2p_seq and w.tag == rec.tag
                    for w in waiting.get(peer, ())):
                continue  # both waiting: reported once, from the sender's record
            findings.append(_p2p_hang_finding(
                run, rec, r, hang, peer, match, sender, receiver, latest, known, last_any,
                errors if errors is not None else {}))
    return findings


def _per_peer(rec: CollectiveRecord) -> bool:
    """A point-to-point op, checked against its peer rather than in its group's
    sequence: one numbered per peer (schema 3), or one without a number in its group
    (a receive from any source, which has no number per peer either)."""
    return rec.p2p_seq is not None or (rec.kind == semconv.KIND_P2P and rec.seq is None)


_P2P_MATCH = {"send": "recv", "recv": "send"}
_P2P_TO = {"send": "to", "recv": "from"}


def _p2p_hang_finding(
    run: Run, rec: CollectiveRecord, r: int, hang: HangRecord | None, peer: int,
    match: CollectiveRecord | None, sender: int, receiver: int,
    latest: Mapping[int, HangRecord],
    known: Mapping[int, Mapping[tuple[str, str, int, int, int | None], CollectiveRecord]],
    last_any: Mapping[int, CollectiveRecord],
    errors: Mapping[int, Sequence[tuple[int, RankStep]]],
) -> Finding:
    other = _P2P_MATCH[rec.op]
    entry = _waiting_entry(rec, hang, peer)
    tag = f" (tag {rec.tag})" if rec.tag is not None else ""
    parts = [_in_op(r, rec, f"{rec.op} {_P2P_TO[rec.op]} rank {peer}{tag}")]
    peer_hang = latest.get(peer)
    peer_entry: dict[str, Any]
    never: list[int] = []
    nothing: list[int] = []  # (the peer) wrote nothing at all
    untraced: list[int] = []
    unread: list[int] = []  # (the peer) its record of it may be in a damaged line
    root = True
    if match is not None:
        peer_entry = _entry(match)
        peer_entry.update(state=match.state, peer=r, p2p_seq=match.p2p_seq)
        if match.state == semconv.STATE_COMPLETED:
            parts.append(f"rank {peer} completed the matching {other} in {match.where()}")
        else:
            parts.append(_in_op(peer, match, f"{other} {_P2P_TO[other]} rank {r}"))
            root = False
    elif peer_hang is None and run.left_out(peer):
        untraced.append(peer)
        peer_entry = {"op": None, "fqn": None, "phase": None, "seq": None,
                      "state": "not traced"}
        parts.append(f"rank {peer} is not traced ({run.sample_rule}): unknown")
    elif lost := _unread_since(run, peer, peer_hang, max(
            (m for k, m in known.get(peer, {}).items()
             if k[:3] == (rec.group, other, r) and m.rank == peer),
            key=lambda m: m.p2p_seq or 0, default=None), (rec.trace_id,)):
        # its record of the matching op may be in a damaged line: unknown, not absent
        unread.append(peer)
        text, peer_entry = _unread_entry(lost, peer, last_any)
        parts.append(f"rank {peer} " + text.replace(
            "may have issued it", f"may have issued the matching {other}{tag}", 1))
    else:
        ended = _ended(run, peer, (rec.trace_id,))
        earlier = None
        if (ended is None or ended.error is None) and errors.get(peer):
            # an earlier step's error, since the peer's last op with r in step with r's
            mine = {k[3]: m for k, m in known.get(peer, {}).items()
                    if k[:3] == (rec.group, other, r) and m.rank == peer}
            theirs = {k[3]: m.step for k, m in known.get(r, {}).items()
                      if k[:3] == (rec.group, rec.op, peer)}
            firsts = [st for st in theirs.values() if st is not None]
            earlier = _earlier_error(errors[peer], mine, theirs,
                                     rec.p2p_seq if rec.p2p_seq is not None else 0,
                                     min(firsts) if firsts else rec.step,
                                     _seen_ns(run, peer, peer_hang, last_any),
                                     None if ended is None else _left_ns(ended))
        silent = _wrote_nothing(peer, peer_hang, last_any, earlier or ended)
        (nothing if silent else never).append(peer)
        text, fqn, phase = _unseen(peer, peer_hang, last_any, ended, earlier=earlier)
        issued = [k[3] for k in known.get(peer, {}) if k[:3] == (rec.group, other, r)]
        peer_entry = {"op": None, "fqn": fqn, "phase": phase, "seq": None,
                      "state": _NO_RECORD if silent else _NOT_ISSUED}
        _note_error(peer_entry, earlier or ended)
        if issued:
            peer_entry["last_p2p_seq"] = max(issued)
        elsewhere = _waits_in(peer_hang)
        if elsewhere:
            root = False
            text += elsewhere
        elif _blocked_by_failure(peer, peer_hang, last_any):
            root = False
        text = text.replace("never issued it", f"never issued the matching {other}{tag}", 1)
        parts.append(f"rank {peer} {text}")
    if peer_hang is not None:
        peer_entry["hang_record"] = peer_hang.reason
        peer_entry["stack"] = _stack(peer_hang)
    else:
        peer_entry.setdefault("hang_record", None)
    label = _group_label(rec.group, rec.group_ranks)
    message = (f"{label}, rank {sender} -> rank {receiver} #{rec.p2p_seq}: "
               + "; ".join(parts))
    details: dict[str, Any] = {
        "group_ranks": list(rec.group_ranks),
        "p2p": {"sender": sender, "receiver": receiver, "p2p_seq": rec.p2p_seq},
        "never_issued": never,
        "wrote_nothing": nothing,
        "unread": unread,
        "not_traced": untraced,
        "issued_ns": rec.issued_ns,
        "root": root and bool(never or nothing),
        "trace_id": hang.trace_id if hang is not None else rec.trace_id,
    }
    step = hang.step if hang is not None else rec.step
    return Finding(KIND_HANG, rec.group, rec.p2p_seq, step, {r: entry, peer: peer_entry},
                   message, details)


def _in_op(r: int, rec: CollectiveRecord, what: str) -> str:
    """``rank 1 is in `Net.p` forward send to rank 2``, or, when its op raised, ``rank
    1 issued send to rank 2 in `Net.p` forward and it failed there``."""
    if rec.state == semconv.STATE_FAILED:
        return f"rank {r} issued {what} in {rec.where()} and it failed there"
    return f"rank {r} is in {rec.where()} {what}"


def _unmatched_p2p_finding(rec: CollectiveRecord, r: int,
                           hang: HangRecord | None) -> Finding:
    """A send or receive not completed that names no single peer (a receive from any
    source, a batch): no peer's side to match it with; said as it is."""
    entry = _waiting_entry(rec, hang)
    if rec.peer is None:
        what = f"{rec.op} from any source"
    else:
        peers = list(rec.peer) if isinstance(rec.peer, tuple) else [rec.peer]
        entry["peer"] = peers
        what = f"{rec.op} with ranks {_list(peers)}"
    number = f" #{rec.p2p_seq}" if rec.p2p_seq is not None else ""
    message = (f"{_group_label(rec.group, rec.group_ranks)}, rank {r}{number}: "
               f"{_in_op(r, rec, what)}, not matched with a peer's side")
    details: dict[str, Any] = {"group_ranks": list(rec.group_ranks), "never_issued": [],
                               "wrote_nothing": [], "not_traced": [],
                               "issued_ns": rec.issued_ns, "root": False,
                               "trace_id": hang.trace_id if hang is not None else rec.trace_id}
    step = hang.step if hang is not None else rec.step
    return Finding(KIND_HANG, rec.group, None, step, {r: entry}, message, details)


def _waiting_entry(rec: CollectiveRecord, hang: HangRecord | None,
                   peer: int | None = None) -> dict[str, Any]:
    """A rank's entry for the op ``rec`` its hang record shows it waiting in, or that
    failed (without a record: no ``waited_ns`` nor ``stack``); with ``peer``, the rank
    at the other end."""
    entry = _entry(rec)
    entry["state"] = rec.state
    if peer is not None:
        entry["peer"] = peer
    if hang is None:
        entry["hang_record"] = None
        return entry
    entry.update(waited_ns=max(0, hang.time_ns - rec.issued_ns), hang_record=hang.reason,
                 stack=_stack(hang))
    return entry


def _stack(hang: HangRecord) -> list[str]:
    """``["Net forward", "Net.stage forward"]``: a hang record's open spans."""
    return [f"{f} {p}" for f, p in hang.stack]


def _waits_in(hang: HangRecord | None) -> str:
    """``"; it is itself waiting in ..."``: the op a hang record shows its rank blocked
    in (:func:`_stuck_in`; an op it never issued is then no sign that it is the cause);
    ``""`` when it waits in none."""
    b = _stuck_in(hang)
    if b is None:
        return ""
    return f"; it is itself waiting in {b.where()} {_op_words(b)}"


def _op_words(rec: CollectiveRecord) -> str:
    """``all_reduce (seq 4)``, ``send to rank 2 (#3)``: an op, for messages."""
    if rec.p2p_seq is not None and isinstance(rec.peer, int) and rec.op in _P2P_TO:
        return f"{rec.op} {_P2P_TO[rec.op]} rank {rec.peer} (#{rec.p2p_seq})"
    if _per_peer(rec) and rec.peer is None:
        return f"{rec.op} from any source on group {rec.group}"
    return f"{rec.op} on group {rec.group} (seq {rec.seq})"


def _ended(run: Run, r: int, traces: Iterable[str]) -> RankStep | None:
    """The rank span of the step (of ``traces``, where its peers wait) that rank ``r``
    ended, its rank span written: it went past the op without issuing it (it issued
    fewer collectives than its peers, or an exception left the step: the span's
    ``error``), it did not stop in that step; else ``None``."""
    for trace in traces:
        ended = run.rank_steps.get((r, trace))
        if ended is not None:
            return ended
    return None


def _error_words(ended: RankStep) -> str:
    """``"ValueError: bad shape, raised in `Net.block` forward"``."""
    where = (f"`{ended.error_fqn}` {ended.error_phase}" if ended.error_fqn is not None
             else "outside every module")
    return f"{ended.error}, raised {'in ' if ended.error_fqn is not None else ''}{where}"


def _add_errors(ranks: dict[int, dict[str, Any]], errors: Mapping[int, RankStep]) -> None:
    """Give the rank entries of ranks an exception took out of the step its ``error``."""
    for r, ended in errors.items():
        if r in ranks:
            _note_error(ranks[r], ended)


def _note_error(entry: dict[str, Any], ended: RankStep | None) -> None:
    """Give a rank's entry its ``error`` when an exception left its step (``ended``,
    :func:`_ended`, or an earlier step's, :func:`_earlier_error`): the exception,
    where it was raised and the step."""
    if ended is not None and ended.error is not None:
        entry["error"] = {"message": ended.error, "fqn": ended.error_fqn,
                          "phase": ended.error_phase, "step": ended.step}


def _errors_by_rank(run: Run) -> dict[int, list[tuple[int, RankStep]]]:
    """Each rank's steps an exception left, as ``(when, rank step)``, ``when`` the end
    of the use that raised (of a step number used again, the one that ended last)."""
    out: dict[int, list[tuple[int, RankStep]]] = defaultdict(list)
    for (r, _), rs in run.rank_steps.items():
        if rs.error is not None:
            out[r].append((_left_ns(rs), rs))
    return out


def _earlier_error(
    errors: Sequence[tuple[int, RankStep]], mine: Mapping[int, CollectiveRecord],
    theirs: Mapping[int, int | None], number: int, first_step: int | None,
    seen_ns: int | None = None, left_ns: int | None = None,
) -> RankStep | None:
    """The latest error that left a step of a rank that never issued op ``number`` (a
    group's seq, or the number per peer of a send or receive) its peers wait in, when
    it may be why: raised after the rank's last op numbered below ``number`` that it
    issued in the same step as its peers (``mine``: its ops by number; ``theirs``:
    the step its peers issued each number in), and before the first it issued in
    another step (from there it went its own way: it had skipped ops). An error
    before that last op in step is not named: the rank was still in step with its
    peers after it; nor one of a step before the one its peers issued their next op
    in, when the rank was seen after it (``seen_ns``: its latest hang record, op or
    step start): it had issued every op of its step and went on. Without any op in
    step, errors of the step ``first_step`` (its peers' first op there) and later. An
    error after ``left_ns`` (when the rank ended the step its peers wait in) came
    after it went past the op: it is not why."""
    if not errors:
        return None
    since: int | None = None
    since_n: int | None = None
    until: int | None = None
    for n in sorted(k for k in mine if k < number):
        rec, peers = mine[n], theirs.get(n)
        if rec.step is None or peers is None:
            continue  # (outside steps, or no peer's record of it: nothing to compare)
        if rec.step == peers:
            since, since_n = rec.issued_ns, n
        else:
            until = rec.issued_ns
            break
    # the step of the peers' first op after the rank's last one in step with them
    after = [n for n in theirs if since_n is not None and since_n < n <= number
             and theirs[n] is not None]
    next_step = theirs[min(after)] if after else None
    best: tuple[int, RankStep] | None = None
    for when, rs in errors:
        if since is None and (rs.step is None or first_step is None or rs.step < first_step):
            continue
        if (since is not None and when <= since) or (until is not None and when > until):
            continue
        if left_ns is not None and when > left_ns:
            continue  # (raised after it ended the step its peers wait in)
        if (next_step is not None and rs.step is not None and rs.step < next_step
                and seen_ns is not None and seen_ns > when):
            continue  # it issued all of the error's step's ops, then went on
        if best is None or when > best[0]:
            best = (when, rs)
    return best[1] if best is not None else None


def _left_ns(ended: RankStep) -> int:
    """When a rank ended the step ``ended`` (of a step number used again, its last
    use)."""
    return max([ended.end_ns, *(end for _, _, end in ended.repeats)])


def _seen_ns(run: Run, r: int, hang: HangRecord | None,
             last_any: Mapping[int, CollectiveRecord]) -> int | None:
    """When rank ``r`` was last seen: its hang record, its latest op or the start of
    its latest step span (``None``: never)."""
    times = [rs.start_ns for (rank, _), rs in run.rank_steps.items() if rank == r]
    times += [s for (rank, _), rs in run.rank_steps.items() if rank == r
              for _, s, _ in rs.repeats]
    if hang is not None:
        times.append(hang.time_ns)
    if r in last_any:
        times.append(last_any[r].issued_ns)
    return max(times, default=None)


def _peer_steps(records: Iterable[tuple[int, CollectiveRecord]],
                r: int) -> dict[int, int | None]:
    """Number -> the step most ranks other than ``r`` issued the op of that number in,
    from ``(number, record)`` pairs."""
    seen: dict[int, Counter[int]] = defaultdict(Counter)
    for n, rec in records:
        if rec.rank != r and rec.step is not None:
            seen[n][rec.step] += 1
    return {n: steps.most_common(1)[0][0] for n, steps in seen.items()}


def _left_words(rs: RankStep) -> str:
    """``it left step 1 on an error, ValueError: bad shape, raised in `Net.b` forward``."""
    return f"it left {_step_words(rs.step)} on an error, {_error_words(rs)}"


def _unseen(
    r: int, hang: HangRecord | None, last_any: Mapping[int, CollectiveRecord],
    ended: RankStep | None = None,
    diverged: bool | None = None,
    earlier: RankStep | None = None,
) -> tuple[str, str | None, str | None]:
    """``(text, fqn, phase)``: what is known of rank ``r``, which did not issue an op
    its peers wait in: where its hang record saw it, else its last exported op (and
    ``ended``, the rank span of the step it ended without issuing it, :func:`_ended`:
    with an error, the exception that left the step and where it was raised). An
    error that left an earlier step and may be why (``earlier``,
    :func:`_earlier_error`), or that left the step of a rank with a hang record, is
    said after it."""
    text, fqn, phase = _unseen_words(r, hang, last_any, ended, diverged)
    error = ended if ended is not None and ended.error is not None else earlier
    if error is not None and (hang is not None or error is not ended):
        if hang is None and r not in last_any and ended is None:
            text = "never issued it; no collective of its was exported"  # (wrote no op)
        text += f"; {_left_words(error)}"
    return text, fqn, phase


def _unseen_words(
    r: int, hang: HangRecord | None, last_any: Mapping[int, CollectiveRecord],
    ended: RankStep | None, diverged: bool | None,
) -> tuple[str, str | None, str | None]:
    seen = hang.innermost() if hang is not None else None
    if seen is not None:
        return f"never issued it and was last seen in `{seen[0]}` {seen[1]}", *seen
    if hang is not None:
        return "never issued it and was outside any module", None, None
    if ended is not None and ended.error is not None:
        # an exception left the step (the rank span's ERROR): that is why
        last_words = ""
        if r in last_any:
            last_words = f"; its {_last_exported(last_any[r])}"
        return (f"never issued it: it left {_step_words(ended.step)} on an error, "
                f"{_error_words(ended)}{last_words}",
                ended.error_fqn, ended.error_phase)
    if r in last_any:
        last = last_any[r]
        if last.state == semconv.STATE_FAILED:
            # its last op raised (a peer died, a backend's timeout): it waited there
            return ("wrote no record of it and no hang record; its last exported "
                    f"collective was {last.where()} {_op_words(last)}, in "
                    f"{_step_words(last.step)}, and it failed: it was blocked there",
                    last.fqn, last.phase)
        # nothing after its last exported spans: not known to have issued it
        if ended is not None:
            why = ("it issued fewer collectives than its peers; see the other findings"
                   if diverged is not False else
                   "it left the step early, by an exception say, or skipped collectives "
                   "its peers issued")
            return (f"never issued it: it ended step {ended.step} without it ({why}); its "
                    f"{_last_exported(last)}", last.fqn, last.phase)
        return ("wrote no record of it and no hang record (stopped, or stuck outside "
                f"collectives?); its {_last_exported(last)}", last.fqn, last.phase)
    # no file, or nothing in it: no evidence either way
    return "wrote nothing at all: whether it issued it is unknown", None, None


def _last_exported(last: CollectiveRecord) -> str:
    """``last exported collective was all_reduce in `Net.a` forward (step 1)``."""
    return (f"last exported collective was {last.op} in `{last.fqn}` {last.phase} "
            f"({_step_words(last.step)})")


def _unread_since(run: Run, r: int, hang: HangRecord | None, last: CollectiveRecord | None,
                  traces: Iterable[str]) -> list[Unread]:
    """The damaged lines (:attr:`Run.unread`) that may have held rank ``r``'s record of
    an op its peers wait in (issued in ``traces``): those of its steps among ``traces``
    or at or after the step of ``last``, its last op before that one (every step of it
    without one). None when ``r`` wrote a hang record: that lists its ops in flight,
    whatever its other lines lost."""
    mine = [u for (rank, _), u in run.unread.items() if rank == r]
    if hang is not None or not mine:
        return []
    order = {t: i for i, t in enumerate(run.traces())}
    where = set(traces)
    since = order.get(last.trace_id, -1) if last is not None else -1
    lost = [u for u in mine if u.trace_id in where or order.get(u.trace_id, -1) >= since]
    return sorted(lost, key=lambda u: (order.get(u.trace_id, -1), u.path, u.line))


def _unread_entry(lost: Sequence[Unread], r: int, last_any: Mapping[int, CollectiveRecord],
                  ) -> tuple[str, dict[str, Any]]:
    """``(text, rank entry)`` of a rank whose record of an op its peers wait in a
    damaged line may have held (``lost``, :func:`_unread_since`): whether it issued it
    is unknown, as in a step the ``unread`` finding leaves it out of."""
    lines = list(dict.fromkeys(f"{u.path}:{u.line}" for u in lost))
    more = f" (and {len(lines) - 1} more damaged lines)" if len(lines) > 1 else ""
    steps = sorted({u.step for u in lost if u.step is not None})
    of = (f" of {_step_words(steps[0])}" if len(steps) == 1 else
          f" of steps {_list(steps)}" if steps else "")
    text = (f"may have issued it: {lines[0]}{more} is damaged and may have held its "
            f"records{of}, so whether it did is unknown")
    last = last_any.get(r)
    if last is not None:
        text += f"; its {_last_exported(last)}"
    entry: dict[str, Any] = {"op": None, "fqn": last.fqn if last is not None else None,
                             "phase": last.phase if last is not None else None,
                             "seq": None, "state": _UNREAD, "damaged": lines[0]}
    return text, entry


def _wrote_nothing(r: int, hang: HangRecord | None,
                   last_any: Mapping[int, CollectiveRecord],
                   ended: RankStep | None = None) -> bool:
    """Rank ``r`` wrote no hang record, no collective at all (no file, or nothing in
    it) and no error leaving the step: nothing says whether it issued an op (state
    ``no record``)."""
    return hang is None and r not in last_any and (ended is None or ended.error is None)


def _blocked_by_failure(r: int, hang: HangRecord | None,
                        last_any: Mapping[int, CollectiveRecord]) -> bool:
    """Rank ``r`` wrote no hang record and its last exported op failed: it was blocked
    in that op (its peer died, or the backend timed out), as a hang record would
    have shown it waiting there."""
    last = last_any.get(r)
    return hang is None and last is not None and last.state == semconv.STATE_FAILED


def _hang_finding(
    run: Run,
    group: str,
    seq: int,
    members: tuple[int, ...],
    per_rank: Mapping[int, list[CollectiveRecord]],
    exported: Mapping[tuple[str, int], list[CollectiveRecord]],
    last_any: Mapping[int, CollectiveRecord],
    latest: Mapping[int, HangRecord],
    diverged: bool | None = None,
    errors: Mapping[int, Sequence[tuple[int, RankStep]]] | None = None,
) -> Finding:
    ranks: dict[int, dict[str, Any]] = {}
    inside: dict[str, list[int]] = {}
    failed: dict[str, list[int]] = {}
    done: list[int] = []
    never: dict[str, list[int]] = {}
    steps: Counter[int | None] = Counter()
    issued_at: list[int] = []
    untraced: list[int] = []
    blocked: list[int] = []  # ranks that never issued it, waiting in another op
    nothing: list[int] = []  # ranks that wrote nothing at all (in ``never`` for the text)
    unread: list[int] = []  # ranks whose record of it a damaged line may have held (same)
    issued: dict[int, CollectiveRecord] = {}  # the ranks that issued something at seq
    waited_in = {rec.trace_id for m in members  # the steps where ranks issued it
                 for rec in (*exported.get((group, m), ()), *per_rank.get(m, ()))
                 if rec.seq == seq}
    group_ops: list[tuple[int, CollectiveRecord]] | None = None
    errors = errors if errors is not None else {}
    for r in members:
        hang = latest.get(r)
        if hang is None and run.left_out(r):
            # left out by the rank sample: nothing is known of what it did
            untraced.append(r)
            ranks[r] = {"op": None, "fqn": None, "phase": None, "seq": None,
                        "state": "not traced", "hang_record": None}
            continue
        known = {rec.seq: rec for rec in exported.get((group, r), []) if rec.seq is not None}
        known.update({rec.seq: rec for rec in per_rank.get(r, []) if rec.seq is not None})
        at = known.get(seq)
        entry: dict[str, Any]
        if at is not None:
            issued[r] = at
            entry = _entry(at)
            entry["state"] = at.state
            if at.state == semconv.STATE_COMPLETED:
                done.append(r)
            else:
                if hang is not None:
                    entry["waited_ns"] = max(0, hang.time_ns - at.issued_ns)
                    steps[hang.step] += 1
                else:
                    steps[at.step] += 1
                issued_at.append(at.issued_ns)
                if at.state == semconv.STATE_FAILED:
                    failed.setdefault(f"{at.op} in {at.where()}", []).append(r)
                else:
                    inside.setdefault(f"in {at.where()} {at.op}", []).append(r)
        else:
            before = [rec for s, rec in known.items() if s < seq]
            last = max(before, key=_order_key) if before else None
            lost = _unread_since(run, r, hang, last, waited_in)
            if lost:  # its record of it may be in a damaged line: not known not issued
                text, entry = _unread_entry(lost, r, last_any)
                unread.append(r)
                if last is not None:
                    entry.update(last_seq=last.seq, last_op=last.op)
                never.setdefault(text, []).append(r)
                entry["hang_record"] = None
                ranks[r] = entry
                continue
            ended = _ended(run, r, waited_in)
            earlier = None
            if (ended is None or ended.error is None) and errors.get(r):
                if group_ops is None:  # (seq, record) of every member's op on the group
                    group_ops = [(rec.seq, rec) for m in members for rec in (
                        *exported.get((group, m), ()), *per_rank.get(m, ()))
                        if rec.seq is not None]
                theirs = _peer_steps(group_ops, r)
                firsts = [theirs[n] for n in sorted(theirs)[:1]]
                earlier = _earlier_error(errors[r], known, theirs, seq,
                                         firsts[0] if firsts else None,
                                         _seen_ns(run, r, hang, last_any),
                                         None if ended is None else _left_ns(ended))
            text, fqn, phase = _unseen(r, hang, last_any, ended, diverged=diverged,
                                       earlier=earlier)
            silent = _wrote_nothing(r, hang, last_any, earlier or ended)
            if silent:
                nothing.append(r)
            entry = {"op": None, "fqn": fqn, "phase": phase, "seq": None,
                     "state": _NO_RECORD if silent else _NOT_ISSUED}
            _note_error(entry, earlier or ended)
            if last is not None:
                entry["last_seq"] = last.seq
                entry["last_op"] = last.op
            elsewhere = _waits_in(hang)
            if elsewhere:  # it did not get there because it waits in another op
                text += elsewhere
                blocked.append(r)
            elif _blocked_by_failure(r, hang, last_any):  # (which the text says)
                blocked.append(r)
            never.setdefault(text, []).append(r)
        entry["hang_record"] = hang.reason if hang is not None else None
        if hang is not None:
            entry["stack"] = _stack(hang)
        ranks[r] = entry
    parts = []
    for text, who in inside.items():
        verb = "is" if len(who) == 1 else "are"
        parts.append(f"{_who(who)} {verb} {text}")
    for text, who in failed.items():
        parts.append(f"{_who(who)} issued {text} and it failed there")
    if done:
        parts.append(f"{_who(done)} completed it")
    for text, who in never.items():
        if len(who) > 1:
            text = text.replace(" and was ", " and were ", 1).replace(
                "; it is itself waiting", "; they are themselves waiting", 1).replace(
                "; its last exported", "; their last exported", 1).replace(
                "it was blocked there", "they were blocked there", 1)
        parts.append(f"{_who(who)} {text}")
    if untraced:
        parts.append(f"{_who(untraced)} {'is' if len(untraced) == 1 else 'are'} not traced "
                     f"({run.sample_rule}): unknown")
    step = steps.most_common(1)[0][0] if steps else None
    pending = [rec for rec in issued.values() if rec.state != semconv.STATE_COMPLETED]
    trace = (min(pending, key=lambda rec: rec.issued_ns).trace_id if pending else
             next((h.trace_id for h in latest.values()), ""))
    differ = differing_fields(list(issued.values())) if len(issued) > 1 else []
    if differ:
        # the ranks did not issue the same collective there: it can never complete
        parts.insert(0, f"the ranks issued different collectives ({', '.join(differ)} "
                        "differ), which cannot complete")
        for r, rec in issued.items():  # (each rank's values of what differs)
            if r in ranks:
                for name in differ:
                    ranks[r].setdefault(name, field_value(rec, name))
    message = f"{_group_label(group, members)}, seq {seq}: " + "; ".join(parts)
    details: dict[str, Any] = {
        "group_ranks": list(members),
        "never_issued": sorted(r for who in never.values() for r in who
                               if r not in nothing and r not in unread),
        "wrote_nothing": sorted(nothing),
        "unread": sorted(unread),
        "not_traced": sorted(untraced),
        "issued_ns": min(issued_at) if issued_at else 0,
        # it names a rank that never issued it and waits on nothing else, or ranks
        # that issued different collectives: a cause
        "root": not blocked or bool(differ),
        "trace_id": trace,
    }
    if differ:
        details["differ"] = differ
    return Finding(KIND_HANG, group, seq, step, ranks, message, details)


# ------------------------------------------------------------------ wording
def _common(values: Iterable[int | None]) -> int | None:
    seen = Counter(v for v in values if v is not None)
    if not seen:
        return None
    top = max(seen.values())
    return min(v for v, n in seen.items() if n == top)


def _list(values: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3, 7"``; runs of three or more become ranges, written
    ``-3..-1`` when the list holds a negative number (as ``format_numbers`` does:
    ``-3--1`` reads as two numbers)."""
    values = sorted(values)
    dash = ".." if values and values[0] < 0 else "-"
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{values[i]}{dash}{values[j]}")
        else:
            parts.extend(str(v) for v in values[i : j + 1])
        i = j + 1
    return ", ".join(parts)


def _who(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_list(ranks)}"


def _group_label(group: str, members: Sequence[int]) -> str:
    return f"group {group} (ranks {_list(members)})" if members else f"group {group}"


def _splits_words(records: Sequence[CollectiveRecord]) -> str:
    """``"; rank 0 sends rank 1 1 row, rank 1 receives 2 from it"``: the first pair of
    ranks whose all-to-all splits disagree (:func:`split_disagreement`)."""
    found = split_disagreement(records)
    if found is None:
        return ""
    a, b, sends, gets = found
    return (f"; rank {a} sends rank {b} {sends} row{'s' if sends != 1 else ''} "
            f"(input_split_sizes), rank {b} receives {gets} from it (output_split_sizes)")


def _differ(fields: Sequence[str]) -> str:
    return f"{', '.join(fields)} {'differs' if len(fields) == 1 else 'differ'}"


def _step_words(step: int | None) -> str:
    return f"step {step}" if step is not None else "outside steps"
