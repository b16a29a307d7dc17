"""One function per ``commspan`` command: read the files, call analysis/ and render/.

Each command takes the parsed arguments and a :class:`Reader` (which reads the
files, keeps what was skipped and what to say on stderr) and returns an
:class:`Outcome`: the text for stdout and the status when all went well
(``check`` and ``diff`` say 1 when they found something). An error is raised
and turned into one line by :func:`commspan.cli.main`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, Union

from commspan import semconv
from commspan.analysis.records import Unread
from commspan.analysis.runs import (
    RunInfo,
    Selection,
    SelectionError,
    StepPruner,
    StepRange,
    format_numbers,
    select,
)
from commspan.analysis.unread import LineTally, copies_note, unread_note
from commspan.otlpjson.decode import read_spans_in
from commspan.otlpjson.files import jsonl_files
from commspan.otlpjson.records import (
    DEFAULT_MAX_LINE_BYTES,
    ReadReport,
    SpanRecord,
    count_words,
    no_commspan_span,
)

if TYPE_CHECKING:
    from commspan.analysis.diff import FoldedSide, Profile, ProfileBuilder
    from commspan.analysis.digest import DigestPart, PartSelection
    from commspan.analysis.records import Run

_Sel = TypeVar("_Sel", bound=Union[Selection, "PartSelection"])

__all__ = ["COMMANDS", "ERROR_STATUS", "Damaged", "Outcome", "RankCap", "Reader"]

_MIB = 1024 * 1024


class Outcome(NamedTuple):
    """What a command prints on stdout and its exit status."""

    text: str
    status: int = 0
    written: bool = False
    """The output went to files (``html -o``, ``perfetto -o``, ``digest``): ``text``
    only says so, and a stdout that cannot take it (closed, full) fails nothing
    (``--json``, asked for on stdout, is output)."""
    to_stderr: bool = False
    """``text`` goes to stderr: the output file is stdout itself (``-o /dev/stdout``),
    where a line after it would spoil it."""


class Damaged(Exception):
    """No commspan span was read and lines were damaged: the lines naming them say why."""


def _one_request(path: Path, max_bytes: int) -> str | None:
    """If the regular file ``path`` (gzip'd or not, at most ``max_bytes`` read) is, read
    whole, one OTLP/JSON trace request (JSON written over several lines,
    ``json.dump(..., indent=2)``, instead of one request per line): the shell command
    that writes it as one line; else ``None``."""
    import gzip
    import shlex
    import zlib

    import orjson

    try:
        if not path.is_file() or path.stat().st_size > max_bytes:
            return None
        data = path.read_bytes()
        compressed = data[:2] == b"\x1f\x8b"
        doc = orjson.loads(gzip.decompress(data) if compressed else data)
    except (OSError, EOFError, zlib.error, orjson.JSONDecodeError):
        return None
    if type(doc) is not dict or type(doc.get("resourceSpans")) is not list:
        return None
    name = shlex.quote(str(path))
    read = f"zcat {name} | jq -c ." if compressed else f"jq -c . {name}"
    return f"{read} > one-line.jsonl"


class Reader:
    """Reads the files of one command: skipped lines go to one report, notes for stderr
    (which run was picked among several) to :attr:`notes`, what the output covers (a
    rank sample, ranks that wrote no spans) to :attr:`covers`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report = ReadReport()
        self.notes: list[str] = []
        self.covers: list[str] = []
        """Which ranks of the job the output covers, when not all: said when there is
        an output (an error has none)."""
        self.not_jsonl: dict[str, int] = {}
        """Files none of whose lines is an OTLP/JSON trace request -> their lines."""
        self.one_document: dict[str, str] = {}
        """Those of :attr:`not_jsonl` that are one OTLP/JSON trace request written over
        several lines (pretty-printed) -> the command that makes it one line."""
        self.copied = False
        """Whether a span was read twice (:attr:`LineTally.copies`): the output counts
        some steps twice, and the status says so."""
        self.lines = LineTally()
        """Where each rank's steps are in the lines read: which a damaged line may have
        held (:meth:`unread`)."""
        self._located: list[Unread] | None = None
        self._files: set[str] = set()

    def read(
        self, paths: Sequence[str], label: str = "FILES",
        hold: Callable[[Iterable[SpanRecord]], None] | None = None,
    ) -> list[SpanRecord]:
        """Every span of ``paths``; an error if none of them is a commspan span.
        ``hold``: given each file's spans in turn, instead of returning them (``[]``
        is returned): :meth:`load_built` builds the run as it reads, :class:`RankCap`
        holds some ranks' spans only."""
        files = self.files(paths, label)
        spans, ours, lines = self.report.spans, self.report.commspan_spans, self.report.lines
        skipped, torn = len(self.report.damaged), len(self.report.torn)
        records: list[SpanRecord] = []
        self.lines.new_read()
        copies = len(self.lines.copies)
        for f in files:  # (one at a time: a file none of whose lines is read is named)
            used, damaged = self.report.lines, len(self.report.skipped)
            spans_of = read_spans_in([f], strict=False, report=self.report,
                                     max_line_bytes=self.args.max_line_mib * _MIB,
                                     on_line=self.lines.add)
            if hold is None:
                records.extend(spans_of)
            else:
                hold(spans_of)
            self.check_lines(f, used, damaged)
        self._reading(files)
        if len(self.lines.copies) > copies:
            self.copied = True
            note = copies_note(self.lines, "" if label == "FILES" else f"{label}: ", copies)
            if note is not None and note not in self.notes:
                self.notes.append(note)
        if self.report.commspan_spans == ours:
            if len(self.report.damaged) > skipped:
                raise Damaged
            raise no_commspan_span(label, files, self.report.lines - lines,
                                   self.report.spans - spans, len(self.report.torn) - torn,
                                   "the warnings above")
        return records

    def _reading(self, files: Sequence[Path]) -> None:
        """The files now read, whose damaged lines :meth:`select` names (``diff`` reads
        B after locating A's)."""
        self._located = None
        self._files = {str(f) for f in files}

    def check_lines(self, path: Path, used: int, skipped: int) -> None:
        """After ``path`` was read (``used`` lines and ``skipped`` lines skipped in
        :attr:`report` before it): if none of its lines was an OTLP/JSON trace request,
        keep it in :attr:`not_jsonl` (stderr names it once, not each line)."""
        mine = self.report.skipped[skipped:]
        damaged = sum(s.kind == "damaged" for s in mine)
        # (one line: FILE:1 says it; a last line without a newline, a pretty-printed
        # JSON document's closing brace, is one of its lines like the others)
        if (self.report.lines == used and damaged > 1
                and all(s.kind in ("damaged", "torn") for s in mine)):
            self.not_jsonl[str(path)] = len(mine)
            limit = getattr(self.args, "max_line_mib", None)  # (digest has none)
            fix = _one_request(path, limit * _MIB if limit else DEFAULT_MAX_LINE_BYTES)
            if fix is not None:
                self.one_document[str(path)] = fix

    def files(
        self, paths: Sequence[str], label: str = "FILES", digests: bool = False,
    ) -> list[Path]:
        """:func:`jsonl_files` of ``paths``; its notes (a decompressed copy skipped)
        kept once each: a command may list the same files twice (digests, then lines).

        Digests named (``*.digest``: a shell glob such as ``DIR/*`` names them) are
        left out with one note, unless ``digests`` (``digest`` refuses them itself):
        a file's digest is read with the file, when the command reads digests. Only
        digests named: an error.
        """
        from commspan.analysis.digest import DIGEST_SUFFIX

        notes: list[str] = []
        files = jsonl_files(paths, param=label, notes=notes)
        if not digests:
            named = [f for f in files if f.name.endswith(DIGEST_SUFFIX)]
            if named and len(named) == len(files):
                one = len(named) == 1
                what = (f"{named[0]} is a digest, not a JSONL file" if one else
                        f"all {len(named)} files named are digests, not JSONL files")
                raise ValueError(
                    f"{label}: {what}; pass the JSONL files (a file's digest is read with "
                    "it) or their directory")
            if named:
                files = [f for f in files if not f.name.endswith(DIGEST_SUFFIX)]
                shown = ", ".join(str(f) for f in named[:3])
                more = f" and {len(named) - 3} more" if len(named) > 3 else ""
                notes.append(
                    f"commspan: not reading {shown}{more} as JSONL: "
                    + ("digests" if len(named) > 1 else "a digest")
                    + " (a file's digest is read with the file, where the command reads "
                    "digests)")
        self.notes.extend(n for n in notes if n not in self.notes)
        return files

    def select(
        self, records: list[SpanRecord], run: str | None, steps: StepRange | None,
        option: str | None = None, label: str = "", every: Sequence[RunInfo] | None = None,
    ) -> Selection:
        """One run (and steps) of ``records``; errors in the terms of the options
        (``every``: the runs of the files, when ``records`` hold some of their spans)."""
        return self._selected(lambda: select(records, run=run, steps=steps, every=every),
                              option, label)

    def _selected(self, selecting: Callable[[], _Sel], option: str | None, label: str,
                  traces: Callable[[Selection], Collection[str]] | None = None) -> _Sel:
        """``selecting()``, its errors in the terms of the options, its note kept
        (``traces``: the trace ids of a selection that holds no records)."""
        try:
            sel = selecting()
        except SelectionError as exc:
            name = "--run" if exc.param == "run" else (option or "--steps")
            value = exc.value if exc.value != "" else "''"
            raise ValueError(f"{label}{name} {value}: {exc.detail}") from None
        if sel.note:
            more = " (--run ID picks another)" if len(sel.runs) > 1 else ""
            self.notes.append(f"commspan: {label}{sel.note}{more}")
        # counts over a rank sample, or without the ranks that wrote no file, are not
        # the job's (check reports those ranks missing itself; --rank N shows one rank)
        one_rank = type(getattr(self.args, "rank", None)) is int
        missing = self.args.command != "check" and not one_rank
        covers = sel.run.coverage(missing=missing) if sel.run else None
        if covers:
            others = "; the others ran untraced" if sel.run and sel.run.sample else ""
            note = f"commspan: {label}{covers}{others}"
            if note not in self.covers:
                self.covers.append(note)
        if isinstance(sel, Selection) and self.args.command != "check":  # (check: findings)
            self.notes.extend(unread_note(self.unread(sel, traces), label))
        return sel

    def unread(self, sel: Selection,
               traces_of: Callable[[Selection], Collection[str]] | None = None,
               ) -> list[Unread]:
        """The steps of a rank of ``sel`` that damaged lines read so far may have held
        collectives of (:mod:`commspan.analysis.unread`); ``traces_of``: the trace ids
        of ``sel``, when it holds no records."""
        if not self.report.damaged or sel.run is None:
            return []
        if self._located is None:
            self._located = self.lines.locate(self.report.skipped)
        traces = {r.trace_id for r in sel.records} if traces_of is None else traces_of(sel)
        return [u for u in self._located
                if u.run_id == sel.run.run_id and u.trace_id in traces and u.path in self._files]

    def select_folded(
        self, builder: ProfileBuilder, run: str | None, steps: StepRange | None,
        option: str | None = None, label: str = "",
    ) -> FoldedSide:
        """:meth:`select` of the spans a :class:`~commspan.analysis.diff.ProfileBuilder`
        folded as they were read (``diff``: holding none of them)."""
        chosen: list[FoldedSide] = []

        def selecting() -> Selection:
            chosen.append(builder.select(run, steps))
            return chosen[0].selection

        self._selected(selecting, option, label, lambda _: chosen[0].traces)
        return chosen[0]

    def load(self, paths: Sequence[str]) -> Selection:
        """Read ``paths`` and select with the command's ``--run`` and ``--step(s)``;
        with a step selection, holding only the spans it may keep as it reads
        (:class:`~commspan.analysis.runs.StepPruner`)."""
        steps, option = _steps_of(self.args, 0)
        if steps is None:
            return self.select(self.read(paths), _first(self.args.run), None, option)
        pruner = StepPruner(steps)
        self.read(paths, hold=pruner.hold)
        return self._selected(lambda: pruner.select(_first(self.args.run)), option, "")

    def load_built(self, paths: Sequence[str],
                   ) -> tuple[Selection, Run, Run, list[dict[str, int | None]]]:
        """Read ``paths`` into a :class:`~commspan.analysis.records.Run` per run of the
        files as the spans are read, holding no span longer than its file (as
        :func:`~commspan.analysis.records.load_run`; every span of a 1,024-rank run
        held takes some 11 GB), and select with ``--run`` and ``--step(s)``.

        Returns:
            The selection (its run, runs and steps; no records), the run cut to the
            steps selected, the whole run (the same when no step was selected), and
            the ``{"rank", "step"}`` of the steps selected that were cut short (as
            :func:`~commspan.analysis.summary.summarize` finds them, judged on the
            whole run).
        """
        from dataclasses import replace

        from commspan.analysis.records import RunsBuilder, _keep_steps
        from commspan.analysis.summary import _Unfinished, partial_list

        runs = RunsBuilder()
        unfinished: dict[str, _Unfinished] = {}

        def hold(spans: Iterable[SpanRecord]) -> None:
            for span in spans:
                run_id = runs.add(span)
                seen = unfinished.get(run_id)
                if seen is None:
                    seen = unfinished[run_id] = _Unfinished()
                seen.see(span)
                seen.add(span)

        self.read(paths, hold=hold)
        steps, option = _steps_of(self.args, 0)
        built: dict[str, Run] = {}

        def whole_of(sel: Selection) -> Run:
            run_id = sel.run.run_id if sel.run else ""
            if run_id not in built:
                built[run_id] = runs.finish(run_id)
            return built[run_id]

        def traces(sel: Selection) -> set[str]:
            trace_steps = whole_of(sel).trace_steps
            if steps is None:
                return {*trace_steps, *whole_of(sel).presence}
            return {t for t, s in trace_steps.items() if s in steps}

        sel = self._selected(lambda: select([], run=_first(self.args.run), steps=steps,
                                            every=runs.tally.runs()), option, "", traces)
        whole = whole_of(sel)
        runs.clear()  # (the runs not chosen)
        seen = unfinished.get(sel.run.run_id if sel.run else "")
        kept = traces(sel)
        cut = partial_list((rank, step) for rank, trace, step in
                           (seen.cut_short() if seen is not None else []) if trace in kept)
        if steps is None:
            return sel, whole, whole, cut
        # the steps selected, with the whole run for what passes on from before them
        part = replace(whole)
        _keep_steps(part, frozenset(sel.steps))
        return sel, part, whole, cut

    def load_capped(self, paths: Sequence[str], cap: RankCap) -> Selection:
        """:meth:`load` holding the spans of ``cap``'s ranks only (:class:`RankCap`):
        the run is chosen, and its ranks and steps told, from every span of the files.

        When every file has a digest that stands for all its lines (docs/jsonl.md,
        "Digests"), the digests say which ranks each file holds: the files of none of
        the ranks kept are not parsed, and the runs are told from the digests.
        """
        files = self.files(paths)
        planned = cap.plan(files, self.args.max_line_mib * _MIB)
        every = cap.tally.runs
        if planned is not None:
            files, runs = planned
            every = lambda: runs  # noqa: E731
        self.read([str(f) for f in files] if planned is not None else paths, hold=cap.hold)
        sel = self.select(cap.records(), _first(self.args.run), *_steps_of(self.args, 0),
                          every=every())
        note = cap.note(sel.run.run_id if sel.run else None, self.args.command)
        if note is not None:
            self.covers.append(note)
        return sel


    def load_digested(self, paths: Sequence[str], module_spans: bool = False,
                      ) -> PartSelection | None:
        """:meth:`load` from the files' digests (docs/jsonl.md, "Digests"), selected
        the same way (``module_spans``: with the parts' module spans); ``None`` when a
        file has none (then :meth:`load`)."""
        from commspan.analysis.digest import select_parts

        digested = self._digested(paths, "FILES", module_spans)
        if digested is None:
            return None
        parts, read, _ = digested
        steps, option = _steps_of(self.args, 0)
        if steps is not None and len({p.get("table") is None for p in parts}) > 1:
            # lines a digest stands for mixed with lines parsed here (a damaged or
            # cut digest): a module's first start is known only from the step that
            # defined it in the digest, so modules of some steps would come out of
            # order; read the spans instead
            return None
        self.report.add(read)
        return self._selected(
            lambda: select_parts(parts, run=_first(self.args.run), steps=steps), option, "")

    def fold_digested(self, path: str, builder: ProfileBuilder, label: str) -> bool:
        """Fold ``path``'s digests into ``builder`` (``diff``: one side; ``label`` names
        it in errors); ``False`` when they cannot stand for its lines (as
        :meth:`load_digested`: a file without a digest of this version, no commspan
        span, a damaged line), which are then read."""
        digested = self._digested([path], label)
        if digested is None:
            return False
        parts, read, files = digested
        self.report.add(read)
        builder.add_parts(parts)
        self._reading(files)  # (this side's damaged lines: none)
        return True

    def _digested(self, paths: Sequence[str], label: str, module_spans: bool = False,
                  ) -> tuple[list[DigestPart], ReadReport, list[Path]] | None:
        """The parts of ``paths``' digests, what reading them read, and the files;
        ``None`` when the lines are to be read instead: ``--no-digest``, no commspan
        span (the lines' reader says so), a line a part cannot hold (a hang record), or
        a damaged line (the steps it may have held are
        found among the lines around it, which the lines' reader names)."""
        from commspan.analysis.digest import load_parts

        if getattr(self.args, "no_digest", False):
            return None
        files = self.files(paths, label)
        read = ReadReport()
        parts = load_parts(files, read, self.args.max_line_mib * _MIB, module_spans)
        self._older_digests(files)  # (their lines were parsed, here or by the lines' reader)
        if parts is None:
            return None
        if not any(p["commspan_spans"] for p in parts) or read.damaged:
            return None
        return parts, read, files

    def _older_digests(self, files: Sequence[Path]) -> None:
        """Note, when some files' digests were written by another version of commspan
        (this one parsed their lines), how to have them read again."""
        from commspan.analysis.digest import DIGEST_VERSION, older_digests

        older = older_digests(files)
        if not older:
            return
        versions = ", ".join(str(v) for v in sorted(older))
        count = sum(older.values())
        note = (
            f"commspan: {count:,} file{'s have' if count > 1 else ' has'} digests of version "
            f"{versions}, which this commspan does not read (it reads version "
            f"{DIGEST_VERSION}): the lines were parsed instead; `commspan digest` on "
            "the same files rewrites their digests")
        if note not in self.notes:  # (diff: both sides' files may say the same)
            self.notes.append(note)


class RankCap:
    """The spans of at most ``most`` ranks of each run, the lowest-numbered, held as the
    files are read one at a time (``commspan html`` and ``perfetto`` on a run of
    thousands of ranks: every span of a 1,024-rank run held takes some 11 GB).

    Each file's spans pass through :meth:`hold`: all of them are counted (which runs
    the files hold, their ranks and steps: :attr:`tally`) and offered to
    :attr:`builders` (``html --check`` needs every rank's collectives), and those of a
    rank among the ``most`` lowest of its run seen so far are kept: a lower rank read
    later puts out the highest kept. Spans without a rank are all kept. ``most``
    ``None``: every rank's.
    """

    def __init__(self, most: int | None, builders: bool = False) -> None:
        from commspan.analysis.records import RunsBuilder
        from commspan.analysis.runs import RunTally

        self.most = most
        self.tally = RunTally()
        self.builders: RunsBuilder | None = (
            RunsBuilder(module_spans=False, tally=self.tally) if builders else None)
        # run -> rank -> its spans, each with its place among all spans read
        self._kept: dict[str, dict[int, list[tuple[int, SpanRecord]]]] = {}
        self._loose: list[tuple[int, SpanRecord]] = []  # spans without a rank
        self.left_out: dict[str, set[int]] = {}
        """Run -> the ranks whose spans were not kept."""
        self._seen = 0

    def hold(self, spans: Iterable[SpanRecord]) -> None:
        """Count one file's spans, keep those of the ranks kept."""
        from commspan.analysis.runs import _rank_of

        most, kept, left_out, builders = self.most, self._kept, self.left_out, self.builders
        tally = self.tally
        grew: set[str] = set()
        for span in spans:
            run = builders.add(span) if builders is not None else tally.add(span)
            self._seen += 1
            rank = _rank_of(span)
            if rank is None:
                self._loose.append((self._seen, span))
                continue
            ranks = kept.setdefault(run, {})
            held = ranks.get(rank)
            if held is None:
                if rank in left_out.get(run, ()):
                    continue  # (always above every rank kept: the highest are put out)
                held = ranks[rank] = []
                grew.add(run)
            held.append((self._seen, span))
        if most is None:
            return
        for run in grew:  # (once per file: a rank's spans are kept until its file ends)
            ranks = kept[run]
            while len(ranks) > most:
                highest = max(ranks)
                del ranks[highest]
                left_out.setdefault(run, set()).add(highest)

    def plan(self, files: Sequence[Path], max_line_bytes: int,
             ) -> tuple[list[Path], list[RunInfo]] | None:
        """The files to read, and the runs of all ``files``, from the files' digests;
        ``None`` (read every file) when a file has no digest or lines its digest does
        not stand for (a damaged line, one written after the digest), or when every
        rank is to be kept or :attr:`builders` need every span.

        The ranks of the files not read go to :attr:`left_out`."""
        from commspan.analysis.digest import list_part_runs, read_digest

        if self.most is None or self.builders is not None:
            return None
        parts, of_file = [], []
        scratch = ReadReport()
        for f in files:
            digest = read_digest(f)
            if digest is None or digest.gaps() or any(
                    end - start > max_line_bytes for start, end in digest.covered):
                return None
            mine = [p for line in digest.used(scratch) for p in line]
            parts.extend(mine)
            of_file.append({(p["run"], p["rank"]) for p in mine})
        if scratch.damaged:
            return None
        ranks: dict[str, set[int]] = {}
        for run, rank in set().union(*of_file):
            if rank is not None:
                ranks.setdefault(run, set()).add(rank)
        kept = {(run, r) for run, rs in ranks.items() for r in sorted(rs)[:self.most]}
        read = [f for f, held in zip(files, of_file)
                if any(rank is None or (run, rank) in kept for run, rank in held)]
        if len(read) == len(files):
            return None  # (every file holds a rank kept: read them as they come)
        for run, rs in ranks.items():
            out = {r for r in rs if (run, r) not in kept}
            if out:
                self.left_out.setdefault(run, set()).update(out)
        return read, list_part_runs(parts)

    def records(self) -> list[SpanRecord]:
        """The spans kept, in the order they were read."""
        held = [*self._loose, *(s for ranks in self._kept.values()
                                for spans in ranks.values() for s in spans)]
        held.sort(key=lambda s: s[0])
        return [span for _, span in held]

    def run(self, run_id: str, steps: Iterable[int] | None = None) -> Any:
        """The :class:`~commspan.analysis.records.Run` of every rank's spans of
        ``run_id`` (collectives only), when :attr:`builders` were kept."""
        from commspan.analysis.records import build_run

        if self.builders is None:
            return build_run([], module_spans=False)
        return self.builders.finish(run_id, None if steps is None else frozenset(steps))

    def note(self, run_id: str | None, command: str) -> str | None:
        """What the output leaves out, and how to have it; ``None`` when nothing."""
        out = self.left_out.get(run_id or "")
        if not out or self.most is None:
            return None
        kept = sorted(self._kept.get(run_id or "", {}))
        what = "the report shows" if command == "html" else "the trace holds"
        return (f"commspan: {what} ranks {format_numbers(kept)} only, the {len(kept)} "
                f"lowest of {len(kept) + len(out)} (--max-ranks {self.most}); ranks "
                f"{format_numbers(sorted(out))} left out: pass --max-ranks N for more "
                "(0: every rank; each rank adds its spans to the memory taken and the "
                "file written)")


def _first(values: Sequence[Any] | None, index: int = 0) -> Any:
    if not values:
        return None
    return values[min(index, len(values) - 1)]


def _steps_of(args: argparse.Namespace, index: int) -> tuple[StepRange | None, str | None]:
    if args.step:
        return _first(args.step, index), "--step"
    if args.steps:
        return _first(args.steps, index), "--steps"
    return None, None


def _ranks(sel: Selection | PartSelection) -> set[int | None]:
    if isinstance(sel, Selection):
        return {r.rank for r in sel.records if semconv.MODULE_FQN in r.attributes}
    return {p["rank"] for p in sel.parts if p["commspan_spans"]}


def _rank_filter(rank: int | str | None, sel: Selection | PartSelection) -> int | None:
    """The rank to count (``None``: all), after checking ``--rank`` against the files."""
    present = _ranks(sel)
    numbered = sorted(r for r in present if r is not None)
    if rank is None and len(present) > 1:
        unranked = " and spans without a rank" if None in present else ""
        raise ValueError(
            f"--rank is needed: the files hold spans of ranks {format_numbers(numbered)}"
            f"{unranked}; pass --rank N for one rank or --rank all to sum them"
        )
    if isinstance(rank, int) and rank not in numbered:
        raise ValueError(
            f"--rank {rank}: the files hold no span of that rank "
            f"(ranks: {format_numbers(numbered)})"
        )
    return rank if isinstance(rank, int) else None


def _ends_note(sel: Selection | PartSelection) -> str | None:
    """:func:`~commspan.analysis.summary.ends_note` of the selection: ranks whose spans
    end at an earlier step than the others' (the counts of the steps after leave
    them out)."""
    from commspan.analysis.digest import PartSelection
    from commspan.analysis.summary import ends_note, last_steps

    if isinstance(sel, PartSelection):
        return ends_note(last_steps((p["rank"], p["trace"], p["step"]) for p in sel.parts))
    named = (semconv.SPAN_STEP, semconv.SPAN_RANK, semconv.SPAN_HANG)
    return ends_note(last_steps(
        (r.rank, r.trace_id, r.attributes.get(semconv.STEP) if r.name in named
         and type(r.attributes.get(semconv.STEP)) is int else None)
        for r in sel.records))


def _json(data: Any) -> str:
    from commspan.render.table import tree_json

    return tree_json(data)  # json.dumps recurses per level: deep module trees fail


# ------------------------------------------------------------------ commands
def table(args: argparse.Namespace, reader: Reader) -> Outcome:
    """The module tree with counts per phase (``--show``: and what each module issued)."""
    from commspan.analysis.counts import Aggregator
    from commspan.analysis.digest import aggregate_parts, summarize_parts
    from commspan.analysis.issued import issued
    from commspan.analysis.summary import partial_note, summarize
    from commspan.render.details import issued_notes
    from commspan.render.table import module_table

    fast = None if args.show else reader.load_digested(args.files)
    if fast is not None:
        rank = _rank_filter(args.rank, fast)
        agg = aggregate_parts(fast.parts, rank)
        partial = summarize_parts(agg, fast.parts, rank, fast.last_traces)["partial"]
    else:
        sel = reader.load(args.files)
        rank = _rank_filter(args.rank, sel)
        agg = Aggregator.from_records(sel.records, rank="all" if rank is None else rank)
        partial = summarize(agg, sel.records, rank, sel.last_traces)["partial"]
    note = partial_note(partial)
    if note is not None:
        reader.notes.append(note)
    ends = _ends_note(fast if fast is not None else sel) if rank is None else None
    if ends is not None:
        reader.notes.append(ends)
    if args.by_mesh_dim:
        return _mesh_dim_view(agg, args.json)
    tree = agg.to_dict()
    if not args.show:
        return Outcome(_json(tree) if args.json else agg.table(noise_level=args.noise).rstrip())
    rows = issued(sel.records, rank=rank)
    if args.json:  # each node also lists what its module issued itself
        by_fqn: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            by_fqn.setdefault(row.fqn, []).append(row.to_dict())
        todo = [tree]
        while todo:
            node = todo.pop()
            node["issued"] = by_fqn.get(node["fqn"], [])
            todo.extend(node["children"])
        return Outcome(_json(tree))
    return Outcome(module_table(tree, args.noise, issued_notes(rows, args.show)).rstrip())


def _mesh_dim_view(agg: Any, as_json: bool) -> Outcome:
    """``table --by-mesh-dim``: per mesh dimension, then per owner and dimension."""
    from commspan.render.table import mesh_dim_table

    owned = agg.mesh_dim_counts(subtree=False)
    order = [f for f in agg.modules() if f in owned]
    if semconv.GLOBAL_FQN in owned:
        order.append(semconv.GLOBAL_FQN)
    data = {"totals": agg.mesh_dim_counts().get(semconv.GLOBAL_FQN, {}),
            "modules": [{"fqn": f, "mesh_dims": owned[f]} for f in order]}
    if as_json:
        return Outcome(_json(data))
    return Outcome(mesh_dim_table(data["totals"], data["modules"]))


def summary(args: argparse.Namespace, reader: Reader) -> Outcome:
    """Spans, traces, ranks, steps and collectives per phase and op; the runs."""
    from commspan.analysis.counts import Aggregator
    from commspan.analysis.digest import aggregate_parts, summarize_parts
    from commspan.analysis.issued import Issued, issued
    from commspan.analysis.summary import partial_note, summarize
    from commspan.render.details import runs_lines, summary_rows
    from commspan.render.table import summary_table

    fast = None if args.show else reader.load_digested(args.files)
    sel: Selection | PartSelection
    if fast is not None:
        sel = fast
        rank = _rank_filter(args.rank, fast)
        agg = aggregate_parts(fast.parts, rank)
        data = summarize_parts(agg, fast.parts, rank, fast.last_traces)
        rows: list[Issued] = []
    else:
        sel = slow = reader.load(args.files)
        rank = _rank_filter(args.rank, slow)
        agg = Aggregator.from_records(slow.records, rank="all" if rank is None else rank)
        data = summarize(agg, slow.records, rank, slow.last_traces)
        rows = []
        if args.show:
            # the collectives of the traces whose rank spans were written: those the
            # total counts (a step cut short by a hang has none, partial_note says)
            rooted = {(r.rank, r.trace_id) for r in slow.records
                      if r.name == semconv.SPAN_RANK}
            rows = issued([r for r in slow.records if (r.rank, r.trace_id) in rooted],
                          rank=rank)
    note = partial_note(data["partial"])
    if note is not None:
        reader.notes.append(note)
    ends = _ends_note(sel) if rank is None else None
    if ends is not None:
        reader.notes.append(ends)
    data["run"] = sel.run.run_id if sel.run else None
    data["runs"] = [r.to_dict() for r in sel.runs]
    # what the counts cover: the job's size, the rule of a rank sample, the ranks of
    # the job that wrote no spans
    data["world_size"] = sel.run.world_size if sel.run else None
    data["rank_sample"] = sel.run.sample if sel.run else None
    data["missing_ranks"] = list(sel.run.missing()) if sel.run else []
    if args.show:
        data["issued"] = [r.to_dict() for r in rows]
    if args.json:
        return Outcome(json.dumps(data, indent=2))
    text = summary_table(data)
    if args.show:  # the first line, then the table with the asked-for columns
        text = "\n".join([text.splitlines()[0], *summary_rows(rows, args.show)])
    if len(sel.runs) > 1:
        text = "\n".join([text, *runs_lines(sel.runs, sel.run)])
    return Outcome(text)


def _is_stdout(path: str | Path) -> bool:
    """Whether ``path`` is the file (or pipe, or terminal) stdout writes to."""
    try:
        there, out = os.stat(path), os.fstat(1)
    except (OSError, ValueError):
        return False
    return (there.st_dev, there.st_ino) == (out.st_dev, out.st_ino)


def _written(path: Path, sel: Selection, extra: dict[str, Any], args: argparse.Namespace,
             what: str) -> Outcome:
    if _is_stdout(path):  # (-o /dev/stdout: the output is on stdout, the line on stderr)
        return Outcome(f"commspan: wrote the {what} to stdout ({path})", written=True,
                       to_stderr=True)
    size = path.stat().st_size
    ranks = sorted({r.rank for r in sel.records if r.rank is not None})
    data = {
        "output": str(path),
        "bytes": size,
        "run": sel.run.run_id if sel.run else None,
        "ranks": ranks,
        "steps": list(sel.steps),
        **extra,
    }
    if args.json:  # (asked for on stdout: a stdout that cannot take it is an error)
        return Outcome(json.dumps(data, indent=2))
    run = f"run {data['run']}, " if data["run"] else ""
    text = (f"wrote {what} {path} ({size:,} bytes): {run}ranks {format_numbers(ranks)}, "
            f"steps {format_numbers(sel.steps)}")
    if "findings" in extra:
        n = extra["findings"]
        text += f", {n} finding{'' if n == 1 else 's'}"
    return Outcome(text, written=True)


def _findings_file(name: str) -> Any:
    path = Path(name)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"--findings {name!r} does not exist") from None
    except OSError as exc:
        raise OSError(f"--findings {name!r} cannot be read: {exc.strerror or exc}; pass the "
                      "file `commspan check --json > FILE` wrote") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"--findings {name!r} is not JSON ({exc}); pass the output of "
            "`commspan check --json`"
        ) from None


