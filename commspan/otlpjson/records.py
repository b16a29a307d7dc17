"""Typed records of what JSONL span files hold, shared by the exporter and every reader.

- :class:`SpanRecord`: one span read back;
- :class:`ReadReport` and :class:`SkippedLine`: what a read found and left out;
- :func:`rank_value` and :func:`record_rank`: the one rule for a span's rank.

Example:
    >>> record_rank(SpanRecord("s", "t", "1", "", 0, 0, {"commspan.rank": 2}))
    2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from commspan import semconv

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "ReadReport",
    "SkippedLine",
    "SpanRecord",
    "count_words",
    "no_commspan_span",
    "rank_value",
    "record_rank",
]


@dataclass
class SpanRecord:
    """A span read back from a JSONL file.

    Attributes:
        events: ``(name, attributes)`` pairs, in order.
        event_times: timestamps of those events (ns).
        rank: ``commspan.rank`` of the span's resource, if any.
    """

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_time: int
    end_time: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    event_times: list[int] = field(default_factory=list)
    status_code: int = 0
    status_message: str = ""
    rank: int | None = None
    resource: dict[str, Any] = field(default_factory=dict)


DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024


class SkippedLine(NamedTuple):
    """A line of a JSONL file that a read left out.

    Attributes:
        path: the file.
        line: its line number (from 1).
        kind: ``"torn"`` (a last line without a trailing newline: a write cut
            short, or a file still being written), ``"damaged"`` (a complete
            line that is not an OTLP/JSON trace request) or ``"too_long"``
            (longer than ``max_line_bytes``; the rest of that file is not read).
        reason: what is wrong with it, for people.
    """

    path: str
    line: int
    kind: str
    reason: str


@dataclass
class ReadReport:
    """What a read of JSONL files found and what it skipped.

    Pass one as ``report=`` to :func:`read_spans`, :func:`read_documents` or
    :meth:`commspan.Aggregator.from_jsonl`; skipped lines are then recorded
    here instead of logged.

    Attributes:
        lines: lines read and used.
        spans: spans in those lines (counted by ``read_spans`` and ``from_jsonl``).
        commspan_spans: those carrying ``commspan.module.fqn`` (commspan's
            module and rank spans, what counts are made of), counted by
            ``read_spans`` and ``from_jsonl``.
        ranks: ``commspan.rank`` of the resources of commspan spans (``None``
            for spans without one).
        skipped: every line left out, in the order met.

    Example:
        >>> from commspan.exporters import ReadReport, read_spans
        >>> report = ReadReport()
        >>> spans = list(read_spans(strict=False, report=report))  # pass the files of a run
        >>> report.damaged
        []
    """

    lines: int = 0
    spans: int = 0
    commspan_spans: int = 0
    ranks: set[Any] = field(default_factory=set)
    skipped: list[SkippedLine] = field(default_factory=list)

    def add(self, other: ReadReport) -> None:
        """Add what ``other`` found (a read into a scratch report, kept once it is used).

        Example:
            >>> a, b = ReadReport(lines=2), ReadReport(lines=3, ranks={1})
            >>> a.add(b)
            >>> a.lines, a.ranks
            (5, {1})
        """
        self.lines += other.lines
        self.spans += other.spans
        self.commspan_spans += other.commspan_spans
        self.ranks |= other.ranks
        self.skipped.extend(other.skipped)

    @property
    def damaged(self) -> list[SkippedLine]:
        """Skipped lines other than torn last lines: data that was in the file and is lost."""
        return [s for s in self.skipped if s.kind != "torn"]

    @property
    def torn(self) -> list[SkippedLine]:
        """Last lines without a trailing newline (a write cut short or still under way)."""
        return [s for s in self.skipped if s.kind == "torn"]


def rank_value(value: Any) -> int | None:
    """A ``commspan.rank`` attribute value as a rank: an int (not a bool), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def record_rank(record: SpanRecord) -> int | None:
    """The rank that wrote ``record``: its resource's ``commspan.rank``, else the
    span's own ``commspan.rank`` attribute (rank spans carry one), else ``None``."""
    if record.rank is not None:
        return record.rank
    return rank_value(record.attributes.get(semconv.RANK))


def no_commspan_span(
    label: str, files: Sequence[object], lines: int, spans: int, skipped: int = 0,
    said: str = "the warnings, or report.skipped,",
) -> ValueError:
    """The error of a read of ``files`` that found no commspan span (none carrying
    ``commspan.module.fqn``): files another program wrote, empty files, or files of
    damaged lines only. Its counts would be empty, and a check or an assertion of
    absence over them would pass whatever ran; the command line and the Python
    readers refuse them in these words.

    Args:
        label: the parameter or argument that named the files (``"FILES"``, ``"paths"``).
        files: the files read.
        lines, spans: the lines read and used, and the spans in them.
        skipped: lines skipped as damaged or torn (``strict=False``).
        said: what says why they were skipped.

    Example:
        >>> str(no_commspan_span("paths", ["other.jsonl"], 1, 1)).split(": not")[0]
        'paths: no commspan span in other.jsonl (1 line, 1 span, none with commspan.module.fqn)'
    """
    what = f"{len(files)} files" if len(files) != 1 else str(files[0])
    also = f", {count_words(skipped, 'line')} skipped" if skipped else ""
    files_of = "(DIR/commspan-rank<N>.jsonl of JsonlSpanExporter(DIR))"
    why = f"not files written by commspan's JsonlSpanExporter; pass the files it wrote {files_of}"
    if skipped and not lines:  # (a file being written, or damaged: maybe one of ours)
        why = (f"every line was skipped, damaged or cut short ({said} say why); pass "
               f"files whose writer has finished {files_of}")
    return ValueError(
        f"{label}: no commspan span in {what} ({count_words(lines, 'line')}, "
        f"{count_words(spans, 'span')}, none with {semconv.MODULE_FQN}{also}): {why}")


def count_words(n: int, word: str) -> str:
    """``1 line``, ``2 lines``.

    Example:
        >>> count_words(1, "line"), count_words(0, "span")
        ('1 line', '0 spans')
    """
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
