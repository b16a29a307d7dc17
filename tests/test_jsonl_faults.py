"""JSONL files under faults: partial lines, full disks, deleted directories, damaged input.

The writer never appends after a partial line and never reports a line it did
not wholly write as exported; the readers recover every complete line around
a damaged one and say what they skipped (file, line, reason), or raise naming
file and line when ``strict``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest
import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commspan import Aggregator, CommSpanMode, semconv
from commspan.exporters import JsonlSpanExporter, ReadReport, encode_spans, read_spans
from commspan.exporters.queue import ExportQueue

REPO = Path(__file__).resolve().parent.parent


def _spans(n: int, tag: str) -> list[ReadableSpan]:
    """``n`` finished SDK spans named ``tag-i`` with a commspan rank in their resource."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({semconv.RANK: 0}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("faults")
    for i in range(n):
        with tracer.start_as_current_span(f"{tag}-{i}", attributes={"pad": "x" * 200}):
            pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def _names(path: Path, **kwargs: object) -> list[str]:
    return [s.name for s in read_spans(path, **kwargs)]  # type: ignore[arg-type]


# ---------------------------------------------------------------- writer: partial lines
def test_restart_after_a_torn_line_starts_a_fresh_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Appending to a file left with a partial last line (a crashed writer) starts a
    new line: the new lines stay readable, the fragment is reported as damaged."""
    caplog.set_level(logging.WARNING)
    path = tmp_path / "trace.jsonl"
    whole = encode_spans(_spans(2, "old")) + b"\n"
    fragment = encode_spans(_spans(2, "torn"))[:150]
    path.write_bytes(whole + fragment)

    exporter = JsonlSpanExporter(path)
    for tag in ("new-a", "new-b"):
        assert exporter.export(_spans(3, tag)) is SpanExportResult.SUCCESS
    exporter.shutdown()

    data = path.read_bytes()
    assert data.startswith(whole + fragment + b"\n")
    report = ReadReport()
    names = _names(path, strict=False, report=report)
    assert names == ["old-0", "old-1"] + [f"{t}-{i}" for t in ("new-a", "new-b") for i in range(3)]
    assert [(s.line, s.kind) for s in report.skipped] == [(2, "damaged")]
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not a JSON line")):
        list(read_spans(path))
    assert any("does not end in a newline" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records)


def test_short_write_is_removed_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write that stops partway (ENOSPC) returns FAILURE and leaves nothing of its
    line in the file; once space is back, later lines are whole and readable."""
    caplog.set_level(logging.WARNING)
    path = tmp_path / "trace.jsonl"
    exporter = JsonlSpanExporter(path)
    assert exporter.export(_spans(2, "a")) is SpanExportResult.SUCCESS
    size = path.stat().st_size
    real_write = os.write
    calls = []

    def disk_fills(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 3]))  # what fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "write", disk_fills)
        assert exporter.export(_spans(4, "b")) is SpanExportResult.FAILURE
        assert exporter.export(_spans(4, "c")) is SpanExportResult.FAILURE
    assert len(calls) == 3  # b: a third, then ENOSPC; c: ENOSPC at once
    assert path.stat().st_size == size  # b's third was cut off again
    assert exporter.export(_spans(2, "d")) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert _names(path) == ["a-0", "a-1", "d-0", "d-1"]  # strict: every line whole
    warned = [r.getMessage() for r in caplog.records if "writing" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0]
    assert "removed from the file" in warned[0]


