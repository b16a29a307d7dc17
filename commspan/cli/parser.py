"""The ``commspan`` command's arguments: one parser, one argument type per kind of value.

Every error found here is a usage error: argparse prints the usage and the
message and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from commspan import __version__
from commspan.analysis.runs import StepRange
from commspan.render.details import SHOW_FIELDS

__all__ = ["build_parser", "check_usage", "parse_args"]

_EPILOG = (
    "Exit status: 0 ok; 1 an error, damaged lines skipped or no commspan span (check: "
    "findings; diff: differences); 2 bad arguments (check, diff: also unreadable input); "
    "130 interrupted. See docs/cli.md."
)


_WHOLE = re.compile(r"-?[0-9]+", re.ASCII)


def _whole(value: str) -> int:
    """``int(value)`` for a whole number written in ASCII digits only (``int()`` also
    takes ``1_0`` as 10 and other scripts' digits: a typo read as a number)."""
    text = value.strip()
    if not _WHOLE.fullmatch(text):
        raise ValueError(value)
    return int(text)


def _rank(value: str) -> int | str:
    if value == "all":
        return "all"
    try:
        rank = _whole(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--rank {value!r} is not valid; pass a rank number or 'all'"
        ) from None
    if rank < 0:
        raise argparse.ArgumentTypeError(f"--rank {value!r} is not valid; ranks are >= 0")
    return rank


def _at_least_one(option: str, value: str, what: str, most: int | None = None) -> int:
    try:
        n = _whole(value)
    except ValueError:
        n = 0
    if n < 1 or (most is not None and n > most):
        raise argparse.ArgumentTypeError(f"{option} {value!r} is not valid; pass {what}")
    return n


_MOST = 1 << 20  # --max-line-mib (1 TiB) and --world: beyond is a typo, not a setting


def _mib(value: str) -> int:
    return _at_least_one("--max-line-mib", value, f"a whole number of MiB from 1 to {_MOST}",
                         _MOST)


def _at_least_zero(option: str, value: str, what: str) -> int:
    try:
        n = _whole(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{option} {value!r} is not valid; pass {what}")
    return n


def _step(value: str) -> StepRange:
    try:
        step = _whole(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--step {value!r} is not valid; pass a step number (or --steps A-B for a "
            "range)") from None
    return StepRange(step, step)


# "A-B" (or "A..B"), A and B whole numbers, negative ones too ("-3--1", "-2..1")
_RANGE = re.compile(r"^\s*(-?[0-9]+)\s*(?:(?:-|\.\.)\s*(-?[0-9]+)\s*)?$", re.ASCII)


def _steps(value: str) -> StepRange:
    m = _RANGE.match(value)
    a = int(m.group(1)) if m else 0
    b = int(m.group(2)) if m and m.group(2) is not None else a
    if m is None or b < a:
        raise argparse.ArgumentTypeError(
            f"--steps {value!r} is not valid; pass A-B with A <= B, e.g. 0-9 (or one step; "
            "steps below 0: --steps=-3--1 or --steps=-2..1)"
        )
    return StepRange(a, b)


def _show(value: str) -> tuple[str, ...]:
    wanted = [v.strip() for v in value.split(",") if v.strip()]
    if wanted == ["all"]:
        return SHOW_FIELDS
    bad = [v for v in wanted if v not in SHOW_FIELDS]
    if bad or not wanted:
        raise argparse.ArgumentTypeError(
            f"--show {value!r} is not valid; pass a comma-separated list of "
            f"{', '.join(SHOW_FIELDS)}, or all"
        )
    return tuple(f for f in SHOW_FIELDS if f in wanted)


def _positive(value: str) -> int:
    return _at_least_one("--top", value, "a number >= 1")


MAX_RANKS = 32
"""``html`` and ``perfetto``: the ranks held by default (``--max-ranks``)."""


def _max_ranks(value: str) -> int:
    try:
        n = _whole(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"--max-ranks {value!r} is not valid; pass a number of ranks >= 1, or 0 for "
            "every rank")
    return n


def _every(value: str) -> int:
    return _at_least_one("--timeline-every", value, "a number >= 1 (1: every step)")


_DIGESTED = ("summary", "table", "check", "stragglers", "diff")
"""The commands that read digests: the ones taking ``--no-digest``."""


def _selection(p: argparse.ArgumentParser, twice: bool, digests: bool) -> None:
    """--run, --step / --steps, --json, --max-line-mib (every reading command has them)
    and --no-digest (``digests``: the commands that read digests)."""
    again = " (diff: give it twice, for A then B)" if twice else ""
    p.add_argument("--run", action="append", metavar="ID",
                   help="the run to read when the files hold several (its run id, or the "
                        "start of it); default: the latest, named on stderr" + again)
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--step", action="append", type=_step, metavar="N",
                       help="only step N" + again)
    steps.add_argument("--steps", action="append", type=_steps, metavar="A-B",
                       help="only steps A to B (both included; steps below 0: "
                            "-2..1)" + again)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--max-line-mib", type=_mib, default=64, metavar="MIB",
                   help="longest line read, in MiB (default 64); a longer line ends the "
                        "reading of its file")
    if not digests:
        return
    p.add_argument("--no-digest", action="store_true",
                   help="read the lines even where the files' digests could stand for "
                        "them (summary, table, check, stragglers and diff read digests "
                        "otherwise)")


def _files(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILES",
                   help="JSONL files (.jsonl, .jsonl.gz) or directories of them")


def _rank_option(p: argparse.ArgumentParser, required_note: str) -> None:
    p.add_argument("--rank", type=_rank, default=None, metavar="N|all",
                   help="one rank, or 'all' to sum every rank " + required_note)


_HELP = {
    "table": "the module tree with collective counts per phase",
    "summary": "runs, spans, ranks, steps and collective totals",
    "html": "a self-contained HTML report of the run",
    "perfetto": "a Chrome trace for ui.perfetto.dev",
    "check": "cross-rank consistency, missing ranks and hangs (exit 1 on findings)",
    "stragglers": "who arrives last at collectives, and where step time goes",
    "diff": "compare two runs, or two steps of one run (exit 1 when they differ)",
}
_SHOW_HELP = f"{','.join(SHOW_FIELDS)} or all"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (see ``docs/cli.md``)."""
    parser = argparse.ArgumentParser(
        prog="commspan",
        description="Look at what commspan recorded: JSONL span files in, tables, "
                    "reports, checks and diffs out.",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"commspan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {name: sub.add_parser(name, help=text, epilog=_EPILOG)
                for name, text in _HELP.items()}
    for name, command in commands.items():
        if name != "diff":
            _files(command)

    for name in ("table", "summary"):
        _rank_option(commands[name], "(required when the files hold several ranks)")
    commands["table"].add_argument("--noise", type=int, choices=(0, 1), default=0,
                                   help="1 also shows module types and parameter placements")
    commands["table"].add_argument(
        "--show", type=_show, default=(), metavar="FIELDS",
        help=f"under each module, the collectives it issued itself with: {_SHOW_HELP}")
    commands["table"].add_argument(
        "--by-mesh-dim", action="store_true",
        help="collectives and bytes per mesh dimension, then per owning module and "
             "dimension (instead of the tree)")
    commands["summary"].add_argument("--show", type=_show, default=(), metavar="FIELDS",
                                     help=f"columns beside the counts: {_SHOW_HELP}")

    html = commands["html"]
    html.add_argument("-o", "--output", required=True, metavar="PATH",
                      help="the HTML file to write")
    html.add_argument("--findings", metavar="FILE",
                      help="findings to show: the output of `commspan check --json`")
    html.add_argument("--check", action="store_true",
                      help="run `commspan check` on the same files and show its findings")
    html.add_argument("--title", metavar="TEXT",
                      help="page title (default: commspan report)")
    html.add_argument("--timeline-every", type=_every, default=1, metavar="N",
                      help="embed the timeline of the steps whose number is a multiple of "
                           "N, the first step and the steps findings name only (default 1: "
                           "every step); the counts and tables still cover every step. Long "
                           "runs make large pages")
    commands["perfetto"].add_argument("-o", "--output", required=True, metavar="PATH",
                                      help="the trace file to write (.json, or .json.gz)")
    for name, what in (("html", "report"), ("perfetto", "trace")):
        commands[name].add_argument(
            "--max-ranks", type=_max_ranks, default=MAX_RANKS, metavar="N",
            help=f"the {what} holds the N lowest ranks of the run (default {MAX_RANKS}); "
                 "the others are read, counted and named on stderr and in the "
                 f"{what}, not held: a run of thousands of ranks takes GBs of memory "
                 f"and makes a {what} too large to open. 0: every rank")
    commands["stragglers"].add_argument(
        "--top", type=_positive, default=20, metavar="N",
        help="rows shown of each part (default 20; --json lists all): straggler rows, "
             "ranks of the per rank line, and ranks of the step-time table, which with "
             "more ranks than N shows the latest arrivals, then the longest steps, and "
             "the median of every rank")

    diff = commands["diff"]
    diff.add_argument("a", metavar="A", help="a run: JSONL file or directory")
    diff.add_argument("b", metavar="B", nargs="?",
                      help="the other run (omit it to compare two steps or two runs of A)")
    _rank_option(diff, "(default: all ranks summed)")

    for name, command in commands.items():
        _selection(command, twice=name == "diff", digests=name in _DIGESTED)

    digest = sub.add_parser(
        "digest", epilog=_EPILOG,
        help="write the digest of JSONL files written without one, so that summary, "
             "table and check read them fast")
    digest.add_argument("files", nargs="+", metavar="FILES",
                        help="JSONL files (.jsonl, .jsonl.gz) or directories of them")

    plan = sub.add_parser(
        "plan", epilog=_EPILOG,
        help="one step of one rank of a large job, on this CPU (fake process group): "
             "collectives, counts and bytes per module and mesh dimension")
    plan.add_argument("target", metavar="FILE.py:FUNCTION",
                      help="a function of no arguments that builds the mesh, model and plan "
                           "and returns the step (also MODULE:FUNCTION)")
    plan.add_argument("--world", type=_world, required=True, metavar="N",
                      help="ranks in the job, e.g. 512")
    plan.add_argument("--rank", type=_played_rank, default=0, metavar="R",
                      help="the rank to play (default 0)")
    plan.add_argument("--warmup", type=_warmup, default=0, metavar="N",
                      help="untraced steps first (default 0)")
    plan.add_argument("--json", action="store_true", help="print the result as JSON")
    for command in (*commands.values(), digest, plan):  # an option of one value: once
        for action in command._actions:
            if type(action) is argparse._StoreAction and action.option_strings:
                action.__class__ = _StoreOnce
    return parser


class _StoreOnce(argparse._StoreAction):
    """An option of one value given twice is a usage error (argparse keeps the last
    silently: ``--rank 1 --rank 2`` would count rank 2 only)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        given: set[str] = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in given:
            parser.error(f"{option_string or self.option_strings[0]} given twice "
                         f"({getattr(namespace, self.dest)!r:.40}, then {values!r:.40}); it "
                         "can be given once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def _world(value: str) -> int:
    return _at_least_one("--world", value, f"a number of ranks from 1 to {_MOST}", _MOST)


def _played_rank(value: str) -> int:
    rank = _rank(value)
    if not isinstance(rank, int):
        raise argparse.ArgumentTypeError(f"--rank {value!r} is not valid; pass one rank number")
    return rank


def _warmup(value: str) -> int:
    return _at_least_zero("--warmup", value, "a number >= 0")


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-parser of ``command`` (``parser`` itself if it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            found: argparse.ArgumentParser = action.choices[command]
            return found
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but arguments no command knows (``digest --json``)
    are refused with the command's own usage, which lists its options, not the
    top-level one argparse would show. Exits with status 2.

    ``--steps -2..1`` is read as ``--steps=-2..1``: argparse takes a value starting
    with ``-`` that is not a number for an option, and said only "expected one
    argument" (``--step -2`` is a number: argparse reads it).
    """
    given = list(sys.argv[1:] if argv is None else argv)
    argv = []
    while given:
        arg = given.pop(0)
        if arg == "--":
            argv += [arg, *given]
            break
        if arg == "--steps" and given and given[0].startswith("-") and _RANGE.match(given[0]):
            arg = f"--steps={given.pop(0)}"
        argv.append(arg)
    args, unknown = parser.parse_known_args(argv)
    vars(args).pop("_given_once", None)  # (_StoreOnce's record)
    if unknown:
        _command_parser(parser, args.command).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    return args


def check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rules argparse cannot say: options given twice only for ``diff``, and a diff
    of one path needs two steps or two runs. Exits with status 2 (usage) otherwise,
    showing the command's own usage."""
    parser = _command_parser(parser, args.command)
    if args.command == "table" and args.by_mesh_dim and (args.show or args.noise):
        parser.error("--by-mesh-dim is a table of its own; it takes neither --show nor --noise")
    if args.command == "digest":
        return
    if args.command in ("html", "perfetto"):
        example = "report.html" if args.command == "html" else "trace.json"
        if not args.output:
            parser.error(f"-o '' is empty; pass a file name, e.g. {example!r}")
        _output_not_an_input(parser, args.output, args.files, example)
    if args.command == "plan":
        where, sep, name = args.target.rpartition(":")
        if not sep or not where or not name.isidentifier():
            parser.error(f"FILE.py:FUNCTION {args.target!r} is not valid; pass FILE.py:FUNCTION "
                         "or MODULE:FUNCTION, e.g. examples/plan_at_scale.py:setup")
        if args.rank >= args.world:
            parser.error(f"--rank {args.rank} is not valid with --world {args.world}; "
                         f"pass a rank from 0 to {args.world - 1}")
        return
    for name in ("run", "step", "steps"):
        values: Sequence[object] = getattr(args, name) or ()
        limit = 2 if args.command == "diff" else 1
        if len(values) > limit:
            where = "diff takes it at most twice (A, then B)" if limit == 2 else \
                "it can be given once"
            parser.error(f"--{name} given {len(values)} times; {where}")
    if args.command == "diff" and args.b is None:
        twice = [n for n in ("run", "step", "steps") if len(getattr(args, n) or ()) == 2]
        if not twice:
            parser.error(
                "diff compares two things: pass two runs (diff A B), or one folder with two "
                "steps (diff DIR --step 3 --step 7) or two runs (diff DIR --run X --run Y)"
            )
        if all(getattr(args, n)[0] == getattr(args, n)[1] for n in twice):
            same = " ".join(f"--{n} {getattr(args, n)[0]}" for n in twice)
            parser.error(
                f"diff {args.a} {same} given twice compares a selection with itself "
                "(no difference, whatever the files hold); pass two different steps or runs"
            )


def _output_not_an_input(
    parser: argparse.ArgumentParser, output: str, paths: Sequence[str], example: str
) -> None:
    """``-o`` must not name a file the command reads, nor a new ``*.jsonl`` file in a
    folder it reads (:func:`commspan.otlpjson.files.output_clash`)."""
    from commspan.otlpjson.files import output_clash

    clash = output_clash(output, paths)
    if clash is not None:
        parser.error(f"-o {clash}; pass another file name, e.g. {example!r}")
