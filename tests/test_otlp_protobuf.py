"""commspan's OTLP/protobuf encoder and the OTLP/HTTP exporter that uses it.

The encoder is checked against the SDK's: for real commspan spans (the tensor
parallel Transformer on the fake process group) and for hand-made spans
covering every field (remote parents, links, trace state, events, every
attribute type, statuses, kinds, dropped counts, several resources and
scopes), the bytes parse with the official ``ExportTraceServiceRequest`` into
a message equal to the SDK's ``encode_spans(spans)``, and are the same bytes
as its ``SerializePartialToString()``. The exporter is checked against an
HTTP endpoint on 127.0.0.1 that keeps what it receives.
"""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Iterator, Sequence
from types import MappingProxyType
from typing import Any

import pytest
import torch
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import trace_exporter as sdk_http
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceState,
)

from commspan import CommSpanMode
from commspan.exporters import _otlp_http, otlp_exporter
from commspan.otlpjson import protobuf
from commspan.otlpjson.protobuf import encode_spans_protobuf
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step


def assert_same_as_sdk(spans: Sequence[ReadableSpan]) -> None:
    """Our bytes parse into the SDK's message, and are its serialization byte for byte."""
    ours = encode_spans_protobuf(spans)
    expected = encode_spans(spans)
    assert ExportTraceServiceRequest.FromString(ours) == expected
    assert ours == expected.SerializePartialToString()


def _provider(resource: Resource | None = None, **limits: int) -> tuple[TracerProvider,
                                                                        InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource or Resource.create({"service.name": "t"}),
                              span_limits=SpanLimits(**limits) if limits else None)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


# every attribute value type, with the edges of each
VALUES: dict[str, Any] = {
    "str": "x",
    "empty": "",
    "unicode": "ünï — 字 🎉",
    "zero": 0,
    "small": 7,
    "negative": -1,
    "negative_large": -(1 << 40),
    "int64_min": -(1 << 63),
    "int64_max": (1 << 63) - 1,
    "large": 123_456_789_012,
    "true": True,
    "false": False,
    "float": 1.5,
    "float_zero": 0.0,
    "float_negative_zero": -0.0,
    "float_inf": float("inf"),
    "float_negative": -2.25e-300,
    "strs": ["a", "", "é"],
    "ints": [1, -1, 1 << 62, 0],
    "bools": [True, False],
    "floats": [0.0, -0.0, 3.5],
    "empty_list": [],
}


