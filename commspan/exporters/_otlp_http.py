"""The SDK's OTLP/HTTP span exporter with commspan's protobuf encoder.

:class:`OTLPSpanExporter` is the SDK's ``OTLPSpanExporter``
(``opentelemetry-exporter-otlp-proto-http``) whose ``export`` encodes the batch
with :func:`commspan.otlpjson.protobuf.encode_spans_protobuf` (the same bytes,
several times faster) and otherwise does what the SDK's does: the shutdown
check, the exporter's metrics operation, the ``max_request_size`` check, the
POST through the SDK's HTTP client (its retries, timeout, compression and
headers) and the result, except that a redirect (HTTP 3xx: the client follows
none, and the SDK counts it a success) fails the batch, with an error logged
naming the endpoint, the status and the ``Location``. Those steps use the SDK
exporter's private members; when an installed SDK version does not have them
all, the exporter says so at debug level and exports through the SDK's own
``export`` instead.

Imported only when an OTLP/HTTP exporter is created (it imports the SDK's
HTTP exporter and ``requests``).

Example:
    >>> from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    ...     OTLPSpanExporter as SdkExporter)
    >>> exporter = OTLPSpanExporter(endpoint="http://127.0.0.1:4318/v1/traces")
    >>> isinstance(exporter, SdkExporter), exporter.fast_encoding
    (True, True)
"""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.http import trace_exporter as _sdk
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from commspan._errors import Once
from commspan.exporters.otlp import _mask_credentials
from commspan.otlpjson.protobuf import encode_spans_protobuf

__all__ = ["OTLPSpanExporter", "PlainHttpTransport"]

_logger = logging.getLogger(__name__)

# What export() uses from the SDK's module, looked up once: absent in some versions
_SDK_NAMES = ("_logger", "_is_request_too_large", "RequestPayloadTooLargeError",
              "HTTP_RESPONSE_STATUS_CODE")


