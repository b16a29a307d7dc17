"""This process's place in the job: rank, local rank and world size.

The one place commspan asks for them: the mode's resource (``commspan.rank``,
``commspan.local_rank``, ``commspan.world_size``) and the JSONL exporter's
``{rank}`` file-name field, for spans whose resource does not say, both come
from :func:`process_ranks`. torch is imported only when called, so the
exporters stay importable without it.

Example:
    >>> process_ranks().world_size >= 1
    True
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["Ranks", "process_ranks", "ranks_known"]


class Ranks(NamedTuple):
    """Where this process sits in the job.

    Attributes:
        local_rank: the rank within the node, ``None`` when unknown.
    """

    rank: int
    local_rank: int | None
    world_size: int


def process_ranks() -> Ranks:
    """Rank and world size from torch.distributed when it is initialised, else
    ``RANK`` and ``WORLD_SIZE`` (torchrun's variables), ``0`` and ``1`` when unset.

    The local rank comes from ``LOCAL_RANK`` only (torchrun sets it; torch
    knows no other source): without it, it is ``0`` for a world of one rank and
    ``None`` (unknown) otherwise, e.g. under ``mp.spawn`` or ``srun``."""
    env_local = os.environ.get("LOCAL_RANK", "")
    local = int(env_local) if env_local else None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = int(dist.get_world_size())
            return Ranks(int(dist.get_rank()), _local(local, world), world)
    except Exception:
        pass
    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return Ranks(rank, _local(local, world), world)


def ranks_known() -> bool:
    """Whether :func:`process_ranks` says where this process is, rather than guessing
    rank 0 of 1: torch.distributed is initialised, or ``RANK`` is set.

    Example:
        >>> ranks = process_ranks()
        >>> ranks_known() or ranks.rank == 0  # unknown: rank 0, a guess
        True
    """
    if os.environ.get("RANK", ""):
        return True
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def _local(local: int | None, world: int) -> int | None:
    """``LOCAL_RANK``'s value; without it ``0`` when the process is alone, else unknown."""
    if local is None and world == 1:
        return 0
    return local
