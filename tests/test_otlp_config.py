"""otlp_exporter() configuration: a malformed endpoint is a ValueError at creation that
names its source (argument or variable), shows the value with credentials masked and
the fix; credentials in an endpoint never reach a log line or an error message."""

from __future__ import annotations

import http.server
import logging
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from commspan import CommSpanMode
from commspan.exporters import otlp_exporter

SECRET = "s3cr3t-t0ken"
_ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTLP variables from the machine running the tests."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------ malformed endpoints
@pytest.mark.parametrize(
    ("protocol", "endpoint", "problem", "fix"),
    [
        ("http/protobuf", "localhost:4318", "it has no scheme",
         "http://localhost:4318/v1/traces"),
        ("http/protobuf", "http//x", "its scheme lacks the ':'", "http://x/v1/traces"),
        ("http/protobuf", "http://h:99999/v1/traces", "the port '99999' is not a number from 1 "
         "to 65535", "http://h:4318/v1/traces"),
        ("http/protobuf", "http://h:http/v1/traces", "the port 'http' is not a number",
         "http://h:4318/v1/traces"),
        ("http/protobuf", "ftp://h:4318/v1/traces", "the scheme 'ftp' is not supported",
         "http://h:4318/v1/traces"),
        ("http/protobuf", "http://:4319/v1/traces", "it names no host",
         "http://localhost:4319/v1/traces"),
        ("grpc", "localhost:99999", "the port '99999'", "localhost:4317"),
        ("grpc", "grpc://h:4317", "the scheme 'grpc' is not supported", "http://h:4317"),
        ("grpc", "localhost:4317/v1/traces", "a gRPC address is host:port, without a path",
         "localhost:4317"),
        ("grpc", "http//h:4317", "its scheme lacks the ':'", "http://h:4317"),
    ],
)
def test_malformed_endpoint_argument(protocol: str, endpoint: str, problem: str, fix: str) -> None:
    """A malformed endpoint= fails at creation naming the argument, the value and the fix."""
    with pytest.raises(ValueError) as info:
        otlp_exporter(protocol=protocol, endpoint=endpoint)
    msg = str(info.value)
    kind = "OTLP/gRPC" if protocol == "grpc" else "OTLP/HTTP"
    assert msg.startswith(f"endpoint={endpoint!r} is not a valid {kind} endpoint: {problem}")
    assert msg.endswith(f"; pass endpoint={fix!r}")


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318",
         "OTEL_EXPORTER_OTLP_ENDPOINT='localhost:4318' (environment variable) is not a valid "
         "OTLP/HTTP endpoint: it has no scheme; set OTEL_EXPORTER_OTLP_ENDPOINT="
         "http://localhost:4318"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4318",
         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT='collector:4318' (environment variable) is not a "
         "valid OTLP/HTTP endpoint: it has no scheme; set OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="
         "http://collector:4318/v1/traces"),
    ],
)
def test_malformed_endpoint_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    """A malformed variable is named as the variable, with the value to set instead."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as info:
        otlp_exporter()
    assert str(info.value) == expected


def test_endpoint_sources_follow_the_sdk_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The argument beats ..._TRACES_ENDPOINT, which beats OTEL_EXPORTER_OTLP_ENDPOINT; an
    empty value counts as unset; only the one that will be used is checked."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "bad:99999")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://ok:4318/v1/traces")
    otlp_exporter()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    with pytest.raises(ValueError, match="^OTEL_EXPORTER_OTLP_ENDPOINT='bad:99999'"):
        otlp_exporter()
    with pytest.raises(ValueError, match="^OTEL_EXPORTER_OTLP_ENDPOINT='bad:99999'"):
        otlp_exporter(endpoint="")
    otlp_exporter(endpoint="http://ok:4318/v1/traces")
    with pytest.raises(ValueError, match="^OTEL_EXPORTER_OTLP_ENDPOINT='bad:99999' .* OTLP/gRPC"):
        otlp_exporter(protocol="grpc")


@pytest.mark.parametrize(
    ("protocol", "endpoint"),
    [
        ("http/protobuf", "http://127.0.0.1:4318/v1/traces"),
        ("http/protobuf", "https://collector.example:443/otlp/v1/traces"),
        ("http/protobuf", "http://[::1]:4318/v1/traces"),
        ("http/protobuf", f"https://user:{SECRET}@collector.example/v1/traces"),
        ("http/protobuf", "HTTP://127.0.0.1:4318/v1/traces"),
        ("grpc", "localhost:4317"),
        ("grpc", "http://localhost:4317"),
        ("grpc", "https://collector.example:4317"),
        ("grpc", "[::1]:4317"),
        ("grpc", "unix:///tmp/otlp.sock"),
    ],
)
def test_valid_endpoints_are_accepted(protocol: str, endpoint: str) -> None:
    """Well-formed addresses of either protocol create an exporter."""
    assert type(otlp_exporter(protocol=protocol, endpoint=endpoint)).__name__ == "OTLPSpanExporter"


def test_protocol_error_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsupported protocol names the variable it came from, or the argument."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match=r"^OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' "
                       r"\(environment variable\) is not supported; use one of 'grpc', "
                       r"'http/protobuf'$"):
        otlp_exporter()
    with pytest.raises(ValueError, match=r"^protocol='thrift' is not supported"):
        otlp_exporter(protocol="thrift")


# ------------------------------------------------------------------ credentials
def test_mask_credentials() -> None:
    """user:password and query values become ***; the rest of the address stays readable."""
    from commspan.exporters.otlp import _mask_credentials

    assert _mask_credentials(f"http://user:{SECRET}@h:4318/v1/traces") == (
        "http://***@h:4318/v1/traces")
    assert _mask_credentials(f"http://u:p@{SECRET}@h/x?token={SECRET}&flag#f") == (
        "http://***@h/x?token=***&***#f")
    assert _mask_credentials(f"http//u:{SECRET}@h") == "http//***@h"
    assert _mask_credentials(f"u:{SECRET}@h:4317") == "***@h:4317"
    assert _mask_credentials(f"http://u:{SECRET}?x@h/v1") == "http://***@h/v1"  # unencoded ?
    assert _mask_credentials("http://h:4318/v1/traces") == "http://h:4318/v1/traces"


@pytest.mark.parametrize(
    ("protocol", "endpoint"),
    [
        ("http/protobuf", f"http://user:{SECRET}@h:99999/v1/traces"),
        ("http/protobuf", f"http//user:{SECRET}@h/v1/traces"),
        ("http/protobuf", f"ftp://user:{SECRET}@h/v1/traces?key={SECRET}"),
        ("grpc", f"http://user:{SECRET}@127.0.0.1:4317"),
        ("grpc", f"user:{SECRET}@127.0.0.1:4317"),
    ],
)
def test_credentials_never_in_errors_or_logs(
    protocol: str, endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A rejected endpoint with credentials shows them masked (a gRPC address takes none)."""
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ValueError) as info:
        otlp_exporter(protocol=protocol, endpoint=endpoint, timeout_s=0.5)
    assert SECRET not in str(info.value)
    assert "***@" in str(info.value)
    assert SECRET not in caplog.text