class OTLPSpanExporter(_sdk.OTLPSpanExporter):
    """The SDK's OTLP/HTTP ``OTLPSpanExporter``, encoding with commspan's encoder.

    Takes the SDK exporter's arguments. :attr:`fast_encoding` says whether the
    installed SDK has what the fast path needs; if not, ``export`` is the SDK's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: whether batches go through commspan's :class:`PlainHttpTransport` (a plain
        #: ``http://`` endpoint with no proxy, session or credentials in the URL) instead of
        #: the SDK's ``requests`` transport
        self.plain_http = PlainHttpTransport.install(self, "session" in kwargs or args)
        self._rejected = 0
        self._rejected_message = ""
        self._redirects = Once()  # redirect answers logged: one line per status and target
        self._watch = _LastResponse.install(self)
        missing = self._missing()
        #: whether ``export`` uses commspan's encoder (else it is the SDK's ``export``)
        self.fast_encoding = not missing
        if missing:
            _logger.debug(
                "this opentelemetry-exporter-otlp-proto-http lacks %s: OTLP/HTTP batches "
                "are encoded by the SDK", ", ".join(missing))

    def _missing(self) -> list[str]:
        """The members of the SDK exporter (and its module) ``export`` relies on that are absent."""
        missing = [name for name in _SDK_NAMES if not hasattr(_sdk, name)]
        client = getattr(self, "_client", None)
        if not callable(getattr(client, "export", None)):
            missing.append("_client.export")
        if not callable(getattr(getattr(self, "_metrics", None), "export_operation", None)):
            missing.append("_metrics.export_operation")
        if not isinstance(getattr(self, "_max_request_size", None), int):
            missing.append("_max_request_size")
        if not isinstance(getattr(self, "_shutdown", None), bool):
            missing.append("_shutdown")
        return missing

    def take_rejected(self) -> tuple[int, str]:
        """The spans the backend said it rejected (OTLP partial success) since the last
        call, and its message; the export queue counts them as failed."""
        out = (self._rejected, self._rejected_message)
        self._rejected, self._rejected_message = 0, ""
        return out

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export ``spans`` as the SDK does, encoded by commspan's encoder; a response
        that rejects some spans (OTLP partial success) is remembered for
        :meth:`take_rejected`."""
        watch = self._watch
        if watch is not None:
            watch.last = None
        result = self._export(spans)
        if result is SpanExportResult.SUCCESS and watch is not None and watch.last is not None:
            status = getattr(watch.last, "status_code", None)
            if _is_redirect(status):  # the SDK's own export (no fast encoding) took it
                self._redirected(status, len(spans))
                return SpanExportResult.FAILURE
            self._note_partial_success(watch.last)
        return result

    def _redirected(self, status: int | None, n: int) -> Exception:
        """Log (once per status and target) that the endpoint answered a redirect: the
        SDK's client follows none and counts any status below 400 as success, but
        nothing was delivered. Returns the error for the exporter's metrics."""
        location = "(no Location header)"
        watch = self._watch
        try:
            if watch is not None and watch.last is not None:
                location = watch.last.headers().get("location") or location
        except Exception:  # headers a transport cannot give: the message says less
            pass
        endpoint = _mask_credentials(str(getattr(self, "_endpoint", "?")))
        location = _mask_credentials(str(location))
        message = (f"the OTLP/HTTP endpoint {endpoint} answered HTTP {status} (a redirect "
                   f"to {location}): the batch was not delivered")
        if self._redirects.first(f"{status}\0{location}"):
            _logger.error(
                "commspan: %s (%d spans failed; OTLP exporters follow no redirect, so every "
                "batch sent there fails): set endpoint= (or "
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) to the URL it redirects to", message, n)
        return RuntimeError(message)

    def _note_partial_success(self, response: Any) -> None:
        try:
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                ExportTraceServiceResponse,
            )

            body = response.content()
            if not body:
                return
            partial = ExportTraceServiceResponse.FromString(body).partial_success
        except Exception:  # a body that is not the response message: nothing to say
            return
        if partial.rejected_spans > 0:
            self._rejected += int(partial.rejected_spans)
            self._rejected_message = str(partial.error_message)

    def _export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self.fast_encoding:
            return super().export(spans)
        log = _sdk._logger
        if self._shutdown:
            log.warning("Exporter already shutdown, ignoring batch")
            return SpanExportResult.FAILURE

        with self._metrics.export_operation(len(spans)) as result:
            try:
                serialized_data = encode_spans_protobuf(spans)
            except Exception as error:  # as the SDK: the batch fails, training goes on
                log.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE

            if _sdk._is_request_too_large(serialized_data, self._max_request_size):
                log.warning(
                    "Dropping span batch: serialized size %d bytes exceeds max_request_size "
                    "%d bytes.",
                    len(serialized_data),
                    self._max_request_size,
                )
                result.error = _sdk.RequestPayloadTooLargeError(
                    f"Serialized span request size {len(serialized_data)} "
                    f"bytes exceeds max_request_size "
                    f"{self._max_request_size} bytes."
                )
                return SpanExportResult.FAILURE

            export_result = self._client.export(serialized_data)
            if export_result.success and _is_redirect(export_result.status_code):
                result.error = self._redirected(export_result.status_code, len(spans))
                result.error_attrs = {_sdk.HTTP_RESPONSE_STATUS_CODE: export_result.status_code}
                return SpanExportResult.FAILURE
            if not export_result.success:
                result.error = export_result.error
                result.error_attrs = (
                    {_sdk.HTTP_RESPONSE_STATUS_CODE: export_result.status_code}
                    if export_result.status_code is not None
                    else None
                )
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


def _is_redirect(status: int | None) -> bool:
    """Whether ``status`` is a 3xx answer, which the SDK's client counts as success
    (OTLP/HTTP's success is 200; what a redirect points to was never sent the batch)."""
    return status is not None and 300 <= status < 400


