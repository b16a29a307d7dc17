"""Scenarios run by each spawned gloo rank for tests/test_multiprocess.py.

Run as ``python tests/_mp_scenarios.py OUT_DIR`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set. Every scenario writes one JSONL file
per rank (through ``JsonlSpanExporter`` with ``{rank}`` in the path) and the
rank's in-process view (aggregator results, run ids) to
``OUT_DIR/<scenario>/rank<r>.result.json``; the parent test compares them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commspan import Aggregator, CommSpanMode
from commspan.exporters import JsonlSpanExporter
from commspan.testing.models import MLP, MLPStacked, parallelize_mlp

ENV_RUN_ID_VALUE = "mp-env-run-id"
"""The ``COMMSPAN_RUN_ID`` the run-id scenario sets before its second mode."""

STEPS = 2
DIM = 16


def tp_mlp_stack(mesh: Any, **kwargs: Any) -> MLPStacked:
    """Two ``MLP(DIM, 2 * DIM)`` blocks, block 1 checkpointed, each tensor-parallel over
    ``mesh`` (seeded); ``kwargs`` go to :class:`MLPStacked`."""
    torch.manual_seed(0)
    options: dict[str, Any] = {"block": lambda: MLP(DIM, 2 * DIM), "checkpointed": (1,)}
    model = MLPStacked(**{**options, **kwargs})
    for layer in model.layers:
        parallelize_mlp(layer, mesh)  # type: ignore[arg-type]
    return model


class C10dOps(torch.nn.Module):
    """Issues one of each c10d collective over the default group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        t = x.clone()
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        gathered = torch.empty(world * t.numel(), dtype=t.dtype)
        dist.all_gather_into_tensor(gathered, t)
        scattered = torch.empty(t.numel(), dtype=t.dtype)
        dist.reduce_scatter_tensor(scattered, gathered)
        exchanged = torch.empty_like(gathered)
        dist.all_to_all_single(exchanged, gathered)
        return exchanged


class Ring(torch.nn.Module):
    """Sends to rank+1 and receives from rank-1 (even ranks send first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = torch.empty_like(x)
        if rank % 2 == 0:
            dist.send(x, dst=(rank + 1) % world)
            dist.recv(out, src=(rank - 1) % world)
        else:
            dist.recv(out, src=(rank - 1) % world)
            dist.send(x, dst=(rank + 1) % world)
        return out


SUBGROUP = (2, 3)
"""Global ranks of the subgroup in which rank 2 sends to rank 3."""


class SubgroupSend(torch.nn.Module):
    """In a process group of global ranks 2 and 3 only, rank 2 sends to rank 3."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        if rank == SUBGROUP[0]:
            dist.send(x, dst=SUBGROUP[1], group=self.group)
        elif rank == SUBGROUP[1]:
            x = x.clone()
            dist.recv(x, src=SUBGROUP[0], group=self.group)
        return x


class Comms(torch.nn.Module):
    """Root of the c10d scenario: ``Comms.ops``, ``Comms.ring``, then ``Comms.sub``."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.ops = C10dOps()
        self.ring = Ring()
        self.sub = SubgroupSend(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(self.ring(self.ops(x)))


# ---------------------------------------------------------------- helpers
def _aggregate_view(agg: Aggregator) -> dict[str, Any]:
    return {
        "module_counts": agg.module_counts(),
        "comm_counts": agg.comm_counts(),
        "parameter_info": agg.parameter_info(),
        "sharding_info": agg.sharding_info(),
        "collectives": [list(vars(s).values()) for s in agg.collectives()],
        "table": agg.table(1),
    }


def _write(out: Path, name: str, rank: int, data: dict[str, Any]) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.result.json").write_text(json.dumps(data, sort_keys=True))


def _train_steps(
    mode: CommSpanMode, step_fn: Callable[[], float], steps: int = STEPS
) -> list[float]:
    """Enter ``mode`` and run ``steps`` traced steps of ``step_fn`` (forward + backward)."""
    losses = []
    with mode:
        for i in range(steps):
            with mode.step(i):
                losses.append(step_fn())
    return losses


# ---------------------------------------------------------------- scenarios
def scenario_run_id(out: Path, rank: int) -> None:
    """Run ids: agreed over the process group without env vars, then taken from the env."""
    assert "COMMSPAN_RUN_ID" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
    agreed = CommSpanMode(aggregator=False)
    with agreed:
        pass
    os.environ["COMMSPAN_RUN_ID"] = ENV_RUN_ID_VALUE
    try:
        from_env = CommSpanMode(aggregator=False)
        with from_env:
            pass
    finally:
        del os.environ["COMMSPAN_RUN_ID"]
    _write(out, "run_id", rank, {"agreed": agreed.run_id, "from_env": from_env.run_id})


def scenario_tp_mlp(out: Path, rank: int) -> None:
    """Tensor-parallel MLP stack with a checkpointed block, two steps, one trace per step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tp_mlp_stack(mesh)
    exporter = JsonlSpanExporter(out / "tp_mlp" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])

    def step_fn() -> float:
        torch.manual_seed(1)
        loss = model(torch.randn(4, DIM, requires_grad=True)).pow(2).mean()
        loss.backward()
        return float(loss.detach())

    losses = _train_steps(mode, step_fn)
    mode.shutdown()
    assert mode.aggregator is not None
    _write(
        out,
        "tp_mlp",
        rank,
        {
            "run_id": mode.run_id,
            "losses": losses,
            "stats": mode.stats(),
            **_aggregate_view(mode.aggregator),
        },
    )


