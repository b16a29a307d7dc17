"""Backward nesting, inferred from the forward pass.

Autograd does not say which module a backward node belongs to, and module
backward hooks fire in an order that does not nest. This module implements
the five steps of docs/design.md, "How backward nesting is inferred"; the
comments cite them as (step N):

1. a forward call leaves gradient pre-hooks on the autograd nodes of its
   outputs and of its inputs; an output that already carries gradient hooks
   (FSDP2's) gets a hook on the tensor, before them, instead
   (:meth:`BackwardNesting._watch_outputs`, :meth:`BackwardNesting._watch_inputs`);
2. the module's backward starts when the gradient of one of its outputs is
   ready, together with its forward ancestors whose backward has not started
   (:meth:`BackwardNesting._output_grad_ready`);
3. its backward frame goes under the backward frame of its nearest forward
   ancestor, closing the frames of non-ancestors opened above that one;
4. it ends when the gradients of all its inputs are computed, or when the
   node of one of them runs (:meth:`BackwardNesting._input_grad_ready`);
   what is still open when
   autograd finishes the graph task is closed by an engine callback
   (:meth:`BackwardNesting._backward_done`);
5. a forward that runs while autograd executes is a recompute when
   activation checkpointing runs it (:func:`recomputing`), else backward work
   (a module called from a gradient hook); :func:`commspan.ownership.phase_now`,
   called by the module hooks, decides.

Hooks hold no tensor and no module. Hooks left on leaf tensors hold their
call only weakly and are removed after each backward; those whose call died
with its graph (a forward that no backward followed) are removed as more are
added. A call that nothing but leaf hooks watch (a module returning a
parameter) is kept alive until the next forward of its top-level module (at
most 1,024 of them): a backward then belongs to that model's last forward. So
nothing grows step after step, nor call after call in a mode held open
without steps or backward, and forwards no backward followed (an evaluation
without ``no_grad``) add no backward spans to the next backward.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as _pytree

from commspan import semconv
from commspan._errors import ErrorCounter
from commspan.capture import ModuleObserver
from commspan.semconv import Phase
from commspan.spans.frames import Frame
from commspan.spans.recorder import SpanRecorder

_LEAF_PRUNE_AT = 256
"""Hooks on leaf tensors at which those of dead calls are first removed."""
_LEAF_CALLS = 1024
"""Calls that only hooks on leaf tensors watch (a module returning a parameter)
kept alive: those of each top-level module's last forward, the last 1,024 at most."""

_RUNNING = (Phase.FORWARD, Phase.RECOMPUTE)
"""Phases of a module call that may run a backward inside it."""

if TYPE_CHECKING:
    from commspan.capture.modules import ModuleInfo

__all__ = ["BackwardNesting", "graph_task_id", "hook_first", "recomputing", "recomputing_module"]

_Tensor = torch.Tensor
# types torch's pytree flattens (registered dataclasses, ...): type -> its NodeDef
_PYTREE_NODES: dict[type, Any] = _pytree.SUPPORTED_NODES

_get_ident = threading.get_ident

graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""The id of the autograd graph task running on this thread, ``-1`` outside autograd."""

try:
    _current_node: Callable[[], Any] | None = torch._C._current_autograd_node
    _top_saved_hooks: Callable[[bool], Any] | None = (
        torch._C._autograd._top_saved_tensors_default_hooks)
except AttributeError:  # pragma: no cover - depends on the torch build
    _current_node = _top_saved_hooks = None


def recomputing(unknown: bool = True) -> bool:
    """Whether a module called now, while autograd executes, is activation
    checkpointing re-running a forward (step 5).

    Yes inside the backward of a reentrant checkpoint (an autograd ``Function``
    whose name says ``Checkpoint``: torch's ``CheckpointFunction``, Megatron's
    and DeepSpeed's), and while a non-reentrant checkpoint (selective ones
    included) recomputes a saved tensor (torch's recomputation hooks are the
    innermost saved-tensor hooks). No otherwise: a module called from a
    gradient hook does backward work. A torch build without the two probes
    (or a probe that fails) answers ``unknown``: yes for a module call, as
    commspan did before it could tell; a collective outside every recomputed
    module asks with ``unknown=False``, so that such a build does not call every
    collective of a backward span a recompute's.

    Example:
        >>> recomputing()  # no autograd running here: nothing is recomputed
        False
    """
    if _current_node is None or _top_saved_hooks is None:
        return unknown
    try:
        node = _current_node()
        if node is not None and "Checkpoint" in type(node).__name__:
            return True
        hooks = _top_saved_hooks(True)
        return hooks is not None and "recomputation" in getattr(hooks[0], "__qualname__", "")
    except Exception:  # a probe that changed shape
        return unknown


try:
    import torch.utils.checkpoint as _checkpoint_module

    _CHECKPOINT_FILE: str | None = _checkpoint_module.__file__
except Exception:  # pragma: no cover - depends on the torch build
    _CHECKPOINT_FILE = None
_Module = torch.nn.Module
_RECOMPUTE_FRAMES = 64
"""Python frames looked through, from a collective up to checkpointing's own code."""


