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

import logging
import os
from typing import NamedTuple

from commspan._errors import Once

__all__ = ["Ranks", "process_ranks", "ranks_known"]

_log = logging.getLogger(__name__)


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
    ``None`` (unknown) otherwise, e.g. under ``mp.spawn`` or ``srun``.

    A variable holding no int (``LOCAL_RANK=gpu0``) counts as unset, with a
    warning naming it and its value (once per value): these only label spans
    and name files, so a bad one never stops training."""
    local = _env_int("LOCAL_RANK", "the local rank is unknown")
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = int(dist.get_world_size())
            return Ranks(int(dist.get_rank()), _local(local, world), world)
    except Exception:
        pass
    env_rank = _env_int("RANK", "rank 0 is used")
    env_world = _env_int("WORLD_SIZE", "a world of 1 is used")
    world = 1 if env_world is None else env_world
    return Ranks(0 if env_rank is None else env_rank, _local(local, world), world)


_WARNED = Once()  # variables whose value was warned about: once per variable and value


def _env_int(name: str, instead: str) -> int | None:
    """The int in environment variable ``name``; ``None`` when it is unset or empty,
    and when it is no int (a warning, saying ``instead`` what is used, names the
    variable and its value: commspan uses it only to label spans and name files,
    so it does not stop training over it)."""
    raw = os.environ.get(name, "")
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        _WARNED.warn(_log, f"{name}\0{raw}",
                     "commspan: %s=%r (environment variable) is not a whole number; %s "
                     "(set %s to this process's number, as torchrun does, or unset it)",
                     name, raw, instead, name)
        return None


def ranks_known() -> bool:
    """Whether :func:`process_ranks` says where this process is, rather than guessing
    rank 0 of 1: torch.distributed is initialised, or ``RANK`` is set (to a number).

    Example:
        >>> ranks = process_ranks()
        >>> ranks_known() or ranks.rank == 0  # unknown: rank 0, a guess
        True
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return True
    except Exception:
        pass
    return _env_int("RANK", "rank 0 is used") is not None


def _local(local: int | None, world: int) -> int | None:
    """``LOCAL_RANK``'s value; without it ``0`` when the process is alone, else unknown."""
    if local is None and world == 1:
        return 0
    return local
