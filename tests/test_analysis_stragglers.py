"""commspan.analysis.stragglers and .bandwidth over synthetic span records with durations.

Collective durations are not recorded by the capture side yet (issue 11 item 1):
these tests build them; a test on real gloo ranks belongs with that work.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
from _analysis_builder import SpanBuilder

from commspan import semconv
from commspan.analysis import bandwidth, build_run, bus_factor, stragglers
from commspan.analysis.records import SpanTimes
from commspan.analysis.stragglers import analyze, step_breakdown, straggler_report
from commspan.render.findings import format_stragglers

WORLD = 4
MS = 1_000_000


def timed_run(durations: dict[tuple[int, str], list[int]], steps: int = 2,
              blocking: bool = True) -> SpanBuilder:
    """Every rank issues, each step, one all_reduce in each module of ``durations``;
    ``durations[(rank, fqn)][step]`` is its duration on that rank. ``blocking``: each
    rank's clock moves past a collective's end before the next is issued (else the
    collectives of a step are in flight together, 1 µs apart)."""
    b = SpanBuilder(WORLD)
    fqns = sorted({fqn for _, fqn in durations})
    for step in range(steps):
        for r in range(WORLD):
            s = b.rank(r, step)
            for fqn in fqns:
                s.coll("all_reduce", fqn=fqn, duration_ns=durations[(r, fqn)][step])
                if blocking:
                    s._tick(durations[(r, fqn)][step])
    return b


def test_last_rank_is_the_one_that_waited_least_and_its_wait_is_summed() -> None:
    """Rank 2 arrives last at Net.blocks.1's all_reduce in both steps (shortest duration);
    the wait it causes is the others' extra time, per step and module."""
    d: dict[tuple[int, str], list[int]] = {}
    for r in range(WORLD):
        d[(r, "Net.blocks.0")] = [5 * MS + r, 5 * MS + r]  # rank 0 last, a few ns
        d[(r, "Net.blocks.1")] = [(1 if r == 2 else 30 + r) * MS, (1 if r == 2 else 40) * MS]
    rows, ranks, checked = straggler_report(build_run(timed_run(d).spans()))
    assert checked == {"collectives": 4, "with_wait": 4, "without_duration": 0,
                       "inconsistent": 0, "incomplete": 0, "point_to_point": 0, "rooted": 0,
                       "late_wait": 0, "late_last": 0}
    top = rows[0]
    assert (top.step, top.fqn, top.phase, top.rank) == (1, "Net.blocks.1", "forward", 2)
    assert top.wait_ns == 3 * (40 - 1) * MS and top.max_wait_ns == 39 * MS
    assert (top.times_last, top.collectives, top.groups) == (1, 1, ("0",))
    step0 = next(r for r in rows if r.step == 0 and r.fqn == "Net.blocks.1")
    assert step0.rank == 2
    assert step0.wait_ns == sum((30 + r - 1) * MS for r in (0, 1, 3))
    small = [r for r in rows if r.fqn == "Net.blocks.0"]
    assert {r.rank for r in small} == {0} and all(r.wait_ns == 1 + 2 + 3 for r in small)
    assert ranks[0].rank == 2 and ranks[0].times_last == 2
    assert ranks[0].wait_ns == top.wait_ns + step0.wait_ns


def test_ties_cause_no_wait_and_missing_durations_are_counted() -> None:
    """Equal durations name no straggler; a collective without duration on one rank is
    left out and counted."""
    d = {(r, "Net.a"): [2 * MS, 2 * MS] for r in range(WORLD)}
    d.update({(r, "Net.b"): [MS, MS] for r in range(WORLD)})
    b = timed_run(d)
    for r in range(WORLD):
        b.rank(r, 2).coll("all_reduce", fqn="Net.c", duration_ns=None if r == 1 else MS)
    rows, ranks, checked = straggler_report(build_run(b.spans()))
    assert rows == [] and ranks == []
    assert checked["collectives"] == 4 and checked["with_wait"] == 0
    assert checked["without_duration"] == 1  # one collective (on four ranks)


def test_steps_whose_ranks_disagree_are_left_out() -> None:
    """A (group, step) where one rank issued an extra collective is not matched."""
    d = {(r, "Net.a"): [MS * (r + 1)] * 2 for r in range(WORLD)}
    b = timed_run(d)
    b.rank(0, 2).coll("all_reduce", fqn="Net.a", duration_ns=MS)
    b.rank(0, 2).coll("all_reduce", fqn="Net.a", duration_ns=MS)
    for r in range(1, WORLD):
        b.rank(r, 2).coll("all_reduce", fqn="Net.a", duration_ns=MS)
    _, _, checked = straggler_report(build_run(b.spans()))
    # the collectives of step 2: two on rank 0, one on the others
    assert checked["collectives"] == 2 and checked["inconsistent"] == 2


