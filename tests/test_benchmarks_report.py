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
