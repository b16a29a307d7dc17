"""Bytes of one step's trace for world sizes 8 to 4,096, by simulation on the fake process group.

For each world size W, one spawned process plays rank 0 of a TP 8 x FSDP (W / 8)
job (``commspan.plan_step``) on the toy Transformer at the step section's
medium size, one untraced warm-up step then one traced step written to JSONL:
the file's size is what a rank writes per step (plain, and with
``compress=True``). Ranks of a TP x FSDP job issue
the same collectives with the same shapes, so rank 0 stands for every rank,
and a step's trace is that size times the ranks that trace: all of them, or a
sample (``CommSpanMode(ranks=...)``: a fraction 1/8, one rank per TP group,
one rank per FSDP group).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import run_in_subprocess

__all__ = ["WORLDS", "run_tracesize"]

WORLDS = (8, 64, 512, 4096)
TP = 8


def _rank_bytes(world: int) -> dict[str, Any]:
    import torch

    from benchmarks.common import quiet
    from commspan import plan_step
    from commspan.exporters import JsonlSpanExporter
    from commspan.testing.models import ModelArgs, make_batch, tp_fsdp_transformer, train_step

    quiet()
    torch.set_num_threads(1)
    args = ModelArgs(n_layers=4, vocab_size=1024, dim=256, n_heads=8, max_seq_len=64,
                     checkpoint={1: False, 3: False})

    def setup() -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
        model = tp_fsdp_transformer(args, mesh)
        tokens, targets = make_batch(args, batch=8, seq=64)
        return lambda: train_step(model, tokens, targets)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank0.jsonl"
        packed = Path(tmp) / "rank0.jsonl.gz"
        plan = plan_step(setup, world_size=world, warmup_steps=1,
                         exporters=[JsonlSpanExporter(path),
                                    JsonlSpanExporter(packed, compress=True)])
        size, gz_size = path.stat().st_size, packed.stat().st_size
    return {"bytes_per_rank_step": size, "gzip_bytes_per_rank_step": gz_size,
            "collectives": plan.aggregator.total_count(), "seconds": plan.seconds}


def run_tracesize(worlds: tuple[int, ...] = WORLDS) -> dict[str, Any]:
    """Bytes per rank per step, and per step for the whole job with and without sampling."""
    out: dict[str, Any] = {"tp": TP, "worlds": {}}
    for world in worlds:
        rank = run_in_subprocess(_rank_bytes, world, timeout_s=600)
        per = rank["bytes_per_rank_step"]
        traced = {"all ranks": world, "fraction 1/8": len(range(0, world, 8)),
                  "one per TP group": world // TP, "one per FSDP group": TP}
        gz = rank["gzip_bytes_per_rank_step"]
        out["worlds"][str(world)] = {**rank, "traced_ranks": traced,
                                     "step_bytes": {k: per * n for k, n in traced.items()},
                                     "gzip_step_bytes_all": gz * world}
    return out