def test_a_group_member_without_a_record_names_no_straggler() -> None:
    """Rank 1 arrived last at Net.b (the others waited 300 ms), and its file is lost or
    the rank sample left it out: of ranks 0, 2, 3 the one with the shortest duration is
    not the straggler, so the collective is left out and counted, and the text says
    why nothing is named."""
    d = {(r, "Net.b"): [(1 if r == 1 else 300 + r) * MS] * 2 for r in range(WORLD)}
    run = build_run(timed_run(d).spans(ranks=[0, 2, 3]))
    rows, ranks, checked = straggler_report(run)
    assert rows == [] and ranks == []
    assert checked["collectives"] == 0 and checked["incomplete"] == 2
    text = format_stragglers(analyze(run))
    assert "may be a rank with no record" in text
    # with rank 1's record, it is named
    rows, _, _ = straggler_report(build_run(timed_run(d).spans()))
    assert {r.rank for r in rows} == {1}


def test_step_breakdown_counts_each_instant_once_for_the_innermost_span() -> None:
    """Rank span 0-100; forward Net 10-50 holding Net.a 20-30; backward Net 50-90 holding
    a recompute 60-70: forward 40, backward 30, recompute 10, outside 20."""
    b = SpanBuilder(1)
    s = b.rank(0, 0)
    fwd = s.module("Net", "forward", start=10, end=50)
    s.module("Net.a", "forward", start=20, end=30, parent=fwd)
    bwd = s.module("Net", "backward", start=50, end=90)
    s.module("Net.a", "recompute", start=60, end=70, parent=bwd)
    s.set_times(0, 100)
    (t,) = step_breakdown(build_run(b.spans()))
    assert (t.rank, t.step, t.total_ns) == (0, 0, 100)
    assert (t.forward_ns, t.backward_ns, t.recompute_ns, t.outside_ns) == (40, 30, 10, 20)
    assert t.forward_ns + t.backward_ns + t.recompute_ns + t.outside_ns == t.total_ns
    assert t.collectives_ns is None


def test_module_spans_folded_a_rank_at_a_time_give_the_same_step_times() -> None:
    """Run.span_times (the module spans folded a rank at a time, as the digests' reader
    keeps them for stragglers) gives each of two ranks the times of the nesting test
    above, worked out by hand (rank 1's forward Net ends at 51: forward 41, backward
    29), with the ranks folded apart and each parent before its children."""
    b = SpanBuilder(2)
    for r in range(2):
        s = b.rank(r, 0)
        fwd = s.module("Net", "forward", start=10, end=50 + r)
        s.module("Net.a", "forward", start=20, end=30, parent=fwd)
        bwd = s.module("Net", "backward", start=50 + r, end=90)
        s.module("Net.a", "recompute", start=60, end=70, parent=bwd)
        s.set_times(0, 100)
    run = build_run(b.spans())
    spans, run.module_spans = run.module_spans, []
    assert len(spans) == 8
    run.span_times = SpanTimes()
    for r in (1, 0):
        run.span_times.add([m for m in sorted(spans, key=lambda m: m.start_ns) if m.rank == r])
    times = {t.rank: t for t in step_breakdown(run)}
    for r in range(2):
        t = times[r]
        assert (t.forward_ns, t.backward_ns, t.recompute_ns, t.outside_ns) == (
            40 + r, 30 - r, 10, 20)


def test_a_step_number_used_again_adds_up_its_uses() -> None:
    """Two epochs number their steps 0, 1, 0, 1: a used-again number shares the trace
    (docs/design.md), and the step-time view adds its uses up. Step 0's rank spans
    are 0-100 (forward 10-50) and 1000-1200 (forward 1010-1110): total 300, forward
    140, outside 160. (The second rank span used to replace the first: total 200 with
    forward 140.)"""
    b = SpanBuilder(1)
    for epoch, (start, fwd, end) in enumerate([(0, (10, 50), 100), (1000, (1010, 1110), 1200)]):
        s = b.rank(0, 0)
        s.module("Net", "forward", start=fwd[0], end=fwd[1])
        s.set_times(start, end)
        other = b.rank(0, 1)
        other.set_times(500 + 1000 * epoch, 600 + 1000 * epoch)
    times = {t.step: t for t in step_breakdown(build_run(b.spans()))}
    assert sorted(times) == [0, 1]
    t = times[0]
    assert (t.total_ns, t.forward_ns, t.outside_ns) == (300, 140, 160)
    assert t.forward_ns + t.backward_ns + t.recompute_ns + t.outside_ns == t.total_ns
    assert times[1].total_ns == 200