def html(args: argparse.Namespace, reader: Reader) -> Outcome:
    """Write the HTML report of the selected run (and steps)."""
    from commspan.render.html import write_html_report

    findings: list[Any] | None = None
    found_in: Any = None  # the run the saved findings are of (check --json's "run")
    if args.findings is not None:
        document = _findings_file(args.findings)
        findings = _finding_list(document, args.findings)
        if isinstance(document, dict):
            found_in = document.get("run")
    _output_checked(args.output, "report.html", args.json)  # before minutes of reading, not after
    cap = RankCap(args.max_ranks or None, builders=args.check)
    sel = reader.load_capped(args.files, cap)
    read = sel.run.run_id if sel.run else None
    if isinstance(found_in, str) and read is not None and found_in != read:
        raise ValueError(
            f"--findings {args.findings!r} holds the findings of run {found_in!r}, and the "
            f"files read are of run {read!r}: pass that run's files (or --run {found_in}, "
            "when the folder holds both), or the findings of this one "
            "(commspan check --json, or --check)")
    notes = [cap.note(sel.run.run_id if sel.run else None, "html")]
    if args.check:
        from commspan.analysis import build_run, check

        # every rank's collectives, those of the ranks left out too
        if sel.run is not None and cap.left_out.get(sel.run.run_id):
            run = cap.run(sel.run.run_id, sel.steps if _steps_of(args, 0)[0] else None)
        else:
            run = build_run(sel.records, module_spans=False)
        cap.builders = None
        run.unread = {(u.rank, u.trace_id): u for u in reader.unread(sel)}
        found = check(run).to_dict()["findings"]
        findings = (findings or []) + found
    if findings:  # --findings FILE and --check may name the same finding
        findings = list({json.dumps(f, sort_keys=True, default=str): f
                         for f in findings}.values())
    timeline_steps = None
    if args.timeline_every > 1:  # the multiples of N, the first step, the findings' steps
        timeline_steps = {s for s in sel.steps if s % args.timeline_every == 0}
        timeline_steps.update(sorted(sel.steps)[:1])
        timeline_steps.update(f["step"] for f in findings or ()
                              if isinstance(f, dict) and type(f.get("step")) is int)
    try:
        path = _writing(args.output, lambda: write_html_report(
            sel.records, args.output, findings=findings, title=args.title,
            timeline_steps=timeline_steps, last_traces=sel.last_traces,
            notes=[n for n in notes if n],
            runs=[sel.run] if notes[0] and sel.run else None), "report.html")
    except TypeError as exc:
        if args.findings is None or not str(exc).startswith("findings"):
            raise  # not about the findings: not to be blamed on --findings
        raise TypeError(f"--findings {args.findings!r}: {exc}") from None  # a wrong shape
    return _written(path, sel, {} if findings is None else {"findings": len(findings)}, args,
                    "report")


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


