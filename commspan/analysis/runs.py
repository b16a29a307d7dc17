"""Which runs a set of span records holds, and one run's steps picked out of them.

A folder of JSONL files can hold more than one run: a job restarted into the
same output directory appends a second run (another ``commspan.run_id``) to
the same files. Counting them together would sum two runs silently, so every
reader of the command line goes through :func:`select`: it lists the runs
(:class:`RunInfo`, in the order they started), keeps one (the one asked for,
else the latest, with a :attr:`Selection.note` saying so) and, optionally,
some of its steps.

A run's id is the ``commspan.run_id`` of a span's resource (or of the span);
spans without one (written by something else than commspan) form the run
``""``. A step is one trace; its number is the ``commspan.step`` of its step,
rank or hang spans. Traces outside steps (a plain ``with mode:`` block) have
no number: selecting steps leaves them out.

Example:
    >>> from commspan.analysis.runs import select
    >>> sel = select([])
    >>> sel.records, sel.runs, sel.note
    ([], (), None)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from commspan import semconv
from commspan.otlpjson.records import SpanRecord

__all__ = [
    "RunInfo",
    "RunTally",
    "Selection",
    "SelectionError",
    "StepPruner",
    "StepRange",
    "choose",
    "commspan_runs",
    "format_numbers",
    "list_runs",
    "resource_facts",
    "runs_of",
    "select",
    "writer_of",
]


class SelectionError(ValueError):
    """A run or steps asked for that the records do not hold.

    Attributes:
        param: ``"run"`` or ``"steps"``.
        value: what was asked for.
        detail: what the records hold instead, for people.
    """

    def __init__(self, param: str, value: object, detail: str) -> None:
        super().__init__(f"{param}={value!r} is not valid: {detail}")
        self.param = param
        self.value = value
        self.detail = detail


class RunInfo(NamedTuple):
    """One run found in the records.

    Attributes:
        run_id: its ``commspan.run_id`` (``""`` when the spans carry none).
        ranks: the ranks that wrote spans of it.
        steps: its step numbers.
        spans: how many spans it has.
        start_ns: its earliest span start (Unix ns).
        end_ns: its latest span end.
        writers: the most processes (host and pid of the resource) that wrote one
            rank's spans of it: more than 1 when two jobs ran under one run id (a
            fixed ``COMMSPAN_RUN_ID`` or ``run_id=``), whose steps readers then add
            up; 1 when not known.
        sample: how the ranks that traced were chosen, when not all did
            (``commspan.sampling.ranks``: ``CommSpanMode(ranks=...)``), else ``None``.
        world_size: the job's number of ranks, when its resources say.
    """

    run_id: str
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    spans: int
    start_ns: int
    end_ns: int
    writers: int = 1
    sample: str | None = None
    world_size: int | None = None

    def missing(self) -> tuple[int, ...]:
        """Ranks of the job that wrote no span of this run (their files lost, empty, or
        not among those read): those of ``range(world_size)`` not in :attr:`ranks`;
        of a rank sample, those the sample names (``commspan.sampling.ranks``). ``()``
        when the resources say neither.

        Example:
            >>> RunInfo("r", (0, 2), (0,), 9, 0, 1, world_size=4).missing()
            (1, 3)
        """
        from commspan.analysis.records import sampled_ranks

        world = self.world_size
        if self.sample:
            wanted = {r for r in sampled_ranks(self.sample) if not world or r < world}
        else:
            wanted = set(range(world or 0))
        return tuple(sorted(wanted.difference(self.ranks)))

    def coverage(self, shown: str = "what follows covers", *,
                 missing: bool = True) -> str | None:
        """What a count over this run covers, when it is not every rank of the job, as
        a sentence whose consequence starts with ``shown``: ``"ranks 0,2 of 4 traced
        (rank sample: fraction 0.5): what follows covers those ranks only"``, ``"ranks
        1-3 of 4 wrote no spans (no file of theirs read): what follows covers rank 0
        only"``; ``None`` when every rank traced and wrote
        spans (or nothing says otherwise). ``missing=False``: the rank sample alone
        (``check`` reports the ranks that wrote nothing as findings).

        Example:
            >>> RunInfo("r", (0,), (0,), 9, 0, 1, world_size=4).coverage("0 is")
            'ranks 1-3 of 4 wrote no spans (no file of theirs read): 0 is rank 0 only'
        """
        from commspan.analysis.records import sample_rule

        chosen_lost = self.missing()
        lost = chosen_lost if missing else ()
        if not self.sample and not lost:
            return None
        of = f" of {self.world_size}" if self.world_size else ""
        parts = []
        if self.sample:  # (the ranks it chose: those that wrote, and those lost)
            traced = sorted({*self.ranks, *chosen_lost})
            parts.append(f"{_ranks_text(traced)}{of} traced (rank sample: "
                         f"{sample_rule(self.sample)})")
        if lost:
            parts.append(f"{_ranks_text(lost)}{' of them' if self.sample else of} wrote no "
                         "spans (no file of theirs read)")
        those = _ranks_text(self.ranks) if lost else "those ranks"
        return f"{', and '.join(parts)}: {shown} {those} only"

    def describe(self) -> str:
        """``"cli-test (ranks 0-1, steps 0-4)"``: the run for messages."""
        name = self.run_id or "(no run id)"
        return f"{name} (ranks {format_numbers(self.ranks)}, steps {format_numbers(self.steps)})"

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``run_id``, ``ranks``, ``steps``, ``spans``, ``start_ns``, ``end_ns``,
        ``world_size``, ``rank_sample`` (``null`` when not known / not sampled) and
        ``missing_ranks`` (:meth:`missing`)."""
        return {
            "run_id": self.run_id,
            "ranks": list(self.ranks),
            "steps": list(self.steps),
            "spans": self.spans,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "world_size": self.world_size,
            "rank_sample": self.sample,
            "missing_ranks": list(self.missing()),
        }


