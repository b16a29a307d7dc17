"""A damaged line in the middle of one rank's file: what it held is unknown, not different.

Runs written by a traced model on the fake process group (4 ranks, steps 0-3, one
forward and one backward all_reduce per step, rank 2 issuing one more in step 3: a
real divergence), then rewritten one span per line, as an export queue that sends
small batches writes a step over several lines. One line of rank 1's step 1 is then
damaged in several ways; the findings are compared with those of the same files
undamaged, and the damaged step and line with those we damaged.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from _cli_runs import net_step, run_cli, session_dir, write_run

DAMAGED_RANK, DAMAGED_STEP = 1, 1
DIVERGENT = (2, 3)  # (rank, step) issuing one more all_reduce

DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda line: line[: len(line) // 2] + b"\n",
    "garbage": lambda line: b"\x00\xff\x1b[31m garbage \xfe\n",
    "empty": lambda line: b"\n",
    "wrong shape": lambda line: b'{"resourceSpans": {"spans": 3}}\n',
}


def _relined(path: Path, per_step: bool) -> None:
    """Rewrite a file one span per line, or one step per line (each line a whole
    OTLP/JSON request with the spans' resource and scope), keeping the spans' order:
    the exporter's lines depend on when its thread woke up."""
    out: list[bytes] = []
    last = None
    for raw in path.read_bytes().splitlines():
        doc = orjson.loads(raw)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    if per_step and span["traceId"] == last:
                        line = orjson.loads(out[-1])
                        line["resourceSpans"][0]["scopeSpans"][0]["spans"].append(span)
                        out[-1] = orjson.dumps(line)
                    else:
                        out.append(orjson.dumps({"resourceSpans": [
                            {**rs, "scopeSpans": [{**ss, "spans": [span]}]}]}))
                    last = span["traceId"]
    path.write_bytes(b"\n".join(out) + b"\n")


def _spans(raw: bytes) -> list[dict[str, Any]]:
    doc = orjson.loads(raw)
    return [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


def _attr(span: dict[str, Any], key: str) -> Any:
    for a in span.get("attributes", ()):
        if a["key"] == key:
            return next(iter(a["value"].values()))
    return None


def _line_of(path: Path, step: int, holding: Callable[[dict[str, Any]], bool]) -> int:
    """The number (from 1) of the first line of ``path`` with a span of ``step`` that
    ``holding`` accepts (the step's trace: that of its ``commspan.rank`` span)."""
    lines = path.read_bytes().splitlines()
    trace = next(s["traceId"] for raw in lines for s in _spans(raw)
                 if s["name"] == "commspan.rank" and int(_attr(s, "commspan.step")) == step)
    return next(i for i, raw in enumerate(lines, 1)
                if any(s["traceId"] == trace and holding(s) for s in _spans(raw)))


def _has_collective(span: dict[str, Any]) -> bool:
    return any(_attr(e, "commspan.collective.op") for e in span.get("events", ()))


def _damage(src: Path, dst: Path, how: str, line: int | None = None) -> tuple[Path, int]:
    """``src`` copied to ``dst`` with one line of rank 1's file damaged ``how``: by
    default the first holding a collective of step 1 (a forward all_reduce)."""
    for f in src.glob("*.jsonl"):
        shutil.copy(f, dst / f.name)
    path = dst / f"commspan-rank{DAMAGED_RANK}.jsonl"
    if line is None:
        line = _line_of(path, DAMAGED_STEP, _has_collective)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1] = DAMAGE[how](lines[line - 1])
    path.write_bytes(b"".join(lines))
    return path, line


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """The run as the exporter wrote it."""
    return session_dir(tmp_path_factory, "damaged-written", lambda out: write_run(
        out, "damaged", net_step(extra_on=DIVERGENT), steps=range(4)))


def _relined_dir(tmp_path_factory: pytest.TempPathFactory, written: Path, name: str,
                 per_step: bool) -> Path:
    def build(out: Path) -> None:
        for f in written.glob("*.jsonl"):
            shutil.copy(f, out / f.name)
            _relined(out / f.name, per_step)

    return session_dir(tmp_path_factory, name, build)


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory, written: Path) -> Path:
    """The spans one per line: a step spread over several lines."""
    return _relined_dir(tmp_path_factory, written, "damaged-split", per_step=False)


