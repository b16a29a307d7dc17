"""The reference tensor-parallel style tests: which collectives each style issues, and when.

Each test runs twice: through ``commspan.compat.CommDebugMode`` (the reference
API) and through the native ``CommSpanMode`` + ``Aggregator``. Counts are also
read between forward and backward, inside the context, as the reference does.
The fake process group stands in for 4 ranks, so gathered values are not
meaningful: shapes and collective counts are checked, values only where no
collective produced them.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from _counting import API_NAMES, make_counter
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

pytestmark = pytest.mark.parametrize("api", API_NAMES)


def test_colwise_parallel_style(api: str, mesh: DeviceMesh) -> None:
    """Colwise: no forward collective, one backward all_reduce; with Shard(0) inputs an
    all_gather forward and a reduce_scatter backward."""
    world = mesh.size()
    counter = make_counter(api)
    tensor = torch.rand(8, 16, requires_grad=True)
    model = nn.Linear(16, 16)

    colwise = parallelize_module(deepcopy(model), mesh, ColwiseParallel())
    with counter:
        out = colwise(tensor)
        assert out.shape == (8, 16 // world)
        assert counter.total() == 0
        out.sum().backward()
        assert counter.count("all_reduce") == 1
        assert counter.total() == 1
    assert counter.module_count("Linear", "all_reduce", "backward") == 1

    colwise = parallelize_module(deepcopy(model), mesh, ColwiseParallel(input_layouts=Shard(0)))
    with counter:
        out = colwise(tensor)
        assert out.shape == (8 * world, 16 // world)
        assert counter.count("all_gather_into_tensor") == 1
        assert counter.total() == 1
        out.sum().backward()
        assert counter.count("reduce_scatter_tensor") == 1
        assert counter.total() == 2
    assert counter.module_count("Linear", "all_gather_into_tensor", "forward") == 1
    assert counter.module_count("Linear", "reduce_scatter_tensor", "backward") == 1


def test_colwise_parallel_embedding(api: str, mesh: DeviceMesh) -> None:
    """A column-sharded embedding needs no collective, forward or backward."""
    world = mesh.size()
    counter = make_counter(api)
    tensor = torch.arange(8).reshape(4, 2)
    colwise = parallelize_module(nn.Embedding(16, 16), mesh, ColwiseParallel())
    with counter:
        out = colwise(tensor)
        assert out.shape == (4, 2, 16 // world)
        assert counter.total() == 0
        out.sum().backward()
        assert counter.total() == 0


def test_rowwise_parallel_style(api: str, mesh: DeviceMesh) -> None:
    """Rowwise: one forward all_reduce and no backward collective; with Shard(0) outputs a
    reduce_scatter forward and an all_gather backward."""
    world = mesh.size()
    counter = make_counter(api)
    tensor = torch.rand(8, 16 // world, requires_grad=True)
    model = nn.Linear(16, 16)

    rowwise = parallelize_module(deepcopy(model), mesh, RowwiseParallel())
    with counter:
        out = rowwise(tensor)
        assert out.shape == (8, 16)
        assert counter.count("all_reduce") == 1
        assert counter.total() == 1
        out.sum().backward()
        assert counter.total() == 1
    assert counter.module_count("Linear", "all_reduce", "forward") == 1

    rowwise = parallelize_module(deepcopy(model), mesh, RowwiseParallel(output_layouts=Shard(0)))
    with counter:
        out = rowwise(tensor)
        assert out.shape == (8 // world, 16)
        assert counter.count("reduce_scatter_tensor") == 1
        assert counter.total() == 1
        out.sum().backward()
        assert counter.count("all_gather_into_tensor") == 1
        assert counter.total() == 2
    assert counter.module_count("Linear", "reduce_scatter_tensor", "forward") == 1
    assert counter.module_count("Linear", "all_gather_into_tensor", "backward") == 1


def test_rowwise_parallel_embedding(api: str, mesh: DeviceMesh) -> None:
    """A row-sharded embedding all_reduces its output forward (reduce_scatter with Shard(1)
    outputs, then an all_gather backward)."""
    world = mesh.size()
    counter = make_counter(api)
    model = nn.Embedding(16, 16)

    rowwise = parallelize_module(deepcopy(model), mesh, RowwiseParallel(input_layouts=Replicate()))
    with counter:
        out = rowwise(torch.arange(8).reshape(4, 2))
        assert out.shape == (4, 2, 16)
        assert counter.total() == 1
        assert counter.count("all_reduce") == 1
        out.sum().backward()
        assert counter.total() == 1
    assert counter.module_count("Embedding", "all_reduce", "forward") == 1

    sharded = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    rowwise = parallelize_module(deepcopy(model), mesh, sharded)
    with counter:
        out = rowwise(torch.arange(8))
        assert out.shape == (8, 16 // world)
        assert counter.total() == 1
        assert counter.count("reduce_scatter_tensor") == 1
        out.sum().backward()
        assert counter.total() == 2
        assert counter.count("all_gather_into_tensor") == 1


def test_prepare_module_input(api: str, mesh: DeviceMesh) -> None:
    """PrepareModuleInput gathers a Shard(0) input into a replicated one with one all_gather."""
    world = mesh.size()
    style = PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())
    gather = parallelize_module(nn.Identity(), mesh, style)
    counter = make_counter(api)
    with counter:
        output = gather(torch.ones(2, 16))
        assert counter.count("all_gather_into_tensor") == 1
        full = output.full_tensor()
    assert isinstance(output, DTensor) and output.placements == (Replicate(),)
    assert full.shape == (2 * world, 16)
    assert counter.total() == 1
    assert counter.module_count("Identity", "all_gather_into_tensor", "forward") == 1


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + y


def test_prepare_module_input_multiple_inputs(api: str, mesh: DeviceMesh) -> None:
    """Layout lists must match each other and the inputs; a None layout passes an input through."""
    world = mesh.size()
    with pytest.raises(
        AssertionError, match="input_layouts and desired_input_layouts should have same length!"
    ):
        PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=(Replicate(), None))

    short = PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())
    mod = _TwoInputs()
    parallelize_module(mod.linear, mesh, ColwiseParallel())
    parallelize_module(mod, mesh, short)
    y = torch.ones(2 * world, 8 // world)
    with pytest.raises(
        ValueError, match="module inputs and input_layouts should have same length!"
    ):
        mod(torch.randn(2, 8), y)

    mod = _TwoInputs()
    parallelize_module(mod.linear, mesh, ColwiseParallel())
    layouts = PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)
    )
    parallelize_module(mod, mesh, layouts)
    counter = make_counter(api)
    with counter:
        output = mod(torch.randn(2, 8), y)
        assert counter.total() == 1
    assert output.shape == (2 * world, 8 // world)
    assert counter.module_count("_TwoInputs", "all_gather_into_tensor", "forward") == 1
    assert counter.module_count("_TwoInputs.linear", "all_gather_into_tensor") == 0


class _KwargModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, y: torch.Tensor, z: int = 2) -> torch.Tensor:
        return self.linear(x) + y + z


class _KwargOnlyModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(
        self, *, x: torch.Tensor, y: int = 2, z: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.linear(x) + y + z


def test_prepare_module_kwargs_input(api: str, mesh: DeviceMesh) -> None:
    """Keyword inputs are redistributed by name: one all_gather per Shard(0) keyword
    (a DTensor keyword is gathered as well)."""
    world = mesh.size()
    mod = _KwargModule()
    parallelize_module(mod.linear, mesh, ColwiseParallel(use_local_output=False))
    parallelize_module(
        mod,
        mesh,
        PrepareModuleInput(
            input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"y": Replicate()}
        ),
    )
    counter = make_counter(api)
    with counter:
        output = mod(torch.randn(world, 8), y=torch.ones(1, 8))
    assert counter.total() == 1
    assert counter.count("all_gather_into_tensor") == 1
    assert output.shape == (world, 8)

    kwonly = _KwargOnlyModule()
    parallelize_module(kwonly.linear, mesh, ColwiseParallel(use_local_output=False))
    parallelize_module(
        kwonly,
        mesh,
        PrepareModuleInput(
            input_kwarg_layouts={"x": Shard(0), "z": Shard(0)},
            desired_input_kwarg_layouts={"x": Replicate(), "z": Replicate()},
        ),
    )
    with counter:
        output = kwonly(x=torch.randn(1, 8), z=torch.ones(1, 8))
    assert counter.total() == 2
    assert counter.module_count("_KwargOnlyModule", "all_gather_into_tensor", "forward") == 2
    assert output.shape == (world, 8)

    x_dt = DTensor.from_local(torch.randn(1, 8), mesh, [Shard(0)])
    with counter:
        output = kwonly(x=x_dt, z=torch.ones(1, 8))
    assert counter.total() == 2
    assert output.shape == (world, 8)


def test_prepare_module_output(api: str, mesh: DeviceMesh) -> None:
    """PrepareModuleOutput from Replicate to Shard(0) keeps this rank's chunk, no collective."""
    world = mesh.size()
    style = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    chunk = parallelize_module(nn.Identity(), mesh, style)
    counter = make_counter(api)
    with counter:
        output = chunk(torch.ones(8, 16))
    torch.testing.assert_close(output, torch.ones(8 // world, 16))
    assert counter.total() == 0
