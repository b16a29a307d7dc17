"""commspan.analysis.timeline: steps, module slices and collectives of a real 4-rank run."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
from _example_run import RANKS, example_run

from commspan import semconv
from commspan.analysis.timeline import (
    assign_lanes,
    build_timeline,
    load_records,
    match_collectives,
)
from commspan.exporters import read_spans

STEPS = 3


def _nest_or_disjoint(a: tuple[int, int], b: tuple[int, int]) -> bool:
    (s1, e1), (s2, e2) = a, b
    return e1 <= s2 or e2 <= s1 or (s1 <= s2 and e2 <= e1) or (s2 <= s1 and e1 <= e2)


def _check_lanes(intervals: list[tuple[int, int]], placed: list[tuple[int, int]]) -> None:
    """Every two intervals of a lane nest or are disjoint, and depth counts the enclosing ones."""
    for i, (iv, (lane, depth)) in enumerate(zip(intervals, placed)):
        same = [j for j, (lane2, _) in enumerate(placed) if lane2 == lane and j != i]
        for j in same:
            assert _nest_or_disjoint(iv, intervals[j]), (iv, intervals[j], lane)
        enclosing = [
            j for j in same
            if intervals[j][0] <= iv[0] and iv[1] <= intervals[j][1]
            and intervals[j][1] > iv[0]  # touching at the start is not enclosing
            and (intervals[j] != iv or j < i)
        ]
        assert depth <= len(enclosing)


def test_assign_lanes_keeps_nested_intervals_on_one_lane() -> None:
    """Intervals that already nest stay on lane 0, at their nesting depth."""
    intervals = [(0, 100), (10, 40), (12, 20), (50, 90), (90, 100), (100, 120)]
    assert assign_lanes(intervals) == [(0, 0), (0, 1), (0, 2), (0, 1), (0, 1), (0, 0)]


def test_assign_lanes_moves_partial_overlaps_to_new_lanes() -> None:
    """An interval overlapping another partially goes to the next lane where it nests."""
    placed = assign_lanes([(0, 10), (5, 15), (6, 8), (12, 20)])
    assert placed == [(0, 0), (1, 0), (0, 1), (0, 0)]


def test_assign_lanes_random_intervals_always_nest_per_lane() -> None:
    """On random intervals, every lane holds only nested or disjoint intervals."""
    rng = random.Random(7)
    for _ in range(200):
        intervals = []
        for _ in range(rng.randint(1, 25)):
            start = rng.randint(0, 50)
            intervals.append((start, start + rng.choice([0, 0, 1, 3, 10, 30])))
        _check_lanes(intervals, assign_lanes(intervals))


def test_assign_lanes_rejects_reversed_interval() -> None:
    """An interval ending before it starts is a ValueError naming it."""
    with pytest.raises(ValueError, match=r"intervals\[1\] = \(5, 3\)"):
        assign_lanes([(0, 1), (5, 3)])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return example_run(tmp_path_factory, STEPS)


@pytest.mark.multiprocess
def test_build_timeline_on_a_real_run(run_dir: Path) -> None:
    """Steps, ranks, module spans and collectives of the example's files all come out."""
    records = load_records(run_dir)
    timeline = build_timeline(records)
    assert timeline.ranks == tuple(range(RANKS))
    assert [w.step for w in timeline.steps] == list(range(STEPS))
    assert [w.label for w in timeline.steps] == [f"step {i}" for i in range(STEPS)]
    assert len(timeline.run_ids) == 1
    for w in timeline.steps:
        assert [r for r, _, _ in w.ranks] == list(range(RANKS))
        assert w.start_ns == min(s for _, s, _ in w.ranks)
        assert w.end_ns == max(e for _, _, e in w.ranks)
    modules = [
        r for r in records if semconv.MODULE_FQN in r.attributes and r.name != semconv.SPAN_RANK
    ]
    assert len(timeline.slices) == len(modules)
    events = sum(
        1 for r in records for _, ev in r.events if semconv.COLL_OP in ev
    )
    assert len(timeline.collectives) == events > 0
    # every collective was issued inside a span of its module on its rank, in its step
    spans = {(s.rank, s.fqn, s.window): [] for s in timeline.slices}
    for s in timeline.slices:
        spans[(s.rank, s.fqn, s.window)].append((s.start_ns, s.end_ns))
    for c in timeline.collectives:
        if c.fqn == semconv.GLOBAL_FQN:
            continue
        assert any(a <= c.time_ns <= b for a, b in spans[(c.rank, c.fqn, c.window)]), c
    # one rank's module spans nest: a single lane
    for rank in timeline.ranks:
        mine = [(s.start_ns, s.end_ns) for s in timeline.slices if s.rank == rank]
        assert {lane for lane, _ in assign_lanes(mine)} == {0}
    assert timeline.processes[0][1] is not None  # the rank's pid is known


