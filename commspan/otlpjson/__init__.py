"""OTLP/JSON, both directions, OTLP/protobuf encoding, and the typed records every reader
shares.

- :mod:`~commspan.otlpjson.encode`: SDK spans -> one OTLP/JSON request (bytes);
- :mod:`~commspan.otlpjson.protobuf`: SDK spans -> one OTLP/protobuf request
  (bytes), what the OTLP/HTTP exporter sends;
- :mod:`~commspan.otlpjson.decode`: JSONL lines -> documents -> spans, with one
  walk over a document and one attribute decoder;
- :mod:`~commspan.otlpjson.records`: :class:`SpanRecord`, :class:`ReadReport`,
  :class:`SkippedLine` and the rule for a span's rank;
- :mod:`~commspan.otlpjson.files`: the one rule for which files a path names.

The public names are re-exported by :mod:`commspan.exporters`.
"""