# ------------------------------------------------------------------ equivalence
@pytest.fixture(scope="module")
def commspan_steps(fake_pg: None) -> list[list[ReadableSpan]]:
    """The spans of three traced steps of the TP Transformer (checkpointed block), per step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    args = ModelArgs(n_layers=2, checkpoint={1: False})
    model = parallelize(Transformer(args), mesh)
    provider, memory = _provider()
    mode = CommSpanMode(tracer_provider=provider, run_id="protobuf-test")
    steps = []
    with mode:
        for i in range(3):
            with mode.step(i):
                train_step(model, *make_batch(args, seed=i))
            steps.append(list(memory.get_finished_spans()))
            memory.clear()
    mode.shutdown()
    return steps


def test_commspan_spans(commspan_steps: list[list[ReadableSpan]]) -> None:
    """A step's spans (modules, collectives with their events) encode as the SDK encodes
    them, step after step (the later steps from the caches), and all steps at once."""
    assert all(len(step) > 10 for step in commspan_steps)
    assert any(s.events for s in commspan_steps[0]), "the model issues collectives"
    for step in commspan_steps:
        assert_same_as_sdk(step)
    assert_same_as_sdk([s for step in commspan_steps for s in step])


def test_every_field_of_sdk_spans() -> None:
    """Nested and remote parents, links, trace state, events, every attribute type,
    ERROR with and without message, OK, every kind, several resources and scopes."""
    provider, memory = _provider()
    other, other_memory = _provider(Resource.create({"service.name": "other", "rank": 3},
                                                    schema_url="https://schema/r"))
    tracer = provider.get_tracer("commspan", "1.2", schema_url="https://schema/s",
                                 attributes={"scope.attr": "v", "n": 2})
    unversioned = provider.get_tracer("bare")
    remote = SpanContext(0xABC, 0xDEF, is_remote=True,
                         trace_state=TraceState([("k", "v"), ("vendor", "a=b")]))
    local = SpanContext(1 << 127, (1 << 64) - 1, is_remote=False)
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes=VALUES,
                                      start_time=1, links=[Link(remote, {"why": "follows"}),
                                                           Link(local)]) as root:
        root.add_event("no attributes", timestamp=5)
        root.add_event("with attributes", {"a": 1, "b": "two", "c": [1.0, 2.0]})
        with unversioned.start_as_current_span("child", kind=SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
            with tracer.start_as_current_span("grandchild", kind=SpanKind.PRODUCER) as g:
                g.set_status(Status(StatusCode.ERROR))
        with tracer.start_as_current_span("ok", kind=SpanKind.CONSUMER) as ok:
            ok.set_status(Status(StatusCode.OK))
    remote_ctx = trace.set_span_in_context(NonRecordingSpan(remote))
    with tracer.start_as_current_span("remote child", context=remote_ctx):
        pass
    with other.get_tracer("commspan", "1.2").start_as_current_span("other", attributes={"": 1}):
        pass
    with tracer.start_as_current_span("", attributes={"k": "unnamed"}):
        pass
    spans = [*memory.get_finished_spans(), *other_memory.get_finished_spans()]
    # interleave the resources and scopes: the grouping keeps first-seen order
    spans = spans[::2] + spans[1::2]
    assert_same_as_sdk(spans)
    for span in spans:
        assert_same_as_sdk([span])


def test_equal_resources_and_scopes_group_together() -> None:
    """Distinct but equal resource and scope objects share a group, as in the SDK."""
    res = [Resource({"service.name": "a"}), Resource({"service.name": "a"}),
           Resource({"service.name": "b"})]
    scopes = [InstrumentationScope("s", "1"), InstrumentationScope("s", "1"),
              InstrumentationScope("s", "2", attributes={"x": 1}), None]
    spans = [
        ReadableSpan(f"s{i}", SpanContext(9, i + 1, False), resource=res[i % 3],
                     instrumentation_scope=scopes[i % 4], start_time=i, end_time=i + 1)
        for i in range(24)
    ]
    assert_same_as_sdk(spans)
    decoded = ExportTraceServiceRequest.FromString(encode_spans_protobuf(spans))
    assert len(decoded.resource_spans) == 2
    assert [len(r.scope_spans) for r in decoded.resource_spans] == [3, 3]


def test_dropped_counts() -> None:
    """Attributes, events, links and their attributes beyond the limits are counted."""
    provider, memory = _provider(max_span_attributes=2, max_events=1, max_links=1,
                                 max_event_attributes=1, max_link_attributes=1)
    tracer = provider.get_tracer("t")
    link = SpanContext(3, 4, False)
    with tracer.start_as_current_span(
        "limited", attributes={"a": 1, "b": 2, "c": 3},
        links=[Link(link, {"x": 1, "y": 2}), Link(link)],
    ) as span:
        span.add_event("e1", {"p": 1, "q": 2})
        span.add_event("e2")
    (limited,) = memory.get_finished_spans()
    assert limited.dropped_attributes and limited.dropped_events and limited.dropped_links
    assert_same_as_sdk([limited])


class _PropertiesOnly:
    """A span-like object with only ReadableSpan's public properties."""

    def __init__(self, span: ReadableSpan) -> None:
        self._wrapped = span

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def get_span_context(self) -> Any:
        return self._wrapped.get_span_context()