def recomputing_module() -> Any:
    """The module whose code checkpointing is re-running now, outside every module
    call (a checkpointed method, ``checkpoint(self.attn_core, h)``): the innermost
    ``self`` that is an ``nn.Module`` among the Python frames between the caller and
    ``torch.utils.checkpoint``'s code that re-runs the function; ``None`` if there
    is none (a free function; no such frame within :data:`_RECOMPUTE_FRAMES`).
    Looked up only for a collective issued while recomputing with no recompute
    span open.

    Example:
        >>> recomputing_module() is None  # not inside a recompute
        True
    """
    if _CHECKPOINT_FILE is None:  # pragma: no cover - depends on the torch build
        return None
    frame: Any = sys._getframe(1)
    for _ in range(_RECOMPUTE_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_filename == _CHECKPOINT_FILE:
            return None  # checkpointing's own frame: the function it re-runs is below
        if "self" in code.co_varnames or "self" in code.co_freevars:
            owner = frame.f_locals.get("self")
            if isinstance(owner, _Module):
                return owner
        frame = frame.f_back
    return None


def _restart(call: _Call) -> None:
    """Forget a call's backward of an earlier pass through a retained graph."""
    call.bw_started = False
    call.bw_finished = False
    call.bw_frame = None
    call.inputs_left = call.inputs
    call.bw_unheard = False
    call.bw_thread = 0


class _Call:
    """One forward (or recompute) call of a module, as its backward sees it."""

    __slots__ = (
        "info",
        "module",
        "parent",
        "frame",
        "bw_frame",
        "bw_started",
        "bw_finished",
        "bw_task",
        "inputs",
        "inputs_left",
        "depth",
        "task",
        "input_ids",
        "local",
        "on_graph",
        "on_leaf",
        "bw_unheard",
        "bw_thread",
        "in_place",
        "wraps",
        "__weakref__",  # hooks on leaf tensors hold the call weakly
    )

    def __init__(
        self, info: ModuleInfo, module: Any, parent: _Call | None, frame: Frame, depth: int
    ) -> None:
        self.info = info
        self.module = module  # weakref.ref to the module
        self.parent = parent
        self.frame = frame
        self.bw_frame: Frame | None = None
        self.bw_started = False
        self.bw_finished = False
        self.bw_task = -1  # the graph task of the backward bw_* describe
        self.inputs = 0  # input tensors watched
        self.inputs_left = 0
        self.depth = depth
        self.task = -1  # graph task a recompute ran in
        # id(tensor) -> (its version at call time, a weak reference to it): the
        # reference tells an input handed back from a new tensor that took the id of
        # an input freed during the forward (U-Net's popped skips); cleared at the end
        self.input_ids: dict[int, tuple[int, Any]] = {}
        self.local: Any = None  # handle of the forward hook that closes this call, if any
        self.on_graph = False  # a pre-hook on an autograd node holds it
        self.on_leaf = False  # a hook on a leaf tensor watches it (weakly)
        self.bw_unheard = False  # its backward started; the observer not told yet
        self.bw_thread = 0  # the thread its backward started on (step 4)
        self.in_place = False  # opened around a module's in-place compiled call
        self.wraps = False  # the call of torch.compile(module)'s wrapper: the module's span


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside ``obj``: args tuples, dicts, lists, and
    what torch's pytree flattens (dataclasses and other registered types)."""
    if isinstance(obj, _Tensor):
        return [obj] if obj.requires_grad else []
    out: list[torch.Tensor] = []
    if isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, _Tensor):
                if item.requires_grad:
                    out.append(item)
            elif isinstance(item, (tuple, list, dict)) or type(item) in _PYTREE_NODES:
                out.extend(_tensors(item))
    elif isinstance(obj, dict):
        for item in obj.values():
            out.extend(_tensors(item))
    else:
        node = _PYTREE_NODES.get(type(obj))
        if node is not None:
            for item in node.flatten_fn(obj)[0]:
                out.extend(_tensors(item))
    return out


