"""Span exporters: JSONL files and OTLP (gRPC, HTTP/protobuf).

Both are ordinary OpenTelemetry ``SpanExporter``s: pass them to
``CommSpanMode(exporters=[...])`` or to any SDK span processor.
"""

from commspan.exporters.jsonl import (
    JsonlSpanExporter,
    ReadReport,
    SkippedLine,
    SpanRecord,
    encode_spans,
    read_spans,
)
from commspan.exporters.otlp import PROTOCOLS, otlp_exporter

__all__ = [
    "JsonlSpanExporter",
    "PROTOCOLS",
    "ReadReport",
    "SkippedLine",
    "SpanRecord",
    "encode_spans",
    "otlp_exporter",
    "read_spans",
]
