"""Stalls: how far the slowest steps are from the median step, with export running.

One spawned process over torch's fake process group (world 4, rank 0: the
Python work of a rank, without the waiting), the step section's model at the
given size. Like a training loop, each variant enters one ``CommSpanMode`` for
all its steps (``with mode.step(i):`` each) and never flushes in between, so
the export thread encodes and writes while the next steps run: a step during
which it holds the interpreter for long is a stall. Variants, one after the
other: no mode (the noise of the measurement itself), commspan + JSONL,
commspan + JSONL compressed, commspan + OTLP/HTTP to a local receiver. For
each, the wall time of every step; the median, the 99th percentile and the
worst, and p99 / median (issue 13's target: at most 1.3).

Garbage collection is recorded beside the steps (``gc.callbacks``): how many
full (oldest-generation) collections each variant ran, the longest, and how
much of the worst step was one. A full collection walks every object of the
process (torch's and the model's: about 290k for the medium model, 120-140 ms
here), and a tracer's allocations make it come sooner: that, not the export
thread, is the worst step of a traced run. The last two variants ("heap
frozen first") show the usual remedy, the training loop's own: ``gc.freeze()``
once the model is built, so a full collection walks only what was allocated
since. (Variant names hold no ".": the report looks results up by dotted path.)
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from benchmarks.common import median, run_in_subprocess

__all__ = ["run_stalls"]

OTLP = "commspan + OTLP/HTTP (local receiver)"
FROZEN = "commspan + JSONL, heap frozen first"
FROZEN_OTLP = "commspan + OTLP/HTTP, heap frozen first"
VARIANTS = ("no mode", "commspan + JSONL", "commspan + JSONL, compressed", OTLP, FROZEN,
            FROZEN_OTLP)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _measure(cfg_dict: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    import gc

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.common import quiet
    from benchmarks.otlp_receiver import OtlpReceiver
    from benchmarks.workload import ModelConfig, build_model, make_batch, train_step
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter, otlp_exporter
    from commspan.testing import fake_process_group

    quiet()
    torch.set_num_threads(1)
    cfg = ModelConfig(**cfg_dict)
    out: dict[str, Any] = {}
    collections: list[tuple[int, float, float]] = []  # (generation, start, stop)
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], started[0], time.perf_counter()))

    gc.callbacks.append(on_gc)
    with fake_process_group(world_size=4, rank=0), OtlpReceiver() as receiver, \
            tempfile.TemporaryDirectory(prefix="commspan-bench-stalls-") as tmp:
        mesh = init_device_mesh("cpu", (4,))
        model = build_model(cfg, mesh)
        batch = make_batch(cfg)
        for name in VARIANTS:
            if name == "no mode":
                mode = None
            elif name == "commspan + JSONL":
                mode = CommSpanMode(exporters=[JsonlSpanExporter(f"{tmp}/plain")])
            elif name == FROZEN:
                mode = CommSpanMode(exporters=[JsonlSpanExporter(f"{tmp}/frozen")])
            elif name == "commspan + JSONL, compressed":
                mode = CommSpanMode(exporters=[JsonlSpanExporter(f"{tmp}/gz", compress=True)])
            else:  # OTLP, FROZEN_OTLP
                mode = CommSpanMode(exporters=[otlp_exporter(protocol="http/protobuf",
                                                             endpoint=receiver.endpoint)])
            times: list[float] = []
            bounds: list[tuple[float, float]] = []
            if name in (FROZEN, FROZEN_OTLP):
                gc.collect()
                gc.freeze()
            collections.clear()
            if mode is None:
                for i in range(warmup + steps):
                    t0 = time.perf_counter()
                    train_step(model, batch)
                    if i >= warmup:
                        bounds.append((t0, time.perf_counter()))
            else:
                with mode:
                    for i in range(warmup + steps):
                        t0 = time.perf_counter()
                        with mode.step(i):
                            train_step(model, batch)
                        if i >= warmup:
                            bounds.append((t0, time.perf_counter()))
                mode.shutdown()
            if name in (FROZEN, FROZEN_OTLP):
                gc.unfreeze()
            times = [b - a for a, b in bounds]
            med = median(times)
            p99 = _percentile(times, 0.99)
            first, last = bounds[0][0], bounds[-1][1]  # the measured steps only
            full = [(a, b) for g, a, b in collections if g == 2 and first <= a and b <= last]
            w0, w1 = bounds[times.index(max(times))]
            out[name] = {"median_ms": med * 1e3, "p99_ms": p99 * 1e3,
                         "max_ms": max(times) * 1e3, "p99_over_median": p99 / med,
                         "max_over_median": max(times) / med,
                         "full_gc": len(full),
                         "full_gc_max_ms": max((b - a for a, b in full), default=0.0) * 1e3,
                         "full_gc_in_worst_ms": sum(
                             min(b, w1) - max(a, w0) for a, b in full if a < w1 and b > w0
                         ) * 1e3,
                         "steps_ms": [t * 1e3 for t in times]}
    gc.callbacks.remove(on_gc)
    return out


def run_stalls(cfg_dict: dict[str, Any], steps: int = 200, warmup: int = 5) -> dict[str, Any]:
    """Per-step wall times of each variant (see the module docstring)."""
    variants = run_in_subprocess(_measure, cfg_dict, steps, warmup, timeout_s=1200)
    return {"steps": steps, "warmup": warmup, "variants": variants}
