"""Programs run by each spawned gloo rank for tests/test_timing_gloo.py.

``python tests/_mp_timing_scenarios.py OUT_DIR main`` runs, one after the other,

- ``timed``: :class:`Timed` for :data:`STEPS` steps: blocking and async c10d
  collectives, a send/recv ring and a functional all_reduce waited after the
  module that issued it closed;
- ``straggler``: :class:`Straggler` for :data:`STEPS` steps: rank
  :data:`SLOW_RANK` sleeps :data:`SLOW_S` in ``Straggler.slow`` before its
  all_reduce.
- ``mesh_straggler``: :class:`MeshStraggler` for :data:`STEPS` steps: a 2 x 2
  mesh where rank :data:`SLOW_RANK` sleeps in ``tp`` and its tp peer is late at
  ``dp`` for having waited;
- ``gc_straggler``: :class:`GcStraggler` for :data:`STEPS` steps: rank
  :data:`GC_RANK`, which holds :data:`BALLAST` extra objects, runs a full garbage
  collection in ``GcStraggler.collect`` before its all_reduce; each rank writes
  its own record of its full collections (``gc_straggler/reference-rank<r>.json``:
  ``[step, duration_ns]`` pairs, from a ``gc.callbacks`` of its own).

``python tests/_mp_timing_scenarios.py OUT_DIR hang`` runs ``hang``: each step
rank 0 sends to rank 1 in ``Hang.pipe``, then every rank all_reduces in each of
``Hang.blocks``; steps 0 and
1 of :class:`Hang` complete; in step 2 rank :data:`STALLED_RANK` stalls in
``Hang.blocks.1`` and never issues ``Hang.blocks.2``'s all_reduce, in which the
other ranks block. Every rank has ``hang_timeout_s=HANG_TIMEOUT_S`` and
``dump_signal=SIGUSR1``; the parent test stops the job.

``python tests/_mp_timing_scenarios.py OUT_DIR crash`` runs ``crash``: the same
program without hang records (``hang_timeout_s`` off), where in step 2 rank
:data:`STALLED_RANK` dies in ``Hang.blocks.1`` (``os._exit(CRASH_EXIT)``) instead of
stalling: the other ranks' all_reduce in ``Hang.blocks.2`` (``async_op=True`` in
this scenario) raises the backend's error, which they catch after the mode has
exported their spans.

Each writes ``OUT_DIR/<scenario>/trace-rank<r>.jsonl``; the world group's name
goes to ``OUT_DIR/groups.json``. ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` come from the environment.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter

STEPS = 3
DIM = 256
SLOW_RANK = 2
SLOW_S = 0.2
STALLED_RANK = 1
HANG_STEP = 2
HANG_TIMEOUT_S = 1.0
CRASH_EXIT = 3
GC_RANK = 1
BALLAST = 400_000


# ---------------------------------------------------------------- timed
class Blocking(torch.nn.Module):
    """A blocking all_reduce and all_gather_into_tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.clone()
        dist.all_reduce(t)
        out = torch.empty(DIM * dist.get_world_size())
        dist.all_gather_into_tensor(out, t)
        return t


class Async(torch.nn.Module):
    """An async all_reduce, waited by hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.clone()
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        work.wait()
        return t


class Ring(torch.nn.Module):
    """Send to rank+1, receive from rank-1 (even ranks send first)."""

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


class Issue(torch.nn.Module):
    """A functional all_reduce returned unwaited."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", dist.group.WORLD)


class Timed(torch.nn.Module):
    """Every kind of completion: blocking, async, p2p, functional waited later."""

    def __init__(self) -> None:
        super().__init__()
        self.blocking = Blocking()
        self.async_ = Async()
        self.ring = Ring()
        self.issue = Issue()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ring(self.async_(self.blocking(x)))
        y = self.issue(x)
        return funcol.wait_tensor(y) * 2


# ---------------------------------------------------------------- straggler
class Slow(torch.nn.Module):
    """all_reduce; rank SLOW_RANK first sleeps SLOW_S."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == SLOW_RANK:
            time.sleep(SLOW_S)
        t = x.clone()
        dist.all_reduce(t)
        return t


class Fast(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.clone()
        dist.all_reduce(t)
        return t


class Straggler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fast = Fast()
        self.slow = Slow()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.slow(self.fast(x))


# ---------------------------------------------------------------- mesh straggler
class OnGroup(torch.nn.Module):
    """all_reduce on ``group``; rank ``slow`` (if any) first sleeps SLOW_S."""

    def __init__(self, group: object, slow: int | None = None) -> None:
        super().__init__()
        self.group, self.slow = group, slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.slow:
            time.sleep(SLOW_S)
        t = x.clone()
        dist.all_reduce(t, group=self.group)
        return t


class MeshStraggler(torch.nn.Module):
    """A 2 x 2 mesh of 4 ranks: tensor-parallel pairs (0, 1), (2, 3) and data-parallel
    pairs (0, 2), (1, 3). Rank SLOW_RANK sleeps SLOW_S in ``tp`` before its pair's
    all_reduce; then every rank all_reduces with its ``dp`` pair. SLOW_RANK's tp peer
    arrives at ``dp`` late only for having waited for SLOW_RANK."""

    def __init__(self) -> None:
        super().__init__()
        rank = dist.get_rank()
        tp_pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.tp = OnGroup(tp_pairs[rank // 2], slow=SLOW_RANK)
        self.dp = OnGroup(dp_pairs[rank % 2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dp(self.tp(x))


# ---------------------------------------------------------------- late wait
class LateWait(torch.nn.Module):
    """Every rank issues LateWait.issue's all_reduce on time; rank SLOW_RANK then works
    SLOW_S before using (waiting for) its output, so its duration holds that work.
    LateWait.sync's blocking all_reduce then waits for rank SLOW_RANK."""

    def __init__(self) -> None:
        super().__init__()
        self.issue = Issue()
        self.sync = Fast()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.issue(x)
        if dist.get_rank() == SLOW_RANK:
            time.sleep(SLOW_S)
        return self.sync(funcol.wait_tensor(y) + 1)


