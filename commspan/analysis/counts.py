"""Collective counts per module and phase, derived from commspan's spans.

The :class:`Aggregator` is an ordinary OpenTelemetry span processor. It reads
only what the spans carry: the per-op count attributes of module and rank
spans (``commspan.collectives.<phase>.<op>``), their parameter attributes, and
their collective events (whose ``commspan.owner.credit_fqns`` name the modules
a collective counts for that had no open span when it was issued). So the same
numbers come out of a live run, of JSONL files written by
:class:`~commspan.exporters.JsonlSpanExporter` (:meth:`Aggregator.from_jsonl`),
and of any backend the spans were sent to.

Example:
    >>> from commspan import CommSpanMode
    >>> mode = CommSpanMode()
    >>> with mode:
    ...     pass  # model(x).sum().backward()
    >>> mode.aggregator.comm_counts()
    {}
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from commspan import semconv
from commspan._fork import renew_after_fork
from commspan.analysis.tree import PHASE_ORDER, Counts, ModuleRecord, module_tree
from commspan.otlpjson.decode import LineReader, resource_rank, span_time, walk
from commspan.otlpjson.encode import paused_gc
from commspan.otlpjson.files import jsonl_files
from commspan.otlpjson.records import (
    DEFAULT_MAX_LINE_BYTES,
    ReadReport,
    SpanRecord,
    no_commspan_span,
    rank_value,
)
from commspan.ownership import counted_names
from commspan.spans.frames import OpenSpan

__all__ = ["Aggregator", "CollectiveSummary", "LiveView", "mesh_dim_of"]

_PHASE_ORDER = PHASE_ORDER


@dataclass(frozen=True)
class CollectiveSummary:
    """Collectives of one kind owned directly by one module (not its children).

    Attributes:
        fqn: module that owns them (``commspan.owner.fqn``): the module that
            issued them (``Global`` outside any module), or for framework
            communication the module it serves (an FSDP unit, a DDP bucket's
            module; docs/parallelisms.md).
        phase: ``forward``, ``backward``, ``recompute`` or ``setup``.
        op: canonical op name.
        src: DTensor placements before the redistribution, ``""`` if none.
        dst: DTensor placements after it, ``""`` if none.
        count: how many.
        bytes: input bytes, summed.
    """

    fqn: str
    phase: str
    op: str
    src: str
    dst: str
    count: int
    bytes: int


LiveView = Callable[[], Iterable[OpenSpan]]
"""The spans still open, e.g. :meth:`commspan.spans.SpanRecorder.open_spans`."""


class Aggregator(SpanProcessor):
    """Counts collectives per module and phase from commspan spans.

    A collective counts for the module that owns it (the module that issued
    it, or the one framework communication serves: docs/parallelisms.md), for
    every module enclosing it, and for ``Global``. Counts accumulate until :meth:`reset`
    (``CommSpanMode`` resets its aggregator each time it is entered).

    Args:
        rank: only count spans of this rank (``None``: every span given).
    """

    def __init__(self, rank: int | None = None) -> None:
        self._rank = rank
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")  # readers on other threads take it
        self._live: LiveView | None = None
        self.reset()

    # ------------------------------------------------------------ processor API
    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do when a span starts."""

    def on_end(self, span: ReadableSpan) -> None:
        """Fold one finished span into the counts."""
        try:  # an SDK span's stored fields: its properties wrap them anew at each read
            attrs, span_events, start = span._attributes, span._events, span._start_time
        except AttributeError:
            attrs, span_events, start = span.attributes, span.events, span.start_time
        if not attrs:
            return
        fqn = attrs.get(semconv.MODULE_FQN)
        if fqn is None:
            return
        if self._rank is not None and _rank_of(span) not in (None, self._rank):
            return
        events = [(e.name, e.attributes or {}) for e in span_events] if span_events else ()
        with self._lock:
            self._add(str(fqn), attrs, start or 0, events)

    def shutdown(self) -> None:
        """Nothing to release."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered; always ``True``."""
        return True

    # ------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every count."""
        self._counts: Counts = {}
        self._modules: dict[str, ModuleRecord] = {}
        self._summaries: dict[tuple[str, str, str, str, str], list[int]] = {}
        # (owner, mesh dimension, phase, op) -> [count, bytes]
        self._by_dim: dict[tuple[str, str, str, str], list[int]] = {}
        self._phases: dict[str, set[str]] = {}  # module fqn -> phases it ran in
        # "group <name>" (a group outside every mesh) -> its global ranks, when known
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        self._seen_global = False

    def attach_live(self, live: LiveView | None) -> None:
        """Let queries include the spans that are still open.

        ``CommSpanMode`` attaches its recorder's
        :meth:`~commspan.spans.SpanRecorder.open_spans` while it is entered,
        so ``mode.aggregator`` counts a step in progress too, and detaches it
        (``None``) when it leaves. The view is only read, never changed.

        Args:
            live: returns the open spans (:class:`~commspan.spans.OpenSpan`),
                or ``None`` to count finished spans only.
        """
        self._live = live

    def _add(
        self,
        fqn: str,
        attrs: Mapping[str, Any],
        start: int,
        events: Iterable[tuple[str, Mapping[str, Any]]],
    ) -> None:
        keys = tuple(attrs)  # the plan of the span's count attributes (see _count_plan)
        plan = _PLANS.get(keys, _NO_PLAN)
        if plan is _NO_PLAN:
            plan = _count_plan(keys)
        if plan:  # (inline: one frame less per span)
            per_module = self._counts.get(fqn)
            if per_module is None:
                per_module = self._counts[fqn] = {}
            for name, phase, count_op in plan:
                per_op = per_module.get(phase)
                if per_op is None:
                    per_op = per_module[phase] = {}
                per_op[count_op] = per_op.get(count_op, 0) + int(attrs[name])
        if fqn == semconv.GLOBAL_FQN:
            self._seen_global = True
        else:
            self._note_module(fqn, attrs, start)
            phase = attrs.get(semconv.PHASE)
            if phase:
                self._phases.setdefault(fqn, set()).add(str(phase))
        for _name, ev in events:
            op = ev.get(semconv.COLL_OP)
            if op is None:
                continue
            credited = ev.get(semconv.OWNER_CREDIT)
            if credited:
                self._credit(credited, str(ev.get(semconv.PHASE, "")), str(op), start)
            key = _summary_key(ev, fqn, op)
            nbytes = int(ev.get(semconv.TENSOR_BYTES, 0) or 0)
            slot = self._summaries.get(key)
            if slot is None:
                slot = self._summaries[key] = [0, 0]
            slot[0] += 1
            slot[1] += nbytes
            dim_key = (key[0], mesh_dim_of(ev), key[1], key[2])
            slot = self._by_dim.get(dim_key)
            if slot is None:
                slot = self._by_dim[dim_key] = [0, 0]
                _note_group(self._group_ranks, dim_key[1], ev)
            slot[0] += 1
            slot[1] += nbytes

    def _credit(self, fqns: Iterable[Any], phase: str, op: str, start: int) -> None:
        """Count one collective for modules that had no open span when it was
        issued (an event's ``commspan.owner.credit_fqns``)."""
        for name in fqns:
            fqn = str(name)
            self._phases.setdefault(fqn, set()).add(phase)
            slot = self._counts.setdefault(fqn, {}).setdefault(phase, {})
            slot[op] = slot.get(op, 0) + 1
            if fqn not in self._modules:  # e.g. a DDP module before its first forward
                self._modules[fqn] = ModuleRecord(fqn, "", fqn.count(".") + 1, start)

    def _note_module(self, fqn: str, attrs: Mapping[str, Any], start: int) -> None:
        rec = self._modules.get(fqn)
        if rec is None:
            depth = int(attrs.get(semconv.MODULE_DEPTH, 1) or 1)
            rec = self._modules[fqn] = ModuleRecord(
                fqn, str(attrs.get(semconv.MODULE_TYPE, "")), depth, start
            )
        elif not rec.type and attrs.get(semconv.MODULE_TYPE):
            # known from a credit only: its span tells what it is, and when it first ran
            # (a credit's time is its rank span's, which starts before every module)
            rec.type = str(attrs[semconv.MODULE_TYPE])
            rec.depth = int(attrs.get(semconv.MODULE_DEPTH, 1) or 1)
            rec.first_seen = start
        elif start < rec.first_seen:
            rec.first_seen = start
            rec.depth = int(attrs.get(semconv.MODULE_DEPTH, 1) or 1)
        elif rec.params:
            return
        if attrs.get(semconv.PARAM_NAMES):
            rec.params.update(_params(attrs))

    # ------------------------------------------------------------ queries
    def _snapshot(self) -> tuple[Counts, dict[str, ModuleRecord]]:
        with self._lock:
            counts = {f: {p: dict(o) for p, o in ph.items()} for f, ph in self._counts.items()}
            modules = dict(self._modules)
        if self._live is not None:
            for span in self._live():
                fqn, attrs = span.fqn, span.attributes
                for (phase, op), n in span.counts.items():
                    slot = counts.setdefault(fqn, {}).setdefault(phase, {})
                    slot[op] = slot.get(op, 0) + n
                for (credited, phase, op), n in span.credits.items():
                    slot = counts.setdefault(credited, {}).setdefault(phase, {})
                    slot[op] = slot.get(op, 0) + n
                    if credited not in modules:
                        modules[credited] = ModuleRecord(
                            credited, "", credited.count(".") + 1, 0
                        )
                if fqn != semconv.GLOBAL_FQN and (fqn not in modules or (
                        not modules[fqn].params and semconv.PARAM_NAMES in attrs)):
                    rec = modules[fqn] = ModuleRecord(
                        fqn,
                        str(attrs.get(semconv.MODULE_TYPE, "")),
                        int(attrs.get(semconv.MODULE_DEPTH, 1) or 1),
                        modules[fqn].first_seen if fqn in modules else span.start,
                    )
                    rec.params.update(_params(attrs))  # (a span still open: its own)
        return counts, modules

    def module_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{module fqn: {phase: {op: count}}}``, ``Global`` included.

        Example:
            ``agg.module_counts()["MLPModule.net2"]["forward"]["all_reduce"] == 1``
        """
        counts, _ = self._snapshot()
        return counts

    def comm_counts(self, phase: str | None = None) -> dict[str, int]:
        """``{op: count}`` over the whole rank (optionally one phase)."""
        counts, _ = self._snapshot()
        out: dict[str, int] = {}
        for ph, ops in counts.get(semconv.GLOBAL_FQN, {}).items():
            if phase is not None and ph != phase:
                continue
            for op, n in ops.items():
                out[op] = out.get(op, 0) + n
        return out

    def total_count(self, phase: str | None = None) -> int:
        """Number of collectives over the whole rank (optionally one phase)."""
        return sum(self.comm_counts(phase).values())

    def modules(self) -> list[str]:
        """Module names in the order they first ran."""
        _, modules = self._snapshot()
        return [m.fqn for m in sorted(modules.values(), key=lambda m: m.first_seen)]

    def module_phases(self) -> dict[str, list[str]]:
        """``{module fqn: [phases]}``: the phases each module ran in (its spans' phases,
        and the phases of collectives credited to it), in phase order, whether or not
        it issued collectives there; ``Global`` is not listed.

        Example:
            >>> from commspan import Aggregator
            >>> Aggregator().module_phases()
            {}

            After ``model(x)`` without a backward pass, ``agg.module_phases()["MLP"]``
            is ``["forward"]``.
        """
        with self._lock:
            ran = {fqn: set(phases) for fqn, phases in self._phases.items()}
        if self._live is not None:
            for span in self._live():
                if span.fqn != semconv.GLOBAL_FQN:
                    phase = span.attributes.get(semconv.PHASE)
                    if phase:
                        ran.setdefault(span.fqn, set()).add(str(phase))
                for credited, phase, _op in span.credits:
                    ran.setdefault(credited, set()).add(phase)
        return {fqn: sorted(phases, key=_phase_rank) for fqn, phases in ran.items()}

    def parameter_info(self) -> dict[str, dict[str, dict[str, str]]]:
        """``{module fqn: {param: {"shape": "16x10", "placements": "S(0)"}}}``."""
        _, modules = self._snapshot()
        return {
            m.fqn: {n: {"shape": s, "placements": p} for n, (s, p) in m.params.items()}
            for m in sorted(modules.values(), key=lambda m: m.first_seen)
            if m.params
        }

    def sharding_info(self) -> dict[str, str]:
        """``{"<module fqn>.<param>": placements}`` for every DTensor parameter."""
        return {
            f"{fqn}.{name}": p["placements"]
            for fqn, params in self.parameter_info().items()
            for name, p in params.items()
            if p["placements"]
        }

    def collectives(
        self, fqn: str | None = None, phase: str | None = None, op: str | None = None
    ) -> list[CollectiveSummary]:
        """Collectives grouped by owning module, phase, op and placements: of the
        spans that ended, and, live, of the spans still open (the rank span of a
        step in progress holds the collectives issued outside every module)."""
        with self._lock:
            summaries = {k: list(v) for k, v in self._summaries.items()}
        for key, _ev, nbytes in _collectives_of(self._live() if self._live else ()):
            slot = summaries.setdefault(key, [0, 0])
            slot[0] += 1
            slot[1] += nbytes
        items = list(summaries.items())
        out = [
            CollectiveSummary(k[0], k[1], k[2], k[3], k[4], v[0], v[1])
            for k, v in items
            if (fqn is None or k[0] == fqn)
            and (phase is None or k[1] == phase)
            and (op is None or k[2] == op)
        ]
        out.sort(key=lambda s: (s.fqn, _phase_rank(s.phase), s.op, s.src, s.dst))
        return out

    def mesh_dim_counts(
        self, phase: str | None = None, *, subtree: bool = True
    ) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
        """Collectives and their bytes per module and mesh dimension.

        ``{module fqn: {mesh dimension: {op: {"count": n, "bytes": b}}}}``.
        The mesh dimension is the name the device mesh gives it
        (``mesh_dim_names``, e.g. ``tp``, ``dp_shard``), else ``dim <i>``, else,
        for a process group outside any mesh, ``group <name>``
        (:func:`mesh_dim_of`). Bytes are the input bytes of each collective
        (``commspan.tensor.bytes``), summed. Built from the collective events of
        the spans that ended and, live, of those still open (a step's rank span,
        a module whose collective is not waited yet), so it is the same live,
        after the step and from JSONL.

        Args:
            phase: only this phase (``forward``, ``backward``, ``recompute``,
                ``setup``); ``None``: all.
            subtree: count a collective for its owner, every module enclosing
                the owner by name that has run, and ``Global`` (default);
                ``False``: for its owner only. By name: a submodule registered
                under ``Net.a`` but called from ``Net.b`` counts for ``Net.a``
                here, where :meth:`module_counts` follows the calls and counts
                it for ``Net.b``; the two agree whenever modules run where they
                are registered.

        Example:
            >>> from commspan import Aggregator
            >>> Aggregator().mesh_dim_counts()
            {}

            After a TP + FSDP2 step on a mesh named ``("dp", "tp")``,
            ``agg.mesh_dim_counts()["Model.layers.0"]["tp"]["all_reduce"]``
            might be ``{"count": 2, "bytes": 65536}``.
        """
        with self._lock:
            items: list[tuple[Any, Any]] = list(self._by_dim.items())
            ran = set(self._modules)
        if self._live is not None:  # and the collectives of the spans still open
            live = tuple(self._live())
            ran.update(span.fqn for span in live if span.fqn != semconv.GLOBAL_FQN)
            items.extend(((key[0], mesh_dim_of(ev), key[1], key[2]), (1, nbytes))
                         for key, ev, nbytes in _collectives_of(live))
        out: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
        for (owner, dim, ph, op), (count, nbytes) in items:
            if phase is not None and ph != phase:
                continue
            if not subtree:
                names: tuple[str, ...] = (owner,)
            else:
                names = counted_names(owner, ran) if owner != semconv.GLOBAL_FQN else ()
                names = (*names, semconv.GLOBAL_FQN)
            for name in names:
                slot = out.setdefault(name, {}).setdefault(dim, {}).setdefault(
                    op, {"count": 0, "bytes": 0})
                slot["count"] += count
                slot["bytes"] += nbytes
        return out

    def group_ranks(self) -> dict[str, tuple[int, ...]]:
        """``{"group <name>": ranks}``: the global ranks of each process group outside
        every mesh that :meth:`mesh_dim_counts` names by its name (torch numbers groups
        in the order a process creates them, so the name depends on what ran before;
        the ranks do not). Known from spans given to the aggregator live, not from
        files (which the readers do not read the ranks of).

        Example:
            >>> from commspan import Aggregator
            >>> Aggregator().group_ranks()
            {}
        """
        with self._lock:
            out = dict(self._group_ranks)
        if self._live is not None:
            for _key, ev, _nbytes in _collectives_of(self._live()):
                _note_group(out, mesh_dim_of(ev), ev)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The module tree as JSON-ready data.

        Each node: ``{"fqn", "type", "counts": {phase: {op: n}}, "parameters",
        "children": [...]}``; the root is ``Global``.
        """
        counts, modules = self._snapshot()
        return module_tree(counts, modules)

    def table(self, noise_level: int = 0) -> str:
        """The module tree with collective counts per phase, as text.

        Args:
            noise_level: ``0`` modules and counts; ``1`` adds module types and
                parameter shapes and placements.

        Raises:
            ValueError: ``noise_level`` is not 0 or 1.
        """
        if noise_level not in (0, 1):
            raise ValueError(
                f"noise_level={noise_level!r} is not supported; use 0 (modules and "
                "counts) or 1 (also module types and parameter placements)"
            )
        # the one import of a view from here: table() is public since 0.1
        from commspan.render.table import module_table

        return module_table(self.to_dict(), noise_level)

    # ------------------------------------------------------------ offline
    @classmethod
    def from_jsonl(
        cls,
        *paths: str | os.PathLike[str],
        rank: int | str | None = None,
        strict: bool = True,
        report: ReadReport | None = None,
        max_line_bytes: int | None = None,
        run: str | None = None,
    ) -> Aggregator:
        """Build an aggregator from files written by ``JsonlSpanExporter``.

        Lines are read as :func:`commspan.exporters.read_spans` reads them: a
        torn last line (no trailing newline) is skipped with a warning; a
        damaged line raises, or with ``strict=False`` is skipped while every
        other line counts. A line that cannot be decoded adds nothing.

        Args:
            paths: JSONL files, or directories holding ``*.jsonl`` files.
            rank: which rank to count. ``None`` requires the files to hold one
                rank only; ``"all"`` sums every rank.
            strict: raise on a damaged line (default) or skip it.
            report: a :class:`~commspan.exporters.ReadReport` that collects
                lines read, spans, ranks and skipped lines (these are then not
                logged).
            max_line_bytes: longest line read (``None``: 64 MiB).
            run: which run to count (its ``commspan.run_id``; ``commspan summary``
                lists a folder's runs). ``None`` requires the files to hold one run
                only (a ``JsonlSpanExporter`` appends, so a program run twice into
                one folder writes two); ``"all"`` sums every run.

        Raises:
            ValueError: no path given; no commspan span in the files (empty files,
                files another program's spans, or of damaged lines only: counts of
                them would be empty, and ``assert_no_comm`` would pass on them
                whatever ran); several ranks found and ``rank=None``, or
                ``rank=N`` and the files hold spans of other ranks only, or
                several runs and ``run=None``; a damaged or over-long line and
                ``strict`` (naming file and line).
            FileNotFoundError: a path does not exist, or a directory holds no
                ``*.jsonl`` file (:class:`~commspan.otlpjson.files.NoJsonlFilesError`,
                also a ``ValueError``).

        Example:
            >>> import pathlib, tempfile
            >>> from commspan import Aggregator
            >>> from commspan.exporters import ReadReport
            >>> run_dir = tempfile.mkdtemp()  # a directory of a run's *.jsonl files
            >>> _ = (pathlib.Path(run_dir) / "commspan-rank0.jsonl").write_text("")
            >>> report = ReadReport()
            >>> agg = Aggregator.from_jsonl(run_dir, rank="all", strict=False, report=report)
            Traceback (most recent call last):
            ...
            ValueError: paths: no commspan span in ... (0 lines, 0 spans, ...
            >>> report.damaged  # SkippedLine(path, line, kind, reason) of each damaged line
            []
        """
        if not paths:
            raise ValueError("paths is empty; pass at least one JSONL file or directory")
        files = jsonl_files(paths)
        if rank is not None and rank != "all" and not isinstance(rank, int):
            raise ValueError(f"rank={rank!r} is not valid; pass an int, 'all' or None")
        reader = LineReader(
            strict, report,
            DEFAULT_MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes, False,
        )
        if run is not None and not isinstance(run, str):
            raise ValueError(f"run={run!r} is not valid; pass a run id (str), 'all' or None")
        agg = cls()
        ranks: set[Any] = set()
        runs: set[str] = set()
        only = rank if isinstance(rank, int) else None
        one_run = None if run in (None, "all") else run
        regions = _use_digests(agg, files, only, ranks, report, one_run, runs)
        lines = spans_read = 0
        with paused_gc():  # millions of small acyclic dicts: GC passes cost more than parsing
            for path, number, doc in reader.documents(files, regions):
                try:
                    spans, adds = _decode_document(doc)
                except (TypeError, KeyError, AttributeError, ValueError) as exc:
                    reader.bad_request(path, number, doc, exc)
                    continue
                del doc
                lines += 1
                spans_read += spans
                for r, span_run, fqn, attrs, start, events in adds:
                    runs.add(span_run)
                    if one_run is not None and span_run != one_run:
                        continue
                    ranks.add(r)
                    if only is None or r == only:
                        agg._add(fqn, attrs, start, events)
                if report is not None:
                    report.lines += 1
                    report.spans += spans
                    report.commspan_spans += len(adds)
        if report is not None:
            report.ranks |= ranks
        if not runs:  # (what a digest stands for counts too: its runs are in ``runs``)
            # an empty aggregator: its tables are empty and assert_no_comm passes on it,
            # whatever ran (`commspan table` refuses such files too)
            raise no_commspan_span("paths", files, lines, spans_read, reader.skipped)
        if run is None and len(runs) > 1:
            raise ValueError(
                f"run=None but the files hold {len(runs)} runs "
                f"({', '.join(sorted(repr(r) for r in runs))}"
                f"{_NO_RUN_ID if '' in runs else ''}"
                "): counting them together would sum them; pass run=<id> for one "
                "(`commspan summary` lists them) or run='all' to sum them"
            )
        if one_run is not None and one_run not in runs:
            raise ValueError(
                f"run={run!r} is not a run of these files; they hold "
                f"{', '.join(sorted(repr(r) for r in runs)) or 'none'}"
                + (f"{_NO_RUN_ID}, and they have none: pass one of their run ids, or "
                   "run=None for the only run" if run == "" else "")
            )
        if rank is None and len(ranks) > 1:
            raise ValueError(
                f"rank=None but the files hold spans of ranks {sorted(ranks, key=str)}; "
                "pass rank=<n> for one rank or rank='all' to sum them"
            )
        _check_rank_present(rank, ranks, "files")
        return agg

    @classmethod
    def from_records(
        cls, records: Iterable[Any], *, rank: int | str | None = None
    ) -> Aggregator:
        """Build an aggregator from span records already read (``read_spans``).

        Args:
            records: :class:`~commspan.exporters.SpanRecord` objects.
            rank: as for :meth:`from_jsonl`.

        Raises:
            ValueError: ``rank`` is not valid, several ranks found and ``rank=None``,
                or ``rank=N`` and the records hold spans of other ranks only.

        Example:
            >>> Aggregator.from_records([]).module_counts()
            {}
        """
        if rank is not None and rank != "all" and not isinstance(rank, int):
            raise ValueError(f"rank={rank!r} is not valid; pass an int, 'all' or None")
        if isinstance(records, (str, os.PathLike)):
            raise TypeError(f"records={records!r} is a path, not span records; pass it to "
                            "Aggregator.from_jsonl, or pass read_spans(path)'s records")
        if not isinstance(records, Iterable):
            raise TypeError(f"records={records!r} is not valid; pass SpanRecords (from "
                            "commspan.exporters.read_spans), or files to Aggregator.from_jsonl")
        agg = cls()
        ranks: set[Any] = set()
        for rec in records:
            if not isinstance(rec, SpanRecord):
                raise TypeError(
                    f"records: {rec!r} ({type(rec).__name__}) is not a SpanRecord; pass "
                    "records from commspan.exporters.read_spans, or files to "
                    "Aggregator.from_jsonl")
            fqn = rec.attributes.get(semconv.MODULE_FQN)
            if fqn is None:
                continue
            ranks.add(rec.rank)
            if isinstance(rank, int) and rec.rank != rank:
                continue
            agg._add(str(fqn), rec.attributes, rec.start_time, rec.events)
        if rank is None and len(ranks) > 1:
            raise ValueError(
                f"rank=None but the records hold spans of ranks {sorted(ranks, key=str)}; "
                "pass rank=<n> for one rank or rank='all' to sum them"
            )
        _check_rank_present(rank, ranks, "records")
        return agg


