"""Today's ownership rule: the innermost open module span owns a collective.

This covers tensor parallelism (its collectives run inside the module whose
forward or backward needs them; for a module whose own forward hooks issue
collectives, the module hooks close its span after those hooks, see
docs/design.md, "Forward") and every collective issued outside modules
(charged to ``Global``, the rank span).

It also says which open spans a collective counts for (:func:`counts_for`):
the subtree counts a span carries when it closes.

Example:
    >>> from commspan.semconv import Phase
    >>> InnermostModule().owner("Net.mlp", Phase.BACKWARD, in_autograd=True)[:3]
    ('Net.mlp', <Phase.BACKWARD: 'backward'>, 'position')
    >>> counts_for("Net", Phase.BACKWARD, "Net.mlp.fc", "recompute")
    True
    >>> counts_for("Net.head", Phase.BACKWARD, "Net.mlp.fc", "recompute")
    False
"""

from __future__ import annotations

from commspan.ownership import Ownership, phase_now
from commspan.semconv import Phase

__all__ = ["InnermostModule", "counts_for"]


class InnermostModule:
    """The innermost open span's module owns the collective; :func:`phase_now`
    gives its phase."""

    def owner(self, fqn: str, phase: Phase | None, in_autograd: bool,
              recomputing: bool = False) -> Ownership:
        """See :meth:`commspan.ownership.OwnershipRule.owner`."""
        return Ownership(fqn, phase_now(phase, in_autograd, recomputing=recomputing))


def counts_for(span_fqn: str, span_phase: Phase | None, owner_fqn: str, phase: str) -> bool:
    """Whether an open span counts a collective of ``owner_fqn`` in ``phase``.

    A collective counts for the rank span and every open span of its phase. A
    span of another phase (a backward span around a recompute) counts it only
    when its module encloses the owner by name, so a recompute triggered inside
    one module's backward is not charged to that module (docs/design.md, "How
    backward nesting is inferred", step 5).
    """
    return (
        span_phase is None
        or span_phase.value == phase
        or owner_fqn == span_fqn
        or owner_fqn.startswith(span_fqn + ".")
    )
