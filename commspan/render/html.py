"""A recorded run as one self-contained HTML file: no server, no network, all inlined.

The report has, top to bottom (``docs/views.md`` shows it):

- **summary**: run, ranks, steps, collectives and bytes per step;
- **findings** of cross-rank checks (``commspan check`` / ``stragglers``), when given;
- **modules**: the module tree (collapsible), each module with its collective
  counts per phase and op (its own and those of the modules inside it, as
  ``commspan table`` counts them), the collectives it issued itself with
  process group, bytes, placements and (when recorded) time, its parameters'
  placements, and its mean span time per step;
- **redistributions**: every DTensor redistribution that issued collectives,
  with source and destination placements;
- **timeline**: per rank, the module spans and collectives of one step, drawn
  as SVG by a small inline script from data embedded in the page; a step
  selector switches steps (only the chosen step is drawn).

Counts and bytes are summed over the steps in the records. Where the ranks
agree one value is shown; where they differ, one value per rank, highlighted.

Size: the timeline data is most of the file and grows linearly with ranks x
steps x module calls per step (about 30 bytes per module span and 50 per
collective); ``timeline_steps`` limits which steps get one.

Example:
    >>> page = html_report([])
    >>> page.startswith("<!doctype html>")
    True
"""

from __future__ import annotations

import datetime as _dt
import html
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from commspan import __version__, semconv
from commspan._errors import file_path
from commspan._json import dumps
from commspan.analysis.counts import Aggregator
from commspan.analysis.runs import RunInfo, format_numbers, list_runs, shared_run_note
from commspan.analysis.summary import cut_short, cut_short_steps
from commspan.analysis.timeline import (
    Collective,
    RecordSource,
    StepWindow,
    Timeline,
    assign_lanes,
    build_timeline,
    load_records,
)
from commspan.otlpjson.files import refuse_output_clash
from commspan.otlpjson.records import SpanRecord
from commspan.render.findings import rank_entry_text

__all__ = ["html_report", "write_html_report"]

_log = logging.getLogger(__name__)

_PHASES = [p.value for p in semconv.Phase]
_TICK_NS = 100  # timeline data: times in units of 0.1 us
_OPEN_DEPTH = 2  # tree levels open when the page loads
_NESTED_DEPTH = 64
"""Tree levels written as nested ``<details>``; the modules deeper than that are listed
flat, in tree order, inside their ancestor at this depth, each saying its depth.
Browsers keep a bounded nesting: Chromium's HTML parser moves elements nested past
512 out to the side, Firefox lays out at most about 200 levels of boxes."""
_CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
FINDING_KEYS = ("kind", "group", "seq", "step", "ranks", "message")