def test_hand_made_readable_spans() -> None:
    """ReadableSpans built directly: plain dicts, None attributes, bytes, mappings and None
    in values, no times; and span-like objects read through their public properties."""
    ctx = SpanContext(5, 6, False)
    spans = [
        ReadableSpan("plain", ctx, attributes={"b": b"\x00\xff", "none": None,
                                               "with_none": ("a", None), "map": {"k": [1, 2]},
                                               "nested": [[1], [2]], "tuple": (1, 2)}),
        ReadableSpan("no attributes", ctx, parent=SpanContext(5, 7, True), attributes=None,
                     events=(Event("e", None, timestamp=0), Event("f", {"x": "y"}, 3)),
                     kind=SpanKind.CONSUMER, status=Status(StatusCode.ERROR, "é"),
                     start_time=10, end_time=0),
        ReadableSpan("links only", ctx, links=(Link(SpanContext(1, 2, True), None),),
                     attributes=MappingProxyType({"m": 1}), start_time=None, end_time=20),
    ]
    assert_same_as_sdk(spans)
    assert_same_as_sdk([_PropertiesOnly(s) for s in spans])  # type: ignore[misc]


def test_attributes_the_sdk_cannot_encode_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    """Ints outside int64 and values of other types are dropped, the rest encoded."""
    ctx = SpanContext(5, 6, False)
    attrs = {"ok": 1, "too big": 1 << 64, "too small": -(1 << 63) - 1, "object": object(),
             "bad in array": [1, object()], "last": "kept"}
    span = ReadableSpan("s", ctx, attributes=attrs)
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # the SDK logs tracebacks
    try:
        with caplog.at_level(logging.WARNING, logger=protobuf.__name__):
            assert_same_as_sdk([span])
    finally:
        logging.getLogger("opentelemetry").setLevel(logging.NOTSET)
    decoded = ExportTraceServiceRequest.FromString(encode_spans_protobuf([span]))
    keys = [kv.key for kv in decoded.resource_spans[0].scope_spans[0].spans[0].attributes]
    assert keys == ["ok", "last"]
    assert sum("Failed to encode attribute" in r.getMessage() for r in caplog.records) >= 4


def _text_cases(bad: str) -> list[ReadableSpan]:
    """Spans with ``bad`` wherever text goes: name, status message, event name, attribute
    keys and values (arrays too), resource, scope."""
    ctx = SpanContext(5, 6, False)
    resource = Resource({"service.name": f"trainer{bad}", f"k{bad}": 1}, f"https://r{bad}")
    scope = InstrumentationScope(f"lib{bad}", f"1{bad}", f"https://s{bad}", {"sa": f"x{bad}"})
    return [
        ReadableSpan("fine", ctx, attributes={"a": 1}),
        ReadableSpan(f"head{bad}", ctx, attributes={"m": f"head{bad}", f"k{bad}": (f"a{bad}", "b")},
                     status=Status(StatusCode.ERROR, f"cannot open shard-{bad}.bin"),
                     events=(Event(f"e{bad}", {"v": f"v{bad}"}, timestamp=3),)),
        ReadableSpan("other resource", ctx, resource=resource, instrumentation_scope=scope),
    ]


def test_text_utf8_cannot_encode_is_written_with_replacement() -> None:
    """A lone surrogate (a file name from a non-UTF-8 file system in an exception message, a
    module name) costs neither the span nor its batch: the bytes are the SDK's encoding of
    the same spans with U+FFFD there, as the OTLP/JSON encoder writes them."""
    ours = encode_spans_protobuf(_text_cases("\udcff"))
    assert ours == encode_spans(_text_cases("\ufffd")).SerializePartialToString()


def test_an_unencodable_span_raises() -> None:
    """A span the SDK cannot encode either (an unknown kind, no context) raises."""
    span = ReadableSpan("s", SpanContext(1, 2, False), kind="not a kind")  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        encode_spans(span_list := [span])
    with pytest.raises(KeyError):
        encode_spans_protobuf(span_list)
    no_context = [ReadableSpan("s")]
    with pytest.raises(AttributeError):
        encode_spans(no_context)
    with pytest.raises(ValueError, match="has no SpanContext"):
        encode_spans_protobuf(no_context)


