"""Pipeline parallelism (``torch.distributed.pipelining``): point-to-point ops of a stage.

For a stage the mode was asked to watch (``mode.watch_pipeline(schedule)``),
the capture layer notes which tensor each send and receive of a microbatch
carries (:class:`~commspan.ownership.PipelineTag`). Owner: the stage module.
Phase: forward for activations, backward for gradients. The event names the
microbatch, the stage and the stage it exchanges with (the peer's global rank
is already ``commspan.collective.peer``). An unannounced point-to-point op
while a stage prepares its first step (warm-up votes, exchanging shapes), or,
with one stage per rank, before a step's first microbatch, is that stage's
setup: owner the stage module, phase ``setup``.

Example:
    >>> from commspan.ownership import PipelineTag
    >>> phase_of(PipelineTag("Sequential", 1, 0, semconv.OWNER_KIND_GRADIENT_SEND, 0))
    <Phase.BACKWARD: 'backward'>
"""

from __future__ import annotations

from commspan import semconv
from commspan.ownership import Issued, Ownership, ParallelFacts, PipelineTag
from commspan.semconv import Phase

__all__ = ["PipelineStages", "phase_of"]

_P2P = frozenset({"send", "recv", "batch_p2p"})
_ACTIVATIONS = frozenset({semconv.OWNER_KIND_ACTIVATION_SEND, semconv.OWNER_KIND_ACTIVATION_RECV})


def phase_of(tag: PipelineTag) -> Phase:
    """Activations serve forward, gradients backward."""
    return Phase.FORWARD if tag.kind in _ACTIVATIONS else Phase.BACKWARD


class PipelineStages:
    """The :class:`~commspan.ownership.CollectiveRule` for watched pipeline stages."""

    def owner(self, issued: Issued, facts: ParallelFacts) -> Ownership | None:
        """See :meth:`commspan.ownership.CollectiveRule.owner`."""
        if issued.op not in _P2P or not facts.has_pipeline:
            return None
        tag = facts.pipeline_tag(issued.tensor) if issued.tensor is not None else None
        if tag is not None:
            return Ownership(
                tag.stage_fqn,
                phase_of(tag),
                semconv.SOURCE_PIPELINE,
                tag.kind,
                {
                    semconv.PP_STAGE: tag.stage,
                    semconv.PP_MICROBATCH: tag.microbatch,
                    semconv.PP_PEER_STAGE: tag.peer_stage,
                },
            )
        stage = facts.pipeline_setup()
        if stage is not None:
            return Ownership(stage, Phase.SETUP, semconv.SOURCE_PIPELINE,
                             semconv.OWNER_KIND_STAGE_SETUP)
        return None