def scenario_tp_transformer(out: Path, rank: int) -> None:
    """The toy Transformer of commspan.testing.models, tensor-parallel, blocks checkpointed
    both ways."""
    from torch.distributed.device_mesh import init_device_mesh

    from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    args = ModelArgs(n_layers=3, checkpoint={1: False, 2: True})
    model = parallelize(Transformer(args), mesh)
    exporter = JsonlSpanExporter(out / "tp_transformer" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])

    def step_fn() -> float:
        loss = train_step(model, *make_batch(args))
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    losses = _train_steps(mode, step_fn)
    mode.shutdown()
    assert mode.aggregator is not None
    _write(
        out,
        "tp_transformer",
        rank,
        {
            "run_id": mode.run_id,
            "losses": losses,
            "stats": mode.stats(),
            **_aggregate_view(mode.aggregator),
        },
    )


def scenario_c10d(out: Path, rank: int) -> None:
    """c10d collectives, a send/recv ring and a subgroup send inside module calls, one step."""
    group = dist.new_group(list(SUBGROUP))  # every rank takes part in creating it
    exporter = JsonlSpanExporter(out / "c10d" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter])
    model = Comms(group)
    with mode, mode.step(0):
        model(torch.full((4,), float(rank + 1)))
    mode.shutdown()
    assert mode.aggregator is not None
    _write(out, "c10d", rank, {"run_id": mode.run_id, **_aggregate_view(mode.aggregator)})


SCENARIOS: dict[str, Callable[[Path, int], None]] = {
    "run_id": scenario_run_id,
    "tp_mlp": scenario_tp_mlp,
    "tp_transformer": scenario_tp_transformer,
    "c10d": scenario_c10d,
}


def entered_before_init(out: Path) -> None:
    """``with CommSpanMode(...): main()`` where main initialises the process group
    (``mp.spawn``: no ``RANK`` in the environment): the mode enters not knowing its
    rank, and must learn it (and agree on the run id) by the first step. Leaves the
    default process group initialised for the other scenarios."""
    rank, world = os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
    try:
        mode = CommSpanMode(exporters=[JsonlSpanExporter(
            out / "before_init" / "trace-rank{rank}.jsonl")], aggregator=False)
        with mode:
            dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
            model = C10dOps()
            for i in range(STEPS):
                with mode.step(i):
                    model(torch.ones(8))
        mode.shutdown()
    finally:
        os.environ.update(RANK=rank, WORLD_SIZE=world)
    _write(out, "before_init", dist.get_rank(), {"run_id": mode.run_id})


def main(argv: list[str]) -> int:
    """Initialise gloo from the environment (in the first scenario), run every
    scenario, report timings."""
    out = Path(argv[1])
    t0 = time.perf_counter()
    entered_before_init(out)
    rank = dist.get_rank()
    timings: dict[str, float] = {"before_init": time.perf_counter() - t0}
    try:
        for name, scenario in SCENARIOS.items():
            t0 = time.perf_counter()
            scenario(out, rank)
            timings[name] = time.perf_counter() - t0
            dist.barrier()
    finally:
        dist.destroy_process_group()
    (out / f"timings-rank{rank}.json").write_text(json.dumps(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
