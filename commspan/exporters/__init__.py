"""Span exporters: JSONL files and OTLP (gRPC, HTTP/protobuf), and the JSONL readers.

Both exporters are ordinary OpenTelemetry ``SpanExporter``s: pass them to
``CommSpanMode(exporters=[...])`` or to any SDK span processor. The mode puts
each behind its own :class:`~commspan.exporters.queue.ExportQueue`. The
encoding and the readers live in :mod:`commspan.otlpjson`.
"""

from commspan.exporters.jsonl import JsonlSpanExporter
from commspan.exporters.otlp import PROTOCOLS, otlp_exporter
from commspan.otlpjson.decode import read_spans
from commspan.otlpjson.encode import encode_spans
from commspan.otlpjson.records import ReadReport, SkippedLine, SpanRecord

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
