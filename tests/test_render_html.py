"""commspan.render.html: the self-contained report of a real 4-rank run, read back as HTML."""

from __future__ import annotations

import dataclasses
import html
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _example_run import RANKS, example_run
from _report_dom import embedded_data, tree_counts

from commspan import Aggregator, semconv
from commspan.analysis.timeline import build_timeline, load_records, match_collectives
from commspan.exporters import SpanRecord, read_spans
from commspan.render.html import html_report, write_html_report
from commspan.render.perfetto import write_chrome_trace

STEPS = 3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return example_run(tmp_path_factory, STEPS, "--no-timing")  # collectives without widths


@pytest.fixture(scope="module")
def records(run_dir: Path) -> list[SpanRecord]:
    return load_records(run_dir)


@pytest.fixture(scope="module")
def page(records: list[SpanRecord]) -> str:
    return html_report(records)


def test_aggregator_from_records_matches_from_jsonl(tmp_path: Path) -> None:
    """Aggregator.from_records counts what from_jsonl counts from the same file."""
    import torch

    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter, read_spans

    mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path / "r0.jsonl")])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with mode:
        for i in range(2):
            with mode.step(i):
                model(torch.ones(3, 4)).sum().backward()
    mode.shutdown()
    from_file = Aggregator.from_jsonl(tmp_path / "r0.jsonl")
    from_records = Aggregator.from_records(read_spans(tmp_path / "r0.jsonl"))
    assert from_records.to_dict() == from_file.to_dict()
    assert from_records.modules() == ["Sequential", "Sequential.0", "Sequential.1", "Sequential.2"]
    with pytest.raises(ValueError, match="rank='x'"):
        Aggregator.from_records([], rank="x")


@pytest.mark.multiprocess
def test_page_is_self_contained(page: str) -> None:
    """Nothing is loaded from elsewhere: no external src/href, no <link>, no url(), a strict CSP."""
    assert page.startswith("<!doctype html>")
    assert "<link" not in page and "@import" not in page and "url(" not in page
    for attr, value in re.findall(r'\b(src|href)="([^"]*)"', page):
        assert value.startswith("#"), (attr, value)
    assert "default-src 'none'" in page
    assert page.count("<script") == 2  # the data, and the inline script drawing it


@pytest.mark.multiprocess
def test_module_tree_shows_every_module_and_its_counts(page: str, run_dir: Path) -> None:
    """Each module of each rank is in the tree, with the counts `commspan table` gives."""
    shown = tree_counts(page)
    per_rank = [Aggregator.from_jsonl(run_dir, rank=r) for r in range(RANKS)]
    expected_modules = {semconv.GLOBAL_FQN, *per_rank[0].modules()}
    assert set(shown.modules) == expected_modules
    assert len(shown.modules) == len(expected_modules)  # each once
    for agg in per_rank:
        for fqn, phases in agg.module_counts().items():
            assert {p: {op: int(n) for op, n in ops.items()}
                    for p, ops in shown.counts[fqn].items()} == phases, fqn
    wo = shown.counts["Transformer.layers.0.attention.wo"]
    assert wo["forward"] == {"all_reduce": str(STEPS)}


@pytest.mark.multiprocess
def test_ranks_that_differ_show_one_value_each(records: list[SpanRecord]) -> None:
    """A module whose counts differ between ranks shows each rank's value, marked."""
    dropped = [
        r for r in records
        if not (r.rank == 3 and r.name == "Transformer.output forward"
                and r.trace_id == records[0].trace_id)
    ]
    shown = tree_counts(html_report(dropped))
    text = shown.counts["Transformer.output"]["forward"]["all_gather_into_tensor"]
    assert text == f"{STEPS} \u00b7 {STEPS} \u00b7 {STEPS} \u00b7 {STEPS - 1}"
    assert 'class="n differs"' in html_report(dropped)
    assert shown.counts["Transformer.output"]["backward"]["all_reduce"] == str(STEPS)


