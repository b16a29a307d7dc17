"""Compressed JSONL (``JsonlSpanExporter(compress=...)``): the same lines as gzip
members, read by every reader; a cut or damaged line costs that line only."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from commspan import Aggregator, CommSpanMode
from commspan.cli import main
from commspan.exporters import JsonlSpanExporter, ReadReport, read_spans
from commspan.otlpjson.files import jsonl_files
from commspan.testing.models import MLP, parallelize_mlp

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> tuple[Path, Path]:
    """The same steps of a TP MLP written twice by one mode: plain and compressed,
    one line per step (each step flushed)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = tmp_path_factory.mktemp("gz")
    plain, packed = out / "plain", out / "packed"
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = parallelize_mlp(MLP(), mesh)
    mode = CommSpanMode(
        exporters=[JsonlSpanExporter(plain), JsonlSpanExporter(packed, compress=True)],
        run_id="gz-test",
    )
    with mode:
        for i in range(STEPS):
            with mode.step(i):
                model(torch.randn(4, 8)).sum().backward()
            assert mode.flush()
    mode.shutdown()
    return plain, packed


def _spans(path: Path, report: ReadReport | None = None) -> list[tuple[str, str, str]]:
    files = jsonl_files(path)
    return sorted(
        (s.name, s.span_id, json.dumps(s.attributes, sort_keys=True, default=str))
        for s in read_spans(*files, strict=False, report=report)
    )


def test_compressed_file_holds_the_same_lines_and_reads_the_same(
    runs: tuple[Path, Path],
) -> None:
    """The directory's file is named .jsonl.gz and is a valid gzip file of OTLP/JSON
    lines; every reader gets from it what it gets from the plain file; it is smaller."""
    plain, packed = runs
    (plain_file,) = plain.iterdir()
    (packed_file,) = packed.iterdir()
    assert plain_file.name == "commspan-rank0.jsonl"
    assert packed_file.name == "commspan-rank0.jsonl.gz"
    lines = gzip.decompress(packed_file.read_bytes()).splitlines()
    assert len(lines) >= STEPS
    assert all("resourceSpans" in json.loads(line) for line in lines)
    assert _spans(packed) == _spans(plain) != []
    assert Aggregator.from_jsonl(packed).module_counts() == \
        Aggregator.from_jsonl(plain).module_counts()
    assert packed_file.stat().st_size * 3 < plain_file.stat().st_size