@pytest.mark.multiprocess
def test_match_collectives_pairs_every_rank_once(run_dir: Path) -> None:
    """Each (run, group, seq) holds one collective per rank, same op, ordered by issue time."""
    timeline = build_timeline(load_records(run_dir))
    matched = match_collectives(timeline.collectives)
    assert len(matched) * RANKS == len(timeline.collectives)
    for members in matched.values():
        assert sorted(c.rank for c in members) == list(range(RANKS))
        assert len({(c.op, c.fqn, c.phase, c.bytes) for c in members}) == 1
        times = [c.time_ns for c in members]
        assert times == sorted(times)


@pytest.mark.multiprocess
def test_step_comes_from_rank_spans_even_without_rank_span(run_dir: Path) -> None:
    """A rank whose rank span is missing (it died mid-step) still gets its spans' step."""
    records = load_records(run_dir)
    lost = [r for r in records if not (r.name == semconv.SPAN_RANK and r.rank == 1)]
    timeline = build_timeline(lost)
    assert [w.step for w in timeline.steps] == list(range(STEPS))
    assert all(1 in [r for r, _, _ in w.ranks] for w in timeline.steps)
    whole = build_timeline(records)
    assert len(timeline.slices) == len(whole.slices)


@pytest.mark.multiprocess
def test_two_runs_in_one_folder_are_labelled_apart(run_dir: Path) -> None:
    """Records of two runs get steps labelled with their run id, not merged."""
    records = list(read_spans(*sorted(run_dir.glob("*.jsonl"))))
    other = [
        dataclasses.replace(
            r,
            trace_id=f"{int(r.trace_id, 16) ^ (1 << 127):032x}",  # another trace
            resource={**r.resource, semconv.RUN_ID: "otherrun"},
            start_time=r.start_time + 10**12,
            end_time=r.end_time + 10**12,
        )
        for r in records
    ]
    timeline = build_timeline(records + other)
    assert len(timeline.steps) == 2 * STEPS
    assert timeline.run_ids[1] == "otherrun"
    assert timeline.steps[-1].label == f"run otherrun step {STEPS - 1}"


