"""DistributedDataParallel: bucket all-reduces, and DDP's own syncs.

- A bucket all-reduce runs from the gradient hook of a parameter (autograd's
  current node is that parameter's ``AccumulateGrad``): the hook of the
  parameter whose gradient completed the bucket, or of one that completed an
  earlier bucket when buckets became ready out of order (the reducer launches
  them in index order). The capture layer tells which bucket
  (:meth:`~commspan.ownership.ParallelFacts.ddp_bucket_now`). Owner: the lowest
  module holding all the bucket's parameters; phase backward. A comm hook's
  collectives for the bucket (PowerSGD, compression) are the bucket's too.
- With ``find_unused_parameters=True`` the same hook all-reduces the map of
  used parameters (one integer per parameter of the DDP module): owner the DDP
  module. A Python comm hook's collectives whose sizes match no bucket
  (compression) belong to the bucket the hook was called with.
- DDP's forward broadcasts (the bucket layout after its rebuild, buffers) run
  inside the label ``DistributedDataParallel.forward``: owner the DDP module.
- DDP's construction (parameter shape check, state broadcast from rank 0):
  owner the DDP module, phase ``setup`` (not a training step's forward).

Example:
    >>> from commspan.ownership import DdpBucket
    >>> bucket = DdpBucket(1, 1056, 2, ("DDP.module.l2.0",), "DDP.module.l2.0", "DDP", False)
    >>> numel({semconv.TENSOR_SHAPE: [1056], semconv.TENSOR_COUNT: 1}) == bucket.numel
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from commspan import semconv
from commspan.ownership import Issued, Ownership, ParallelFacts
from commspan.semconv import Phase

__all__ = ["DDP_FORWARD_LABEL", "DdpModules", "numel"]

DDP_FORWARD_LABEL = "DistributedDataParallel.forward"
"""The ``record_function`` label DDP's ``forward`` runs in."""

_INIT_OPS = frozenset({"all_gather", "broadcast", "all_gather_into_tensor"})
_INTEGER = ("int", "uint", "bool")


def numel(attributes: Mapping[str, Any]) -> int | None:
    """Elements of a single-tensor collective, from its event attributes."""
    shape = attributes.get(semconv.TENSOR_SHAPE)
    if shape is None or attributes.get(semconv.TENSOR_COUNT, 1) != 1:
        return None
    return math.prod(int(d) for d in shape)


class DdpModules:
    """The :class:`~commspan.ownership.CollectiveRule` for DistributedDataParallel."""

    def owner(self, issued: Issued, facts: ParallelFacts) -> Ownership | None:
        """See :meth:`commspan.ownership.CollectiveRule.owner`."""
        if issued.in_autograd:
            if not facts.has_ddp:
                return None
            return self._in_backward(issued, facts)
        if facts.has_ddp and DDP_FORWARD_LABEL in issued.labels:
            # DDP's own forward work (buffer broadcasts, parameter syncs) runs with
            # its span innermost; the label stays open around the wrapped module's
            # forward too, whose modules' collectives (SyncBatchNorm, tensor
            # parallelism) are theirs
            open_fqns = issued.open_fqns()
            if open_fqns and open_fqns[-1] in facts.ddp_fqns():
                return Ownership(open_fqns[-1], Phase.FORWARD, semconv.SOURCE_DDP,
                                 semconv.OWNER_KIND_FORWARD_SYNC)
            return None
        if issued.fqn == semconv.GLOBAL_FQN and issued.op in _INIT_OPS:
            ddp = facts.ddp_constructing()
            if ddp is not None:
                return Ownership(ddp, Phase.SETUP, semconv.SOURCE_DDP,
                                 semconv.OWNER_KIND_INIT_SYNC)
        return None

    @staticmethod
    def _in_backward(issued: Issued, facts: ParallelFacts) -> Ownership | None:
        attrs = issued.attributes
        size = numel(attrs)
        if str(attrs.get(semconv.TENSOR_DTYPE, "")).startswith(_INTEGER):
            hook = facts.ddp_bucket_now()
            if hook is None:
                return None
            if hook.find_unused and size == hook.ddp_params and issued.op == "all_reduce":
                # the map of used parameters (an int32 per parameter), all-reduced from
                # the same hook (a comm hook's own integer collectives are its bucket's)
                return Ownership(hook.ddp_fqn, Phase.BACKWARD, semconv.SOURCE_DDP,
                                 semconv.OWNER_KIND_UNUSED_MAP)
        bucket = facts.ddp_bucket_now(size)
        if bucket is None:
            return None
        extra = {
            semconv.DDP_BUCKET_INDEX: bucket.index,
            semconv.OWNER_PARAMS: bucket.params,
            semconv.DDP_BUCKET_MODULES: list(bucket.modules),
            semconv.OWNER_BYTES: int(attrs.get(semconv.TENSOR_BYTES, 0) or 0),
        }
        return Ownership(bucket.owner, Phase.BACKWARD, semconv.SOURCE_DDP,
                         semconv.OWNER_KIND_BUCKET, extra)
