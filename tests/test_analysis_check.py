"""commspan.analysis.check: cross-rank mismatches, missing ranks and hangs.

Unit tests run over synthetic span records (tests/_analysis_builder.py); the
multi-process tests at the end run divergent programs on 4 real gloo ranks
(tests/_mp_check_scenarios.py) and check what ``check_run`` says about their
JSONL files against what the programs did.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _analysis_builder import WORLD_GROUP, SpanBuilder, trace_of
from _spawn import run_ranks

from commspan import semconv
from commspan.analysis import build_run, check, check_run
from commspan.analysis.check import KIND_HANG, KIND_MISMATCH, KIND_MISSING, CheckResult
from commspan.exporters import read_spans
from commspan.render.findings import format_check

WORLD = 4
SUBGROUP = "1"
SUB_RANKS = (2, 3)

Op = dict[str, Any]


def program(rank: int) -> list[Op]:
    """One step of the synthetic program on ``rank``: collectives on the world group,
    a send/recv ring on it, and an all_reduce on a subgroup of ranks 2 and 3."""
    ops: list[Op] = [
        {"op": "all_reduce", "fqn": "Net.blocks.0"},
        {"op": "send", "fqn": "Net.ring", "kind": semconv.KIND_P2P,
         "peer": (rank + 1) % WORLD},
        {"op": "recv", "fqn": "Net.ring", "kind": semconv.KIND_P2P,
         "peer": (rank - 1) % WORLD},
        {"op": "all_gather_into_tensor", "fqn": "Net.blocks.1", "shape": (4,),
         "reduce_op": None},
        {"op": "all_reduce", "fqn": "Net.blocks.2"},
    ]
    if rank in SUB_RANKS:
        ops.append({"op": "all_reduce", "fqn": "Net.head", "group": SUBGROUP,
                    "ranks": SUB_RANKS, "shape": (8,)})
    ops.append({"op": "reduce_scatter_tensor", "fqn": "Net.blocks.1", "phase": "backward"})
    return ops


PER_STEP = 6
"""Ops of the world group per step and rank (collectives and p2p share the counter)."""
COLLECTIVES_PER_STEP = 4 * WORLD + len(SUB_RANKS)
"""Non-p2p collectives compared per step over all ranks."""

Edit = Callable[[int, int, list[Op]], "list[Op] | None"]


def build(steps: int = 3, edit: Edit | None = None, world: int = WORLD) -> SpanBuilder:
    """The program run for ``steps`` steps; ``edit(rank, step, ops)`` may change a rank's
    ops for a step, or return ``None`` for a step the rank did not trace."""
    b = SpanBuilder(world)
    for step in range(steps):
        for r in range(world):
            ops = program(r)
            if edit is not None:
                edited = edit(r, step, ops)
                if edited is None:
                    continue
                ops = edited
            s = b.rank(r, step)
            for o in ops:
                s.coll(**o)
    return b


def run_check(b: SpanBuilder, **kwargs: Any) -> CheckResult:
    return check(build_run(b.spans(**kwargs)))


# ------------------------------------------------------------------ consistent
def test_consistent_program_has_no_findings() -> None:
    """Identical programs on every rank: no finding, and the counts say what was compared."""
    result = run_check(build(steps=3))
    assert result.ok, [f.message for f in result.findings]
    assert result.checked["ranks"] == WORLD
    assert result.checked["groups"] == 2
    assert result.checked["steps"] == 3
    assert result.checked["collectives"] == 3 * COLLECTIVES_PER_STEP
    assert result.checked["p2p"] == 3 * 2 * WORLD
    assert format_check(result).startswith("consistent: checked 4 ranks, 2 groups, 3 steps")
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc == {"findings": [], "checked": result.checked}


# ------------------------------------------------------------------ mismatches
def test_extra_all_reduce_on_one_rank_is_reported_where_it_was_issued() -> None:
    """Rank 2 issues an extra all_reduce in Net.blocks.1 in step 1: one mismatch at its seq,
    with every rank's op and module; step 2 (seqs shifted on rank 2) is not a cascade."""

    def extra(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 2 and step == 1:
            ops.insert(3, {"op": "all_reduce", "fqn": "Net.blocks.1"})
        return ops

    result = run_check(build(steps=3, edit=extra))
    assert len(result.findings) == 1
    f = result.findings[0]
    seq = PER_STEP * 1 + 4  # step 1, the 4th op of the world group
    assert (f.kind, f.group, f.step, f.seq) == (KIND_MISMATCH, WORLD_GROUP, 1, seq)
    assert f.details["fields"] == ["op", "shape"]
    assert f.details["later_steps"] == []
    assert f.ranks[2] == {"op": "all_reduce", "fqn": "Net.blocks.1", "phase": "forward",
                          "seq": seq, "shape": [16]}
    for r in (0, 1, 3):
        assert f.ranks[r] == {"op": "all_gather_into_tensor", "fqn": "Net.blocks.1",
                              "phase": "forward", "seq": seq, "shape": [4]}
    assert f.message == (
        f"group 0 (ranks 0-3), step 1, seq {seq}: op, shape differ: ranks 0, 1, 3 issued "
        "all_gather_into_tensor [4] in `Net.blocks.1` forward; rank 2 issued all_reduce [16] "
        "in `Net.blocks.1` forward"
    )
def test_traces_outside_steps_are_counted_apart_from_the_steps() -> None:
    """A set-up (or checkpoint) collective outside every step, then 3 steps: `checked`
    counts 3 steps and 1 trace outside steps (it said '4 steps' while `summary` says
    'steps: 0-2'), and the text line says both."""
    b = build(steps=3)
    for r in range(WORLD):
        b.rank(r, None).coll(**program(r)[0])
    result = run_check(b)
    assert result.ok, [f.message for f in result.findings]
    assert (result.checked["steps"], result.checked["outside_steps"]) == (3, 1)
    assert format_check(result).startswith(
        "consistent: checked 4 ranks, 2 groups, 3 steps (and 1 trace outside steps), ")




def test_extra_collective_at_the_end_of_a_step_is_a_count_mismatch() -> None:
    """An extra all_reduce after the step's last collective: the other ranks issued nothing
    there, and their entry says what they issued last."""

    def extra(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 0 and step == 0:
            ops.append({"op": "all_reduce", "fqn": "Net.loss", "phase": "backward"})
        return ops

    (f,) = run_check(build(steps=2, edit=extra)).findings
    assert (f.kind, f.step, f.seq) == (KIND_MISMATCH, 0, PER_STEP + 1)
    assert f.details["fields"] == ["count"]
    assert f.ranks[0]["fqn"] == "Net.loss" and f.ranks[0]["phase"] == "backward"
    last = {"op": "reduce_scatter_tensor", "fqn": "Net.blocks.1", "phase": "backward",
            "seq": PER_STEP}
    for r in (1, 2, 3):
        assert f.ranks[r] == {"op": None, "fqn": None, "phase": None, "seq": None,
                              "last_seen": last}
    assert "ranks 1-3 issued nothing more in the step" in f.message


def test_a_count_mismatch_names_the_module_that_issued_one_more() -> None:
    """Rank 1 issues one all_reduce more in `Net.a`, the first of three modules that each
    all-reduce the same tensor. Matched by position, the sequences part only at the end
    of the step (`Net.c`'s); by construction the extra one is `Net.a`'s, and the
    finding says so: the module and phase whose counts differ, with each rank's."""
    b = SpanBuilder(world=2)
    for step in range(2):
        for r in range(2):
            s = b.rank(r, step)
            for fqn in ("Net.a", "Net.b", "Net.c"):
                s.coll("all_reduce", fqn=fqn)
                if (r, step, fqn) == (1, 0, "Net.a"):
                    s.coll("all_reduce", fqn=fqn)
    (f,) = run_check(b).findings
    assert (f.kind, f.step, f.details["fields"]) == (KIND_MISMATCH, 0, ["count"])
    assert f.details["count_by_module"] == [
        {"fqn": "Net.a", "phase": "forward", "counts": {0: 1, 1: 2}}]
    assert f.message == (
        "group 0 (ranks 0, 1), step 0, seq 4: count differs: rank 0 issued nothing more "
        "in the step; rank 1 issued all_reduce in `Net.c` forward; the counts differ in "
        "`Net.a` forward (rank 0: 1, rank 1: 2)")
    # the JSON form's keys are strings (orjson, which the HTML report embeds findings
    # with, refuses int keys)
    assert f.to_dict()["count_by_module"] == [
        {"fqn": "Net.a", "phase": "forward", "counts": {"0": 1, "1": 2}}]


def test_count_mismatch_entry_of_the_issuing_rank_is_plain_data() -> None:
    """In a count mismatch the rank that issued the extra collective is described by that
    collective alone (a "count" is no field of it): the finding's JSON form serialises."""

    def extra(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 0 and step == 0:
            ops.append({"op": "all_reduce", "fqn": "Net.loss", "phase": "backward"})
        return ops

    result = run_check(build(steps=2, edit=extra))
    (f,) = result.findings
    assert f.ranks[0] == {"op": "all_reduce", "fqn": "Net.loss", "phase": "backward",
                          "seq": PER_STEP + 1}
    assert json.loads(json.dumps(result.to_dict()))["findings"][0]["ranks"]["0"]["op"] == (
        "all_reduce")
    assert "count <built-in" not in format_check(result)


@pytest.mark.parametrize(
    ("field", "change", "expected"),
    [
        ("shape", {"shape": (2, 8)}, ([16], [2, 8])),
        ("dtype", {"dtype": "int32"}, ("float32", "int32")),
        ("reduce_op", {"reduce_op": "max"}, ("sum", "max")),
    ],
)
def test_one_rank_with_another_field_is_reported_with_the_values(
    field: str, change: dict[str, Any], expected: tuple[Any, Any]
) -> None:
    """Rank 1's Net.blocks.2 all_reduce has another shape / dtype / reduce op in step 2:
    the finding names that field and each rank's value."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 1 and step == 2:
            ops[4] = {**ops[4], **change}
        return ops

    (f,) = run_check(build(steps=3, edit=other)).findings
    seq = PER_STEP * 2 + 5
    assert (f.kind, f.group, f.step, f.seq) == (KIND_MISMATCH, WORLD_GROUP, 2, seq)
    assert f.details["fields"] == [field]
    assert f.ranks[1][field] == expected[1]
    assert all(f.ranks[r][field] == expected[0] for r in (0, 2, 3))
    assert all(f.ranks[r]["fqn"] == "Net.blocks.2" for r in range(WORLD))
    assert f"{field} differ" in f.message and "rank 1 issued all_reduce" in f.message


def test_uneven_all_to_all_splits_are_not_a_mismatch_but_another_op_is() -> None:
    """Ranks of an all_to_all_single send uneven splits (MoE token routing): their input
    shapes differ and that is no divergence; its dtype still must agree."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_to_all_single", fqn="Net.moe", shape=(3 + r, 8), reduce_op=None)
        b.rank(r, 1).coll("all_to_all_single", fqn="Net.moe", shape=(3 + r, 8), reduce_op=None,
                          dtype="bfloat16" if r == 2 else "float32")
    (f,) = check(build_run(b.spans())).findings
    assert (f.kind, f.step, f.details["fields"]) == (KIND_MISMATCH, 1, ["dtype"])
    assert f.ranks[2]["dtype"] == "bfloat16"


def test_first_divergence_is_by_step_whatever_the_clocks_say() -> None:
    """Ranks 2 and 3 disagree on a subgroup's dtype in steps 1 and 2. Rank 0 traced
    only steps 0 and 2 and its clock is 10 s behind: step 2's earliest span is then
    its, before step 1's. The first divergence is still step 1's."""
    b = SpanBuilder(WORLD)
    b.clock[0] = 10**12 - 10**10
    for r in range(1, WORLD):
        b.clock[r] = 10**12
    for step in range(3):
        for r in range(WORLD):
            if r == 0 and step == 1:
                continue
            s = b.rank(r, step)
            s.coll("all_reduce", fqn="Net.a", group="g", ranks=(0, 1, 2, 3))
            if r >= 2:
                s.coll("all_reduce", fqn="Net.b", group="pair", ranks=(2, 3),
                       dtype="bfloat16" if (r == 3 and step) else "float32")
    pair = [f for f in check(build_run(b.spans())).findings if f.group == "pair"]
    assert [(f.step, f.details["later_steps"]) for f in pair] == [(1, [2])]


def test_divergence_in_every_step_is_one_finding_listing_later_steps() -> None:
    """The same divergence in steps 0, 1 and 2: the first is reported, the others listed."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 3:
            ops[0] = {**ops[0], "dtype": "bfloat16"}
        return ops

    (f,) = run_check(build(steps=3, edit=other)).findings
    assert (f.step, f.seq, f.details["later_steps"]) == (0, 1, [1, 2])


def test_subgroup_divergence_names_the_subgroup_and_its_ranks_only() -> None:
    """A mismatch on the subgroup of ranks 2 and 3 is reported for that group."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 3 and step == 1:
            ops[5] = {**ops[5], "shape": (4,)}
        return ops

    (f,) = run_check(build(steps=2, edit=other)).findings
    assert (f.group, f.seq, f.details["group_ranks"]) == (SUBGROUP, 2, [2, 3])
    assert sorted(f.ranks) == [2, 3]


def test_collectives_matched_by_position_not_by_seq() -> None:
    """Rank 0 issued its p2p ops of a step after the collectives (seqs differ from the
    others'), yet the collective sequences are the same: no finding."""

    def reorder(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 0:
            ops = [o for o in ops if o.get("kind") != semconv.KIND_P2P] + [
                o for o in ops if o.get("kind") == semconv.KIND_P2P
            ]
        return ops

    b = build(steps=2, edit=reorder)
    run = build_run(b.spans())
    seqs = {
        r: [c.seq for c in run.collectives if c.rank == r and c.fqn == "Net.blocks.1"][:1]
        for r in (0, 1)
    }
    assert seqs[0] != seqs[1]  # the sequence numbers really differ
    assert check(run).ok


# ------------------------------------------------------------------ point-to-point
def test_p2p_send_and_recv_with_other_shapes_is_a_mismatch() -> None:
    """Rank 1 receives rank 0's tensor into a buffer of another shape."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 1 and step == 0:
            ops[2] = {**ops[2], "shape": (4, 4)}
        return ops

    (f,) = run_check(build(steps=1, edit=other)).findings
    assert (f.kind, f.group, f.step) == (KIND_MISMATCH, WORLD_GROUP, 0)
    assert (f.details["src"], f.details["dst"], f.details["fields"]) == (0, 1, ["shape"])
    assert f.ranks[0]["op"] == "send" and f.ranks[0]["shape"] == [16]
    assert f.ranks[1]["op"] == "recv" and f.ranks[1]["shape"] == [4, 4]


def test_p2p_send_without_recv_is_reported() -> None:
    """Rank 2 sends to rank 3 but rank 3 does not receive: an unmatched send."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 3 and step == 1:
            ops = [o for o in ops if o["op"] != "recv"]
        return ops

    (f,) = run_check(build(steps=2, edit=other)).findings
    assert (f.details["src"], f.details["dst"], f.step) == (2, 3, 1)
    assert f.ranks[3]["op"] is None
    assert "has no matching recv" in f.message


def test_batched_p2p_is_counted_unchecked() -> None:
    """batch_p2p (a list of peers) is not matched, and the count says so."""
    b = SpanBuilder(2)
    for r in range(2):
        b.rank(r, 0).coll("batch_p2p", kind=semconv.KIND_P2P, peer=[1 - r, 1 - r],
                          ranks=(0, 1))
    result = run_check(b)
    assert result.ok and result.checked["p2p_unchecked"] == 2


@pytest.mark.parametrize("how", ["any source", "batched"])
def test_a_receive_of_unknown_peer_leaves_the_sends_into_it_unchecked(how: str) -> None:
    """Rank 2 receives rank 1's send with ``dist.recv(buf)`` (any source) or inside a
    ``batch_isend_irecv``: that send is not "without its receive" (it was reported
    in every step); the pair is counted unchecked in that step only."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 2 and step == 1:
            for o in ops:
                if o["op"] == "recv":
                    if how == "any source":
                        o["peer"] = None
                    else:
                        o["op"], o["peer"] = "batch_p2p", [1]
        return ops

    result = run_check(build(steps=2, edit=other))
    assert result.ok, [f.message for f in result.findings]
    assert result.checked["p2p_unchecked"] == 2  # rank 2's receive and rank 1's send
    both = run_check(build(steps=2))
    assert both.checked["p2p"] - result.checked["p2p"] == 2


# ------------------------------------------------------------------ missing
def test_rank_that_skipped_a_step_is_missing_from_it_without_a_cascade() -> None:
    """Rank 3 did not trace step 1 (its seqs in step 2 are then lower than the others'):
    one missing finding for step 1, nothing for step 2."""

    def skip(rank: int, step: int, ops: list[Op]) -> list[Op] | None:
        return None if (rank, step) == (3, 1) else ops

    (f,) = run_check(build(steps=3, edit=skip)).findings
    assert (f.kind, f.group, f.seq, f.step) == (KIND_MISSING, None, None, 1)
    assert f.details["steps"] == [1]
    assert f.ranks == {3: {"op": None, "fqn": None, "phase": None, "seq": None,
                           "last_step": 0}}
    assert f.message == "step 1: rank 3 wrote no span (ranks 0-2 did)"


def test_rank_without_a_file_is_missing_from_every_step() -> None:
    """World size 4, files of ranks 0-2 only: rank 3 is missing from steps 0-2."""
    (f,) = run_check(build(steps=3), ranks=[0, 1, 2]).findings
    assert f.kind == KIND_MISSING and f.details["steps"] == [0, 1, 2]
    assert list(f.ranks) == [3] and f.ranks[3]["last_step"] is None
    assert f.message == "steps 0-2: rank 3 wrote no span (ranks 0-2 did)"


def test_a_rank_a_sample_of_given_ranks_names_is_expected() -> None:
    """CommSpanMode(ranks=[0, 2]) and rank 2's file lost: rank 2 is missing from every
    step (it traced, and wrote nothing); ranks 1 and 3, left out, are not."""
    b = build(steps=2)
    b.resource_extra = {semconv.SAMPLING_RANKS: "ranks 0,2"}
    (f,) = run_check(b, ranks=[0]).findings
    assert f.kind == KIND_MISSING and f.details["steps"] == [0, 1]
    assert list(f.ranks) == [2]
    assert run_check(b, ranks=[0, 2]).ok
    b.resource_extra = {semconv.SAMPLING_RANKS: "fraction 0.5"}  # which ranks: unknown
    assert run_check(b, ranks=[0]).ok


@pytest.mark.parametrize("later", ["completed_with_it", "not_timed", "without_it"])
def test_a_rank_whose_file_ends_mid_step_while_the_others_went_on_with_it(later: str) -> None:
    """Rank 1's file ends inside step 2 (killed while its last lines were written:
    no rank span, nothing after), while ranks 0, 2, 3 went on to step 3 and completed
    an all_reduce there on the world group, rank 1 among its members: rank 1 did not
    stop in step 2, its records of step 3 are lost, and it is missing from step 3 (the
    run read "consistent", step 3 compared without it). Without that evidence (the
    collectives not timed, or on a group without rank 1) it may have stopped in step 2,
    and is not missing from the steps after (the hang findings' business)."""
    b = SpanBuilder(WORLD)
    for step in range(4):
        for r in range(WORLD):
            if r == 1 and step == 3:
                continue
            s = b.rank(r, step, finished=not (r == 1 and step == 2))
            if step < 3 or later == "completed_with_it":
                s.coll("all_reduce", fqn="Net.a", duration_ns=MS)
            elif later == "not_timed":
                s.coll("all_reduce", fqn="Net.a")
            elif r in SUB_RANKS:
                s.coll("all_reduce", fqn="Net.head", group=SUBGROUP, ranks=SUB_RANKS,
                       duration_ns=MS)
    result = run_check(b)
    assert result.checked["steps_interrupted"] == 1  # step 2: not compared
    if later != "completed_with_it":
        assert result.ok, [f.message for f in result.findings]
        return
    (f,) = result.findings
    assert f.kind == KIND_MISSING and f.details["steps"] == [3] and list(f.ranks) == [1]
    assert f.ranks[1]["last_step"] == 2
    assert f.message == "step 3: rank 1 wrote no span (ranks 0, 2, 3 did)"


def test_ranks_that_did_a_missing_ranks_steps_are_those_that_wrote_them() -> None:
    """Ranks 0 and 2 wrote nothing after step 1; rank 1's file ends inside step 2
    (stopped, no evidence otherwise); rank 3 went on to step 3: the finding for step 3
    says rank 3 did it (it said "ranks 1, 3 did", rank 1 having written nothing of
    it)."""
    b = SpanBuilder(WORLD)
    for step in range(4):
        for r in range(WORLD):
            if (r in (0, 2) and step >= 2) or (r == 1 and step == 3):
                continue
            b.rank(r, step, finished=not (r == 1 and step == 2)).coll(
                "all_reduce", fqn="Net.a")
    missing = [f for f in run_check(b).findings if f.kind == KIND_MISSING]
    assert [(f.details["steps"], sorted(f.ranks)) for f in missing] == [([3], [0, 2])]
    assert missing[0].message == "step 3: ranks 0, 2 wrote no span (rank 3 did)"


def test_a_world_size_beyond_any_job_is_ignored() -> None:
    """A damaged ``commspan.world_size`` (10**20 ran out of memory) is not a job: the
    check expects the ranks that wrote spans (it built range(world_size) and ran out of
    memory). An intValue beyond 64 bits (older files may hold one in a resource) is
    read as it is."""
    from commspan.analysis.records import MAX_WORLD_SIZE
    from commspan.otlpjson.decode import decode_value

    records = build(steps=1).spans()
    for rec in records:
        if rec.rank == 1:
            rec.resource[semconv.WORLD_SIZE] = MAX_WORLD_SIZE + 1
    result = check(build_run(records))
    assert result.ok and result.checked["ranks"] == WORLD
    assert decode_value({"intValue": str(2**100)}) == 2**100


def test_rank_that_issued_nothing_on_a_group_in_a_step_is_missing_from_the_group() -> None:
    """Rank 2 traced step 1 but issued nothing on the subgroup there; rank 3 did."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 2 and step == 1:
            ops = [o for o in ops if o.get("group") != SUBGROUP]
        return ops

    (f,) = run_check(build(steps=2, edit=other)).findings
    assert (f.kind, f.group, f.step, f.seq) == (KIND_MISSING, SUBGROUP, 1, 2)
    assert f.ranks[2]["op"] is None and f.ranks[2]["last_seen"]["seq"] == 1
    assert f.ranks[3] == {"op": "all_reduce", "fqn": "Net.head", "phase": "forward", "seq": 2}


def test_traces_outside_steps_on_one_rank_are_not_missing_elsewhere() -> None:
    """A session trace (no step) written by rank 0 alone is not a missing-rank finding."""
    b = build(steps=1)
    b.rank(0, None).module("Net", start=10**9, end=10**9 + 10)
    assert run_check(b).ok


# ------------------------------------------------------------------ hangs
def hang_scenario(rank1_record: bool) -> SpanBuilder:
    """Step 0 completes; in step 1 ranks 0, 2, 3 block in Net.blocks.2's all_reduce
    (world seq 11) and write hang records; rank 1 never issues it (it is in Net.blocks.1
    forward, writing a record on a signal, or writing none)."""
    b = build(steps=1)
    stuck_seq = PER_STEP + 5
    for r in range(WORLD):
        s = b.rank(r, 1, finished=False)
        for o in program(r)[:4]:  # up to Net.blocks.1's all_gather: exported spans
            s.coll(**o)
        recent = []
        for seq, o in zip(range(PER_STEP + 1, stuck_seq), program(r)[:4]):
            recent.append(b.event_attrs(
                o["op"], fqn=o["fqn"], phase="forward", group=WORLD_GROUP,
                ranks=range(WORLD), seq=seq, kind=o.get("kind", semconv.KIND_COLLECTIVE),
                state=semconv.STATE_COMPLETED,
            ))
        if r in SUB_RANKS:
            recent.append(b.event_attrs(
                "all_reduce", fqn="Net.head", phase="forward", group=SUBGROUP,
                ranks=SUB_RANKS, seq=1, state=semconv.STATE_COMPLETED,
            ))
        if r != 1:
            recent.append(b.event_attrs(
                "all_reduce", fqn="Net.blocks.2", phase="forward", group=WORLD_GROUP,
                ranks=range(WORLD), seq=stuck_seq, state=semconv.STATE_ISSUED,
            ))
            b.hang(r, 1, stack=[("Net", "forward"), ("Net.blocks.2", "forward")],
                   collectives=recent)
        elif rank1_record:
            b.hang(r, 1, stack=[("Net", "forward"), ("Net.blocks.1", "forward")],
                   collectives=recent, reason=semconv.HANG_REASON_SIGNAL)
    return b


def test_hang_names_group_seq_the_missing_rank_and_each_ranks_module() -> None:
    """Ranks 0, 2, 3 wait in Net.blocks.2's all_reduce; rank 1 never issued it and was
    last seen in Net.blocks.1: one hang finding; step 0 is checked and clean."""
    result = run_check(hang_scenario(rank1_record=True))
    (f,) = result.findings
    seq = PER_STEP + 5
    assert (f.kind, f.group, f.seq, f.step) == (KIND_HANG, WORLD_GROUP, seq, 1)
    assert f.message == (
        f"group 0 (ranks 0-3), seq {seq}: ranks 0, 2, 3 are in `Net.blocks.2` forward "
        "all_reduce; rank 1 never issued it and was last seen in `Net.blocks.1` forward"
    )
    assert f.details["never_issued"] == [1]
    for r in (0, 2, 3):
        assert f.ranks[r]["op"] == "all_reduce" and f.ranks[r]["fqn"] == "Net.blocks.2"
        assert f.ranks[r]["state"] == semconv.STATE_ISSUED and f.ranks[r]["waited_ns"] > 0
        assert f.ranks[r]["stack"] == ["Net forward", "Net.blocks.2 forward"]
    assert f.ranks[1]["op"] is None and f.ranks[1]["state"] == "not issued"
    assert (f.ranks[1]["fqn"], f.ranks[1]["phase"]) == ("Net.blocks.1", "forward")
    assert (f.ranks[1]["last_seq"], f.ranks[1]["hang_record"]) == (seq - 1, "signal")
    assert result.checked["steps_interrupted"] == 1
    assert result.checked["steps"] == 1 and result.checked["hang_records"] == 4
    assert result.checked["collectives"] == COLLECTIVES_PER_STEP


def test_hang_with_a_rank_the_sample_left_out_does_not_blame_it() -> None:
    """ranks=0,1,2: rank 3 traced nothing. Rank 1 never issued the collective (its
    hang record says so); of rank 3 nothing is known, which the finding says."""
    b = hang_scenario(rank1_record=True)
    b._spans = [(r, s) for r, s in b._spans if r != 3]
    b.resource_extra = {semconv.SAMPLING_RANKS: "ranks 0,1,2"}
    (f,) = run_check(b).findings
    assert f.kind == KIND_HANG
    assert f.details["never_issued"] == [1] and f.details["not_traced"] == [3]
    assert f.ranks[3]["state"] == "not traced"
    assert "rank 3 is not traced (ranks 0,1,2): unknown" in f.message
    assert "rank 1 never issued it" in f.message
    # rank 3 in the sample: it traced, so writing nothing means it stopped (whether
    # it issued the collective is unknown: no record)
    b.resource_extra = {semconv.SAMPLING_RANKS: "ranks 0,1,2,3"}
    hang, missing = sorted(run_check(b).findings, key=lambda f: f.kind)
    assert hang.details["not_traced"] == [] and hang.details["wrote_nothing"] == [3]
    assert hang.details["never_issued"] == [1] and hang.ranks[3]["state"] == "no record"
    assert missing.kind == KIND_MISSING and list(missing.ranks) == [3]


def test_hang_without_a_record_from_the_missing_rank_uses_its_last_collective() -> None:
    """Rank 1 wrote no hang record (it died): it is described by its last exported
    collective."""
    (f,) = run_check(hang_scenario(rank1_record=False)).findings
    assert f.kind == KIND_HANG and f.details["never_issued"] == [1]
    assert f.ranks[1]["hang_record"] is None
    assert f.ranks[1]["fqn"] == "Net.blocks.1"
    assert ("rank 1 wrote no record of it and no hang record (stopped, or stuck outside "
            "collectives?); its last exported collective was "
            "all_gather_into_tensor in `Net.blocks.1` forward") in f.message


def test_dump_with_every_collective_completed_is_not_a_hang() -> None:
    """A record written by mode.dump() with nothing pending finds nothing."""
    b = build(steps=1)
    done = b.event_attrs("all_reduce", fqn="Net.blocks.2", phase="forward",
                         group=WORLD_GROUP, ranks=range(WORLD), seq=5,
                         state=semconv.STATE_COMPLETED)
    b.hang(0, 0, stack=[], collectives=[done], reason=semconv.HANG_REASON_DUMP)
    result = run_check(b)
    assert result.ok and result.checked["hang_records"] == 1
    assert result.checked["steps_interrupted"] == 0  # every rank span of step 0 exists


@pytest.mark.parametrize("known_by", ["another_rank", "a_later_collective"])
def test_a_record_of_a_slow_collective_that_completed_is_no_hang(known_by: str) -> None:
    """Rank 2 is late at step 1's all_reduce (seq 2), waited after its module closed
    (a functional collective): ranks 0, 1, 3 write timeout records listing it issued,
    and the spans flushed with them carry no duration for it. It completed: rank 2's
    span says so, or (its file lost) each rank completed the next collective on the
    group. No hang. A collective a record lists failed is kept."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_reduce", fqn="Net.m", duration_ns=MS)
        s = b.rank(r, 1)
        s.coll("all_reduce", fqn="Net.m", duration_ns=MS if r == 2 else None)
        s.coll("all_reduce", fqn="Net.n",
               duration_ns=MS if known_by == "a_later_collective" else None)
    slow = {r: b.event_attrs("all_reduce", fqn="Net.m", phase="forward", group=WORLD_GROUP,
                             ranks=range(WORLD), seq=2, state=semconv.STATE_ISSUED)
            for r in (0, 1, 3)}
    for r, attrs in slow.items():
        b.hang(r, 1, stack=[("Net", "forward")], collectives=[attrs])
    spans = b.spans(ranks=[0, 1, 3]) if known_by == "a_later_collective" else b.spans()
    result = check(build_run(spans))
    assert [f for f in result.findings if f.kind == KIND_HANG] == []
    # the same records, the collective failed on rank 0: reported
    failed = dict(slow[0], **{semconv.COLL_STATE: semconv.STATE_FAILED})
    b.hang(0, 1, stack=[("Net", "forward")], collectives=[failed],
           time_ns=b.clock[0] + 20_000_000)
    spans = b.spans(ranks=[0, 1, 3]) if known_by == "a_later_collective" else b.spans()
    (f,) = [f for f in check(build_run(spans)).findings if f.kind == KIND_HANG]
    assert (f.seq, f.ranks[0]["state"]) == (2, semconv.STATE_FAILED)


def _p2p_then_all_reduce(stall_in_step_1: int) -> SpanBuilder:
    """Schema 3. Each step rank 0 sends to rank 1 in Net.pipe (ranks 2 and 3 do no
    send/recv), then every rank all_reduces in Net.sync. In step 1, rank
    ``stall_in_step_1`` stalls in Net.compute before the all_reduce; the others block
    in it and write hang records."""
    b = SpanBuilder(schema=3)
    stalled = stall_in_step_1
    for step in (0, 1):
        for r in range(WORLD):
            s = b.rank(r, step, finished=step == 0)
            if r == 0:
                s.coll("send", fqn="Net.pipe", kind=semconv.KIND_P2P, peer=1)
            elif r == 1:
                s.coll("recv", fqn="Net.pipe", kind=semconv.KIND_P2P, peer=0)
            if step == 0:
                s.coll("all_reduce", fqn="Net.sync")
    for r in range(WORLD):
        recent = [b.event_attrs("all_reduce", fqn="Net.sync", phase="forward",
                                group=WORLD_GROUP, ranks=range(WORLD), seq=1,
                                state=semconv.STATE_COMPLETED)]
        if r == stalled:
            b.hang(r, 1, stack=[("Net", "forward"), ("Net.compute", "forward")],
                   collectives=recent, reason=semconv.HANG_REASON_SIGNAL)
            continue
        recent.append(b.event_attrs("all_reduce", fqn="Net.sync", phase="forward",
                                    group=WORLD_GROUP, ranks=range(WORLD), seq=2,
                                    state=semconv.STATE_ISSUED))
        b.hang(r, 1, stack=[("Net", "forward"), ("Net.sync", "forward")], collectives=recent)
    return b


def test_hang_on_a_group_that_also_carries_send_and_recv_aligns_the_collectives() -> None:
    """Ranks 0 and 1 send/recv on the world group, 2 and 3 do not: the all_reduce every
    rank but 3 waits in is the group's second collective on each rank (its p2p ops are
    numbered per peer), so all three are named in it. With one counter for both, seq 3
    was rank 0's and 1's second send/recv and 2's nothing: ranks 0 and 1 were said to
    have completed it."""
    result = run_check(_p2p_then_all_reduce(stall_in_step_1=3))
    (f,) = result.findings
    assert (f.kind, f.group, f.seq, f.step) == (KIND_HANG, WORLD_GROUP, 2, 1)
    assert f.message == (
        "group 0 (ranks 0-3), seq 2: ranks 0-2 are in `Net.sync` forward all_reduce; "
        "rank 3 never issued it and was last seen in `Net.compute` forward")
    assert f.details["never_issued"] == [3]


def test_hang_message_agrees_in_number() -> None:
    """Two ranks that never issued the collective 'were' last seen somewhere."""
    b = _p2p_then_all_reduce(stall_in_step_1=3)
    b._spans = [(r, s) for r, s in b._spans
                if not (r == 2 and s.name == semconv.SPAN_HANG)]
    b.hang(2, 1, stack=[("Net", "forward"), ("Net.compute", "forward")],
           collectives=[], reason=semconv.HANG_REASON_SIGNAL)
    (f,) = run_check(b).findings
    assert f.message.endswith(
        "ranks 2, 3 never issued it and were last seen in `Net.compute` forward")


def _chain(stalled: int, record: bool) -> SpanBuilder:
    """Schema 3. A pipeline of 4 stages: rank r receives from r - 1, then sends to r + 1,
    in Net.stage. Step 0 completes; in step 1 rank ``stalled`` stalls before its receive
    (writing a hang record on a signal if ``record``): rank ``stalled - 1`` blocks in its
    send to it and rank ``stalled + 1`` in its receive from it."""
    b = SpanBuilder(schema=3)
    for step in (0, 1):
        for r in range(WORLD):
            s = b.rank(r, step, finished=step == 0)
            if step == 1 and r >= stalled - 1:
                if r == stalled - 1 and r > 0:  # its receive completed
                    s.coll("recv", fqn="Net.stage", kind=semconv.KIND_P2P, peer=r - 1)
                continue
            if r > 0:
                s.coll("recv", fqn="Net.stage", kind=semconv.KIND_P2P, peer=r - 1)
            if r < WORLD - 1:
                s.coll("send", fqn="Net.stage", kind=semconv.KIND_P2P, peer=r + 1)

    def p2p(op: str, peer: int, state: str) -> dict[str, Any]:
        return b.event_attrs(op, fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                             ranks=range(WORLD), seq=None, p2p_seq=2,
                             kind=semconv.KIND_P2P, peer=peer, state=state)

    stack = [("Net", "forward"), ("Net.stage", "forward")]
    b.hang(stalled - 1, 1, stack=stack,
           collectives=[p2p("send", stalled, semconv.STATE_ISSUED)])
    if stalled + 1 < WORLD:
        b.hang(stalled + 1, 1, stack=stack,
               collectives=[p2p("recv", stalled, semconv.STATE_ISSUED)])
    if record:
        b.hang(stalled, 1, stack=[("Net", "forward"), ("Net.stage.compute", "forward")],
               collectives=[], reason=semconv.HANG_REASON_SIGNAL)
    return b


@pytest.mark.parametrize("record", [True, False], ids=["signal-record", "no-record"])
def test_a_stalled_pipeline_stage_is_named_by_the_stages_waiting_for_it(
    record: bool,
) -> None:
    """Rank 2 stalls before its receive: rank 1 waits in its send to 2, rank 3 in its
    receive from 2. Both findings name rank 2 as the one that never issued its side,
    each send matched with its receive by their number per peer (#2 of the pair)."""
    result = run_check(_chain(stalled=2, record=record))
    assert [f.kind for f in result.findings] == [KIND_HANG, KIND_HANG]
    by_pair = {(f.details["p2p"]["sender"], f.details["p2p"]["receiver"]): f
               for f in result.findings}
    assert set(by_pair) == {(1, 2), (2, 3)}
    where = ("last seen in `Net.stage.compute` forward" if record else
             "its last exported collective was send in `Net.stage` forward")
    for (sender, receiver), f in by_pair.items():
        waiting = sender if sender != 2 else receiver
        op = "send" if waiting == sender else "recv"
        other = "recv" if op == "send" else "send"
        assert (f.group, f.seq, f.step) == (WORLD_GROUP, 2, 1)
        assert f.details["never_issued"] == [2] and f.details["root"]
        assert f.message.startswith(
            f"group 0 (ranks 0-3), rank {sender} -> rank {receiver} #2: rank {waiting} is "
            f"in `Net.stage` forward {op} {'to' if op == 'send' else 'from'} rank 2; "
            f"rank 2 never issued the matching {other}" if record else
            f"group 0 (ranks 0-3), rank {sender} -> rank {receiver} #2: rank {waiting} is "
            f"in `Net.stage` forward {op} {'to' if op == 'send' else 'from'} rank 2; "
            "rank 2 wrote no record of it")
        assert where in f.message
        assert f.ranks[waiting]["p2p_seq"] == 2 and f.ranks[waiting]["state"] == "issued"
        assert f.ranks[2]["state"] == "not issued" and f.ranks[2]["last_p2p_seq"] == 1


def test_a_stage_blocked_in_its_own_send_is_not_the_first_suspect() -> None:
    """Rank 2 stalls as above, and rank 0 went on to step 2: it waits in its send to
    rank 1, which never receives it because it is itself blocked in its send to rank 2.
    That finding names rank 1, says it is waiting, and comes after the findings that
    name rank 2, which waits on nothing."""
    b = _chain(stalled=2, record=True)
    b.hang(0, 2, stack=[("Net", "forward"), ("Net.stage", "forward")], collectives=[
        b.event_attrs("send", fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                      ranks=range(WORLD), seq=None, p2p_seq=3, kind=semconv.KIND_P2P,
                      peer=1, state=semconv.STATE_ISSUED)])
    findings = run_check(b).findings
    assert [f.details["p2p"]["sender"] for f in findings][-1] == 0
    last = findings[-1]
    assert not last.details["root"] and last.details["never_issued"] == [1]
    assert last.message.endswith(
        "rank 1 never issued the matching recv and was last seen in `Net.stage` forward; "
        "it is itself waiting in `Net.stage` forward send to rank 2 (#2)")
    assert all(f.details["root"] for f in findings[:-1])


def test_a_stuck_receive_whose_sender_wrote_no_record_is_reported() -> None:
    """Rank 2 waits in its receive from rank 1, whose send was exported not completed
    and who wrote no hang record (its process died): one finding, from the receiver's
    record (the receiver's side was left to a sender's record that never came)."""
    b = _chain(stalled=2, record=True)
    b._spans = [(r, sp) for r, sp in b._spans if sp.name != semconv.SPAN_HANG or r == 3]
    s = b.rank(1, 1, finished=False)
    s.coll("send", fqn="Net.stage", kind=semconv.KIND_P2P, peer=2)  # exported, issued
    b.hang(2, 1, stack=[("Net", "forward"), ("Net.stage", "forward")], collectives=[
        b.event_attrs("recv", fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                      ranks=range(WORLD), seq=None, p2p_seq=2, kind=semconv.KIND_P2P,
                      peer=1, state=semconv.STATE_ISSUED)])
    findings = [f for f in run_check(b).findings if f.details["p2p"]["receiver"] == 2]
    assert len(findings) == 1
    assert "rank 2 is in `Net.stage` forward recv from rank 1; rank 1 is in `Net.stage` " \
        "forward send to rank 2" in findings[0].message


@pytest.mark.parametrize("peer", [None, [0, 3]], ids=["any-source", "batch"])
def test_a_stuck_receive_from_any_source_is_reported_as_it_is(peer: Any) -> None:
    """A receive from any source (or a batch) has no single peer to match: the finding
    says where the rank waits, and blames no one (it used to give nothing)."""
    b = SpanBuilder(schema=3)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_reduce", fqn="Net.sync")
    op = "recv" if peer is None else "batch_p2p"
    b.hang(1, 1, stack=[("Net", "forward"), ("Net.stage", "forward")], collectives=[
        b.event_attrs(op, fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                      ranks=range(WORLD), seq=None, p2p_seq=1, kind=semconv.KIND_P2P,
                      peer=peer, state=semconv.STATE_ISSUED)])
    hangs = [f for f in run_check(b).findings if f.kind == KIND_HANG]
    assert len(hangs) == 1
    what = "recv from any source" if peer is None else "batch_p2p with ranks 0, 3"
    assert hangs[0].message == (
        f"group 0 (ranks 0-3), rank 1 #1: rank 1 is in `Net.stage` forward {what}, not "
        "matched with a peer's side")
    assert hangs[0].details["never_issued"] == [] and not hangs[0].details["root"]


def test_a_stuck_receive_from_any_source_without_a_number_is_reported_as_it_is() -> None:
    """Receives from any source carry no ``p2p.seq`` (none matches them): such a stuck
    receive is still a point-to-point op waiting, said as it is, not taken for a
    collective of its group (the same finding as for files that numbered it)."""
    b = SpanBuilder(schema=3)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_reduce", fqn="Net.sync")
    b.hang(1, 1, stack=[("Net", "forward"), ("Net.stage", "forward")], collectives=[
        b.event_attrs("recv", fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                      ranks=range(WORLD), seq=None, p2p_seq=None, kind=semconv.KIND_P2P,
                      peer=None, state=semconv.STATE_ISSUED)])
    hangs = [f for f in run_check(b).findings if f.kind == KIND_HANG]
    assert [f.message for f in hangs] == [
        "group 0 (ranks 0-3), rank 1: rank 1 is in `Net.stage` forward recv from any "
        "source, not matched with a peer's side"]


def test_a_completed_receive_from_any_source_does_not_hide_the_next_one() -> None:
    """Two receives from any source on one rank, neither numbered: the first completed,
    the second is stuck. The second is still reported (they are told apart by when
    they were issued, not taken for one op)."""
    b = SpanBuilder(schema=3)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_reduce", fqn="Net.sync")
    receives = [
        b.event_attrs("recv", fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                      ranks=range(WORLD), seq=None, p2p_seq=None, kind=semconv.KIND_P2P,
                      peer=None, state=state)
        for state in (semconv.STATE_COMPLETED, semconv.STATE_ISSUED)]
    b.hang(1, 1, stack=[("Net", "forward"), ("Net.stage", "forward")], collectives=receives)
    hangs = [f for f in run_check(b).findings if f.kind == KIND_HANG]
    assert [f.message for f in hangs] == [
        "group 0 (ranks 0-3), rank 1: rank 1 is in `Net.stage` forward recv from any "
        "source, not matched with a peer's side"]


def test_a_rank_that_skipped_a_collective_while_blocked_elsewhere_says_so() -> None:
    """Group "dp" is ranks 0 and 1. Rank 0 waits in its all_reduce; rank 1 never issued
    it because it waits in a receive from rank 2, which stalled. The all_reduce's
    finding says rank 1 is itself waiting, and comes after the one naming rank 2."""
    b = SpanBuilder(schema=3)
    stack = [("Net", "forward"), ("Net.stage", "forward")]
    b.hang(0, 0, stack=[("Net", "forward"), ("Net.sync", "forward")], collectives=[
        b.event_attrs("all_reduce", fqn="Net.sync", phase="forward", group="dp",
                      ranks=(0, 1), seq=1, state=semconv.STATE_ISSUED)])
    b.hang(1, 0, stack=stack, collectives=[
        b.event_attrs("recv", fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                      ranks=range(WORLD), seq=None, p2p_seq=1, kind=semconv.KIND_P2P,
                      peer=2, state=semconv.STATE_ISSUED)])
    b.hang(2, 0, stack=[("Net", "forward"), ("Net.compute", "forward")], collectives=[],
           reason=semconv.HANG_REASON_SIGNAL)
    first, second = run_check(b).findings
    assert first.details["p2p"] == {"sender": 2, "receiver": 1, "p2p_seq": 1}
    assert first.details["root"] and first.details["never_issued"] == [2]
    assert second.group == "dp" and not second.details["root"]
    assert second.message.endswith(
        "rank 1 never issued it and was last seen in `Net.stage` forward; it is itself "
        "waiting in `Net.stage` forward recv from rank 2 (#1)")


def test_ranks_that_wait_for_each_other_on_two_groups_are_the_root() -> None:
    """A subgroup only some of its ranks entered: rank 0 waits in the all_reduce of
    group "sub" (ranks 0, 1), which rank 1 skipped; rank 1 went on and waits in its
    next all_reduce on group "tp" (ranks 0, 1), which rank 0 never reaches; rank 2
    waits on group "dp" (ranks 0, 2) for rank 0, the first to block. By construction
    the cycle (sub, tp) is the cause and dp a consequence: the two findings of the
    cycle come first, each naming the deadlock, though every missing rank waits in
    another op (which alone makes a finding no cause) and dp's was issued first."""
    b = SpanBuilder(world=3)
    fwd = ("Net", "forward")
    b.hang(2, 1, stack=[], time_ns=10_000_000, times=[1_000], collectives=[
        b.event_attrs("all_reduce", fqn="Global", phase="forward", group="dp",
                      ranks=(0, 2), seq=1, state=semconv.STATE_ISSUED)])
    b.hang(0, 1, stack=[fwd, ("Net.sub", "forward")], time_ns=10_000_000, times=[2_000],
           collectives=[b.event_attrs("all_reduce", fqn="Net.sub", phase="forward",
                                      group="sub", ranks=(0, 1), seq=1,
                                      state=semconv.STATE_ISSUED)])
    b.hang(1, 2, stack=[fwd, ("Net.tp", "forward")], time_ns=10_000_000, times=[3_000],
           collectives=[b.event_attrs("all_reduce", fqn="Net.tp", phase="forward",
                                      group="tp", ranks=(0, 1), seq=1,
                                      state=semconv.STATE_ISSUED)])
    findings = run_check(b).findings
    assert [f.group for f in findings] == ["sub", "tp", "dp"]
    for f in findings[:2]:
        assert f.details["root"] is True
        assert f.details["deadlock"] == {"groups": ["sub", "tp"], "ranks": [0, 1]}
        assert f.message.endswith(
            "; a deadlock: ranks 0, 1 wait for each other on groups sub, tp")
    assert findings[2].details["root"] is False and "deadlock" not in findings[2].details


def test_point_to_point_numbers_survive_digests() -> None:
    """Digests keep a point-to-point op's number per peer: the run read from them has
    the collectives the lines give."""
    from commspan.analysis.digest import digest_parts, run_from_parts

    spans = [s for s in _chain(stalled=2, record=True).spans()
             if s.name != semconv.SPAN_HANG]  # (a line with a hang record has no digest)
    parts = digest_parts(spans)
    assert parts is not None
    from_digest = run_from_parts(parts).collectives
    plain = build_run(spans).collectives
    assert any(c.p2p_seq for c in plain)

    def key(c: Any) -> tuple[Any, ...]:
        return (c.rank, c.trace_id, c.issued_ns)

    assert sorted(from_digest, key=key) == sorted(plain, key=key)


# ------------------------------------------------------------------ files and output
def test_check_run_errors_name_the_path_or_parameter(tmp_path: Path) -> None:
    """Missing path, empty directory, a corrupt line and bad steps raise clear errors."""
    with pytest.raises(FileNotFoundError, match="nope"):
        check_run(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"holds no \*\.jsonl"):
        check_run(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{}\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        check_run(bad)
    (tmp_path / "ok.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="steps"):
        check_run(tmp_path / "ok.jsonl", steps=["1"])  # type: ignore[list-item]


def test_steps_filter_checks_only_those_steps() -> None:
    """steps=[0] leaves out a divergence in step 1."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op]:
        if rank == 1 and step == 1:
            ops[0] = {**ops[0], "dtype": "int32"}
        return ops

    spans = build(steps=2, edit=other).spans()
    assert not check(build_run(spans)).ok
    only0 = check(build_run(spans, steps=[0]))
    assert only0.ok and only0.checked["steps"] == 1


def test_json_form_has_the_documented_keys() -> None:
    """Each finding serialises with kind, group, seq, step, ranks (string keys), message."""

    def other(rank: int, step: int, ops: list[Op]) -> list[Op] | None:
        if (rank, step) == (3, 1):
            return None
        if rank == 1:
            ops[0] = {**ops[0], "dtype": "int32"}
        return ops

    result = run_check(build(steps=2, edit=other))
    doc = json.loads(json.dumps(result.to_dict()))
    assert set(doc) == {"findings", "checked"}
    kinds = {f["kind"] for f in doc["findings"]}
    assert kinds == {KIND_MISMATCH, KIND_MISSING}
    for f in doc["findings"]:
        assert {"kind", "group", "seq", "step", "ranks", "message"} <= set(f)
        assert all(k.isdigit() for k in f["ranks"])
        for entry in f["ranks"].values():
            assert {"op", "fqn", "phase", "seq"} <= set(entry)
        assert "\n" not in f["message"]
    text = format_check(result)
    assert text.splitlines()[-1].startswith("2 findings; checked 4 ranks")


# ------------------------------------------------------------------ real gloo ranks
SCRIPT = Path(__file__).with_name("_mp_check_scenarios.py")


@dataclass
class GlooRun:
    """Where the ranks of tests/_mp_check_scenarios.py wrote, and how they ended."""

    root: Path
    returncodes: list[int | None]
    logs: list[str]

    def failure(self) -> str:
        return "\n".join(
            f"--- rank {r} exit {rc}\n{self.logs[r][-4000:]}"
            for r, rc in enumerate(self.returncodes)
            if rc != 0
        )


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> GlooRun:
    """Spawn 4 gloo ranks once for every scenario; kill them all if one fails or hangs."""
    root = tmp_path_factory.mktemp("check")
    run = GlooRun(root, *run_ranks(SCRIPT, [str(root)], root, WORLD, timeout_s=150))
    if any(rc != 0 for rc in run.returncodes):
        pytest.fail(f"ranks failed:\n{run.failure()}")
    return run


def _groups(run: GlooRun) -> dict[str, str]:
    return json.loads((run.root / "groups.json").read_text())


def _seq(step: int, index: int) -> int:
    """The world-group seq of the collective at ``index`` of WORLD_OPS in ``step``
    (1-based; the send/recv pairs there are numbered per peer, not in this count)."""
    from _mp_check_scenarios import WORLD_OPS

    collectives = [i for i, (_, op) in enumerate(WORLD_OPS) if "/" not in op]
    assert index in collectives, "not a collective"
    return len(collectives) * step + collectives.index(index) + 1


@pytest.mark.multiprocess
def test_gloo_consistent_run_has_no_findings(gloo_run: GlooRun) -> None:
    """Every rank ran the program: no finding; every step, group and collective compared."""
    from _mp_check_scenarios import STEPS, SUBGROUP, WORLD_OPS

    result = check_run(gloo_run.root / "consistent")
    assert result.ok, [f.message for f in result.findings]
    collectives_per_rank = len([op for _, op in WORLD_OPS if "/" not in op])
    assert result.checked["groups"] == 2 and result.checked["steps"] == STEPS
    assert result.checked["collectives"] == STEPS * (WORLD * collectives_per_rank + len(SUBGROUP))
    assert result.checked["p2p"] == STEPS * 2 * WORLD


@pytest.mark.multiprocess
def test_gloo_extra_all_reduce(gloo_run: GlooRun) -> None:
    """Rank 2's extra all_reduce in Net.blocks.1 at step 1 stands where the others issued
    Net.blocks.1's all_gather."""
    from _mp_check_scenarios import SCENARIOS

    dev = SCENARIOS["extra_all_reduce"]
    assert dev is not None
    (f,) = check_run(gloo_run.root / "extra_all_reduce").findings
    seq = _seq(dev.step, 1)
    assert (f.kind, f.group, f.step, f.seq) == (KIND_MISMATCH, _groups(gloo_run)["world"],
                                                dev.step, seq)
    assert f.details["fields"] == ["op", "shape"]
    assert f.ranks[dev.rank] == {"op": "all_reduce", "fqn": "Net.blocks.1",
                                 "phase": "forward", "seq": seq, "shape": [16]}
    for r in set(range(WORLD)) - {dev.rank}:
        assert f.ranks[r] == {"op": "all_gather_into_tensor", "fqn": "Net.blocks.1",
                              "phase": "forward", "seq": seq, "shape": [4]}
    assert f.details["later_steps"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("scenario", "index", "fqn", "field", "values"),
    [
        ("shape", 2, "Net.blocks.2", "shape", ([16], [2, 8])),
        ("dtype", 0, "Net.blocks.0", "dtype", ("float32", "int32")),
    ],
)
def test_gloo_other_shape_or_dtype(
    gloo_run: GlooRun, scenario: str, index: int, fqn: str, field: str,
    values: tuple[Any, Any],
) -> None:
    """One rank all-reduces a tensor of another shape / dtype (same bytes) in one step."""
    from _mp_check_scenarios import SCENARIOS

    dev = SCENARIOS[scenario]
    assert dev is not None
    (f,) = check_run(gloo_run.root / scenario).findings
    assert (f.kind, f.group, f.step, f.seq) == (KIND_MISMATCH, _groups(gloo_run)["world"],
                                                dev.step, _seq(dev.step, index))
    assert f.details["fields"] == [field]
    for r in range(WORLD):
        expected = values[1] if r == dev.rank else values[0]
        assert f.ranks[r] == {"op": "all_reduce", "fqn": fqn, "phase": "forward",
                              "seq": _seq(dev.step, index), field: expected}


@pytest.mark.multiprocess
def test_gloo_rank_skipping_a_step(gloo_run: GlooRun) -> None:
    """Rank 3 did not trace step 1: it is missing from step 1, and its shifted sequence
    numbers in step 2 cause no mismatch."""
    from _mp_check_scenarios import SCENARIOS, STEPS

    dev = SCENARIOS["skip_step"]
    assert dev is not None
    result = check_run(gloo_run.root / "skip_step")
    (f,) = result.findings
    assert (f.kind, f.group, f.step) == (KIND_MISSING, None, dev.step)
    assert f.ranks == {dev.rank: {"op": None, "fqn": None, "phase": None, "seq": None,
                                  "last_step": dev.step - 1}}
    assert result.checked["steps"] == STEPS
    run = build_run(read_spans(*sorted((gloo_run.root / "skip_step").glob("*.jsonl"))))
    last = [c for c in run.collectives if c.step == STEPS - 1 and c.fqn == "Net.blocks.0"]
    seqs = {c.rank: c.seq for c in last}
    assert seqs[dev.rank] != seqs[0]  # the shift that matching by seq would trip on


@pytest.mark.multiprocess
def test_gloo_recv_into_another_shape(gloo_run: GlooRun) -> None:
    """Rank 1 receives rank 0's send into a 4x4 buffer: a p2p mismatch of that pair."""
    from _mp_check_scenarios import SCENARIOS

    dev = SCENARIOS["recv_shape"]
    assert dev is not None
    (f,) = check_run(gloo_run.root / "recv_shape").findings
    assert (f.kind, f.group, f.step) == (KIND_MISMATCH, _groups(gloo_run)["world"], dev.step)
    assert (f.details["src"], f.details["dst"]) == (dev.rank - 1, dev.rank)
    assert f.ranks[dev.rank - 1]["op"] == "send" and f.ranks[dev.rank - 1]["shape"] == [16]
    assert f.ranks[dev.rank]["op"] == "recv" and f.ranks[dev.rank]["shape"] == [4, 4]
    assert f.ranks[dev.rank]["fqn"] == "Net.ring"


# ------------------------------------------------------------------ documentation
REPO = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


_CHILD = """
import sys
readme, debugging = sys.argv[1], sys.argv[2]
ns = {"__name__": "docs:README.md"}
exec(compile(readme, "README.md", "exec"), ns)
ns["mode"].shutdown()
print("=== debugging.md", flush=True)
exec(compile(debugging, "debugging.md", "exec"), {"__name__": "docs:debugging.md"})
"""


def test_debugging_doc_example_runs(tmp_path: Path) -> None:
    """docs/debugging.md's Python block runs on the files README's example writes.

    In a fresh interpreter: a process group another test left initialised would make
    the README's one-process example a rank of that group."""
    readme = "\n".join(_BLOCK.findall((REPO / "README.md").read_text(encoding="utf-8")))
    debugging = "\n".join(
        _BLOCK.findall((REPO / "docs" / "debugging.md").read_text(encoding="utf-8"))
    )
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, readme, debugging],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.split("=== debugging.md\n", 1)[1]
    assert out.startswith("consistent: checked 1 rank, 0 groups, 3 steps")
    assert "Step time per rank" in out


def test_json_that_is_not_spans_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    """A JSON line of another shape (a list, a bad timestamp) names the file, no traceback
    from deep inside the reader."""
    odd = tmp_path / "odd.jsonl"
    odd.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"odd\.jsonl:1: an array, not an OTLP/JSON"):
        check_run(odd)
    bad_time = tmp_path / "time.jsonl"
    span = {"traceId": "1", "spanId": "2", "name": "x", "startTimeUnixNano": "soon"}
    bad_time.write_text(json.dumps(
        {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}) + "\n")
    with pytest.raises(ValueError, match=r"time\.jsonl(:1)?: "):
        check_run(bad_time)


def test_hang_reports_the_lowest_collective_still_pending() -> None:
    """Ranks 0, 2, 3 issued an async all_gather (seq 1) and then an all_reduce (seq 2),
    neither completed; rank 1 issued neither: the hang is at seq 1, the all_gather."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        pending = []
        if r != 1:
            pending = [
                b.event_attrs("all_gather_into_tensor", fqn="Net.blocks.0", phase="forward",
                              group=WORLD_GROUP, ranks=range(WORLD), seq=1,
                              state=semconv.STATE_ISSUED),
                b.event_attrs("all_reduce", fqn="Net.blocks.1", phase="forward",
                              group=WORLD_GROUP, ranks=range(WORLD), seq=2,
                              state=semconv.STATE_ISSUED),
            ]
        stack = [("Net", "forward"), ("Net.blocks.1" if r != 1 else "Net.embed", "forward")]
        b.hang(r, 0, stack=stack, collectives=pending)
    (f,) = run_check(b).findings
    assert (f.kind, f.seq, f.step) == (KIND_HANG, 1, 0)
    assert f.ranks[0]["op"] == "all_gather_into_tensor" and f.ranks[0]["fqn"] == "Net.blocks.0"
    assert f.ranks[1]["fqn"] == "Net.embed" and f.ranks[1]["op"] is None
    assert "rank 1 never issued it and was last seen in `Net.embed` forward" in f.message


def test_an_unmatched_send_is_told_by_its_number_per_peer_in_the_text() -> None:
    """Schema 3: rank 0 sends twice to rank 1, which receives once. The text names the
    send by its number per peer, and the receiver's last op by its own (a
    point-to-point op has no collective ``seq``: the text never says ``seq None``)."""
    b = SpanBuilder(world=2, schema=3)
    s0, s1 = b.rank(0, 0), b.rank(1, 0)
    s0.coll("send", fqn="Net.pipe", kind=semconv.KIND_P2P, peer=1)
    s0.coll("send", fqn="Net.pipe", kind=semconv.KIND_P2P, peer=1)
    s1.coll("recv", fqn="Net.pipe", kind=semconv.KIND_P2P, peer=0)
    result = check(build_run(b.spans()))
    (finding,) = result.findings
    assert finding.kind == KIND_MISMATCH and finding.seq == 2
    text = format_check(result)
    assert "p2p_seq 2: rank 0 sent 2 to rank 1" in text
    assert "last: recv in `Net.pipe` forward p2p_seq 1" in text
    assert "None" not in text


MS = 1_000_000


def test_a_record_of_a_collective_that_completed_later_reports_no_hang() -> None:
    """Rank 1 waited longer than hang_timeout_s at Net.b's all_reduce (rank 0 was slow)
    and wrote a record of it as issued; the collective then completed, as rank 1's
    spans (written after) show with its duration. The run is consistent: a record
    of a slow collective is no hang."""
    b = SpanBuilder(world=2)
    for step in (0, 1):
        for r in range(2):
            b.rank(r, step).coll("all_reduce", fqn="Net.b", duration_ns=(4_000 if r else 1) * MS)
    pending = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                            ranks=range(2), seq=1, state=semconv.STATE_ISSUED)
    b.hang(1, 0, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[pending],
           time_ns=b.clock[1] // 2)
    result = check(build_run(b.spans()))
    assert result.findings == []


def test_a_stale_record_does_not_hide_the_real_hang() -> None:
    """Rank 1 wrote a record in step 0 (a slow collective, completed later) and later
    stalls computing in step 2, writing nothing more; rank 0 waits at seq 3 in step 2
    and writes a record. The finding is seq 3 (rank 1 never issued it), not the
    step-0 collective rank 1's old record lists."""
    b = SpanBuilder(world=2)
    for step in (0, 1):
        for r in range(2):
            b.rank(r, step).coll("all_reduce", fqn="Net.b", duration_ns=MS)
    old = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                        ranks=range(2), seq=1, state=semconv.STATE_ISSUED)
    b.hang(1, 0, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[old],
           time_ns=b.clock[1] // 2)
    b.rank(0, 2, finished=False).coll("all_reduce", fqn="Net.b")
    b.rank(1, 2, finished=False)
    stuck = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                          ranks=range(2), seq=3, state=semconv.STATE_ISSUED)
    b.hang(0, 2, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[stuck])
    result = check(build_run(b.spans()))
    hangs = [f for f in result.findings if f.kind == KIND_HANG]
    assert [(f.seq, f.step) for f in hangs] == [(3, 2)]
    assert hangs[0].ranks[1]["op"] is None  # never issued


def test_a_hang_where_the_ranks_issued_different_collectives_says_so() -> None:
    """Rank 1 skipped its backward: at seq 3 rank 0 waits in a reduce_scatter, rank 1
    (a step later) in an all_gather. Both issued seq 3, so neither is "never issued";
    the finding says the collectives differ, which no wait can resolve, and counts as
    a cause."""
    b = SpanBuilder(world=2)
    for r in range(2):
        b.rank(r, 0).coll("all_gather_into_tensor", fqn="Net.layer", reduce_op=None,
                          duration_ns=MS)
        b.rank(r, 0).coll("all_gather_into_tensor", fqn="Net.layer", reduce_op=None,
                          duration_ns=MS)
    b.rank(0, 1, finished=False).coll("reduce_scatter_tensor", fqn="Net.layer",
                                      phase="backward")
    b.rank(1, 2, finished=False).coll("all_gather_into_tensor", fqn="Net.layer",
                                      reduce_op=None)
    for r, (op, step, phase) in enumerate((("reduce_scatter_tensor", 1, "backward"),
                                           ("all_gather_into_tensor", 2, "forward"))):
        stuck = b.event_attrs(op, fqn="Net.layer", phase=phase, group=WORLD_GROUP,
                              ranks=range(2), seq=3, state=semconv.STATE_ISSUED,
                              reduce_op="sum" if op.startswith("reduce") else None)
        b.hang(r, step, stack=[("Net", phase), ("Net.layer", phase)], collectives=[stuck])
    result = check(build_run(b.spans()))
    hangs = [f for f in result.findings if f.kind == KIND_HANG]
    assert len(hangs) == 1 and hangs[0].seq == 3
    assert "issued different collectives (op" in hangs[0].message
    assert hangs[0].details["differ"][0] == "op" and hangs[0].details["root"] is True


def test_a_collective_that_failed_on_one_rank_is_a_hang_finding() -> None:
    """Rank 1 stalls before Net.b's all_reduce; rank 0's all_reduce fails on the
    backend's timeout and its record lists it failed. The finding names seq 2: rank 0
    issued it (failed), rank 1 never did."""
    b = SpanBuilder(world=2)
    for r in range(2):
        b.rank(r, 0).coll("all_reduce", fqn="Net.b", duration_ns=MS)
    b.rank(0, 1, finished=False).coll("all_reduce", fqn="Net.b")
    b.rank(1, 1, finished=False)
    failed = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                           ranks=range(2), seq=2, state=semconv.STATE_FAILED)
    b.hang(0, 1, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[failed],
           reason=semconv.HANG_REASON_DUMP)
    result = check(build_run(b.spans()))
    hangs = [f for f in result.findings if f.kind == KIND_HANG]
    assert [(f.seq, f.step) for f in hangs] == [(2, 1)]
    assert hangs[0].ranks[0]["state"] == semconv.STATE_FAILED
    assert hangs[0].ranks[1]["op"] is None


