"""The `commspan` command on every command: --version, --run, --step/--steps, --json,
--show, and a folder holding several runs (never summed silently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli_runs import (
    net_step,
    run_cli,
    session_dir,
    tp_run,
    write_run,
)

from commspan import __version__
from commspan.cli import main

COMMANDS = ("table", "summary", "html", "perfetto", "check", "stragglers")



def _argv(command: str, path: Path, tmp_path: Path, *more: str) -> list[str]:
    argv = [command, str(path), *more]
    if command in ("table", "summary"):
        argv += ["--rank", "all"]
    if command in ("html", "perfetto"):
        argv += ["-o", str(tmp_path / f"out.{command}")]
    return argv



@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """4 ranks, steps 0-2 of the tensor-parallel toy Transformer (run "tp-run")."""
    return tp_run(tmp_path_factory)

@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """One folder, two runs of 4 ranks appended to the same files: "first" (steps 0-1,
    one forward and one backward all_reduce per step and rank) then "second" (steps 0-2,
    twice that)."""
    def build(out: Path) -> None:
        write_run(out, "first-run", net_step(), steps=(0, 1))
        twice = net_step()

        def step(rank: int, index: int) -> None:
            twice(rank, index)
            twice(rank, index)

        write_run(out, "second-run", step, steps=(0, 1, 2))

    return session_dir(tmp_path_factory, "runs-two", build)


@pytest.fixture(scope="module")
def one_id_two_jobs(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """Two jobs under one run id ("exp1", as a fixed COMMSPAN_RUN_ID gives), appended to
    the same files by two processes (their resources' process.pid)."""
    def build(out: Path) -> None:
        for pid in (1001, 1002):
            write_run(out, "exp1", net_step(), steps=(0, 1), resource={"process.pid": pid})

    return session_dir(tmp_path_factory, "runs-one-id", build)


@pytest.mark.parametrize("command", COMMANDS)
def test_two_jobs_under_one_run_id_are_flagged(
    one_id_two_jobs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Every command says that the run was written by two processes for one rank and
    that its steps are added up (they used to be summed without a word)."""
    code, _, err = run_cli(capsys, *_argv(command, one_id_two_jobs, tmp_path, "--json"))
    assert code == 0, err
    assert err.splitlines() == [
        "commspan: run exp1 was written by 2 processes for one rank (two jobs under one "
        "run id: a fixed COMMSPAN_RUN_ID or run_id=): their steps are added up; give each "
        "job its own run id"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the package version and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"commspan {__version__}\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_several_runs_pick_the_latest_and_say_so(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Every command reads only the latest run of a folder holding two, and says so on
    stderr, naming both runs and --run."""
    code, out, err = run_cli(capsys, *_argv(command, two_runs, tmp_path, "--json"))
    assert code == 0, err
    assert err.splitlines()[0] == (
        "commspan: the files hold 2 runs: first-run (ranks 0-3, steps 0-1); second-run "
        "(ranks 0-3, steps 0-2); showing the latest, second-run (--run ID picks another)")
    assert len(err.splitlines()) == 1
    _assert_read(command, json.loads(out), "second-run", 4 * 3 * 2)  # 4 ranks, 3 steps, 2 each


def _assert_read(command: str, data: dict[str, object], run: str, per_phase: int) -> None:
    """The --json of ``command`` says it read ``run`` (table: by its counts per phase)."""
    if command == "table":
        assert data["counts"] == {"forward": {"all_reduce": per_phase},
                                  "backward": {"all_reduce": per_phase}}
    else:
        assert data["run"] == run


@pytest.mark.parametrize("command", COMMANDS)
def test_run_option_picks_a_run(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--run ID (or a unique start of it) reads that run only; nothing on stderr."""
    code, out, err = run_cli(capsys, *_argv(command, two_runs, tmp_path, "--run", "first",
                                         "--json"))
    assert (code, err) == (0, "")
    _assert_read(command, json.loads(out), "first-run", 4 * 2 * 1)  # 4 ranks, 2 steps, 1 each


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_run_is_one_line(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--run naming no run (or several) lists the runs there are; exit 1 (check: 2)."""
    code, out, err = run_cli(capsys, *_argv(command, two_runs, tmp_path, "--run", "nope"))
    assert (code, out) == (2 if command == "check" else 1, "")
    assert err == ("ValueError: --run nope: no such run in the files (runs: first-run (ranks "
                   "0-3, steps 0-1); second-run (ranks 0-3, steps 0-2))\n")
    code, _, err = run_cli(capsys, *_argv(command, two_runs, tmp_path, "--run", "s"))
    assert code == 0  # "s" starts only second-run
    code, _, err = run_cli(capsys, *_argv(command, two_runs, tmp_path, "--run", "f"))
    assert code == 0


@pytest.mark.parametrize("command", (*COMMANDS, "diff"))
def test_an_empty_run_id_says_what_it_names_and_lists_the_runs(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--run '' (an empty shell variable) names the run of spans without a run id: when
    the files hold none, one line names --run and the value, says so, and lists the run
    ids to pass; exit 1 (check, diff: 2)."""
    argv = (["diff", str(two_runs), str(two_runs), "--run", ""] if command == "diff" else
            _argv(command, two_runs, tmp_path, "--run", ""))
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (2 if command in ("check", "diff") else 1, "")
    assert err == (
        f"ValueError: {'A: ' if command == 'diff' else ''}--run '': an empty run id names "
        "the run of commspan spans without a run id, and the files hold none; pass one of their "
        "run ids, or the start of one (runs: first-run (ranks 0-3, steps 0-1); second-run "
        "(ranks 0-3, steps 0-2)), or leave it out to read the latest run\n")


@pytest.mark.parametrize("command", COMMANDS)
def test_step_and_steps_select(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--step N and --steps A-B keep those steps only; a step not in the run is one line
    naming the steps there are."""
    code, out, _ = run_cli(capsys, *_argv(command, tp, tmp_path, "--step", "1", "--json"))
    one = json.loads(out)
    code2, out, _ = run_cli(capsys, *_argv(command, tp, tmp_path, "--steps", "1-2", "--json"))
    two = json.loads(out)
    assert code == code2 == 0
    if command == "table":
        assert two["counts"]["forward"]["all_reduce"] == 2 * one["counts"]["forward"][
            "all_reduce"]
    elif command in ("summary", "html", "perfetto"):
        assert (one["steps"], two["steps"]) == ([1], [1, 2])
    elif command == "check":
        assert (one["checked"]["steps"], two["checked"]["steps"]) == (1, 2)
    else:
        assert {s["step"] for s in one["step_times"]} == {1}
        assert {s["step"] for s in two["step_times"]} == {1, 2}
    code, out, err = run_cli(capsys, *_argv(command, tp, tmp_path, "--step", "7"))
    assert (code, out) == (2 if command == "check" else 1, "")
    assert err == "ValueError: --step 7: not in run tp-run, which has steps 0-2\n"
    code, out, err = run_cli(capsys, *_argv(command, tp, tmp_path, "--steps", "5-9"))
    assert err == "ValueError: --steps 5-9: none of them is in run tp-run, which has steps 0-2\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["table", "X", "--step", "x"], "--step 'x' is not valid; pass a step number (or"),
        (["table", "X", "--steps", "3-1"], "--steps '3-1' is not valid; pass A-B with A <= B"),
        (["table", "X", "--steps", "a-b"], "--steps 'a-b' is not valid"),
        (["table", "X", "--step", "1", "--steps", "1-2"], "not allowed with argument"),
        (["check", "X", "--step", "1", "--step", "2"],
         "--step given 2 times; it can be given once"),
        (["summary", "X", "--run", "a", "--run", "b"],
         "--run given 2 times; it can be given once"),
        (["table", "X", "--show", "colour"],
         "--show 'colour' is not valid; pass a comma-separated"),
        (["html", "X"], "the following arguments are required: -o/--output"),
        (["stragglers", "X", "--top", "0"], "--top '0' is not valid"),
        # what int() reads as a number but is a typo: an underscore, another script's digit
        (["table", "X", "--step", "1_0"], "--step '1_0' is not valid"),
        (["table", "X", "--step", "\u0661"], "--step '\u0661' is not valid"),
        (["table", "X", "--steps", "0-1_0"], "--steps '0-1_0' is not valid"),
        (["table", "X", "--rank", "1_0"], "--rank '1_0' is not valid"),
        (["stragglers", "X", "--top", "\u0663"], "--top '\u0663' is not valid"),
    ],
)
def test_bad_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Bad option values are argparse usage errors: status 2, the rule in the message."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_summary_lists_the_runs(two_runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`summary` lists every run of the folder, the one shown starred; --json has them all."""
    code, out, _ = run_cli(capsys, "summary", str(two_runs), "--rank", "all")
    assert code == 0
    lines = out.splitlines()
    assert lines[-3:] == [
        "runs: 2 (* shown; --run ID picks another)",
        f"  first-run (ranks 0-3, steps 0-1), {_spans(two_runs, 'first-run')} spans",
        f"* second-run (ranks 0-3, steps 0-2), {_spans(two_runs, 'second-run')} spans",
    ]
    _, out, _ = run_cli(capsys, "summary", str(two_runs), "--rank", "all", "--json")
    runs = json.loads(out)["runs"]
    assert [(r["run_id"], r["ranks"], r["steps"]) for r in runs] == [
        ("first-run", [0, 1, 2, 3], [0, 1]), ("second-run", [0, 1, 2, 3], [0, 1, 2])]


def _spans(path: Path, run: str) -> int:
    from commspan.exporters import read_spans

    return sum(1 for s in read_spans(*sorted(path.glob("*.jsonl")))
               if s.resource.get("commspan.run_id") == run)


def test_table_show_bytes_groups_placements(
    tp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`table --show all`: under each module, what it issued itself with process group,
    mesh dim, bytes, placements and time ('-' when not recorded)."""
    code, out, _ = run_cli(capsys, "table", str(tp), "--rank", "0", "--show", "all")
    assert code == 0
    lines = out.splitlines()
    wo = lines.index("        Transformer.layers.0.attention.wo")
    assert lines[wo + 1:wo + 3] == [
        "          *forward: all_reduce 3",
        "          issued: forward all_reduce x3  group 0 (mesh dim 0, ranks 0-3)  3,072 B  "
        "P(sum) -> R  time -",
    ]
    code, out, _ = run_cli(capsys, "table", str(tp), "--rank", "0", "--show", "bytes")
    assert "          issued: forward all_reduce x3  3,072 B" in out.splitlines()


def test_summary_show_columns(tp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`summary --show bytes,groups,time`: one row per phase, op and group, with bytes
    and time; the first line is unchanged."""
    _, plain, _ = run_cli(capsys, "summary", str(tp), "--rank", "0")
    code, out, _ = run_cli(capsys, "summary", str(tp), "--rank", "0", "--show",
                        "bytes,groups,time")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == plain.splitlines()[0]
    assert lines[1].split() == ["phase", "op", "group", "count", "bytes", "time"]
    fwd = [ln.split() for ln in lines if ln.startswith("forward   all_reduce")]
    # per step: tok_embeddings (1,024 B), pos_embeddings (512 B), wo and w2 of 2 blocks
    # (1,024 B each) all-reduce in forward; 3 steps
    assert fwd == [["forward", "all_reduce", "0", "(mesh", "dim", "0,", "ranks", "0-3)", "18",
                    "16,896", "B", "-"]]
    assert lines[-1].split()[0] == "total"


def test_json_everywhere(tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every command's --json is one JSON document with its documented keys."""
    keys = {
        "table": {"fqn", "type", "counts", "parameters", "children"},
        "summary": {"spans", "traces", "ranks", "steps", "collectives", "total", "partial",
                    "run", "runs", "world_size", "rank_sample", "missing_ranks"},
        "html": {"output", "bytes", "run", "ranks", "steps"},
        "perfetto": {"output", "bytes", "run", "ranks", "steps"},
        "check": {"findings", "checked", "run"},
        "stragglers": {"stragglers", "ranks", "step_times", "checked", "cut_short", "run"},
    }
    for command in COMMANDS:
        code, out, err = run_cli(capsys, *_argv(command, tp, tmp_path, "--json"))
        assert (code, err) == (0, ""), command
        assert set(json.loads(out)) == keys[command], command
    code, out, _ = run_cli(capsys, "diff", str(tp), str(tp), "--json")
    assert code == 0 and set(json.loads(out)) == {"equal", "counts", "entries", "a", "b"}
    # with --show, table and summary say what each module issued itself
    _, out, _ = run_cli(capsys, "table", str(tp), "--rank", "0", "--json", "--show", "all")
    nodes, todo = {}, [json.loads(out)]
    while todo:
        node = todo.pop()
        nodes[node["fqn"]] = node
        todo.extend(node["children"])
    wo = nodes["Transformer.layers.0.attention.wo"]
    assert nodes["Transformer.layers.0.attention"]["issued"] == []  # counts its children's
    assert wo["issued"] == [{
        "fqn": wo["fqn"], "phase": "forward", "op": "all_reduce", "group": "0",
        "group_ranks": [0, 1, 2, 3], "mesh_dim": 0, "src": "P(sum)", "dst": "R", "count": 3,
        "bytes": 3072, "duration_ns": None, "timed": 0, "ranks": [0], "mesh_dim_name": ""}]
    _, out, _ = run_cli(capsys, "summary", str(tp), "--rank", "0", "--json", "--show", "all")
    issued = json.loads(out)["issued"]
    assert sum(i["count"] for i in issued) == json.loads(out)["total"]


def test_summary_time_of_partly_timed_collectives_says_how_many() -> None:
    """A phase whose collectives are timed only in part shows the partial sum with "(2
    of 3 timed)", as `table --show time` does, not as the phase's time."""
    from commspan.analysis.issued import Issued
    from commspan.render.details import summary_rows

    def row(count: int, timed: int) -> Issued:
        return Issued("Net", "forward", "all_reduce", "0", (0, 1), None, "", "", count, 8,
                      1_000_000 * timed, timed, (0,))

    lines = summary_rows([row(3, 2)], ["time"])
    assert lines[1].split() == ["forward", "all_reduce", "3", "2.00", "ms", "(2", "of", "3",
                                "timed)"]
    assert summary_rows([row(3, 3)], ["time"])[1].split()[-2:] == ["3.00", "ms"]
    assert summary_rows([row(3, 0)], ["time"])[1].split()[-1] == "-"


@pytest.fixture(scope="module")
def negative_steps(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """Steps -2 to 1 (a warm-up numbered below 0): one all_reduce forward and one
    backward per step and rank."""
    return session_dir(tmp_path_factory, "runs-negative",
                       lambda out: write_run(out, "warm", net_step(), steps=(-2, -1, 0, 1)))


def test_steps_below_zero_can_be_selected_and_read(
    negative_steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mode.step(-2) is accepted, so the commands take such steps too (--step refused
    them) and print their ranges unambiguously ("-2..1", not "-2-1")."""
    code, out, _ = run_cli(capsys, "summary", str(negative_steps), "--rank", "all")
    assert code == 0 and "steps: -2..1" in out.splitlines()[0]
    totals = {}
    for args in (["--step", "-2"], ["--steps=-2--1"], ["--steps=-2..1"], ["--steps", "0-1"],
                 ["--steps", "-2..1"], ["--steps", "-2--1"]):
        code, out, err = run_cli(capsys, "summary", str(negative_steps), "--rank", "all",
                                 "--json", *args)
        assert code == 0, (args, err)
        totals[args[-1]] = json.loads(out)["total"]
    per_step = totals["-2"]
    assert per_step > 0
    assert totals == {"-2": per_step, "--steps=-2--1": 2 * per_step,
                      "--steps=-2..1": 4 * per_step, "0-1": 2 * per_step,
                      "-2..1": 4 * per_step, "-2--1": 2 * per_step}  # (no = needed)
    code, out, _ = run_cli(capsys, "diff", str(negative_steps), "--step", "-2", "--step", "1")
    assert code == 0 and "no difference" in out
    code, _, err = run_cli(capsys, "summary", str(negative_steps), "--steps=-9..-5")
    assert code == 1 and "--steps -9..-5: none of them is in" in err, err  # (not "-9--5")
    assert "which has steps -2..1" in err, err


def test_the_python_api_reads_one_run_of_a_folder_as_the_command_line_does(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``check_run`` and ``stragglers`` of a folder holding two runs check the latest
    and warn, as ``commspan check`` and ``commspan stragglers`` do, and ``run=`` picks
    the other; they used to sum both runs without a word."""
    from commspan.analysis import check_run, stragglers

    for run in (None, "first-run"):
        more = ("--run", run) if run else ()
        with caplog.at_level("WARNING", logger="commspan"):
            caplog.clear()
            checked = check_run(two_runs, run=run).to_dict()["checked"]
            late = stragglers(two_runs, run=run).to_dict()["checked"]
        warned = [r.getMessage() for r in caplog.records]
        code, out, _ = run_cli(capsys, "check", str(two_runs), "--json", *more)
        assert code == 0 and json.loads(out)["checked"] == checked
        code, out, _ = run_cli(capsys, "stragglers", str(two_runs), "--json", *more)
        assert code == 0 and json.loads(out)["checked"] == late
        if run is None:
            assert len(warned) == 2 and all(  # one per call
                "second-run" in w and "first-run" in w for w in warned), warned
        else:
            assert warned == []
    with pytest.raises(ValueError, match="run='nope' is not valid"):
        check_run(two_runs, run="nope")


def test_the_python_api_says_what_an_empty_run_id_names(two_runs: Path) -> None:
    """run='' of files without spans lacking a run id: load_run, check_run and
    Aggregator.from_jsonl say that '' names those spans and list the run ids to pass."""
    from commspan import Aggregator
    from commspan.analysis import check_run, load_run

    for read in (load_run, check_run):
        with pytest.raises(ValueError, match=r"run='' is not valid: an empty run id names "
                           r"the run of commspan spans without a run id.*first-run.*second-run"):
            read(two_runs, run="")
    with pytest.raises(ValueError, match=r"run='' is not a run of these files; they hold "
                       r"'first-run', 'second-run'; '' is the run of spans without a run id, "
                       r"and they have none: pass one of their run ids"):
        Aggregator.from_jsonl(two_runs, rank="all", run="")


def test_show_groups_names_the_mesh_dimension_of_a_group_a_mesh_made(
    fake_pg: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain `dist.all_reduce` on the group of a 2-D mesh's `tp` dimension (as a
    training loop all-reduces over `mesh["tp"].get_group()`): `--show groups` names the
    dimension as the mesh does (`mesh.get_group("tp")` is that group), as
    `--by-mesh-dim` does; it said only the group's name and ranks."""
    import torch
    import torch.distributed as dist

    from commspan.testing import fake_mesh

    mesh = fake_mesh((2, 2), names=("dp", "tp"))
    tp_group = mesh.get_group("tp")

    def step(rank: int, index: int) -> None:
        dist.all_reduce(torch.ones(4), group=tp_group)

    write_run(tmp_path, "mesh-run", step, steps=(0,), ranks=(0,))
    code, out, _ = run_cli(capsys, "summary", str(tmp_path), "--show", "groups")
    assert code == 0
    ranks = dist.get_process_group_ranks(tp_group)
    label = f"{tp_group.group_name} (mesh dim tp, ranks {ranks[0]}-{ranks[-1]})"
    assert [line.split()[2:-1] for line in out.splitlines()[2:3]] == [label.split()]
    code, out, _ = run_cli(capsys, "table", str(tmp_path), "--by-mesh-dim")
    assert code == 0 and out.splitlines()[1].split()[0] == "tp"
