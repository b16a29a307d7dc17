"""The ``commspan`` command: read JSONL span files, print collective counts.

Argument parsing and exit codes only, over :meth:`commspan.Aggregator.from_jsonl`,
:func:`commspan.exporters.read_spans`, :mod:`commspan.analysis` and
:mod:`commspan.render` (also ``python -m commspan.cli``)::

    commspan table  run/commspan-rank*.jsonl --rank 0 --noise 1
    commspan summary run/ --rank all
    commspan summary run/ --rank all --json

``FILES`` are JSONL files written by ``JsonlSpanExporter`` or directories
holding ``*.jsonl`` files. ``--rank`` picks one rank (``N``) or sums every
rank (``all``); without it the files must hold one rank.

Damaged lines (complete lines that are not OTLP/JSON trace requests) are
skipped: each is named on stderr (``ValueError: FILE:LINE: reason``), the
output counts every other line, and the exit status is 1. A torn last line
(no trailing newline: a crash, or a file still being written) is named with a
warning and does not change the status. A line longer than ``--max-line-mib``
ends the reading of its file.

Exit status: 0 success; 1 an error (one line ``TypeName: message`` on stderr,
nothing on stdout), damaged lines skipped, or no commspan span in the files;
2 bad arguments; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["main"]

_MAX_LISTED = 20  # damaged lines named one by one; then a count
_MIB = 1024 * 1024


def _rank(value: str) -> int | str:
    if value == "all":
        return "all"
    try:
        rank = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--rank {value!r} is not valid; pass a rank number or 'all'"
        ) from None
    if rank < 0:
        raise argparse.ArgumentTypeError(f"--rank {value!r} is not valid; ranks are >= 0")
    return rank


def _mib(value: str) -> int:
    try:
        mib = int(value)
    except ValueError:
        mib = 0
    if mib < 1:
        raise argparse.ArgumentTypeError(
            f"--max-line-mib {value!r} is not valid; pass a whole number of MiB >= 1"
        )
    return mib


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commspan",
        description="Collective counts per module from commspan JSONL span files.",
        epilog="Exit status: 0 ok; 1 error, damaged lines skipped, or no commspan span; "
               "2 bad arguments; 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("files", nargs="+", metavar="FILES",
                       help="JSONL files or directories of *.jsonl files")
        p.add_argument("--rank", type=_rank, default=None, metavar="N|all",
                       help="count one rank, or 'all' to sum every rank "
                            "(required when the files hold several ranks)")
        p.add_argument("--max-line-mib", type=_mib, default=64, metavar="MIB",
                       help="longest line read, in MiB (default 64); a longer line ends "
                            "the reading of its file")

    table = sub.add_parser("table", help="the module tree with collective counts per phase")
    common(table)
    table.add_argument("--noise", type=int, choices=(0, 1), default=0,
                       help="1 also shows module types and parameter placements")
    table.add_argument("--json", action="store_true", help="print the tree as JSON")

    summary = sub.add_parser("summary", help="spans, ranks, steps and collective totals")
    common(summary)
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


class _Damaged(Exception):
    """No commspan span was read and lines were damaged: the lines naming them say why."""


def _read(args: argparse.Namespace, report: Any) -> tuple[Any, list[Path]]:
    """The files' aggregate (every rank, or ``--rank N``), after the checks that
    need the whole read: commspan spans present, ranks. ``report`` collects
    what was read and skipped."""
    from commspan.analysis.counts import Aggregator
    from commspan.otlpjson.files import jsonl_files
    from commspan.render.table import span_list

    files = jsonl_files(args.files, param="FILES")
    agg = Aggregator.from_jsonl(
        *files, rank="all" if args.rank is None else args.rank, strict=False, report=report,
        max_line_bytes=args.max_line_mib * _MIB,
    )
    if not report.commspan_spans:
        if report.damaged:
            raise _Damaged
        what = f"{len(files)} files" if len(files) > 1 else str(files[0])
        raise ValueError(
            f"FILES: no commspan span in {what} ({report.lines} lines, {report.spans} spans, "
            "none with commspan.module.fqn): not files written by commspan's "
            "JsonlSpanExporter"
        )
    ranks = sorted(r for r in report.ranks if isinstance(r, int))
    if args.rank is None and len(report.ranks) > 1:
        unranked = " and spans without a rank" if None in report.ranks else ""
        raise ValueError(
            f"--rank is needed: the files hold spans of ranks {span_list(ranks)}{unranked}; "
            "pass --rank N for one rank or --rank all to sum them"
        )
    if isinstance(args.rank, int) and args.rank not in ranks:
        raise ValueError(
            f"--rank {args.rank}: the files hold no span of that rank "
            f"(ranks: {span_list(ranks)})"
        )
    return agg, files


def _table(args: argparse.Namespace, report: Any) -> str:
    from commspan.render.table import tree_json

    agg, _ = _read(args, report)
    if args.json:
        return tree_json(agg.to_dict())  # json.dumps recurses per level: deep models fail
    return agg.table(noise_level=args.noise).rstrip("\n")


def _summary(args: argparse.Namespace, report: Any) -> str:
    from commspan.analysis.summary import summarize
    from commspan.otlpjson.decode import read_spans
    from commspan.otlpjson.records import ReadReport
    from commspan.render.table import summary_table

    agg, files = _read(args, report)
    # the same lines again, every span decoded (Aggregator.from_jsonl decodes only
    # what counts need): problems found only now join the report
    again = ReadReport()
    spans = read_spans(*files, strict=False, report=again,
                       max_line_bytes=args.max_line_mib * _MIB)
    data = summarize(agg, spans, args.rank if isinstance(args.rank, int) else None)
    known = {(s.path, s.line) for s in report.skipped}
    new = [s for s in again.skipped if (s.path, s.line) not in known]
    report.skipped.extend(new)
    report.lines -= len(new)
    if args.json:
        return json.dumps(data, indent=2)
    return summary_table(data)


def _problems(report: Any, args: argparse.Namespace) -> list[str]:
    """stderr lines for the lines a read skipped: damaged ones (named, up to
    ``_MAX_LISTED``) and torn last lines (warnings)."""
    out: list[str] = []
    damaged = report.damaged
    for s in damaged[:_MAX_LISTED]:
        reason = s.reason
        if s.kind == "too_long":
            reason = (f"line longer than --max-line-mib {args.max_line_mib}; the rest of the "
                      "file was not read (raise --max-line-mib if the line is genuine)")
        out.append(f"ValueError: {s.path}:{s.line}: {reason}")
    if len(damaged) > _MAX_LISTED:
        out.append(f"ValueError: {len(damaged) - _MAX_LISTED} more damaged lines skipped")
    for s in report.torn:
        out.append(f"warning: {s.path}:{s.line}: torn last line skipped ({s.reason})")
    return out


def _type_name(exc: BaseException) -> str:
    """The name of the standard exception ``exc`` is (``FileNotFoundError`` for
    commspan's ``NoJsonlFilesError``): what a user's mistake is, in words they know."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "builtins":
            return cls.__name__
    return type(exc).__name__


def _say(stream: IO[str], text: str) -> None:
    """Write a line that the stream's encoding may not cover (non-ASCII module
    names on an ASCII terminal): what it cannot encode is escaped."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        pass
    stream.write(text + "\n")
    stream.flush()


def _err(text: str) -> None:
    """A line on stderr; a stderr that cannot be written to is given up on."""
    with contextlib.suppress(OSError, ValueError):
        _say(sys.stderr, text)


def _silence(stream: IO[str]) -> None:
    """After stdout failed (a closed pipe, a full disk), point its descriptor at
    /dev/null so that the interpreter's final flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Returns:
        0 on success; 1 on an error, when damaged lines were skipped or the
        files hold no commspan span; 130 when interrupted. Bad arguments exit
        with status 2 (``SystemExit``, from argparse).

    Example:
        ``commspan table out/ --rank all`` prints the module table of every rank's
        files summed.
    """
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        _err("commspan: interrupted")
        return 130


def _run(args: argparse.Namespace) -> int:
    from commspan.otlpjson.records import ReadReport

    report = ReadReport()
    error = None
    try:
        out = _table(args, report) if args.command == "table" else _summary(args, report)
    except _Damaged:
        out = None
    except Exception as exc:  # noqa: BLE001 - a user-facing command: one line, no traceback
        out, error = None, f"{_type_name(exc)}: {exc}"
    for line in _problems(report, args):
        _err(line)
    if out is None:
        if error is not None:
            _err(error)
        return 1
    try:
        _say(sys.stdout, out)
    except BrokenPipeError:  # `commspan table ... | head`
        _silence(sys.stdout)
        return 0
    except OSError as exc:  # stdout on a full disk
        _silence(sys.stdout)
        _err(f"{type(exc).__name__}: cannot write the output to stdout: {exc}")
        return 1
    if report.damaged:
        _err(f"commspan: {len(report.damaged)} damaged line(s) skipped; the output counts "
             f"the other {report.lines} line(s)")
        return 1
    return 0

