"""examples/pipeline.py runs end to end: two pipeline stages on 2 gloo ranks, GPipe and 1F1B.

The reference is the schedule itself: per step, each microbatch's activations
go from stage 0 to stage 1 once and its gradients come back once; GPipe runs
every forward before any backward, 1F1B starts backward (stage 0 receives a
gradient) before its last activation send.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from commspan import semconv
from commspan.exporters import read_spans

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "pipeline.py"
STEPS = 2
MICROBATCHES = 4

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=["gpipe", "1f1b"])
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, subprocess.CompletedProcess[str], Path]:
    """Run the example once per schedule, as a user would."""
    out = tmp_path_factory.mktemp(f"pipeline-{request.param}") / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the example starts its own ranks
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--schedule", request.param, "--out", str(out),
         "--steps", str(STEPS)],
        check=False, capture_output=True, text=True, timeout=600, env=env, cwd=out.parent,
    )
    return request.param, proc, out


def _p2p(path: Path) -> list[list[tuple[str, int]]]:
    """Per step (trace), the (kind, microbatch) of each pipeline op, in issue order."""
    steps: dict[str, list[tuple[int, tuple[str, int]]]] = {}
    for span in read_spans(path):
        for (_, attrs), when in zip(span.events, span.event_times):
            if attrs.get(semconv.OWNER_SOURCE) == semconv.SOURCE_PIPELINE and attrs.get(
                semconv.PP_MICROBATCH
            ) is not None:
                steps.setdefault(span.trace_id, []).append(
                    (when, (attrs[semconv.OWNER_KIND], attrs[semconv.PP_MICROBATCH])))
    return [[item for _, item in sorted(ops)] for ops in steps.values()]


def test_example_runs(run: tuple[str, subprocess.CompletedProcess[str], Path]) -> None:
    """Exit 0, a loss per step, the table and one line per op of the last step."""
    _, proc, out = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == STEPS
    assert sum("microbatch" in line for line in lines) == 2 * 2 * MICROBATCHES
    files = sorted(out.glob("commspan-rank*.jsonl"))
    assert len(files) == 2
    assert proc.stdout.split("Spans written to:\n", 1)[1].split() == [str(f) for f in files]


def test_ops_follow_the_schedule(run: tuple[str, subprocess.CompletedProcess[str], Path]) -> None:
    """Each step, stage 0 sends every microbatch's activations and receives its
    gradients once, stage 1 the other way round, in the schedule's order."""
    schedule, proc, out = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = _p2p(out / "commspan-rank0.jsonl")
    last = _p2p(out / "commspan-rank1.jsonl")
    assert len(first) == len(last) == STEPS
    for ops0, ops1 in zip(first, last):
        assert sorted(ops0) == sorted([("activation_send", m) for m in range(MICROBATCHES)]
                                      + [("gradient_recv", m) for m in range(MICROBATCHES)])
        assert sorted(ops1) == sorted([("activation_recv", m) for m in range(MICROBATCHES)]
                                      + [("gradient_send", m) for m in range(MICROBATCHES)])
        sends = [i for i, (kind, _) in enumerate(ops0) if kind == "activation_send"]
        grads = [i for i, (kind, _) in enumerate(ops0) if kind == "gradient_recv"]
        if schedule == "gpipe":
            assert max(sends) < min(grads)  # all forwards, then all backwards
        else:
            assert min(grads) < max(sends)  # one forward, one backward
        for kind in ("activation_send", "gradient_recv"):  # microbatches in order
            assert [m for k, m in ops0 if k == kind] == list(range(MICROBATCHES))
