"""Owners of FSDP2 and DDP collectives on real gloo ranks: 2 ranks, spawned once.

Each rank runs ``tests/_mp_ownership_scenarios.py`` (FSDP2 on issue 10's
model; DDP with small buckets, plain, with a recording comm hook, and with
``find_unused_parameters``; a two-stage pipeline, GPipe and 1F1B) and writes
one JSONL file per scenario plus its in-process results and reference facts.
The references never use commspan's attribution: FSDP units from the sizes of
their parameters before sharding, DDP buckets from what a comm hook saw
(``GradBucket.index()`` and ``.parameters()``) or from the order the reducer
launches them, pipeline ops from the stage's own buffers (which microbatch's
receive buffer or forward output a tensor is) and from the schedule (every
microbatch's activations go forward once and its gradients back once; with
an interleaved schedule, four stages on the two ranks, through every stage).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _spawn import run_ranks

from commspan import Aggregator, semconv
from commspan.exporters import SpanRecord, read_spans

pytestmark = pytest.mark.multiprocess

WORLD = 2
SCRIPT = Path(__file__).with_name("_mp_ownership_scenarios.py")
SCENARIOS = ["fsdp", "ddp", "ddp_hook", "ddp_unused", "ddp_cascade", "ddp_compiled",
             "ddp_nested", "ddp_resized", "ddp_forward", "ddp_tp",
             "pp_gpipe", "pp_1f1b", "pp_interleaved"]
PIPELINES = ["pp_gpipe", "pp_1f1b"]
MICROBATCHES = 4
STEPS = 2
STAGE = ["Sequential", "Sequential"]  # each rank's stage module: a slice of one Sequential
DDP = "DistributedDataParallel"
WRAPPED = f"{DDP}.module"


@dataclass
class MpRun:
    root: Path
    returncodes: list[int | None]
    logs: list[str]

    def result(self, scenario: str, rank: int) -> dict[str, Any]:
        return json.loads((self.root / scenario / f"rank{rank}.result.json").read_text())

    def spans(self, scenario: str, rank: int) -> list[SpanRecord]:
        return list(read_spans(self.root / scenario / f"trace-rank{rank}.jsonl"))

    def collectives(self, scenario: str, rank: int) -> list[tuple[str, int, dict[str, Any]]]:
        """(fqn of the span holding it, time, attributes) of each collective, in time order."""
        out = []
        for span in self.spans(scenario, rank):
            for (_, attrs), when in zip(span.events, span.event_times):
                if semconv.COLL_OP in attrs:
                    out.append((str(span.attributes.get(semconv.MODULE_FQN)), when, attrs))
        return sorted(out, key=lambda item: item[1])


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory: pytest.TempPathFactory) -> MpRun:
    """Spawn the ranks once; wait for all (killing the rest if one fails or time runs out)."""
    root = tmp_path_factory.mktemp("mp-ownership")
    return MpRun(root, *run_ranks(SCRIPT, [str(root)], root, WORLD, timeout_s=150))


@pytest.fixture()
def ok_run(mp_run: MpRun) -> MpRun:
    """The run, if every rank exited 0 (else the test fails with the ranks' logs)."""
    if any(rc != 0 for rc in mp_run.returncodes):
        logs = "\n".join(f"--- rank {r}\n{log[-4000:]}" for r, log in enumerate(mp_run.logs))
        pytest.fail(f"ranks failed:\n{logs}")
    return mp_run


def _ancestors(fqn: str, ran: set[str]) -> list[str]:
    out = [fqn]
    head = fqn
    while "." in head:
        head = head.rsplit(".", 1)[0]
        if head in ran:
            out.append(head)
    return out


def _add(counts: dict[str, dict[str, dict[str, int]]], fqn: str, phase: str, op: str) -> None:
    slot = counts.setdefault(fqn, {}).setdefault(phase, {})
    slot[op] = slot.get(op, 0) + 1


# ------------------------------------------------------------------ FSDP2
@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_owner_phase_and_counts_match_the_size_reference(ok_run: MpRun, rank: int) -> None:
    """On gloo, every FSDP2 collective names the unit whose parameters it moves
    (the unit with that padded size), its kind and phase (forward for gathers
    before the step's backward() call, backward after), and the table counts it
    for that unit, its enclosing modules and Global: in process and from JSONL."""
    res = ok_run.result("fsdp", rank)
    root = res["root"]
    assert root == "FSDPNet"  # fully_shard renamed the class; commspan names the unit so
    units = {(root + "." + rel if rel else root): tuple(v) for rel, v in res["units"].items()}
    blocks = {f"{root}.blocks.{i}{sub}" for i in (0, 1) for sub in ("", ".a", ".b")}
    ran = {root, f"{root}.head"} | blocks
    steps = res["steps"]
    expected: dict[str, dict[str, dict[str, int]]] = {}
    n = 0
    for _, when, attrs in ok_run.collectives("fsdp", rank):
        op = attrs[semconv.COLL_OP]
        elements = attrs[semconv.TENSOR_BYTES] // 4
        full = elements * WORLD if op.startswith("all_gather") else elements
        (unit,) = [u for u, (padded, _) in units.items() if padded == full]
        step = max(i for i, (t_forward, _) in enumerate(steps) if t_forward <= when)
        backward = when >= steps[step][1]
        kind = "unshard" if op.startswith("all_gather") else "reduce_grad"
        phase = "backward" if backward or kind == "reduce_grad" else "forward"
        assert (attrs[semconv.OWNER_FQN], attrs[semconv.OWNER_KIND], attrs[semconv.PHASE]) == (
            unit, kind, phase)
        assert attrs[semconv.OWNER_PARAMS] == units[unit][1]
        assert attrs[semconv.OWNER_BYTES] == full * 4
        for fqn in [*_ancestors(unit, ran), semconv.GLOBAL_FQN]:
            _add(expected, fqn, phase, op)
        n += 1
    assert n == 16  # per step: 3 forward gathers, 2 backward re-gathers, 3 reduce-scatters
    live = {f: c for f, c in res["module_counts"].items() if c}
    offline = Aggregator.from_jsonl(ok_run.root / "fsdp", rank=rank)
    assert live == expected
    assert {f: c for f, c in offline.module_counts().items() if c} == expected
    assert offline.table(0) == res["table"]
    assert res["stats"]["internal_errors"] == 0


def test_fsdp_straggler_is_charged_to_the_unit_it_delayed(ok_run: MpRun) -> None:
    """The last rank sleeps as its backward starts: the collective the others then wait
    for longest (found from the durations alone) is a unit's all-gather, the unit
    named by its size; commspan stragglers names that rank and that unit, in backward,
    in each step, not the module the all-gather was issued from (blocks.1's backward
    prefetches blocks.0's parameters)."""
    from commspan.analysis import stragglers

    res = ok_run.result("fsdp_straggler", 0)
    root = res["root"]
    by_size = {padded: (root + "." + rel if rel else root) for rel, padded in res["units"].items()}
    # per step, the collective with the largest spread of durations across the ranks
    events: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for rank in range(WORLD):
        for span in ok_run.spans("fsdp_straggler", rank):
            for _, attrs in span.events:
                if semconv.COLL_OP in attrs:
                    step = _step_of(ok_run, "fsdp_straggler", rank, span.trace_id)
                    events.setdefault((step, attrs[semconv.COLL_SEQ]), {})[rank] = attrs
    slowest: dict[int, tuple[int, dict[str, Any]]] = {}
    for (step, _seq), per_rank in events.items():
        spread = (max(a[semconv.COLL_DURATION_NS] for a in per_rank.values())
                  - min(a[semconv.COLL_DURATION_NS] for a in per_rank.values()))
        if step not in slowest or spread > slowest[step][0]:
            slowest[step] = (spread, per_rank[0])
    expected = set()
    for step, (spread, attrs) in slowest.items():
        assert attrs[semconv.COLL_OP].startswith("all_gather") and spread > 0.2e9
        unit = by_size[attrs[semconv.TENSOR_BYTES] // 4 * WORLD]
        expected.add((step, unit, "backward", WORLD - 1))
    rows = stragglers(ok_run.root / "fsdp_straggler").stragglers
    top = {(r.step, r.fqn, r.phase, r.rank) for r in rows
           if r.max_wait_ns > 0.2e9}
    assert top == expected and len(expected) == 2


def _step_of(run: MpRun, scenario: str, rank: int, trace_id: str) -> int:
    for span in run.spans(scenario, rank):
        if span.trace_id == trace_id and semconv.STEP in span.attributes:
            return int(span.attributes[semconv.STEP])
    raise AssertionError(f"no step span in trace {trace_id}")


# ------------------------------------------------------------------ DDP
def _lowest_common_module(param_names: list[str]) -> str:
    """The deepest module path that contains every parameter ('' = the wrapped model)."""
    paths = [n.split(".")[:-1] for n in param_names]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _module_name(path: str) -> str:
    return WRAPPED + ("." + path if path else "")


def _bucket_events(run: MpRun, scenario: str, rank: int) -> list[dict[str, Any]]:
    return [a for _, _, a in run.collectives(scenario, rank)
            if a.get(semconv.OWNER_KIND) == "bucket"]


@pytest.mark.parametrize("scenario", ["ddp_hook", "ddp_compiled"])
@pytest.mark.parametrize("rank", range(WORLD))
def test_ddp_bucket_all_reduces_match_the_comm_hook(
    ok_run: MpRun, rank: int, scenario: str
) -> None:
    """Each bucket all-reduce names the bucket a comm hook saw (index), is owned by the
    lowest module holding all its parameters and lists their number and modules; also
    under ``torch.compile(ddp)`` (whose wrapper's forward is the one commspan sees)."""
    hook = ok_run.result(scenario, rank)["hook"]
    events = _bucket_events(ok_run, scenario, rank)
    assert len(events) == len(hook) == 7  # step 0: one bucket; after the rebuild: three
    for attrs, (index, params) in zip(events, hook):
        assert attrs[semconv.DDP_BUCKET_INDEX] == index
        assert attrs[semconv.OWNER_FQN] == _module_name(_lowest_common_module(params))
        assert attrs[semconv.OWNER_PARAMS] == len(params)
        modules = sorted({_module_name(p.rsplit(".", 1)[0]) for p in params})
        assert sorted(attrs[semconv.DDP_BUCKET_MODULES]) == modules
        assert attrs[semconv.PHASE] == "backward"
        assert attrs[semconv.OWNER_SOURCE] == "ddp"


@pytest.mark.parametrize("rank", range(WORLD))
def test_ddp_of_a_tensor_parallel_model_owns_buckets_by_module(ok_run: MpRun, rank: int) -> None:
    """DDP composed with tensor parallelism: the modules' DTensor parameters are set
    again from DDP's local tensors at every forward, yet each bucket is owned by the
    lowest module holding the parameters the comm hook saw in it (the block's
    layers, not the whole model)."""
    hook = ok_run.result("ddp_tp", rank)["hook"]
    events = _bucket_events(ok_run, "ddp_tp", rank)
    assert len(events) == len(hook) > 0
    owners = set()
    for attrs, (index, params) in zip(events, hook):
        assert attrs[semconv.DDP_BUCKET_INDEX] == index
        assert attrs[semconv.OWNER_FQN] == _module_name(_lowest_common_module(params))
        owners.add(attrs[semconv.OWNER_FQN])
    assert any(o.startswith(f"{WRAPPED}.tp.") for o in owners), owners
    assert ok_run.result("ddp_tp", rank)["stats"]["internal_errors"] == 0


@pytest.mark.parametrize("rank", range(WORLD))
def test_ddp_buckets_launched_together_are_each_their_own(ok_run: MpRun, rank: int) -> None:
    """Buckets made ready out of order are all-reduced together from one
    parameter's hook; each all-reduce still names the bucket the comm hook was
    given for it, and its owner holds that bucket's parameters."""
    hook = ok_run.result("ddp_cascade", rank)["hook"]
    events = _bucket_events(ok_run, "ddp_cascade", rank)
    assert len(events) == len(hook) == 9  # three buckets, three steps, no rebuild
    assert {len(params) for _, params in hook} == {2}  # one layer per bucket
    for attrs, (index, params) in zip(events, hook):
        assert attrs[semconv.DDP_BUCKET_INDEX] == index
        assert attrs[semconv.OWNER_FQN] == _module_name(_lowest_common_module(params))
        assert attrs[semconv.OWNER_BYTES] == 4 * sum(
            ok_run.result("ddp_cascade", rank)["numel"][p] for p in params)


@pytest.mark.parametrize("rank", range(WORLD))
def test_ddp_bucket_after_a_resized_collective_is_its_own(ok_run: MpRun, rank: int) -> None:
    """A comm hook reduces half of bucket 0 (another size than the bucket's, as a
    compressing hook does): commspan loses its count of launched buckets there and
    resyncs on bucket 1, so bucket 2 (bucket 0's size) is not taken for bucket 0."""
    hook = ok_run.result("ddp_resized", rank)["hook"]
    events = _bucket_events(ok_run, "ddp_resized", rank)
    assert [index for index, _, _ in hook] == [0, 1, 2] * 2
    assert [numel for _, _, numel in hook] == [576, 1536, 1152] * 2
    assert len(events) == len(hook)
    for attrs, (index, params, numel) in zip(events, hook):
        assert attrs[semconv.DDP_BUCKET_INDEX] == index
        assert attrs[semconv.OWNER_FQN] == _module_name(_lowest_common_module(params))
        assert attrs[semconv.TENSOR_BYTES] == 4 * numel


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_compressing_hooks_collectives_are_the_bucket_it_was_called_with(
    ok_run: MpRun, rank: int
) -> None:
    """A comm hook all-reduces each bucket in two halves (sizes no bucket has) and one
    parameter's hook launches several buckets: each half is the bucket the hook was
    given (its record), owned by the lowest module holding that bucket's parameters.
    The halves of bucket 1 were charged to bucket 0 (the launching hook's)."""
    hook = ok_run.result("ddp_halves", rank)["hook"]
    events = _bucket_events(ok_run, "ddp_halves", rank)
    assert len(hook) == 2 * 3 * 2  # two halves, three buckets, two steps
    assert len(events) == len(hook)
    for attrs, (index, params, numel) in zip(events, hook):
        assert attrs[semconv.DDP_BUCKET_INDEX] == index
        assert attrs[semconv.OWNER_FQN] == _module_name(_lowest_common_module(params))
        assert attrs[semconv.TENSOR_BYTES] == 4 * numel


def test_a_users_collective_in_a_gradient_hook_is_not_a_bucket(ok_run: MpRun) -> None:
    """A gradient hook of the user's all-reduces a norm (1 element, no bucket's size) from
    DDP's backward: it is not DDP's; its owner is where it ran, and the bucket
    all-reduces are exactly those the comm hook saw."""
    for rank in range(WORLD):
        hook = ok_run.result("ddp_user_hook", rank)["hook"]
        events = [a for _, _, a in ok_run.collectives("ddp_user_hook", rank)
                  if a.get(semconv.TENSOR_DTYPE) == "float32"]
        buckets = [a for a in events if a.get(semconv.OWNER_KIND) == "bucket"]
        assert sorted(a[semconv.DDP_BUCKET_INDEX] for a in buckets) == sorted(i for i, _, _ in hook)
        norms = [a for a in events if a[semconv.TENSOR_SHAPE] == [1]]
        assert len(norms) == STEPS
        for attrs in norms:
            assert semconv.OWNER_KIND not in attrs and semconv.DDP_BUCKET_INDEX not in attrs
            assert attrs[semconv.OWNER_SOURCE] == semconv.SOURCE_POSITION
            assert attrs[semconv.OWNER_FQN] == attrs[semconv.MODULE_FQN]


def test_the_unused_map_is_not_a_bucket_of_its_size(ok_run: MpRun) -> None:
    """The map of used parameters (int32, one per parameter: 3) is the DDP module's even
    when a bucket (l0.weight's, 3 elements) has its size; that bucket's all-reduces are
    those the comm hook saw for it."""
    for rank in range(WORLD):
        hook = ok_run.result("ddp_map_sized", rank)["hook"]
        assert [p for _, p, _ in hook].count(["l0.weight"]) == 2
        events = ok_run.collectives("ddp_map_sized", rank)
        maps = [a for _, _, a in events if a.get(semconv.TENSOR_DTYPE) == "int32"]
        assert len(maps) == 2  # one per step
        for attrs in maps:
            assert (attrs[semconv.OWNER_KIND], attrs[semconv.OWNER_FQN]) == ("unused_map", DDP)
            assert attrs[semconv.TENSOR_SHAPE] == [3]
        l0 = [a for _, _, a in events if a.get(semconv.OWNER_KIND) == "bucket"
              and a.get(semconv.OWNER_FQN) == _module_name("l0")]
        assert len(l0) == 2


@pytest.mark.parametrize("rank", range(WORLD))
def test_ddp_built_inside_the_mode_for_a_larger_model_is_named_in_it(
    ok_run: MpRun, rank: int
) -> None:
    """DDP constructed while the mode is entered, as ``Outer.body``: its start-up
    collectives go by its class (it has no place yet), and it is not named for good
    then: its spans and buckets are ``Outer.body...``, and Outer counts every bucket
    all-reduce the comm hook saw."""
    res = ok_run.result("ddp_nested", rank)
    assert {"Outer", "Outer.body", "Outer.body.module"} <= set(res["modules"])
    events = _bucket_events(ok_run, "ddp_nested", rank)
    assert len(events) == len(res["hook"]) > 0
    for attrs, (index, params) in zip(events, res["hook"]):
        assert attrs[semconv.DDP_BUCKET_INDEX] == index
        common = _lowest_common_module(params)
        assert attrs[semconv.OWNER_FQN] == "Outer.body.module" + ("." + common if common else "")
    assert res["module_counts"]["Outer"]["backward"]["all_reduce"] == len(res["hook"])
    setup = [a for _, _, a in ok_run.collectives("ddp_nested", rank)
             if a.get(semconv.OWNER_KIND) == "init_sync"]
    assert setup and {a[semconv.OWNER_FQN] for a in setup} == {DDP}
    assert res["stats"]["internal_errors"] == 0


@pytest.mark.parametrize("rank", range(WORLD))
def test_ddp_forward_owns_its_syncs_and_the_model_its_collectives(ok_run: MpRun, rank: int) -> None:
    """In DDP's forward, the collectives issued while the wrapped model's forward ran
    (a module's own all-reduce, as SyncBatchNorm's) belong to the module that issued
    them; the rest (DDP's buffer broadcasts) are DDP's forward syncs. Reference: a
    dispatch mode of the test's own, told by hooks on the wrapped model whether its
    forward runs, and the module's own count of its calls."""
    res = ok_run.result("ddp_forward", rank)
    forward = [a for _, _, a in ok_run.collectives("ddp_forward", rank)
               if a[semconv.PHASE] == "forward"]
    syncs = [a for a in forward if a.get(semconv.OWNER_KIND) == "forward_sync"]
    own = [a for a in forward if a[semconv.OWNER_FQN] == f"{WRAPPED}.stat"]
    assert res["reference"]["ddp"] > 0 and res["stat_calls"] == STEPS
    assert len(syncs) == res["reference"]["ddp"]
    assert {a[semconv.OWNER_FQN] for a in syncs} == {DDP}
    assert len(own) == res["stat_calls"] == res["reference"]["model"]
    assert {a[semconv.OWNER_SOURCE] for a in own} == {"position"}
    assert res["module_counts"][f"{WRAPPED}.stat"]["forward"]["all_reduce"] == STEPS
    assert res["stats"]["internal_errors"] == 0


@pytest.mark.parametrize("scenario", ["ddp", "ddp_unused"])
def test_ddp_buckets_are_launched_in_index_order(ok_run: MpRun, scenario: str) -> None:
    """Without a hook, the k-th bucket all-reduce of a backward is bucket k (the
    reducer launches buckets in index order)."""
    for rank in range(WORLD):
        indices = [a[semconv.DDP_BUCKET_INDEX] for a in _bucket_events(ok_run, scenario, rank)]
        per_step: list[list[int]] = []
        for i in indices:
            if i == 0:
                per_step.append([])
            per_step[-1].append(i)
        assert len(per_step) == 3
        assert all(step == list(range(len(step))) for step in per_step), indices


@pytest.mark.parametrize("scenario", ["ddp", "ddp_hook", "ddp_unused"])
def test_ddp_construction_broadcasts_are_setup_of_the_ddp_module(
    ok_run: MpRun, scenario: str
) -> None:
    """DDP's start-up collectives (parameter shape check, module state broadcast),
    issued while the mode is on but outside any step, are phase setup, owned by the
    DDP module, in a session trace, and no step counts them."""
    for rank in range(WORLD):
        spans = ok_run.spans(scenario, rank)
        init = [
            (span, attrs)
            for span in spans
            for _, attrs in span.events
            if attrs.get(semconv.OWNER_KIND) == "init_sync"
        ]
        assert init, "the start-up collectives are recorded"
        for span, attrs in init:
            assert (attrs[semconv.OWNER_FQN], attrs[semconv.PHASE]) == (DDP, "setup")
            assert semconv.STEP not in span.attributes  # a session trace, not a step
        assert {attrs[semconv.COLL_OP] for _, attrs in init} == {"all_gather", "broadcast"}
        counts = Aggregator.from_jsonl(ok_run.root / scenario, rank=rank).module_counts()
        assert counts[DDP]["setup"] == {"all_gather": 1, "broadcast": 2}
        assert "forward" not in counts[DDP] or "all_gather" not in counts[DDP]["forward"]


@pytest.mark.parametrize("scenario", ["ddp", "ddp_hook", "ddp_unused", "ddp_cascade"])
def test_ddp_counts_follow_the_bucket_owner(ok_run: MpRun, scenario: str) -> None:
    """Per-module counts: a bucket all-reduce counts for its owner, the modules
    enclosing it and Global, not for the layer whose backward was open; live and
    from JSONL agree."""
    for rank in range(WORLD):
        res = ok_run.result(scenario, rank)
        offline = Aggregator.from_jsonl(ok_run.root / scenario, rank=rank)
        live = {f: c for f, c in res["module_counts"].items() if c}
        assert {f: c for f, c in offline.module_counts().items() if c} == live
        assert offline.table(0) == res["table"]
        ran = set(offline.modules())
        expected: dict[str, dict[str, dict[str, int]]] = {}
        for _, _, attrs in ok_run.collectives(scenario, rank):
            for fqn in [*_ancestors(attrs[semconv.OWNER_FQN], ran), semconv.GLOBAL_FQN]:
                _add(expected, fqn, attrs[semconv.PHASE], attrs[semconv.COLL_OP])
        assert live == expected
        assert res["stats"]["internal_errors"] == 0


def test_ddp_unused_map_all_reduce_is_the_ddp_modules(ok_run: MpRun) -> None:
    """With find_unused_parameters, the reducer's all-reduce of the used-parameter map
    (one int per parameter) is owned by the DDP module, kind unused_map."""
    for rank in range(WORLD):
        maps = [a for _, _, a in ok_run.collectives("ddp_unused", rank)
                if a.get(semconv.OWNER_KIND) == "unused_map"]
        assert len(maps) == 3  # one per step
        for attrs in maps:
            assert attrs[semconv.OWNER_FQN] == DDP
            assert attrs[semconv.TENSOR_SHAPE] == [12]  # 10 used + 2 unused parameters


# ------------------------------------------------------------------ pipelining
def _pp_expected(rank: int) -> dict[tuple[str, int], int]:
    """Per step: stage 0 sends each microbatch's activations and receives its
    gradients; stage 1 the other way round."""
    kinds = ("activation_send", "gradient_recv") if rank == 0 else (
        "activation_recv", "gradient_send")
    return {(kind, mb): 1 for kind in kinds for mb in range(MICROBATCHES)}


@pytest.mark.parametrize("scenario", PIPELINES)
@pytest.mark.parametrize("rank", range(WORLD))
def test_pipeline_p2p_owned_by_the_stage_per_microbatch(
    ok_run: MpRun, scenario: str, rank: int
) -> None:
    """Each send and receive of a microbatch is owned by the rank's stage module,
    names the microbatch, direction and peer stage (peer rank = the other rank),
    serves forward (activations) or backward (gradients), and agrees with what
    the stage's own buffers say (receives, activation sends); per step every
    microbatch goes each way once; the shape exchange of the first step is setup."""
    res = ok_run.result(scenario, rank)
    events = [a for _, _, a in ok_run.collectives(scenario, rank)]
    assert [a[semconv.COLL_OP] for a in events] == [op for op, _, _ in res["reference"]]
    tagged = [a for a in events if a[semconv.OWNER_KIND] != "stage_setup"]
    setup = [a for a in events if a[semconv.OWNER_KIND] == "stage_setup"]
    assert len(tagged) == 2 * MICROBATCHES * 2  # two steps, two directions
    assert setup and all(a[semconv.PHASE] == "setup" for a in setup)
    checked = 0
    for attrs, (_, ref_mb, ref_kind) in zip(events, res["reference"]):
        if attrs[semconv.OWNER_KIND] == "stage_setup":
            assert attrs[semconv.OWNER_FQN] == STAGE[rank]
            continue
        kind, mb = attrs[semconv.OWNER_KIND], attrs[semconv.PP_MICROBATCH]
        assert attrs[semconv.OWNER_SOURCE] == "pipeline"
        assert attrs[semconv.OWNER_FQN] == STAGE[rank]
        assert attrs[semconv.PP_STAGE] == rank
        assert attrs[semconv.PP_PEER_STAGE] == 1 - rank
        assert attrs[semconv.COLL_PEER] == 1 - rank
        serves = "forward" if kind.startswith("activation") else "backward"
        assert attrs[semconv.PHASE] == serves
        if ref_kind is not None:  # the stage's buffers know this one
            assert (kind, mb) == (ref_kind, ref_mb)
            checked += 1
    steps = [tagged[: len(tagged) // 2], tagged[len(tagged) // 2 :]]
    for step in steps:
        got = Counter((a[semconv.OWNER_KIND], a[semconv.PP_MICROBATCH]) for a in step)
        assert got == _pp_expected(rank)
    # checked against the buffers: every receive, and stage 0's activation sends
    # (stage 1's gradient sends have no buffer to compare: the schedule count covers them)
    assert checked == (2 if rank == 0 else 1) * MICROBATCHES * 2


@pytest.mark.parametrize("scenario", PIPELINES)
@pytest.mark.parametrize("rank", range(WORLD))
def test_pipeline_module_spans_carry_the_microbatch(
    ok_run: MpRun, scenario: str, rank: int
) -> None:
    """In each step, the stage module has one forward and one backward span per
    microbatch, carrying its index and the stage; both ranks' spans of a step are in
    one trace; the wrappers are gone from the stage after the mode."""
    spans = ok_run.spans(scenario, rank)
    per_trace: dict[str, Counter] = {}  # type: ignore[type-arg]
    for span in spans:
        a = span.attributes
        if a.get(semconv.MODULE_FQN) != STAGE[rank] or semconv.PP_MICROBATCH not in a:
            continue
        assert a[semconv.PP_STAGE] == rank
        per_trace.setdefault(span.trace_id, Counter())[
            (a[semconv.PHASE], a[semconv.PP_MICROBATCH])] += 1
    assert len(per_trace) == 2  # one trace per step
    for counts in per_trace.values():
        assert counts == {(phase, mb): 1 for phase in ("forward", "backward")
                          for mb in range(MICROBATCHES)}
    other = {s.trace_id for s in ok_run.spans(scenario, 1 - rank) if s.name == "commspan.rank"}
    mine = {s.trace_id for s in spans if s.name == "commspan.rank"}
    assert set(per_trace) <= mine and (set(per_trace) & other) == set(per_trace)
    assert ok_run.result(scenario, rank)["left_on_stage"] == []


@pytest.mark.parametrize("scenario", PIPELINES)
def test_pipeline_counts_live_and_from_jsonl(ok_run: MpRun, scenario: str) -> None:
    """The stage module counts its sends and receives per phase (credited: they are
    issued outside its spans); live and JSONL tables agree."""
    for rank in range(WORLD):
        res = ok_run.result(scenario, rank)
        offline = Aggregator.from_jsonl(ok_run.root / scenario, rank=rank)
        assert offline.table(0) == res["table"]
        counts = offline.module_counts()[STAGE[rank]]
        sends, recvs = ("forward", "backward") if rank == 0 else ("backward", "forward")
        assert counts[sends]["send"] == counts[recvs]["recv"] == 2 * MICROBATCHES
        assert counts["setup"] == offline.module_counts()[semconv.GLOBAL_FQN]["setup"]
        assert res["stats"]["internal_errors"] == 0


# ------------------------------------------------------------------ interleaved pipeline
# rank r holds stages r and r + 2 of four: what each stage sends and receives per microbatch
_INTERLEAVED_KINDS = {
    0: ("activation_send", "gradient_recv"),
    1: ("activation_recv", "activation_send", "gradient_recv", "gradient_send"),
    2: ("activation_recv", "activation_send", "gradient_recv", "gradient_send"),
    3: ("activation_recv", "gradient_send"),
}
_PEER_STEP = {"activation_send": 1, "gradient_recv": 1, "activation_recv": -1,
              "gradient_send": -1}


@pytest.mark.parametrize("rank", range(WORLD))
def test_interleaved_pipeline_p2p_owned_by_each_stage(ok_run: MpRun, rank: int) -> None:
    """With two stages per rank (Interleaved1F1B), each send and receive names the
    stage it serves, the microbatch and the peer stage, as the stages' own buffers
    and the schedule say; the stages' set-up traffic (warm-up votes, shape
    exchange) is owned by the stage as ``setup``; nothing falls back to the position."""
    res = ok_run.result("pp_interleaved", rank)
    events = [a for _, _, a in ok_run.collectives("pp_interleaved", rank)]
    assert [a[semconv.COLL_OP] for a in events] == [ref[0] for ref in res["reference"]]
    assert all(a[semconv.OWNER_SOURCE] == "pipeline" for a in events)
    mine = (rank, rank + WORLD)
    # the rank's two stage modules share a class: each is named after its stage (they
    # were one owner, "Sequential", their rows and counts merged)
    names = {f"Sequential[stage{stage}]" for stage in mine}
    assert {a[semconv.OWNER_FQN] for a in events} == names
    tagged = [a for a in events if a[semconv.OWNER_KIND] != "stage_setup"]
    setup = [a for a in events if a[semconv.OWNER_KIND] == "stage_setup"]
    assert setup and all(a[semconv.PHASE] == "setup" for a in setup)
    checked = 0
    for attrs, ref in zip(events, res["reference"]):
        if attrs[semconv.OWNER_KIND] == "stage_setup":
            continue
        kind, stage = attrs[semconv.OWNER_KIND], attrs[semconv.PP_STAGE]
        assert stage in mine
        assert attrs[semconv.PP_PEER_STAGE] == stage + _PEER_STEP[kind]
        assert attrs[semconv.OWNER_FQN] == f"Sequential[stage{stage}]"
        assert attrs[semconv.COLL_PEER] == 1 - rank  # the neighbouring stages are on the other rank
        assert attrs[semconv.PHASE] == ("forward" if kind.startswith("activation") else "backward")
        if ref[2] is not None:  # the stage's buffers know this one
            assert (stage, kind, attrs[semconv.PP_MICROBATCH]) == (ref[3], ref[2], ref[1])
            checked += 1
    expected = Counter({(stage, kind, mb): 1 for stage in mine
                        for kind in _INTERLEAVED_KINDS[stage] for mb in range(MICROBATCHES)})
    per_step = len(tagged) // STEPS
    assert len(tagged) == STEPS * sum(expected.values())
    for step in range(STEPS):
        got = Counter((a[semconv.PP_STAGE], a[semconv.OWNER_KIND], a[semconv.PP_MICROBATCH])
                      for a in tagged[step * per_step: (step + 1) * per_step])
        assert got == expected
    assert checked >= STEPS * MICROBATCHES * 2  # at least the receives of both stages
    assert res["left_on_stage"] == []
    assert res["stats"]["internal_errors"] == 0


@pytest.mark.parametrize("rank", range(WORLD))
def test_interleaved_pipeline_module_spans_carry_stage_and_microbatch(
    ok_run: MpRun, rank: int
) -> None:
    """Each stage's module has one forward and one backward span per microbatch and
    step, carrying its stage index and the microbatch."""
    per_trace: dict[str, Counter] = {}  # type: ignore[type-arg]
    for span in ok_run.spans("pp_interleaved", rank):
        a = span.attributes
        if semconv.PP_MICROBATCH not in a or "." in a[semconv.MODULE_FQN]:
            continue  # (a stage module's children carry them too)
        assert a[semconv.MODULE_FQN] == f"Sequential[stage{a[semconv.PP_STAGE]}]"
        per_trace.setdefault(span.trace_id, Counter())[
            (a[semconv.PP_STAGE], a[semconv.PHASE], a[semconv.PP_MICROBATCH])] += 1
    assert len(per_trace) == STEPS
    for counts in per_trace.values():
        assert counts == {(stage, phase, mb): 1 for stage in (rank, rank + WORLD)
                          for phase in ("forward", "backward") for mb in range(MICROBATCHES)}
