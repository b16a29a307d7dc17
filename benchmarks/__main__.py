"""``python -m benchmarks``: run commspan's benchmarks, print the table, write JSON.

Run from the repository root (commspan installed, e.g. ``pip install -e .``)::

    python -m benchmarks                 # everything, medium model (~10 min on 2 cores)
    python -m benchmarks --quick         # smoke run, small model, few rounds (< 2 min)
    python -m benchmarks --only step --size large --rounds 10
    python -m benchmarks --only export,memory --json /tmp/bench.json
    python -m benchmarks --only timing   # what collective timing costs per collective
    python -m benchmarks --only stalls   # slowest steps against the median, export running
    python -m benchmarks --only offline  # the CLI over 1,024 generated rank files x 20 steps

Targets are reported PASS/FAIL but never change the exit status: it is 1
only when a section could not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.workload import SIZES, ModelConfig

SECTIONS = ("step", "export", "memory", "profile", "labels", "timing", "tracesize", "stalls",
            "offline")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "latest.json"


@dataclasses.dataclass
class Plan:
    rounds: int
    warmup: int
    steps_per_round: int
    step_budget_s: float
    export_min_seconds: float
    export_repeats: int
    export_file_steps: int
    memory_steps: int
    memory_warmup: int
    memory_cap_s: float
    profile_steps: int
    profile_rounds: int
    timing_rounds: int = 15
    timing_calls: int = 2000
    stall_steps: int = 200


FULL = Plan(
    rounds=20, warmup=2, steps_per_round=2, step_budget_s=330.0,
    export_min_seconds=0.25, export_repeats=12, export_file_steps=200,
    memory_steps=1000, memory_warmup=20, memory_cap_s=300.0, profile_steps=10,
    profile_rounds=30,
)
QUICK = Plan(
    rounds=2, warmup=1, steps_per_round=1, step_budget_s=45.0,
    export_min_seconds=0.2, export_repeats=2, export_file_steps=30,
    memory_steps=40, memory_warmup=3, memory_cap_s=60.0, profile_steps=3,
    profile_rounds=2, timing_rounds=3, timing_calls=500, stall_steps=20,
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="commspan benchmarks: step-time overhead (4 gloo ranks), exporter "
        "throughput, memory over many steps, and a profile of where commspan's time goes.",
    )
    p.add_argument("--quick", action="store_true",
                   help="fast smoke run: small model, few rounds and steps (< 2 min)")
    p.add_argument("--size", choices=["medium", "large", "small"], default=None,
                   help="model of the step and export sections (default medium; --quick: small)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measured rounds of the step section (each runs every variant)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds, not measured")
    p.add_argument("--steps-per-round", type=int, default=None,
                   help="steps per variant per round (one context per variant per round)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds after which the step section stops starting new rounds")
    p.add_argument("--optimizer", action="store_true", help="add an SGD step to every step")
    p.add_argument("--memory-steps", type=int, default=None,
                   help="traced steps of the memory section (default "
                        f"{FULL.memory_steps}; --quick: {QUICK.memory_steps})")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {', '.join(SECTIONS)}")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON,
                   help=f"where to write the results (default {DEFAULT_JSON})")
    for name in ("dim", "n_heads", "n_layers", "vocab", "seq", "batch"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"override the model's {name}")
    ns = p.parse_args(argv)
    only = [s.strip() for s in ns.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad or not only:
        p.error(f"--only {ns.only!r}: choose from {', '.join(SECTIONS)}")
    ns.only = only
    if ns.rounds is not None and ns.rounds < 1:
        p.error(f"--rounds {ns.rounds}: must be >= 1")
    return ns


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parent.parent,
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip() if out.returncode == 0 else ""
    except Exception:
        return ""


def machine_info() -> dict[str, Any]:
    import torch

    import commspan

    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "commspan"))
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commspan": commspan.__version__,
        "git": (commit + ("+dirty" if dirty else "")) if commit else "unknown",
        "load_average_at_start": os.getloadavg(),
    }


def _log(msg: str) -> None:
    print(f"[benchmarks {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ns = _parse(argv)
    plan = dataclasses.replace(QUICK if ns.quick else FULL)
    for field, value in (("rounds", ns.rounds), ("warmup", ns.warmup),
                         ("steps_per_round", ns.steps_per_round),
                         ("step_budget_s", ns.budget), ("memory_steps", ns.memory_steps)):
        if value is not None:
            setattr(plan, field, value)
    if ns.rounds is not None and ns.budget is None:
        plan.step_budget_s = float("inf")  # the rounds asked for, however long they take
    size = ns.size or ("small" if ns.quick else "medium")
    overrides = {k: getattr(ns, k) for k in ("dim", "n_heads", "n_layers", "vocab", "seq", "batch")
                 if getattr(ns, k) is not None}
    cfg: ModelConfig = dataclasses.replace(SIZES[size], **overrides)
    memory_cfg = SIZES["small"]

    results: dict[str, Any] = {
        "mode": "quick" if ns.quick else "full",
        "size": size,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:] if argv is None else argv,
        "plan": dataclasses.asdict(plan),
        "machine": machine_info(),
    }
    failed = False
    t0 = time.monotonic()

    def section(name: str, what: str, fn: Callable[[], dict[str, Any]]) -> None:
        nonlocal failed
        if name not in ns.only:
            return
        _log(f"{name}: {what}")
        s0 = time.monotonic()
        load0 = os.getloadavg()[0]
        try:
            results[name] = fn()
            results[name]["load_average_1min"] = [load0, os.getloadavg()[0]]
        except Exception as exc:
            failed = True
            results[name] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
            _log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
        _log(f"{name}: done in {time.monotonic() - s0:.0f} s")

    from benchmarks.export_throughput import run_export_throughput
    from benchmarks.hotspots import run_profile
    from benchmarks.labels import run_labels
    from benchmarks.memory import run_memory
    from benchmarks.offline import run_offline
    from benchmarks.stalls import run_stalls
    from benchmarks.step_overhead import run_step_overhead
    from benchmarks.timing import run_timing
    from benchmarks.tracesize import WORLDS, run_tracesize
    from benchmarks.variants import ALL_VARIANTS

    section(
        "step",
        f"4 gloo ranks, {size} model, {plan.rounds} rounds x {plan.steps_per_round} steps "
        f"x {len(ALL_VARIANTS)} variants (stops new rounds after {plan.step_budget_s:.0f} s)",
        lambda: run_step_overhead(
            cfg, rounds=plan.rounds, warmup=plan.warmup, steps_per_round=plan.steps_per_round,
            keys=ALL_VARIANTS, optimizer=ns.optimizer, budget_s=plan.step_budget_s,
            timeout_s=plan.step_budget_s + 600 if plan.step_budget_s != float("inf") else 86400,
        ),
    )
    section(
        "export",
        f"JSONL export and from_jsonl throughput on spans of the {size} model",
        lambda: run_export_throughput(
            cfg, file_steps=plan.export_file_steps, min_seconds=plan.export_min_seconds,
            repeats=plan.export_repeats,
        ),
    )
    section(
        "memory",
        f"RSS over {plan.memory_steps} steps, small model, 4 processes side by side",
        lambda: run_memory(
            memory_cfg, steps=plan.memory_steps, warmup=plan.memory_warmup,
            cap_s=plan.memory_cap_s,
        ),
    )
    section(
        "profile",
        f"one rank's step split, then cProfile of {plan.profile_steps} traced steps, {size} model",
        lambda: run_profile(cfg, steps=plan.profile_steps, rounds=plan.profile_rounds),
    )

    section(
        "labels",
        "record_function label tracking (FSDP2 ownership): per label pair and per FSDP2 step",
        lambda: run_labels(rounds=plan.rounds, steps=plan.steps_per_round * 3),
    )

    section(
        "timing",
        f"CPU per collective on the training thread, timing off/on, {plan.timing_rounds} rounds",
        lambda: run_timing(rounds=plan.timing_rounds, calls=plan.timing_calls),
    )
    worlds = WORLDS[:2] if ns.quick else WORLDS
    section(
        "tracesize",
        f"bytes of a step's trace for world sizes {', '.join(map(str, worlds))} "
        "(fake process group, rank 0 of TP 8 x FSDP)",
        lambda: run_tracesize(worlds),
    )

    offline_world = 64 if ns.quick else 1024
    section(
        "offline",
        f"summary, table, check, html, perfetto, stragglers, diff and from_jsonl over "
        f"{offline_world} generated rank files "
        "x 20 steps with digests",
        lambda: run_offline(world=offline_world, steps=20),
    )
    section(
        "stalls",
        f"step wall times with export running, {plan.stall_steps} steps per variant, "
        f"{size} model (one process, fake process group)",
        lambda: run_stalls(cfg.as_dict(), steps=plan.stall_steps),
    )

    from benchmarks.report import evaluate_targets, format_report

    results["targets"] = evaluate_targets(results)
    results["elapsed_s"] = time.monotonic() - t0
    results["machine"]["load_average_at_end"] = os.getloadavg()
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = format_report(results)
    results["report"] = text
    ns.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(text, end="")
    _log(f"wrote {ns.json} ({results['elapsed_s']:.0f} s in all)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
