"""JSONL span files: one per rank, OTLP/JSON lines, read back into identical aggregates.

Two runs feed the tests. ``tp_run`` traces the tensor-parallel toy Transformer
(fake process group, checkpointed blocks) in this process through two
``JsonlSpanExporter``s, flushing after each step so the files hold several
lines. ``child_run`` is a separate Python process: it writes the files of three
ranks (a fake process group re-initialised as rank 0, 1, 2, rank r issuing r+1
all_reduces per step), then exports and leaves one more mode, starts another
and dies with ``os._exit(1)`` in the middle of a step.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commspan import Aggregator, CommSpanMode, semconv
from commspan.exporters import JsonlSpanExporter, read_spans
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")
DIGITS = re.compile(r"^[0-9]+$")
CHILD_RANKS = 3


# ---------------------------------------------------------------- in-process run
@dataclass
class TpRun:
    """Files and in-process results of the traced TP Transformer run."""

    template_file: Path
    dir_file: Path
    mode: CommSpanMode
    span_ids: set[str]


@pytest.fixture(scope="module")
def tp_run(fake_pg: None, tmp_path_factory: pytest.TempPathFactory) -> TpRun:
    """Three traced steps of the TP Transformer written through '{rank}' and directory exporters."""
    from torch.distributed.device_mesh import init_device_mesh

    root = tmp_path_factory.mktemp("tp_run")
    (root / "dir").mkdir()
    mesh = init_device_mesh("cpu", (4,))
    args = ModelArgs(n_layers=2, checkpoint={1: False})
    model = parallelize(Transformer(args), mesh)
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    mode = CommSpanMode(
        tracer_provider=provider,
        exporters=[
            JsonlSpanExporter(root / "t" / "trace-{rank}.jsonl"),
            JsonlSpanExporter(root / "dir"),
        ],
        run_id="jsonl-test",
    )
    with mode:
        for i in range(3):
            with mode.step(i):
                train_step(model, *make_batch(args, seed=i))
            assert mode.flush(10.0)
    mode.shutdown()
    ids = {f"{s.context.span_id:016x}" for s in memory.get_finished_spans()}
    return TpRun(root / "t" / "trace-0.jsonl", root / "dir" / "commspan-rank0.jsonl", mode, ids)


def _lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return data[:-1].split(b"\n")


def test_rank_template_and_directory_paths(tp_run: TpRun) -> None:
    """'{rank}' in the path and a directory path each give this rank's file, with the same spans."""
    assert sorted(p.name for p in tp_run.template_file.parent.iterdir()) == ["trace-0.jsonl"]
    assert sorted(p.name for p in tp_run.dir_file.parent.iterdir()) == ["commspan-rank0.jsonl"]
    from_template = {s.span_id for s in read_spans(tp_run.template_file)}
    from_dir = {s.span_id for s in read_spans(tp_run.dir_file)}
    assert from_template == from_dir == tp_run.span_ids


def _check_attributes(items: Any) -> None:
    assert isinstance(items, list)
    for item in items:
        assert set(item) == {"key", "value"} and isinstance(item["key"], str)
        _check_value(item["value"])


def _check_value(value: dict[str, Any]) -> None:
    assert len(value) == 1
    ((kind, v),) = value.items()
    if kind == "intValue":
        assert isinstance(v, str) and re.match(r"^-?[0-9]+$", v)
    elif kind == "stringValue":
        assert isinstance(v, str)
    elif kind == "boolValue":
        assert isinstance(v, bool)
    elif kind == "doubleValue":
        assert isinstance(v, (int, float))
    elif kind == "arrayValue":
        assert set(v) <= {"values"}
        for item in v.get("values", []):
            _check_value(item)
    else:
        raise AssertionError(f"unexpected AnyValue kind {kind}")


def _hex_ids_to_base64(doc: dict[str, Any]) -> dict[str, Any]:
    """OTLP/JSON ids are hex; protobuf's JSON mapping wants base64 for bytes fields."""
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return doc