def _finding_list(findings: Any, name: str) -> list[Any]:
    """The findings of a ``check --json`` document (or a list of findings)."""
    if isinstance(findings, dict) and isinstance(findings.get("findings"), list):
        return list(findings["findings"])
    if isinstance(findings, list):
        return findings
    what = _JSON_KINDS.get(type(findings), type(findings).__name__)
    if isinstance(findings, dict):
        what += " without a findings list"
    raise TypeError(
        f"--findings {name!r} holds {what}, not the output of `commspan check --json`"
    )


def perfetto(args: argparse.Namespace, reader: Reader) -> Outcome:
    """Write the Chrome trace (Perfetto) of the selected run (and steps)."""
    from commspan.render.perfetto import write_chrome_trace

    _output_checked(args.output, "trace.json", args.json)
    cap = RankCap(args.max_ranks or None)
    sel = reader.load_capped(args.files, cap)
    note = cap.note(sel.run.run_id if sel.run else None, "perfetto")
    path = _writing(args.output, lambda: write_chrome_trace(
        sel.records, args.output, [note] if note else ()), "trace.json")
    return _written(path, sel, {}, args, "trace")


def _output_checked(output: str, example: str, json_out: bool = False) -> None:
    """``-o`` that cannot be a file to write (a directory, a path below a file) is an
    error before the files are read, worded as :func:`_writing` words it; so is ``-o``
    naming stdout with ``--json``, which prints there too."""
    from commspan._errors import file_path

    if json_out and _is_stdout(output):
        raise ValueError(f"-o {output!r} is stdout, where --json prints too; pass a file "
                         "name to -o, or leave out --json")
    _writing(output, lambda: file_path("-o", output, example), example)


