"""What following ``record_function`` labels costs (the FSDP2 ownership mechanism).

commspan's dispatch mode keeps, per thread, the stack of open
``torch.profiler.record_function`` labels, which FSDP2 uses to name the unit
of each all-gather and reduce-scatter. Both profiler ops are entries of the
mode's op table, so any other op still costs one dict lookup; the labels cost
a push and a pop.

One spawned process over torch's fake process group (world 4, rank 0):

1. microseconds per ``with record_function(...)`` pair: no mode, a
   pass-through dispatch mode (the floor any mode pays), commspan's dispatch
   mode without label tracking (the profiler ops removed from its table, as
   before labels were followed) and with it;
2. an FSDP2 step (two blocks and the root sharded, issue 10's model, forward +
   backward): label pairs per step, and CPU ms per step of a full
   ``CommSpanMode`` with and without label tracking, interleaved round by
   round; the difference is the label stack's cost per step.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from benchmarks.common import median, quiet, run_in_subprocess

__all__ = ["run_labels"]


def _measure(rounds: int, pairs: int, steps: int) -> dict[str, Any]:
    quiet()
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from commspan import CommSpanMode
    from commspan.capture.collectives import label_overloads
    from commspan.capture.dispatch import CollectiveDispatchMode

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    def without_labels(mode: CollectiveDispatchMode) -> CollectiveDispatchMode:
        enter, leave = label_overloads()
        for op in enter + leave:
            mode.forget(op)
        return mode

    def per_pair(mode: Any) -> float:
        def loop() -> float:
            t0 = time.perf_counter()
            for _ in range(pairs):
                with record_function("FSDP::pre_forward (blocks.0)"):
                    pass
            return (time.perf_counter() - t0) / pairs * 1e6

        if mode is None:
            return loop()
        with mode:
            return loop()

    makers = {
        "none": lambda: None,
        "floor": PassThrough,
        "commspan_no_labels": lambda: without_labels(CollectiveDispatchMode(lambda i, a: None)),
        "commspan": lambda: CollectiveDispatchMode(lambda i, a: None),
    }
    pair_us: dict[str, list[float]] = {k: [] for k in makers}
    for r in range(rounds + 1):
        for k, make in makers.items():
            value = per_pair(make())
            if r:
                pair_us[k].append(value)

    # ---- an FSDP2 step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Block(torch.nn.Module):
        def __init__(self, d: int, h: int) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.relu(self.a(x)))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(64, 128), Block(64, 192)])
            self.head = torch.nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (4,))
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(16, 64)

    def train_step() -> None:
        model(x).sum().backward()

    class CountLabels(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.profiler._record_function_enter_new.default:
                CountLabels.n += 1
            return func(*args, **(kwargs or {}))

    train_step()  # lazy init
    with CountLabels():
        train_step()
    labels_per_step = CountLabels.n

    modes = {"labels": CommSpanMode(), "no_labels": CommSpanMode()}
    step_ms: dict[str, list[float]] = {k: [] for k in modes}
    index = 0
    for r in range(rounds + 1):
        for k, mode in modes.items():
            gc.collect()
            with mode:
                if k == "no_labels":
                    assert mode._dispatch is not None
                    without_labels(mode._dispatch)
                c0 = time.process_time()
                for _ in range(steps):
                    with mode.step(index):
                        train_step()
                    index += 1
                if r:
                    step_ms[k].append((time.process_time() - c0) * 1e3 / steps)
    owned = modes["labels"].aggregator
    assert owned is not None
    delta = [a - b for a, b in zip(step_ms["labels"], step_ms["no_labels"])]
    return {
        "pair_us": {k: median(v) for k, v in pair_us.items()},
        "label_pair_cost_us": median(
            [a - b for a, b in zip(pair_us["commspan"], pair_us["commspan_no_labels"])]
        ),
        "fsdp_labels_per_step": labels_per_step,
        "fsdp_step_ms": {k: median(v) for k, v in step_ms.items()},
        "fsdp_label_cost_ms_per_step": median(delta),
        "fsdp_label_cost_share": median(
            [d / b for d, b in zip(delta, step_ms["no_labels"])]
        ),
    }


def run_labels(rounds: int = 10, pairs: int = 20000, steps: int = 5) -> dict[str, Any]:
    """The label-tracking costs (see the module docstring), measured in a subprocess."""
    return dict(run_in_subprocess(_measure, rounds, pairs, steps, timeout_s=900))
