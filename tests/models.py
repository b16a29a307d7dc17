"""Small models the commspan tests run, and the two counting front ends of the ported tests.

The models are commspan's own: an MLP (two Linears around a ReLU), a stack of
them, and a toy decoder-only Transformer with a tensor-parallel plan that runs
on CPU under torch 2.13 (fake process group and gloo), optionally with
activation checkpointing per block, reentrant or not.

The ported reference tests run once through ``commspan.compat.CommDebugMode``
(the reference API, keyed by legacy ``torch.ops.c10d_functional`` packets) and
once through the native API (``CommSpanMode`` + its ``Aggregator``, keyed by
canonical names). :class:`CompatCounts` and :class:`NativeCounts` put both
behind one small interface so each test body is written once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint
from typing_extensions import Self

from commspan import CommSpanMode
from commspan.compat import CommDebugMode

__all__ = [
    "API_NAMES",
    "Attention",
    "CompatCounts",
    "FeedForward",
    "MLPModule",
    "MLPStacked",
    "ModelArgs",
    "NativeCounts",
    "Transformer",
    "TransformerBlock",
    "make_batch",
    "make_counter",
    "parallelize",
    "train_step",
]


# ---------------------------------------------------------------- MLPs
class MLPModule(nn.Module):
    """Linear(10, 16) -> ReLU -> Linear(16, 10), initialised from a fixed seed."""

    def __init__(self, device: str | torch.device = "cpu", bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.net1 = nn.Linear(10, 16, bias=bias, device=device)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.relu(self.net1(x))
        return self.net2(hidden)

    def reset_parameters(self) -> None:
        """Re-draw both Linears' parameters."""
        self.net1.reset_parameters()
        self.net2.reset_parameters()


class MLPStacked(nn.Module):
    """``n_layers`` MLPModules applied one after the other (``layers.<i>``)."""

    def __init__(self, device: str | torch.device = "cpu", n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPModule(device) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mlp in self.layers:
            x = mlp(x)
        return x


# ---------------------------------------------------------------- Transformer
@dataclasses.dataclass
class ModelArgs:
    """Sizes and switches of the toy Transformer (defaults keep a step a few ms).

    Attributes:
        checkpoint: block index -> ``use_reentrant`` for the blocks run under
            ``torch.utils.checkpoint``; blocks not listed run plainly.
    """

    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.0
    causal: bool = True
    weight_tying: bool = False
    checkpoint: Mapping[int, bool] = dataclasses.field(default_factory=dict)


class Attention(nn.Module):
    """Multi-head self-attention; ``n_heads`` is the number of heads this rank owns."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(f"dim={args.dim} must be a multiple of n_heads={args.n_heads}")
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.causal = args.causal
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.resid_dropout = nn.Dropout(args.dropout_p)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = t.shape
        return t.reshape(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        merged = mixed.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)
        return self.resid_dropout(self.wo(merged))


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear -> dropout."""

    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, a final norm and the vocab head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.model_args.max_seq_len:
            raise ValueError(
                f"tokens has {seq} positions; max_seq_len is {self.model_args.max_seq_len}"
            )
        positions = torch.arange(seq, device=tokens.device)
        h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for index, block in enumerate(self.layers):
            reentrant = self.model_args.checkpoint.get(index)
            if reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=reentrant)
        return self.output(self.norm(h)).float()