def _ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 0"``, ``"ranks 1-3"``: ranks for messages."""
    return f"rank{'s' if len(ranks) != 1 else ''} {format_numbers(ranks)}"


class StepRange(NamedTuple):
    """Steps ``first`` to ``last``, both included (``first == last``: one step)."""

    first: int
    last: int

    def __str__(self) -> str:
        if self.first == self.last:
            return str(self.first)
        dash = ".." if self.first < 0 else "-"  # ("-5--1" reads as two numbers)
        return f"{self.first}{dash}{self.last}"

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and self.first <= step <= self.last


@dataclass(frozen=True)
class Selection:
    """What :func:`select` kept.

    Attributes:
        records: the records of the chosen run (and steps), in input order.
        run: the chosen run; ``None`` when there were no records.
        runs: every run in the input, in the order they started.
        steps: the step numbers kept (of the chosen run).
        note: a sentence saying which run was chosen among several when none
            was asked for (``None`` otherwise); the caller shows it.
        last_traces: with a step selection, each rank's last trace in the whole run
            (by start), which the records kept no longer show: a step whose rank span
            a rank never wrote was cut short when that rank went on to a later one
            (``summarize``, ``cut_short``, ``diff.profile`` take it); ``None``
            without one (the records show it).
    """

    records: list[SpanRecord]
    run: RunInfo | None
    runs: tuple[RunInfo, ...]
    steps: tuple[int, ...]
    note: str | None = None
    last_traces: Mapping[int | None, str] | None = None


def _run_of(rec: SpanRecord) -> str:
    run = rec.resource.get(semconv.RUN_ID) or rec.attributes.get(semconv.RUN_ID)
    return str(run) if run else ""


def _rank_of(rec: SpanRecord) -> int | None:
    if rec.rank is not None:
        return rec.rank
    r = rec.attributes.get(semconv.RANK)
    return r if isinstance(r, int) and not isinstance(r, bool) else None


_STEP_SPANS = frozenset({semconv.SPAN_STEP, semconv.SPAN_RANK, semconv.SPAN_HANG})


def _trace_steps(records: Iterable[SpanRecord]) -> dict[str, int]:
    steps: dict[str, int] = {}
    for rec in records:
        if rec.name in _STEP_SPANS:
            step = rec.attributes.get(semconv.STEP)
            if isinstance(step, int) and not isinstance(step, bool):
                steps.setdefault(rec.trace_id, step)
    return steps


