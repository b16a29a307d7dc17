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

__all__ = ["Ranks", "process_ranks"]


class Ranks(NamedTuple):
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int


def process_ranks() -> Ranks:
    """From torch.distributed when it is initialised, else ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE`` (torchrun's variables); ``(0, 0, 1)``
    when none is set."""
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return Ranks(int(dist.get_rank()), local, int(dist.get_world_size()))
    except Exception:
        pass
    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return Ranks(rank, local, world)