def _writing(output: str, write: Callable[[], Path], example: str) -> Path:
    """``write()``, its OS errors naming ``-o`` and the fix (``example``: a file name)."""
    try:
        return write()
    except IsADirectoryError:
        what = "is a directory" if os.path.isdir(output) else "names a directory (it ends with '/')"
        raise IsADirectoryError(
            f"-o {output!r} {what}; pass a file name in it, e.g. "
            f"{os.path.join(output, example)!r}") from None
    except (FileExistsError, NotADirectoryError):  # a directory on the way is a file
        parent = Path(output).parent
        while parent != parent.parent and not parent.exists():
            parent = parent.parent
        raise NotADirectoryError(
            f"-o {output!r} cannot be written: {str(parent)!r} is a file, not a "
            "directory; pass a file in a directory") from None
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and _is_stdout(output):
            return Path(output)  # (-o /dev/stdout | head: the reader had enough)
        raise OSError(
            f"-o {output!r} cannot be written ({exc.strerror or exc}); pass a file in an "
            "existing directory you can write to") from None


def check(args: argparse.Namespace, reader: Reader) -> Outcome:
    """Cross-rank consistency: status 1 when something was found."""
    from commspan.analysis import build_run
    from commspan.analysis import check as run_check
    from commspan.analysis.digest import run_from_parts
    from commspan.render.findings import format_check

    fast = reader.load_digested(args.files)
    sel: Selection | PartSelection
    if fast is not None:
        sel = fast
        result = run_check(run_from_parts(fast.parts))
    else:
        sel = slow = reader.load(args.files)
        run = build_run(slow.records, module_spans=False)
        run.unread = {(u.rank, u.trace_id): u for u in reader.unread(slow)}
        result = run_check(run)
    status = 0 if result.ok else 1
    if args.json:
        data = result.to_dict()
        data["run"] = sel.run.run_id if sel.run else None
        return Outcome(json.dumps(data, indent=2), status)
    return Outcome(format_check(result), status)


