"""Ownership: which module a collective belongs to, and which phase it serves.

The rule book that the capture layer and the span recorder consult. It holds
no state and imports nothing but :mod:`commspan.semconv`, so each rule can be
read and tested on its own:

- :func:`phase_now`: the one place that decides the phase of the work running
  now (a module call starting, or a collective being issued);
- :class:`OwnershipRule`: decides the owner of a collective from what is open
  when it is issued; :mod:`~commspan.ownership.innermost` is today's rule (the
  innermost open module span owns it: tensor parallelism and everything
  else). Rules for other sources (FSDP2, DDP, pipeline) arrive as sibling
  modules behind the same interface.

Example:
    >>> from commspan.ownership import phase_now
    >>> from commspan.semconv import Phase
    >>> phase_now(None, in_autograd=True), phase_now(None, in_autograd=True, module_call=True)
    (<Phase.BACKWARD: 'backward'>, <Phase.RECOMPUTE: 'recompute'>)
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from commspan.semconv import Phase

__all__ = ["Ownership", "OwnershipRule", "phase_now"]

_FORWARD, _BACKWARD, _RECOMPUTE = Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE


def phase_now(
    innermost: Phase | None, in_autograd: bool, *, module_call: bool = False
) -> Phase:
    """The phase of the work starting now.

    - A module call (``module_call=True``) is a forward, or a *recompute* when
      autograd is executing (activation checkpointing re-runs the forward
      during backward: docs/design.md, "How backward nesting is inferred",
      step 5).
    - A collective belongs to the phase of the innermost open module span;
      outside every module span (the rank span, ``innermost=None``) it is
      *backward* while autograd executes (a gradient hook's all_reduce) and
      *forward* otherwise (the loss, the optimizer step).

    Args:
        innermost: phase of the innermost open module span, ``None`` if none is open.
        in_autograd: autograd is executing a graph on this thread.
        module_call: the work is a module call starting (not a collective).

    Returns:
        The :class:`~commspan.semconv.Phase`.
    """
    if module_call:
        return _RECOMPUTE if in_autograd else _FORWARD
    if innermost is not None:
        return innermost
    return _BACKWARD if in_autograd else _FORWARD


class Ownership(NamedTuple):
    """Who a collective is charged to.

    Attributes:
        fqn: the module that owns it (``Global`` outside any module).
        phase: the phase it serves.
    """

    fqn: str
    phase: Phase


class OwnershipRule(Protocol):
    """Decides the owner of a collective from the innermost open span."""

    def owner(self, fqn: str, phase: Phase | None, in_autograd: bool) -> Ownership:
        """The owner of a collective issued now.

        Args:
            fqn: name of the innermost open span's module (``Global`` for the rank span).
            phase: that span's phase, ``None`` for the rank span.
            in_autograd: autograd is executing a graph on this thread.
        """
        ...