def list_runs(records: Sequence[SpanRecord]) -> list[RunInfo]:
    """The runs of ``records``, in the order they started (earliest span first).

    Example:
        >>> list_runs([])
        []
    """
    tally = RunTally()
    for rec in records:
        tally.add(rec)
    return tally.runs()


def resource_facts(resource: Any) -> tuple[str | None, str | None, int | None]:
    """What a resource says of its run: the writer (:func:`writer_of`), how the ranks
    that trace were chosen (``commspan.sampling.ranks``) and the world size."""
    from commspan.analysis.records import MAX_WORLD_SIZE

    sample = resource.get(semconv.SAMPLING_RANKS)
    world = resource.get(semconv.WORLD_SIZE)
    return (writer_of(resource), str(sample) if sample else None,
            world if type(world) is int and 0 < world <= MAX_WORLD_SIZE else None)


class RunTally:
    """:func:`list_runs` and :func:`select`'s choice of run, one span at a time,
    holding none: what :func:`~commspan.analysis.records.load_run` needs to build
    the runs of files as it reads them and keep one.

    Example:
        >>> RunTally().choose(None)
        (None, None)
    """

    def __init__(self) -> None:
        # (run, rank, trace, writer, sample, world) -> [spans, start, end]
        self._rows: dict[tuple[Any, ...], list[int]] = {}
        self._steps: dict[str, int] = {}
        self._resource: Any = None
        self._facts: tuple[str | None, str | None, int | None] = (None, None, None)

    def add(self, rec: SpanRecord) -> str:
        """Count ``rec``; returns its run id (``""`` for none)."""
        run = _run_of(rec)
        if rec.name in _STEP_SPANS:
            step = rec.attributes.get(semconv.STEP)
            if isinstance(step, int) and not isinstance(step, bool):
                self._steps.setdefault(rec.trace_id, step)
        if rec.resource is not self._resource:  # (the spans of a line share theirs)
            self._resource, self._facts = rec.resource, resource_facts(rec.resource)
        key = (run, _rank_of(rec), rec.trace_id, *self._facts)
        row = self._rows.get(key)
        if row is None:
            self._rows[key] = [1, rec.start_time, rec.end_time]
        else:
            row[0] += 1
            row[1] = min(row[1], rec.start_time)
            row[2] = max(row[2], rec.end_time)
        return run

    def runs(self) -> list[RunInfo]:
        """:func:`list_runs` of the spans added."""
        return runs_of((run, rank, self._steps.get(trace), n, start, end, *facts)
                       for (run, rank, trace, *facts), (n, start, end) in self._rows.items())

    def choose(self, run: str | None) -> tuple[RunInfo | None, str | None]:
        """The run :func:`select` would keep (``None`` when no span was added) and
        its note.

        Raises:
            SelectionError: as :func:`select`.
        """
        return choose_run(self.runs(), run)


def choose_run(every: Sequence[RunInfo], run: str | None,
               ) -> tuple[RunInfo | None, str | None]:
    """The run :func:`select` keeps of the runs of the files read, ``every`` (``None``
    when there is none), and its note (the run chosen among several, spans of other
    programs left out, a run two jobs wrote).

    Raises:
        SelectionError: as :func:`select`.
    """
    runs = commspan_runs(every)
    if not runs:
        return None, None
    chosen, _, note = choose(runs, run, None)
    return chosen, _others_note(every, runs, note)


def writer_of(resource: Any) -> str | None:
    """``"host:pid"`` of the process that wrote spans with ``resource``, if it says."""
    pid = resource.get(semconv.PROCESS_PID)
    if pid is None:
        return None
    return f"{resource.get(semconv.HOST_NAME, '')}:{pid}"


