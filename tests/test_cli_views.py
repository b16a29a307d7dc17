"""`commspan html` and `commspan perfetto`: the report and the trace written from the
command line, for the run and steps chosen."""

from __future__ import annotations

import gzip
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
from _report_dom import embedded_data, tree_counts


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """4 ranks, steps 0-2 of the tensor-parallel toy Transformer (run "tp-run")."""
    return tp_run(tmp_path_factory)

@pytest.fixture(scope="module")
def divergent(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """4 ranks, steps 0-1 of one all_reduce per step; rank 1 issues one more in step 1."""
    return session_dir(tmp_path_factory, "views-divergent", lambda out: write_run(
        out, "divergent", net_step(extra_on=(1, 1))))


def test_html_writes_the_report(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`html DIR -o FILE`: one self-contained page with the run's modules; stdout says
    what was written."""
    out = tmp_path / "sub" / "report.html"
    code, text, err = run_cli(capsys, "html", str(tp), "-o", str(out))
    assert (code, err) == (0, "")
    size = out.stat().st_size
    assert text == (f"wrote report {out} ({size:,} bytes): run tp-run, ranks 0-3, "
                    "steps 0-2\n")
    page = out.read_text()
    assert page.startswith("<!doctype html>")
    assert "Transformer.layers.1.attention.wo" in page
    assert [s["l"] for s in embedded_data(page)["steps"]] == ["step 0", "step 1", "step 2"]


def test_html_step_keeps_that_step(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--step 1: the report covers step 1 only (timeline and counts)."""
    out = tmp_path / "report.html"
    code, text, _ = run_cli(capsys, "html", str(tp), "-o", str(out), "--step", "1", "--json")
    assert code == 0 and json.loads(text)["steps"] == [1]
    assert [s["l"] for s in embedded_data(out.read_text())["steps"]] == ["step 1"]


def test_html_timeline_every_embeds_some_steps_and_counts_all(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--timeline-every 2: the timeline of steps 0 and 2 only (a smaller page); the
    counts of the tree are the same as with every step's timeline."""
    every, some = tmp_path / "every.html", tmp_path / "some.html"
    assert run_cli(capsys, "html", str(tp), "-o", str(every))[0] == 0
    code, _, err = run_cli(capsys, "html", str(tp), "-o", str(some), "--timeline-every", "2")
    assert (code, err) == (0, "")
    full, part = every.read_text(), some.read_text()
    assert [s["l"] for s in embedded_data(part)["steps"]] == ["step 0", "step 2"]
    assert len(part) < len(full)
    assert tree_counts(part).counts == tree_counts(full).counts != {}
    # no multiple of N among the steps selected: the first one still gets its timeline
    code, _, _ = run_cli(capsys, "html", str(tp), "-o", str(some), "--timeline-every", "2",
                         "--step", "1")
    assert code == 0 and [s["l"] for s in embedded_data(some.read_text())["steps"]] == [
        "step 1"]
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, "html", str(tp), "-o", str(some), "--timeline-every", "0")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--timeline-every '0' is not valid; pass" in err


def test_html_check_and_findings_file(
    divergent: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--check shows check's findings; --findings FILE shows those of `check --json`."""
    code, checked, _ = run_cli(capsys, "check", str(divergent), "--json")
    assert code == 1
    message = json.loads(checked)["findings"][0]["message"]
    findings = tmp_path / "findings.json"
    findings.write_text(checked)
    for extra in (["--check"], ["--findings", str(findings)]):
        out = tmp_path / "report.html"
        code, text, err = run_cli(capsys, "html", str(divergent), "-o", str(out), *extra)
        assert (code, err) == (0, "")
        assert text.rstrip().endswith(", 1 finding")  # (it said "1 findings")
        assert message.split("`")[0].strip() in out.read_text()
    # --timeline-every keeps the step a finding names (and the first)
    step = json.loads(checked)["findings"][0]["step"]
    code, _, _ = run_cli(capsys, "html", str(divergent), "-o", str(out), "--check",
                         "--timeline-every", "5")
    assert code == 0 and [s["s"] for s in embedded_data(out.read_text())["steps"]] == sorted(
        {0, step})


def test_html_refuses_the_findings_of_another_run(
    divergent: Path, tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Findings saved from one run (`check --json` names it) shown on the report of
    another would blame that run's ranks for what they never did: exit 1, one line
    naming both runs and the fix, no report written."""
    _, checked, _ = run_cli(capsys, "check", str(divergent), "--json")
    theirs = json.loads(checked)["run"]
    mine = json.loads(run_cli(capsys, "check", str(tp), "--json")[1])["run"]
    assert theirs and mine and theirs != mine
    findings = tmp_path / "findings.json"
    findings.write_text(checked)
    out = tmp_path / "report.html"
    code, text, err = run_cli(capsys, "html", str(tp), "-o", str(out), "--findings",
                              str(findings))
    assert (code, text) == (1, "")
    assert err == (f"ValueError: --findings '{findings}' holds the findings of run "
                   f"'{theirs}', and the files read are of run '{mine}': pass that run's "
                   f"files (or --run {theirs}, when the folder holds both), or the findings "
                   "of this one (commspan check --json, or --check)\n")
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "FileNotFoundError: --findings '{f}' does not exist"),
        ("{not json", "ValueError: --findings '{f}' is not JSON"),
        ("42", "TypeError: --findings '{f}' holds a number, not the output of `commspan "
               "check --json`"),
        ('{"other": 1}', "TypeError: --findings '{f}' holds an object without a findings "
                         "list, not the output of `commspan check --json`"),
        ('{"findings": [1]}', "TypeError: --findings '{f}': findings[0] is a int, not a dict"),
        ("<dir>", "OSError: --findings '{f}' cannot be read: Is a directory; pass the file "
                  "`commspan check --json > FILE` wrote"),
    ],
)
def test_html_bad_findings_file(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None,
    message: str,
) -> None:
    """A findings file that is missing, not JSON or not check's JSON: one line, exit 1,
    no report written."""
    f = tmp_path / "f.json"
    if content == "<dir>":
        f.mkdir()
    elif content is not None:
        f.write_text(content)
    out = tmp_path / "report.html"
    code, text, err = run_cli(capsys, "html", str(tp), "-o", str(out), "--findings", str(f))
    assert (code, text) == (1, "")
    assert err.startswith(message.format(f=f)) and err.count("\n") == 1, err
    assert not out.exists()


def test_perfetto_writes_the_trace(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`perfetto DIR -o trace.json(.gz)`: one process per rank; --step keeps one step."""
    out = tmp_path / "trace.json"
    code, text, err = run_cli(capsys, "perfetto", str(tp), "-o", str(out))
    assert (code, err) == (0, "")
    assert text.startswith(f"wrote trace {out} (")
    trace = json.loads(out.read_text())
    assert trace["otherData"]["ranks"] == [0, 1, 2, 3] and trace["otherData"]["steps"] == 3
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2, 3}
    gz = tmp_path / "trace.json.gz"
    code, _, _ = run_cli(capsys, "perfetto", str(tp), "-o", str(gz), "--step", "2")
    one = json.loads(gzip.decompress(gz.read_bytes()))
    assert code == 0 and one["otherData"]["steps"] == 1
    assert one["otherData"]["collectives"] * 3 == trace["otherData"]["collectives"]


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_unwritable_output_is_one_line(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """-o naming a directory (or a path under a file): one line naming it, exit 1."""
    code, text, err = run_cli(capsys, command, str(tp), "-o", str(tmp_path))
    assert (code, text) == (1, "")
    assert err.startswith("IsADirectoryError: ") and str(tmp_path) in err
    assert err.count("\n") == 1
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_cli(capsys, command, str(tp), "-o", str(blocker / "out"))
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_unwritable_output_is_refused_before_the_files_are_read(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """A bad -o was found after every file had been read (minutes over a large run)."""
    from commspan.cli.commands import Reader

    def read(*_a: object, **_k: object) -> None:
        raise AssertionError("the files were read before -o was checked")

    monkeypatch.setattr(Reader, "load_capped", read)
    code, _, err = run_cli(capsys, command, str(tp), "-o", str(tmp_path))
    assert code == 1 and err.startswith("IsADirectoryError: -o "), err
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, command, str(tp), "-o", str(tmp_path / "file" / "out"))
    assert code == 1 and err.startswith("NotADirectoryError: -o "), err


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """4 ranks, steps 0-1 of one all_reduce per step, rank 1 one more in step 1. Ranks 0
    and 1's files are named to be read last (files are read in name order: rank 2, 3,
    1, 0): the lowest ranks come last."""
    def build(out: Path) -> None:
        write_run(out, "wide", net_step(extra_on=(1, 1)))
        (out / "commspan-rank0.jsonl").rename(out / "zz-rank0.jsonl")
        (out / "commspan-rank1.jsonl").rename(out / "zy-rank1.jsonl")

    return session_dir(tmp_path_factory, "views-wide", build)


def _only(run: Path, ranks: tuple[int, ...], out: Path) -> Path:
    """The files of ``ranks`` alone, in a folder of their own."""
    out.mkdir()
    for rank in ranks:
        (f,) = run.glob(f"*-rank{rank}.jsonl")
        (out / f.name).write_bytes(f.read_bytes())
    return out


def test_html_max_ranks_shows_the_lowest_ranks_and_names_those_left_out(
    wide: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-ranks 2: the report of ranks 0 and 1 (the lowest, though read last) is the
    report of their files alone; the page and stderr name the ranks left out and the
    option; --check still checks every rank's collectives (as `commspan check`)."""
    out = tmp_path / "capped.html"
    code, text, err = run_cli(capsys, "html", str(wide), "-o", str(out), "--max-ranks", "2")
    note = ("the report shows ranks 0-1 only, the 2 lowest of 4 (--max-ranks 2); ranks "
            "2-3 left out: pass --max-ranks N for more (0: every rank; each rank adds its "
            "spans to the memory taken and the file written)")
    assert code == 0 and err == f"commspan: {note}\n"
    assert ", ranks 0-1, steps 0-1\n" in text
    page = out.read_text()
    assert f"<p class=\"warn\">{note[0].upper()}{note[1:]}.</p>" in page
    alone = tmp_path / "alone.html"
    assert run_cli(capsys, "html", str(_only(wide, (0, 1), tmp_path / "two")), "-o",
                   str(alone))[0] == 0
    assert embedded_data(page) == embedded_data(alone.read_text())
    assert tree_counts(page).counts == tree_counts(alone.read_text()).counts != {}
    # every rank by default (4 <= 32) and with 0: no note, ranks 2 and 3 shown
    for extra in ((), ("--max-ranks", "0")):
        code, text, err = run_cli(capsys, "html", str(wide), "-o", str(out), *extra)
        assert (code, err) == (0, "") and ", ranks 0-3, steps 0-1\n" in text
        assert "--max-ranks" not in out.read_text()
    # --check: the findings of check on every file, with rank 1 (which issued one more)
    # left out
    _, checked, _ = run_cli(capsys, "check", str(wide), "--json")
    findings = json.loads(checked)["findings"]
    assert [f["kind"] for f in findings] == ["mismatch"]
    code, text, _ = run_cli(capsys, "html", str(wide), "-o", str(out), "--max-ranks", "1",
                            "--check")
    assert code == 0 and text.rstrip().endswith("ranks 0, steps 0-1, 1 finding")
    assert findings[0]["message"].split("`")[0].strip() in out.read_text()
    assert "(--max-ranks 1); ranks 1-3 left out" in out.read_text()
    with pytest.raises(SystemExit):
        run_cli(capsys, "html", str(wide), "-o", str(out), "--max-ranks", "-1")
    assert "--max-ranks '-1' is not valid; pass a number of ranks >= 1, or 0 for every " \
        "rank" in capsys.readouterr().err


def test_perfetto_max_ranks_holds_the_lowest_ranks_and_names_those_left_out(
    wide: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-ranks 2: the trace of ranks 0 and 1 is the trace of their files alone; its
    otherData and stderr name the ranks left out."""
    out, alone = tmp_path / "capped.json", tmp_path / "alone.json"
    code, text, err = run_cli(capsys, "perfetto", str(wide), "-o", str(out), "--max-ranks",
                              "2", "--step", "1")
    note = ("the trace holds ranks 0-1 only, the 2 lowest of 4 (--max-ranks 2); ranks "
            "2-3 left out: pass --max-ranks N for more (0: every rank; each rank adds its "
            "spans to the memory taken and the file written)")
    assert code == 0 and err == f"commspan: {note}\n" and ", ranks 0-1, steps 1\n" in text
    assert run_cli(capsys, "perfetto", str(_only(wide, (0, 1), tmp_path / "two")), "-o",
                   str(alone), "--step", "1")[0] == 0
    capped, reference = json.loads(out.read_text()), json.loads(alone.read_text())
    assert capped["otherData"].pop("notes") == [note]
    assert capped == reference
    assert capped["otherData"]["ranks"] == [0, 1]
    code, _, err = run_cli(capsys, "perfetto", str(wide), "-o", str(out))
    assert (code, err) == (0, "")
    assert json.loads(out.read_text())["otherData"]["ranks"] == [0, 1, 2, 3]
    assert "notes" not in json.loads(out.read_text())["otherData"]


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_max_ranks_with_digests_parses_the_files_of_the_ranks_shown_only(
    wide: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, command: str,
) -> None:
    """Files with digests: the digests say which ranks each file holds, the files of the
    ranks left out are not parsed, and the output and notes are those of every file
    parsed (the same files without digests)."""
    import commspan.cli.commands as commands

    run = tmp_path / "run"
    run.mkdir()
    for f in wide.glob("*.jsonl"):
        (run / f.name).write_bytes(f.read_bytes())
    suffix = "html" if command == "html" else "json"
    plain, digested = tmp_path / f"plain.{suffix}", tmp_path / f"digested.{suffix}"
    code, _, plain_err = run_cli(capsys, command, str(run), "-o", str(plain), "--max-ranks",
                                 "2", "--steps", "1-1")
    assert code == 0 and "ranks 2-3 left out" in plain_err
    assert run_cli(capsys, "digest", str(run))[0] == 0
    parsed: list[str] = []
    real = commands.read_spans_in

    def read_spans_in(paths: list[Path], **kwargs: object) -> object:
        parsed.extend(Path(p).name for p in paths)
        return real(paths, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(commands, "read_spans_in", read_spans_in)
    code, _, err = run_cli(capsys, command, str(run), "-o", str(digested), "--max-ranks",
                           "2", "--steps", "1-1")
    assert (code, err) == (0, plain_err)
    assert sorted(parsed) == ["zy-rank1.jsonl", "zz-rank0.jsonl"]
    if command == "html":
        assert embedded_data(digested.read_text()) == embedded_data(plain.read_text())
        assert tree_counts(digested.read_text()).counts == tree_counts(plain.read_text()).counts
    else:
        assert digested.read_bytes() == plain.read_bytes()


@pytest.mark.parametrize("command", ["perfetto", "html"])
def test_output_to_stdout_is_the_output_alone(tp: Path, tmp_path: Path, command: str) -> None:
    """``-o /dev/stdout`` (into a file, or a pipe): stdout holds the trace or report
    alone, the line saying what was written goes to stderr (it was written on stdout,
    over the start of the output in a file, after it in a pipe); with --json, which
    prints on stdout too, it is refused."""
    import subprocess
    import sys

    out = tmp_path / f"out-{command}"
    cmd = [sys.executable, "-m", "commspan", command, str(tp), "-o", "/dev/stdout"]
    with out.open("wb") as fh:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    what = "trace" if command == "perfetto" else "report"
    assert done.stderr.strip().endswith(f"commspan: wrote the {what} to stdout (/dev/stdout)")
    text = out.read_text()
    if command == "perfetto":
        assert json.loads(text)["traceEvents"]
    else:
        assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    piped = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # (a pipe)
    assert piped.returncode == 0 and piped.stdout == text
    # | head: the reader closes the pipe early; that is no error, as for the other commands
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    closed_err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, closed_err
    assert "Traceback" not in closed_err and "cannot be written" not in closed_err
    refused = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stdout == ""
    assert "is stdout, where --json prints too" in refused.stderr