def test_short_write_that_cannot_be_cut_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When the cut-off part of a line cannot be truncated away, the warning says the
    line was left cut short (not "removed"), and the next line starts afresh: a
    lenient read skips the one damaged line and keeps the others."""
    from commspan.exporters import ReadReport, read_spans

    caplog.set_level(logging.WARNING)
    path = tmp_path / "trace.jsonl"
    exporter = JsonlSpanExporter(path)
    assert exporter.export(_spans(2, "a")) is SpanExportResult.SUCCESS
    real_write = os.write
    calls = []

    def disk_fills(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 3]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    with monkeypatch.context() as m:
        m.setattr(os, "write", disk_fills)
        m.setattr(os, "ftruncate", no_truncate)
        assert exporter.export(_spans(4, "b")) is SpanExportResult.FAILURE
    assert exporter.export(_spans(2, "d")) is SpanExportResult.SUCCESS
    exporter.shutdown()
    warned = [r.getMessage() for r in caplog.records if "writing" in r.getMessage()]
    assert len(warned) == 1 and "left cut short in the file" in warned[0]
    report = ReadReport()
    names = [s.name for s in read_spans(path, strict=False, report=report)]
    assert names == ["a-0", "a-1", "d-0", "d-1"] and len(report.skipped) == 1


FILE_SIZE_CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from commspan.exporters.queue import ExportQueue
    from commspan.exporters import JsonlSpanExporter

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death

    def spans(n, tag):
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"commspan.rank": 0}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        for i in range(n):
            with provider.get_tracer("t").start_as_current_span(f"{tag}-{i}",
                                                                attributes={"pad": "x" * 300}):
                pass
        return list(memory.get_finished_spans())

    path = sys.argv[1]
    queue = ExportQueue(JsonlSpanExporter(path), schedule_delay_s=0.01)

    def batch(tag, n):
        for s in spans(n, tag):
            queue.on_end(s)
        assert queue.force_flush(10_000)

    batch("a", 5)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    size = __import__("os").path.getsize(path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1000, hard))  # the disk is full
    batch("b", 20)  # about 10 kB: cut short after 1000 bytes
    batch("c", 20)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space freed
    batch("d", 5)
    queue.shutdown()
    print(json.dumps(queue.stats()))
    """
)


def test_file_size_limit_short_writes_are_failed_not_glued(tmp_path: Path) -> None:
    """Real short writes (RLIMIT_FSIZE in a child process): the spans of cut lines
    are counted failed, nothing of them stays in the file, the other lines read whole."""
    path = tmp_path / "trace.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", FILE_SIZE_CHILD, str(path)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (stats["queued"], stats["exported"], stats["failed"], stats["dropped"]) == (
        50, 10, 40, 0)
    assert stats["pending"] == stats["in_flight"] == 0
    assert _names(path) == [f"{t}-{i}" for t in "ad" for i in range(5)]


def test_full_device_fails_and_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Writing to /dev/full (ENOSPC at once) returns FAILURE: the queue counts the spans
    failed, logs once, and nothing raises."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    caplog.set_level(logging.WARNING)
    link = tmp_path / "full.jsonl"
    link.symlink_to("/dev/full")
    queue = ExportQueue(JsonlSpanExporter(link), schedule_delay_s=0.01)
    for tag in "ab":
        for s in _spans(3, tag):
            queue.on_end(s)
        assert queue.force_flush(10_000)
    queue.shutdown()
    stats = queue.stats()
    assert (stats["queued"], stats["exported"], stats["failed"]) == (6, 0, 6)
    assert len([r for r in caplog.records if "No space left" in r.getMessage()]) == 1


# ---------------------------------------------------------------- writer: file gone
def _step(mode: CommSpanMode, model: torch.nn.Module, i: int) -> None:
    with mode.step(i):
        model(torch.ones(2, 4)).sum().backward()
    assert mode.flush(10.0)


