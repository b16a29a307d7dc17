"""OTLP exporter factory (gRPC or HTTP/protobuf) over opentelemetry-exporter-otlp.

The standard variables configure it: ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc`` or ``http/protobuf``,
default ``http/protobuf`` as the OpenTelemetry specification says),
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``…_TRACES_ENDPOINT``, ``…_HEADERS``,
``…_INSECURE``, ``…_TIMEOUT``, ``…_COMPRESSION``. Arguments override them.

The endpoint is checked when the exporter is created: a malformed one is a
``ValueError`` that names where it came from (the ``endpoint=`` argument or the
variable), shows it with any credentials masked (``http://***@host:4318``) and
says how to write it. An endpoint is never logged with its credentials.

gRPC is the SDK's ``OTLPSpanExporter`` as it is. HTTP/protobuf is a subclass
of the SDK's HTTP ``OTLPSpanExporter`` that encodes each batch with
:func:`commspan.otlpjson.protobuf.encode_spans_protobuf` (the same bytes as the
SDK's encoder, several times faster: see docs/performance.md) and sends it
through the SDK's HTTP client, retries and all.

Example:
    >>> from commspan.exporters import otlp_exporter
    >>> exporter = otlp_exporter(protocol="http/protobuf", endpoint="http://127.0.0.1:4318/v1/traces")
    >>> type(exporter).__name__
    'OTLPSpanExporter'
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, urlsplit

from opentelemetry.sdk.trace.export import SpanExporter

from commspan._errors import seconds

__all__ = ["PROTOCOLS", "otlp_exporter"]

PROTOCOLS = ("grpc", "http/protobuf")

_ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
_ENV_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
_ENV_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_ENV_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
_ENV_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
_TRACES_PATH = "/v1/traces"
# gRPC name-resolver schemes a gRPC target may start with (they are passed on as they are).
_GRPC_TARGET_SCHEMES = ("unix", "unix-abstract", "dns", "ipv4", "ipv6", "vsock")
_MISSING_COLON = re.compile(r"^(https?)//+(.*)$", re.IGNORECASE)
_HTTP_PORT = 4318
_GRPC_PORT = 4317


def otlp_exporter(
    protocol: str | None = None,
    endpoint: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    insecure: bool | None = None,
) -> SpanExporter:
    """Create an OTLP ``SpanExporter``.

    Args:
        protocol: ``"grpc"`` or ``"http/protobuf"``; default from the
            environment, else ``"http/protobuf"``.
        endpoint: collector address. gRPC: ``host:port`` or ``http(s)://host:port``;
            HTTP: the full traces URL (``http://host:4318/v1/traces``). Default
            from the environment (for HTTP, ``/v1/traces`` is appended to
            ``OTEL_EXPORTER_OTLP_ENDPOINT``). Credentials in an HTTP URL
            (``http://user:token@host``) are sent as basic auth and never
            logged; gRPC takes them in ``headers`` only.
        headers: extra request headers (e.g. an auth token).
        timeout_s: per-export timeout in seconds.
        insecure: gRPC only: plaintext instead of TLS.

    Returns:
        The OpenTelemetry ``OTLPSpanExporter`` of the protocol; for
        HTTP/protobuf a subclass whose ``export`` encodes with commspan's
        protobuf encoder (the SDK's own ``export`` if the installed SDK lacks
        what that needs).

    Raises:
        ValueError: ``timeout_s`` (or, without it, ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``
            or ``OTEL_EXPORTER_OTLP_TIMEOUT``) is not a number of seconds above 0, or
            ``protocol`` is not one of :data:`PROTOCOLS`, or the
            endpoint (argument or variable, named in the message) is not a
            valid address: no or an unsupported scheme, no host, a port
            outside 1-65535, or credentials in a gRPC address. The message
            shows the value with its credentials masked and how to fix it.

    Example:
        >>> from commspan.exporters import otlp_exporter
        >>> otlp_exporter(endpoint="localhost:4318")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
          ...
        ValueError: endpoint='localhost:4318' is not a valid OTLP/HTTP endpoint: it has no
        scheme; pass endpoint='http://localhost:4318/v1/traces'
    """
    proto = _protocol(protocol)
    _check_endpoint(proto, endpoint)
    kwargs: dict[str, Any] = {}
    if endpoint is not None:
        kwargs["endpoint"] = endpoint
    if headers is not None:
        kwargs["headers"] = dict(headers)
    if timeout_s is not None:
        kwargs["timeout"] = seconds("timeout_s", timeout_s)
    else:
        _check_env_timeout()
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        if insecure is not None:
            kwargs["insecure"] = insecure
        return GrpcExporter(**kwargs)
    # the SDK's HTTP exporter with commspan's protobuf encoder (the same bytes)
    from commspan.exporters._otlp_http import OTLPSpanExporter as HttpExporter

    return HttpExporter(**kwargs)


def _mask_credentials(url: str) -> str:
    """``url`` with its user:password and query values replaced by ``***``.

    Example:
        >>> _mask_credentials("https://user:s3cret@collector:4318/v1/traces?token=abc")
        'https://***@collector:4318/v1/traces?token=***'
    """
    at = url.rfind("@")
    if at >= 0:  # everything between the scheme's "//" (or the start) and the last "@"
        slashes = url.rfind("//", 0, at)
        start = slashes + 2 if slashes >= 0 else 0
        url = f"{url[:start]}***{url[at:]}"
    main, sep, query = url.partition("?")
    if sep:
        query, hash_, fragment = query.partition("#")
        items = (item.partition("=") for item in query.split("&"))
        query = "&".join(f"{k}=***" if eq else "***" for k, eq, _ in items) + hash_ + fragment
    return main + sep + query


# ------------------------------------------------------------------ checks
def _check_env_timeout() -> None:
    """The timeout variable the SDK will read, if set, is a finite number of seconds
    above 0 (the SDK accepts 0 and less, then fails every export; it ignores text that
    is no number, such as ``10s``, with a warning)."""
    for name in (_ENV_TRACES_TIMEOUT, _ENV_TIMEOUT):
        raw = os.environ.get(name)
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise ValueError(
                f"{name}={raw!r} is not valid: the OTLP exporter's timeout must be a number "
                f"of seconds above 0; set {name}=10 (or unset it for the default), or pass "
                "timeout_s=10")
        return


def _protocol(protocol: str | None) -> str:
    if protocol:
        source, value = "protocol", protocol
    elif os.environ.get(_ENV_TRACES_PROTOCOL):
        source, value = _ENV_TRACES_PROTOCOL, os.environ[_ENV_TRACES_PROTOCOL]
    elif os.environ.get(_ENV_PROTOCOL):
        source, value = _ENV_PROTOCOL, os.environ[_ENV_PROTOCOL]
    else:
        return "http/protobuf"
    proto = value.strip().lower()
    if proto not in PROTOCOLS:
        where = "" if source == "protocol" else " (environment variable)"
        raise ValueError(
            f"{source}={value!r}{where} is not supported; use one of "
            + ", ".join(repr(p) for p in PROTOCOLS)
        )
    return proto


def _check_endpoint(proto: str, endpoint: str | None) -> None:
    """Raise ValueError if the endpoint the exporter will use is malformed.

    The value is looked up the way the SDK's exporter will: the argument, then
    ``…_TRACES_ENDPOINT``, then ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL for
    HTTP, to which ``/v1/traces`` is appended); an empty value counts as unset.
    """
    if endpoint:
        source, value, path = "endpoint", endpoint, _TRACES_PATH
    elif os.environ.get(_ENV_TRACES_ENDPOINT):
        source, value, path = _ENV_TRACES_ENDPOINT, os.environ[_ENV_TRACES_ENDPOINT], _TRACES_PATH
    elif os.environ.get(_ENV_ENDPOINT):
        source, value, path = _ENV_ENDPOINT, os.environ[_ENV_ENDPOINT], ""
    else:
        return  # the SDK's default, on localhost
    if proto == "grpc":
        problem, fix = _grpc_problem(value.strip())
        kind = "OTLP/gRPC"
    else:
        problem, fix = _http_problem(value.strip(), path)
        kind = "OTLP/HTTP"
    if problem is None:
        return
    fix = _mask_credentials(fix)
    if source == "endpoint":
        raise ValueError(
            f"endpoint={_mask_credentials(value)!r} is not a valid {kind} endpoint: "
            f"{problem}; pass endpoint={fix!r}"
        )
    raise ValueError(
        f"{source}={_mask_credentials(value)!r} (environment variable) is not a valid "
        f"{kind} endpoint: {problem}; set {source}={fix}"
    )


def _http_problem(text: str, path: str) -> tuple[str | None, str]:
    """(what is wrong, a corrected URL) for an OTLP/HTTP URL; ``(None, "")`` if fine."""
    missing_colon = _MISSING_COLON.match(text)
    if missing_colon:
        fixed = f"{missing_colon.group(1).lower()}://{missing_colon.group(2)}"
        return "its scheme lacks the ':'", _with_path(fixed, path)
    if "://" not in text:
        return "it has no scheme", _with_path(f"http://{text.lstrip('/')}", path)
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https"):
        fixed = "http://" + text.split("://", 1)[1]
        return f"the scheme {parts.scheme!r} is not supported (use http or https)", _with_path(
            fixed, path
        )
    problem = _netloc_problem(parts)
    if problem is None:
        return None, ""
    return problem, _repaired(parts, _HTTP_PORT, path)


def _grpc_problem(text: str) -> tuple[str | None, str]:
    """(what is wrong, a corrected address) for an OTLP/gRPC address; ``(None, "")`` if fine."""
    head, colon, _ = text.partition(":")
    if colon and head.lower() in _GRPC_TARGET_SCHEMES:
        return None, ""  # a gRPC target such as unix:/path, passed on unchanged
    missing_colon = _MISSING_COLON.match(text)
    if missing_colon:
        return "its scheme lacks the ':'", (
            f"{missing_colon.group(1).lower()}://{missing_colon.group(2)}"
        )
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme.lower() not in ("http", "https"):
            return (
                f"the scheme {parts.scheme!r} is not supported (use http, https or host:port)",
                "http://" + text.split("://", 1)[1],
            )
    else:
        parts = urlsplit("//" + text)
        if parts.path.strip("/") or parts.query:
            return "a gRPC address is host:port, without a path", _hostport(parts)
    if parts.username is not None or parts.password is not None:
        fixed = (f"{parts.scheme}://" if parts.scheme else "") + _hostport(parts)
        return (
            "it carries credentials, which a gRPC address cannot (the exporter would "
            "log them); send them in headers= (e.g. {'authorization': 'Basic ...'}) or "
            "OTEL_EXPORTER_OTLP_HEADERS",
            fixed,
        )
    problem = _netloc_problem(parts)
    if problem is None:
        return None, ""
    return problem, _repaired(parts, _GRPC_PORT, "")


def _netloc_problem(parts: SplitResult) -> str | None:
    if not parts.hostname:
        return "it names no host"
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        text = parts.netloc.rsplit("@", 1)[-1].rsplit(":", 1)[-1]
        return f"the port {text!r} is not a number from 1 to 65535"
    return None


def _hostport(parts: SplitResult) -> str:
    return parts.netloc.rsplit("@", 1)[-1]


def _repaired(parts: SplitResult, default_port: int, path: str) -> str:
    """The address with a default host or port where they were wrong."""
    try:
        port = parts.port or default_port
    except ValueError:
        port = default_port
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    scheme = f"{parts.scheme}://" if parts.scheme else ""
    userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return f"{scheme}{userinfo}{host}:{port}{parts.path or path}"


def _with_path(url: str, path: str) -> str:
    """``url`` with the traces path appended if it has none."""
    if path and urlsplit(url).path in ("", "/"):
        return url.rstrip("/") + path
    return url
