"""Global nn.Module hooks -> an ordered stack of (module, phase) frames.

Forward: a global forward pre-hook opens a frame, a global forward hook
(``always_call=True``) closes it. A module that has forward hooks of its own
(tensor-parallel output hooks, for instance) is closed by a hook of ours
registered after them, so the collectives those hooks issue belong to it.
A forward that runs while autograd executes backward is a recompute when
activation checkpointing runs it, else backward work (a module called from a
gradient hook); the phase comes from :func:`commspan.ownership.phase_now`.

Backward: :mod:`commspan.capture.backward` (the other half of
:class:`ModuleTracker`) infers backward frames from hooks each forward call
leaves on its outputs and inputs.

Threads: the tracker follows the thread it was installed on (its owner) and
the autograd work done for the owner's graphs; module calls on other threads
are ignored (one comparison per call). Nothing here recurses per module depth,
and while installed the tracker raises Python's recursion limit by the frame
each traced module call costs, so a model runs as deep traced as untraced.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from commspan import semconv
from commspan._errors import ErrorCounter, describe_error
from commspan._fork import renew_after_fork
from commspan.capture import ModuleObserver
from commspan.capture.backward import BackwardNesting, _Call, graph_task_id, recomputing
from commspan.capture.dtensor import param_summary
from commspan.capture.groups import ProcessGroups
from commspan.capture.parallel import ParallelModules
from commspan.ownership import ACTIVATION_KEY, COMPILED_KEY, phase_now
from commspan.semconv import Phase
from commspan.spans.frames import Frame
from commspan.spans.recorder import SpanRecorder

__all__ = ["ModuleHooks", "ModuleInfo", "ModuleTracker"]

_log = logging.getLogger(__name__)
_NO_KWARGS: Any = object()  # the forward hook was called without kwargs (after an exception)
_torch_module = torch.nn.modules.module
# torch's global backward hooks (register_module_full_backward_pre_hook, ...): a
# module call takes them as it takes its own (the dicts are updated, never replaced)
_GLOBAL_BW_PRE_HOOKS: dict[int, Any] = _torch_module._global_backward_pre_hooks
_GLOBAL_BW_HOOKS: dict[int, Any] = _torch_module._global_backward_hooks
# torch's global forward-hook tables commspan's pair goes in: the pre-hook's, then
# the hook's and its flags' (with kwargs, always called)
_GLOBAL_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks",
                  "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")
_graph_task_id = graph_task_id
_get_ident = threading.get_ident
_ref = weakref.ref
_FORWARD = Phase.FORWARD

# Frames the hooks themselves may use on top of a module call (span building,
# processors, logging an internal error), beyond what an untraced call uses.
_HOOK_FRAMES = 100

try:  # non-reentrant checkpointing stops a recompute early with this exception
    from torch.utils.checkpoint import _StopRecomputationError as _StopRecomputation
except Exception:  # pragma: no cover - depends on the torch build

    class _StopRecomputation(Exception):  # type: ignore[no-redef]
        pass


_Compiled: Any
try:  # torch.compile(module) wraps the module: the wrapper's call is the compiled module's
    from torch._dynamo.eval_frame import OptimizedModule as _Compiled
except Exception:  # pragma: no cover - depends on the torch build
    _Compiled = ()

_Activation: Any
try:  # checkpoint_wrapper / offload_wrapper (torchtitan's activation checkpointing)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        ActivationWrapper as _Activation,
    )
except Exception:  # pragma: no cover - depends on the torch build
    _Activation = ()


def _wrapped_key(mod: torch.nn.Module, torch_names: bool) -> str | None:
    """The child key under which ``mod``, a wrapper named as the module it wraps,
    holds that module; ``None`` for any other module."""
    if isinstance(mod, _Compiled):
        return COMPILED_KEY
    if not torch_names and isinstance(mod, _Activation):
        return ACTIVATION_KEY
    return None


def _unwrapped(mod: torch.nn.Module, torch_names: bool) -> torch.nn.Module:
    """The module a chain of such wrappers wraps (``mod`` if it is none)."""
    key = _wrapped_key(mod, torch_names)
    while key is not None:
        mod = mod._modules[key]  # type: ignore[assignment]
        key = _wrapped_key(mod, torch_names)
    return mod


# True while dynamo traces: a hook it traces (``model.compile()`` compiles the
# module's ``_call_impl``, global hooks included) must return before anything
# dynamo cannot trace, or it breaks the user's graph at every module
_is_compiling = torch.compiler.is_compiling


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
        renew_after_fork(self, "_lock")  # another thread's mode may hold it
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


def _global_pre_fw(module: torch.nn.Module, args: Any) -> None:
    """commspan's global forward pre-hook: every installed tracker's."""
    if _is_compiling():  # first: dynamo traces this hook and must see nothing else
        return
    for tracker in _GLOBAL_HOOKS.trackers:
        tracker._pre_fw(module, args)


def _global_post_fw(
    module: torch.nn.Module, args: Any, kwargs: Any, output: Any = _NO_KWARGS
) -> None:
    """commspan's global forward hook (``with_kwargs``, ``always_call``): every
    installed tracker's end of a forward, inline. It runs in torch's
    error path too, where a model that ran out of stack has a few frames left: a
    frame more per tracker made the deepest call's hook fail there, its exception
    event lost."""
    if _is_compiling():
        return
    for tracker in _GLOBAL_HOOKS.trackers:
        # (module, args, kwargs, output) after a forward; (module, args, output)
        # when torch runs the always-called global hooks after an exception
        if tracker._ignores_eager_call(module):  # (not compiling: asked above)
            continue
        info = tracker._known_by_ref.get(_ref(module))  # (_known.get, without its frame)
        if info is None or info.local_open:
            continue
        # (_finish_forward reads torch's frame, 2 up: past this hook)
        if output is _NO_KWARGS:
            tracker._finish_forward(info, module, args, kwargs, None, 2)
        else:
            tracker._finish_forward(info, module, args, output, kwargs, 2)


class _GlobalHooks:
    """commspan's two global module hooks, one pair per process, shared by the
    installed trackers (one mode per thread).

    torch.compile'd code guards on torch's global forward-hook tables: on their
    keys (the hooks' ids) and on the hook functions it traced. Hooks registered
    anew each time a mode is entered (``with mode:`` around every step) failed
    those guards at every entry: a recompile per step, then eager code once the
    recompile limit was hit, or ``FailOnRecompileLimitHit`` with
    ``fullgraph=True``. So the hooks are two module-level functions, registered
    the first time a tracker installs; when the last tracker leaves they come
    out of torch's tables (an untraced step takes torch's hook-free path) and
    go back in under the same ids when a tracker installs again. Compiled code
    then sees one of two states, traced or not, as with one long-lived mode.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")
        self.trackers: tuple[ModuleTracker, ...] = ()
        """The installed trackers (replaced, never changed in place: the hooks read it
        without the lock)."""
        self._ids: tuple[int, int] | None = None  # (pre-hook id, hook id) once registered

    def add(self, tracker: ModuleTracker) -> None:
        with self._lock:
            if tracker in self.trackers:
                return
            self.trackers = (*self.trackers, tracker)
            if len(self.trackers) == 1:
                self._register()

    def discard(self, tracker: ModuleTracker) -> None:
        with self._lock:
            if tracker not in self.trackers:
                return
            self.trackers = tuple(t for t in self.trackers if t is not tracker)
            if not self.trackers:
                self._unregister()

    @staticmethod
    def _tables() -> tuple[dict[int, Any], ...] | None:
        tables = tuple(getattr(_torch_module, name, None) for name in _GLOBAL_TABLES)
        return None if any(t is None for t in tables) else tables  # type: ignore[return-value]

    def _register(self) -> None:
        _IN_PLACE.put()
        tables = self._tables()
        if self._ids is None or tables is None:
            pre = register_module_forward_pre_hook(_global_pre_fw)
            # with kwargs: tensors passed by keyword are inputs too (their
            # gradient ends the module's backward, step 4)
            post = register_module_forward_hook(
                _global_post_fw, with_kwargs=True, always_call=True)
            self._ids = (pre.id, post.id)
            return
        pre_hooks, hooks, with_kwargs, always = tables
        pre_id, post_id = self._ids
        # the flags first: another thread's module call never sees the hook without them
        with_kwargs[post_id] = True
        always[post_id] = True
        hooks[post_id] = _global_post_fw
        pre_hooks[pre_id] = _global_pre_fw

    def _unregister(self) -> None:
        _IN_PLACE.take()
        if self._ids is None:
            return
        pre_id, post_id = self._ids
        for name, key in zip(_GLOBAL_TABLES, (pre_id, post_id, post_id, post_id)):
            table = getattr(_torch_module, name, None)
            if table is not None:
                table.pop(key, None)
        if self._tables() is None:  # this torch cannot take them back under their ids
            self._ids = None


