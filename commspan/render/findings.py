"""Text views of ``commspan check`` and ``commspan stragglers`` results.

Pure formatting: the results come from :mod:`commspan.analysis`; their JSON
form is their ``to_dict()``.

Example:
    >>> from commspan.analysis import check, build_run
    >>> from commspan.render.findings import format_check
    >>> print(format_check(check(build_run([]))))
    consistent: checked 0 ranks, 0 groups, 0 steps, 0 collectives, 0 p2p ops
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from commspan import semconv
from commspan.analysis.check import CheckResult, Finding
from commspan.analysis.stragglers import StragglerResult, totals_by_rank

__all__ = ["format_check", "format_duration", "format_stragglers"]

_INDENT = " " * 10


def format_duration(ns: int | None) -> str:
    """``1_500_000`` -> ``"1.50 ms"``; ``None`` -> ``"-"``.

    Example:
        >>> format_duration(2_500), format_duration(3_000_000_000), format_duration(None)
        ('2.50 µs', '3.00 s', '-')
        >>> format_duration(999_999), format_duration(999_994), format_duration(995)
        ('1.00 ms', '999.99 µs', '995 ns')
    """
    if ns is None:
        return "-"
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        value = abs(ns) / scale
        # or the next unit down would print 1000.00 (999_999 ns: 1.00 ms)
        if value >= 1 or round(value * 1000, 2) >= 1000:
            return f"{ns / scale:.2f} {unit}"
    return f"{ns} ns"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _checked_line(checked: Mapping[str, int]) -> str:
    line = (
        f"checked {_plural(checked.get('ranks', 0), 'rank')}, "
        f"{_plural(checked.get('groups', 0), 'group')}, "
        f"{_plural(checked.get('steps', 0), 'step')}"
        + (f" (and {_plural(checked['outside_steps'], 'trace')} outside steps)"
           if checked.get("outside_steps") else "")
        + f", {_plural(checked.get('collectives', 0), 'collective')}, "
        f"{checked.get('p2p', 0):,} p2p ops"
    )
    extra = []
    if checked.get("p2p_unchecked"):
        extra.append(f"{checked['p2p_unchecked']} batched or any-source p2p ops not checked")
    if checked.get("hang_records"):
        extra.append(_plural(checked["hang_records"], "hang record"))
    if checked.get("steps_interrupted"):
        extra.append(
            f"{_plural(checked['steps_interrupted'], 'step')} some rank did not finish "
            "(hang, crash or stop) not compared"
        )
    if checked.get("outside_interrupted"):
        extra.append("collectives outside steps some rank did not finish not compared")
    if checked.get("unread"):
        extra.append(f"{_plural(checked['unread'], 'step')} of a rank left out: a damaged line "
                     "may have held its collectives")
    return line + (f" ({'; '.join(extra)})" if extra else "")


def _rank_line(rank: int, entry: Mapping[str, Any]) -> str:
    return f"{_INDENT}rank {rank}:  {rank_entry_text(entry)}"


def rank_entry_text(entry: Mapping[str, Any]) -> str:
    """What one rank did where a finding is (a value of its ``ranks``), as ``commspan
    check`` writes it after ``rank N:``; the HTML report shows the same.

    Example:
        >>> rank_entry_text({"op": "all_reduce", "fqn": "Net.fc", "phase": "forward",
        ...                  "seq": 9, "state": "issued", "waited_ns": 2_370_000_000})
        'all_reduce  in `Net.fc` forward  seq 9  state issued  waited 2.37 s'
    """
    bits = []
    if entry.get("op") is not None:
        bits.append(str(entry["op"]))
    else:
        bits.append("-")
    if entry.get("fqn") is not None:
        bits.append(f"in `{entry['fqn']}` {entry.get('phase') or ''}".rstrip())
    if entry.get("seq") is not None:
        bits.append(f"seq {entry['seq']}")
    shown = {"op", "fqn", "phase", "seq", "stack", "hang_record"}
    for key, value in entry.items():
        if key in shown or value is None:
            continue
        if key == "waited_ns":
            bits.append(f"waited {format_duration(value)}")
        elif key == "last_seen" and isinstance(value, Mapping):
            # a point-to-point op has no collective number, its number per peer instead
            number = (f"seq {value.get('seq')}" if value.get("seq") is not None
                      else f"p2p_seq {value.get('p2p_seq')}"
                      if value.get("p2p_seq") is not None else "")
            bits.append(
                f"last: {value.get('op')} in `{value.get('fqn')}` {value.get('phase')} "
                f"{number}".rstrip()
            )
        elif key == "error" and isinstance(value, Mapping):
            where = (f" in `{value.get('fqn')}` {value.get('phase')}"
                     if value.get("fqn") is not None else "")
            step = f" (step {value['step']})" if value.get("step") is not None else ""
            bits.append(f"error: {value.get('message')}{where}{step}")
        elif key == "steps" and isinstance(value, list):  # (an unread rank's)
            words = ["outside steps" if v is None else str(v) for v in value]
            bits.append(f"step{'s' if len(words) > 1 else ''} {', '.join(words)}")
        elif key == "shape" and isinstance(value, list):
            bits.append(f"shape [{', '.join(map(str, value))}]")
        else:
            bits.append(f"{key} {value}")
    if entry.get("stack"):
        bits.append("stack: " + " > ".join(map(str, entry["stack"])))
    return "  ".join(bits)


def _finding_lines(finding: Finding, max_ranks: int) -> list[str]:
    lines = [f"{finding.kind:<10}{finding.message}"]
    items = sorted(finding.ranks.items())
    for rank, entry in items[:max_ranks]:
        lines.append(_rank_line(rank, entry))
    if len(items) > max_ranks:
        lines.append(f"{_INDENT}... {len(items) - max_ranks:,} more ranks (--json lists all)")
    later = finding.details.get("later_steps")
    if later:
        shown = ", ".join("outside steps" if s is None else str(s) for s in later[:10])
        more = f" and {len(later) - 10} more" if len(later) > 10 else ""
        lines.append(f"{_INDENT}also diverges in steps {shown}{more}")
    return lines


def format_check(result: CheckResult, *, max_ranks: int = 16) -> str:
    """The findings of ``commspan check`` as text, one block per finding.

    Args:
        result: what :func:`commspan.analysis.check_run` returned.
        max_ranks: rank lines shown per finding (the message names them all).
    """
    if result.ok:
        return "consistent: " + _checked_line(result.checked)
    lines: list[str] = []
    for finding in result.findings:
        lines.extend(_finding_lines(finding, max_ranks))
    lines.append(f"{_plural(len(result.findings), 'finding')}; " + _checked_line(result.checked))
    return "\n".join(lines)


def _why_nothing_matched(checked: Mapping[str, int]) -> str:
    """Why ``stragglers`` matched no collective, from what it looked at."""
    if checked.get("without_duration"):
        return ("no collective matched across ranks with a duration on every rank "
                f"({semconv.COLL_DURATION_NS}): stragglers need collective timing")
    if checked.get("inconsistent"):
        return ("no collective matched across ranks: the ranks of each group issued "
                "different sequences (commspan check says where)")
    if checked.get("incomplete"):
        return ("no collective recorded by every rank of its group: the last to arrive "
                "may be a rank with no record (a missing file, or one the rank sample "
                "left out), so none is named")
    if checked.get("late_wait"):
        return ("no collective matched: at each, a rank waited for the collective only once "
                "it had completed (commspan.collective.wait_ns much shorter than its "
                "duration), so who arrived last cannot be told")
    if checked.get("rooted"):
        return (f"no collective to match: the {_plural(checked['rooted'], 'collective')} of "
                "these files with a root (broadcast, scatter, gather, reduce) are not "
                "matched: their ranks do not all wait for the last to arrive")
    if checked.get("point_to_point"):
        return (f"no collective to match: the {checked['point_to_point']} communication "
                "ops of these files are point-to-point (send, recv), which stragglers "
                "does not match (a send and its receive do not wait for each other)")
    return "no collective issued by two or more ranks of a group in these files"


def format_stragglers(result: StragglerResult, *, top: int = 20) -> str:
    """The result of ``commspan stragglers`` as text: the first rows (by the last
    rank's own lateness: the wait it caused less the part passed on), the per-rank
    totals and the per-rank step time.

    Args:
        result: what :func:`commspan.analysis.stragglers` returned.
        top: rows shown of each part: straggler rows, ranks of the ``per rank:``
            line and ranks of the step-time table. With more ranks than ``top``,
            the table shows those the ``per rank:`` line names first, then those
            with the longest steps, and a ``median`` row over every rank (the
            collectives column over the ranks whose collectives were timed): a
            thousand-rank run gives a screen, not a thousand lines.
    """
    lines: list[str] = []
    checked = result.checked
    if not checked.get("collectives"):
        lines.append(_why_nothing_matched(checked))
    else:
        lines.append(
            "Last to arrive (the rank that waited least; last/of = the row's collectives it "
            "arrived last at / those matched; wait = time the others waited for it; passed "
            "on = the part it had itself waited for others on other groups)"
        )
        header = ("step", "module", "phase", "rank", "last/of", "wait", "passed on",
                  "max wait", "gc before")
        rows: list[tuple[str, ...]] = [
            (
                "-" if r.step is None else str(r.step),
                r.fqn,
                r.phase,
                str(r.rank),
                f"{r.times_last}/{r.collectives}",
                format_duration(r.wait_ns),
                format_duration(r.passed_on_ns) if r.passed_on_ns else "-",
                format_duration(r.max_wait_ns),
                format_duration(r.gc_ns) if r.gc_ns else "-",
            )
            for r in result.stragglers[:top]
        ]
        lines.extend(_table(header, rows))
        if len(result.stragglers) > top:
            lines.append(f"... {len(result.stragglers) - top:,} more rows (--top N shows more, "
                         "--json lists all)")
        if result.ranks:
            lines.append(
                "per rank: "
                + "; ".join(
                    f"rank {w.rank} last {_plural(w.times_last, 'time')}, "
                    f"caused {format_duration(w.wait_ns)} of waiting"
                    + (f" ({format_duration(w.passed_on_ns)} passed on)"
                       if w.passed_on_ns else "")
                    + (f", {format_duration(w.gc_ns)} in garbage collection" if w.gc_ns else "")
                    for w in result.ranks[:top]
                )
                + (f"; ... {len(result.ranks) - top:,} more ranks (--top N shows more, "
                   "--json lists all)" if len(result.ranks) > top else "")
            )
    lines.extend(_step_times(result, top))
    lines.append(
        f"checked: {checked.get('collectives', 0):,} collectives matched, "
        f"{checked.get('with_wait', 0):,} with a wait, "
        f"{checked.get('without_duration', 0):,} without duration, "
        + (f"{checked['late_wait']:,} waited late (functional, not matched), "
           if checked.get("late_wait") else "")
        + (f"{checked['late_last']:,} whose last rank waited late (their waits are lower "
           "bounds: up to the others' time blocked in wait_tensor), "
           if checked.get("late_last") else "")
        + f"{checked.get('inconsistent', 0):,} in steps whose ranks disagree (see commspan check)"
        + (f", {checked['incomplete']:,} with group members not recorded"
           if checked.get("incomplete") else "")
    )
    return "\n".join(lines)


_TIMES = ("total_ns", "forward_ns", "backward_ns", "recompute_ns", "outside_ns",
          "collectives_ns", "gc_ns")


def _step_times(result: StragglerResult, top: int) -> list[str]:
    """The step-time table of :func:`format_stragglers`: every rank, or with more
    than ``top``, ``top`` of them (the latest arrivals first, then the longest
    steps; shown in rank order) and the median of every rank."""
    totals = totals_by_rank(result.step_times)
    if not totals:
        return []
    timed = {s.rank for s in result.step_times if s.collectives_ns is not None}
    means = {rank: {k: t[k] // max(1, t["steps"]) for k in _TIMES}
             for rank, t in totals.items()}
    shown = sorted(totals)
    title = "Step time per rank (mean per step)"
    if len(shown) > top:
        chosen = [w.rank for w in result.ranks if w.rank in totals][:top]
        rest = sorted((r for r in totals if r not in set(chosen)),
                      key=lambda r: (-means[r]["total_ns"], r))
        shown = sorted(chosen + rest[:top - len(chosen)])
        title = (f"Step time per rank (mean per step; {top} of {len(totals):,} ranks: the "
                 "per rank line's first, then the longest steps; median: each column's "
                 "median over every rank, collectives' over the ranks timed)")

    def cells(mean: Mapping[str, int], is_timed: bool) -> tuple[str, ...]:
        return (*(format_duration(mean[k]) for k in _TIMES[:5]),
                format_duration(mean["collectives_ns"]) if is_timed else "-",
                format_duration(mean["gc_ns"]) if mean["gc_ns"] else "-")

    rows = [(str(rank), str(totals[rank]["steps"]), *cells(means[rank], rank in timed))
            for rank in shown]
    if len(shown) < len(totals):
        # (the collectives column over the ranks whose collectives were timed: an
        # untimed rank's 0 is no time)
        median = {k: round(statistics.median(
            m[k] for r, m in means.items() if k != "collectives_ns" or r in timed or not timed))
            for k in _TIMES}
        steps = round(statistics.median(t["steps"] for t in totals.values()))
        rows.append(("median", str(steps), *cells(median, bool(timed))))
    lines = ["", title, *_table(("rank", "steps", "total", "forward", "backward",
                                 "recompute", "outside", "collectives", "gc"), rows)]
    if len(shown) < len(totals):
        lines.append(f"... {len(totals) - len(shown):,} more ranks (--top N shows more, "
                     "--json lists all)")
    return lines


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return [line(header), *(line(r) for r in rows)]