def test_credentials_in_an_env_endpoint_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same holds for a value from a variable, in the value and in the suggested fix."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://u:{SECRET}@h:0/v1/traces")
    with pytest.raises(ValueError) as info:
        otlp_exporter()
    assert SECRET not in str(info.value)
    assert str(info.value).endswith("set OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="
                                    "http://***@h:4318/v1/traces")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every POST with 401 and echoes nothing of the request."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(401)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def refusing_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(2)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("where", ["closed", "refusing"])
def test_failed_exports_never_log_credentials(
    where: str, refusing_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Exports to a closed port or a 401 server fail and are counted; no log line (commspan's,
    the SDK's, urllib3's, at DEBUG) carries the URL's credentials."""
    caplog.set_level(logging.DEBUG)
    port = refusing_port if where == "refusing" else _closed_port()
    exporter = otlp_exporter(endpoint=f"http://user:{SECRET}@127.0.0.1:{port}/v1/traces",
                             timeout_s=1.0)
    mode = CommSpanMode(exporters=[exporter], flush_timeout_s=5.0)
    with mode:
        torch.nn.ReLU()(torch.ones(1))
    mode.shutdown(5.0)
    stats = mode.stats()
    assert stats["spans_failed"] == stats["spans"] > 0
    assert "commspan: OTLPSpanExporter.export" in caplog.text  # the loss was logged ...
    assert SECRET not in caplog.text  # ... without the secret


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_TIMEOUT",
                                      "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"])
@pytest.mark.parametrize("value", ["0", "-5", "ten", "10s", "inf"])
def test_a_timeout_variable_that_is_not_a_positive_number_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """The SDK accepts 0 and negative timeouts, then fails every export; commspan
    refuses them when the exporter is made, naming the variable, its value and the
    fix. ``timeout_s=`` overrides the variable."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}='{value}' is not valid.*timeout_s=10"):
        otlp_exporter(endpoint="http://127.0.0.1:4318/v1/traces")
    assert otlp_exporter(endpoint="http://127.0.0.1:4318/v1/traces", timeout_s=3) is not None
    monkeypatch.setenv(variable, "2.5")
    assert otlp_exporter(endpoint="http://127.0.0.1:4318/v1/traces") is not None
