"""examples/fsdp2_tp.py runs end to end: TP + FSDP2 on a 2x2 mesh of 4 gloo ranks.

Every collective has an owner and a mesh dimension name: FSDP2's on ``dp``,
owned by the unit whose parameters they move; tensor parallelism's on ``tp``,
owned by the layer that issues them. The reference for the FSDP units is built
here without commspan: the same model, tensor-parallel on the fake process
group, gives each unit's local parameter sizes (what FSDP2 gathers, padded to
the ``dp`` size); FSDP2 gathers each unit once for forward, each block once
more for backward (the root stays gathered) and reduces each unit's gradients
once per step.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from commspan import semconv
from commspan.exporters import read_spans

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fsdp2_tp.py"
RANKS = 4
STEPS = 2
DP = 2
ROOT = "FSDPTransformer"
LAYERS = [f"{ROOT}.layers.0", f"{ROOT}.layers.1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the example once, as a user would, into a fresh output directory."""
    out = tmp_path_factory.mktemp("fsdp2-tp") / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the example starts its own ranks
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--steps", str(STEPS)],
        check=False, capture_output=True, text=True, timeout=600, env=env, cwd=out.parent,
    )
    return proc, out


def _unit_sizes(fake_pg: None) -> dict[str, int]:
    """Elements FSDP2 gathers per unit: the root's and a block's own parameters as
    tensor parallelism leaves them on a rank, dim 0 padded to a multiple of dp."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from tp_transformer import Config, Transformer, parallelize
    finally:
        sys.path.pop(0)
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, RANKS // DP), mesh_dim_names=("dp", "tp"))
    model = parallelize(Transformer(Config()), mesh["tp"])

    def padded(params: list[torch.Tensor]) -> int:
        total = 0
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            shape = list(local.shape) or [1]
            total += math.ceil(shape[0] / DP) * DP * math.prod(shape[1:])
        return total

    block = list(model.layers[0].parameters())
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return {"root": padded(root), "block": padded(block)}


@pytest.mark.multiprocess
def test_example_prints_no_torch_warning(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """FSDP2's "returned a view tensor" warning (the TP output layer's local tensor is
    a view; the loop uses it out of place) came four times before the example's
    output: a new user took the example for broken."""
    proc, _ = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "returned a view tensor" not in proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]


def test_example_runs_and_prints_owners(run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """The example exits 0, prints a loss per step, the table and the owner lines."""
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sum(line.startswith("step ") for line in proc.stdout.splitlines()) == STEPS
    assert "by owner, kind (or op), phase and mesh dimension" in proc.stdout
    files = sorted(out.glob("commspan-rank*.jsonl"))
    assert len(files) == RANKS
    # where the spans went, as tp_transformer.py says it
    assert proc.stdout.split("Spans written to:\n", 1)[1].split() == [str(f) for f in files]


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", range(RANKS))
def test_every_collective_has_an_owner_and_a_mesh_dimension(
    run: tuple[subprocess.CompletedProcess[str], Path], rank: int, fake_pg: None
) -> None:
    """FSDP2's collectives are on dp, owned by the unit they move (size and count
    reference above), in order of the blocks; tensor parallelism's are on tp, owned
    by the layer that issued them (the span they sit on)."""
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    sizes = _unit_sizes(fake_pg)
    assert sizes["root"] != sizes["block"]
    events: list[tuple[int, dict[str, Any]]] = []
    for span in read_spans(out / f"commspan-rank{rank}.jsonl"):
        for (_, attrs), when in zip(span.events, span.event_times):
            if semconv.COLL_OP in attrs:
                events.append((when, attrs))
    events.sort(key=lambda item: item[0])
    assert events
    fsdp: Counter[tuple[str, str, str]] = Counter()
    forward_gathers: list[str] = []
    for _, attrs in events:
        assert attrs.get(semconv.OWNER_FQN), attrs
        if attrs[semconv.OWNER_SOURCE] == semconv.SOURCE_FSDP:
            assert attrs[semconv.MESH_DIM_NAME] == "dp"
            owner, kind = attrs[semconv.OWNER_FQN], attrs[semconv.OWNER_KIND]
            want = sizes["root"] if owner == ROOT else sizes["block"]
            assert owner in (ROOT, *LAYERS)
            assert attrs[semconv.OWNER_BYTES] == want * 4, attrs
            fsdp[(owner, kind, attrs[semconv.PHASE])] += 1
            if kind == "unshard" and attrs[semconv.PHASE] == "forward":
                forward_gathers.append(owner)
        else:
            assert attrs[semconv.OWNER_SOURCE] == semconv.SOURCE_POSITION
            assert attrs[semconv.MESH_DIM_NAME] == "tp"
            assert attrs[semconv.OWNER_FQN] == attrs[semconv.MODULE_FQN]
    expected = Counter({
        (ROOT, "unshard", "forward"): STEPS,  # the root stays gathered for backward
        (ROOT, "reduce_grad", "backward"): STEPS,
    })
    for layer in LAYERS:
        for kind, phase in (("unshard", "forward"), ("unshard", "backward"),
                            ("reduce_grad", "backward")):
            expected[(layer, kind, phase)] = STEPS
    assert fsdp == expected
    assert forward_gathers == [ROOT, *LAYERS] * STEPS


def test_table_by_mesh_dim_of_the_run(run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """``commspan table OUT --rank 0 --by-mesh-dim --json``: per mesh dimension, the
    count and input bytes of rank 0's collectives, as summed here from the events'
    own group and size attributes; per owner, the same totals again."""
    import json

    proc, out = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, "-m", "commspan.cli", "table", str(out), "--rank", "0",
         "--by-mesh-dim", "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    expected: dict[str, dict[str, dict[str, int]]] = {}
    for span in read_spans(out / "commspan-rank0.jsonl"):
        for _, attrs in span.events:
            if semconv.COLL_OP not in attrs:
                continue
            slot = expected.setdefault(str(attrs[semconv.MESH_DIM_NAME]), {}).setdefault(
                str(attrs[semconv.COLL_OP]), {"count": 0, "bytes": 0})
            slot["count"] += 1
            slot["bytes"] += int(attrs[semconv.TENSOR_BYTES])
    assert set(expected) == {"dp", "tp"}
    assert data["totals"] == expected
    summed: dict[str, dict[str, dict[str, int]]] = {}
    for module in data["modules"]:
        for dim, ops in module["mesh_dims"].items():
            for op, v in ops.items():
                slot = summed.setdefault(dim, {}).setdefault(op, {"count": 0, "bytes": 0})
                slot["count"] += v["count"]
                slot["bytes"] += v["bytes"]
    assert summed == expected
    text = subprocess.run(
        [sys.executable, "-m", "commspan.cli", "table", str(out), "--rank", "0",
         "--by-mesh-dim"], capture_output=True, text=True, timeout=120, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO))).stdout
    assert text.startswith("mesh dim  op") and "\ntp " in text and "\ndp " in text


def test_digests_give_the_same_tables_as_the_lines(
    run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`table` (and `--json`) read from digests equal `table` read from the lines, module
    order included: modules FSDP2 credits through the rank span (layers.1's unshards
    before it ran) were listed first from digests, at the rank span's start."""
    import shutil

    from commspan.cli import main

    proc, out = run
    assert proc.returncode == 0, proc.stderr
    digested = tmp_path / "digested"
    shutil.copytree(out, digested)
    assert main(["digest", str(digested)]) == 0
    capsys.readouterr()
    for args in (["--rank", "0"], ["--rank", "all"], ["--rank", "1", "--step", "0"],
                 ["--rank", "0", "--json"]):
        answers = []
        for folder in (out, digested):
            code = main(["table", str(folder), *args])
            answers.append((code, capsys.readouterr().out))
        assert answers[0] == answers[1], args
        assert answers[0][1].index("tok_embeddings") < answers[0][1].index("layers.1"), args