def test_caches_stay_bounded_and_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past their bounds the caches are cleared and the output stays right: with the real
    bounds (more distinct entries than they hold) and with tiny ones (cleared constantly)."""
    ctx = SpanContext(1, 2, False)

    def batch(n: int, width: int, salt: str) -> list[ReadableSpan]:
        return [
            ReadableSpan(f"{salt}{i}", SpanContext(i + 1, i + 1, False), parent=ctx,
                         attributes={f"{salt}k{j}": f"{salt}v{i}.{j}" if j % 2 else i * width + j
                                     for j in range(width)})
            for i in range(n)
        ]

    distinct = protobuf._CACHE_MAX + 100
    spans = batch(distinct // 32 + 1, 32, "a")
    assert_same_as_sdk(spans)
    assert len(protobuf._ENTRY_CACHE) <= protobuf._CACHE_MAX
    assert len(protobuf._BLOBS) <= protobuf._BLOBS_MAX
    assert len(protobuf._TRACE_IDS) <= 256
    assert_same_as_sdk(spans[:50])  # the first spans' entries were evicted meanwhile

    monkeypatch.setattr(protobuf, "_CACHE_MAX", 3)
    monkeypatch.setattr(protobuf, "_BLOBS_MAX", 2)
    small = batch(20, 6, "b")
    for _ in range(3):
        assert_same_as_sdk(small)
        assert len(protobuf._ENTRY_CACHE) <= 3 and len(protobuf._KEY_CACHE) <= 3
        assert len(protobuf._BLOBS) <= 2 and len(protobuf._NAMES) <= 3


def test_cache_keys_tell_bools_ints_and_floats_apart() -> None:
    """``True == 1 == 1.0`` and ``0.0 == -0.0``: the caches still encode each as its type."""
    ctx = SpanContext(1, 2, False)
    values = [1, True, 1.0, 0, False, 0.0, -0.0, [1, 0], [True, False], [1.0, 0.0],
              [-0.0], (1,), (True,), ("1",)]
    spans = [ReadableSpan("s", ctx, attributes={"k": v, "s": "x"}) for v in values]
    for _ in range(2):  # the second time from the caches
        for span in spans:
            assert_same_as_sdk([span])


# ------------------------------------------------------------------ the exporter
class _Endpoint:
    """An OTLP/HTTP endpoint on 127.0.0.1 answering ``status`` (200) and keeping every
    body."""

    def __init__(self) -> None:
        owner = self
        self.bodies: list[bytes] = []
        self.status = 200

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                owner.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(owner.status)
                if owner.status != 200:
                    self.send_header("Location", "https://elsewhere.example/v1/traces")
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                """Quiet."""

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture()
def endpoint() -> Iterator[_Endpoint]:
    server = _Endpoint()
    yield server
    server.close()


def _some_spans() -> list[ReadableSpan]:
    provider, memory = _provider()
    with provider.get_tracer("t").start_as_current_span("parent", attributes=VALUES):
        with provider.get_tracer("t").start_as_current_span("child"):
            pass
    return list(memory.get_finished_spans())


def test_http_exporter_sends_what_the_sdk_would(endpoint: _Endpoint) -> None:
    """otlp_exporter('http/protobuf') is the SDK's exporter with the fast encoder: the body
    it posts is the SDK's encoding of the batch."""
    exporter = otlp_exporter(protocol="http/protobuf", endpoint=endpoint.url)
    assert isinstance(exporter, sdk_http.OTLPSpanExporter)
    assert isinstance(exporter, _otlp_http.OTLPSpanExporter) and exporter.fast_encoding
    spans = _some_spans()
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert endpoint.bodies == [encode_spans(spans).SerializePartialToString()]
    assert exporter.export(spans) is SpanExportResult.FAILURE  # after shutdown, as the SDK


