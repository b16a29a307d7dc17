"""What collective timing costs the training thread, per collective.

One spawned process over torch's fake process group (world 4, rank 0: the
Python work per collective is the one a gloo or NCCL rank does, without the
waiting). A module issues one collective per call, a step every 50 calls,
``CommSpanMode`` with its aggregator; three kinds of collective:

- ``functional``: ``funcol.all_reduce`` + ``wait_tensor`` (DTensor, TP, FSDP2);
- ``c10d_blocking``: ``dist.all_reduce(t)``;
- ``c10d_async``: ``dist.all_reduce(t, async_op=True).wait()``.

For each, the training thread's CPU time (``time.thread_time_ns``) per
collective with ``time_collectives=False`` and ``True``, inside the entered
mode (entering and leaving are not per collective), interleaved round by
round (order alternating), median over rounds; the difference is what timing
adds on the training thread: the issue time, learning of the completion, the
recent-collectives log, the readiness check and the time roll-ups (durations
and bandwidths are written by the export thread). The no-mode time of the
same loop is the reference. Since the clock of a shared VM moves by several
µs between rounds, the Python bytecodes run per collective are counted too
(``sys.settrace``, one loop each): a deterministic measure of the same work.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from benchmarks.common import median, run_in_subprocess

__all__ = ["run_timing"]

KINDS = ("functional", "c10d_blocking", "c10d_async")


def _measure(rounds: int, calls: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from benchmarks.common import quiet
    from commspan import CommSpanMode
    from commspan.testing import fake_process_group

    quiet()
    torch.set_num_threads(1)

    class Functional(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))

    class Blocking(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

    class Async(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            work = dist.all_reduce(x, async_op=True)
            assert work is not None
            work.wait()
            return x

    models = {"functional": Functional(), "c10d_blocking": Blocking(), "c10d_async": Async()}
    x = torch.ones(256)

    next_step: dict[int, int] = {}  # per mode: step numbers grow over the whole run

    def loop(model: torch.nn.Module, mode: CommSpanMode | None, trace: Any = None) -> float:
        if mode is None:
            t0 = time.thread_time_ns()
            for _ in range(calls):
                model(x)
            return (time.thread_time_ns() - t0) / calls / 1000
        first = next_step.get(id(mode), 0)
        next_step[id(mode)] = first + (calls + 49) // 50
        with mode:  # entering and leaving are not per collective: outside the clock
            t0 = time.thread_time_ns()
            if trace is not None:
                sys.settrace(trace)
            try:
                for start in range(0, calls, 50):
                    with mode.step(first + start // 50):
                        for _ in range(min(50, calls - start)):
                            model(x)
            finally:
                sys.settrace(None)
            t1 = time.thread_time_ns()
        return (t1 - t0) / calls / 1000

    def opcodes(model: torch.nn.Module, mode: CommSpanMode) -> float:
        """Python bytecodes run per collective: deterministic, unlike the clock."""
        count = [0]

        def trace(frame: Any, event: str, _arg: Any) -> Any:
            frame.f_trace_opcodes = True
            if event == "opcode":
                count[0] += 1
            return trace

        loop(model, mode, trace)
        return count[0] / calls

    out: dict[str, Any] = {}
    with fake_process_group(world_size=4, rank=0):
        for kind, model in models.items():
            samples: dict[str, list[float]] = {"none": [], "untimed": [], "timed": []}
            untimed = CommSpanMode(time_collectives=False)
            timed = CommSpanMode(time_collectives=True)
            loop(model, untimed)
            loop(model, timed)  # warm-up
            for r in range(rounds):
                order = [("untimed", untimed), ("timed", timed), ("none", None)]
                for name, mode in order if r % 2 == 0 else order[::-1]:
                    samples[name].append(loop(model, mode))
            stats = timed.stats()
            ops_untimed, ops_timed = opcodes(model, untimed), opcodes(model, timed)
            out[kind] = {
                "opcodes_untimed": ops_untimed,
                "opcodes_timed": ops_timed,
                "opcodes_added": ops_timed - ops_untimed,
                "us_per_collective_no_mode": median(samples["none"]),
                "us_per_collective_untimed": median(samples["untimed"]),
                "us_per_collective_timed": median(samples["timed"]),
                "added_us": median([t - u for t, u in zip(samples["timed"], samples["untimed"])]),
                "samples": samples,
                "collectives_untimed": stats["collectives_untimed"],
            }
    return out


def run_timing(rounds: int = 15, calls: int = 2000) -> dict[str, Any]:
    """Per-collective CPU cost of timing on the training thread (see the module docstring)."""
    result = run_in_subprocess(_measure, rounds, calls, timeout_s=900)
    return {"rounds": rounds, "calls": calls, "kinds": result}