def test_a_collective_that_failed_with_no_hang_record_is_a_hang_finding() -> None:
    """Rank 1 died in step 1 before Net.b's all_reduce, with no hang record anywhere;
    ranks 0, 2, 3's all_reduce raised (the event says ``failed``). The finding names
    the group, seq, step and modules; step 1 is not compared (rank 1's spans stop
    short there), so its missing all_reduce is no count mismatch."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_reduce", fqn="Net.a", duration_ns=MS)
        b.rank(r, 0).coll("all_reduce", fqn="Net.b", duration_ns=MS)
    b.rank(1, 1, finished=False).coll("all_reduce", fqn="Net.a", duration_ns=MS)
    for r in (0, 2, 3):
        s = b.rank(r, 1)
        s.coll("all_reduce", fqn="Net.a", duration_ns=MS)
        s.coll("all_reduce", fqn="Net.b")
    spans = b.spans()
    for rec in spans:  # what the capture writes on the event of an op that raised
        for _name, attrs in rec.events:
            if attrs.get(semconv.COLL_SEQ) == 4:
                attrs[semconv.COLL_STATE] = semconv.STATE_FAILED
    result = check(build_run(spans))
    (f,) = result.findings
    assert (f.kind, f.seq, f.step) == (KIND_HANG, 4, 1)
    assert f.details["never_issued"] == [1] and f.ranks[1]["last_seq"] == 3
    assert [r for r in range(WORLD) if f.ranks[r]["state"] == semconv.STATE_FAILED] == [0, 2, 3]
    assert "ranks 0, 2, 3 issued all_reduce in `Net.b` forward and it failed there" in f.message
    assert "its last exported collective was all_reduce in `Net.a` forward (step 1)" \
        in f.message
    assert result.checked["steps_interrupted"] == 1 and result.checked["steps"] == 1


def test_a_rank_that_stops_mid_step_is_not_a_mismatch_but_a_missing_rank_span_earlier_is(
) -> None:
    """A rank's last step without its rank span (stopped, or still running) is not
    compared; a step it finished on the other ranks but whose rank span is lost while
    it went on to later steps is compared as before."""
    b = SpanBuilder(WORLD)
    for step in range(3):
        for r in range(WORLD):
            s = b.rank(r, step, finished=not (r == 2 and step in (0, 2)))
            s.coll("all_reduce", fqn="Net.a", duration_ns=MS)
            if not (r == 2 and step in (0, 2)):
                s.coll("all_reduce", fqn="Net.b", duration_ns=MS)
    result = check(build_run(b.spans()))
    (f,) = result.findings  # step 0: rank 2 went on to later steps
    assert (f.kind, f.step, f.details["fields"]) == (KIND_MISMATCH, 0, ["count"])
    assert result.checked["steps_interrupted"] == 1 and result.checked["steps"] == 2


def test_a_collective_owned_by_another_module_names_both() -> None:
    """Rank 2's all-gather of unit Net.blocks.0, prefetched from Net.blocks.1's backward,
    has another shape: the entries and the message say where it was issued and whose
    it is."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_gather_into_tensor", fqn="Net.blocks.1", phase="backward",
                          owner="Net.blocks.0", reduce_op=None,
                          shape=(12,) if r == 2 else (8,))
    (f,) = check(build_run(b.spans())).findings
    assert f.details["fields"] == ["shape"]
    assert all((f.ranks[r]["fqn"], f.ranks[r]["owner"]) == ("Net.blocks.1", "Net.blocks.0")
               for r in range(WORLD))
    assert "in `Net.blocks.1` backward (for `Net.blocks.0`)" in f.message


