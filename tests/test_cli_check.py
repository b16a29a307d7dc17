"""`commspan check` and `commspan stragglers` on JSONL written by traced models: exit
statuses, text and JSON, errors as one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cli_runs import add_durations, net_step, run_cli, session_dir, write_run


@pytest.fixture(scope="module")
def consistent(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """4 ranks, steps 0-1, one forward and one backward all_reduce per step, everywhere."""
    return session_dir(tmp_path_factory, "check-ok", lambda out: write_run(
        out, "same", net_step()))


@pytest.fixture(scope="module")
def divergent(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """As ``consistent``, but rank 1 issues one more forward all_reduce in step 1."""
    return session_dir(tmp_path_factory, "check-bad", lambda out: write_run(
        out, "divergent", net_step(extra_on=(1, 1))))


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory, consistent: Path) -> Path:
    """``consistent`` with durations: at Net's collectives rank 2 waits 0.1 µs, the others
    5 µs (rank 2 arrives last)."""
    def build(out: Path) -> None:
        for f in consistent.glob("*.jsonl"):
            shutil.copy(f, out / f.name)
        add_durations(out, "Net", {2: 100}, 5_000)

    return session_dir(tmp_path_factory, "check-timed", build)


def test_consistent_run_exits_0(consistent: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank issued the same collectives: 'consistent', exit 0."""
    code, out, err = run_cli(capsys, "check", str(consistent))
    assert (code, err) == (0, "")
    assert out == ("consistent: checked 4 ranks, 1 group, 2 steps, 16 collectives, "
                   "0 p2p ops\n")


