"""A plan at scale: one step of rank 0 of a 512-rank job (TP 8 x FSDP 64) on the fake
process group, checked against the analytic sizes of its collectives.

The references are formulas over the model's parameters and activations,
computed by the test before sharding, never commspan's attribution:

- FSDP2 all-gather of a unit: each rank sends its shard of the unit's
  (tensor-parallel local) parameters, each padded on dim 0 to a multiple of
  the shard size, and receives the rest: input bytes x shard = the padded unit,
  received = the padded unit x (shard - 1) / shard;
- FSDP2 reduce-scatter of a unit: its input is the whole padded unit's gradients;
- tensor-parallel all-reduce: one activation, batch x seq x dim x 4 bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _fsdp_sizes import padded_unit_elements

from commspan import StepPlan, plan_step
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

ROOT = Path(__file__).resolve().parent.parent
WORLD, TP = 512, 8
DP = WORLD // TP
ARGS = ModelArgs(n_layers=2, vocab_size=64, dim=64, n_heads=8, max_seq_len=16)
BATCH, SEQ = 2, 16


def _plan_in_this_process() -> dict[str, Any]:
    """Run the plan; returns its JSON form and the reference unit sizes."""
    units: dict[str, int] = {}

    def setup() -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp_shard", "tp"))
        torch.manual_seed(0)
        model = parallelize(Transformer(ARGS), mesh["tp"])
        nested = {id(b) for b in model.layers}
        for i, block in enumerate(model.layers):
            units[f"FSDPTransformer.layers.{i}"] = padded_unit_elements([block], set(), DP) * 4
        units["FSDPTransformer"] = padded_unit_elements([model], nested, DP) * 4
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
        tokens, targets = make_batch(ARGS, batch=BATCH, seq=SEQ)
        return lambda: train_step(model, tokens, targets)

    plan = plan_step(setup, world_size=WORLD)
    assert isinstance(plan, StepPlan)
    return {"plan": plan.to_dict(), "table": plan.table(), "units": units}


@pytest.fixture(scope="module")
def planned() -> dict[str, Any]:
    """The plan, made in a process of its own (this one may hold the tests' fake world
    of 4 ranks: a process has one default process group)."""
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _owned(planned: dict[str, Any]) -> dict[str, Any]:
    return {m["fqn"]: m["mesh_dims"] for m in planned["plan"]["modules"]}


def test_fsdp_bytes_follow_the_unit_sizes(planned: dict[str, Any]) -> None:
    owned = _owned(planned)
    for unit, padded in planned["units"].items():
        dims = owned[unit]
        assert set(dims) == {"dp_shard"}, dims  # a unit's own collectives are FSDP's
        gather = dims["dp_shard"]["all_gather_into_tensor"]
        scatter = dims["dp_shard"]["reduce_scatter_tensor"]
        per_gather = gather["bytes"] // gather["count"]
        assert per_gather * gather["count"] == gather["bytes"]
        assert per_gather * DP == padded  # each rank sends its shard
        assert padded - per_gather == padded * (DP - 1) // DP  # and receives the rest
        assert scatter["bytes"] == scatter["count"] * padded  # whole-unit gradients in


def test_tp_all_reduces_carry_one_activation(planned: dict[str, Any]) -> None:
    activation = BATCH * SEQ * ARGS.dim * 4
    reduces = {fqn: ops["tp"]["all_reduce"] for fqn, ops in _owned(planned).items()
               if "all_reduce" in ops.get("tp", {})}
    assert len(reduces) == 3 + 6 * ARGS.n_layers  # embeddings, head; 6 linears per block
    for fqn, r in reduces.items():
        # positions have no batch dimension: (seq, dim)
        size = SEQ * ARGS.dim * 4 if fqn.endswith("pos_embeddings") else activation
        assert r["bytes"] == r["count"] * size, fqn


def test_totals_and_json(planned: dict[str, Any]) -> None:
    data = planned["plan"]
    assert (data["world_size"], data["rank"]) == (WORLD, 0)
    assert set(data["totals"]) == {"dp_shard", "tp"}
    for dim, ops in data["totals"].items():
        for op, total in ops.items():
            parts = [m["mesh_dims"][dim][op] for m in data["modules"]
                     if op in m["mesh_dims"].get(dim, {})]
            assert total == {"count": sum(p["count"] for p in parts),
                             "bytes": sum(p["bytes"] for p in parts)}
    text = planned["table"]
    assert text.startswith(f"rank 0 of {WORLD}, one step")
    assert "FSDPTransformer.layers.1" in text and "dp_shard" in text


def test_setup_must_return_the_step(fake_pg: None) -> None:
    with pytest.raises(TypeError, match="setup returned int"):
        plan_step(lambda: 3, world_size=4)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        plan_step(lambda: (lambda: None), world_size=4, warmup_steps=-1)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PLAN_TP="8", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "commspan.cli", "plan", *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_cli_plan_of_the_example() -> None:
    """``commspan plan examples/plan_at_scale.py:setup --world 16 --json``."""
    done = _cli("examples/plan_at_scale.py:setup", "--world", "16", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["world_size"] == 16 and set(data["totals"]) == {"dp_shard", "tp"}
    assert any(m["fqn"] == "FSDPTransformer.layers.3" for m in data["modules"])


@pytest.mark.parametrize(("argv", "message", "code"), [
    # a target that is no FILE.py:FUNCTION at all is bad arguments (docs/cli.md)
    (["nope"], "FILE.py:FUNCTION 'nope' is not valid", 2),
    (["examples/plan_at_scale.py"], "FILE.py:FUNCTION 'examples/plan_at_scale.py' is not "
     "valid; pass FILE.py:FUNCTION", 2),
    (["examples/missing.py:setup"], "examples/missing.py is not a file", 1),
    # a file Python has no loader for (it said "raised AssertionError: ")
    (["README.md:setup"], "FileNotFoundError: FILE.py:FUNCTION 'README.md:setup': README.md "
     "is not a Python file; pass the .py file that defines the function", 1),
    (["examples/plan_at_scale.py:nothing"], "has no function 'nothing'", 1),
    (["examples/plan_at_scale.py:setup", "--world", "12"],
     "raised ValueError at", 1),  # 12 ranks do not divide by tp=8: the user's own error
])
def test_cli_plan_errors_are_one_line(argv: list[str], message: str, code: int) -> None:
    done = _cli(*argv, *([] if "--world" in argv else ["--world", "16"]))
    assert done.returncode == code
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(("source", "message"), [
    ("def setup():\n    raise RuntimeError('boom in setup')\n",
     "RuntimeError: {target} raised RuntimeError at {file}:2: boom in setup"),
    ("def setup():\n    def step():\n        raise RuntimeError('boom in step')\n"
     "    return step\n",
     "RuntimeError: the step that {target} returned raised RuntimeError at {file}:3: boom "
     "in step"),
    ("import sys\ndef setup():\n    sys.exit(3)\n",  # (it exited 3, printing nothing)
     "RuntimeError: {target} raised SystemExit at {file}:3: 3"),
    ("import sys\ndef setup():\n    return lambda: sys.exit(0)\n",  # (exited 0, no plan)
     "RuntimeError: the step that {target} returned raised SystemExit at {file}:3: 0"),
    ("setup = 3\n", "AttributeError: FILE.py:FUNCTION '{target}': 'setup' in {file} is not "
     "a function (it is of type int)"),
    ("def setup():\n    return 3\n",
     "RuntimeError: FILE.py:FUNCTION '{target}': TypeError: setup returned int, not the step"),
])
def test_cli_plan_says_whether_setup_or_its_step_raised(
    tmp_path: Path, source: str, message: str
) -> None:
    """An exception in the step is the step's, not blamed on the setup function."""
    plan = tmp_path / "badplan.py"
    plan.write_text(source)
    done = _cli(f"{plan}:setup", "--world", "2")
    assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr
    assert message.format(target=f"{plan}:setup", file=plan) in done.stderr, done.stderr


def test_example_prints_a_512_rank_plan() -> None:
    done = subprocess.run([sys.executable, "examples/plan_at_scale.py"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rank 0 of 512, one step")
    assert "dp_shard" in done.stdout and "FSDPTransformer.layers.0.attention.wo" in done.stdout


if __name__ == "__main__":  # the planned fixture's process
    print(json.dumps(_plan_in_this_process()))


def test_plan_step_writes_the_traced_step_to_exporters(fake_pg: None, tmp_path: Path) -> None:
    """``exporters=``: the planned step's spans, readable, one collective per call."""
    import torch.distributed as dist

    from commspan.exporters import JsonlSpanExporter, read_spans

    def setup() -> Any:
        layer = torch.nn.Linear(4, 4)

        def step() -> None:
            out = layer(torch.randn(2, 4))
            dist.all_reduce(out)

        return step

    plan = plan_step(setup, world_size=4, warmup_steps=1,
                     exporters=[JsonlSpanExporter(tmp_path / "rank0.jsonl")])
    spans = list(read_spans(tmp_path / "rank0.jsonl"))
    events = [e for s in spans for e in s.events if e[0] == "all_reduce"]
    assert len(events) == plan.aggregator.total_count() == 1
