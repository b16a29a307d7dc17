"""Global nn.Module hooks -> an ordered stack of (module, phase) frames.

Forward: a global forward pre-hook opens a frame, a global forward hook
(``always_call=True``) closes it. A module that has forward hooks of its own
(tensor-parallel output hooks, for instance) is closed by a hook of ours
registered after them, so the collectives those hooks issue belong to it.
A forward that runs while autograd executes backward is a recompute
(activation checkpointing).

Backward: each forward call leaves gradient hooks on its outputs (the module's
backward starts when one of their gradients is ready) and on its inputs (it
ends when all of theirs are). Backward frames nest the way the forward calls
nested: when a module's backward starts, the frames of modules that are not
its forward ancestors are finished. What is left open when autograd finishes
is closed by an engine callback. Hooks hold no tensor and no module, and hooks
left on leaf tensors are removed, so nothing grows step after step.

Threads: the tracker follows the thread it was installed on (its owner) and
the autograd work done for the owner's graphs; module calls on other threads
are ignored (one comparison per call). Nothing here recurses per module depth,
and while installed the tracker raises Python's recursion limit by the frame
each traced module call costs, so a model runs as deep traced as untraced.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from commspan import semconv
from commspan._dtensor import param_summary
from commspan.semconv import Phase
from commspan.spans import Frame, SpanRecorder, describe_error

__all__ = ["ModuleHooks", "ModuleTracker"]

_log = logging.getLogger(__name__)
_Tensor = torch.Tensor
_graph_task_id = torch._C._current_graph_task_id
_get_ident = threading.get_ident

# Frames the hooks themselves may use on top of a module call (span building,
# processors, logging an internal error), beyond what an untraced call uses.
_HOOK_FRAMES = 100

try:  # non-reentrant checkpointing stops a recompute early with this exception
    from torch.utils.checkpoint import _StopRecomputationError as _StopRecomputation
except Exception:  # pragma: no cover - depends on the torch build

    class _StopRecomputation(Exception):  # type: ignore[no-redef]
        pass


try:  # torch.compile'd regions: leave them alone, as torch's own trackers do
    from torch._dynamo.eval_frame import _is_in_optimized_module as _in_compiled
except Exception:  # pragma: no cover - depends on the torch build

    def _in_compiled() -> bool:
        return False


class _RecursionHeadroom:
    """Keeps Python's recursion limit high enough for traced module calls.

    With a global module hook registered, ``Module._call_impl`` runs each
    forward through one more Python frame (its ``inner`` closure) than it does
    without hooks, so a model ``d`` modules deep needs ``d`` more frames traced
    than untraced: plain ``nn.Sequential`` nesting ran 249 deep untraced and
    199 deep under two no-op global hooks at the default limit of 1000. While
    a tracker is installed, the limit is the user's limit plus the deepest
    module nesting seen plus :data:`_HOOK_FRAMES`; when the last tracker is
    removed the user's limit is restored, unless something else changed it in
    the meantime (then it is left alone). The limit is per interpreter, so one
    object serves every tracker (one mode per thread).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._base = 0  # the limit before this object raised it
        self._set = 0  # the limit this object set, 0 if it set none

    def acquire(self) -> None:
        with self._lock:
            self._holders += 1

    def need(self, extra: int) -> None:
        """Make the limit at least the user's limit + ``extra``."""
        with self._lock:
            if not self._holders:
                return
            current = sys.getrecursionlimit()
            if current != self._set:  # not ours: the user's limit (set or changed by them)
                self._base, self._set = current, 0
            target = self._base + extra
            if target > current:
                sys.setrecursionlimit(target)
                self._set = target

    def release(self) -> None:
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders or not self._set:
                return
            try:
                if sys.getrecursionlimit() == self._set:
                    sys.setrecursionlimit(self._base)
            except Exception:  # the calling thread is deeper than the old limit
                _log.debug("commspan: could not restore the recursion limit", exc_info=True)
            self._set = 0


_HEADROOM = _RecursionHeadroom()


