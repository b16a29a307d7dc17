"""A tensor-parallel toy Transformer on 4 CPU ranks, traced by commspan.

Run it with one command (it spawns its own gloo ranks), or under torchrun::

    python examples/tp_transformer.py [--out DIR] [--steps N] [--sequence-parallel]
    torchrun --nproc-per-node 4 examples/tp_transformer.py

Every rank writes its spans to ``DIR/commspan-rank<r>.jsonl`` (default
``./commspan-out``). With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set (e.g.
``http://localhost:4318`` for Jaeger) the spans also go to that backend, one
trace per step. Rank 0 prints the collectives each module issued.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from opentelemetry.sdk.trace.export import SpanExporter
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter, otlp_exporter

WORLD_SIZE = 4


# The model is a copy of commspan.testing.models.Transformer, kept short here so
# the example reads on its own (tests/test_example.py checks the two agree).
@dataclass
class Config:
    vocab: int = 8
    max_seq: int = 16
    dim: int = 16
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0
    checkpointed: tuple[int, ...] = (1,)  # blocks re-run in backward (activation checkpointing)


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.dim, c.dim, bias=False) for _ in range(4))
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # under TP, q/k/v hold this rank's heads only
        q, k, v = (
            w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.wo(o.transpose(1, 2).reshape(b, s, -1)))


class FeedForward(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1, self.gelu = nn.Linear(c.dim, 4 * c.dim), nn.GELU()
        self.w2, self.resid_dropout = nn.Linear(4 * c.dim, c.dim), nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(c.dim), Attention(c)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(c.dim), FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.checkpointed = set(c.checkpointed)
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.pos_embeddings = nn.Embedding(c.max_seq, c.dim)
        self.dropout = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(TransformerBlock(c) for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        h = self.dropout(h)
        for i, layer in enumerate(self.layers):
            h = checkpoint(layer, h, use_reentrant=False) if i in self.checkpointed else layer(h)
        return self.output(self.norm(h))


def parallelize(
    model: Transformer, mesh: DeviceMesh, sequence_parallel: bool = False
) -> Transformer:
    """Megatron-style tensor parallelism over a 1-D mesh; with ``sequence_parallel`` the
    activations between the blocks' matmuls are sharded along the sequence (norms run
    on sequence shards, wo and w2 reduce-scatter instead of all-reducing)."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the activations between blocks
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "pos_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else seq
        ),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    })
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(use_local_output=True),
            "attention.wk": ColwiseParallel(use_local_output=True),
            "attention.wv": ColwiseParallel(use_local_output=True),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:  # norms on sequence shards; gather before the matmuls
            for norm, inner in (("attention_norm", "attention"), ("ffn_norm", "feed_forward")):
                plan[norm] = SequenceParallel()
                plan[inner] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
        parallelize_module(block, mesh, plan)
        block.attention.n_heads //= mesh.size()  # each rank owns n_heads / tp heads
    return model


def train(out: Path, steps: int, sequence_parallel: bool = False, timing: bool = True) -> None:
    """One rank: build the model, train ``steps`` steps under commspan."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = Config()
    torch.manual_seed(0)  # same weights and data on every rank
    model = parallelize(Transformer(config), mesh, sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    path = out / f"commspan-rank{rank}.jsonl"
    path.unlink(missing_ok=True)  # JsonlSpanExporter appends; start afresh
    exporters: list[SpanExporter] = [JsonlSpanExporter(path)]
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        exporters.append(otlp_exporter())

    tokens = torch.randint(0, config.vocab, (2, 9))  # one toy batch, learnt by heart
    mode = CommSpanMode(exporters=exporters, time_collectives=timing)
    with mode:
        for i in range(steps):
            with mode.step(i):  # one trace per step, shared by all ranks
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
        print(f"\nCollectives per module on rank 0, summed over {steps} steps:")
        print(mode.aggregator.table(noise_level=1))
        print("Spans written to:")
        for file in sorted(out.glob("commspan-rank*.jsonl")):
            print(f"  {file}")


# ---------------------------------------------------------------- running the ranks
# (the other examples launch their ranks and check their arguments with these too)
def free_port() -> int:
    """A free TCP port on 127.0.0.1, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_out_dir(parser: argparse.ArgumentParser, out: Path) -> None:
    """Make ``--out``; a file given where the directory goes is one error line, not a
    traceback."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {out}: cannot make this directory ({exc.strerror}); "
                     "pass a directory, new or existing, you can write to")


def add_out_and_steps(parser: argparse.ArgumentParser, out: str, steps: int) -> None:
    """The ``--out DIR`` and ``--steps N`` options of a training example."""
    parser.add_argument("--out", type=Path, default=Path(out),
                        help="JSONL directory; its commspan-rank*.jsonl files of an earlier "
                             "run are replaced (the exporter itself appends)")
    parser.add_argument("--steps", type=int, default=steps, help="training steps")


def parse_training_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line of a training example and check ``--steps`` and ``--out``
    before any rank starts."""
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: pass 1 or more training steps")
    make_out_dir(parser, args.out)
    return args


def launch(train: Callable[..., None], world_size: int, *train_args: Any) -> None:
    """``train(*train_args)`` on every rank: this process is one rank under torchrun;
    otherwise ``world_size`` gloo ranks are forked here (they reuse the imported torch,
    CPU only)."""
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        dist.init_process_group("gloo")
        try:
            train(*train_args)
        finally:
            dist.destroy_process_group()
    else:
        torch.multiprocessing.start_processes(
            _rank_main, (free_port(), world_size, train, train_args), world_size,
            start_method="fork",
        )


def _rank_main(rank: int, port: int, world_size: int, train: Callable[..., None],
               train_args: tuple[Any, ...]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        train(*train_args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_and_steps(parser, "commspan-out", 3)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="shard activations along the sequence between the matmuls")
    parser.add_argument("--no-timing", action="store_true",
                        help="record when collectives are issued only, not their durations")
    args = parse_training_args(parser)
    launch(train, WORLD_SIZE, args.out, args.steps, args.sequence_parallel, not args.no_timing)


if __name__ == "__main__":
    main()
