"""`commspan diff`: two runs, or two steps of one run, compared per module, phase and op."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli_runs import (
    net_step,
    run_cli,
    session_dir,
    tp_transformer,
    transformer_step,
    without_step_ends,
    write_run,
)

from commspan.cli import main
from commspan.testing import fake_mesh

WO = "Transformer.layers.0.attention.wo"
RANK_0_OF_4 = "".join(
    f"commspan: {side}: ranks 1-3 of 4 wrote no spans (no file of theirs read): what follows "
    "covers rank 0 only\n" for side in "AB")
"""What stderr says of two sides that are rank 0 of a fake world of 4 each."""



@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> dict[str, Path]:
    """Rank 0 of the tensor-parallel toy Transformer, one training step per run: plain
    tensor parallelism, the same with sequence parallelism, and one run whose step 0
    is plain and step 1 sequence parallel."""
    mesh = fake_mesh(4)

    def one(sp: bool, run_id: str) -> object:
        return lambda out: write_run(
            out, run_id, transformer_step(tp_transformer(mesh, sequence_parallel=sp)),
            steps=(0,), ranks=(0,))

    def mixed(out: Path) -> None:
        tp = transformer_step(tp_transformer(mesh))
        sp = transformer_step(tp_transformer(mesh, sequence_parallel=True))
        write_run(out, "mixed", lambda rank, step: (sp if step else tp)(rank, step),
                  steps=(0, 1), ranks=(0,))

    return {
        "tp": session_dir(tmp_path_factory, "diff-tp", one(False, "tp")),  # type: ignore[arg-type]
        "tp-again": session_dir(tmp_path_factory, "diff-tp2", one(False, "tp2")),  # type: ignore[arg-type]
        "sp": session_dir(tmp_path_factory, "diff-sp", one(True, "sp")),  # type: ignore[arg-type]
        "mixed": session_dir(tmp_path_factory, "diff-mixed", mixed),
    }


def test_sequence_parallel_shows_as_a_readable_diff(
    plans: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Turning sequence parallelism on: wo's forward all_reduce becomes a reduce_scatter
    (P(sum)->S(1)), attention gains a forward all_gather (S(1)->R); exit 1."""
    code, out, err = run_cli(capsys, "diff", str(plans["tp"]), str(plans["sp"]))
    assert (code, err) == (1, RANK_0_OF_4)
    lines = out.splitlines()
    assert lines[0] == f"--- A: {plans['tp']} (run tp, ranks 0, steps 0)"
    assert lines[1] == f"+++ B: {plans['sp']} (run sp, ranks 0, steps 0)"
    wo = lines.index(WO)
    assert [ln.split() for ln in lines[wo + 1: wo + 4]] == [
        ["-", "forward", "all_reduce", "x1", "1,024", "B", "P(sum)->R"],
        ["+", "forward", "reduce_scatter_tensor", "x1", "1,024", "B", "P(sum)->S(1)"],
        ["+", "backward", "all_gather_into_tensor", "x1", "256", "B", "S(1)->R"],
    ]
    assert lines[wo + 4] == "Transformer.layers.0.attention.wq"  # the next module's block
    attention = lines.index("Transformer.layers.0.attention")
    assert [ln.split() for ln in lines[attention + 1: attention + 3]] == [
        ["+", "forward", "all_gather_into_tensor", "x1", "256", "B", "S(1)->R"],
        ["+", "backward", "reduce_scatter_tensor", "x1", "1,024", "B", "P(sum)->S(1)"],
    ]
    # the vocab head gathers its input too: same op, now twice, with another placement
    output = lines.index("Transformer.output")
    assert lines[output + 1].split() == [
        "~", "forward", "all_gather_into_tensor", "count", "1", "=>", "2;", "bytes", "128", "B",
        "=>", "384", "B;", "placements", "S(2)->R", "=>", "S(1)->R,", "S(2)->R"]
    # 16 (module, phase, op) without SP, 22 with; only the head's forward gather is in both
    assert lines[-1] == "21 added, 15 removed, 1 changed, 0 same (per step)"