class _LastResponse:
    """Wraps the SDK client's HTTP transport to keep the last response it got (its body
    holds an OTLP partial success, which the SDK's client does not read)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.last: Any = None

    @classmethod
    def install(cls, exporter: Any) -> _LastResponse | None:
        client = getattr(exporter, "_client", None)
        inner = getattr(client, "_transport", None)
        if client is None or inner is None or not callable(getattr(inner, "request", None)):
            return None
        watch = cls(inner)
        client._transport = watch
        return watch

    def request(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner.request(*args, **kwargs)
        self.last = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _PlainResult:
    """What :class:`PlainHttpTransport` answers: the SDK's ``BaseHTTPResult`` interface
    (``status_code``, ``reason``, ``error``, ``content()``, ``headers()``, ``text()``)."""

    __slots__ = ("_body", "_headers", "_message", "error", "reason", "status_code")

    def __init__(self, status_code: int | None = None, reason: str | None = None,
                 error: Exception | None = None, body: bytes = b"",
                 message: Any = None) -> None:
        self.status_code = status_code
        self.reason = reason
        self.error = error
        self._body = body
        self._message = message  # (http.client's headers, read into a mapping on demand)
        self._headers: Mapping[str, str] | None = None

    def content(self) -> bytes:
        return self._body

    def headers(self) -> Mapping[str, str]:
        """The answer's headers, keys in any case, a repeated one's values joined with
        ``", "`` (as ``requests`` gives them)."""
        if self._headers is None:
            from requests.structures import CaseInsensitiveDict

            joined: CaseInsensitiveDict[str] = CaseInsensitiveDict()
            for key, value in (self._message.items() if self._message is not None else ()):
                joined[key] = f"{joined[key]}, {value}" if key in joined else value
            self._headers = joined
        return self._headers

    def text(self) -> str:
        return self._body.decode("utf-8")

    def json(self) -> Any:
        import json

        return json.loads(self._body)


class _AfterTheAnswer(Exception):
    """The answer's status came, then reading its body failed: the batch fails, as with
    ``requests``, but is no connection error (the SDK's client would send again a
    request the server had)."""


_SENT_ANYWAY = (BrokenPipeError, ConnectionResetError)
"""Errors writing a request after which the server may still have answered (an early
413 to a large body, then a closed connection): the answer is read before giving up."""


class PlainHttpTransport:
    """An OTLP/HTTP transport over one kept-alive :mod:`http.client` connection, for a
    plain ``http://`` endpoint: the SDK's ``requests`` transport costs about 1 ms of the
    export thread's CPU per batch, this one about 0.2 (docs/performance.md). The SDK's
    client above it keeps doing the rest (retries and their backoff, compression,
    headers, the immediate retry after a connection error, such as a kept-alive
    connection the server closed). Requests from several threads take turns.

    :meth:`install` puts it in place of the SDK's transport only where ``requests``
    would send the request as it is: an ``http://`` URL without credentials in it, no
    proxy for its host in the environment (``HTTP_PROXY``, ``NO_PROXY``), no ``.netrc``
    entry, and the SDK's own session unchanged (no ``session=`` of the user's, no
    credential provider's: ``OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER``);
    ``https://`` keeps ``requests`` (its certificates and verification). Like the SDK's
    transports it follows no redirect. What counts as a connection error (sent again
    at once by the SDK's client) is what ``requests`` counts: a failure before the
    answer's status came, not one reading its body.

    Example:
        >>> transport = PlainHttpTransport()
        >>> transport.request("POST", "http://127.0.0.1:9/v1/traces", data=b"",
        ...                   timeout=1.0).error is not None  # (nothing listens there)
        True
        >>> transport.close()
    """

    def __init__(self) -> None:
        self._conn: http.client.HTTPConnection | None = None
        self._where: tuple[str, int] | None = None
        self._url = ""
        self._target = ""
        self._lock = threading.Lock()

    @classmethod
    def install(cls, exporter: Any, users_session: Any) -> bool:
        """Put a transport of this class in place of ``exporter``'s (the SDK's HTTP
        exporter) where the class docstring says; whether it did."""
        client: Any = getattr(exporter, "_client", None)
        inner = getattr(client, "_transport", None)
        if users_session or inner is None or type(inner).__name__ != "RequestsHTTPTransport":
            return False
        if any(os.environ.get(f"OTEL_PYTHON_EXPORTER_OTLP_HTTP{kind}_CREDENTIAL_PROVIDER")
               for kind in ("", "_TRACES")):
            return False  # (its session carries what the provider gave: auth, headers)
        url = str(getattr(exporter, "_endpoint", ""))
        try:
            parts = urlsplit(url)
            if (parts.scheme != "http" or not parts.hostname or parts.username is not None
                    or parts.password is not None):
                return False
            parts.port  # noqa: B018 - (a bad port raises)
            import requests
            import requests.utils

            if (not _pristine(getattr(inner, "_session", None), requests)
                    or requests.utils.get_environ_proxies(url)
                    or requests.utils.get_netrc_auth(url)):
                return False
        except Exception:  # whatever requests would make of it: requests sends it
            return False
        try:
            inner.close()
        except Exception:  # (nothing was sent through it yet)
            pass
        client._transport = cls()
        return True

    def request(self, method: str, url: str, *, headers: dict[str, str] | None = None,
                timeout: float | None = None, data: bytes | None = None) -> Any:
        """Send one request; a failure is the result's ``error`` (the connection is then
        dropped, and a new one made by the next request)."""
        with self._lock:
            return self._request(method, url, headers, timeout, data)

    def _request(self, method: str, url: str, headers: dict[str, str] | None,
                 timeout: float | None, data: bytes | None) -> Any:
        try:
            if url != self._url:
                import requests.utils

                parts = urlsplit(url)
                where = (parts.hostname or "", parts.port or 80)
                # (the path quoted as requests quotes it: a space is %20)
                target = requests.utils.requote_uri(
                    (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
                if where != self._where:
                    self.close()
                self._url, self._where, self._target = url, where, target
            conn = self._conn
            if conn is None:
                assert self._where is not None
                conn = self._conn = http.client.HTTPConnection(*self._where, timeout=timeout)
            else:
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
            try:
                conn.request(method, self._target, body=data, headers=headers or {})
            except _SENT_ANYWAY as error:  # (the server may have answered, and closed)
                try:
                    response = conn.getresponse()
                except Exception:
                    raise error from None
            else:
                response = conn.getresponse()
        except Exception as error:  # noqa: BLE001 - the SDK's client decides what it means
            self.close()
            return _PlainResult(error=error)
        try:
            body = response.read()
        except Exception as error:  # noqa: BLE001 - answered: delivered, no connection error
            self.close()
            failed = _AfterTheAnswer(f"reading the answer (HTTP {response.status}) failed: "
                                     f"{type(error).__name__}: {error}")
            return _PlainResult(error=failed)  # (as requests: failed, not sent again)
        # (an answer saying "Connection: close": http.client closes, and opens anew)
        coding = (response.getheader("content-encoding") or "").lower()
        try:
            if coding == "gzip":
                body = gzip.decompress(body)
            elif coding == "deflate":
                body = zlib.decompress(body)
        except Exception:  # (a body the answer mislabels: only partial success reads it)
            body = b""
        return _PlainResult(response.status, response.reason, None, body, response.msg)

    def is_connection_error(self, exception: Exception | None) -> bool:
        """Whether ``exception`` means the request may not have reached the server (the
        SDK's client sends it again at once, then with backoff): a failure before the
        answer's status came."""
        return isinstance(exception, (OSError, http.client.HTTPException))

    def close(self) -> None:
        """Close the connection (the next request opens another)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # (closing a broken socket)
                pass


def _pristine(session: Any, requests: Any) -> bool:
    """Whether ``session`` is a ``requests.Session`` as the SDK makes it: nothing that
    would change a request (auth, headers beyond requests' own, hooks, proxies,
    certificates, adapters of another kind)."""
    if type(session) is not requests.Session:
        return False
    return (session.auth is None and not session.proxies and session.cert is None
            and not session.params and dict(session.headers) == dict(
                requests.utils.default_headers())
            and not any(session.hooks.values())
            and sorted(session.adapters) == ["http://", "https://"]
            and all(type(a) is requests.adapters.HTTPAdapter
                    for a in session.adapters.values()))