def test_a_step_selection_keeps_the_record_of_a_rank_stuck_before_it() -> None:
    """Rank 2 stalls in step 1, so rank 1 waits there on group "b" (ranks 1, 2) and
    writes a record in step 1; rank 0 goes on to step 2 and waits on group "a" (ranks 0,
    1). Checking step 2 alone (``check --step 2``) still says rank 1 is itself waiting
    on group "b", not that it "wrote nothing": its step-1 record is kept."""
    from commspan.analysis.runs import StepRange, select

    b = SpanBuilder(world=3)
    for step in (0, 1):
        b.rank(0, step).coll("all_reduce", fqn="Net.a", group="a", ranks=(0, 1),
                             duration_ns=MS)
        b.rank(1, step, finished=step == 0).coll("all_reduce", fqn="Net.a", group="a",
                                                 ranks=(0, 1), duration_ns=MS)
    b.rank(1, 0).coll("all_reduce", fqn="Net.b", group="b", ranks=(1, 2), duration_ns=MS)
    b.rank(2, 0).coll("all_reduce", fqn="Net.b", group="b", ranks=(1, 2), duration_ns=MS)
    b.rank(1, 1, finished=False).coll("all_reduce", fqn="Net.b", group="b", ranks=(1, 2))
    b.rank(2, 1, finished=False)
    waits_b = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group="b",
                            ranks=(1, 2), seq=2, state=semconv.STATE_ISSUED)
    b.hang(1, 1, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[waits_b])
    b.rank(0, 2, finished=False).coll("all_reduce", fqn="Net.a", group="a", ranks=(0, 1))
    waits_a = b.event_attrs("all_reduce", fqn="Net.a", phase="forward", group="a",
                            ranks=(0, 1), seq=3, state=semconv.STATE_ISSUED)
    b.hang(0, 2, stack=[("Net", "forward"), ("Net.a", "forward")], collectives=[waits_a])
    sel = select(b.spans(), steps=StepRange(2, 2))
    result = check(build_run(sel.records))
    (on_a,) = [f for f in result.findings if f.kind == KIND_HANG and f.group == "a"]
    assert "wrote nothing" not in on_a.message
    assert "itself waiting" in on_a.message and on_a.ranks[1]["hang_record"] is not None


