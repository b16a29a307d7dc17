"""A torchtitan-style training loop on 4 real gloo ranks (a 2 x 2 ``dp`` x ``tp`` mesh).

Each rank runs ``tests/_mp_titan_scenarios.py``, spawned once: tensor
parallelism with sequence-parallel norms and loss parallel, selective
activation checkpointing, FSDP2, gradient accumulation over two microbatches
(FSDP2 syncs on the last), ``clip_grad_norm_`` over the DTensor parameters,
AdamW (``foreach``) with an lr scheduler, an evaluation step under
``no_grad`` and ``inference_mode``, and a distributed checkpoint saved and
loaded between steps; scenario ``eager``, and ``compiled`` with each block
compiled in place (``aot_eager``) as torchtitan does. The references never use
commspan's attribution: the same loop run without commspan (losses, gradient
norms, final parameters, warnings, Dynamo's graph counts) and under a dispatch
mode of the scenario file's own that logs every collective with the loop's own
label of what it is doing, the block whose forward or backward runs (its own hooks), the
process group and the input bytes; FSDP2 unit sizes and the parameters
replicated over ``tp`` from the model before sharding. The commands read the
run directory as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _spawn import run_ranks

from commspan import semconv
from commspan.exporters import read_spans

pytestmark = pytest.mark.multiprocess

WORLD = 4
SCRIPT = Path(__file__).with_name("_mp_titan_scenarios.py")
SCENARIOS = ["eager", "compiled"]
TRAIN_STEPS, EVAL_STEP = (0, 2, 3), 1
ROOT = "FSDPTransformer"
# the modules owning the units' collectives: [norm, output] is one unit, the root's
UNITS = [f"{ROOT}.tok_embeddings", f"{ROOT}.layers.0", f"{ROOT}.layers.1", ROOT]
DP = 2
# the c10d ops FSDP2 and DCP call, by commspan's canonical name
_C10D = {"_allgather_base_": "all_gather_into_tensor", "_reduce_scatter_base_":
         "reduce_scatter_tensor", "allgather_": "all_gather", "broadcast_": "broadcast",
         "gather_": "gather", "scatter_": "scatter", "allreduce_": "all_reduce"}


@dataclass
class Titan:
    root: Path
    returncodes: list[int | None]
    logs: list[str]

    def result(self, scenario: str, rank: int) -> dict[str, Any]:
        return json.loads((self.root / scenario / f"rank{rank}.result.json").read_text())

    def run_dir(self, scenario: str) -> Path:
        return self.root / scenario / "run"


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> Titan:
    """Spawn the ranks once; wait for all (killing the rest if one fails or time runs out)."""
    root = tmp_path_factory.mktemp("titan")
    return Titan(root, *run_ranks(SCRIPT, [str(root)], root, WORLD, timeout_s=480))


@pytest.fixture()
def ok(titan: Titan) -> Titan:
    """The run, if every rank exited 0 and no scenario raised (else the logs)."""
    failed = [r for r, rc in enumerate(titan.returncodes) if rc != 0]
    errors = [f"{s} rank {r}:\n{titan.result(s, r)['error'][-3000:]}"
              for s in SCENARIOS for r in range(WORLD)
              if not failed and "error" in titan.result(s, r)]
    if failed or errors:
        logs = "\n".join(f"--- rank {r}\n{log[-3000:]}" for r, log in enumerate(titan.logs))
        pytest.fail("ranks failed:\n" + "\n".join(errors) + "\n" + logs)
    return titan


def _events(path: Path) -> list[tuple[int | None, dict[str, Any]]]:
    """(step or None outside steps, attributes) of each collective of one rank's file."""
    spans = list(read_spans(path))
    steps = {s.trace_id: s.attributes[semconv.STEP] for s in spans if semconv.STEP in s.attributes}
    return [(steps.get(s.trace_id), attrs) for s in spans for _, attrs in s.events
            if semconv.COLL_OP in attrs]


def _paired(titan: Titan, rank: int) -> list[tuple[list[Any], int | None, dict[str, Any]]]:
    """Each collective of the reference run beside commspan's of the traced run: the
    same loop issues the same collectives on each group in the same order."""
    log = titan.result("eager", rank)["log"]
    ours: dict[tuple[int, ...], list[tuple[int | None, dict[str, Any]]]] = defaultdict(list)
    for step, attrs in _events(titan.run_dir("eager") / f"rank{rank}.jsonl"):
        ours[tuple(attrs[semconv.PG_RANKS])].append((step, attrs))
    for events in ours.values():
        events.sort(key=lambda e: e[1][semconv.COLL_SEQ])
    theirs: dict[tuple[int, ...], list[list[Any]]] = defaultdict(list)
    for entry in log:
        theirs[tuple(entry[4])].append(entry)
    assert {g: len(v) for g, v in ours.items()} == {g: len(v) for g, v in theirs.items()}
    return [(entry, step, attrs) for group, entries in theirs.items()
            for entry, (step, attrs) in zip(entries, ours[group])]