@pytest.mark.parametrize("how", ["rmtree", "unlink"])
def test_deleted_output_is_recreated(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The output directory (or file) deleted mid-run: the exporter notices at the next
    batch, creates the file again, logs once; every span is on disk or counted."""
    caplog.set_level(logging.WARNING)
    out = tmp_path / "out"
    mode = CommSpanMode(exporters=[JsonlSpanExporter(out / "trace-{rank}.jsonl")])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with mode:
        for i in range(2):
            _step(mode, model, i)
        (path,) = out.iterdir()
        before = mode.stats()["exporters"][0]["exported"]
        assert before > 0
        if how == "rmtree":
            shutil.rmtree(out)
        else:
            path.unlink()
        for i in range(2, 5):
            _step(mode, model, i)
    mode.shutdown()
    (stats,) = mode.stats()["exporters"]
    assert stats["queued"] == stats["exported"] + stats["dropped"] + stats["failed"]
    assert stats["pending"] == stats["in_flight"] == 0
    assert stats["failed"] == stats["dropped"] == 0
    on_disk = list(read_spans(path))
    assert len(on_disk) == stats["exported"] - before > 0
    steps = {s.attributes.get(semconv.STEP) for s in on_disk if s.name == semconv.SPAN_RANK}
    assert steps == {2, 3, 4}
    gone = [r for r in caplog.records if "deleted or replaced" in r.getMessage()]
    assert len(gone) == 1 and str(path) in gone[0].getMessage()


def test_output_that_cannot_be_recreated_counts_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """If the deleted directory cannot be made again (a file is in its place), later
    batches return FAILURE: counted failed, logged once, never raised."""
    caplog.set_level(logging.WARNING)
    out = tmp_path / "out"
    exporter = JsonlSpanExporter(out / "trace.jsonl")
    queue = ExportQueue(exporter, schedule_delay_s=0.01)
    for s in _spans(3, "a"):
        queue.on_end(s)
    assert queue.force_flush(10_000)
    shutil.rmtree(out)
    out.write_text("in the way")
    for tag in "bc":
        for s in _spans(3, tag):
            queue.on_end(s)
        assert queue.force_flush(10_000)
    queue.shutdown()
    stats = queue.stats()
    assert (stats["queued"], stats["exported"], stats["failed"]) == (9, 3, 6)
    assert len([r for r in caplog.records if "cannot open" in r.getMessage()]) == 1


# ---------------------------------------------------------------- writer: template
@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("trace-{rnak}.jsonl", "unknown field {rnak}"),
        ("trace-{0}.jsonl", "a positional field"),
        ("trace-{rank.jsonl", "expected '}' before end of string"),
        ("{run_id}/trace-{run_id:d}.jsonl", "Unknown format code 'd'"),
        ("{rnak}/", "unknown field {rnak}"),
    ],
)
def test_bad_file_name_template_is_rejected_at_creation(
    tmp_path: Path, name: str, problem: str
) -> None:
    """A template the exporter could not fill raises ValueError when it is created,
    naming the parameter, the value and the fields there are."""
    value = str(tmp_path / name)
    with pytest.raises(ValueError) as info:
        JsonlSpanExporter(value)
    message = str(info.value)
    assert message.startswith(f"path={value!r} is not a valid file-name template: ")
    assert problem in message
    assert "the fields are {rank} and {run_id}" in message


def test_good_templates_are_accepted(tmp_path: Path) -> None:
    """Format specs and doubled braces are fine, and fill as documented."""
    exporter = JsonlSpanExporter(tmp_path / "{{x}}-r{rank:03d}.jsonl")
    assert exporter.export(_spans(1, "a")) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == ["{x}-r000.jsonl"]


# ---------------------------------------------------------------- reader
@pytest.fixture(scope="module")
def good_lines(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Four lines of a traced Linear model, one step each (newline included)."""
    path = tmp_path_factory.mktemp("good") / "trace.jsonl"
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with mode:
        for i in range(4):
            _step(mode, model, i)
    mode.shutdown()
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 4
    return lines


WRONG_TYPE = (
    b'{"resourceSpans":[{"resource":{"attributes":[]},"scopeSpans":[{"spans":'
    b'[{"name":"x","attributes":[{"key":"commspan.module.fqn","value":{"stringValue":"M"}},'
    b'{"key":"commspan.collectives.forward.all_reduce","value":{"intValue":"many"}}]}]}]}]}\n'
)


def _typed_line(span_attrs: bytes, event_attrs: bytes = b"") -> bytes:
    """A line of one module span M (and one all_reduce event on it) with more attributes."""
    fqn = b'{"key":"commspan.module.fqn","value":{"stringValue":"M"}}'
    op = b'{"key":"commspan.collective.op","value":{"stringValue":"all_reduce"}}'
    event = b'"events":[{"name":"all_reduce","attributes":[' + op + event_attrs + b"]}]"
    return (b'{"resourceSpans":[{"resource":{"attributes":[]},"scopeSpans":[{"spans":'
            b'[{"name":"M forward","attributes":[' + fqn + span_attrs + b"]," + event
            + b"}]}]}]}\n")


DAMAGE = {
    "garbage": (b"{not json\n", "not a JSON line"),
    "null": (b"null\n", "null, not an OTLP/JSON trace request"),
    "list": (b"[1, 2]\n", "an array, not an OTLP/JSON trace request"),
    "no-resourceSpans": (b'{"resourceLogs": []}\n',
                         "an object without resourceSpans (keys: resourceLogs)"),
    "resourceSpans-type": (b'{"resourceSpans": {}}\n', "resourceSpans is an object"),
    "scopeSpans-type": (b'{"resourceSpans": [{"scopeSpans": 3}]}\n',
                        "resourceSpans[0].scopeSpans is a number, expected an array"),
    "wrong-type-inside": (
        WRONG_TYPE,
        "resourceSpans[0].scopeSpans[0].spans[0].attributes[1].value is not an OTLP AnyValue",
    ),
    # an attribute the readers convert, of a type commspan never writes
    "bytes-type": (
        _typed_line(b"", b',{"key":"commspan.tensor.bytes","value":{"stringValue":"12kB"}}'),
        "resourceSpans[0].scopeSpans[0].spans[0] ('M forward'): commspan.tensor.bytes is "
        "'12kB', not an integer as commspan writes it",
    ),
    "depth-type": (
        _typed_line(b',{"key":"commspan.module.depth","value":{"stringValue":"deep"}}'),
        "spans[0] ('M forward'): commspan.module.depth is 'deep', not an integer",
    ),
    # the roll-ups the readers sum: a count of another type, or empty
    "count-type": (
        _typed_line(b',{"key":"commspan.collectives.forward.all_reduce",'
                    b'"value":{"stringValue":"five"}}'),
        "spans[0] ('M forward'): commspan.collectives.forward.all_reduce is 'five', not an "
        "integer",
    ),
    "count-empty": (
        _typed_line(b',{"key":"commspan.collectives.forward.all_reduce","value":{}}'),
        "spans[0] ('M forward'): commspan.collectives.forward.all_reduce is None, not an "
        "integer",
    ),
    # what int() would have read as a count: a boolean, a float, padded text; and a
    # negative count (they were summed, without a word)
    **{f"count-{name}": (
        _typed_line(b',{"key":"commspan.collectives.forward.all_reduce","value":{"intValue":'
                    + raw + b"}}"),
        f"spans[0]{'' if what.startswith(' ') else '.'}{what}") for name, raw, what in (
            ("bool", b"true", "attributes[1].value is not an OTLP AnyValue (BadValue: "
             "intValue is True, not an integer"),
            ("float", b"1.9", "attributes[1].value is not an OTLP AnyValue (BadValue: "
             "intValue is 1.9, not an integer"),
            ("padded", b'" 1"', "attributes[1].value is not an OTLP AnyValue (BadValue: "
             "intValue is ' 1', not an integer"),
            ("negative", b'"-3"', " ('M forward'): commspan.collectives.forward.all_reduce is "
             "-3, not a count"),
        )},
    # a key that is not a string (read as a key, it failed every command later), a name
    # that is not a string, a time that is not an integer
    "key-type": (
        _typed_line(b',{"key":-1,"value":{"intValue":"1"}}'),
        "spans[0].attributes[1].key is a number, expected a string",
    ),
    "name-type": (
        _typed_line(b"").replace(b'"name":"M forward"', b'"name":["x"]'),
        "name is ['x'], not a string",
    ),
    "placements-type": (
        _typed_line(b',{"key":"commspan.module.param_names","value":{"arrayValue":{"values":'
                    b'[{"stringValue":"weight"}]}}},'
                    b'{"key":"commspan.module.param_placements","value":{"intValue":"-1"}}'),
        "spans[0] ('M forward'): commspan.module.param_placements is -1, not an array of 1 "
        "values, one per name in commspan.module.param_names",
    ),
}


@pytest.mark.parametrize("where", ["middle", "last"])
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_line_raises_by_default(
    good_lines: list[bytes], tmp_path: Path, kind: str, where: str
) -> None:
    """A complete line that is not an OTLP/JSON trace request, in the middle or last
    (with its newline), raises ValueError naming file:line and the fix, from
    read_spans and from_jsonl alike."""
    bad, reason = DAMAGE[kind]
    lines = list(good_lines)
    number = 2 if where == "middle" else len(lines) + 1
    lines.insert(number - 1, bad)
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(lines))
    for read in (lambda: list(read_spans(path)), lambda: Aggregator.from_jsonl(path)):
        with pytest.raises(ValueError) as info:
            read()
        message = str(info.value)
        assert message.startswith(f"{path}:{number}: ")
        assert reason in message and "pass strict=False" in message


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_lenient_read_recovers_every_other_line(
    good_lines: list[bytes], tmp_path: Path, kind: str
) -> None:
    """With strict=False every complete line around damaged ones is read, and the
    report names each skipped line with its reason; both readers agree."""
    bad, reason = DAMAGE[kind]
    path = tmp_path / "trace.jsonl"
    path.write_bytes(bad + good_lines[0] + bad + b"".join(good_lines[1:]) + bad)
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"".join(good_lines))

    report = ReadReport()
    spans = list(read_spans(path, strict=False, report=report))
    assert [s.span_id for s in spans] == [s.span_id for s in read_spans(clean)]
    assert [(s.path, s.line, s.kind) for s in report.skipped] == [
        (str(path), n, "damaged") for n in (1, 3, 7)]
    assert all(reason in s.reason for s in report.skipped)
    assert report.lines == 4 and report.spans == len(spans)
    assert report.commspan_spans == sum(semconv.MODULE_FQN in s.attributes for s in spans) > 0
    assert report.ranks == {spans[0].rank}

    agg_report = ReadReport()
    agg = Aggregator.from_jsonl(path, strict=False, report=agg_report)
    expected = Aggregator.from_jsonl(clean)
    assert agg.module_counts() == expected.module_counts()
    assert agg.table(noise_level=1) == expected.table(noise_level=1)
    assert agg_report.skipped == report.skipped
    assert (agg_report.lines, agg_report.spans) == (report.lines, report.spans)


