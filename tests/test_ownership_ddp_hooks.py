"""DDP comm hooks whose collectives commspan cannot see (docs/parallelisms.md, DDP)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel

from commspan import CommSpanMode


@pytest.mark.parametrize("hook", ["powerSGD_hook", "batched_powerSGD_hook", "allreduce_hook",
                                  None])
def test_a_ddp_hook_issuing_collectives_from_callbacks_is_warned_of(
    fake_pg: None, caplog: pytest.LogCaptureFixture, hook: str | None
) -> None:
    """torch's PowerSGD hooks issue all-reduces from ``Future.then`` callbacks, on the
    backend's threads, which commspan does not trace (and on gloo they can hang):
    said once, at the DDP module's first forward; other hooks are not warned of."""
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    if hook == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook is not None:
        ddp.register_comm_hook(ps.PowerSGDState(process_group=None), getattr(ps, hook))
    mode = CommSpanMode(aggregator=False)
    with caplog.at_level(logging.WARNING, logger="commspan"), mode:
        for i in range(2):
            with mode.step(i):
                ddp(torch.ones(2, 4))  # (no backward: the fake group's futures hold nothing)
    warned = [r.getMessage() for r in caplog.records if "Future callbacks" in r.getMessage()]
    if hook in ("powerSGD_hook", "batched_powerSGD_hook"):
        assert len(warned) == 1 and f"uses the comm hook {hook}" in warned[0]
    else:
        assert warned == []