def test_step_breakdown_sums_collective_durations() -> None:
    """collectives_ns is the sum of the rank's collective durations in the step."""
    d = {(r, fqn): [MS * (r + 1), 2 * MS] for r in range(WORLD) for fqn in ("Net.a", "Net.b")}
    times = step_breakdown(build_run(timed_run(d).spans()))
    assert len(times) == WORLD * 2
    for t in times:
        expected = 2 * MS * (t.rank + 1) if t.step == 0 else 4 * MS
        assert t.collectives_ns == expected


def test_stragglers_reads_files_and_serialises(tmp_path: Path) -> None:
    """stragglers(paths) raises clear errors on bad paths; to_dict has the documented keys."""
    with pytest.raises(FileNotFoundError, match="missing"):
        stragglers(tmp_path / "missing")
    d = {(r, "Net.a"): [MS * (4 - r)] * 2 for r in range(WORLD)}
    result = analyze(build_run(timed_run(d).spans()))
    doc = json.loads(json.dumps(result.to_dict()))
    assert set(doc) == {"stragglers", "ranks", "step_times", "checked"}
    assert doc["stragglers"][0]["rank"] == 3 and doc["stragglers"][0]["fqn"] == "Net.a"
    assert {"step", "fqn", "phase", "rank", "times_last", "wait_ns"} <= set(doc["stragglers"][0])
    text = format_stragglers(result)
    assert "Net.a" in text and "rank 3 last 2 times" in text


def test_garbage_collection_before_a_late_arrival_is_charged_to_it() -> None:
    """Rank 2 runs a full collection of 7 ms between its first and second all_reduce of
    step 1 and arrives last at the second: that row's gc_ns is the 7 ms (the pause lies
    wholly between the two issues), the first row's is 0; a pause before the step's first
    collective counts for that one; step times and rank totals carry every pause."""
    b = SpanBuilder(WORLD)
    pauses: dict[tuple[int, int], list[int]] = {}
    for step in range(2):
        for r in range(WORLD):
            s = b.rank(r, step)
            if (step, r) == (0, 1):
                start, end = s.gc(3 * MS, generation=1, fqn="Net.a")
                pauses.setdefault((step, r), []).append(end - start)
            last_a = r == 1 and step == 0
            s.coll("all_reduce", fqn="Net.a", duration_ns=(1 if last_a else 9) * MS)
            if (step, r) == (1, 2):
                start, end = s.gc(7 * MS, fqn="Net.b")
                pauses.setdefault((step, r), []).append(end - start)
            last_b = r == 2 and step == 1
            s.coll("all_reduce", fqn="Net.b", duration_ns=(1 if last_b else 9) * MS)
    run = build_run(b.spans())
    assert [(g.rank, g.step, g.generation, g.fqn, g.duration_ns) for g in run.gc_pauses] == [
        (1, 0, 1, "Net.a", 3 * MS), (2, 1, 2, "Net.b", 7 * MS)]
    result = analyze(run)
    late_b = next(r for r in result.stragglers if (r.step, r.fqn) == (1, "Net.b"))
    assert late_b.rank == 2 and late_b.gc_ns == sum(pauses[(1, 2)])
    late_a = next(r for r in result.stragglers if (r.step, r.fqn) == (0, "Net.a"))
    assert late_a.rank == 1 and late_a.gc_ns == sum(pauses[(0, 1)])  # since the step began
    others = [r for r in result.stragglers if (r.step, r.fqn) not in ((1, "Net.b"), (0, "Net.a"))]
    assert all(r.gc_ns == 0 for r in others)
    for t in result.step_times:
        assert t.gc_ns == sum(pauses.get((t.step, t.rank), [])), t
    by_rank = {w.rank: w.gc_ns for w in result.ranks}
    assert by_rank[2] == 7 * MS and by_rank[1] == 3 * MS
    text = format_stragglers(result)
    assert "gc before" in text and "7.00 ms in garbage collection" in text
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["stragglers"][0]["gc_ns"] in (0, 3 * MS, 7 * MS)
    assert {"gc_ns"} <= set(doc["step_times"][0]) and {"gc_ns"} <= set(doc["ranks"][0])


def test_without_durations_the_text_says_timing_is_needed() -> None:
    """No durations: no rows, and the text names the attribute that is missing."""
    b = SpanBuilder(2)
    for r in range(2):
        b.rank(r, 0).coll("all_reduce", ranks=(0, 1))
    result = analyze(build_run(b.spans()))
    assert result.stragglers == [] and result.checked["without_duration"] == 1
    assert semconv.COLL_DURATION_NS in format_stragglers(result)