# ------------------------------------------------------------------ the training
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_is_bit_identical_and_warns_nothing_more(ok: Titan, scenario: str) -> None:
    """Losses, gradient norms, evaluation losses and the final parameters are the same
    bits with and without commspan; Dynamo compiles the same graphs; the traced run
    warns nothing the plain one does not; commspan met no error and lost no span."""
    for rank in range(WORLD):
        res = ok.result(scenario, rank)
        assert res["traced"] == res["plain"], rank
        assert len(res["plain"]["loss"]) == len(TRAIN_STEPS) * 2
        assert res["traced_warnings"] == res["plain_warnings"], rank
        stats = res["stats"]
        assert stats["internal_errors"] == stats["processor_errors"] == 0, stats
        assert stats["spans_dropped"] == stats["spans_failed"] == 0, stats
        assert stats["steps_traced"] == len(TRAIN_STEPS) + 1, stats
        if scenario == "eager":
            assert res["reference"] == res["plain"]
    if scenario == "compiled":
        assert ok.result(scenario, 0)["plain"]["dynamo"]["stats"]["unique_graphs"] > 0


# ------------------------------------------------------------------ what was recorded
@pytest.mark.parametrize("rank", range(WORLD))
def test_every_collective_matches_the_reference(ok: Titan, rank: int) -> None:
    """Op, group, input bytes and step of every collective are the reference's; its
    phase is backward or recompute exactly when autograd ran it; the loop's own work
    outside modules (the gradient norm's all-reduces, the optimizer, the checkpoint)
    is Global's, in phase forward, and the checkpoint's and set-up's are outside
    every step."""
    labels = Counter()
    for (where, block, in_autograd, op, ranks, nbytes), step, attrs in _paired(ok, rank):
        what = (where, op, ranks)
        assert attrs[semconv.COLL_OP] == _C10D.get(op, op), what
        assert attrs[semconv.TENSOR_BYTES] == nbytes, what
        phase = attrs[semconv.PHASE]
        assert (phase in ("backward", "recompute")) == in_autograd, (what, phase)
        expected_step = {"setup": None, "ckpt": None, "eval": EVAL_STEP}.get(where, step)
        assert step == expected_step, (what, step)
        if where in ("clip", "optim", "ckpt", "setup"):
            assert (attrs[semconv.OWNER_FQN], phase) == (semconv.GLOBAL_FQN, "forward"), what
        if where == "eval":
            assert phase == "forward", what
        if block is not None:
            # in a block's forward or backward (its own hooks say): that block's,
            # recomputed or not (FSDP's: a unit's, by its label)
            owner = attrs[semconv.OWNER_FQN]
            if attrs.get(semconv.OWNER_SOURCE) == "fsdp":
                assert owner in UNITS, what
            else:
                assert owner.startswith(f"{ROOT}.{block}"), (what, owner)
        labels[where] += 1
    assert {"setup", "forward", "backward", "clip", "eval", "ckpt"} <= set(labels), labels


def _unit(relative: str) -> str:
    """commspan's name of the unit at ``relative`` (FSDP's path from its root)."""
    return f"{ROOT}.{relative}" if relative else ROOT


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_units_and_their_gradient_syncs(ok: Titan, rank: int) -> None:
    """Each FSDP2 unit gathers its padded parameters and reduce-scatters its gradients
    once per optimizer step (gradient accumulation: not on the first microbatch); the
    all-reduce over tp of each gradient replicated over tp (the sequence-parallel
    norms') is its unit's, once per step; each carries its unit's or gradient's bytes
    (``commspan.owner.bytes``). Reference: the unit sizes and placements of the model
    before FSDP2, the reduce-scatters the reference mode saw per step."""
    facts = ok.result("eager", rank)["facts"]
    padded = {_unit(k): v for k, v in facts["unit_padded_elements"].items()}
    replicated = {_unit(k): v for k, v in facts["tp_replicated_bytes"].items()}
    scatters: Counter[tuple[int | None, str]] = Counter()
    syncs: dict[str, list[int]] = defaultdict(list)
    for (where, _, _, _, _, nbytes), step, attrs in _paired(ok, rank):
        if attrs.get(semconv.OWNER_SOURCE) != "fsdp":
            continue
        unit, kind = attrs[semconv.OWNER_FQN], attrs[semconv.OWNER_KIND]
        if kind == "unshard":
            assert attrs[semconv.OWNER_BYTES] == padded[unit] * 4, (unit, attrs)
        elif kind == "reduce_grad":
            assert nbytes == padded[unit] * 4 and where == "backward", (unit, where)
            assert attrs[semconv.OWNER_BYTES] == nbytes, (unit, attrs)
            scatters[(step, unit)] += 1
        else:
            assert kind == "redistribute_grad" and attrs[semconv.PHASE] == "backward"
            assert attrs[semconv.OWNER_BYTES] == nbytes, (unit, attrs)
            syncs[unit].append(attrs[semconv.OWNER_BYTES])
    assert scatters == {(s, u): 1 for s in TRAIN_STEPS for u in UNITS}
    assert {u: sorted(b) for u, b in syncs.items()} == {
        u: sorted(b * len(TRAIN_STEPS)) for u, b in replicated.items() if b}


