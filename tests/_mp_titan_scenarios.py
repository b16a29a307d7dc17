"""A torchtitan-style training loop, run by each spawned gloo rank for tests/test_titan_loop.py.

Run as ``python tests/_mp_titan_scenarios.py OUT_DIR`` with ``RANK``,
``WORLD_SIZE`` (4), ``MASTER_ADDR`` and ``MASTER_PORT`` set. A small Llama-like
Transformer on a 2 x 2 (``dp``, ``tp``) mesh, parallelized as torchtitan does:
tensor parallelism with sequence-parallel norms and a loss-parallel output,
selective activation checkpointing of each block (``checkpoint_wrapper``), each
block compiled in place (``aot_eager``, scenario ``compiled`` only), then FSDP2
on ``dp`` with torchtitan's units (the embeddings; the final norm and the output
as one unit; each block; the root). Each
training step accumulates gradients over two microbatches (FSDP2 syncs on the
last only), clips the gradient norm over the DTensor parameters, steps AdamW
(``foreach``) and an lr scheduler; after the first step an evaluation step runs
under ``torch.no_grad()`` and ``torch.inference_mode()`` (eager only: compiled
blocks refuse inference tensors), then a distributed checkpoint is saved and
loaded outside any step.

Each scenario trains the same model three times from the same seed: without
commspan (``plain``), under ``CommSpanMode`` exporting JSONL to
``OUT_DIR/<scenario>/run/``, and (eager only) under a dispatch mode of this
file's own that logs every collective with the loop's own label of where it is
(``setup``, ``forward``, ``backward``, ``clip``, ``optim``, ``eval``, ``ckpt``),
the block whose forward or backward runs (the blocks' own hooks), its process
group and input bytes. It
writes ``OUT_DIR/<scenario>/rank<r>.result.json``: the losses, gradient norms,
evaluation losses and a digest of the final parameters of each run, the Python
warnings each run raised, ``mode.stats()``, that log, and facts of the model
from before FSDP2 (each unit's padded size; the parameters replicated over
``tp``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter

DIM, HEADS, VOCAB, SEQ, LAYERS, MICRO = 16, 4, 16, 8, 2, 2
TRAIN_STEPS, EVAL_STEP = (0, 2, 3), 1  # step numbers: train, evaluate, train, train


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads = HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def _sac_policy() -> Callable[..., Any]:
    """torchtitan's selective policy in small: save every other matmul, attention and
    reduce-scatters; recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    count = {"forward": 0, "recompute": 0}
    save = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func is torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            count[key] += 1
            return (CheckpointPolicy.MUST_SAVE if count[key] % 2
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def build(mesh: Any, compiled: bool, facts: dict[str, Any] | None = None) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    model = Transformer()
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                  use_local_output=False),  # loss parallel
    })
    for block in model.layers.values():
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": gather, "feed_forward": gather,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        block.attention.n_heads //= tp.size()
    if facts is not None:  # before FSDP2: units' padded sizes, params replicated over tp
        # by the module owning their collectives: [norm, output] is one unit, the
        # root's own (the lowest module holding both), which has no parameters left
        units = {f"layers.{n}": list(b.parameters()) for n, b in model.layers.items()}
        units["tok_embeddings"] = list(model.tok_embeddings.parameters())
        units[""] = [*model.norm.parameters(), *model.output.parameters()]
        shard = dp.size()
        facts["unit_padded_elements"] = {
            name: sum(math.ceil(p.to_local().shape[0] / shard) * shard
                      * math.prod(p.to_local().shape[1:]) for p in params)
            for name, params in units.items()}
        facts["tp_replicated_bytes"] = {
            name: sorted(p.to_local().numel() * 4 for p in params
                         if p.placements == (Replicate(),))
            for name, params in units.items()}
    for name, block in list(model.layers.items()):
        block = checkpoint_wrapper(
            block, context_fn=lambda: create_selective_checkpoint_contexts(_sac_policy()),
            preserve_rng_state=False)
        if compiled:
            block.compile(backend="aot_eager", fullgraph=True)
        model.layers.register_module(name, block)
    # torchtitan's units: the embeddings, the norm and output together (not resharded
    # after forward: FSDP would prefetch them at once), each block, the root
    fully_shard(model.tok_embeddings, mesh=dp)
    fully_shard([model.norm, model.output], mesh=dp, reshard_after_forward=False)
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _tokens(step: int, micro: int) -> torch.Tensor:
    """The same on a rank's tp peers, different across dp."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank() // 2)
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)


def _value(t: torch.Tensor) -> float:
    from torch.distributed.tensor import DTensor

    return float((t.full_tensor() if isinstance(t, DTensor) else t).item())


def train(mesh: Any, compiled: bool, mode: CommSpanMode | None, ckpt: Path,
          where: Callable[[str], None], stack: list[str]) -> dict[str, Any]:
    """The loop; ``where`` is told what the loop does next, ``stack`` holds the names of
    the blocks whose forward or backward runs (their own hooks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    where("setup")
    model = build(mesh, compiled)
    if not compiled:  # (a compiled block's hooks are compiled with it)
        for name, block in model.layers.items():
            block.register_forward_pre_hook(_enter(stack, f"layers.{name}"))
            block.register_forward_hook(_leave(stack))
            block.register_full_backward_pre_hook(_enter(stack, f"layers.{name}"))
            block.register_full_backward_hook(_leave(stack))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    out: dict[str, Any] = {"loss": [], "norm": [], "eval": []}

    def step(i: int) -> None:
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            tok = _tokens(i, micro)
            with loss_parallel():
                where("forward")
                logits = model(tok[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten()) / MICRO
                where("backward")
                loss.backward()
            where("forward")
            out["loss"].append(_value(loss.detach()))
        where("clip")
        out["norm"].append(_value(torch.nn.utils.clip_grad_norm_(
            model.parameters(), 1.0, foreach=True)))
        where("optim")
        opt.step()
        sched.step()
        opt.zero_grad()

    def evaluate() -> None:
        where("eval")
        tok = _tokens(100, 0)
        with torch.no_grad(), loss_parallel():
            out["eval"].append(_value(F.cross_entropy(
                model(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())))
        if not compiled:  # loss_parallel does not run under inference_mode: gather the logits
            tok = _tokens(101, 0)
            with torch.inference_mode():
                logits = model(tok[:, :-1]).full_tensor()
                out["eval"].append(float(F.cross_entropy(
                    logits.flatten(0, 1), tok[:, 1:].flatten()).item()))

    def checkpoint() -> None:
        where("ckpt")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def traced(i: int) -> contextlib.AbstractContextManager[Any]:
        return mode.step(i) if mode is not None else contextlib.nullcontext()

    for j, i in enumerate(TRAIN_STEPS):
        with traced(i):
            step(i)
        if j == 0:
            with traced(EVAL_STEP):
                evaluate()
            checkpoint()  # outside every step
    where("end")
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        digest.update(name.encode() + full.detach().numpy().tobytes())
    out["params"] = digest.hexdigest()
    out["dynamo"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                     if k in ("stats", "graph_break", "recompiles")}
    return out


def _enter(stack: list[str], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        stack.append(name)
    return hook


def _leave(stack: list[str]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()
    return hook


_NOT = {"wait_tensor", "_wrap_tensor_autograd"}


class Reference(TorchDispatchMode):
    """Every collective: the loop's label, the block whose forward or backward runs,
    whether autograd runs, op, the group's ranks and the input bytes (``scatter``: its
    output's)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.where = "setup"
        self.stack = stack
        self.log: list[list[Any]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.distributed_c10d import _resolve_process_group
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first: the collectives it issues come back here
        if func.namespace in ("c10d", "_c10d_functional") and func._opname not in _NOT:
            values = dict(zip([a.name for a in func._schema.arguments], args), **kwargs)
            if "group_name" in values:  # functional ops name their group
                group = _resolve_process_group(values["group_name"])
            else:  # c10d ops take it, boxed
                group = dist.ProcessGroup.unbox(next(
                    v for v in values.values() if isinstance(v, torch.ScriptObject)))
            ranks = list(dist.get_process_group_ranks(group))
            if func._opname.startswith("scatter"):
                source = values["output_tensors"]
            else:
                source = next(values[n] for n in ("input_tensors", "input_tensor", "input",
                                                   "tensors", "self") if n in values)
            self.log.append([self.where, self.stack[-1] if self.stack else None,
                             torch._C._current_graph_task_id() != -1, func._opname, ranks,
                             _bytes(source)])
        return func(*args, **kwargs)


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


@contextlib.contextmanager
def _warnings_into(caught: list[str]) -> Iterator[None]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # torch's own note on a 2-D redistribution (the gradient norm's): with or without
        # commspan alike; it is logged, not warned, but filtered in case a build warns it
        warnings.filterwarnings("ignore", message=".*sequential all_")
        yield
    caught.extend(sorted({f"{w.category.__name__}: {w.message}" for w in seen}))


def scenario(out: Path, name: str, compiled: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    here = out / name
    (here / "run").mkdir(parents=True, exist_ok=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    result: dict[str, Any] = {"facts": {}}
    build(mesh, compiled=False, facts=result["facts"])
    stack: list[str] = []
    ignore = lambda label: None  # noqa: E731
    try:
        result["plain_warnings"] = []
        with _warnings_into(result["plain_warnings"]):
            result["plain"] = train(mesh, compiled, None, here / "ckpt-p", ignore, stack)
        mode = CommSpanMode(exporters=[JsonlSpanExporter(here / "run" / f"rank{rank}.jsonl")])
        result["traced_warnings"] = []
        with _warnings_into(result["traced_warnings"]):
            with mode:
                result["traced"] = train(mesh, compiled, mode, here / "ckpt-t", ignore, stack)
            mode.shutdown()
        result["stats"] = mode.stats()
        if not compiled:
            ref = Reference(stack)

            def label(where: str) -> None:
                ref.where = where

            with ref:
                result["reference"] = train(mesh, compiled, None, here / "ckpt-r", label, stack)
            result["log"] = ref.log
    except Exception:
        result["error"] = traceback.format_exc()
    (here / f"rank{rank}.result.json").write_text(json.dumps(result, default=str))
    dist.barrier()


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        scenario(out, "eager", compiled=False)
        if os.environ.get("COMMSPAN_TITAN_COMPILED", "1") == "1":
            scenario(out, "compiled", compiled=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