def test_every_line_is_an_otlp_json_request(tp_run: TpRun) -> None:
    """Each line is a complete ExportTraceServiceRequest in OTLP/JSON (hex ids, string int64s)."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    lines = _lines(tp_run.template_file)
    assert len(lines) >= 3  # one flush per step
    seen: list[str] = []
    for line in lines:
        doc = orjson.loads(line)
        assert set(doc) == {"resourceSpans"} and doc["resourceSpans"]
        for rs in doc["resourceSpans"]:
            _check_attributes(rs["resource"]["attributes"])
            resource = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
            assert resource[semconv.RANK] == {"intValue": "0"}
            assert resource[semconv.RUN_ID] == {"stringValue": "jsonl-test"}
            for ss in rs["scopeSpans"]:
                assert ss["scope"]["name"] == semconv.INSTRUMENTATION_SCOPE
                assert ss["scope"]["version"]
                for span in ss["spans"]:
                    assert HEX32.match(span["traceId"]) and HEX16.match(span["spanId"])
                    if "parentSpanId" in span:
                        assert HEX16.match(span["parentSpanId"])
                    assert DIGITS.match(span["startTimeUnixNano"])
                    assert DIGITS.match(span["endTimeUnixNano"])
                    assert int(span["startTimeUnixNano"]) <= int(span["endTimeUnixNano"])
                    assert span["kind"] == 1  # SPAN_KIND_INTERNAL
                    assert span["name"]
                    _check_attributes(span["attributes"])
                    for event in span.get("events", []):
                        assert DIGITS.match(event["timeUnixNano"]) and event["name"]
                        _check_attributes(event["attributes"])
                    seen.append(span["spanId"])
        message = json_format.ParseDict(_hex_ids_to_base64(doc), ExportTraceServiceRequest())
        assert sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans) > 0
    assert len(seen) == len(set(seen)) == tp_run.mode.stats()["spans"]
    assert set(seen) == tp_run.span_ids


def test_from_jsonl_matches_in_process_aggregator(tp_run: TpRun) -> None:
    """Aggregator.from_jsonl on the run's file equals the live aggregator in every view."""
    live = tp_run.mode.aggregator
    assert live is not None and live.total_count() > 0
    for path in (tp_run.template_file, tp_run.dir_file.parent):
        offline = Aggregator.from_jsonl(path)
        assert offline.module_counts() == live.module_counts()
        assert offline.comm_counts() == live.comm_counts()
        assert offline.parameter_info() == live.parameter_info()
        assert offline.sharding_info() == live.sharding_info()
        assert offline.collectives() == live.collectives()
        assert offline.modules() == live.modules()
        assert offline.to_dict() == live.to_dict()
        assert offline.table() == live.table()
        assert offline.table(noise_level=1) == live.table(noise_level=1)
    assert Aggregator.from_jsonl(tp_run.template_file).sharding_info()