def test_diff_json_lists_added_removed_changed(
    plans: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--json: equal, counts, one entry per module/phase/op with both sides' usage."""
    code, out, _ = run_cli(capsys, "diff", str(plans["tp"]), str(plans["sp"]), "--json")
    data = json.loads(out)
    assert code == 1 and data["equal"] is False
    assert set(data) >= {"equal", "counts", "entries", "a", "b"}
    assert data["a"] == {"path": str(plans["tp"]), "run": "tp", "steps": [0], "ranks": [0],
                         "cut_short": []}
    entries = {(e["fqn"], e["phase"], e["op"]): e for e in data["entries"]}
    removed = entries[(WO, "forward", "all_reduce")]
    assert removed["status"] == "removed" and removed["b"] is None
    assert removed["a"] == {"count": 1, "bytes": 1024, "placements": ["P(sum)->R"],
                            "groups": ["dim 0 x1"], "total_count": 1, "total_bytes": 1024,
                            "steps": 1}
    added = entries[(WO, "forward", "reduce_scatter_tensor")]
    assert added["status"] == "added" and added["a"] is None
    assert added["b"] == {"count": 1, "bytes": 1024, "placements": ["P(sum)->S(1)"],
                          "groups": ["dim 0 x1"], "total_count": 1, "total_bytes": 1024,
                          "steps": 1}
    assert data["counts"] == {"added": 21, "removed": 15, "changed": 1, "same": 0}
    assert len(data["entries"]) == 37


def test_equal_runs_exit_0(plans: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of the same plan (other run ids) are equal: exit 0, one line saying so."""
    code, out, _ = run_cli(capsys, "diff", str(plans["tp"]), str(plans["tp-again"]))
    assert code == 0
    assert out.splitlines()[-1] == "no difference: 16 module/phase/op compared (per step)"
    code, out, _ = run_cli(capsys, "diff", str(plans["tp"]), str(plans["tp-again"]), "--json")
    assert code == 0 and json.loads(out)["entries"] == []


def test_two_steps_of_one_run(plans: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`diff DIR --step 0 --step 1` compares two steps of one run: the same difference
    as between the two runs."""
    code, out, _ = run_cli(capsys, "diff", str(plans["mixed"]), "--step", "0", "--step", "1",
                        "--json")
    across_steps = json.loads(out)
    _, out, _ = run_cli(capsys, "diff", str(plans["tp"]), str(plans["sp"]), "--json")
    across_runs = json.loads(out)
    assert code == 1
    assert across_steps["entries"] == across_runs["entries"]
    assert across_steps["a"]["steps"] == [0] and across_steps["b"]["steps"] == [1]


def test_steps_are_compared_per_step(
    plans: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A 2-step run compared with a 1-step run of the same plan is equal (counts per step);
    --steps applies the same range to both sides."""
    code, _, _ = run_cli(capsys, "diff", str(plans["mixed"]), str(plans["tp"]), "--steps", "0-0")
    assert code == 0
    code, out, _ = run_cli(capsys, "diff", str(plans["mixed"]), str(plans["tp"]), "--json")
    data = json.loads(out)
    assert code == 1 and data["a"]["steps"] == [0, 1]
    fwd = {(e["fqn"], e["phase"], e["op"]): e for e in data["entries"]}[(WO, "forward",
                                                                          "all_reduce")]
    assert fwd["status"] == "changed" and fwd["fields"] == ["count", "bytes"]
    assert fwd["a"]["count"] == 0.5 and fwd["b"]["count"] == 1  # 1 all_reduce in 2 steps


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["diff", "{tp}", "{missing}"], "FileNotFoundError: B: '{missing}' does not exist"),
        (["diff", "{tp}", "{tp}", "--step", "5"],
         "ValueError: A: --step 5: not in run tp, which has steps 0"),
        (["diff", "{tp}", "{sp}", "--rank", "3"],
         "ValueError: --rank 3: A holds no span of that rank (ranks: 0)"),
        (["diff", "{mixed}", "--step", "0", "--step", "4"],
         "ValueError: --step 4: not in run mixed, which has steps 0-1"),
        (["diff", "{tp}", "{notjsonl}"],
         "ValueError: {notjsonl}:1: not a JSON line"),
    ],
)
def test_bad_input_exits_2(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    argv: list[str], message: str,
) -> None:
    """A missing path, a step or rank not in a run, a file that is not JSONL: one line on
    stderr, nothing on stdout, exit 2 (1 would mean "different")."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    fill = {**{k.replace("-", ""): str(v) for k, v in plans.items()},
            "missing": str(tmp_path / "nope"), "notjsonl": str(bad)}
    code, out, err = run_cli(capsys, *(a.format(**fill) for a in argv))
    assert (code, out) == (2, "")
    assert err.startswith(message.format(**fill)), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["diff", "{tp}"],
        ["diff", "{tp}", "--step", "0"],
        ["diff", "{tp}", "{sp}", "--step", "0", "--step", "0", "--step", "0"],
        ["diff", "{tp}", "{sp}", "--step", "0", "--steps", "0-1"],
    ],
)
def test_usage_errors_exit_2(
    plans: dict[str, Path], capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """One path without two steps or runs, an option three times, --step with --steps:
    argparse's usage error, status 2."""
    with pytest.raises(SystemExit) as info:
        main([a.format(tp=plans["tp"], sp=plans["sp"]) for a in argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" in err


@pytest.mark.parametrize("twice", [["--step", "0", "--step", "0"],
                                   ["--steps", "0-1", "--steps", "0-1"],
                                   ["--run", "X", "--run", "X", "--step", "0", "--step", "0"]])
def test_one_selection_given_twice_is_a_usage_error(
    plans: dict[str, Path], capsys: pytest.CaptureFixture[str], twice: list[str]
) -> None:
    """`diff DIR --step 0 --step 0` compared a step with itself and said "no
    difference" (exit 0), whatever the run held."""
    with pytest.raises(SystemExit) as info:
        main(["diff", str(plans["tp"]), *twice])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "compares a selection with itself" in err and "Traceback" not in err


def test_two_spellings_of_one_selection_are_an_error(
    streamed_runs: dict[str, Any], capsys: pytest.CaptureFixture[str],
) -> None:
    """`diff DIR --run second --run sec` (a run and a prefix of its id) compared the run
    with itself and said "no difference" (exit 0): the selections are compared once
    resolved, not as typed."""
    folder = str(streamed_runs["b"])
    for twice in (["--run", "second", "--run", "sec"],
                  ["--run", "second", "--run", "s", "--steps", "0-4", "--steps", "0-9"]):
        code, out, err = run_cli(capsys, "diff", folder, *twice)
        assert (code, out) == (2, ""), err
        assert err.splitlines()[-1].startswith(
            f"ValueError: diff {folder} {' '.join(twice)}: both select run second, "
            "steps 0-4, which would be compared with itself"), err
    _, out, err = run_cli(capsys, "diff", folder, "--run", "first", "--run", "sec")
    assert out and "with itself" not in err  # (two runs: compared; the status is 2 for
    # the folder's damaged line)


@pytest.mark.multiprocess
def test_example_with_sequence_parallel(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's diff: examples/tp_transformer.py on 4 gloo ranks, with and without
    --sequence-parallel; wo's all_reduce turns into a reduce_scatter in forward and in
    the recompute of the checkpointed block."""
    from _example_run import example_run

    tp = example_run(tmp_path_factory, 3)
    sp = example_run(tmp_path_factory, 3, "--sequence-parallel")
    code, out, err = run_cli(capsys, "diff", str(tp), str(sp))
    assert (code, err) == (1, "")
    lines = out.splitlines()
    for block, recomputed in (("0", False), ("1", True)):
        wo = lines.index(f"Transformer.layers.{block}.attention.wo")
        changes = [ln.split()[:3] for ln in lines[wo + 1:wo + 6] if ln[:1] in "+-~"]
        assert ["-", "forward", "all_reduce"] in changes
        assert ["+", "forward", "reduce_scatter_tensor"] in changes
        assert (["+", "recompute", "reduce_scatter_tensor"] in changes) is recomputed
    code, out, _ = run_cli(capsys, "diff", str(sp), str(sp), "--json")
    assert code == 0 and json.loads(out)["equal"] is True


def _mlp_on(dim: str) -> Any:
    """Rank 0 of a 2x2 mesh named ("data", "model"): an MLP made tensor parallel over
    mesh dimension ``dim``, one training step. (Names of its own: torch caches DTensor
    state per mesh, and an equal mesh of another test would get its groups.)"""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from commspan.testing.models import MLPModule, parallelize_mlp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    torch.manual_seed(0)
    model = parallelize_mlp(MLPModule("cpu"), mesh[dim])

    def step(rank: int, index: int) -> None:
        model(torch.randn(4, 10)).sum().backward()

    return step


def test_the_same_collectives_on_another_mesh_dimension_are_a_change(
    tmp_path: Path, fake_pg: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tensor parallelism over the mesh's data dimension instead of model: the same ops,
    counts, bytes and placements, on another dimension; diff says where they ran
    (the dimension this test chose), and exits 1."""
    on_tp = write_run(tmp_path / "tp", "tp", _mlp_on("model"), steps=(0,), ranks=(0,))
    on_dp = write_run(tmp_path / "dp", "dp", _mlp_on("data"), steps=(0,), ranks=(0,))
    code, out, err = run_cli(capsys, "diff", str(on_tp), str(on_dp), "--json")
    assert (code, err) == (1, RANK_0_OF_4)
    entries = json.loads(out)["entries"]
    assert entries and all(e["status"] == "changed" and e["fields"] == ["groups"]
                           for e in entries)
    assert {(e["a"]["groups"][0].split(" x")[0], e["b"]["groups"][0].split(" x")[0])
            for e in entries} == {("model", "data")}
    code, out, _ = run_cli(capsys, "diff", str(on_tp), str(on_dp))
    net2 = out.splitlines().index("MLPModule.net2")
    assert "groups model x1 => data x1" in out.splitlines()[net2 + 1]
    code, out, _ = run_cli(capsys, "diff", str(on_tp), str(on_tp), "--step", "0",
                           "--step", "0")
    assert code == 0


def test_a_change_smaller_than_the_rounding_is_still_a_change() -> None:
    """10,001 all_reduces over 10,000 steps against one per step: both show as 1 per
    step after rounding, yet the counts differ; diff compares exact totals, and the
    text gives them."""
    from _analysis_builder import SpanBuilder

    from commspan.analysis.diff import diff, profile
    from commspan.render.diff import format_diff

    def side(n: int) -> list[Any]:
        b = SpanBuilder(1)
        step = b.rank(0, 0)
        for _ in range(n):
            step.coll("all_reduce", fqn="Net", nbytes=64)
        return b.spans()

    a, b = profile(side(10_001), steps=10_000), profile(side(1), steps=1)
    result = diff(a, b)
    ((entry),) = result.entries
    assert entry.fields == ("count", "bytes") and (entry.a.count, entry.b.count) == (1, 1)
    text = format_diff(result, "A", "B")
    assert "count 1 => 1 (10,001 in 10,000 steps => 1 in 1 steps)" in text
    assert diff(profile(side(3), steps=3), profile(side(1), steps=1)).equal


def test_what_happens_once_is_not_divided_by_the_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """A run of 2 steps and one of 4 of the same program, which all-reduces once before
    its first step (outside steps) and once per step: equal. A third run that
    all-reduces twice before its first step differs there, and only there."""
    import torch
    import torch.distributed as dist

    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

    def run(name: str, steps: int, before: int) -> Path:
        out = tmp_path / name
        net = Net()
        mode = CommSpanMode(exporters=[JsonlSpanExporter(out / "rank0.jsonl")], run_id=name)
        with mode:
            for _ in range(before):
                net(torch.ones(4))  # set-up, outside the steps
            for i in range(steps):
                with mode.step(i):
                    net(torch.ones(4))
        mode.shutdown()
        return out

    two, four, more = run("two", 2, 1), run("four", 4, 1), run("more", 4, 2)
    code, out, _ = run_cli(capsys, "diff", str(two), str(four))
    assert code == 0, out
    code, out, _ = run_cli(capsys, "diff", str(two), str(more), "--json")
    data = json.loads(out)
    assert code == 1 and data["counts"]["changed"] == 1 and data["counts"]["same"] == 1
    (entry,) = [e for e in data["entries"] if e["status"] == "changed"]
    assert (entry["phase"], entry["a"]["count"], entry["b"]["count"]) == (
        "forward (outside steps)", 1, 2)


def test_the_header_names_the_rank_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """``--rank 1`` compares rank 1: the text header says so, as the JSON does."""
    run = write_run(tmp_path / "run", "r", net_step(), ranks=(0, 1, 2, 3))
    code, out, _ = run_cli(capsys, "diff", str(run), str(run), "--rank", "1")
    assert code == 0 and "ranks 1, steps" in out.splitlines()[0], out
    code, out, _ = run_cli(capsys, "diff", str(run), str(run))
    assert "ranks 0-3, steps" in out.splitlines()[0], out


def test_a_step_cut_short_is_left_out_of_its_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """Step 1 of 3 of a run lost its rank and step spans (a hang leaves them so): diff
    leaves it out, on every rank, instead of dividing steps 0 and 2's collectives by 3
    and calling step 1's "outside steps"; compared with the whole run it is equal,
    its totals are the hand count of the other steps', and stderr and --json name it."""
    from commspan.analysis.diff import OUTSIDE_STEPS, profile
    from commspan.exporters import read_spans

    whole = write_run(tmp_path / "whole", "w", net_step(), steps=(0, 1, 2), ranks=(0, 1))
    kept = without_step_ends(whole, tmp_path / "cut", (1,))
    code, out, err = run_cli(capsys, "diff", str(whole), str(tmp_path / "cut"), "--json")
    data = json.loads(out)
    assert (code, data["equal"]) == (0, True), out
    assert data["b"]["cut_short"] == [{"rank": 0, "step": None}, {"rank": 1, "step": None}]
    assert data["a"]["cut_short"] == []
    assert "B: a step of ranks 0-1 was cut short" in err and "2 step(s) left" in err
    cut = profile(read_spans(tmp_path / "cut"))
    assert cut.steps == 2 and kept > 0
    assert sum(u.total_count for u in cut.usage.values()) == kept
    assert not any(OUTSIDE_STEPS in phase for _, phase, _ in cut.usage)


def test_sides_of_other_ranks_are_said_to_sum_other_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """One rank's file against the folder of four: every count differs by the number
    of ranks summed, which stderr now says (with --rank as the way out); sides of the
    same ranks, or one rank picked, say nothing."""
    run = write_run(tmp_path / "run", "r", net_step(), ranks=(0, 1, 2, 3))
    one = run / "commspan-rank0.jsonl"
    assert one.exists()
    code, _, err = run_cli(capsys, "diff", str(one), str(run))
    assert code == 1
    assert ("commspan: A holds ranks 0 and B ranks 0-3: each side's counts are summed "
            "over its own ranks; compare one rank of both with --rank N") in err
    for argv in ([str(run), str(run)], [str(one), str(run), "--rank", "0"]):
        code, _, err = run_cli(capsys, "diff", *argv)
        assert code == 0 and "summed over" not in err, err


def test_a_side_whose_every_step_was_cut_short_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """`diff DIR --step 0 --step 1` where rank 1's rank span of step 1 is lost (it went
    on to step 2: step 1 was cut short on it): B's only step is left out, so B is
    empty. diff compared it as a side with no collective ("5 removed"), said "counts
    per step over the 1 step(s) left" (there were none) and exited 1; it is an error
    naming the side and the step (status 2, nothing on stdout). With a step that
    ended beside it, the cut step is left out as before."""
    run = write_run(tmp_path / "run", "r", net_step(), steps=(0, 1, 2), ranks=(0, 1))
    _lose_rank_span(run / "commspan-rank1.jsonl", step=1)
    code, out, err = run_cli(capsys, "diff", str(run), "--step", "0", "--step", "1")
    assert (code, out) == (2, "")
    assert err.startswith("ValueError: B: every step selected was cut short (step 1 of "
                          "rank 1: "), err
    code, out, err = run_cli(capsys, "diff", str(run), "--steps", "0-0", "--steps", "1-2")
    assert code == 0 and "step 1 of rank 1 was cut short" in err, (out, err)


def test_a_step_cut_short_is_named_when_it_alone_is_selected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """Rank 1's rank span of step 1 is lost and it went on to step 2: step 1 was cut
    short on it. Selected alone (`--step 1`), the records kept no longer showed that
    rank 1 went on, so step 1 passed for a last step still running: `summary --rank 1
    --step 1` said `total 0` with no word, and `diff --step 0 --step 1` compared rank
    1's partial step as a whole one. Read from the lines and from digests alike."""
    from commspan.analysis.digest import write_digest

    run = write_run(tmp_path / "run", "r", net_step(), steps=(0, 1, 2), ranks=(0, 1))
    _lose_rank_span(run / "commspan-rank1.jsonl", step=1)
    digested = tmp_path / "digested"
    digested.mkdir()
    for f in run.glob("*.jsonl"):
        (digested / f.name).write_bytes(f.read_bytes())
        write_digest(digested / f.name)
    for folder in (run, digested):
        code, out, err = run_cli(capsys, "summary", str(folder), "--rank", "1", "--step", "1",
                                 "--json")
        assert json.loads(out)["partial"] == [{"rank": 1, "step": 1}], folder
        assert "step 1 of rank 1 was cut short" in err
        # the report says so too (it said the step had not ended when read)
        page = tmp_path / f"{folder.name}.html"
        code, out, err = run_cli(capsys, "html", str(folder), "--step", "1", "-o", str(page))
        assert code == 0, err
        note = page.read_text()
        assert "Step 1 of rank 1 was cut short" in note and "had not ended" not in note
    code, out, err = run_cli(capsys, "diff", str(run), "--step", "0", "--step", "1")
    assert (code, out) == (2, "") and "B: every step selected was cut short" in err


def _lose_rank_span(path: Path, step: int) -> None:
    """Remove the ``commspan.rank`` span of ``step`` from a rank's file."""
    mark = {"key": "commspan.step", "value": {"intValue": str(step)}}
    docs = [json.loads(line) for line in path.read_bytes().splitlines()]
    for doc in docs:
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                ss["spans"] = [s for s in ss["spans"] if not (
                    s["name"] == "commspan.rank" and mark in s["attributes"])]
    path.write_bytes(b"".join(json.dumps(d).encode() + b"\n" for d in docs))


def _dumped_in_step_2(run: Path) -> Path:
    """Ranks 0 and 1 of :func:`net_step` over steps 0-2, each writing a hang record
    (``mode.dump()``) in step 2; every step ends."""
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    step_fn = net_step()
    for rank in (0, 1):
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(run / f"commspan-rank{rank}.jsonl")],
            run_id="hung", resource_attributes={"commspan.rank": rank})
        with mode:
            for step in (0, 1, 2):
                with mode.step(step):
                    step_fn(rank, step)
                    if step == 2:
                        mode.dump()  # the hang record, naming step 2
        mode.shutdown()
    return run


def test_a_side_whose_only_step_hung_on_every_rank_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """Every rank wrote a hang record in step 2 and no rank or step span of it (the
    job hung there, as `examples/hang_and_straggler.py --only hang` leaves it):
    `diff DIR --step 0 --step 2` compared step 0 with an empty side ("3 removed", exit
    1), for no span of step 2 but the hang records says it is a step. It is the error
    docs/cli.md shows for that command (status 2, nothing on stdout)."""
    run = _dumped_in_step_2(tmp_path / "run")
    hung = tmp_path / "hung"
    without_step_ends(run, hung, (2,))
    code, out, err = run_cli(capsys, "diff", str(hung), "--step", "0", "--step", "2")
    assert (code, out) == (2, ""), (out, err)
    assert err.startswith("ValueError: B: every step selected was cut short (step 2 of "
                          "ranks 0-1: "), err
    # a step that ended beside it: the hung step is left out, as before
    code, out, err = run_cli(capsys, "diff", str(hung), "--steps", "0-0", "--steps", "1-2")
    assert code == 0 and "step 2 of ranks 0-1 was cut short" in err, (out, err)


def test_stragglers_names_a_step_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """`commspan stragglers` on a run that hung in step 2 said nothing of it, while
    summary, table and diff named it on stderr: its step-time table just had a step
    fewer per rank. It names the step now (under --step too: judged on the whole run),
    and --json lists it; a run whose steps all ended names none."""
    run = _dumped_in_step_2(tmp_path / "run")
    code, out, err = run_cli(capsys, "stragglers", str(run), "--json")
    assert code == 0 and json.loads(out)["cut_short"] == [] and "cut short" not in err, err
    hung = tmp_path / "hung"
    without_step_ends(run, hung, (2,))
    code, out, err = run_cli(capsys, "stragglers", str(hung))
    assert code == 0, err
    assert "step 2 of ranks 0-1 was cut short" in err and "the step times leave it out" in err
    code, out, err = run_cli(capsys, "stragglers", str(hung), "--json")
    data = json.loads(out)
    assert data["cut_short"] == [{"rank": 0, "step": 2}, {"rank": 1, "step": 2}]
    assert sorted((row["rank"], row["step"]) for row in data["step_times"]) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    code, _, err = run_cli(capsys, "stragglers", str(hung), "--step", "2")
    assert code == 0 and "step 2 of ranks 0-1 was cut short" in err, err
    code, out, err = run_cli(capsys, "stragglers", str(hung), "--step", "1", "--json")
    assert code == 0 and json.loads(out)["cut_short"] == [] and "cut short" not in err


def _trace_run(out: Path, run_id: str, step_fn: Any, steps: range,
               hang_at: tuple[int, int]) -> None:
    """Like ``write_run`` (4 ranks), with a hang record written (``mode.dump()``) by rank
    ``hang_at[0]`` in step ``hang_at[1]``."""
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    for rank in range(4):
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(out / f"commspan-rank{rank}.jsonl")],
            run_id=run_id, resource_attributes={"commspan.rank": rank})
        with mode:
            for step in steps:
                with mode.step(step):
                    step_fn(rank, step)
                    if (rank, step) == hang_at:
                        mode.dump()
        mode.shutdown()