# ---------------------------------------------------------------- gc straggler
class Collect(torch.nn.Module):
    """all_reduce; rank GC_RANK first runs a full garbage collection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == GC_RANK:
            gc.collect()
        t = x.clone()
        dist.all_reduce(t)
        return t


class GcStraggler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fast = Fast()
        self.collect = Collect()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.collect(self.fast(x))


def _gc_straggler(out: Path) -> None:
    ballast = [[] for _ in range(BALLAST)] if dist.get_rank() == GC_RANK else []
    full: list[list[int]] = []
    started = [0]

    def reference(phase: str, info: dict[str, object]) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
        elif info["generation"] == 2:
            full.append([Step.index, time.perf_counter_ns() - started[0]])

    gc.callbacks.append(reference)
    try:
        _run(out, "gc_straggler", GcStraggler())
    finally:
        gc.callbacks.remove(reference)
    del ballast
    path = out / "gc_straggler" / f"reference-rank{dist.get_rank()}.json"
    path.write_text(json.dumps(full))


# ---------------------------------------------------------------- hang
class Step:
    index = 0
    crash = False


class Block(torch.nn.Module):
    """all_reduce; at step HANG_STEP the stalled rank then stalls in block 1."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.clone()
        if Step.crash and self.index == 2:  # (an async op: its Work's future fails)
            dist.all_reduce(t, async_op=True).wait()
        else:
            dist.all_reduce(t)
        if self.index == 1 and Step.index == HANG_STEP and dist.get_rank() == STALLED_RANK:
            if Step.crash:  # dies in compute, once the spans closed so far are written
                time.sleep(1.5)  # (the export queue writes every 0.5 s)
                os._exit(CRASH_EXIT)
            while True:  # stuck in compute: never reaches block 2's all_reduce
                time.sleep(0.05)
        return t


class Pipe(torch.nn.Module):
    """Rank 0 sends to rank 1 on the world group; the other ranks do no send/recv (so
    only ranks 0 and 1 have point-to-point ops on the group the all_reduces use)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0:
            dist.send(x, dst=1)
        elif dist.get_rank() == 1:
            dist.recv(x.clone(), src=0)
        return x


class Hang(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pipe = Pipe()
        self.blocks = torch.nn.ModuleList([Block(i) for i in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pipe(x)
        for block in self.blocks:
            x = block(x)
        return x


# ---------------------------------------------------------------- running
def _run(out: Path, name: str, model: torch.nn.Module, **mode_kwargs: object) -> CommSpanMode:
    exporter = JsonlSpanExporter(out / name / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter], aggregator=False, **mode_kwargs)  # type: ignore[arg-type]
    with mode:
        for step in range(STEPS):
            Step.index = step
            with mode.step(step):
                model(torch.ones(DIM))
    mode.shutdown()
    stats = mode.stats()
    assert stats["spans_dropped"] == stats["spans_failed"] == 0, stats
    return mode


def _crash(out: Path) -> None:
    Step.crash = True
    exporter = JsonlSpanExporter(out / "crash" / "trace-rank{rank}.jsonl")
    mode = CommSpanMode(exporters=[exporter], aggregator=False)
    try:
        with mode:
            for step in range(STEPS):
                Step.index = step
                with mode.step(step):
                    Hang()(torch.ones(DIM))
    except RuntimeError as e:  # the backend's error: a peer died
        print(f"raised: {e}", flush=True)
    mode.shutdown()
    stats = mode.stats()
    assert stats["spans_dropped"] == stats["spans_failed"] == 0, stats


def main(argv: list[str]) -> int:
    out, what = Path(argv[1]), argv[2]
    # a crashed peer makes gloo raise at once; the timeout is the backstop
    timeout = 30 if what == "crash" else 300
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    try:
        if dist.get_rank() == 0:
            (out / "groups.json").write_text(json.dumps({"world": dist.group.WORLD.group_name}))
        if what == "main":
            mode = _run(out, "timed", Timed())
            assert mode._dispatch is not None
            # the ops whose Work had no future (asked once each, then polled at once)
            (out / "timed" / f"no-future-rank{dist.get_rank()}.json").write_text(
                json.dumps(sorted([op, *key] for op, keys in
                                  mode._dispatch.completions.no_future.items() for key in keys)))
            dist.barrier()
            _run(out, "straggler", Straggler())
            dist.barrier()
            _run(out, "late_wait", LateWait())
            dist.barrier()
            _run(out, "mesh_straggler", MeshStraggler())
            dist.barrier()
            _gc_straggler(out)
            dist.barrier()
        elif what == "crash":
            _crash(out)
        else:
            _run(out, "hang", Hang(), hang_timeout_s=HANG_TIMEOUT_S, dump_signal=signal.SIGUSR1)
    finally:
        if what == "main":
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