@pytest.mark.parametrize("reason", [semconv.HANG_REASON_DUMP, semconv.HANG_REASON_SIGNAL])
def test_a_send_never_waited_on_whose_receive_completed_is_no_hang(reason: str) -> None:
    """Schema 3, 2 ranks: in each step rank 0 isends to rank 1 in Net.p and never waits
    on the Work (gloo then never reports it completed: no duration); rank 1's blocking
    recv completes. A dump (or signal) at the end lists the send issued: the peer
    completed the matching recv, so the data went across and nothing hangs. A send
    whose receive did not complete is still reported."""
    b = SpanBuilder(world=2, schema=3)
    for step in range(3):
        b.rank(0, step).coll("send", fqn="Net.p", kind=semconv.KIND_P2P, peer=1)
        b.rank(1, step).coll("recv", fqn="Net.p", kind=semconv.KIND_P2P, peer=0,
                             duration_ns=MS)

    def p2p(op: str, peer: int, n: int, state: str) -> dict[str, Any]:
        return b.event_attrs(op, fqn="Net.p", phase="forward", group=WORLD_GROUP,
                             ranks=range(2), seq=None, p2p_seq=n, kind=semconv.KIND_P2P,
                             peer=peer, state=state)

    for r in range(2):
        b.hang(r, 2, stack=[], reason=reason, collectives=[
            p2p("send", 1, n, semconv.STATE_ISSUED) if r == 0 else
            p2p("recv", 0, n, semconv.STATE_COMPLETED) for n in (1, 2, 3)])
    result = check(build_run(b.spans()))
    assert result.findings == [] and result.checked["hang_records"] == 2
    # rank 1's receive #3 not completed (no duration, its record says issued): a hang
    spans = b.spans()
    for rec in spans:
        for _name, attrs in rec.events:
            if rec.rank == 1 and attrs.get(semconv.P2P_SEQ) == 3:
                attrs.pop(semconv.COLL_DURATION_NS, None)
                if semconv.COLL_STATE in attrs:
                    attrs[semconv.COLL_STATE] = semconv.STATE_ISSUED
    (f,) = check(build_run(spans)).findings
    assert (f.kind, f.details["p2p"]) == (KIND_HANG, {"sender": 0, "receiver": 1,
                                                      "p2p_seq": 3})