def test_truncated_last_line_is_tolerated(
    tp_run: TpRun, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A half-written last line is skipped with a warning; the whole lines still count."""
    caplog.set_level(logging.WARNING)
    path = tmp_path / "trace-0.jsonl"
    shutil.copy(tp_run.template_file, path)
    first = _lines(path)[0]
    with path.open("ab") as fh:
        fh.write(first[: len(first) // 2])
    agg = Aggregator.from_jsonl(path)
    assert tp_run.mode.aggregator is not None
    assert agg.module_counts() == tp_run.mode.aggregator.module_counts()
    warned = [
        r for r in caplog.records if r.levelno == logging.WARNING and "truncated" in r.getMessage()
    ]
    assert len(warned) == 1 and str(path) in warned[0].getMessage()


@pytest.mark.parametrize("damage", ["half-line", "garbage"])
def test_corrupt_middle_line_raises(tp_run: TpRun, tmp_path: Path, damage: str) -> None:
    """A corrupt line that is not the last raises ValueError naming file:line."""
    lines = _lines(tp_run.template_file)
    assert len(lines) >= 3
    lines[1] = lines[1][: len(lines[1]) // 2] if damage == "half-line" else b"not json {"
    path = tmp_path / "trace-0.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2")):
        Aggregator.from_jsonl(path)


def test_run_id_placeholder_in_path(tmp_path: Path) -> None:
    """'{run_id}' and '{rank}' in the path are filled from the spans' resource."""
    mode = CommSpanMode(
        exporters=[JsonlSpanExporter(tmp_path / "{run_id}" / "r{rank}.jsonl")], run_id="run-xyz"
    )
    with mode:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    mode.shutdown()
    files = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.jsonl")]
    assert files == [f"run-xyz/r{mode.rank}.jsonl"]
    assert {s.resource[semconv.RUN_ID] for s in read_spans(tmp_path / files[0])} == {"run-xyz"}


def test_export_after_shutdown_fails(tmp_path: Path) -> None:
    """After shutdown the exporter reports FAILURE instead of writing."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = JsonlSpanExporter(tmp_path / "x-{rank}.jsonl")
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with CommSpanMode(tracer_provider=provider):
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    spans = memory.get_finished_spans()
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert exporter.export(spans) is SpanExportResult.FAILURE
    assert len(_lines(next(tmp_path.glob("x-*.jsonl")))) == 1


# ---------------------------------------------------------------- child process
CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    out = sys.argv[1]
    n_ranks = int(sys.argv[2])

    class Chatty(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.n = n
        def forward(self, x):
            for _ in range(self.n):
                x = funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
            return x

    results = {}
    for rank in range(n_ranks):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n_ranks)
        mode = CommSpanMode(exporters=[JsonlSpanExporter(out + "/ranks/trace-{rank}.jsonl")],
                            run_id="child-run")
        with mode:
            for i in range(2):
                with mode.step(i):
                    Chatty(rank + 1)(torch.ones(2))
        mode.shutdown()
        results[rank] = mode.aggregator.module_counts()
        dist.destroy_process_group()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    before = CommSpanMode(exporters=[JsonlSpanExporter(out + "/crash/before.jsonl")],
                          run_id="crash")
    with before:
        with before.step(0):
            Chatty(2)(torch.ones(2))
    stats = before.stats()
    print(json.dumps({"results": results, "before_spans": stats["spans"],
                      "before_exported": stats["exporters"][0]["exported"]}), flush=True)

    during = CommSpanMode(exporters=[JsonlSpanExporter(out + "/crash/during.jsonl")],
                          run_id="crash")
    during.__enter__()
    with during.step(0):
        Chatty(1)(torch.ones(2))
    during.flush()
    print(json.dumps({"during_spans": during.stats()["spans"]}), flush=True)
    step = during.step(1)
    step.__enter__()
    Chatty(3)(torch.ones(2))
    os._exit(1)  # dies mid-step, mode still entered
    """
)


@dataclass
class ChildRun:
    """What the child process wrote and reported."""

    root: Path
    returncode: int
    report: dict[str, Any]
    stderr: str


@pytest.fixture(scope="module")
def child_run(tmp_path_factory: pytest.TempPathFactory) -> ChildRun:
    """Run the child script once: per-rank files, then a crash mid-step."""
    root = tmp_path_factory.mktemp("child")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "COMMSPAN_RUN_ID", "TORCHELASTIC_RUN_ID")
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(CHILD_RANKS)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    report: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            report.update(json.loads(line))
    return ChildRun(root, proc.returncode, report, proc.stderr)


def _rank_counts(child: ChildRun, rank: int) -> dict[str, Any]:
    return child.report["results"][str(rank)]


def test_child_wrote_one_file_per_rank(child_run: ChildRun) -> None:
    """Each rank's spans go to its own '{rank}' file, tagged with that rank."""
    assert "results" in child_run.report, child_run.stderr[-3000:]
    files = sorted(p.name for p in (child_run.root / "ranks").iterdir())
    assert files == [f"trace-{r}.jsonl" for r in range(CHILD_RANKS)]
    for r in range(CHILD_RANKS):
        spans = list(read_spans(child_run.root / "ranks" / f"trace-{r}.jsonl"))
        assert spans and {s.rank for s in spans} == {r}
        rank_spans = [s for s in spans if s.name == semconv.SPAN_RANK]
        assert len(rank_spans) == 2
        assert all(s.attributes[semconv.RANK] == r for s in rank_spans)


def test_from_jsonl_per_rank_matches_child(child_run: ChildRun) -> None:
    """from_jsonl(dir, rank=r) equals rank r's live aggregator; one rank's file needs no rank=."""
    assert "results" in child_run.report, child_run.stderr[-3000:]
    ranks_dir = child_run.root / "ranks"
    for r in range(CHILD_RANKS):
        expected = _rank_counts(child_run, r)
        assert expected["Global"] == {"forward": {"all_reduce": 2 * (r + 1)}}
        assert Aggregator.from_jsonl(ranks_dir, rank=r).module_counts() == expected
        assert Aggregator.from_jsonl(ranks_dir / f"trace-{r}.jsonl").module_counts() == expected