def test_lenient_read_without_report_logs_each_skipped_line(
    good_lines: list[bytes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """strict=False without a report: each skipped line is logged (file:line, reason)."""
    caplog.set_level(logging.WARNING)
    path = tmp_path / "trace.jsonl"
    path.write_bytes(good_lines[0] + b"null\n" + good_lines[1])
    assert len(list(read_spans(path, strict=False))) > 0
    (record,) = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert f"{path}:2" in record.getMessage() and "null" in record.getMessage()


def test_torn_last_line_is_reported_as_torn(good_lines: list[bytes], tmp_path: Path) -> None:
    """Only a last line without a newline is torn: skipped in either mode, reported
    as torn (not damaged), the lines before it read."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(good_lines[:3]) + good_lines[3][:100])
    report = ReadReport()
    strict_ids = [s.span_id for s in read_spans(path, report=report)]
    assert [(s.line, s.kind) for s in report.skipped] == [(4, "torn")]
    assert report.damaged == [] and report.lines == 3
    lenient = ReadReport()
    assert [s.span_id for s in read_spans(path, strict=False, report=lenient)] == strict_ids
    assert lenient.skipped == report.skipped


def test_whole_last_line_without_newline_is_read(good_lines: list[bytes], tmp_path: Path) -> None:
    """A last line that is whole but lacks its newline (another tool's file) is read."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(good_lines)[:-1])
    report = ReadReport()
    assert len(list(read_spans(path, report=report))) == report.spans > 0
    assert report.lines == 4 and report.skipped == []


def test_over_long_line_is_capped(good_lines: list[bytes], tmp_path: Path) -> None:
    """A line longer than max_line_bytes is never read whole: strict raises naming
    the limit; lenient keeps the lines before it and reports the rest unread."""
    path = tmp_path / "trace.jsonl"
    limit = max(len(line) for line in good_lines)
    path.write_bytes(good_lines[0] + b"x" * (limit + 1) + b"\n" + good_lines[1])
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: line longer than {limit} bytes")
                       + ".*max_line_bytes"):
        list(read_spans(path, max_line_bytes=limit))
    report = ReadReport()
    spans = list(read_spans(path, strict=False, report=report, max_line_bytes=limit))
    assert report.lines == 1 and len(spans) == report.spans > 0
    assert [(s.line, s.kind) for s in report.skipped] == [(2, "too_long")]
    assert "the rest of the file is not read" in report.skipped[0].reason
    with pytest.raises(ValueError, match="max_line_bytes=0 is not valid"):
        list(read_spans(path, max_line_bytes=0))


DEV_ZERO_CHILD = textwrap.dedent(
    """
    import resource, sys
    from commspan.otlpjson.decode import read_documents
    # the default cap (64 MiB) must hold well within 1 GiB more than now
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), hard))
    try:
        list(read_documents("/dev/zero"))
    except ValueError as exc:
        print(exc)
    """
)


def test_dev_zero_is_bounded_by_the_default_cap() -> None:
    """Reading /dev/zero (an endless line) stops at the default 64 MiB cap with a
    ValueError naming file and line, in bounded memory."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", DEV_ZERO_CHILD], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(
        f"/dev/zero:1: line longer than {64 * 2**20} bytes (64 MiB); the rest of the file "
        "is not read; pass a larger max_line_bytes"
    )


def test_reader_arguments_are_checked(tmp_path: Path) -> None:
    """Bad strict/report values are errors naming the parameter."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"")
    with pytest.raises(TypeError, match="strict='no' is not valid"):
        list(read_spans(path, strict="no"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="report=.* is not valid; pass a ReadReport"):
        Aggregator.from_jsonl(path, report=[])  # type: ignore[arg-type]


def test_malformed_line_adds_nothing_to_the_counts(tmp_path: Path) -> None:
    """A line whose spans decode only partly (the second span's count is not an
    int) adds none of its spans: the first span's count is not kept."""
    span = (b'{"name":"s","attributes":[{"key":"commspan.module.fqn","value":{"stringValue":"M"}},'
            b'{"key":"commspan.collectives.forward.total","value":{"intValue":"%s"}},'
            b'{"key":"commspan.collectives.forward.all_reduce","value":{"intValue":"%s"}}]}')
    head = (b'{"resourceSpans":[{"resource":{"attributes":[{"key":"commspan.rank","value":'
            b'{"intValue":"0"}}]},"scopeSpans":[{"spans":[')
    line = head + span % (b"1", b"1") + b"," + span % (b"1", b"x") + b"]}]}]}\n"
    good = head + (span % (b"1", b"1")).replace(b'"M"', b'"N"') + b"]}]}]}\n"
    path = tmp_path / "trace.jsonl"
    path.write_bytes(line + good)
    report = ReadReport()
    agg = Aggregator.from_jsonl(path, strict=False, report=report)
    assert "M" not in agg.module_counts() and report.lines == 1
    assert agg.module_counts()["N"] == {"forward": {"all_reduce": 1}}  # the good line counts
    assert orjson.loads(line)  # valid JSON: damage is in the content
    assert "spans[1].attributes[2].value is not an OTLP AnyValue" in report.skipped[0].reason
    path.write_bytes(line)  # the bad line alone: no commspan span read, an error
    with pytest.raises(ValueError, match=r"no commspan span in .*, 1 line skipped\)"):
        Aggregator.from_jsonl(path, strict=False)


def test_a_path_below_a_file_is_refused_at_once(tmp_path: Path) -> None:
    """A path below an existing file (a rank file taken for the run's folder): no
    directory can be made there, so every export failed, after the step had run; it is
    refused when the exporter is made, naming the parameter and the file in the way."""
    afile = tmp_path / "commspan-rank0.jsonl"
    afile.write_text("keep\n")
    for path in (afile / "out", afile / "a" / "rank{rank}.jsonl"):
        with pytest.raises(ValueError, match=(
                re.escape(f"path={str(path)!r} is not valid: {str(afile)!r} is a file, not a "
                          "directory, so nothing can be written below it"))):
            JsonlSpanExporter(path)
    assert afile.read_text() == "keep\n"
    JsonlSpanExporter(tmp_path / "new" / "deeper" / "rank{rank}.jsonl")  # made when written


def test_an_existing_non_directory_taken_for_a_directory_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """A path without a suffix names a directory of rank files; one that exists and is
    not a directory (``/dev/full``, a file) used to be accepted, every export then
    failing; it is refused when the exporter is made, naming the parameter."""
    plain = tmp_path / "notes"
    plain.write_text("x")
    for path in (plain, Path("/dev/full")):
        if not path.exists():
            continue
        with pytest.raises(ValueError, match="it names a directory .no suffix. but exists"):
            JsonlSpanExporter(path)
    JsonlSpanExporter(tmp_path / "out")  # a new directory: fine


def test_a_resource_attribute_utf8_cannot_encode_costs_no_span(tmp_path: Path) -> None:
    """A resource value with a lone surrogate (``OTEL_SERVICE_NAME`` holding a byte that
    is not UTF-8): every span is written, the value with U+FFFD (every export failed)."""
    model = torch.nn.Linear(2, 2)
    mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path)],
                        resource_attributes={"team": "ml\udcff"})
    with mode:
        for i in range(2):
            with mode.step(i):
                model(torch.randn(2, 2)).sum().backward()
    mode.shutdown()
    stats = mode.stats()
    assert stats["spans_failed"] == 0 and stats["spans_exported"] == stats["spans"] > 0
    lines = (tmp_path / "commspan-rank0.jsonl").read_bytes().splitlines()
    resources = [json.loads(line)["resourceSpans"][0]["resource"] for line in lines]
    teams = {a["value"]["stringValue"] for r in resources for a in r["attributes"]
             if a["key"] == "team"}
    assert teams == {"ml\ufffd"}
    assert sum(len(s["spans"]) for line in lines
               for s in json.loads(line)["resourceSpans"][0]["scopeSpans"]) == stats["spans"]


