"""Text of what was recorded beyond counts: bytes, process groups and mesh dimensions,
placements and time, for ``commspan table --show`` and ``commspan summary --show``.

Pure formatting of :class:`commspan.analysis.issued.Issued` rows (their JSON
form is their ``to_dict()``).

Example:
    >>> from commspan.analysis.issued import Issued
    >>> row = Issued("MLP.net2", "forward", "all_reduce", "0", (0, 1, 2, 3), 0,
    ...              "P(sum)", "R", 2, 2048, 0, 0, (0,))
    >>> issued_line(row, SHOW_FIELDS)
    'forward all_reduce x2  group 0 (mesh dim 0, ranks 0-3)  2,048 B  P(sum) -> R  time -'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from commspan.analysis.issued import Issued
from commspan.analysis.runs import RunInfo, format_numbers
from commspan.render.findings import format_duration

__all__ = [
    "SHOW_FIELDS",
    "format_bytes",
    "issued_line",
    "issued_notes",
    "runs_lines",
    "summary_rows",
]

SHOW_FIELDS = ("bytes", "groups", "placements", "time")
"""What ``--show`` can add to the counts."""


def format_bytes(n: int | float) -> str:
    """``2048`` -> ``"2,048 B"``: exact, so that a change of a few bytes shows.

    Example:
        >>> format_bytes(1234567)
        '1,234,567 B'
    """
    return f"{n:,} B" if isinstance(n, int) else f"{n:,.3f} B"


def _group(row: Issued) -> str:
    if not row.group:
        return "group ?"
    bits = []
    if row.mesh_dim_name:  # as --by-mesh-dim and diff name it; known without the index
        bits.append(f"mesh dim {row.mesh_dim_name}")  # for a group a mesh made
    elif row.mesh_dim is not None:
        bits.append(f"mesh dim {row.mesh_dim}")
    if row.group_ranks:
        bits.append(f"ranks {format_numbers(row.group_ranks)}")
    return f"group {row.group}" + (f" ({', '.join(bits)})" if bits else "")


def _time(total_ns: int, timed: int, count: int) -> str:
    if not timed:
        return "time -"
    text = f"time {format_duration(total_ns)}"
    return text if timed == count else f"{text} ({timed} of {count} timed)"


def issued_line(row: Issued, show: Sequence[str]) -> str:
    """One group of identical collectives a module issued itself, with the ``show`` fields."""
    parts = [f"{row.phase} {row.op} x{row.count}"]
    if "groups" in show:
        parts.append(_group(row))
    if "bytes" in show:
        parts.append(format_bytes(row.bytes))
    if "placements" in show and (row.src or row.dst):
        parts.append(f"{row.src or '?'} -> {row.dst or '?'}")
    if "time" in show:
        parts.append(_time(row.duration_ns, row.timed, row.count))
    return "  ".join(parts)


def summary_rows(rows: Iterable[Issued], show: Sequence[str]) -> list[str]:
    """The ``summary --show`` table: per phase and op (and group, placements when shown)
    the count and the shown columns, then a total line."""
    acc: dict[tuple[str, ...], list[int]] = {}
    order = {"forward": 0, "backward": 1, "recompute": 2}
    for r in rows:
        key = (
            r.phase,
            r.op,
            _group(r) if "groups" in show else "",
            f"{r.src or '?'} -> {r.dst or '?'}" if "placements" in show and (r.src or r.dst)
            else "",
        )
        slot = acc.setdefault(key, [0, 0, 0, 0])
        slot[0] += r.count
        slot[1] += r.bytes
        slot[2] += r.duration_ns
        slot[3] += r.timed
    keys = sorted(acc, key=lambda k: (order.get(k[0], 9), *k))
    header = ["phase", "op"]
    if "groups" in show:
        header.append("group")
    if "placements" in show:
        header.append("placements")
    header.append("count")
    if "bytes" in show:
        header.append("bytes")
    if "time" in show:
        header.append("time")
    table: list[list[str]] = [header]
    total = [0, 0, 0, 0]
    for k in keys:
        count, nbytes, ns, timed = acc[k]
        total = [total[0] + count, total[1] + nbytes, total[2] + ns, total[3] + timed]
        table.append(_cells(k, count, nbytes, ns, timed, show))
    table.append(_cells(("total", "", "", ""), total[0], total[1], total[2], total[3], show))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    numeric = {"count", "bytes"}
    return [
        "  ".join(
            (c.rjust(w) if header[i] in numeric else c.ljust(w)) for i, (c, w) in
            enumerate(zip(row, widths))
        ).rstrip()
        for row in table
    ]


def _cells(
    key: tuple[str, ...], count: int, nbytes: int, ns: int, timed: int, show: Sequence[str]
) -> list[str]:
    cells = [key[0], key[1]]
    if "groups" in show:
        cells.append(key[2][len("group "):] if key[2] else "")
    if "placements" in show:
        cells.append(key[3])
    cells.append(str(count))
    if "bytes" in show:
        cells.append(format_bytes(nbytes))
    if "time" in show:
        cells.append(_time(ns, timed, count).removeprefix("time "))
    return cells


def issued_notes(rows: Iterable[Issued], show: Sequence[str]) -> dict[str, list[str]]:
    """``{module: ["issued: ..." lines]}``: what each module issued itself, for
    :func:`commspan.render.table.module_table`'s ``notes`` (``commspan table --show``)."""
    notes: dict[str, list[str]] = {}
    for row in rows:
        notes.setdefault(row.fqn, []).append(f"issued: {issued_line(row, show)}")
    return notes


def runs_lines(runs: Sequence[RunInfo], shown: RunInfo | None) -> list[str]:
    """``summary``'s list of the runs in the files, the one shown starred."""
    return [f"runs: {len(runs)} (* shown; --run ID picks another)"] + [
        f"{'*' if r == shown else ' '} {r.describe()}, {r.spans} spans" for r in runs
    ]
