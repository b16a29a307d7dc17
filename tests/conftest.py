"""Shared fixtures: torch's fake process group (one process, world of 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

WORLD_SIZE = 4


@pytest.fixture(scope="session")
def fake_pg() -> None:
    """A fake process group of 4 ranks (this process is rank 0); collectives are no-ops."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    yield
    # left initialised for the rest of the session; the process exits after it


@pytest.fixture()
def mesh(fake_pg: None) -> torch.distributed.device_mesh.DeviceMesh:
    """A 1-D CPU DeviceMesh over the fake process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD_SIZE,))
