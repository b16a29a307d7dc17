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
