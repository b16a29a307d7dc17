"""The ``commspan`` command: read JSONL span files, print collective counts.

A thin layer over :meth:`commspan.Aggregator.from_jsonl` and
:func:`commspan.exporters.read_spans`::

    commspan table  run/commspan-rank*.jsonl --rank 0 --noise 1
    commspan summary run/ --rank all
    commspan summary run/ --rank all --json

``FILES`` are JSONL files written by ``JsonlSpanExporter`` or directories
holding ``*.jsonl`` files. ``--rank`` picks one rank (``N``) or sums every
rank (``all``); without it the files must hold one rank. On an error the
command prints ``TypeName: message`` on stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commspan",
        description="Collective counts per module from commspan JSONL span files.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("files", nargs="+", metavar="FILES",
                       help="JSONL files or directories of *.jsonl files")
        p.add_argument("--rank", type=_rank, default=None, metavar="N|all",
                       help="count one rank, or 'all' to sum every rank "
                            "(required when the files hold several ranks)")

    table = sub.add_parser("table", help="the module tree with collective counts per phase")
    common(table)
    table.add_argument("--noise", type=int, choices=(0, 1), default=0,
                       help="1 also shows module types and parameter placements")
    table.add_argument("--json", action="store_true", help="print the tree as JSON")

    summary = sub.add_parser("summary", help="spans, ranks, steps and collective totals")
    common(summary)
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _files(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise FileNotFoundError(f"FILES: directory {p!r} holds no *.jsonl file")
            out.extend(found)
        elif path.exists():
            out.append(path)
        else:
            raise FileNotFoundError(f"FILES: {p!r} does not exist")
    return out


def _ranks_in(files: Sequence[Path]) -> set[int]:
    from commspan.exporters.jsonl import read_spans

    return {s.rank for s in read_spans(*files) if s.rank is not None}


def _check_rank(rank: int | str | None, ranks: set[int]) -> None:
    if isinstance(rank, int) and rank not in ranks:
        raise ValueError(
            f"--rank {rank}: the files hold no span of that rank "
            f"(ranks: {_span_list(sorted(ranks))})"
        )


def _table(args: argparse.Namespace) -> str:
    from commspan.aggregate import Aggregator

    files = _files(args.files)
    agg = Aggregator.from_jsonl(*files, rank=args.rank)
    if isinstance(args.rank, int) and not agg.modules() and not agg.total_count():
        _check_rank(args.rank, _ranks_in(files))  # nothing counted: a wrong rank?
    if args.json:
        from commspan.aggregate import _tree_json

        return _tree_json(agg.to_dict())  # json.dumps recurses per level: deep models fail
    return agg.table(noise_level=args.noise).rstrip("\n")


def _summary(args: argparse.Namespace) -> str:
    from commspan import semconv
    from commspan.aggregate import Aggregator
    from commspan.exporters.jsonl import read_spans

    files = _files(args.files)
    agg = Aggregator.from_jsonl(*files, rank=args.rank)
    spans = 0
    all_ranks: set[int] = set()
    ranks: set[int] = set()
    steps: set[int] = set()
    traces: set[str] = set()
    for span in read_spans(*files):
        if span.rank is not None:
            all_ranks.add(span.rank)
        if isinstance(args.rank, int) and span.rank != args.rank:
            continue
        spans += 1
        traces.add(span.trace_id)
        if span.rank is not None:
            ranks.add(span.rank)
        step = span.attributes.get(semconv.STEP)
        if isinstance(step, int) and span.name == semconv.SPAN_RANK:
            steps.add(step)
    _check_rank(args.rank, all_ranks)
    per_phase = {
        phase: agg.comm_counts(phase) for phase in (p.value for p in semconv.Phase)
    }
    per_phase = {ph: dict(sorted(ops.items())) for ph, ops in per_phase.items() if ops}
    data: dict[str, Any] = {
        "spans": spans,
        "traces": len(traces),
        "ranks": sorted(ranks),
        "steps": sorted(steps),
        "collectives": per_phase,
        "total": agg.total_count(),
    }
    if args.json:
        return json.dumps(data, indent=2)
    lines = [
        (f"spans: {spans}   traces: {len(traces)}   ranks: {_span_list(data['ranks'])}   "
         f"steps: {_span_list(data['steps'])}"),
    ]
    rows = [(ph, op, n) for ph, ops in per_phase.items() for op, n in ops.items()]
    width = max([len("backward")] + [len(op) for _, op, _ in rows])
    lines.append(f"{'phase':<10}{'op':<{width + 2}}{'count':>7}")
    lines.extend(f"{ph:<10}{op:<{width + 2}}{n:>7}" for ph, op, n in rows)
    lines.append(f"{'total':<10}{'':<{width + 2}}{data['total']:>7}")
    return "\n".join(lines)


def _span_list(values: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"``; ``"-"`` when empty."""
    if not values:
        return "-"
    parts: list[str] = []
    start = prev = values[0]
    for v in values[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 on success, 1 on error).

    Example:
        ``commspan table out/ --rank all`` prints the module table of every rank's
        files summed.
    """
    args = _parser().parse_args(argv)
    try:
        out = _table(args) if args.command == "table" else _summary(args)
    except Exception as exc:  # noqa: BLE001 - a user-facing command: one line, no traceback
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    try:
        print(out)
    except BrokenPipeError:  # `commspan table ... | head`
        return 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
