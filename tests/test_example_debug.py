"""examples/hang_and_straggler.py runs end to end on 4 gloo ranks and says what
`commspan stragglers` and `commspan check` would say about its stragglers (a sleep, a
garbage collection) and its hang."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from commspan.analysis import check_run, load_run, stragglers

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "hang_and_straggler.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("debug-example")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out)],
        capture_output=True, text=True, timeout=400, env=env, cwd=out, check=False,
    )
    return proc, out


def test_example_exits_cleanly_without_tracebacks(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Exit 0; stopping the hung job leaves no rank's traceback behind."""
    proc, _ = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


def test_straggler_is_rank_2_in_blocks_1(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """The printed straggler table starts with rank 2 in Net.blocks.1, every step; the
    library says the same about the files."""
    proc, out = run
    lines = proc.stdout.splitlines()
    start = lines.index(f"$ commspan stragglers {out / 'straggler'}")
    rows = [re.split(r"\s{2,}", line) for line in lines[start + 3:start + 6]]
    assert sorted(r[0] for r in rows) == ["0", "1", "2"]
    assert all(r[1:4] == ["Net.blocks.1", "forward", "2"] for r in rows), rows
    top = stragglers(out / "straggler").stragglers[:3]
    assert {(r.fqn, r.rank) for r in top} == {("Net.blocks.1", 2)}


def test_gc_straggler_is_rank_3_in_blocks_0_with_its_collection(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Rank 3's full garbage collection in Net.blocks.0 makes it the straggler there in
    every step; the printed table shows the collection's time beside the wait, and the
    library charges at least the rank's recorded full collections of each step to it."""
    proc, out = run
    lines = proc.stdout.splitlines()
    start = lines.index(f"$ commspan stragglers {out / 'gc'}")
    assert "gc before" in lines[start + 2]
    rows = [re.split(r"\s{2,}", line) for line in lines[start + 3:start + 6]]
    assert sorted(r[0] for r in rows) == ["0", "1", "2"]
    assert all(r[1:4] == ["Net.blocks.0", "forward", "3"] and r[7] != "-" for r in rows), rows
    result = stragglers(out / "gc")
    top = {r.step: r for r in result.stragglers if (r.fqn, r.rank) == ("Net.blocks.0", 3)}
    assert sorted(top) == [0, 1, 2]
    run_ = load_run(out / "gc")
    full = {s: sum(g.duration_ns for g in run_.gc_pauses
                   if g.rank == 3 and g.step == s and g.fqn == "Net.blocks.0")
            for s in range(3)}
    assert all(full[s] > 0 and top[s].gc_ns >= full[s] for s in range(3)), (full, top)


def test_hang_names_the_missing_rank_and_where_everyone_was(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """The printed check says: ranks 0, 2, 3 are in Net.blocks.2's all_reduce, rank 1
    never issued it and was in Net.blocks.1; the library finds exactly that one hang."""
    proc, out = run
    assert (
        "hang      group 0 (ranks 0-3), seq 9: ranks 0, 2, 3 are in `Net.blocks.2` forward "
        "all_reduce; rank 1 never issued it and was last seen in `Net.blocks.1` forward"
    ) in proc.stdout
    (finding,) = check_run(out / "hang").findings
    assert (finding.kind, finding.seq, finding.step) == ("hang", 9, 2)
    assert finding.details["never_issued"] == [1]
