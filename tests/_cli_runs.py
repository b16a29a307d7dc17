"""JSONL runs for the command-line tests, written by traced models on the fake process group.

One process plays every rank: each rank's file is written by its own
``CommSpanMode`` whose resource says that rank (``commspan.rank``), which is
where a file's rank comes from. The collectives are the fake process group's
(rank 0 of a world of 4 in this process): their groups, sizes and placements
are what each rank would issue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from commspan import CommSpanMode
from commspan.cli import main
from commspan.exporters import JsonlSpanExporter
from commspan.testing import fake_mesh
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

RANKS = (0, 1, 2, 3)


def tp_transformer(mesh: DeviceMesh, *, sequence_parallel: bool = False) -> Transformer:
    """The toy Transformer, tensor parallel over ``mesh`` (with sequence parallelism)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    if sequence_parallel:
        return parallelize_sequence_parallel(model, mesh)
    return parallelize(model, mesh)


def parallelize_sequence_parallel(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """The toy Transformer's tensor-parallel plan with Megatron-style sequence parallelism:
    the activations between the matmuls are sharded along the sequence, so the
    embeddings, wo and w2 reduce-scatter their outputs instead of all-reducing them,
    the norms run on sequence shards and attention and feed-forward all-gather their
    input. The parameters are sharded as without it."""
    gather_input = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(**gather_input),  # type: ignore[arg-type]
            "attention.wq": ColwiseParallel(use_local_output=True),
            "attention.wk": ColwiseParallel(use_local_output=True),
            "attention.wv": ColwiseParallel(use_local_output=True),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(**gather_input),  # type: ignore[arg-type]
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        block.get_submodule("attention").n_heads //= mesh.size()
    return model


def write_run(
    out: Path,
    run_id: str,
    step_fn: Callable[[int, int], None],
    *,
    steps: Sequence[int] = (0, 1),
    ranks: Sequence[int] = RANKS,
    time_collectives: bool = False,
    resource: dict[str, Any] | None = None,
) -> Path:
    """Trace ``step_fn(rank, step)`` for each rank and step into ``out`` (one file per
    rank, appended to: a second call with another run id adds a second run).
    ``resource``: more resource attributes (``{"process.pid": 7}``: another process).

    The ranks are simulated one after the other in this process, so collective
    durations would mean nothing: they are not recorded unless ``time_collectives``.
    """
    out.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(out / f"commspan-rank{rank}.jsonl")],
            run_id=run_id,
            resource_attributes={"commspan.rank": rank, **(resource or {})},
            time_collectives=time_collectives,
        )
        with mode:
            for step in steps:
                with mode.step(step):
                    step_fn(rank, step)
        mode.shutdown()
    return out


def transformer_step(model: Transformer) -> Callable[[int, int], None]:
    """One training step of ``model`` on a fixed batch, whatever the rank and step."""
    tokens, targets = make_batch(model.model_args)

    def step(rank: int, index: int) -> None:
        train_step(model, tokens, targets)
        model.zero_grad(set_to_none=True)

    return step


