"""The session: :class:`CommSpanMode` wires capture, spans and span processors.

- :mod:`~commspan.session.mode`: the context manager (enter, exit, steps,
  stats, flush, shutdown);
- :mod:`~commspan.session.config`: its arguments, checked once;
- :mod:`~commspan.session.resource`: the resource of every span;
- :mod:`~commspan.session.run_id`: the run id all ranks agree on.

The top of the stack: it imports the layers below; only the facades,
:mod:`commspan.testing` and :mod:`commspan.compat` import it.
"""

from commspan.session.mode import CommSpanMode

__all__ = ["CommSpanMode"]