_GLOBAL_HOOKS = _GlobalHooks()


def _run_as_is(*codes: Any) -> None:
    """Dynamo never compiles a frame of ``codes``, nor any frame they call, when it
    meets one as a frame of its own: a module call that compiled code runs eagerly
    (the ``_call_impl`` of a module compiled in place or of ``torch.compile(m)``'s
    module, whose forward alone is compiled; a module called where a graph broke)
    calls commspan's hooks from a frame Dynamo skips, and Dynamo compiled each hook
    into a frame that returned at once (it traces ``torch.compiler.is_compiling()``
    as true): those calls had no span. Dynamo still traces the hooks inline where it
    traces a module call, where they return at once."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        as_is = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        for code in codes:
            set_code_exec_strategy(code, as_is)
    except Exception:  # another torch (no such API): those calls have no span
        _log.debug("commspan: could not keep Dynamo out of the module hooks", exc_info=True)


_COMPILED_CALL = "_compiled_call_impl"  # where module.compile() puts the compiled call


class _SpannedCall:
    """The call of a module compiled in place (``module.compile()``, which sets its
    ``_compiled_call_impl`` to ``torch.compile(module._call_impl)``), put in that
    attribute's place while a tracker is installed (:class:`_InPlaceCalls`).

    This opens the module's span around the compiled call, eagerly, as the call of
    ``torch.compile(module)``'s wrapper does: forward (or recompute), its backward
    from the outputs' gradients, and in it the collectives of the compiled graph
    (under ``aot_eager``, each owned by its submodule). The module's own call
    inside (torch runs its ``_call_impl``, commspan's hooks included, eagerly,
    :func:`_run_as_is`) opens no second span. While Dynamo traces it (a model
    compiled around it), it is the compiled call and nothing else."""

    __slots__ = ("compiled", "own", "module", "__weakref__")

    def __init__(self, module: torch.nn.Module, compiled: Callable[..., Any]) -> None:
        self.compiled: Callable[..., Any] | None = None
        """The module's compiled call while this is in its place (which then holds
        it), else ``None``: the compiled call holds the module, and this object is
        kept between modes (:class:`_InPlaceCalls`)."""
        self.own = weakref.ref(compiled)
        self.module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self.compiled
        if compiled is None:  # (taken out of place by another thread meanwhile)
            compiled = self.own()
            assert compiled is not None  # (the module holds it)
        if _is_compiling():
            return compiled(*args, **kwargs)
        trackers = _GLOBAL_HOOKS.trackers
        module = self.module()
        if not trackers or module is None:
            return compiled(*args, **kwargs)
        opened: list[tuple[ModuleTracker, _Call]] = []
        try:
            for tracker in trackers:
                tracker._open_in_place(module, args, opened)
            output = compiled(*args, **kwargs)
        except BaseException:
            # (the frames close with the error; it goes on as it came)
            for tracker, call in reversed(opened):
                try:
                    tracker._close_in_place(call, module, args, None, kwargs)
                except BaseException:  # noqa: PERF203 - the user's error goes on
                    _log.debug("commspan: closing a compiled call raised", exc_info=True)
            raise
        # every tracker's call closes, even after one's observer (a user hook of
        # commspan.compat's ModTracker) raised: its error goes on after them
        first: BaseException | None = None
        for tracker, call in reversed(opened):
            try:
                tracker._close_in_place(call, module, args, output, kwargs)
            except BaseException as error:  # noqa: PERF203 - each call must close
                if first is None:
                    first = error
        if first is not None:
            raise first
        return output


_SPANNED_CALL = _SpannedCall.__call__.__code__


class _InPlaceCalls:
    """The modules compiled in place that trackers have named, and their spanned
    calls (:class:`_SpannedCall`): in their ``_compiled_call_impl`` while a tracker
    is installed, the module's own compiled call again when the last one leaves
    (with commspan's global hooks). A module keeps one spanned call per compiled
    call, so a model compiled around it (``torch.compile(model)``, which guards on
    the attribute) sees two states, traced and untraced, as for the global hooks.
    A compiled call the module got since (``module.compile()`` again) is left in
    place, and spanned when a tracker finds it. Modules are held weakly: a spanned
    call out of place holds its compiled call (which holds the module) weakly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # the spanned calls out of their module's attribute (between modes)
        self._parked: weakref.WeakKeyDictionary[torch.nn.Module, _SpannedCall] = (
            weakref.WeakKeyDictionary())
        self._on = False

    def add(self, module: torch.nn.Module) -> None:
        """``module`` is compiled in place (has a compiled call that is not spanned):
        span its calls (now, if a tracker is installed)."""
        with self._lock:
            self._modules.add(module)
            if self._on:
                self._put(module)

    def put(self) -> None:
        """The first tracker is installed: every spanned call in place."""
        with self._lock:
            self._on = True
            for module in list(self._modules):
                self._put(module)

    def take(self) -> None:
        """The last tracker left: every module's own compiled call back in place."""
        with self._lock:
            self._on = False
            for module in list(self._modules):
                try:
                    state = module.__dict__
                    spanned = state.get(_COMPILED_CALL)
                    if type(spanned) is _SpannedCall and spanned.compiled is not None:
                        state[_COMPILED_CALL] = spanned.compiled
                        spanned.compiled = None
                        self._parked[module] = spanned
                except Exception:  # pragma: no cover - a module without a plain __dict__
                    _log.debug("commspan: could not restore a compiled call", exc_info=True)

    def _put(self, module: torch.nn.Module) -> None:
        try:
            state = module.__dict__
            compiled = state.get(_COMPILED_CALL)
            if compiled is None or type(compiled) is _SpannedCall:
                return
            spanned = self._parked.pop(module, None)
            if spanned is None or spanned.own() is not compiled:  # (compiled anew)
                spanned = _SpannedCall(module, compiled)
            spanned.compiled = compiled
            state[_COMPILED_CALL] = spanned
        except Exception:  # a compiled call of another kind (no weak reference): no span
            _log.debug("commspan: could not span a compiled call", exc_info=True)


_IN_PLACE = _InPlaceCalls()


def _compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a compiled call (``module.compile()``) not spanned yet."""
    compiled = module.__dict__.get(_COMPILED_CALL)
    return compiled is not None and type(compiled) is not _SpannedCall


def _named_modules(root: torch.nn.Module,
                   torch_names: bool = False) -> list[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` without recursion (same order), except that a wrapper
    that gives its name to the module it wraps (``torch.compile``'s
    ``OptimizedModule``; activation checkpointing's ``checkpoint_wrapper`` and
    ``offload_wrapper`` unless ``torch_names``) does: ``blocks.0``, not
    ``blocks.0._orig_mod`` or ``blocks.0._checkpoint_wrapped_module`` (the wrapper
    comes first, under the same name), as torch's ``state_dict`` names them."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    todo: list[tuple[str, torch.nn.Module]] = [("", root)]
    while todo:
        name, mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append((name, mod))
        wrapped = _wrapped_key(mod, torch_names)
        children = [
            (name if key == wrapped else f"{name}.{key}" if name else key, child)
            for key, child in mod._modules.items()
            if child is not None
        ]
        todo.extend(reversed(children))
    return out


def _path_in(owner: torch.nn.Module, module: torch.nn.Module,
             torch_names: bool = False) -> str | None:
    """The dotted path of ``module`` among ``owner``'s submodules, looked for among its
    children and inside the containers among them (``ModuleList``, ``ModuleDict``,
    which are never called themselves) and the activation-checkpointing wrappers
    (whose calls have no span), or ``None``. A wrapped module is looked for under the
    name of its wrapper, as :func:`_named_modules` names it."""
    todo: list[tuple[str, torch.nn.Module]] = [("", owner)]
    while todo:
        prefix, mod = todo.pop(0)
        wrapped = _wrapped_key(mod, torch_names)
        for key, child in mod._modules.items():
            if child is None:
                continue
            name = prefix if key == wrapped else f"{prefix}.{key}" if prefix else key
            if child is module:
                return name
            if isinstance(child, _CONTAINERS) or (
                    not torch_names and isinstance(child, _Activation)):
                todo.append((name, child))
    return None


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)

ModuleHooks = ModuleObserver
"""Former name of :class:`commspan.capture.ModuleObserver`."""


class _Closer:
    """The forward hook that closes one call's frame after the module's own hooks
    (:meth:`ModuleTracker._close_after_own_hooks`). It is only ever in a view of the
    module's hook table (:class:`_CallHooks`), which pickles and copies as the
    module's own table, without it."""

    __slots__ = ("tracker", "call")

    def __init__(self, tracker: ModuleTracker, call: _Call) -> None:
        self.tracker = tracker
        self.call = call

    def __call__(
        self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any = _NO_KWARGS
    ) -> None:
        # (module, args, output) from another thread's call that read the hook table
        # before and the kwargs table after this call's tables were put back
        if output is _NO_KWARGS:
            return  # not this call's (this call's tables hold both)
        tracker = self.tracker
        if tracker._local_post_fw(self.call, module):
            info = self.call.info
            # (_finish_forward reads the caller of this hook, 2 frames up)
            tracker._finish_forward(info, module, args, output, kwargs, 2)


_run_as_is(_global_pre_fw.__code__, _global_post_fw.__code__, _Closer.__call__.__code__)

# the module's tables a forward hook is registered in; the hook table last
_HOOK_TABLES = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_hooks")
_HOOK_TABLES_HOOK_FIRST = tuple(reversed(_HOOK_TABLES))
_od_set = OrderedDict.__setitem__
_TABLES_LOCK = threading.Lock()
_closer_ids = itertools.count(-1, -1)  # keys of closing hooks: torch's ids are >= 0


class _CallHooks(OrderedDict):  # type: ignore[type-arg]
    """One of a module's forward-hook tables while a traced call of it runs: a view
    of the module's own table (``own``) followed by the closing hooks (or their
    flags) of the calls running now (``closers``, keyed below 0), put in the
    module's ``__dict__`` in place of the own table.

    The module's own tables are never given commspan's hooks: another thread
    calling the same module (untraced, or traced by its own mode) reads them
    without a lock, and torch's error path walks the hook table itself, so a hook
    added and removed per call made that call fail (a hook called without its
    kwargs, "OrderedDict mutated during iteration" instead of the user's
    exception). Reads (``items``, ``keys``, ``in``, ``len``, ``[]``, ...) see the
    own table as it is at that moment, so a hook removed or added during the call
    (through its handle, ``pop``, ``clear``) counts as it would untraced; writes
    go to the own table, and the handle of a hook registered during the call is
    pointed at it. Pickling and copying give the own table. (The OrderedDict's
    own storage holds a snapshot, for code that reads it below Python.)
    """

    def __init__(self, own: dict[int, Any], closers: Any) -> None:
        super().__init__()
        self.own = own
        self.closers: dict[int, Any] = dict(closers)
        self.dirty = False  # written to since built (not reused then: _ModuleViews)
        for key, value in (*own.items(), *self.closers.items()):
            _od_set(self, key, value)

    # ---- reads: the own table now, then the closers
    def items(self) -> Any:
        return [*self.own.items(), *self.closers.items()]

    def keys(self) -> Any:
        return [*self.own, *self.closers]

    def values(self) -> Any:
        return [*self.own.values(), *self.closers.values()]

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __reversed__(self) -> Any:
        return reversed(self.keys())

    def __len__(self) -> int:
        return len(self.own) + len(self.closers)

    def __contains__(self, key: Any) -> bool:
        return key in self.own or key in self.closers

    def __getitem__(self, key: Any) -> Any:
        if key in self.closers:
            return self.closers[key]
        return self.own[key]

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __repr__(self) -> str:
        return f"OrderedDict({self.items()!r})"

    # ---- writes: to the own table (commspan's closers are left alone)
    def __setitem__(self, key: Any, value: Any) -> None:
        self.dirty = True
        self.own[key] = value
        OrderedDict.__setitem__(self, key, value)
        handle = sys._getframe(1).f_locals.get("handle")  # torch's register_*_hook
        if isinstance(handle, RemovableHandle):
            _point_at_own(handle)

    def __delitem__(self, key: Any) -> None:
        self.dirty = True
        if key in self.closers:
            del self.closers[key]
        else:
            del self.own[key]
        OrderedDict.pop(self, key, None)

    def pop(self, key: Any, *default: Any) -> Any:
        self.dirty = True
        if key in self.closers:
            OrderedDict.pop(self, key, None)
            return self.closers.pop(key)
        value = self.own.pop(key, *default)
        OrderedDict.pop(self, key, None)
        return value

    def popitem(self, last: bool = True) -> Any:
        self.dirty = True
        key, value = self.own.popitem(last)  # type: ignore[call-arg]
        OrderedDict.pop(self, key, None)
        return key, value

    def clear(self) -> None:
        self.dirty = True
        self.own.clear()
        OrderedDict.clear(self)
        for key, value in self.closers.items():
            OrderedDict.__setitem__(self, key, value)

    def move_to_end(self, key: Any, last: bool = True) -> None:
        self.dirty = True
        if key in self.own:
            self.own.move_to_end(key, last)  # type: ignore[attr-defined]
        OrderedDict.move_to_end(self, key, last)

    def __reduce__(self) -> Any:
        return self.own.__reduce__()

    def __copy__(self) -> Any:
        return copy.copy(self.own)

    def __deepcopy__(self, memo: Any) -> Any:
        return copy.deepcopy(self.own, memo)


def _own(table: Any) -> Any:
    return table.own if type(table) is _CallHooks else table


def _point_at_own(handle: RemovableHandle) -> None:
    """A hook registered on a module during a traced call of it: its handle removes
    it from the module's own tables, not from the call's views."""
    try:
        table = handle.hooks_dict_ref()
        if type(table) is _CallHooks:
            handle.hooks_dict_ref = weakref.ref(table.own)
        handle.extra_dict_ref = tuple(
            weakref.ref(_own(ref())) if ref() is not None else ref
            for ref in handle.extra_dict_ref)
    except Exception:  # pragma: no cover - another torch's handle
        _log.debug("commspan: could not point a hook handle at its module", exc_info=True)


def _add_closer(module: torch.nn.Module, closer: _Closer) -> int:
    """Put views of the module's tables, with ``closer`` after the closers already
    there, in their place; returns the closer's key."""
    key = next(_closer_ids)
    state = module.__dict__
    flag = ((key, True),)
    with _TABLES_LOCK:
        for name, entry in zip(_HOOK_TABLES, (flag, flag, ((key, closer),))):
            # (flags first: a reader never sees the hook without them)
            table = state[name]
            if type(table) is _CallHooks:  # another call of the module runs: its closers first
                state[name] = _CallHooks(table.own, (*table.closers.items(), *entry))
            else:
                state[name] = _CallHooks(table, entry)
    return key


def _remove_closer(module: torch.nn.Module, key: int) -> None:
    """Take the closer ``key`` out of the module's tables (a new view, or the own
    table when no other call's closer is left)."""
    state = module.__dict__
    with _TABLES_LOCK:
        for name in _HOOK_TABLES_HOOK_FIRST:  # the hook first
            table = state.get(name)
            if type(table) is not _CallHooks:
                continue
            closers = table.closers
            if key not in closers:
                continue
            if len(closers) == 1:  # this call's closer is its only one
                state[name] = table.own
                continue
            state[name] = _CallHooks(table.own, [(k, v) for k, v in closers.items() if k != key])


class _ModuleViews:
    """One module's views of its two forward-hook flag tables (``with_kwargs``,
    ``always_called``) with the flags of one closer of this tracker's
    (:class:`_CallHooks`), kept between its calls and put in place again at the
    next, instead of views built and taken down per call; the view of its hook
    table is built per call (``hooks``, the call's while it runs): kept, it would
    hold the module's hooks, and a hook that refers to the module (a bound method,
    an FSDP2 state) would keep the module alive as long as the tracker. The flag
    views are put back only while they still show the module's flag tables as they
    are: the same table objects with the same items (``snap``, taken when the views
    were built), and nothing written through a view since (``dirty``); otherwise
    they are built anew. A call of the module while another one's views are in
    place (the module called inside itself, or from another thread) takes views of
    its own (:func:`_add_closer`)."""

    __slots__ = ("key", "kw", "always", "hooks", "snap")

    def __init__(self, state: dict[str, Any], key: int) -> None:
        self.key = key
        kw = state["_forward_hooks_with_kwargs"]
        always = state["_forward_hooks_always_called"]
        self.snap = (tuple(kw.items()), tuple(always.items()))
        flag = ((key, True),)
        self.kw = _CallHooks(kw, flag)
        self.always = _CallHooks(always, flag)
        self.hooks: _CallHooks | None = None

    def put(self, state: dict[str, Any], closer: _Closer) -> bool:
        """Put the views in place with ``closer`` (under ``_TABLES_LOCK``), if they
        still show the module's own tables; returns whether they were put."""
        kw, always = self.kw, self.always
        own_kw = state["_forward_hooks_with_kwargs"]
        own_always = state["_forward_hooks_always_called"]
        own_hooks = state["_forward_hooks"]
        if (own_kw is not kw.own or own_always is not always.own
                or type(own_hooks) is _CallHooks or kw.dirty or always.dirty
                or self.snap != (tuple(own_kw.items()), tuple(own_always.items()))):
            return False
        hooks = self.hooks = _CallHooks(own_hooks, ((self.key, closer),))
        # (flags first: a reader never sees the hook without them)
        state["_forward_hooks_with_kwargs"] = kw
        state["_forward_hooks_always_called"] = always
        state["_forward_hooks"] = hooks
        return True

    def take(self, state: dict[str, Any]) -> bool:
        """Put the module's own tables back in place of the views (under
        ``_TABLES_LOCK``), if the views are what is in place; returns whether they
        were."""
        hooks, always, kw = self.hooks, self.always, self.kw
        try:
            if (hooks is None or state["_forward_hooks"] is not hooks
                    or state["_forward_hooks_always_called"] is not always
                    or state["_forward_hooks_with_kwargs"] is not kw):
                return False
        except KeyError:  # (a table taken off the module)
            return False
        state["_forward_hooks"] = hooks.own  # (the hook first)
        state["_forward_hooks_always_called"] = always.own
        state["_forward_hooks_with_kwargs"] = kw.own
        self.hooks = None  # (holds the module's hooks and the call's closer)
        return True


def _put_closer(module: torch.nn.Module, info: ModuleInfo, closer: _Closer) -> int:
    """:func:`_add_closer` through the module's kept views (:class:`_ModuleViews`),
    made or made anew when its own tables are in place; returns the closer's key."""
    state = module.__dict__
    with _TABLES_LOCK:
        views = info.views
        if views is not None and views.put(state, closer):
            return views.key
        if (type(state.get("_forward_hooks")) is not _CallHooks
                and type(state.get("_forward_hooks_with_kwargs")) is not _CallHooks
                and type(state.get("_forward_hooks_always_called")) is not _CallHooks):
            views = info.views = _ModuleViews(
                state, next(_closer_ids) if views is None else views.key)
            if views.put(state, closer):
                return views.key
    return _add_closer(module, closer)  # another call's views are in place


class ModuleInfo:
    """What the tracker knows of one module: its name, type and the attributes
    its spans start from (built once, copied per call)."""

    __slots__ = (
        "fqn",
        "type",
        "params",
        "param_ids",
        "local_open",
        "attrs",
        "names",
        "depth",
        "ref",
        "ddp",
        "fw_trace",
        "views",
    )

    def __init__(self, fqn: str, mtype: str) -> None:
        self.fqn = fqn
        self.ddp = False  # a DistributedDataParallel module: its forward end reads buckets
        self.type = mtype
        self.params: dict[str, Any] | None = None
        self.param_ids: tuple[int, ...] = ()  # the parameters params describes
        self.local_open = 0  # open calls with a closing hook of their own (below)
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
        self.fw_trace: Any = None  # trace id of its last forward (a recompute re-runs it)
        self.views: _ModuleViews | None = None  # its flag tables' views, kept between calls


def _without_traceback(error: BaseException) -> BaseException:
    """``error`` as a span needs it, without its traceback (which holds every frame of
    the recursion and its tensors) when it can be copied: a ``RecursionError``."""
    if type(error) is RecursionError:
        return RecursionError(*error.args)
    return error


_exc_info = sys.exc_info
_CALL_IMPL = torch.nn.Module._call_impl.__code__
_DID_NOT_RETURN = "forward did not return (a BaseException crossed it and was caught)"


def _raised_into(caller: Any) -> BaseException | None:
    """The exception a module call raised, seen from its always-called forward
    hook, or ``None``: torch runs those hooks from the ``except`` block of the
    call that caught it (``caller``), where the exception's traceback starts. An
    exception merely being handled around the call (a module called inside an
    ``except`` block that returned ``None``) started in another frame."""
    error = sys.exc_info()[1]
    if error is None:
        return None
    tb = error.__traceback__
    return error if tb is not None and tb.tb_frame is caller else None


class ModuleTracker(BackwardNesting):
    """Turns module hooks into frames on a :class:`SpanRecorder`.

    Args:
        recorder: where frames go.
        observer: optional :class:`~commspan.capture.ModuleObserver` called at
            each module event.
        record_params: put parameter names, shapes and placements on forward spans.
        groups: the process-group registry that learns the device meshes of
            DTensor parameters (shared with the dispatch mode).
        parallel: the registry of FSDP2 units and DDP modules to teach the
            module trees the tracker names (read by the ownership rules).
        torch_names: name modules by torch's paths through activation-checkpointing
            wrappers, as torch's trackers do (``commspan.compat``): see
            :attr:`torch_names`.
    """

    def __init__(
        self,
        recorder: SpanRecorder,
        observer: ModuleObserver | None = None,
        record_params: bool = True,
        groups: ProcessGroups | None = None,
        parallel: ParallelModules | None = None,
        torch_names: bool = False,
    ) -> None:
        self.recorder = recorder
        self.parallel = parallel
        if parallel is not None:
            parallel.namer = self.name
            parallel.known_name = self.fqn
            parallel.pipeline.namer = self.name
            parallel.pipeline.on_microbatch = self._tag_spans
        self.ran: set[str] = set()
        """Names of the modules whose forward has run (the modules with spans)."""
        self.span_tags: dict[str, Any] | None = None
        """Attributes every frame opened now gets (the pipeline stage and microbatch
        running, set by :class:`~commspan.capture.pipeline.PipelineWatch`)."""
        self.groups = groups
        self._on_mesh = groups.add_mesh if groups is not None else None
        self.observer = observer
        self.record_params = record_params
        self._known: weakref.WeakKeyDictionary[torch.nn.Module, ModuleInfo] = (
            weakref.WeakKeyDictionary()
        )
        # the dictionary under it (weak reference -> info), read by the hooks
        self._known_by_ref: dict[Any, ModuleInfo] = self._known.data  # type: ignore[attr-defined]
        # activation-checkpointing wrappers -> the wrapped module's info: not in
        # _known, so their calls open no span (the wrapped module's does)
        self._wrappers: weakref.WeakKeyDictionary[torch.nn.Module, ModuleInfo] = (
            weakref.WeakKeyDictionary()
        )
        self.torch_names = torch_names
        """Name modules by torch's paths through activation-checkpointing wrappers
        (``layers.0._checkpoint_wrapped_module``; ``commspan.compat``, as torch's
        trackers), each wrapper's call its own span; else a wrapper's name is the
        wrapped module's, whose call is the only span."""
        # id(module) -> (module ref, name), for compiled graphs' module stacks
        self._by_id: dict[int, tuple[Callable[[], Any], str]] = {}
        self._named = 0  # modules named so far (a version of _known)
        # DDP modules named before forget_names, learnt by the registry already
        self._was_ddp: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._by_id_known = -1  # self._named when _by_id was built
        self._names: set[str] = set()  # names of the modules named, for compiled graphs
        self._names_known = -1  # self._named when _names was built
        self._calls: list[_Call] = []
        self._installed = False
        self._local: list[_Call] = []  # calls whose closing hook is still on their module
        self._init_backward()
        self.active = False
        self._errors = ErrorCounter(
            _log,
            "internal error while tracking modules; tracing of this call is incomplete",
            deferred="internal error while tracking modules (the stack was too deep to log "
            "it when it happened); tracing of that call is incomplete",
        )
        # (id, "Type: message") of the exception last put on a span: the spans it
        # crosses on its way out get ERROR, not another event. An id, not the
        # exception (its traceback holds the step's tensors) nor a weak
        # reference (built-in exceptions take none); forgotten at the next
        # module call, so a freed exception's id cannot be mistaken for it.
        self._error_mark: tuple[int, str | None] | None = None
        self.unwound: tuple[Frame, BaseException, int] | None = None
        """``(frame, error, id of the error raised)``: a RecursionError left a call
        whose caller is a module; its frame (and those above) stays open until the
        next hook or collective, which has the stack to close them
        (:meth:`close_unwound`): a caller that catches it goes on (a fallback) with
        them closed, ERROR; one that does not closes them itself. ``error`` is a copy
        without the traceback."""
        self.owner = 0  # thread the tracker follows (set by install)
        self._deepest = 0  # deepest module nesting the recursion limit allows for
        self._headroom = False

    @property
    def internal_errors(self) -> int:
        """Errors of the tracker's own hooks so far (the first is logged)."""
        return self._errors.count

    # ------------------------------------------------------------ install
    def install(self) -> None:
        """Register the global hooks (idempotent; the process's pair, shared by
        every installed tracker and the same at every install: :class:`_GlobalHooks`)."""
        if self._installed:
            return
        self.owner = _get_ident()
        self._installed = True
        _GLOBAL_HOOKS.add(self)
        self.find_compiled_in_place()
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
        self._leave_hooks()
        self._release_headroom()

    def uninstall(self) -> None:
        """Remove every hook this tracker registered; forget open calls."""
        self.active = False
        self._release_headroom()
        self._error_mark = None
        self.unwound = None
        self._leave_hooks()
        self._drop_closers()
        self._calls.clear()
        self._forget_backward()

    def reset_step(self) -> None:
        """Drop per-step state (leaf hooks of a backward that never ran, open calls
        and their closing hooks)."""
        self._forget_backward()
        self._calls.clear()
        self._drop_closers()
        self._error_mark = None
        self.unwound = None

    def find_compiled_in_place(self) -> None:
        """Span the calls of the modules named before they were compiled in place
        (``module.compile()`` after the model first ran traced) with
        :class:`_SpannedCall` (called when the tracker is installed and when a traced
        step starts; until then their own calls are their spans). A look-up per
        named module."""
        try:
            for ref in list(self._known_by_ref):
                module = ref()
                if module is None:
                    continue
                # (inline: _compiled_in_place; a module spanned already is passed by,
                # not handed to _IN_PLACE again under its lock at every step)
                compiled = module.__dict__.get(_COMPILED_CALL)
                if compiled is not None and type(compiled) is not _SpannedCall:
                    _IN_PLACE.add(module)
            for module in list(self._wrappers) if self._wrappers else ():
                if _compiled_in_place(module):
                    _IN_PLACE.add(module)
        except Exception:
            self._errors.record()

    def _leave_hooks(self) -> None:
        """This tracker's calls come off the global hooks (which leave torch's
        tables with the last tracker)."""
        self._installed = False
        _GLOBAL_HOOKS.discard(self)

    def _drop_closers(self) -> None:
        """Remove every closing hook of a call still registered (:class:`_Closer`)."""
        local, self._local = self._local, []
        for call in local:
            key, call.local = call.local, None
            module = call.module()
            if key is not None and module is not None:
                _remove_closer(module, key)
            # (a module's open calls with a closing hook are all in _local: those
            # are the only infos whose count is not 0)
            call.info.local_open = 0
            call.info.views = None  # (may hold the call's closer)

    def _innermost_call(self, info: ModuleInfo) -> int:
        """Index in ``_calls`` of the module's innermost open call, or -1."""
        calls = self._calls
        idx = len(calls) - 1
        while idx >= 0 and calls[idx].info is not info:
            idx -= 1
        return idx

    def _release_headroom(self) -> None:
        if self._headroom:
            self._headroom = False
            _HEADROOM.release()

    def _ignores_this_call(self, module: torch.nn.Module | None = None) -> bool:
        """Not tracking, a call on a thread the tracker does not follow, or a call
        Dynamo traces (compiled into a graph: no span). A call that compiled code
        runs eagerly (where a graph broke) is a call as uncompiled."""
        return _is_compiling() or self._ignores_eager_call(module)

    def _ignores_eager_call(self, module: torch.nn.Module | None) -> bool:
        """:meth:`_ignores_this_call` for a caller that knows Dynamo is not tracing
        (the global hooks, which ask first)."""
        return (
            not self.active
            or (_get_ident() != self.owner and not self._follows())
        )

    # ------------------------------------------------------------ names
    def forget_names(self) -> None:
        """Name every module afresh at its next call, as a new tracker would
        (``commspan.compat``: each context names modules as a new instance does).
        Between contexts only: open calls keep the names they opened with."""
        # named again, DDP modules stay DDP modules
        self._was_ddp.update(m for m, info in self._known.items() if info.ddp)
        self._known.clear()
        self._wrappers.clear()
        self._by_id.clear()
        self._by_id_known = -1
        self._names_known = -1
        self.ran.clear()

    def fqn(self, module: torch.nn.Module) -> str | None:
        """The name the tracker knows ``module`` by, or ``None``."""
        info = self._known.get(module)
        if info is None and self._wrappers:
            info = self._wrappers.get(module)
        return info.fqn if info is not None else None

    def fqn_of_id(self, ident: int) -> str | None:
        """The name of the module whose ``id`` is ``ident`` (a compiled graph names
        modules by identity), or ``None`` if the tracker has not named it."""
        by_id = self._by_id
        hit = by_id.get(ident)
        if (hit is None or hit[0]() is None) and self._named != self._by_id_known:
            # rebuilt only when the tracker has named modules since: an unknown id
            # (a module never called eagerly) costs one lookup, not a walk
            by_id.clear()
            for module, info in list(self._known.items()):
                by_id[id(module)] = (weakref.ref(module), info.fqn)
            self._by_id_known = self._named
            hit = by_id.get(ident)
        if hit is None or hit[0]() is None:
            return None
        return hit[1]

    def knows_name(self, fqn: str) -> bool:
        """Whether a module the tracker has named is called ``fqn``."""
        if self._names_known != self._named:
            self._names = {info.fqn for info in list(self._known.values())}
            self._names_known = self._named
        return fqn in self._names

    def _tag_spans(self, tags: dict[str, Any] | None) -> None:
        self.span_tags = tags

    def name(self, module: torch.nn.Module, root: str | None = None) -> str:
        """The name spans give ``module``, naming its module tree if it is new: its
        class name, or ``root`` if given, then the dotted path inside it."""
        return self._info(module, root).fqn

    def _info(self, module: torch.nn.Module, root: str | None = None) -> ModuleInfo:
        info = self._known.get(module)
        if info is not None:
            return info
        known = self._known
        torch_names = self.torch_names
        wrappers = self._wrappers
        if wrappers and module in wrappers:
            return wrappers[module]
        inner = _unwrapped(module, torch_names)
        root = root or type(inner).__name__
        new: list[tuple[str, torch.nn.Module]] = []
        wrapping = []
        for name, sub in _named_modules(module, torch_names):
            if sub not in known and sub not in wrappers:
                fqn = f"{root}.{name}" if name else root
                if _wrapped_key(sub, torch_names) is not None:
                    wrapping.append(sub)  # named, and spanned, as the module it wraps
                else:
                    known[sub] = ModuleInfo(fqn, type(sub).__name__)
                new.append((fqn, sub))  # a wrapper too: FSDP may shard it
        for wrapper in wrapping:
            info = known[_unwrapped(wrapper, torch_names)]
            if isinstance(wrapper, _Compiled):
                # torch.compile(m): its call is m's span (m's own runs compiled)
                known[wrapper] = info
            else:
                # activation checkpointing: the wrapped module's call is the span
                # (the wrapper's has none): only it re-runs in a recompute
                wrappers[wrapper] = info
        self._named += len(new)
        for _, sub in new:
            if _compiled_in_place(sub):  # module.compile(): its hooks are compiled with it
                _IN_PLACE.add(sub)
        if self.parallel is not None and new:
            for ddp in self.parallel.learn(new, self._on_mesh):
                known[ddp].ddp = True
            if self._was_ddp:  # (after forget_names: the registry knows them already)
                for _, sub in new:
                    if sub in self._was_ddp:
                        known[sub].ddp = True
        return known[module] if module in known else wrappers[module]

    def _first_call_info(self, module: torch.nn.Module) -> ModuleInfo | None:
        """A module the tracker has not named is called: if the module calling it
        holds it (assigned after that model was named: a new head, a swapped block,
        a LoRA layer), it is named by its path there (``Net.head``), else as a model
        of its own (its class name). Nothing is renamed: a module keeps the name it
        was first seen under. ``None`` for an activation-checkpointing wrapper (named
        as the module it wraps, whose call is the span; its own call has none)."""
        wrappers = self._wrappers
        if wrappers and module in wrappers:
            return None
        if self._calls:
            caller = self._calls[-1]
            owner = caller.module()
            if owner is not None:
                path = _path_in(owner, module, self.torch_names)
                if path is not None:
                    info = self._info(module, f"{caller.info.fqn}.{path}")
                    return None if module in wrappers else info
        info = self._info(module)
        return None if module in wrappers else info

    def open_fqns(self) -> set[str]:
        """Names of the modules with an open (not finished) frame, plus ``Global``."""
        return {f.fqn for f in self.recorder.stack if not f.finished}

    # ------------------------------------------------------------ forward
    def _pre_fw(self, module: torch.nn.Module, args: Any, in_place: bool = False) -> None:
        """A module call starts: open its frame (steps below), watch its inputs
        for backward, tell the observer. (Called by the global pre-hook once it has
        found that Dynamo is not tracing; ``in_place``: by the spanned call of a module
        compiled in place, :class:`_SpannedCall`, whose own hooks run inside it.)"""
        if self._ignores_eager_call(module):
            return
        try:
            if self.unwound is not None:
                self.close_unwound()
            self._error_mark = None
            info = self._known_by_ref.get(_ref(module))
            if info is None:
                info = self._first_call_info(module)
                if info is None:  # an activation-checkpointing wrapper: no span
                    if not in_place:
                        return
                    # compiled in place: the call runs the wrapped module compiled
                    # (as torch.compile(wrapper)'s does), its span the wrapped module's
                    info = self._wrappers.get(module)
                    if info is None:
                        return
            task = _graph_task_id()
            calls = self._calls
            parent = calls[-1] if calls else None
            if parent is not None and parent.info is info and not in_place and (
                    (info.local_open and parent.in_place)
                    or (parent.wraps and not isinstance(module, _Compiled))):
                # the module's own call inside its spanned compiled call, or inside
                # the call of its torch.compile(module) wrapper (torch runs its
                # _call_impl, hooks included, eagerly; Dynamo compiles its forward):
                # that span is the call's
                return
            if task == -1:  # outside autograd: a forward (phase_now's rule, inline)
                phase = _FORWARD
                if self._tasks:
                    self._abandon_backward()
                if parent is None and self._leaf_calls:
                    self._new_top_level_forward(info)
            else:
                # in backward: a recompute if checkpointing says so, or if the module
                # already ran forward in this trace (other checkpoint implementations)
                phase = phase_now(None, True, module_call=True, recomputing=(
                    recomputing() or info.fw_trace == self.recorder.trace_id))
            depth = self._call_depth(info, phase, parent)
            attrs = self._call_attributes(module, info, phase, depth)
            frame = self.recorder.push(info.fqn, phase, attrs, task, name=info.names[phase])
            if phase is _FORWARD:
                info.fw_trace = self.recorder.trace_id
            ref = info.ref
            if ref is None:
                ref = info.ref = weakref.ref(module)
            call = _Call(info, ref, parent, frame, depth)
            call.task = task
            if isinstance(module, _Compiled):
                call.wraps = True
            calls.append(call)
            if in_place:
                # its own hooks run inside the compiled call, which the frame is
                # closed after (by the spanned call, never by the global hook)
                call.in_place = True
                info.local_open += 1
            else:
                if module._forward_hooks:
                    self._close_after_own_hooks(module, info, call)
                if (module._backward_pre_hooks or module._backward_hooks
                        or _GLOBAL_BW_PRE_HOOKS or _GLOBAL_BW_HOOKS):
                    self._watch_backward_hooks(module, call)
            if torch.is_grad_enabled():
                self._watch_inputs(call, args)
            if self.observer is not None:
                self.observer.pre_fw(module, args)
        except RecursionError:
            # The model itself ran out of stack (the limit allows for what
            # tracing adds): its own RecursionError follows; not commspan's error.
            pass
        except Exception:  # never break the user's step
            self._errors.record()
        if self.observer is not None:
            self._raise_observed()

    def _open_in_place(self, module: torch.nn.Module, args: Any,
                       opened: list[tuple[ModuleTracker, _Call]]) -> None:
        """A spanned call of a module compiled in place starts (:class:`_SpannedCall`):
        its frame opens as for any call; added to ``opened`` (even when the observer
        then raises) for :meth:`_close_in_place`."""
        calls = self._calls
        before = len(calls)
        try:
            self._pre_fw(module, args, in_place=True)
        finally:
            if len(calls) > before and calls[-1].in_place:
                opened.append((self, calls[-1]))

    def _close_in_place(self, call: _Call, module: torch.nn.Module, args: Any,
                        output: Any, kwargs: Any) -> None:
        """The spanned call of a module compiled in place returned ``output`` (or
        raised: ``None``, from the ``except`` block of :class:`_SpannedCall`'s call)."""
        info = call.info
        info.local_open = max(0, info.local_open - 1)
        # (_finish_forward reads the spanned call's frame, 2 up: past this method)
        self._finish_forward(info, module, args, output, kwargs, 2)

    def _call_depth(self, info: ModuleInfo, phase: Phase, parent: _Call | None) -> int:
        """Nesting depth of the call (1 for a top-level module), and headroom
        in the recursion limit for it."""
        depth = parent.depth + 1 if parent is not None else 1
        if phase is _FORWARD:
            if not info.depth:
                info.depth = depth
                self.ran.add(info.fqn)
        elif info.depth:
            depth = info.depth  # a recompute sits where its forward sat
        if depth > self._deepest:  # each traced level costs a frame more
            self._deepest = depth + 16
            _HEADROOM.need(self._deepest + _HOOK_FRAMES)
        return depth

    def _call_attributes(
        self, module: torch.nn.Module, info: ModuleInfo, phase: Phase, depth: int
    ) -> dict[str, Any]:
        """The new frame's attributes: the module's, its depth and, on a forward,
        its parameters (described again when they are other objects: a
        re-sharded or re-registered parameter)."""
        attrs = info.attrs[phase].copy()
        attrs[semconv.MODULE_DEPTH] = depth
        if self.span_tags is not None:  # a pipeline stage's microbatch is running
            attrs.update(self.span_tags)
        if self.record_params and phase is _FORWARD:
            ids = tuple(map(id, module._parameters.values()))
            if info.params is None or ids != info.param_ids:
                parallel = self.parallel
                info.params = param_summary(
                    module, self._on_mesh,
                    parallel.sharded_param if parallel is not None
                    and parallel.manages_params else None)
                info.param_ids = ids
            if info.params:
                attrs.update(info.params)
        return attrs

    def _close_after_own_hooks(
        self, module: torch.nn.Module, info: ModuleInfo, call: _Call
    ) -> None:
        """The module has forward hooks of its own (e.g. tensor-parallel output
        hooks): close its frame from a hook registered after them, for this call
        only, so their collectives belong to it. The hook comes off when it has
        run: one left on the module between calls would hold the tracker, and
        copying, pickling or scripting the model would fail. It is added to views
        of the module's hook tables put in their place for the call
        (:class:`_CallHooks`), never to the tables themselves, which another
        thread may be reading; the views of its two flag tables are kept for the
        module's next call while those tables stay as they are, the hook table's is
        built per call (:class:`_ModuleViews`)."""
        call.local = _put_closer(module, info, _Closer(self, call))
        self._local.append(call)
        info.local_open += 1

    def _local_post_fw(self, call: _Call, module: torch.nn.Module) -> bool:
        """The closing hook of ``call`` ran; returns whether to finish the call (and
        takes the hook off: torch runs it from a table no longer the module's)."""
        if self._ignores_this_call(module):
            return False  # another thread's call of the module: not this call's end
        key = call.local
        if key is None:  # ran already (or the tracker was reset)
            return False
        info = call.info
        idx = self._innermost_call(info)
        if idx >= 0 and self._calls[idx] is not call:
            return False  # the module called inside itself: this hook is the outer call's
        call.local = None
        info.local_open = max(0, info.local_open - 1)
        try:
            self._local.remove(call)
        except ValueError:
            pass
        views = info.views
        if views is not None and key == views.key:
            with _TABLES_LOCK:
                if views.take(module.__dict__):
                    return True
            info.views = None  # (another call's views were put over them: drop them)
        _remove_closer(module, key)
        return True

    def _watch_backward_hooks(self, module: torch.nn.Module, call: _Call) -> None:
        """The module has backward hooks of its own, or global ones apply
        (``register_module_full_backward_pre_hook``). torch runs them from autograd
        nodes it puts around the call's outputs after the forward hooks ran, so a full
        backward pre-hook would run before the nodes commspan's output hooks are on,
        outside the module's backward. The call's backward starts from a pre-hook of
        commspan's put first among the ones torch took for this call: in the list the
        frame that called this hook (torch's ``Module._call_impl``) hands its
        ``BackwardHook`` next. (Nothing is registered on the module.)"""
        if module._is_full_backward_hook is False or (
                _torch_module._global_is_full_backward_hook is False):
            return  # old-style hooks: torch refuses both
        # (this function, _pre_fw, _global_pre_fw, then torch's frame)
        taken = sys._getframe(3).f_locals.get("backward_pre_hooks")
        if type(taken) is list:
            taken.insert(0, functools.partial(self._call_backward_starts, call))

    def _call_backward_starts(self, call: _Call, module: torch.nn.Module,
                              grad_output: Any) -> None:
        """commspan's full backward pre-hook of one call: the gradient of its outputs is
        ready. An observer hears of it from the outputs' own nodes, after the module's
        pre-hooks (which may change the gradient), as before."""
        self._output_grad_ready(call, grad_output, observe=False)

    def _finish_forward(
        self, info: ModuleInfo, module: torch.nn.Module, args: Any, output: Any, kwargs: Any,
        up: int,
    ) -> None:
        """The call's forward ended (``up``: how many frames up torch's frame that ran
        the hook is, where an exception the forward raised starts)."""
        raised = False  # the forward raised
        try:
            if self.unwound is not None:
                self.close_unwound()
            calls = self._calls
            idx = self._innermost_call(info)
            if idx < 0:
                return
            call = calls[idx]
            if call.wraps and not isinstance(module, _Compiled):
                return  # the compiled module's own call, inside its wrapper's: no frame
            del calls[idx:]
            # the hook's caller is torch's Module._call_impl (``up``); a call whose
            # forward returned and one of whose own forward hooks raised has an output
            error = (_raised_into(sys._getframe(up))
                     if output is None or _exc_info()[1] is not None else None)
            if error is not None:
                if isinstance(error, _StopRecomputation):
                    error = None  # checkpointing ends a recompute early this way: normal
                elif isinstance(error, RecursionError) and call.parent is not None:
                    # no stack left here to build spans: the next hook closes these
                    # frames, ERROR and event (the caller's, or the next call's if
                    # the caller caught it); the outermost frame it left wins
                    self.unwound = (call.frame, _without_traceback(error), id(error))
                    return
            if self.observer is not None:
                self.observer.post_fw(module, args, output)
                raised = error is not None
            if error is not None and not call.frame.closed:
                # frames above this one are calls the error crossed whose
                # hooks did not run: the innermost is where it came from
                self._record_exception(error)
            self.recorder.close_now(call.frame, error)
            error = None
            if info.ddp and output is not None and self.parallel is not None:
                # the bucket layout, read here and never in backward (docs/parallelisms.md)
                self.parallel.ddp_forward_done(
                    module._orig_mod if isinstance(module, _Compiled) else module, self.fqn)
            if output is not None and torch.is_grad_enabled():
                if kwargs:  # keyword inputs: seen only now
                    self._watch_inputs(call, kwargs, versions=False)
                self._watch_outputs(call, output)
        except Exception:
            self._errors.record()
        if self.observer is not None:
            observed = self._take_observed()
            # a forward that raised keeps its exception (torch silences a hook's then)
            if observed is not None and not raised:
                raise observed

    def close_unwound(self) -> None:
        """Close the frames a ``RecursionError`` left (see :attr:`unwound`), if any,
        before anything else is recorded: ERROR, and the innermost gets the
        ``exception`` event."""
        unwound, self.unwound = self.unwound, None
        if unwound is None:
            return
        frame, error, original = unwound
        if frame.closed:  # closed already by the outermost call it left
            return
        # marked as the error's own exception object (not the copy), which is still
        # on its way out: the spans it crosses get ERROR, not another event
        self._record_exception(error, original)
        self.recorder.close_now(frame, error)

    def _record_exception(self, error: BaseException, ident: int | None = None) -> None:
        """Put an ``exception`` event for ``error`` on the innermost open frame,
        unless it is already on a frame the error crossed before (``ident``: the
        ``id`` it goes by, when ``error`` stands for another exception object)."""
        rec = self.recorder
        mark = (id(error) if ident is None else ident, describe_error(error))
        if mark == self._error_mark:
            return
        self._error_mark = mark
        if rec.stack:
            rec.add_exception(rec.stack[-1], error)

    def _mark_interrupted(self) -> None:
        """The trace ends without an error while module calls are open: those whose
        module is not running now (no ``Module._call_impl`` of it on this thread's
        stack) never returned; a ``BaseException`` (``KeyboardInterrupt``,
        ``SystemExit``) crossed them, which no module hook sees, and was caught
        inside the step. Their frames end with ERROR saying so. (Only at the end of
        a trace: nothing is looked at per module call.)"""
        running: set[int] = set()
        frame: Any = sys._getframe(1)
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                running.add(id(frame.f_locals.get("self")))
            elif frame.f_code is _SPANNED_CALL:  # a module compiled in place
                running.add(id(frame.f_locals.get("module")))
            frame = frame.f_back
        for call in self._calls:
            if id(call.module()) not in running and call.frame.error is None:
                call.frame.error = _DID_NOT_RETURN

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
            self.close_unwound()
            if error is not None:
                self._record_exception(error)
            else:
                if self._calls:
                    self._mark_interrupted()
                if self._tasks:
                    self._abandon_backward()
        except Exception:
            self._errors.record()
        finally:
            self._error_mark = None
            self._errors.log_deferred()
