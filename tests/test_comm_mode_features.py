"""The reference CommDebugMode feature tests (module counts, parameter and sharding info).

Each test runs twice: through ``commspan.compat.CommDebugMode`` (the reference
API, ops keyed by ``torch.ops.c10d_functional`` packets) and through the native
``CommSpanMode`` + ``Aggregator`` (ops keyed by canonical names). The fake
process group stands in for 4 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _counting import API_NAMES, make_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from commspan.compat import CommDebugMode
from commspan.testing.models import (
    MLPModule,
    MLPStacked,
    ModelArgs,
    Transformer,
    make_batch,
    parallelize,
    train_step,
)

both_apis = pytest.mark.parametrize("api", API_NAMES)

MLP_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
STACKED_PLAN = {  # torch 2.13 resolves plan keys relative to the module
    "layers.0.net1": ColwiseParallel(),
    "layers.0.net2": RowwiseParallel(),
    "layers.1.net1": ColwiseParallel(),
    "layers.1.net2": RowwiseParallel(),
}


def expected_parameters(model: torch.nn.Module) -> tuple[list[tuple[str, str]], list[str]]:
    """What the parameter and sharding views must list for ``model``, in order.

    Returns:
        ``[(module fqn, parameter name)]`` of every parameter, and
        ``["<module fqn>.<parameter name>"]`` of those that are DTensors.
    """
    root = type(model).__name__
    params: list[tuple[str, str]] = []
    sharded: list[str] = []
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        fqn = f"{root}.{owner}" if owner else root
        params.append((fqn, leaf))
        if isinstance(param.data, DTensor):
            sharded.append(f"{fqn}.{leaf}")
    return params, sharded


def _mlp_input() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.rand(8, 10)


@both_apis
def test_MLP_distributed_sharding_display(api: str, mesh: DeviceMesh) -> None:
    """Parameter and sharding info list every (module, parameter) of the TP MLP, in order."""
    model = parallelize_module(MLPModule(), mesh, MLP_PLAN)
    counter = make_counter(api)
    with counter:
        model(_mlp_input()).sum().backward()

    params, sharded = expected_parameters(model)
    assert counter.parameter_keys() == params
    assert counter.sharding_keys() == sharded
    assert len(sharded) == 4


@both_apis
def test_MLPStacked_distributed_sharding_display(api: str, mesh: DeviceMesh) -> None:
    """Re-entering the mode forgets the previous model's parameters; nested MLPs are all listed."""
    inp = _mlp_input()
    model = parallelize_module(MLPModule(), mesh, MLP_PLAN)
    counter = make_counter(api)
    with counter:
        model(inp).sum().backward()

    stacked = parallelize_module(MLPStacked(), mesh, STACKED_PLAN)
    with counter:
        assert counter.parameter_keys() == []
        assert counter.sharding_keys() == []
        stacked(inp)

    params, sharded = expected_parameters(stacked)
    assert counter.parameter_keys() == params
    assert counter.sharding_keys() == sharded
    assert len(counter.sharding_keys()) == 8


@both_apis
def test_MLP_module_tracing(api: str, mesh: DeviceMesh) -> None:
    """The Rowwise output all_reduce counts for net2, its parent and Global, and nothing else."""
    model = parallelize_module(MLPModule(), mesh, MLP_PLAN)
    counter = make_counter(api)
    with counter:
        out = model(_mlp_input())
        # between forward and backward: the forward all_reduce is already attributed
        assert counter.total() == 1
        assert counter.module_count("MLPModule.net2", "all_reduce", "forward") == 1
        assert counter.module_count("MLPModule", "all_reduce", "forward") == 1
        out.sum().backward()

    assert counter.module_depths() == {
        "Global": 0,
        "MLPModule": 1,
        "MLPModule.net1": 2,
        "MLPModule.relu": 2,
        "MLPModule.net2": 2,
    }
    for fqn in ("Global", "MLPModule", "MLPModule.net2"):
        assert counter.module_count(fqn, "all_reduce") == 1, fqn
        assert counter.module_count(fqn, "all_reduce", "backward") == 0, fqn
    for fqn in ("MLPModule.net1", "MLPModule.relu"):
        assert counter.module_count(fqn, "all_reduce") == 0, fqn
    assert counter.total() == 1


# The toy Transformer without checkpointing, 2 blocks: {fqn: (forward, backward)} all_reduces.
TRANSFORMER_ALL_REDUCES = {
    "Global": (6, 9),
    "Transformer": (6, 9),
    "Transformer.tok_embeddings": (1, 0),
    "Transformer.pos_embeddings": (1, 0),
    "Transformer.layers.0": (2, 4),
    "Transformer.layers.0.attention": (1, 3),
    "Transformer.layers.0.attention.wq": (0, 1),
    "Transformer.layers.0.attention.wk": (0, 1),
    "Transformer.layers.0.attention.wv": (0, 1),
    "Transformer.layers.0.attention.wo": (1, 0),
    "Transformer.layers.0.feed_forward": (1, 1),
    "Transformer.layers.0.feed_forward.w1": (0, 1),
    "Transformer.layers.0.feed_forward.w2": (1, 0),
    "Transformer.layers.1": (2, 4),
    "Transformer.norm": (0, 0),
    "Transformer.output": (0, 1),
}


@both_apis
def test_transformer_module_tracing(api: str, mesh: DeviceMesh) -> None:
    """Each TP module of the toy Transformer counts its own collectives and its children's."""
    args = ModelArgs()
    torch.manual_seed(0)
    model = parallelize(Transformer(args), mesh)
    counter = make_counter(api)
    with counter:
        train_step(model, *make_batch(args))

    for fqn, (fw, bw) in TRANSFORMER_ALL_REDUCES.items():
        assert counter.module_count(fqn, "all_reduce", "forward") == fw, fqn
        assert counter.module_count(fqn, "all_reduce", "backward") == bw, fqn
    assert counter.module_count("Transformer.output", "all_gather_into_tensor", "forward") == 1
    assert counter.count("all_gather_into_tensor") == 1
    assert counter.count("all_reduce") == 15
    assert counter.total() == 16
    called = [m for m in model.modules() if not isinstance(m, torch.nn.ModuleList)]
    assert len(counter.module_depths()) == 1 + len(called)


def test_compat_accepts_every_spelling_of_an_op(mesh: DeviceMesh) -> None:
    """Compat counts answer legacy and native packets, overloads and canonical names alike."""
    model = parallelize_module(MLPModule(), mesh, MLP_PLAN)
    comm_mode = CommDebugMode()
    with comm_mode:
        model(_mlp_input()).sum().backward()
    keys: list[Any] = [
        torch.ops.c10d_functional.all_reduce,
        torch.ops._c10d_functional.all_reduce,
        torch.ops._c10d_functional.all_reduce.default,
        "all_reduce",
    ]
    for key in keys:
        assert comm_mode.get_comm_counts()[key] == 1, key
        assert comm_mode.comm_module_counts["MLPModule.net2"][key] == 1, key
        assert comm_mode.comm_module_counts["MLPModule.net2"]["forward"][key] == 1, key
    assert comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor] == 0
    assert list(comm_mode.get_comm_counts()) == [torch.ops.c10d_functional.all_reduce]