def runs_of(
    rows: Iterable[tuple[Any, ...]],
) -> list[RunInfo]:
    """The runs of ``(run id, rank, step, spans, start, end[, writer[, sample[,
    world]]])`` rows, in the order they started; rows of one run add their spans and
    ranks and widen its times (``writer``: :func:`writer_of` the row's resource, or
    ``None``; ``sample`` and ``world``: its ``commspan.sampling.ranks`` and world
    size, or ``None``)."""
    # run -> [ranks, steps, spans, start, end, writers, sample, world]
    acc: dict[str, list[Any]] = {}
    for run, rank, step, spans, start, end, *more in rows:
        slot = acc.get(run)
        if slot is None:
            slot = acc[run] = [set(), set(), 0, start, end, {}, None, None]
        if rank is not None:
            slot[0].add(rank)
            if more and more[0] is not None:
                slot[5].setdefault(rank, set()).add(more[0])
        if step is not None:
            slot[1].add(step)
        slot[2] += spans
        slot[3] = min(slot[3], start)
        slot[4] = max(slot[4], end)
        if len(more) > 1 and more[1]:
            slot[6] = more[1]
        if len(more) > 2 and more[2]:
            slot[7] = max(slot[7] or 0, more[2])
    runs = [
        RunInfo(run, tuple(sorted(s[0])), tuple(sorted(s[1])), s[2], s[3], s[4],
                max((len(w) for w in s[5].values()), default=1), s[6], s[7])
        for run, s in acc.items()
    ]
    runs.sort(key=lambda r: (r.start_ns, r.run_id))
    return runs


def _find(runs: Sequence[RunInfo], wanted: str) -> RunInfo:
    exact = [r for r in runs if r.run_id == wanted]
    if exact:
        return exact[0]
    prefixed = [r for r in runs if wanted and r.run_id.startswith(wanted)]
    if len(prefixed) == 1:
        return prefixed[0]
    listed = "; ".join(r.describe() for r in runs) or "none"
    if len(prefixed) > 1:
        raise SelectionError(
            "run", wanted,
            f"{len(prefixed)} runs start with it ({listed}); give more of the run id",
        )
    if not wanted:  # ('' picks the spans without a run id: say so, and what to pass)
        raise SelectionError(
            "run", wanted,
            "an empty run id names the run of commspan spans without a run id, and the "
            f"files hold none; pass one of their run ids, or the start of one (runs: {listed}), or "
            "leave it out to read the latest run")
    raise SelectionError("run", wanted, f"no such run in the files (runs: {listed})")


def select(
    records: Sequence[SpanRecord],
    *,
    run: str | None = None,
    steps: StepRange | None = None,
    every: Sequence[RunInfo] | None = None,
) -> Selection:
    """Keep the records of one run, and of some of its steps.

    Args:
        records: span records of any number of runs (``read_spans``).
        run: the run id to keep, or a prefix of it naming one run; ``None``:
            the only run, or the latest of several (the selection's ``note``
            then says so).
        steps: keep only these steps of the run (traces outside steps go too);
            ``None`` keeps everything.
        every: the runs of the files read (:meth:`RunTally.runs`), when ``records``
            hold only some of their spans (``commspan html --max-ranks``): the run is
            chosen among these, and the selection's ``run`` and ``runs`` say what the
            files hold, not what ``records`` keep. ``None``: the runs of ``records``.

    Returns:
        The :class:`Selection`.

    Raises:
        SelectionError: (a ``ValueError``) ``run`` names no run of the records,
            or more than one; no step of ``steps`` is in the run (the message
            lists the runs or the steps there are).

    Example:
        >>> select([], steps=StepRange(0, 2)).steps
        ()
    """
    records = list(records)
    every = tuple(list_runs(records) if every is None else every)
    runs = commspan_runs(every)
    if not runs:
        return Selection([], None, (), ())
    chosen, kept_steps, note = choose(runs, run, steps)
    note = _others_note(every, runs, note)
    kept = [r for r in records if _run_of(r) == chosen.run_id] if len(every) > 1 else records
    last_traces = None
    if steps is not None:
        last_traces = last_traces_of((r.rank, r.start_time, r.trace_id) for r in kept)
        trace_steps = _trace_steps(kept)
        traces = {t for t, s in trace_steps.items() if s in steps}
        selected = [r for r in kept if r.trace_id in traces]
        kept = selected + _earlier_hangs(kept, selected, trace_steps, kept_steps)
    return Selection(kept, chosen, runs, kept_steps, note, last_traces)