def parallelize(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Shard ``model`` over the 1-D ``mesh`` (tensor parallel, in place) and return it.

    Embeddings are row-sharded over the vocabulary with a replicated output;
    the vocab head is column-sharded and gathers its output. In each block
    wq/wk/wv are column-sharded and hand *local* shards to SDPA (the causal
    SDPA rejects DTensor inputs on CPU), so each rank runs
    ``n_heads / mesh.size()`` heads; wo and w2 are row-sharded, w1 is
    column-sharded.

    Raises:
        ValueError: ``n_heads`` or ``vocab_size`` is not a multiple of the mesh size.
    """
    tp = mesh.size()
    args = model.model_args
    for name in ("n_heads", "vocab_size"):
        if getattr(args, name) % tp:
            raise ValueError(
                f"{name}={getattr(args, name)} must be a multiple of the mesh size {tp}"
            )
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    block_plan = {
        "attention.wq": ColwiseParallel(use_local_output=True),
        "attention.wk": ColwiseParallel(use_local_output=True),
        "attention.wv": ColwiseParallel(use_local_output=True),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, mesh, block_plan)
        attention = block.get_submodule("attention")
        assert isinstance(attention, Attention)
        attention.n_heads //= tp
    if args.weight_tying:  # both weights are (vocab, dim) sharded S(0): tie the DTensors
        model.output.weight = model.tok_embeddings.weight
    return model


def make_batch(
    args: ModelArgs, batch: int = 2, seq: int = 8, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(tokens, targets)`` of shape ``(batch, seq)``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)
    return tokens, targets


def train_step(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward, cross-entropy and backward; returns the (detached) loss."""
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach()


# ---------------------------------------------------------------- counting front ends
API_NAMES = ("compat", "native")
"""The two ways the ported tests read counts: ``commspan.compat`` and the native API."""


class CompatCounts:
    """Reads counts through ``commspan.compat.CommDebugMode``, the reference way.

    Ops are looked up by the legacy ``torch.ops.c10d_functional`` packet, as the
    reference tests do.
    """

    api = "compat"

    def __init__(self) -> None:
        self.comm_mode = CommDebugMode()

    def __enter__(self) -> Self:
        self.comm_mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.comm_mode.__exit__(exc_type, exc, tb)

    @staticmethod
    def _packet(op: str) -> Any:
        return getattr(torch.ops.c10d_functional, op)

    def total(self) -> int:
        """All collectives seen in the context."""
        return self.comm_mode.get_total_counts()

    def count(self, op: str) -> int:
        """Collectives of canonical kind ``op`` seen in the context."""
        return self.comm_mode.get_comm_counts()[self._packet(op)]

    def module_count(self, fqn: str, op: str, phase: str | None = None) -> int:
        """``op`` collectives in module ``fqn``: one phase or all (backward includes recompute)."""
        per_module = self.comm_mode.comm_module_counts.get(fqn)
        if per_module is None:  # like the reference, modules without collectives are absent
            return 0
        if phase is None:
            return per_module[self._packet(op)]
        return per_module[phase][self._packet(op)]

    def module_depths(self) -> dict[str, int]:
        """``{fqn: depth}`` of every module seen, ``Global`` included."""
        return dict(self.comm_mode.advanced_module_tracker.module_depth_dict)

    def parameter_keys(self) -> list[tuple[str, str]]:
        """``(module fqn, parameter name)`` of every parameter seen, in order."""
        return _nested_keys(self.comm_mode.get_parameter_info())

    def sharding_keys(self) -> list[str]:
        """``"<fqn>.<param>"`` of every DTensor parameter seen, in order."""
        return list(self.comm_mode.get_sharding_info())


class NativeCounts:
    """Reads counts through ``CommSpanMode`` and its aggregator (canonical op names)."""

    api = "native"

    def __init__(self) -> None:
        self.mode = CommSpanMode()

    def __enter__(self) -> Self:
        self.mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.mode.__exit__(exc_type, exc, tb)

    @property
    def _agg(self) -> Any:
        assert self.mode.aggregator is not None
        return self.mode.aggregator

    def total(self) -> int:
        """All collectives seen in the context."""
        return self._agg.total_count()

    def count(self, op: str) -> int:
        """Collectives of canonical kind ``op`` seen in the context."""
        return self._agg.comm_counts().get(op, 0)

    def module_count(self, fqn: str, op: str, phase: str | None = None) -> int:
        """``op`` collectives in module ``fqn``: one phase or all (backward includes recompute)."""
        phases = self._agg.module_counts().get(fqn, {})
        wanted = {None: phases, "forward": ["forward"], "backward": ["backward", "recompute"]}
        return sum(phases.get(p, {}).get(op, 0) for p in wanted[phase])

    def module_depths(self) -> dict[str, int]:
        """``{fqn: depth}`` of every module seen, ``Global`` (depth 0) included."""
        depths = {"Global": 0}

        def walk(node: dict[str, Any], depth: int) -> None:
            for child in node["children"]:
                depths[child["fqn"]] = depth
                walk(child, depth + 1)

        walk(self._agg.to_dict(), 1)
        return depths

    def parameter_keys(self) -> list[tuple[str, str]]:
        """``(module fqn, parameter name)`` of every parameter seen, in order."""
        return _nested_keys(self._agg.parameter_info())

    def sharding_keys(self) -> list[str]:
        """``"<fqn>.<param>"`` of every DTensor parameter seen, in order."""
        return list(self._agg.sharding_info())


Counts = CompatCounts | NativeCounts


def make_counter(api: str) -> Counts:
    """A fresh counting front end: ``"compat"`` or ``"native"``."""
    if api == "compat":
        return CompatCounts()
    if api == "native":
        return NativeCounts()
    raise ValueError(f"api={api!r} is not one of {API_NAMES}")


def _nested_keys(nested: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    return [(outer, inner) for outer, values in nested.items() for inner in values]
