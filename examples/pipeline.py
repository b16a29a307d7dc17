"""A two-stage pipeline (torch.distributed.pipelining) on 2 CPU ranks, traced by commspan.

A small MLP is cut in two stages, one per rank, and trained with a GPipe or a
1F1B schedule over 4 microbatches. ``mode.watch_pipeline(schedule)`` makes each
send and receive the stage module's, with its microbatch, direction and peer
stage, and puts the microbatch on the stage's module spans. Run it with one
command (it spawns its own gloo ranks), or under torchrun::

    python examples/pipeline.py [--schedule gpipe|1f1b] [--out DIR] [--steps N]
    torchrun --nproc-per-node 2 examples/pipeline.py

Every rank writes its spans to ``DIR/commspan-rank<r>.jsonl`` (default
``./commspan-out-pipeline``); rank 0 prints its table, then each rank's
point-to-point ops of the last step, per microbatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_transformer import add_out_and_steps, launch, parse_training_args  # noqa: E402 - sibling

from commspan import CommSpanMode, semconv  # noqa: E402
from commspan.exporters import JsonlSpanExporter, read_spans  # noqa: E402

WORLD_SIZE = 2
MICROBATCHES = 4
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def train(out: Path, steps: int, schedule_name: str) -> None:
    """One rank: its stage of the MLP, ``steps`` pipelined steps under commspan."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)  # same weights and data on every rank
    mlp = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )
    stage = PipelineStage(mlp[:3] if rank == 0 else mlp[3:], rank, WORLD_SIZE, torch.device("cpu"))
    schedule = SCHEDULES[schedule_name](
        stage, n_microbatches=MICROBATCHES,
        loss_fn=lambda output, target: torch.nn.functional.mse_loss(output, target),
    )
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    path = out / f"commspan-rank{rank}.jsonl"
    path.unlink(missing_ok=True)  # JsonlSpanExporter appends; start afresh
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)])
    mode.watch_pipeline(schedule)  # before or inside `with mode:`
    with mode:
        for i in range(steps):
            with mode.step(i):  # one trace per step: both stages' spans
                losses: list[torch.Tensor] = []
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=losses)
                optimizer.step()
                optimizer.zero_grad()
            if rank == WORLD_SIZE - 1:
                print(f"step {i}: loss {torch.stack(losses).mean().item():.4f}")
    mode.shutdown()
    dist.barrier()  # every rank's file is complete
    if rank == 0:
        assert mode.aggregator is not None
        print(f"\nCollectives per module on rank 0 ({schedule_name}), summed over {steps} steps:")
        print(mode.aggregator.table())
        print(f"Point-to-point ops of step {steps - 1}, per rank, in the order issued:")
        for r in range(WORLD_SIZE):
            for line in p2p_lines(out / f"commspan-rank{r}.jsonl", steps - 1):
                print(f"  rank {r}: {line}")
        print("Spans written to:")
        for file in sorted(out.glob("commspan-rank*.jsonl")):
            print(f"  {file}")


def p2p_lines(path: Path, step: int) -> list[str]:
    """``op kind microbatch peer`` of one step's point-to-point events in one file."""
    trace = None
    for span in read_spans(path):
        if span.name == semconv.SPAN_RANK and span.attributes.get(semconv.STEP) == step:
            trace = span.trace_id
    rows = []
    for span in read_spans(path):
        if span.trace_id != trace:
            continue
        for (_, attrs), when in zip(span.events, span.event_times):
            if attrs.get(semconv.OWNER_SOURCE) == semconv.SOURCE_PIPELINE:
                rows.append((when, (
                    f"{attrs[semconv.COLL_OP]:<5} {attrs[semconv.OWNER_KIND]:<16} "
                    f"microbatch {attrs.get(semconv.PP_MICROBATCH, '-')}  "
                    f"stage {attrs.get(semconv.PP_STAGE, '-')} <-> "
                    f"stage {attrs.get(semconv.PP_PEER_STAGE, '-')} "
                    f"(rank {attrs.get(semconv.COLL_PEER)})  {attrs[semconv.PHASE]}"
                )))
    return [text for _, text in sorted(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    add_out_and_steps(parser, "commspan-out-pipeline", 2)
    args = parse_training_args(parser)
    launch(train, WORLD_SIZE, args.out, args.steps, args.schedule)


if __name__ == "__main__":
    main()