def _named_modules(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` without recursion (same names, same order)."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    todo: list[tuple[str, torch.nn.Module]] = [("", root)]
    while todo:
        name, mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append((name, mod))
        children = [
            (f"{name}.{key}" if name else key, child)
            for key, child in mod._modules.items()
            if child is not None
        ]
        todo.extend(reversed(children))
    return out


class ModuleHooks(Protocol):
    """Optional observer of module events (the compat ModTracker uses it)."""

    def pre_fw(self, module: torch.nn.Module, args: Any) -> None: ...
    def post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None: ...
    def pre_bw(self, module: torch.nn.Module | None, grads: Any) -> None: ...
    def post_bw(self, module: torch.nn.Module | None, grads: Any) -> None: ...


class _ModInfo:
    __slots__ = (
        "fqn",
        "type",
        "params",
        "param_ids",
        "local_hooked",
        "attrs",
        "names",
        "depth",
        "ref",
    )

    def __init__(self, fqn: str, mtype: str) -> None:
        self.fqn = fqn
        self.type = mtype
        self.params: dict[str, Any] | None = None
        self.param_ids: tuple[int, ...] = ()  # the parameters params describes
        self.local_hooked = False
        self.attrs: dict[Phase, dict[str, Any]] = {
            phase: {
                semconv.MODULE_FQN: fqn,
                semconv.MODULE_TYPE: mtype,
                semconv.PHASE: phase.value,
            }
            for phase in Phase
        }
        self.names = {phase: semconv.module_span_name(fqn, phase) for phase in Phase}
        self.depth = 0  # nesting depth at the module's first forward
        self.ref: Any = None  # weakref.ref to the module, made once


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
        "inputs_left",
        "depth",
        "task",
        "input_ids",
    )

    def __init__(
        self, info: _ModInfo, module: Any, parent: _Call | None, frame: Frame, depth: int
    ) -> None:
        self.info = info
        self.module = module  # weakref.ref to the module
        self.parent = parent
        self.frame = frame
        self.bw_frame: Frame | None = None
        self.bw_started = False
        self.bw_finished = False
        self.inputs_left = 0
        self.depth = depth
        self.task = -1  # graph task a recompute ran in
        self.input_ids: dict[int, int] = {}  # id(tensor) -> its version at call time


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside ``obj`` (args tuples, dicts, lists)."""
    if isinstance(obj, _Tensor):
        return [obj] if obj.requires_grad else []
    out: list[torch.Tensor] = []
    if isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, _Tensor):
                if item.requires_grad:
                    out.append(item)
            elif isinstance(item, (tuple, list, dict)):
                out.extend(_tensors(item))
    elif isinstance(obj, dict):
        for item in obj.values():
            out.extend(_tensors(item))
    return out


class ModuleTracker:
    """Turns module hooks into frames on a :class:`SpanRecorder`.

    Args:
        recorder: where frames go.
        observer: optional :class:`ModuleHooks` called at each module event.
        record_params: put parameter names, shapes and placements on forward spans.
    """

    def __init__(
        self,
        recorder: SpanRecorder,
        observer: ModuleHooks | None = None,
        record_params: bool = True,
        on_mesh: Callable[[Any], None] | None = None,
    ) -> None:
        self.recorder = recorder
        self.on_mesh = on_mesh
        self.observer = observer
        self.record_params = record_params
        self._known: weakref.WeakKeyDictionary[torch.nn.Module, _ModInfo] = (
            weakref.WeakKeyDictionary()
        )
        self._calls: list[_Call] = []
        self._handles: list[Any] = []
        self._local: list[Any] = []
        self._leaf_handles: list[Any] = []
        self._tasks: set[int] = set()
        self._bw_open: list[_Call] = []
        self.active = False
        self.internal_errors = 0
        # (id, "Type: message") of the exception last put on a span: the spans it
        # crosses on its way out get ERROR, not another event. An id, not the
        # exception (its traceback holds the step's tensors) nor a weak
        # reference (built-in exceptions take none); forgotten at the next
        # module call, so a freed exception's id cannot be mistaken for it.
        self._error_mark: tuple[int, str | None] | None = None
        self.owner = 0  # thread the tracker follows (set by install)
        self._log_pending = False  # an internal error could not be logged yet
        self._deepest = 0  # deepest module nesting the recursion limit allows for
        self._headroom = False

    # ------------------------------------------------------------ install
    def install(self) -> None:
        """Register the global hooks (idempotent)."""
        if self._handles:
            return
        self.owner = _get_ident()
        self._handles = [
            register_module_forward_pre_hook(self._pre_fw),
            register_module_forward_hook(self._post_fw, always_call=True),
        ]
        if not self._headroom:
            _HEADROOM.acquire()
            self._headroom = True
            self._deepest = 0
        self.active = True

    def pause(self) -> None:
        """Stop tracking and remove the global hooks until :meth:`install`.

        With a global module hook registered, every module call takes
        PyTorch's slower hook-handling path; an untraced step should not.
        """
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles = []
        self._release_headroom()

    def uninstall(self) -> None:
        """Remove every hook this tracker registered; forget open calls."""
        self.active = False
        self._release_headroom()
        self._error_mark = None
        for h in self._handles + self._local + self._leaf_handles:
            h.remove()
        self._handles, self._local, self._leaf_handles = [], [], []
        for info in list(self._known.values()):
            info.local_hooked = False
        self._calls.clear()
        self._bw_open.clear()
        self._tasks.clear()

    def reset_step(self) -> None:
        """Drop per-step state (leaf hooks of a backward that never ran, open calls)."""
        for h in self._leaf_handles:
            h.remove()
        self._leaf_handles = []
        self._calls.clear()
        self._bw_open.clear()
        self._tasks.clear()
        self._error_mark = None

    def _release_headroom(self) -> None:
        if self._headroom:
            self._headroom = False
            _HEADROOM.release()

    def _follows(self) -> bool:
        """Whether a module call on a thread other than the owner is the
        owner's work: a recompute inside a backward of the owner's graph, run
        on an autograd worker thread."""
        return _graph_task_id() in self._tasks

    # ------------------------------------------------------------ names
    def fqn(self, module: torch.nn.Module) -> str | None:
        """The name the tracker knows ``module`` by, or ``None``."""
        info = self._known.get(module)
        return info.fqn if info is not None else None

    def _info(self, module: torch.nn.Module) -> _ModInfo:
        info = self._known.get(module)
        if info is not None:
            return info
        root = type(module).__name__
        known = self._known
        for name, sub in _named_modules(module):
            if sub not in known:
                known[sub] = _ModInfo(f"{root}.{name}" if name else root, type(sub).__name__)
        return known[module]

    def open_fqns(self) -> set[str]:
        """Names of the modules with an open (not finished) frame, plus ``Global``."""
        return {f.fqn for f in self.recorder.stack if not f.done}

    # ------------------------------------------------------------ forward
    def _pre_fw(self, module: torch.nn.Module, args: Any) -> None:
        if (
            not self.active
            or (_get_ident() != self.owner and not self._follows())
            or _in_compiled()
        ):
            return
        try:
            self._error_mark = None
            info = self._info(module)
            task = _graph_task_id()
            phase = Phase.RECOMPUTE if task != -1 else Phase.FORWARD
            if task == -1 and self._tasks:
                self._abandon_backward()
            parent = self._calls[-1] if self._calls else None
            depth = parent.depth + 1 if parent is not None else 1
            if phase is Phase.FORWARD:
                if not info.depth:
                    info.depth = depth
            elif info.depth:
                depth = info.depth  # a recompute sits where its forward sat
            if depth > self._deepest:  # each traced level costs a frame more
                self._deepest = depth + 16
                _HEADROOM.need(self._deepest + _HOOK_FRAMES)
            attrs = info.attrs[phase].copy()
            attrs[semconv.MODULE_DEPTH] = depth
            if self.record_params and phase is Phase.FORWARD:
                # described again when the parameters are other objects (a
                # re-sharded or re-registered parameter)
                ids = tuple(map(id, module._parameters.values()))
                if info.params is None or ids != info.param_ids:
                    info.params = param_summary(module, self.on_mesh)
                    info.param_ids = ids
                if info.params:
                    attrs.update(info.params)
            frame = self.recorder.push(info.fqn, phase, attrs, task, name=info.names[phase])
            ref = info.ref
            if ref is None:
                ref = info.ref = weakref.ref(module)
            call = _Call(info, ref, parent, frame, depth)
            call.task = task
            self._calls.append(call)
            if module._forward_hooks and not info.local_hooked:
                # closes after the module's own forward hooks (e.g. TP output hooks)
                self._local.append(
                    module.register_forward_hook(self._local_post_fw, always_call=True)
                )
                info.local_hooked = True
            if torch.is_grad_enabled():
                self._watch_inputs(call, args)
            if self.observer is not None:
                self.observer.pre_fw(module, args)
        except RecursionError:
            # The model itself ran out of stack (the limit allows for what
            # tracing adds): its own RecursionError follows; not commspan's error.
            pass
        except Exception:  # never break the user's step
            self._internal_error()

    def _post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if (
            not self.active
            or (_get_ident() != self.owner and not self._follows())
            or _in_compiled()
        ):
            return
        info = self._known.get(module)
        if info is None or info.local_hooked:
            return
        self._finish_forward(info, module, args, output)

    def _local_post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if (
            not self.active
            or (_get_ident() != self.owner and not self._follows())
            or _in_compiled()
        ):
            return
        info = self._known.get(module)
        if info is not None:
            self._finish_forward(info, module, args, output)

    def _finish_forward(
        self, info: _ModInfo, module: torch.nn.Module, args: Any, output: Any
    ) -> None:
        try:
            calls = self._calls
            idx = len(calls) - 1
            while idx >= 0 and calls[idx].info is not info:
                idx -= 1
            if idx < 0:
                return
            call = calls[idx]
            del calls[idx:]
            error = sys.exc_info()[1] if output is None else None
            if error is not None:
                if isinstance(error, _StopRecomputation):
                    error = None  # checkpointing ends a recompute early this way: normal
                elif isinstance(error, RecursionError) and call.parent is not None:
                    # no stack left here to build spans: the outermost call (or
                    # the end of the trace) closes these frames, ERROR and event
                    return
            if self.observer is not None:
                self.observer.post_fw(module, args, output)
            if error is not None and not call.frame.closed:
                # frames above this one are calls the error crossed whose
                # hooks did not run: the innermost is where it came from
                self._record_exception(error)
            self.recorder.close_now(call.frame, error)
            error = None
            if output is not None and torch.is_grad_enabled():
                self._watch_outputs(call, output)
        except Exception:
            self._internal_error()

    def _record_exception(self, error: BaseException) -> None:
        """Put an ``exception`` event for ``error`` on the innermost open frame,
        unless it is already on a frame the error crossed before."""
        rec = self.recorder
        mark = (id(error), describe_error(error))
        if mark == self._error_mark:
            return
        self._error_mark = mark
        if rec.stack:
            rec.add_exception(rec.stack[-1], error)

    def unwind(self, error: BaseException | None) -> None:
        """The trace is about to end: account for what is still open.

        Frames still open are calls ``error`` crossed without their hooks
        running (an error in backward, a ``BaseException`` such as
        ``KeyboardInterrupt`` in forward): the innermost gets the ``exception``
        event (the recorder gives them all ERROR when it ends the trace).
        Without an error, a backward still open never finished (it raised and
        the error was caught): its frames end with ERROR saying so.
        """
        try:
            if error is not None:
                self._record_exception(error)
            elif self._tasks:
                self._abandon_backward()
        except Exception:
            self._internal_error()
        finally:
            self._error_mark = None
            self._log_deferred()

    # ------------------------------------------------------------ backward
    def _watch_inputs(self, call: _Call, args: Any) -> None:
        tensors = _tensors(args)
        if not tensors:
            return
        call.input_ids = {id(t): t._version for t in tensors}
        call.inputs_left = len(tensors)
        hook = functools.partial(self._input_grad_ready, call)
        for t in tensors:
            self._register(t, hook)

    def _watch_outputs(self, call: _Call, output: Any) -> None:
        tensors = _tensors(output)
        ids = call.input_ids
        if ids:
            # an input handed back unchanged (Identity, Dropout(p=0)) has no
            # backward in this module; its gradient belongs to whoever made it.
            # One modified in place (ReLU(inplace=True)) does: its version moved.
            tensors = [t for t in tensors if ids.get(id(t), -1) != t._version]
        if not tensors:
            return
        hook = functools.partial(self._output_grad_ready, call)
        for t in tensors:
            self._register(t, hook)

    def _register(self, t: torch.Tensor, hook: Callable[[Any], None]) -> None:
        node = t.grad_fn
        if node is not None:
            # fires when the gradient w.r.t. ``t`` is complete; dies with the graph
            node.register_prehook(hook)
        else:  # a leaf keeps its hooks: remove ours after backward
            self._leaf_handles.append(t.register_hook(hook))

    def _output_grad_ready(self, call: _Call, grad: Any) -> None:
        if call.bw_started or not self.active:
            return
        try:
            task = _graph_task_id()
            if call.task == task:
                # a recompute's hooks on tensors of the graph being executed:
                # the original forward call's hooks already cover them
                return
            if task not in self._tasks:
                self._tasks.add(task)
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(self._backward_done, task)
                )
            # The module's backward starts; so do those of its forward ancestors
            # that have not started yet (they enclose it).
            chain = [call]
            ancestor = call.parent
            while ancestor is not None and ancestor.bw_frame is None:
                chain.append(ancestor)
                ancestor = ancestor.parent
            while ancestor is not None and ancestor.bw_frame is not None and (
                ancestor.bw_frame.closed
            ):
                ancestor = ancestor.parent
            under = ancestor.bw_frame if ancestor is not None else self._task_base(task)
            for c in reversed(chain):
                self._open_backward(c, task, under, grad)
                under = None
        except Exception:
            self._internal_error()

    def _open_backward(self, call: _Call, task: int, under: Frame | None, grad: Any) -> None:
        call.bw_started = True
        info = call.info
        attrs = info.attrs[Phase.BACKWARD].copy()
        attrs[semconv.MODULE_DEPTH] = call.depth
        call.bw_frame = self.recorder.push(
            info.fqn, Phase.BACKWARD, attrs, task, under, info.names[Phase.BACKWARD]
        )
        self._bw_open.append(call)
        if self.observer is not None:
            self.observer.pre_bw(call.module(), grad)

    def _task_base(self, task: int) -> Frame | None:
        """The frame a parentless backward frame of ``task`` goes under."""
        stack = self.recorder.stack
        for idx in range(1, len(stack)):
            if stack[idx].task == task and stack[idx].phase is Phase.BACKWARD:
                return stack[idx - 1]
        return None

    def _input_grad_ready(self, call: _Call, grad: Any) -> None:
        if call.bw_finished or not self.active:
            return
        try:
            if call.task == _graph_task_id():
                return
            call.inputs_left -= 1
            if call.inputs_left > 0:
                return
            self._finish_backward(call, grad)
        except Exception:
            self._internal_error()

    def _finish_backward(self, call: _Call, grad: Any) -> None:
        call.bw_finished = True
        if self.observer is not None:
            self.observer.post_bw(call.module(), grad)
        if call.bw_frame is not None:
            self.recorder.pop(call.bw_frame)

    def _backward_done(self, task: int) -> None:
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
                for h in self._leaf_handles:
                    h.remove()
                self._leaf_handles = []
        except Exception:
            self._internal_error()

    def _abandon_backward(self) -> None:
        """A forward runs outside autograd while backward frames are open: that
        backward raised (its end-of-backward callback never ran). Close them."""
        for task in sorted(self._tasks):
            self.recorder.close_task(task, "backward did not finish")
        self._tasks.clear()
        self._bw_open = []
        for h in self._leaf_handles:
            h.remove()
        self._leaf_handles = []

    # ------------------------------------------------------------ misc
    def _internal_error(self) -> None:
        self.internal_errors += 1
        if self.internal_errors == 1 or self._log_pending:
            try:
                _log.warning(
                    "commspan: internal error while tracking modules; tracing of this "
                    "call is incomplete (further errors are counted, not logged)",
                    exc_info=True,
                )
                self._log_pending = False
            except Exception:  # no stack left to log with: log at the end of the trace
                self._log_pending = True

    def _log_deferred(self) -> None:
        if self._log_pending:
            self._log_pending = False
            _log.warning(
                "commspan: internal error while tracking modules (the stack was too "
                "deep to log it when it happened); tracing of that call is incomplete "
                "(further errors are counted, not logged)"
            )