def _damage_collective_line(path: Path, run_id: str, step: int) -> int:
    """Make garbage of the first line of ``path`` holding a collective of ``step`` of run
    ``run_id``; returns its number. The step's rank span stays whole: when the exporter
    batched it into that line, it is moved to a line of its own after it first (else
    the step would be cut short on that rank in some runs and not in others)."""
    lines = path.read_bytes().splitlines(keepends=True)
    mark = {"key": "commspan.step", "value": {"intValue": str(step)}}
    run = {"key": "commspan.run_id", "value": {"stringValue": run_id}}
    spans = [(n, rs, s) for n, raw in enumerate(lines) for rs in json.loads(raw)["resourceSpans"]
             for ss in rs["scopeSpans"] for s in ss["spans"]]
    trace = next(s["traceId"] for _, rs, s in spans if s["name"] == "commspan.rank"
                 and mark in s["attributes"] and run in rs["resource"]["attributes"])
    n = next(n for n, _, s in spans if s["traceId"] == trace and any(
        a["key"] == "commspan.collective.op" for e in s.get("events", ())
        for a in e["attributes"]))
    doc = json.loads(lines[n])
    kept = []
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            ranks = [s for s in ss["spans"]
                     if s["name"] == "commspan.rank" and s["traceId"] == trace]
            if ranks:
                kept.append({"resource": rs["resource"],
                             "scopeSpans": [{**ss, "spans": ranks}]})
    lines[n] = b'{"resourceSpans": [garbage\n'
    if kept:
        lines.insert(n + 1, json.dumps({"resourceSpans": kept}).encode() + b"\n")
    path.write_bytes(b"".join(lines))
    return n + 1