class StepPruner:
    """:func:`select` with ``steps``, one span at a time: holds only the spans that
    selection may keep (those of the steps wanted, of traces whose step is not known
    yet, and hang records), not every span of the run. A command showing a few steps
    of a thousand-rank run then needs memory for those steps, not for the run.

    Add every span read, in order (:meth:`add`), then :meth:`select`: the same
    :class:`Selection` as ``select(all_spans, run=run, steps=steps)``.

    Example:
        >>> pruner = StepPruner(StepRange(2, 3))
        >>> pruner.select(None).records
        []
    """

    def __init__(self, steps: StepRange) -> None:
        self.steps = steps
        self._tally = RunTally()
        self._held: list[SpanRecord] = []
        self._compact_at = 1 << 16
        # run -> rank -> (start, trace) of its latest-starting span (last_traces_of)
        self._latest: dict[str, dict[int | None, tuple[int, str]]] = {}

    def add(self, rec: SpanRecord) -> None:
        """Take one span (spans in the order read)."""
        run = self._tally.add(rec)
        latest = self._latest.get(run)
        if latest is None:
            latest = self._latest[run] = {}
        last = latest.get(rec.rank)
        if last is None or rec.start_time > last[0]:
            latest[rec.rank] = (rec.start_time, rec.trace_id)
        step = self._tally._steps.get(rec.trace_id)
        if step is None or step in self.steps or rec.name == semconv.SPAN_HANG:
            self._held.append(rec)
            if len(self._held) >= self._compact_at:
                self.compact()

    @property
    def held(self) -> int:
        """How many spans it holds now."""
        return len(self._held)

    def compact(self) -> None:
        """Let go of the spans of traces now known to be of other steps (called as
        spans are added, and by readers at the end of each file)."""
        steps, wanted = self._tally._steps, self.steps
        self._held = [r for r in self._held
                      if r.name == semconv.SPAN_HANG
                      or (step := steps.get(r.trace_id)) is None or step in wanted]
        self._compact_at = max(1 << 16, 2 * len(self._held))

    def hold(self, spans: Iterable[SpanRecord]) -> None:
        """:meth:`add` one file's spans, then :meth:`compact` (a reader's ``hold``)."""
        for span in spans:
            self.add(span)
        self.compact()

    def select(self, run: str | None) -> Selection:
        """:func:`select` of every span added, with ``run`` and this pruner's steps.

        Raises:
            SelectionError: as :func:`select`.
        """
        self.compact()
        sel = select(self._held, run=run, steps=self.steps, every=self._tally.runs())
        if sel.run is None:
            return sel
        # each rank's last trace among all the spans added, not only those held
        latest = self._latest.get(sel.run.run_id, {})
        return replace(sel, last_traces={rank: trace for rank, (_, trace) in latest.items()})


def last_traces_of(spans: Iterable[tuple[int | None, int, str]]) -> dict[int | None, str]:
    """Each rank's last trace, the one of its latest-starting span, from ``(rank, start,
    trace id)`` of spans.

    Example:
        >>> last_traces_of([(0, 5, "a"), (0, 9, "b"), (1, 3, "a")])
        {0: 'b', 1: 'a'}
    """
    latest: dict[int | None, tuple[int, str]] = {}
    for rank, start, trace in spans:
        last = latest.get(rank)
        if last is None or start > last[0]:
            latest[rank] = (start, trace)
    return {rank: trace for rank, (_, trace) in latest.items()}


def _earlier_hangs(records: Sequence[SpanRecord], selected: Sequence[SpanRecord],
                   trace_steps: Mapping[str, int | None],
                   kept_steps: Sequence[int]) -> list[SpanRecord]:
    """The hang records a step selection keeps from before it
    (:func:`commspan.analysis.records.latest_before`)."""
    from commspan.analysis.records import latest_before

    if not kept_steps:
        return []
    hangs = [r for r in records if r.name == semconv.SPAN_HANG]
    present = {r.rank for r in selected if r.name == semconv.SPAN_HANG}
    return latest_before(hangs, min(kept_steps),
                         lambda r: (r.rank, trace_steps.get(r.trace_id), r.end_time), present)


