"""Digests (``JsonlSpanExporter(digest=True)``, ``commspan digest``): the readers give the
same answers from a run's digests as from its JSONL lines, whatever happened to either.

The reference everywhere is the same reader on the same JSONL files without their
digests: the line-by-line parse that predates digests.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_runs import net_step, run_cli, session_dir, tp_run, without_step_ends, write_run
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from commspan import Aggregator, CommSpanMode, semconv
from commspan.analysis import digest as digest_mod
from commspan.analysis.digest import digest_path, read_digest, write_digest
from commspan.exporters import JsonlSpanExporter, ReadReport
from commspan.testing import fake_mesh
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

# what each CLI command is asked, on every run directory below
COMMANDS: list[list[str]] = [
    ["summary", "--rank", "all"],
    ["summary", "--rank", "all", "--json"],
    ["summary", "--rank", "1"],
    ["summary", "--rank", "all", "--steps", "1-2"],
    ["table", "--rank", "all"],
    ["table", "--rank", "0", "--json"],
    ["table", "--rank", "all", "--by-mesh-dim"],
    ["table", "--rank", "all", "--step", "1", "--noise", "1"],
    ["check"],
    ["check", "--json"],
    ["check", "--steps", "1-1"],
    ["stragglers"],
    ["stragglers", "--json"],
    ["stragglers", "--steps", "1-2", "--json"],
    ["diff", "--step", "0", "--step", "2"],
    ["diff", "--steps", "0-1", "--steps", "2-2", "--json"],
    ["diff", "--step", "1", "--step", "2", "--rank", "1"],
    ["diff", "--run", "first", "--run", "second", "--json"],
]


def _changed(raw: bytes, change: Any) -> bytes:
    """Digest line ``raw`` with its object changed by ``change`` and checksummed again."""
    body, _, blob, blob_crc = raw.rsplit(b" ", 3)
    body = change(body)
    return b"%s %08x %s %s\n" % (body, zlib.crc32(body), blob, blob_crc)


def _without_digests(run: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in run.iterdir():
        if f.is_file() and not f.name.endswith(".digest"):
            shutil.copy(f, out / f.name)
    return out


def _with_digests(run: Path, out: Path) -> Path:
    _without_digests(run, out)
    for f in out.iterdir():
        if f.name.endswith((".jsonl", ".jsonl.gz")):
            write_digest(f)
    return out


def _answers(capsys: pytest.CaptureFixture[str], run: Path) -> list[tuple[int, str, str]]:
    answers = []
    for cmd in COMMANDS:
        code, out, err = run_cli(capsys, cmd[0], str(run), *cmd[1:])
        answers.append((code, out.replace(str(run), "RUN"), err.replace(str(run), "RUN")))
    return answers


def _agg(folder: Path, **kwargs: Any) -> tuple[Any, ...]:
    report = ReadReport()
    agg = Aggregator.from_jsonl(folder, report=report, strict=False, **kwargs)
    return (agg.to_dict(), agg.mesh_dim_counts(), agg.mesh_dim_counts(subtree=False),
            sorted(agg.collectives(), key=repr), agg.modules(), agg.parameter_info(),
            (report.lines, report.spans, report.commspan_spans, sorted(report.ranks),
             [(Path(s.path).name, s.kind) for s in report.skipped]))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


def _api(folder: Path, **kwargs: Any) -> tuple[Any, ...]:
    """What the Python API answers over ``folder`` (``check_run``, ``stragglers``,
    ``load_run``), with the warnings it logged and what its report counted, or the
    error it raised."""
    from commspan.analysis import check_run, load_run, stragglers

    answers: list[Any] = []
    logger = logging.getLogger("commspan")
    for call in (check_run, stragglers, load_run):
        warnings, report = _Warnings(), ReadReport()
        logger.addHandler(warnings)
        try:
            got = call(folder, strict=False, report=report, **kwargs)
        except ValueError as exc:
            got = f"{type(exc).__name__}: {exc}".replace(str(folder), "RUN")
        finally:
            logger.removeHandler(warnings)
        if call is load_run and not isinstance(got, str):
            got = (sorted(got.collectives, key=repr), got.rank_steps,
                   sorted(got.module_spans, key=repr), sorted(got.hangs, key=repr),
                   sorted(got.gc_pauses, key=repr), got.presence, got.trace_steps,
                   got.ranks, got.world_size, got.trace_start, got.unread)
        elif not isinstance(got, str):
            got = got.to_dict()
        answers.append((got, [t.replace(str(folder), "RUN") for t in warnings.texts],
                        (report.lines, report.spans, report.commspan_spans,
                         sorted(report.ranks), [(Path(s.path).name, s.kind)
                                                for s in report.skipped])))
    return tuple(answers)


def _profiles(folder: Path) -> list[Any]:
    """What ``commspan diff`` folds of each side (``ProfileBuilder``, from the digests
    where ``load_parts`` can read them, else from the spans, as the command reads):
    the profile (placements, mesh dimensions, counts, bytes), ranks, module ranks,
    last steps and traces of each run, of every rank and of rank 1, of every step and
    of steps 1-2."""
    from commspan.analysis.diff import ProfileBuilder
    from commspan.analysis.digest import load_parts
    from commspan.analysis.runs import StepRange
    from commspan.exporters import read_spans
    from commspan.otlpjson.files import jsonl_files

    out: list[Any] = []
    for rank in (None, 1):
        builder = ProfileBuilder(rank)
        read = ReadReport()
        parts = load_parts(jsonl_files(folder), read)
        if parts is not None and not read.damaged:
            builder.add_parts(parts)
        else:
            builder.hold(read_spans(folder, strict=False, report=ReadReport()))
        for run in (None, *_run_ids(folder)):
            for steps in (None, StepRange(1, 2)):
                try:
                    side = builder.select(run, steps)
                    got: Any = side.profile()
                except ValueError as exc:  # (SelectionError: no such steps)
                    out.append((rank, run, steps, str(exc)))
                    continue
                out.append((rank, run, steps, got, side.ranks(), side.module_ranks(),
                            side.last_steps(), side.traces))
    return out


_LOAD_PARTS = digest_mod.load_parts


@pytest.fixture(autouse=True)
def _lines_where_a_digest_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference of this module: the spans of the lines wherever a file has no
    digest, as the readers read before files without one were digested in memory
    (``load_parts`` parses and digests their lines itself: :func:`_same_answers`
    compares that with both, through :func:`_in_memory`)."""
    def lines_where_undigested(files: Sequence[Path], *args: Any, **kwargs: Any) -> Any:
        if any(read_digest(f) is None for f in files):
            return None
        return _LOAD_PARTS(files, *args, **kwargs)

    monkeypatch.setattr(digest_mod, "load_parts", lines_where_undigested)


@contextlib.contextmanager
def _in_memory() -> Iterator[None]:
    """The readers as they are: a file without a digest digested in memory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(digest_mod, "load_parts", _LOAD_PARTS)
        yield


def _same_answers(capsys: pytest.CaptureFixture[str], digested: Path, plain: Path) -> list[Any]:
    """The answers of every reader are the same from ``digested`` (its digest files) as
    from ``plain``'s lines, and from ``plain`` digested in memory as its lines are
    parsed (:func:`_in_memory`); returns what diff folded (:func:`_profiles`)."""
    assert any(f.name.endswith(".digest") for f in digested.iterdir())
    assert not any(f.name.endswith(".digest") for f in plain.iterdir())
    answers = _answers(capsys, plain)
    aggs = {(run, rank): _agg(plain, rank=rank, run=run)
            for run in ("all", *_run_ids(plain)) for rank in ("all", 1)}
    profiles = _profiles(plain)
    apis = {(api_run, steps): _api(plain, run=api_run, steps=steps)
            for api_run in (None, *_run_ids(plain)) for steps in (None, (1, 2), (99,))}
    for folder, way in ((digested, contextlib.nullcontext()), (plain, _in_memory())):
        with way:
            assert _answers(capsys, folder) == answers, folder.name
            for (run, rank), agg in aggs.items():
                assert _agg(folder, rank=rank, run=run) == agg, (folder.name, run, rank)
            assert _profiles(folder) == profiles, folder.name
            for (api_run, steps), api in apis.items():
                assert _api(folder, run=api_run, steps=steps) == api, (folder.name, api_run,
                                                                      steps)
    return profiles


def _run_ids(run: Path) -> list[str]:
    from commspan.analysis.runs import list_runs
    from commspan.exporters import read_spans

    return [r.run_id for r in list_runs(list(read_spans(run)))]


# ====================================================================== runs
@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    return tp_run(tmp_path_factory)


@pytest.fixture(scope="module")
def divergent_two_runs(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """Two runs in one directory; in the second, rank 1 issues one more all_reduce in step 1."""
    def build(out: Path) -> None:
        write_run(out, "first", net_step(), steps=(0, 1, 2))
        write_run(out, "second", net_step(extra_on=(1, 1)), steps=(0, 1, 2))

    return session_dir(tmp_path_factory, "digest-two-runs", build)


class _Chunked(SpanExporter):
    """Hands its exporter 50 spans at a time: lines then split steps."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        results = [self.inner.export(spans[i:i + 50]) for i in range(0, len(spans), 50)]
        ok = all(r == SpanExportResult.SUCCESS for r in results)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.inner.shutdown()