_STRAGGLERS_CUT_SHORT = (
    "the step times leave it out, and the collectives of the modules still open then "
    "were not written, so they are not compared")


def stragglers(args: argparse.Namespace, reader: Reader) -> Outcome:
    """Who arrives last at each collective, and where each rank's step goes."""
    from commspan.analysis.counts import Aggregator
    from commspan.analysis.digest import run_from_parts, summarize_parts
    from commspan.analysis.stragglers import analyze
    from commspan.analysis.summary import partial_note
    from commspan.render.findings import format_stragglers

    # built as the files are read; with steps, the whole run too: a wait passed on goes
    # back to where the group's ranks last met, which can be in a step before those
    fast = reader.load_digested(args.files, module_spans=True)
    sel: Selection | PartSelection
    if fast is not None:  # every file digested (version 6: with module spans and pauses)
        sel = fast
        # the module spans folded a rank at a time: a thousand ranks' are millions
        run = run_from_parts(fast.parts, module_spans="folded")
        whole = run if fast.last_traces is None else run_from_parts(fast.run_parts)
        cut = summarize_parts(Aggregator(), fast.parts, None, fast.last_traces)["partial"]
    else:
        sel, run, whole, cut = reader.load_built(args.files)
    note = partial_note(cut, _STRAGGLERS_CUT_SHORT)
    if note is not None:
        reader.notes.append(note)
    result = analyze(run, whole if run is not whole else None)
    if args.json:
        data = result.to_dict()
        data["cut_short"] = cut
        data["run"] = sel.run.run_id if sel.run else None
        return Outcome(json.dumps(data, indent=2))
    return Outcome(format_stragglers(result, top=args.top))


