"""The communication of one training step of a 512-rank job, on this CPU, in seconds.

torch's fake process group lets one process play rank 0 of a job of any size:
collectives return at once, but every shape, group and mesh dimension is the
one that rank would use. This example builds the toy Transformer of
``commspan.testing.models`` (embeddings, attention, feed-forward, norms) at a
size worth planning for, applies tensor parallelism over the mesh's ``tp``
dimension and FSDP2 over ``dp_shard`` (as torchtitan does), and prints what
rank 0 issues in one step, per mesh dimension and per module, with counts and
bytes::

    python examples/plan_at_scale.py                 # TP 8 x FSDP 64, world 512
    python examples/plan_at_scale.py --world 4096 --tp 8 --json

The same from the command line, for any file with a ``setup()`` function::

    commspan plan examples/plan_at_scale.py:setup --world 512

``setup()`` builds the mesh, the model and its plan in the fake world and
returns the step; :func:`commspan.plan_step` runs it under commspan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commspan import plan_step
from commspan.testing.models import ModelArgs, make_batch, tp_fsdp_transformer, train_step

# the toy model's output is a view; its step does no in-place op on it
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

# a model worth planning for, small enough to build on a laptop CPU in seconds
ARGS = ModelArgs(n_layers=4, vocab_size=8192, dim=1024, n_heads=16, max_seq_len=512)
BATCH, SEQ = 1, 512


def setup(tp: int | None = None) -> object:
    """Mesh (dp_shard x tp), model, TP over ``tp`` then FSDP2 over ``dp_shard``; the step.

    ``tp`` defaults to ``$PLAN_TP`` or 8; dp_shard is the world size / tp.
    """
    tp = int(os.environ.get("PLAN_TP", "8")) if tp is None else tp
    if tp < 1:
        raise ValueError(f"tp={tp} is not valid; pass a tensor-parallel degree of 1 or more")
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of tp={tp}")
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    model = tp_fsdp_transformer(ARGS, mesh)  # TP over "tp", then FSDP2 over "dp_shard"
    tokens, targets = make_batch(ARGS, batch=BATCH, seq=SEQ)
    return lambda: train_step(model, tokens, targets)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=512, help="ranks in the job (default 512)")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (default 8)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.tp < 1 or args.world < args.tp or args.world % args.tp:
        parser.error(f"--world {args.world} --tp {args.tp}: the world size must be a "
                     "positive multiple of the tensor-parallel degree (1 or more), e.g. "
                     "--world 512 --tp 8")
    torch.set_num_threads(1)
    plan = plan_step(lambda: setup(args.tp), world_size=args.world)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