@pytest.mark.multiprocess
def test_issued_collectives_and_redistributions(page: str, records: list[SpanRecord]) -> None:
    """Each module's own collectives list group, bytes and placements; redistributions too."""
    timeline = build_timeline(records)
    pairs = {(c.src, c.dst) for c in timeline.collectives if c.src}
    section = page.split('<section id="redistributions">', 1)[1].split("</section>", 1)[0]
    for src, dst in pairs:
        assert f"<td><code>{src}</code></td><td><code>{dst}</code></td>" in section
    rows = Counter(
        (c.fqn, c.phase, c.src, c.dst) for c in timeline.collectives if c.src and c.rank == 0
    )
    for (fqn, phase, _src, _dst), n in rows.items():
        assert re.search(
            rf'<tr data-fqn="{re.escape(fqn)}"><td class="fqn">{re.escape(fqn)}</td>'
            rf'<td><span class="dot ph-{phase}"></span>{phase}</td>.*?'
            rf'<td class="count"><span class="n">{n}</span>',
            section,
        ), (fqn, phase)
    wo = page.split('data-fqn="Transformer.layers.0.attention.wo">', 1)[1].split("</details>")[0]
    assert '<table class="issued">' in wo and "P(sum) \u2192 R" in wo
    assert "1.0 KiB" in wo or "3.0 KiB" in wo  # bytes of its all_reduces
    assert "S(1)" in wo  # its weight's placements


