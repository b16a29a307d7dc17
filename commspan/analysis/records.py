"""Typed records of a run, built from the span records of its JSONL files.

The analyzers (:mod:`commspan.analysis.check`, :mod:`commspan.analysis.stragglers`)
never look at spans: they take a :class:`Run`, which holds one
:class:`CollectiveRecord` per collective event, one :class:`RankStep` per rank
span, one :class:`ModuleSpan` per module span, one :class:`HangRecord` per
``commspan.hang`` span and one :class:`GcRecord` per ``commspan.gc`` event.
Loading (here), matching (the analyzers) and reporting
(:mod:`commspan.render.findings`) are kept apart.

Example:
    >>> from commspan.analysis.records import build_run
    >>> run = build_run([])
    >>> run.collectives, run.expected_ranks()
    ([], [])
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, Union

from commspan import semconv
from commspan.otlpjson.decode import (
    DEFAULT_MAX_LINE_BYTES,
    LineReader,
    ReadReport,
    read_spans_in,
)
from commspan.otlpjson.files import jsonl_files
from commspan.otlpjson.records import SpanRecord, no_commspan_span, record_rank

__all__ = [
    "CollectiveRecord",
    "GcRecord",
    "HangRecord",
    "MAX_WORLD_SIZE",
    "ModuleSpan",
    "RankStep",
    "Run",
    "RunPaths",
    "RunsBuilder",
    "SpanTimes",
    "Unread",
    "build_run",
    "gc_event_fields",
    "latest_before",
    "load_run",
    "p2p_pair",
]

_log = logging.getLogger(__name__)
_STATUS_ERROR = 2  # OTLP status code ERROR

MAX_WORLD_SIZE = 1 << 20
"""A ``commspan.world_size`` above this is a damaged value, not a job: it is
ignored (the ranks expected are then those that wrote spans), as the CLI's
``--world`` refuses it."""

RunPaths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]
"""JSONL files of a run (one per rank), or directories of them."""


class CollectiveRecord(NamedTuple):
    """One collective (or p2p op) as one rank issued it.

    Attributes:
        rank: global rank that issued it.
        step: step number of its trace (``None`` outside steps or unknown).
        trace_id: trace it was recorded in (shared by all ranks for one step).
        group: process group name (``""`` when commspan did not know the group).
        group_ranks: global ranks of that group.
        seq: the rank's per-group sequence number (``commspan.collective.seq``).
        op: canonical op name, e.g. ``all_reduce``.
        kind: ``collective`` or ``p2p``.
        dtype: dtype of the input tensor(s).
        shape: shape of the first input tensor.
        nbytes: bytes of all input tensors.
        reduce_op: reduce op, when the op has one.
        peer: global rank of the peer (p2p), a tuple for batched p2p.
        fqn: module that issued it (``Global`` outside modules).
        phase: ``forward``, ``backward`` or ``recompute``.
        issued_ns: when it was issued (the event's time, host clock of that rank).
        duration_ns: issue to completion, when recorded.
        state: ``issued`` or ``completed`` (known completed: a duration, or a
            hang record saying so).
        p2p_seq: a point-to-point op's number among those in its direction with
            its peer on the group (``commspan.p2p.seq``; a send and the receive
            that matches it have the same); ``None`` for collectives and in files
            of schema 2, whose ``seq`` numbered point-to-point ops with the
            collectives.
        wait_ns: a functional collective's time inside the ``wait_tensor`` that
            completed it (``commspan.collective.wait_ns``), when recorded.
        owner: the module that owns it (``commspan.owner.fqn``: FSDP's unit, DDP's
            bucket, ...) when that is not :attr:`fqn`, else ``None``; see
            :attr:`charged`.
        tag: a point-to-point op's tag (``commspan.p2p.tag``) when not 0; ``None``
            for tag 0 and in files of schema 3 and before, which did not write it.
        splits: an ``all_to_all_single``'s ``(input split sizes, output split
            sizes)``, the rows it sends to and receives from each rank of its group,
            when it was given them (uneven splits); else ``None``.
        root_rank: the global rank of the root of a collective that has one
            (``commspan.collective.root``: broadcast, gather, scatter, reduce); else
            ``None`` (and in files written before it was recorded).
    """

    rank: int
    step: int | None
    trace_id: str
    group: str
    group_ranks: tuple[int, ...]
    seq: int | None
    op: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int | None
    reduce_op: str | None
    peer: int | tuple[int, ...] | None
    fqn: str
    phase: str
    issued_ns: int
    duration_ns: int | None
    state: str
    p2p_seq: int | None = None
    wait_ns: int | None = None
    owner: str | None = None
    tag: int | None = None
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    root_rank: int | None = None

    @property
    def charged(self) -> str:
        """The module the collective is counted in: its owner, else the module that
        issued it (what ``commspan summary`` charges it to)."""
        return self.owner or self.fqn

    def where(self) -> str:
        """``"`Net.blocks.0` forward"``: the module and phase, for messages; with
        ``" (for `Net.blocks.1`)"`` when another module owns the collective."""
        if self.owner:
            return f"`{self.fqn}` {self.phase} (for `{self.owner}`)"
        return f"`{self.fqn}` {self.phase}"


COMPARED = ("op", "dtype", "shape", "reduce_op", "root_rank")
"""Fields of a collective that must be equal on every rank of its group."""

# inputs that legitimately differ between ranks: uneven splits, root-only inputs
_NO_SHAPE = frozenset({"all_to_all", "all_to_all_single", "shard_dim_alltoall", "scatter"})
_NO_DTYPE = frozenset({"scatter"})


def field_value(rec: CollectiveRecord, name: str) -> Any:
    """Field ``name`` of ``rec`` as compared across ranks (a shape as a list; an
    all-to-all's ``splits`` as ``{"input": [...], "output": [...]}``)."""
    if name == "shape":
        return list(rec.shape) if rec.shape is not None else None
    if name == "splits":
        return ({"input": list(rec.splits[0]), "output": list(rec.splits[1])}
                if rec.splits is not None else None)
    return getattr(rec, name)


def differing_fields(records: Sequence[CollectiveRecord]) -> list[str]:
    """The fields of :data:`COMPARED` on which ``records`` (one collective as several
    ranks issued it) disagree. Inputs that legitimately differ between ranks are not
    compared: the shapes of an all-to-all (uneven splits) and of a scatter, a scatter's
    dtype (only its root has inputs); an all-to-all's splits must agree instead: what
    each rank sends another is what that rank receives from it (``"splits"``). The
    one rule of ``commspan check`` (a mismatch) and ``commspan stragglers`` (a
    collective it cannot match)."""
    ops = {r.op for r in records}
    out = []
    for name in COMPARED:
        if name == "shape" and ops & _NO_SHAPE:
            continue
        if name == "dtype" and ops & _NO_DTYPE:
            continue
        values = {repr(field_value(r, name)) for r in records if field_value(r, name) is not None}
        if len(values) > 1:
            out.append(name)
    if "op" not in out and split_disagreement(records) is not None:
        out.append("splits")
    return out


def split_disagreement(
    records: Sequence[CollectiveRecord],
) -> tuple[int, int, int, int] | None:
    """The first pair of ranks (in rank order) whose all-to-all split sizes disagree,
    among ``records`` (one collective as the ranks of its group issued it) that carry
    them: ``(a, b, rows a sends b, rows b receives from a)``, where rank ``a``'s input
    split for ``b`` should be ``b``'s output split from ``a`` (positions in the group's
    ranks); ``None`` when they agree. Records without splits, or of ranks not in the
    group, are not compared.

    Example:
        >>> from commspan.analysis.records import CollectiveRecord
        >>> def rec(rank, ins, outs):
        ...     return CollectiveRecord(rank, 0, "t", "0", (0, 1), 1, "all_to_all_single",
        ...                             "collective", "float32", None, None, None, None,
        ...                             "M", "forward", 0, None, "completed",
        ...                             splits=(ins, outs))
        >>> split_disagreement([rec(0, (1, 2), (1, 3)), rec(1, (3, 4), (2, 4))]) is None
        True
        >>> split_disagreement([rec(0, (1, 2), (1, 3)), rec(1, (3, 4), (1, 4))])
        (0, 1, 2, 1)
    """
    by_rank = {r.rank: (r.group_ranks.index(r.rank), r.splits) for r in records
               if r.splits is not None and r.rank in r.group_ranks}
    for a, (i, (ins, _)) in sorted(by_rank.items()):
        for b, (j, (_, outs)) in sorted(by_rank.items()):
            if j < len(ins) and i < len(outs) and ins[j] != outs[i]:
                return a, b, ins[j], outs[i]
    return None


def p2p_pair(op: str, rank: int, peer: int) -> tuple[int, int]:
    """``(sender, receiver)`` of point-to-point op ``op`` (``send`` or ``recv``) that
    ``rank`` issued with ``peer``.

    Example:
        >>> p2p_pair("send", 1, 2), p2p_pair("recv", 2, 1)
        ((1, 2), (1, 2))
    """
    return (rank, peer) if op == "send" else (peer, rank)


class Unread(NamedTuple):
    """A step of one rank that a damaged line may have held part of.

    Attributes:
        rank: the rank whose file holds the line.
        trace_id: the step's trace.
        step: its step number (``None`` outside steps).
        path: the file.
        line: the damaged line's number (from 1).
        reason: why it could not be read.
        run_id: the run of the lines around it.
    """

    rank: int
    trace_id: str
    step: int | None
    path: str
    line: int
    reason: str
    run_id: str


class RankStep(NamedTuple):
    """One rank's span of one trace (``commspan.rank``).

    A step number used again (a loop of epochs numbering steps from 0 each time)
    shares the earlier step's trace: the rank span of each use after the first is
    in ``repeats`` as ``(span_id, start_ns, end_ns)``, and :attr:`duration_ns`
    adds them up.

    A rank span that ended with status ERROR (an exception left the step) has its
    text in ``error`` (``"ValueError: bad shape"``), and ``error_fqn`` and
    ``error_phase`` say where it was raised: the span of the step's last
    ``exception`` event (``None`` for one raised outside every module). Of a step
    number used again, the use that ended last says: a step that raised, was caught
    and run again to its end has no ``error``.
    """

    rank: int
    step: int | None
    trace_id: str
    span_id: str
    start_ns: int
    end_ns: int
    repeats: tuple[tuple[str, int, int], ...] = ()
    error: str | None = None
    error_fqn: str | None = None
    error_phase: str | None = None

    @property
    def duration_ns(self) -> int:
        """The time of the rank's spans of this trace, added up."""
        return max(0, self.end_ns - self.start_ns) + sum(
            max(0, end - start) for _, start, end in self.repeats)

    @property
    def span_ids(self) -> tuple[str, ...]:
        """The ids of the rank's spans of this trace, the first first."""
        return (self.span_id, *(span for span, _, _ in self.repeats))


class ModuleSpan(NamedTuple):
    """One module span: a module call in one phase on one rank."""

    rank: int
    trace_id: str
    span_id: str
    parent_span_id: str
    fqn: str
    phase: str
    start_ns: int
    end_ns: int


class SpanTimes:
    """Module spans folded into what the step-time view reads of them, a rank at a
    time, so that a run's module spans need not all be held at once (a thousand
    ranks' are millions).

    Attributes:
        own: ``(rank, trace_id) -> phase ->`` the own time of that rank's module
            spans of that phase in that trace: each span's duration minus its
            child spans' (clipped at 0), so an instant is counted once, for the
            innermost span.
        under: ``(rank, span_id) ->`` the summed duration of the module spans
            whose parent is that span, for parents that are not module spans (a
            rank span: the time of its step spent in modules).

    Example:
        >>> outer = ModuleSpan(0, "t", "a", "step", "Net", "forward", 0, 10)
        >>> inner = ModuleSpan(0, "t", "b", "a", "Net.fc", "forward", 2, 6)
        >>> times = SpanTimes.of([outer, inner])
        >>> times.own[(0, "t")]["forward"], times.under[(0, "step")]
        (10, 10)
    """

    __slots__ = ("own", "under")

    def __init__(self) -> None:
        self.own: dict[tuple[int, str], Counter[str]] = {}
        self.under: Counter[tuple[int, str]] = Counter()

    @classmethod
    def of(cls, spans: Iterable[ModuleSpan]) -> SpanTimes:
        """``spans`` folded (every module span of the ranks they hold)."""
        times = cls()
        times.add(spans)
        return times

    def add(self, spans: Iterable[ModuleSpan]) -> None:
        """Fold ``spans``: all the module spans of the ranks they hold, in one call
        per rank (a span's own time needs every child of it)."""
        spans = spans if isinstance(spans, (list, tuple)) else list(spans)
        children: Counter[tuple[int, str]] = Counter()
        for m in spans:
            children[(m.rank, m.parent_span_id)] += max(0, m.end_ns - m.start_ns)
        own = self.own
        for m in spans:
            key = (m.rank, m.trace_id)
            phases = own.get(key)
            if phases is None:
                phases = own[key] = Counter()
            phases[m.phase] += max(
                0, m.end_ns - m.start_ns - children.get((m.rank, m.span_id), 0))
        for m in spans:  # what is left: the parents that are not module spans
            children.pop((m.rank, m.span_id), None)
        self.under.update(children)


class GcRecord(NamedTuple):
    """A pause of one rank's process for Python's garbage collector (a
    ``commspan.gc`` event).

    Attributes:
        rank: the rank.
        step: step of its trace (``None`` outside steps).
        trace_id: the trace in progress then.
        start_ns: when it started (host clock of that rank).
        duration_ns: how long it held the process.
        generation: the generation collected (2: a full collection).
        fqn: module the traced thread was in (``None`` outside every module).
        phase: that module span's phase (``None`` outside every module).
    """

    rank: int
    step: int | None
    trace_id: str
    start_ns: int
    duration_ns: int
    generation: int
    fqn: str | None
    phase: str | None


class HangRecord(NamedTuple):
    """What a rank was doing when it wrote a ``commspan.hang`` span.

    Attributes:
        rank: the rank that wrote it.
        step: the step in progress (``None`` outside steps).
        trace_id: trace of the step in progress.
        reason: ``timeout``, ``dump`` or ``signal``.
        time_ns: when it was written (the span's end).
        stack: open module spans, outermost first, as ``(fqn, phase)``.
        collectives: the rank's recent collectives per group, with their state.
        step_traced: ``False`` when written in a step ``sample=`` leaves out (nothing
            of the step recorded: the stack and collectives say nothing of it).
    """

    rank: int
    step: int | None
    trace_id: str
    reason: str
    time_ns: int
    stack: tuple[tuple[str, str], ...]
    collectives: tuple[CollectiveRecord, ...]
    step_traced: bool = True

    def innermost(self) -> tuple[str, str] | None:
        """``(fqn, phase)`` of the innermost open module span, if any."""
        return self.stack[-1] if self.stack else None


@dataclass
class Run:
    """Everything the analyzers need from the files of one run.

    Attributes:
        collectives: collective events of finished spans, per rank in file order.
        rank_steps: ``(rank, trace_id) -> RankStep``.
        module_spans: module spans of every rank.
        hangs: hang records of every rank, in file order.
        gc_pauses: garbage-collector pauses of every rank, in file order.
        trace_steps: ``trace_id -> step`` (``None`` for traces outside steps).
        presence: ``trace_id -> ranks`` that wrote any span of that trace.
        trace_start: ``trace_id -> `` earliest start of any span of it (orders traces).
        world_size: from the resources or rank spans, when any says.
        rank_sample: how the traced ranks were chosen (``commspan.sampling.ranks``),
            when not all ranks traced.
        ranks: every rank that wrote a span.
        skipped: counts of what could not be used (spans without a rank, ...).
        unread: ``(rank, trace_id) ->`` the damaged line that may have held some of
            that rank's collectives of that trace (:mod:`commspan.analysis.unread`):
            what the rank issued there is unknown, ``check`` does not compare it.
        span_times: the module spans folded for the step-time view, when that is
            what was kept of them instead of :attr:`module_spans` (the digests'
            reader for ``stragglers``); ``None`` otherwise.
    """

    collectives: list[CollectiveRecord] = field(default_factory=list)
    rank_steps: dict[tuple[int, str], RankStep] = field(default_factory=dict)
    module_spans: list[ModuleSpan] = field(default_factory=list)
    hangs: list[HangRecord] = field(default_factory=list)
    gc_pauses: list[GcRecord] = field(default_factory=list)
    trace_steps: dict[str, int | None] = field(default_factory=dict)
    presence: dict[str, set[int]] = field(default_factory=dict)
    trace_start: dict[str, int] = field(default_factory=dict)
    world_size: int | None = None
    ranks: set[int] = field(default_factory=set)
    skipped: Counter[str] = field(default_factory=Counter)
    rank_sample: str | None = None
    unread: dict[tuple[int, str], Unread] = field(default_factory=dict)
    span_times: SpanTimes | None = None

    def expected_ranks(self) -> list[int]:
        """Ranks that should have written spans: ``range(world_size)`` and every rank
        seen; when the run traced some ranks only (:attr:`rank_sample`), the ranks
        seen and those the sample names (a sample of given ranks)."""
        expected = set(self.ranks)
        if self.rank_sample is None:
            if self.world_size:
                expected.update(range(self.world_size))
        else:
            expected.update(r for r in self.listed_ranks()
                            if not self.world_size or r < self.world_size)
        return sorted(expected)

    def left_out(self, rank: int) -> bool:
        """Whether the run's rank sample left ``rank`` out: it traced only some ranks,
        ``rank`` wrote nothing and the sample does not name it (then nothing is known of
        what it did, which is not a sign that it stopped)."""
        return bool(self.rank_sample) and rank not in self.ranks \
            and rank not in self.listed_ranks()

    def listed_ranks(self) -> frozenset[int]:
        """The ranks the sample says trace: those of a sample of given ranks
        (``commspan.sampling.ranks`` is ``"ranks 0,1,2"``), or those a fraction or
        one per group chose (``"fraction 0.5 (ranks 0,2)"``); a rank of them that
        wrote nothing stopped. Empty when the sample does not name them (files
        written before it did) and without one."""
        return sampled_ranks(self.rank_sample)

    @property
    def sample_rule(self) -> str | None:
        """:attr:`rank_sample` without the ranks a fraction or one per group chose
        (``"fraction 0.5"``), for messages."""
        return sample_rule(self.rank_sample)

    def traces(self) -> list[str]:
        """Trace ids in the order the run went through them: steps by number (the
        ranks' clocks need not agree: ordering by the earliest span, a skewed rank
        missing from a step put it out of place), a trace outside steps after the
        last step that started before it, by its earliest span."""
        steps = sorted((self.trace_start.get(t, 0), step)
                       for t, step in self.trace_steps.items() if step is not None)

        def key(t: str) -> tuple[int, int, int, str]:
            step = self.trace_steps.get(t)
            start = self.trace_start.get(t, 0)
            if step is not None:
                return (step, 1, start, t)
            # after the latest step started before it (host clock: approximate)
            before = [s for at, s in steps if at <= start]
            return (max(before) if before else (steps[0][1] - 1 if steps else 0), 2, start, t)

        return sorted(self.presence, key=key)

    def latest_hangs(self) -> dict[int, HangRecord]:
        """The latest hang record of each rank that wrote one."""
        latest: dict[int, HangRecord] = {}
        for h in self.hangs:
            if h.rank not in latest or h.time_ns >= latest[h.rank].time_ns:
                latest[h.rank] = h
        return latest


def sample_rule(sample: str | None) -> str | None:
    """``"fraction 0.5 (ranks 0,2)"`` -> ``"fraction 0.5"``: the rule of a rank sample
    (``commspan.sampling.ranks``) without the ranks it chose.

    Example:
        >>> sample_rule("one per tp group (ranks 0,8)"), sample_rule("ranks 0,2")
        ('one per tp group', 'ranks 0,2')
    """
    return _split_sample(sample)[0] if sample else sample


def _split_sample(sample: str) -> tuple[str, str | None]:
    """``"fraction 0.5 (ranks 0,2)"`` -> ``("fraction 0.5", "0,2")``: a rank sample's
    rule and the ranks it chose, when it lists them after the rule (``None`` if not)."""
    if sample.endswith(")") and " (ranks " in sample:
        cut = sample.rindex(" (ranks ")
        return sample[:cut], sample[cut + len(" (ranks "):-1]
    return sample, None


def sampled_ranks(sample: str | None) -> frozenset[int]:
    """The ranks a rank sample (``commspan.sampling.ranks``) says trace, when it names
    them (:meth:`Run.listed_ranks`); empty otherwise.

    Example:
        >>> sorted(sampled_ranks("fraction 0.5 (ranks 0,2-3)"))
        [0, 2, 3]
    """
    if not sample:
        return frozenset()
    text = sample[len("ranks "):] if sample.startswith("ranks ") else _split_sample(sample)[1]
    if text is None:
        return frozenset()
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.partition("-")
            ranks.update(range(int(first), int(last) + 1) if dash else (int(first),))
    except ValueError:
        return frozenset()
    return frozenset(ranks)


def _step_key(step: int | None) -> tuple[bool, int]:
    return (step is None, step if step is not None else 0)


def load_run(
    paths: RunPaths,
    *,
    steps: Iterable[int] | None = None,
    module_spans: bool | Literal["folded"] = True,
    strict: bool = True,
    report: ReadReport | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    run: str | None = None,
) -> Run:
    """Read the JSONL files of a run into a :class:`Run`.

    Where the files have digests (``JsonlSpanExporter(digest=True)`` or ``commspan
    digest``; docs/jsonl.md, "Digests") and every line reads cleanly, the digests are
    read instead of the lines, as the ``commspan`` commands read them: the same
    :class:`Run`, in seconds instead of minutes over a thousand ranks. A file without
    one is digested in memory as its lines are parsed, so that the run never holds
    every span at once (a thousand ranks' spans take some 11 GB).

    Args:
        paths: JSONL files written by ``JsonlSpanExporter``, or directories of them.
        steps: keep only these step numbers (traces outside steps are dropped too);
            ``None`` keeps everything.
        run: the run to read when the files hold several (a job restarted into
            the same folder): its ``commspan.run_id``, or a prefix naming one run;
            ``None`` reads the only run, or the latest of several, with a warning
            naming the others, as the command line does (runs are never summed).
        module_spans: keep the module spans (only the step-time view needs them);
            ``"folded"`` keeps only what that view reads of them
            (:attr:`Run.span_times`, folded a rank at a time from digests: a
            thousand ranks' module spans take gigabytes).
        strict, report, max_line_bytes: how damaged and over-long lines are
            handled, as for :func:`~commspan.exporters.read_spans` (``strict=False``
            skips a damaged line and reads the rest).

    Returns:
        The run's records.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: no path, an empty directory, a line that is not JSON (names
            file and line), a file that is not OTLP/JSON spans (names the file), no
            commspan span in the files (empty files, another program's spans),
            ``steps`` not a collection of ints, ``run`` naming no run of the
            files or no step of ``steps`` in the run read
            (:class:`~commspan.analysis.runs.SelectionError`, listing the runs or
            steps there are).

    Example:
        >>> from commspan.analysis.records import load_run
        >>> load_run("no-such-dir")
        Traceback (most recent call last):
        ...
        FileNotFoundError: paths: 'no-such-dir' does not exist
    """
    wanted = _check_steps(steps)
    files = jsonl_files(paths)
    if not files:
        raise ValueError("paths is empty; pass at least one JSONL file or directory")
    if run is not None and not isinstance(run, str):
        raise TypeError(f"run={run!r} is not valid; pass a run id (str), a prefix of one, "
                        "or None for the latest run")
    if module_spans not in (True, False, "folded"):
        raise ValueError(f"module_spans={module_spans!r} is not valid; pass True, False "
                         "or 'folded'")
    from commspan.analysis.unread import LineTally, copies_note

    read = report if report is not None else ReadReport()
    digested = _load_digested(files, wanted, module_spans, read, max_line_bytes, run)
    if digested is not None:
        return digested
    # One pass, a Run built per run of the files as their spans are read (a span
    # record lives as long as its line): the run chosen is known at the end only.
    runs = RunsBuilder(bool(module_spans))
    lines = LineTally()  # where a damaged line lies: the steps it may have held
    before, lines_before, spans_before = len(read.skipped), read.lines, read.spans
    ours = read.commspan_spans
    for span in _read(files, strict, read, max_line_bytes, lines.add):
        runs.add(span)
    if read.commspan_spans == ours:  # (an empty Run: check_run would find nothing wrong)
        raise no_commspan_span("paths", files, read.lines - lines_before,
                               read.spans - spans_before, len(read.skipped) - before)
    chosen, note = runs.tally.choose(run)  # (the note says too if two jobs wrote the run)
    if note:
        _log.warning("%s", note)
    copied = copies_note(lines)
    if copied:
        _log.warning("%s", copied)
    if report is None:  # (skipped lines are logged when no report collects them)
        logger = LineReader(strict, None, max_line_bytes, False)
        for s in read.skipped[before:]:
            logger.skip(Path(s.path), s.line, s.kind, s.reason)
    if chosen is None:
        return build_run([])
    require_steps(wanted, chosen.steps, f"run {chosen.run_id}" if chosen.run_id else "")
    built = runs.finish(chosen.run_id, wanted)
    built.unread = {(u.rank, u.trace_id): u for u in lines.locate(read.skipped[before:])
                    if u.run_id == chosen.run_id and u.trace_id in built.presence}
    if module_spans == "folded":
        built.span_times, built.module_spans = SpanTimes.of(built.module_spans), []
    return built


def _load_digested(files: Sequence[Path], wanted: frozenset[int] | None,
                   module_spans: bool | Literal["folded"], report: ReadReport,
                   max_line_bytes: int, run: str | None) -> Run | None:
    """:func:`load_run` from the files' digests (docs/jsonl.md, "Digests"), as the
    ``commspan`` commands read them; ``None`` (then the lines are parsed) when a file
    has no digest of this version (with ``module_spans``: one whose lines' module spans
    do not all hold), when no span of the files is commspan's (the lines' reader says
    so), or when a line was skipped: a damaged line raises or is located
    (:attr:`Run.unread`) by the lines' reader, a torn one is logged by it."""
    from commspan.analysis.digest import (
        list_part_runs,
        load_parts,
        run_from_parts,
    )
    from commspan.analysis.runs import choose_run

    read = ReadReport()
    parts = load_parts(files, read, max_line_bytes, bool(module_spans))
    if parts is None or read.skipped or not any(p["commspan_spans"] for p in parts):
        return None
    report.add(read)  # (what was read, also when the selection below raises)
    every = list_part_runs(parts)
    chosen, note = choose_run(every, run)  # (SelectionError: as from the lines)
    if chosen is None:
        return None
    if note:
        _log.warning("%s", note)
    require_steps(wanted, chosen.steps, f"run {chosen.run_id}" if chosen.run_id else "")
    if len(every) > 1:
        parts = [p for p in parts if p["run"] == chosen.run_id]
    built = run_from_parts(parts, module_spans)
    if wanted is not None:
        _keep_steps(built, wanted)
    return built


def _read(files: Sequence[Path], strict: bool = True, report: ReadReport | None = None,
          max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
          on_line: Callable[[Path, int, Sequence[SpanRecord]], None] | None = None,
          ) -> Iterator[SpanRecord]:
    """The spans of ``files``; a file of JSON that is not OTLP spans is a ValueError
    naming it (read_spans names file and line for lines that are not JSON)."""
    for f in files:
        try:
            yield from read_spans_in([f], strict=strict, report=report,
                                     max_line_bytes=max_line_bytes, on_line=on_line)
        except ValueError as exc:
            if str(exc).startswith(str(f)):
                raise
            raise ValueError(f"{f}: not a JSONL file of OTLP spans ({exc})") from None
        except (AttributeError, TypeError, KeyError) as exc:
            raise ValueError(
                f"{f}: not a JSONL file of OTLP spans ({type(exc).__name__}: {exc}); pass "
                "files written by JsonlSpanExporter"
            ) from None


def require_steps(wanted: frozenset[int] | None, there: Iterable[int], where: str = "") -> None:
    """A :class:`~commspan.analysis.runs.SelectionError` when steps were asked for
    (``wanted``) and none of them is among the run's (``there``; ``where``: ``"run
    ID"``): a typo'd step would check nothing and read "consistent", where the
    command line says it is not in the run."""
    held = set(there)
    if wanted is None or wanted & held:
        return
    from commspan.analysis.runs import SelectionError, format_numbers

    steps = f"steps {format_numbers(sorted(held))}" if held else "no steps"
    raise SelectionError("steps", sorted(wanted),
                         f"none of them is in {where or 'the run read'}, which has {steps}")


def _check_steps(steps: Iterable[int] | None) -> frozenset[int] | None:
    if steps is None:
        return None
    if isinstance(steps, (str, bytes)):  # ("0-2": its characters are no steps)
        raise ValueError(f"steps={steps!r} is not valid; pass step numbers (ints), e.g. "
                         "steps=[0, 1] or steps=range(0, 3), or None")
    try:
        values = list(steps)
    except TypeError:
        raise ValueError(
            f"steps={steps!r} is not valid; pass step numbers (ints) or None"
        ) from None
    bad = [s for s in values if not isinstance(s, int) or isinstance(s, bool)]
    if bad:
        raise ValueError(f"steps: {bad[0]!r} is not a step number; pass ints, e.g. steps=[0, 1]")
    return frozenset(values)


def build_run(
    spans: Iterable[SpanRecord],
    *,
    steps: Iterable[int] | None = None,
    module_spans: bool = True,
) -> Run:
    """Build a :class:`Run` from span records (as :func:`commspan.exporters.read_spans` yields).

    Collective events become :class:`CollectiveRecord` s; their step is their
    trace's step, taken from the rank spans (or hang records, or the step root)
    once every span has been read.

    Args:
        spans: span records of any number of ranks, in any order.
        steps: keep only these step numbers; ``None`` keeps everything.
        module_spans: keep the module spans (only the step-time view needs them).

    Returns:
        The run's records.
    """
    wanted = _check_steps(steps)
    builder = _RunBuilder(module_spans)
    for span in spans:
        builder.add(span)
    return builder.finish(wanted)


class RunsBuilder:
    """:func:`build_run` one span at a time for each run of the spans added, and the
    :class:`~commspan.analysis.runs.RunTally` of them all: the runs of files read one
    span at a time, the one to keep known only at the end (:func:`load_run`, the
    commands that build a run as they read).

    Example:
        >>> RunsBuilder().finish("no-such-run").collectives
        []
    """

    def __init__(self, module_spans: bool = True, tally: Any = None) -> None:
        from commspan.analysis.runs import RunTally

        self.tally = RunTally() if tally is None else tally
        self._module_spans = module_spans
        self._builders: dict[str, _RunBuilder] = {}

    def add(self, span: SpanRecord) -> str:
        """Count ``span`` and add it to its run's; returns its run id (``""`` for none)."""
        run_id = self.tally.add(span)
        builder = self._builders.get(run_id)
        if builder is None:
            builder = self._builders[run_id] = _RunBuilder(self._module_spans)
        builder.add(span)
        return run_id

    def finish(self, run_id: str, wanted: frozenset[int] | None = None) -> Run:
        """The :class:`Run` of ``run_id``'s spans (empty when none was added), of the
        steps ``wanted`` only if given; its builder is let go (once per run)."""
        builder = self._builders.pop(run_id, None)
        return (builder or _RunBuilder(self._module_spans)).finish(wanted)

    def clear(self) -> None:
        """Let go of every run not finished."""
        self._builders.clear()


class _RunBuilder:
    """:func:`build_run` one span at a time (:func:`load_run` feeds one per run of the
    files as it reads them, holding no span record longer than its line).

    The texts and tuples the records repeat (trace ids, module names, a group's
    ranks, shapes) are kept once each: a thousand-rank run repeats them millions of
    times."""

    def __init__(self, module_spans: bool = True) -> None:
        self.module_spans = module_spans
        self.run = Run()
        self.pending: list[CollectiveRecord] = []
        self.hang_spans: list[tuple[int, SpanRecord]] = []
        self.gc_pending: list[tuple[int, str, int, dict[str, Any]]] = []
        # (rank, trace) -> (end, start, error or None) of its rank span that ended
        # last: a step number used again is left on an error only if its last use was
        self.errors: dict[tuple[int, str], tuple[int, int, str | None]] = {}
        # (rank, trace) -> (time, fqn, phase) of its latest exception event
        self.raised: dict[tuple[int, str], tuple[int, str | None, str | None]] = {}
        self.shared: dict[Any, Any] = {}

    def _one(self, value: _T) -> _T:
        """``value``, or the equal one kept before."""
        try:
            return self.shared.setdefault(value, value)
        except TypeError:  # (unhashable: a damaged shape of lists)
            return value

    def add(self, span: SpanRecord) -> None:
        run = self.run
        rank = record_rank(span)
        world = span.resource.get(semconv.WORLD_SIZE, span.attributes.get(semconv.WORLD_SIZE))
        if isinstance(world, int) and 0 < world <= MAX_WORLD_SIZE:
            run.world_size = max(run.world_size or 0, world)
        sample = span.resource.get(semconv.SAMPLING_RANKS)
        if sample:
            run.rank_sample = str(sample)
        step = span.attributes.get(semconv.STEP)
        trace_id = self._one(span.trace_id)
        if span.name in (semconv.SPAN_STEP, semconv.SPAN_RANK, semconv.SPAN_HANG) and isinstance(
            step, int
        ):
            run.trace_steps[trace_id] = step
        if rank is None:
            run.skipped["spans without a rank"] += 1
            return
        run.ranks.add(rank)
        if span.name == semconv.SPAN_STEP:
            return  # written by rank 0 for all ranks: says nothing of rank 0 itself
        run.presence.setdefault(trace_id, set()).add(rank)
        start = run.trace_start.get(trace_id)
        if start is None or span.start_time < start:
            run.trace_start[trace_id] = span.start_time
        if span.name == semconv.SPAN_HANG:
            self.hang_spans.append((rank, span))
            return
        if span.name == semconv.SPAN_RANK:
            key = (rank, trace_id)
            seen = run.rank_steps.get(key)
            last_use = self.errors.get(key)
            if last_use is None or span.end_time >= last_use[0]:
                self.errors[key] = (span.end_time, span.start_time,
                                    span.status_message or "error"
                                    if span.status_code == _STATUS_ERROR else None)
            if seen is None:
                run.rank_steps[key] = RankStep(
                    rank, None, trace_id, span.span_id, span.start_time, span.end_time
                )
            else:  # the step number used again: the same trace (RankStep.repeats)
                first, later = sorted(
                    [(seen.start_ns, seen.end_ns, seen.span_id),
                     (span.start_time, span.end_time, span.span_id)])
                run.rank_steps[key] = seen._replace(
                    span_id=first[2], start_ns=first[0], end_ns=first[1],
                    repeats=tuple(sorted([*seen.repeats, (later[2], later[0], later[1])],
                                         key=lambda r: r[1])))
        else:
            fqn = span.attributes.get(semconv.MODULE_FQN)
            phase = span.attributes.get(semconv.PHASE)
            if self.module_spans and isinstance(fqn, str) and isinstance(phase, str):
                run.module_spans.append(
                    ModuleSpan(
                        rank,
                        trace_id,
                        span.span_id,
                        span.parent_span_id,
                        self._one(fqn),
                        self._one(phase),
                        span.start_time,
                        span.end_time,
                    )
                )
        for (name, attrs), t in zip(span.events, _times(span)):
            if semconv.COLL_OP in attrs:
                # (the step is its trace's, known once every span is read)
                rec = _collective(rank, None, trace_id, t, attrs, self._one)
                if rec is None:
                    run.skipped["collective events without an op name"] += 1
                else:
                    self.pending.append(rec)
            elif name == semconv.EVENT_GC:
                self.gc_pending.append((rank, trace_id, t, attrs))
            elif name == semconv.EVENT_EXCEPTION:
                key = (rank, trace_id)
                if key not in self.raised or t >= self.raised[key][0]:
                    self.raised[key] = (t, *_raised_where(span.name, span.attributes))

    def finish(self, wanted: frozenset[int] | None = None) -> Run:
        """The :class:`Run` of the spans added (once)."""
        run = self.run
        steps_of = run.trace_steps
        make = tuple.__new__
        run.collectives = [make(CollectiveRecord, (rec[0], steps_of[rec.trace_id], *rec[2:]))
                           if rec.trace_id in steps_of else rec for rec in self.pending]
        self.pending = []
        for rank, span in self.hang_spans:
            run.hangs.append(_hang(rank, span, run.trace_steps.get(span.trace_id)))
        for rank, trace_id, t, attrs in self.gc_pending:
            pause = gc_event_fields(attrs)
            if pause is None:
                run.skipped["garbage-collection events without a duration"] += 1
                continue
            run.gc_pauses.append(GcRecord(rank, run.trace_steps.get(trace_id), trace_id, t,
                                          *pause))
        for key, (_end, start, error) in self.errors.items():
            if error is None:
                continue
            where = self.raised.get(key, (0, None, None))
            if where[0] < start:  # (the exception events of an earlier use)
                where = (0, None, None)
            run.rank_steps[key] = run.rank_steps[key]._replace(
                error=error, error_fqn=where[1], error_phase=where[2])
        run.rank_steps = {
            key: rs._replace(step=run.trace_steps.get(rs.trace_id))
            for key, rs in run.rank_steps.items()
        }
        if wanted is not None:
            _keep_steps(run, wanted)
        if run.skipped:
            _log.info("commspan: records skipped while reading the run: %s", dict(run.skipped))
        return run


def _raised_where(name: str, attrs: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(fqn, phase)`` of the span an ``exception`` event is on: a module span's module
    and phase, ``(None, None)`` for the rank or step span (raised outside every
    module)."""
    if name in (semconv.SPAN_RANK, semconv.SPAN_STEP):
        return None, None
    return _str(attrs.get(semconv.MODULE_FQN)), _str(attrs.get(semconv.PHASE))


def _times(span: SpanRecord) -> Iterator[int]:
    yield from span.event_times
    while True:  # event_times shorter than events: fall back on the span's start
        yield span.start_time


_T = TypeVar("_T")


def latest_before(items: Iterable[_T], first: int,
                  where: Callable[[_T], tuple[int | None, int | None, int]],
                  present: set[int | None]) -> list[_T]:
    """Of hang records (``items``; ``where`` gives each one's rank, step and time), the
    latest of each rank not in ``present`` (those with a record in the selected steps)
    from a step before ``first``: that rank never got to the selected steps, and the
    record says where it is stuck, so a step selection keeps it (``check --step`` would
    otherwise say the rank wrote nothing)."""
    latest: dict[int, tuple[int, _T]] = {}
    for item in items:
        rank, step, time_ns = where(item)
        if rank is None or rank in present or step is None or step >= first:
            continue
        if rank not in latest or time_ns >= latest[rank][0]:
            latest[rank] = (time_ns, item)
    return [item for _, item in latest.values()]


def _hang_where(h: HangRecord) -> tuple[int | None, int | None, int]:
    return h.rank, h.step, h.time_ns


def _keep_steps(run: Run, wanted: frozenset[int]) -> None:
    keep = {t for t, s in run.trace_steps.items() if s in wanted}
    run.collectives = [c for c in run.collectives if c.trace_id in keep]
    run.rank_steps = {k: v for k, v in run.rank_steps.items() if v.trace_id in keep}
    run.module_spans = [m for m in run.module_spans if m.trace_id in keep]
    kept = [h for h in run.hangs if h.trace_id in keep]
    if wanted:
        kept += latest_before(run.hangs, min(wanted), _hang_where, {h.rank for h in kept})
    run.hangs = kept
    run.gc_pauses = [g for g in run.gc_pauses if g.trace_id in keep]
    run.presence = {t: r for t, r in run.presence.items() if t in keep}
    run.unread = {k: u for k, u in run.unread.items() if u.trace_id in keep}
    run.trace_start = {t: s for t, s in run.trace_start.items() if t in keep}


def gc_event_fields(
    attrs: Mapping[str, Any],
) -> tuple[int, int, str | None, str | None] | None:
    """``(duration_ns, generation, fqn, phase)`` of a ``commspan.gc`` event's attributes
    (generation 2 when absent; fqn and phase ``None`` outside every module), or
    ``None`` when it has no duration.

    Example:
        >>> gc_event_fields({"commspan.gc.duration_ns": 5, "commspan.gc.generation": 1})
        (5, 1, None, None)
    """
    duration = _int(attrs.get(semconv.GC_DURATION_NS))
    if duration is None:
        return None
    generation = _int(attrs.get(semconv.GC_GENERATION))
    return (duration, 2 if generation is None else generation,
            _str(attrs.get(semconv.MODULE_FQN)), _str(attrs.get(semconv.PHASE)))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _itself(value: _T) -> _T:
    return value


def _collective(
    rank: int, step: int | None, trace_id: str, issued: int, attrs: dict[str, Any],
    one: Callable[[Any], Any] = _itself,
) -> CollectiveRecord | None:
    """The record of a collective event (``None`` without an op name); ``one`` gives
    the object kept for each text and tuple (:meth:`_RunBuilder._one`)."""
    op = _str(attrs.get(semconv.COLL_OP))
    if op is None:
        return None
    shape = attrs.get(semconv.TENSOR_SHAPE)
    peer = attrs.get(semconv.COLL_PEER)
    if isinstance(peer, list):
        peer = tuple(p for p in peer if isinstance(p, int))
    elif not isinstance(peer, int) or isinstance(peer, bool):
        peer = None
    ranks = attrs.get(semconv.PG_RANKS)
    duration = _int(attrs.get(semconv.COLL_DURATION_NS))
    state = _str(attrs.get(semconv.COLL_STATE))
    if state is None:
        state = semconv.STATE_COMPLETED if duration is not None else semconv.STATE_ISSUED
    phase = _str(attrs.get(semconv.PHASE)) or semconv.Phase.FORWARD.value
    fqn = _str(attrs.get(semconv.MODULE_FQN)) or semconv.GLOBAL_FQN
    owner = _str(attrs.get(semconv.OWNER_FQN))
    return CollectiveRecord(
        rank=rank,
        step=step,
        trace_id=trace_id,
        group=one(_str(attrs.get(semconv.PG_NAME)) or ""),
        group_ranks=one(tuple(r for r in ranks if isinstance(r, int)))
        if isinstance(ranks, list)
        else (),
        seq=_int(attrs.get(semconv.COLL_SEQ)),
        p2p_seq=_int(attrs.get(semconv.P2P_SEQ)),
        op=one(op),
        kind=_str(attrs.get(semconv.COLL_KIND)) or semconv.KIND_COLLECTIVE,
        dtype=one(_str(attrs.get(semconv.TENSOR_DTYPE))),
        shape=one(tuple(shape)) if isinstance(shape, list) else None,
        nbytes=_int(attrs.get(semconv.TENSOR_BYTES)),
        reduce_op=_str(attrs.get(semconv.COLL_REDUCE_OP)),
        peer=peer,
        fqn=one(fqn),
        phase=one(phase),
        issued_ns=issued,
        duration_ns=duration,
        state=state,
        wait_ns=_int(attrs.get(semconv.COLL_WAIT_NS)),
        owner=one(owner) if owner is not None and owner != fqn else None,
        tag=_int(attrs.get(semconv.P2P_TAG)),
        splits=_splits(attrs),
        root_rank=_int(attrs.get(semconv.COLL_ROOT)),
    )


def _splits(attrs: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(input, output)`` split sizes of an all-to-all event, when it has both."""
    ins, outs = attrs.get(semconv.COLL_INPUT_SPLITS), attrs.get(semconv.COLL_OUTPUT_SPLITS)
    if type(ins) is not list or type(outs) is not list or not all(
            type(n) is int for n in (*ins, *outs)):
        return None
    return tuple(ins), tuple(outs)


def _hang(rank: int, span: SpanRecord, step: int | None) -> HangRecord:
    fqns = span.attributes.get(semconv.HANG_STACK_FQNS)
    phases = span.attributes.get(semconv.HANG_STACK_PHASES)
    fqns = [str(f) for f in fqns] if isinstance(fqns, list) else []
    phases = [str(p) for p in phases] if isinstance(phases, list) else []
    phases += [""] * (len(fqns) - len(phases))  # tolerate a short array
    stack = tuple(zip(fqns, phases))
    collectives = []
    for (_name, attrs), t in zip(span.events, _times(span)):
        rec = _collective(rank, step, span.trace_id, t, attrs)
        if rec is not None:
            collectives.append(rec)
    return HangRecord(
        rank=rank,
        step=step,
        trace_id=span.trace_id,
        reason=_str(span.attributes.get(semconv.HANG_REASON)) or "",
        time_ns=span.end_time,
        stack=stack,
        collectives=tuple(collectives),
        step_traced=span.attributes.get(semconv.HANG_STEP_TRACED) is not False,
    )
