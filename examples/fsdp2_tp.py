"""FSDP2 + tensor parallelism on a 2x2 mesh of 4 CPU ranks, traced by commspan.

The toy Transformer of ``tp_transformer.py`` (embeddings, attention,
feed-forward, norms; its second block under activation checkpointing) is
tensor-parallel over the mesh's ``tp`` dimension and sharded with FSDP2
(``fully_shard``: each block, then the root) over its ``dp`` dimension, as
torchtitan does. Run it with one command (it spawns its own gloo ranks), or
under torchrun::

    python examples/fsdp2_tp.py [--out DIR] [--steps N]
    torchrun --nproc-per-node 4 examples/fsdp2_tp.py

Every rank writes its spans to ``DIR/commspan-rank<r>.jsonl`` (default
``./commspan-out-fsdp2-tp``). Rank 0 prints the module table, then its
collectives grouped by owner, kind and mesh dimension: FSDP2's all-gathers and
reduce-scatters on ``dp``, owned by the block (or root) whose parameters they
move, wherever they were issued; the tensor-parallel all-reduces and
all-gathers on ``tp``, owned by the layer that issues them.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_transformer import (  # noqa: E402 - the sibling example
    Config,
    Transformer,
    add_out_and_steps,
    launch,
    parallelize,
    parse_training_args,
)

from commspan import CommSpanMode, semconv  # noqa: E402
from commspan.exporters import JsonlSpanExporter, read_spans  # noqa: E402

WORLD_SIZE = 4
MESH = (2, 2)  # (dp, tp)

# The root's output is a view: tensor parallelism's output layer hands back its
# DTensor's local tensor (`to_local()` is a view), and FSDP2 warns once per rank that
# an in-place op on it (`logits += ...`) would skip its pre-backward hook. This loop
# uses the logits out of place only (cross_entropy), so the warning does not apply.
warnings.filterwarnings(
    "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
)


def build(config: Config) -> torch.nn.Module:
    """The Transformer, tensor-parallel over ``tp``, then FSDP2 over ``dp``."""
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # same weights and data on every rank
    model = parallelize(Transformer(config), mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # the root: embeddings, final norm, output
    return model


def train(out: Path, steps: int) -> None:
    """One rank: build the model, train ``steps`` steps under commspan."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    config = Config()
    model = build(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = out / f"commspan-rank{rank}.jsonl"
    path.unlink(missing_ok=True)  # JsonlSpanExporter appends; start afresh
    tokens = torch.randint(0, config.vocab, (2, 9))
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)])
    with mode:
        for i in range(steps):
            with mode.step(i):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            if rank == 0:
                print(f"step {i}: loss {loss.item():.4f}")
    mode.shutdown()
    dist.barrier()  # every rank's file is complete
    if rank == 0:
        assert mode.aggregator is not None
        print(f"\nCollectives per module on rank 0, summed over {steps} steps:")
        print(mode.aggregator.table())
        print("Rank 0's collectives by owner, kind (or op), phase and mesh dimension:")
        for line in owners(path):
            print(f"  {line}")
        print("Spans written to:")
        for file in sorted(out.glob("commspan-rank*.jsonl")):
            print(f"  {file}")


def owners(path: Path) -> list[str]:
    """``count  owner  kind/op  on <mesh dim>`` lines from one rank's JSONL file."""
    seen: Counter[tuple[str, str, str, str]] = Counter()
    for span in read_spans(path):
        for _, attrs in span.events:
            if semconv.COLL_OP not in attrs:
                continue
            seen[(
                str(attrs.get(semconv.OWNER_FQN)),
                str(attrs.get(semconv.OWNER_KIND) or attrs[semconv.COLL_OP]),
                str(attrs.get(semconv.PHASE)),
                str(attrs.get(semconv.MESH_DIM_NAME, "?")),
            )] += 1
    return [f"{n:3d}  {fqn:<44} {kind:<22} {phase:<9} on {dim}"
            for (fqn, kind, phase, dim), n in sorted(seen.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_and_steps(parser, "commspan-out-fsdp2-tp", 2)
    args = parse_training_args(parser)
    launch(train, WORLD_SIZE, args.out, args.steps)


if __name__ == "__main__":
    main()
