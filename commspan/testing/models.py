"""Toy models to trace: the ones commspan's tests and benchmarks run, for yours too.

- :class:`MLP`: two Linears around a ReLU (``net1``, ``relu``, ``net2``);
  :func:`parallelize_mlp` makes it tensor-parallel (``net1`` column-wise,
  ``net2`` row-wise: one all_reduce in forward, one in backward);
  :class:`MLPModule` is the 10 -> 16 -> 10 one of torch's own tests, seeded;
  :class:`MLPStacked` a stack of them, blocks optionally checkpointed;
- :class:`Transformer`: a toy decoder-only Transformer (:class:`ModelArgs`
  sizes it) with a tensor-parallel plan (:func:`parallelize`) that runs on CPU
  under torch 2.13 (fake process group and gloo), optionally with activation
  checkpointing per block, reentrant or not; :func:`make_batch` and
  :func:`train_step` drive it.

The example ``examples/tp_transformer.py`` keeps its own, shorter copy of the
Transformer; ``tests/test_example.py`` checks that it has the same modules and
parameter shapes.

Example:
    >>> import torch
    >>> from commspan.testing import capture
    >>> from commspan.testing.models import MLP
    >>> with capture() as cap:
    ...     MLP()(torch.ones(2, 8)).sum().backward()
    >>> cap.aggregator.modules()
    ['MLP', 'MLP.net1', 'MLP.relu', 'MLP.net2']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

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

__all__ = [
    "MLP",
    "Attention",
    "FeedForward",
    "MLPModule",
    "MLPStacked",
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "make_batch",
    "parallelize",
    "parallelize_mlp",
    "tp_fsdp_transformer",
    "train_step",
]


# ---------------------------------------------------------------- MLPs
class MLP(nn.Module):
    """``Linear(dim, hidden) -> ReLU -> Linear(hidden, dim)``."""

    def __init__(
        self, dim: int = 8, hidden: int = 16, *, bias: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self.net1 = nn.Linear(dim, hidden, bias=bias, device=device)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, dim, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))

    def reset_parameters(self) -> None:
        """Re-draw both Linears' parameters."""
        self.net1.reset_parameters()
        self.net2.reset_parameters()


def parallelize_mlp(mlp: MLP, mesh: DeviceMesh) -> MLP:
    """Shard ``mlp`` over the 1-D ``mesh`` in place: net1 column-wise, net2 row-wise."""
    parallelize_module(mlp, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    return mlp


class MLPModule(MLP):
    """The MLP of torch's own tests: ``Linear(10, 16) -> ReLU -> Linear(16, 10)``,
    initialised from a fixed seed (5)."""

    def __init__(self, device: str | torch.device = "cpu", bias: bool = True) -> None:
        torch.manual_seed(5)
        super().__init__(10, 16, bias=bias, device=device)


class MLPStacked(nn.Module):
    """``n_layers`` blocks applied one after the other (``layers.<i>``).

    Args:
        device: where a default block's parameters live.
        n_layers: how many blocks.
        block: makes each block (default: :class:`MLPModule` on ``device``).
        checkpointed: indices of the blocks run under ``torch.utils.checkpoint``.
        use_reentrant: the checkpointing flavour.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        n_layers: int = 2,
        *,
        block: Callable[[], nn.Module] | None = None,
        checkpointed: Iterable[int] = (),
        use_reentrant: bool = False,
    ) -> None:
        super().__init__()
        make = block if block is not None else (lambda: MLPModule(device))
        self.layers = nn.ModuleList(make() for _ in range(n_layers))
        self.checkpointed = frozenset(checkpointed)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i in self.checkpointed:
                x = checkpoint(layer, x, use_reentrant=self.use_reentrant)
            else:
                x = layer(x)
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
        ValueError: ``n_heads``, ``vocab_size`` or ``dim`` is not a multiple of
            the mesh size.
    """
    tp = mesh.size()
    args = model.model_args
    for name in ("n_heads", "vocab_size", "dim"):
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


def tp_fsdp_transformer(args: ModelArgs, mesh: DeviceMesh, tp: str = "tp",
                        dp: str = "dp_shard") -> nn.Module:
    """The Transformer, tensor-parallel over mesh dimension ``tp``, then sharded with
    FSDP2 over ``dp`` (each block, then the root), as torchtitan does. Seeded: the
    same weights on every rank.

    Example:
        >>> from commspan.testing import fake_process_group, fake_mesh
        >>> from commspan.testing.models import ModelArgs, tp_fsdp_transformer
        >>> with fake_process_group(world_size=4):
        ...     mesh = fake_mesh((2, 2), names=("dp_shard", "tp"))
        ...     type(tp_fsdp_transformer(ModelArgs(), mesh)).__name__
        'FSDPTransformer'
    """
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = parallelize(Transformer(args), mesh[tp])
    for block in model.layers:
        fully_shard(block, mesh=mesh[dp])
    fully_shard(model, mesh=mesh[dp])
    return model


def make_batch(
    args: ModelArgs, batch: int = 2, seq: int = 8, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(tokens, targets)`` of shape ``(batch, seq)``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)
    return tokens, targets


def train_step(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    zero_grad: bool = False,
) -> torch.Tensor:
    """Forward, cross-entropy and backward; returns the (detached) loss.

    Args:
        optimizer: if given, its gradients are zeroed first and it steps last.
        zero_grad: zero the model's gradients first (without an optimizer).
    """
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    elif zero_grad:
        model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()
