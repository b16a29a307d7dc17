"""Real multi-process runs: 4 gloo ranks on 127.0.0.1, spawned once for the whole module.

Each rank runs the scenarios of ``tests/_mp_scenarios.py`` (run ids, a TP MLP
stack and the TP toy Transformer with checkpointing for two ``mode.step(i)``
steps, plain c10d collectives and a send/recv ring), writing one JSONL file per
rank and scenario plus its in-process results. The tests read those files.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _spawn import run_ranks

from commspan import Aggregator, semconv
from commspan.exporters import SpanRecord, read_spans

pytestmark = pytest.mark.multiprocess

WORLD = 4
STEPS = 2
SCRIPT = Path(__file__).with_name("_mp_scenarios.py")
TP_SCENARIOS = ["tp_mlp", "tp_transformer"]
STEP_SCENARIOS = [*TP_SCENARIOS, "c10d"]
ENV_RUN_ID_VALUE = "mp-env-run-id"  # what _mp_scenarios.scenario_run_id sets


@dataclass
class MpRun:
    """Where the ranks wrote, how they ended and how long they took."""

    root: Path
    returncodes: list[int | None]
    logs: list[str]
    seconds: float

    def failure(self) -> str:
        """The log tails of the ranks that did not exit 0."""
        return "\n".join(
            f"--- rank {r} exit {rc}\n{self.logs[r][-4000:]}"
            for r, rc in enumerate(self.returncodes)
            if rc != 0
        )

    def result(self, scenario: str, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s in-process results of ``scenario``."""
        return json.loads((self.root / scenario / f"rank{rank}.result.json").read_text())

    def spans(self, scenario: str, rank: int) -> list[SpanRecord]:
        """Rank ``rank``'s spans of ``scenario``, read from its JSONL file."""
        return list(read_spans(self.root / scenario / f"trace-rank{rank}.jsonl"))


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory: pytest.TempPathFactory) -> MpRun:
    """Spawn the 4 ranks once; wait for all (killing the rest if one fails or time runs out)."""
    root = tmp_path_factory.mktemp("mp")
    t0 = time.monotonic()
    returncodes, logs = run_ranks(SCRIPT, [str(root)], root, WORLD, timeout_s=150)
    return MpRun(
        root,
        returncodes,
        logs,
        time.monotonic() - t0,
    )


@pytest.fixture()
def ok_run(mp_run: MpRun) -> MpRun:
    """The run, if every rank exited 0 (else the test fails with the ranks' logs)."""
    if any(rc != 0 for rc in mp_run.returncodes):
        pytest.fail(f"ranks failed:\n{mp_run.failure()}")
    return mp_run


def test_all_ranks_finished(mp_run: MpRun) -> None:
    """All 4 ranks ran every scenario and exited 0 within the time budget."""
    assert mp_run.returncodes == [0] * WORLD, mp_run.failure()
    assert mp_run.seconds < 120
    for r in range(WORLD):
        timings = json.loads((mp_run.root / f"timings-rank{r}.json").read_text())
        assert set(timings) == {"before_init", "run_id", *STEP_SCENARIOS}


def test_a_mode_entered_before_the_process_group_learns_its_rank(ok_run: MpRun) -> None:
    """``with CommSpanMode(): main()`` under ``mp.spawn`` (no ``RANK``; main calls
    ``init_process_group``): each rank writes its own file, its resource names its
    rank and the world, and all ranks share one run id. Every rank wrote to rank 0's
    file as rank 0 of 1, each with a run id of its own."""
    ids = set()
    for r in range(WORLD):
        spans = ok_run.spans("before_init", r)
        assert spans, r
        assert {(s.resource[semconv.RANK], s.resource[semconv.WORLD_SIZE])
                for s in spans} == {(r, WORLD)}
        assert {s.resource[semconv.RUN_ID] for s in spans} == {
            ok_run.result("before_init", r)["run_id"]}
        ids.add(ok_run.result("before_init", r)["run_id"])
        # the steps' collectives, all of them on this rank's file
        assert sum(1 for s in spans for _name, attrs in s.events
                   if semconv.COLL_OP in attrs) == 5 * STEPS
    assert len(ids) == 1


def test_run_id_agreed_without_env_and_taken_from_env(ok_run: MpRun) -> None:
    """Without env vars all ranks agree on one random run id; with COMMSPAN_RUN_ID they use it."""
    results = [ok_run.result("run_id", r) for r in range(WORLD)]
    agreed = {res["agreed"] for res in results}
    assert len(agreed) == 1 and len(agreed.pop()) >= 16
    assert {res["from_env"] for res in results} == {ENV_RUN_ID_VALUE}
    for scenario in STEP_SCENARIOS:
        ids = {ok_run.result(scenario, r)["run_id"] for r in range(WORLD)}
        assert len(ids) == 1, scenario
        resource_ids = {
            s.resource[semconv.RUN_ID] for r in range(WORLD) for s in ok_run.spans(scenario, r)
        }
        assert resource_ids == ids, scenario


@pytest.mark.parametrize("scenario", TP_SCENARIOS)
def test_tp_counts_equal_across_ranks(ok_run: MpRun, scenario: str) -> None:
    """Tensor parallelism issues the same collectives on every rank: per-rank counts are equal."""
    per_rank = [Aggregator.from_jsonl(ok_run.root / scenario, rank=r) for r in range(WORLD)]
    first = per_rank[0].module_counts()
    assert first["Global"]["forward"]["all_reduce"] > 0
    assert first["Global"]["backward"]["all_reduce"] > 0
    for r, agg in enumerate(per_rank):
        assert agg.module_counts() == first, r
        assert agg.collectives() == per_rank[0].collectives(), r
    losses = {tuple(ok_run.result(scenario, r)["losses"]) for r in range(WORLD)}
    assert len(losses) == 1


