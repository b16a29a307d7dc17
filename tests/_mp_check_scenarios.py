"""Divergent programs run by each spawned gloo rank for tests/test_analysis_check.py.

Run as ``python tests/_mp_check_scenarios.py OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Each scenario trains
:class:`Net` for :data:`STEPS` traced steps under its own ``CommSpanMode``,
writing ``OUT_DIR/<scenario>/trace-rank<r>.jsonl``; one rank deviates from the
program as :data:`SCENARIOS` says. gloo must still see matching collectives on
every rank, so each deviation keeps the bytes equal (another shape or dtype of
the same size), or is paired with the same collective issued on the other
ranks out of commspan's sight, or only changes what is traced. The process
group names go to ``OUT_DIR/groups.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter

STEPS = 3
DIM = 16
SUBGROUP = (2, 3)
"""Global ranks of the subgroup used by ``Net.head``."""

WORLD_OPS = [
    ("Net.blocks.0", "all_reduce"),
    ("Net.blocks.1", "all_gather_into_tensor"),
    ("Net.blocks.2", "all_reduce"),
    ("Net.ring", "send/recv"),
    ("Net.ring", "recv/send"),
    ("Net.grad_sync", "all_reduce"),
]
"""What each rank issues on the world group per step, in order (the sequence numbers of
step s are ``len(WORLD_OPS) * s + 1`` onwards)."""


@dataclass(frozen=True)
class Deviation:
    """Where one rank leaves the program."""

    rank: int
    step: int
    what: str  # "extra_all_reduce", "shape", "dtype", "skip_step", "recv_shape"


SCENARIOS: dict[str, Deviation | None] = {
    "consistent": None,
    "extra_all_reduce": Deviation(rank=2, step=1, what="extra_all_reduce"),
    "shape": Deviation(rank=1, step=1, what="shape"),
    "dtype": Deviation(rank=3, step=2, what="dtype"),
    "skip_step": Deviation(rank=3, step=1, what="skip_step"),
    "recv_shape": Deviation(rank=1, step=0, what="recv_shape"),
}
"""Scenario name -> the deviation (``None``: every rank runs the program)."""


class _Context:
    """What the modules need to know about the step being run."""

    deviation: Deviation | None = None
    step: int = 0

    @classmethod
    def deviates(cls, what: str) -> bool:
        d = cls.deviation
        return d is not None and d.what == what and d.step == cls.step and (
            d.rank == dist.get_rank()
        )

    @classmethod
    def someone_deviates(cls, what: str) -> bool:
        d = cls.deviation
        return d is not None and d.what == what and d.step == cls.step


@contextmanager
def _unseen() -> Iterator[None]:
    """Issue a collective commspan does not see (gloo still pairs it with other ranks')."""
    with _disable_current_modes():
        yield


class AllReduce(torch.nn.Module):
    """all_reduce of a copy of the input; the deviating rank may change shape or dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.detach().clone()
        if _Context.deviates("shape") and isinstance(self, ShapeBlock):
            t = t.view(2, DIM // 2)  # same bytes, another shape
        if _Context.deviates("dtype") and isinstance(self, DtypeBlock):
            t = t.view(torch.int32)  # same bytes, another dtype
        dist.all_reduce(t)
        return x


class DtypeBlock(AllReduce):
    """Net.blocks.0: the block whose dtype the ``dtype`` scenario changes."""


class ShapeBlock(AllReduce):
    """Net.blocks.2: the block whose shape the ``shape`` scenario changes."""


class Gather(torch.nn.Module):
    """Net.blocks.1: all_gather_into_tensor of a quarter of the input; in the
    ``extra_all_reduce`` scenario the deviating rank first issues an extra all_reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Context.someone_deviates("extra_all_reduce"):
            extra = x.detach().clone()
            if _Context.deviates("extra_all_reduce"):
                dist.all_reduce(extra)
            else:
                with _unseen():
                    dist.all_reduce(extra)
        shard = x.detach()[: DIM // 4].clone()
        out = torch.empty(DIM // 4 * dist.get_world_size())
        dist.all_gather_into_tensor(out, shard)
        return x


class Ring(torch.nn.Module):
    """Net.ring: send to rank+1, receive from rank-1 (even ranks send first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        t = x.detach().clone()
        out = torch.empty(DIM)
        buf = out.view(4, DIM // 4) if _Context.deviates("recv_shape") else out
        if rank % 2 == 0:
            dist.send(t, dst=(rank + 1) % world)
            dist.recv(buf, src=(rank - 1) % world)
        else:
            dist.recv(buf, src=(rank - 1) % world)
            dist.send(t, dst=(rank + 1) % world)
        return x


class Head(torch.nn.Module):
    """Net.head: an all_reduce on the subgroup of ranks 2 and 3 (nothing on the others)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() in SUBGROUP:
            t = x.detach()[: DIM // 2].clone()
            dist.all_reduce(t, group=self.group)
        return x


class _SyncGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        g = grad.clone()
        dist.all_reduce(g)
        return g


class GradSync(torch.nn.Module):
    """Net.grad_sync: identity forward, all_reduce of the gradient in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SyncGrad.apply(x)


class Net(torch.nn.Module):
    """The program: see :data:`WORLD_OPS`."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)
        self.blocks = torch.nn.ModuleList([DtypeBlock(), Gather(), ShapeBlock()])
        self.ring = Ring()
        self.head = Head(group)
        self.grad_sync = GradSync()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        for block in self.blocks:
            x = block(x)
        x = self.ring(x)
        x = self.head(x)
        return self.grad_sync(x)


def run_scenario(out: Path, name: str, deviation: Deviation | None, group: Any) -> None:
    """Train :class:`Net` for :data:`STEPS` traced steps under a fresh mode."""
    rank = dist.get_rank()
    sample = None
    if deviation is not None and deviation.what == "skip_step" and deviation.rank == rank:
        sample = [s for s in range(STEPS) if s != deviation.step]  # this rank skips one
    exporter = JsonlSpanExporter(out / name / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter], sample=sample, aggregator=False)
    torch.manual_seed(0)
    model = Net(group)
    _Context.deviation = deviation
    with mode:
        for step in range(STEPS):
            _Context.step = step
            with mode.step(step):
                model(torch.ones(DIM)).sum().backward()
    mode.shutdown()
    stats = mode.stats()
    assert stats["spans_dropped"] == stats["spans_failed"] == 0, stats


def main(argv: list[str]) -> int:
    """Initialise gloo from the environment and run every scenario."""
    out = Path(argv[1])
    dist.init_process_group("gloo")
    try:
        group = dist.new_group(list(SUBGROUP))
        if dist.get_rank() == SUBGROUP[0]:  # a member of both groups
            names = {"world": dist.group.WORLD.group_name, "sub": group.group_name}
            (out / "groups.json").write_text(json.dumps(names))
        for name, deviation in SCENARIOS.items():
            run_scenario(out, name, deviation, group)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
