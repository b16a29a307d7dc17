"""What the readers and the command make of the folders users really have: a
decompressed copy beside its ``.jsonl.gz`` (``gunzip -k``), a file named twice,
another program's newer spans, digests given as input, unreadable directories,
out-of-range options, and runs whose only communication is point-to-point.

The reference counts are the test's own: collective events counted in the raw
OTLP/JSON lines (events carrying ``commspan.collective.op``), not commspan's
aggregation.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from commspan import Aggregator, CommSpanMode, semconv
from commspan.cli import main
from commspan.exporters import JsonlSpanExporter
from commspan.otlpjson.files import jsonl_files
from commspan.testing.models import MLP, parallelize_mlp

RANKS = (0, 1)


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """Compressed files of ranks 0 and 1, two steps of a TP MLP, one run, one line
    per step (each flushed: lines are the export thread's batches, and a step cut
    into two by a busy machine made _cut_step's tests fail now and then)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = tmp_path_factory.mktemp("packed")
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = parallelize_mlp(MLP(), mesh)
    for rank in RANKS:
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(out / f"commspan-rank{rank}.jsonl.gz", compress=True)],
            run_id="inputs-test", resource_attributes={"commspan.rank": rank},
        )
        with mode:
            for i in range(2):
                with mode.step(i):
                    model(torch.randn(4, 8)).sum().backward()
                assert mode.flush()
        mode.shutdown()
    lines = [len(gzip.decompress(f.read_bytes()).splitlines()) for f in out.iterdir()]
    assert lines == [2] * len(RANKS)
    return out


def _raw_collectives(*files: Path) -> int:
    """Collective events in the files' lines, counted by hand."""
    n = 0
    for f in files:
        data = f.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        for line in data.splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        for e in span.get("events", []):
                            keys = {a["key"] for a in e.get("attributes", [])}
                            n += semconv.COLL_OP in keys
    return n


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _with_copies(packed_dir: Path, tmp_path: Path, ranks: tuple[int, ...] = RANKS) -> Path:
    """The run's folder after ``gunzip -k`` of the given ranks' files."""
    folder = tmp_path / "copied"
    shutil.copytree(packed_dir, folder)
    for rank in ranks:
        packed = folder / f"commspan-rank{rank}.jsonl.gz"
        (folder / f"commspan-rank{rank}.jsonl").write_bytes(gzip.decompress(packed.read_bytes()))
    return folder


def test_decompressed_copies_are_read_once(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After ``gunzip -k`` (what docs/jsonl.md suggests before replaying), the
    folder counts what the compressed files hold, and stderr says which files
    were left out."""
    expected = _raw_collectives(*sorted(packed_dir.glob("*.jsonl.gz")))
    assert expected > 0
    folder = _with_copies(packed_dir, tmp_path)
    code, out, err = _cli(capsys, "summary", str(folder), "--rank", "all", "--json")
    assert code == 0
    assert json.loads(out)["total"] == expected
    assert "gunzip -k" in err and "commspan-rank0.jsonl (read" in err
    # one rank's copy only: check finds what it finds without the copy (it used to
    # see rank 0 issue every collective twice)
    one = _with_copies(packed_dir, tmp_path / "one", ranks=(0,))
    reference = _cli(capsys, "check", str(packed_dir), "--json")
    code, out, _ = _cli(capsys, "check", str(one), "--json")
    assert (code, json.loads(out)["findings"]) == (
        reference[0], json.loads(reference[1])["findings"])
    assert json.loads(out)["checked"]["collectives"] == json.loads(
        reference[1])["checked"]["collectives"]
    code, out, _ = _cli(capsys, "diff", str(folder), str(packed_dir))
    assert code == 0 and "no difference" in out
    assert Aggregator.from_jsonl(folder, rank="all").total_count() == expected


def test_copies_under_other_names_and_hard_links_are_read_once(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank's file copied into the folder under another name (``cp``, decompressed
    or not) or hard-linked there: its spans used to be counted twice and ``check``
    saw rank 0 issue everything twice. Each copy is named on stderr and left out."""
    expected = _raw_collectives(*sorted(packed_dir.glob("*.jsonl.gz")))
    folder = tmp_path / "dups"
    shutil.copytree(packed_dir, folder)
    rank0 = folder / "commspan-rank0.jsonl.gz"
    shutil.copy(rank0, folder / "rank0-copy.jsonl.gz")
    (folder / "backup-of-rank1.jsonl").write_bytes(
        gzip.decompress((folder / "commspan-rank1.jsonl.gz").read_bytes()))
    os.link(folder / "commspan-rank1.jsonl.gz", folder / "zz-link.jsonl.gz")
    code, out, err = _cli(capsys, "summary", str(folder), "--rank", "all", "--json")
    assert code == 0 and json.loads(out)["total"] == expected
    assert "rank0-copy.jsonl.gz" in err and "backup-of-rank1.jsonl" in err
    reference = _cli(capsys, "check", str(packed_dir), "--json")
    code, out, _ = _cli(capsys, "check", str(folder), "--json")
    assert (code, json.loads(out)["findings"]) == (
        reference[0], json.loads(reference[1])["findings"])
    kept = {f.name for f in jsonl_files(folder, notes=[])}
    assert kept == {f.name for f in packed_dir.glob("*.jsonl.gz")}


def test_a_copy_shorter_than_the_first_kilobytes_is_found(tmp_path: Path) -> None:
    """A ``gunzip -k`` copy made early (1.5 kB) of a file that has grown since (12 kB):
    files are grouped by their first line, so the short copy is still compared."""
    line = b'{"resourceSpans":[{"x":"%d"}]}\n'
    early = b"".join(line % i for i in range(50))
    (tmp_path / "rank0.jsonl").write_bytes(early)
    with gzip.open(tmp_path / "rank0.jsonl.gz", "wb") as g:
        g.write(early + b"".join(line % i for i in range(50, 400)))
    notes: list[str] = []
    assert [f.name for f in jsonl_files(tmp_path, notes=notes)] == ["rank0.jsonl.gz"]
    assert "rank0.jsonl (read" in notes[0]


def test_a_plain_file_with_other_lines_is_read(packed_dir: Path, tmp_path: Path) -> None:
    """A ``.jsonl`` beside a ``.jsonl.gz`` that holds other lines (another run,
    written without compression) is not a copy: both are read."""
    folder = tmp_path / "both"
    shutil.copytree(packed_dir, folder)
    packed = folder / "commspan-rank0.jsonl.gz"
    lines = gzip.decompress(packed.read_bytes()).splitlines(keepends=True)
    (folder / "commspan-rank0.jsonl").write_bytes(b"".join(lines[1:]))  # starts elsewhere
    assert {f.name for f in jsonl_files(folder)} >= {
        "commspan-rank0.jsonl", "commspan-rank0.jsonl.gz"}


def test_a_file_named_twice_is_read_once(
    packed_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _raw_collectives(*sorted(packed_dir.glob("*.jsonl.gz")))
    again = packed_dir / "commspan-rank0.jsonl.gz"
    code, out, _ = _cli(capsys, "summary", str(packed_dir), str(again), "--rank", "all",
                        "--json")
    assert code == 0 and json.loads(out)["total"] == expected


def _foreign_line(start_ns: int) -> bytes:
    span = {"traceId": "0123456789abcdef0123456789abcdef", "spanId": "0123456789abcdef",
            "name": "GET /", "kind": 2, "startTimeUnixNano": str(start_ns),
            "endTimeUnixNano": str(start_ns + 1000)}
    doc = {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "web"}}]},
        "scopeSpans": [{"scope": {"name": "web"}, "spans": [span]}]}]}
    return json.dumps(doc).encode() + b"\n"


