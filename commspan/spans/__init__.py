"""Spans: open frames on a stack, turned into OpenTelemetry spans when they close.

- :mod:`~commspan.spans.frames`: :class:`Frame` (an open span) and
  :class:`OpenSpan` (the read-only copy readers get);
- :mod:`~commspan.spans.recorder`: :class:`SpanRecorder`, the stack of frames
  of one trace at a time, which builds each span as its frame closes and
  hands it to the sink (the mode's span processors);
- :mod:`~commspan.spans.traces`: which trace spans go into (one per step, one
  per stretch outside steps) and the ids every rank derives for it.

Nothing here imports torch; the capture layer drives the recorder.
"""

from commspan.spans.frames import Frame, OpenSpan
from commspan.spans.recorder import SpanRecorder
from commspan.spans.traces import Trace, TraceOpener, derive_ids

__all__ = ["Frame", "OpenSpan", "SpanRecorder", "Trace", "TraceOpener", "derive_ids"]
