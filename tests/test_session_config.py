"""session/config.py: a bad constructor argument is an error naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commspan import CommSpanMode


@pytest.mark.parametrize(
    ("kwargs", "error", "parameter"),
    [
        ({"exporters": object()}, TypeError, "exporters"),
        ({"exporters": [object()]}, TypeError, "exporters"),
        ({"tracer_provider": object()}, TypeError, "tracer_provider"),
        ({"sample": 0}, ValueError, "sample"),
        ({"sample": True}, TypeError, "sample"),
        ({"flush_timeout_s": 0}, ValueError, "flush_timeout_s"),
        ({"export_queue_size": 0}, ValueError, "export_queue_size"),
        ({"run_id": ""}, TypeError, "run_id"),
        ({"aggregator": "yes"}, TypeError, "aggregator"),
    ],
    ids=[
        "exporters-object",
        "exporters-list-of-object",
        "tracer_provider",
        "sample-0",
        "sample-bool",
        "flush_timeout_s",
        "export_queue_size",
        "run_id-empty",
        "aggregator-str",
    ],
)
def test_bad_constructor_arguments(
    kwargs: dict[str, Any], error: type[Exception], parameter: str
) -> None:
    """A bad constructor argument raises a clear error naming the parameter."""
    with pytest.raises(error, match=rf"\b{parameter}="):
        CommSpanMode(**kwargs)


def test_export_queue_size_checked_with_exporters() -> None:
    """export_queue_size=0 with an exporter raises ValueError naming export_queue_size."""
    with pytest.raises(ValueError, match=r"\bexport_queue_size="):
        CommSpanMode(exporters=[InMemorySpanExporter()], export_queue_size=0)