@pytest.mark.parametrize("scenario", STEP_SCENARIOS)
def test_jsonl_matches_each_ranks_in_process_aggregator(ok_run: MpRun, scenario: str) -> None:
    """from_jsonl(dir, rank=r) reproduces rank r's live aggregator in every view."""
    for r in range(WORLD):
        live = ok_run.result(scenario, r)
        offline = Aggregator.from_jsonl(ok_run.root / scenario, rank=r)
        assert offline.module_counts() == live["module_counts"]
        assert offline.comm_counts() == live["comm_counts"]
        assert offline.parameter_info() == live["parameter_info"]
        assert offline.sharding_info() == live["sharding_info"]
        assert [list(vars(s).values()) for s in offline.collectives()] == live["collectives"]
        assert offline.table(1) == live["table"]
        if "stats" in live:
            assert live["stats"]["spans_dropped"] == live["stats"]["spans_failed"] == 0


@pytest.mark.parametrize("scenario", STEP_SCENARIOS)
def test_steps_are_shared_traces(ok_run: MpRun, scenario: str) -> None:
    """Step i of all ranks is one trace: one commspan.step root, every rank's rank span under it."""
    n_steps = STEPS if scenario in TP_SCENARIOS else 1
    traces: dict[str, list[tuple[int, SpanRecord]]] = defaultdict(list)
    for r in range(WORLD):
        for s in ok_run.spans(scenario, r):
            traces[s.trace_id].append((r, s))
    assert len(traces) == n_steps
    steps_seen = set()
    for trace_id, spans in traces.items():
        roots = [(r, s) for r, s in spans if s.name == semconv.SPAN_STEP]
        assert len(roots) == 1, trace_id
        root_rank, root = roots[0]
        assert root_rank == 0 and root.parent_span_id == ""
        step = root.attributes[semconv.STEP]
        steps_seen.add(step)
        rank_spans = {r: s for r, s in spans if s.name == semconv.SPAN_RANK}
        assert sorted(rank_spans) == list(range(WORLD))
        for r, rank_span in rank_spans.items():
            assert rank_span.parent_span_id == root.span_id
            assert rank_span.attributes[semconv.RANK] == r
            assert rank_span.attributes[semconv.STEP] == step
            assert rank_span.attributes[semconv.MODULE_FQN] == semconv.GLOBAL_FQN
        by_id = {(r, s.span_id): s for r, s in spans}
        for r, s in spans:
            if s.name in (semconv.SPAN_STEP, semconv.SPAN_RANK):
                continue
            cur = s
            while cur.name != semconv.SPAN_RANK:
                cur = by_id[(r, cur.parent_span_id)]
            assert cur is rank_spans[r]
    assert steps_seen == set(range(n_steps))


def test_c10d_collectives_recorded_on_their_module(ok_run: MpRun) -> None:
    """Each c10d collective the module issues is one event of its span, on the whole group."""
    expected = {
        "all_reduce",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
    }
    for r in range(WORLD):
        ops_span = [s for s in ok_run.spans("c10d", r) if s.name == "Comms.ops forward"]
        assert len(ops_span) == 1
        events = ops_span[0].events
        assert sorted(name for name, _ in events) == sorted(expected)
        for _name, attrs in events:
            assert attrs[semconv.COLL_KIND] == semconv.KIND_COLLECTIVE
            assert attrs[semconv.PG_SIZE] == WORLD
            assert attrs[semconv.PG_RANKS] == list(range(WORLD))
            assert attrs[semconv.MODULE_FQN] == "Comms.ops"
            assert attrs[semconv.PHASE] == "forward"
        assert ok_run.result("c10d", r)["module_counts"]["Comms.ops"] == {
            "forward": {op: 1 for op in expected}
        }


def test_p2p_events_name_their_peer(ok_run: MpRun) -> None:
    """send/recv are p2p events of Comms.ring with the peer rank of the ring."""
    for r in range(WORLD):
        ring = [s for s in ok_run.spans("c10d", r) if s.name == "Comms.ring forward"]
        assert len(ring) == 1
        events = {name: attrs for name, attrs in ring[0].events}
        assert set(events) == {"send", "recv"}
        assert events["send"][semconv.COLL_KIND] == semconv.KIND_P2P
        assert events["recv"][semconv.COLL_KIND] == semconv.KIND_P2P
        assert events["send"][semconv.COLL_PEER] == (r + 1) % WORLD
        assert events["recv"][semconv.COLL_PEER] == (r - 1) % WORLD
        counts = Aggregator.from_jsonl(ok_run.root / "c10d", rank=r).module_counts()
        assert counts["Comms.ring"] == {"forward": {"send": 1, "recv": 1}}


def test_subgroup_p2p_peer_is_a_global_rank(ok_run: MpRun) -> None:
    """send/recv in a subgroup of ranks 2 and 3 name the peer by global rank, like commspan.rank."""
    sender, receiver = 2, 3
    for r, op, peer in ((sender, "send", receiver), (receiver, "recv", sender)):
        sub = [s for s in ok_run.spans("c10d", r) if s.name == "Comms.sub forward"]
        assert len(sub) == 1
        events = {name: attrs for name, attrs in sub[0].events}
        assert set(events) == {op}
        assert events[op][semconv.PG_RANKS] == [sender, receiver]
        assert events[op][semconv.PG_SIZE] == 2
        assert events[op][semconv.COLL_PEER] == peer
    for r in (0, 1):
        sub = [s for s in ok_run.spans("c10d", r) if s.name == "Comms.sub forward"]
        assert len(sub) == 1 and sub[0].events == []