def test_a_killed_rank_is_the_root_and_a_rank_whose_own_collective_failed_waits() -> None:
    """No hang records. Groups B = (2, 3) and the world; each step Net.b all_reduces on
    B, then Net.w on the world. Rank 3 is killed in step 1 before Net.b: rank 2's B
    all_reduce fails, so it never reaches Net.w, whose all_reduce fails on ranks 0
    and 1 (every rank but 3 closes its step with the error). The B finding names rank
    3 and comes first (root); the world finding says rank 2 was blocked in B's
    all_reduce (root false). Step 1 is cut short: no missing findings."""
    b = SpanBuilder(WORLD)
    B = (2, 3)
    for r in range(WORLD):
        s = b.rank(r, 0)
        if r in B:
            s.coll("all_reduce", fqn="Net.b", group="2", ranks=B, duration_ns=MS)
        s.coll("all_reduce", fqn="Net.w", duration_ns=MS)
    for r in range(3):
        s = b.rank(r, 1)
        if r in B:
            b.clock[r] += 5 * MS  # (issued after ranks 0 and 1's: order is no cause)
            s.coll("all_reduce", fqn="Net.b", group="2", ranks=B)
        else:
            s.coll("all_reduce", fqn="Net.w")
    spans = b.spans()
    for rec in spans:  # what the capture writes on the event of an op that raised
        for _name, attrs in rec.events:
            if rec.trace_id == trace_of(1):
                attrs[semconv.COLL_STATE] = semconv.STATE_FAILED
    result = check(build_run(spans))
    assert [(f.kind, f.group, f.details.get("root")) for f in result.findings] == [
        (KIND_HANG, "2", True), (KIND_HANG, WORLD_GROUP, False)]
    world = result.findings[1]
    assert world.details["never_issued"] == [2, 3]
    assert ("rank 2 wrote no record of it and no hang record; its last exported collective "
            "was `Net.b` forward all_reduce on group 2 (seq 2), in step 1, and it failed: "
            "it was blocked there") in world.message
    assert ("rank 3 wrote no record of it and no hang record (stopped, or stuck outside "
            "collectives?)") in world.message
    assert result.checked["steps_interrupted"] == 1


def test_findings_carry_the_documented_keys_and_p2p_only_groups_are_counted() -> None:
    """Hang findings carry their trace_id (a hang is tied to its trace from JSON); a p2p
    mismatch carries group_ranks, and its message labels the group with its ranks as
    other findings do; a group that carried only sends and receives is a group checked;
    a rank that wrote nothing at all is not said to have "never issued" anything."""
    b = SpanBuilder(world=3, schema=3)
    for r in range(3):
        s = b.rank(r, 0)
        s.coll("all_reduce", fqn="Net.a", ranks=range(3))
    b.rank(0, 0).coll("send", fqn="Net.p", kind=semconv.KIND_P2P, peer=1, group="1",
                      ranks=(0, 1))
    b.rank(1, 0).coll("recv", fqn="Net.p", kind=semconv.KIND_P2P, peer=0, group="1",
                      ranks=(0, 1), shape=(4,))
    result = check(build_run(b.spans()))
    (f,) = result.findings
    assert f.details["group_ranks"] == [0, 1] and f.details["trace_id"] == trace_of(0)
    assert f.message.startswith("group 1 (ranks 0, 1), step 0, p2p_seq 1: shape differs")
    assert result.checked["groups"] == 2
    # a hang: ranks 0 and 1 in step 1's all_reduce; rank 2 wrote nothing at all
    for r in (0, 1):
        b.rank(r, 1, finished=False).coll("all_reduce", fqn="Net.a", ranks=range(3))
        b.hang(r, 1, stack=[("Net.a", "forward")], collectives=[b.event_attrs(
            "all_reduce", fqn="Net.a", phase="forward", group=WORLD_GROUP, ranks=range(3),
            seq=2, state=semconv.STATE_ISSUED)])
    (hang,) = [f for f in check(build_run(b.spans(ranks=[0, 1]))).findings
               if f.kind == KIND_HANG]
    assert hang.details["trace_id"] == trace_of(1)
    assert hang.message.endswith("rank 2 wrote nothing at all: whether it issued it is unknown")
    # a p2p hang: rank 0's send #2 on group 1, rank 1 never received it
    b.hang(0, 1, stack=[("Net.p", "forward")], collectives=[b.event_attrs(
        "send", fqn="Net.p", phase="forward", group="1", ranks=(0, 1), seq=None, p2p_seq=2,
        kind=semconv.KIND_P2P, peer=1, state=semconv.STATE_ISSUED)])
    (p2p,) = [f for f in check(build_run(b.spans())).findings
              if f.kind == KIND_HANG and "p2p" in f.details]
    assert p2p.details["trace_id"] == trace_of(1)


def test_a_send_or_receive_that_failed_is_a_hang_finding_not_a_skipped_step() -> None:
    """Schema 3, 2 ranks, no hang records: each step all_reduces, then rank 0 sends to
    rank 1. Rank 1 dies in step 1 after its all_reduce, before its recv: rank 0's send
    #2 raises (its event says failed). The step counts as interrupted (not compared),
    so the failed send itself must be reported: a hang finding naming the pair, both
    ranks, the module and the state; rank 1, which wrote nothing after, is the root.
    A receive from any source that failed is reported too, without a peer to match."""
    b = SpanBuilder(world=2, schema=3)
    for step in range(2):
        for r in range(2):
            s = b.rank(r, step, finished=step == 0 or r == 0)
            s.coll("all_reduce", fqn="Net.a", duration_ns=MS)
            if r == 0:
                s.coll("send", fqn="Net.p", kind=semconv.KIND_P2P, peer=1,
                       duration_ns=MS if step == 0 else None)
            elif step == 0:
                s.coll("recv", fqn="Net.p", kind=semconv.KIND_P2P, peer=0, duration_ns=MS)
    spans = b.spans()
    for rec in spans:  # what the capture writes on the event of an op that raised
        for name, attrs in rec.events:
            if name == "send" and attrs.get(semconv.P2P_SEQ) == 2:
                attrs[semconv.COLL_STATE] = semconv.STATE_FAILED
    result = check(build_run(spans))
    (f,) = result.findings
    assert (f.kind, f.group, f.seq, f.step) == (KIND_HANG, WORLD_GROUP, 2, 1)
    assert f.details["p2p"] == {"sender": 0, "receiver": 1, "p2p_seq": 2}
    assert f.details["root"] is True and f.details["trace_id"] == trace_of(1)
    assert f.ranks[0]["state"] == semconv.STATE_FAILED and f.ranks[0]["fqn"] == "Net.p"
    assert f.ranks[0]["hang_record"] is None and "stack" not in f.ranks[0]
    assert f.ranks[1]["op"] is None and f.ranks[1]["last_p2p_seq"] == 1
    assert f.message == (
        f"group {WORLD_GROUP} (ranks 0, 1), rank 0 -> rank 1 #2: rank 0 issued send to "
        "rank 1 in `Net.p` forward and it failed there; rank 1 wrote no record of it and "
        "no hang record (stopped, or stuck outside collectives?); its last exported "
        "collective was all_reduce in `Net.a` forward (step 1)")
    assert result.checked["steps_interrupted"] == 1
    # a receive from any source (no peer, no number) that failed: said as it is
    for rec in spans:
        for name, attrs in rec.events:
            if name == "send" and attrs.get(semconv.P2P_SEQ) == 2:
                attrs.update({semconv.COLL_OP: "recv", semconv.COLL_STATE:
                              semconv.STATE_FAILED})
                del attrs[semconv.COLL_PEER], attrs[semconv.P2P_SEQ]
    (f,) = check(build_run(spans)).findings
    assert (f.kind, f.step, f.ranks[0]["state"]) == (KIND_HANG, 1, semconv.STATE_FAILED)
    assert f.message.endswith("rank 0: rank 0 issued recv from any source in `Net.p` "
                              "forward and it failed there, not matched with a peer's side")


def test_a_receive_is_matched_with_the_send_of_its_own_tag() -> None:
    """gloo matches a send with a receive by peer and tag. Rank 0 posts irecv(tag=1)
    (#1) and irecv(tag=2) (#2) from rank 1; rank 1 sends only tag 2 (its send #1),
    which completes with rank 0's receive #2. Rank 0 waits in receive #1 forever; a
    dump on both ranks. Rank 1's completed send #1 is not the match of receive #1
    (another tag): the hang is reported, naming the tag. Untagged ops (tag 0, and
    files before schema 4) match by number as before; digests keep the tag."""
    from commspan.analysis.digest import digest_parts, run_from_parts

    b = SpanBuilder(world=2, schema=3)
    s0 = b.rank(0, 0, finished=False)
    s0.coll("recv", fqn="Net.p", kind=semconv.KIND_P2P, peer=1)
    s0.coll("recv", fqn="Net.p", kind=semconv.KIND_P2P, peer=1, duration_ns=MS)
    b.rank(1, 0).coll("send", fqn="Net.p", kind=semconv.KIND_P2P, peer=0, duration_ns=MS)
    tags = {(0, 1): 1, (0, 2): 2, (1, 1): 2}  # (rank, p2p_seq) -> tag

    def p2p(r: int, n: int, state: str) -> dict[str, Any]:
        attrs = b.event_attrs("recv" if r == 0 else "send", fqn="Net.p", phase="forward",
                              group=WORLD_GROUP, ranks=range(2), seq=None, p2p_seq=n,
                              kind=semconv.KIND_P2P, peer=1 - r, state=state)
        attrs[semconv.P2P_TAG] = tags[(r, n)]
        return attrs

    b.hang(0, 0, stack=[("Net.p", "forward")], reason=semconv.HANG_REASON_DUMP,
           collectives=[p2p(0, 1, semconv.STATE_ISSUED), p2p(0, 2, semconv.STATE_COMPLETED)])
    b.hang(1, 0, stack=[], reason=semconv.HANG_REASON_DUMP,
           collectives=[p2p(1, 1, semconv.STATE_COMPLETED)])
    spans = b.spans()
    for rec in spans:
        for _name, attrs in rec.events:
            if rec.name != semconv.SPAN_HANG and semconv.P2P_SEQ in attrs:
                attrs[semconv.P2P_TAG] = tags[(rec.rank or 0, attrs[semconv.P2P_SEQ])]
    run = build_run(spans)
    assert sorted(rec.tag for rec in run.collectives) == [1, 2, 2]
    parts = digest_parts([rec for rec in spans if rec.name != semconv.SPAN_HANG])
    assert parts is not None
    assert sorted(run_from_parts(parts).collectives) == sorted(
        rec for rec in run.collectives)
    (f,) = check(run).findings
    assert (f.kind, f.details["p2p"]) == (KIND_HANG, {"sender": 1, "receiver": 0,
                                                      "p2p_seq": 1})
    assert f.ranks[0]["tag"] == 1 and f.ranks[1]["op"] is None
    assert f.message.startswith(
        f"group {WORLD_GROUP} (ranks 0, 1), rank 1 -> rank 0 #1: rank 0 is in `Net.p` "
        "forward recv from rank 1 (tag 1); rank 1 never issued the matching send (tag 1)")
    # the same without tags (tag 0, or an older file): rank 1's send #1 is the match
    for rec in spans:
        for _name, attrs in rec.events:
            attrs.pop(semconv.P2P_TAG, None)
    assert check(build_run(spans)).findings == []


