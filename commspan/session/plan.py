"""A plan at scale without the hardware: one training step of one rank of a large job.

torch's fake process group lets one CPU process play rank ``r`` of a world of
any size: collectives return at once without moving data, but every shape,
group and mesh dimension is the one that rank would use. :func:`plan_step`
runs a step there under :class:`~commspan.CommSpanMode` and returns what it
issued per module and mesh dimension, with counts and bytes.

Example:
    >>> import torch
    >>> def setup():
    ...     model = torch.nn.Linear(4, 4)  # parallelize over a mesh here
    ...     return lambda: model(torch.randn(2, 4)).sum().backward()
    >>> plan = plan_step(setup, world_size=4)
    >>> plan.world_size, plan.aggregator.total_count()
    (4, 0)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter

from commspan import semconv
from commspan.analysis.counts import Aggregator

__all__ = ["StepPlan", "plan_step"]


@dataclass(frozen=True)
class StepPlan:
    """What one rank of a job issues in one training step.

    Attributes:
        world_size: the world the rank played in.
        rank: the rank played.
        seconds: wall time of the traced step on this machine.
        aggregator: the counts (:meth:`~commspan.Aggregator.mesh_dim_counts`,
            :meth:`~commspan.Aggregator.module_counts`, ...).
    """

    world_size: int
    rank: int
    seconds: float
    aggregator: Aggregator

    def mesh_dim_counts(self, subtree: bool = False) -> dict[str, Any]:
        """``{module: {mesh dimension: {op: {"count", "bytes"}}}}``; owners only by default."""
        return self.aggregator.mesh_dim_counts(subtree=subtree)

    def totals(self) -> dict[str, dict[str, dict[str, int]]]:
        """The whole rank's step per mesh dimension: ``{dim: {op: {"count", "bytes"}}}``."""
        return self.aggregator.mesh_dim_counts().get(semconv.GLOBAL_FQN, {})

    def table(self) -> str:
        """The per-module, per-dimension table as text (what ``commspan plan`` prints)."""
        from commspan.render.table import plan_table

        return plan_table(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: world size, rank, seconds, totals and modules (in the order they ran)."""
        owned = self.mesh_dim_counts()
        order = self.aggregator.modules()
        modules = [{"fqn": fqn, "mesh_dims": owned[fqn]} for fqn in order if fqn in owned]
        if semconv.GLOBAL_FQN in owned:  # collectives outside every module
            modules.append({"fqn": semconv.GLOBAL_FQN, "mesh_dims": owned[semconv.GLOBAL_FQN]})
        return {"world_size": self.world_size, "rank": self.rank,
                "seconds": round(self.seconds, 3), "totals": self.totals(),
                "modules": modules}


def plan_step(
    setup: Callable[[], Callable[[], Any]],
    *,
    world_size: int,
    rank: int = 0,
    warmup_steps: int = 0,
    exporters: Sequence[SpanExporter] = (),
) -> StepPlan:
    """Play ``rank`` of ``world_size`` ranks on torch's fake process group and trace
    one training step.

    Args:
        setup: called once the fake world exists; builds the device mesh, the
            model and its parallelism plan (``parallelize_module``,
            ``fully_shard``, ...) and returns the step: a function of no
            arguments that runs forward and backward (and an optimizer step
            if you want it counted).
        world_size: ranks in the job (>= 1), e.g. 512 for TP 8 x FSDP 64.
        rank: the rank this process plays.
        warmup_steps: steps run untraced first (lazy initialisation that issues
            collectives, e.g. FSDP2's first lazy init). DDP cannot run on torch
            2.13's fake process group (torch's own assertion), so DDP plans need
            real ranks.
        exporters: where the traced step's spans go too (e.g. a
            ``JsonlSpanExporter``, to see how many bytes a rank writes per step).

    Returns:
        The :class:`StepPlan`.

    Raises:
        ValueError: ``world_size``, ``rank`` or ``warmup_steps`` is not valid.
        TypeError: ``setup`` did not return a callable.
        RuntimeError: another process group is already initialised in this process
            (a real one, or a fake one of another size or rank): run the plan in
            a process of its own.
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r} is not valid; pass an int >= 0")
    from commspan.session.mode import CommSpanMode
    from commspan.testing.distributed import fake_process_group

    with fake_process_group(world_size=world_size, rank=rank):
        step = setup()
        if not callable(step):
            raise TypeError(
                f"setup returned {type(step).__name__}, not the step; return a function of "
                "no arguments that runs one training step"
            )
        for _ in range(warmup_steps):
            step()
        mode = CommSpanMode(exporters=exporters)
        start = time.perf_counter()
        with mode, mode.step(0):
            step()
        seconds = time.perf_counter() - start
        mode.shutdown()
    assert mode.aggregator is not None
    return StepPlan(world_size, rank, seconds, mode.aggregator)
