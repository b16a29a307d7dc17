"""DDP comm hooks whose collectives commspan cannot see (docs/parallelisms.md, DDP)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel

from commspan import CommSpanMode


def _own_wrapper(hook: Any) -> Any:
    """A user's hook around another (a closure, named otherwise; no annotations:
    DDP checks them)."""
    return lambda state, bucket: hook(state, bucket)


@pytest.mark.parametrize("hook", ["powerSGD_hook", "batched_powerSGD_hook",
                                  "fp16_compress_wrapper(powerSGD_hook)",
                                  "own_wrapper(batched_powerSGD_hook)",
                                  "allreduce_hook", None])
def test_a_ddp_hook_issuing_collectives_from_callbacks_is_warned_of(
    fake_pg: None, caplog: pytest.LogCaptureFixture, hook: str | None
) -> None:
    """torch's PowerSGD hooks issue all-reduces from ``Future.then`` callbacks, on the
    backend's threads, which commspan does not trace (and on gloo they can hang):
    said once, at the DDP module's first forward; other hooks are not warned of."""
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    if hook == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16_compress_wrapper(powerSGD_hook)":
        ddp.register_comm_hook(ps.PowerSGDState(process_group=None),
                               default_hooks.fp16_compress_wrapper(ps.powerSGD_hook))
    elif hook == "own_wrapper(batched_powerSGD_hook)":
        ddp.register_comm_hook(ps.PowerSGDState(process_group=None),
                               _own_wrapper(ps.batched_powerSGD_hook))
    elif hook is not None:
        ddp.register_comm_hook(ps.PowerSGDState(process_group=None), getattr(ps, hook))
    mode = CommSpanMode(aggregator=False)
    with caplog.at_level(logging.WARNING, logger="commspan"), mode:
        for i in range(2):
            with mode.step(i):
                ddp(torch.ones(2, 4))  # (no backward: the fake group's futures hold nothing)
    warned = [r.getMessage() for r in caplog.records if "Future callbacks" in r.getMessage()]
    if hook is not None and "powerSGD" in hook:
        named = "batched_powerSGD_hook" if "batched" in hook else "powerSGD_hook"
        assert len(warned) == 1 and f"uses the comm hook {named}" in warned[0]
    else:
        assert warned == []


class _Created(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the elements of what ``zeros_like`` made while it was on the mode stack."""

    def __init__(self) -> None:
        super().__init__()
        self.zeros_like = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.zeros_like.default:
            self.zeros_like += out.numel()
        return out


def test_reading_ddp_buckets_copies_no_gradient_and_is_no_op_of_the_model(
    fake_pg: None,
) -> None:
    """commspan reads DDP's bucket layout with ``_get_zeros_like_grad_buckets``,
    which makes a zero copy of every bucket: as much memory as all the gradients,
    at the first forward (and after the rebuild), enough to run a full GPU out of
    memory, and an ``aten.zeros_like`` a compat CommDebugMode listed under
    ``Global``. The layout is now read from one expanded zero element per bucket,
    out of the modes' sight; the parameters of each bucket are those of torch's own
    call."""
    from commspan.capture.parallel import _grad_buckets

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    real = ddp.reducer._get_zeros_like_grad_buckets()
    read = _grad_buckets(ddp.reducer)
    assert len(read) == len(real) >= 1
    for a, b in zip(read, real):
        assert a.index() == b.index()
        assert [id(p) for p in a.parameters()] == [id(p) for p in b.parameters()]
        assert a.buffer().shape == b.buffer().shape and a.buffer().dtype == b.buffer().dtype
        assert a.buffer().untyped_storage().nbytes() <= 8 < b.buffer().untyped_storage().nbytes()
    seen = _Created()
    mode = CommSpanMode(aggregator=False)
    with seen, mode, mode.step(0):
        ddp(torch.ones(2, 64))
    assert seen.zeros_like == 0
