"""Scenarios run by each spawned gloo rank for tests/test_ownership_multiprocess.py.

Run as ``python tests/_mp_ownership_scenarios.py OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Each scenario writes
one JSONL file per rank and ``OUT_DIR/<scenario>/rank<r>.result.json``: the
rank's in-process view and the facts the tests use as references, gathered
without commspan (parameter sizes before sharding, the time each step's
backward began, what a DDP comm hook saw, which pipeline buffer each
point-to-point op used).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from commspan import Aggregator, CommSpanMode
from commspan.exporters import JsonlSpanExporter

STEPS = 2


class Block(torch.nn.Module):
    """The block of issue 10's FSDP2 table: two linears, a residual."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(dim, hidden)
        self.b = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Net(torch.nn.Module):
    """Two blocks of different sizes and a head (issue 10's FSDP2 example)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(8, 16), Block(8, 24)])
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DdpNet(torch.nn.Module):
    """Layers of distinct sizes; ``spare`` is never used (find_unused_parameters)."""

    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(6, 8)
        self.l1 = torch.nn.Linear(8, 32)
        self.l2 = torch.nn.Sequential(
            torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32)
        )
        self.l3 = torch.nn.Linear(32, 4)
        self.spare = torch.nn.Linear(4, 4) if spare else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(self.l0(x))))))


class CascadeNet(torch.nn.Module):
    """Parameters registered in the reverse of the order they are used: their
    gradients make DDP's buckets ready out of order, and the last hook launches
    several buckets at once (every step with ``find_unused_parameters``, where
    DDP never rebuilds its buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(32, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.last = torch.nn.Linear(6, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(torch.relu(self.mid(torch.relu(self.last(x)))))


class ResizedNet(torch.nn.Module):
    """Three bias-free layers, each above ``bucket_cap_mb=0.004`` (4,194 bytes), so
    one bucket each: buckets 0 (``c``) and 2 (``a``) have 1,152 elements, bucket 1
    (``b``) 1,536."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(24, 48, bias=False)
        self.b = torch.nn.Linear(48, 32, bias=False)
        self.c = torch.nn.Linear(32, 36, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


Hook = Callable[[Any, Any], Any]


def _hooked_ddp_run(
    out: Path, rank: int, name: str, make_model: Callable[[], torch.nn.Module], width: int,
    make_hook: Callable[[Callable[[Any], list[str]], list[list[Any]]], Hook],
) -> None:
    """Two steps of ``make_model()`` (inputs ``width`` wide) under DDP with
    ``find_unused_parameters`` (DDP then never rebuilds its buckets: one layer each,
    in reverse registration order) and the comm hook ``make_hook(params_of, seen)``
    returns; the hook notes what it does in ``seen`` (``params_of(bucket)``: the names
    of the bucket's parameters)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = make_model()
    names = {id(p): n for n, p in model.named_parameters()}
    mode = CommSpanMode(exporters=[JsonlSpanExporter(out / name / "trace-rank{rank}.jsonl")])
    seen: list[list[Any]] = []
    with mode:
        ddp = DDP(model, bucket_cap_mb=0.004, find_unused_parameters=True)
        ddp.register_comm_hook(None, make_hook(
            lambda bucket: [names[id(p)] for p in bucket.parameters()], seen))
        for i in range(2):
            with mode.step(i):
                ddp(torch.randn(4, width)).sum().backward()
    mode.shutdown()
    assert mode.aggregator is not None
    _write(out, name, rank, {"hook": seen, "stats": mode.stats(), **_view(mode.aggregator)})


def _half_hook(params_of: Callable[[Any], list[str]], seen: list[list[Any]]) -> Hook:
    """All-reduces only half of bucket 0 (as a compressing hook reduces tensors of other
    sizes than its bucket): the next bucket's collective has bucket 1's size, the one
    after has bucket 0's size again, and must still be bucket 2's."""
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        part = buffer[: buffer.numel() // 2] if bucket.index() == 0 else buffer
        seen.append([bucket.index(), params_of(bucket), part.numel()])
        return dist.all_reduce(part, async_op=True).get_future().then(lambda _: buffer)
    return hook


def _halves_hook(params_of: Callable[[Any], list[str]], seen: list[list[Any]]) -> Hook:
    """A compressing hook: two all-reduces of half a bucket each, sizes no bucket has
    (on CascadeNet, whose last hook launches several buckets at once: each collective
    is the bucket the hook was called with)."""
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        half = buffer.numel() // 2
        for part in (buffer[:half], buffer[half:]):
            seen.append([bucket.index(), params_of(bucket), part.numel()])
            dist.all_reduce(part)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    return hook


def _recording_hook(params_of: Callable[[Any], list[str]], seen: list[list[Any]]) -> Hook:
    """torch's all-reduce hook, noting each bucket (index, parameters, dtype)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        seen.append([bucket.index(), params_of(bucket), str(bucket.buffer().dtype)])
        return allreduce_hook(state, bucket)
    return hook


class NormWatchedNet(torch.nn.Module):
    """Two layers; a gradient hook on ``l0.weight`` all-reduces that gradient's norm
    (one element: a user's gradient-norm monitor), no bucket's size."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(4, 8)
        self.l1 = torch.nn.Linear(8, 2)
        self.l0.weight.register_post_accumulate_grad_hook(self._watch)

    @staticmethod
    def _watch(param: torch.Tensor) -> None:
        assert param.grad is not None
        dist.all_reduce(param.grad.norm().reshape(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(torch.relu(self.l0(x)))


class MapSizedNet(torch.nn.Module):
    """3 parameters; ``l0.weight`` (float64, so a bucket of its own) has 3 elements:
    the size of DDP's map of used parameters (one int32 per parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(3, 1, bias=False).double()
        self.l1 = torch.nn.Linear(1, 1200, bias=False)
        self.l2 = torch.nn.Linear(1200, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(self.l0(x.double()).float())))


class Outer(torch.nn.Module):
    """A model whose middle part is a DDP module, built inside the mode."""

    def __init__(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__()
        self.pre = torch.nn.Linear(6, 6)
        self.body = DDP(DdpNet(), bucket_cap_mb=0.004)
        self.post = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.body(self.pre(x)))


def _ddp_nested_run(out: Path, rank: int) -> None:
    """DDP constructed while the mode is entered, as a part of a larger model."""
    torch.manual_seed(0)
    exporter = JsonlSpanExporter(out / "ddp_nested" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        model = Outer()  # DDP's start-up collectives run here, before any forward
        names = {id(p): n for n, p in model.body.module.named_parameters()}
        seen: list[list[Any]] = []

        def recording_hook(state, bucket):  # type: ignore[no-untyped-def]
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                allreduce_hook,
            )

            seen.append([bucket.index(), [names[id(p)] for p in bucket.parameters()]])
            return allreduce_hook(state, bucket)

        model.body.register_comm_hook(None, recording_hook)
        for i in range(3):
            with mode.step(i):
                model(torch.randn(4, 6)).sum().backward()
    mode.shutdown()
    assert mode.aggregator is not None
    _write(out, "ddp_nested", rank, {"hook": seen, "stats": mode.stats(),
                                     "modules": mode.aggregator.modules(),
                                     **_view(mode.aggregator)})


class _Stat(torch.nn.Module):
    """Subtracts the batch mean all-reduced across ranks, as SyncBatchNorm does (which
    refuses CPU tensors); counts its own all-reduces."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.detach().mean(0)
        dist.all_reduce(mean)
        type(self).calls += 1
        return x - mean / dist.get_world_size()


class StatNet(torch.nn.Module):
    """A batch norm (a buffer DDP broadcasts at each forward) and a module that
    all-reduces in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.stat = _Stat()
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.stat(self.norm(self.inp(x))))


class _InsideReference(TorchDispatchMode):
    """Collectives issued in DDP's forward, split by whether the wrapped module's
    forward was running (hooks on it set ``inside``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.seen = {"ddp": 0, "model": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace in ("c10d", "_c10d_functional") and "barrier" not in func._opname:
            self.seen["model" if self.inside else "ddp"] += 1
        return func(*args, **(kwargs or {}))


def _ddp_forward_run(out: Path, rank: int) -> None:
    """DDP around a model whose own module all-reduces in forward: that module's
    collectives are its own; DDP's buffer broadcasts are DDP's forward syncs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    exporter = JsonlSpanExporter(out / "ddp_forward" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    ddp = DDP(StatNet())
    reference = _InsideReference()

    def enter(module: Any, args: Any) -> None:
        reference.inside = True

    def leave(module: Any, args: Any, output: Any) -> None:
        reference.inside = False

    ddp.module.register_forward_pre_hook(enter)
    ddp.module.register_forward_hook(leave)
    _Stat.calls = 0
    with mode:
        for i in range(STEPS):
            with mode.step(i):
                with reference:
                    loss = ddp(torch.randn(3, 4)).sum()
                loss.backward()
    mode.shutdown()
    assert mode.aggregator is not None
    _write(out, "ddp_forward", rank, {"stat_calls": _Stat.calls, "reference": reference.seen,
                                      "stats": mode.stats(), **_view(mode.aggregator)})


class TpBlockNet(torch.nn.Module):
    """A plain input layer, a tensor-parallel block, a plain head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.tp = Block(8, 16)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tp(self.inp(x)))


def _ddp_tp_run(out: Path, rank: int) -> None:
    """DDP over ``dp`` of a model whose block is tensor-parallel over ``tp`` (a 1 x 2
    mesh), the way torch composes them (``_pre_dp_module_transform``: DDP holds the
    local tensors, each forward sets DTensors made from them on the modules). The
    comm hook records each bucket's parameters by the names they had when DDP was
    built."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dpt", "tpt"))
    model = TpBlockNet()
    parallelize_module(model.tp, mesh["tpt"], {"a": ColwiseParallel(),
                                               "b": RowwiseParallel()})
    _pre_dp_module_transform(model)
    exporter = JsonlSpanExporter(out / "ddp_tp" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    seen: list[list[Any]] = []
    with mode:
        ddp = DDP(model, process_group=mesh["dpt"].get_group(), bucket_cap_mb=0.0002)
        names = {id(p): n for n, p in model.named_parameters()}  # DDP's, by their names

        def recording_hook(state, bucket):  # type: ignore[no-untyped-def]
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                allreduce_hook,
            )

            seen.append([bucket.index(), [names[id(p)] for p in bucket.parameters()]])
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(mesh["dpt"].get_group(), recording_hook)
        for i in range(3):
            with mode.step(i):
                ddp(torch.randn(4, 6)).sum().backward()
    mode.shutdown()
    _write(out, "ddp_tp", rank, {"hook": seen, "stats": mode.stats()})


def _view(agg: Aggregator) -> dict[str, Any]:
    return {
        "module_counts": agg.module_counts(),
        "table": agg.table(0),
        "collectives": [list(vars(s).values()) for s in agg.collectives()],
    }


def _write(out: Path, name: str, rank: int, data: dict[str, Any]) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.result.json").write_text(json.dumps(data, sort_keys=True))


def _shard_net(model: Net, world: int) -> None:
    """fully_shard each block, then the root, over a 1-D ``dp`` mesh of ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def scenario_fsdp(out: Path, rank: int) -> None:
    """fully_shard on both blocks and the root, 2 steps (issue 10's FSDP2 table)."""

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    units = {"blocks.0": model.blocks[0], "blocks.1": model.blocks[1], "": model}
    nested = {id(m) for m in units.values()}
    sizes: dict[str, list[int]] = {}
    for rel, module in units.items():  # numel and parameter count, before sharding
        shapes = []
        todo = [module]
        while todo:
            cur = todo.pop()
            shapes.extend(p.shape for p in cur._parameters.values())
            todo.extend(c for c in cur._modules.values() if id(c) not in nested)
        padded = sum(math.ceil(s[0] / world) * world * math.prod(s[1:]) for s in shapes)
        sizes[rel] = [padded, len(shapes)]
    _shard_net(model, world)
    exporter = JsonlSpanExporter(out / "fsdp" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    steps = []
    with mode:
        for i in range(STEPS):
            with mode.step(i):
                t_forward = time.time_ns()
                loss = model(torch.randn(4, 8)).sum()
                steps.append((t_forward, time.time_ns()))
                loss.backward()
    mode.shutdown()
    assert mode.aggregator is not None
    _write(out, "fsdp", rank, {
        "root": type(model).__name__,
        "units": sizes,
        "steps": steps,
        "stats": mode.stats(),
        **_view(mode.aggregator),
    })


SLOW_S = 0.3


def scenario_fsdp_straggler(out: Path, rank: int) -> None:
    """FSDP2 on Net, as ``fsdp``; the last rank sleeps SLOW_S when its backward starts
    (a hook on the model's output), so it arrives last at the first collective FSDP
    issues after that (the test finds which from the sizes: blocks.0's all-gather,
    prefetched from blocks.1's backward)."""

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    # padded numel of each unit's own parameters, before sharding: names a collective's
    # unit from its size alone
    from _fsdp_sizes import padded_unit_elements

    units = {"blocks.0": model.blocks[0], "blocks.1": model.blocks[1], "": model}
    nested = {id(m) for m in units.values()}
    sizes = {rel: padded_unit_elements([m], nested, world) for rel, m in units.items()}
    _shard_net(model, world)
    exporter = JsonlSpanExporter(out / "fsdp_straggler" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        for i in range(STEPS):
            with mode.step(i):
                y = model(torch.randn(4, 8))
                if rank == world - 1:
                    y.register_hook(lambda g: (time.sleep(SLOW_S), g)[1])
                y.sum().backward()
    mode.shutdown()
    _write(out, "fsdp_straggler", rank, {"root": type(model).__name__, "units": sizes})


def _ddp_run(
    out: Path, rank: int, name: str, *, hook: bool = False, find_unused: bool = False,
    cascade: bool = False, compiled: bool = False,
) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model: torch.nn.Module = CascadeNet() if cascade else DdpNet(spare=find_unused)
    names = {id(p): n for n, p in model.named_parameters()}
    exporter = JsonlSpanExporter(out / name / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    seen: list[list[Any]] = []  # what the comm hook saw, in call order
    with mode:
        ddp = DDP(model, bucket_cap_mb=0.004, find_unused_parameters=find_unused)
        if hook:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            # no annotations: DDP checks them against dist.GradBucket / Future at runtime
            def recording_hook(state, bucket):  # type: ignore[no-untyped-def]
                seen.append([bucket.index(), [names[id(p)] for p in bucket.parameters()]])
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, recording_hook)
        run: Any = ddp
        if compiled:  # (DDPOptimizer splits graphs at buckets; tiny buckets trip its checks)
            torch._dynamo.config.optimize_ddp = False
            run = torch.compile(ddp, backend="aot_eager")
        for i in range(3):
            with mode.step(i):
                run(torch.randn(4, 6)).sum().backward()
    mode.shutdown()
    assert mode.aggregator is not None
    _write(out, name, rank, {"hook": seen, "stats": mode.stats(),
                             "numel": {n: p.numel() for n, p in model.named_parameters()},
                             **_view(mode.aggregator)})


MICROBATCHES = 4


class _RecvReference(TorchDispatchMode):
    """Notes, for each point-to-point op, what the stage's own buffers say it is:
    a receive whose tensor is the stage's pre-allocated buffer for microbatch m,
    or a send of microbatch m's forward output (same storage). Independent of
    commspan; it runs inside commspan's mode and hands every op on."""

    def __init__(self, *stages: Any) -> None:
        super().__init__()
        self.stages = stages
        # [op, microbatch or None, direction or None] (+ the stage index with several)
        self.seen: list[list[Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._opname
        if func.namespace == "c10d" and name in ("send", "recv_"):
            tensor = args[0][0]
            found: list[Any] = [None, None, None]
            for stage in self.stages:
                mb, kind = self._lookup(stage, tensor)
                if kind is not None:
                    found = [mb, kind, stage.stage_index]
                    break
            self.seen.append(["send" if name == "send" else "recv",
                              *found[: 3 if len(self.stages) > 1 else 2]])
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _lookup(stage: Any, tensor: torch.Tensor) -> tuple[int | None, str | None]:
        for mb, infos in getattr(stage, "args_recv_info", {}).items():
            for info in infos:
                if getattr(info, "buffer", None) is tensor:
                    return mb, "activation_recv"
        for mb, infos in getattr(stage, "grad_recv_info", {}).items():
            for info in infos or ():
                if getattr(info, "buffer", None) is tensor:
                    return mb, "gradient_recv"
        ptr = tensor.untyped_storage().data_ptr()
        for mb, (outputs, _) in getattr(stage, "fwd_cache", {}).items():
            for out in outputs:
                if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == ptr:
                    return mb, "activation_send"
        return None, None


def _pipeline_run(out: Path, rank: int, name: str) -> None:
    """Two stages (one per rank) of a small MLP, 4 microbatches, 2 steps."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    full = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )
    stage = PipelineStage(full[:3] if rank == 0 else full[3:], rank, dist.get_world_size(),
                          torch.device("cpu"))
    schedule_class = ScheduleGPipe if name == "pp_gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=MICROBATCHES,
                              loss_fn=lambda output, target: ((output - target) ** 2).mean())
    _train_schedule(out, rank, name, schedule, [stage], torch.randn(8, 4))


def _interleaved_run(out: Path, rank: int) -> None:
    """Four stages on two ranks (rank r holds stages r and r + 2), Interleaved1F1B,
    4 microbatches, 2 steps."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    chunks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(4)]
    world = dist.get_world_size()
    stages = [PipelineStage(chunks[i], i, 2 * world, torch.device("cpu"))
              for i in (rank, rank + world)]
    schedule = ScheduleInterleaved1F1B(
        stages, n_microbatches=MICROBATCHES,
        loss_fn=lambda output, target: ((output - target) ** 2).mean())
    _train_schedule(out, rank, "pp_interleaved", schedule, stages, torch.randn(8, 8))


def _train_schedule(out: Path, rank: int, name: str, schedule: Any, stages: list[Any],
                    target: torch.Tensor) -> None:
    """STEPS steps of ``schedule`` under a mode watching it, with the buffers' reference."""
    x = torch.randn(8, 8)
    mode = CommSpanMode(exporters=[JsonlSpanExporter(out / name / "trace-rank{rank}.jsonl")])
    mode.watch_pipeline(schedule)
    reference = _RecvReference(*stages)
    with mode:
        for i in range(STEPS):
            with mode.step(i), reference:
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=target)
    wrapped = sorted(k for stage in stages for k in vars(stage)
                     if k.endswith(("_ops", "_one_chunk", "_infra", "_vote", "_result")))
    mode.shutdown()
    assert mode.aggregator is not None
    _write(out, name, rank, {
        "reference": reference.seen,
        "left_on_stage": wrapped,
        "stats": mode.stats(),
        **_view(mode.aggregator),
    })


SCENARIOS: dict[str, Callable[[Path, int], None]] = {
    "fsdp": scenario_fsdp,
    "fsdp_straggler": scenario_fsdp_straggler,
    "ddp": lambda out, rank: _ddp_run(out, rank, "ddp"),
    "ddp_hook": lambda out, rank: _ddp_run(out, rank, "ddp_hook", hook=True),
    "ddp_unused": lambda out, rank: _ddp_run(out, rank, "ddp_unused", find_unused=True),
    "ddp_compiled": lambda out, rank: _ddp_run(out, rank, "ddp_compiled", hook=True,
                                               compiled=True),
    "ddp_nested": _ddp_nested_run,
    "ddp_forward": _ddp_forward_run,
    "ddp_tp": _ddp_tp_run,
    "ddp_cascade": lambda out, rank: _ddp_run(
        out, rank, "ddp_cascade", hook=True, find_unused=True, cascade=True),
    "ddp_resized": lambda out, rank: _hooked_ddp_run(
        out, rank, "ddp_resized", ResizedNet, 24, _half_hook),
    "ddp_halves": lambda out, rank: _hooked_ddp_run(
        out, rank, "ddp_halves", CascadeNet, 6, _halves_hook),
    "ddp_map_sized": lambda out, rank: _hooked_ddp_run(
        out, rank, "ddp_map_sized", MapSizedNet, 3, _recording_hook),
    "ddp_user_hook": lambda out, rank: _hooked_ddp_run(
        out, rank, "ddp_user_hook", NormWatchedNet, 4, _recording_hook),
    "pp_gpipe": lambda out, rank: _pipeline_run(out, rank, "pp_gpipe"),
    "pp_1f1b": lambda out, rank: _pipeline_run(out, rank, "pp_1f1b"),
    "pp_interleaved": _interleaved_run,
}


def main(argv: list[str]) -> int:
    """Initialise gloo from the environment and run every scenario."""
    out = Path(argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for scenario in SCENARIOS.values():
            scenario(out, rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
