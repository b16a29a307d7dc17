"""Pipeline stages commspan was asked to watch (``torch.distributed.pipelining``).

``mode.watch_pipeline(schedule_or_stage)`` hands stages to a
:class:`PipelineWatch`. While the mode is entered, the watch sets instance
attributes on each stage that wrap its public methods, and removes them (the
class's methods show through again) when the mode is left:

- ``get_fwd_recv_ops`` / ``get_bwd_recv_ops`` / ``get_fwd_send_ops`` /
  ``get_bwd_send_ops(chunk_id)``: the schedule asks the stage for the
  point-to-point ops of one microbatch; the watch notes, for the tensor of each
  op, the stage, the microbatch and the direction. When the dispatch mode sees
  a ``send``/``recv`` of that very tensor object, it is that op (the tensor is
  kept until then, so its ``id`` cannot be reused);
- ``forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk(chunk_id)``: while one runs, module spans carry
  the stage index and the microbatch.

Point-to-point ops of a watched stage that were not announced, issued while
the stage prepares its first step (``_prepare_forward_infra`` /
``_prepare_backward_infra``: the stages exchange tensor shapes), are that
stage's setup; so are, when the rank has one stage, those issued before the
step's first microbatch.

Nothing global is changed: other stage objects, and the class, are untouched.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from commspan import semconv
from commspan.ownership import PipelineTag

__all__ = ["PipelineWatch", "stages_of"]

_log = logging.getLogger(__name__)

_OPS = (
    ("get_fwd_recv_ops", semconv.OWNER_KIND_ACTIVATION_RECV),
    ("get_fwd_send_ops", semconv.OWNER_KIND_ACTIVATION_SEND),
    ("get_bwd_recv_ops", semconv.OWNER_KIND_GRADIENT_RECV),
    ("get_bwd_send_ops", semconv.OWNER_KIND_GRADIENT_SEND),
)
_CHUNKS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
# a stage's set-up at its first step: the votes and metadata it exchanges with its
# neighbours
# (private methods of torch's stages: missing ones are skipped)
_SETUP = ("_warmup_forward_vote", "_warmup_backward_result", "_prepare_forward_infra",
          "_prepare_backward_infra")
# the stage a direction talks to, relative to this one (stage i exchanges with i - 1, i + 1)
_PEER = {
    semconv.OWNER_KIND_ACTIVATION_RECV: -1,
    semconv.OWNER_KIND_ACTIVATION_SEND: 1,
    semconv.OWNER_KIND_GRADIENT_RECV: 1,
    semconv.OWNER_KIND_GRADIENT_SEND: -1,
}


def stages_of(target: Any) -> list[Any]:
    """The pipeline stages of a schedule (one stage or several), or of a stage itself.

    Raises:
        TypeError: ``target`` is neither a ``PipelineStage`` nor a schedule of them.
    """
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except Exception as exc:  # pragma: no cover - a torch build without pipelining
        raise TypeError(f"torch.distributed.pipelining is not available: {exc}") from None
    if isinstance(target, _PipelineStageBase):
        return [target]
    stages = getattr(target, "_stages", None)
    if stages is None:
        one = getattr(target, "_stage", None)
        stages = [one] if one is not None else None
    if stages and all(isinstance(s, _PipelineStageBase) for s in stages):
        return list(stages)
    raise TypeError(
        f"schedule={target!r} is not a pipeline schedule or a PipelineStage; pass the "
        "schedule you call step() on (ScheduleGPipe, Schedule1F1B, ...) or its stages"
    )


class _Watched:
    """One watched stage: what is installed on it and its state in the step."""

    __slots__ = ("ref", "index", "fqn", "installed")

    def __init__(self, stage: Any) -> None:
        self.ref = weakref.ref(stage)
        self.index = int(stage.stage_index)
        self.fqn = ""  # the stage module's name, given when first installed
        self.installed: list[str] = []


class PipelineWatch:
    """Announced point-to-point ops and the microbatch running, for watched stages."""

    def __init__(self) -> None:
        self._stages: list[_Watched] = []
        # id(tensor) -> (tensor, tag): the tensor is kept until its op is dispatched
        self._tags: dict[int, tuple[Any, PipelineTag]] = {}
        self.current: dict[str, int] | None = None
        """Span attributes of the microbatch running now (stage, microbatch), or None."""
        self._started = False  # a microbatch ran in this step
        self._setting_up: _Watched | None = None  # the stage whose set-up runs now
        self._active = False
        self.namer: Callable[[Any, str], str] | None = None
        """The module tracker's name of a module (set by the tracker)."""
        self.on_microbatch: Callable[[dict[str, int] | None], None] | None = None
        """Told the span attributes of the microbatch starting (and ``None``, or the
        outer one, when it ends): the module tracker puts them on its frames."""

    @property
    def watching(self) -> bool:
        return bool(self._stages)

    # ------------------------------------------------------------ set-up
    def watch(self, *stages: Any) -> bool:
        """Watch ``stages`` (installed now if the mode is entered, else when it is);
        ``False`` if they all are already watched.

        A stage's module is named by its class, as any model is; when this rank
        watches several stages whose modules share a class (an interleaved
        schedule), each is named ``<class>[stage<index>]`` instead, so that their
        spans and owners stay apart (a module the mode already named keeps its name).
        """
        added = []
        for stage in stages:
            if any(w.ref() is stage for w in self._stages):
                continue
            watched = _Watched(stage)
            self._stages.append(watched)
            added.append(watched)
        if self._active:
            for watched in added:
                self._install(watched)
        return bool(added)

    def install(self) -> None:
        """Wrap the watched stages' methods (entering the mode)."""
        self._active = True
        self._stages = [w for w in self._stages if w.ref() is not None]
        for w in self._stages:
            self._install(w)

    def uninstall(self) -> None:
        """Remove every wrapper (leaving the mode); forget announced ops."""
        self._active = False
        for w in self._stages:
            stage = w.ref()
            for name in w.installed:
                if stage is not None and name in vars(stage):
                    delattr(stage, name)  # the class's method shows through again
            w.installed = []
        self.reset_step()

    def reset_step(self) -> None:
        """A step ended: forget ops announced but never issued, and the microbatch."""
        self._tags.clear()
        self._set_current(None)
        self._started = False

    def _set_current(self, current: dict[str, int] | None) -> None:
        self.current = current
        if self.on_microbatch is not None:
            self.on_microbatch(current)

    def _install(self, w: _Watched) -> None:
        stage = w.ref()
        if stage is None or w.installed:
            return
        if not w.fqn:
            cls = type(stage.submod).__name__
            root = cls
            if any(o is not w and (other := o.ref()) is not None
                   and type(other.submod).__name__ == cls for o in self._stages):
                root = f"{cls}[stage{w.index}]"  # several stages of one class on this rank
            w.fqn = self.namer(stage.submod, root) if self.namer is not None else root
        for name, kind in _OPS:
            original = getattr(stage, name, None)
            if original is None:
                _log.debug("commspan: pipeline stage has no %s; its ops are not tagged", name)
                continue
            setattr(stage, name, functools.partial(self._ops, original, w, kind))
            w.installed.append(name)
        for names, wrapper in ((_CHUNKS, self._chunk), (_SETUP, self._setup)):
            for name in names:
                original = getattr(stage, name, None)
                if original is None:
                    continue
                setattr(stage, name, functools.partial(wrapper, original, w))
                w.installed.append(name)

    # ------------------------------------------------------------ wrappers
    def _ops(self, original: Callable[..., Any], w: _Watched, kind: str,
             chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        ops = original(chunk_id, *args, **kwargs)
        try:
            tag = PipelineTag(w.fqn, w.index, int(chunk_id), kind, w.index + _PEER[kind])
            for op in ops:
                tensor = op.tensor
                self._tags[id(tensor)] = (tensor, tag)
        except Exception:  # an op without .tensor: left to the position
            _log.debug("commspan: could not tag pipeline ops", exc_info=True)
        return ops

    def _chunk(self, original: Callable[..., Any], w: _Watched,
               chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        previous = self.current
        self._set_current({semconv.PP_STAGE: w.index, semconv.PP_MICROBATCH: int(chunk_id)})
        self._started = True
        try:
            return original(chunk_id, *args, **kwargs)
        finally:
            self._set_current(previous)

    def _setup(self, original: Callable[..., Any], w: _Watched,
               *args: Any, **kwargs: Any) -> Any:
        previous = self._setting_up
        self._setting_up = w
        try:
            return original(*args, **kwargs)
        finally:
            self._setting_up = previous

    # ------------------------------------------------------------ facts
    def tag(self, tensor: Any) -> PipelineTag | None:
        """The announced op of ``tensor`` (forgotten once asked), or None."""
        hit = self._tags.pop(id(tensor), None)
        if hit is None or hit[0] is not tensor:
            return None
        return hit[1]

    def setup_stage(self) -> str | None:
        """The watched stage whose setup an unannounced point-to-point op is: one
        issued while the stage prepares its first step (it exchanges shapes with its
        neighbours), or before the step's first microbatch when the rank has one
        stage; else None."""
        if self._setting_up is not None:
            return self._setting_up.fqn
        if self._started or self.current is not None:
            return None
        live = [w for w in self._stages if w.ref() is not None]
        return live[0].fqn if len(live) == 1 else None
