"""A deliberate straggler and a deliberate hang on 4 gloo ranks, and what commspan says.

    python examples/hang_and_straggler.py                  # all three, into ./commspan-debug
    python examples/hang_and_straggler.py --only hang --out /tmp/debug

**Straggler.** Every rank trains :class:`Net` (three blocks, each an
all_reduce) for 3 steps; rank 2 sleeps 0.1 s inside ``Net.blocks.1`` before
its all_reduce, so the other ranks wait for it there. commspan times every
collective; ``commspan stragglers DIR/straggler`` names rank 2 and
``Net.blocks.1``.

**Garbage collection.** The same program; rank 3 holds a few hundred thousand
extra Python objects and runs a full garbage collection inside
``Net.blocks.0`` before its all_reduce, as the collector does on its own when
a rank's heap grows. ``commspan stragglers DIR/gc`` names rank 3 and
``Net.blocks.0``, with the collection's time (``gc before``) beside the wait.

**Hang.** The same program, with ``CommSpanMode(hang_timeout_s=2,
dump_signal=signal.SIGUSR1)``. In step 2, rank 1 stalls in ``Net.blocks.1``
after its all_reduce (a rank stuck in compute) and never issues
``Net.blocks.2``'s; ranks 0, 2 and 3 block in it. After 2 s each of them
writes a ``commspan.hang`` record; this script then sends SIGUSR1 to rank 1,
which writes one too, and stops the job, as you would. ``commspan check
DIR/hang`` names the group, the sequence number, the rank that never issued
the all_reduce and where every rank was.

The ranks are started here (forked); each writes ``DIR/<scenario>/rank<r>.jsonl``.
This script prints what the two commands print, by calling the library
(:func:`commspan.analysis.stragglers`, :func:`commspan.analysis.check_run`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_transformer import free_port, make_out_dir  # noqa: E402 - the sibling example

from commspan import CommSpanMode  # noqa: E402
from commspan.analysis import check_run, stragglers  # noqa: E402
from commspan.exporters import JsonlSpanExporter, read_spans  # noqa: E402
from commspan.render.findings import format_check, format_stragglers  # noqa: E402

WORLD_SIZE = 4
STEPS = 3
SLOW_RANK, SLOW_S = 2, 0.1
GC_RANK, BALLAST = 3, 500_000
STALLED_RANK, HANG_STEP, HANG_TIMEOUT_S = 1, 2, 2.0


class Block(torch.nn.Module):
    """An all_reduce of its input; the deliberate slowness or stall lives here."""

    def __init__(self, index: int, scenario: str) -> None:
        super().__init__()
        self.index, self.scenario, self.step = index, scenario, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        if self.scenario == "straggler" and self.index == 1 and rank == SLOW_RANK:
            time.sleep(SLOW_S)  # rank 2 arrives late at this all_reduce
        if self.scenario == "gc" and self.index == 0 and rank == GC_RANK:
            gc.collect()  # rank 3 walks its whole heap before this all_reduce
        y = x.clone()
        dist.all_reduce(y)
        if (self.scenario == "hang" and self.index == 1 and rank == STALLED_RANK
                and self.step == HANG_STEP):
            while True:  # stuck in compute: never issues blocks.2's all_reduce
                time.sleep(0.1)
        return y / WORLD_SIZE


class Net(torch.nn.Module):
    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(i, scenario) for i in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def rank_main(rank: int, port: int, out: Path, scenario: str) -> None:
    """One rank: train ``Net`` for STEPS steps under commspan, writing JSONL."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=300),  # longer than hang_timeout_s
    )
    model = Net(scenario)
    ballast = [[] for _ in range(BALLAST)] if scenario == "gc" and rank == GC_RANK else []
    options = {}
    if scenario == "hang":
        options = {"hang_timeout_s": HANG_TIMEOUT_S, "dump_signal": signal.SIGUSR1}
    mode = CommSpanMode(exporters=[JsonlSpanExporter(out / f"rank{rank}.jsonl")], **options)
    dist.barrier()  # start together: rank 3 built its ballast (seconds) before the loop
    with mode:
        for step in range(STEPS):
            for block in model.blocks:
                block.step = step
            with mode.step(step):
                model(torch.ones(1024))
    mode.shutdown()
    del ballast
    dist.barrier()
    dist.destroy_process_group()


def _start(out: Path, scenario: str) -> list[multiprocessing.Process]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.jsonl"):
        old.unlink()  # JsonlSpanExporter appends; start afresh
    ctx = multiprocessing.get_context("fork")  # CPU only: forked ranks reuse imported torch
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, out, scenario), daemon=True)
             for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    return procs


def _hang_records(path: Path) -> int:
    try:
        return sum(1 for s in read_spans(path) if s.name == "commspan.hang")
    except (OSError, ValueError):  # not there yet, or a line being written
        return 0


def _wait_for(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def straggler(out: Path, scenario: str = "straggler") -> str:
    """Run the straggler (or ``gc``) scenario; return what ``commspan stragglers`` says."""
    procs = _start(out, scenario)
    for p in procs:
        p.join(120)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return format_stragglers(stragglers(out), top=5)


def hang(out: Path) -> str:
    """Run the hang scenario, stop it once every rank wrote a record; return what
    ``commspan check`` says."""
    procs = _start(out, "hang")
    files = [out / f"rank{r}.jsonl" for r in range(WORLD_SIZE)]
    try:
        blocked = [r for r in range(WORLD_SIZE) if r != STALLED_RANK]
        if not _wait_for(lambda: all(_hang_records(files[r]) for r in blocked), 120):
            raise SystemExit("the blocked ranks wrote no hang record in 120 s")
        print(f"ranks {blocked} wrote hang records (a collective stuck for "
              f"{HANG_TIMEOUT_S:g} s); sending SIGUSR1 to rank {STALLED_RANK}")
        pid = procs[STALLED_RANK].pid
        assert pid is not None
        os.kill(pid, signal.SIGUSR1)
        if not _wait_for(lambda: _hang_records(files[STALLED_RANK]) > 0, 60):
            raise SystemExit(f"rank {STALLED_RANK} wrote no hang record on SIGUSR1")
    finally:  # stop the job, as a user would: freeze every rank first, so that none
        for p in procs:  # sees its peers die and prints a traceback of its own
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGSTOP)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return format_check(check_run(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("commspan-debug"),
                        help="directory for the JSONL files (one folder per scenario); a "
                             "scenario's files of an earlier run are replaced (the exporter "
                             "itself appends)")
    parser.add_argument("--only", choices=["straggler", "gc", "hang"], default=None,
                        help="run one scenario only")
    args = parser.parse_args(argv)
    make_out_dir(parser, args.out)
    if args.only in (None, "straggler"):
        print(f"$ commspan stragglers {args.out / 'straggler'}")
        print(straggler(args.out / "straggler"))
    if args.only in (None, "gc"):
        print(f"$ commspan stragglers {args.out / 'gc'}")
        print(straggler(args.out / "gc", "gc"))
    if args.only in (None, "hang"):
        text = hang(args.out / "hang")
        print(f"$ commspan check {args.out / 'hang'}")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
