"""The ``commspan`` command line: table and summary over JSONL files, errors as one line."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from commspan import CommSpanMode
from commspan.cli import main
from commspan.exporters import JsonlSpanExporter
from commspan.render.table import span_list
from commspan.testing.models import MLP, parallelize_mlp

STEPS = 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """JSONL files of ranks 0 and 1, two steps of a TP MLP each.

    One process writes both: rank 1's file is made by overriding the rank in
    the resource, which is where the files' rank comes from.
    """
    from torch.distributed.device_mesh import init_device_mesh

    out = tmp_path_factory.mktemp("run")
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = parallelize_mlp(MLP(), mesh)
    for rank in (0, 1):
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(out / f"commspan-rank{rank}.jsonl")],
            run_id="cli-test",
            resource_attributes={"commspan.rank": rank},
        )
        with mode:
            for i in range(STEPS):
                with mode.step(i):
                    model(torch.randn(4, 8)).sum().backward()
        mode.shutdown()
    return out


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_one_rank(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`table FILE --rank 0` prints rank 0's module tree with its counts."""
    code, out, err = _cli(capsys, "table", str(run_dir / "commspan-rank0.jsonl"), "--rank", "0")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:2] == ["Global", f"  *forward: all_reduce {STEPS}"]
    assert "    MLP.net2" in lines
    assert "(Linear)" not in out


