"""The ``commspan`` command: look at the JSONL span files of a run.

::

    commspan table      run/ --rank 0 --noise 1 --show bytes,groups
    commspan summary    run/ --rank all --json
    commspan html       run/ -o report.html --check
    commspan perfetto   run/ -o trace.json
    commspan check      run/
    commspan stragglers run/
    commspan diff       runs/sp-off runs/sp-on
    commspan diff       run/ --step 3 --step 7

``FILES`` are JSONL files written by ``JsonlSpanExporter`` or directories
holding ``*.jsonl`` files. Every command takes ``--run ID`` (files holding
several runs are never summed: without ``--run`` the latest run is read and
stderr says so), ``--step N`` or ``--steps A-B``, ``--json`` and
``--max-line-mib``. ``docs/cli.md`` describes every command and flag.

Damaged lines (complete lines that are not OTLP/JSON trace requests) are
skipped: each is named on stderr (``ValueError: FILE:LINE: reason``; a file
none of whose lines is one, once: ``FILE: none of its N lines ...``, with the
command that makes it one line when it is one request pretty-printed) and the
exit status says so. A torn last line (no trailing newline: a crash, or a
file still being written) is named with a warning and does not change the
status. A line longer than ``--max-line-mib`` ends the reading of its file.

Exit status: 0 success; 1 an error (one line ``TypeName: message`` on stderr,
nothing on stdout), damaged lines skipped, or no commspan span in the files —
except for ``check`` (1: findings) and ``diff`` (1: the two differ), whose
errors and damaged input exit with 2; 2 bad arguments; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import IO, Any

__all__ = ["main"]

_MAX_LISTED = 20  # damaged lines named one by one; then a count


def _problems(
    report: Any, args: argparse.Namespace, not_jsonl: dict[str, int],
    one_document: dict[str, str] | None = None,
) -> list[str]:
    """stderr lines for the lines a read skipped: files none of whose lines is an
    OTLP/JSON trace request (``not_jsonl``, one line each; ``one_document``: those that
    are one request over several lines -> the command making it one line), damaged
    lines of the other files (named, up to ``_MAX_LISTED``) and torn last lines
    (warnings)."""
    out: list[str] = []
    damaged = report.damaged
    for path, lines in not_jsonl.items():
        first = next(s for s in damaged if s.path == path)
        what = "not a file JsonlSpanExporter wrote"
        if one_document and path in one_document:
            what = ("it is one OTLP/JSON trace request written over several lines "
                    "(pretty-printed), and commspan reads one request per line, as "
                    f"JsonlSpanExporter writes them: `{one_document[path]}` makes it one")
        out.append(f"ValueError: {path}: none of its {lines} lines is an OTLP/JSON trace request "
                   f"(line {first.line}: {first.reason}): {what}")
    damaged = [s for s in damaged if s.path not in not_jsonl]
    for s in damaged[:_MAX_LISTED]:
        reason = s.reason
        if s.kind == "too_long":
            reason = (f"line longer than --max-line-mib {args.max_line_mib}; the rest of the "
                      "file was not read (raise --max-line-mib if the line is genuine)")
        out.append(f"ValueError: {s.path}:{s.line}: {reason}")
    if len(damaged) > _MAX_LISTED:
        out.append(f"ValueError: {len(damaged) - _MAX_LISTED} more damaged lines skipped")
    for s in report.torn:
        if s.path in not_jsonl:  # (its last line: counted among the file's lines)
            continue
        out.append(f"warning: {s.path}:{s.line}: torn last line skipped ({s.reason})")
    return out


def _type_name(exc: BaseException) -> str:
    """The name of the standard exception ``exc`` is (``FileNotFoundError`` for
    commspan's ``NoJsonlFilesError``): what a user's mistake is, in words they know."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "builtins":
            return cls.__name__
    return type(exc).__name__


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))
             if chr(c) not in "\n\t"}
"""Control characters (ESC, BEL, CR, ...) a file's module names could carry to the
terminal, as visible escapes."""


def _say(stream: IO[str], text: str) -> None:
    """Write a line that the stream's encoding may not cover (non-ASCII module
    names on an ASCII terminal): what it cannot encode is escaped, and so are
    control characters (a module name in a file could otherwise retitle or
    recolour the terminal; JSON output escapes them already)."""
    text = text.translate(_CONTROLS)
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
        files hold no commspan span (``check``: findings, ``diff``: a
        difference; their errors return 2); 130 when interrupted. Bad
        arguments exit with status 2 (``SystemExit``, from argparse).

    Example:
        ``commspan table out/ --rank all`` prints the module table of every rank's
        files summed.
    """
    try:  # (Ctrl-C while the modules load, too)
        from commspan.cli.parser import build_parser, check_usage, parse_args

        parser = build_parser()
        args = parse_args(parser, argv)
        check_usage(parser, args)
        return _run(args)
    except KeyboardInterrupt:
        _err("commspan: interrupted")
        return 130


def _run(args: argparse.Namespace) -> int:
    from commspan.cli.commands import COMMANDS, ERROR_STATUS, Damaged, Reader

    failed = ERROR_STATUS.get(args.command, 1)
    reader = Reader(args)
    error = None
    try:
        outcome = COMMANDS[args.command](args, reader)
    except Damaged:
        outcome = None
    except Exception as exc:  # noqa: BLE001 - a user-facing command: one line, no traceback
        outcome, error = None, f"{_type_name(exc)}: {exc}"
    for line in reader.notes:
        _err(line)
    for line in _problems(reader.report, args, reader.not_jsonl, reader.one_document):
        _err(line)
    if outcome is None:
        if error is not None:
            _err(error)
        return failed
    if outcome.to_stderr:  # (the output itself went to stdout: -o /dev/stdout)
        _err(outcome.text)
    elif sys.stdout is None:  # started with stdout closed (`commspan ... >&-`)
        if not outcome.written:
            _err("OSError: cannot write the output: stdout is closed; send it to a file "
                 "(> FILE) or to /dev/null")
            return failed
    else:
        try:
            _say(sys.stdout, outcome.text)
        except BrokenPipeError:  # `commspan table ... | head`: the reader had enough;
            _silence(sys.stdout)  # the status still says what the input was (below)
        except OSError as exc:  # stdout on a full disk
            _silence(sys.stdout)
            if not outcome.written:  # (else only the line saying what was written)
                _err(f"{type(exc).__name__}: cannot write the output to stdout: {exc}")
                return failed
    for line in reader.covers:  # (what the output covers: none when there is none)
        _err(line)
    if reader.report.damaged:
        _err(f"commspan: {len(reader.report.damaged)} damaged line(s) skipped; the output "
             f"counts the other {reader.report.lines} line(s)")
        return failed
    if reader.copied:  # (some steps counted twice: said in the notes)
        return failed
    return outcome.status
