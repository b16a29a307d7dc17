"""commspan.render.perfetto: the Chrome Trace Event Format of a real 4-rank run, checked by rule.

The rules checked (Trace Event Format document, and how Perfetto's JSON importer reads it):
every event has ph, pid, tid and ts in microseconds; complete events ("X") have dur >= 0;
the slices of one thread nest (no partial overlap), as decoded by both truncating and
rounding readers; each process and thread used is named by metadata; flow events v2
(bind_id with flow_out / flow_in) start once, end once, in time order, and one id
joins exactly the events of one collective (group, seq).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from _example_run import RANKS, example_run

from commspan import semconv
from commspan.analysis.timeline import build_timeline, load_records
from commspan.exporters import SpanRecord
from commspan.render.perfetto import chrome_trace, write_chrome_trace

STEPS = 3


def _ns(value: float, rounding: str) -> int:
    scaled = value * 1000.0
    return int(scaled) if rounding == "trunc" else int(math.floor(scaled + 0.5))


def problems(trace: dict[str, Any]) -> list[str]:
    """Every rule of the format the trace breaks (empty when it is valid)."""
    out: list[str] = []
    if not isinstance(trace.get("traceEvents"), list):
        return ["no traceEvents list"]
    if trace.get("displayTimeUnit") not in ("ms", "ns"):
        out.append(f"displayTimeUnit {trace.get('displayTimeUnit')!r}")
    events = trace["traceEvents"]
    named_pids: set[int] = set()
    named_tids: set[tuple[int, int]] = set()
    used: set[tuple[int, int]] = set()
    slices: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    flows: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for i, e in enumerate(events):
        missing = [key for key in ("ph", "pid", "tid", "ts") if key not in e]
        if missing:
            out.append(f"event {i} has no {', '.join(missing)}: {e}")
            continue
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            out.append(f"event {i}: pid/tid not integers")
        if not isinstance(e.get("ts"), (int, float)) or e.get("ts", -1) < 0:
            out.append(f"event {i}: ts {e.get('ts')!r} is not a time in us")
        ph = e.get("ph")
        if ph == "M":
            if e["name"] == "process_name":
                named_pids.add(e["pid"])
            elif e["name"] == "thread_name":
                named_tids.add((e["pid"], e["tid"]))
            continue
        if ph in ("B", "E"):
            out.append(f"event {i}: B/E events are not used; X events are")
        if ph != "X":
            out.append(f"event {i}: unexpected phase {ph!r}")
            continue
        if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
            out.append(f"event {i}: X without dur >= 0")
            continue
        used.add((e["pid"], e["tid"]))
        slices[(e["pid"], e["tid"])].append(e)
        if "bind_id" in e:
            flows[e["bind_id"]].append(e)
    for pid, tid in used:
        if pid not in named_pids:
            out.append(f"pid {pid} has no process_name")
        if (pid, tid) not in named_tids:
            out.append(f"pid {pid} tid {tid} has no thread_name")
    for rounding in ("trunc", "round"):
        for key, items in slices.items():
            spans = sorted(
                ((_ns(e["ts"], rounding), _ns(e["ts"], rounding) + _ns(e["dur"], rounding))
                 for e in items),
                key=lambda se: (se[0], -se[1]),
            )
            stack: list[int] = []
            for start, end in spans:
                while stack and stack[-1] <= start:
                    stack.pop()
                if stack and end > stack[-1]:
                    out.append(f"{key}: slice {start}-{end} overlaps its parent ending "
                               f"{stack[-1]} ({rounding})")
                stack.append(end)
    for fid, members in flows.items():
        # in file order: a reader binds a flow's steps to the start it has seen
        kinds = [(bool(e.get("flow_in")), bool(e.get("flow_out"))) for e in members]
        expected = [(False, True)] + [(True, True)] * (len(members) - 2) + [(True, False)]
        if len(members) < 2 or kinds != expected:
            out.append(f"flow {fid}: in/out marks {kinds} are not start, steps, end")
        if len({(e["args"].get("group"), e["args"].get("seq")) for e in members}) != 1:
            out.append(f"flow {fid} joins different collectives")
        if len({e["pid"] for e in members}) != len(members):
            out.append(f"flow {fid} visits a rank twice")
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return example_run(tmp_path_factory, STEPS, "--no-timing")  # collectives without widths


@pytest.fixture(scope="module")
def records(run_dir: Path) -> list[SpanRecord]:
    return load_records(run_dir)


@pytest.fixture(scope="module")
def trace(records: list[SpanRecord]) -> dict[str, Any]:
    return chrome_trace(records)


def _x(trace: dict[str, Any], cat: str | None = None) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


@pytest.mark.multiprocess
def test_trace_follows_the_format_rules(trace: dict[str, Any]) -> None:
    """The trace of a real 4-rank run breaks none of the format's rules."""
    assert problems(trace) == []
    assert trace["displayTimeUnit"] == "ms"
    json.dumps(trace)  # plain JSON