def test_a_rank_that_wrote_nothing_is_no_record_in_json_not_never_issued() -> None:
    """Ranks 0 and 1 hang in step 1's all_reduce (and rank 0 in a send #1 to rank 2);
    rank 2 wrote nothing at all (no file), rank 3 wrote step 0 only. Only rank 3 is
    known not to have issued it: rank 2's state is "no record" and it is listed in
    wrote_nothing, not never_issued, in the collective's finding and the send's."""
    b = SpanBuilder(world=4, schema=3)
    for r in (1, 2, 3):
        b.rank(r, 0).coll("all_reduce", fqn="Net.a", duration_ns=MS)
    b.rank(0, 0).coll("all_reduce", fqn="Net.a", duration_ns=MS)
    for r in (0, 1):
        b.rank(r, 1, finished=False).coll("all_reduce", fqn="Net.a")
        events = [b.event_attrs("all_reduce", fqn="Net.a", phase="forward",
                                group=WORLD_GROUP, ranks=range(4), seq=2,
                                state=semconv.STATE_ISSUED)]
        if r == 0:
            events.insert(0, b.event_attrs(
                "send", fqn="Net.p", phase="forward", group=WORLD_GROUP, ranks=range(4),
                seq=None, p2p_seq=1, kind=semconv.KIND_P2P, peer=2,
                state=semconv.STATE_ISSUED))
        b.hang(r, 1, stack=[("Net.a", "forward")], collectives=events)
    findings = check(build_run(b.spans(ranks=[0, 1, 3]))).findings
    (coll,) = [f for f in findings if f.kind == KIND_HANG and "p2p" not in f.details]
    assert coll.details["never_issued"] == [3] and coll.details["wrote_nothing"] == [2]
    assert (coll.ranks[2]["state"], coll.ranks[3]["state"]) == ("no record", "not issued")
    assert "rank 2 wrote nothing at all: whether it issued it is unknown" in coll.message
    (send,) = [f for f in findings if f.kind == KIND_HANG and "p2p" in f.details]
    assert send.details["never_issued"] == [] and send.details["wrote_nothing"] == [2]
    assert send.ranks[2]["state"] == "no record" and send.details["root"] is True
    assert json.loads(json.dumps(coll.to_dict()))["ranks"]["2"]["state"] == "no record"


def test_a_rank_that_ended_the_step_without_the_collective_is_said_to_have_skipped_it(
) -> None:
    """Rank 2 skipped Net.a's all_reduce in step 1 (an exception it caught), so it
    issued one collective fewer, ended all three steps, and the others wait for it
    in step 2's last all_reduce (their hang records). Its files show it ended step 2:
    the hang finding says it never issued the collective and ended that step without
    it (it said "(stopped?)", as of a rank that died); a rank with no span of that
    step keeps "(stopped, or stuck outside collectives?)"."""
    b = SpanBuilder(WORLD)
    for step in range(3):
        for r in range(WORLD):
            s = b.rank(r, step, finished=not (step == 2 and r != 2))
            if not (step == 1 and r == 2):
                s.coll("all_reduce", fqn="Net.a", duration_ns=MS)
            if step < 2 or r == 2:
                s.coll("all_reduce", fqn="Net.w", duration_ns=MS)
    for r in (0, 1, 3):
        pending = b.event_attrs("all_reduce", fqn="Net.w", phase="forward", group=WORLD_GROUP,
                                ranks=range(WORLD), seq=6, state=semconv.STATE_ISSUED)
        b.hang(r, 2, stack=[("Net", "forward"), ("Net.w", "forward")], collectives=[pending])
    result = check(build_run(b.spans()))
    hang = next(f for f in result.findings if f.kind == KIND_HANG)
    assert (hang.seq, hang.step, hang.details["never_issued"]) == (6, 2, [2])
    assert ("rank 2 never issued it: it ended step 2 without it (it issued fewer "
            "collectives than its peers; see the other findings)") in hang.message
    assert "stuck outside collectives?" not in hang.message
    mismatch = [f for f in result.findings if f.kind != KIND_HANG]
    assert mismatch and mismatch[0].step == 1  # where it skipped one


def test_a_rank_that_left_the_step_early_is_not_referred_to_findings_that_are_not_there(
) -> None:
    """Rank 1 raised in step 1 after `Net.a`'s all_reduce (its step ended, by the
    exception); rank 0 waits in `Net.b`'s (its hang record). The step is not compared
    (a rank did not finish it), so no mismatch finding names where rank 1 went its own
    way: the hang finding says it left the step early, not "see the other findings"."""
    b = SpanBuilder(world=2)
    for step in range(2):
        for r in range(2):
            s = b.rank(r, step, finished=not (step == 1 and r == 0))
            s.coll("all_reduce", fqn="Net.a", duration_ns=MS)
            if step == 0:
                s.coll("all_reduce", fqn="Net.b", duration_ns=MS)
    pending = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                            ranks=(0, 1), seq=4, state=semconv.STATE_ISSUED)
    b.hang(0, 1, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[pending])
    result = check(build_run(b.spans()))
    (hang,) = result.findings
    assert (hang.kind, hang.step, hang.details["never_issued"]) == (KIND_HANG, 1, [1])
    assert ("rank 1 never issued it: it ended step 1 without it (it left the step early, "
            "by an exception say, or skipped collectives its peers issued)") in hang.message
    assert "see the other findings" not in hang.message


def test_a_hang_names_the_error_that_took_a_rank_out_of_the_step() -> None:
    """As above, but rank 1's step ended on an error raised in `Net.b` forward (its rank
    span's ERROR status and the exception event, as commspan records them): the hang
    finding says so, where it was raised, and --json's entry for rank 1 carries it; the
    rank is 'not issued', not 'no record'. One that raised in its first step before any
    collective is named too (it was 'wrote nothing at all')."""
    for first_step in (False, True):
        b = SpanBuilder(world=2)
        steps = [0] if first_step else [0, 1]
        last = steps[-1]
        for step in steps:
            for r in range(2):
                s = b.rank(r, step, finished=not (step == last and r == 0))
                if not (first_step and r == 1):
                    s.coll("all_reduce", fqn="Net.a", duration_ns=MS)
                if step < last:
                    s.coll("all_reduce", fqn="Net.b", duration_ns=MS)
                if step == last and r == 1:
                    s.raised("ValueError: bad shape 7", "Net.b")
        pending = b.event_attrs("all_reduce", fqn="Net.b", phase="forward",
                                group=WORLD_GROUP, ranks=(0, 1), seq=2 if first_step else 4,
                                state=semconv.STATE_ISSUED)
        b.hang(0, last, stack=[("Net", "forward"), ("Net.b", "forward")],
               collectives=[pending])
        result = check(build_run(b.spans()))
        hang = next(f for f in result.findings if f.kind == KIND_HANG)
        assert hang.details["never_issued"] == [1], hang.message
        assert (f"rank 1 never issued it: it left step {last} on an error, ValueError: bad "
                "shape 7, raised in `Net.b` forward") in hang.message
        entry = hang.ranks[1]
        assert entry["error"] == {"message": "ValueError: bad shape 7", "fqn": "Net.b",
                                  "phase": "forward", "step": last}
        assert (entry["fqn"], entry["phase"], entry["state"]) == ("Net.b", "forward",
                                                                  "not issued")
        assert "error: ValueError: bad shape 7 in `Net.b` forward" in format_check(result)


def _raising_net(message: str = "bad shape 7") -> Any:
    """``Net`` of two ``Block``s (``Net.a``, ``Net.b``), each a linear and an all_reduce;
    a block whose ``boom`` is set raises the test's own ``ValueError(message)`` before
    its all_reduce."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.boom = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.boom:
                raise ValueError(message)
            return funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD).wait()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    return Net()


def test_a_count_mismatch_names_the_error_a_rank_left_the_step_on(
        tmp_path: Path, fake_pg: None) -> None:
    """Four ranks traced by commspan (fake process group); in step 1 rank 1's `Net.b`
    raises (the test's own ValueError) before its all_reduce, and in step 2 its loss
    raises outside every module. `check` from the lines and from the digests alike names
    the error and where it was raised in the count mismatch, and each rank entry has
    it."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from commspan import CommSpanMode
    from commspan.cli import main
    from commspan.exporters.jsonl import JsonlSpanExporter

    run = tmp_path / "run"
    run.mkdir()
    for rank in range(4):
        mode = CommSpanMode(exporters=[JsonlSpanExporter(run / f"commspan-rank{rank}.jsonl")],
                            run_id="raise", resource_attributes={"commspan.rank": rank})
        net = _raising_net()
        with mode:
            for step in range(3):
                net.b.boom = rank == 1 and step == 1
                try:
                    with mode.step(step):
                        out = net(torch.ones(2, 4))
                        if rank == 1 and step == 2:
                            raise RuntimeError("loss is nan")
                        funcol.all_reduce(out.sum(), "sum", dist.group.WORLD).wait()
                except (ValueError, RuntimeError):
                    pass
        mode.shutdown()
    expected = {1: ("ValueError: bad shape 7", "Net.b", "forward",
                    "raised in `Net.b` forward"),
                2: ("RuntimeError: loss is nan", None, None, "raised outside every module")}
    assert main(["digest", str(run)]) == 0
    from commspan.analysis.digest import load_parts, run_from_parts
    from commspan.analysis.records import load_run

    parts = load_parts(sorted(run.glob("*.jsonl")))
    assert parts is not None  # the digests are read, and say what the lines say:
    from_digests = run_from_parts(parts).rank_steps
    from_lines = load_run(run).rank_steps
    assert from_digests == from_lines
    assert sorted((rs.step, rs.error, rs.error_fqn, rs.error_phase)
                  for rs in from_lines.values() if rs.error) == [
        (step, message, fqn, phase) for step, (message, fqn, phase, _) in expected.items()]
    for flags in ([], ["--no-digest"]):
        for step, (message, fqn, phase, words) in expected.items():
            # (one finding per group: step 2's is step 1's later step unless alone)
            code = subprocess.run([sys.executable, "-m", "commspan", "check", "--json",
                                   "--step", str(step), *flags, str(run)],
                                  capture_output=True, text=True, check=False)
            assert code.returncode == 1, code.stderr
            (finding,) = json.loads(code.stdout)["findings"]
            assert finding["step"] == step, code.stdout
            assert finding["ranks"]["1"]["error"] == {"message": message, "fqn": fqn,
                                                      "phase": phase, "step": step}, flags
            assert f"it left it on an error, {message}, {words}" in finding["message"]
            assert [r for r, e in finding["ranks"].items() if "error" in e] == ["1"]


def _cut_at_hang(path: Path, step: int | None = None,
                 keep: tuple[str, ...] | None = None) -> None:
    """Leave in a rank's file what a rank that hung at its hang record (``mode.dump()``)
    wrote: the spans of that trace still open then (the module spans it was in, its
    rank and step span) are dropped, as a hung process never ends them. With ``step``
    and ``keep`` (a rank that died, no hang record): of that step's trace, only the
    spans of the modules ``keep`` names are left."""
    docs = [json.loads(line) for line in path.read_bytes().splitlines()]
    spans = [span for doc in docs for rs in doc["resourceSpans"] for ss in rs["scopeSpans"]
             for span in ss["spans"]]

    def attrs(span: dict[str, Any]) -> dict[str, Any]:
        return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}

    if keep is None:
        hangs = [(s["traceId"], int(s["startTimeUnixNano"])) for s in spans
                 if s["name"] == semconv.SPAN_HANG]
        assert len(hangs) == 1, path
        trace, at = hangs[0]

        def dropped(span: dict[str, Any]) -> bool:
            return (span["traceId"] == trace and span["name"] != semconv.SPAN_HANG
                    and int(span["endTimeUnixNano"]) > at)
    else:
        (trace,) = {s["traceId"] for s in spans
                    if attrs(s).get(semconv.STEP) in (step, str(step))}

        def dropped(span: dict[str, Any]) -> bool:
            return span["traceId"] == trace and attrs(span).get(semconv.MODULE_FQN) not in keep
    for doc in docs:
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                ss["spans"] = [span for span in ss["spans"] if not dropped(span)]
    path.write_bytes(b"".join(json.dumps(d).encode() + b"\n" for d in docs))


def _erring_run(out: Path, plan: dict[int, dict[int, str]], steps: int = 3) -> Path:
    """4 ranks of ``Net`` (blocks ``a``, ``b``: a linear and an all_reduce each) traced by
    commspan under the fake process group. ``plan[rank][step]`` says what the rank does
    differently in that step: ``"raise_b"`` (its `Net.b` raises the test's own
    ValueError before its all_reduce, caught by the loop), ``"raise_after"`` (a
    RuntimeError outside every module after the net ran, caught), ``"hang_b"`` (its
    `Net.b` issues its all_reduce and the rank hangs waiting there: a hang record, and
    the rank writes nothing more), ``"hang_a"`` (it hangs in `Net.a` before its
    all_reduce, waiting on something else), ``"die_b"`` (it dies in `Net.b` before its
    all_reduce: no hang record, nothing more)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch import nn

    from commspan import CommSpanMode
    from commspan.exporters.jsonl import JsonlSpanExporter

    class Stop(BaseException):
        """The rank hangs or dies here: nothing after it is traced."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.what = ""
            self.mode: Any = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.what == "raise":
                raise ValueError("transient")
            if self.what == "hang_before":
                self.mode.dump()
                raise Stop
            if self.what == "die_before":
                raise Stop
            out = funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD)
            if self.what == "hang_in":
                self.mode.dump()  # (its all_reduce issued, not completed)
                raise Stop
            return out.wait()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    blocks = {"raise_b": ("b", "raise"), "hang_b": ("b", "hang_in"),
              "hang_a": ("a", "hang_before"), "die_b": ("b", "die_before")}
    out.mkdir()
    for rank in range(4):
        path = out / f"commspan-rank{rank}.jsonl"
        mode = CommSpanMode(exporters=[JsonlSpanExporter(path)], run_id="erring",
                            resource_attributes={"commspan.rank": rank})
        net = Net()
        net.a.mode = net.b.mode = mode
        stopped = False
        with mode:
            for step in range(steps):
                what = plan.get(rank, {}).get(step, "")
                net.a.what = net.b.what = ""
                if what in blocks:
                    getattr(net, blocks[what][0]).what = blocks[what][1]
                try:
                    with mode.step(step):
                        net(torch.ones(2, 4))
                        if what == "raise_after":
                            raise RuntimeError("loss is nan")
                except (ValueError, RuntimeError):
                    pass
                except Stop:
                    stopped = True
                    break
        mode.shutdown()
        if stopped and what != "die_b":
            _cut_at_hang(path)
        elif stopped:  # died in `Net.b`: only `Net.a`'s spans of the step were ended
            _cut_at_hang(path, step=step, keep=("Net.a", "Net.a.lin"))
    return out


