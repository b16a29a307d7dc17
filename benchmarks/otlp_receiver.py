"""A tiny OTLP/HTTP receiver on 127.0.0.1: accepts ``POST /v1/traces``, answers 200.

It stands in for a local OpenTelemetry Collector so the OTLP variant pays
the whole client side (protobuf encoding, HTTP) without any network beyond
loopback. It does not decode the payload; it counts requests and bytes.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["OtlpReceiver"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector would
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        length = int(self.headers.get("Content-Length", "0") or 0)
        remaining = length
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                break
            remaining -= len(chunk)
        ok = self.path.rstrip("/") == "/v1/traces"
        self.server.count(length - remaining, ok)
        # an empty ExportTraceServiceResponse is an empty protobuf message
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.requests = 0
        self.bytes = 0
        self.rejected = 0

    def count(self, nbytes: int, ok: bool) -> None:
        with self.lock:
            if ok:
                self.requests += 1
                self.bytes += nbytes
            else:
                self.rejected += 1


class OtlpReceiver:
    """Context manager running the receiver in a daemon thread.

    Example:
        >>> with OtlpReceiver() as rx:
        ...     rx.endpoint.startswith("http://127.0.0.1:")
        True
    """

    def __init__(self) -> None:
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "the receiver is not running"
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def stats(self) -> dict[str, int]:
        s = self._server
        if s is None:
            return {"requests": 0, "bytes": 0, "rejected": 0}
        with s.lock:
            return {"requests": s.requests, "bytes": s.bytes, "rejected": s.rejected}

    def __enter__(self) -> OtlpReceiver:
        self._server = _Server()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