@pytest.mark.multiprocess
def test_one_process_per_rank(trace: dict[str, Any], records: list[SpanRecord]) -> None:
    """pid is the rank: named 'rank N', sorted by rank, and every slice's rank arg is its pid."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(RANKS)}
    sort = {e["pid"]: e["args"]["sort_index"] for e in trace["traceEvents"]
            if e["name"] == "process_sort_index"}
    assert sort == {r: r for r in range(RANKS)}
    for e in _x(trace):
        assert e["args"]["rank"] == e["pid"]
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    # "gc" when a rank recorded a pause of the garbage collector
    assert lanes - {"gc"} == {"steps", "forward", "backward", "recompute", "collectives"}
    pids = {r.rank for r in records}
    assert pids == set(names)


@pytest.mark.multiprocess
def test_every_module_span_and_collective_is_a_slice(
    trace: dict[str, Any], records: list[SpanRecord]
) -> None:
    """Module spans become X slices on their phase's lane, with fqn, phase, type and step."""
    modules = [r for r in records
               if semconv.MODULE_FQN in r.attributes and r.name != semconv.SPAN_RANK]
    slices = [e for e in _x(trace) if e["cat"] in {p.value for p in semconv.Phase}]
    assert len(slices) == len(modules)
    lane = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["name"] == "thread_name"}
    want = Counter((r.rank, r.attributes[semconv.MODULE_FQN], r.attributes[semconv.PHASE])
                   for r in modules)
    got = Counter((e["pid"], e["args"]["fqn"], e["args"]["phase"]) for e in slices)
    assert got == want
    for e in slices:
        assert lane[(e["pid"], e["tid"])] == e["cat"] == e["args"]["phase"]
        assert e["args"]["fqn"].endswith(e["name"])
        assert e["args"]["step"] in range(STEPS)
    # µs, from the earliest record: the first rank span starts at ts ~0
    origin = trace["otherData"]["time_origin_unix_ns"]
    first = min(r.start_time for r in records if r.name == semconv.SPAN_RANK)
    steps = _x(trace, "step")
    assert min(e["ts"] for e in steps) == pytest.approx((first - origin) / 1000, abs=0.001)
    wo = next(r for r in modules if r.attributes[semconv.MODULE_FQN].endswith("attention.wo"))
    match = [e for e in slices if e["pid"] == wo.rank and e["args"]["fqn"] == wo.attributes[
        semconv.MODULE_FQN] and _ns(e["ts"], "round") == wo.start_time - origin]
    assert len(match) == 1
    assert _ns(match[0]["dur"], "round") == wo.end_time - wo.start_time


@pytest.mark.multiprocess
def test_collectives_carry_op_group_seq_bytes_and_placements(
    trace: dict[str, Any], records: list[SpanRecord]
) -> None:
    """Collective slices sit at their issue time, zero-wide (no duration recorded), with args."""
    events = [(r.rank, t, ev) for r in records for (_, ev), t in zip(r.events, r.event_times)
              if semconv.COLL_OP in ev]
    colls = _x(trace, "collective")
    assert len(colls) == len(events)
    origin = trace["otherData"]["time_origin_unix_ns"]
    by_key = {(e["pid"], e["args"]["group"], e["args"]["seq"]): e for e in colls}
    for rank, t, ev in events:
        e = by_key[(rank, ev[semconv.PG_NAME], ev[semconv.COLL_SEQ])]
        assert e["name"] == e["args"]["op"] == ev[semconv.COLL_OP]
        assert e["args"]["bytes"] == ev[semconv.TENSOR_BYTES]
        assert e["args"]["fqn"] == ev[semconv.MODULE_FQN]
        assert _ns(e["ts"], "round") == t - origin
        assert e["dur"] == 0 and "duration_ns" not in e["args"]
        if semconv.REDIST_SRC in ev:
            want = f"{ev[semconv.REDIST_SRC]} -> {ev[semconv.REDIST_DST]}"
            assert e["args"]["placements"] == want
    assert any("placements" in e["args"] for e in colls)
    assert trace["otherData"]["collectives_with_duration"] == 0


