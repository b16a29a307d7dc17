"""Ownership: which module a collective belongs to, and which phase it serves.

The rule book that the capture layer and the span recorder consult. It holds
no state and imports nothing but :mod:`commspan.semconv`, so each rule can be
read and tested on its own:

- :func:`phase_now`: the one place that decides the phase of the work running
  now (a module call starting, or a collective being issued);
- :class:`OwnershipRule`: decides the owner of a collective from what is open
  when it is issued; :mod:`~commspan.ownership.innermost` is the default rule
  (the innermost open module span owns it: tensor parallelism and everything
  else);
- :class:`CollectiveRule`: a rule for one source of framework-issued
  communication, tried before the default one: :mod:`~commspan.ownership.fsdp`
  (FSDP2 / HSDP units), :mod:`~commspan.ownership.ddp` (DDP buckets and syncs),
  :mod:`~commspan.ownership.pipeline` (point-to-point ops of pipeline stages).
  It reads an :class:`Issued` collective and the :class:`ParallelFacts` the
  capture layer gathered, and returns an :class:`Ownership` or ``None``
  (not its collective); :func:`resolve` tries them in order;
- :func:`counted_names`: the modules a collective counts for, by name.

docs/parallelisms.md has the rule for each source.

Example:
    >>> from commspan.ownership import phase_now
    >>> from commspan.semconv import Phase
    >>> phase_now(None, in_autograd=True), phase_now(None, in_autograd=True, module_call=True)
    (<Phase.BACKWARD: 'backward'>, <Phase.RECOMPUTE: 'recompute'>)
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from commspan import semconv
from commspan.semconv import Phase

__all__ = [
    "CollectiveRule",
    "DdpBucket",
    "FsdpUnit",
    "Issued",
    "Ownership",
    "OwnershipRule",
    "ParallelFacts",
    "PipelineTag",
    "counted_names",
    "lowest_common_module",
    "phase_now",
    "without_wrapper",
    "resolve",
]

_FORWARD, _BACKWARD, _RECOMPUTE = Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE


def phase_now(
    innermost: Phase | None,
    in_autograd: bool,
    *,
    module_call: bool = False,
    recomputing: bool | None = None,
) -> Phase:
    """The phase of the work starting now.

    - A module call (``module_call=True``) is a forward; while autograd is
      executing it is a *recompute* when activation checkpointing re-runs the
      forward (``recomputing``, yes unless told), and *backward* work otherwise
      (a module called from a gradient hook): docs/design.md, "How backward
      nesting is inferred", step 5.
    - A collective belongs to the phase of the innermost open module span;
      outside every module span (the rank span, ``innermost=None``) it is
      *backward* while autograd executes (a gradient hook's all_reduce) and
      *forward* otherwise (the loss, the optimizer step). Issued while
      checkpointing re-runs a forward (``recomputing``) with no span of that
      recompute open (a checkpointed function's own collective, in the backward
      span that needed its activations, or in the rank span), it is *recompute*.

    Args:
        innermost: phase of the innermost open module span, ``None`` if none is open.
        in_autograd: autograd is executing a graph on this thread.
        module_call: the work is a module call starting (not a collective).
        recomputing: while autograd executes, whether activation checkpointing
            is re-running a forward (the capture layer tells:
            :func:`commspan.capture.backward.recomputing`); ``None``: not asked
            (yes for a module call, no for a collective).

    Returns:
        The :class:`~commspan.semconv.Phase`.

    Example:
        >>> phase_now(Phase.BACKWARD, in_autograd=True, recomputing=True)
        <Phase.RECOMPUTE: 'recompute'>
    """
    if module_call:
        if not in_autograd:
            return _FORWARD
        return _BACKWARD if recomputing is False else _RECOMPUTE
    if in_autograd and recomputing and innermost in (None, _BACKWARD):
        return _RECOMPUTE
    if innermost is not None:
        return innermost
    return _BACKWARD if in_autograd else _FORWARD


class Ownership(NamedTuple):
    """Who a collective is charged to.

    Attributes:
        fqn: the module that owns it (``Global`` outside any module).
        phase: the phase it serves.
        source: what decided it (``commspan.owner.source``: ``position``,
            ``fsdp``, ``ddp``).
        kind: what the collective does for its owner (``commspan.owner.kind``),
            ``""`` for the position.
        attributes: further event attributes the rule knows (parameters and
            bytes moved, DDP bucket, prefetch).
    """

    fqn: str
    phase: Phase
    source: str = semconv.SOURCE_POSITION
    kind: str = ""
    attributes: Mapping[str, Any] | None = None


class OwnershipRule(Protocol):
    """Decides the owner of a collective from the innermost open span."""

    def owner(self, fqn: str, phase: Phase | None, in_autograd: bool,
              recomputing: bool = False) -> Ownership:
        """The owner of a collective issued now.

        Args:
            fqn: name of the innermost open span's module (``Global`` for the rank span).
            phase: that span's phase, ``None`` for the rank span.
            in_autograd: autograd is executing a graph on this thread.
            recomputing: activation checkpointing is re-running a forward (asked
                only when autograd executes and no forward or recompute span is
                open: :func:`phase_now`).
        """
        ...


class Issued(NamedTuple):
    """A collective being issued, as the ownership rules see it.

    Attributes:
        op: canonical op name (``all_gather_into_tensor``, ``all_reduce``, ...).
        attributes: its event attributes so far (sizes, dtype, process group).
        fqn: the innermost open span's module (``Global`` for the rank span).
        phase: that span's phase, ``None`` for the rank span.
        in_autograd: autograd is executing a graph on this thread.
        labels: the ``record_function`` labels open on this thread, outermost first.
        open_fqns: returns the modules of the open spans, outermost first.
        tensor: the tensor of a point-to-point op (the object itself), else ``None``.
    """

    op: str
    attributes: Mapping[str, Any]
    fqn: str
    phase: Phase | None
    in_autograd: bool
    labels: tuple[str, ...]
    open_fqns: Callable[[], Sequence[str]]
    tensor: Any = None


class FsdpUnit(NamedTuple):
    """One FSDP2 unit (a module ``fully_shard`` was applied to).

    Attributes:
        fqn: its module's name in commspan's naming (``FSDPNet.blocks.0``).
        params: its own parameters (those of nested units excluded).
        trainable: how many of them require gradients (those whose gradients its
            reduce-scatter moves), when the unit was learned; ``-1``: all.
    """

    fqn: str
    params: int
    trainable: int = -1


@dataclass(frozen=True)
class DdpBucket:
    """One gradient bucket of a DistributedDataParallel module.

    Attributes:
        index: the reducer's bucket index.
        numel: elements of all its gradients.
        params: number of parameters.
        modules: modules holding those parameters (commspan names).
        owner: the lowest module holding all of them.
        ddp_fqn: the DistributedDataParallel module.
        find_unused: the DDP module was built with ``find_unused_parameters=True``.
        ddp_params: parameters of the whole DDP module (its buckets'): the size of
            its map of used parameters.
    """

    index: int
    numel: int
    params: int
    modules: tuple[str, ...]
    owner: str
    ddp_fqn: str
    find_unused: bool
    ddp_params: int = 0


class PipelineTag(NamedTuple):
    """A point-to-point op a watched pipeline stage announced for one microbatch.

    Attributes:
        stage_fqn: the stage module (commspan name).
        stage: the stage index.
        microbatch: the microbatch index.
        kind: ``activation_send``, ``activation_recv``, ``gradient_send`` or
            ``gradient_recv``.
        peer_stage: the stage it exchanges with.
    """

    stage_fqn: str
    stage: int
    microbatch: int
    kind: str
    peer_stage: int


class ParallelFacts(Protocol):
    """What the capture layer knows of the parallel wrappers on this rank
    (:class:`commspan.capture.parallel.ParallelModules`)."""

    @property
    def has_fsdp(self) -> bool:
        """An FSDP2 unit was seen."""
        ...

    @property
    def has_ddp(self) -> bool:
        """A DistributedDataParallel module was seen."""
        ...

    def fsdp_units(self, relative: str) -> Sequence[FsdpUnit]:
        """Units whose path relative to their FSDP root is ``relative`` ("" = a root)."""
        ...

    def fsdp_unit_on_stack(self) -> FsdpUnit | None:
        """The unit whose FSDP parameter group is gathering or reducing right now
        (read from the Python stack; used only to tell apart units with the same
        relative name)."""
        ...

    def ddp_bucket_now(self, numel: int | None = None) -> DdpBucket | None:
        """The bucket of the parameter whose gradient hook is running now, if any.

        Given ``numel``, the elements of a collective that hook issues: the
        bucket that collective reduces. The reducer launches a backward's
        buckets in index order, several from one hook when they became ready
        out of order; so it is the DDP module's next bucket not yet launched
        in this backward when that one has ``numel`` elements (it then counts
        as launched), else the hook's parameter's bucket if it has ``numel``
        elements, else the bucket a Python comm hook on the stack was called with;
        ``None`` for a collective of no bucket's size outside every comm hook (a
        user's own collective in a gradient hook).
        """
        ...

    def ddp_fqns(self) -> Container[str]:
        """Names of the DistributedDataParallel modules seen."""
        ...

    def ddp_constructing(self) -> str | None:
        """Name of a DistributedDataParallel module being constructed on this thread."""
        ...

    @property
    def has_pipeline(self) -> bool:
        """A pipeline stage is watched."""
        ...

    def pipeline_tag(self, tensor: Any) -> PipelineTag | None:
        """The op a watched stage announced for ``tensor``, if any."""
        ...

    def pipeline_setup(self) -> str | None:
        """The watched stage whose setup an unannounced point-to-point op is, if any."""
        ...


class CollectiveRule(Protocol):
    """Decides the owner of collectives of one source; ``None`` for the others."""

    def owner(self, issued: Issued, facts: ParallelFacts) -> Ownership | None:
        """The owner of ``issued``, or ``None`` if this rule does not know it."""
        ...


def resolve(
    issued: Issued, facts: ParallelFacts, rules: Sequence[CollectiveRule]
) -> Ownership | None:
    """The first owner one of ``rules`` gives ``issued``; ``None`` if none does
    (then the default rule, the position, applies)."""
    for rule in rules:
        owner = rule.owner(issued, facts)
        if owner is not None:
            return owner
    return None


COMPILED_KEY = "_orig_mod"
"""The child under which ``torch.compile``'s wrapper (``OptimizedModule``) holds its
module."""
ACTIVATION_KEY = "_checkpoint_wrapped_module"
"""The child under which activation checkpointing's ``checkpoint_wrapper`` and
``offload_wrapper`` hold their module."""


def without_wrapper(path: str, key: str) -> str:
    """The dotted ``path`` without the parts ``key`` (a wrapper's child,
    :data:`COMPILED_KEY` or :data:`ACTIVATION_KEY`): torch's path of a module inside a
    wrapper, named as commspan names it (the wrapped module takes the wrapper's name).

    Example:
        >>> without_wrapper("layers.0._checkpoint_wrapped_module.attn", ACTIVATION_KEY)
        'layers.0.attn'
    """
    return ".".join(p for p in path.split(".") if p != key)


def lowest_common_module(paths: Sequence[str]) -> str:
    """The deepest dotted path that is a prefix (by whole names) of every path.

    Example:
        >>> lowest_common_module(["l2.0", "l2.2"]), lowest_common_module(["l2.2", "l3"])
        ('l2', '')
    """
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return ".".join(common)


def counted_names(owner: str, ran: Container[str]) -> tuple[str, ...]:
    """The modules a collective owned by ``owner`` counts for, innermost first:
    ``owner`` and each module enclosing it by name that has run (``ran``); a
    container never called, such as a ``ModuleList``, has no spans and is skipped.

    Example:
        >>> counted_names("Net.blocks.0", {"Net", "Net.blocks.0"})
        ('Net.blocks.0', 'Net')
    """
    out = [owner]
    head = owner
    while "." in head:
        head = head.rsplit(".", 1)[0]
        if head in ran:
            out.append(head)
    return tuple(out)
