"""FSDP2 unit sizes for references: computed from a model's parameters, never from commspan."""

from __future__ import annotations

import math

import torch


def padded_unit_elements(modules: list[torch.nn.Module], nested: set[int], shard: int) -> int:
    """Elements FSDP2 all-gathers for a unit made of ``modules``: their own
    parameters (modules whose ``id`` is in ``nested`` are other units: excluded;
    tensor-parallel ones as this rank's local shard), each padded on dim 0 to a
    multiple of ``shard``. A rank's all-gather input is this / ``shard``."""
    total = 0
    todo = list(modules)
    while todo:
        cur = todo.pop()
        for p in cur._parameters.values():
            if p is not None:
                shape = p.to_local().shape if hasattr(p, "to_local") else p.shape
                total += math.ceil(shape[0] / shard) * shard * math.prod(shape[1:])
        todo.extend(c for c in cur._modules.values() if c is not None and id(c) not in nested)
    return total


def fsdp2_sequential(world: int = 4) -> torch.nn.Sequential:
    """Two linears, each an FSDP2 unit, under a root unit, on a ``world``-rank mesh (of
    the process group in use: a fake one in tests). FSDP2 prefetches the first
    unit's all-gather from the second's backward, and runs the root's
    reduce-scatter outside every module: collectives owned by another module than
    the one that issued them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