@pytest.mark.multiprocess
def test_flows_join_each_collective_across_ranks(trace: dict[str, Any]) -> None:
    """One flow id per (group, seq), through all 4 ranks in issue order, ids never reused."""
    colls = _x(trace, "collective")
    ids: dict[tuple[str, int], set[int]] = defaultdict(set)
    for e in colls:
        ids[(e["args"]["group"], e["args"]["seq"])].add(e["bind_id"])
    assert all(len(v) == 1 for v in ids.values())
    flat = [next(iter(v)) for v in ids.values()]
    assert len(set(flat)) == len(flat)  # unique per collective
    per_id = Counter(e["bind_id"] for e in colls)
    assert set(per_id.values()) == {RANKS}
    for fid in per_id:
        chain = sorted((e for e in colls if e["bind_id"] == fid), key=lambda e: e["ts"])
        assert "flow_in" not in chain[0] and chain[0]["flow_out"] is True
        assert chain[-1]["flow_in"] is True and "flow_out" not in chain[-1]


def test_a_flow_starts_first_in_the_file_when_ranks_issue_at_the_same_time(
    records: list[SpanRecord],
) -> None:
    """Two ranks issuing a collective at the same nanosecond, the later in the flow's
    chain with the longer duration (written first, as the outer slice): the flow's
    start still comes first in the file."""
    timed = []
    t0 = min(r.start_time for r in records)
    for r in records:  # each collective issued at the same ns on every rank
        times = [t0 + 10_000_000 * (int(ev.get(semconv.COLL_SEQ) or 0) + 1)
                 if semconv.COLL_OP in ev else t
                 for (_name, ev), t in zip(r.events, r.event_times)]
        events = [(name, {**ev, semconv.COLL_DURATION_NS: 1000 * (r.rank or 0) + 1000}
                   if semconv.COLL_OP in ev else ev) for name, ev in r.events]
        timed.append(dataclasses.replace(r, events=events, event_times=times))
    trace = chrome_trace(timed)
    ties = Counter((e["ts"], e["bind_id"]) for e in _x(trace, "collective") if "bind_id" in e)
    assert max(ties.values()) > 1  # the situation is there
    assert problems(trace) == []


@pytest.mark.multiprocess
def test_step_markers_per_rank(trace: dict[str, Any]) -> None:
    """Each rank has one 'step N' slice per step on its steps lane, enclosing its module spans."""
    steps = _x(trace, "step")
    assert Counter(e["pid"] for e in steps) == {r: STEPS for r in range(RANKS)}
    assert {e["name"] for e in steps} == {f"step {i}" for i in range(STEPS)}
    for e in _x(trace):
        if e["cat"] in ("forward", "backward", "recompute"):
            marker = next(s for s in steps if s["pid"] == e["pid"]
                          and s["args"]["step"] == e["args"]["step"])
            assert marker["ts"] <= e["ts"] and e["ts"] + e["dur"] <= marker["ts"] + marker["dur"]


@pytest.mark.multiprocess
def test_recorded_durations_widen_collectives(records: list[SpanRecord]) -> None:
    """With commspan.collective.duration_ns on the events, collectives are slices that wide."""
    timed = []
    for r in records:
        events = [
            (name, {**ev, semconv.COLL_DURATION_NS: 5000 + 10 * i} if semconv.COLL_OP in ev else ev)
            for i, (name, ev) in enumerate(r.events)
        ]
        timed.append(dataclasses.replace(r, events=events))
    trace = chrome_trace(timed)
    assert problems(trace) == []
    colls = _x(trace, "collective")
    assert colls and all(_ns(e["dur"], "round") == e["args"]["duration_ns"] >= 5000 for e in colls)
    assert trace["otherData"]["collectives_with_duration"] == len(colls)


