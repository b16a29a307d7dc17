"""The benchmark workload: the toy tensor-parallel Transformer of
:mod:`commspan.testing.models` at benchmark sizes, and its training step.

The model is a plain decoder (token and position embeddings, pre-norm blocks
of attention and a GELU feed-forward, a final norm and an output projection),
made tensor-parallel over a 1-D mesh by :func:`commspan.testing.models.parallelize`:

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
from torch import nn

from commspan.testing.models import ModelArgs, Transformer, parallelize
from commspan.testing.models import make_batch as _make_batch
from commspan.testing.models import train_step as _train_step

__all__ = ["SIZES", "ModelConfig", "build_model", "make_batch", "train_step"]


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

    def model_args(self) -> ModelArgs:
        """The shared toy Transformer's arguments for this shape."""
        return ModelArgs(
            n_layers=self.n_layers,
            vocab_size=self.vocab,
            max_seq_len=self.seq,
            dim=self.dim,
            n_heads=self.n_heads,
            dropout_p=self.dropout,
            checkpoint={i: False for i in range(self.n_layers) if self.checkpointed(i)},
        )


SIZES: dict[str, ModelConfig] = {
    # the model of MEASUREMENTS.md and issue 4
    "medium": ModelConfig(),
    # more compute per dispatched op: the overhead ratio shrinks as the model grows
    "large": ModelConfig(dim=512, n_heads=16, n_layers=8, vocab=4096, seq=128, batch=8),
    # the --quick smoke run and the memory run: same modules and collectives, little compute
    "small": ModelConfig(dim=64, n_heads=8, n_layers=4, vocab=256, seq=32, batch=4),
}


def build_model(cfg: ModelConfig, mesh: Any, seed: int = 0) -> Transformer:
    """The model, tensor-parallel over the 1-D ``mesh`` (same weights on every rank)."""
    torch.manual_seed(seed)
    return parallelize(Transformer(cfg.model_args()), mesh)


def make_batch(cfg: ModelConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, identical on every rank."""
    return _make_batch(cfg.model_args(), cfg.batch, cfg.seq, seed)


def train_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """zero grads, forward, cross-entropy, backward (and ``optimizer.step()``)."""
    return float(_train_step(model, *batch, optimizer, zero_grad=True))
