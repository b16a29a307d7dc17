"""Where commspan's time goes: one rank's step split, then cProfile around traced steps.

First, in one process without the noise of 4 ranks on 2 cores, CPU per step
of no mode, the pass-through floor (bare, with do-nothing hooks, as a
DebugMode, with ModTracker), collectives seen through kernels on their ops
with no dispatch mode (``CollectiveKernels``, an experiment), commspan
(aggregator only), commspan + JSONL and commspan on sampled-out steps,
interleaved round by round: how much of commspan's cost is the floor any
dispatch mode pays, and how much is commspan's own.

One spawned process over torch's fake process group (world 4, rank 0; the
per-rank Python work is the same as over gloo, without the waiting), the
benchmark model, ``CommSpanMode`` with a JSONL exporter open over the steps.
It reports the commspan functions with the largest cumulative time per step
(cumulative includes what they call: for the dispatch mode's
``__torch_dispatch__`` that is the op itself), and own time per step grouped
by package (which part of the step is commspan's code, the OpenTelemetry SDK,
torch's Python code, ...).
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import tempfile
import time
from typing import Any

from benchmarks.common import median, quiet, run_in_subprocess
from benchmarks.workload import ModelConfig

__all__ = ["run_profile"]


def _package(filename: str) -> str:
    # the model the benchmark trains lives in commspan.testing but is not commspan's cost
    if "/benchmarks/" in filename or filename.endswith("/commspan/testing/models.py"):
        return "benchmark model code"
    if "/commspan/" in filename:
        return "commspan"
    if "/opentelemetry/" in filename:
        return "opentelemetry"
    if "/torch/" in filename:
        return "torch (Python)"
    if filename.startswith("~") or filename == "<built-in>":
        return "built-ins / C (torch ops, orjson, ...)"
    return "other Python (stdlib, ...)"


DECOMPOSE = ("none", "none_aa", "floor", "floor_hooks", "floor_dm_hooks", "floor_modtracker",
             "kernels_hooks", "cs_agg", "cs_jsonl", "cs_sampled_out")


def _decompose(model: Any, batch: Any, tmp: str, rounds: int, make_variant: Any,
               train_step: Any) -> dict[str, dict[str, Any]]:
    """CPU ms per step of each variant, interleaved one step at a time, one process.

    Returns, per variant, the median over rounds, and the median over rounds of
    its difference and ratio to "no mode" in the same round (paired, so slow
    drift of the machine cancels).
    """
    variants = {k: make_variant(k, tmpdir=tmp) for k in DECOMPOSE}
    samples: dict[str, list[float]] = {k: [] for k in DECOMPOSE}
    index = 1
    for r in range(rounds + 1):
        order = DECOMPOSE[r % len(DECOMPOSE):] + DECOMPOSE[: r % len(DECOMPOSE)]
        for k in order:
            gc.collect()
            c0 = time.process_time()
            variants[k].run_block(lambda: train_step(model, batch), range(index, index + 1))
            index += 1
            if r:  # round 0 warms up
                samples[k].append((time.process_time() - c0) * 1e3)
    for v in variants.values():
        v.close()
    base = samples["none"]
    return {
        k: {
            "ms": median(v),
            "delta_ms": median([a - b for a, b in zip(v, base)]),
            "ratio": median([a / b for a, b in zip(v, base)]),
            "samples": v,
        }
        for k, v in samples.items()
    }


def _worker(cfg_dict: dict[str, Any], steps: int, top: int, rounds: int) -> dict[str, Any]:
    quiet()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.variants import make_variant
    from benchmarks.workload import build_model, make_batch, train_step
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    cfg = ModelConfig(**cfg_dict)
    model = build_model(cfg, init_device_mesh("cpu", (4,)))
    batch = make_batch(cfg)
    with tempfile.TemporaryDirectory(prefix="commspan-bench-prof-") as tmp:
        decomposition = _decompose(model, batch, tmp, rounds, make_variant, train_step)
        mode = CommSpanMode(exporters=[JsonlSpanExporter(f"{tmp}/prof-rank{{rank}}.jsonl")])
        with mode:
            for i in range(3):  # warm-up
                with mode.step(i):
                    train_step(model, batch)
            c0 = time.process_time()
            for i in range(steps):
                with mode.step(100 + i):
                    train_step(model, batch)
            unprofiled = (time.process_time() - c0) / steps * 1e3
            prof = cProfile.Profile()
            c0 = time.process_time()
            prof.enable()
            for i in range(steps):
                with mode.step(200 + i):
                    train_step(model, batch)
            mode.flush()
            prof.disable()
            profiled = (time.process_time() - c0) / steps * 1e3
        c0 = time.process_time()
        for _ in range(steps):
            train_step(model, batch)
        untraced = (time.process_time() - c0) / steps * 1e3
        mode.shutdown()
    stats = pstats.Stats(prof)
    rows = []
    own_by_package: dict[str, float] = {}
    raw = stats.stats  # type: ignore[attr-defined]
    for (filename, line, name), (_cc, nc, tt, ct, _callers) in raw.items():
        pkg = _package(filename)
        own_by_package[pkg] = own_by_package.get(pkg, 0.0) + tt
        if pkg != "commspan":
            continue
        short = filename.split("/commspan/", 1)[1]
        rows.append({
            "function": f"{short}:{line}({name})",
            "cumtime_ms_per_step": ct / steps * 1e3,
            "tottime_ms_per_step": tt / steps * 1e3,
            "calls_per_step": nc / steps,
        })
    rows.sort(key=lambda r: r["cumtime_ms_per_step"], reverse=True)
    total = sum(own_by_package.values())
    return {
        "config": cfg_dict,
        "steps": steps,
        "decomposition_rounds": rounds,
        "decomposition_cpu_ms_per_step": decomposition,
        "unprofiled_ms_per_step": unprofiled,
        "untraced_ms_per_step": untraced,
        "profiled_ms_per_step": profiled,
        "top": rows[:top],
        "own_ms_per_step_by_package": {
            k: v / steps * 1e3 for k, v in sorted(own_by_package.items(), key=lambda kv: -kv[1])
        },
        "profiled_total_ms_per_step": total / steps * 1e3,
    }


def run_profile(cfg: ModelConfig, *, steps: int = 10, top: int = 15, rounds: int = 30,
                timeout_s: float = 300.0) -> dict[str, Any]:
    """Split one rank's step cost (no mode / floor / commspan, ``rounds`` interleaved
    rounds of one step each), then profile ``steps`` traced steps, in a fresh process."""
    return run_in_subprocess(_worker, cfg.as_dict(), steps, top, rounds, timeout_s=timeout_s)
