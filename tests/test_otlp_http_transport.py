"""commspan's plain-HTTP transport for OTLP/HTTP (``PlainHttpTransport``): where it
replaces the SDK's ``requests`` transport, it sends what ``requests`` sends, and the
SDK's client keeps its retries over it (a kept-alive connection the server closed,
statuses to retry). Every endpoint runs on 127.0.0.1 inside the test."""

from __future__ import annotations

import gzip
import http.server
import os
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

    def __init__(self, close_after: bool = False, statuses: tuple[int, ...] = (),
                 answer: Any = None) -> None:
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
                if answer is not None:
                    answer(self)
                    return
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


@pytest.fixture(autouse=True)
def _no_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A CI machine's proxy settings would keep requests for 127.0.0.1.)"""
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY",
                 "all_proxy", "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                 "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent-netrc")


def _plain(endpoint: str, **kwargs: Any) -> Any:
    exporter = otlp_exporter(protocol="http/protobuf", endpoint=endpoint, **kwargs)
    assert exporter.plain_http is True  # type: ignore[attr-defined]
    return exporter


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
    plain = _plain(recorder.endpoint, headers={"x-token": "secret"})
    kept = OTLPSpanExporter(endpoint=recorder.endpoint, headers={"x-token": "secret"},
                            session=requests.Session())
    assert kept.plain_http is False
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
            exporter = _plain(server.endpoint)
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
        exporter = _plain(server.endpoint)
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


def test_a_credential_providers_session_keeps_requests(
    monkeypatch: pytest.MonkeyPatch, recorder: _Recorder, tmp_path: Any,
) -> None:
    """The SDK makes its session from a credential provider (an entry point named by
    OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER) when no session= is given: what
    that session carries (auth) must be sent, so requests is kept."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter as sdk

    def provided(variable: str) -> requests.Session | None:
        if not os.environ.get(variable) and not os.environ.get(
                "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER"):
            return None
        session = requests.Session()
        session.headers["Authorization"] = "Bearer from-provider"
        return session

    # a provider's session that no variable announces: the session alone says
    monkeypatch.setattr(sdk, "_load_session_from_envvar", lambda _variable: _changed())
    exporter = OTLPSpanExporter(endpoint=recorder.endpoint)
    assert exporter.plain_http is False
    exporter.shutdown()
    monkeypatch.setattr(sdk, "_load_session_from_envvar", provided)
    for variable in ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                     "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"):
        monkeypatch.setenv(variable, "provider")
        exporter = OTLPSpanExporter(endpoint=recorder.endpoint)
        assert exporter.plain_http is False
        assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
        assert recorder.got[-1][1].get("authorization") == "Bearer from-provider"
        exporter.shutdown()
        monkeypatch.delenv(variable)
    from commspan.exporters._otlp_http import _pristine

    assert _pristine(requests.Session(), requests) and not _pristine(_changed(), requests)


def _changed() -> requests.Session:
    session = requests.Session()
    session.auth = ("user", "token")
    return session


def test_batches_from_several_threads_take_turns(recorder: _Recorder) -> None:
    """A SimpleSpanProcessor exports from whichever thread ends a span: one connection
    shared without turns sent some batches twice (67-72 requests for 60)."""
    exporter = _plain(recorder.endpoint)
    results: list[SpanExportResult] = []

    def send() -> None:
        for _ in range(10):
            results.append(exporter.export(_spans(1)))

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    exporter.shutdown()
    assert results == [SpanExportResult.SUCCESS] * 60
    assert len(recorder.got) == 60


def test_an_answer_whose_body_breaks_is_not_sent_again() -> None:
    """The status came, then the connection closed before the body's end: the server
    has the batch. As with requests, the batch fails without being sent again (it was
    retried as a connection error: the server got it 6 times)."""
    def short(handler: Any) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "100")
        handler.end_headers()
        handler.wfile.write(b"\x0a\x02")
        handler.wfile.flush()
        handler.close_connection = True

    server = _Recorder(answer=short)
    try:
        exporter = _plain(server.endpoint, timeout_s=5)
        assert exporter.export(_spans(1)) is SpanExportResult.FAILURE
        exporter.shutdown()
    finally:
        server.close()
    assert len(server.got) == 1


def test_an_early_answer_to_a_large_body_is_read() -> None:
    """A server that answers 413 before reading a large body, and closes: the write
    fails (broken pipe), the answer is still read, and the batch fails once with 413
    (it was sent six times, then a timeout)."""
    from opentelemetry.exporter.otlp.common.http import _OTLPHTTPClient

    got: list[int] = []

    class Early(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            got.append(1)
            self.rfile.read(1000)
            self.send_response(413)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Early)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = _OTLPHTTPClient(PlainHttpTransport(),
                                 f"http://127.0.0.1:{server.server_address[1]}/v1/traces",
                                 "spans", timeout=5)
        result = client.export(b"x" * (32 << 20))
    finally:
        server.shutdown()
        server.server_close()
    assert (result.success, result.status_code, len(got)) == (False, 413, 1)


def test_what_the_answer_says_is_read_as_requests_reads_it() -> None:
    """A gzip-encoded answer is decompressed (an OTLP partial success in it is read), a
    repeated header's values are joined, a connection the server says it closes is not
    kept, and a kept one takes each request's timeout."""
    import json as _json

    def gzipped(handler: Any) -> None:
        body = gzip.compress(_json.dumps({"ok": 1}).encode())
        handler.send_response(200)
        handler.send_header("Content-Encoding", "gzip")
        handler.send_header("X-Many", "a")
        handler.send_header("X-Many", "b")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(body)

    server = _Recorder(answer=gzipped)
    try:
        transport = PlainHttpTransport()
        for _ in range(2):
            result = transport.request("POST", server.endpoint, data=b"x", timeout=3.0)
            assert result.error is None and result.json() == {"ok": 1}
            assert result.headers()["x-many"] == "a, b"
    finally:
        server.close()
    assert server.connections == 2  # ("Connection: close": a new one each time)
    kept = _Recorder()
    try:
        transport = PlainHttpTransport()
        for timeout in (3.0, 1.5):
            assert transport.request("POST", kept.endpoint, data=b"x",
                                     timeout=timeout).error is None
            assert transport._conn is not None and transport._conn.sock is not None
            assert transport._conn.sock.gettimeout() == timeout
        transport.close()
    finally:
        kept.close()
    assert kept.connections == 1