# ------------------------------------------------------------------ the commands
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commspan", *args], capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_commands_read_the_run(ok: Titan, scenario: str, tmp_path: Path) -> None:
    """``summary``, ``table``, ``check``, ``stragglers``, ``html`` and ``perfetto`` on
    the run directory: exit 0, no traceback; every rank's steps are there, check finds
    nothing, and the summary's count is every collective of every rank's file."""
    run = ok.run_dir(scenario)
    total = sum(len(_events(run / f"rank{r}.jsonl")) for r in range(WORLD))
    outputs = {}
    for args in (["summary", "--rank", "all"], ["table", "--rank", "0"], ["check"],
                 ["stragglers"], ["html", "-o", str(tmp_path / "r.html")],
                 ["perfetto", "-o", str(tmp_path / "t.json")]):
        proc = _cli(*args, str(run))
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
        outputs[args[0]] = proc.stdout
    summary = outputs["summary"]
    assert "ranks: 0-3" in summary and "steps: 0-3" in summary, summary
    assert summary.splitlines()[-1].split() == ["total", str(total)], summary
    assert outputs["check"].startswith("consistent:"), outputs["check"]
    assert f"{total:,} collectives" in outputs["check"], outputs["check"]
    for unit in UNITS:
        assert unit in outputs["table"]
    steps = "\n".join(outputs["stragglers"].split("Step time per rank")[1].splitlines()[2:6])
    assert [line.split()[:2] for line in steps.splitlines()] == [
        [str(r), str(len(TRAIN_STEPS) + 1)] for r in range(WORLD)], steps


def test_compiled_blocks_collectives_carry_no_placements(ok: Titan) -> None:
    """The blocks' tensor-parallel collectives are DTensor redistributions in the eager
    run (their events name the placements) and plain functional collectives of the
    compiled graph in the compiled run (owned by the submodule of their graph node, no
    placements), as docs/parallelisms.md says."""
    for scenario, compiled in (("eager", False), ("compiled", True)):
        blocks = [attrs for _, attrs in _events(ok.run_dir(scenario) / "rank0.jsonl")
                  if str(attrs[semconv.OWNER_FQN]).startswith(f"{ROOT}.layers.")
                  and attrs.get(semconv.MESH_DIM_NAME) == "tp"
                  and attrs.get(semconv.OWNER_SOURCE) != "fsdp"]
        assert blocks
        sources = {a[semconv.OWNER_SOURCE] for a in blocks}
        assert sources == ({"compile"} if compiled else {"position"}), (scenario, sources)
        assert all((semconv.REDIST_SRC in a) != compiled for a in blocks), scenario


@pytest.mark.parametrize("rank", range(WORLD))
def test_compiled_blocks_gradient_syncs_are_the_eager_ones(ok: Titan, rank: int) -> None:
    """FSDP2's gradient work runs outside the compiled blocks: the compiled run's
    reduce-scatters and redistribute_grad all-reduces (the blocks' norms' gradients,
    made by the compiled backward) are the eager run's, with their units, bytes and
    phase (the eager ones are checked against the reference above)."""
    syncs = {}
    for scenario in SCENARIOS:
        syncs[scenario] = Counter(
            (a[semconv.OWNER_FQN], a[semconv.OWNER_KIND], a[semconv.COLL_OP],
             a[semconv.OWNER_BYTES], a[semconv.PHASE])
            for _, a in _events(ok.run_dir(scenario) / f"rank{rank}.jsonl")
            if a.get(semconv.OWNER_KIND) in ("reduce_grad", "redistribute_grad"))
    assert syncs["compiled"] == syncs["eager"], syncs
    assert any(key[1] == "redistribute_grad" for key in syncs["eager"])


@pytest.mark.parametrize("rank", range(WORLD))
def test_compiled_blocks_own_their_collectives_as_eager_blocks_do(ok: Titan, rank: int) -> None:
    """Each block compiled in place (``block.compile()``, after its
    ``checkpoint_wrapper``) owns its tensor-parallel collectives, per phase (forward,
    recompute, backward), as the eager run's block does (checked against the
    reference above). (Without the evaluation step: compiled blocks refuse its
    ``inference_mode`` part.)"""
    owned = {}
    for scenario in SCENARIOS:
        owned[scenario] = Counter(
            (".".join(str(a[semconv.OWNER_FQN]).split(".")[:3]), a[semconv.PHASE])
            for step, a in _events(ok.run_dir(scenario) / f"rank{rank}.jsonl")
            if step != EVAL_STEP and a.get(semconv.OWNER_SOURCE) != "fsdp"
            and str(a[semconv.OWNER_FQN]).startswith(f"{ROOT}.layers."))
    assert {block for block, _ in owned["eager"]} == {f"{ROOT}.layers.0", f"{ROOT}.layers.1"}
    assert owned["compiled"] == owned["eager"], owned