@pytest.fixture(scope="module")
def streamed_runs(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> dict[str, Any]:
    """A: 4 ranks, steps 0-3, one all_reduce more on rank 1 in step 2. B: an earlier run
    ("first") and the run compared ("second", steps 0-4, one all_reduce more on rank 2
    in step 3), rank 0 writing a hang record in step 1, rank 3's rank span of step 2
    lost (cut short: it went on), and a line of rank 1 holding a collective of step 3
    damaged (which other steps it held depends on how the exporter batched them)."""
    a = tmp_path_factory.mktemp("streamed-a")
    b = tmp_path_factory.mktemp("streamed-b")
    write_run(a, "a", net_step(extra_on=(1, 2)), steps=range(4))
    write_run(b, "first", net_step(), steps=range(2))
    _trace_run(b, "second", net_step(extra_on=(2, 3)), range(5), hang_at=(0, 1))
    _lose_rank_span(b / "commspan-rank3.jsonl", step=2)
    line = _damage_collective_line(b / "commspan-rank1.jsonl", "second", 3)
    return {"a": a, "b": b, "damaged": (b / "commspan-rank1.jsonl", line)}


def _held_in_memory(path: Path, run: str | None, steps: Any, rank: int | None) -> Any:
    """One side as diff computed it before it folded the spans as it read them: every
    span of the files held, selected, then profiled."""
    from commspan.analysis.diff import profile
    from commspan.analysis.runs import select
    from commspan.exporters import read_spans
    from commspan.otlpjson.records import ReadReport

    records = list(read_spans(path, strict=False, report=ReadReport()))
    sel = select(records, run=run, steps=steps)
    return sel, profile(sel.records, rank=rank, last_traces=sel.last_traces)


_STREAMED_CASES = [
    # (A, B, runs, steps, rank): as the command line takes them
    ("a", "b", (None, None), (None, None), None),
    ("a", "b", (None, None), (None, None), 2),
    ("b", None, (None, None), ((0, 0), (3, 4)), None),
    ("b", None, (None, None), ((2, 4), (3, 3)), 0),
    ("a", "b", (None, None), ((1, 2), (2, 4)), None),
    ("b", None, ("first", "second"), ((0, 1), (1, 1)), None),
    ("b", None, ("first", "second"), (None, None), 1),
]


@pytest.mark.parametrize(("a", "b", "runs", "steps", "rank"), _STREAMED_CASES)
def test_the_streamed_diff_is_the_diff_of_every_span_held(
    streamed_runs: dict[str, Any], capsys: pytest.CaptureFixture[str], a: str, b: str | None,
    runs: tuple[str | None, str | None], steps: tuple[Any, Any], rank: int | None,
) -> None:
    """`diff` folds each file's spans as it reads them (a 1,024-rank run held took more
    memory than the machine had): on multi-rank runs with differences, a second run in
    the folder, a hang record from before the steps selected, a step cut short on one
    rank and a damaged line, its text and JSON are those computed from every span held
    (read, selected, profiled: what diff did before), side by side and for one rank."""
    from commspan.analysis.diff import diff
    from commspan.analysis.runs import StepRange, format_numbers
    from commspan.render.diff import format_diff

    paths = [streamed_runs[a], streamed_runs[b or a]]
    argv = ["diff", str(paths[0]), *([str(paths[1])] if b else [])]
    for run in runs:
        argv += ["--run", run] if run else []
    for s in steps:
        argv += ["--steps", f"{s[0]}-{s[1]}"] if s else []
    argv += ["--rank", str(rank)] if rank is not None else []
    sides = [_held_in_memory(path, run, StepRange(*s) if s else None, rank)
             for path, run, s in zip(paths, runs, steps)]
    expected = diff(sides[0][1], sides[1][1])
    code, out, err = run_cli(capsys, *argv, "--json")
    data = json.loads(out)
    assert code == 2 if "b" in (a, b) else (0 if expected.equal else 1), err
    assert {k: data[k] for k in ("equal", "counts", "entries")} == expected.to_dict()
    for key, (sel, prof) in zip("ab", sides):
        assert data[key]["run"] == sel.run.run_id and data[key]["steps"] == list(sel.steps)
        assert data[key]["ranks"] == list(prof.ranks)
        assert data[key]["cut_short"] == [{"rank": r, "step": st} for r, st in prof.cut_short]
    code, text, err_text = run_cli(capsys, *argv)
    assert err_text == err
    labels = []
    for name, path, (sel, _) in zip("AB", paths, sides):
        ranks = [rank] if rank is not None else {r.rank for r in sel.records
                                                 if r.rank is not None}
        labels.append(f"{name}: {path} (run {sel.run.run_id}, ranks {format_numbers(ranks)}, "
                      f"steps {format_numbers(sel.steps)})")
    assert text.rstrip("\n") == format_diff(expected, *labels)
    if "b" in (a, b):  # the damaged line is named, and the steps it may have held
        path, line = streamed_runs["damaged"]
        assert f"ValueError: {path}:{line}: " in err
        # (which steps besides 3 the line held depends on how the exporter batched)
        if any(sel.run.run_id == "second" and 3 in sel.steps
               for (sel, _), side in zip(sides, (a, b or a)) if side == "b"):
            assert f"{path}:{line} is damaged: rank 1's collectives of step" in err, err


def test_the_profile_builder_folds_what_select_and_profile_keep(
    streamed_runs: dict[str, Any],
) -> None:
    """ProfileBuilder, span by span, against select() and profile() of every span held:
    the same selection (run, runs, steps, note, each rank's last trace), the traces,
    ranks and each rank's last step of the spans kept, and the same profile, for every
    run, step range and rank of run B (a hang record from before the steps, a step cut
    short on one rank, a damaged line)."""
    from commspan.analysis.diff import ProfileBuilder
    from commspan.analysis.runs import SelectionError, StepRange
    from commspan.analysis.summary import last_steps
    from commspan.exporters import read_spans
    from commspan.otlpjson.records import ReadReport

    path = streamed_runs["b"]
    held = list(read_spans(path, strict=False, report=ReadReport()))
    compared = 0
    for rank in (None, 0, 3):
        builder = ProfileBuilder(rank)
        builder.hold(read_spans(path, strict=False, report=ReadReport()))
        for run in (None, "first", "second"):
            for steps in (None, *(StepRange(f, t) for f in range(5) for t in range(f, 5))):
                try:
                    sel, expected = _held_in_memory(path, run, steps, rank)
                except SelectionError as exc:
                    with pytest.raises(SelectionError, match=str(exc.detail)):
                        builder.select(run, steps)
                    continue
                except ValueError as exc:  # every step selected was cut short
                    side = builder.select(run, steps)
                    with pytest.raises(ValueError) as caught:
                        side.profile()
                    assert str(caught.value) == str(exc)
                    continue
                side = builder.select(run, steps)
                got = side.selection
                assert (got.run, got.runs, got.steps, got.note, got.last_traces) == (
                    sel.run, sel.runs, sel.steps, sel.note, sel.last_traces)
                assert side.traces == {r.trace_id for r in sel.records}
                assert side.ranks() == {r.rank for r in sel.records if r.rank is not None}
                assert side.module_ranks() == {r.rank for r in sel.records
                                               if "commspan.module.fqn" in r.attributes}
                named = ("commspan.step", "commspan.rank", "commspan.hang")
                assert side.last_steps() == last_steps(
                    (r.rank, r.trace_id, r.attributes.get("commspan.step")
                     if r.name in named and type(r.attributes.get("commspan.step")) is int
                     else None) for r in sel.records)
                assert side.profile() == expected
                compared += 1
                if steps == StepRange(2, 4) and run != "first":
                    # rank 0's hang record of step 1 is kept, as select keeps it, and
                    # rank 3's step 2 was cut short
                    assert any(r.name == "commspan.hang" and r.trace_id not in {
                        h.trace_id for h in sel.records if h.name == "commspan.rank"}
                        for r in sel.records)
                    assert (3, 2) in expected.cut_short
    assert compared > 40 and len(held) > 100


def test_diff_holds_no_span_once_read(
    streamed_runs: dict[str, Any], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the two sides are compared, the span records read are gone but the hang
    records (one here): diff held every span of both sides until the end, which took
    more memory than a 24 GB machine has over two 1,024-rank runs."""
    import gc
    import weakref

    import commspan.analysis.diff as diff_module
    import commspan.cli.commands as commands

    read = commands.read_spans_in
    seen: list[Any] = []

    def tracked(*args: Any, **kwargs: Any) -> Any:
        for span in read(*args, **kwargs):
            seen.append(weakref.ref(span))
            yield span

    compare = diff_module.diff
    alive: list[int] = []

    def counting(a: Any, b: Any) -> Any:
        gc.collect()
        alive.append(sum(ref() is not None for ref in seen))
        return compare(a, b)

    monkeypatch.setattr(commands, "read_spans_in", tracked)
    monkeypatch.setattr(diff_module, "diff", counting)
    code, out, _ = run_cli(capsys, "diff", str(streamed_runs["a"]), str(streamed_runs["b"]))
    assert code == 2 and out
    assert len(seen) > 100 and alive == [1]


def test_one_rank_whose_file_ends_early_is_divided_by_its_own_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """B's rank 0 wrote step 0 only (a rank that stopped), the others steps 0-2. ``diff A
    B --rank 0`` compares rank 0's counts per step: the same as A's, divided by the one
    step it wrote, not by the three of the run (it said "count 1 => 0.333" for every
    row, status 1, stderr empty), and says so on stderr."""
    from _cli_runs import write_run

    a = write_run(tmp_path / "a", "early", net_step(), steps=(0, 1, 2))
    b = write_run(tmp_path / "b", "early", net_step(), steps=(0, 1, 2), ranks=(1, 2, 3))
    write_run(b, "early", net_step(), steps=(0,), ranks=(0,))
    code, out, err = run_cli(capsys, "diff", str(a), str(b), "--rank", "0")
    assert (code, out.splitlines()[-1].split(":")[0]) == (0, "no difference"), (out, err)
    assert ("commspan: B: rank 0's spans end at step 0: its counts are per step of the 1 it "
            "wrote, of the 3 selected") in err.splitlines(), err
    code, out, _ = run_cli(capsys, "diff", str(a), str(b), "--rank", "1")
    assert code == 0 and "no difference" in out
