"""End to end: 4 real gloo ranks export over OTLP to Arize Phoenix; read back and compare.

The ranks run a tensor-parallel MLP stack (its second block under activation
checkpointing, so forward, backward and recompute all issue collectives) for
two steps, twice: once exporting over OTLP/gRPC and once over OTLP/HTTP, each
run into its own Phoenix project, and always also to a JSONL file. Every rank
writes its in-process aggregator's counts to a JSON file. The test then reads
the spans back from Phoenix's REST API and checks that

* Phoenix holds exactly the spans of the JSONL files (ids, names, parents);
* each step is one trace shared by the four ranks, rooted at one
  ``commspan.step`` span, with no dangling parent;
* the per-module, per-phase collective counts summed from the span attributes
  Phoenix returned equal each rank's in-process aggregator (and the JSONL's);
* each span's events are its collectives.

This file is also the rank program: the test runs it as a script, once per rank.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # a rank's start, to report how long its imports took

import contextlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from _phoenix import PROJECT_ATTRIBUTE, Phoenix, free_port, phoenix  # noqa: F401 (fixture)

pytestmark = pytest.mark.backend

WORLD_SIZE = 4
STEPS = 2
PROTOCOLS = ("grpc", "http/protobuf")
RANK_TIMEOUT_S = 180.0

Counts = dict[str, dict[str, dict[str, int]]]


# ====================================================================== rank program
def _rank_main(config_path: str) -> None:
    """One rank: train the TP MLP stack for STEPS steps once per protocol, write results."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.utils.checkpoint import checkpoint

    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter, otlp_exporter

    t_imported = time.perf_counter()
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
    t_pg = time.perf_counter()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1 = nn.Linear(16, 32)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # tanh keeps its output for backward, so a recompute must redo net2's all_reduce
            return torch.tanh(x + self.net2(self.relu(self.net1(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)
            return checkpoint(self.blocks[1], x, use_reentrant=False)

    torch.manual_seed(0)
    model = Stack()
    for block in model.blocks:
        parallelize_module(block, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)

    out = Path(cfg["out"])
    for proto in cfg["protocols"]:
        tag = proto.split("/")[0]
        if proto == "grpc":
            otlp = otlp_exporter(protocol="grpc", endpoint=cfg["grpc_endpoint"],
                                 insecure=True, timeout_s=10)
        else:
            otlp = otlp_exporter(protocol=proto, endpoint=cfg["http_endpoint"], timeout_s=10)
        jsonl = JsonlSpanExporter(out / f"{tag}-rank{rank}.jsonl")
        mode = CommSpanMode(
            exporters=[otlp, jsonl],
            resource_attributes={PROJECT_ATTRIBUTE: cfg["projects"][proto]},
            flush_timeout_s=30.0,
        )
        t0 = time.perf_counter()
        with mode:
            t_enter = time.perf_counter()
            for i in range(cfg["steps"]):
                with mode.step(i):
                    model(x).pow(2).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            t_steps = time.perf_counter()
        t_flushed = time.perf_counter()  # leaving the mode flushed both exporters
        mode.shutdown(timeout_s=30.0)
        t_shutdown = time.perf_counter()
        assert mode.aggregator is not None
        result = {
            "rank": rank,
            "run_id": mode.run_id,
            "counts": mode.aggregator.module_counts(),
            "stats": mode.stats(),
            "enter_s": t_enter - t0,
            "steps_s": t_steps - t_enter,
            "flush_s": t_flushed - t_steps,
            "shutdown_s": t_shutdown - t_flushed,
            "import_s": t_imported - _T0,
            "init_pg_s": t_pg - t_imported,
        }
        (out / f"{tag}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ====================================================================== helpers
def _run_ranks(config: dict[str, Any], tmp: Path) -> float:
    """Run WORLD_SIZE rank processes of this file; return their wall time."""
    config_path = tmp / "config.json"
    config_path.write_text(json.dumps(config))
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("OTEL_") and k not in ("COMMSPAN_RUN_ID", "TORCHELASTIC_RUN_ID")
    }
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(WORLD_SIZE), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as logs:
        try:
            for rank in range(WORLD_SIZE):
                log = logs.enter_context(open(tmp / f"rank{rank}.log", "wb"))
                procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), str(config_path)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                ))
            deadline = t0 + RANK_TIMEOUT_S
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc in procs:  # only our own rank processes, by handle
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        r = failed[0]
        text = (tmp / f"rank{r}.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"ranks {failed} failed (status {procs[r].returncode}); rank {r} log:\n{text}")
    return time.monotonic() - t0


def _backend_counts(spans: list[dict[str, Any]]) -> dict[int, Counts]:
    """Per rank, ``{fqn: {phase: {op: n}}}`` summed from the count attributes Phoenix returned.

    Phoenix keeps no resource attributes, so a span's rank is that of the
    ``commspan.rank`` span above it.
    """
    from commspan import semconv

    by_id = {s["context"]["span_id"]: s for s in spans}

    def rank_of(span: dict[str, Any]) -> int:
        node: dict[str, Any] | None = span
        while node is not None:
            if node["name"] == semconv.SPAN_RANK:
                return int(node["attributes"][semconv.RANK])
            node = by_id.get(node["parent_id"] or "")
        raise AssertionError(f"span {span['name']!r} has no commspan.rank ancestor")

    counts: dict[int, Counts] = defaultdict(dict)
    for span in spans:
        attrs = span["attributes"]
        fqn = attrs.get(semconv.MODULE_FQN)
        if fqn is None:
            continue
        rank = rank_of(span)
        for key, value in attrs.items():
            parsed = semconv.parse_count_key(key)
            if parsed is None:
                continue
            assert type(value) is int, f"{key}={value!r} came back as {type(value).__name__}"
            phase, op = parsed
            slot = counts[rank].setdefault(fqn, {}).setdefault(phase, {})
            slot[op] = slot.get(op, 0) + value
    return dict(counts)


def _check_tree(spans: list[dict[str, Any]], run_id: str) -> None:
    """One trace per step, rooted at the step span, every rank under it, no dangling parent."""
    from commspan import semconv
    from commspan.spans.traces import derive_ids

    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        traces[span["context"]["trace_id"]].append(span)
    expected = {f"{derive_ids(run_id, f'step/{i}')[0]:032x}": i for i in range(STEPS)}
    assert set(traces) == set(expected), "one trace per step, ids derived from run id and step"
    for trace_id, members in traces.items():
        step = expected[trace_id]
        ids = {s["context"]["span_id"] for s in members}
        assert len(ids) == len(members), f"step {step}: duplicate span ids"
        roots = [s for s in members if s["parent_id"] is None]
        assert [r["name"] for r in roots] == [semconv.SPAN_STEP], f"step {step}: roots {roots}"
        root = roots[0]
        assert root["attributes"][semconv.STEP] == step
        assert root["context"]["span_id"] == f"{derive_ids(run_id, f'step/{step}')[1]:016x}"
        dangling = [s["name"] for s in members if s["parent_id"] and s["parent_id"] not in ids]
        assert not dangling, f"step {step}: spans whose parent is missing: {dangling}"
        rank_spans = [s for s in members if s["name"] == semconv.SPAN_RANK]
        assert sorted(s["attributes"][semconv.RANK] for s in rank_spans) == list(range(WORLD_SIZE))
        for s in rank_spans:
            assert s["parent_id"] == root["context"]["span_id"]
            assert s["attributes"][semconv.STEP] == step
            assert s["attributes"][semconv.RUN_ID] == run_id
            assert s["attributes"][semconv.WORLD_SIZE] == WORLD_SIZE


def _check_events(spans: list[dict[str, Any]]) -> int:
    """A span's events are its own collectives, tagged with its module and phase; none is an
    error. A rank span may also hold garbage-collector pauses (``commspan.gc``), whenever
    the collector ran long during the step: they keep their attributes.

    Returns how many collective events there are.
    """
    from commspan import semconv

    total = 0
    for span in spans:
        attrs, events = span["attributes"], span["events"] or []
        assert span["status_code"] != "ERROR", (span["name"], span["status_message"])
        pauses = [ev for ev in events if ev["name"] == semconv.EVENT_GC]
        for ev in pauses:
            assert span["name"] == semconv.SPAN_RANK, span["name"]
            assert ev["attributes"][semconv.GC_DURATION_NS] > 0
            assert ev["attributes"][semconv.GC_GENERATION] in (0, 1, 2)
        events = [ev for ev in events if ev["name"] != semconv.EVENT_GC]
        assert len(events) == attrs.get(semconv.SELF_COUNT, 0), span["name"]
        for ev in events:
            assert ev["name"] == ev["attributes"][semconv.COLL_OP]
            assert ev["attributes"][semconv.MODULE_FQN] == attrs[semconv.MODULE_FQN]
            assert ev["attributes"][semconv.PHASE] in ("forward", "backward", "recompute")
            assert ev["attributes"][semconv.PG_SIZE] == WORLD_SIZE
        total += len(events)
    return total


# ====================================================================== the test
def test_four_gloo_ranks_round_trip_through_phoenix(
    phoenix: Phoenix, tmp_path: Path  # noqa: F811 (the fixture)
) -> None:
    """Spans exported by 4 gloo TP ranks over gRPC and HTTP come back from Phoenix intact."""
    from commspan import Aggregator
    from commspan.exporters import read_spans

    projects = {proto: f"commspan-e2e-{proto.split('/')[0]}-{os.getpid()}" for proto in PROTOCOLS}
    config = {
        "out": str(tmp_path),
        "steps": STEPS,
        "protocols": list(PROTOCOLS),
        "projects": projects,
        "grpc_endpoint": phoenix.grpc_endpoint,
        "http_endpoint": phoenix.http_endpoint,
    }
    ranks_s = _run_ranks(config, tmp_path)
    figures: dict[str, Any] = {"phoenix_startup_s": round(phoenix.startup_s, 1),
                               "phoenix_version": phoenix.version,
                               "ranks_wall_s": round(ranks_s, 1)}

    run_ids = set()
    for proto in PROTOCOLS:
        tag = proto.split("/")[0]
        results = [json.loads((tmp_path / f"{tag}-rank{r}.json").read_text())
                   for r in range(WORLD_SIZE)]
        (run_id,) = {res["run_id"] for res in results}  # agreed by broadcast
        run_ids.add(run_id)
        for res in results:
            stats = res["stats"]
            assert stats["spans_dropped"] == 0 and stats["spans_failed"] == 0, stats
            assert all(e["exported"] == e["queued"] == stats["spans"]
                       for e in stats["exporters"]), stats

        files = [tmp_path / f"{tag}-rank{r}.jsonl" for r in range(WORLD_SIZE)]
        local = {(s.trace_id, s.span_id): s for s in read_spans(*files)}
        t0 = time.monotonic()
        spans = phoenix.wait_for_spans(projects[proto], len(local))
        visible_s = time.monotonic() - t0

        # Phoenix holds exactly the spans of the JSONL files
        remote = {(s["context"]["trace_id"], s["context"]["span_id"]): s for s in spans}
        assert set(remote) == set(local), f"{proto}: span ids differ between Phoenix and JSONL"
        for key, rec in local.items():
            assert remote[key]["name"] == rec.name
            assert (remote[key]["parent_id"] or "") == rec.parent_span_id

        _check_tree(spans, run_id)
        n_events = _check_events(spans)

        backend = _backend_counts(spans)
        for res in results:
            r = res["rank"]
            assert backend[r] == res["counts"], f"{proto}: rank {r} counts differ"
            assert Aggregator.from_jsonl(files[r], rank=r).module_counts() == res["counts"]
        assert set(results[0]["counts"]["Global"]) == {"forward", "backward", "recompute"}
        issued = sum(n for res in results for ops in res["counts"]["Global"].values()
                     for n in ops.values())
        assert n_events == issued, "one event per collective, over all ranks and steps"

        export_s = max(res["flush_s"] for res in results)
        figures[tag] = {
            "spans": len(local),
            "events": n_events,
            "slowest_rank_flush_s": round(export_s, 3),
            "slowest_rank_shutdown_s": round(max(res["shutdown_s"] for res in results), 3),
            "rank_import_s_max": round(max(res["import_s"] for res in results), 1),
            "visible_after_s": round(visible_s, 1),
            "steps_s_max": round(max(res["steps_s"] for res in results), 3),
        }
    assert len(run_ids) == len(PROTOCOLS), "each run got its own run id"
    print(f"\ncommspan e2e figures: {json.dumps(figures)}")


if __name__ == "__main__":  # a rank of the test above
    _rank_main(sys.argv[1])