def test_grpc_stays_the_sdk_exporter() -> None:
    """gRPC is the SDK's own exporter."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter = otlp_exporter(protocol="grpc", endpoint="127.0.0.1:4317", insecure=True)
    assert type(exporter) is OTLPSpanExporter
    exporter.shutdown()


def test_encoding_failure_fails_the_batch_and_is_counted(
    endpoint: _Endpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception while encoding fails the export (logged as the SDK logs it, nothing
    sent); under a mode the step goes on and the spans count as failed."""

    def broken(spans: Sequence[ReadableSpan]) -> bytes:
        raise RuntimeError("encoder bug")

    monkeypatch.setattr(_otlp_http, "encode_spans_protobuf", broken)
    exporter = otlp_exporter(protocol="http/protobuf", endpoint=endpoint.url)
    with caplog.at_level(logging.ERROR):
        assert exporter.export(_some_spans()) is SpanExportResult.FAILURE
    assert any("Failed to encode span batch: encoder bug" in r.getMessage()
               for r in caplog.records)

    model = torch.nn.Linear(4, 4)
    mode = CommSpanMode(exporters=[exporter], run_id="protobuf-failure")
    with mode:
        for i in range(2):
            with mode.step(i):
                model(torch.randn(2, 4)).sum().backward()
    mode.shutdown()
    stats = mode.stats()
    assert stats["spans"] > 0 and stats["spans_failed"] == stats["spans"], stats
    assert endpoint.bodies == []


def test_one_span_with_text_utf8_cannot_encode_costs_not_its_batch(endpoint: _Endpoint) -> None:
    """A span whose status message holds a lone surrogate: the whole batch is sent and
    succeeds (it failed), that message with U+FFFD."""
    exporter = otlp_exporter(protocol="http/protobuf", endpoint=endpoint.url)
    assert exporter.export(_text_cases("\udcff")) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert endpoint.bodies == [encode_spans(_text_cases("\ufffd")).SerializePartialToString()]


def test_request_size_limit(endpoint: _Endpoint) -> None:
    """A batch over max_request_size is dropped before sending, as the SDK does."""
    exporter = _otlp_http.OTLPSpanExporter(endpoint=endpoint.url, max_request_size=10)
    assert exporter.export(_some_spans()) is SpanExportResult.FAILURE
    assert endpoint.bodies == []


def test_falls_back_to_the_sdk_export_when_members_are_missing(
    endpoint: _Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SDK without a member the fast path uses (simulated) gets the SDK's own export."""
    exporter = _otlp_http.OTLPSpanExporter(endpoint=endpoint.url)
    del exporter._metrics
    assert exporter._missing() == ["_metrics.export_operation"]

    monkeypatch.setattr(_otlp_http, "_SDK_NAMES",
                        (*_otlp_http._SDK_NAMES, "_not_in_this_version"))

    def unused(spans: Sequence[ReadableSpan]) -> bytes:
        raise AssertionError("the fallback must not use commspan's encoder")

    monkeypatch.setattr(_otlp_http, "encode_spans_protobuf", unused)
    fallback = otlp_exporter(protocol="http/protobuf", endpoint=endpoint.url)
    assert isinstance(fallback, sdk_http.OTLPSpanExporter) and not fallback.fast_encoding
    spans = _some_spans()
    assert fallback.export(spans) is SpanExportResult.SUCCESS
    assert endpoint.bodies == [encode_spans(spans).SerializePartialToString()]


def test_a_redirect_fails_the_export_on_the_fast_path_and_the_sdks(
    endpoint: _Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP 308 (which the SDK's client counts as success, following no redirect) fails
    the export, whether commspan's encoder or the SDK's own export sent it."""
    endpoint.status = 308
    fast = otlp_exporter(protocol="http/protobuf", endpoint=endpoint.url)
    assert fast.fast_encoding and fast.export(_some_spans()) is SpanExportResult.FAILURE
    monkeypatch.setattr(_otlp_http, "_SDK_NAMES",
                        (*_otlp_http._SDK_NAMES, "_not_in_this_version"))
    fallback = otlp_exporter(protocol="http/protobuf", endpoint=endpoint.url)
    assert not fallback.fast_encoding
    assert fallback.export(_some_spans()) is SpanExportResult.FAILURE
    assert len(endpoint.bodies) == 2
