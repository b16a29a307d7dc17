"""OTLP exporter factory (gRPC or HTTP/protobuf) over opentelemetry-exporter-otlp.

The standard variables configure it: ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc`` or ``http/protobuf``,
default ``http/protobuf`` as the OpenTelemetry specification says),
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``…_TRACES_ENDPOINT``, ``…_HEADERS``,
``…_INSECURE``, ``…_TIMEOUT``, ``…_COMPRESSION``. Arguments override them.

Example:
    >>> from commspan.exporters import otlp_exporter
    >>> exporter = otlp_exporter(protocol="http/protobuf", endpoint="http://127.0.0.1:4318/v1/traces")
    >>> type(exporter).__name__
    'OTLPSpanExporter'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["PROTOCOLS", "otlp_exporter"]

PROTOCOLS = ("grpc", "http/protobuf")


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
        endpoint: collector address. gRPC: ``host:port`` or ``http://host:port``;
            HTTP: the full traces URL (``http://host:4318/v1/traces``). Default
            from the environment (for HTTP, ``/v1/traces`` is appended to
            ``OTEL_EXPORTER_OTLP_ENDPOINT``).
        headers: extra request headers (e.g. an auth token).
        timeout_s: per-export timeout in seconds.
        insecure: gRPC only: plaintext instead of TLS.

    Raises:
        ValueError: ``protocol`` is not one of :data:`PROTOCOLS`.
    """
    proto = (
        protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip().lower()
    if proto not in PROTOCOLS:
        raise ValueError(
            f"protocol={proto!r} is not supported; use one of {PROTOCOLS} "
            "(argument or OTEL_EXPORTER_OTLP_PROTOCOL)"
        )
    kwargs: dict[str, Any] = {}
    if endpoint is not None:
        kwargs["endpoint"] = endpoint
    if headers is not None:
        kwargs["headers"] = dict(headers)
    if timeout_s is not None:
        kwargs["timeout"] = timeout_s
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        if insecure is not None:
            kwargs["insecure"] = insecure
        return GrpcExporter(**kwargs)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(**kwargs)
