"""A fake process group and device mesh for tests, without torch's private imports.

torch's *fake* process group lets one process play one rank of a world of any
size: collectives return at once without communicating (their results are
meaningless), but DTensor, tensor parallelism and commspan see every
collective with its group, sizes and placements — enough to assert on which
module issues which collective. torch registers it in a private module
(``torch.testing._internal.distributed.fake_pg``); this module is the one
place that imports it, so tests need not.

- :func:`fake_process_group`: a context manager that initialises the default
  process group as a fake one and destroys it on exit;
- :func:`fake_mesh`: a CPU ``DeviceMesh`` over it, e.g. ``fake_mesh((2, 2),
  names=("dp", "tp"))``;
- the pytest fixture ``commspan_fake_pg`` (commspan's pytest plugin) does the
  same per test, sized by ``@pytest.mark.commspan_fake_pg(world_size=8, rank=3)``.

Example:
    >>> from commspan.testing import fake_mesh, fake_process_group
    >>> with fake_process_group(world_size=4) as world:
    ...     mesh = fake_mesh((2, 2), names=("dp", "tp"))
    ...     world.size(), mesh["tp"].size(), mesh.mesh_dim_names
    (4, 2, ('dp', 'tp'))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["fake_mesh", "fake_process_group"]

_FAKE = "fake"


def _register_fake_backend() -> None:
    """Make ``"fake"`` a usable backend: torch registers it when its (private) module is
    imported; importing it again does nothing."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            "this torch build has no fake process group "
            f"(torch.testing._internal.distributed.fake_pg: {exc}); commspan's fake "
            "process group needs torch>=2.13 with its testing package"
        ) from None


def _check_size(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is not valid; pass an int >= {minimum}")
    return value


@contextlib.contextmanager
def fake_process_group(world_size: int = 4, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Initialise the default process group as torch's fake one, for the block.

    This process plays rank ``rank`` of ``world_size`` ranks. Collectives do not
    communicate and their results are meaningless; their sizes, groups and
    placements are what a real rank would issue. On exit the group is destroyed
    (with every group and mesh made from it).

    If a fake default group of the same size and rank is already initialised
    (by an enclosing ``fake_process_group``, or a session-wide fixture), it is
    used as it is and left in place.

    Args:
        world_size: number of ranks to pretend (>= 1).
        rank: the rank this process plays, ``0 <= rank < world_size``.

    Yields:
        The default (world) process group.

    Raises:
        ValueError: ``world_size`` or ``rank`` is not valid.
        RuntimeError: another default process group is initialised (a real one,
            or a fake one of another size or rank): only one can exist at a time.

    Example:
        >>> import torch.distributed as dist
        >>> with fake_process_group(world_size=4, rank=0) as pg:
        ...     pg.size(), dist.get_rank()
        (4, 0)
    """
    _check_size("world_size", world_size, 1)
    _check_size("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(
            f"rank={rank!r} is not valid for world_size={world_size}; "
            f"pass 0 <= rank < {world_size}"
        )
    if dist.is_initialized():
        backend = str(dist.get_backend())
        current = (backend, dist.get_world_size(), dist.get_rank())
        if current == (_FAKE, world_size, rank):
            yield _world()
            return
        raise RuntimeError(
            f"fake_process_group(world_size={world_size}, rank={rank}): a default process "
            f"group is already initialised (backend {backend!r}, world size {current[1]}, "
            f"rank {current[2]}); only one can exist at a time: leave it first "
            "(torch.distributed.destroy_process_group()) or use the same size and rank"
        )
    _register_fake_backend()
    dist.init_process_group(_FAKE, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield _world()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None  # initialised by the caller
    return group


def fake_mesh(
    shape: int | Sequence[int], names: Sequence[str] | None = None
) -> DeviceMesh:
    """A CPU ``DeviceMesh`` of ``shape`` over the current (fake) default process group.

    Args:
        shape: the mesh's sizes, e.g. ``4`` or ``(2, 2)``; their product must be
            the world size.
        names: one name per dimension, e.g. ``("dp", "tp")``.

    Returns:
        The mesh (``init_device_mesh("cpu", shape, mesh_dim_names=names)``).

    Raises:
        RuntimeError: no process group is initialised (enter
            :func:`fake_process_group` or use the ``commspan_fake_pg`` fixture first).
        ValueError: ``shape`` does not multiply to the world size, holds a size
            < 1, or ``names`` has another length or repeats a name.

    Example:
        >>> with fake_process_group(world_size=4):
        ...     fake_mesh((2, 2), names=("dp", "tp"))["tp"].size()
        2
    """
    from torch.distributed.device_mesh import init_device_mesh

    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
        raise ValueError(f"shape={shape!r} is not valid; pass sizes >= 1, e.g. (2, 2)")
    if names is not None:
        if isinstance(names, str):
            names = (names,)
        names = tuple(names)
        if len(names) != len(dims) or len(set(names)) != len(names):
            raise ValueError(
                f"names={names!r} is not valid for shape {dims}; pass {len(dims)} distinct "
                f"names, one per dimension"
            )
    if not dist.is_initialized():
        raise RuntimeError(
            f"fake_mesh({dims}): no process group is initialised; enter "
            f"commspan.testing.fake_process_group(world_size={math.prod(dims)}) or use the "
            "commspan_fake_pg fixture first"
        )
    world = dist.get_world_size()
    if math.prod(dims) != world:
        raise ValueError(
            f"shape={dims} is not valid: it holds {math.prod(dims)} ranks, the process group "
            f"{world}; pass sizes that multiply to {world}"
        )
    return init_device_mesh("cpu", dims, mesh_dim_names=names)