def test_another_programs_newer_spans_do_not_hide_the_run(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newer file of spans without a run id (another program's) in the folder:
    the latest run commspan wrote is still the one read."""
    folder = tmp_path / "mixed"
    shutil.copytree(packed_dir, folder)
    (folder / "zz-web.jsonl").write_bytes(_foreign_line(2**62))  # later than any run
    expected = _raw_collectives(*sorted(packed_dir.glob("*.jsonl.gz")))
    code, out, err = _cli(capsys, "summary", str(folder), "--rank", "all", "--json")
    assert code == 0 and json.loads(out)["total"] == expected
    # they are not a run of their own: said once, never chosen
    assert err == ("commspan: 1 span of other programs (no run id, no commspan rank) left out\n"
                   # (the fixture is ranks 0-1 of a fake world of 4)
                   "commspan: ranks 2-3 of 4 wrote no spans (no file of theirs read): what "
                   "follows covers ranks 0-1 only\n")
    assert json.loads(out)["runs"][0]["run_id"] == "inputs-test"
    assert len(json.loads(out)["runs"]) == 1
    for command in ("summary", "check"):
        code, _, err = _cli(capsys, command, str(folder), "--run", "")
        assert code == (2 if command == "check" else 1)
        assert ("--run '': an empty run id names the run of commspan spans without a run "
                "id, and the files hold none; pass one of their run ids, or the start of "
                "one (runs: inputs-test") in err


def test_digest_refuses_digests_and_reports_what_it_skipped(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "dg"
    shutil.copytree(packed_dir, folder)
    code, out, err = _cli(capsys, "digest", str(folder))
    assert code == 0 and "digests written" in out
    digest = next(folder.glob("*.digest"))
    code, _, err = _cli(capsys, "digest", str(digest))
    assert code == 1 and "is a digest, not a JSONL file" in err
    assert not list(folder.glob("*.digest.digest"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "notes.jsonl").write_bytes(b"not json\n")
    code, _, err = _cli(capsys, "digest", str(bad))
    assert code == 1 and "notes.jsonl:1" in err
    web = tmp_path / "web"
    web.mkdir()
    (web / "web.jsonl").write_bytes(_foreign_line(1))
    code, _, err = _cli(capsys, "digest", str(web))
    assert code == 1 and "no commspan span" in err
    assert "Traceback" not in err


def test_digests_named_by_a_glob_are_left_out_with_one_note(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``summary DIR/*`` after ``commspan digest DIR``: the shell names the digests
    too; every reading command leaves them out with one note (it read them as JSONL,
    one damaged line each), and the files' own digests still serve."""
    folder = tmp_path / "dg"
    shutil.copytree(packed_dir, folder)
    assert _cli(capsys, "digest", str(folder))[0] == 0
    everything = [str(f) for f in sorted(folder.iterdir())]
    assert sum(f.endswith(".digest") for f in everything) == len(RANKS)
    _, expected, _ = _cli(capsys, "summary", str(folder), "--rank", "all", "--json")
    code, out, err = _cli(capsys, "summary", *everything, "--rank", "all", "--json")
    assert code == 0 and out == expected
    assert "not a JSON line" not in err and "damaged" not in err
    assert err.count("commspan: not reading") == 1 and "digests" in err
    for command in ("table", "check", "stragglers", "html", "perfetto"):
        more = ["--rank", "all"] if command == "table" else []
        if command in ("html", "perfetto"):
            more = ["-o", str(tmp_path / f"out.{command}")]
        status, _, _ = _cli(capsys, command, str(folder), *more)
        code, _, err = _cli(capsys, command, *everything, *more)
        assert code == status, (command, err)
        assert "not a JSON line" not in err and err.count("commspan: not reading") == 1
    # only digests named: one error saying what to pass
    code, out, err = _cli(capsys, "summary", *(f for f in everything if f.endswith(".digest")))
    assert code == 1 and not out
    assert err.startswith("ValueError: FILES: all 2 files named are digests, not JSONL files")
    assert err.count("\n") == 1
    one = next(f for f in everything if f.endswith(".digest"))
    code, out, err = _cli(capsys, "summary", one)
    assert code == 1 and not out
    assert err == f"ValueError: FILES: {one} is a digest, not a JSONL file; pass the JSONL " \
                  "files (a file's digest is read with it) or their directory\n"


def test_a_file_that_is_not_jsonl_is_named_once(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A README given by mistake: one line saying it is not a file commspan wrote,
    instead of a line per line; the exit status still says lines were lost."""
    readme = tmp_path / "README.md"
    readme.write_text("".join(f"line {i} of prose\n\n" for i in range(30)))
    for command, failed in (("summary", 1), ("check", 2), ("table", 1)):
        code, out, err = _cli(capsys, command, str(readme))
        assert code == failed and not out
        assert f"{readme}:1:" not in err and f"{readme}:3:" not in err
        # (59: its empty lines are lines too, as damaged as the others, but the last,
        # at the end of the file, which lost nothing)
        assert (f"ValueError: {readme}: none of its 59 lines is an OTLP/JSON trace request "
                "(line 1: not a JSON line") in err
        assert "not a file JsonlSpanExporter wrote" in err
    # beside a good file: named once, the good file read, status 1
    code, out, err = _cli(capsys, "summary", str(packed_dir), str(readme), "--rank", "all")
    assert code == 1 and out
    assert err.count(str(readme)) == 1 and "59 damaged line(s) skipped" in err


def test_a_file_without_a_last_newline_that_is_not_jsonl_is_named_once(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file none of whose lines is a request whose last line has no newline (what
    ``json.dump`` writes) is named once too, not line by line with a torn-line warning;
    an OTLP/JSON request pretty-printed over many lines gets the command that makes
    it one line, and that command's output reads."""
    request = json.loads(gzip.decompress((packed_dir / "commspan-rank0.jsonl.gz")
                                         .read_bytes()).splitlines()[0])
    pretty = tmp_path / "otlp.json"
    with open(pretty, "w", encoding="utf-8") as fh:
        json.dump(request, fh, indent=2)  # (no newline at the end)
    lines = pretty.read_text(encoding="utf-8").count("\n") + 1
    notes = tmp_path / "notes.jsonl"
    notes.write_text("first note\nsecond note\nthird, unfinished")
    for command, failed in (("summary", 1), ("check", 2), ("table", 1), ("digest", 1)):
        code, out, err = _cli(capsys, command, str(pretty))
        assert code == failed and not out, (command, err)
        assert err.count("\n") == 1, (command, err)  # (no torn-line warning, no line list)
        assert f"ValueError: {pretty}: none of its " in err
        if command != "digest":  # (digest counts the last line only when it has a newline)
            assert f"none of its {lines} lines" in err
        assert f"`jq -c . {pretty} > one-line.jsonl` makes it one" in err
        code, out, err = _cli(capsys, command, str(notes))
        assert code == failed and not out, (command, err)
        assert err.count("\n") == 1 and "torn" not in err, (command, err)
        assert "not a file JsonlSpanExporter wrote" in err and "jq" not in err
    packed = tmp_path / "otlp.json.gz"
    packed.write_bytes(gzip.compress(pretty.read_bytes()))
    code, _, err = _cli(capsys, "summary", str(packed))
    assert code == 1 and f"`zcat {packed} | jq -c . > one-line.jsonl`" in err
    # what the command writes: the request on one line, which reads as rank 0's spans
    one = tmp_path / "one-line.jsonl"
    one.write_text(json.dumps(request) + "\n", encoding="utf-8")
    code, out, err = _cli(capsys, "summary", str(one), "--json")
    assert code == 0, err
    spans = sum(len(s["spans"]) for r in request["resourceSpans"] for s in r["scopeSpans"])
    assert json.loads(out)["spans"] == spans


def test_a_chrome_trace_or_another_format_given_as_input_says_what_to_pass(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Chrome trace `commspan perfetto` wrote, given back to a reading command or
    to read_spans: named as a Chrome trace, with the files to pass instead. A strict
    read whose first line is not a request asks whether the file is one
    JsonlSpanExporter wrote, instead of only suggesting strict=False (which skips the
    whole file)."""
    from commspan.exporters import read_spans

    trace = tmp_path / "trace.json"
    assert main(["perfetto", str(packed_dir), "-o", str(trace)]) == 0
    assert json.loads(trace.read_text())["traceEvents"]  # (the test's own reading)
    capsys.readouterr()
    chrome = ("not an OTLP/JSON trace request: a Chrome trace (what `commspan perfetto` and "
              "write_chrome_trace write); pass the JSONL files JsonlSpanExporter wrote")
    for command in ("summary", "table", "stragglers"):
        code, out, err = _cli(capsys, command, str(trace))
        assert code == 1 and not out
        assert err.startswith(f"ValueError: {trace}:1: an object without resourceSpans") \
            and chrome in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match=r"a Chrome trace .*JsonlSpanExporter wrote$"):
        list(read_spans(trace))
    page = tmp_path / "report.html"
    page.write_text("<!doctype html>\n<html>\n</html>\n")
    with pytest.raises(ValueError, match=r"report.html:1: not a JSON line .*; not a file "
                       r"JsonlSpanExporter wrote \(one OTLP/JSON trace request per line\)\? "
                       r"pass those files, or strict=False to skip damaged lines$"):
        list(read_spans(page))


def test_a_folder_of_run_folders_names_them(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The folder `hang_and_straggler.py --out DIR` (or two `--out runs/X` demos)
    writes holds one folder per run and no JSONL file: the error names the folders
    that hold some, and an example to pass; `-` names /dev/stdin."""
    from commspan import Aggregator

    parent = tmp_path / "debug"
    for name in ("straggler", "hang"):
        shutil.copytree(packed_dir, parent / name)
    (parent / "notes").mkdir()  # (a folder without JSONL files is not named)
    for command in ("summary", "check", "table"):
        code, out, err = _cli(capsys, command, str(parent))
        assert not out and code == (2 if command == "check" else 1)
        assert err == (f"FileNotFoundError: FILES: directory '{parent}' holds no *.jsonl or "
                       "*.jsonl.gz file; pass the directory a JsonlSpanExporter wrote to, or its "
                       "files (JSONL files are in its folders hang, straggler: pass one of them, "
                       f"e.g. '{parent / 'hang'}')\n")
    with pytest.raises(FileNotFoundError, match=r"JSONL files are in its folders hang, straggler"):
        Aggregator.from_jsonl(parent, rank="all")
    shutil.rmtree(parent / "straggler")
    code, _, err = _cli(capsys, "summary", str(parent))
    assert code == 1
    assert f"(JSONL files are in its folder hang: pass it, '{parent / 'hang'}')" in err
    code, _, err = _cli(capsys, "summary", str(tmp_path / "debug" / "notes"))
    assert code == 1 and err.endswith("or its files\n")  # (nothing inside to name)
    code, _, err = _cli(capsys, "summary", "-")
    assert err == "FileNotFoundError: FILES: '-' does not exist (standard input is /dev/stdin)\n"


def test_python_steps_none_of_which_is_in_the_run_are_an_error(packed_dir: Path) -> None:
    """check_run / stragglers with steps=[5] of a run of steps 0-1 (a typo) checked
    nothing and read "consistent: ... 0 steps"; as `--step 5` is on the command line,
    it is an error listing the run's steps. Steps some of which are there are read."""
    from commspan.analysis import check_run, stragglers
    from commspan.analysis.runs import SelectionError

    for analysis in (check_run, stragglers):
        for steps in ([5], [], range(7, 9)):
            with pytest.raises(SelectionError, match=r"none of them is in .*which has "
                               r"steps 0-1"):
                analysis(packed_dir, steps=steps)
    assert check_run(packed_dir, steps=[1, 5]).checked["steps"] == 1
    assert {t.step for t in stragglers(packed_dir, steps=[1, 5]).step_times} == {1}


def test_an_unreadable_directory_says_so(
    packed_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "holds no *.jsonl file" (root reads any directory: listing is refused here)."""
    real = os.listdir

    def refuse(path: object) -> list[str]:
        if Path(str(path)) == packed_dir:
            raise PermissionError(13, "Permission denied")
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "listdir", refuse)
    code, _, err = _cli(capsys, "summary", str(packed_dir), "--rank", "all")
    assert code == 1
    assert "cannot be listed (Permission denied)" in err and "holds no" not in err


def test_a_step_selection_is_read_holding_only_its_steps(
    packed_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``summary``/``table``/``check`` reading the lines with ``--step`` give what the
    step's spans selected from all of them give, and the reader never held the other
    step's spans (they used to be held, every step of every rank, until the selection
    at the end)."""
    from commspan.analysis import runs
    from commspan.exporters import read_spans

    most: list[int] = []
    real_add = runs.StepPruner.add

    def add(self: runs.StepPruner, rec: object) -> None:
        real_add(self, rec)  # type: ignore[arg-type]
        most.append(self.held)

    monkeypatch.setattr(runs.StepPruner, "add", add)
    every = list(read_spans(*sorted(packed_dir.glob("*.jsonl.gz"))))
    by_step = runs.select(every, steps=runs.StepRange(1, 1)).records
    assert 0 < len(by_step) < len(every)
    code, out_text, _ = _cli(capsys, "summary", str(packed_dir), "--step", "1", "--no-digest",
                             "--rank", "all", "--json")
    assert code == 0
    expected = Aggregator.from_records(by_step, rank="all").total_count()
    assert json.loads(out_text)["total"] == expected
    # rank 0's step 0 was let go once its file was read: never both steps of both ranks
    assert most and max(most) < len(every) - 1
    assert most[-1] <= len(by_step)
    code, out_text, _ = _cli(capsys, "check", str(packed_dir), "--step", "1", "--no-digest",
                             "--json")
    reference = _cli(capsys, "check", str(packed_dir), "--step", "1", "--json")
    assert (code, json.loads(out_text)["findings"]) == (
        reference[0], json.loads(reference[1])["findings"])


def test_entries_of_a_directory_that_are_no_files_are_left_out(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO named *.jsonl in a run folder (``mkfifo DIR/rank9.jsonl``) made every
    reader wait for ever, opening it; a directory, a link looping on itself and one to
    nothing, so named, are no files either: each is left out with a note naming it,
    and the rest is read as if they were not there."""
    run = tmp_path / "run"
    shutil.copytree(packed_dir, run)
    commands = [[c, str(run), "--json"] for c in ("summary", "check", "table")]
    clean = [_cli(capsys, *argv) for argv in commands]  # (ranks 2-3 wrote nothing: noted)
    odd = {"rank9.jsonl": "a FIFO", "sub.jsonl": "a directory",
           "loop.jsonl": "a symbolic link to 'loop.jsonl' that loops back on itself",
           "gone.jsonl.gz": "a symbolic link to 'nowhere', which does not exist"}
    os.mkfifo(run / "rank9.jsonl")
    (run / "sub.jsonl").mkdir()
    (run / "loop.jsonl").symlink_to("loop.jsonl")
    (run / "gone.jsonl.gz").symlink_to("nowhere")
    notes: list[str] = []
    # (before anything opens the FIFO: the old code listed it, and reading it hung)
    assert sorted(f.name for f in jsonl_files(run, notes=notes)) == sorted(
        p.name for p in packed_dir.iterdir())
    for name, what in odd.items():
        assert f"{run / name} ({what})" in notes[0]
    for argv, (clean_code, clean_out, clean_err) in zip(commands, clean):
        code, out, err = _cli(capsys, *argv)
        assert (code, out) == (clean_code, clean_out)
        note, rest = err.split("\n", 1)
        assert rest == clean_err and note.startswith("commspan: not reading ")
        assert all(f"{run / name} ({what})" in note for name, what in odd.items())
    # a folder of nothing else: the error names them
    only = tmp_path / "only"
    only.mkdir()
    os.mkfifo(only / "r.jsonl")
    code, _, err = _cli(capsys, "summary", str(only))
    assert code == 1 and err == (
        f"FileNotFoundError: FILES: directory '{only}' holds no *.jsonl or *.jsonl.gz file "
        f"(not files: {only / 'r.jsonl'} (a FIFO)); pass the directory a JsonlSpanExporter "
        "wrote to, or its files\n")


def test_a_file_named_that_leads_nowhere_or_cannot_be_read_says_so(
    packed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    """A link named as FILE that loops, or leads to nothing, is named as such (not
    "does not exist", nor a RuntimeError of pathlib); a file this user may not read
    (root reads any: refused here) says how to fix it, without errno's ``[Errno 13]``."""
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop.name)
    code, _, err = _cli(capsys, "summary", str(loop), str(packed_dir))
    assert code == 1 and err == (f"FileNotFoundError: FILES: '{loop}' is a symbolic link to "
                                 "'loop.jsonl' that loops back on itself\n")
    denied = packed_dir / "commspan-rank1.jsonl.gz"
    real = Path.open

    def refuse(self: Path, *args: object, **kwargs: object) -> object:
        if self == denied:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(Path, "open", refuse)
    code, _, err = _cli(capsys, "check", str(packed_dir), "--no-digest")
    assert code == 2 and err == (
        f"PermissionError: {denied} cannot be read (Permission denied); give this user read "
        "permission on it, or leave it out of FILES\n")


@pytest.mark.parametrize("argv", [
    ["summary", "DIR", "--rank", "all", "--max-line-mib", "9000000000000"],
    ["plan", "x.py:f", "--world", "99999999999999999999"],
])
def test_huge_option_values_are_usage_errors(
    packed_dir: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(packed_dir) if a == "DIR" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "is not valid; pass" in err and "1048576" in err


def _cut_step(packed_dir: Path, folder: Path, index: int) -> int:
    """Plain copies of the run's files whose line ``index`` (one step) lost its rank
    span, step span and top-level module spans, as a rank stopped mid-step leaves
    it; returns the hand count of collectives in the other lines."""
    folder.mkdir()
    whole = 0
    for packed in sorted(packed_dir.glob("*.jsonl.gz")):
        lines = gzip.decompress(packed.read_bytes()).splitlines(keepends=True)
        doc = json.loads(lines[index])
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                ss["spans"] = [
                    span for span in ss["spans"]
                    if span["name"] not in (semconv.SPAN_RANK, semconv.SPAN_STEP)
                    and "parentSpanId" in span
                    and not span["name"].startswith("MLP ")]
        lines[index] = json.dumps(doc).encode() + b"\n"
        (folder / packed.name.removesuffix(".gz")).write_bytes(b"".join(lines))
        rest = folder / "rest.jsonl"
        rest.write_bytes(b"".join(line for i, line in enumerate(lines) if i != index))
        whole += _raw_collectives(rest)
        rest.unlink()
    return whole


@pytest.mark.parametrize("digested", [False, True], ids=["lines", "digests"])
def test_a_step_cut_short_is_named(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], digested: bool
) -> None:
    """Module spans of a step without its rank span, followed by later steps: the
    summary's total is the complete steps' (hand count), and stderr and --json name
    the cut step. The last step so cut, with no hang record, may still be running:
    not named."""
    folder = tmp_path / "cut"
    whole = _cut_step(packed_dir, folder, 0)
    if digested:
        assert _cli(capsys, "digest", str(folder))[0] == 0
    code, out, err = _cli(capsys, "summary", str(folder), "--rank", "all", "--json")
    data = json.loads(out)
    assert code == 0 and data["total"] == whole
    # no span left of that trace says its step (a hang record would)
    assert data["partial"] == [{"rank": r, "step": None} for r in RANKS]
    assert "a step of ranks 0-1 was cut short" in err
    assert 0 not in data["steps"]
    code, _, err = _cli(capsys, "table", str(folder), "--rank", "all")
    assert code == 0 and "was cut short" in err
    # --show counts the same collectives (it counted the cut step's finished modules')
    code, out, err = _cli(capsys, "summary", str(folder), "--rank", "all", "--show", "bytes",
                          "--json")
    shown = json.loads(out)
    assert code == 0 and shown["total"] == whole
    assert sum(r["count"] for r in shown["issued"]) == whole
    code, _, err = _cli(capsys, "summary", str(packed_dir), "--rank", "all")
    assert "cut short" not in err
    # the last step without its rank span and no hang record: a job still running
    running = tmp_path / "running"
    _cut_step(packed_dir, running, -1)
    if digested:
        assert _cli(capsys, "digest", str(running))[0] == 0
    code, out, err = _cli(capsys, "summary", str(running), "--rank", "all", "--json")
    assert code == 0 and json.loads(out)["partial"] == [] and "cut short" not in err


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_output_paths_that_cannot_be_written_name_the_option(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    code, _, err = _cli(capsys, command, str(packed_dir), "-o", str(tmp_path))
    assert code == 1 and f"-o '{tmp_path}' is a directory; pass a file name in it" in err
    (tmp_path / "a-file").write_text("")
    under_a_file = tmp_path / "a-file" / "out.html"  # (missing directories are made)
    code, _, err = _cli(capsys, command, str(packed_dir), "-o", str(under_a_file))
    assert code == 1 and f"-o '{under_a_file}' cannot be written: " \
        f"'{tmp_path / 'a-file'}' is a file, not a directory" in err  # (was "File exists")
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as info:  # (was "is a directory")
        main([command, str(packed_dir), "-o", ""])
    assert info.value.code == 2 and "-o '' is empty; pass a file name" in \
        capsys.readouterr().err


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_an_output_ending_in_a_slash_is_a_directory_not_a_file(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """``-o reports/`` (a folder meant, not there yet) wrote the report to a file named
    ``reports``, exit 0; it is now the error an existing directory gets, naming a file
    in it, and nothing is written. The Python writers refuse it the same way."""
    from commspan.render import write_chrome_trace, write_html_report

    example = "report.html" if command == "html" else "trace.json"
    folder = os.path.join(str(tmp_path), "reports") + os.sep
    code, out, err = _cli(capsys, command, str(packed_dir), "-o", folder)
    assert (code, out) == (1, "")
    assert err == (f"IsADirectoryError: -o {folder!r} names a directory (it ends with '/'); "
                   f"pass a file name in it, e.g. {os.path.join(folder, example)!r}\n")
    assert not os.path.lexists(folder.rstrip(os.sep))  # no file named `reports`
    write = write_html_report if command == "html" else write_chrome_trace
    with pytest.raises(IsADirectoryError, match=r"out_path='.*/reports/' names a directory"):
        write([], folder)
    assert not os.path.lexists(folder.rstrip(os.sep))


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_the_python_writers_name_out_path_when_it_is_a_directory_or_below_a_file(
    tmp_path: Path, command: str
) -> None:
    """write_html_report / write_chrome_trace with out_path an existing directory, or a
    path below a file, raised the OS's bare "[Errno 21] Is a directory: ..." or
    "[Errno 17] File exists"; they now name out_path, the value and the fix, as `-o` does,
    and write nothing."""
    from commspan.render import write_chrome_trace, write_html_report

    write = write_html_report if command == "html" else write_chrome_trace
    example = "report.html" if command == "html" else "trace.json"
    folder = tmp_path / "reports"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match=re.escape(
            f"out_path={str(folder)!r} is a directory; pass a file path in it, e.g. "
            f"{os.path.join(str(folder), example)!r}")):
        write([], str(folder))
    afile = tmp_path / "notes.txt"
    afile.write_text("keep")
    below = afile / "sub" / example
    with pytest.raises(NotADirectoryError, match=re.escape(
            f"out_path={str(below)!r} cannot be written: {str(afile)!r} is a file, not a "
            "directory; pass a file path in a directory")):
        write([], below)
    assert list(folder.iterdir()) == [] and afile.read_text() == "keep"


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_an_output_that_is_an_input_file_is_refused(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """-o naming one of the files read (by its name, or a link to it) is refused before
    anything is written: it replaced a rank's spans with the report and exited 0."""
    run = tmp_path / "run"
    shutil.copytree(packed_dir, run)
    target = run / "commspan-rank0.jsonl.gz"
    link = tmp_path / "link.gz"
    link.symlink_to(target)
    before = target.read_bytes()
    for output in (target, link):
        with pytest.raises(SystemExit) as info:  # a usage error, before anything is read
            main([command, str(run), "-o", str(output)])
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert f"-o '{output}' is an input file ({target}): writing it would replace its " \
            "spans; pass another file name" in err
        assert "Traceback" not in err
    assert target.read_bytes() == before


@pytest.mark.parametrize("command", ["html", "perfetto"])
def test_a_new_jsonl_output_in_an_input_folder_is_refused(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """-o naming a new *.jsonl (or *.jsonl.gz) file in a folder the command reads is
    refused before anything is written: it was written, and every later read of the
    folder found it a damaged line. Another name in the folder is written."""
    run = tmp_path / "run"
    shutil.copytree(packed_dir, run)
    before = sorted(p.name for p in run.iterdir())
    for output in (run / "trace.jsonl", run / "out.jsonl.gz"):
        with pytest.raises(SystemExit) as info:  # a usage error, before anything is read
            main([command, str(run), "-o", str(output)])
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert f"-o '{output}' is a new *.jsonl file in the input folder '{run}'" in err
        assert "pass another file name" in err and "Traceback" not in err
    assert sorted(p.name for p in run.iterdir()) == before
    # the folder of a file read is a folder read later; so is a digest's name
    rank0 = next(run.glob("commspan-rank0.jsonl*"))
    for output, kind, what in ((run / "new.jsonl", "*.jsonl", "a rank's spans"),
                               (run / "new.digest", "*.digest", "a rank file's digest")):
        with pytest.raises(SystemExit) as info:
            main([command, str(rank0), "-o", str(output)])
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert (f"-o '{output}' is a new {kind} file in the folder of the input file "
                f"'{rank0}': every later read of the folder would take it for {what}") in err
    # an input's digest is not overwritten either
    main(["digest", str(run)])
    capsys.readouterr()
    side = Path(f"{rank0}.digest")
    digest = side.read_bytes()
    for source in (run, rank0):
        with pytest.raises(SystemExit) as info:
            main([command, str(source), "-o", str(side)])
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert (f"-o '{side}' is the digest of an input file ({rank0}): writing it would "
                "replace the digest") in err
    assert side.read_bytes() == digest
    assert main([command, str(run), "-o", str(run / "view.out")]) == 0
    capsys.readouterr()
    assert main(["summary", str(run), "--rank", "all"]) == 0


@pytest.mark.parametrize("writer", ["write_html_report", "write_chrome_trace"])
def test_the_python_writers_refuse_an_output_that_is_an_input(
    packed_dir: Path, tmp_path: Path, writer: str
) -> None:
    """write_html_report / write_chrome_trace with out_path one of the files read (a
    folder's, a file named, a link to it) or a new *.jsonl file in a folder read: a
    ValueError naming out_path, before anything is written (the rank's file was
    replaced by the page and the call returned, as `commspan html -o` did once)."""
    import commspan.render

    write = getattr(commspan.render, writer)
    run = tmp_path / "run"
    shutil.copytree(packed_dir, run)
    target = run / "commspan-rank0.jsonl.gz"
    link = tmp_path / "link.gz"
    link.symlink_to(target)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for source, output in ((str(run), target), (run, link), ([str(target)], str(target)),
                           ((target, run / "commspan-rank1.jsonl.gz"), link)):
        with pytest.raises(ValueError, match=r"out_path='.*' is an input file \(.*"
                           r"commspan-rank0.jsonl.gz\): writing it would replace its spans; "
                           r"pass another file name"):
            write(source, output)
    for output in (run / "view.jsonl", run / "view.jsonl.gz"):
        with pytest.raises(ValueError, match=r"is a new \*.jsonl file in the input folder"):
            write(run, output)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert write(run, run / "view.out").stat().st_size > 0  # (another name: written)
    assert write([], tmp_path / "empty.jsonl").exists()  # (records: no file to clash with)


def test_an_int_beyond_64_bits_is_read_and_written_as_it_is(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An intValue beyond 64 bits (older files' resources may hold one) is read as it
    is, and the views write it: html failed blaming --findings (never given), perfetto
    and digest with a TypeError naming nothing (orjson takes 64-bit ints only)."""
    run = tmp_path / "run"
    run.mkdir()
    lines = gzip.decompress((packed_dir / "commspan-rank0.jsonl.gz").read_bytes()).splitlines()
    key = b'"commspan.tensor.bytes","value":{"intValue":"'
    assert key in lines[0]
    head, _, tail = lines[0].partition(key)
    lines[0] = head + key + b"18446744073709551616" + tail[tail.index(b'"'):]
    (run / "commspan-rank0.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    trace = tmp_path / "t.json"
    for argv in (["summary"], ["html", "-o", str(tmp_path / "r.html")],
                 ["perfetto", "-o", str(trace)], ["digest"]):
        code, _, err = _cli(capsys, argv[0], str(run), *argv[1:])
        # (rank 0's file of a fake world of 4)
        note = ("" if argv[0] == "digest" else "commspan: ranks 1-3 of 4 wrote no spans (no "
                "file of theirs read): what follows covers rank 0 only\n")
        assert (code, err) == (0, note), argv
    assert "18446744073709551616" in trace.read_text()
    code, out, _ = _cli(capsys, "table", str(run), "--show", "bytes")
    assert code == 0 and "18,446,744,073,709,55" in out


def test_control_characters_in_names_reach_the_terminal_escaped(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module name carrying ESC and BEL (a terminal title change, a colour) is printed
    with visible escapes by every text command, never raw."""
    run = tmp_path / "run"
    run.mkdir()
    data = gzip.decompress((packed_dir / "commspan-rank0.jsonl.gz").read_bytes())
    evil = "MLP.net1\u001b]0;OWNED\u0007\u001b[31mRED"
    assert b'"stringValue":"MLP.net1"' in data
    (run / "commspan-rank0.jsonl").write_bytes(
        data.replace(b'"stringValue":"MLP.net1"', f'"stringValue":{json.dumps(evil)}'.encode()))
    for argv in (["table", "--rank", "0", "--show", "all"], ["summary", "--show", "all"],
                 ["check"], ["diff", str(packed_dir / "commspan-rank0.jsonl.gz")]):
        code, out, err = _cli(capsys, argv[0], str(run), *argv[1:])
        assert "\x1b" not in out + err and "\x07" not in out + err, argv
        if argv[0] == "table":
            assert "MLP.net1\\x1b]0;OWNED\\x07\\x1b[31mRED" in out, (argv, out, err)


def test_html_findings_from_a_file_and_check_are_listed_once(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--findings`` holding check's own findings, plus ``--check``: each once."""
    code, out, _ = _cli(capsys, "check", str(packed_dir), "--json")
    found = json.loads(out)["findings"]
    assert found  # ranks 2 and 3 of the world of 4 wrote nothing: a finding
    saved = tmp_path / "findings.json"
    saved.write_text(out)
    code, out, _ = _cli(capsys, "html", str(packed_dir), "-o", str(tmp_path / "r.html"),
                        "--findings", str(saved), "--check")
    assert code == 0 and out.rstrip().endswith(
        f", {len(found)} finding{'' if len(found) == 1 else 's'}")


def test_plan_import_errors_name_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "needs.py"
    plan.write_text("import nosuchthing_zz\n\ndef setup():\n    pass\n")
    code, _, err = _cli(capsys, "plan", f"{plan}:setup", "--world", "2")
    assert code == 1 and f"FILE.py:FUNCTION '{plan}:setup': importing" in err
    assert "No module named 'nosuchthing_zz'" in err
    code, _, err = _cli(capsys, "plan", "nosuch_mod_zz:setup", "--world", "2")
    assert code == 1 and "no module 'nosuch_mod_zz'" in err


def test_plan_imports_a_module_of_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``commspan plan mymod:setup`` beside ``mymod.py``: the `commspan` script's
    sys.path lacks the current directory (``python -m commspan``'s has it), and the
    same command said "no module 'mymod'"; it imports the module now (what follows,
    the plan on a fake process group, is not this test's)."""
    import sys

    (tmp_path / "cwd_plan_zz.py").write_text(
        "import pathlib\npathlib.Path('imported').touch()\n\ndef setup():\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_plan_zz", raising=False)
    code, out, err = _cli(capsys, "plan", "cwd_plan_zz:setup", "--world", "4")
    sys.modules.pop("cwd_plan_zz", None)
    assert code == 1 and not out
    assert (tmp_path / "imported").exists(), err  # (the module ran)
    assert not err.startswith("ModuleNotFoundError"), err


def test_usage_errors_show_the_commands_usage(
    packed_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rules checked after parsing (diff of one folder, --run twice) and options the
    command does not take (digest --json) answer with the command's usage line, as
    argparse's own errors of a known option's value do."""
    for argv, command in ((["diff", str(packed_dir)], "diff"),
                          (["summary", str(packed_dir), "--run", "a", "--run", "b"], "summary"),
                          (["digest", str(packed_dir), "--json"], "digest"),
                          (["plan", "x.py:setup", "--world", "2", "--step", "0"], "plan")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert err.startswith(f"usage: commspan {command} ")
        assert f"commspan {command}: error:" in err


def test_of_a_copy_and_a_grown_file_the_grown_one_is_read(
    packed_dir: Path, tmp_path: Path
) -> None:
    """``gunzip -k`` and then the plain file grew (another run appended), or ``gzip -k``
    of a plain file that kept growing: the file holding more lines is read, the
    copy that is a prefix of it is not, and their shared lines are read once."""
    folder = tmp_path / "grown"
    shutil.copytree(packed_dir, folder)
    packed = folder / "commspan-rank0.jsonl.gz"
    lines = gzip.decompress(packed.read_bytes()).splitlines(keepends=True)
    plain = folder / "commspan-rank0.jsonl"
    plain.write_bytes(b"".join(lines) + lines[0])  # the copy, grown by a line
    assert {f.name for f in jsonl_files(folder)} == {
        "commspan-rank0.jsonl", "commspan-rank1.jsonl.gz"}
    packed.write_bytes(gzip.compress(b"".join(lines[:1])))  # an old, shorter archive
    plain.write_bytes(b"".join(lines))
    assert {f.name for f in jsonl_files(folder)} == {
        "commspan-rank0.jsonl", "commspan-rank1.jsonl.gz"}


def _members(data: bytes) -> list[bytes]:
    """A compressed file cut into its gzip members (one per line)."""
    out = []
    while data:
        d = zlib.decompressobj(31)
        d.decompress(data)
        out.append(data[:len(data) - len(d.unused_data)])
        data = d.unused_data
    return out


@pytest.mark.parametrize("copy", ["gunzip-k", "cp"])
@pytest.mark.parametrize("held", ["all", "fewer"])
def test_a_copy_beside_a_compressed_file_being_written_is_read_once(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], copy: str,
    held: str,
) -> None:
    """The rank's ``.jsonl.gz`` is being written (its last line cut mid-member) beside
    a copy taken earlier (``gunzip -k``, or ``cp`` of the compressed file), holding all
    its whole lines or fewer: the copy is left out as when the file is whole (the cut
    member used to make the two differ, and the rank was counted twice)."""
    folder = tmp_path / copy
    shutil.copytree(packed_dir, folder)
    packed = folder / "commspan-rank0.jsonl.gz"
    members = _members(packed.read_bytes())
    assert len(members) >= 2
    taken = b"".join(members if held == "all" else members[:-1])
    if copy == "gunzip-k":
        kept, copied = packed, folder / "commspan-rank0.jsonl"
        copied.write_bytes(gzip.decompress(taken))
    else:
        kept, copied = folder / "commspan-rank0.jsonl.gz", folder / "rank0-copy.jsonl.gz"
        copied.write_bytes(taken)
    packed.write_bytes(b"".join(members) + members[-1][: len(members[-1]) // 2])
    whole = tmp_path / "whole"  # the reference: the lines the folder holds, once
    whole.mkdir()
    (whole / "rank0.jsonl.gz").write_bytes(b"".join(members))
    expected = _raw_collectives(whole / "rank0.jsonl.gz", folder / "commspan-rank1.jsonl.gz")
    code, out, err = _cli(capsys, "summary", str(folder), "--rank", "all", "--json")
    assert code == 0 and json.loads(out)["total"] == expected
    assert f"not reading {copied} (read {kept})" in err
    assert {f.name for f in jsonl_files(folder, notes=[])} == {
        kept.name, "commspan-rank1.jsonl.gz"}
    assert Aggregator.from_jsonl(folder, rank="all").total_count() == expected


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc")
def test_a_read_error_after_open_names_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    """A file that opens and then fails to read (EIO, as a failing disk or a network
    filesystem gives; /proc/self/mem here) is named with what to do; it was a bare
    "OSError: [Errno 5] Input/output error"."""
    code, _, err = _cli(capsys, "summary", "/proc/self/mem")
    assert code == 1 and "Traceback" not in err
    assert "/proc/self/mem cannot be read (" in err and "leave it out of FILES" in err


def test_a_copy_beside_a_compressed_file_of_short_lines_being_written_is_left_out(
    tmp_path: Path,
) -> None:
    """As above with lines so short that a file's first 4 KiB (decompressed) reach
    the member being written: the files were told apart by those 4 KiB, read with
    ``gzip``, which gave up on the cut member, and both were read (a rank counted
    twice, for small or young files)."""
    lines = [b'{"resourceSpans":[],"n":%d}\n' % n for n in range(40)]
    members = [gzip.compress(line, mtime=0) for line in lines]
    (tmp_path / "X.jsonl.gz").write_bytes(b"".join(members) + members[0][:10])
    (tmp_path / "X.jsonl").write_bytes(b"".join(lines[:30]))  # gunzip -k, earlier
    notes: list[str] = []
    assert [f.name for f in jsonl_files(tmp_path, notes=notes)] == ["X.jsonl.gz"]
    assert len(notes) == 1 and "not reading" in notes[0]


def _any_value(v: object) -> dict[str, object]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": v}


@pytest.mark.parametrize(("key", "value"), [
    (semconv.TENSOR_BYTES, "12kB"), (semconv.MODULE_DEPTH, "deep"),
    (semconv.TENSOR_SHAPE, 7), (semconv.PG_RANKS, 1.5), (semconv.PARAM_NAMES, "str"),
    (semconv.PARAM_PLACEMENTS, -1)])
def test_an_attribute_of_the_wrong_type_damages_its_line_in_every_command(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str,
    value: object
) -> None:
    """An attribute the readers convert, of a type commspan never writes, in the first
    line of rank 0's file: every command names the file, line, attribute and value,
    skips that line as damaged (status 1, no traceback), and counts what the files
    without that line hold."""
    damaged, clean = tmp_path / "damaged", tmp_path / "clean"
    damaged.mkdir()
    clean.mkdir()
    for packed in sorted(packed_dir.glob("*.jsonl.gz")):
        lines = gzip.decompress(packed.read_bytes()).splitlines(keepends=True)
        name = packed.name.removesuffix(".gz")
        (clean / name).write_bytes(b"".join(lines[1:] if "rank0" in name else lines))
        if "rank0" in name:
            doc = json.loads(lines[0])
            hits = 0
            for rs in doc["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        for a in [*span.get("attributes", []), *(
                                b for e in span.get("events", []) for b in e["attributes"])]:
                            if a["key"] == key:
                                a["value"] = _any_value(value)
                                hits += 1
            assert hits
            lines[0] = json.dumps(doc).encode() + b"\n"
        (damaged / name).write_bytes(b"".join(lines))
    where = f"{damaged / 'commspan-rank0.jsonl'}:1: "
    for command in (["summary", "--rank", "all", "--json"], ["table", "--rank", "all", "--json"],
                    ["html", "-o", str(tmp_path / "r.html")],
                    ["perfetto", "-o", str(tmp_path / "t.json")]):
        code, out, err = _cli(capsys, command[0], str(damaged), *command[1:])
        assert code == 1 and "Traceback" not in err, err
        named = [ln for ln in err.splitlines() if ln.startswith(f"ValueError: {where}")]
        assert len(named) == 1 and f"{key} is {value!r}, not " in named[0], err
        assert "1 damaged line" in err, err
        if command[0] in ("summary", "table"):
            _, expected, _ = _cli(capsys, command[0], str(clean), *command[1:])
            got, want = json.loads(out), json.loads(expected)
            if command[0] == "summary":  # (and the hand count of the other lines')
                assert got["total"] == _raw_collectives(*sorted(clean.iterdir())) > 0
                got, want = got["collectives"], want["collectives"]
            assert got == want


@pytest.mark.parametrize(("key", "value"), [
    ("traceId", []), ("spanId", {"hex": "ab"}), ("parentSpanId", 7)])
def test_a_span_id_that_is_no_string_damages_its_line_in_every_command(
    packed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str,
    value: object
) -> None:
    """A span id of another JSON type than a string, in the first line of rank 0's
    file: every command names the file, line and field and skips the line as damaged.
    It used to end check, stragglers and summary with "TypeError: unhashable type:
    'list'", naming neither the file nor the line."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for packed in sorted(packed_dir.glob("*.jsonl.gz")):
        lines = gzip.decompress(packed.read_bytes()).splitlines(keepends=True)
        name = packed.name.removesuffix(".gz")
        if "rank0" in name:
            doc = json.loads(lines[0])
            doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0][key] = value
            lines[0] = json.dumps(doc).encode() + b"\n"
        (damaged / name).write_bytes(b"".join(lines))
    where = f"ValueError: {damaged / 'commspan-rank0.jsonl'}:1: "
    for command in ("check", "stragglers", "summary", "table"):
        extra = ("--rank", "all") if command in ("summary", "table") else ()
        code, _, err = _cli(capsys, command, str(damaged), *extra)
        assert code == (2 if command == "check" else 1), (command, err)
        assert "Traceback" not in err and "TypeError" not in err, err
        named = [ln for ln in err.splitlines() if ln.startswith(where)]
        assert len(named) == 1 and f".{key} is {value!r}" in named[0], (command, err)
        assert "1 damaged line" in err, err


def test_a_span_id_of_json_null_is_no_id(tmp_path: Path) -> None:
    """proto3 JSON writes a default field as null: ``"parentSpanId": null`` is a root
    span (no parent), as an absent or empty one, not a damaged line."""
    from commspan.exporters import read_spans

    span = {"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331",
            "parentSpanId": None, "name": "commspan.rank", "kind": 1,
            "startTimeUnixNano": "1", "endTimeUnixNano": "2"}
    doc = {"resourceSpans": [{"resource": {"attributes": []},
                              "scopeSpans": [{"spans": [span]}]}]}
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(doc) + "\n")
    (record,) = read_spans(path)
    assert record.parent_span_id == "" and record.span_id == "b7ad6b7169203331"


@pytest.mark.parametrize("digest", [False, True])
def test_a_rank_whose_spans_end_early_is_named_with_the_steps_it_leaves_out(
    tmp_path: Path, fake_pg: None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], digest: bool,
) -> None:
    """Rank 1's file keeps steps 0-1 of 4 (its last lines lost: killed while they were
    written): summary's total is the all_reduces of the lines left (counted here), and
    summary, table and diff say that rank 1's spans end at step 1 and steps 2-3 leave
    it out (the total read as four steps of two ranks, diff's per-step counts as a
    changed program)."""
    from _tracing import AllReduceNet

    from commspan.capture.ranks import Ranks
    from commspan.session import mode as mode_module

    issued = {0: 0, 1: 0}

    run = tmp_path / "run"
    for rank in (0, 1):
        monkeypatch.setattr(mode_module, "process_ranks", lambda r=rank: Ranks(r, r, 2))
        mode = CommSpanMode(run_id="early", exporters=[JsonlSpanExporter(run / f"r{rank}.jsonl")])
        with mode:
            for step in range(4):
                with mode.step(step):
                    AllReduceNet()(torch.randn(2, 4))
                mode.flush()
                if rank == 1 and step == 1:  # what its file will keep
                    kept = (run / "r1.jsonl").stat().st_size
                if rank == 0 or step <= 1:
                    issued[rank] += 1
        mode.shutdown()
    whole = tmp_path / "whole"
    shutil.copytree(run, whole)
    os.truncate(run / "r1.jsonl", kept)
    if digest:
        assert main(["digest", str(run)]) == 0
    capsys.readouterr()
    note = ("rank 1's spans end at step 1, the other ranks' at step 3 (a rank that stopped, "
            "or whose file was cut or is still being written): the counts of steps 2-3 "
            "leave those ranks out")
    assert main(["summary", str(run), "--rank", "all", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["total"] == issued[0] + issued[1] == 6
    assert note in err
    assert main(["table", str(run), "--rank", "all"]) == 0
    assert note in capsys.readouterr().err
    assert main(["diff", str(run), str(whole)]) == 1
    assert f"A: {note}" in capsys.readouterr().err
    assert main(["summary", str(whole), "--rank", "all"]) == 0
    assert "spans end at" not in capsys.readouterr().err