def diff(args: argparse.Namespace, reader: Reader) -> Outcome:
    """Two runs, or two steps (or runs) of one folder, compared: status 1 when they differ."""
    from commspan.analysis.diff import ProfileBuilder
    from commspan.analysis.diff import diff as compare
    from commspan.analysis.summary import ends_note
    from commspan.render.diff import format_diff

    paths = [args.a, args.b if args.b is not None else args.a]
    rank = args.rank if isinstance(args.rank, int) else None
    # each file's spans folded into counts per trace as it is read, holding none of them
    # (every span of a 1,024-rank run held takes some 11 GB); a folder given twice (two
    # steps or runs of it) is read once
    read: dict[str, ProfileBuilder] = {}
    sides: list[FoldedSide] = []
    labels: list[str] = []
    for i, (name, path) in enumerate(zip("AB", paths)):
        if path not in read:
            read[path] = ProfileBuilder(rank)
            label = name if args.b is not None else "A"
            if not reader.fold_digested(path, read[path], label):
                reader.read([path], label=label, hold=read[path].hold)
        steps, option = _steps_of(args, i)
        sides.append(reader.select_folded(
            read[path], _first(args.run, i), steps, option,
            label=f"{name}: " if args.b is not None or args.run else ""))
    if args.b is None:  # (one folder: its two selections, resolved, must differ)
        first, second = (side.selection for side in sides)
        run_of = [sel.run.run_id if sel.run else None for sel in (first, second)]
        if run_of[0] == run_of[1] and list(first.steps) == list(second.steps):
            given = " ".join(f"--{n} {v}" for n in ("run", "step", "steps")
                             for v in getattr(args, n) or ())
            raise ValueError(
                f"diff {args.a} {given}: both select {_selected_words(run_of[0], first)}, "
                "which would be compared with itself (no difference, whatever the files "
                "hold); pass two different steps or runs")
    for name, path, side in zip("AB", paths, sides):
        labels.append(_label(name, path, side.selection,
                             [rank] if rank is not None else side.ranks()))
    for side, name in zip(sides, "AB"):
        present = side.module_ranks()
        if rank is not None and rank not in present:
            raise ValueError(
                f"--rank {rank}: {name} holds no span of that rank "
                f"(ranks: {format_numbers(r for r in present if r is not None)})"
            )
    # divided by the steps that ended: a step cut short is left out (the profile's note)
    profiles = []
    for name, side in zip("AB", sides):
        try:
            profiles.append(side.profile())
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    a, b = profiles
    if rank is None and set(a.ranks) != set(b.ranks) and a.ranks and b.ranks:
        reader.notes.append(
            f"commspan: A holds ranks {format_numbers(a.ranks)} and B ranks "
            f"{format_numbers(b.ranks)}: each side's counts are summed over its own "
            "ranks; compare one rank of both with --rank N")
    for name, profiled, side in zip("AB", (a, b), sides):
        note = profiled.note(f"{name}: " if args.b is not None or args.run else "")
        if note is not None:
            reader.notes.append(note)
        last = side.last_steps() if rank is not None else {}
        if rank in last and last[rank] < max(last.values()):  # (its file ends early)
            label = f"{name}: " if args.b is not None or args.run else ""
            reader.notes.append(
                f"commspan: {label}rank {rank}'s spans end at step "
                f"{last[rank]}: its counts are per step of the "
                f"{profiled.steps} it wrote, of the {len(side.selection.steps)} selected")
        ends = ends_note(side.last_steps()) if rank is None else None
        if ends is not None:
            label = f"{name}: " if args.b is not None or args.run else ""
            reader.notes.append(ends.replace("commspan: ", f"commspan: {label}", 1))
    result = compare(a, b)
    status = 0 if result.equal else 1
    if args.json:
        data = result.to_dict()
        data["a"] = _side(paths[0], sides[0].selection, a)
        data["b"] = _side(paths[1], sides[1].selection, b)
        return Outcome(json.dumps(data, indent=2), status)
    return Outcome(format_diff(result, labels[0], labels[1]), status)