@pytest.fixture(scope="module")
def batched(tmp_path_factory: pytest.TempPathFactory, written: Path) -> Path:
    """The spans one step per line."""
    return _relined_dir(tmp_path_factory, written, "damaged-batched", per_step=True)


def _check(capsys: pytest.CaptureFixture[str], path: Path, *more: str
           ) -> tuple[int, dict[str, Any], str]:
    code, out, err = run_cli(capsys, "check", str(path), "--json", *more)
    return code, json.loads(out), err


def _others(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in data["findings"] if f["kind"] != "unread"]


def _assert_unread(data: dict[str, Any], path: Path, line: int, steps: list[int]) -> None:
    unread = [f for f in data["findings"] if f["kind"] == "unread"]
    assert len(unread) == 1, data["findings"]
    (finding,) = unread
    assert finding["ranks"] == {str(DAMAGED_RANK): {
        "op": None, "fqn": None, "phase": None, "seq": None, "state": "unread",
        "steps": steps}}
    assert (finding["step"], finding["steps"]) == (steps[0], steps)
    assert (finding["file"], finding["line"]) == (str(path), line)
    assert finding["reason"] and finding["group"] is None
    assert finding["message"].startswith(
        f"rank {DAMAGED_RANK}, step {steps[0]}: not compared: {path}:{line} is damaged (")
    assert data["checked"]["unread"] == len(steps)