def test_load_records_errors_name_the_path(tmp_path: Path) -> None:
    """A missing path, an empty directory and a wrong item are clear errors."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="holds no"):
        load_records(tmp_path)
    with pytest.raises(TypeError, match="source item 3"):
        load_records([3])  # type: ignore[list-item]


@pytest.mark.parametrize("schema", [2, 3])
def test_match_collectives_joins_a_send_with_its_receive(schema: int) -> None:
    """Rank 0 sends to rank 1 twice per step, then every rank all_reduces: each send is
    matched with the receive of the same number per peer, and each all_reduce with
    the others'. Files of schema 2, whose sends shared the group's counter, match no
    point-to-point op (their numbers meant other ops on the peer)."""
    from _analysis_builder import SpanBuilder

    b = SpanBuilder(world=3, schema=schema)
    for step in range(2):
        for r in range(3):
            s = b.rank(r, step)
            for _ in range(2):
                if r == 0:
                    s.coll("send", fqn="Net.pipe", kind=semconv.KIND_P2P, peer=1)
                elif r == 1:
                    s.coll("recv", fqn="Net.pipe", kind=semconv.KIND_P2P, peer=0)
            if r in (1, 2):  # from any source: no pair, whatever their numbers
                s.coll("recv", fqn="Net.any", kind=semconv.KIND_P2P)
            s.coll("all_reduce", fqn="Net.sync")
    records = b.spans()
    timeline = build_timeline(records)
    matched = match_collectives(timeline.collectives)
    ops = sorted(tuple(sorted((c.rank, c.op) for c in m)) for m in matched.values())
    # the HTML report links the same way: (group, seq) keys of the embedded data
    from _report_dom import embedded_data

    from commspan.render.html import html_report

    data = embedded_data(html_report(records))
    strings = data["strings"]
    linked: dict[tuple[str, int], set[tuple[int, str]]] = {}
    for step in data["steps"]:
        for rank, _, _, _, _, colls in step["r"]:
            for k in range(0, len(colls), 9):
                op, group, seq = strings[colls[k]], strings[colls[k + 3]], colls[k + 4]
                if seq >= 0:
                    linked.setdefault((f"{step['s']} {group}", seq), set()).add((rank, op))
    if schema == 2:  # (the all_reduces of ranks 0 and 1 are numbered after the sends)
        assert not any(op in ("send", "recv") for m in ops for _, op in m)
        assert not any(op in ("send", "recv") for m in linked.values() for _, op in m)
        return
    reduces = [((0, "all_reduce"), (1, "all_reduce"), (2, "all_reduce"))] * 2
    pairs = [((0, "send"), (1, "recv"))] * 4
    assert ops == sorted(reduces + pairs)
    assert sorted(tuple(sorted(m)) for m in linked.values()) == sorted(reduces + pairs)


def test_a_collective_completed_in_a_span_never_written_is_drawn() -> None:
    """Rank 1 completes its all_reduce in Net.blocks.1 in step 2, then stalls inside
    Net.blocks.1 (never written); the other ranks wrote theirs and wait in Net.blocks.2.
    Each hang record lists the rank's whole history: the timeline of step 2 holds on
    each rank exactly what it issued there (rank 1's Net.blocks.1 one marked
    unwritten, not pending), matched across the 4 ranks, and no collective of an
    earlier step twice."""
    from _analysis_builder import WORLD_GROUP, SpanBuilder

    b = SpanBuilder(world=4, schema=3)
    history: dict[int, list[tuple[int, str, int]]] = {r: [] for r in range(4)}  # seq, fqn, t
    issued: dict[tuple[int, int], list[int]] = {}  # (rank, step) -> seqs, by hand
    for step in (0, 1, 2):
        for r in range(4):
            s = b.rank(r, step, finished=step < 2)
            blocks = ("Net.blocks.0",) if (r, step) == (1, 2) else (
                "Net.blocks.0", "Net.blocks.1")
            for fqn in blocks:
                seq = s.coll("all_reduce", fqn=fqn)
                history[r].append((seq, fqn, b.clock[r]))
                issued.setdefault((r, step), []).append(seq)
    b.seq[(1, WORLD_GROUP)] += 1  # rank 1's Net.blocks.1 all_reduce, its span never written
    b.clock[1] += 1000
    history[1].append((b.seq[(1, WORLD_GROUP)], "Net.blocks.1", b.clock[1]))
    issued[(1, 2)].append(b.seq[(1, WORLD_GROUP)])
    for r in range(4):
        events = [b.event_attrs("all_reduce", fqn=fqn, phase="forward", group=WORLD_GROUP,
                                ranks=range(4), seq=seq, state=semconv.STATE_COMPLETED)
                  for seq, fqn, _ in history[r]]
        times = [t for _, _, t in history[r]]
        stack = [("Net", "forward"), ("Net.blocks.1", "forward")]
        if r != 1:  # waiting in Net.blocks.2's
            seq = history[r][-1][0] + 1
            events.append(b.event_attrs("all_reduce", fqn="Net.blocks.2", phase="forward",
                                        group=WORLD_GROUP, ranks=range(4), seq=seq,
                                        state=semconv.STATE_ISSUED))
            times.append(b.clock[r] + 1000)
            issued[(r, 2)].append(seq)
            stack = [("Net", "forward"), ("Net.blocks.2", "forward")]
        b.hang(r, 2, stack=stack, collectives=events, times=times)
    timeline = build_timeline(b.spans())
    for w in timeline.steps:
        for r in range(4):
            drawn = [c.seq for c in timeline.collectives if c.window == w.position and c.rank == r]
            assert drawn == issued[(r, w.step)], (w.step, r)
    (unwritten,) = [c for c in timeline.collectives if c.unwritten and not c.pending]
    assert (unwritten.rank, unwritten.fqn, unwritten.seq) == (1, "Net.blocks.1", issued[(1, 2)][-1])
    matched = match_collectives(timeline.collectives)
    assert sorted(c.rank for c in matched[unwritten.key]) == [0, 1, 2, 3]
    # drawn, not counted: the report's issued table of Net.blocks.1 holds the spans' own
    from commspan.render.html import html_report

    page = html_report(b.spans())
    block = page.split('data-fqn="Net.blocks.1">', 1)[1].split("</details>", 1)[0]
    in_spans = [sum(fqn == "Net.blocks.1" for _, fqn, _ in history[r]) for r in range(4)]
    in_spans[1] -= 1  # the one in the span never written
    assert re.search(r'<td class="count"><span class="n[^"]*"[^>]*>([^<]*)</span>',
                     block).group(1) == " \u00b7 ".join(map(str, in_spans))


def test_a_hang_records_stuck_collective_is_drawn_in_its_step() -> None:
    """Ranks 0, 2, 3 wait in an all_reduce inside a span never written; their hang
    records list it as not completed: the timeline has it in the step the hang cut
    short, once per rank, pending, and matched across those ranks by group and seq
    (so a hang finding's link outlines it); completed ones the records also list are
    not drawn twice."""
    from _analysis_builder import WORLD_GROUP, SpanBuilder

    b = SpanBuilder(world=4, schema=3)
    for step in (0, 1):
        for r in range(4):
            s = b.rank(r, step, finished=step == 0)
            s.coll("all_reduce", fqn="Net.blocks.0")
    for r in (0, 2, 3):
        done = b.event_attrs("all_reduce", fqn="Net.blocks.0", phase="forward",
                             group=WORLD_GROUP, ranks=range(4), seq=2,
                             state=semconv.STATE_COMPLETED)
        stuck = b.event_attrs("all_reduce", fqn="Net.blocks.1", phase="forward",
                              group=WORLD_GROUP, ranks=range(4), seq=3,
                              state=semconv.STATE_ISSUED)
        for _ in range(2):  # a timeout record, then a signal's: the collective once
            b.hang(r, 1, stack=[("Net", "forward"), ("Net.blocks.1", "forward")],
                   collectives=[done, stuck])
    timeline = build_timeline(b.spans())
    step1 = [w.position for w in timeline.steps if w.step == 1]
    assert step1
    pending = [c for c in timeline.collectives if c.pending]
    assert sorted(c.rank for c in pending) == [0, 2, 3]
    assert all((c.window, c.fqn, c.seq, c.duration_ns) == (step1[0], "Net.blocks.1", 3, None)
               for c in pending)
    in_step1 = [c for c in timeline.collectives if c.window == step1[0]]
    assert sorted((c.rank, c.seq) for c in in_step1) == [
        (0, 2), (0, 3), (1, 2), (2, 2), (2, 3), (3, 2), (3, 3)]
    matched = match_collectives(timeline.collectives)
    assert sorted(c.rank for c in matched[(pending[0].run_id, step1[0], WORLD_GROUP, 3)]) == [
        0, 2, 3]
    for c in pending:  # drawn inside its step's extent on its rank
        part = {r: (s, e) for r, s, e in timeline.steps[c.window].ranks}[c.rank]
        assert part[0] <= c.time_ns <= part[1]