def test_table_single_rank_file_needs_no_rank(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file holding one rank needs no --rank."""
    code, out, _ = _cli(capsys, "table", str(run_dir / "commspan-rank1.jsonl"))
    assert code == 0 and out.startswith("Global\n")


def test_table_all_ranks_noise_and_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--rank all` sums ranks; `--noise 1` adds types and placements; `--json` the tree."""
    code, out, _ = _cli(capsys, "table", str(run_dir), "--rank", "all", "--noise", "1")
    assert code == 0
    assert f"*forward: all_reduce {2 * STEPS}" in out
    assert "MLP.net2 (Linear)" in out and "- weight: 8x16 S(1)" in out
    code, out, _ = _cli(capsys, "table", str(run_dir), "--rank", "all", "--json")
    tree = json.loads(out)
    assert tree["fqn"] == "Global"
    assert tree["counts"] == {"forward": {"all_reduce": 2 * STEPS}}
    assert [c["fqn"] for c in tree["children"]] == ["MLP"]


def test_summary_text_and_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`summary` reports spans, traces, ranks, steps and the per-phase op totals."""
    code, out, _ = _cli(capsys, "summary", str(run_dir), "--rank", "all")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["spans:", lines[0].split()[1], "traces:", "2",  # (world 4)
                                "ranks:", "0-1", "of", "4", "steps:", "0-1"]
    assert lines[1].split() == ["phase", "op", "count"]
    assert lines[2].split() == ["forward", "all_reduce", str(2 * STEPS)]
    assert lines[-1].split() == ["total", str(2 * STEPS)]
    code, out, _ = _cli(capsys, "summary", str(run_dir), "--rank", "1", "--json")
    data = json.loads(out)
    assert data["ranks"] == [1] and data["steps"] == [0, 1] and data["traces"] == 2
    assert data["collectives"] == {"forward": {"all_reduce": STEPS}} and data["total"] == STEPS
    assert data["spans"] == int(lines[0].split()[1]) // 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["table", "{dir}"], "ValueError: --rank is needed: the files hold spans of ranks 0-1; "
                             "pass --rank N for one rank or --rank all to sum them"),
        (["summary", "{dir}"], "ValueError: --rank is needed: the files hold spans of ranks 0-1; "
                               "pass --rank N for one rank or --rank all to sum them"),
        (["table", "{dir}", "--rank", "7"],
         "ValueError: --rank 7: the files hold no span of that rank (ranks: 0-1)"),
        (["summary", "{dir}", "--rank", "7"],
         "ValueError: --rank 7: the files hold no span of that rank (ranks: 0-1)"),
        (["table", "{dir}/missing.jsonl"],
         "FileNotFoundError: FILES: '{dir}/missing.jsonl' does not exist"),
        (["table", "{empty}"],
         "FileNotFoundError: FILES: directory '{empty}' holds no *.jsonl or *.jsonl.gz file"),
    ],
)
def test_errors_are_one_line(
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    """A user error prints `TypeName: message` on stderr and exits 1, without a traceback."""
    fill = {"dir": str(run_dir), "empty": str(tmp_path)}
    code, out, err = _cli(capsys, *(a.format(**fill) for a in argv))
    assert code == 1 and out == ""
    assert err.startswith(message.format(**fill))
    assert "Traceback" not in err and err.count("\n") == 1


def test_corrupt_line_names_file_and_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line that is not JSON (before the last) is reported with its file and line number."""
    bad = tmp_path / "bad.jsonl"
    lines = (run_dir / "commspan-rank0.jsonl").read_bytes().splitlines()
    bad.write_bytes(b"\n".join([b"{not json", *lines]) + b"\n")
    code, _, err = _cli(capsys, "table", str(bad))
    assert code == 1
    assert err.startswith(f"ValueError: {bad}:1: not a JSON line")


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse rejects a bad --rank or a missing command with usage and status 2."""
    for argv in (["table", "x.jsonl", "--rank", "one"], ["table", "x.jsonl", "--rank", "-1"], []):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--rank 'one' is not valid; pass a rank number or 'all'" in err
    assert "--rank '-1' is not valid; ranks are >= 0" in err


def test_console_script(run_dir: Path) -> None:
    """The installed `commspan` script runs main and exits with its status."""
    script = Path(sys.executable).with_name("commspan")
    if not script.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    bad = subprocess.run([str(script), "table", str(run_dir)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1
    assert bad.stdout == ""
    assert bad.stderr.startswith("ValueError: --rank is needed")


def test_span_list() -> None:
    """Rank and step lists print as compact ranges."""
    assert span_list([]) == "-"
    assert span_list([3]) == "3"
    assert span_list([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"


# ---------------------------------------------------------------- damaged input, hostile output
def _copy_with(run_dir: Path, tmp_path: Path, insert: dict[int, bytes], tail: bytes = b"") -> Path:
    """Rank 0's file with ``insert[n]`` placed as line n (1-based), then ``tail``."""
    lines = (run_dir / "commspan-rank0.jsonl").read_bytes().splitlines(keepends=True)
    for n in sorted(insert):
        lines.insert(n - 1, insert[n])
    path = tmp_path / "damaged.jsonl"
    path.write_bytes(b"".join(lines) + tail)
    return path


def test_damaged_lines_are_skipped_and_named(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Damaged lines anywhere (a null line, garbage, a complete but invalid last line)
    are each named on stderr with file:line; the table counts every other line; exit 1."""
    clean = run_dir / "commspan-rank0.jsonl"
    n = len(clean.read_bytes().splitlines())
    path = _copy_with(run_dir, tmp_path, {1: b"null\n", 3: b"{not json\n"}, tail=b'{"x": [1}\n')
    code, out, err = _cli(capsys, "table", str(path))
    assert code == 1
    assert out == _cli(capsys, "table", str(clean))[1]
    assert err.splitlines() == [
        f"ValueError: {path}:1: null, not an OTLP/JSON trace request (an object with "
        "resourceSpans)",
        f"ValueError: {path}:3: not a JSON line (unexpected character, expected a string key: "
        "line 1 column 2 (char 1))",
        f"ValueError: {path}:{n + 3}: not a JSON line (unexpected character, expected ',' or "
        "']': line 1 column 9 (char 8))",
        # (the fixture's files are ranks 0-1 of a fake world of 4; this one, rank 0's)
        "commspan: ranks 1-3 of 4 wrote no spans (no file of theirs read): what follows "
        "covers rank 0 only",
        f"commspan: 3 damaged line(s) skipped; the output counts the other {n} line(s)",
    ]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"[1, 2]\n", "an array, not an OTLP/JSON trace request"),
        (b'{"resourceMetrics": []}\n', "an object without resourceSpans (keys: resourceMetrics)"),
        (b'{"resourceSpans": [{"resource": {"attributes": [{"k": 1}]}}]}\n',
         "resourceSpans[0].resource.attributes[0] has no key"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": [{"key": '
         b'"commspan.module.fqn", "value": {"intValue": "x"}}]}]}]}]}\n',
         "resourceSpans[0].scopeSpans[0].spans[0].attributes[0].value is not an OTLP AnyValue "
         "(BadValue: intValue is 'x', not an integer (JSON integer or decimal text) as "
         "commspan writes it (a file edited, or written by another program))"),
        (b"null\n", "null, not an OTLP/JSON trace request"),
    ],
)
def test_json_that_is_not_otlp_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, reason: str
) -> None:
    """Valid JSON that is not an OTLP trace request: one line naming file:line, exit 1."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    for command in ("table", "summary"):
        code, out, err = _cli(capsys, command, str(path))
        assert (code, out) == (1, "")
        assert err.startswith(f"ValueError: {path}:1: {reason}") and err.count("\n") == 1


def test_torn_last_line_is_a_warning(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A last line without a newline (a file still being written) is named as a
    warning; the output counts the whole lines and the exit status is 0."""
    clean = run_dir / "commspan-rank0.jsonl"
    n = len(clean.read_bytes().splitlines())
    path = _copy_with(run_dir, tmp_path, {}, tail=b'{"resourceSpans":[{"reso')
    code, out, err = _cli(capsys, "summary", str(path))
    assert code == 0 and out == _cli(capsys, "summary", str(clean))[1]
    assert err == (f"warning: {path}:{n + 1}: torn last line skipped (no trailing newline: a "
                   "write cut short by a crash, or a file still being written)\n"
                   # (rank 0's file of a fake world of 4)
                   "commspan: ranks 1-3 of 4 wrote no spans (no file of theirs read): what "
                   "follows covers rank 0 only\n")


_PASS = "; pass the files it wrote (DIR/commspan-rank<N>.jsonl of JsonlSpanExporter(DIR))"


def test_files_without_commspan_spans_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Valid OTLP spans of another instrumentation: an error saying there is no commspan
    span, not an empty table with status 0."""
    from _cli_runs import write_foreign_spans

    path = write_foreign_spans(tmp_path / "other.jsonl", 3)
    for command in ("table", "summary"):
        code, out, err = _cli(capsys, command, str(path))
        assert (code, out) == (1, "")
        assert err == (f"ValueError: FILES: no commspan span in {path} (3 lines, 3 spans, none "
                       "with commspan.module.fqn): not files written by commspan's "
                       f"JsonlSpanExporter{_PASS}\n")
    # one line of one span: "1 line, 1 span" (it said "1 lines, 1 spans"), digest too
    one = tmp_path / "one.jsonl"
    one.write_bytes(path.read_bytes().splitlines(keepends=True)[0])
    for command in ("summary", "digest"):
        code, out, err = _cli(capsys, command, str(one))
        assert (code, out) == (1, "")
        assert err.endswith(f"ValueError: FILES: no commspan span in {one} (1 line, 1 span, "
                            "none with commspan.module.fqn): not files written by commspan's "
                            f"JsonlSpanExporter{_PASS}\n")


def test_a_file_whose_only_line_is_cut_short_is_not_called_another_programs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank file still being written (its one line without its end): the torn line is
    a warning and the error says every line was skipped, not that the file is not one
    JsonlSpanExporter wrote (it is)."""
    mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path / "run")])
    with mode:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    (written,) = (tmp_path / "run").glob("*.jsonl")
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(written.read_bytes().splitlines()[0][:200])  # no newline: torn
    for command in ("summary", "table", "check"):
        code, out, err = _cli(capsys, command, str(cut))
        assert (code, out) == (2 if command == "check" else 1, "")
        assert err.startswith(f"warning: {cut}:1: torn last line skipped")
        assert err.endswith(
            f"ValueError: FILES: no commspan span in {cut} (0 lines, 0 spans, none with "
            "commspan.module.fqn, 1 line skipped): every line was skipped, damaged or cut "
            "short (the warnings above say why); pass files whose writer has finished "
            "(DIR/commspan-rank<N>.jsonl of JsonlSpanExporter(DIR))\n"), err


def test_digest_of_one_line_says_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``commspan digest`` of a one-line file said "1 lines"."""
    one = tmp_path / "commspan-rank0.jsonl"
    one.write_bytes((run_dir / "commspan-rank0.jsonl").read_bytes().splitlines(True)[0])
    code, out, err = _cli(capsys, "digest", str(one))
    assert (code, err) == (0, "") and out == f"digests written for {one}: 1 line\n"


def test_over_long_line_names_the_option(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line over --max-line-mib ends its file's reading with a message naming the
    option; lines before it count; /dev/zero stops at the cap."""
    long_line = b'{"resourceSpans": [], "pad": "' + b"a" * (1 << 20) + b'"}\n'
    path = _copy_with(run_dir, tmp_path, {2: long_line})
    code, out, err = _cli(capsys, "table", str(path), "--max-line-mib", "1")
    assert code == 1 and out.startswith("Global\n")
    # (first, unless the lines put work outside steps after line 2: the export thread's
    # timing decides, and then a note that it may be short comes before)
    assert (f"ValueError: {path}:2: line longer than --max-line-mib 1; the rest of the file "
            "was not read (raise --max-line-mib if the line is genuine)") in err.splitlines()
    assert _cli(capsys, "table", str(path), "--max-line-mib", "2")[0] == 0
    if Path("/dev/zero").exists():
        code, out, err = _cli(capsys, "table", "/dev/zero", "--max-line-mib", "1")
        assert (code, out) == (1, "")
        assert err.startswith("ValueError: /dev/zero:1: line longer than --max-line-mib 1")
        assert err.count("\n") == 1
    with pytest.raises(SystemExit) as info:
        main(["table", str(path), "--max-line-mib", "0"])
    assert info.value.code == 2
    assert "--max-line-mib '0' is not valid" in capsys.readouterr().err


def test_keyboard_interrupt_exits_130(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while reading: one line and status 130, no traceback."""
    from commspan.cli.commands import Reader

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Reader, "files", interrupted)  # (every read lists the files first)
    try:
        code, out, err = _cli(capsys, "table", str(run_dir), "--rank", "all")
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main()")
    assert (code, out, err) == (130, "", "commspan: interrupted\n")


def _run_cli(*argv: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           **kwargs.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.run([sys.executable, "-m", "commspan.cli", *argv], env=env,
                          text=True, timeout=120, check=False, **kwargs)  # type: ignore[call-overload]


def test_ctrl_c_in_a_real_process(tmp_path: Path) -> None:
    """SIGINT while the command waits for input (a FIFO): status 130, one line."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "commspan.cli", "table", str(fifo)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:  # opening the write end succeeds once the command reads
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.05)
    try:
        os.write(fd, b'{"resourceSpans":[')
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(fd)
    assert (proc.returncode, out, err) == (130, "", "commspan: interrupted\n")


@pytest.fixture(scope="module")
def unicode_file(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """A run whose module names are not ASCII (rank 0 of the fake world of 4)."""
    path = tmp_path_factory.mktemp("unicode") / "trace.jsonl"
    model = torch.nn.Sequential()
    model.add_module("écoute", torch.nn.Linear(4, 4))
    model.add_module("层", torch.nn.Linear(4, 2))
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)])
    with mode:
        model(torch.ones(1, 4)).sum().backward()
    mode.shutdown()
    return path


def test_ascii_only_stdout_degrades_cleanly(unicode_file: Path) -> None:
    """An ASCII-only stdout shows non-ASCII module names escaped, status 0; UTF-8 as is."""
    ascii_run = _run_cli("table", str(unicode_file), capture_output=True,
                         env={"PYTHONIOENCODING": "ascii"})
    # (rank 0 of the fake world of 4: the rest of the job wrote no spans)
    assert (ascii_run.returncode, ascii_run.stderr) == (0, (
        "commspan: ranks 1-3 of 4 wrote no spans (no file of theirs read): what follows "
        "covers rank 0 only\n"))
    assert "Sequential.\\xe9coute" in ascii_run.stdout and "Sequential.\\u5c42" in ascii_run.stdout
    utf8 = _run_cli("table", str(unicode_file), capture_output=True,
                    env={"PYTHONIOENCODING": "utf-8"})
    assert utf8.returncode == 0 and "Sequential.écoute" in utf8.stdout


def test_stdout_on_a_full_disk(run_dir: Path) -> None:
    """stdout on /dev/full: one line on stderr, status 1, no 'Exception ignored'."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        proc = _run_cli("table", str(run_dir), "--rank", "all", stdout=full,
                        stderr=subprocess.PIPE)
    assert proc.returncode == 1
    assert proc.stderr == ("OSError: cannot write the output to stdout: [Errno 28] No space "
                           "left on device\n")


@pytest.mark.parametrize(("command", "status"), [("table", 1), ("check", 2)])
def test_stdout_closed(run_dir: Path, command: str, status: int) -> None:
    """Started with stdout closed (``commspan ... >&-``): one line on stderr saying so,
    the command's error status (``check``: 2, not 1, which means findings), no
    traceback."""
    proc = _run_cli(command, str(run_dir), *(["--rank", "all"] if command == "table" else []),
                    stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    assert proc.returncode == status, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "OSError: cannot write the output: stdout is closed; send it to a file (> FILE) or "
        "to /dev/null")
    assert "Traceback" not in proc.stderr


def test_a_reader_that_stops_early_leaves_the_status_of_the_input(
    run_dir: Path, tmp_path: Path,
) -> None:
    """``commspan table ... | head`` (a closed pipe): no error of its own, but damaged
    lines skipped still fail the status, as without the pipe (it returned the output's
    status, 0, before looking at the input's)."""
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    damaged = sorted(folder.glob("*.jsonl"))[0]
    for want in (0, 1):
        if want:
            with damaged.open("a") as fh:
                fh.write("not json\n")
        read, write = os.pipe()
        os.close(read)  # (every write to the pipe fails: EPIPE)
        try:
            proc = _run_cli("table", str(folder), "--rank", "all", stdout=write,
                            stderr=subprocess.PIPE)
        finally:
            os.close(write)
        assert proc.returncode == want, proc.stderr
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
        assert ("damaged line" in proc.stderr) == bool(want), proc.stderr


@pytest.mark.parametrize("command", ["html", "perfetto", "digest"])
def test_commands_writing_files_with_stdout_closed_or_full(
    run_dir: Path, tmp_path: Path, command: str,
) -> None:
    """A command whose output is a file (``html -o``, ``perfetto -o``, ``digest``) did
    its work, then failed (status 1, "stdout is closed") because the line saying what it
    wrote could not be printed. It succeeds; stderr says what it says with a stdout that
    works; the file is there."""
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    out = tmp_path / f"out.{command}"
    argv = [command, str(folder)] + ([] if command == "digest" else ["-o", str(out)])
    for how in ("open", "closed", "full"):
        for f in [out, *folder.glob("*.digest")]:
            f.unlink(missing_ok=True)
        if how == "open":
            proc = _run_cli(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert proc.returncode == 0 and proc.stdout, proc.stderr
            said = proc.stderr
            continue
        if how == "closed":
            proc = _run_cli(*argv, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
        elif Path("/dev/full").exists():
            with open("/dev/full", "w") as full:
                proc = _run_cli(*argv, stdout=full, stderr=subprocess.PIPE)
        else:
            continue
        assert (proc.returncode, proc.stderr) == (0, said), (how, proc.stderr)
        made = [out] if command != "digest" else sorted(folder.glob("*.digest"))
        assert made and all(f.stat().st_size > 0 for f in made), (how, made)
    if command != "digest":  # --json asks for output on stdout: that one is an error
        proc = _run_cli(*argv, "--json", stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
        assert proc.returncode == 1 and "stdout is closed" in proc.stderr, proc.stderr


def test_ctrl_c_while_the_command_loads(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C before the arguments are parsed (the modules still loading): status 130
    and one line, as later."""
    import commspan.cli.parser as parser

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(parser, "build_parser", interrupted)
    assert main(["table", "x"]) == 130
    assert capsys.readouterr().err == "commspan: interrupted\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["summary", "x", "--rank", "1", "--rank", "2"], "--rank given twice (1, then 2)"),
    (["html", "x", "-o", "a.html", "--output", "b.html"],
     "--output given twice ('a.html', then 'b.html')"),
    (["table", "x", "--noise", "1", "--noise", "0"], "--noise given twice (1, then 0)"),
    (["stragglers", "x", "--top", "3", "--top", "5"], "--top given twice (3, then 5)"),
    (["plan", "m.py:f", "--world", "2", "--world", "4"], "--world given twice (2, then 4)"),
])
def test_an_option_of_one_value_given_twice_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """argparse keeps the last of an option given twice without a word (``--rank 1
    --rank 2`` counted rank 2 only): a usage error (2) naming the option and both
    values, with the command's usage."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"commspan {argv[0]}: error: {message}; it can be given once" in err
    assert err.startswith(f"usage: commspan {argv[0]} ")


@pytest.mark.parametrize("extra", [["--show", "bytes"], ["--noise", "1"]])
def test_table_by_mesh_dim_takes_no_tree_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    """--by-mesh-dim is its own table: with --show or --noise it is a usage error (2)."""
    with pytest.raises(SystemExit) as exc:
        main(["table", str(tmp_path), "--by-mesh-dim", *extra])
    assert exc.value.code == 2
    assert "--by-mesh-dim is a table of its own" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["commspan", "commspan.cli"])
def test_python_dash_m_runs_the_command(module: str, tmp_path: Path) -> None:
    """`python -m commspan` is the command, as `python -m commspan.cli` is: same help,
    same one-line error and status for a missing file."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", module, *argv], env=env, text=True,
                              capture_output=True, timeout=120, check=False)

    helped = run("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: commspan ")
    nope = tmp_path / "nope.jsonl"
    missing = run("summary", str(nope))
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == f"FileNotFoundError: FILES: '{nope}' does not exist\n"