def html_report(
    source: RecordSource,
    *,
    step: int | None = None,
    findings: Iterable[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    title: str | None = None,
    timeline_steps: Iterable[int] | None = None,
    last_traces: Mapping[int | None, str] | None = None,
    notes: Sequence[str] = (),
    runs: Sequence[RunInfo] | None = None,
) -> str:
    """Build the HTML report of a run.

    Args:
        source: JSONL files or directories written by ``JsonlSpanExporter``, or
            span records (``commspan.exporters.read_spans``).
        step: the step the timeline shows first (its number as given to
            ``mode.step``); default the first step.
        findings: results of cross-rank checks to list: dicts with ``kind``,
            ``group``, ``seq``, ``step``, ``ranks`` (rank -> what it did) and
            ``message``; other keys are shown too. A mapping with a
            ``"findings"`` list (``commspan check --json`` output) is accepted.
        title: page title; default ``commspan report``.
        timeline_steps: the step numbers whose timeline is embedded (default
            all): limits the file size of long runs.
        last_traces: each rank's last trace id in the whole run, when ``source``
            holds some steps of it (``commspan html --steps``): a step a rank did
            not end is then said cut short, not still running, if the rank went
            on to a later one.
        notes: sentences saying what the records leave out of the run read (``commspan
            html --max-ranks``: the ranks not shown), shown at the top of the page.
        runs: the runs of the files read, when the records hold some of their ranks
            (``--max-ranks``): the ranks of the job that wrote no spans are told from
            these; ``None``: from the records.

    Returns:
        The HTML document.

    Raises:
        FileNotFoundError: a path does not exist or a directory holds no ``*.jsonl``.
        ValueError: a file holds a line that is not JSON; ``step`` is not in the
            records (or not among ``timeline_steps``).
        TypeError: ``findings`` is not a list of mappings.

    Example:
        >>> "Modules" in html_report([], title="empty run")
        True
    """
    records = load_records(source)
    timeline = build_timeline(records)
    found = _findings(findings)
    embedded = _embedded_steps(timeline, timeline_steps)
    first = _first_step(timeline, embedded, step)
    return _page(records, timeline, found, embedded, first, title or "commspan report",
                 last_traces, notes, runs)


def write_html_report(
    source: RecordSource,
    out_path: str | os.PathLike[str],
    *,
    step: int | None = None,
    findings: Iterable[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    title: str | None = None,
    timeline_steps: Iterable[int] | None = None,
    last_traces: Mapping[int | None, str] | None = None,
    notes: Sequence[str] = (),
    runs: Sequence[RunInfo] | None = None,
) -> Path:
    """Write the HTML report of a run to ``out_path`` (see :func:`html_report`).

    Open the file in any browser; it needs no network access.

    Returns:
        The path written.

    Raises:
        TypeError: ``out_path`` is not a path; or as :func:`html_report`.
        ValueError: ``out_path`` is one of the JSONL files ``source`` names (writing
            it would replace that rank's spans) or a new ``*.jsonl`` file in a folder
            ``source`` names (later reads would take it for a rank's file); or as
            :func:`html_report`.
        IsADirectoryError: ``out_path`` is a directory, or ends with ``/``.

    Example:
        >>> import tempfile, pathlib
        >>> out = write_html_report([], pathlib.Path(tempfile.mkdtemp()) / "report.html")
        >>> out.read_text().count("<script") >= 1
        True
    """
    path = file_path("out_path", out_path, "report.html")
    refuse_output_clash(source, out_path, "report.html")
    page = html_report(
        source, step=step, findings=findings, title=title, timeline_steps=timeline_steps,
        last_traces=last_traces, notes=notes, runs=runs,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    _log.info("commspan: wrote %s (%d bytes)", path, len(page.encode("utf-8")))
    return path


# ------------------------------------------------------------------ arguments
def _findings(
    findings: Iterable[Mapping[str, Any]] | Mapping[str, Any] | None,
) -> list[Mapping[str, Any]] | None:
    if findings is None:
        return None
    if isinstance(findings, Mapping):
        if "findings" not in findings:
            raise TypeError(
                "findings is a mapping without a 'findings' key; pass a list of finding "
                "dicts (kind, group, seq, step, ranks, message) or the JSON of "
                "`commspan check --json`"
            )
        findings = findings["findings"]
    if isinstance(findings, (str, bytes)):
        raise TypeError(
            f"findings={findings!r:.60} is not valid; pass a list of finding dicts "
            "(kind, group, seq, step, ranks, message)"
        )
    out = list(findings)
    for i, item in enumerate(out):
        if not isinstance(item, Mapping):
            raise TypeError(
                f"findings[{i}] is a {type(item).__name__}, not a dict; each finding is a dict "
                "with kind, group, seq, step, ranks and message"
            )
    return out


def _embedded_steps(timeline: Timeline, wanted: Iterable[int] | None) -> list[int]:
    """Indices (into ``timeline.steps``) of the steps whose timeline is embedded."""
    if wanted is None:
        return [w.position for w in timeline.steps]
    if isinstance(wanted, (str, bytes)) or not isinstance(wanted, Iterable):
        raise TypeError(f"timeline_steps={wanted!r} is not valid; pass step numbers, "
                        "e.g. [0, 5] or range(0, 100, 10)")
    numbers = set()
    for n in wanted:
        if not isinstance(n, int):
            raise TypeError(f"timeline_steps: {n!r} is not a step number (int)")
        numbers.add(n)
    embedded = [w.position for w in timeline.steps if w.step in numbers]
    if numbers and not embedded:  # (a page without any timeline, said nowhere)
        held = sorted({w.step for w in timeline.steps if w.step is not None})
        steps = f"steps {format_numbers(held, sep=', ')}" if held else "no numbered steps"
        raise ValueError(
            f"timeline_steps={sorted(numbers)!r} is not valid: none of them is a step of "
            f"the run, which has {steps}; pass some of those, or None for every step")
    return embedded


def _first_step(timeline: Timeline, embedded: list[int], step: int | None) -> int:
    """Position in ``embedded`` of the step the timeline shows first."""
    if step is None:
        return 0
    for pos, index in enumerate(embedded):
        if timeline.steps[index].step == step:
            return pos
    have = sorted({n for n in (timeline.steps[i].step for i in embedded) if n is not None})
    where = f"steps {format_numbers(have, sep=', ')}" if have else "no numbered steps"
    raise ValueError(f"step={step!r} is not in the report's timeline, which has {where}")


# ------------------------------------------------------------------ the page
def _page(
    records: list[SpanRecord],
    timeline: Timeline,
    findings: list[Mapping[str, Any]] | None,
    embedded: list[int],
    first: int,
    title: str,
    last_traces: Mapping[int | None, str] | None = None,
    notes: Sequence[str] = (),
    read: Sequence[RunInfo] | None = None,
) -> str:
    ranks = list(timeline.ranks)
    tree = _merged_tree(records, ranks)
    # what the ranks did: a collective taken from a hang record (not completed, or
    # completed in a span still open) is drawn on the timeline, not counted (its span
    # was never written; the counts leave it out)
    done = [c for c in timeline.collectives if not c.unwritten]
    issued = _issued(done, ranks)
    times = _span_times(timeline, ranks)
    durations = any(c.duration_ns is not None for c in timeline.collectives)
    ctx = _Context(ranks, _windows_text(timeline), issued, times, durations)
    parts = [
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n",
        # the page loads nothing: the browser is told to refuse any request it might make
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">\n",
        f"<title>{_e(title)}</title>\n<style>\n{_asset('report.css')}</style>\n</head>\n<body>\n",
        _header(timeline, title, findings is not None, records, notes, read),
        _summary(timeline, ranks),
        _unfinished_note(timeline, records, last_traces),
    ]
    if findings is not None:
        parts.append(_findings_section(findings, timeline, embedded))
    parts.append(_modules_section(tree, ctx))
    parts.append(_redistributions_section(done, ranks))
    parts.append(_timeline_section())
    data = _timeline_data(timeline, embedded, first, findings or [])
    parts.append(
        "<script type=\"application/json\" id=\"cs-data\">"
        + _script_safe(dumps(data).decode("utf-8"))
        + "</script>\n"
    )
    parts.append(f"<script>\n{_asset('report.js')}</script>\n</body>\n</html>\n")
    return "".join(parts)


class _Context(NamedTuple):
    """What the module tree's rows are drawn from."""

    ranks: list[int]
    windows: str  # what the tree's counts are summed over, in words
    issued: dict[str, list[_Issued]]
    times: dict[str, dict[str, list[float | None]]]
    durations: bool


def _asset(name: str) -> str:
    return resources.files(__package__ or "").joinpath("assets").joinpath(name).read_text("utf-8")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _script_safe(text: str) -> str:
    """JSON inside a ``<script>`` element: no ``</``, ``<!--`` or ``<script`` may
    appear in it. JSON has ``<``, ``>`` and ``&`` only inside strings, where
    their ``\\u`` escapes mean the same."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _per_step(timeline: Timeline) -> list[StepWindow]:
    """The windows per-step figures are over: the steps (``mode.step(i)``) when there
    are any, every trace otherwise (a run without steps)."""
    steps = [w for w in timeline.steps if w.step is not None]
    return steps or list(timeline.steps)


def _windows_text(timeline: Timeline) -> str:
    """``"2 steps (0-1) and 3 traces outside steps"``, ``"4 traces"``."""
    numbers = sorted({w.step for w in timeline.steps if w.step is not None})
    n_steps = sum(1 for w in timeline.steps if w.step is not None)
    others = len(timeline.steps) - n_steps
    if not n_steps:
        return f"{others} trace{'s' if others != 1 else ''}"
    text = f"{n_steps} step{'s' if n_steps != 1 else ''} ({format_numbers(numbers, sep=', ')})"
    if others:
        text += f" and {others} trace{'s' if others != 1 else ''} outside steps"
    return text


def _header(timeline: Timeline, title: str, findings: bool,
            records: Sequence[SpanRecord], notes: Sequence[str] = (),
            read: Sequence[RunInfo] | None = None) -> str:
    step_text = _windows_text(timeline)
    runs = ", ".join(f"<code>{_e(r)}</code>" for r in timeline.run_ids) or "unknown"
    warn = ""
    if len(timeline.run_ids) > 1:
        warn = (
            f"<p class=\"warn\">These files hold {len(timeline.run_ids)} runs; counts below "
            "add them up. Write each run to its own directory to see them apart.</p>\n"
        )
    shown = "the counts, bytes and timeline below cover" if read is None else \
        "the files read hold"  # (and the notes say which of those the page shows)
    for run in list_runs(records) if read is None else read:
        note = shared_run_note(run)  # two jobs under one run id (the CLI says it too)
        if note is not None:
            warn += f"<p class=\"warn\">{_e(note[0].upper() + note[1:])}.</p>\n"
        # a rank sample, ranks that wrote no file: the page is not the whole job's
        covers = run.coverage(shown)
        if covers is not None:
            warn += f"<p class=\"warn\">{_e(covers[0].upper() + covers[1:])}.</p>\n"
    for note in notes:  # what the records leave out of the files read (--max-ranks)
        note = note.removeprefix("commspan: ")
        warn += f"<p class=\"warn\">{_e(note[0].upper() + note[1:])}.</p>\n"
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    findings_link = "<a href=\"#findings\">Findings</a> " if findings else ""
    return (
        f"<header>\n<h1>{_e(title)}</h1>\n<p class=\"sub\">run {runs} &middot; "
        f"{len(timeline.ranks)} rank{'s' if len(timeline.ranks) != 1 else ''} &middot; "
        f"{step_text} &middot; "
        f"written {now} by commspan {_e(__version__)}</p>\n{warn}"
        f"<nav>{findings_link}<a href=\"#modules\">Modules</a> "
        "<a href=\"#redistributions\">Redistributions</a> <a href=\"#timeline\">Timeline</a>"
        "</nav>\n</header>\n"
    )


def _summary(timeline: Timeline, ranks: list[int]) -> str:
    windows = _per_step(timeline)
    n_steps = max(len(windows), 1)
    counted = {w.position for w in windows}
    # a rank's part of a step that never ended is left out, as the counts (Global) do:
    # per step over the steps the rank finished
    unfinished = set(timeline.unfinished)
    over = {r: max(n_steps - sum((w, r) in unfinished for w in counted), 1) for r in ranks}
    count = {r: 0 for r in ranks}
    nbytes = {r: 0 for r in ranks}
    dur = {r: 0 for r in ranks}
    for c in timeline.collectives:
        if c.window not in counted or (c.window, c.rank) in unfinished or c.unwritten:
            continue  # a trace outside the steps (set-up, evaluation): not per step
        count[c.rank] += 1
        nbytes[c.rank] += c.bytes
        dur[c.rank] += c.duration_ns or 0
    modules = len({s.fqn for s in timeline.slices})
    cards = [
        ("ranks", str(len(ranks))),
        ("steps" if any(w.step is not None for w in windows) else "traces",
         str(len(windows))),
        ("modules", str(modules)),
        ("collectives per step and rank", _per_rank([count[r] / over[r] for r in ranks], _num)),
        ("bytes per step and rank", _per_rank([nbytes[r] / over[r] for r in ranks], _bytes)),
    ]
    if any(c.duration_ns is not None for c in timeline.collectives):
        cards.append(
            ("collective time per step and rank",
             _per_rank([dur[r] / over[r] for r in ranks], _duration))
        )
    body = "".join(
        f"<div class=\"card\"><div class=\"value\">{v}</div><div class=\"label\">{_e(k)}</div>"
        "</div>"
        for k, v in cards
    )
    return f"<section id=\"summary\" class=\"cards\">{body}</section>\n"


def _unfinished_note(timeline: Timeline, records: list[SpanRecord],
                     last_traces: Mapping[int | None, str] | None = None) -> str:
    """What ``commspan summary`` says on stderr of the steps cut short (and of a last step
    still running), on the page; ``""`` when every step ended."""
    if not timeline.unfinished:
        return ""
    cut = {(0 if r is None else r, trace) for r, trace, _ in cut_short(records, last_traces)}
    gone: list[tuple[int | None, int | None]] = []
    running: list[tuple[int | None, int | None]] = []
    for window, rank in timeline.unfinished:
        w = timeline.steps[window]
        (gone if (rank, w.trace_id) in cut else running).append((rank, w.step))
    said = []
    if gone:
        said.append(_capitalized(cut_short_steps(gone)) + " was cut short (no commspan.rank "
                    "span written: a hang or a process stopped mid-step).")
    if running:
        said.append(_capitalized(cut_short_steps(running)) + " had not ended when the files "
                    "were read (no commspan.rank span yet).")
    said.append("The figures per step above leave such a step out; in the module tree, "
                "Global and the modules still open then do not count its collectives, the "
                "modules that finished do. The timeline draws it.")
    return f"<p class=\"warn\" id=\"unfinished\">{_e(' '.join(said))}</p>\n"


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


# ------------------------------------------------------------------ findings
def _findings_section(
    findings: list[Mapping[str, Any]], timeline: Timeline, embedded: list[int]
) -> str:
    head = "<section id=\"findings\">\n<h2>Findings</h2>\n"
    if not findings:
        return head + "<p class=\"ok\">No findings: the checks found nothing.</p>\n</section>\n"
    steps = {timeline.steps[i].step for i in embedded}  # (only those the page can draw)
    rows = []
    for i, f in enumerate(findings):
        kind = f.get("kind", "")
        step = f.get("step")
        step_cell = _e(_dash(step))
        if isinstance(step, int) and step in steps:
            step_cell = f"<a href=\"#step={step}&amp;finding={i}\">{step}</a>"
        extra = {k: v for k, v in f.items() if k not in FINDING_KEYS}
        rows.append(
            f"<tr class=\"finding\" data-kind=\"{_e(kind)}\"><td><span class=\"kind\">"
            f"{_e(_dash(kind))}</span></td><td>{_e(_dash(f.get('group')))}</td>"
            f"<td>{_e(_dash(f.get('seq')))}</td><td>{step_cell}</td>"
            f"<td>{_e(_dash(f.get('message')))}{_ranks_table(f.get('ranks'))}"
            f"{_extra(extra)}</td></tr>\n"
        )
    return (
        head
        + f"<p>{len(findings)} finding{'s' if len(findings) != 1 else ''}. A step links to the "
        "timeline, with the collective marked.</p>\n"
        "<table class=\"findings\"><thead><tr><th>kind</th><th>group</th><th>seq</th>"
        "<th>step</th><th>what happened</th></tr></thead>\n<tbody>\n"
        + "".join(rows)
        + "</tbody></table>\n</section>\n"
    )


def _dash(value: Any) -> Any:
    return "\u2014" if value is None or value == "" else value


def _ranks_table(ranks: Any) -> str:
    if not ranks:
        return ""
    if not isinstance(ranks, Mapping):
        return f"<div class=\"detail\">ranks: {_e(ranks)}</div>"
    rows = []
    for rank, what in sorted(ranks.items(), key=_rank_order):
        if isinstance(what, Mapping):  # (as `commspan check` writes it)
            cells = _e(rank_entry_text(what))
        else:
            cells = f"<code>{_e(_fmt(what))}</code>"
        rows.append(f"<tr><th>rank {_e(rank)}</th><td>{cells}</td></tr>")
    return "<table class=\"ranks\">" + "".join(rows) + "</table>"


def _rank_order(item: tuple[Any, Any]) -> tuple[int, int, str]:
    """Ranks in number order (``"10"`` after ``"9"``: JSON keys are strings)."""
    key = str(item[0])
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def _extra(extra: Mapping[str, Any]) -> str:
    """The finding's other fields: the steps it also diverges in, as ``commspan check``
    says it, and the rest folded away (``--json`` names them)."""
    if not extra:
        return ""
    out = ""
    later = extra.get("later_steps")
    if isinstance(later, list) and later:
        words = ", ".join("outside steps" if v is None else str(v) for v in later)
        out += f"<div class=\"detail\">also diverges in steps {_e(words)}</div>"
    rest = {k: v for k, v in extra.items() if k != "later_steps"}
    if rest:
        items = ", ".join(f"{_e(k)} <code>{_e(_fmt(v))}</code>" for k, v in rest.items())
        out += (f"<details class=\"detail\"><summary>details</summary>{items}"
                "</details>")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return dumps(value, default=str).decode("utf-8")
    return str(value)


# ------------------------------------------------------------------ module tree
class _Node:
    __slots__ = ("fqn", "type", "params", "counts", "children")

    def __init__(self, fqn: str, mtype: str, params: dict[str, dict[str, str]]) -> None:
        self.fqn = fqn
        self.type = mtype
        self.params = params
        self.counts: dict[str, dict[str, list[int]]] = {}
        self.children: list[_Node] = []


def _merged_tree(records: list[SpanRecord], ranks: list[int]) -> _Node:
    """One tree over all ranks; each count is a list with one entry per rank."""
    root = _Node(semconv.GLOBAL_FQN, "", {})
    nodes = {root.fqn: root}
    by_rank: dict[int | None, list[SpanRecord]] = {}
    for rec in records:
        by_rank.setdefault(rec.rank if rec.rank is not None else 0, []).append(rec)
    for pos, rank in enumerate(ranks):
        tree = Aggregator.from_records(by_rank.get(rank, []), rank="all").to_dict()
        stack: list[tuple[dict[str, Any], _Node | None]] = [(tree, None)]
        while stack:
            item, parent = stack.pop()
            node = nodes.get(item["fqn"])
            if node is None:
                node = nodes[item["fqn"]] = _Node(item["fqn"], item["type"], item["parameters"])
                if parent is not None:
                    parent.children.append(node)
            for phase, ops in item["counts"].items():
                slot = node.counts.setdefault(phase, {})
                for op, n in ops.items():
                    slot.setdefault(op, [0] * len(ranks))[pos] = n
            stack.extend((child, node) for child in reversed(item["children"]))
    return root


class _Issued:
    """Collectives one module issued itself, grouped by phase, op, group and placements."""

    __slots__ = ("phase", "op", "group", "src", "dst", "issuer", "count", "bytes", "time",
                 "timed")

    def __init__(self, phase: str, op: str, group: str, src: str, dst: str, n: int,
                 issuer: str = "") -> None:
        self.phase, self.op, self.group, self.src, self.dst = phase, op, group, src, dst
        self.issuer = issuer  # the module it was issued in, when not this one
        self.count = [0] * n
        self.bytes = [0] * n
        self.time = [0] * n
        self.timed = [0] * n


def _issued(collectives: Sequence[Collective], ranks: list[int]) -> dict[str, list[_Issued]]:
    pos = {r: i for i, r in enumerate(ranks)}
    groups: dict[tuple[str, str, str, str, str, str, str], _Issued] = {}
    for c in collectives:
        # under the module that owns it, as the counts and `table --show` list it (an
        # FSDP unit's all-gather prefetched from another unit's backward is the unit's)
        issuer = c.fqn if c.owner else ""
        key = (c.owner or c.fqn, c.phase, c.op, c.group, c.src, c.dst, issuer)
        item = groups.get(key)
        if item is None:
            item = groups[key] = _Issued(c.phase, c.op, c.group, c.src, c.dst, len(ranks),
                                         issuer)
        i = pos[c.rank]
        item.count[i] += 1
        item.bytes[i] += c.bytes
        if c.duration_ns is not None:
            item.time[i] += c.duration_ns
            item.timed[i] += 1
    out: dict[str, list[_Issued]] = {}
    for (fqn, *_rest), item in groups.items():
        out.setdefault(fqn, []).append(item)
    for items in out.values():
        items.sort(key=lambda s: (_phase_order(s.phase), s.op, s.group, s.src, s.dst,
                                  s.issuer))
    return out


def _span_times(
    timeline: Timeline, ranks: list[int]
) -> dict[str, dict[str, list[float | None]]]:
    """``{fqn: {phase: [mean ns per step, per rank]}}`` of the module's spans, over
    the windows of :func:`_per_step`; ``None`` for a rank with no span of it."""
    pos = {r: i for i, r in enumerate(ranks)}
    windows = _per_step(timeline)
    counted = {w.position for w in windows}
    total: dict[str, dict[str, list[float | None]]] = {}
    steps_of: dict[int, set[int]] = {}
    for s in timeline.slices:
        if s.window not in counted:
            continue
        slot = total.setdefault(s.fqn, {}).setdefault(s.phase, [None] * len(ranks))
        i = pos[s.rank]
        slot[i] = (slot[i] or 0.0) + (s.end_ns - s.start_ns)
    for w in windows:
        for rank, _start, _end in w.ranks:
            steps_of.setdefault(rank, set()).add(w.position)
    for phases in total.values():
        for values in phases.values():
            for r, i in pos.items():
                v = values[i]
                if v is not None:
                    values[i] = v / max(len(steps_of.get(r, ())), 1)
    return total


def _modules_section(root: _Node, ctx: _Context) -> str:
    out: list[str] = []
    _tree_html(root, ctx, out)
    over = f"summed over {ctx.windows}"
    return (
        "<section id=\"modules\">\n<h2>Modules</h2>\n"
        f"<p class=\"note\">Collective counts per phase and op, {over}: a module counts "
        "its own collectives and those of the modules inside it. One value where all ranks "
        "agree; <span class=\"differs\">one per rank</span> (rank "
        f"{' &middot; '.join(str(r) for r in ctx.ranks)}) where they differ. Open a module "
        "for the collectives it issued itself, their bytes and placements.</p>\n"
        "<p class=\"tools\"><button type=\"button\" data-tree=\"open\">expand all</button> "
        "<button type=\"button\" data-tree=\"close\">collapse all</button></p>\n"
        "<div class=\"tree\">\n" + "".join(out) + "</div>\n</section>\n"
    )


def _tree_html(root: _Node, ctx: _Context, out: list[str]) -> None:
    """The module tree as nested ``<details>``, without recursion (a model thousands of
    modules deep stays under Python's recursion limit); past :data:`_NESTED_DEPTH`
    levels, the rows follow each other in tree order, flat (a browser would move them
    out of their parents anyway), each saying its depth."""
    todo: list[tuple[_Node, int] | None] = [(root, 0)]
    while todo:
        item = todo.pop()
        if item is None:
            out.append("</details>\n")
            continue
        node, depth = item
        flat = depth > _NESTED_DEPTH
        if _node_html(node, depth, ctx, out, flat=flat):
            todo.append(None)  # closes its <details> after its children
        todo.extend((child, depth + 1) for child in reversed(node.children))


def _node_html(node: _Node, depth: int, ctx: _Context, out: list[str], *,
               flat: bool = False) -> bool:
    """One module's row; ``True`` if it opened a ``<details>`` its children go in (a
    ``flat`` row, past the nesting the page keeps, closes its own and says its depth;
    its children follow it)."""
    chips = []
    for phase in sorted(node.counts, key=_phase_order):
        ops = " ".join(
            f"<span class=\"op\" data-op=\"{_e(op)}\">{_e(op)} "
            f"{_per_rank(values, _num)}</span>"
            for op, values in sorted(node.counts[phase].items())
        )
        chips.append(
            f"<span class=\"phase ph-{_e(phase)}\" data-phase=\"{_e(phase)}\">"
            f"<b>{_e(phase)}</b> {ops}</span>"
        )
    mtype = f" <span class=\"type\">{_e(node.type)}</span>" if node.type else ""
    line = f"<span class=\"fqn\">{_e(node.fqn)}</span>{mtype} {''.join(chips)}"
    body = _node_body(node, ctx)
    where = f"data-fqn=\"{_e(node.fqn)}\""
    if flat:  # (the depth, as the nesting would have shown it)
        line = (f"<span class=\"depth\" title=\"nesting depth: the rows this deep are "
                f"listed flat, in tree order\">depth {depth}</span> {line}")
        where += f" data-depth=\"{depth}\""
    if (not node.children or flat) and not body:
        cls = "leaf flat" if flat else "leaf"
        out.append(f"<div class=\"{cls}\" {where}>{line}</div>\n")
        return False
    is_open = " open" if depth < _OPEN_DEPTH else ""
    cls = " class=\"flat\"" if flat else ""
    out.append(f"<details{is_open}{cls} {where}><summary>{line}</summary>\n{body}")
    if flat:
        out.append("</details>\n")
    return not flat


def _node_body(node: _Node, ctx: _Context) -> str:
    parts = []
    times = ctx.times.get(node.fqn)
    if times:
        cells = " ".join(
            f"<span class=\"ph-{_e(p)}\">{_e(p)} "
            f"<span title=\"{_e(_rank_list(v, _maybe_duration, ctx.ranks))}\">"
            f"{_duration(_mean(v))}</span></span>"
            for p, v in sorted(times.items(), key=lambda kv: _phase_order(kv[0]))
        )
        parts.append("<div class=\"times\">span time per step (mean over the ranks that ran "
                     f"it): {cells}</div>")
    if node.params:
        rows = "".join(
            f"<tr><td>{_e(name)}</td><td>{_e(p['shape'])}</td>"
            f"<td>{_e(p['placements'] or 'local tensor')}</td></tr>"
            for name, p in node.params.items()
        )
        parts.append(
            "<table class=\"params\"><thead><tr><th>parameter</th><th>shape</th>"
            f"<th>placements</th></tr></thead><tbody>{rows}</tbody></table>"
        )
    issued = ctx.issued.get(node.fqn)
    if issued:
        time_head = "<th>time</th>" if ctx.durations else ""
        lines = []
        for s in issued:
            placements = f"{s.src} \u2192 {s.dst}" if (s.src or s.dst) else ""
            issuer = (f" <span class=\"issuer\" title=\"issued while {_e(s.issuer)} ran; "
                      f"counted here, in the module that owns it\">issued in "
                      f"{_e(s.issuer)}</span>" if s.issuer else "")
            time_cell = ""
            if ctx.durations:
                time_cell = f"<td>{_per_rank(s.time, _duration) if any(s.timed) else '-'}</td>"
            lines.append(
                f"<tr data-phase=\"{_e(s.phase)}\" data-op=\"{_e(s.op)}\">"
                f"<td><span class=\"dot ph-{_e(s.phase)}\"></span>{_e(s.phase)}</td>"
                f"<td>{_e(s.op)}{issuer}</td><td>{_e(s.group)}</td>"
                f"<td class=\"count\">{_per_rank(s.count, _num)}</td>"
                f"<td>{_per_rank(s.bytes, _bytes)}</td><td>{_e(placements)}</td>{time_cell}</tr>"
            )
        parts.append(
            "<table class=\"issued\"><caption>collectives it issued itself, or that were "
            "issued for it</caption><thead><tr>"
            "<th>phase</th><th>op</th><th>group</th><th>count</th><th>bytes</th>"
            f"<th>placements</th>{time_head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"
        )
    if not parts:
        return ""
    return "<div class=\"body\">" + "".join(parts) + "</div>\n"


def _redistributions_section(collectives: Sequence[Collective], ranks: list[int]) -> str:
    pos = {r: i for i, r in enumerate(ranks)}
    groups: dict[tuple[str, str, str, str, str, str, str], list[list[int]]] = {}
    for c in collectives:
        if not (c.src or c.dst):
            continue
        key = (c.fqn, c.phase, c.redistribute_op, c.src, c.dst, c.op, c.group)
        slot = groups.get(key)
        if slot is None:
            slot = groups[key] = [[0] * len(ranks), [0] * len(ranks)]
        slot[0][pos[c.rank]] += 1
        slot[1][pos[c.rank]] += c.bytes
    head = "<section id=\"redistributions\">\n<h2>Redistributions</h2>\n"
    if not groups:
        return head + "<p>No DTensor redistribution issued a collective.</p>\n</section>\n"
    rows = "".join(
        f"<tr data-fqn=\"{_e(fqn)}\"><td class=\"fqn\">{_e(fqn)}</td>"
        f"<td><span class=\"dot ph-{_e(phase)}\"></span>{_e(phase)}</td><td>{_e(rop)}</td>"
        f"<td><code>{_e(src)}</code></td><td><code>{_e(dst)}</code></td><td>{_e(op)}</td>"
        f"<td>{_e(group)}</td><td class=\"count\">{_per_rank(n, _num)}</td>"
        f"<td>{_per_rank(b, _bytes)}</td></tr>\n"
        for (fqn, phase, rop, src, dst, op, group), (n, b) in groups.items()
    )
    return (
        head
        + "<p class=\"note\">Each DTensor redistribution that issued a collective: the module "
        "and phase it ran in, the DTensor op that needed it, the placements before and after, "
        "and the collective it took.</p>\n"
        "<table class=\"redistributions\"><thead><tr><th>module</th><th>phase</th>"
        "<th>DTensor op</th><th>from</th><th>to</th><th>collective</th><th>group</th>"
        "<th>count</th><th>bytes</th></tr></thead>\n<tbody>\n"
        + rows
        + "</tbody></table>\n</section>\n"
    )


def _timeline_section() -> str:
    phases = "".join(
        f"<span class=\"key\"><span class=\"swatch ph-{p}\"></span>{p}</span>" for p in _PHASES
    )
    return (
        "<section id=\"timeline\">\n<h2>Timeline</h2>\n"
        "<div class=\"controls\"><label>step <select id=\"cs-step\"></select></label> "
        "<button type=\"button\" id=\"cs-prev\" title=\"previous step (\u2190)\">\u25c0</button>"
        "<button type=\"button\" id=\"cs-next\" title=\"next step (\u2192)\">\u25b6</button> "
        "<label>zoom <select id=\"cs-zoom\"><option>1</option><option>2</option>"
        "<option>4</option><option>8</option><option>16</option><option>32</option>"
        "</select></label> <span id=\"cs-stepinfo\"></span></div>\n"
        f"<div class=\"legend\">{phases}<span class=\"key\"><span class=\"swatch coll\"></span>"
        "collective (issue time; width = duration when recorded)</span><span class=\"key\">"
        "<span class=\"swatch link\"></span>same collective on each rank (group, seq; a send "
        "and its receive)</span>"
        "</div>\n"
        "<div id=\"cs-scroll\"><svg id=\"cs-svg\" xmlns=\"http://www.w3.org/2000/svg\"></svg>"
        "</div>\n<div id=\"cs-tip\" hidden></div>\n"
        "<noscript><p>The timeline is drawn by JavaScript; enable it to see it.</p></noscript>\n"
        "<output id=\"cs-status\" hidden></output>\n</section>\n"
    )


# ------------------------------------------------------------------ timeline data
class _Strings:
    def __init__(self) -> None:
        self.items: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, value: str) -> int:
        i = self._index.get(value)
        if i is None:
            i = self._index[value] = len(self.items)
            self.items.append(value)
        return i


def _timeline_data(
    timeline: Timeline,
    embedded: list[int],
    first: int,
    findings: list[Mapping[str, Any]],
) -> dict[str, Any]:
    """The embedded JSON: strings deduplicated, times in 0.1 us from the step's start.

    Per step: ``{"l": label, "s": step number, "d": duration, "r": [per rank:
    [rank, start, end, rows, spans, collectives]]}`` where ``spans`` is flat,
    5 numbers a span (fqn, phase, start, duration, row), and ``collectives``
    flat, 9 numbers a collective (op, fqn, phase, group, seq, bytes, time,
    duration or -1, details); a point-to-point op's group is ``"<group>
    <sender>→<receiver>"`` and its seq its number per peer, so that a send and its
    receive link.
    """
    strings = _Strings()
    phase_index = {p: strings(p) for p in _PHASES}
    wanted = set(embedded)
    slices: dict[tuple[int, int], list[Any]] = {}
    for s in timeline.slices:
        if s.window in wanted:
            slices.setdefault((s.window, s.rank), []).append(s)
    colls: dict[tuple[int, int], list[Collective]] = {}
    for c in timeline.collectives:
        if c.window in wanted:
            colls.setdefault((c.window, c.rank), []).append(c)
    steps = []
    for index in embedded:
        w = timeline.steps[index]
        t0 = w.start_ns
        per_rank = []
        for rank, start, end in w.ranks:
            items = slices.get((index, rank), [])
            rows = _rows(items)
            flat: list[int] = []
            for s, row in zip(items, rows):
                flat += [
                    strings(s.fqn),
                    phase_index[s.phase] if s.phase in phase_index else strings(s.phase),
                    _tick(s.start_ns - t0),
                    _tick(s.end_ns - s.start_ns),
                    row,
                ]
            cflat: list[int] = []
            for c in colls.get((index, rank), []):
                if c.kind == semconv.KIND_P2P:  # linked with its peer's side, if any
                    pair = c.pair
                    group = _link_group(c.group, *pair) if pair else c.group
                    seq = c.p2p_seq if pair and c.p2p_seq is not None else -1
                else:
                    group, seq = c.group, c.seq if c.seq is not None else -1
                cflat += [
                    strings(c.op),
                    strings(c.fqn),
                    strings(c.phase),
                    strings(group),
                    seq,
                    c.bytes,
                    _tick(c.time_ns - t0),
                    _tick(c.duration_ns) if c.duration_ns is not None else -1,
                    strings(_details(c)),
                ]
            per_rank.append([
                rank, _tick(start - t0), _tick(end - t0), (max(rows) + 1) if rows else 0,
                flat, cflat,
            ])
        steps.append({
            "l": w.label,
            "s": w.step,
            "d": _tick(w.end_ns - w.start_ns),
            "r": per_rank,
        })
    marks = [_mark(i, f) for i, f in enumerate(findings) if f.get("step") is not None]
    return {
        "v": 1,
        "tick_ns": _TICK_NS,
        "first": first,
        "strings": strings.items,
        "phases": _PHASES,
        "steps": steps,
        "findings": marks,
        "durations": any(c.duration_ns is not None for c in timeline.collectives),
    }


def _rows(items: list[Any]) -> list[int]:
    """Row of each slice in a rank's band: its nesting depth, lanes stacked below."""
    placed = assign_lanes([(s.start_ns, s.end_ns) for s in items])
    depth_of_lane: dict[int, int] = {}
    for lane, depth in placed:
        depth_of_lane[lane] = max(depth_of_lane.get(lane, 0), depth + 1)
    offset, base = 0, {}
    for lane in sorted(depth_of_lane):
        base[lane] = offset
        offset += depth_of_lane[lane]
    return [base[lane] + depth for lane, depth in placed]


def _tick(ns: int) -> int:
    return int(round(ns / _TICK_NS))


def _link_group(group: str, sender: Any, receiver: Any) -> str:
    """What the page links a send and its receive by, with their number: ``0 1→2``
    (a point-to-point op's number counts per peer, not with the group's collectives)."""
    return f"{group} {sender}\u2192{receiver}"


def _mark(i: int, f: Mapping[str, Any]) -> dict[str, Any]:
    """A finding as the page marks it: the collective of its group and seq, or the send
    and receive of a point-to-point finding."""
    group, seq = str(f.get("group", "")), f.get("seq")
    pair = f.get("p2p")
    if isinstance(pair, Mapping):
        group = _link_group(group, pair.get("sender"), pair.get("receiver"))
        seq = pair.get("p2p_seq")
    return {"i": i, "step": f.get("step"), "group": group, "seq": seq,
            "kind": str(f.get("kind", ""))}


def _unwritten(c: Collective) -> str:
    """What a collective taken from a hang record is, in words."""
    if c.pending:
        return "not completed: the rank waited in it (hang record)"
    return "completed in a span never written (hang record): not counted"


def _details(c: Collective) -> str:
    parts = [_unwritten(c)] if c.unwritten else []
    if c.dtype:
        shape = "x".join(str(d) for d in c.shape)
        parts.append(f"{c.dtype}[{shape}]" if shape else c.dtype)
    if c.reduce_op:
        parts.append(f"reduce {c.reduce_op}")
    if c.group_ranks:
        parts.append(f"ranks {list(c.group_ranks)}")
    if c.mesh_dim is not None:
        parts.append(f"mesh dim {c.mesh_dim}")
    if c.peer is not None:
        parts.append(f"peer {c.peer}" if c.p2p_seq is None
                     else f"{'to' if c.op == 'send' else 'from'} rank {c.peer}, #{c.p2p_seq}")
    if c.src or c.dst:
        where = f" in {c.redistribute_op}" if c.redistribute_op else ""
        parts.append(f"{c.src} \u2192 {c.dst}{where}")
    return "; ".join(parts)


# ------------------------------------------------------------------ formatting
def _phase_order(phase: str) -> int:
    return _PHASES.index(phase) if phase in _PHASES else len(_PHASES)


def _per_rank(values: Sequence[float], fmt: Any) -> str:
    """One value when all ranks agree, else each rank's, marked as differing."""
    if not values:
        return ""
    if all(v == values[0] for v in values):
        return f"<span class=\"n\">{fmt(values[0])}</span>"
    shown = " \u00b7 ".join(fmt(v) for v in values)
    return f"<span class=\"n differs\" title=\"one value per rank\">{shown}</span>"


def _mean(values: Sequence[float | None]) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else 0.0


def _maybe_duration(value: float | None) -> str:
    return "-" if value is None else _duration(value)


def _rank_list(values: Sequence[Any], fmt: Any, ranks: list[int]) -> str:
    return ", ".join(f"rank {r}: {fmt(v)}" for r, v in zip(ranks, values))


def _num(value: float) -> str:
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}"


def _bytes(value: float) -> str:
    n = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def _duration(ns: float) -> str:
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1_000:.1f} \u00b5s"
    if ns < 1_000_000_000:
        return f"{ns / 1_000_000:.2f} ms"
    return f"{ns / 1_000_000_000:.2f} s"