def test_a_hang_names_the_error_a_rank_left_an_earlier_step_on(
        tmp_path: Path, fake_pg: None) -> None:
    """Records written by commspan (fake process group, hang records from mode.dump()):

    - rank 1's `Net.b` raises in step 1 (its all_reduce skipped), the loop goes on, and
      in step 2 its collectives pair with its peers' one place late: ranks 0, 2, 3
      wait in step 2's last all_reduce (seq 6), which rank 1, its step 2 ended, never
      issued. The finding named no error (the step it ended was step 2, without one);
      it names step 1's, where it was raised, and rank 1's entry has it, with its step.
    - the same error, then rank 1 hangs in step 2's `Net.a` waiting on something else
      (its hang record) while ranks 0, 2, 3 wait in step 1's `Net.b` all_reduce: the
      message said only where it was last seen; it names the error too.
    - rank 1 raised in step 0 after every collective of the step (its loss), then ran
      step 1 in step with its peers, and dies in step 2's `Net.b`: that old error is
      not named (its last collective the peers issued at the same place came after).
    """
    ran = {
        "shifted": _erring_run(tmp_path / "shifted", {
            1: {1: "raise_b"}, 0: {2: "hang_b"}, 2: {2: "hang_b"}, 3: {2: "hang_b"}}),
        "hung_after": _erring_run(tmp_path / "hung_after", {
            1: {1: "raise_b", 2: "hang_a"}, 0: {1: "hang_b"}, 2: {1: "hang_b"},
            3: {1: "hang_b"}}),
        "old_error": _erring_run(tmp_path / "old_error", {
            1: {0: "raise_after", 2: "die_b"}, 0: {2: "hang_b"}, 2: {2: "hang_b"},
            3: {2: "hang_b"}}),
    }
    error = {"message": "ValueError: transient", "fqn": "Net.b", "phase": "forward",
             "step": 1}
    words = "it left step 1 on an error, ValueError: transient, raised in `Net.b` forward"
    expected = {  # (seq, step, rank 1's words before the error's)
        "shifted": (6, 2, "rank 1 never issued it: it ended step 2 without it"),
        "hung_after": (4, 1, "rank 1 never issued it and was last seen in `Net.a` forward"),
        "old_error": (6, 2, "rank 1 wrote no record of it and no hang record (stopped, or "
                            "stuck outside collectives?)"),
    }
    for name, run in ran.items():
        result = check_run(run)
        (hang,) = [f for f in result.findings if f.kind == KIND_HANG]
        seq, step, said = expected[name]
        assert (hang.seq, hang.step, hang.details["never_issued"]) == (seq, step, [1]), (
            name, hang.message)
        assert said in hang.message, (name, hang.message)
        if name == "old_error":
            assert "error" not in hang.ranks[1] and "on an error" not in hang.message
            assert "loss is nan" not in format_check(result)
            continue
        assert hang.ranks[1]["error"] == error, name
        assert words in hang.message, (name, hang.message)
        assert "error: ValueError: transient in `Net.b` forward (step 1)" in format_check(
            result), name


def _one_span_per_line(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Rewrite ``path`` one span per line (an export queue sending small batches), its
    spans' order kept; ``(name, attributes)`` of each line's span."""
    out, spans = [], []
    for raw in path.read_bytes().splitlines():
        for rs in json.loads(raw)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    out.append(json.dumps({"resourceSpans": [
                        {**rs, "scopeSpans": [{**ss, "spans": [span]}]}]}).encode())
                    spans.append((span["name"], {a["key"]: next(iter(a["value"].values()))
                                                 for a in span.get("attributes", [])}))
    path.write_bytes(b"\n".join(out) + b"\n")
    return spans


@pytest.mark.parametrize("lost", ["hang record", "collective"])
def test_a_hang_does_not_blame_a_rank_whose_record_of_it_a_damaged_line_may_hold(
        tmp_path: Path, fake_pg: None, lost: str) -> None:
    """Ranks 0, 2, 3 wait in step 2's `Net.b` all_reduce (seq 6). Rank 1 waits there too
    (its hang record says so), or died before it, after `Net.a`'s all_reduce (seq 5).
    Rank 1's line holding its hang record, or `Net.a`'s span of step 2, is damaged:
    the finding said rank 1 never issued it ("wrote no record of it and no hang
    record", its last op the one before), blaming it, while the `unread` finding
    said the line may have held its collectives of step 2. Rank 1's state is now
    `unread`, naming the line: whether it issued it is unknown."""
    rank1 = "hang_b" if lost == "hang record" else "die_b"
    run = _erring_run(tmp_path / "run", {0: {2: "hang_b"}, 1: {2: rank1}, 2: {2: "hang_b"},
                                         3: {2: "hang_b"}})
    path = run / "commspan-rank1.jsonl"
    spans = _one_span_per_line(path)
    for f in run.glob("*.jsonl"):
        if f != path:
            _one_span_per_line(f)
    (reference,) = [f for f in check_run(run).findings if f.kind == KIND_HANG]
    assert reference.seq == 6 and reference.details["never_issued"] == (
        [] if lost == "hang record" else [1])
    if lost == "hang record":
        line = next(i for i, (name, _) in enumerate(spans, 1) if name == semconv.SPAN_HANG)
    else:
        # (step 2's: the last, the rank died in step 2's `Net.b`)
        line = max(i for i, (name, _) in enumerate(spans, 1) if name == "Net.a forward")
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1] = b"\x00 garbage\n"
    path.write_bytes(b"".join(lines))
    result = check_run(run, strict=False)
    (hang,) = [f for f in result.findings if f.kind == KIND_HANG]
    (unread,) = [f for f in result.findings if f.kind == "unread"]
    assert (unread.details["line"], unread.details["steps"], list(unread.ranks)) == (
        line, [2], [1])
    assert (hang.seq, hang.step) == (6, 2)
    assert (hang.details["never_issued"], hang.details["wrote_nothing"],
            hang.details["unread"]) == ([], [], [1])
    assert hang.ranks[1]["state"] == "unread"
    assert hang.ranks[1]["damaged"] == f"{path}:{line}"
    assert (f"rank 1 may have issued it: {path}:{line} is damaged and may have held its "
            "records of step 2, so whether it did is unknown") in hang.message
    assert "never issued" not in hang.message and "no hang record" not in hang.message
    assert {r: e["state"] for r, e in hang.ranks.items() if r != 1} == {
        r: e["state"] for r, e in reference.ranks.items() if r != 1}


def test_a_p2p_hang_does_not_blame_a_peer_whose_record_of_it_a_damaged_line_may_hold(
) -> None:
    """Rank 0 sends to rank 1 once a step and waits in step 2's send #3 (its hang
    record); rank 1 wrote no record of the matching receive, but a damaged line of its
    file may have held its collectives of step 2 (:attr:`Run.unread`, as the lines
    around it say: :mod:`commspan.analysis.unread`). Not "never issued the matching
    recv": whether it did is unknown; a damaged line of step 0 only (before its
    receive #2) changes nothing."""
    from commspan.analysis.records import Unread

    b = SpanBuilder(world=2, schema=3)
    for step in range(3):
        for r in range(2):
            s = b.rank(r, step, finished=step < 2)
            if step < 2:
                s.coll("send" if r == 0 else "recv", fqn="Net.stage", kind=semconv.KIND_P2P,
                       peer=1 - r, ranks=range(2))
    b.hang(0, 2, stack=[("Net", "forward"), ("Net.stage", "forward")], collectives=[
        b.event_attrs("send", fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                      ranks=range(2), seq=None, p2p_seq=3, kind=semconv.KIND_P2P,
                      peer=1, state=semconv.STATE_ISSUED)])
    run = build_run(b.spans())
    trace = {s: t for t, s in run.trace_steps.items()}
    (before,) = [f for f in check(run).findings if f.kind == KIND_HANG]
    assert before.details["never_issued"] == [1] and before.ranks[1]["state"] == "not issued"
    run.unread = {(1, trace[0]): Unread(1, trace[0], 0, "r1.jsonl", 3, "not JSON", "run")}
    (same,) = [f for f in check(run).findings if f.kind == KIND_HANG]
    assert same.message == before.message and same.details["unread"] == []
    run.unread[(1, trace[2])] = Unread(1, trace[2], 2, "r1.jsonl", 9, "not JSON", "run")
    (f,) = [f for f in check(run).findings if f.kind == KIND_HANG]
    assert (f.details["never_issued"], f.details["wrote_nothing"], f.details["unread"]) == (
        [], [], [1])
    assert f.ranks[1]["state"] == "unread" and f.ranks[1]["damaged"] == "r1.jsonl:9"
    assert ("rank 1 may have issued the matching recv: r1.jsonl:9 is damaged and may have "
            "held its records of step 2, so whether it did is unknown") in f.message
    assert "never issued" not in f.message


def test_a_p2p_hang_names_the_error_the_peer_left_an_earlier_step_on() -> None:
    """Rank 0 sends to rank 1 once a step (their numbers per peer: #1 in step 0, ...).
    Rank 1's step 1 ended on an error raised in `Net.stage` forward before its receive,
    so its receive #2 came in step 2, where it ended; rank 0 waits in step 2's send #3
    (its hang record). The finding names the error of step 1; when rank 1 instead
    raised in step 0 after its receive #1 and then received #2 in step 1 as its peer
    sent it, that old error is not named."""
    for old in (False, True):
        b = SpanBuilder(world=2, schema=3)
        for step in range(3):
            for r in range(2):
                s = b.rank(r, step, finished=not (r == 0 and step == 2))
                skips = r == 1 and step == 1 and not old
                if not skips and not (r == 1 and old and step == 2):
                    s.coll("send" if r == 0 else "recv", fqn="Net.stage",
                           kind=semconv.KIND_P2P, peer=1 - r, ranks=range(2))
                if r == 1 and step == (0 if old else 1):
                    s.raised("ValueError: transient", None if old else "Net.stage")
        b.hang(0, 2, stack=[("Net", "forward"), ("Net.stage", "forward")], collectives=[
            b.event_attrs("send", fqn="Net.stage", phase="forward", group=WORLD_GROUP,
                          ranks=range(2), seq=None, p2p_seq=3, kind=semconv.KIND_P2P,
                          peer=1, state=semconv.STATE_ISSUED)])
        (f,) = [f for f in check(build_run(b.spans())).findings if f.kind == KIND_HANG]
        assert f.details["p2p"] == {"sender": 0, "receiver": 1, "p2p_seq": 3}, f.message
        assert "rank 1 never issued the matching recv" in f.message, f.message
        if old:
            assert "error" not in f.ranks[1] and "on an error" not in f.message, f.message
            continue
        assert ("it left step 1 on an error, ValueError: transient, raised in `Net.stage` "
                "forward") in f.message, f.message
        assert f.ranks[1]["error"] == {"message": "ValueError: transient",
                                       "fqn": "Net.stage", "phase": "forward", "step": 1}


def test_a_hang_does_not_name_an_error_after_which_the_rank_issued_all_of_its_step(
) -> None:
    """Rank 1's step 0 raised after both of its collectives (an error of its own, caught,
    as a loss check would raise), so it skipped none: it issued every op its peer
    issued in step 0. It then went on and hangs in a later step before that step's
    first all_reduce, waiting on something else (its hang record, in `Net.a`), while
    rank 0 waits in that all_reduce. The error was named as what may be why, although
    the rank was in step with its peer after it; it is not (the next step, or step 10
    when ``sample=`` traced steps 0 and 10 only; a receive, for a send and receive).
    A rank that wrote nothing after the error (it died of it) still has it named."""
    for later, p2p, died in ((1, False, False), (10, False, False), (1, True, False),
                             (1, False, True)):
        b = SpanBuilder(world=2, schema=3)
        kind = semconv.KIND_P2P if p2p else semconv.KIND_COLLECTIVE
        for step in (0, later):
            for r in range(2):
                s = b.rank(r, step, finished=step == 0)
                ops = (["send" if r == 0 else "recv"] if p2p
                       else ["all_reduce", "all_reduce"])
                for op in ops if step == 0 or r == 0 else ():
                    s.coll(op, fqn="Net.a", kind=kind, peer=1 - r if p2p else None,
                           ranks=range(2))
                if step == 0 and r == 1:
                    s.raised("RuntimeError: loss is nan", None)  # (after its ops)
        b.hang(0, later, stack=[("Net", "forward"), ("Net.a", "forward")], collectives=[
            b.event_attrs("send" if p2p else "all_reduce", fqn="Net.a", phase="forward",
                          group=WORLD_GROUP, ranks=range(2), kind=kind,
                          seq=None if p2p else 3, p2p_seq=2 if p2p else None,
                          peer=1 if p2p else None, state=semconv.STATE_ISSUED)])
        if not died:
            b.hang(1, later, stack=[("Net", "forward"), ("Net.a", "forward")],
                   collectives=[])
        (f,) = [f for f in check(build_run(b.spans())).findings if f.kind == KIND_HANG]
        case = (later, p2p, died, f.message)
        assert f.step == later and f.details["never_issued"] == [1], case
        if died:
            assert f.ranks[1]["error"]["step"] == 0, case
            assert "it left step 0 on an error, RuntimeError: loss is nan" in f.message, case
            continue
        assert "last seen in `Net.a` forward" in f.message, case
        assert "error" not in f.ranks[1] and "on an error" not in f.message, case


def test_a_hang_does_not_name_an_error_raised_after_the_rank_ended_the_step() -> None:
    """Rank 0 waits in step 1's all_reduce (its hang record); rank 1 ended step 1 without
    it and no error (its rank span, status OK), then raised in step 2 in `Net.c` (a
    collective on a group of its own). That error came after rank 1 left the step its
    peer waits in, so it cannot be why; it was named (as for a send its peer never
    received, below)."""
    for p2p in (False, True):
        b = SpanBuilder(world=2, schema=3)
        kind = semconv.KIND_P2P if p2p else semconv.KIND_COLLECTIVE
        for step in range(3):
            for r in range(2):
                s = b.rank(r, step, finished=not (r == 0 and step == 1))
                op = ("send" if r == 0 else "recv") if p2p else "all_reduce"
                if step == 0 or (step == 1 and r == 0):
                    s.coll(op, fqn="Net.a", kind=kind, peer=1 - r if p2p else None,
                           ranks=range(2))
                elif step == 2 and r == 1:
                    s.coll("all_reduce", fqn="Net.c", group="7", ranks=[1])
                    s.raised("ValueError: later", "Net.c")
        b.hang(0, 1, stack=[("Net", "forward"), ("Net.a", "forward")], collectives=[
            b.event_attrs("send" if p2p else "all_reduce", fqn="Net.a", phase="forward",
                          group=WORLD_GROUP, ranks=range(2), kind=kind,
                          seq=None if p2p else 2, p2p_seq=2 if p2p else None,
                          peer=1 if p2p else None, state=semconv.STATE_ISSUED)])
        (f,) = [f for f in check(build_run(b.spans())).findings if f.kind == KIND_HANG]
        assert f.step == 1 and f.details["never_issued"] == [1], f.message
        assert "it ended step 1 without it" in f.message, f.message
        assert "error" not in f.ranks[1] and "ValueError" not in f.message, f.message


def test_a_step_retried_under_its_number_is_not_named_left_on_its_first_error(
        tmp_path: Path, fake_pg: None) -> None:
    """Rank 1's step 1 raises (the test's own ValueError in `Net.b`), is caught and run
    again under the same number, and finishes. The rank did not leave the step on an
    error: RankStep.error is None from the lines and from the digests alike (the lines
    kept the first use's error; the digests the last use's). When the retry is the
    one that raises, both name its error."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from commspan import CommSpanMode
    from commspan.analysis.digest import load_parts, run_from_parts
    from commspan.analysis.records import load_run
    from commspan.cli import main
    from commspan.exporters.jsonl import JsonlSpanExporter

    for raises_last in (False, True):
        run = tmp_path / f"run{int(raises_last)}"
        run.mkdir()
        for rank in range(2):
            mode = CommSpanMode(
                exporters=[JsonlSpanExporter(run / f"commspan-rank{rank}.jsonl")],
                run_id="retry", resource_attributes={"commspan.rank": rank})
            net = _raising_net("transient")
            uses = [(0, False), (1, False)]
            if rank == 1:  # step 1 run twice, one of the two raising
                uses = [(0, False), (1, not raises_last), (1, raises_last)]
            with mode:
                for step, boom in uses:
                    net.b.boom = boom
                    try:
                        with mode.step(step):
                            out = net(torch.ones(2, 4))
                            funcol.all_reduce(out.sum(), "sum", dist.group.WORLD).wait()
                    except ValueError:
                        pass
            mode.shutdown()
        assert main(["digest", str(run)]) == 0
        from_lines = load_run(run).rank_steps
        parts = load_parts(sorted(run.glob("*.jsonl")))
        assert parts is not None
        from_digests = run_from_parts(parts).rank_steps
        want = ("ValueError: transient", "Net.b", "forward") if raises_last else (None,) * 3
        for rank_steps in (from_lines, from_digests):
            (retried,) = [rs for (r, _), rs in rank_steps.items() if r == 1 and rs.step == 1]
            assert (retried.error, retried.error_fqn, retried.error_phase) == want
            assert [rs for rs in rank_steps.values() if rs is not retried and rs.error] == []


def test_where_an_error_was_raised_is_read_from_digests_when_a_step_spans_lines(
        tmp_path: Path, fake_pg: None) -> None:
    """Rank 1's `Net.b` raises in step 1 (the test's own ValueError) and the step's spans
    go out in two JSONL lines (a flush inside the step, as a step longer than the export
    delay has): the module span with the exception event in one, the rank span in the
    next. The digests say where it was raised, `Net.b` forward, as the lines do (they
    said outside every module: each digest line looked at its own spans only)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from commspan import CommSpanMode
    from commspan.analysis.digest import load_parts, run_from_parts
    from commspan.analysis.records import load_run
    from commspan.cli import main
    from commspan.exporters.jsonl import JsonlSpanExporter

    run = tmp_path / "run"
    run.mkdir()
    for rank in range(2):
        path = run / f"commspan-rank{rank}.jsonl"
        mode = CommSpanMode(exporters=[JsonlSpanExporter(path)], run_id="split",
                            resource_attributes={"commspan.rank": rank})
        net = _raising_net()
        with mode:
            for step in range(2):
                net.b.boom = rank == 1 and step == 1
                try:
                    with mode.step(step):
                        try:
                            out = net(torch.ones(2, 4))
                            funcol.all_reduce(out.sum(), "sum", dist.group.WORLD).wait()
                        finally:
                            assert mode.flush()
                except ValueError:
                    pass
                # the rank span in a line of its own, not with the next step's spans
                assert mode.flush()
        mode.shutdown()
    lines = (run / "commspan-rank1.jsonl").read_text().splitlines()
    assert len(lines) >= 4  # each step's spans in two lines
    assert main(["digest", str(run)]) == 0
    parts = load_parts(sorted(run.glob("*.jsonl")))
    assert parts is not None
    for rank_steps in (load_run(run).rank_steps, run_from_parts(parts).rank_steps):
        assert sorted((rs.rank, rs.step, rs.error, rs.error_fqn, rs.error_phase)
                      for rs in rank_steps.values() if rs.error) == [
            (1, 1, "ValueError: bad shape 7", "Net.b", "forward")]