def commspan_runs(runs: Sequence[RunInfo]) -> tuple[RunInfo, ...]:
    """``runs`` without the spans of other programs (no run id and no commspan rank:
    a web server's spans in the same folder), unless there is nothing else."""
    own = tuple(r for r in runs if r.run_id or r.ranks)
    return own or tuple(runs)


def _others_note(every: Sequence[RunInfo], runs: Sequence[RunInfo], note: str | None,
                 ) -> str | None:
    """``note``, and how many spans of other programs :func:`commspan_runs` left out."""
    others = sum(r.spans for r in every if r not in runs)
    if not others:
        return note
    text = (f"{others} span{'s' if others != 1 else ''} of other programs (no run id, no "
            "commspan rank) left out")
    return f"{note}; {text}" if note else text


def choose(
    runs: Sequence[RunInfo], run: str | None, steps: StepRange | None
) -> tuple[RunInfo, tuple[int, ...], str | None]:
    """The run :func:`select` keeps of ``runs`` (not empty), its steps kept, and the
    note saying which run was chosen among several when none was asked for.

    Raises:
        SelectionError: as :func:`select`.
    """
    note = None
    if run is not None:
        chosen = _find(runs, run)
    else:
        # the latest run commspan wrote: spans without a run id (other programs'
        # spans in the same directory, or files older than run ids) only when
        # there is nothing else
        chosen = ([r for r in runs if r.run_id] or list(runs))[-1]
        if len(runs) > 1:
            note = (
                f"the files hold {len(runs)} runs: "
                + "; ".join(r.describe() for r in runs)
                + f"; showing the latest, {chosen.run_id or '(no run id)'}"
            )
    twice = shared_run_note(chosen)
    if twice is not None:
        note = f"{note}. {twice[0].upper()}{twice[1:]}" if note else twice
    kept_steps = chosen.steps
    if steps is not None:
        kept_steps = tuple(s for s in chosen.steps if s in steps)
        if not kept_steps:
            there = f"steps {format_numbers(chosen.steps)}" if chosen.steps else "no steps"
            where = f"run {chosen.run_id}" if chosen.run_id else "the files"
            what = "not" if steps.first == steps.last else "none of them is"
            raise SelectionError("steps", str(steps), f"{what} in {where}, which has {there}")
    return chosen, kept_steps, note


def shared_run_note(run: RunInfo) -> str | None:
    """What to say of a run that two jobs wrote (one rank's spans from two processes:
    a fixed ``COMMSPAN_RUN_ID`` or ``run_id=``), whose steps readers add up; ``None``
    for a run of one job.

    Example:
        >>> shared_run_note(RunInfo("r", (0,), (0,), 1, 0, 1)) is None
        True
    """
    if run.writers <= 1:
        return None
    what = f"run {run.run_id}" if run.run_id else "the files"
    return (f"{what} was written by {run.writers} processes for one rank (two jobs under "
            "one run id: a fixed COMMSPAN_RUN_ID or run_id=): their steps are added up; "
            "give each job its own run id")


def format_numbers(values: Iterable[int], sep: str = ",") -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"`` (parts joined by ``sep``); ``"-"`` when empty.

    Example:
        >>> format_numbers([0, 1, 2, 3, 7, 9, 10])
        '0-3,7,9-10'
        >>> format_numbers([-2, -1, 0, 1])
        '-2..1'
        >>> format_numbers([0, 1, 2, 5], sep=", ")
        '0-2, 5'
    """
    numbers = sorted(set(values))
    if not numbers:
        return "-"
    dash = ".." if numbers[0] < 0 else "-"  # ("-2-1" would read as two numbers)
    parts: list[str] = []
    start = prev = numbers[0]
    for v in numbers[1:]:
        if v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}{dash}{prev}")
        start = prev = v
    parts.append(str(start) if start == prev else f"{start}{dash}{prev}")
    return sep.join(parts)