@pytest.mark.multiprocess
def test_garbage_collections_are_slices_on_a_gc_lane(records: list[SpanRecord]) -> None:
    """A commspan.gc event on rank 1's rank span is a slice on that rank's gc lane, as
    long as the pause, named after its generation, with the module it names."""
    def without_gc(r: SpanRecord) -> SpanRecord:  # the run's own pauses, if any
        kept = [(e, t) for e, t in zip(r.events, r.event_times) if e[0] != semconv.EVENT_GC]
        return dataclasses.replace(r, events=[e for e, _ in kept],
                                   event_times=[t for _, t in kept])

    plain = [without_gc(r) for r in records]
    rank_span = next(r for r in plain if r.name == semconv.SPAN_RANK and r.rank == 1)
    start = rank_span.start_time + 2_000_000
    pause = {semconv.GC_GENERATION: 2, semconv.GC_DURATION_NS: 3_000_000,
             semconv.GC_COLLECTED: 5, semconv.MODULE_FQN: "Transformer.layers.0",
             semconv.PHASE: "forward"}
    with_gc = [
        dataclasses.replace(r, events=[*r.events, (semconv.EVENT_GC, pause)],
                            event_times=[*r.event_times, start])
        if r is rank_span else r
        for r in plain
    ]
    trace = chrome_trace(with_gc)
    assert problems(trace) == []
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    (gc_slice,) = [e for e in _x(trace, "gc") if lanes[(e["pid"], e["tid"])] == "gc"]
    assert (gc_slice["pid"], gc_slice["name"]) == (1, "gc gen 2")
    assert _ns(gc_slice["dur"], "round") == 3_000_000
    origin = trace["otherData"]["time_origin_unix_ns"]
    assert abs(_ns(gc_slice["ts"], "round") - (start - origin)) <= 1
    assert gc_slice["args"]["module"] == "Transformer.layers.0"
    assert _x(chrome_trace(plain), "gc") == []


@pytest.mark.multiprocess
def test_overlapping_spans_go_to_an_overflow_lane(records: list[SpanRecord]) -> None:
    """A backward span stretched past its parent's end is drawn on 'backward #2'; lanes nest."""
    victim = next(r for r in records if r.name.endswith("attention.wo backward") and r.rank == 2)
    parent = next(r for r in records if r.span_id == victim.parent_span_id)
    stretched = [
        dataclasses.replace(r, end_time=parent.end_time + 1000) if r is victim else r
        for r in records
    ]
    trace = chrome_trace(stretched)
    assert problems(trace) == []
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    overflow = [e for e in _x(trace) if lanes[(e["pid"], e["tid"])] == "backward #2"]
    assert [(e["pid"], e["args"]["fqn"]) for e in overflow] == [
        (2, victim.attributes[semconv.MODULE_FQN])
    ]


def test_checker_catches_broken_traces() -> None:
    """The rule checker itself fails on partial overlap, missing names, unpaired flows, no ts."""
    def x(ts: float, dur: float, tid: int = 1, **extra: Any) -> dict[str, Any]:
        return {"name": "s", "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur,
                "args": {"group": "0", "seq": 1}, **extra}

    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0, "args": {}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "ts": 0, "args": {}}]
    good = {"traceEvents": [*meta, x(0, 10), x(2, 3)], "displayTimeUnit": "ms"}
    assert problems(good) == []
    assert any("overlaps" in p for p in problems(
        {"traceEvents": [*meta, x(0, 10), x(5, 10)], "displayTimeUnit": "ms"}))
    assert any("thread_name" in p for p in problems(
        {"traceEvents": [*meta, x(0, 1, tid=2)], "displayTimeUnit": "ms"}))
    assert any("flow" in p for p in problems(
        {"traceEvents": [*meta, x(0, 1, bind_id=1, flow_out=True)], "displayTimeUnit": "ms"}))
    no_ts = x(0, 1)
    del no_ts["ts"]
    assert any("no ts" in p for p in problems({"traceEvents": [*meta, no_ts],
                                               "displayTimeUnit": "ms"}))
    # plain ns / 1000 floats: a child ending with its parent pokes out once a reader truncates
    parent, child = (131383004, 426911), (131723553, 86362)  # both end at 131809915 ns
    naive = [x(parent[0] / 1000, parent[1] / 1000), x(child[0] / 1000, child[1] / 1000)]
    assert any("(trunc)" in p for p in problems({"traceEvents": [*meta, *naive],
                                                 "displayTimeUnit": "ms"}))


