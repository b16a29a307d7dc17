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