def test_point_to_point_only_the_text_says_so_not_timing() -> None:
    """A pipeline's timed sends and receives are not matched: the text says that,
    and does not blame missing timing."""
    b = SpanBuilder(2)
    b.rank(0, 0).coll("send", kind=semconv.KIND_P2P, peer=1, reduce_op=None,
                      duration_ns=MS)
    b.rank(1, 0).coll("recv", kind=semconv.KIND_P2P, peer=0, reduce_op=None,
                      duration_ns=2 * MS)
    result = analyze(build_run(b.spans()))
    assert result.stragglers == []
    assert result.checked["point_to_point"] == 2 and result.checked["without_duration"] == 0
    text = format_stragglers(result)
    assert "point-to-point" in text and "timing" not in text


@pytest.mark.parametrize("op", ["broadcast", "scatter", "gather", "reduce"])
def test_collectives_with_a_root_name_no_straggler(op: str) -> None:
    """A gather's root waits for every rank and the others for nobody (a broadcast's
    ranks wait for whom the backend's algorithm says): the shortest duration is not
    the last arrival. Rank 3 arrived last at the all_reduce of the same step and is
    named there; the rooted op is counted once and names nobody."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        # the durations of a gather whose rank 3 was late: the root waited, the rest not
        b.rank(r, 0).coll(op, fqn="Net.a", duration_ns=(300 if r == 0 else 1 + r) * MS)
        b.rank(r, 0).coll("all_reduce", fqn="Net.b", duration_ns=(1 if r == 3 else 300) * MS)
    result = analyze(build_run(b.spans()))
    assert [(row.fqn, row.rank) for row in result.stragglers] == [("Net.b", 3)]
    assert result.checked["rooted"] == 1 and result.checked["collectives"] == 1
    only = SpanBuilder(WORLD)
    for r in range(WORLD):
        only.rank(r, 0).coll(op, fqn="Net.a", duration_ns=(1 + r) * MS)
    text = format_stragglers(analyze(build_run(only.spans())))
    assert "with a root" in text and "timing" not in text


def test_a_rank_that_waited_late_names_no_straggler_there() -> None:
    """Functional all_reduce in Net.tp: ranks 0, 1, 3 wait for it at once (their wait
    is their duration, ~10 ms); rank 2 works 300 ms before waiting, and waits 1 ms. Its
    duration holds its work: rank 1 (the shortest) is not the last arrival, and no
    wait is charged there. Had rank 2 been the shortest (step 1), it did arrive last:
    its duration (work included) is below everyone's; the others' durations less its
    own are then a lower bound of the wait it caused (counted in late_last)."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        if r == 2:
            b.rank(r, 0).coll(fqn="Net.tp", duration_ns=300 * MS, wait_ns=MS)
            b.rank(r, 1).coll(fqn="Net.tp", duration_ns=MS, wait_ns=MS // 100)
        else:
            d = (10 + r) * MS
            b.rank(r, 0).coll(fqn="Net.tp", duration_ns=d, wait_ns=d)
            b.rank(r, 1).coll(fqn="Net.tp", duration_ns=50 * MS, wait_ns=50 * MS)
    result = analyze(build_run(b.spans()))
    assert result.checked["late_wait"] == 1 and result.checked["collectives"] == 1
    assert result.checked["late_last"] == 1
    assert [(row.step, row.rank) for row in result.stragglers] == [(1, 2)]
    assert result.stragglers[0].wait_ns == 3 * 49 * MS


# ------------------------------------------------------------------ bandwidth
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_bus_factors_follow_nccl_tests(n: int) -> None:
    """2(n-1)/n for all_reduce, (n-1)/n for gather/scatter/all-to-all families, 1 else."""
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert bus_factor(op, n) == pytest.approx((n - 1) / n)
    for op in ("broadcast", "reduce", "send", "recv"):
        assert bus_factor(op, n) == 1.0


def test_bandwidth_uses_the_whole_operation_size() -> None:
    """all_gather's size is the gathered output; 1 GB in 1 s is 1 GB/s; no duration: None."""
    gb = 10**9
    assert bandwidth("all_reduce", nbytes=gb, duration_ns=10**9, group_size=8) == (
        pytest.approx(1.0), pytest.approx(1.75))
    ag = bandwidth("all_gather_into_tensor", nbytes=gb // 4, duration_ns=10**9, group_size=4)
    assert ag is not None and ag.algbw == pytest.approx(1.0) and ag.busbw == pytest.approx(0.75)
    assert bandwidth("all_reduce", nbytes=gb, duration_ns=0, group_size=2) is None
    with pytest.raises(ValueError, match="group_size"):
        bus_factor("all_reduce", 0)


def test_a_pause_is_charged_once_to_collectives_issued_at_the_same_instant() -> None:
    """Rank 1 issues two collectives (two groups) at the same recorded instant after a
    4 ms pause, late at both: the pause is charged once, not twice."""
    import dataclasses

    b = SpanBuilder(2)
    for r in range(2):
        s = b.rank(r, 0)
        if r == 1:
            s.gc(4 * MS)
        s.coll("all_reduce", fqn="Net.a", group="g1", ranks=(0, 1),
               duration_ns=(1 if r == 1 else 9) * MS)
        s.coll("all_reduce", fqn="Net.a", group="g2", ranks=(0, 1),
               duration_ns=(1 if r == 1 else 9) * MS)
    spans = []
    for rec in b.spans():
        if rec.events and rec.attributes.get(semconv.MODULE_FQN) == "Net.a":
            rec = dataclasses.replace(rec, event_times=[rec.event_times[0]] * len(rec.events))
        spans.append(rec)
    (row,) = [r for r in analyze(build_run(spans)).stragglers if r.rank == 1]
    assert row.times_last == 2 and row.gc_ns == 4 * MS


def test_a_step_whose_ranks_issued_another_dtype_is_left_out() -> None:
    """One rank all-reduces bfloat16 where the others all-reduce float32 (check reports a
    mismatch there): that group and step are not ranked, as when the ops differ."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        b.rank(r, 0).coll(fqn="Net.a", duration_ns=(1 if r == 3 else 300) * MS,
                          dtype="bfloat16" if r == 1 else "float32")
        b.rank(r, 1).coll(fqn="Net.a", duration_ns=(1 if r == 3 else 300) * MS)
    result = analyze(build_run(b.spans()))
    assert [(row.step, row.rank) for row in result.stragglers] == [(1, 3)]
    assert result.checked["inconsistent"] == 1


def test_an_all_to_all_with_uneven_splits_is_ranked() -> None:
    """Uneven all_to_all splits give each rank another input shape (check finds no
    mismatch there): the collective is matched, and its late rank named."""
    b = SpanBuilder(WORLD)
    for step in range(2):
        for r in range(WORLD):
            b.rank(r, step).coll("all_to_all_single", fqn="Net.moe", shape=(3 + r, 8),
                                 reduce_op=None, duration_ns=(1 if r == 2 else 50) * MS)
    result = analyze(build_run(b.spans()))
    assert result.checked["inconsistent"] == 0
    assert [(row.step, row.fqn, row.rank) for row in result.stragglers] == [
        (0, "Net.moe", 2), (1, "Net.moe", 2)]


def test_rows_are_per_owner_not_per_issuing_module() -> None:
    """FSDP2 prefetches unit Net.blocks.0's all-gather from Net.blocks.1's backward, and
    runs the root's reduce-scatter from a final callback outside modules: the rows name
    the unit each collective is counted in (its owner), as summary does."""
    b = SpanBuilder(WORLD)
    for step in range(2):
        for r in range(WORLD):
            s = b.rank(r, step)
            s.coll("all_gather_into_tensor", fqn="Net.blocks.1", phase="backward",
                   owner="Net.blocks.0", reduce_op=None, duration_ns=(1 if r == 3 else 20) * MS)
            s.coll("reduce_scatter_tensor", fqn="Global", phase="backward", owner="Net",
                   duration_ns=(1 if r == 0 else 30) * MS)
    rows = analyze(build_run(b.spans())).stragglers
    assert sorted({(row.fqn, row.phase, row.rank) for row in rows}) == [
        ("Net", "backward", 0), ("Net.blocks.0", "backward", 3)]


def test_a_collective_only_one_rank_recorded_is_counted_incomplete() -> None:
    """Reading one rank's file (or the only file left): its collectives are counted
    incomplete, and the text says why nothing is named, not that rooted ops are."""
    d = {(r, "Net.a"): [MS * (r + 1)] * 2 for r in range(WORLD)}
    b = timed_run(d)
    for r in range(WORLD):
        b.rank(r, 0).coll("broadcast", fqn="Net.a", duration_ns=MS)
    result = analyze(build_run(b.spans(ranks=[0])))
    assert result.checked["incomplete"] == 2 and result.checked["rooted"] == 1
    assert "may be a rank with no record" in format_stragglers(result)


def test_time_outside_steps_is_not_a_step_of_the_mean() -> None:
    """A rank spends time in the mode before its first step (model set-up, DDP's
    construction: a trace without a step number) and then runs 2 steps: the per-rank
    means are over the 2 steps, not 3."""
    from commspan.analysis.stragglers import totals_by_rank

    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        b.rank(r, None).coll(fqn="Net.setup", duration_ns=MS)
        for step in (0, 1):
            b.rank(r, step).coll(fqn="Net.a", duration_ns=MS)
    result = analyze(build_run(b.spans()))
    assert {t.step for t in result.step_times} == {None, 0, 1}
    totals = totals_by_rank(result.step_times)
    assert {slot["steps"] for slot in totals.values()} == {2}


def test_a_late_rank_that_also_waits_late_is_charged_a_lower_bound() -> None:
    """Functional all_reduce in Net.a (as in FSDP2 prefetch, async TP): rank 2 issues it
    100 ms after the others, then works 60 ms before its wait_tensor (duration 63 ms,
    wait 0.7 ms); ranks 0, 1, 3 wait at once and are blocked ~105 ms (their wait_ns,
    which holds the transfer too). Rank 2 is last and caused ~100 ms per waiting rank;
    without clock alignment that is only known to lie between duration - 63 ms (~43
    ms: its work after issuing makes its duration too long) and the others' wait_ns
    (~105 ms). The lower bound is charged, and the collective counted in late_last,
    which the text says. The reviewer's case (r12): a rank 1 ms late whose work
    overlaps a 50 ms transfer (duration 50, wait 1; the others 51, wait 31) caused
    ~1 ms per rank, within [1, 31]; it was charged 31. When the last rank waits at
    once, a rank that worked before its wait is charged only the time it was blocked."""
    b = SpanBuilder(WORLD)
    for step in range(2):
        for r in range(WORLD):
            if r == 2:
                b.rank(r, step).coll(fqn="Net.a", duration_ns=63 * MS, wait_ns=7 * MS // 10)
            else:
                d = 105 * MS + r * MS // 2
                b.rank(r, step).coll(fqn="Net.a", duration_ns=d + MS, wait_ns=d)
    result = analyze(build_run(b.spans()))
    assert result.checked["late_wait"] == 0 and result.checked["collectives"] == 2
    assert result.checked["late_last"] == 2
    (row, _) = result.stragglers
    assert (row.fqn, row.rank) == ("Net.a", 2)
    assert row.max_wait_ns == 43 * MS + 3 * MS // 2
    assert row.wait_ns == sum(43 * MS + r * MS // 2 for r in (0, 1, 3))
    assert "2 whose last rank waited late (their waits are lower bounds" in \
        format_stragglers(result)
    # r12: barely late, its work overlapping the transfer
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        d, w = (50 * MS, MS) if r == 2 else (51 * MS, 31 * MS)
        b.rank(r, 0).coll(fqn="Net.a", duration_ns=d, wait_ns=w)
    result = analyze(build_run(b.spans()))
    (row,) = result.stragglers
    assert (row.rank, row.wait_ns, result.checked["late_last"]) == (2, 3 * MS, 1)
    # rank 2 waits at once (its duration exact, 5 ms); rank 0 worked 40 of its 105 ms
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        d, w = (5 * MS, 5 * MS) if r == 2 else (105 * MS, 65 * MS if r == 0 else 100 * MS)
        b.rank(r, 0).coll(fqn="Net.a", duration_ns=d, wait_ns=w)
    (row,) = analyze(build_run(b.spans())).stragglers
    assert row.rank == 2 and row.wait_ns == (65 + 2 * 100) * MS


def test_the_checked_line_counts_collectives_waited_late() -> None:
    """The text's checked line names the functional collectives waited late when
    there are some (50 matched of 51 per rank did not add up), and not otherwise."""
    from commspan.analysis.stragglers import StragglerResult

    checked = {"collectives": 50, "with_wait": 50, "without_duration": 0, "inconsistent": 0}
    text = format_stragglers(StragglerResult([], [], [], {**checked, "late_wait": 1}))
    assert text.splitlines()[-1] == (
        "checked: 50 collectives matched, 50 with a wait, 0 without duration, 1 waited late "
        "(functional, not matched), 0 in steps whose ranks disagree (see commspan check)")
    text = format_stragglers(StragglerResult([], [], [], {**checked, "late_wait": 0}))
    assert "waited late" not in text


def test_ranks_that_number_their_steps_apart_are_not_matched_by_position() -> None:
    """Rank 0 numbers its steps 1-3, the others 0-2: the trace of step 1 holds rank
    0's first all_reduce (seq 1) and the others' second (seq 2), not one collective.
    Those steps are left out as inconsistent (``commspan check`` reports the missing
    steps); they used to be matched by position, and durations of different
    collectives named a straggler."""
    b = SpanBuilder(WORLD)
    for step in range(3):
        for r in range(WORLD):
            b.rank(r, step + 1 if r == 0 else step).coll(
                "all_reduce", fqn="Net.a", duration_ns=(1 if r == 2 else 30) * MS)
    rows, _, checked = straggler_report(build_run(b.spans()))
    assert {row.step for row in rows} <= {0}  # step 0: ranks 1-3, one collective
    assert checked["inconsistent"] == 2


def _otlp_value(v: object) -> dict[str, object]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_otlp_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _write_otlp(out: Path, spans: list) -> None:  # type: ignore[type-arg]
    """The builder's span records as OTLP/JSON lines, one file per rank."""
    out.mkdir()
    for rank in sorted({s.rank for s in spans}):
        lines = []
        for s in (s for s in spans if s.rank == rank):
            span = {
                "traceId": s.trace_id, "spanId": s.span_id, "parentSpanId": s.parent_span_id,
                "name": s.name, "startTimeUnixNano": str(s.start_time),
                "endTimeUnixNano": str(s.end_time),
                "attributes": [{"key": k, "value": _otlp_value(v)}
                               for k, v in s.attributes.items()],
                "events": [{"name": n, "timeUnixNano": str(t),
                            "attributes": [{"key": k, "value": _otlp_value(v)}
                                           for k, v in a.items()]}
                           for (n, a), t in zip(s.events, s.event_times)],
            }
            resource = {"attributes": [{"key": k, "value": _otlp_value(v)}
                                       for k, v in s.resource.items()]}
            lines.append(json.dumps({"resourceSpans": [
                {"resource": resource, "scopeSpans": [{"spans": [span]}]}]}))
        (out / f"commspan-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_wait_passed_on_from_the_step_before_is_seen_with_a_step_selected(
        tmp_path: Path) -> None:
    """2 x 2 mesh (tp groups (0, 1), (2, 3); dp groups (0, 2), (1, 3)): each step a dp
    all_reduce, then a tp all_reduce (a gradient norm, say) at which rank 3 waits 200 ms
    for rank 2; so, from the next step on, rank 3 (and rank 2) come late to their dp
    all_reduce. Rank 3's wait at step 2's dp was passed on (it had waited that long at
    tp since the dp ranks last met, in step 1): the same with --step 2 as over every
    step (the selection left step 1's waits out: nothing passed on, rank 3 tied with
    rank 2 again)."""
    tp = {0: ("tp0", (0, 1)), 1: ("tp0", (0, 1)), 2: ("tp1", (2, 3)), 3: ("tp1", (2, 3))}
    dp = {0: ("dp0", (0, 2)), 2: ("dp0", (0, 2)), 1: ("dp1", (1, 3)), 3: ("dp1", (1, 3))}
    b = SpanBuilder(WORLD)
    for step in range(3):
        for r in range(WORLD):
            s = b.rank(r, step)
            late = step > 0 and r in (2, 3)  # the others wait ~200 ms at dp for them
            g, members = dp[r]
            s.coll("all_reduce", fqn="Net.dp", group=g, ranks=members,
                   duration_ns=MS if late or step == 0 else 201 * MS)
            g, members = tp[r]
            s.coll("all_reduce", fqn="Net.tp", group=g, ranks=members,
                   duration_ns=200 * MS if r == 3 else MS)
    _write_otlp(tmp_path / "run", b.spans())

    def dp_rows(result: object) -> dict[int, tuple[int, int]]:
        return {r.rank: (r.wait_ns, r.passed_on_ns)
                for r in result.stragglers  # type: ignore[attr-defined]
                if r.step == 2 and r.fqn == "Net.dp"}

    whole = dp_rows(stragglers(tmp_path / "run"))
    # the reference: rank 3 waited 200 ms at tp before step 2's dp, rank 2 did not
    assert whole == {2: (200 * MS, 0), 3: (200 * MS, 199 * MS)}
    assert dp_rows(stragglers(tmp_path / "run", steps=[2])) == whole
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "commspan", "stragglers", "--json",
                          "--step", "2", str(tmp_path / "run")],
                         capture_output=True, text=True, check=True).stdout
    rows = {r["rank"]: (r["wait_ns"], r["passed_on_ns"])
            for r in json.loads(out)["stragglers"] if r["fqn"] == "Net.dp"}
    assert rows == whole
    ranks = [w["rank"] for w in json.loads(out)["ranks"]]
    assert ranks[0] == 2, ranks  # the slow rank first, its tp peer after it