# ------------------------------------------------------------------ helpers
def _check_rank_present(rank: int | str | None, ranks: set[Any], what: str) -> None:
    """Refuse ``rank=N`` when the spans read are of other ranks only: counting it would
    give an empty aggregator, whose tables and assertions of absence pass whatever
    ran (``commspan table --rank N`` refuses it too)."""
    if isinstance(rank, int) and ranks and rank not in ranks:
        raise ValueError(
            f"rank={rank!r} is not valid: the {what} hold no span of that rank (ranks: "
            f"{', '.join(map(str, sorted(ranks, key=_rank_key)))}); pass one of them, or "
            "rank='all' to sum them"
        )


def _rank_key(rank: Any) -> tuple[bool, int, str]:
    return (not isinstance(rank, int), rank if isinstance(rank, int) else 0, str(rank))


def _params(attrs: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """``{param: (shape, placements)}`` of a module span's attributes."""
    names = attrs.get(semconv.PARAM_NAMES)
    if not names:
        return {}
    placements = list(attrs.get(semconv.PARAM_PLACEMENTS) or [""] * len(names))
    shapes = list(attrs.get(semconv.PARAM_SHAPES) or [""] * len(names))
    return {str(name): (str(shapes[i]), str(placements[i])) for i, name in enumerate(names)}


def _collectives_of(
    spans: Iterable[OpenSpan],
) -> Iterator[tuple[tuple[str, str, str, str, str], Mapping[str, Any], int]]:
    """``(summary key, event, bytes)`` of each collective event on ``spans`` (spans
    still open: what the tables of the spans that ended do not hold yet)."""
    for span in spans:
        for _name, ev in span.events:
            op = ev.get(semconv.COLL_OP)
            if op is not None:
                yield (_summary_key(ev, span.fqn, op), ev,
                       int(ev.get(semconv.TENSOR_BYTES, 0) or 0))


def _summary_key(ev: Mapping[str, Any], fqn: str, op: Any) -> tuple[str, str, str, str, str]:
    """(owner, phase, op, placement before, after) of a collective event of a span of
    module ``fqn``: what :meth:`Aggregator.collectives` groups by."""
    return (
        str(ev.get(semconv.OWNER_FQN) or ev.get(semconv.MODULE_FQN, fqn)),
        str(ev.get(semconv.PHASE, "")),
        str(op),
        str(ev.get(semconv.REDIST_SRC, "")),
        str(ev.get(semconv.REDIST_DST, "")),
    )


def _use_digests(
    agg: Aggregator, files: Sequence[Path], only: int | None, ranks: set[Any],
    report: ReadReport | None, run: str | None, runs: set[str],
) -> dict[str, list[tuple[int, int, int]]]:
    """Fold what the files' digests stand for (docs/jsonl.md, "Digests") into ``agg``;
    returns the byte ranges of each file still to be parsed."""
    from commspan.analysis.digest import PartMerger, read_digest

    regions: dict[str, list[tuple[int, int, int]]] = {}
    merger = PartMerger(agg, only, run)
    for path in files:
        digest = read_digest(path)
        if digest is None:
            continue
        for parts in digest.used(report):
            merger.add(parts)
        regions[os.fspath(path)] = digest.gaps()
    merger.finish()
    ranks |= merger.ranks
    runs |= merger.runs
    return regions


_NO_RUN_ID = "; '' is the run of spans without a run id"

_SPAN_KEYS = frozenset(
    {
        semconv.RUN_ID,
        semconv.MODULE_FQN,
        semconv.MODULE_TYPE,
        semconv.MODULE_DEPTH,
        semconv.PARAM_NAMES,
        semconv.PARAM_PLACEMENTS,
        semconv.PARAM_SHAPES,
        semconv.PHASE,
    }
)
_EVENT_KEYS = frozenset(
    {
        semconv.COLL_OP,
        semconv.MODULE_FQN,
        semconv.PHASE,
        semconv.REDIST_SRC,
        semconv.REDIST_DST,
        semconv.TENSOR_BYTES,
        semconv.OWNER_FQN,
        semconv.OWNER_CREDIT,
        semconv.MESH_DIM,
        semconv.MESH_DIM_NAME,
        semconv.PG_NAME,
    }
)


def _note_group(known: dict[str, tuple[int, ...]], dim: str, ev: Mapping[str, Any]) -> None:
    """Keep the ranks of the group ``dim`` names when it is a group outside every mesh
    (``group <name>``) and the event carries them."""
    if dim in known or not dim.startswith("group "):
        return
    ranks = ev.get(semconv.PG_RANKS)
    if ranks:
        try:
            known[dim] = tuple(int(r) for r in ranks)
        except (TypeError, ValueError):  # not a list of ranks: the name it is
            pass


def mesh_dim_of(event: Mapping[str, Any]) -> str:
    """The mesh dimension a collective event ran on, as :meth:`Aggregator.mesh_dim_counts`
    names it: the mesh's name for it, else ``dim <i>``, else ``group <process group>``.

    Example:
        >>> mesh_dim_of({"commspan.mesh.dim_name": "tp"}), mesh_dim_of({"commspan.pg.name": "0"})
        ('tp', 'group 0')
    """
    name = event.get(semconv.MESH_DIM_NAME)
    if name:
        return str(name)
    index = event.get(semconv.MESH_DIM)
    if index is not None and index != "":
        return f"dim {index}"
    group = event.get(semconv.PG_NAME)
    return f"group {group}" if group not in (None, "") else "unknown"


_Add = tuple[Any, str, str, dict[str, Any], int, list[tuple[str, dict[str, Any]]]]


def _decode_document(doc: dict[str, Any]) -> tuple[int, list[_Add]]:
    """Decode one OTLP/JSON request, only what counts need: the number of spans
    and ``(rank, fqn, attributes, start, events)`` of each commspan span. Raises
    (TypeError, KeyError, ...) on a malformed request before anything is counted."""
    decoded = walk(doc, _SPAN_KEYS, _EVENT_KEYS, semconv.COUNT_PREFIX)  # counts: ints
    adds: list[_Add] = []
    for resource, s, attrs, events in decoded:
        fqn = attrs.get(semconv.MODULE_FQN)
        if fqn is None:
            continue
        # (the values the aggregator converts were checked by walk: a line with one of
        # another type is damaged, and adds nothing)
        r = resource_rank(resource, attrs)  # (BadValue: a commspan span without one)
        run = resource.get(semconv.RUN_ID, attrs.get(semconv.RUN_ID))
        adds.append((r, "" if run is None else str(run), str(fqn), attrs,
                     span_time(s, "startTimeUnixNano"), events))
    return len(decoded), adds


_TOTAL_KEYS = tuple(
    f"{semconv.COUNT_PREFIX}{p.value}.{semconv.COUNT_TOTAL}" for p in semconv.Phase
)
_CountPlan = tuple[tuple[str, str, str], ...]
_PLANS: dict[tuple[str, ...], _CountPlan] = {}
"""The count attributes among a span's attribute keys (in their order), as
``(key, phase, op)``, by the tuple of those keys: module spans of a run have a
few such tuples, so a span's counts are read without parsing every key. Empty
when no per-phase total is among them (such a span's counts are not folded)."""
_MAX_PLANS = 4096
_NO_PLAN: Any = object()


def _count_plan(keys: tuple[str, ...]) -> _CountPlan:
    """The plan of :data:`_PLANS` for a tuple of attribute keys (made and kept)."""
    plan: _CountPlan = ()
    if any(key in keys for key in _TOTAL_KEYS):
        parsed = ((key, semconv.parse_count_key(key)) for key in keys)
        plan = tuple((key, *p) for key, p in parsed if p is not None)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[keys] = plan
    return plan


def _rank_of(span: ReadableSpan) -> int | None:
    return rank_value(span.resource.attributes.get(semconv.RANK) if span.resource else None)


def _phase_rank(phase: str) -> int:
    return _PHASE_ORDER.index(phase) if phase in _PHASE_ORDER else len(_PHASE_ORDER)