def test_the_undamaged_run_finds_only_the_real_divergence(
    split: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference: rank 2's extra all_reduce in step 3, nothing else."""
    code, data, err = _check(capsys, split)
    assert (code, err) == (1, "")
    assert [(f["kind"], f["step"]) for f in data["findings"]] == [("mismatch", 3)]
    assert data["findings"][0]["ranks"]["2"]["fqn"] == "Net"
    assert data["checked"]["unread"] == 0


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_line_leaves_its_rank_out_of_its_step_only(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """A damaged line holding one of rank 1's step-1 collectives: no finding blames rank
    1 for it; one ``unread`` finding names rank 1, step 1, the file and line; every other
    finding (the real divergence in step 3) is the undamaged run's; exit 2 (damaged
    input), the line named on stderr."""
    _, reference, _ = _check(capsys, split)
    path, line = _damage(split, tmp_path, how)
    code, data, err = _check(capsys, tmp_path)
    assert code == 2
    assert _others(data) == _others(reference)
    _assert_unread(data, path, line, [DAMAGED_STEP])
    # rank 1's 2 collectives of step 1 are left out of the comparison, nothing else
    assert data["checked"]["collectives"] == reference["checked"]["collectives"] - 2
    assert {k: v for k, v in data["checked"].items() if k not in ("collectives", "unread")} \
        == {k: v for k, v in reference["checked"].items() if k not in ("collectives", "unread")}
    assert f"ValueError: {path}:{line}: " in err
    # the text names it too, and the same from Python (check_run, strict=False)
    code, out, _ = run_cli(capsys, "check", str(tmp_path))
    assert code == 2 and out.startswith(f"unread    rank 1, step 1: not compared: {path}:{line}")
    from commspan.analysis import check_run
    from commspan.exporters import ReadReport

    report = ReadReport()
    result = check_run(tmp_path, strict=False, report=report)
    assert result.to_dict()["findings"] == data["findings"]
    assert [(s.path, s.line) for s in report.damaged] == [(str(path), line)]


def test_a_line_of_module_spans_only_costs_no_comparison(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged line holding a module span without collectives (`Net.block` forward): the
    rank span's counts show every collective of the step was read, so everything is
    compared as in the undamaged run; exit 2 all the same (a line was lost)."""
    _, reference, _ = _check(capsys, split)
    line = _line_of(split / "commspan-rank1.jsonl", DAMAGED_STEP,
                    lambda s: s["name"] == "Net.block forward")
    _damage(split, tmp_path, "garbage", line)
    code, data, _ = _check(capsys, tmp_path)
    assert code == 2 and data == reference


def test_a_lost_line_holding_a_whole_step(
    batched: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line per step: rank 1's step 1 lost whole is unread, not
    'rank 1 wrote no span'; steps 0 and 2 around it are whole (their rank spans count
    what was read) and compared."""
    _, reference, _ = _check(capsys, batched)
    line = _line_of(batched / "commspan-rank1.jsonl", DAMAGED_STEP, _has_collective)
    path, _ = _damage(batched, tmp_path, "truncated", line)
    code, data, _ = _check(capsys, tmp_path)
    assert code == 2
    assert _others(data) == _others(reference)
    _assert_unread(data, path, line, [DAMAGED_STEP])


def test_digests_read_the_lines_around_a_damaged_line(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With digests: a damaged span line (no digest line for it) gives the findings the
    lines give; a damaged digest line (its span line intact) is read from the span line:
    the undamaged run's findings, exit 1."""
    _, reference, _ = _check(capsys, split)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    path, line = _damage(split, damaged, "truncated")
    _, lines_only, _ = _check(capsys, damaged, "--no-digest")
    assert run_cli(capsys, "digest", str(damaged))[0] == 1  # (a damaged line skipped)
    code, data, _ = _check(capsys, damaged)
    assert code == 2 and data == lines_only
    _assert_unread(data, path, line, [DAMAGED_STEP])

    intact = tmp_path / "digest-damaged"
    intact.mkdir()
    for f in split.glob("*.jsonl"):
        shutil.copy(f, intact / f.name)
    assert run_cli(capsys, "digest", str(intact))[0] == 0
    digest = intact / "commspan-rank1.jsonl.digest"
    digest_lines = digest.read_bytes().splitlines(keepends=True)
    digest_lines[8] = b"{oops\n"
    digest.write_bytes(b"".join(digest_lines))
    code, data, err = _check(capsys, intact)
    assert (code, data, err) == (1, reference, "")


@pytest.mark.parametrize(
    ("command", "status"),
    [(["summary", "--rank", "all"], 1), (["table", "--rank", "all"], 1),
     (["stragglers"], 1), (["diff"], 2)])
def test_the_other_commands_name_the_line_and_the_short_step(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str],
    status: int,
) -> None:
    """summary, table, stragglers and diff: no traceback, the damaged line named, and a
    line saying rank 1's counts of step 1 may be short; their status says lines were
    lost."""
    path, line = _damage(split, tmp_path, "garbage")
    argv = [command[0], str(split), str(tmp_path)] if command == ["diff"] \
        else [*command, str(tmp_path)]
    code, out, err = run_cli(capsys, *argv)
    assert code == status and out and "Traceback" not in err
    label = "B: " if command == ["diff"] else ""
    assert (f"commspan: {label}{path}:{line} is damaged: rank 1's collectives of step 1 may "
            "be missing from what follows") in err
    assert f"ValueError: {path}:{line}: " in err


def test_html_check_lists_the_unread_step(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``html --check``: the report lists the real divergence and the unread step, not a
    mismatch of rank 1 in step 1."""
    damaged = tmp_path / "run"
    damaged.mkdir()
    _damage(split, damaged, "garbage")
    report = tmp_path / "report.html"
    code, _, err = run_cli(capsys, "html", str(damaged), "-o", str(report), "--check")
    assert code == 1 and "Traceback" not in err
    assert sorted(re.findall(r'data-kind="(\w+)"', report.read_text())) == ["mismatch", "unread"]


def test_a_damaged_line_in_a_step_number_used_again(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """Steps 0, 1, 2, then 0 and 1 again (an evaluation loop numbering its steps anew:
    a step number used again shares its trace). A damaged line holding a collective of
    rank 1's second step 1 makes rank 1 unread in step 1, not the rank that issued one
    all_reduce fewer there; the undamaged run has no finding."""
    reused = session_dir(tmp_path_factory, "damaged-reused", lambda out: write_run(
        out, "reused", net_step(), steps=[0, 1, 2, 0, 1]))
    for f in reused.glob("*.jsonl"):
        shutil.copy(f, tmp_path / f.name)
        _relined(tmp_path / f.name, per_step=False)
    code, reference, _ = _check(capsys, tmp_path)
    assert (code, reference["findings"]) == (0, [])
    path = tmp_path / f"commspan-rank{DAMAGED_RANK}.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    trace = next(s["traceId"] for raw in lines for s in _spans(raw)
                 if s["name"] == "commspan.rank" and int(_attr(s, "commspan.step")) == 1)
    line = max(i for i, raw in enumerate(lines, 1)
               if any(s["traceId"] == trace and _has_collective(s) for s in _spans(raw)))
    lines[line - 1] = DAMAGE["garbage"](lines[line - 1])
    path.write_bytes(b"".join(lines))
    code, data, _ = _check(capsys, tmp_path)
    assert code == 2
    assert _others(data) == []
    _assert_unread(data, path, line, [DAMAGED_STEP])


def test_empty_lines_at_the_end_of_a_file_are_no_damage(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Empty lines after a file's last line (``echo >> FILE``, an editor) lost nothing:
    ``read_spans(strict=True)`` reads every span of the file, and ``check`` gives the
    undamaged run's findings and status, with a digest or without."""
    from commspan.exporters import read_spans

    _, reference, _ = _check(capsys, split)
    for f in split.glob("*.jsonl"):
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / f"commspan-rank{DAMAGED_RANK}.jsonl"
    expected = [s["spanId"] for raw in path.read_bytes().splitlines() for s in _spans(raw)]
    with path.open("ab") as fh:
        fh.write(b"\n \n\r\n")
    assert [r.span_id for r in read_spans(path)] == expected
    assert _check(capsys, tmp_path, "--no-digest") == (1, reference, "")
    assert run_cli(capsys, "digest", str(tmp_path))[0] == 0
    assert _check(capsys, tmp_path) == (1, reference, "")


def test_an_empty_line_in_the_middle_is_damaged_with_a_digest_too(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty line followed by others is a damaged line: the digest does not stand for
    it, so ``check`` with digests says so (exit 2, the line named) as without them."""
    for f in split.glob("*.jsonl"):
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / f"commspan-rank{DAMAGED_RANK}.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:3], b"\n", *lines[3:]]))
    code, lines_only, err = _check(capsys, tmp_path, "--no-digest")
    assert code == 2 and f"ValueError: {path}:4: an empty line" in err
    assert run_cli(capsys, "digest", str(tmp_path))[0] == 1  # (a damaged line skipped)
    code, data, err = _check(capsys, tmp_path)
    assert (code, data) == (2, lines_only) and f"ValueError: {path}:4: an empty line" in err


def test_diff_names_a_damaged_line_on_each_side(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``diff A B``, both with a damaged line: each side's short step is named (B's was
    not once A's had been located)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    path_a, line = _damage(split, a, "garbage")
    path_b, _ = _damage(split, b, "garbage")
    code, _, err = run_cli(capsys, "diff", str(a), str(b))
    assert code == 2
    for label, path in (("A", path_a), ("B", path_b)):
        assert (f"commspan: {label}: {path}:{line} is damaged: rank 1's collectives of "
                "step 1 may be missing") in err
    assert f"B: {path_a}" not in err and f"A: {path_b}" not in err


def _owned_lines(src: Path) -> list[tuple[int, bytes]]:
    """``(rank, line)`` of every line of the rank files of ``src``, each file's in order."""
    return [(rank, raw) for rank in range(4)
            for raw in (src / f"commspan-rank{rank}.jsonl").read_bytes().splitlines()]


def _ranks_of(raw: bytes) -> set[int]:
    """The ranks whose spans a line holds (its resources' ``commspan.rank``)."""
    doc = orjson.loads(raw)
    return {int(_attr({"attributes": rs["resource"]["attributes"]}, "commspan.rank"))
            for rs in doc["resourceSpans"]}


def _step_of_line(raw: bytes, trace_steps: dict[str, int]) -> set[int]:
    return {trace_steps[s["traceId"]] for s in _spans(raw) if s["traceId"] in trace_steps}


def _trace_steps(lines: list[bytes]) -> dict[str, int]:
    """trace id -> step, from the rank spans of ``lines``."""
    return {s["traceId"]: int(_attr(s, "commspan.step")) for raw in lines for s in _spans(raw)
            if s["name"] == "commspan.rank"}


def _one_file(out: Path, lines: list[bytes]) -> Path:
    out.mkdir()
    path = out / "all.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _multi_check(capsys: pytest.CaptureFixture[str], tmp_path: Path, lines: list[bytes],
                 damaged: int) -> tuple[dict[str, Any], dict[str, Any], Path, str]:
    """``check`` of ``lines`` in one file, whole (the reference) and with line
    ``damaged`` (from 1) garbled: (reference, damaged run's output, path, stderr)."""
    code, reference, _ = _check(capsys, _one_file(tmp_path / "whole", lines).parent)
    assert code == 1
    bad = list(lines)
    bad[damaged - 1] = DAMAGE["garbage"](bad[damaged - 1] + b"\n").rstrip(b"\n")
    path = _one_file(tmp_path / "damaged", bad)
    code, data, err = _check(capsys, path.parent)
    assert code == 2
    return reference, data, path, err


def _unread_of(data: dict[str, Any]) -> dict[str, Any]:
    (finding,) = [f for f in data["findings"] if f["kind"] == "unread"]
    return finding


def test_a_file_of_several_ranks_interleaved_credits_the_rank_that_wrote_the_line(
    split: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One file holding every rank's lines, in turn (one exporter writing for several
    ranks): a damaged line of rank 1's step 1 lies between a line of rank 0 and one of
    rank 2. Rank 1 alone is unread in step 1 (the others' rank spans of step 1 count
    every collective read); it was credited to rank 0, the line before, and rank 1's
    step 1 compared short: a mismatch blaming rank 1."""
    owned = _owned_lines(split)
    per_rank = [[raw for r, raw in owned if r == rank] for rank in range(4)]
    lines: list[bytes] = []
    for row in range(max(map(len, per_rank))):
        lines.extend(raws[row] for raws in per_rank if row < len(raws))
    steps = _trace_steps(lines)
    damaged = next(i for i, raw in enumerate(lines, 1) if _ranks_of(raw) == {DAMAGED_RANK}
                   and _step_of_line(raw, steps) == {DAMAGED_STEP}
                   and any(_has_collective(s) for s in _spans(raw)))
    assert (_ranks_of(lines[damaged - 2]), _ranks_of(lines[damaged])) == ({0}, {2})
    reference, data, path, _ = _multi_check(capsys, tmp_path, lines, damaged)
    assert _others(data) == _others(reference)
    finding = _unread_of(data)
    assert (finding["file"], finding["line"], finding["steps"]) == (str(path), damaged, [1])
    assert list(finding["ranks"]) == [str(DAMAGED_RANK)]


def test_a_damaged_line_where_one_rank_s_lines_end_and_the_next_begin(
    batched: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ranks' files concatenated (a step per line): rank 1's first line, holding
    all of its step 0, damaged. Rank 1 is unread in step 0 (it was credited to rank 0,
    whose lines all lie before it, and rank 1 reported missing from step 0)."""
    owned = _owned_lines(batched)
    lines = [raw for _, raw in owned]
    damaged = next(i for i, (r, _) in enumerate(owned, 1) if r == DAMAGED_RANK)
    assert _step_of_line(lines[damaged - 1], _trace_steps(lines)) == {0}
    reference, data, path, _ = _multi_check(capsys, tmp_path, lines, damaged)
    assert _others(data) == _others(reference)
    finding = _unread_of(data)
    assert (finding["file"], finding["line"], finding["steps"]) == (str(path), damaged, [0])
    assert list(finding["ranks"]) == [str(DAMAGED_RANK)]


def test_a_damaged_line_holding_several_ranks_names_each(
    batched: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One exporter writing ranks 0 and 1 in one line per step, ranks 2 and 3 in
    another: the line of ranks 0 and 1's step 1 damaged. Both are unread in step 1, in
    one finding; ranks 2 and 3 are compared there (the rest as undamaged); the other
    commands name both ranks' short counts."""
    per_rank = {rank: (batched / f"commspan-rank{rank}.jsonl").read_bytes().splitlines()
                for rank in range(4)}
    lines = []
    for row in range(4):  # (a line per step of each rank: steps 0-3)
        for pair in ((0, 1), (2, 3)):
            docs = [orjson.loads(per_rank[r][row]) for r in pair]
            lines.append(orjson.dumps({"resourceSpans": [
                rs for doc in docs for rs in doc["resourceSpans"]]}))
    steps = _trace_steps(lines)
    damaged = next(i for i, raw in enumerate(lines, 1) if _ranks_of(raw) == {0, 1}
                   and _step_of_line(raw, steps) == {DAMAGED_STEP})
    reference, data, path, _ = _multi_check(capsys, tmp_path, lines, damaged)
    assert _others(data) == _others(reference)
    finding = _unread_of(data)
    assert (finding["file"], finding["line"], finding["steps"]) == (str(path), damaged, [1])
    assert finding["ranks"] == {str(r): {"op": None, "fqn": None, "phase": None, "seq": None,
                                         "state": "unread", "steps": [1]} for r in (0, 1)}
    assert finding["message"].startswith(f"ranks 0, 1, step 1: not compared: {path}:{damaged}")
    assert "collectives of ranks 0, 1 there (the file holds lines of several ranks)" \
        in finding["message"]
    assert data["checked"]["unread"] == 2
    code, _, err = run_cli(capsys, "summary", str(path), "--rank", "all")
    assert code == 1 and (f"commspan: {path}:{damaged} is damaged: collectives of rank 0 in "
                          "step 1 and of rank 1 in step 1 may be missing from what follows "
                          "(counts of those ranks there may be short)") in err


def test_the_line_tally_takes_a_few_bytes_per_line_of_one_span() -> None:
    """Every line read is tallied (where a damaged line lies, copied lines): a file of
    one span per line (an exporter sending small batches) has as many lines as spans,
    millions at a thousand ranks, so what the tally keeps per line must stay small (it
    kept 524 bytes, 1.5 GB for 1,024 ranks x 20 steps of the medium model's 143 spans)."""
    import tracemalloc

    from commspan import semconv
    from commspan.analysis.unread import LineTally
    from commspan.otlpjson.records import SpanRecord

    def records(rank: int, step: int) -> list[SpanRecord]:
        return [SpanRecord(name=semconv.SPAN_RANK if k == 99 else "m",
                           trace_id=f"{step + 1:032x}",  # (a string of its own, as read)
                           span_id=f"{rank:08x}{step * 100 + k:08x}", parent_span_id="",
                           start_time=k, end_time=k + 1, rank=rank,
                           attributes={semconv.STEP: step, semconv.MODULE_FQN: "m"})
                for k in range(100)]

    made = [(rank, records(rank, step)) for rank in range(8) for step in range(10)]
    tally = LineTally()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        numbers = [0] * 8
        read_at = {}
        for rank, recs in made:
            for rec in recs:
                numbers[rank] += 1
                tally.add(f"/run/rank{rank}.jsonl", numbers[rank], [rec])
                read_at[rec.span_id] = numbers[rank]
        per_line = (tracemalloc.get_traced_memory()[0] - before) / sum(numbers)
    finally:
        tracemalloc.stop()
    assert per_line < 200, per_line
    # and it still knows where each line was read: a line read again is a copy
    rank, recs = made[15]  # (rank 1, step 5)
    tally.add("/run/copy.jsonl", 1, [recs[3]])
    assert tally.copies == [(1, recs[3].trace_id, ("/run/rank1.jsonl", read_at[recs[3].span_id]),
                             ("/run/copy.jsonl", 1))]
    assert read_at[recs[3].span_id] == 504