def _selected_words(run_id: str | None, sel: Selection) -> str:
    """``run X, steps 0-2`` of a selection, for a message."""
    run = f"run {run_id}, " if run_id else ""
    return f"{run}steps {format_numbers(sel.steps)}" if sel.steps else f"{run}no step"


def _label(name: str, path: str, sel: Selection, ranks: Iterable[int]) -> str:
    run = sel.run
    bits = []
    if run is not None and run.run_id:
        bits.append(f"run {run.run_id}")
    bits.append(f"ranks {format_numbers(sorted(ranks))}")
    bits.append(f"steps {format_numbers(sel.steps)}")
    return f"{name}: {os.fspath(path)} ({', '.join(bits)})"


def _side(path: str, sel: Selection, side: Profile) -> dict[str, Any]:
    return {
        "path": path,
        "run": sel.run.run_id if sel.run else None,
        "steps": list(sel.steps),
        "ranks": list(side.ranks),
        "cut_short": [{"rank": r, "step": s} for r, s in side.cut_short],
    }


def plan(args: argparse.Namespace, reader: Reader) -> Outcome:
    """``commspan plan FILE.py:FUNCTION --world N``: run the user's step as one rank
    of a fake world and print its collectives per module and mesh dimension."""
    # the one command that runs a model: it needs the session (and torch)
    from commspan.session.plan import plan_step

    setup = _load_function(args.target)
    running = [""]  # which of the user's functions runs: "setup", "step" or neither

    def watched_setup() -> Any:
        running[0] = "setup"
        step = setup()
        running[0] = ""
        if not callable(step):
            return step  # (plan_step says what is wrong with it)

        def watched_step() -> Any:
            running[0] = "step"
            out = step()
            running[0] = ""
            return out
        return watched_step

    try:
        result = plan_step(watched_setup, world_size=args.world, rank=args.rank,
                           warmup_steps=args.warmup)
    except (Exception, SystemExit) as exc:  # (sys.exit() in the user's code: no plan)
        who = {"setup": f"{args.target} raised",
               "step": f"the step that {args.target} returned raised"}.get(running[0])
        if who is None:  # plan_step's own check (setup returned no step, a group exists)
            raise PlanError(f"FILE.py:FUNCTION {args.target!r}: {type(exc).__name__}: "
                            f"{exc}") from None
        raise PlanError(f"{who} {type(exc).__name__}{_where(exc)}: {exc}") from None
    return Outcome(_json(result.to_dict()) if args.json else result.table())


