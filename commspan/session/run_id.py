"""The run id: one value shared by every rank of a run.

Resolution order: the ``run_id=`` argument, ``COMMSPAN_RUN_ID``,
``TORCHELASTIC_RUN_ID`` (set by torchrun), then a random id agreed across
ranks once, when the mode is entered, else a random id for a single process.
The agreement goes through the default process group's store: rank 0 writes
its id, the other ranks wait for it (up to five minutes) and read it. No
collective is issued, so a mode entered on rank 0 alone (``CommSpanMode() if
rank == 0 else nullcontext()``) waits for nobody; a rank that waits in vain
uses an id of its own and says so. (A process group whose store cannot do
that agrees by one 16-byte broadcast from rank 0; torch's fake process group, where
one process plays one rank, keeps the rank's own id.)

torchrun keeps ``TORCHELASTIC_RUN_ID`` across the restarts of an elastic job,
and each node counts its own restarts (a node whose workers did not fail
restarts with count 0), so neither tells one attempt from the next on every
rank alike. Under torchrun the run id is therefore ``<TORCHELASTIC_RUN_ID>-<8
hex digits>``, the digits agreed across ranks by the same broadcast: each
attempt is a run of its own, whose step numbers start again without adding
to the last attempt's. Without a process group to agree through (one
process), the suffix is ``restart<N>`` from ``TORCHELASTIC_RESTART_COUNT``
after the first restart, and nothing before it.

Python decodes environment variables with ``surrogateescape``, so a variable
holding bytes that are not UTF-8 (a scheduler's job name in Latin-1) gives text
no UTF-8 encoder accepts; such a run id is used with those bytes written as
``\\xNN`` escapes (``run\\xff``), and a warning says so.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import re
import uuid
from typing import Any

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
        value = _utf8(var, os.environ.get(var, "").strip())
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


def _utf8(var: str, value: str) -> str:
    """``value`` if UTF-8 can encode it, else :func:`escape_non_utf8` of it, with a
    warning naming the variable."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    cleaned = escape_non_utf8(value)
    _log.warning("commspan: %s=%s holds bytes that are not UTF-8; the run id is %r "
                 "(set %s to UTF-8 text to choose it)", var, ascii(value), cleaned, var)
    return cleaned


def escape_non_utf8(value: str) -> str:
    """``value`` with what UTF-8 cannot encode written as backslash escapes: the
    bytes ``os.environ`` kept as lone surrogates as ``\\xNN`` (``run\\xff``),
    other lone surrogates as ``\\uNNNN``."""
    try:
        raw = value.encode("utf-8", "surrogateescape")  # the variable's own bytes
    except UnicodeEncodeError:
        raw = value.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


_AGREEMENTS = itertools.count()
"""Run ids agreed through the store by this process (the key of the next one): the
ranks enter their modes in the same order, so their n-th agreements match."""
_WAIT_S = 300.0
"""How long a rank waits for rank 0's run id."""


def _agree(local: str) -> str | None:
    """Rank 0's id, on every rank; ``None`` without a process group (or when rank 0's
    never came)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        if str(dist.get_backend()) == "fake":  # one process plays one rank: nobody to ask
            return local
        usable, agreed = _by_store(dist, local)
        if usable:
            return agreed
        return _by_broadcast(dist, local)
    except Exception as exc:
        _log.warning("commspan: could not agree on a run id across ranks (%s); "
                     "set COMMSPAN_RUN_ID so all ranks share one trace per step", exc)
        return None


def _by_store(dist: Any, local: str) -> tuple[bool, str | None]:
    """``(store usable, agreed id)``: rank 0 writes its id in the default process
    group's store, the others wait for it and read it."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return False, None
    key = f"commspan/run_id/{next(_AGREEMENTS)}"
    try:
        if dist.get_rank() == 0:
            store.set(key, local)
            return True, local
        store.wait([key], datetime.timedelta(seconds=_WAIT_S))
        value = store.get(key).decode("ascii", "replace")
    except dist.DistStoreError as exc:  # rank 0 did not enter its mode in time
        _log.warning(
            "commspan: rank %d waited %.0f s for rank 0's run id (%s): its spans get a run "
            "id of their own; enter the mode on rank 0 too, or set COMMSPAN_RUN_ID",
            dist.get_rank(), _WAIT_S, exc)
        return True, None
    except Exception:  # a store that cannot set or wait (torch's fake process group)
        return False, None
    return True, value if _HEX32.fullmatch(value) else None


_HEX32 = re.compile(r"[0-9a-f]{32}")


def _by_broadcast(dist: Any, local: str) -> str | None:
    """One 16-byte broadcast of rank 0's id over the default process group."""
    from torch.utils._python_dispatch import _disable_current_modes

    backend = str(dist.get_backend())
    device = torch.device("cpu")
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    payload = torch.tensor(list(bytes.fromhex(local)), dtype=torch.uint8, device=device)
    with _disable_current_modes():  # other dispatch modes must not count this
        dist.broadcast(payload, src=0)
    return bytes(payload.cpu().tolist()).hex()
