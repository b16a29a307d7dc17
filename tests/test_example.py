"""examples/tp_transformer.py runs end to end: 4 gloo ranks, a table, one JSONL file per rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _example_run import load_example

from commspan import Aggregator
from commspan.testing.models import ModelArgs, Transformer

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tp_transformer.py"
RANKS = 4
STEPS = 2


def _block(table: str, fqn: str) -> dict[str, dict[str, int]]:
    """``{phase: {op: n}}`` of one module in ``Aggregator.table()`` text."""
    lines = table.splitlines()
    start = next(
        i for i, line in enumerate(lines) if re.fullmatch(rf"\s*{re.escape(fqn)}( \(\w+\))?", line)
    )
    indent = len(lines[start]) - len(lines[start].lstrip())
    counts: dict[str, dict[str, int]] = {}
    for line in lines[start + 1 :]:
        if len(line) - len(line.lstrip()) <= indent:
            break  # next module at the same or an outer level
        found = re.fullmatch(r"\s*\*(\w+): (.*)", line)
        if found and len(line) - len(line.lstrip()) == indent + 2:
            ops = (item.rsplit(" ", 1) for item in found.group(2).split(", "))
            counts[found.group(1)] = {op: int(n) for op, n in ops}
    return counts


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the example once, as a user would, into a fresh output directory."""
    out = tmp_path_factory.mktemp("example") / "commspan-out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the example must start its own ranks
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--steps", str(STEPS)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=out.parent,
    )
    return proc, out


@pytest.mark.multiprocess
def test_example_exits_cleanly(run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """The example exits 0 and prints one loss line per step, then the table."""
    proc, _ = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(re.findall(r"^step \d+: loss \d", proc.stdout, re.MULTILINE)) == STEPS
    assert "Collectives per module on rank 0" in proc.stdout


@pytest.mark.multiprocess
def test_example_table_has_forward_and_backward_counts(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Rank 0's table counts forward and backward collectives; wo all_reduces once a step."""
    proc, _ = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    total = _block(proc.stdout, "Global")
    assert sum(total["forward"].values()) > 0
    assert sum(total["backward"].values()) > 0
    assert sum(total["recompute"].values()) > 0  # layer 1 is checkpointed
    wo = _block(proc.stdout, "Transformer.layers.0.attention.wo")
    assert wo["forward"] == {"all_reduce": STEPS}
    assert "S(1)" in proc.stdout  # noise level 1: parameter placements are shown


@pytest.mark.multiprocess
def test_example_writes_one_jsonl_file_per_rank(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Each rank wrote its own JSONL file, rank 0 printed their paths, and they read back."""
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(out.glob("commspan-rank*.jsonl"))
    assert [f.name for f in files] == [f"commspan-rank{r}.jsonl" for r in range(RANKS)]
    for f in files:
        assert str(f) in proc.stdout
        assert Aggregator.from_jsonl(f).total_count() > 0
    # the file holds what the live aggregator printed
    printed = _block(proc.stdout, "Global")
    assert Aggregator.from_jsonl(out, rank=0).module_counts()["Global"] == printed


def _shape(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """``({module name: type}, {parameter name: shape})``."""
    modules = {name: type(m).__name__ for name, m in model.named_modules()}
    return modules, {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_example_model_matches_the_shared_toy_model() -> None:
    """The example's own Transformer has the modules (names and types) and the parameter
    shapes of commspan.testing.models.Transformer for the same sizes, and checkpoints the
    same block."""
    example = load_example(EXAMPLE)
    config = example.Config()
    shared = ModelArgs(
        n_layers=config.n_layers,
        vocab_size=config.vocab,
        max_seq_len=config.max_seq,
        dim=config.dim,
        n_heads=config.n_heads,
        dropout_p=config.dropout,
        checkpoint={i: False for i in config.checkpointed},
    )
    assert _shape(example.Transformer(config)) == _shape(Transformer(shared))
    assert type(example.Transformer(config)).__name__ == "Transformer"  # the spans' root name