class Net(torch.nn.Module):
    """Linear -> all_reduce over the world, in a block; ``extra`` more all_reduces."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Linear(4, 4)
        self.extra = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = funcol.wait_tensor(funcol.all_reduce(self.block(x), "sum", dist.group.WORLD))
        for _ in range(self.extra):
            y = funcol.wait_tensor(funcol.all_reduce(y, "sum", dist.group.WORLD))
        return y


def net_step(extra_on: tuple[int, int] | None = None) -> Callable[[int, int], None]:
    """A step of :class:`Net`; at ``extra_on = (rank, step)`` it issues one more all_reduce."""
    net = Net()

    def step(rank: int, index: int) -> None:
        net.extra = 1 if (rank, index) == extra_on else 0
        net(torch.ones(2, 4)).sum().backward()

    return step


def add_durations(run: Path, fqn: str, durations: dict[int, int], default_ns: int) -> None:
    """Give every collective event of module ``fqn`` a ``commspan.collective.duration_ns``:
    ``durations[rank]``, or ``default_ns`` for ranks not listed. (commspan on the fake
    process group records no durations; this writes what ranks that waited that long
    would record.)"""
    for path in run.glob("commspan-rank*.jsonl"):
        rank = int(path.stem.rsplit("rank", 1)[1])
        lines = []
        for raw in path.read_bytes().splitlines():
            doc = orjson.loads(raw)
            for rs in doc["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        owner = {a["key"]: a["value"] for a in span.get("attributes", ())}
                        for ev in span.get("events", ()):
                            attrs = {a["key"]: a["value"] for a in ev.get("attributes", ())}
                            if "commspan.collective.op" not in attrs:
                                continue
                            where = attrs.get("commspan.module.fqn",
                                              owner.get("commspan.module.fqn", {}))
                            if where.get("stringValue") != fqn:
                                continue
                            ns = durations.get(rank, default_ns)
                            ev["attributes"].append({
                                "key": "commspan.collective.duration_ns",
                                "value": {"intValue": str(ns)},
                            })
            lines.append(orjson.dumps(doc))
        path.write_bytes(b"\n".join(lines) + b"\n")


def write_foreign_spans(path: Path, n: int) -> Path:
    """``n`` valid OTLP/JSON lines of another instrumentation (a web server's ``request``
    spans, no commspan span) written by the JSONL exporter to ``path``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    for i in range(n):
        with provider.get_tracer("web").start_as_current_span("request", attributes={"i": i}):
            pass
    provider.shutdown()
    return path


def session_dir(tmp_path_factory: object, name: str, build: Callable[[Path], None]) -> Path:
    """``build(dir)`` once per test session; later calls return the same directory."""
    out = tmp_path_factory.getbasetemp() / f"cli-{name}"  # type: ignore[attr-defined]
    done = out / "DONE"
    if not done.exists():
        out.mkdir(parents=True, exist_ok=True)
        build(out)
        done.write_text("ok\n")
    return out


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``commspan ARGV`` in this process: exit status, stdout, stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def tp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks, steps 0-2 of the tensor-parallel toy Transformer (run "tp-run"), once per
    session; needs the fake process group (``fake_pg``)."""
    return session_dir(tmp_path_factory, "runs-tp", lambda out: write_run(
        out, "tp-run", transformer_step(tp_transformer(fake_mesh(4))), steps=(0, 1, 2)))


def without_step_ends(run: Path, out: Path, steps: Sequence[int],
                      names: Sequence[str] = ("commspan.rank", "commspan.step")) -> int:
    """Copies in ``out`` of ``run``'s files without the spans named ``names`` (the rank
    and step spans) of ``steps``, as a hang or a process stopped in those steps leaves
    them; returns the hand count of the collective events in the other steps' traces."""
    import json

    out.mkdir()
    kept = 0
    for path in sorted(run.glob("*.jsonl")):
        docs = [json.loads(line) for line in path.read_bytes().splitlines()]
        spans = [span for doc in docs for rs in doc["resourceSpans"]
                 for ss in rs["scopeSpans"] for span in ss["spans"]]
        cut = {span["traceId"] for span in spans for step in steps
               if {"key": "commspan.step", "value": {"intValue": str(step)}}
               in span.get("attributes", [])}
        assert len(cut) == len(steps)  # (one trace per step)
        for doc in docs:
            for rs in doc["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    ss["spans"] = [span for span in ss["spans"]
                                   if span["traceId"] not in cut or span["name"] not in names]
        for span in spans:
            if span["traceId"] not in cut:
                kept += sum(any(a["key"] == "commspan.collective.op" for a in e["attributes"])
                            for e in span.get("events", []))
        (out / path.name).write_bytes(b"".join(json.dumps(d).encode() + b"\n" for d in docs))
    return kept
