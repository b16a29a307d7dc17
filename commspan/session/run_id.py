"""The run id: one value shared by every rank of a run.

Resolution order: the ``run_id=`` argument, ``COMMSPAN_RUN_ID``,
``TORCHELASTIC_RUN_ID`` (set by torchrun), then a random id agreed across
ranks through the default process group (one 16-byte broadcast from rank 0,
once, when the mode is entered), else a random id for a single process.

torchrun keeps ``TORCHELASTIC_RUN_ID`` across the restarts of an elastic job,
and each node counts its own restarts (a node whose workers did not fail
restarts with count 0), so neither tells one attempt from the next on every
rank alike. Under torchrun the run id is therefore ``<TORCHELASTIC_RUN_ID>-<8
hex digits>``, the digits agreed across ranks by the same broadcast: each
attempt is a run of its own, whose step numbers start again without adding
to the last attempt's. Without a process group to agree through (one
process), the suffix is ``restart<N>`` from ``TORCHELASTIC_RESTART_COUNT``
after the first restart, and nothing before it.
"""

from __future__ import annotations

import logging
import os
import uuid

import torch

__all__ = ["resolve_run_id"]

_log = logging.getLogger(__name__)
ENV_RUN_ID = "COMMSPAN_RUN_ID"
ENV_TORCHELASTIC = "TORCHELASTIC_RUN_ID"
ENV_RESTARTS = "TORCHELASTIC_RESTART_COUNT"


def resolve_run_id(explicit: str | None = None) -> str:
    """Return the run id for this process (see the module docstring for the order)."""
    if explicit:
        return explicit
    for var in (ENV_RUN_ID, ENV_TORCHELASTIC):
        value = os.environ.get(var, "").strip()
        if value and value != "none":
            if var == ENV_TORCHELASTIC:
                attempt = _agree(uuid.uuid4().hex)
                if attempt is not None:
                    return f"{value}-{attempt[:8]}"
                restart = os.environ.get(ENV_RESTARTS, "").strip()
                if restart.isdigit() and int(restart) > 0:
                    return f"{value}-restart{int(restart)}"
            return value
    local = uuid.uuid4().hex
    agreed = _agree(local)
    return agreed if agreed is not None else local


def _agree(local: str) -> str | None:
    """Broadcast rank 0's id to every rank; ``None`` without a process group."""
    try:
        import torch.distributed as dist
        from torch.utils._python_dispatch import _disable_current_modes

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        backend = str(dist.get_backend())
        device = torch.device("cpu")
        if "nccl" in backend and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        payload = torch.tensor(list(bytes.fromhex(local)), dtype=torch.uint8, device=device)
        with _disable_current_modes():  # other dispatch modes must not count this
            dist.broadcast(payload, src=0)
        return bytes(payload.cpu().tolist()).hex()
    except Exception as exc:
        _log.warning("commspan: could not agree on a run id across ranks (%s); "
                     "set COMMSPAN_RUN_ID so all ranks share one trace per step", exc)
        return None
