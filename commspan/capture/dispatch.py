"""The TorchDispatchMode that recognises collectives and describes them.

For every aten op the mode sees, the hot path is one check (a tensor
subclass such as DTensor is involved: let it run first, its local ops come
back here) and one dict lookup (is this a collective, a ``record_function``
label, or ``wait_tensor``?). A collective is described (op, tensors, process
group, sequence number, reduce op, peer, DTensor redistribution) and handed to
a callback; when the callback returns a
:class:`~commspan.spans.timing.CollectiveTiming`, the mode times the op from
issue to completion (:mod:`commspan.capture.completion`). The mode itself does
no IO and no counting.

It also keeps, per thread, the stack of ``torch.profiler.record_function``
labels open right now (:meth:`CollectiveDispatchMode.labels`): frameworks
name their communication with them (FSDP2's ``FSDP::all_gather (<unit>)``),
and :mod:`commspan.ownership` reads them when a collective is issued.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from commspan import semconv
from commspan._errors import ErrorCounter
from commspan.capture.collectives import (
    CollectiveInfo,
    build_overload_table,
    label_overloads,
    wait_overloads,
)
from commspan.capture.completion import CompletionTracker
from commspan.capture.dtensor import DTensor as _DTensor
from commspan.capture.dtensor import placements_str, skip_redistribution_text
from commspan.capture.groups import ProcessGroups
from commspan.spans.timing import CollectiveTiming

__all__ = [
    "MAX_LABELS", "CollectiveDispatchMode", "OpRecordingDispatchMode", "describe", "module_path",
    "module_source", "running_module",
]

_log = logging.getLogger(__name__)
_Tensor = torch.Tensor
_OpOverload: Any = torch._ops.OpOverload  # subclasses (TorchBindOpOverload) excluded
# a c10d op's overload: its __call__ looks for a FakeScriptObject in every argument
_TorchBindOpOverload: Any = getattr(torch._ops, "TorchBindOpOverload", None)
_contains_fake_script_object: Any = getattr(torch._ops, "_contains_fake_script_object", None)
try:
    from torch._library.fake_class_registry import FakeScriptObject as _FakeScriptObject
except ImportError:  # pragma: no cover - another torch: its overloads' own call
    _contains_fake_script_object = None
_ScriptObject = torch.ScriptObject
try:  # a c10d op's Work, as returned to the dispatch mode
    _unbox: Any = torch._C._distributed_c10d.Work.unbox  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - torch built without distributed
    _unbox = None

CollectiveCallback = Callable[[CollectiveInfo, dict[str, Any]], "CollectiveTiming | None"]
"""Told about each collective before it runs; returns the timing to complete, or ``None``."""
OpCallback = Callable[[Any, Any, Any, bool], None]
"""``on_op(func, types, args, deferred)``: see :class:`OpRecordingDispatchMode`."""

try:  # DTensor reports redistributions to the active DebugMode (torch >= 2.10 or so)
    import torch.distributed.tensor._redistribute as _redistribute_mod
    from torch.utils._debug_mode import DebugMode as _DebugMode

    REDISTRIBUTE_HOOK = callable(getattr(_DebugMode, "record_redistribute_calls", None)) and (
        hasattr(_redistribute_mod, "get_active_debug_mode")
    )
except Exception:  # pragma: no cover - older torch: no placements on events
    REDISTRIBUTE_HOOK = False

_ModeBase: Any = _DebugMode if REDISTRIBUTE_HOOK else TorchDispatchMode

_dynamo_callback: Any
try:  # Dynamo's frame callback: set while compiled code runs (see CollectiveDispatchMode)
    from torch._dynamo.eval_frame import skip_code as _skip_code

    _dynamo_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
    _DYNAMO_GUARD = True
except Exception:  # pragma: no cover - another torch: keep torch's own wrapper
    _DYNAMO_GUARD = False

    def _dynamo_callback() -> Any:
        return None

MAX_LABELS = 256
"""Most labels kept open per thread. A ``record_function`` ended through
``_call_end_callbacks_on_future`` never sends its exit op; labels beyond this
are not tracked, so the stack cannot grow without bound."""

# Markers in the op table: the profiler ops that open and close a label.
_LABEL_ENTER: Any = object()
_LABEL_EXIT: Any = object()
_perf = time.perf_counter_ns

_ACT: type | None
try:  # functional collectives' lazy outputs: an op on one may wait on it
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    _ACT = AsyncCollectiveTensor
except Exception:  # pragma: no cover - torch built without distributed
    _ACT = None

_WAIT = CollectiveInfo("wait_tensor", "wait", "_c10d_functional.wait_tensor", None,
                       0, -1, -1, -1, -1, ("tensor",))
"""The table's entry for ``wait_tensor``: the completion of a functional collective."""


def _op_name(op: Any) -> str:
    return "" if op is None else str(op)