def test_the_text_of_a_large_run_shows_top_ranks_and_the_median() -> None:
    """30 ranks, each step a rank span of (100 + rank) ms and an all_reduce in each of
    11 modules; in module k < 10 rank 5 + k arrives last (1 ms against 9 + rank ms
    for the others), in the eleventh rank 5 again: ranks 5-14 are last, rank 5 most,
    then the others by the wait they caused (rank 6 the most: the others' durations
    are longer the higher their rank). With ``top=3`` the per rank line names ranks
    5, 6, 7 and says how many more, and the step-time table shows those 3 and a
    median row of every rank's mean total (the median of 100-129 ms). With the
    default ``top`` (20) it shows the 10 ranks of the per rank line, then the 10
    longest steps (ranks 20-29), in rank order, and the median."""
    world = 30
    b = SpanBuilder(world)
    for step in range(2):
        for r in range(world):
            s = b.rank(r, step)
            for k in range(11):
                late = r == 5 + k % 10 if k < 10 else r == 5
                s.coll("all_reduce", fqn=f"Net.m{k}", ranks=tuple(range(world)),
                       duration_ns=(1 if late else 9 + r) * MS)
            s.set_times(step * 1000 * MS, step * 1000 * MS + (100 + r) * MS)
    result = analyze(build_run(b.spans()))
    assert [w.rank for w in result.ranks] == list(range(5, 15))

    def table(text: str) -> list[list[str]]:
        body = text.split("Step time per rank", 1)[1].splitlines()[2:]
        return [line.split() for line in body
                if line.split() and not line.startswith(("...", "checked"))]

    text = format_stragglers(result, top=3)
    assert "last/of = the row's collectives it arrived last at / those matched" in (
        text.splitlines()[0])
    per_rank = next(line for line in text.splitlines() if line.startswith("per rank: "))
    assert [int(n) for n in re.findall(r"(?:^per rank: |; )rank (\d+)", per_rank)] == [5, 6, 7]
    assert per_rank.endswith("; ... 7 more ranks (--top N shows more, --json lists all)")
    rows = table(text)
    assert [row[0] for row in rows] == ["5", "6", "7", "median"]
    assert [row[2] for row in rows] == ["105.00", "106.00", "107.00",
                                        f"{statistics.median(100 + r for r in range(30)):.2f}"]
    assert f"... {world - 3} more ranks (--top N shows more, --json lists all)" in text
    rows = table(format_stragglers(result))
    assert [row[0] for row in rows] == [*map(str, range(5, 15)), *map(str, range(20, 30)),
                                        "median"]
    # each step 11 collectives of (9 + rank) ms, 1 ms where the rank is late
    comm = [sum(1 if r == (5 + k % 10 if k < 10 else 5) else 9 + r for k in range(11))
            for r in range(world)]
    median = re.split(r"\s{2,}", text.split("\nmedian", 1)[1].splitlines()[0].strip())
    assert median[6] == f"{statistics.median(comm):.2f} ms", median  # (steps, 5 times, comm)
    small = analyze(build_run(timed_run(
        {(r, "Net.a"): [MS * (4 - r)] * 2 for r in range(WORLD)}).spans()))
    assert "median" not in format_stragglers(small, top=4)  # (every rank shown)
    assert "more ranks" not in format_stragglers(small, top=4)