def _traced(out: Path, *, steps: int = 3, ranks: tuple[int, ...] = (0, 1, 2, 3),
            dump_at: tuple[int, int] | None = None, **exporter: Any) -> Path:
    """The TP Transformer traced with ``JsonlSpanExporter(digest=True, **exporter)``,
    one small export batch at a time (so steps straddle lines); ``dump_at=(rank, step)``
    writes a hang record (``mode.dump()``) there."""
    model = parallelize(Transformer(ModelArgs()), fake_mesh(4))
    tokens, targets = make_batch(model.model_args)
    out.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        name = f"commspan-rank{rank}.jsonl" + (".gz" if exporter.get("compress") else "")
        mode = CommSpanMode(
            exporters=[_Chunked(JsonlSpanExporter(out / name, **{"digest": True, **exporter}))],
            run_id="traced", resource_attributes={"commspan.rank": rank},
        )
        with mode:
            for step in range(steps):
                with mode.step(step):
                    train_step(model, tokens, targets)
                    if (rank, step) == dump_at:
                        mode.dump()
                model.zero_grad(set_to_none=True)
        mode.shutdown()
    return out


# ====================================================================== the same answers
@pytest.mark.parametrize("name", ["tp", "divergent_two_runs"])
def test_cli_and_from_jsonl_answer_the_same_from_digests(
    name: str, request: pytest.FixtureRequest, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every command of COMMANDS, and ``Aggregator.from_jsonl``, give the same output from
    digests written by ``commspan digest`` as from the lines."""
    run = request.getfixturevalue(name)
    plain = _without_digests(run, tmp_path / "plain")
    code, out, err = run_cli(capsys, "digest", str(_without_digests(run, tmp_path / "d")))
    assert (code, err) == (0, "") and out.startswith("digests written for 4 files")
    profiles = _same_answers(capsys, tmp_path / "d", plain)
    if name == "tp":  # (diff's placements and mesh dimensions, from the digests too)
        assert any(u.placements and u.group_totals for p in profiles
                   if not isinstance(p[3], str) for u in p[3].usage.values())


@pytest.mark.parametrize("compress", [False, True])
def test_digests_written_while_tracing(
    compress: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """``JsonlSpanExporter(digest=True)`` (plain and compressed files, small export batches)
    writes digests the readers use, and they give the lines' answers."""
    run = _traced(tmp_path / "run", compress=compress)
    suffix = ".jsonl.gz" if compress else ".jsonl"
    for rank in range(4):
        digest = read_digest(run / f"commspan-rank{rank}{suffix}")
        assert digest is not None
        assert digest.size == (run / f"commspan-rank{rank}{suffix}").stat().st_size
        assert digest.gaps() == []  # every line stands in the digest
        assert len(digest.covered) > 3  # several lines: steps straddle them
    _same_answers(capsys, run, _without_digests(run, tmp_path / "plain"))


def test_the_digest_is_used_not_the_lines(tmp_path: Path, fake_pg: None) -> None:
    """With a digest, ``from_jsonl`` reads no JSONL line (a reader that parsed the lines
    would count what they say): proven by a digest whose counts differ from its lines."""
    run = _traced(tmp_path / "run", ranks=(0,), steps=2)
    path = run / "commspan-rank0.jsonl"
    side = digest_path(path)
    lines = []
    for raw in side.read_bytes().splitlines():
        lines.append(_changed(raw, lambda body: body.replace(
            b'\\"all_reduce\\":1', b'\\"all_reduce\\":1000')))
    assert b"".join(lines) != side.read_bytes()
    side.write_bytes(b"".join(lines))
    report = ReadReport()
    counts = Aggregator.from_jsonl(run, report=report).module_counts()
    assert report.lines == len(read_digest(path).covered)  # type: ignore[union-attr]
    assert max(n for ph in counts.values() for ops in ph.values() for n in ops.values()) > 900


def test_the_python_api_reads_digests_not_the_lines(
    tp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``load_run``, ``check_run`` and ``stragglers`` read a digested run without
    parsing a line, as the commands do (over 1,024 ranks: seconds instead of minutes),
    and give the lines' answers (``_same_answers``, every accident above)."""
    from commspan.analysis import check_run, load_run, stragglers
    from commspan.analysis import records as records_module

    plain = _without_digests(tp, tmp_path / "plain")
    digested = _with_digests(tp, tmp_path / "digested")
    expected = (check_run(plain).to_dict(), stragglers(plain).to_dict(),
                stragglers(plain, steps=[1]).to_dict(), len(load_run(plain).collectives))
    assert expected[1]["step_times"] and expected[3] > 0

    def parse_lines(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the lines of a digested run were parsed")

    monkeypatch.setattr(records_module, "_read", parse_lines)
    assert (check_run(digested).to_dict(), stragglers(digested).to_dict(),
            stragglers(digested, steps=[1]).to_dict(),
            len(load_run(digested).collectives)) == expected
    with pytest.raises(AssertionError, match="were parsed"):
        check_run(plain)  # (the patch holds: without digests the lines are read)


def test_diff_reads_digests_not_the_lines(
    divergent_two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``commspan diff`` folds each side from its digests where it has them (it parsed
    every line: 349 s over 1,024 ranks), with the lines' answer: two runs of a folder
    (the second's rank 1 issues one more all_reduce in step 1), and A digested
    against B not."""
    from commspan.cli.commands import Reader

    plain = _without_digests(divergent_two_runs, tmp_path / "plain")
    digested = _with_digests(divergent_two_runs, tmp_path / "digested")
    args = ["--run", "first", "--run", "second", "--json"]
    expected = run_cli(capsys, "diff", str(plain), *args)
    assert expected[0] == 1 and json.loads(expected[1])["entries"]  # (the extra all_reduce)
    read = Reader.read

    def lines_of(self: Any, paths: Sequence[str], label: str = "FILES", **kw: Any) -> Any:
        if any(str(digested) in str(p) for p in paths):
            raise AssertionError(f"the lines of a digested side were parsed: {paths}")
        return read(self, paths, label, **kw)

    monkeypatch.setattr(Reader, "read", lines_of)
    got = run_cli(capsys, "diff", str(digested), *args)
    assert got == (expected[0], expected[1].replace(str(plain), str(digested)), expected[2])
    one = _without_digests(divergent_two_runs, tmp_path / "one-run")
    for f in one.glob("*.jsonl"):  # (B: the second run's spans only, from its lines)
        f.write_text("".join(line for line in f.read_text().splitlines(keepends=True)
                             if '"second"' in line))
    first = ["--run", "first", "--run", "second", "--json"]
    lines_only = run_cli(capsys, "diff", str(plain), str(one), *first)
    assert lines_only[0] == 1, lines_only
    mixed = run_cli(capsys, "diff", str(digested), str(one), *first)
    assert mixed == (lines_only[0], lines_only[1].replace(str(plain), str(digested)),
                     lines_only[2].replace(str(plain), str(digested)))


def _spans_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


def _step_attr(span: dict[str, Any]) -> Any:
    return next((a["value"] for a in span.get("attributes", [])
                 if a["key"] == "commspan.step"), None)


def _drop_step_ends(docs: list[dict[str, Any]], traces: set[str]) -> None:
    """Remove the rank and step spans of ``traces`` from ``docs``: those steps cut short."""
    for doc in docs:
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                ss["spans"] = [s for s in ss["spans"] if not (
                    s["traceId"] in traces and s["name"] in ("commspan.rank", "commspan.step"))]


def test_a_step_used_again_and_cut_short_in_one_line_reads_as_from_the_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """Steps 0, 1, 0 written as one line per rank, rank 1's step 1 cut short (its
    rank and step spans lost): its latest trace is step 0's, used again after step 1,
    so step 1 was cut short. Digests took the trace of the part whose first span
    started last (step 1: maybe still running), so summary named nothing and diff
    compared it; parts now keep their latest span's start (``last_start``)."""
    base = tmp_path / "base"
    write_run(base, "rep", net_step(), steps=(0, 1, 0))
    for f in base.glob("*.jsonl"):
        docs = [json.loads(line) for line in f.read_text().splitlines()]
        merged = docs[0]
        for doc in docs[1:]:
            merged["resourceSpans"].extend(doc["resourceSpans"])
        if f.name.endswith("rank1.jsonl"):
            step1 = {s["traceId"] for s in _spans_of(merged) if s["name"] == "commspan.rank"
                     and int(_step_attr(s)["intValue"]) == 1}
            assert step1
            _drop_step_ends([merged], step1)
        f.write_text(json.dumps(merged) + "\n")
    plain = _without_digests(base, tmp_path / "plain")
    digested = _with_digests(base, tmp_path / "digested")
    for cmd in (["summary", "--rank", "all"], ["diff", "--step", "0", "--step", "1"],
                ["diff", "--step", "0", "--step", "1", "--json"], ["check"]):
        expected = run_cli(capsys, cmd[0], str(plain), *cmd[1:])
        if cmd[0] == "summary":
            assert "step 1 of rank 1 was cut short" in expected[2]
        got = run_cli(capsys, cmd[0], str(digested), *cmd[1:])
        assert got == tuple(x.replace(str(plain), str(digested)) if isinstance(x, str) else x
                            for x in expected), cmd


def _late_module_span_of_a_step_cut_short(run: Path) -> None:
    """Rank 1's step 1 lost its rank and step spans, and one of its module spans ends
    after step 2's spans: the rank's latest trace is still step 2's (latest start)."""
    f = run / "commspan-rank1.jsonl"
    docs = [json.loads(line) for line in f.read_text().splitlines()]
    spans = [s for d in docs for s in _spans_of(d)]
    trace = {int(_step_attr(s)["intValue"]): s["traceId"] for s in spans
             if s["name"] == "commspan.rank"}
    end2 = max(int(s["endTimeUnixNano"]) for s in spans if s["traceId"] == trace[2])
    late = next(s for s in spans if s["traceId"] == trace[1] and "commspan" not in s["name"])
    late["endTimeUnixNano"] = str(end2 + 1000)
    _drop_step_ends(docs, {trace[1]})
    f.write_text("".join(json.dumps(d) + "\n" for d in docs))


def _a_boolean_step(run: Path) -> None:
    """Step 2's spans say their step as a boolean (the lines' readers number it in
    some places: such a line is parsed, not digested)."""
    for f in run.glob("*.jsonl"):
        docs = [json.loads(line) for line in f.read_text().splitlines()]
        for d in docs[2:]:
            for s in _spans_of(d):
                for a in s.get("attributes", []):
                    if a["key"] == "commspan.step":
                        a["value"] = {"boolValue": True}
        f.write_text("".join(json.dumps(d) + "\n" for d in docs))


@pytest.mark.parametrize("change", [_late_module_span_of_a_step_cut_short, _a_boolean_step])
def test_odd_lines_read_from_digests_as_from_the_lines(
    change: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """summary, diff and check from digests answer as from the lines (found in review:
    a part's end, then a boolean step, gave other answers)."""
    base = tmp_path / "base"
    write_run(base, "odd", net_step(), steps=(0, 1, 2))
    change(base)
    plain = _without_digests(base, tmp_path / "plain")
    digested = _with_digests(base, tmp_path / "digested")
    for cmd in (["summary", "--rank", "all"], ["diff", "--step", "0", "--step", "1"],
                ["diff", "--steps", "0-1", "--steps", "1-2", "--json"], ["check", "--json"]):
        expected = run_cli(capsys, cmd[0], str(plain), *cmd[1:])
        got = run_cli(capsys, cmd[0], str(digested), *cmd[1:])
        assert got == tuple(x.replace(str(plain), str(digested)) if isinstance(x, str) else x
                            for x in expected), cmd


def test_diff_names_older_digests_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """Both sides' files with digests of an older version: one note, not one per side."""
    base = tmp_path / "base"
    write_run(base, "first", net_step(), steps=(0, 1))
    a, b = _with_digests(base, tmp_path / "a"), _with_digests(base, tmp_path / "b")
    for side in [*a.glob("*.digest"), *b.glob("*.digest")]:
        side.write_bytes(side.read_bytes().replace(b'{"digest":8,', b'{"digest":6,'))
    err = run_cli(capsys, "diff", str(a), str(b))[2]
    assert err.count("digests of version 6") == 1, err


def test_a_digested_side_names_no_damaged_line_of_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """diff A B, A read from its lines (one damaged), B from its digests: the damaged
    line is A's only (the digested B named it too)."""
    base = tmp_path / "base"
    write_run(base, "first", net_step(), steps=(0, 1, 2))
    a = _without_digests(base, tmp_path / "a")
    f = a / "commspan-rank1.jsonl"
    lines = f.read_bytes().splitlines(keepends=True)
    lines[min(1, len(lines) - 1)] = b'{"resourceSpans": [garbage\n'  # (one line: the
    f.write_bytes(b"".join(lines))  # export thread may have written the steps at once)
    plain = _without_digests(base, tmp_path / "b")
    expected = run_cli(capsys, "diff", str(a), str(plain))
    assert expected[2].count("is damaged") == 1
    digested = _with_digests(base, tmp_path / "b-digested")
    assert run_cli(capsys, "diff", str(a), str(digested)) == tuple(
        x.replace(str(plain), str(digested)) if isinstance(x, str) else x for x in expected)


def test_a_run_two_jobs_wrote_is_warned_about_once(tp: Path, tmp_path: Path) -> None:
    """Two processes wrote each rank's file under one run id: ``load_run`` says so in
    one warning, from the lines and from the digests (it said it twice)."""
    from commspan.analysis import load_run

    plain = _without_digests(tp, tmp_path / "plain")
    for f in plain.glob("*.jsonl"):  # (the same spans again, from another pid)
        data = f.read_text()
        again = re.sub(r'("process\.pid","value":\{"intValue":)"?\d+"?', r'\1"1"', data)
        assert again != data
        f.write_text(data + again)
    digested = _with_digests(plain, tmp_path / "digested")
    for folder in (plain, digested):
        warnings = _Warnings()
        logging.getLogger("commspan").addHandler(warnings)
        try:
            load_run(folder)
        finally:
            logging.getLogger("commspan").removeHandler(warnings)
        assert [t for t in warnings.texts if "written by 2 processes" in t] == [
            "run tp-run was written by 2 processes for one rank (two jobs under one run id: "
            "a fixed COMMSPAN_RUN_ID or run_id=): their steps are added up; give each job "
            "its own run id"], folder.name


@pytest.mark.parametrize("command", ["summary", "table", "check"])
def test_no_digest_reads_the_lines(
    tmp_path: Path, fake_pg: None, capsys: pytest.CaptureFixture[str], command: str,
) -> None:
    """``--no-digest``: the command's answer is the lines', even beside a digest that
    says otherwise (a digest whose counts differ from its lines); without the option
    the digest is read (the test would pass on a reader that ignored digests)."""
    run = _traced(tmp_path / "run", ranks=(0,), steps=2)
    plain = _without_digests(run, tmp_path / "plain")
    side = digest_path(run / "commspan-rank0.jsonl")
    lines = []
    for raw in side.read_bytes().splitlines():
        lines.append(_changed(raw, lambda body: body.replace(
            b'\\"all_reduce\\":1', b'\\"all_reduce\\":1000')))
    side.write_bytes(b"".join(lines))
    expected = run_cli(capsys, command, str(plain), "--json")
    assert run_cli(capsys, command, str(run), "--json", "--no-digest")[:2] == expected[:2]
    if command == "table":  # (the lie is in the module counts, which table prints)
        assert run_cli(capsys, command, str(run), "--json")[1] != expected[1]


def _small_then_big_line(tmp_path: Path) -> tuple[str, str]:
    """A small line of a traced run, and one of more than 1 MiB holding every span
    of its two ranks twenty times."""
    run = _traced(tmp_path / "run", ranks=(0, 1), steps=2)
    spans = []
    for f in sorted(run.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            spans.extend(json.loads(line)["resourceSpans"])
    first = (run / "commspan-rank0.jsonl").read_text().splitlines()[0]
    big = json.dumps({"resourceSpans": spans * 20}, separators=(",", ":"))
    assert len(big) > 1 << 20
    return first, big


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "compressed"])
def test_a_line_longer_than_the_limit_is_not_read_from_its_digest(
    tmp_path: Path, fake_pg: None, capsys: pytest.CaptureFixture[str], compressed: bool,
) -> None:
    """``--max-line-mib``: a line longer than the limit ends its file's reading, from
    the lines and from a digest alike (same exit status, same counts). A compressed
    file's digest knows each line's compressed length only (here under the limit):
    under a limit below the default, such a file is read from its lines."""
    first, big = _small_then_big_line(tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()
    if compressed:
        packed_big = gzip.compress(big.encode() + b"\n")
        assert len(packed_big) < 1 << 20  # over the limit, its member under it
        (plain / "all.jsonl.gz").write_bytes(
            gzip.compress(first.encode() + b"\n") + packed_big)
    else:
        (plain / "all.jsonl").write_text(first + "\n" + big + "\n")
    digested = _with_digests(plain, tmp_path / "digested")
    expected = run_cli(capsys, "summary", str(plain), "--json", "--max-line-mib", "1")
    assert expected[0] == 1 and "longer than" in expected[2]
    got = run_cli(capsys, "summary", str(digested), "--json", "--max-line-mib", "1")
    assert got[:2] == expected[:2]


# ====================================================================== what can go wrong
def _cut_digest(run: Path, keep: int) -> None:
    for side in run.glob("*.digest"):
        lines = side.read_bytes().splitlines(keepends=True)
        side.write_bytes(b"".join(lines[:keep]))


def _damage_digest(run: Path) -> None:
    for side in run.glob("*.digest"):
        data = bytearray(side.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 40] = b"#" * 40
        side.write_bytes(bytes(data))


def _append_second_writer(run: Path) -> None:
    """A second process appends steps to the same files (its own digest lines follow)."""
    _traced(run, steps=2)


def _replace_jsonl(run: Path) -> None:
    """The JSONL files are replaced by other runs' files; the old digests stay."""
    other = _traced(run.parent / "other", steps=2)
    for f in other.glob("*.jsonl"):
        shutil.copy(f, run / f.name)


def _cut_jsonl(run: Path) -> None:
    """A crash cut each file's last line short (its digest line was written)."""
    for f in run.glob("*.jsonl"):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 100])


@pytest.mark.parametrize("accident", [
    _cut_digest.__name__, _damage_digest.__name__, _append_second_writer.__name__,
    _replace_jsonl.__name__, _cut_jsonl.__name__, "hang_record",
])
def test_answers_stay_right_whatever_happened(
    accident: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """Digests cut short, damaged, written by two writers, left beside replaced or
    crash-cut JSONL files, or lines holding a hang record: the answers are still the
    lines' (the reader parses what the digest does not stand for)."""
    if accident == "hang_record":
        run = _traced(tmp_path / "run", dump_at=(2, 1))
    else:
        run = _traced(tmp_path / "run")
        {
            "_cut_digest": lambda r: _cut_digest(r, 2),
            "_damage_digest": _damage_digest,
            "_append_second_writer": _append_second_writer,
            "_replace_jsonl": _replace_jsonl,
            "_cut_jsonl": _cut_jsonl,
        }[accident](run)
    _same_answers(capsys, run, _without_digests(run, tmp_path / "plain"))


def _lose_a_rank_span(run: Path, rank: int, step: int) -> None:
    """As in a real run, only rank 0 writes the ``commspan.step`` root (one process played
    every rank here: the others' are removed), and ``rank``'s ``commspan.rank`` span of
    ``step`` is lost (dropped by the export queue) while the rest was written."""
    for f in run.glob("*.jsonl"):
        r = int(f.name.removeprefix("commspan-rank").removesuffix(".jsonl"))
        lines = []
        for line in f.read_bytes().splitlines():
            doc = json.loads(line)
            for rs in doc["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    ss["spans"] = [sp for sp in ss["spans"] if not (
                        (sp["name"] == semconv.SPAN_STEP and r != 0)
                        or (sp["name"] == semconv.SPAN_RANK and r == rank
                            and {"key": semconv.STEP, "value": {"intValue": str(step)}}
                            in sp["attributes"]))]
            lines.append(json.dumps(doc, separators=(",", ":")).encode())
        f.write_bytes(b"\n".join(lines) + b"\n")


def test_a_step_cut_short_is_named_from_the_other_ranks_spans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """Rank 1's rank span of step 1 is lost and only rank 0 wrote step roots: the lines
    name the step from the other ranks' spans of its trace ("step 1 of rank 1 was cut
    short"); the digests said "a step of rank 1" (the step from rank 1's own part)."""
    plain = _without_digests(_traced(tmp_path / "run"), tmp_path / "plain")
    _lose_a_rank_span(plain, rank=1, step=1)
    digested = _with_digests(plain, tmp_path / "digested")
    code, out, err = run_cli(capsys, "summary", str(plain), "--rank", "all", "--json")
    assert json.loads(out)["partial"] == [{"rank": 1, "step": 1}]
    assert "step 1 of rank 1 was cut short" in err
    _same_answers(capsys, digested, plain)


def test_ints_beyond_64_bits_come_back_as_ints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """A collective's bytes and a rank beyond 64 bits (older files may hold them): the
    digests gave them back as floats (orjson reads such an int as one), so ``table
    --json`` and ``summary`` printed ``9.87...e+29`` and ``3.68...e+19``. Lines holding
    one get no digest parts: they are parsed, and the answers are the lines'."""
    plain = _without_digests(_traced(tmp_path / "run", steps=2), tmp_path / "plain")
    big = 2**100
    for f in plain.glob("*.jsonl"):
        data = f.read_bytes().replace(
            b'{"key":"commspan.tensor.bytes","value":{"intValue":"', b"@", 2).replace(
            b"@", b'{"key":"commspan.tensor.bytes","value":{"intValue":"%d' % big, 2)
        if f.name == "commspan-rank3.jsonl":
            data = data.replace(b'{"key":"commspan.rank","value":{"intValue":"3"}}',
                                b'{"key":"commspan.rank","value":{"intValue":"%d"}}' % 2**65)
        f.write_bytes(data)
    digested = _with_digests(plain, tmp_path / "digested")
    code, out, _ = run_cli(capsys, "summary", str(plain), "--rank", "all")
    assert code == 0 and f"0-2,{2**65}" in out
    code, out, _ = run_cli(capsys, "table", str(plain), "--rank", "all", "--by-mesh-dim",
                           "--json")
    assert code == 0 and re.search(r'"bytes": \d{30}', out) and "e+" not in out
    for cmd in (["table", "--rank", "all", "--json"], ["summary", "--rank", "all"],
                ["table", "--rank", "all", "--by-mesh-dim", "--json"]):
        assert run_cli(capsys, cmd[0], str(digested), *cmd[1:]) == run_cli(
            capsys, cmd[0], str(plain), *cmd[1:]), cmd
    assert _agg(digested, rank="all") == _agg(plain, rank="all")


def test_a_line_changed_near_its_start_is_read_not_its_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """A line whose bytes changed after its 64th byte but inside its first 2 KiB (a
    replaced file of the same program, whose spans differ there) kept its length and
    the bytes at its start, middle and end that the digest used to sample: the stale
    digest answered. The digest stands for the first 2 KiB too."""
    run = _traced(tmp_path / "run", steps=1)
    path = run / "commspan-rank0.jsonl"
    data = bytearray(path.read_bytes())
    first_line = data.index(b"\n")
    mid = first_line // 2
    key = b'"key":"commspan.module.fqn","value":{"stringValue":"'
    at = data.index(key, 64) + len(key)  # the first span's module
    end = data.index(b'"', at)
    assert end < 2048 and end < mid - 64 and end < first_line - 64
    data[end - 1:end] = b"Z" if data[end - 1:end] != b"Z" else b"Y"  # same length
    path.write_bytes(bytes(data))
    _same_answers(capsys, run, _without_digests(run, tmp_path / "plain"))


def test_a_file_without_digest_is_read_from_its_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """One rank's digest is missing: ``from_jsonl`` uses the others' and parses that file;
    the commands read the lines."""
    run = _traced(tmp_path / "run")
    digest_path(run / "commspan-rank3.jsonl").unlink()
    _same_answers(capsys, run, _without_digests(run, tmp_path / "plain"))


def test_write_digest_of_a_file_with_a_torn_line(tmp_path: Path, fake_pg: None) -> None:
    """``write_digest`` stands for the complete lines only; the cut one stays torn."""
    plain = tmp_path / "plain"
    torch_run = _traced(tmp_path / "t", ranks=(0,))
    _without_digests(torch_run, plain)
    path = plain / "commspan-rank0.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[:-50])
    lines = write_digest(path)
    assert lines == data.count(b"\n") - 1
    report = ReadReport()
    Aggregator.from_jsonl(path, report=report)
    assert [s.kind for s in report.skipped] == ["torn"]


# ====================================================================== the writer
def test_digest_argument_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"digest='yes' is not valid; pass True or False"):
        JsonlSpanExporter(tmp_path / "x.jsonl", digest="yes")  # type: ignore[arg-type]


def test_no_digest_unless_asked(tmp_path: Path, fake_pg: None) -> None:
    run = tmp_path / "run"
    write_run(run, "r", net_step(), ranks=(0,))
    assert [f.name for f in run.iterdir()] == ["commspan-rank0.jsonl"]


def test_a_digest_that_cannot_be_written_costs_no_span(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fake_pg: None
) -> None:
    """The digest's path is taken by a directory: every span is still exported, the
    problem is logged once, and the readers read the lines."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "commspan-rank0.jsonl.digest").mkdir()
    _traced(run, ranks=(0,))
    assert sum("cannot write the digest" in r.getMessage() for r in caplog.records) == 1
    assert read_digest(run / "commspan-rank0.jsonl") is None
    mode_spans = Aggregator.from_jsonl(run).total_count()
    assert mode_spans > 0


def test_digest_command_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "digest", str(tmp_path / "nowhere"))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err and "nowhere" in err
    # an empty file holds no commspan span: status 1, as summary says of it (it was 0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out, err = run_cli(capsys, "digest", str(empty))
    assert (code, out) == (1, "") and "no commspan span in" in err
    assert run_cli(capsys, "summary", str(empty))[0] == 1


def test_a_copy_of_some_lines_of_a_rank_is_named_not_counted_silently(
    tp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A file holding some lines of another (``tail -n 1 rank1.jsonl > copy.jsonl``: not
    a prefix copy, which is left unread) made every command count those steps twice,
    silently, status 0 (``check`` found a mismatch that was not there). The spans read
    twice (the same rank span) are named, file and line, and the status says so, from
    the lines and from digests alike (a digest standing for a copied line is not used);
    two runs compared by ``diff``, one a copy of the other, are no copy."""
    import logging

    from commspan.analysis.records import load_run

    run = _with_digests(tp, tmp_path / "run")
    lines = (run / "commspan-rank1.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) >= 2
    (run / "copy.jsonl").write_bytes(lines[-1])
    code, out, err = run_cli(capsys, "summary", str(run), "--rank", "all")
    assert code == 1 and out
    note = next(e for e in err.splitlines() if "read twice" in e)
    assert note.startswith(f"commspan: spans read twice (rank 1's step 2: "
                           f"{run / 'commspan-rank1.jsonl'}:{len(lines)} and "
                           f"{run / 'copy.jsonl'}:1): a file holds a copy of some lines")
    write_digest(run / "copy.jsonl")  # (every file digested: the digests are not used)
    for command, status in (("summary", 1), ("table", 1), ("check", 2), ("stragglers", 1)):
        extra = ["--rank", "all"] if command in ("summary", "table") else []
        code, _, err = run_cli(capsys, command, str(run), *extra)
        assert code == status and note in err.splitlines(), (command, err)
    (run / "copy.jsonl").unlink()
    assert run_cli(capsys, "check", str(run))[0] == 0
    again = tmp_path / "again.jsonl"  # (the Python readers: a warning)
    again.write_bytes(lines[-1])
    with caplog.at_level(logging.WARNING):
        load_run([run, again])
    assert any(r.getMessage().startswith("commspan: spans read twice (rank 1's step 2")
               for r in caplog.records)
    other = _with_digests(tp, tmp_path / "other")
    code, _, err = run_cli(capsys, "diff", str(run), str(other))
    assert code == 0 and "read twice" not in err
    # a copy on each side: each side's note names its own files only
    for side in (run, other):
        (side / "copy.jsonl").write_bytes(lines[-1])
    _, _, err = run_cli(capsys, "diff", str(run), str(other))
    notes = [e for e in err.splitlines() if "read twice" in e]
    assert [n.split(":", 2)[1] for n in notes] == [" A", " B"], notes
    assert str(other) not in notes[0] and str(run / "copy.jsonl") not in notes[1], notes


def test_a_copied_line_of_module_spans_only_is_named_not_counted_silently(
    fake_pg: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A copied line that holds no rank span (module spans and their collectives only:
    a step exported over several lines) was not found by the rank spans it lacks:
    ``table`` counted its collectives twice, status 0. Each line's first span of a
    rank and step finds it, from the lines and from digests alike; the original
    files' table is the reference."""
    run = _traced(tmp_path / "run", steps=2)  # (steps straddle lines)
    code, want, _ = run_cli(capsys, "table", str(run), "--rank", "1")
    assert code == 0
    lines = (run / "commspan-rank1.jsonl").read_bytes().splitlines(keepends=True)
    index, line = next(
        (i, raw) for i, raw in enumerate(lines)
        if i > 0  # (a copy of a file's first lines is a copy of the file: not read)
        and f'"{semconv.COLL_OP}"'.encode() in raw
        and f'"name":"{semconv.SPAN_RANK}"'.encode() not in raw)
    (run / "copy.jsonl").write_bytes(line)
    for digested in (False, True):
        if digested:
            write_digest(run / "copy.jsonl")
        code, out, err = run_cli(capsys, "table", str(run), "--rank", "1")
        assert code == 1, (digested, err)
        assert out != want  # (the copied line's collectives counted twice: said, below)
        assert (f"{run / 'commspan-rank1.jsonl'}:{index + 1} and {run / 'copy.jsonl'}:1"
                in err), (digested, err)
        code, _, err = run_cli(capsys, "check", str(run))
        assert code == 2 and "read twice" in err, (digested, err)
    for f in (run / "copy.jsonl", run / "copy.jsonl.digest"):
        f.unlink()
    assert run_cli(capsys, "table", str(run), "--rank", "1")[:2] == (0, want)


def test_a_line_and_its_copy_both_beyond_the_digest_are_named(
    fake_pg: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A digest that covers a file's first lines only (``commspan digest`` run mid-run, a
    second job appending without ``digest=True``): the lines after it were digested
    all at once, one part per rank and step, so a line and its copy there made one part
    and ``table`` counted the copy, status 0. They are digested a line at a time, as
    digests are: the copy is named, as when the lines are read."""
    run = _traced(tmp_path / "run", steps=2)
    rank1 = run / "commspan-rank1.jsonl"
    code, want, _ = run_cli(capsys, "table", str(run), "--rank", "1")
    assert code == 0
    lines = rank1.read_bytes().splitlines(keepends=True)
    digested = digest_path(rank1).read_bytes().splitlines(keepends=True)
    assert len(digested) == len(lines)  # (a digest line per line)
    index = next(i for i, raw in enumerate(lines)
                 if i > 0 and f'"{semconv.COLL_OP}"'.encode() in raw)
    digest_path(rank1).write_bytes(b"".join(digested[:index]))  # (lines from index on: none)
    assert run_cli(capsys, "table", str(run), "--rank", "1")[:2] == (0, want)
    with rank1.open("ab") as fh:
        fh.write(lines[index])
    for extra in ([], ["--no-digest"]):
        code, out, err = run_cli(capsys, "table", str(run), "--rank", "1", *extra)
        assert code == 1 and out != want, (extra, err)
        assert f"{rank1}:{index + 1} and {rank1}:{len(lines) + 1}" in err, (extra, err)


def test_two_jobs_under_one_run_id_are_no_copy(
    fake_pg: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Two jobs under one run id append to one file (their steps add up, said on
    stderr). Each session's root span has the id of its key, the same in both jobs: with
    one span per line (a ``SimpleSpanProcessor``), it was a line's first span and was
    taken for a copied line, status 1."""
    import torch.distributed as dist
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    path = tmp_path / "commspan-rank0.jsonl"
    for _job in range(2):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
        mode = CommSpanMode(tracer_provider=provider, run_id="same")
        layer, t = torch.nn.Linear(4, 4), torch.ones(4)
        with mode:
            dist.all_reduce(t)  # (outside steps: the session's trace)
            with mode.step(0):
                layer(torch.ones(2, 4))
                dist.all_reduce(t)
        mode.shutdown()
        provider.shutdown()
    roots = [json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
             for line in path.read_text().splitlines()]
    sessions = [r["spanId"] for r in roots if r["name"] == semconv.SPAN_SESSION]
    assert len(sessions) == 2 and sessions[0] == sessions[1]  # (what made it look copied)
    code, out, err = run_cli(capsys, "table", str(path), "--rank", "0")
    assert code == 0 and "read twice" not in err, err


def test_digest_leaves_no_temporary_file_when_it_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A digest is written to ``<digest>.tmp`` and moved into place: when the writing
    stops (a directory where the digest goes, Ctrl-C), the ``.tmp`` goes too, and the
    error says what to do (it said "pass a file in a directory you can write to")."""
    import commspan.analysis.digest as digest_module

    run = _without_digests(_traced(tmp_path / "run", ranks=(0, 1), steps=1), tmp_path / "p")
    side = digest_path(run / "commspan-rank1.jsonl")
    side.mkdir()
    code, _, err = run_cli(capsys, "digest", str(run))
    assert code == 1
    assert err.splitlines()[-1] == (f"OSError: {run / 'commspan-rank1.jsonl'}: cannot write "
                                    f"its digest: {side} is a directory; remove or rename it")
    side.rmdir()

    def interrupted(*args: Any, **kwargs: Any) -> bytes:
        raise KeyboardInterrupt

    monkeypatch.setattr(digest_module, "digest_line", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_digest(run / "commspan-rank1.jsonl")
    assert run_cli(capsys, "digest", str(run))[0] == 130
    assert not list(run.glob("*.tmp")), sorted(p.name for p in run.iterdir())


def test_digest_names_damaged_lines_as_the_other_commands_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """Lines that are no OTLP/JSON trace request: ``digest`` says what is wrong with each
    as ``summary`` does, not by a Python exception (``KeyError: 'resourceSpans'``)."""
    run = _without_digests(_traced(tmp_path / "run", ranks=(0,), steps=1), tmp_path / "p")
    with (run / "commspan-rank0.jsonl").open("ab") as fh:
        fh.write(b'{"resourceLogs":[]}\n[1,2]\n{"resourceSpans":[{"scopeSpans":[{"spans":'
                 b'[{"name":"x","startTimeUnixNano":"soon"}]}]}]}\nnot json\n')

    def damaged(err: str) -> list[str]:
        return [e for e in err.splitlines() if e.startswith("ValueError: ")]

    code, _, err = run_cli(capsys, "summary", str(run))
    expected = damaged(err)
    assert code == 1 and len(expected) == 4
    code, _, err = run_cli(capsys, "digest", str(run))
    assert code == 1 and damaged(err) == expected
    assert "Error: " not in err.replace("ValueError: ", "")


def test_digest_is_small(tmp_path: Path, fake_pg: None) -> None:
    """What repeats is written once per file: over 6 steps the digest is a fraction of
    the JSONL it stands for."""
    run = _traced(tmp_path / "run", ranks=(0,), steps=6)
    path = run / "commspan-rank0.jsonl"
    assert digest_path(path).stat().st_size < path.stat().st_size / 8


def test_digest_lines_are_json(tmp_path: Path, fake_pg: None) -> None:
    """Each digest line is a JSON object naming the line it stands for by offset and
    length, and those bytes are that line in the JSONL file; then a JSON array of its
    parts' module spans, and the CRC-32 of both."""
    run = _traced(tmp_path / "run", ranks=(0,), steps=2)
    path = run / "commspan-rank0.jsonl"
    data = path.read_bytes()
    for raw in digest_path(path).read_bytes().splitlines():
        body, crc, mods, mods_crc = raw.rsplit(b" ", 3)
        assert int(crc, 16) == zlib.crc32(body) and int(mods_crc, 16) == zlib.crc32(mods)
        doc = json.loads(body)
        assert len(json.loads(mods)) == len(doc["parts"])
        line = data[doc["offset"]: doc["offset"] + doc["length"]]
        assert line.endswith(b"\n") and b"\n" not in line[:-1]
        assert doc["spans"] == len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"])
    assert os.path.getsize(path) == sum(
        json.loads(raw.rsplit(b" ", 3)[0])["length"]
        for raw in digest_path(path).read_bytes().splitlines())


def test_from_jsonl_of_a_folder_of_two_runs_counts_one_or_says_so(
    divergent_two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A folder holding two runs (a program run twice into it): from_jsonl used to sum
    them silently. Without run= it now raises naming both; run=<id> counts that run
    (rank 1's extra all_reduce of the second run, in its step 1, is counted there
    only), run="all" sums them; the same from digests."""
    from commspan.exporters import read_spans

    expected: dict[str, int] = {}  # rank 1's collective events per run, from the lines
    for span in read_spans(divergent_two_runs / "commspan-rank1.jsonl"):
        run = str(span.resource.get(semconv.RUN_ID))
        expected[run] = expected.get(run, 0) + sum(
            1 for _, ev in span.events if semconv.COLL_OP in ev)
    digested = _without_digests(divergent_two_runs, tmp_path / "d")
    run_cli(capsys, "digest", str(digested))
    for folder in (divergent_two_runs, digested):
        with pytest.raises(ValueError, match=r"2 runs \('first', 'second'\).*run='all'"):
            Aggregator.from_jsonl(folder, rank=1)
        with pytest.raises(ValueError, match=r"run='third' is not a run of these files"):
            Aggregator.from_jsonl(folder, rank=1, run="third")
        per_run = {run: Aggregator.from_jsonl(folder, rank=1, run=run).total_count()
                   for run in ("first", "second", "all")}
        assert per_run == {**expected, "all": expected["first"] + expected["second"]}
        assert per_run["second"] > per_run["first"]


def _through_digests(run: Path) -> Any:
    """The run's records as ``commspan check`` reads them: from the digests only (fails
    if some line is not covered by its digest)."""
    from commspan.analysis.digest import load_parts, run_from_parts
    from commspan.otlpjson.files import jsonl_files

    parts = load_parts(jsonl_files([run]))
    assert parts is not None and all(p.get("table") is not None for p in parts)
    return run_from_parts(parts)


def test_digests_keep_each_collectives_wait(tmp_path: Path, fake_pg: None) -> None:
    """The records read through digests are those read from the lines, the time each
    functional collective spent in its wait (``commspan.collective.wait_ns``) included,
    and the tensor-parallel run has such waits."""
    from commspan.analysis.records import load_run

    run = _traced(tmp_path / "run", steps=2, ranks=(0, 1))
    plain = _without_digests(run, tmp_path / "plain")
    lines = sorted(load_run(plain).collectives)
    digested = sorted(_through_digests(run).collectives)
    assert digested == lines
    assert [c for c in lines if c.wait_ns is not None]


def test_digests_keep_each_collectives_owner(tmp_path: Path, fake_pg: None) -> None:
    """FSDP2's collectives are owned by their unit, not always the module that issued
    them (a unit's all-gather prefetched from the next unit's backward): the records
    read through digests keep the owner, as the lines do. An older digest (version 1,
    no owner in its templates) is not used: its lines are parsed, and the owners are
    the lines' (it used to be read with every owner taken to be the issuer)."""
    from _fsdp_sizes import fsdp2_sequential

    from commspan.analysis import digest as digest_mod
    from commspan.analysis.records import load_run

    model = fsdp2_sequential()

    def step(rank: int, index: int) -> None:
        model(torch.ones(2, 8)).sum().backward()

    run = write_run(tmp_path / "run", "fsdp", step)
    plain = _without_digests(run, tmp_path / "plain")
    v2 = _with_digests(run, tmp_path / "v2")
    lines = sorted(load_run(plain, module_spans=False).collectives)
    assert [c for c in lines if c.owner is not None and c.owner != c.fqn]
    assert sorted(_through_digests(v2).collectives) == lines
    digests = [json.loads(x.rsplit(" ", 3)[0]) for f in v2.glob("*.digest")
               for x in f.read_text().splitlines()]
    assert {d["digest"] for d in digests} == {digest_mod.DIGEST_VERSION} == {8}
    # a version-1 digest: the same without the owners in its templates
    v1 = tmp_path / "v1"
    v1.mkdir()
    for f in v2.iterdir():
        shutil.copy(f, v1 / f.name)
    for f in v1.glob("*.digest"):
        out = []
        for line in f.read_text().splitlines():
            doc = json.loads(line.rsplit(" ", 3)[0])
            doc["digest"] = 1
            doc["defs"] = {k: (json.dumps(json.loads(v)[:15], separators=(",", ":"))
                               if isinstance(v, str) and v.startswith("[") else v)
                           for k, v in doc["defs"].items()}
            body = json.dumps(doc, separators=(",", ":")).encode()
            out.append(f"{body.decode()} {zlib.crc32(body):08x}")
        f.write_text("\n".join(out) + "\n")
    from commspan.analysis.digest import load_parts

    assert all(digest_mod.read_digest(f) is None for f in v1.glob("*.jsonl"))  # (none usable)
    # so their lines are parsed and digested in memory: the owners are the lines'
    assert load_parts(sorted(v1.glob("*.jsonl"))) is None  # (this module's reference)
    parsed = _LOAD_PARTS(sorted(v1.glob("*.jsonl")))  # (the readers': parsed, digested)
    assert parsed is not None
    assert sorted(digest_mod.run_from_parts(parsed, False).collectives) == lines
    assert sorted(load_run(v1, module_spans=False).collectives) == lines


def test_no_digest_is_offered_only_where_it_does_something(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--no-digest`` is an option of the commands that read digests only; html and
    perfetto (which always read the lines) listed it and ignored it."""
    from commspan.cli import main

    for command in ("summary", "table", "check", "html", "perfetto", "stragglers", "diff"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        offered = "--no-digest" in capsys.readouterr().out
        assert offered == (command in ("summary", "table", "check", "stragglers", "diff")), (
            command)
    with pytest.raises(SystemExit) as exit_:
        main(["perfetto", "run", "-o", "out.json", "--no-digest"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --no-digest" in capsys.readouterr().err


def _fail_a_collective(run: Path, rank: int, step: int) -> None:
    """Mark the first collective event of ``rank``'s module spans in ``step`` failed
    (``commspan.collective.state``), as when its op raised: a peer died there."""
    f = run / f"commspan-rank{rank}.jsonl"
    lines, done = [], False
    for line in f.read_bytes().splitlines():
        doc = json.loads(line)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    keys = {a["key"] for a in sp["attributes"]}
                    for ev in sp.get("events", ()):
                        if (not done and semconv.MODULE_FQN in keys
                                and any(a["key"] == semconv.COLL_OP for a in ev["attributes"])
                                and sp["traceId"] == _trace_of_step(run, step)):
                            ev["attributes"].append({"key": semconv.COLL_STATE, "value": {
                                "stringValue": semconv.STATE_FAILED}})
                            done = True
        lines.append(json.dumps(doc, separators=(",", ":")).encode())
    assert done
    f.write_bytes(b"\n".join(lines) + b"\n")


def _trace_of_step(run: Path, step: int) -> str:
    from commspan.exporters import read_spans

    return next(s.trace_id for s in read_spans(run) if s.name == semconv.SPAN_RANK
                and s.attributes.get(semconv.STEP) == step)


def test_a_ranks_last_step_is_cut_short_when_a_peers_collective_failed_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """Rank 1 died in step 2, its last: its module spans of the step were written, its
    rank span never was; rank 0's collective of that step failed (its peer died).
    The step was taken for one still running (a rank's last step may be), so neither
    summary nor diff named it, and the counts of rank 1 silently left its collectives
    out of Global and counted them in the modules that finished. A failed collective
    in the step says the job broke there: it is cut short, from the lines and from
    the digests alike, whichever rank is selected."""
    plain = _without_digests(_traced(tmp_path / "run"), tmp_path / "plain")
    _lose_a_rank_span(plain, rank=1, step=2)
    _fail_a_collective(plain, rank=0, step=2)
    digested = _with_digests(plain, tmp_path / "digested")
    for folder in (plain, digested):
        for rank in ("1", "all"):
            code, out, err = run_cli(capsys, "summary", str(folder), "--rank", rank, "--json")
            assert json.loads(out)["partial"] == [{"rank": 1, "step": 2}], (folder, rank)
            assert "step 2 of rank 1 was cut short" in err
    code, out, err = run_cli(capsys, "diff", str(plain), "--steps", "0-1", "--steps", "0-2")
    assert code == 0 and "step 2 of rank 1 was cut short" in err
    _same_answers(capsys, digested, plain)


def test_a_live_digest_keeps_the_error_a_step_ended_on(tmp_path: Path) -> None:
    """`JsonlSpanExporter(digest=True)` wrote the rank span of a step an exception left
    without its error (the SDK spans' status was never read), so `check` from live
    digests could not name the exception the lines name. The error, and the module
    and phase where it was raised, are now in the live digest as in one written by
    `commspan digest` afterwards; compared with the spans' own status, read back
    from the lines by read_spans."""
    from commspan.analysis.digest import load_parts, run_from_parts
    from commspan.exporters import read_spans

    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad shape 7")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = Boom()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(x)

    path = tmp_path / "rank0.jsonl"
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path, digest=True)], run_id="r",
                        resource_attributes={"commspan.rank": 0})
    with mode, pytest.raises(ValueError), mode.step(0):
        Net()(torch.ones(2))
    mode.shutdown()
    (rank_span,) = [s for s in read_spans(path) if s.name == semconv.SPAN_RANK]
    assert (rank_span.status_code, rank_span.status_message) == (2, "ValueError: bad shape 7")
    live = run_from_parts(load_parts([path]) or [])
    write_digest(path)
    rebuilt = run_from_parts(load_parts([path]) or [])
    for run in (live, rebuilt):
        (step,) = run.rank_steps.values()
        assert (step.error, step.error_fqn, step.error_phase) == (
            "ValueError: bad shape 7", "Net.b", "forward")


def _retried_run(out: Path, *, flush_each_use: bool, hang: bool) -> Path:
    """4 ranks (fake process group), steps 0-3 of a two-block net, each block a linear
    and an all_reduce. Rank 1's step 1 raises (the test's own ValueError in block `b`),
    is caught and run again under the same number, and finishes; its step 2 raises and
    is not run again (a failed step). With ``flush_each_use`` every use of a step goes
    out in its own JSONL line; with ``hang``, rank 0 writes a hang record
    (``mode.dump()``) in step 3."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.boom = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.boom:
                raise ValueError("transient")
            return funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD).wait()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    out.mkdir(parents=True, exist_ok=True)
    for rank in range(4):
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(out / f"commspan-rank{rank}.jsonl", digest=True)],
            run_id="retried", resource_attributes={"commspan.rank": rank})
        net = Net()
        uses = [(0, False), (1, False), (2, False), (3, False)]
        if rank == 1:
            uses = [(0, False), (1, True), (1, False), (2, True), (3, False)]
        with mode:
            for step, boom in uses:
                net.b.boom = boom
                try:
                    with mode.step(step):
                        net(torch.ones(2, 4)).sum().backward()
                        if hang and rank == 0 and step == 3:
                            mode.dump()
                except ValueError:
                    pass
                if flush_each_use:
                    assert mode.flush()
        mode.shutdown()
    return out


@pytest.mark.parametrize("flush_each_use", [False, True])
def test_a_retried_step_a_failed_step_and_a_hang_answer_the_same_from_digests(
    flush_each_use: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    fake_pg: None,
) -> None:
    """A step number used twice (rank 1's step 1: raised, caught and run again), a step
    left on an error (its step 2) and, in a second run, a hang record: the rank steps
    read through the digests are the lines' (the spans of every use of a step, in
    ``RankStep.repeats``, and its duration: digests kept the use that ended last only),
    and every command's output, ``--json`` included, is the same from the digests
    (live, and written by ``commspan digest``) as from the lines."""
    from commspan.analysis.digest import load_parts, run_from_parts
    from commspan.analysis.records import load_run

    for hang in (False, True):
        run = _retried_run(tmp_path / f"run{int(hang)}", flush_each_use=flush_each_use,
                           hang=hang)
        plain = _without_digests(run, tmp_path / f"plain{int(hang)}")
        from_lines = load_run(plain, module_spans=False).rank_steps
        (retried,) = [rs for (r, _), rs in from_lines.items() if r == 1 and rs.step == 1]
        assert len(retried.repeats) == 1 and retried.error is None  # (the reference)
        (failed,) = [rs for (r, _), rs in from_lines.items() if r == 1 and rs.step == 2]
        assert failed.error == "ValueError: transient" and failed.repeats == ()
        rebuilt = _with_digests(plain, tmp_path / f"rebuilt{int(hang)}")
        for digested in (run, rebuilt):
            if not hang:  # (a line holding a hang record has no digest)
                parts = load_parts(sorted(digested.glob("*.jsonl")))
                assert parts is not None
                assert run_from_parts(parts).rank_steps == from_lines
            _same_answers(capsys, digested, plain)
            for cmd in (["check", "--json"], ["summary", "--rank", "all", "--json"],
                        ["table", "--rank", "1", "--json"]):
                answers = [run_cli(capsys, cmd[0], str(folder), *cmd[1:])
                           for folder in (digested, plain)]
                assert answers[0][0] == answers[1][0]
                assert json.loads(answers[0][1]) == json.loads(answers[1][1]), cmd


def test_digest_refuses_standard_input_and_other_streams(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """``commspan digest /dev/stdin < FILE`` said "digests written" and wrote
    ``/dev/stdin.digest``: beside no file of the run, in /dev. A path that is not a
    regular file of its own (/dev/stdin, /dev/fd/N, a FIFO) is refused before any
    digest is written, naming it and the fix; reading it still works."""
    run = _without_digests(_traced(tmp_path / "run", ranks=(0,), steps=1), tmp_path / "p")
    rank0 = run / "commspan-rank0.jsonl"
    fd = os.open(rank0, os.O_RDONLY)
    try:
        stream = f"/dev/fd/{fd}"  # what /dev/stdin is when stdin is redirected from rank0
        code, out, err = run_cli(capsys, "digest", stream)
        assert (code, out) == (1, "")
        assert err.startswith(f"ValueError: FILES: {stream}: not a regular file of its own")
        assert "pass the JSONL file's own path" in err and err.count("\n") == 1
        with pytest.raises(ValueError, match="not a regular file of its own"):
            write_digest(stream)
        assert run_cli(capsys, "summary", stream)[0] == 0
    finally:
        os.close(fd)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    code, _, err = run_cli(capsys, "digest", str(rank0), str(fifo))
    assert code == 1 and "not a regular file of its own" in err
    assert not digest_path(fifo).exists()
    assert not digest_path(rank0).exists()  # refused before the first file's digest


def test_digest_of_a_file_of_another_format_leaves_no_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None
) -> None:
    """``commspan digest trace.json`` (a Chrome trace, or a README) failed, rightly, but
    left an empty ``trace.json.digest`` beside it; a file none of whose lines gets a
    digest line now gets no digest (an empty one stood for nothing), and a stale one
    is removed. A rank file's digest is still written."""
    run = _without_digests(_traced(tmp_path / "run", ranks=(0,), steps=1), tmp_path / "p")
    chrome = tmp_path / "trace.json"  # one line, no newline: what `commspan perfetto` writes
    chrome.write_text(json.dumps({"traceEvents": [], "displayTimeUnit": "ns"}))
    readme = tmp_path / "README.md"
    readme.write_text("# a run\n\nnot JSON\n")
    digest_path(readme).write_text("stale\n")
    for path in (chrome, readme):
        code, out, err = run_cli(capsys, "digest", str(path))
        assert code == 1 and out == "" and "Traceback" not in err
        assert not digest_path(path).exists(), path
        assert write_digest(path) == 0 and not digest_path(path).exists()
    rank0 = run / "commspan-rank0.jsonl"
    assert run_cli(capsys, "digest", str(run))[0] == 0 and read_digest(rank0) is not None


def test_the_exporters_records_are_the_spans_as_read_back(tmp_path: Path, fake_pg: None) -> None:
    """What the exporter digests (``span_records`` of the SDK spans it is handed) is what a
    reader gets back from the line written for them, field by field (ids, times,
    events, status with its message, rank, resource): the digest is built from the
    spans, its readers trust it instead of the lines. Two steps, one ending in an
    error, and two resources (ranks) in one batch."""
    from commspan.analysis.digest import span_records
    from commspan.exporters import read_spans
    from commspan.otlpjson.encode import span_fields

    held: list[ReadableSpan] = []

    class _Hold(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            held.extend(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    model = parallelize(Transformer(ModelArgs()), fake_mesh(4))
    tokens, targets = make_batch(model.model_args)
    for rank in (0, 1):
        mode = CommSpanMode(exporters=[_Hold()], run_id="records",
                            resource_attributes={"commspan.rank": rank})
        with mode:
            with mode.step(0):
                train_step(model, tokens, targets)
            with pytest.raises(RuntimeError), mode.step(1):
                train_step(model, tokens, targets)
                raise RuntimeError("the step failed")
        mode.shutdown()
    assert any(span_fields(s)[9].status_code.value == 2 for s in held)  # (an ERROR)
    exporter = JsonlSpanExporter(tmp_path / "one.jsonl")
    exporter.export(held)  # one line for both ranks' spans
    exporter.shutdown()
    back = list(read_spans(tmp_path / "one.jsonl"))
    mine = span_records(held)
    assert len(mine) == len(back) == len(held)

    def plain(v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    for a, b in zip(mine, back):
        assert ({**a.__dict__, "attributes": None}
                == {**b.__dict__, "attributes": None}), a.name
        assert {k: plain(v) for k, v in a.attributes.items()} == b.attributes
    assert {r.rank for r in mine} == {0, 1}
    assert any(r.status_code == 2 and r.status_message for r in mine)


def test_stragglers_reads_module_spans_and_pauses_from_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 6 digests hold each module span (its module, phase, ids and times) and
    the collector's pauses, so `commspan stragglers` reads a digested run without
    parsing a line (it parsed all of them: 216 s over 1,024 ranks). The module spans
    and pauses rebuilt from the digests are the lines' (steps straddle lines here,
    and rank 0 runs a full collection inside step 1), and its answer is the lines'."""
    import gc

    from commspan.analysis.digest import load_parts, run_from_parts, span_times_of_parts
    from commspan.analysis.records import SpanTimes, load_run
    from commspan.cli.commands import Reader

    model = parallelize(Transformer(ModelArgs()), fake_mesh(4))
    tokens, targets = make_batch(model.model_args)
    run = tmp_path / "run"
    for rank in (0, 1):
        mode = CommSpanMode(
            exporters=[_Chunked(JsonlSpanExporter(run / f"commspan-rank{rank}.jsonl",
                                                  digest=True))],
            run_id="gc", resource_attributes={"commspan.rank": rank})
        with mode:
            for step in range(3):
                with mode.step(step):
                    train_step(model, tokens, targets)
                    if (rank, step) == (0, 1):
                        gc.collect()
                model.zero_grad(set_to_none=True)
        mode.shutdown()
    plain = _without_digests(run, tmp_path / "plain")
    lines = load_run(plain)
    assert lines.module_spans and any(  # (the reference: rank 0's full collection)
        g.rank == 0 and g.generation == 2 for g in lines.gc_pauses)
    parts = load_parts(sorted(run.glob("*.jsonl")), module_spans=True)
    assert parts is not None
    digested = run_from_parts(parts, module_spans=True)
    assert sorted(digested.module_spans) == sorted(lines.module_spans)
    assert sorted(digested.gc_pauses) == sorted(lines.gc_pauses)
    assert run_from_parts(parts).module_spans == []  # (check needs none)
    # folded a rank at a time (what stragglers keeps of them): the lines' spans folded
    reference = SpanTimes.of(lines.module_spans)
    assert reference.own and reference.under
    folded = span_times_of_parts(parts)
    assert (folded.own, folded.under) == (reference.own, reference.under)
    for path in (run, plain):  # digests, lines
        kept = load_run(path, module_spans="folded")
        assert kept.module_spans == [] and kept.span_times is not None
        assert (kept.span_times.own, kept.span_times.under) == (
            reference.own, reference.under)
    with pytest.raises(ValueError, match="module_spans='yes' is not valid; pass True"):
        load_run(run, module_spans="yes")  # type: ignore[arg-type]

    def parse_lines(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("stragglers parsed the lines of a digested run")

    expected = run_cli(capsys, "stragglers", str(plain), "--json")
    assert json.loads(expected[1])["step_times"][0]["forward_ns"] > 0
    with monkeypatch.context() as patch:
        patch.setattr(Reader, "load_built", parse_lines)
        assert run_cli(capsys, "stragglers", str(run), "--json") == expected
    # --no-digest reads the lines
    assert run_cli(capsys, "stragglers", str(run), "--json", "--no-digest") == expected
    # module spans damaged on one digest line: that line is parsed for stragglers, and
    # the other commands, which do not read them, still use all of the digest
    side = digest_path(run / "commspan-rank0.jsonl")
    raws = side.read_bytes().splitlines(keepends=True)
    body, crc, mods, mods_crc = raws[1].rsplit(b" ", 3)
    digit = mods.rindex(b"]]") - 1  # the last digit of a duration, changed
    mods = mods[:digit] + (b"1" if mods[digit:digit + 1] != b"1" else b"2") + mods[digit + 1:]
    raws[1] = b" ".join([body, crc, mods, mods_crc])  # (their checksum kept)
    side.write_bytes(b"".join(raws))
    with monkeypatch.context() as patch:
        patch.setattr(Reader, "load_built", parse_lines)
        assert run_cli(capsys, "stragglers", str(run), "--json") == expected
    report = ReadReport()
    Aggregator.from_jsonl(run, rank="all", report=report)
    assert report.lines == sum(len(read_digest(f).covered)  # type: ignore[union-attr]
                               for f in run.glob("*.jsonl"))
    assert len(read_digest(side.with_suffix(""), module_spans=True).covered) == (
        len(raws) - 1)  # type: ignore[union-attr]


@pytest.mark.parametrize("names", [("commspan.rank",), ("commspan.rank", "commspan.step")],
                         ids=["step-known", "step-unknown"])
def test_stragglers_names_steps_cut_short_as_summary_does(
    names: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    fake_pg: None,
) -> None:
    """Steps 1 and 2 of both ranks cut short: `stragglers` from the lines listed them
    in trace-id order, and a step no span named once per trace (digests: as summary's
    `partial`, once each, by step); both paths now list and word them as `summary`."""
    run = write_run(tmp_path / "run", "r", net_step(), steps=(0, 1, 2, 3), ranks=(0, 1))
    plain = tmp_path / "plain"
    without_step_ends(run, plain, (1, 2), names)
    digested = _with_digests(plain, tmp_path / "digested")
    summary = run_cli(capsys, "summary", str(plain), "--rank", "all", "--json")
    partial = json.loads(summary[1])["partial"]
    assert len(partial) == (4 if names == ("commspan.rank",) else 2)  # (the reference)
    note = summary[2].splitlines()[0].split(" was cut short")[0]
    for folder in (plain, digested):
        code, out, err = run_cli(capsys, "stragglers", str(folder), "--json")
        assert code == 0 and json.loads(out)["cut_short"] == partial, folder.name
        assert err.splitlines()[0].split(" was cut short")[0] == note, (folder.name, err)


def test_a_lost_digest_line_that_defined_a_module_template_leaves_lines_to_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """The digest line that first named a module span's (module, phase) is lost (its
    object damaged; a write that failed in the live writer leaves the same: texts
    numbered, never written), and a later line uses that template: `stragglers`
    stopped with a ValueError; that line is now parsed, as one whose other texts
    are undefined, and the answer is the lines'."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))

    run = tmp_path / "run"
    for rank in (0, 1):
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(run / f"commspan-rank{rank}.jsonl", digest=True)],
            run_id="m", resource_attributes={"commspan.rank": rank})
        net = Net()
        with mode, torch.no_grad():
            for step in range(2):
                with mode.step(step):
                    net(torch.ones(1 + 2 * step, 4))
                    mode.flush()  # an export batch that ends mid-step
                    net(torch.ones(2 + 2 * step, 4))  # new shapes: new templates
                    mode.flush()
        mode.shutdown()
    expected = run_cli(capsys, "stragglers", str(_without_digests(run, tmp_path / "p")),
                       "--json")
    side = digest_path(run / "commspan-rank0.jsonl")
    raws = side.read_bytes().splitlines(keepends=True)
    raws[0] = b"x" + raws[0]  # the first line's object no longer matches its checksum
    side.write_bytes(b"".join(raws))
    digest = read_digest(run / "commspan-rank0.jsonl", module_spans=True)
    assert digest is not None and len(digest.covered) < len(raws) - 1
    assert run_cli(capsys, "stragglers", str(run), "--json") == expected


@pytest.mark.parametrize("how", ["short", "failed", "crashed"])
def test_a_digest_line_written_short_or_not_at_all_costs_that_line_only(
    how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second digest line is written short (a full disk), or its write fails, or a
    crash left the digest ending mid-line before a new writer appends: the next line
    was glued to the torn one (both lost), and the texts the lost line defined stayed
    numbered, so every later line naming them was parsed too. Now that line alone is
    parsed, and the answers are the lines'."""
    from commspan.exporters import jsonl as jsonl_mod

    real_write = os.write
    calls = {"n": 0}
    exporters: list[JsonlSpanExporter] = []

    def write(fd: int, data: Any) -> int:
        if exporters and fd == exporters[0]._digest_fd and how != "crashed":
            calls["n"] += 1
            if calls["n"] == 2:
                if how == "failed":
                    raise OSError(28, "No space left on device")
                return real_write(fd, bytes(data)[: len(data) // 2])
        return real_write(fd, data)

    monkeypatch.setattr(jsonl_mod.os, "write", write)
    model = parallelize(Transformer(ModelArgs()), fake_mesh(4))
    tokens, targets = make_batch(model.model_args)
    run = tmp_path / "run"
    path = run / "commspan-rank0.jsonl"
    for use in range(2 if how == "crashed" else 1):  # crashed: a second writer appends
        for rank in (0, 1):  # (rank 0's digest is the one that goes wrong)
            exporter = JsonlSpanExporter(run / f"commspan-rank{rank}.jsonl", digest=True)
            exporters[:] = [exporter] if rank == 0 else []
            mode = CommSpanMode(exporters=[_Chunked(exporter)], run_id=f"w{use}",
                                resource_attributes={"commspan.rank": rank})
            with mode:
                for step in range(3):
                    with mode.step(step):
                        train_step(model, tokens, targets)
                    model.zero_grad(set_to_none=True)
            mode.shutdown()
        if how == "crashed" and use == 0:  # the last digest line cut mid-way
            side = digest_path(path)
            side.write_bytes(side.read_bytes()[:-40])
    lines = len(path.read_bytes().splitlines())
    digest = read_digest(path, module_spans=True)
    assert digest is not None
    assert len(digest.covered) == lines - 1, (len(digest.covered), lines)
    _same_answers(capsys, run, _without_digests(run, tmp_path / "plain"))


def test_digests_of_an_older_version_are_named_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_pg: None,
) -> None:
    """Digests an earlier commspan wrote (version 6 here) are not read: the commands
    parsed the lines, minutes at a thousand ranks, and said nothing. They say so on
    stderr now, naming `commspan digest`, after which the digests are read again."""
    run = _traced(tmp_path / "run", ranks=(0, 1), steps=2)
    plain = _without_digests(run, tmp_path / "plain")
    expected = run_cli(capsys, "summary", str(plain), "--rank", "all")
    for side in run.glob("*.digest"):
        side.write_bytes(side.read_bytes().replace(b'{"digest":8,', b'{"digest":6,'))
    for command in (["summary", "--rank", "all"], ["table", "--rank", "all"], ["check"],
                    ["stragglers"], ["diff", "--step", "0", "--step", "1"]):
        code, _, err = run_cli(capsys, command[0], str(run), *command[1:])
        assert code == (1 if command[0] == "check" else 0), (command, err)  # (check:
        # ranks 2-3 of the mesh wrote nothing)
        assert "2 files have digests of version 6, which this commspan does not " \
            "read (it reads version 8)" in err, (command, err)
        assert "`commspan digest` on the same files" in err
    code, out, err = run_cli(capsys, "summary", str(run), "--rank", "all", "--no-digest")
    assert (code, out) == expected[:2] and "version 6" not in err  # (lines asked for)
    assert run_cli(capsys, "digest", str(run))[0] == 0
    code, out, err = run_cli(capsys, "summary", str(run), "--rank", "all")
    assert (code, out) == expected[:2] and "version" not in err
