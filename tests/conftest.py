"""Shared fixtures: torch's fake process group (one process, world of 4)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from commspan.testing import fake_mesh, fake_process_group

WORLD_SIZE = 4


@pytest.fixture(scope="session")
def fake_pg() -> Iterator[None]:
    """A fake process group of 4 ranks (this process is rank 0); collectives are no-ops.

    Kept for the whole session (module-scoped fixtures hold meshes made from it);
    destroyed when the session ends.
    """
    with fake_process_group(world_size=WORLD_SIZE, rank=0):
        yield


@pytest.fixture()
def mesh(fake_pg: None) -> torch.distributed.device_mesh.DeviceMesh:
    """A 1-D CPU DeviceMesh over the fake process group."""
    return fake_mesh(WORLD_SIZE)
