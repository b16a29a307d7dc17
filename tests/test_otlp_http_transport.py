"""commspan's plain-HTTP transport for OTLP/HTTP (``PlainHttpTransport``): where it
replaces the SDK's ``requests`` transport, it sends what ``requests`` sends, and the
SDK's client keeps its retries over it (a kept-alive connection the server closed,
statuses to retry). Every endpoint runs on 127.0.0.1 inside the test."""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commspan.exporters import otlp_exporter
from commspan.exporters._otlp_http import OTLPSpanExporter, PlainHttpTransport


class _Recorder:
    """An OTLP/HTTP stand-in keeping every request (path, headers, body). ``close_after``:
    it closes each connection after answering, without saying so (a collector's idle
    timeout): the next request on that connection finds it closed. ``statuses``: the
    statuses of the first answers (then 200)."""

    def __init__(self, close_after: bool = False, statuses: tuple[int, ...] = ()) -> None:
        owner = self
        self.got: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0
        self._statuses = list(statuses)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                owner.connections += 1

            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                owner.got.append((self.path, {k.lower(): v for k, v in self.headers.items()},
                                  body))
                status = owner._statuses.pop(0) if owner._statuses else 200
                self.send_response(status)
                if status == 503:
                    self.send_header("Retry-After", "0")
                self.send_header("Content-Length", "0")
                self.end_headers()
                if close_after:
                    self.close_connection = True  # (no "Connection: close" said)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@pytest.fixture()
def recorder() -> Iterator[_Recorder]:
    rec = _Recorder()
    yield rec
    rec.close()


def _spans(n: int = 3) -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in range(n):
        with tracer.start_as_current_span(f"span-{i}", attributes={"i": i}):
            pass
    return list(memory.get_finished_spans())


def test_a_plain_http_endpoint_gets_what_requests_sends(
    recorder: _Recorder, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same path, body (compressed as asked) and the SDK's headers (content type,
    encoding, user agent, the user's) as through the SDK's ``requests`` transport."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    spans = _spans()
    plain = otlp_exporter(protocol="http/protobuf", endpoint=recorder.endpoint,
                          headers={"x-token": "secret"})
    kept = OTLPSpanExporter(endpoint=recorder.endpoint, headers={"x-token": "secret"},
                            session=requests.Session())
    assert (plain.plain_http, kept.plain_http) == (True, False)  # type: ignore[attr-defined]
    assert plain.export(spans) is kept.export(spans) is SpanExportResult.SUCCESS
    (path_a, head_a, body_a), (path_b, head_b, body_b) = recorder.got
    assert path_a == path_b == "/v1/traces"
    assert gzip.decompress(body_a) == gzip.decompress(body_b) != b""
    for name in ("content-type", "content-encoding", "user-agent", "x-token", "host"):
        assert head_a.get(name) == head_b.get(name) is not None, name
    plain.shutdown()
    kept.shutdown()


def test_one_connection_is_kept_and_one_the_server_closed_is_made_again() -> None:
    """Batches share one connection; when the server closes it between batches (its
    idle timeout), the next batch is sent once on a new one (the SDK client's immediate
    retry after a connection error), not lost nor sent twice."""
    for close_after, connections in ((False, 1), (True, 4)):
        server = _Recorder(close_after=close_after)
        try:
            exporter = otlp_exporter(protocol="http/protobuf", endpoint=server.endpoint)
            results = [exporter.export(_spans(1)) for _ in range(4)]
            exporter.shutdown()
        finally:
            server.close()
        assert results == [SpanExportResult.SUCCESS] * 4, close_after
        assert len(server.got) == 4, close_after  # (none sent twice)
        assert server.connections == connections, close_after


def test_statuses_to_retry_are_retried_over_it() -> None:
    """503 (with Retry-After: 0) then 200: the SDK's client retries over the plain
    transport, and the batch is delivered."""
    server = _Recorder(statuses=(503, 503))
    try:
        exporter = otlp_exporter(protocol="http/protobuf", endpoint=server.endpoint)
        assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
        exporter.shutdown()
    finally:
        server.close()
    assert len(server.got) == 3


@pytest.mark.parametrize(("endpoint", "env"), [
    ("https://127.0.0.1:4318/v1/traces", {}),  # (TLS: requests verifies certificates)
    ("http://user:token@127.0.0.1:4318/v1/traces", {}),  # (basic auth from the URL)
    ("http://collector:4318/v1/traces", {"HTTP_PROXY": "http://proxy:3128"}),
    ("http://collector:4318/v1/traces", {"http_proxy": "http://proxy:3128",
                                         "NO_PROXY": "other"}),
])
def test_requests_is_kept_where_it_would_change_the_request(
    endpoint: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    exporter = otlp_exporter(protocol="http/protobuf", endpoint=endpoint)
    assert exporter.plain_http is False  # type: ignore[attr-defined]
    assert type(exporter._client._transport._inner).__name__ == (  # type: ignore[attr-defined]
        "RequestsHTTPTransport")
    # a host the proxy settings leave out gets the plain transport
    if env:
        monkeypatch.setenv("NO_PROXY", "collector")
        assert otlp_exporter(protocol="http/protobuf",
                             endpoint=endpoint).plain_http is True  # type: ignore[attr-defined]


def test_an_endpoint_that_refuses_is_a_connection_error() -> None:
    """Nothing listening: the result carries the error, which the SDK's client takes
    for a connection error (retried, then the batch fails)."""
    transport = PlainHttpTransport()
    result = transport.request("POST", "http://127.0.0.1:9/v1/traces", data=b"x",
                               timeout=1.0)
    assert result.status_code is None and transport.is_connection_error(result.error)
    transport.close()