def test_rank_none_with_several_ranks_raises(child_run: ChildRun) -> None:
    """rank=None over several ranks' files raises ValueError telling to pass rank=."""
    assert "results" in child_run.report, child_run.stderr[-3000:]
    with pytest.raises(ValueError, match=r"rank="):
        Aggregator.from_jsonl(child_run.root / "ranks")
    files = sorted((child_run.root / "ranks").glob("*.jsonl"))
    with pytest.raises(ValueError, match=r"pass rank="):
        Aggregator.from_jsonl(*files[:2])


def test_rank_all_sums_ranks(child_run: ChildRun) -> None:
    """rank='all' sums every rank's counts."""
    assert "results" in child_run.report, child_run.stderr[-3000:]
    expected: dict[str, dict[str, dict[str, int]]] = {}
    for r in range(CHILD_RANKS):
        for fqn, phases in _rank_counts(child_run, r).items():
            for phase, ops in phases.items():
                slot = expected.setdefault(fqn, {}).setdefault(phase, {})
                for op, n in ops.items():
                    slot[op] = slot.get(op, 0) + n
    summed = Aggregator.from_jsonl(child_run.root / "ranks", rank="all")
    assert summed.module_counts() == expected
    assert summed.total_count() == sum(2 * (r + 1) for r in range(CHILD_RANKS))


def test_exported_lines_survive_process_death(child_run: ChildRun) -> None:
    """After os._exit mid-run, what was exported is on disk as whole, parseable lines."""
    assert child_run.returncode == 1, child_run.stderr[-3000:]
    before = child_run.root / "crash" / "before.jsonl"
    lines = _lines(before)
    spans = [
        s
        for line in lines
        for rs in orjson.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    ]
    assert len(spans) == child_run.report["before_spans"] == child_run.report["before_exported"]
    assert Aggregator.from_jsonl(before).comm_counts() == {"all_reduce": 2}

    during = child_run.root / "crash" / "during.jsonl"
    during_spans = [
        s
        for line in _lines(during)
        for rs in orjson.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    ]
    assert len(during_spans) >= child_run.report["during_spans"] > 0