def digest(args: argparse.Namespace, reader: Reader) -> Outcome:
    """``commspan digest FILES``: write each file's digest (docs/jsonl.md, "Digests")."""
    from commspan.analysis.digest import (
        DIGEST_SUFFIX,
        check_digestible,
        digest_path,
        write_digest,
    )

    files = reader.files(args.files, digests=True)
    for path in files:
        if path.name.endswith(DIGEST_SUFFIX):
            raise ValueError(
                f"FILES: {path} is a digest, not a JSONL file; pass the JSONL files "
                "(or their directory: it stands for its *.jsonl and *.jsonl.gz only)")
        try:
            check_digestible(path)  # (before any digest is written)
        except ValueError as exc:
            raise ValueError(f"FILES: {exc}") from None
    lines = 0
    report = reader.report
    for path in files:
        before, lines_before = report.commspan_spans, report.lines
        skipped = len(report.skipped)
        try:
            lines += write_digest(path, report)
        except OSError as exc:
            side = digest_path(path)
            if side.is_dir():
                raise OSError(f"{path}: cannot write its digest: {side} is a directory; "
                              "remove or rename it") from None
            raise OSError(f"{path}: cannot write its digest ({exc.strerror or exc}); pass "
                          "a file in a directory you can write to") from None
        reader.check_lines(path, lines_before, skipped)
        if report.commspan_spans == before and report.lines > lines_before:
            reader.notes.append(f"commspan: {path} holds no commspan span")
    what = f"{len(files)} files" if len(files) > 1 else str(files[0])
    if not report.commspan_spans:  # (empty files too: as the other commands)
        if report.damaged:
            raise Damaged
        raise no_commspan_span("FILES", files, report.lines, report.spans)
    return Outcome(f"digests written for {what}: {_count(lines, 'line')}", written=True)


_count = count_words


class PlanError(RuntimeError):
    """The user's setup or step raised: its type, place and message in one line."""


def _where(exc: BaseException) -> str:
    """`` at FILE:LINE`` of the innermost frame of the traceback outside torch and commspan."""
    tb, place = exc.__traceback__, ""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not any(part in name for part in ("/torch/", "/commspan/", "<frozen")):
            place = f" at {name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return place


def _load_function(target: str) -> Callable[[], Any]:
    """``FILE.py:FUNCTION`` or ``MODULE:FUNCTION`` -> the function (errors name the
    argument as the usage line does, ``FILE.py:FUNCTION``; its form was checked with the
    usage, :func:`~commspan.cli.parser.check_usage`)."""
    import importlib
    import importlib.util
    import sys

    where, _, name = target.rpartition(":")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where or Path(where).is_file():
            path = Path(where)
            if not path.is_file():
                raise FileNotFoundError(f"FILE.py:FUNCTION {target!r}: {where} is not a file")
            spec = importlib.util.spec_from_file_location(f"_commspan_plan_{path.stem}", path)
            if spec is None or spec.loader is None:  # (no loader for its suffix)
                raise FileNotFoundError(
                    f"FILE.py:FUNCTION {target!r}: {where} is not a Python file; pass the "
                    ".py file that defines the function")
            module = importlib.util.module_from_spec(spec)
            # its sibling imports, also those made when the step runs (the command's
            # process ends with the plan)
            sys.path.insert(0, str(path.resolve().parent))
            spec.loader.exec_module(module)
        else:
            # a module of the current directory is importable, as under `python -m
            # commspan` (whose sys.path starts with it; the `commspan` script's does not)
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except FileNotFoundError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name and where.replace("/", ".").removesuffix(".py").endswith(exc.name):
            raise ModuleNotFoundError(
                f"FILE.py:FUNCTION {target!r}: no module {where!r}; pass FILE.py:FUNCTION or an "
                "importable MODULE:FUNCTION") from None
        raise ModuleNotFoundError(
            f"FILE.py:FUNCTION {target!r}: importing {where} failed: {exc} (install it, or run "
            "from the directory it imports from)") from None
    except (Exception, SystemExit) as exc:
        raise PlanError(f"importing {where} raised {type(exc).__name__}{_where(exc)}: "
                        f"{exc}") from None
    function = getattr(module, name, None)
    if function is None:
        raise AttributeError(f"FILE.py:FUNCTION {target!r}: {where} has no function {name!r}")
    if not callable(function):
        raise AttributeError(f"FILE.py:FUNCTION {target!r}: {name!r} in {where} is not a "
                             f"function (it is of type {type(function).__name__})")
    return function  # type: ignore[no-any-return]


COMMANDS: dict[str, Callable[[argparse.Namespace, Reader], Outcome]] = {
    "plan": plan,
    "digest": digest,
    "table": table,
    "summary": summary,
    "html": html,
    "perfetto": perfetto,
    "check": check,
    "stragglers": stragglers,
    "diff": diff,
}

ERROR_STATUS = {"check": 2, "diff": 2}
"""Exit status of an error, for commands whose status 1 means "found something"
(every other command: 1)."""