def _waiting_lazy(lazy_type: Any, args: Any, kwargs: Any) -> list[Any]:
    """The lazy collective outputs not waited yet among an op's arguments: direct, or
    in a list or tuple argument (``torch.cat([a, b])``), positional or keyword."""
    found: list[Any] = []
    for values in (args, kwargs.values() if kwargs else ()):
        for a in values:
            if isinstance(a, lazy_type):
                if not a.completed:
                    found.append(a)
            elif type(a) is list or type(a) is tuple:
                found.extend(x for x in a if isinstance(x, lazy_type) and not x.completed)
    return found


class CollectiveDispatchMode(_ModeBase):  # type: ignore[misc,valid-type]
    """Calls ``on_collective(info, attributes)`` before each collective op runs.

    On torch builds whose DTensor reports redistributions to the active
    ``torch.utils._debug_mode.DebugMode`` (torch 2.13 does), this mode is such
    a mode, without DebugMode's own recording, so each collective carries the
    placements before and after the redistribution that issued it and the
    DTensor op that needed it. Elsewhere it is a plain ``TorchDispatchMode``
    and those attributes are absent.

    Args:
        on_collective: receives the op's :class:`CollectiveInfo` and its event
            attributes (everything but module and phase); returns a
            :class:`~commspan.spans.timing.CollectiveTiming` to complete when
            the op completes, or ``None``.
        groups: the process-group registry to describe groups with and to
            teach the meshes of redistributions (a new one if not given).
        timing: time collectives: also look up ``wait_tensor``, and notice when
            an op on the lazy output of a functional collective
            (``AsyncCollectiveTensor``) waited on it. ``False`` keeps the
            dispatch path exactly as without timing.
    """

    # DebugMode's switches: commspan records none of what DebugMode records.
    record_torchfunction = False
    record_stack_trace = False
    record_faketensor = False
    record_realtensor = False
    record_tensor_attributes = False
    record_ids = False
    record_output = False
    record_profiler_context = False
    record_localtensor = False
    store_original_args = False
    supports_higher_order_operators = True
    # torch.compile with the aot_eager backend: while a DebugMode is active and asks
    # for it, the compiled graph runs in torch's DebugInterpreter, which reports each
    # node's module stack to the mode (_handle_fx_nn_module_stack): the collectives of
    # the region are owned by the submodule that issued them. DebugMode's own module
    # tracking stays off (module_tracker below does nothing).
    run_compile_with_interpreter = True
    record_nn_module = True
    call_depth = 0
    current_nn_module_stack: tuple[str, ...] = ()

    def __init__(
        self,
        on_collective: CollectiveCallback,
        groups: ProcessGroups | None = None,
        *,
        timing: bool = False,
    ) -> None:
        # DebugMode.__init__ sets up op recording (and imports the compiler
        # stack); the plain TorchDispatchMode initialisation is all we need.
        TorchDispatchMode.__init__(self)
        entries: dict[Any, Any] = dict(build_overload_table())
        enter, leave = label_overloads()
        entries.update(dict.fromkeys(enter, _LABEL_ENTER))
        entries.update(dict.fromkeys(leave, _LABEL_EXIT))
        self._lazy: type | None = _ACT if timing else None
        if timing:
            entries.update(dict.fromkeys(wait_overloads(), _WAIT))
        self._ops = tuple(entries)  # keeps the keys' objects (and so their ids) alive
        self._table: dict[int, Any] = {id(op): info for op, info in entries.items()}
        self.completions = CompletionTracker()
        self._on_collective = on_collective
        self.groups = groups if groups is not None else ProcessGroups()
        self._tls = threading.local()
        self._errors = ErrorCounter(_log, "could not record a collective")
        self._text_undo: list[Callable[[], None]] = []  # one per __enter__ not left
        self.recording = True
        """``False``: collectives run as any op, undescribed and unnumbered (a step not
        traced while the mode stays on the stack under a mode pushed after it)."""

    @property
    def errors(self) -> int:
        """Internal errors counted so far (the first is logged)."""
        return self._errors.count

    # ------------------------------------------------ compiled regions (aot_eager)
    @property
    def module_tracker(self) -> _NoTracker:
        """DebugMode's module tracking, which commspan does not use."""
        return _NO_TRACKER

    @property
    def operators(self) -> _RegionLog:
        """Where torch's DebugInterpreter announces a compiled region's start and end."""
        return _RegionLog(self._tls)

    def _handle_fx_nn_module_stack(
        self, base: Any, nn_module_stack: Any, fwd_nn_module_stack: Any
    ) -> None:
        """The module stack of the compiled graph's next node: its innermost module
        (by identity, and its path in the compiled frame), and whether the node is
        forward or backward."""
        try:
            stack = nn_module_stack or fwd_nn_module_stack
            if stack:
                key = next(reversed(stack))
                self._tls.compiled = (key, bool(nn_module_stack), stack[key])
            else:
                self._tls.compiled = None
        except Exception:
            self._errors.record(message="could not read a compiled graph's module stack")

    def compiled_module(self) -> tuple[int, bool, str | None] | None:
        """In a compiled region run by torch's DebugInterpreter (aot_eager): the ``id``
        of the module the running node belongs to in the module the graph was traced
        on, whether the node is forward, and that module's dotted path under the
        compiled frame's module (``attn.proj``; ``None`` if not read); else None.

        Dynamo runs one graph for every module of a class (the parameters are its
        inputs): for another module than the one it traced, the ``id`` is of the
        traced module's submodule, the path is the running module's."""
        found = getattr(self._tls, "compiled", None)
        if found is None:
            return None
        key = found[0]
        try:
            if type(key) is str and "@" in key:  # "<id>@1": the module's second call
                key = key.split("@", 1)[0]
            return int(key), found[1], module_path(found[2])
        except (TypeError, ValueError):  # a key that is not a module id: unknown
            return None

    def compiled_source(self) -> tuple[str, str, Any] | None:
        """In a compiled region run by torch's DebugInterpreter: the local of the
        compiled frame the running node's module hangs under (``self``, or an
        argument: ``block`` of ``def run(block, x)``), the module's dotted path
        under it, and its class; ``None`` outside one, or for a module reached
        otherwise (a global)."""
        found = getattr(self._tls, "compiled", None)
        if found is None:
            return None
        source = module_source(found[2])
        if source is None:
            return None
        try:
            return source[0], source[1], found[2][1]
        except (TypeError, IndexError, KeyError):
            return None

    def __getattr__(self, name: str) -> Any:
        # torch internals probe DebugMode flags added in newer releases
        if name.startswith("record_"):
            return False
        raise AttributeError(name)

    ignores_redistribution_text = True
    """DTensor need not build the text of its redistributions for this mode
    (:func:`~commspan.capture.dtensor.skip_redistribution_text`): the placements
    are all it reads."""

    def __enter__(self) -> Any:
        entered = super().__enter__()
        self._text_undo.append(skip_redistribution_text())
        return entered

    def __exit__(self, *exc: Any) -> Any:
        undo = self._text_undo.pop() if self._text_undo else None
        try:
            return super().__exit__(*exc)
        finally:
            if undo is not None:
                undo()

    def on_top(self) -> bool:
        """Whether this mode is the innermost dispatch mode of this thread (only
        then can it leave the mode stack without disturbing modes pushed later)."""
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            return _get_current_dispatch_mode() is self
        except Exception:  # pragma: no cover - depends on the torch build
            return False

    # An "infra" mode for torch.compile: without this, torch 2.13 runs compiled
    # code eagerly whenever the mode is active.
    _compile_infra = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return cls._compile_infra

    # torch wraps every TorchDispatchMode's __torch_dispatch__ in a Dynamo-disabling
    # wrapper (1-2 µs on every op of the step, compiled or not). This class keeps Dynamo
    # out itself, paying only when Dynamo's frame callback is set (compiled code is
    # running): its __torch_dispatch__ is a frame Dynamo skips, and it hands the op to
    # a Dynamo-disabled copy of the dispatch then. Subclasses keep torch's wrapper.
    _guards_dynamo = _DYNAMO_GUARD

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not cls.__dict__.get("_guards_dynamo", False)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if _dynamo_callback() is not None:  # compiled code runs this op: Dynamo off
            return self._dispatch_without_dynamo(func, types, args, kwargs)
        if types:
            if types[0] is _DTensor or _defers(types):  # (DTensor,): the usual case
                # DTensor runs first: its local ops (collectives included) come back
                # here (so the op table is not read for it)
                if REDISTRIBUTE_HOOK:
                    self._tls.op = func
                return NotImplemented
            info = self._table.get(id(func))  # OpOverload.__hash__ is a Python call
            if info is _WAIT:  # on a lazy output, the usual case
                return self._wait(func, args, kwargs)
            if self._lazy is not None and _has(types, self._lazy):
                return self._on_lazy(func, args, kwargs or {}, info)
        else:
            info = self._table.get(id(func))
        if info is not None:
            if info is _WAIT:
                return self._wait(func, args, kwargs)
            if info is _LABEL_ENTER:
                return self._open_label(func, args, kwargs)
            if info is _LABEL_EXIT:
                self._close_label(args, kwargs)
            else:
                return self._collective(info, func, args, kwargs or {})
        if type(func) is _OpOverload:  # its __call__ is a Python frame around _op
            func = func._op
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)

    def knows(self, op: Any) -> bool:
        """Whether ``op`` (an overload or packet) is in this mode's op table: a
        collective, a ``record_function`` label op, or (with timing) ``wait_tensor``."""
        return id(op) in self._table

    def forget(self, op: Any) -> None:
        """Drop ``op`` from the op table: the mode then runs it as any other op."""
        self._table.pop(id(op), None)

    # the same, run with Dynamo's frame callback unset (so the check above passes)
    _dispatch_without_dynamo = torch._disable_dynamo(__torch_dispatch__, recursive=True)

    def _on_lazy(self, func: Any, args: Any, kwargs: Any, info: Any) -> Any:
        """An op on the lazy output of a functional collective (``AsyncCollectiveTensor``),
        ``info`` its entry in the op table: the subclass waits on it inside the op, out
        of this mode's sight; afterwards the outputs it waited on say so
        (``completed``), which is their completion."""
        lazy = _waiting_lazy(self._lazy, args, kwargs)
        start = _perf()
        if isinstance(info, CollectiveInfo):
            out = self._collective(info, func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if lazy:
            now = _perf()
            try:
                for a in lazy:
                    if a.completed:
                        self.completions.waited(a.elem, now, start)
            except Exception:
                self._errors.record(message="could not time the completion of a collective")
        return out

    # ------------------------------------------------ record_function labels
    def _open_label(self, func: Any, args: Any, kwargs: Any) -> Any:
        handle = func(*args, **kwargs) if kwargs else func(*args)
        try:
            tls = self._tls
            try:
                names = tls.labels
            except AttributeError:
                names = tls.labels = []
                tls.handles = []
            if len(names) < MAX_LABELS:
                names.append(args[0] if args else kwargs["name"])
                # the exit op receives another Python object for the same
                # handle: ``is`` fails, the hash matches
                tls.handles.append(hash(handle))
        except Exception:
            self._errors.record(message="could not track a record_function label")
        return handle

    def _close_label(self, args: Any, kwargs: Any) -> None:
        try:
            tls = self._tls
            handles = getattr(tls, "handles", None)
            if not handles:
                return
            key = hash(args[0] if args else next(iter(kwargs.values())))
            if handles[-1] == key:  # labels nest: the usual case
                handles.pop()
                tls.labels.pop()
                return
            for i in range(len(handles) - 2, -1, -1):
                if handles[i] == key:  # left out of order: those opened after it go too
                    del handles[i:]
                    del tls.labels[i:]
                    return
        except Exception:
            self._errors.record(message="could not track a record_function label")

    def labels(self) -> tuple[str, ...]:
        """The ``record_function`` labels open on this thread, outermost first."""
        names = getattr(self._tls, "labels", None)
        return tuple(names) if names else ()

    def clear_labels(self) -> None:
        """Forget this thread's open labels and compiled-region module stack (at
        the end of a step: a label whose exit the mode did not see, or a compiled
        region an exception left, must not outlive it)."""
        tls = self._tls
        tls.labels, tls.handles = [], []
        tls.compiled, tls.regions = None, []

    def _wait(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``wait_tensor``: run it, then complete the collective whose output it waited."""
        if type(func) is _OpOverload:  # its __call__ is a Python frame around _op
            func = func._op
        start = _perf()
        try:
            out = func(*args, **kwargs) if kwargs else func(*args)
        except BaseException:
            self._wait_failed(args, kwargs)
            raise
        now = _perf()
        try:
            tensor = args[0] if args else kwargs["tensor"]
            if type(tensor) is not _Tensor:
                tensor = getattr(tensor, "elem", tensor)  # a lazy output: the tensor inside
                if not isinstance(tensor, _Tensor):
                    return out
            # CompletionTracker.waited, inline: this runs once per functional collective
            completions = self.completions
            if completions.polled:
                completions.poll_some()
            timing = completions.outputs.pop(tensor.data_ptr() or id(tensor), None)
            if timing is not None:
                timing.wait_start = start
                if timing.hold is None and timing.duration is None:
                    timing.duration = now - timing.issued  # the usual case: done
                else:
                    completions.finish(timing, now)
        except Exception:
            self._errors.record(message="could not time the completion of a collective")
        return out

    def _wait_failed(self, args: Any, kwargs: Any) -> None:
        """``wait_tensor`` raised (the collective failed: a backend's timeout): the
        collective that made its tensor never completes; hang records list it failed."""
        try:
            tensor = args[0] if args else kwargs["tensor"]
            tensor = getattr(tensor, "elem", tensor)
            completions = self.completions
            timing = completions.outputs.pop(tensor.data_ptr() or id(tensor), None)
            if timing is not None:
                completions.give_up(timing, failed=True)
        except Exception:
            self._errors.record(message="could not note a failed collective")

    def _collective(self, info: CollectiveInfo, func: Any, args: Any, kwargs: Any) -> Any:
        """Describe a collective, hand it over, run it and time it; returns its result."""
        if not self.recording:  # (numbering it would set this rank's numbers apart)
            return func(*args, **kwargs)
        tls = self._tls
        timing: CollectiveTiming | None = None
        try:
            redist = self.current_redistribution()
            tensors = _tensor_list(_arg(info, args, kwargs, info.input_index))
            attrs = describe(info, args, kwargs, self.groups, tensors)
            if redist is not None:
                attrs[semconv.REDIST_SRC] = redist[0]
                attrs[semconv.REDIST_DST] = redist[1]
                if redist[2]:
                    attrs[semconv.REDIST_OP] = redist[2]
            if info.kind == semconv.KIND_P2P:  # which op it is: its tensor object
                tls.p2p_tensor = tensors[0] if tensors else None
            timing = self._on_collective(info, attrs)
        except Exception:  # tracing never breaks the step
            self._errors.record(info.overload, message="could not record collective %s")
        finally:
            tls.p2p_tensor = None
        if timing is None:
            if info.script_indices:  # a c10d op
                return _torchbind_call(func, info, args, kwargs)(*args, **kwargs)
            return func(*args, **kwargs)
        completions = self.completions
        if completions.cuda or completions.polled:
            try:
                started = completions.start(info, timing, args, kwargs)
            except Exception:
                self._errors.record(info.overload, message="could not time collective %s")
                completions.give_up(timing)
                return func(*args, **kwargs)
        else:  # CPU, nothing to poll: the issue time is all start() would take
            started = None
            timing.issued = _perf()
        try:
            if info.script_indices:  # a c10d op
                out = _torchbind_call(func, info, args, kwargs)(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
        except BaseException:
            completions.give_up(timing, failed=True)  # the op raised: it never completes
            raise
        try:
            if started is None:  # CompletionTracker.issued's usual cases on the CPU, inline
                if info.functional:
                    if type(out) is _Tensor:  # one output, found by its data pointer when waited
                        key = out.data_ptr()
                        if key:
                            outputs = completions.outputs
                            outputs[key] = timing
                            if len(outputs) > completions.sweep_at:
                                completions.sweep()
                            return out
                elif not kwargs and type(out) is tuple and out and type(out[-1]) is _ScriptObject:
                    # a c10d op and its Work; async_op, if given, is positional
                    index = info.async_index
                    handle = _unbox(out[-1])
                    if index < 0 or index >= len(args) or args[index] is not False:
                        completions.watch(info, timing, handle, None)
                    else:  # blocking: the caller waits right after this returns
                        completions.wait_blocking(timing, handle)
                    return out
            completions.issued(info, timing, args, kwargs, out, started)
        except Exception:
            self._errors.record(info.overload, message="could not time collective %s")
            completions.give_up(timing)
        return out

    def p2p_tensor(self) -> Any:
        """The tensor of the point-to-point op being described on this thread
        (inside the ``on_collective`` callback), else ``None``."""
        return getattr(self._tls, "p2p_tensor", None)

    # ------------------------------------------------ DTensor's debug-mode hooks
    def current_redistribution(self) -> tuple[str, str, str] | None:
        """``(src, dst, op)`` of the redistribution running now, if any.

        A redistribution that cannot be described counts one internal error;
        its collectives are recorded without placements.
        """
        stack = getattr(self._tls, "stack", None)
        if not stack:
            return None
        record = stack[-1]
        if record.failed:
            return None
        try:
            return record.describe()
        except Exception:
            record.failed = True
            self._errors.record(message="could not describe a DTensor redistribution")
            return None

    def record_redistribute_calls(
        self, arg: Any, src: Any, dst: Any, *rest: Any, **kwargs: Any
    ) -> _Redistribution:
        """Called by DTensor around every redistribution (a context manager).

        About half of DTensor's redistributions issue no collective (a
        replicated tensor is only sliced), so the record is cheap and its
        strings are built when a collective asks for them.
        """
        tls = self._tls
        stack = getattr(tls, "stack", None)
        if stack is None:
            stack = tls.stack = []
        try:  # learn the mesh now: a redistribution without collectives names it too
            learned = False
            if type(src) is not tuple or type(dst) is not tuple:  # (placements: no mesh)
                for spec in (src, dst):
                    mesh = getattr(spec, "mesh", None)
                    if mesh is not None:
                        self.groups.add_mesh(mesh)
                        learned = True
            if not learned:
                # an explicit redistribution (redistribute(), full_tensor()) passes
                # placements only; torch's caller (redistribute_local_tensor) holds the mesh
                mesh = sys._getframe(1).f_locals.get("device_mesh")
                if mesh is not None and hasattr(mesh, "get_group"):
                    self.groups.add_mesh(mesh)
        except Exception:
            self._errors.record(
                message="could not read the device mesh of a DTensor redistribution"
            )
        implicit = isinstance(arg, int)  # sharding propagation of a DTensor op
        return _Redistribution(
            stack,
            src,
            dst,
            getattr(tls, "op", None) if implicit else None,
            implicit,
            bool(kwargs.get("is_explicit", rest[1] if len(rest) > 1 else False)),
        )

    def record_output_placements(self, *args: Any, **kwargs: Any) -> None:
        """DTensor reports every op's output placements; commspan does not need them."""

    def record_triton_kernel(self, *args: Any, **kwargs: Any) -> None:
        """Called by the inductor launcher under DebugMode; ignored."""


if _DYNAMO_GUARD:  # Dynamo runs the guard's frame as it is, never compiles it
    _skip_code(CollectiveDispatchMode.__torch_dispatch__.__code__)


class OpRecordingDispatchMode(CollectiveDispatchMode):
    """A :class:`CollectiveDispatchMode` that also reports every op it sees.

    Only ``commspan.compat.CommDebugMode`` uses it (torch's CommDebugMode lists
    the ops run in each module at noise levels 1-3); ``CommSpanMode`` picks it
    at construction only when given an op observer, so the ordinary dispatch
    path pays nothing for it.

    ``on_op(func, types, args, deferred)`` is called once per op overload:
    with ``deferred=True`` before a tensor subclass such as DTensor runs the op
    (its local ops, collectives included, come back here afterwards), and with
    ``deferred=False`` after a plain op ran (after ``on_collective`` for a
    collective). Higher-order operators are not reported. An exception raised
    by ``on_op`` is counted in ``errors`` and never reaches the step.

    Like torch's CommDebugMode, and unlike :class:`CollectiveDispatchMode`, it
    is not an "infra" mode for ``torch.compile``: while it is active, dynamo
    runs frames eagerly, so every op reaches it (a compiled graph would run
    ops it does not list, such as in-place collectives).

    Args:
        on_collective: as for :class:`CollectiveDispatchMode`.
        on_op: called for each op, as above.
    """

    def __init__(
        self,
        on_collective: CollectiveCallback,
        on_op: OpCallback,
        groups: ProcessGroups | None = None,
        *,
        timing: bool = False,
    ) -> None:
        super().__init__(on_collective, groups, timing=timing)
        self._on_op = on_op

    _compile_infra = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            return super().__torch_dispatch__(func, types, args, kwargs)
        deferred = bool(types) and _defers(types)
        if deferred:  # reported before DTensor runs it (its local ops come back here)
            self._report(func, types, args, True)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not deferred:
            self._report(func, types, args, False)
        return out

    def _report(self, func: Any, types: Any, args: Any, deferred: bool) -> None:
        try:
            self._on_op(func, types, args, deferred)
        except Exception:  # tracing never breaks the step
            self._errors.record(func, message="could not record op %s")


class _Redistribution:
    """One redistribution DTensor reported, on a per-thread stack while it runs."""

    __slots__ = ("stack", "src", "dst", "op", "implicit", "explicit", "outer", "text", "failed")

    def __init__(
        self,
        stack: list[_Redistribution],
        src: Any,
        dst: Any,
        op: Any,
        implicit: bool,
        explicit: bool,
    ) -> None:
        self.stack, self.src, self.dst, self.op = stack, src, dst, op
        self.implicit, self.explicit = implicit, explicit
        self.outer: _Redistribution | None = None
        self.text: tuple[str, str, str] | None = None
        self.failed = False

    def __enter__(self) -> None:
        stack = self.stack
        if stack:
            self.outer = stack[-1]
        stack.append(self)

    def __exit__(self, *exc: Any) -> None:
        stack = self.stack
        if stack and stack[-1] is self:
            stack.pop()
        else:  # left out of order: never leave a stale record behind
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self:
                    del stack[i]
                    break
        self.outer = None

    def describe(self) -> tuple[str, str, str]:
        """``(src, dst, op)``: placements before and after, and what asked for it."""
        text = self.text
        if text is not None:
            return text
        src, dst = self.src, self.dst
        src_s = placements_str(getattr(src, "placements", src))
        dst_s = placements_str(getattr(dst, "placements", dst))
        if self.implicit:
            op = _op_name(self.op)
        elif self.outer is not None:  # the inner call of an implicit one: keep its op
            op = self.outer.describe()[2]
        elif self.explicit:
            op = "redistribute"
        else:  # DTensor's backward redistributes inside an autograd node
            node = torch._C._current_autograd_node()
            op = node.name() if node is not None else "redistribute"
        self.text = text = (src_s, dst_s, op)
        return text


def _defers(types: Any) -> bool:
    if _DTensor is None:
        return False
    for t in types:
        if issubclass(t, _DTensor):
            return True
    return False


def _has(types: Any, cls: type) -> bool:
    for t in types:
        if issubclass(t, cls):
            return True
    return False


def _torchbind_call(func: Any, info: CollectiveInfo, args: Any, kwargs: Any) -> Any:
    """What to call to run a c10d op's overload (a ``TorchBindOpOverload``) as its
    ``__call__`` would: its C++ op, without ``__call__``'s search of every argument
    and list item for a ``FakeScriptObject`` (a Python frame each), when none of the
    arguments whose schema type is a TorchBind class holds one; else the overload
    (torch's own check and call)."""
    if kwargs or type(func) is not _TorchBindOpOverload or _contains_fake_script_object is None:
        return func
    for index in info.script_indices:
        if index < len(args):
            value = args[index]
            if isinstance(value, _FakeScriptObject) or (
                    isinstance(value, _CONTAINERS) and _contains_fake_script_object(value)):
                return func
    return func._op


_CONTAINERS = (list, tuple, dict)


def _arg(info: CollectiveInfo, args: Any, kwargs: Any, index: int) -> Any:
    if index < 0:
        return None
    if index < len(args):
        return args[index]
    if kwargs:
        return kwargs.get(info.arg_names[index])
    return None


_DTYPE_NAMES: dict[torch.dtype, str] = {}
"""``torch.float32`` -> ``"float32"``, as events name dtypes (filled as they come)."""


def _tensor_list(value: Any) -> list[torch.Tensor]:
    if isinstance(value, _Tensor):
        return [value]
    out: list[torch.Tensor] = []
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, _Tensor):
                out.append(item)
            elif isinstance(item, (list, tuple)):
                out.extend(t for t in item if isinstance(t, _Tensor))
    return out


class _NoTracker:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NO_TRACKER = _NoTracker()


_PATH_ROOT = re.compile(r"L\['([A-Za-z_][A-Za-z0-9_]*)'\]")
_PATH_STEP = re.compile(  # .__dict__['_modules']['x'] (a module with a __getattr__ of
    # its own: checkpoint_wrapper's) | ._modules['x'] | .x | [0] | ['x']
    r"\.__dict__\['_modules'\]\['([^'\]]+)'\]|"
    r"\._modules\['([^'\]]+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\['([^'\]]+)'\]")


def module_source(entry: Any) -> tuple[str, str] | None:
    """The local of the compiled frame a graph node's module hangs under and the
    module's dotted path there, from an ``nn_module_stack`` entry
    (``("L['self'].layers[0].attn", Attention)`` -> ``("self", "layers.0.attn")``;
    path ``""`` for that local's module itself); ``None`` for another root (a
    global) or a path of another form.

    Example:
        >>> module_source(("L['block']._modules['mlp'].fc", object))
        ('block', 'mlp.fc')
        >>> module_source(("G['model'].fc", object)) is None
        True
    """
    try:
        path = entry[0]
    except (TypeError, IndexError, KeyError):
        return None
    if type(path) is not str:
        return None
    root = _PATH_ROOT.match(path)
    if root is None:
        return None
    parts: list[str] = []
    pos = root.end()
    while pos < len(path):
        step = _PATH_STEP.match(path, pos)
        if step is None:
            return None
        parts.append(next(g for g in step.groups() if g is not None))
        pos = step.end()
    return root.group(1), ".".join(parts)


def module_path(entry: Any) -> str | None:
    """The dotted path of a compiled graph node's module under the module whose
    ``forward`` was compiled (the frame's ``self``), from an ``nn_module_stack``
    entry (``("L['self'].layers[0].attn", Attention)`` -> ``layers.0.attn``;
    ``""`` for that module itself); ``None`` for another root (a global, another
    argument) or a path of another form.

    Example:
        >>> module_path(("L['self']._modules['mlp'].fc", object))
        'mlp.fc'
        >>> module_path(("L['self'].__dict__['_modules']['block'].fc", object))
        'block.fc'
        >>> module_path(("G['model'].fc", object)), module_path(("L['other'].fc", object))
        (None, None)
    """
    source = module_source(entry)
    return source[1] if source is not None and source[0] == "self" else None


_FRAMES_SEARCHED = 256  # frames up from a collective to the compiled frame, at most


def running_module(local: str, path: str, cls: Any) -> torch.nn.Module | None:
    """The module a compiled graph's forward node runs for, found on the Python
    stack: the innermost frame whose ``local`` is a module holding, at ``path``,
    a module of class ``cls`` (the compiled frame, which called the graph); that
    module, or ``None``.

    Dynamo runs one graph for every module of a class (their parameters are its
    inputs) and the graph names the modules of the one it traced: which one runs
    is the compiled frame's ``self`` (or argument), which only the stack knows.
    Forward only: a backward runs from the autograd engine, without that frame."""
    parts = path.split(".") if path else ()
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            return None
        if local in frame.f_code.co_varnames:
            module = frame.f_locals.get(local)
            if isinstance(module, torch.nn.Module):
                for part in parts:
                    module = module.__dict__.get("_modules", {}).get(part)
                    if module is None:
                        break
                if module is not None and type(module) is cls:
                    return module
        frame = frame.f_back
    return None


class _RegionLog:
    """Stands in for DebugMode's op log for the DebugInterpreter: its ``enter`` and
    ``exit`` annotations bracket a compiled region; the module stack of a region is
    forgotten when it ends (regions nest)."""

    __slots__ = ("_tls",)

    def __init__(self, tls: threading.local) -> None:
        self._tls = tls

    def append(self, call: Any) -> None:
        tag = getattr(call, "tag", None)
        tls = self._tls
        if tag == "enter":
            saved = getattr(tls, "regions", None)
            if saved is None:
                saved = tls.regions = []
            saved.append(getattr(tls, "compiled", None))
            tls.compiled = None
        elif tag == "exit":
            saved = getattr(tls, "regions", None)
            tls.compiled = saved.pop() if saved else None


def describe(
    info: CollectiveInfo, args: Any, kwargs: Any, groups: ProcessGroups,
    tensors: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Event attributes of one collective call (no module, phase or placements);
    ``tensors``: its input tensors, when the caller has them already."""
    attrs: dict[str, Any] = {
        semconv.COLL_OP: info.name,
        semconv.COLL_OVERLOAD: info.overload,
        semconv.COLL_KIND: info.kind,
    }
    if tensors is None:
        tensors = _tensor_list(_arg(info, args, kwargs, info.input_index))
    if tensors:
        first = tensors[0]
        attrs[semconv.TENSOR_SHAPE] = list(first.shape)
        dtype = first.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
        attrs[semconv.TENSOR_DTYPE] = name
        attrs[semconv.TENSOR_BYTES] = sum(t.numel() * t.element_size() for t in tensors)
        attrs[semconv.TENSOR_COUNT] = len(tensors)
    group = _arg(info, args, kwargs, info.group_index)
    if group is None and info.ranks_index >= 0:
        group = _legacy_group(_arg(info, args, kwargs, info.ranks_index))
    g = groups.get(group)
    ranks: list[int] = []
    if g is not None:
        name, size, ranks = g
        attrs[semconv.PG_NAME] = name
        attrs[semconv.PG_SIZE] = size
        attrs[semconv.PG_RANKS] = ranks
        mesh_dim = groups.mesh_dims.get(name)
        if mesh_dim is not None:
            attrs[semconv.MESH_DIM] = mesh_dim
        dim_name = groups.mesh_dim_names.get(name)
        if dim_name is not None:  # (known without the index from the group's description)
            attrs[semconv.MESH_DIM_NAME] = dim_name
        if info.kind != semconv.KIND_P2P:
            attrs[semconv.COLL_SEQ] = groups.next_seq(name)
    reduce_op = _reduce_name(_arg(info, args, kwargs, info.reduce_index))
    if reduce_op is not None:
        attrs[semconv.COLL_REDUCE_OP] = reduce_op
    if info.split_in_index >= 0:  # all_to_all_single: how much goes to / comes from each rank
        for index, key in ((info.split_in_index, semconv.COLL_INPUT_SPLITS),
                           (info.split_out_index, semconv.COLL_OUTPUT_SPLITS)):
            splits = _arg(info, args, kwargs, index) if index >= 0 else None
            if splits and all(type(n) is int for n in splits):
                attrs[key] = list(splits)
    if info.root_index >= 0:
        root = _arg(info, args, kwargs, info.root_index)
        if type(root) is int:
            attrs[semconv.COLL_ROOT] = _global_rank(root, ranks)
    if info.peer_index >= 0:
        peer = _arg(info, args, kwargs, info.peer_index)
        if not info.peer_is_group_rank:
            ranks = []  # functional isend/irecv already take global ranks
        if isinstance(peer, int):
            attrs[semconv.COLL_PEER] = _global_rank(peer, ranks)
        elif isinstance(peer, (list, tuple)) and all(isinstance(p, int) for p in peer):
            attrs[semconv.COLL_PEER] = [_global_rank(p, ranks) for p in peer]
    if info.kind == semconv.KIND_P2P:
        if info.tag_index >= 0:
            tag = _arg(info, args, kwargs, info.tag_index)
            if tag and type(tag) is int:
                attrs[semconv.P2P_TAG] = tag
        peer = attrs.get(semconv.COLL_PEER)
        if g is not None and peer is not None:  # (a receive from any source: no number)
            attrs[semconv.P2P_SEQ] = groups.next_p2p_seq(
                g[0], info.name, tuple(peer) if type(peer) is list else peer)
    return attrs


def _global_rank(group_rank: int, ranks: list[int]) -> int:
    """c10d ops take peers as ranks within their group; events report global ranks."""
    if 0 <= group_rank < len(ranks):
        return ranks[group_rank]
    return group_rank


def _legacy_group(ranks: Any) -> Any:
    if isinstance(ranks, (list, tuple)):
        return tuple(int(r) for r in ranks)
    return None


_REDUCE_NAMES: dict[int, str] = {}


def _reduce_name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.lower()
    try:
        import torch.distributed as dist

        if not _REDUCE_NAMES:
            for name, member in dist.ReduceOp.RedOpType.__members__.items():
                _REDUCE_NAMES[int(member.value)] = name.lower()
        if isinstance(value, torch.ScriptObject):
            code = value.op()  # type: ignore[attr-defined]
        elif isinstance(value, dist.ReduceOp):
            code = value.op  # type: ignore[attr-defined]
        else:
            code = value
        code = int(getattr(code, "value", code))
        return _REDUCE_NAMES.get(code, str(code))
    except Exception:
        return str(value)