def test_divergent_run_exits_1(divergent: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's extra all_reduce: a mismatch in step 1, group 0, naming the module; exit 1;
    --json has the documented keys."""
    code, out, err = run_cli(capsys, "check", str(divergent))
    assert (code, err) == (1, "")
    first = out.splitlines()[0]
    assert first.startswith("mismatch") and "step 1" in first and "`Net`" in first
    code, out, _ = run_cli(capsys, "check", str(divergent), "--json")
    data = json.loads(out)
    assert code == 1 and set(data) == {"findings", "checked", "run"}
    finding = data["findings"][0]
    assert {"kind", "group", "seq", "step", "ranks", "message"} <= set(finding)
    assert (finding["kind"], finding["group"], finding["step"]) == ("mismatch", "0", 1)
    assert finding["ranks"]["1"]["fqn"] == "Net"
    code, _, _ = run_cli(capsys, "check", str(divergent), "--step", "0")
    assert code == 0  # step 0 is consistent


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "FileNotFoundError: FILES: '{p}' does not exist"),
        ("empty", "FileNotFoundError: FILES: directory '{p}' holds no *.jsonl or *.jsonl.gz file"),
        ("garbage", "ValueError: {p}:1: not a JSON line"),
        ("foreign", "ValueError: FILES: no commspan span in {p}"),
    ],
)
def test_unreadable_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, message: str
) -> None:
    """A missing path, an empty folder, a file that is not JSONL or holds no commspan span:
    one line on stderr, exit 2 (1 would mean findings)."""
    p = tmp_path / "x.jsonl"
    if setup == "empty":
        p = tmp_path
    elif setup == "garbage":
        p.write_text("garbage\n")
    elif setup == "foreign":
        p.write_text('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "GET /"}]}]}]}\n')
    for command in ("check", "stragglers"):
        code, out, err = run_cli(capsys, command, str(p))
        assert (code, out) == (2 if command == "check" else 1, ""), command
        assert err.startswith(message.format(p=p)) and err.count("\n") == 1, err


def test_damaged_lines_exit_2_after_the_result(
    consistent: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged line among good ones: check still prints its result, names the line, and
    exits 2 (the verdict does not cover the lost line)."""
    for f in consistent.glob("*.jsonl"):
        shutil.copy(f, tmp_path / f.name)
    rank0 = tmp_path / "commspan-rank0.jsonl"
    rank0.write_bytes(b"{oops\n" + rank0.read_bytes())
    code, out, err = run_cli(capsys, "check", str(tmp_path))
    assert code == 2
    assert out.startswith("consistent: ") or out.startswith("mismatch")
    assert err.splitlines()[0].startswith(f"ValueError: {rank0}:1: not a JSON line")
    assert err.splitlines()[-1].startswith("commspan: 1 damaged line(s) skipped")


def test_check_run_and_stragglers_read_past_a_damaged_line_with_strict_false(
    timed: Path, tmp_path: Path
) -> None:
    """From Python: a damaged line raises ValueError naming file and line and how to
    read on (``strict=False``); with it, check_run and stragglers give the answers of
    the intact run and the report names the skipped line."""
    from commspan.analysis import check_run, stragglers
    from commspan.exporters import ReadReport

    for f in timed.glob("*.jsonl"):
        shutil.copy(f, tmp_path / f.name)
    rank0 = tmp_path / "commspan-rank0.jsonl"
    rank0.write_bytes(b"{oops\n" + rank0.read_bytes())
    for read in (check_run, stragglers):
        with pytest.raises(ValueError, match=r"commspan-rank0\.jsonl:1: .*strict=False"):
            read(tmp_path)
    report = ReadReport()
    damaged = check_run(tmp_path, strict=False, report=report)
    intact = check_run(timed)
    assert damaged.to_dict() == intact.to_dict() and damaged.ok
    assert [(s.path, s.line) for s in report.skipped] == [(str(rank0), 1)]
    late = stragglers(tmp_path, strict=False).to_dict()
    assert late == stragglers(timed).to_dict() and late["stragglers"][0]["rank"] == 2


def test_stragglers_without_timing(consistent: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No durations recorded: stragglers says timing is needed and still shows where each
    rank's step goes; exit 0; --json keys."""
    code, out, err = run_cli(capsys, "stragglers", str(consistent))
    assert (code, err) == (0, "")
    assert "stragglers need collective timing" in out.splitlines()[0]
    assert "Step time per rank (mean per step)" in out
    code, out, _ = run_cli(capsys, "stragglers", str(consistent), "--json")
    data = json.loads(out)
    assert set(data) == {"stragglers", "ranks", "step_times", "checked", "cut_short", "run"}
    assert sorted({(s["rank"], s["step"]) for s in data["step_times"]}) == [
        (r, s) for r in range(4) for s in range(2)]


def test_stragglers_names_the_last_rank_and_module(
    timed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 2 waited least at Net's collectives: it is named last, with the wait it caused
    (4.9 µs per other rank and collective)."""
    code, out, _ = run_cli(capsys, "stragglers", str(timed), "--json")
    data = json.loads(out)
    assert code == 0
    top = data["stragglers"][0]
    assert (top["rank"], top["fqn"]) == (2, "Net")
    assert top["max_wait_ns"] == 4_900
    assert {r["rank"] for r in data["stragglers"]} == {2}
    code, out, _ = run_cli(capsys, "stragglers", str(timed), "--top", "1")
    rows = out.splitlines()
    assert rows[1].split()[:4] == ["step", "module", "phase", "rank"]
    assert rows[2].split()[1:4] == ["Net", rows[2].split()[2], "2"]
    assert "more rows (--top N shows more, --json lists all)" in rows[3]


@pytest.mark.parametrize("steps", [(), ("--steps", "1-1")])
def test_stragglers_builds_the_run_as_it_reads_with_the_answer_of_all_spans_held(
    timed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, steps: tuple[str, ...],
) -> None:
    """`stragglers` never holds every span of the run (1,024 ranks x 20 steps: some 11
    GB of span records): it builds the run one file at a time, and its answer is the
    one of every span read first and analysed then (the reference here: the records
    read whole, selected and built as the command used to)."""
    from commspan.analysis import build_run
    from commspan.analysis.runs import StepRange, select
    from commspan.analysis.stragglers import analyze
    from commspan.analysis.summary import cut_short
    from commspan.cli.commands import Reader
    from commspan.exporters import read_spans

    # a second run in the same folder (the latest, the one read) with other waits
    run = tmp_path / "run"
    shutil.copytree(timed, run)
    write_run(run, "later", net_step(), steps=(0, 1, 2))
    add_durations(run, "Net", {1: 50}, 3_000)
    records = read_spans(run)
    wanted = StepRange(1, 1) if steps else None
    sel = select(records, steps=wanted)
    whole = build_run(select(records).records) if steps else None
    reference = analyze(build_run(sel.records), whole).to_dict()
    assert reference["stragglers"] and reference["stragglers"][0]["rank"] == 1
    held = Reader.read

    def read(self: Reader, paths: list[str], label: str = "FILES", hold: object = None,
             ) -> object:
        assert hold is not None, "every span of the files asked for at once"
        return held(self, paths, label, hold)  # type: ignore[arg-type]

    monkeypatch.setattr(Reader, "read", read)
    code, out, err = run_cli(capsys, "stragglers", str(run), "--json", *steps)
    assert code == 0 and "2 runs" in err
    data = json.loads(out)
    assert data.pop("run") == "later"
    # the steps cut short as summary finds them in the records held (none here)
    assert data.pop("cut_short") == [{"rank": r, "step": s} for r, _, s in cut_short(
        sel.records, sel.last_traces)]
    assert data == json.loads(json.dumps(reference))


class _Exchange(torch.nn.Module):
    """One all_to_all_single with uneven splits: rank r sends r + b + 1 rows to rank b
    (it receives a + r + 1 from rank a), but for ``wrong`` = (rank, step), whose rank
    expects one row more from rank 0 than rank 0 sends it."""

    def __init__(self) -> None:
        super().__init__()
        self.wrong: tuple[int, int] | None = None
        self.at: tuple[int, int] = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank, _ = self.at
        world = dist.get_world_size()
        ins = [rank + b + 1 for b in range(world)]
        outs = [a + rank + 1 for a in range(world)]
        if self.at == self.wrong:
            outs[0] += 1
        out = torch.empty(sum(outs), x.shape[1])
        dist.all_to_all_single(out, torch.ones(sum(ins), x.shape[1]), outs, ins)
        return out


def _the_finding(capsys: pytest.CaptureFixture[str], tmp_path: Path, net: torch.nn.Module,
                 x: torch.Tensor, way: str) -> dict[str, Any]:
    """``net(x)`` traced on each rank for steps 0-2 (``net.at``: the rank and step), then
    checked from the lines (``way``), the files digested in memory, or digests written:
    status 1 and the one finding."""
    def step(rank: int, index: int) -> None:
        net.at = (rank, index)
        net(x)

    run = write_run(tmp_path / "run", "run", step, steps=(0, 1, 2))
    more = ["--no-digest"] if way == "lines" else []
    if way == "digests":
        assert run_cli(capsys, "digest", str(run))[0] == 0
    code, out, err = run_cli(capsys, "check", str(run), "--json", *more)
    assert code == 1, err
    findings: list[dict[str, Any]] = json.loads(out)["findings"]
    assert len(findings) == 1, findings
    return findings[0]


@pytest.mark.parametrize("way", ["lines", "in memory", "digests"])
def test_an_all_to_all_whose_splits_disagree_is_a_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None, way: str,
) -> None:
    """Uneven all_to_all_single splits must agree across the group: what rank a sends
    rank b (its input split) is what b receives from a (its output split). In step 1
    rank 2 expects one row more from rank 0 than rank 0 sends: a mismatch naming the
    splits and the two ranks (gloo ran it without an error and check said
    "consistent"); the even steps are consistent. From the lines, from the files
    digested in memory, and from digests written (version 8: they carry the splits)."""
    net = _Exchange()
    net.wrong = (2, 1)
    f = _the_finding(capsys, tmp_path, net, torch.ones(1, 2), way)
    assert (f["kind"], f["step"], f["fields"]) == ("mismatch", 1, ["splits"])
    assert f["ranks"]["2"]["splits"] == {"input": [3, 4, 5, 6], "output": [4, 4, 5, 6]}
    assert f["ranks"]["0"]["splits"] == {"input": [1, 2, 3, 4], "output": [1, 2, 3, 4]}
    assert f["message"].endswith("; rank 0 sends rank 2 3 rows (input_split_sizes), rank 2 "
                                 "receives 4 from it (output_split_sizes)"), f["message"]


class _Announce(torch.nn.Module):
    """A broadcast from rank 0; at ``wrong`` = (rank, step) that rank names rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.wrong: tuple[int, int] | None = None
        self.at: tuple[int, int] = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=1 if self.at == self.wrong else 0)
        return x


@pytest.mark.parametrize("way", ["lines", "in memory", "digests"])
def test_a_broadcast_whose_ranks_name_another_source_is_a_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None, way: str,
) -> None:
    """Every rank of a rooted collective must name the same root: rank 3 broadcasting
    from rank 1 in step 1 where the others broadcast from rank 0 (gloo hangs there, or
    not; check said "consistent" of the steps that completed) is a mismatch of field
    root_rank, each rank's root named; the other steps are consistent."""
    net = _Announce()
    net.wrong = (3, 1)

    f = _the_finding(capsys, tmp_path, net, torch.ones(2), way)
    assert (f["kind"], f["step"], f["fields"]) == ("mismatch", 1, ["root_rank"])
    assert {r: e["root_rank"] for r, e in f["ranks"].items()} == {"0": 0, "1": 0, "2": 0,
                                                                   "3": 1}
    assert ("root_rank differs: ranks 0-2 issued broadcast with root rank 0 in `_Announce` "
            "forward; rank 3 issued broadcast with root rank 1 in `_Announce` forward"
            ) in f["message"], f["message"]