def test_a_hang_outside_steps_is_not_counted_as_a_step_some_rank_did_not_finish() -> None:
    """Every step ended; then the ranks hang in a barrier-like all_reduce after the
    loop, outside steps (rank 1 never issues it). The hang finding is there, and the
    checked counts say the work outside steps was cut short, not "1 step some rank
    did not finish" (there was none)."""
    b = SpanBuilder(WORLD)
    for r in range(WORLD):
        b.rank(r, 0).coll("all_reduce", fqn="Net.a", duration_ns=MS)
    for r in (0, 2, 3):
        b.rank(r, None, finished=False)
        pending = b.event_attrs("all_reduce", fqn="Global", phase="forward", group=WORLD_GROUP,
                                ranks=range(WORLD), seq=2, state=semconv.STATE_ISSUED)
        b.hang(r, None, stack=[], collectives=[pending])
    result = check(build_run(b.spans()))
    assert [f.kind for f in result.findings][:1] == [KIND_HANG]
    assert result.checked["steps_interrupted"] == 0
    assert result.checked["outside_interrupted"] == 1
    text = format_check(result)
    assert "did not finish (hang" not in text
    assert "collectives outside steps some rank did not finish not compared" in text


def test_ranks_hung_in_a_step_are_not_missing_from_the_steps_after_it() -> None:
    """Ranks 0 and 1 hang in step 1 (their hang records; their step never ends) while
    rank 2, which takes no part in their group, finishes steps 1 and 2: the hang is
    found, and no "missing step 2: ranks 0, 1" follows from it (it did). A rank that
    finished step 1 and is absent from step 2 is still missing."""
    b = SpanBuilder(WORLD)
    pair = (0, 1)
    for r in range(WORLD):
        s = b.rank(r, 0)
        if r in pair:
            s.coll("all_reduce", fqn="Net.a", group="1", ranks=pair, duration_ns=MS)
    for r in range(WORLD):
        s = b.rank(r, 1, finished=r not in pair)
        if r in pair:
            s.coll("all_reduce", fqn="Net.a", group="1", ranks=pair, duration_ns=MS)
    for r in pair:
        pending = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group="1",
                                ranks=pair, seq=3, state=semconv.STATE_ISSUED)
        b.hang(r, 1, stack=[("Net.b", "forward")], collectives=[pending])
    b.rank(2, 2)  # rank 3 stops after step 1
    result = check(build_run(b.spans()))
    missing = [f for f in result.findings if f.kind == KIND_MISSING]
    assert [f.kind for f in result.findings if f.kind == KIND_HANG]
    assert [(f.step, list(f.ranks)) for f in missing] == [(2, [3])]


def test_an_unread_finding_words_its_steps_as_the_stderr_note_does() -> None:
    """A damaged line that may have held a rank's steps -2, -1, 0 and work outside steps:
    `check`'s finding and the counting commands' stderr note name them in the same words,
    a range of negative steps written with `..` (not "-2-0", which reads as two
    numbers) and the work outside steps joined by "and"."""
    from commspan.analysis.check import unread_findings
    from commspan.analysis.records import Unread
    from commspan.analysis.unread import unread_note

    run = build_run([])
    run.unread = {(1, t): Unread(1, t, step, "r1.jsonl", 7, "not JSON", "run")
                  for t, step in (("t0", -2), ("t1", -1), ("t2", 0), ("t3", None))}
    (finding,) = unread_findings(run)
    words = "steps -2..0 and work outside steps"
    assert finding.message.startswith(f"rank 1, {words}: not compared: r1.jsonl:7 is damaged")
    (note,) = unread_note(list(run.unread.values()))
    assert f"rank 1's collectives of {words} may be missing" in note


def test_steps_given_as_a_string_are_refused_naming_the_value(tmp_path: Path) -> None:
    """check_run(path, steps="0-2") (the command line's --steps) said "steps: '0' is not a
    step number", naming a character of it; the error names the value given and the
    forms to pass instead."""
    path = tmp_path / "r0.jsonl"
    path.write_text("")  # (the steps are checked before any file is read)
    for steps in ("0-2", "1"):
        with pytest.raises(ValueError, match=re.escape(
                f"steps={steps!r} is not valid; pass step numbers (ints), e.g. steps=[0, 1] "
                "or steps=range(0, 3), or None")):
            check_run(path, steps=steps)  # type: ignore[arg-type]


def test_step_and_rank_lists_write_ranges_of_negative_numbers_with_two_dots() -> None:
    """Findings listed steps -3 to -1 as "-3--1", which reads as two numbers."""
    from commspan.analysis.check import _list

    assert _list([-3, -2, -1, 5]) == "-3..-1, 5"
    assert _list([0, 1, 2, 3, 7]) == "0-3, 7"
    assert _list([4, 5]) == "4, 5"


@pytest.mark.parametrize("rooted", ["gather", "broadcast"])
def test_a_hang_at_a_rooted_collective_is_not_taken_for_completed(rooted: str) -> None:
    """Each step: a gather (or broadcast) to rank 0, then an all_reduce. In step 1 rank 3
    skips the rooted op: its seq 3 is the all_reduce. Ranks 1 and 2 completed their
    part of the rooted op (sent to the root, which does not need them all there) and
    wait in the all_reduce, seq 4; rank 0, the root, waits in the rooted op. The records
    of ranks 0 and 3 at seq 3 are still pending, not completed because a rank of the
    group completed its part of seq 3 (rank 3's is even another op): the finding is
    seq 3, the ops differ, rank 0 is in `Net.log`, rank 3 in `Net.tail`. (It used to
    say seq 4, with ranks 0 and 3 "never issued it".)"""
    b = SpanBuilder(world=4)
    for r in range(4):
        s = b.rank(r, 0)
        s.coll(rooted, fqn="Net.log", reduce_op=None, duration_ns=MS)
        s.coll("all_reduce", fqn="Net.tail", duration_ns=MS)
    stuck: dict[int, list[dict[str, Any]]] = {}
    for r in range(4):
        s = b.rank(r, 1, finished=False)
        if r in (1, 2):
            s.coll(rooted, fqn="Net.log", reduce_op=None, duration_ns=MS)
            s.coll("all_reduce", fqn="Net.tail")
            stuck[r] = [b.event_attrs(rooted, fqn="Net.log", phase="forward",
                                      group=WORLD_GROUP, ranks=range(4), seq=3,
                                      reduce_op=None, state=semconv.STATE_COMPLETED),
                        b.event_attrs("all_reduce", fqn="Net.tail", phase="forward",
                                      group=WORLD_GROUP, ranks=range(4), seq=4,
                                      state=semconv.STATE_ISSUED)]
        else:
            op, fqn = (rooted, "Net.log") if r == 0 else ("all_reduce", "Net.tail")
            s.coll(op, fqn=fqn, reduce_op=None if op == rooted else "sum")
            stuck[r] = [b.event_attrs(op, fqn=fqn, phase="forward", group=WORLD_GROUP,
                                      ranks=range(4), seq=3, state=semconv.STATE_ISSUED,
                                      reduce_op=None if op == rooted else "sum")]
    for r, colls in stuck.items():
        fqn = "Net.log" if r == 0 else "Net.tail"
        b.hang(r, 1, stack=[("Net", "forward"), (fqn, "forward")], collectives=colls)
    result = check(build_run(b.spans()))
    hangs = [f for f in result.findings if f.kind == KIND_HANG]
    assert [f.seq for f in hangs] == [3], [f.message for f in hangs]
    (f,) = hangs
    assert "issued different collectives (op" in f.message, f.message
    assert (f.ranks[0]["op"], f.ranks[0]["fqn"]) == (rooted, "Net.log")
    assert (f.ranks[3]["op"], f.ranks[3]["fqn"]) == ("all_reduce", "Net.tail")
    assert f.details["root"] is True and not f.details.get("never_issued")


def test_a_send_and_a_collective_waiting_on_each_other_are_a_deadlock() -> None:
    """Schema 3, 2 ranks; each step rank 0 sends to rank 1 in Net.pp, then both
    all_reduce in Net.tail. In step 1 rank 1 skips its receive: rank 0 waits in the send
    (its receiver is in the all_reduce), rank 1 in the all_reduce (rank 0 never reaches
    it). Each finding names a rank blocked elsewhere, yet nothing outside the two causes
    them: both are root, with the deadlock's ranks and group (a send's finding and the
    group's collectives' were not matched, as they share the group: both root false)."""
    b = SpanBuilder(world=2, schema=3)
    for r in range(2):
        s = b.rank(r, 0)
        s.coll("send" if r == 0 else "recv", fqn="Net.pp", kind=semconv.KIND_P2P,
               peer=1 - r, duration_ns=MS)
        s.coll("all_reduce", fqn="Net.tail", duration_ns=MS)
    assert b.rank(0, 1, finished=False).coll("send", fqn="Net.pp", kind=semconv.KIND_P2P,
                                             peer=1) == 2
    assert b.rank(1, 1, finished=False).coll("all_reduce", fqn="Net.tail") == 2
    b.hang(0, 1, stack=[("Net", "forward"), ("Net.pp", "forward")], collectives=[
        b.event_attrs("send", fqn="Net.pp", phase="forward", group=WORLD_GROUP,
                      ranks=range(2), seq=None, p2p_seq=2, kind=semconv.KIND_P2P, peer=1,
                      state=semconv.STATE_ISSUED)])
    b.hang(1, 1, stack=[("Net", "forward"), ("Net.tail", "forward")], collectives=[
        b.event_attrs("all_reduce", fqn="Net.tail", phase="forward", group=WORLD_GROUP,
                      ranks=range(2), seq=2, state=semconv.STATE_ISSUED)])
    hangs = [f for f in check(build_run(b.spans())).findings if f.kind == KIND_HANG]
    assert sorted((f.details.get("p2p") is not None, f.details["never_issued"])
                  for f in hangs) == [(False, [0]), (True, [1])], [f.message for f in hangs]
    for f in hangs:
        assert f.details["root"] is True, f.message
        assert f.details["deadlock"] == {"groups": [WORLD_GROUP], "ranks": [0, 1]}
        assert f.message.endswith(f"a deadlock: ranks 0, 1 wait for each other on group "
                                  f"{WORLD_GROUP}"), f.message


def test_a_posted_send_a_rank_went_past_makes_no_deadlock() -> None:
    """Rank 0 posts an isend to rank 1 (never waited yet: gloo reports it not
    completed) and goes on into an all_reduce on group {0, 2}, where rank 2, stuck in
    compute, never comes; rank 1 waits in an all_reduce on {0, 1} before its receive.
    Rank 2 is the cause: nothing is a deadlock (a review found the send taken for where
    rank 0 was blocked, and a cycle through it and group {0, 1} reported first)."""
    b = SpanBuilder(world=3, schema=3)
    g1, g2 = "1", "2"
    s0, s1, s2 = b.rank(0, 0), b.rank(1, 0), b.rank(2, 0)
    s0.coll("send", fqn="Net.pp", kind=semconv.KIND_P2P, peer=1, duration_ns=MS, ranks=range(3))
    s0.coll("all_reduce", fqn="Net.a", group=g2, ranks=(0, 2), duration_ns=MS)
    s0.coll("all_reduce", fqn="Net.b", group=g1, ranks=(0, 1), duration_ns=MS)
    s1.coll("all_reduce", fqn="Net.b", group=g1, ranks=(0, 1), duration_ns=MS)
    s1.coll("recv", fqn="Net.pp", kind=semconv.KIND_P2P, peer=0, duration_ns=MS, ranks=range(3))
    s2.coll("all_reduce", fqn="Net.a", group=g2, ranks=(0, 2), duration_ns=MS)
    r0 = b.rank(0, 1, finished=False)
    r0.coll("send", fqn="Net.pp", kind=semconv.KIND_P2P, peer=1, ranks=range(3))
    r0.coll("all_reduce", fqn="Net.a", group=g2, ranks=(0, 2))
    b.rank(1, 1, finished=False).coll("all_reduce", fqn="Net.b", group=g1, ranks=(0, 1))
    b.hang(0, 1, stack=[("Net", "forward"), ("Net.a", "forward")], collectives=[
        b.event_attrs("send", fqn="Net.pp", phase="forward", group=WORLD_GROUP,
                      ranks=range(3), seq=None, p2p_seq=2, kind=semconv.KIND_P2P, peer=1,
                      state=semconv.STATE_ISSUED),
        b.event_attrs("all_reduce", fqn="Net.a", phase="forward", group=g2, ranks=(0, 2),
                      seq=2, state=semconv.STATE_ISSUED)])
    b.hang(1, 1, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[
        b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=g1, ranks=(0, 1),
                      seq=2, state=semconv.STATE_ISSUED)])
    hangs = [f for f in check(build_run(b.spans())).findings if f.kind == KIND_HANG]
    assert not any("deadlock" in f.details for f in hangs), [f.message for f in hangs]
    assert hangs[0].group == g2 and hangs[0].details["root"] is True  # rank 2 first
    assert [f.details["root"] for f in hangs[1:]] == [False, False]
    group1 = next(f for f in hangs if f.group == g1)
    assert "it is itself waiting in `Net.a` forward all_reduce on group 2" in group1.message


def test_a_receive_from_any_source_does_not_hide_a_deadlock() -> None:
    """Ranks 0 and 1 enter group {0, 1} and the world in opposite orders (a deadlock);
    rank 2, waiting in the world's all_reduce, also posted a receive from any source on
    the world group. Its finding has no sequence number: it is not the world
    collectives' finding, which stays in the cycle (it replaced it, and no finding was
    the cause)."""
    b = SpanBuilder(world=3, schema=3)
    g1, world = "1", (0, 1, 2)
    for r in world:
        s = b.rank(r, 0)
        if r in (0, 1):
            s.coll("all_reduce", fqn="Net.a", group=g1, ranks=(0, 1), duration_ns=MS)
        s.coll("all_reduce", fqn="Net.b", ranks=world, duration_ns=MS)
    b.rank(0, 1, finished=False).coll("all_reduce", fqn="Net.a", group=g1, ranks=(0, 1))
    b.rank(1, 1, finished=False).coll("all_reduce", fqn="Net.b", ranks=world)
    b.rank(2, 1, finished=False).coll("all_reduce", fqn="Net.b", ranks=world)
    b.hang(0, 1, stack=[("Net", "forward"), ("Net.a", "forward")], collectives=[
        b.event_attrs("all_reduce", fqn="Net.a", phase="forward", group=g1, ranks=(0, 1),
                      seq=2, state=semconv.STATE_ISSUED)])
    on_world = b.event_attrs("all_reduce", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                             ranks=world, seq=2, state=semconv.STATE_ISSUED)
    b.hang(1, 1, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[on_world])
    b.hang(2, 1, stack=[("Net", "forward"), ("Net.b", "forward")], collectives=[
        on_world, b.event_attrs("recv", fqn="Net.b", phase="forward", group=WORLD_GROUP,
                                ranks=world, seq=None, kind=semconv.KIND_P2P, peer=None,
                                state=semconv.STATE_ISSUED)])
    hangs = [f for f in check(build_run(b.spans())).findings if f.kind == KIND_HANG]
    cycle = [f for f in hangs if "deadlock" in f.details]
    assert sorted(f.group for f in cycle) == [WORLD_GROUP, g1], [f.message for f in hangs]
    assert all(f.details["root"] and f.details["deadlock"]["ranks"] == [0, 1] for f in cycle)
