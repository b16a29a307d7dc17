"""FSDP2 (``fully_shard``, HSDP): a collective is owned by the unit whose parameters it moves.

FSDP2 names its communication with ``torch.profiler.record_function`` labels,
which the dispatch mode keeps on a per-thread stack
(:meth:`commspan.capture.dispatch.CollectiveDispatchMode.labels`):

- ``FSDP::all_gather (<unit>)`` around the all-gather of a unit's parameters
  (unshard), ``FSDP::post_backward_reduce (<unit>)`` around the gradient
  reduce-scatter and, for HSDP, the all-reduce across replicas;
- ``FSDP::post_backward_reshard (<unit>)`` / ``FSDP::post_backward_accumulate
  (<unit>)`` around FSDP collecting the unit's gradients for that reduction, where
  DTensor brings a tensor-parallel partial gradient to its parameter's placement
  (a sequence-parallel norm's: an all-reduce over ``tp``);
- ``FSDP::forward_prefetch for <unit>`` / ``FSDP::backward_prefetch for <unit>``
  around an unshard another unit's hook issues ahead of time;
- ``FSDP::pre_forward (<unit>)``, ``FSDP::pre_backward (<unit>)``: the hook that
  runs it.

``<unit>`` is the unit's path relative to its FSDP root (no suffix for the
root itself; ``a, b`` for one unit of several modules, ``fully_shard([a, b])``,
owned by the lowest module holding them all); a ``[pg=N]`` suffix follows
when a module has several parameter groups. The labels are not an API of
torch: ``tests/test_ownership_fsdp.py`` pins them, and checks them against the
parameter group on the Python stack.

Example:
    >>> parse_labels(("FSDP::pre_backward (blocks.1)", "FSDP::backward_prefetch for blocks.0",
    ...               "FSDP::all_gather (blocks.0)"))
    FsdpLabel(unit='blocks.0', kind='unshard', prefetch='backward', hook='pre_backward')
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, NamedTuple

from commspan import semconv
from commspan.ownership import (
    ACTIVATION_KEY,
    COMPILED_KEY,
    FsdpUnit,
    Issued,
    Ownership,
    ParallelFacts,
    lowest_common_module,
    without_wrapper,
)
from commspan.semconv import Phase

__all__ = ["FsdpLabel", "FsdpUnits", "parse_labels"]

_PREFIX = "FSDP::"
# "FSDP::<what>" + " (<unit>)" unless the root + " [pg=N]" with several param groups
_UNIT_LABEL = re.compile(r"^FSDP::(?P<what>[a-z_]+)(?: \((?P<unit>.*?)\))?(?: \[pg=\d+\])?$")
_PREFETCH_LABEL = re.compile(r"^FSDP::(?P<pass>forward|backward)_prefetch for (?P<unit>.*)$")
_KINDS = {"all_gather": semconv.OWNER_KIND_UNSHARD,
          "post_backward_reduce": semconv.OWNER_KIND_REDUCE_GRAD,
          # where FSDP collects (and accumulates) the unit's gradients for the reduction:
          # with tensor parallelism, DTensor brings a partial gradient to its
          # parameter's placement there (an all-reduce over tp)
          "post_backward_reshard": semconv.OWNER_KIND_REDISTRIBUTE_GRAD,
          "post_backward_accumulate": semconv.OWNER_KIND_REDISTRIBUTE_GRAD}


class FsdpLabel(NamedTuple):
    """What FSDP's open labels say about a collective.

    Attributes:
        unit: the unit's path relative to its FSDP root (``""``: the root).
        kind: ``unshard``, ``reduce_grad`` or ``redistribute_grad``.
        prefetch: ``"forward"`` / ``"backward"`` when another unit's hook
            prefetches it for that pass, else ``None``.
        hook: the innermost FSDP hook label around it (``pre_forward``,
            ``pre_backward``, ``root_post_backward_callback``, ...), ``""`` if none.
    """

    unit: str
    kind: str
    prefetch: str | None
    hook: str


@lru_cache(maxsize=4096)  # a few distinct label stacks per unit and pass
def parse_labels(labels: tuple[str, ...]) -> FsdpLabel | None:
    """The innermost FSDP unshard or gradient-reduction label and what encloses
    it, from ``labels`` (outermost first); ``None`` without one."""
    found: FsdpLabel | None = None
    prefetch: str | None = None
    hook = ""
    for name in reversed(labels):
        if not name.startswith(_PREFIX):
            continue
        if found is None:
            m = _UNIT_LABEL.match(name)
            if m is not None and m.group("what") in _KINDS:
                found = FsdpLabel(m.group("unit") or "", _KINDS[m.group("what")], None, "")
            continue
        m = _PREFETCH_LABEL.match(name)
        if m is not None:
            prefetch = prefetch or m.group("pass")
            continue
        if not hook:
            m = _UNIT_LABEL.match(name)
            if m is not None:
                hook = m.group("what")
    if found is None:
        return None
    return found._replace(prefetch=prefetch, hook=hook)


class FsdpUnits:
    """The :class:`~commspan.ownership.CollectiveRule` for FSDP2 and HSDP.

    Owner: the unit named by the label. Phase: gradient reduction serves
    backward; an unshard serves the pass it was prefetched for (a forward
    prefetch while autograd runs serves the recompute), backward when FSDP's
    pre-backward hook issued it, recompute when a forward hook issued it while
    autograd runs (activation checkpointing), backward when anything else did
    while autograd runs (a user's ``unshard()`` in a backward hook), forward
    otherwise.
    """

    def owner(self, issued: Issued, facts: ParallelFacts) -> Ownership | None:
        """See :meth:`commspan.ownership.CollectiveRule.owner`."""
        if not issued.labels or not facts.has_fsdp:
            return None
        label = parse_labels(issued.labels)
        if label is None:
            return None
        # fully_shard([a, b]) makes one unit of several modules: FSDP names it
        # "a, b" and it is owned by the lowest module holding all of them
        members: list[FsdpUnit] = []
        for relative in label.unit.split(", ") if ", " in label.unit else (label.unit,):
            unit = _resolve(relative, facts)
            if unit is None:
                return None
            members.append(unit)
        if label.kind == semconv.OWNER_KIND_REDISTRIBUTE_GRAD:
            # one gradient of the unit, not the unit: its bytes are the collective's
            # input, or for an all-gather of a sharded gradient its output (every
            # rank's shard), as for an unshard
            grad = int(issued.attributes.get(semconv.TENSOR_BYTES, 0) or 0)
            if issued.op.startswith("all_gather"):
                grad *= int(issued.attributes.get(semconv.PG_SIZE, 1) or 1)
            one: dict[str, Any] = {semconv.OWNER_BYTES: grad}
            if len(members) > 1:
                one[semconv.FSDP_UNIT_MODULES] = tuple(m.fqn for m in members)
            return Ownership(_owner(members), Phase.BACKWARD, semconv.SOURCE_FSDP,
                             label.kind, one)
        reduces = label.kind == semconv.OWNER_KIND_REDUCE_GRAD
        # a gradient reduction moves the gradients of the trainable parameters only
        counted = [m.trainable if reduces and m.trainable >= 0 else m.params for m in members]
        owner = _owner(members)
        params = counted[0] if len(members) == 1 else sum(counted)
        op = issued.op
        attrs = issued.attributes
        moved = int(attrs.get(semconv.TENSOR_BYTES, 0) or 0)
        if reduces:
            phase = Phase.BACKWARD
            kind = semconv.OWNER_KIND_ALL_REDUCE if op == "all_reduce" else label.kind
        else:
            kind = label.kind
            moved *= int(attrs.get(semconv.PG_SIZE, 1) or 1)  # output: every rank's shard
            if label.prefetch == "forward" and issued.in_autograd:
                # a forward prefetch while autograd runs: a recompute's
                # (activation checkpointing re-runs the forward hooks)
                phase = Phase.RECOMPUTE
            elif label.prefetch is not None:
                phase = Phase(label.prefetch)
            elif label.hook == "pre_backward":
                phase = Phase.BACKWARD
            elif issued.in_autograd:
                # a unit's forward hook while autograd runs: a recompute (activation
                # checkpointing re-runs the forward hooks); anything else there (a
                # user's unshard() from a backward hook, a custom Function) serves
                # the backward
                phase = Phase.RECOMPUTE if label.hook == "pre_forward" else Phase.BACKWARD
            else:
                phase = Phase.FORWARD
        extra: dict[str, Any] = {semconv.OWNER_PARAMS: params, semconv.OWNER_BYTES: moved}
        if kind == semconv.OWNER_KIND_UNSHARD:
            extra[semconv.OWNER_PREFETCH] = label.prefetch is not None
        if len(members) > 1:
            extra[semconv.FSDP_UNIT_MODULES] = tuple(m.fqn for m in members)
        return Ownership(owner, phase, semconv.SOURCE_FSDP, kind, extra)


def _owner(members: list[FsdpUnit]) -> str:
    """The module owning a unit's collectives: the unit's, or for one unit of several
    modules the lowest module holding them all."""
    if len(members) == 1:
        return members[0].fqn
    return lowest_common_module([m.fqn for m in members])


def _resolve(relative: str, facts: ParallelFacts) -> FsdpUnit | None:
    """The unit at ``relative`` (its path from its FSDP root); with several FSDP
    roots, the one whose parameter group is on the stack."""
    if COMPILED_KEY in relative:
        # FSDP names a unit inside a torch.compile'd module by torch's path
        # (``layers.0._orig_mod``); commspan gives the wrapped module the wrapper's name
        relative = without_wrapper(relative, COMPILED_KEY)
    candidates = facts.fsdp_units(relative)
    if not candidates and ACTIVATION_KEY in relative:
        # likewise inside an activation-checkpointing wrapper
        # (``layers.0._checkpoint_wrapped_module.attn``), unless commspan names by
        # torch's paths there (``commspan.compat``): then the first lookup found it
        candidates = facts.fsdp_units(without_wrapper(relative, ACTIVATION_KEY))
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        on_stack = facts.fsdp_unit_on_stack()
        if on_stack is not None and on_stack in candidates:
            return on_stack
    return None