def test_cli_reads_a_compressed_run(runs: tuple[Path, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`commspan summary DIR --json` says the same of both directories."""
    plain, packed = runs
    outs = []
    for path in (plain, packed):
        assert main(["summary", str(path), "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]


def _members(path: Path) -> list[bytes]:
    """The file cut at each member's start (the writer writes one per line, each with
    the header magic, no flags and mtime 0: eight bytes not met inside deflate data)."""
    data = path.read_bytes()
    head = b"\x1f\x8b\x08\x00\x00\x00\x00\x00"
    starts = [i for i in range(len(data)) if data.startswith(head, i)]
    return [data[a:b] for a, b in zip(starts, [*starts[1:], len(data)])]


def test_a_cut_last_line_costs_that_line_and_a_new_writer_appends_after_it(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """A crash mid-write leaves half a member at the end: the read reports it as torn
    and keeps the lines before; a writer appending later is read after it (the cut line
    is then damaged, as in a plain file)."""
    _plain, packed = runs
    (src,) = packed.iterdir()
    members = _members(src)
    assert len(members) >= STEPS
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(b"".join(members[:-1]) + members[-1][: len(members[-1]) // 2])
    report = ReadReport()
    kept = _spans(cut, report)
    assert [s.kind for s in report.skipped] == ["torn"]
    assert report.skipped[0].line == len(members)
    expected = ReadReport()
    whole = tmp_path / "whole.jsonl.gz"
    whole.write_bytes(b"".join(members[:-1]))
    assert kept == _spans(whole, expected) and not expected.skipped
    with cut.open("ab") as fh:  # a new writer appends whole members after the cut one
        fh.write(members[0])
    report = ReadReport()
    again = _spans(cut, report)
    # no longer at the end: damaged, as a plain file's partial line followed by more
    assert [(s.kind, s.line) for s in report.skipped] == [("damaged", len(members))]
    assert again == sorted(kept + _spans(_one(tmp_path, members[0])))


def _one(tmp_path: Path, member: bytes) -> Path:
    path = tmp_path / "one.jsonl.gz"
    path.write_bytes(member)
    return path


def test_a_damaged_line_in_the_middle_is_skipped_and_named(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Bytes flipped inside the second member: that line is reported damaged (file and
    line), the others are read; strict reading raises naming the file and line."""
    _plain, packed = runs
    (src,) = packed.iterdir()
    members = _members(src)
    bad = bytearray(members[1])
    for i in range(20, min(len(bad) - 8, 60)):
        bad[i] ^= 0xFF
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(members[0] + bytes(bad) + b"".join(members[2:]))
    report = ReadReport()
    got = _spans(path, report)
    assert [(s.kind, s.line) for s in report.skipped] == [("damaged", 2)]
    others = tmp_path / "others.jsonl.gz"
    others.write_bytes(members[0] + b"".join(members[2:]))
    assert got == _spans(others)
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz:2: "):
        list(read_spans(path, strict=True))


def test_a_compressed_line_longer_than_the_limit_is_refused(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """max_line_bytes bounds the decompressed line, as for a plain file."""
    _plain, packed = runs
    (src,) = packed.iterdir()
    report = ReadReport()
    assert _spans(src, ReadReport()) != []
    assert list(read_spans(src, strict=False, report=report, max_line_bytes=100)) == []
    assert [s.kind for s in report.skipped] == ["too_long"]


def test_a_file_gzipped_whole_is_bounded_per_line_not_per_member(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """``gzip FILE`` writes one member of every line: ``max_line_bytes`` bounds each of
    its lines, as in the plain file (the member used to be taken for one line, and a
    file of more than 64 MiB was refused whole). A too long line still ends the
    reading, at that line; a file cut short gives its whole lines."""
    plain_dir, _packed = runs
    (src,) = plain_dir.iterdir()
    lines = src.read_bytes().splitlines(keepends=True)
    data = b"".join(lines) * 4
    longest = max(map(len, lines))
    limit = longest + 10
    assert len(data) > 3 * limit
    plain, whole = tmp_path / "plain.jsonl", tmp_path / "whole.jsonl.gz"
    for content in (data, data + b"x" * (limit + 1) + b"\n" + data):  # then a too long line
        plain.write_bytes(content)
        whole.write_bytes(gzip.compress(content))
        reports = ReadReport(), ReadReport()
        got = [_spans_of(f, r, limit) for f, r in zip((plain, whole), reports)]
        assert got[0] == got[1] != []
        assert [(s.kind, s.line) for s in reports[1].skipped] == [
            (s.kind, s.line) for s in reports[0].skipped]
    assert [s.kind for s in reports[1].skipped] == ["too_long"]
    packed = gzip.compress(data)
    part = zlib.decompressobj(31).decompress(packed[:len(packed) * 2 // 3])
    plain.write_bytes(part[:part.rfind(b"\n") + 1])  # the whole lines before the cut
    whole.write_bytes(packed[:len(packed) * 2 // 3])
    report = ReadReport()
    assert _spans_of(whole, report, limit) == _spans_of(plain, ReadReport(), limit) != []
    assert [(s.kind, s.line) for s in report.skipped] == [("torn", part.count(b"\n") + 1)]
    # a plain copy of those lines is the copy of it, not the file holding more
    assert jsonl_files([plain, whole], notes=[]) == [whole]


def test_a_member_longer_than_the_limit_then_another_member(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """A file gzipped whole, then more lines appended as members of their own (``cat
    a.gz b.gz``, or the exporter appending to it): read member after member, as the
    plain file of the same lines is, with no line skipped or numbered twice."""
    plain_dir, _packed = runs
    (src,) = plain_dir.iterdir()
    lines = src.read_bytes().splitlines(keepends=True)
    limit = max(map(len, lines)) + 10
    first, second = b"".join(lines) * 4, b"".join(lines)
    assert len(first) > 3 * limit
    plain, joined = tmp_path / "plain.jsonl", tmp_path / "joined.jsonl.gz"
    plain.write_bytes(first + second)
    joined.write_bytes(gzip.compress(first) + b"".join(gzip.compress(x) for x in lines))
    reports = ReadReport(), ReadReport()
    got = [_spans_of(f, r, limit) for f, r in zip((plain, joined), reports)]
    assert got[0] == got[1] != []
    assert reports[1].skipped == [] and reports[1].lines == reports[0].lines


def _spans_of(path: Path, report: ReadReport, limit: int) -> list[tuple[str, str]]:
    return sorted((s.name, s.span_id) for s in read_spans(
        path, strict=False, report=report, max_line_bytes=limit))


@pytest.mark.skipif(not Path("/dev/stdin").exists(), reason="needs /dev/stdin")
def test_a_compressed_file_is_read_through_a_pipe(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``zcat``'s input through a pipe (``cat X.jsonl.gz | commspan summary /dev/stdin``)
    reads as the file does; it was "cannot be read (File or stream is not seekable.):
    a failing disk ..." (a plain file through a pipe was read)."""
    _plain, packed = runs
    (src,) = packed.iterdir()
    assert main(["summary", str(src), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "commspan", "summary", "/dev/stdin", "--json"],
                          input=src.read_bytes(), capture_output=True, env=env, timeout=120,
                          check=False)
    # (rank 0's file of a fake world of 4: what the output covers, and nothing else)
    assert (proc.returncode, proc.stderr.decode()) == (0, (
        "commspan: ranks 1-3 of 4 wrote no spans (no file of theirs read): what follows "
        "covers rank 0 only\n"))
    assert json.loads(proc.stdout) == expected


@pytest.mark.parametrize("bad", [0, 10, -1, 2.0, "yes", None])
def test_compress_must_be_a_bool_or_a_level(bad: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"compress=.* is not valid; pass True"):
        JsonlSpanExporter(tmp_path, compress=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("first_compressed", [False, True], ids=["plain-first", "gzip-first"])
def test_appending_the_other_format_is_refused_and_counted(
    tmp_path: Path, first_compressed: bool
) -> None:
    """A second run writing the other format to the same file would leave lines no
    reader can read: nothing is appended, its spans are counted as failed, and the
    file reads as the first run wrote it."""
    path = tmp_path / "trace.jsonl"
    model = torch.nn.Linear(2, 2)

    def run(compress: bool, run_id: str) -> dict:
        mode = CommSpanMode(exporters=[JsonlSpanExporter(path, compress=compress)],
                            run_id=run_id)
        with mode:
            for i in range(2):
                with mode.step(i):
                    model(torch.ones(1, 2)).sum().backward()
        mode.shutdown()
        return mode.stats()["exporters"][0]

    first = run(first_compressed, "first")
    assert first["failed"] == 0 and first["exported"] > 0
    before = path.read_bytes()
    second = run(not first_compressed, "second")
    assert second["exported"] == 0 and second["failed"] == second["handed"] > 0
    assert path.read_bytes() == before
    report = ReadReport()
    spans = list(read_spans(path, strict=False, report=report))
    assert report.skipped == [] and len(spans) == first["exported"]


@pytest.mark.parametrize("tail", [1, 2, 3])
def test_a_file_cut_inside_the_last_header_is_torn_not_damaged(
    runs: tuple[Path, Path], tmp_path: Path, tail: int
) -> None:
    """A crash right after the first bytes of a member's header (1, 2 or 3 of the
    gzip magic written): the last line is torn, as a longer cut is, and the lines
    before it are read."""
    _plain, packed = runs
    (src,) = packed.iterdir()
    members = _members(src)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(b"".join(members[:-1]) + members[-1][:tail])
    report = ReadReport()
    kept = _spans(cut, report)
    assert [(s.kind, s.line) for s in report.skipped] == [("torn", len(members))]
    whole = tmp_path / "whole.jsonl.gz"
    whole.write_bytes(b"".join(members[:-1]))
    assert kept == _spans(whole)


def _write_steps(out: Path, first: int, steps: int) -> None:
    from commspan.testing.models import MLPModule

    mode = CommSpanMode(exporters=[JsonlSpanExporter(out, compress=True, digest=True)])
    model = MLPModule()
    with mode:
        for i in range(first, first + steps):
            with mode.step(i):
                model(torch.ones(2, 10)).sum().backward()
            mode.flush()  # a line (a member) per step
    mode.shutdown()


def test_with_a_digest_a_cut_line_with_lines_after_it_is_damaged(tmp_path: Path) -> None:
    """Compressed and digested: a crash cuts the last line (its digest line never
    written), then a writer starting afresh appends. Read through the digest, the
    cut line is damaged (the file goes on), as without the digest; the counts agree."""
    out = tmp_path / "run"
    _write_steps(out, 0, 4)
    (src,) = [p for p in out.iterdir() if p.name.endswith(".jsonl.gz")]
    members = _members(src)
    assert len(members) == 4
    src.write_bytes(b"".join(members[:3]) + members[3][: len(members[3]) // 2])
    digest = src.with_name(src.name + ".digest")
    digest.write_bytes(b"".join(digest.read_bytes().splitlines(keepends=True)[:-1]))
    _write_steps(out, 10, 3)
    seen = []
    for _ in range(2):  # with the digest, then without it
        report = ReadReport()
        total = Aggregator.from_jsonl(out, run="all", strict=False, report=report).total_count()
        seen.append((total, [(s.kind, s.line) for s in report.skipped]))
        digest.unlink(missing_ok=True)
    assert seen[0] == seen[1]
    assert seen[0][1] == [("damaged", 4)]


def _long_compressed_file(runs: tuple[Path, Path], path: Path, min_bytes: int) -> int:
    """A compressed file of the run's lines repeated (each a gzip member, as the
    exporter writes them) to at least ``min_bytes``; returns its number of spans."""
    _plain, packed = runs
    (src,) = packed.iterdir()
    members = src.read_bytes()
    spans = len(list(read_spans(src)))
    copies = -(-min_bytes // len(members))
    path.write_bytes(members * copies)
    return spans * copies


_TRUNCATE_WHILE_READING = """
import os, sys
from commspan.exporters import ReadReport, read_spans
path = sys.argv[1]
report = ReadReport()
n = 0
for _ in read_spans(path, strict=False, report=report):
    n += 1
    if n == 1:  # the exporter trims a cut line after a full disk; a user truncates
        os.truncate(path, os.path.getsize(path) // 3 + int(sys.argv[2]))
print(n, *[s.kind for s in report.skipped])
"""


@pytest.mark.parametrize("offset", [0, 1000])
def test_a_compressed_file_cut_short_while_read_ends_early(
    runs: tuple[Path, Path], tmp_path: Path, offset: int
) -> None:
    """A compressed file truncated while a reader is in it: the reader ends early,
    its last line torn. It was mapped to memory, and the process died of SIGBUS
    (no message, no summary) at the first byte past the new end."""
    path = tmp_path / "cut.jsonl.gz"
    total = _long_compressed_file(runs, path, 12 << 20)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", _TRUNCATE_WHILE_READING, str(path), str(offset)],
                          capture_output=True, env=env, timeout=120, check=False, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    read, *skipped = proc.stdout.split()
    assert 0 < int(read) < total
    assert skipped in ([], ["torn"])


def test_reading_a_compressed_file_holds_a_block_not_the_file(
    runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory (and time) for reading a file of many compressed lines grows with a
    block, not with the file: each line used to copy the rest of the file (what
    follows a gzip member), quadratic in the file's size (3.4 s for a 3.5 MB file
    of 80,000 lines; 0.26 s now)."""
    import tracemalloc

    from commspan.otlpjson import decode

    monkeypatch.setattr(decode, "_BLOCK", 64 << 10, raising=False)
    path = tmp_path / "long.jsonl.gz"
    total = _long_compressed_file(runs, path, 4 << 20)
    tracemalloc.start()
    try:
        read = sum(1 for _ in read_spans(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read == total
    assert peak < path.stat().st_size / 4, (peak, path.stat().st_size)


@pytest.mark.parametrize("form", ["members", "whole"])
def test_a_carriage_return_inside_a_line_splits_no_compressed_line(
    runs: tuple[Path, Path], tmp_path: Path, form: str
) -> None:
    """JSON allows a bare CR between values; a plain file's lines split at LF only,
    and so do a compressed file's (they split at the CR too: a ``torn`` line, then a
    ``damaged`` one, and the line numbers after it off by one)."""
    plain, _packed = runs
    (src,) = plain.iterdir()
    lines = [line.replace(b"{", b"{\r", 1) for line in src.read_bytes().splitlines(keepends=True)]
    assert len(lines) == STEPS and all(b"\r" in line for line in lines)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "r.jsonl").write_bytes(b"".join(lines))
    (tmp_path / "packed").mkdir()
    packed = (b"".join(gzip.compress(line, mtime=0) for line in lines) if form == "members"
              else gzip.compress(b"".join(lines), mtime=0))
    (tmp_path / "packed" / "r.jsonl.gz").write_bytes(packed)
    reports = ReadReport(), ReadReport()
    expected = _spans(tmp_path / "plain", reports[0])
    assert expected and _spans(tmp_path / "packed", reports[1]) == expected
    assert reports[0].skipped == reports[1].skipped == []


def _peak_bytes(fn: Any) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_writing_a_digest_of_a_compressed_file_copies_no_rest_of_it_per_line(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """``commspan digest`` of a compressed file: each line copied the rest of the file
    (quadratic: 4.1 s for a 3.5 MB file of 80,000 one-line members, 0.7 s now); the
    file itself is held once."""
    from commspan.analysis.digest import write_digest

    path = tmp_path / "long.jsonl.gz"
    _long_compressed_file(runs, path, 4 << 20)
    peak = _peak_bytes(lambda: write_digest(path))
    assert path.stat().st_size < peak < 1.5 * path.stat().st_size


class _Fed:
    """``zlib`` for a module under test, counting the compressed bytes its
    decompressors are given."""

    def __init__(self) -> None:
        self.bytes = 0

    def decompressobj(self, wbits: int) -> Any:
        fed = self
        d = zlib.decompressobj(wbits)

        class Counting:
            def decompress(self, data: Any, max_length: int = 0) -> bytes:
                fed.bytes += len(data)
                return d.decompress(data, max_length)

            def __getattr__(self, name: str) -> Any:
                return getattr(d, name)

        return Counting()

    error = zlib.error


def test_comparing_compressed_twins_gives_zlib_each_byte_a_few_times(
    runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telling a copy from its original (the same first line) decompresses both
    member by member; each member was given the rest of a 1 MiB read, which zlib
    copies (what follows the member): quadratic in the members per MiB (each
    byte given ~320 times here; at most the members per 16 KiB now)."""
    from commspan.otlpjson import files

    a = tmp_path / "a.jsonl.gz"
    _long_compressed_file(runs, a, 3 << 20)
    (tmp_path / "b.jsonl.gz").write_bytes(a.read_bytes())
    fed = _Fed()
    monkeypatch.setattr(files, "zlib", fed)
    assert len(jsonl_files(tmp_path, notes=[])) == 1
    assert 2 * a.stat().st_size <= fed.bytes < 2 * 10 * a.stat().st_size


def test_a_member_that_fails_its_checksum_gives_no_line(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """A file gzipped whole (one member, longer than the first slice of input read)
    whose checksum fails: none of its lines is read, one damaged line is reported, as
    before reading in slices (its lines were read, unchecked, then the damage
    reported at its last one)."""
    plain, _packed = runs
    (src,) = plain.iterdir()
    lines = [b'{"pad":"%s",%s' % (os.urandom(2 << 10).hex().encode(), line[1:])
             for _ in range(10)
             for line in src.read_bytes().splitlines(keepends=True)]  # (little to squeeze)
    packed = bytearray(gzip.compress(b"".join(lines), mtime=0))
    assert len(packed) > 4 * (16 << 10)
    ok = tmp_path / "ok.jsonl.gz"
    ok.write_bytes(bytes(packed))
    assert len(list(read_spans(ok))) == 10 * len(list(read_spans(src)))  # (pads ignored)
    packed[-8] ^= 0xFF  # the CRC-32 of the trailer
    path = tmp_path / "whole.jsonl.gz"
    path.write_bytes(bytes(packed))
    report = ReadReport()
    assert list(read_spans(path, strict=False, report=report)) == []
    assert [(s.line, s.kind) for s in report.skipped] == [(1, "damaged")]


@pytest.mark.parametrize("form", ["members", "whole"])
def test_the_digest_writer_numbers_damaged_lines_as_the_readers_do(
    runs: tuple[Path, Path], tmp_path: Path, form: str
) -> None:
    """``commspan digest`` names a damaged line by its decompressed line number, as
    every reader does: it numbered the members it could decompress (a member that
    could not be was neither counted nor reported; a file gzipped whole was line 1)."""
    from commspan.analysis.digest import write_digest

    plain, _packed = runs
    (src,) = plain.iterdir()
    lines = src.read_bytes().splitlines(keepends=True)
    lines.insert(2, b'{"resourceLogs": []}\n')  # line 3: JSON, not a trace request
    if form == "members":
        members = [gzip.compress(line, mtime=0) for line in lines]
        bad = bytearray(members[1])
        bad[len(bad) // 2] ^= 0xFF  # line 2 cannot be decompressed
        members[1] = bytes(bad)
        data = b"".join(members)
    else:
        data = gzip.compress(b"".join(lines), mtime=0)
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(data)
    readers, digest = ReadReport(), ReadReport()
    list(read_spans(path, strict=False, report=readers))
    write_digest(path, report=digest)
    assert [(s.line, s.kind) for s in readers.skipped] == [
        (s.line, s.kind) for s in digest.skipped]
    assert (3, "damaged") in [(s.line, s.kind) for s in digest.skipped]