# ------------------------------------------------ encoder vs the OTLP protobuf encoder
def _sdk_spans() -> list[Any]:
    """Spans from the plain OpenTelemetry SDK with every attribute type, events,
    links, kinds and statuses; the same attributes with an int, then a bool,
    then a float value (equal as Python keys: ``1 == True == 1.0``)."""
    from opentelemetry.trace import (
        Link,
        NonRecordingSpan,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
        TraceState,
        set_span_in_context,
    )

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("encoder-test", "1.2")
    for flag in (1, True, 1.0, 1, True):
        with tracer.start_as_current_span("same", attributes={"a": "x", "flag": flag}):
            pass
    with tracer.start_as_current_span(
        "parent",
        kind=SpanKind.SERVER,
        attributes={"s": "text", "i": 7, "big": 2**40, "f": 0.5, "b": False,
                    "ints": [1, 2, 3], "strs": ["a", "b"], "bools": [True, False]},
    ) as parent:
        parent.add_event("ev", {"seq": 123456789, "shape": [8, 64]})
        with tracer.start_as_current_span(
            "child", kind=SpanKind.CLIENT, links=[Link(parent.get_span_context(), {"why": "x"})]
        ) as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
        with tracer.start_as_current_span("ok") as ok:
            ok.set_status(Status(StatusCode.OK))
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "v1")]))
    with tracer.start_as_current_span(
        "remote-child", context=set_span_in_context(NonRecordingSpan(remote))
    ):
        pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def test_encoder_agrees_with_otlp_protobuf_encoder() -> None:
    """Each line parses into the same ExportTraceServiceRequest that the OTLP
    exporter's own protobuf encoder builds from the same spans; encoding twice
    (with the attribute caches warm) gives the same bytes."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as pb_encode
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from commspan.exporters import encode_spans

    spans = _sdk_spans()
    ours = encode_spans(spans)
    assert encode_spans(spans) == ours
    # OTLP/JSON writes ids as hex, protobuf's JSON mapping as base64
    doc = orjson.loads(ours)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for obj in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in obj:
                            obj[key] = base64.b64encode(bytes.fromhex(obj[key])).decode()
    parsed = json_format.ParseDict(doc, ExportTraceServiceRequest())
    expected = pb_encode(spans)
    # order of spans within a scope and of attributes is not part of the format
    def canonical(req: Any) -> list[Any]:
        out = []
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    d = json_format.MessageToDict(s)
                    d["attributes"] = sorted(d.get("attributes", []), key=lambda a: a["key"])
                    out.append((ss.scope.name, ss.scope.version, d))
        return sorted(out, key=lambda t: t[2]["spanId"])
    assert canonical(parsed) == canonical(expected)
    flags = [s for _, _, s in canonical(parsed) if s["name"] == "same"]
    kinds = [next(a["value"] for a in s["attributes"] if a["key"] == "flag") for s in flags]
    assert sorted(map(str, kinds)) == sorted(
        map(str, [{"intValue": "1"}, {"boolValue": True}, {"doubleValue": 1.0},
                  {"intValue": "1"}, {"boolValue": True}])
    )


def test_cached_arrays_keep_their_element_types() -> None:
    """``True == 1 == 1.0``: an array attribute encoded after an equal one of other
    element types (bools, then ints, then floats, under the same key, alone and among
    other attributes) is written with its own types, not the cached ones."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from commspan.exporters import encode_spans

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    values: list[Any] = [[True, False], [1, 0], [1.0, 0.0], (True,), (1,)]
    for value in values:
        for extra in ({}, {"name": "x"}):
            with tracer.start_as_current_span("s", attributes={"arr": value, **extra}):
                pass
    provider.shutdown()
    spans = memory.get_finished_spans()
    wanted = [v for v in values for _ in range(2)]
    for _ in range(2):  # cold caches, then warm ones
        for span, value in zip(spans, wanted):
            doc = orjson.loads(encode_spans([span]))
            attr = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"][0]
            kind = {bool: "boolValue", int: "intValue", float: "doubleValue"}[type(value[0])]
            assert list(attr["value"]["arrayValue"]["values"][0]) == [kind], (value, attr)


def test_every_reader_refuses_a_directory_without_jsonl_files(tmp_path: Path) -> None:
    """One rule for paths: a directory holding no *.jsonl file is an error for
    Aggregator.from_jsonl too (it used to count it as empty), as for the command, the
    analyses and the views; the error is both a FileNotFoundError and a ValueError."""
    from commspan.analysis import check_run
    from commspan.analysis.timeline import load_records

    empty = tmp_path / "empty"
    empty.mkdir()
    for read in (Aggregator.from_jsonl, check_run, load_records):
        with pytest.raises(FileNotFoundError, match="holds no \\*.jsonl or") as info:
            read(empty)
        assert isinstance(info.value, ValueError), read