def _handed_back(seen: tuple[int, Any] | None, t: torch.Tensor) -> bool:
    """Whether output ``t`` is the input recorded as ``seen`` (its version at the call
    and a weak reference to it), unchanged."""
    return seen is not None and seen[0] == t._version and seen[1]() is t


def hook_first(hooks: Any, key: Any) -> None:
    """Move the hook ``key`` to the front of a tensor's hook dictionary; the other
    hooks keep their order. Autograd runs a tensor's hooks in the order of the
    underlying ``dict`` (``OrderedDict.move_to_end`` does not change it), and a
    user's hooks may change the gradient (scaling, clipping), so only commspan's own
    hook moves: the others are inserted again, in order, under the same keys (their
    handles still remove them)."""
    items = [(k, h) for k, h in hooks.items() if k != key]
    if len(items) != len(hooks) - 1:
        return
    ours = hooks[key]
    hooks.clear()
    hooks[key] = ours
    hooks.update(items)


class BackwardNesting:
    """The backward half of :class:`~commspan.capture.modules.ModuleTracker`.

    A mixin: the tracker calls :meth:`_init_backward` and owns the state
    declared here; the forward half calls :meth:`_watch_inputs` and
    :meth:`_watch_outputs` (step 1).
    """

    recorder: SpanRecorder
    observer: ModuleObserver | None
    active: bool
    _errors: ErrorCounter
    _tasks: set[int]  # graph tasks running a backward this tracker follows
    _bw_open: list[_Call]  # calls whose backward frame is open
    _leaf_handles: list[tuple[Any, Any]]  # (hook on a leaf tensor, weakref to its call)
    _leaf_prune_at: int  # len(_leaf_handles) that prunes those of dead calls
    _leaf_calls: deque[tuple[int, _Call]]  # (id of its top-level module, call): the last
    # calls only leaf hooks watch, kept alive
    span_tags: dict[str, Any] | None  # extra attributes of frames opened now (pipeline)

    def _init_backward(self) -> None:
        self._tasks = set()
        self._bw_open = []
        self._leaf_handles = []
        self._leaf_prune_at = _LEAF_PRUNE_AT
        self._leaf_calls = deque(maxlen=_LEAF_CALLS)

    def _forget_backward(self) -> None:
        """Drop every open backward and the hooks left on leaf tensors."""
        self._remove_leaf_hooks()
        self._bw_open.clear()
        self._tasks.clear()

    def _remove_leaf_hooks(self) -> None:
        for h, _call in self._leaf_handles:
            h.remove()
        self._leaf_handles = []
        self._leaf_prune_at = _LEAF_PRUNE_AT
        self._leaf_calls.clear()

    def _prune_leaf_hooks(self) -> None:
        """Remove the leaf hooks whose call is gone: the autograd graph of its outputs,
        whose hooks held it, was freed without a backward (a forward under the mode
        with no step and no backward, an evaluation without ``no_grad``). No backward
        can reach that call any more. Amortised: the threshold doubles."""
        kept = []
        for pair in self._leaf_handles:
            if pair[1]() is None:
                pair[0].remove()
            else:
                kept.append(pair)
        self._leaf_handles = kept
        self._leaf_prune_at = max(_LEAF_PRUNE_AT, 2 * len(kept))

    def _follows(self) -> bool:
        """Whether a module call on a thread other than the owner is the
        owner's work: a recompute inside a backward of the owner's graph, run
        on an autograd worker thread."""
        return graph_task_id() in self._tasks

    # ------------------------------------------------------------ step 1
    def _watch_inputs(self, call: _Call, args: Any, versions: bool = True) -> None:
        """Watch the gradients of a call's input tensors: positional ones when it
        starts, keyword ones (which only the forward hook sees) when it ends, then
        with ``versions=False``: their versions now may already include the
        module's own in-place change, so they do not mark outputs as inputs
        handed back unchanged."""
        tensors = _tensors(args)
        if not tensors:
            return
        if versions:
            ref = weakref.ref
            ids = call.input_ids
            for t in tensors:  # (a loop, not a comprehension: no frame of its own)
                ids[id(t)] = (t._version, ref(t))
        call.inputs += len(tensors)
        call.inputs_left += len(tensors)
        self._hook(call, tensors, self._input_grad_ready, self._leaf_input_ready)

    def _watch_outputs(self, call: _Call, output: Any) -> None:
        tensors = _tensors(output)
        ids = call.input_ids
        if ids:
            # (step 1) an input handed back unchanged (Identity, Dropout(p=0))
            # has no backward in this module; its gradient belongs to whoever
            # made it. One modified in place (ReLU(inplace=True)) does: its
            # version moved. (The same object: a new tensor may have the id of an
            # input freed meanwhile.) Loops, not comprehensions (frames of their own),
            # where the usual case (none) builds nothing.
            for t in tensors:
                seen = ids.get(id(t))
                if seen is not None and _handed_back(seen, t):
                    tensors = [t for t in tensors if not _handed_back(ids.get(id(t)), t)]
                    break
            ids.clear()
        if not tensors:
            return
        hooked = None
        for t in tensors:
            if t.grad_fn is not None and t._backward_hooks:
                if hooked is None:
                    hooked = [t]
                else:
                    hooked.append(t)
        if hooked is not None:
            # (step 2) gradient hooks other code put on the output (the module's own
            # forward hooks: FSDP2's re-gather of a unit's parameters) run before the
            # node's pre-hooks: the backward starts from a hook on the tensor, put
            # before them, so that what they issue is in this module's backward
            hook = functools.partial(self._output_tensor_ready, call)
            for t in hooked:
                hook_first(t._backward_hooks, t.register_hook(hook).id)
            call.on_graph = True
            tensors = [t for t in tensors if t.grad_fn is None or not t._backward_hooks]
        if tensors:
            self._hook(call, tensors, self._output_grad_ready, self._leaf_output_ready)
        if call.on_leaf and not call.on_graph:
            # only leaf tensors watch it (a module returning a parameter): nothing
            # else holds it; kept alive until its top-level module's next forward
            top = call
            while top.parent is not None:
                top = top.parent
            self._leaf_calls.append((id(top.info), call))

    def _output_tensor_ready(self, call: _Call, grad: Any) -> None:
        """A hook on an output tensor: its gradient is ready (passed on as a tuple,
        as a node's pre-hook receives it)."""
        self._output_grad_ready(call, (grad,))

    def _new_top_level_forward(self, info: ModuleInfo) -> None:
        """A top-level module starts a forward outside autograd: the calls only leaf
        hooks watch from its last forward are not the next backward's (forwards no
        backward followed, an evaluation without ``no_grad``)."""
        key = id(info)
        kept = [pair for pair in self._leaf_calls if pair[0] != key]
        if len(kept) != len(self._leaf_calls):
            self._leaf_calls = deque(kept, maxlen=_LEAF_CALLS)

    def _hook(self, call: _Call, tensors: list[torch.Tensor], ready: Callable[..., None],
              leaf_ready: Callable[..., None]) -> None:
        """Call ``ready(call, grad)`` when the gradient of each of ``tensors`` is
        complete: a pre-hook on its autograd node, which holds the call and dies with
        the graph; on a leaf tensor (which keeps its hooks), a hook holding the call
        weakly, removed after backward or once the call is gone."""
        hook = functools.partial(ready, call)
        leaves = None
        for t in tensors:  # (most have a node: nothing else is done per tensor)
            node = t.grad_fn
            if node is not None:
                node.register_prehook(hook)
            elif leaves is None:
                leaves = [t]
            else:
                leaves.append(t)
        if leaves is None:
            call.on_graph = True
            return
        if len(leaves) < len(tensors):
            call.on_graph = True
        call.on_leaf = True
        ref = weakref.ref(call)
        leaf_hook = functools.partial(leaf_ready, ref)
        handles = self._leaf_handles
        for t in leaves:
            handles.append((t.register_hook(leaf_hook), ref))
        if len(handles) >= self._leaf_prune_at:
            self._prune_leaf_hooks()

    def _leaf_input_ready(self, ref: Any, grad: Any) -> None:
        call = ref()
        if call is not None:
            self._input_grad_ready(call, grad, True)

    def _leaf_output_ready(self, ref: Any, grad: Any) -> None:
        call = ref()
        if call is not None:
            self._output_grad_ready(call, grad)

    # ------------------------------------------------------------ steps 2 and 3
    def _output_grad_ready(self, call: _Call, grad: Any, observe: bool = True) -> None:
        if not self.active:
            return
        if call.bw_unheard and observe:
            # its backward started from the module's pre-hooks: the observer hears of
            # it now, with the gradient they passed on
            call.bw_unheard = False
            if self.observer is not None:
                try:
                    self.observer.pre_bw(call.module(), grad)
                except Exception:
                    self._errors.record()
                self._raise_observed()
            return
        try:
            task = graph_task_id()
            if call.bw_started:
                if call.bw_task == task or (
                        call.bw_frame is not None and not call.bw_frame.closed):
                    # this pass's, or an outer pass's still open (a nested graph
                    # task: autograd.grad inside a backward hook)
                    return
                # a later backward through the same graph (retain_graph=True): the
                # call's backward runs again
                _restart(call)
            if call.task == task:
                # a recompute's hooks on tensors of the graph being executed:
                # the original forward call's hooks already cover them
                return
            if task not in self._tasks:
                self._tasks.add(task)
                # (step 4) whatever is still open when this graph task ends is
                # closed by a callback queued now, at the start of its backward
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(self._backward_done, task)
                )
            # (step 2) the module's backward starts; so do those of its forward
            # ancestors that have not started yet (they enclose it), up to one
            # still running its forward (a backward inside a forward: autograd.grad
            # in a physics-informed model's forward; its backward comes later)
            chain = [call]
            ancestor = call.parent
            while ancestor is not None and ancestor.frame.closed and (
                    ancestor.bw_frame is None or (
                    ancestor.bw_task != task and ancestor.bw_frame.closed)):
                if ancestor.bw_frame is not None:  # its backward in an earlier pass
                    _restart(ancestor)
                chain.append(ancestor)
                ancestor = ancestor.parent
            while ancestor is not None and ancestor.frame.closed and (
                ancestor.bw_frame is not None and ancestor.bw_frame.closed
            ):
                ancestor = ancestor.parent
            # (step 3) under the backward frame of the nearest forward ancestor, or
            # the forward frame of one still running; the recorder closes the
            # frames of non-ancestors opened above it
            if ancestor is None:
                under = self._task_base(task)
            elif not ancestor.frame.closed:
                under = self._running_forward(ancestor.frame)
            else:
                under = ancestor.bw_frame
            if self.observer is not None and under is not None:
                self._observe_closing(under)
            for c in reversed(chain):
                self._open_backward(c, task, under, grad, observe or c is not call)
                under = None
        except Exception:
            self._errors.record()
        if self.observer is not None:
            self._raise_observed()

    def _take_observed(self) -> BaseException | None:
        """What the observer's user code raised during this event (compat's user
        hooks), taken from it, if anything."""
        take = getattr(self.observer, "take_error", None)
        return take() if take is not None else None

    def _raise_observed(self) -> None:
        """Raise what the observer's user code raised during this event, now that the
        mode's own bookkeeping is done."""
        error = self._take_observed()
        if error is not None:
            raise error

    def _running_forward(self, outer: Frame) -> Frame:
        """The innermost forward (or recompute) frame still open at or above
        ``outer`` on the stack: a backward run inside a forward nests under the
        forward running it, and closes no forward that is still running (frames
        above it are backward frames of this backward that are over)."""
        stack = self.recorder.stack
        for idx in range(len(stack) - 1, -1, -1):
            frame = stack[idx]
            if frame is outer:
                break
            if frame.phase in _RUNNING and not frame.closed:
                return frame
        return outer

    def _observe_closing(self, under: Frame) -> None:
        """(step 3) The frames above ``under`` are about to be closed: tell the
        observer that those calls' backward is over while their frames are still
        open (torch's ModTracker runs a module's hooks with it in ``parents``);
        their input gradients, which come later, then tell nothing more."""
        stack = self.recorder.stack
        for idx in range(len(stack) - 1, -1, -1):
            if stack[idx] is under:
                break
        else:
            return
        closing = {id(f) for f in stack[idx + 1:]}
        if not closing:
            return
        observer: Any = self.observer
        left = len(closing)
        # the frames above ``under`` were opened last: scan from the newest call,
        # and stop once each of them is found (no scan of the whole backward)
        for call in reversed(self._bw_open):
            if call.bw_frame is not None and id(call.bw_frame) in closing:
                if not call.bw_finished:
                    call.bw_finished = True
                    observer.post_bw(call.module(), None)
                left -= 1
                if not left:
                    break

    def _open_backward(self, call: _Call, task: int, under: Frame | None, grad: Any,
                       observe: bool = True) -> None:
        call.bw_started = True
        call.bw_task = task
        call.bw_thread = _get_ident()
        info = call.info
        attrs = info.attrs[Phase.BACKWARD].copy()
        attrs[semconv.MODULE_DEPTH] = call.depth
        if self.span_tags is not None:  # a pipeline stage's microbatch is running
            attrs.update(self.span_tags)
        call.bw_frame = self.recorder.push(
            info.fqn, Phase.BACKWARD, attrs, task, under, info.names[Phase.BACKWARD]
        )
        self._bw_open.append(call)
        if not observe:  # the observer hears of it later, with the gradient then
            call.bw_unheard = True
        elif self.observer is not None:
            self.observer.pre_bw(call.module(), grad)

    def _task_base(self, task: int) -> Frame | None:
        """(step 3) The frame a backward frame of ``task`` without a forward
        ancestor goes under: the frame below the task's first backward frame."""
        stack = self.recorder.stack
        for idx in range(1, len(stack)):
            if stack[idx].task == task and stack[idx].phase is Phase.BACKWARD:
                return stack[idx - 1]
        return None

    # ------------------------------------------------------------ step 4
    def _input_grad_ready(self, call: _Call, grad: Any, leaf: bool = False) -> None:
        """The gradient of one of the call's inputs is ready (``leaf``: from a hook on
        a leaf tensor, else from a pre-hook on the input's autograd node)."""
        if call.bw_finished or not self.active:
            return
        try:
            task = graph_task_id()
            if call.task == task or (call.bw_started and call.bw_task != task):
                # a recompute's hook, or a call whose backward started in another
                # pass (a retained graph's) and not in this one
                return
            call.inputs_left -= 1
            if call.inputs_left > 0 and (
                    leaf or not call.bw_started or call.bw_thread != _get_ident()):
                return
            # (step 4) all its inputs' gradients are ready; or the node of one of
            # them runs, in the thread its backward started in: that node was made
            # before the module's forward, and autograd runs the ready node made
            # last first, so every node of the module's backward has run. An input
            # that gets no gradient from it (unused, used through .detach()) ends
            # nothing, and its backward is over anyway.
            self._finish_backward(call, grad)
        except Exception:
            self._errors.record()
        if self.observer is not None:
            self._raise_observed()

    def _finish_backward(self, call: _Call, grad: Any) -> None:
        call.bw_finished = True
        if self.observer is not None:
            self.observer.post_bw(call.module(), grad)
        if call.bw_frame is not None:
            self.recorder.finish(call.bw_frame)

    def _backward_done(self, task: int) -> None:
        """(step 4) Autograd finished graph task ``task``: close what it left open."""
        try:
            self._tasks.discard(task)
            pending = [c for c in self._bw_open if c.bw_frame is not None
                       and c.bw_frame.task == task]
            if self.observer is not None:
                for call in reversed(pending):
                    if not call.bw_finished:
                        call.bw_finished = True
                        self.observer.post_bw(call.module(), None)
            self.recorder.close_task(task)
            done = {id(c) for c in pending}
            self._bw_open = [c for c in self._bw_open if id(c) not in done]
            if not self._tasks:
                self._remove_leaf_hooks()
        except Exception:
            self._errors.record()
        if self.observer is not None:
            self._raise_observed()

    def _abandon_backward(self) -> None:
        """A forward runs outside autograd while backward frames are open: that
        backward raised (its end-of-backward callback never ran). Close them."""
        for task in sorted(self._tasks):
            self.recorder.close_task(task, "backward did not finish")
        self._tasks.clear()
        self._bw_open = []
        self._remove_leaf_hooks()