@pytest.mark.parametrize("value", [b"1.5", b"true", b'"\\u0661"', b'" 7"'])
def test_a_time_that_is_not_an_integer_is_a_damaged_line(
    good_lines: list[bytes], tmp_path: Path, value: bytes,
) -> None:
    """A span's start time of another type, which ``int()`` read (1.5 and true as 1, an
    Arabic-Indic digit as its value): the span readers and the aggregator (which orders
    modules by it) name the line damaged."""
    bad = _typed_line(b"").replace(b'"name":"M forward",',
                                   b'"name":"M forward","startTimeUnixNano":' + value + b",")
    bad = bad.replace(b'"resource":{"attributes":[]}', b'"resource":{"attributes":[{"key":'
                      b'"commspan.rank","value":{"intValue":"0"}}]}')
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join([good_lines[0], bad, *good_lines[1:]]))
    with pytest.raises(ValueError, match=r"trace.jsonl:2: startTimeUnixNano is .*, not an "
                                         r"integer \(nanoseconds\)"):
        list(read_spans(path))
    _damaged_for_both_readers(path, good_lines, tmp_path)


def _damaged_for_both_readers(path: Path, good_lines: list[bytes], tmp_path: Path) -> None:
    """Line 2 of ``path`` (``good_lines`` with it inserted) is damaged for the span
    reader and the aggregator alike: strict, both raise naming it; lenient, both read
    the rest as the good lines alone."""
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"".join(good_lines))
    with pytest.raises(ValueError, match="trace.jsonl:2: "):
        Aggregator.from_jsonl(path)
    report = ReadReport()
    assert len(list(read_spans(path, strict=False, report=report))) == len(list(read_spans(good)))
    assert [s.line for s in report.skipped] == [2]
    report = ReadReport()
    lenient = Aggregator.from_jsonl(path, strict=False, report=report)
    assert lenient.module_counts() == Aggregator.from_jsonl(good).module_counts()
    assert [s.line for s in report.skipped] == [2]


def test_a_commspan_span_without_a_rank_is_a_damaged_line(
    good_lines: list[bytes], tmp_path: Path,
) -> None:
    """A module span whose resource has no commspan.rank (commspan writes it in every
    resource): the readers that go by rank dropped it and the others counted it
    (``summary`` and ``table --show`` disagreed, ``check`` reported a mismatch that was
    not there); the span readers and the aggregator name its line damaged."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join([good_lines[0], _typed_line(b""), *good_lines[1:]]))
    with pytest.raises(ValueError, match=r"trace.jsonl:2: commspan.rank is None, not a rank, "
                                         r"in the resource of a commspan span"):
        list(read_spans(path))
    _damaged_for_both_readers(path, good_lines, tmp_path)