def test_exporting_leaves_the_garbage_collector_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exporters run beside a training loop that may manage the collector itself
    (``gc.disable()``, ``gc.freeze()``): neither JSONL nor OTLP/protobuf encoding turns
    it off or on."""
    import gc

    from commspan.otlpjson.protobuf import encode_spans_protobuf

    calls: list[str] = []
    monkeypatch.setattr(gc, "disable", lambda: calls.append("disable"))
    monkeypatch.setattr(gc, "enable", lambda: calls.append("enable"))
    spans = _sdk_spans()
    exporter = JsonlSpanExporter(tmp_path / "t.jsonl")
    assert exporter.export(spans).name == "SUCCESS"
    exporter.shutdown()
    assert encode_spans_protobuf(spans)
    assert calls == []


def test_read_spans_takes_a_directory(tmp_path: Path) -> None:
    """As every reader: a directory stands for its *.jsonl files."""
    from commspan.exporters import read_spans

    (tmp_path / "run").mkdir()
    line = (b'{"resourceSpans":[{"resource":{"attributes":[]},"scopeSpans":[{"scope":'
            b'{"name":"x"},"spans":[{"traceId":"0123456789abcdef0123456789abcdef",'
            b'"spanId":"0123456789abcdef","name":"s","kind":1,"startTimeUnixNano":"1",'
            b'"endTimeUnixNano":"2"}]}]}]}\n')
    (tmp_path / "run" / "a.jsonl").write_bytes(line)
    assert [s.name for s in read_spans(tmp_path / "run")] == ["s"]
    with pytest.raises(FileNotFoundError, match="holds no"):
        list(read_spans(tmp_path))


@pytest.mark.usefixtures("fake_pg")
def test_rank_absent_from_the_files_raises(tmp_path: Path) -> None:
    """rank=N of a rank the files hold no span of (a typo, a rank the sample left out)
    raised nothing and gave an empty aggregator, whose assert_no_comm passed; it is a
    ValueError naming the ranks the files hold, as `commspan table --rank N` says, for
    the lines, the digests and from_records alike."""
    from _cli_runs import net_step, write_run

    from commspan.analysis.digest import write_digest
    from commspan.testing import assert_no_comm

    out = write_run(tmp_path / "run", "two-ranks", net_step(), ranks=(0, 2))
    issued = {0: 0, 2: 0}  # the reference: each rank's collective events, as written
    for r in read_spans(out):
        issued[r.rank] += sum(semconv.COLL_OP in attrs for _, attrs in r.events)
    assert issued[0] == issued[2] > 0
    for rank in (0, 2):
        assert Aggregator.from_jsonl(out, rank=rank).comm_counts() == {"all_reduce": issued[0]}
    for rank in (1, 5):
        with pytest.raises(ValueError, match=rf"rank={rank} is not valid: .*ranks: 0, 2"):
            Aggregator.from_jsonl(out, rank=rank)
        with pytest.raises(ValueError, match=rf"rank={rank} is not valid: .*ranks: 0, 2"):
            Aggregator.from_records(read_spans(out), rank=rank)
    for path in sorted(out.glob("*.jsonl")):
        write_digest(path)
    with pytest.raises(ValueError, match=r"rank=1 is not valid: .*ranks: 0, 2"):
        assert_no_comm(Aggregator.from_jsonl(out, rank=1), None)
    assert Aggregator.from_jsonl(out, rank=2).comm_counts() == {"all_reduce": issued[2]}


def test_python_readers_refuse_files_without_commspan_spans(tmp_path: Path) -> None:
    """Valid OTLP spans another instrumentation wrote (the SDK's own tracer, no commspan
    attribute), an empty file, and a file of damaged lines skipped with strict=False:
    Aggregator.from_jsonl, load_run, check_run and the views raise the error the command
    line gives, naming the file and what it holds, instead of empty counts on which
    assert_no_comm passed and an empty check with no findings."""
    from _cli_runs import write_foreign_spans

    from commspan.analysis import check_run, load_run
    from commspan.render import chrome_trace, write_html_report
    from commspan.testing import assert_no_comm

    other = write_foreign_spans(tmp_path / "other.jsonl", 2)
    assert len(other.read_text().splitlines()) == 2  # two valid OTLP/JSON lines
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("a,b\n1,2\n")
    tail = r"none with commspan\.module\.fqn{}\): {} \(DIR/commspan-rank<N>\.jsonl of "
    why = (r"not files written by commspan's JsonlSpanExporter; pass the files it wrote",
           r"every line was skipped, damaged or cut short \(the warnings, or report\.skipped, "
           r"say why\); pass files whose writer has finished")
    for path, counts, also in ((other, "2 lines, 2 spans", ""), (empty, "0 lines, 0 spans", ""),
                               (damaged, "0 lines, 0 spans", ", 2 lines skipped")):
        ending = tail.format(also, why[bool(also)])
        message = re.escape(f"no commspan span in {path} ({counts}, ") + ending
        with pytest.raises(ValueError, match="^paths: " + message):
            assert_no_comm(Aggregator.from_jsonl(path, strict=False))
        with pytest.raises(ValueError, match="^paths: " + message):
            load_run(path, strict=False)
        with pytest.raises(ValueError, match="^paths: " + message):
            check_run(path, strict=False)
        if path is not damaged:  # (the views read strictly: a damaged line raises)
            with pytest.raises(ValueError, match="^source: " + message):
                chrome_trace(path)
            with pytest.raises(ValueError, match="^source: " + message):
                write_html_report(path, tmp_path / "report.html")
            assert not (tmp_path / "report.html").exists()
    with pytest.raises(ValueError, match=re.escape("no commspan span in 2 files (2 lines, 2 ")):
        Aggregator.from_jsonl(other, empty, rank="all")
