"""The benchmark workload: a small tensor-parallel Transformer and its training step.

The model is a plain decoder (token and position embeddings, pre-norm blocks
of attention and a GELU feed-forward, a final norm and an output projection),
made tensor-parallel over a 1-D mesh with torch's ``parallelize_module``:

* embeddings row-wise (vocabulary sharded), output column-wise gathered back
  to a replicated tensor;
* ``wq``/``wk``/``wv`` column-wise returning *local* shards, so attention runs
  on plain tensors (SDPA with a causal mask on DTensors fails on CPU in torch
  2.13) with ``n_heads / world`` heads per rank; ``wo`` row-wise;
* the feed-forward ``w1`` column-wise, ``w2`` row-wise.

Every other block runs under ``torch.utils.checkpoint`` (non-reentrant), so
the step has forward, backward and recompute phases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SIZES",
    "ModelConfig",
    "TinyTransformer",
    "build_model",
    "make_batch",
    "train_step",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the benchmark model and of one batch."""

    dim: int = 256
    n_heads: int = 8
    n_layers: int = 4
    vocab: int = 1024
    seq: int = 64
    batch: int = 8
    dropout: float = 0.0
    checkpoint_every: int = 2
    """Block ``i`` runs under activation checkpointing when ``i % checkpoint_every == 1``."""

    def checkpointed(self, index: int) -> bool:
        return self.checkpoint_every > 0 and index % self.checkpoint_every == 1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SIZES: dict[str, ModelConfig] = {
    # the model of MEASUREMENTS.md and issue 4
    "medium": ModelConfig(),
    # more compute per dispatched op: the overhead ratio shrinks as the model grows
    "large": ModelConfig(dim=512, n_heads=16, n_layers=8, vocab=4096, seq=128, batch=8),
    # the --quick smoke run and the memory run: same modules and collectives, little compute
    "small": ModelConfig(dim=64, n_heads=8, n_layers=4, vocab=256, seq=32, batch=4),
}


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"dim={cfg.dim} must be a multiple of n_heads={cfg.n_heads}")
        self.n_heads = cfg.n_heads  # per rank once parallelized
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.dropout(self.wo(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.act = nn.GELU()
        self.w2 = nn.Linear(4 * cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(self.act(self.w1(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.dropout(self.tok(tokens) + self.pos(positions))
        for i, block in enumerate(self.blocks):
            if self.cfg.checkpointed(i):
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(self.norm(h))


def build_model(cfg: ModelConfig, mesh: Any, seed: int = 0) -> TinyTransformer:
    """The model, tensor-parallel over the 1-D ``mesh`` (same weights on every rank)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = mesh.size()
    for name, value in (("n_heads", cfg.n_heads), ("vocab", cfg.vocab), ("dim", cfg.dim)):
        if value % world:
            raise ValueError(f"{name}={value} must be a multiple of the mesh size {world}")
    torch.manual_seed(seed)
    model = TinyTransformer(cfg)
    parallelize_module(
        model,
        mesh,
        {
            "tok": RowwiseParallel(input_layouts=Replicate()),
            "pos": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        parallelize_module(
            block,
            mesh,
            {
                "attn.wq": ColwiseParallel(use_local_output=True),
                "attn.wk": ColwiseParallel(use_local_output=True),
                "attn.wv": ColwiseParallel(use_local_output=True),
                "attn.wo": RowwiseParallel(),
                "mlp.w1": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(),
            },
        )
        attn: SelfAttention = block.attn  # type: ignore[assignment]
        attn.n_heads //= world
    return model


def make_batch(cfg: ModelConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    targets = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    return tokens, targets


def train_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """zero grads, forward, cross-entropy, backward (and ``optimizer.step()``)."""
    tokens, targets = batch
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return float(loss.detach())
