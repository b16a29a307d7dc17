"""Memory: RSS over many traced steps, one fresh process per variant.

Each variant runs in its own spawned process over torch's fake process group
(world 4, this process is rank 0): warm-up steps, RSS, then the measured
steps with RSS sampled as they go, each sample after ``gc.collect()`` (so it
shows what is retained, not garbage waiting for the collector). Variants:

* no tracing (the baseline: allocator and autograd noise);
* commspan with a JSONL exporter writing to a temporary file: one
  ``CommSpanMode`` context open over every step, ``mode.step(i)`` per step,
  as a training loop would run it;
* the same without exporter (aggregator only), to tell the exporter's
  memory from the core's;
* torch's CommDebugMode, a fresh context per step (it cannot span two steps
  in torch 2.13), stopped early if its RSS grows past a cap.

The variants run side by side (RSS is per process, so they do not disturb
each other's numbers, only each other's speed).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import quiet, rss_mb, run_in_subprocess
from benchmarks.workload import ModelConfig

__all__ = ["MEMORY_VARIANTS", "run_memory"]

MEMORY_VARIANTS: dict[str, str] = {
    "none": "no tracing",
    "commspan_jsonl": "commspan + JSONL, one context",
    "commspan_agg": "commspan, aggregator only, one context",
    "cdm": "torch CommDebugMode, fresh per step",
}


def _worker(
    key: str, cfg_dict: dict[str, Any], warmup: int, steps: int, samples: int, cap_mb: float,
    cap_s: float,
) -> dict[str, Any]:
    quiet()
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.workload import build_model, make_batch, train_step

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    cfg = ModelConfig(**cfg_dict)
    model = build_model(cfg, init_device_mesh("cpu", (4,)))
    batch = make_batch(cfg)
    tmp = tempfile.TemporaryDirectory(prefix="commspan-bench-mem-")
    stack = contextlib.ExitStack()
    note = ""

    if key == "none":

        def run(i: int) -> None:
            train_step(model, batch)

    elif key in ("commspan_jsonl", "commspan_agg"):
        from commspan import CommSpanMode
        from commspan.exporters import JsonlSpanExporter

        exporters = (
            [JsonlSpanExporter(f"{tmp.name}/mem-rank{{rank}}.jsonl")]
            if key == "commspan_jsonl" else []
        )
        mode = CommSpanMode(exporters=exporters)
        stack.enter_context(mode)

        def run(i: int) -> None:
            with mode.step(i):
                train_step(model, batch)

    elif key == "cdm":
        from torch.distributed.tensor.debug import CommDebugMode

        def run(i: int) -> None:
            with CommDebugMode():
                train_step(model, batch)

    else:
        raise ValueError(f"memory variant {key!r} is not one of {list(MEMORY_VARIANTS)}")

    with stack:
        for i in range(warmup):
            run(i)
        base = rss_mb()
        curve: list[tuple[int, float]] = [(0, base)]
        every = max(1, steps // max(1, samples))
        t0 = time.perf_counter()
        done = 0
        for i in range(steps):
            run(warmup + i)
            done = i + 1
            if done % every == 0 or done == steps:
                rss = rss_mb()
                curve.append((done, rss))
                if done == steps:
                    break
                if rss - base > cap_mb:
                    note = f"stopped: RSS grew past {cap_mb:.0f} MB"
                    break
                if time.perf_counter() - t0 > cap_s:
                    note = f"stopped: past {cap_s:.0f} s"
                    break
        elapsed = time.perf_counter() - t0
        extra: dict[str, Any] = {}
        if key.startswith("commspan"):
            stats = mode.stats()
            extra = {
                "spans": stats.get("spans"),
                "spans_dropped": stats.get("spans_dropped"),
                "steps_traced": stats.get("steps_traced"),
            }
    end = curve[-1][1]
    result = {
        "label": MEMORY_VARIANTS[key],
        "steps_done": done,
        "rss_after_warmup_mb": base,
        "rss_end_mb": end,
        "growth_mb": end - base,
        "peak_mb": max(r for _, r in curve),
        "curve": curve,
        "ms_per_step": elapsed / max(done, 1) * 1e3,
        "note": note,
        **extra,
    }
    tmp.cleanup()
    dist.destroy_process_group()
    return result


def run_memory(
    cfg: ModelConfig,
    *,
    steps: int = 1000,
    warmup: int = 20,
    samples: int = 10,
    keys: Sequence[str] = tuple(MEMORY_VARIANTS),
    cap_mb: float = 6000.0,
    cap_s: float = 300.0,
    comparison_cap_s: float = 180.0,
    parallel: int = 4,
) -> dict[str, Any]:
    """Run each memory variant in its own process (``parallel`` at a time).

    commspan runs until ``steps`` or ``cap_s``; the comparisons (no tracing,
    CommDebugMode) stop earlier, at ``comparison_cap_s``, leaving the cores to it.
    A variant stopped early reports its growth so far and a linear projection
    to ``steps``.
    """
    from benchmarks.variants import available

    missing: dict[str, str] = {}
    if "cdm" in keys:
        _, missing = available(["cdm"])

    def one(key: str) -> dict[str, Any]:
        if key in missing:
            return {"label": MEMORY_VARIANTS[key], "error": missing[key]}
        try:
            limit = cap_s if key.startswith("commspan") else min(cap_s, comparison_cap_s)
            out = run_in_subprocess(
                _worker, key, cfg.as_dict(), warmup, steps, samples, cap_mb, limit,
                timeout_s=limit + 300,
            )
            done = out["steps_done"]
            out["projected_growth_mb"] = (
                out["growth_mb"] if done >= steps else out["growth_mb"] / max(done, 1) * steps
            )
            return out
        except Exception as exc:
            return {"label": MEMORY_VARIANTS[key], "error": f"{type(exc).__name__}: {exc}"}

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        results = dict(zip(keys, pool.map(one, keys)))
    return {
        "config": cfg.as_dict(),
        "steps": steps,
        "warmup_steps": warmup,
        "variants": results,
        "elapsed_s": time.monotonic() - t0,
    }
