"""The benchmark report finds every stalls variant its targets name (a variant name with
a "." would break the dotted lookup and leave the target "n/a" for ever)."""

from __future__ import annotations

from benchmarks.report import TARGETS, evaluate_targets
from benchmarks.stalls import VARIANTS


def test_every_stalls_target_resolves() -> None:
    results = {"stalls": {"variants": {v: {"p99_over_median": 1.1 + i / 100}
                                       for i, v in enumerate(VARIANTS)}}}
    verdicts = {t["target"]: t for t in evaluate_targets(results)}
    stalls = [key for key, _d, path, _op, _t in TARGETS if path.startswith("stalls.")]
    assert len(stalls) >= 4
    for key in stalls:
        assert verdicts[key]["verdict"] == "PASS", verdicts[key]
    assert all("." not in v for v in VARIANTS)


def test_offline_rows_name_the_rank_files_generated_and_negative_costs_are_noise() -> None:
    """``--quick`` generates 64 rank files: its rows said "1,024 ranks"; a cost measured
    below 0 (the VM's noise) was a plain PASS."""
    results = {
        "offline": {"files": 64, "steps": 20, "commands": {"summary": {"seconds": 0.3}}},
        "timing": {"kinds": {"functional": {"added_us": -49.8},
                             "c10d_blocking": {"added_us": 0.5}}},
    }
    verdicts = {t["target"]: t for t in evaluate_targets(results)}
    row = verdicts["offline_summary_s"]
    assert row["description"] == "commspan summary, 64 ranks x 20 steps (s)"
    assert row["verdict"] == "PASS"
    assert all("1,024" not in t["description"] for t in verdicts.values())
    assert verdicts["timing_functional"]["verdict"] == "PASS (noise: below 0)"
    assert verdicts["timing_c10d"]["verdict"] == "PASS"
    full = {t["target"]: t for t in evaluate_targets({"offline": {"files": 1024, "steps": 20}})}
    assert full["offline_check_s"]["description"] == "commspan check, 1,024 ranks x 20 steps (s)"


def test_memory_steps_help_says_what_quick_runs() -> None:
    from benchmarks.__main__ import QUICK, _parse

    assert QUICK.memory_steps == 40
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        _parse(["--help"])
    assert "--quick: 40)" in " ".join(out.getvalue().split())


def test_step_targets_are_issue_13s_and_otlp_is_judged_against_jsonl() -> None:
    """The printed verdicts used issue 4's thresholds (a quarter of CommDebugMode's cost
    above the floor, the wall ratio only) and had no OTLP-against-JSONL row."""
    from benchmarks.step_overhead import summarize

    base = [10.0, 10.0]
    costs = {"none": 1.0, "floor": 1.05, "cdm": 1.5, "cs_jsonl": 1.12, "cs_otlp": 1.16}
    per_rank = [{"cpu_ms": {k: [x * r for x in base] for k, r in costs.items()},
                 "wall_ms": {k: [x * r for x in base] for k, r in costs.items()}}]
    step = summarize(per_rank, list(costs))
    otlp = step["variants"]["cs_otlp"]
    assert abs(otlp["cpu_ratio_over_jsonl"] - 0.04) < 1e-9
    verdicts = {t["target"]: t for t in evaluate_targets({"step": step})}
    assert verdicts["otlp_over_jsonl_cpu"]["verdict"] == "FAIL"  # +0.04 > +0.03
    assert verdicts["full_tracing_cpu"]["verdict"] == "FAIL"  # x1.12 > x1.10
    # (1.12 - 1.05) / (1.5 - 1.05) = 0.156: under issue 4's 1/4, over issue 13's 0.15
    assert verdicts["above_floor_vs_cdm"]["threshold"] == 0.15
    assert verdicts["above_floor_vs_cdm"]["verdict"] == "FAIL"