def test_the_median_of_collective_time_leaves_out_ranks_not_timed() -> None:
    """Ranks 0-9 of 12 recorded no collective duration (timing off), ranks 10 and 11
    spent 4 and 6 ms: the median row's collectives column is 5.00 (their median), not
    the 0 of the ten untimed ranks; its total column is every rank's median."""
    world = 12
    b = SpanBuilder(world)
    for r in range(world):
        s = b.rank(r, 0)
        s.coll("all_reduce", fqn="Net.a", ranks=tuple(range(world)),
               duration_ns={10: 4 * MS, 11: 6 * MS}.get(r))
        s.set_times(0, (100 + r) * MS)
    result = analyze(build_run(b.spans()))
    assert sorted(t.rank for t in result.step_times if t.collectives_ns is not None) == [10, 11]
    text = format_stragglers(result, top=2)
    median = re.split(r"\s{2,}", text.split("\nmedian", 1)[1].splitlines()[0].strip())
    assert median[1] == f"{statistics.median(100 + r for r in range(world)):.2f} ms"
    assert median[6] == "5.00 ms", median


def test_collectives_in_flight_together_count_a_ranks_wait_once() -> None:
    """DDP's buckets: two all_reduces issued back to back (1 µs apart here) and waited
    together; rank 3 arrives last at both, 79 ms after the others. Each row (one per
    module) holds its collective's wait, 3 x 79 ms; rank 3's total is the time the other
    ranks spent waiting for it, 3 x 79 ms once, not twice (it said 468 ms for 240 ms of
    waiting in a review's 4-rank DDP run)."""
    d: dict[tuple[int, str], list[int]] = {}
    for r in range(WORLD):
        for fqn in ("DDP.module.l0", "DDP.module.l1"):
            d[(r, fqn)] = [1 * MS if r == 3 else 80 * MS]
    rows, ranks, _ = straggler_report(build_run(timed_run(d, steps=1, blocking=False).spans()))
    assert sorted((row.fqn, row.rank, row.wait_ns) for row in rows) == [
        ("DDP.module.l0", 3, 3 * 79 * MS), ("DDP.module.l1", 3, 3 * 79 * MS)]
    (late,) = ranks
    assert late.rank == 3 and late.times_last == 2
    # once each, and the microsecond between the two issues
    assert 3 * 79 * MS <= late.wait_ns <= 3 * (79 * MS + 10_000), late.wait_ns
    assert late.passed_on_ns <= late.wait_ns