@pytest.mark.multiprocess
def test_embedded_timeline_data(page: str, records: list[SpanRecord]) -> None:
    """Every step's spans and collectives are embedded, strings deduplicated."""
    data = embedded_data(page)
    timeline = build_timeline(records)
    assert [s["l"] for s in data["steps"]] == [f"step {i}" for i in range(STEPS)]
    strings = data["strings"]
    assert len(strings) == len(set(strings))
    for index, step in enumerate(data["steps"]):
        assert [r[0] for r in step["r"]] == list(range(RANKS))
        spans = sum(len(r[4]) // 5 for r in step["r"])
        colls = sum(len(r[5]) // 9 for r in step["r"])
        assert spans == sum(1 for s in timeline.slices if s.window == index)
        assert colls == sum(1 for c in timeline.collectives if c.window == index)
        for r in step["r"]:
            names = {strings[r[4][k]] for k in range(0, len(r[4]), 5)}
            assert "Transformer.layers.0.attention.wo" in names
            rows = [r[4][k + 4] for k in range(0, len(r[4]), 5)]
            assert max(rows) + 1 == r[3]
    assert data["first"] == 0 and data["durations"] is False


@pytest.mark.multiprocess
def test_findings_are_listed_and_escaped(records: list[SpanRecord]) -> None:
    """Findings show kind, group, seq, step, message and each rank's part, HTML-escaped."""
    c = next(iter(match_collectives(build_timeline(records).collectives).values()))[0]
    finding = {
        "kind": "mismatch", "group": c.group, "seq": c.seq, "step": 1,
        "ranks": {0: {"op": "all_reduce", "fqn": c.fqn, "shape": [2, 8]}, 1: {"op": "broadcast"}},
        "message": "rank 1 <script>alert(1)</script> issued broadcast", "extra_key": 7,
    }
    page = html_report(records, findings={"findings": [finding], "checked": {}})
    section = page.split('<section id="findings">', 1)[1].split("</section>", 1)[0]
    assert '<span class="kind">mismatch</span>' in section
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in section and "<script>" not in section
    # each rank's part as `commspan check` writes it; other fields folded away
    assert "<th>rank 1</th><td>broadcast</td>" in section
    assert f"<th>rank 0</th><td>all_reduce  in `{html.escape(c.fqn)}`  shape [2, 8]</td>" \
        in section
    assert ('<details class="detail"><summary>details</summary>extra_key <code>7</code>'
            "</details>") in section
    assert '<a href="#step=1&amp;finding=0">1</a>' in section
    assert embedded_data(page)["findings"] == [
        {"i": 0, "step": 1, "group": c.group, "seq": c.seq, "kind": "mismatch"}
    ]
    assert "No findings" in html_report(records, findings=[])
    assert 'id="findings"' not in html_report(records)


@pytest.mark.multiprocess
def test_a_hang_finding_reads_as_check_writes_it(records: list[SpanRecord]) -> None:
    """A finding read back from ``commspan check --json`` (rank keys are strings): ranks
    in number order (10 after 9), each rank's part in check's words (waited in seconds,
    the stack joined), the later steps said, not dumped as dicts."""
    ranks = {str(r): {"op": "all_reduce", "fqn": "Net.blocks.2", "phase": "forward",
                      "seq": 9, "state": "issued", "waited_ns": 2_378_833_126,
                      "stack": ["Net forward", "Net.blocks.2 forward"]} for r in (0, 9, 10)}
    ranks["1"] = {"op": None, "fqn": "Net.blocks.1", "phase": "forward", "seq": None,
                  "state": "not issued", "last_seq": 8}
    finding = {"kind": "hang", "group": "0", "seq": 9, "step": 1, "ranks": ranks,
               "message": "group 0, seq 9: rank 1 never issued it", "later_steps": [2, 3]}
    page = html_report(records, findings=[finding])
    section = page.split('<section id="findings">', 1)[1].split("</section>", 1)[0]
    assert re.findall(r"<th>rank (\d+)</th>", section) == ["0", "1", "9", "10"]
    assert ("<th>rank 0</th><td>all_reduce  in `Net.blocks.2` forward  seq 9  state issued  "
            "waited 2.38 s  stack: Net forward &gt; Net.blocks.2 forward</td>") in section
    assert ("<th>rank 1</th><td>-  in `Net.blocks.1` forward  state not issued  last_seq 8"
            "</td>") in section
    assert '<div class="detail">also diverges in steps 2, 3</div>' in section
    assert "waited_ns" not in section and "{" not in section.split("<table", 1)[1]


def test_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    """Wrong findings, steps or paths raise errors naming the parameter and the fix."""
    with pytest.raises(TypeError, match=r"findings\[1\] is a str"):
        html_report([], findings=[{"kind": "hang"}, "oops"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="findings"):
        html_report([], findings="mismatch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'findings' key"):
        html_report([], findings={"kind": "hang"})
    with pytest.raises(ValueError, match="step=4 is not in"):
        html_report([], step=4)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        html_report(tmp_path / "nothing")
    with pytest.raises(TypeError, match="out_path"):
        write_html_report([], None)  # type: ignore[arg-type]


@pytest.mark.multiprocess
def test_step_and_timeline_steps(records: list[SpanRecord], tmp_path: Path) -> None:
    """`step` picks the first step drawn; `timeline_steps` embeds only those steps."""
    data = embedded_data(html_report(records, step=2))
    assert data["first"] == 2
    small = html_report(records, timeline_steps=[1, 2], step=2)
    data = embedded_data(small)
    assert [s["s"] for s in data["steps"]] == [1, 2] and data["first"] == 1
    assert len(small) < len(html_report(records))
    with pytest.raises(ValueError, match="steps 0-2"):
        html_report(records, step=9)
    # a finding links to its step only when the page holds that step's timeline
    finding = {"kind": "mismatch", "group": "0", "seq": 1, "ranks": {}, "message": "m"}
    page = html_report(records, timeline_steps=[1], findings=[{**finding, "step": 2},
                                                              {**finding, "step": 1}])
    assert '<a href="#step=1&amp;finding=1">' in page and "#step=2" not in page
    out = write_html_report(records, tmp_path / "sub" / "report.html", title="TP <run>")
    assert "<title>TP &lt;run&gt;</title>" in out.read_text(encoding="utf-8")


@pytest.mark.multiprocess
def test_the_header_counts_one_rank_in_the_singular(records: list[SpanRecord]) -> None:
    """A one-rank run's header says "1 rank", not "1 ranks"."""
    one = html_report([r for r in records if r.rank in (0, None)])
    assert re.search(r"run <code>[^<]*</code> &middot; 1 rank &middot; ", one)
    assert f"{RANKS} ranks &middot; " in html_report(records)


def test_every_phase_has_a_colour_in_the_legend_dots_and_timeline() -> None:
    """The legend lists every ``Phase`` (html.py) and each needs its CSS rules: the
    ``setup`` swatch and dots had none, so they were blank."""
    from importlib.resources import files

    css = (files("commspan.render") / "assets" / "report.css").read_text(encoding="utf-8")
    colours = set()
    for phase in semconv.Phase:
        p = phase.value
        rule = re.search(r"\.dot\.ph-" + p + r", \.swatch\.ph-" + p
                         + r" \{ background: var\(--(\w+)\); \}", css)
        assert rule and rule.group(1) == p, p
        assert f"#cs-svg .span.ph-{p} {{ fill: var(--{p}); }}" in css
        assert f".phase.ph-{p} {{" in css
        colour = re.search(r"--" + p + r": (#[0-9a-f]{6});", css)
        assert colour, p
        colours.add(colour.group(1))
    assert len(colours) == len(semconv.Phase)  # each its own


@pytest.mark.multiprocess
def test_two_runs_in_one_folder_are_flagged(records: list[SpanRecord]) -> None:
    """Records of two runs make the report say so instead of silently adding them up."""
    other = [
        dataclasses.replace(r, trace_id=f"{int(r.trace_id, 16) ^ (1 << 127):032x}",
                            resource={**r.resource, semconv.RUN_ID: "second"})
        for r in records
    ]
    page = html_report(records + other)
    assert "These files hold 2 runs" in page
    assert "run second step 0" in page


@pytest.mark.multiprocess
def test_two_jobs_under_one_run_id_are_flagged(records: list[SpanRecord]) -> None:
    """The same run id written by two processes for each rank (a fixed
    COMMSPAN_RUN_ID): the page says their steps are added up, as the CLI does; it
    said nothing, and its cards showed twice the collectives of either job."""
    assert "processes for one rank" not in html_report(records)
    pids = {r.resource.get(semconv.PROCESS_PID) for r in records}
    assert len(pids) == len({r.rank for r in records})  # one process per rank
    other = [dataclasses.replace(r, resource={**r.resource, semconv.PROCESS_PID: -1})
             for r in records]
    page = html_report(records + other)
    run = records[0].resource[semconv.RUN_ID]
    assert f"Run {run} was written by 2 processes for one rank" in page


def _one_rank_run(tmp_path: Path, name: str, body: Any) -> Path:
    """Run ``body(mode)`` in this process (rank 0), JSONL into ``tmp_path / name``."""
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    out = tmp_path / name
    mode = CommSpanMode(exporters=[JsonlSpanExporter(out / "rank0.jsonl")], run_id="run")
    with mode:
        body(mode)
    mode.shutdown()
    return out


def _as_rank(records: list[SpanRecord], rank: int) -> list[SpanRecord]:
    """``records`` as another rank wrote them (one process plays both)."""
    return [dataclasses.replace(r, rank=rank, resource={**r.resource, semconv.RANK: rank})
            for r in records]


def test_names_that_open_an_html_comment_keep_the_embedded_data_valid(tmp_path: Path) -> None:
    """A module named ``<!--x`` (or holding ``<script``) used to be written into the
    embedded JSON as ``<\\!--``, which JSON cannot parse: the timeline drew nothing."""
    import torch

    model = torch.nn.Sequential()
    model.add_module("<!--x", torch.nn.Linear(2, 2))
    model.add_module("<script>", torch.nn.ReLU())

    def body(mode: Any) -> None:
        with mode.step(0):
            model(torch.ones(1, 2))

    page = html_report(_one_rank_run(tmp_path, "run", body))
    script = page.split('<script type="application/json" id="cs-data">', 1)[1]
    script = script.split("</script>", 1)[0]
    assert "<" not in script and ">" not in script  # nothing the HTML parser reads
    data = embedded_data(page)  # parses as JSON
    assert {"Sequential.<!--x", "Sequential.<script>"} <= set(data["strings"])


def test_span_time_is_the_mean_over_the_ranks_that_ran_the_module(tmp_path: Path) -> None:
    """A module only rank 1 runs: its span time is rank 1's, not halved by rank 0,
    which is shown as ``-``."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.common = torch.nn.Linear(2, 2)
            self.extra = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
            x = self.common(x)
            return self.extra(x) if extra else x

    net = Net()
    records: list[SpanRecord] = []
    for rank in (0, 1):
        def body(mode: Any, rank: int = rank) -> None:
            for i in range(2):
                with mode.step(i):
                    net(torch.ones(1, 2), extra=rank == 1)

        records += _as_rank(load_records(_one_rank_run(tmp_path, f"r{rank}", body)), rank)
    timeline = build_timeline(records)
    assert timeline.run_ids == ("run",) and len(timeline.steps) == 2  # the ranks' steps
    mine = [s for s in timeline.slices if s.fqn == "Net.extra"]
    assert {s.rank for s in mine} == {1}
    expected = sum(s.end_ns - s.start_ns for s in mine) / 2  # per step, rank 1 only
    page = html_report(records)
    row = page.split('data-fqn="Net.extra"', 1)[1].split('<div class="times">', 1)[1]
    row = row.split("</div>", 1)[0]
    assert "rank 0: -, rank 1: " in row
    shown = re.search(r'">([0-9.]+) (ns|\u00b5s|ms)</span>', row)
    assert shown is not None
    scale = {"ns": 1, "\u00b5s": 1e3, "ms": 1e6}[shown.group(2)]
    assert float(shown.group(1)) * scale == pytest.approx(expected, rel=0.05, abs=60)


def test_traces_outside_steps_are_not_counted_as_steps(tmp_path: Path, fake_pg: None) -> None:
    """Module calls before, between and after steps make traces of their own: the
    header names them apart, and per-step figures are over the steps only."""
    import torch
    import torch.distributed as dist

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return self.lin(x)

    net = Net()

    def body(mode: Any) -> None:
        net(torch.ones(2))  # before any step
        for i in range(2):
            with mode.step(i):
                net(torch.ones(2))
                net(torch.ones(2))
            net(torch.ones(2))  # between steps

    records = load_records(_one_rank_run(tmp_path, "run", body))
    in_steps = [c for c in build_timeline(records).collectives
                if build_timeline(records).steps[c.window].step is not None]
    assert len(in_steps) == 4
    page = html_report(records)
    header = page.split("<header>", 1)[1].split("</header>", 1)[0]
    assert "2 steps (0-1) and 3 traces outside steps" in header
    cards = page.split('<section id="summary"', 1)[1].split("</section>", 1)[0]
    assert '<div class="value">2</div><div class="label">steps</div>' in cards
    per_step = re.search(r'<span class="n">([0-9.,]+)</span></div><div class="label">'
                         r"collectives per step and rank", cards)
    assert per_step is not None and float(per_step.group(1)) == len(in_steps) / 2
    assert "summed over 2 steps (0-1) and 3 traces outside steps" in page



def test_collectives_issued_for_another_module_are_listed_under_their_owner(
    tmp_path: Path, fake_pg: None
) -> None:
    """FSDP2 prefetches a unit's all-gather from the next unit's backward, and runs the
    root unit's reduce-scatter outside every module: the report lists each under the
    module that owns it (as recorded on the event; as the counts and ``table --show``
    do), saying where it was issued; Perfetto's args name the owner. A collective a
    hang record lists as not completed is not counted."""
    import json

    import torch
    from _fsdp_sizes import fsdp2_sequential

    from commspan.render.perfetto import chrome_trace

    model = fsdp2_sequential()

    def body(mode: Any) -> None:
        for i in range(2):
            with mode.step(i):
                model(torch.ones(2, 8)).sum().backward()

    records = load_records(_one_rank_run(tmp_path, "fsdp", body))
    moved = Counter(
        (str(a[semconv.MODULE_FQN]), str(a[semconv.OWNER_FQN]))
        for r in records for _, a in r.events
        if semconv.COLL_OP in a and a[semconv.OWNER_FQN] != a[semconv.MODULE_FQN]
    )
    assert moved  # the prefetches, and the root's reduce-scatter issued outside modules
    page = html_report(records)
    for issuer, owner in moved:
        block = re.split(r"<details|</details>", page.split(f'data-fqn="{owner}">', 1)[1])[0]
        assert f">issued in {issuer}</span>" in block
    assert page.count('<span class="issuer"') == len(moved)
    # every collective is listed under its owner: the counts of the issued tables add
    # up to the events, rank 0's column
    listed = sum(int(n) for n in re.findall(r'<td class="count"><span class="n">(\d+)</span>',
                                             page.split('<section id="modules">', 1)[1]
                                             .split("</section>", 1)[0]))
    events = sum(1 for r in records for _, a in r.events if semconv.COLL_OP in a)
    assert listed == events
    trace = json.loads(json.dumps(chrome_trace(records)))
    owners = Counter((e["args"]["fqn"], e["args"]["owner"]) for e in trace["traceEvents"]
                     if "owner" in e.get("args", {}))
    assert owners == moved


def test_collectives_a_hang_record_lists_are_drawn_not_counted() -> None:
    """Step 1 hangs in Net.b's all_reduce on ranks 0, 2, 3 (their hang records list it
    not completed; rank 1 never issued it). The timeline draws it; the counts, the
    issued table and the per-step card count only what the spans hold, as ``table``."""
    from _analysis_builder import WORLD_GROUP, SpanBuilder

    b = SpanBuilder(4)
    for r in range(4):
        b.rank(r, 0).coll("all_reduce", fqn="Net.b", duration_ns=1000)
        b.rank(r, 1, finished=False).coll("all_reduce", fqn="Net.a", duration_ns=1000)
    for r in (0, 2, 3):
        stuck = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                              ranks=range(4), seq=3, state=semconv.STATE_ISSUED)
        b.hang(r, 1, stack=[("Net.b", "forward")], collectives=[stuck])
    records = b.spans()
    timeline = build_timeline(records)
    assert sum(c.pending for c in timeline.collectives) == 3  # drawn
    page = html_report(records)
    block = re.split(r"<details|</details>|</div>\n",
                     page.split('data-fqn="Net.b">', 1)[1])[0]
    assert '<td class="count"><span class="n">1</span></td>' in block  # step 0's only
    card = page.split('<div class="label">collectives per step and rank', 1)[0]
    card = card.rsplit('<div class="value">', 1)[1]
    assert card.startswith('<span class="n">1</span>')  # 2 per rank in 2 steps, every rank


def test_a_step_cut_short_is_left_out_of_the_cards_and_named(
    tmp_path: Path, fake_pg: None
) -> None:
    """Step 1 of 3 lost its backward and its rank and step spans, and got hang records
    (as a hang in the backward leaves it), and rank 1
    issues one more all_reduce in step 2: the cards count per step over the steps each
    rank finished, as the tree's Global row does (both the hand count of the finished
    steps' collectives), and the page names the cut step; a run without one has no
    such note."""
    from _cli_runs import net_step, write_run

    run = write_run(tmp_path / "run", "cut", net_step(extra_on=(1, 2)), steps=(0, 1, 2),
                    ranks=(0, 1))
    whole = load_records(run)
    cut = {r.trace_id for r in whole if r.attributes.get(semconv.STEP) == 1}
    # the hang came before the backward pass: neither its spans nor the step's ends
    # were written; each rank wrote a hang record instead (its step, its rank)
    records = [r for r in whole if r.trace_id not in cut
               or (r.name not in (semconv.SPAN_RANK, semconv.SPAN_STEP)
                   and r.attributes.get(semconv.PHASE) != "backward")]
    records += [dataclasses.replace(r, name=semconv.SPAN_HANG, attributes={
        semconv.RANK: r.rank, semconv.STEP: 1, semconv.HANG_REASON: semconv.HANG_REASON_TIMEOUT})
        for r in whole if r.trace_id in cut and r.name == semconv.SPAN_RANK]
    ended = {(r.rank, r.trace_id) for r in records if r.name == semconv.SPAN_RANK}
    by_hand = Counter(r.rank for r in records if (r.rank, r.trace_id) in ended
                      for _, a in r.events if semconv.COLL_OP in a)
    assert by_hand[0] < by_hand[1]  # rank 1's extra one in step 2
    page = html_report(records)
    card = page.split('<div class="label">collectives per step and rank', 1)[0]
    card = re.sub("<[^>]+>", "", card.rsplit('<div class="value">', 1)[1])
    assert card == f"{by_hand[0] / 2:g} \u00b7 {by_hand[1] / 2:g}"
    shown = [[int(n) for n in text.split(" \u00b7 ")]
             for ops in tree_counts(page).counts["Global"].values() for text in ops.values()]
    assert [sum(per_rank) for per_rank in zip(*shown)] == [by_hand[0], by_hand[1]]
    note = page.split('<p class="warn" id="unfinished">', 1)[1].split("</p>", 1)[0]
    assert note.startswith("Step 1 of ranks 0-1 was cut short")
    assert 'id="unfinished"' not in html_report(whole)


def test_negative_step_numbers_read_as_a_range(tmp_path: Path) -> None:
    """Steps -1, 0, 1 are written ``-1..1`` (``-1-1`` reads as two numbers)."""
    import torch

    net = torch.nn.Linear(2, 2)

    def body(mode: Any) -> None:
        for i in (-1, 0, 1):
            with mode.step(i):
                net(torch.ones(1, 2))

    page = html_report(load_records(_one_rank_run(tmp_path, "neg", body)))
    assert "(-1..1)" in page and "(-1-1)" not in page


@pytest.mark.parametrize(("call", "match"), [
    (lambda: write_html_report(5, "unused.html"), r"^source=5 is not valid; pass a JSONL "),
    (lambda: html_report(None), r"^source=None is not valid"),
    (lambda: write_chrome_trace(5, "unused.json"), r"^source=5 is not valid"),
    (lambda: Aggregator.from_jsonl(5), r"^paths: 5 \(int\) is not valid; pass the path "),
    (lambda: Aggregator.from_jsonl(["a.jsonl"]),
     r"^paths: \['a.jsonl'\] \(list\) is not valid; .*unpack it"),
    (lambda: list(read_spans(None)), r"^paths: None \(NoneType\) is not valid"),
    (lambda: Aggregator.from_records(5), r"^records=5 is not valid; pass SpanRecords"),
    (lambda: Aggregator.from_records("run"),
     r"^records='run' is a path, not span records; pass it to Aggregator.from_jsonl"),
    (lambda: Aggregator.from_records([1]), r"^records: 1 \(int\) is not a SpanRecord"),
])
def test_a_wrong_argument_type_names_the_parameter(call: Any, match: str) -> None:
    """A value of the wrong type passed to a public reader or writer is a TypeError naming
    the parameter, the value and what to pass (it was "'int' object is not iterable" or
    "'str' object has no attribute 'attributes'", naming nothing)."""
    with pytest.raises(TypeError, match=match):
        call()


def test_timeline_steps_none_of_which_ran_are_refused(tmp_path: Path) -> None:
    """timeline_steps=[9] of a run of steps 0-2 wrote a page without any timeline, and
    a bare int raised "'int' object is not iterable": the first is a ValueError listing
    the run's steps, the second a TypeError naming timeline_steps; a list holding one
    step of the run still embeds that step only."""
    import torch

    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path / "run")])
    model = torch.nn.Linear(2, 2)
    with mode:
        for i in range(3):
            with mode.step(i):
                model(torch.ones(1, 2)).sum().backward()
    records = list(read_spans(tmp_path / "run"))
    with pytest.raises(ValueError, match=re.escape(
            "timeline_steps=[7, 9] is not valid: none of them is a step of the run, which "
            "has steps 0-2; pass some of those, or None for every step")):
        html_report(records, timeline_steps=[9, 7])
    with pytest.raises(TypeError, match=re.escape("timeline_steps=5 is not valid; pass step "
                                                  "numbers, e.g. [0, 5]")):
        html_report(records, timeline_steps=5)  # type: ignore[arg-type]
    page = html_report(records, timeline_steps=[1, 9])
    assert [s["s"] for s in embedded_data(page)["steps"]] == [1]