def test_times_survive_truncating_and_rounding_readers() -> None:
    """The writer's microseconds decode to the exact nanosecond, truncated or rounded."""
    from commspan.render.perfetto import _us

    for ns in (0, 1, 999, 131383004, 131809915, 86362, 10**11 + 7, 3 * 10**12 + 1):
        assert _ns(_us(ns), "trunc") == ns == _ns(_us(ns), "round")


@pytest.mark.multiprocess
def test_write_chrome_trace_plain_and_gzip(records: list[SpanRecord], tmp_path: Path) -> None:
    """The writer writes the same JSON, gzip-compressed for a .gz name; directories are made."""
    plain = write_chrome_trace(records, tmp_path / "a" / "trace.json")
    packed = write_chrome_trace(build_timeline(records), tmp_path / "trace.json.gz")
    first = json.loads(plain.read_bytes())
    second = json.loads(gzip.decompress(packed.read_bytes()))
    assert first["traceEvents"] == second["traceEvents"]
    assert packed.stat().st_size < plain.stat().st_size / 4
    with pytest.raises(TypeError, match="out_path"):
        write_chrome_trace(records, 3)  # type: ignore[arg-type]


def test_empty_input_is_an_empty_trace(tmp_path: Path) -> None:
    """No records: a valid trace without events; a missing directory is a clear error."""
    assert problems(chrome_trace([])) == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        chrome_trace(tmp_path / "missing")


def test_a_step_number_used_twice_keeps_every_span_inside_the_trace(tmp_path: Path) -> None:
    """Two epochs each counting steps from 0 (commspan warns; readers add them up): every
    slice starts at or after the trace's origin, each step slice holds its module
    spans, and the overlapping windows of the repeated numbers are on lanes of their
    own: the trace follows the format."""
    import time
    import warnings

    import torch

    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path / "rank0.jsonl")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mode:
            for _epoch in range(2):
                for i in range(2):
                    with mode.step(i):
                        net(torch.ones(1, 2))
                        time.sleep(0.005)
    mode.shutdown()
    trace = chrome_trace(load_records(tmp_path))
    assert problems(trace) == []
    xs = _x(trace)
    assert min(e["ts"] for e in xs) >= 0
    steps = _x(trace, "step")
    for e in xs:
        if e["cat"] == "forward":
            assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]
                       and s["args"]["step"] == e["args"]["step"] for s in steps)


@pytest.mark.multiprocess
def test_flows_stay_within_a_step_when_two_jobs_share_a_run_id(
    records: list[SpanRecord],
) -> None:
    """A second job under the same run id (a fixed run id, resumed at step 3) numbers
    its collectives from 1 again: a flow joins one collective of one step, never a
    collective of job 1 with one of job 2."""
    shift = max(r.end_time for r in records) - min(r.start_time for r in records) + 10**9
    second = []
    for r in records:
        attrs = dict(r.attributes)
        if isinstance(attrs.get(semconv.STEP), int):
            attrs[semconv.STEP] += STEPS
        second.append(dataclasses.replace(
            r, trace_id="f" + r.trace_id[1:] if r.trace_id[0] != "f" else "e" + r.trace_id[1:],
            attributes=attrs, start_time=r.start_time + shift, end_time=r.end_time + shift,
            event_times=[t + shift for t in r.event_times]))
    trace = chrome_trace(records + second)
    assert problems(trace) == []
    colls = [e for e in _x(trace, "collective") if "bind_id" in e]
    for fid in {e["bind_id"] for e in colls}:
        assert len({e["args"]["step"] for e in colls if e["bind_id"] == fid}) == 1
