"""A drop-in for torch 2.13's ``CommDebugMode``, on commspan.

Module events come from :class:`~commspan.CommSpanMode`'s module hooks, ops
and collectives from its dispatch mode (which lists every op only for this
class). From them this module keeps the data torch's class keeps, under the
same names and in the same shapes:

* ``comm_counts`` and ``comm_module_counts`` (``{fqn: {"forward": ...,
  "backward": ...}}``, ``Global`` present from the moment the context is
  entered): a collective counts for the current module and every module that
  was open when that module first ran;
* ``comm_module_operation_counts``: every op, under the current module, with
  the global shapes, placements and mesh of its DTensor arguments;
* ``advanced_module_tracker``: ``module_helper_dict``, ``module_parameters_dict``,
  ``sharding_dict``, ``parent_dict``, ``module_parents_dict``, ``name``, ...

and writes torch's reports from them: the table at noise levels 0-3, its log
file, and the JSON file torch's browser visualizer reads.

The current module is the one whose forward is running; in backward, the
module whose backward started last; during an activation-checkpoint
recompute, the module whose recompute started last. Differences from torch
2.13 are listed in docs/compat.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from commspan import semconv
from commspan.capture.backward import hook_first
from commspan.capture.dtensor import DTensor
from commspan.compat import _report
from commspan.compat._counting import ModuleCounts, NamedDict, OpCounts, counted_ops, registry
from commspan.compat.mod_tracker import ModTracker, _UserHooks
from commspan.session import CommSpanMode

__all__ = ["CommDebugMode"]

_log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")
_graph_task_id = torch._C._current_graph_task_id
_GLOBAL = semconv.GLOBAL_FQN

def _no_fake_mode(inputs: Any = None) -> Any:
    return None


try:
    from torch._guards import detect_fake_mode as _detect_fake_mode
except Exception:  # pragma: no cover - depends on the torch build
    _detect_fake_mode = _no_fake_mode  # type: ignore[assignment]


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad in ``obj`` (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    out: list[torch.Tensor] = []
    if isinstance(obj, (tuple, list)):
        for item in obj:
            out.extend(_grad_tensors(item))
    elif isinstance(obj, dict):
        for item in obj.values():
            out.extend(_grad_tensors(item))
    return out


def _passthrough_grad_ready(owner_ref: Any, fqn: str, grads: Any) -> None:
    """A module handed an input back as its output, and that tensor's gradient is ready."""
    owner = owner_ref()
    if owner is None or not owner.mode.active or _graph_task_id() == -1:
        return
    try:
        owner.advanced_module_tracker._pre_bw(fqn)
    except Exception:  # never break the user's backward
        owner._internal_error()


def _type_name(module: torch.nn.Module) -> str:
    """``class 'torch.nn.modules.linear.Linear'``: the type's repr without angle brackets."""
    return str(type(module)).replace("<", "").replace(">", "")


class _CommModeTracker(ModTracker):
    """``CommDebugMode.advanced_module_tracker``: what ran, where, with which parameters.

    Attributes:
        module_helper_dict: ``{fqn: {"module_type", "depth"[, "parameters"]}}``
            in first-call order, starting with ``{"Global": {"depth": 0}}``;
            ``parameters`` maps the names of the module's own DTensor
            parameters to their placements (as text).
        module_parameters_dict: ``{fqn: {name: param.data}}`` of the modules
            with parameters of their own.
        sharding_dict: ``{"<fqn>.<name>": placements}`` of DTensor parameters.
        parent_dict: ``{caller fqn: [callee fqns in call order]}`` from ``Global``.
        module_parents_dict: ``{fqn: set of the names open at its first call,
            itself and Global included}``.
        parent_list: the forward call stack, ``Global`` at the bottom.
        activation_checkpointing: whether the current module is being recomputed.
        register_forward_hook_handles: always empty (no per-module hook is
            registered; torch 2.13 keeps one per module here).
    """

    def __init__(self, mode: CommSpanMode) -> None:
        self._clear_hooks()
        self.mode = mode
        known = self._ran
        self.module_helper_dict: dict[str, dict[str, Any]] = NamedDict(
            "module_helper_dict", known, "")
        self.module_parameters_dict: dict[str, dict[str, Any]] = NamedDict(
            "module_parameters_dict", known, "the module has no parameters of its own")
        self.module_parents_dict: dict[str, set[str]] = NamedDict(
            "module_parents_dict", known, "")
        self.parent_dict: dict[str, list[str]] = NamedDict(
            "parent_dict", known, "the module called no other module")
        self.sharding_dict: dict[str, Any] = {}
        self.register_forward_hook_handles: dict[str, Any] = {}
        self.parent_list: list[str] = [_GLOBAL]
        self.activation_checkpointing = False
        self._name = _GLOBAL
        self._name_from_bw = False
        self._reset()

    def _ran(self) -> Iterable[str]:
        return [fqn for fqn in self.module_helper_dict if fqn != _GLOBAL]

    def __enter__(self) -> _CommModeTracker:
        raise RuntimeError(
            "advanced_module_tracker is entered by the CommDebugMode that owns it; "
            "use `with comm_mode:` (or a separate commspan.compat.ModTracker)"
        )

    def __exit__(self, *exc: Any) -> None:
        """Nothing to undo: the owning CommDebugMode installs and removes the hooks."""

    def _reset(self) -> None:
        self.module_helper_dict.clear()
        self.module_helper_dict[_GLOBAL] = {"depth": 0}
        self.module_parameters_dict.clear()
        self.module_parents_dict.clear()
        self.module_parents_dict[_GLOBAL] = set()
        self.parent_dict.clear()
        self.sharding_dict.clear()
        self.register_forward_hook_handles.clear()
        self.parent_list = [_GLOBAL]
        self.activation_checkpointing = False
        self._name = _GLOBAL
        self._name_from_bw = False

    @property
    def name(self) -> str:
        """The current module: ops and collectives are filed under it."""
        if self._name_from_bw and _graph_task_id() == -1:
            # backward is over: the current module is the one whose forward is
            # running, or Global (torch 2.13 keeps the module whose backward
            # started last)
            self._name = self.parent_list[-1]
            self._name_from_bw = False
            self.activation_checkpointing = False
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value
        self._name_from_bw = False

    @property
    def module_depth_dict(self) -> dict[str, int]:
        """``{fqn: depth}`` of the modules that ran, ``Global`` (0) first."""
        return {fqn: int(info["depth"]) for fqn, info in self.module_helper_dict.items()}

    # ------------------------------------------------------------ module events
    def _pre_fw(self, module: torch.nn.Module, fqn: str, open_names: set[str]) -> None:
        recompute = _graph_task_id() != -1
        self.activation_checkpointing = recompute
        self.name = fqn
        if recompute:
            return
        helper = self.module_helper_dict.get(fqn)
        if helper is None:
            helper = self.module_helper_dict[fqn] = {}
        helper["module_type"] = _type_name(module)
        helper["depth"] = len(open_names) - 1
        for pname, param in module.named_parameters(recurse=False):
            self.module_parameters_dict.setdefault(fqn, {})[pname] = param.data
            if DTensor is not None and isinstance(param, DTensor):
                placements = param.placements
                self.sharding_dict[f"{fqn}.{pname}"] = placements
                helper.setdefault("parameters", {})[pname] = str(placements)
        if fqn not in self.module_parents_dict:
            self.module_parents_dict[fqn] = set(open_names)
        callees = self.parent_dict.setdefault(self.parent_list[-1], [])
        if fqn not in callees:
            callees.append(fqn)
        self.parent_list.append(fqn)

    def _post_fw(self, fqn: str) -> None:
        if _graph_task_id() != -1:  # a recompute leaves the current module as it is
            self.activation_checkpointing = True
            return
        self.activation_checkpointing = False
        stack = self.parent_list
        for i in range(len(stack) - 1, 0, -1):
            if stack[i] == fqn:
                del stack[i:]
                break
        self.name = stack[-1]

    def _pre_bw(self, fqn: str) -> None:
        self.activation_checkpointing = False
        self._name = fqn
        self._name_from_bw = True

    def _ancestors(self, fqn: str) -> list[str]:
        """The modules a collective of ``fqn`` also counts for, outermost first."""
        parents = self.module_parents_dict.get(fqn)
        if parents is None:  # first seen in backward: torch 2.13 raises KeyError here
            return [] if fqn == _GLOBAL else [_GLOBAL]
        helper = self.module_helper_dict
        others = [p for p in parents if p != fqn]
        return sorted(others, key=lambda p: (helper[p]["depth"] if p in helper else 0, p))

    # ------------------------------------------------------------ printing
    def print_paramater_info(self) -> None:
        """Print ``module_parameters_dict`` (torch's spelling of the name)."""
        print(self.module_parameters_dict)

    print_parameter_info = print_paramater_info

    def print_sharding_info(self) -> None:
        """Print one ``<fqn>.<param>: placements`` line per DTensor parameter."""
        for key, value in self.sharding_dict.items():
            print(f"{key}: {value}")


class _Observer:
    """Feeds commspan's module events to the tracker (and its user hooks)."""

    def __init__(self, owner: CommDebugMode) -> None:
        self._owner = owner

    def take_error(self) -> BaseException | None:
        """The exception a user hook raised (for the mode to raise it), if any."""
        return self._owner._user_hooks.take_error()

    def _fqn(self, module: Any) -> str | None:
        if module is None:
            return None
        return self._owner.mode.module_name(module)

    def pre_fw(self, module: torch.nn.Module, args: Any) -> None:
        owner = self._owner
        fqn = self._fqn(module)
        if fqn is not None:
            open_now = {s.fqn for s in owner.mode.open_spans() if not s.finished}
            owner._muted += 1  # reading param.data dispatches a detach: not the user's op
            try:
                owner.advanced_module_tracker._pre_fw(
                    module, fqn, open_now | {_GLOBAL}
                )
            finally:
                owner._muted -= 1
        owner._user_hooks.pre_fw(module, args)

    def post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        fqn = self._fqn(module)
        if fqn is not None:
            self._owner.advanced_module_tracker._post_fw(fqn)
            if output is not None and torch.is_grad_enabled():
                self._watch_passthrough(fqn, args, output)
        self._owner._user_hooks.post_fw(module, args, output)

    def _watch_passthrough(self, fqn: str, args: Any, output: Any) -> None:
        """An output that is one of the inputs (Identity, Dropout(p=0)) gets no
        backward from commspan's tracker; torch 2.13 starts that module's
        backward when the tensor's gradient is ready, so its producer's
        backward ops are filed under it. Do the same."""
        inputs = {id(t) for t in _grad_tensors(args)}
        if not inputs:
            return
        hook = None
        for t in _grad_tensors(output):
            # not on a leaf: a hook there would outlive the graph
            if id(t) in inputs and t.grad_fn is not None:
                if hook is None:
                    hook = functools.partial(
                        _passthrough_grad_ready, weakref.ref(self._owner), fqn
                    )
                # first of the tensor's hooks: before the one that starts the
                # backward of the module that made it
                key = t.register_hook(hook).id
                hook_first(t._backward_hooks, key)

    def pre_bw(self, module: Any, grads: Any) -> None:
        fqn = self._fqn(module)
        if fqn is None and module is None:
            # freed since its forward (a helper built and called it, returning the
            # loss): its backward span was opened just now, the innermost open one
            spans = self._owner.mode.open_spans()
            if spans and not spans[-1].finished and \
                    spans[-1].attributes.get(semconv.PHASE) == semconv.Phase.BACKWARD.value:
                fqn = spans[-1].fqn
        if fqn is not None:
            self._owner.advanced_module_tracker._pre_bw(fqn)
        self._owner._user_hooks.pre_bw(module, grads)

    def post_bw(self, module: Any, grads: Any) -> None:
        self._owner._user_hooks.post_bw(module, grads)


class CommDebugMode:
    """Counts collectives per module and lists ops like torch 2.13's ``CommDebugMode``.

    A drop-in: the same attributes, methods, defaults and report formats
    (see docs/compat.md for the few deliberate differences). A module may run
    any number of times in one context, and nothing stays registered after it.

    Args:
        record_operations: keep every op in ``comm_module_operation_counts``,
            as torch does (what noise levels 1-3 list). ``False`` keeps counts
            only: less memory in long contexts; reports then list no ops.
        **mode_kwargs: passed to the :class:`~commspan.CommSpanMode` that
            records the spans (e.g. ``exporters=[...]``). Without ``run_id=`` the
            mode's run id is its own: entering it talks to no other rank (as
            torch's class does not), so it may be entered on some ranks only; pass
            ``run_id=`` (the same on every rank) for exported spans that all ranks
            share per step.

    Raises:
        TypeError: ``record_operations`` is not a bool.

    Example:
        >>> import torch
        >>> from commspan.compat import CommDebugMode
        >>> comm_mode = CommDebugMode()
        >>> with comm_mode:
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
        >>> comm_mode.get_total_counts()
        0
        >>> comm_mode.comm_module_counts
        {'Global': {'forward': {}, 'backward': {}}}
        >>> print(comm_mode.generate_comm_debug_tracing_table(noise_level=0), end="")
        Global
            Linear
    """

    supports_higher_order_operators = True

    def __init__(self, *, record_operations: bool = True, **mode_kwargs: Any) -> None:
        if not isinstance(record_operations, bool):
            raise TypeError(
                f"record_operations={record_operations!r} is not valid; pass True (list "
                "every op, as torch does) or False (counts only)"
            )
        self._record_ops = record_operations
        self._muted = 0
        self._errors = 0
        self._depth = 0  # `with` entries inside the active one
        self._keys = counted_ops()
        self.comm_registry: set[Any] = registry()
        self.comm_counts: dict[Any, int] = OpCounts()
        mode_kwargs.setdefault("run_id", uuid.uuid4().hex)  # (no agreement across ranks)
        self.mode = CommSpanMode(
            module_observer=_Observer(self), _op_observer=self._on_op, _fresh_names=True,
            _torch_names=True,  # torch's names inside activation-checkpointing wrappers
            **mode_kwargs,
        )
        self.advanced_module_tracker = _CommModeTracker(self.mode)
        ran = self.advanced_module_tracker._ran
        self.comm_module_counts: dict[str, Any] = NamedDict(
            "comm_module_counts",
            ran,
            "a module gets an entry once a collective is counted in it or in a module it called",
        )
        self.comm_module_operation_counts: dict[str, Any] = NamedDict(
            "comm_module_operation_counts",
            ran,
            "no op ran while it was the current module",
        )
        self._user_hooks = _UserHooks(self.advanced_module_tracker)
        self.comm_module_counts[_GLOBAL] = ModuleCounts()

    def __enter__(self) -> CommDebugMode:
        if self.mode.active:  # `with comm_mode:` inside itself: one context, counted once
            self._depth += 1
            return self
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self.comm_module_counts[_GLOBAL] = ModuleCounts()
        self.comm_module_operation_counts.clear()
        self.advanced_module_tracker._reset()
        self._keys = counted_ops()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._depth:
            self._depth -= 1
            return
        self.mode.__exit__(*exc)

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"

    def _internal_error(self) -> None:
        self._errors += 1
        if self._errors == 1:
            _log.warning(
                "commspan.compat: internal error while tracking modules; the op lists "
                "may file some ops under another module (further errors are not logged)",
                exc_info=True,
            )

    @property
    def aggregator(self) -> Any:
        """The commspan Aggregator of the spans recorded in the context (native API)."""
        return self.mode.aggregator

    # ------------------------------------------------------------ recording
    def _on_op(self, func: Any, types: Any, args: Any, deferred: bool) -> None:
        if self._muted:
            return
        tracker = self.advanced_module_tracker
        name = tracker.name
        in_bw = _graph_task_id() != -1
        if not deferred:
            key = self._keys.get(func._overloadpacket)
            if key is not None:
                self._count(key, name, in_bw)
        if not self._record_ops:
            return
        entry = self.comm_module_operation_counts.get(name)
        if entry is None:
            entry = self.comm_module_operation_counts[name] = {"operations_list": []}
        shapes: list[Any] = []
        placements: list[Any] = []
        mesh = ""
        if deferred:
            for arg in args:
                if DTensor is not None and isinstance(arg, DTensor):
                    shapes.append(arg.shape)
                    placements.append(arg.placements)
                    mesh = str(arg.device_mesh)
        elif _detect_fake_mode(args) is not None:
            return  # fake tensors do no real work (torch lists none of these either)
        entry["operations_list"].append({
            "name": func,
            "input_shape": shapes,
            "input_sharding": placements,
            "device_mesh": mesh,
            "is_bw": in_bw,
            "is_activation_checkpointing": tracker.activation_checkpointing,
        })

    def _count(self, key: Any, name: str, in_bw: bool) -> None:
        counts = self.comm_counts
        counts[key] = dict.get(counts, key, 0) + 1
        phase = "backward" if in_bw else "forward"
        per_module = self.comm_module_counts
        for fqn in [name, *self.advanced_module_tracker._ancestors(name)]:
            entry = per_module.get(fqn)
            if entry is None:
                entry = per_module[fqn] = ModuleCounts()
            ops = entry[phase]
            ops[key] = dict.get(ops, key, 0) + 1

    # ------------------------------------------------------------ counts
    def get_total_counts(self) -> int:
        """Number of collectives counted in the context."""
        return int(sum(self.comm_counts.values()))

    def get_comm_counts(self) -> dict[Any, int]:
        """``{packet: count}`` over the context, the live mapping (any spelling of an op reads)."""
        return self.comm_counts

    def get_comm_module_counts(self) -> dict[str, Any]:
        """``comm_module_counts``: ``{fqn: {"forward": {packet: n}, "backward": {...}}}``."""
        return self.comm_module_counts

    def get_parameter_info(self) -> dict[str, dict[str, Any]]:
        """``{module fqn: {param name: param.data}}`` of the modules that ran."""
        return self.advanced_module_tracker.module_parameters_dict

    def get_sharding_info(self) -> dict[str, Any]:
        """``{"<fqn>.<param>": placements}`` of the DTensor parameters seen."""
        return self.advanced_module_tracker.sharding_dict

    def print_parameter_info(self) -> None:
        """Print :meth:`get_parameter_info`."""
        self.advanced_module_tracker.print_paramater_info()

    print_paramater_info = print_parameter_info

    def print_sharding_info(self) -> None:
        """Print one ``<fqn>.<param>: placements`` line per DTensor parameter."""
        self.advanced_module_tracker.print_sharding_info()

    # ------------------------------------------------------------ reports
    def generate_comm_debug_tracing_table(self, noise_level: float = 3) -> str:
        """The module table in torch's layout.

        Args:
            noise_level: 0 modules and collectives; 1 also module types,
                DTensor parameters and non-trivial DTensor ops; 2 also other
                non-trivial ops; 3 every op. Below 0 acts as 0, above 3 as 3.

        Returns:
            The table, with ANSI colours.

        Raises:
            TypeError: ``noise_level`` is not a number.
            ValueError: ``noise_level`` is NaN.
        """
        level = _report.noise_level(noise_level)
        tracker = self.advanced_module_tracker
        return _report.table(
            tracker.module_helper_dict,
            self.comm_module_counts,
            self.comm_module_operation_counts,
            level,
        )

    generate_module_tracing_table = generate_comm_debug_tracing_table

    def log_comm_debug_tracing_table_to_file(
        self, file_name: str | os.PathLike[str] = "comm_mode_log.txt", noise_level: float = 3
    ) -> None:
        """Write :meth:`generate_comm_debug_tracing_table` without colours to ``file_name``.

        Raises:
            TypeError: ``noise_level`` is not a number.
            ValueError: ``noise_level`` is NaN.
            OSError: ``file_name`` cannot be written.
        """
        text = _ANSI.sub("", self.generate_comm_debug_tracing_table(noise_level))
        with open(file_name, "w") as fh:
            fh.write(text)

    def generate_json_dump(
        self, file_name: str | os.PathLike[str] = "comm_mode_log.json", noise_level: float = 3
    ) -> None:
        """Write the JSON file torch's browser visualizer reads.

        One object per module from ``Global`` down the calls, with ``fqn``,
        ``module_type``, ``parameters``, ``children``, ``collectives_forward``,
        ``collectives_backward``, ``operations_forward``,
        ``operations_backward`` and ``operations_checkpointing``.

        Args:
            file_name: where to write.
            noise_level: as for :meth:`generate_comm_debug_tracing_table`.

        Raises:
            TypeError: ``noise_level`` is not a number.
            ValueError: ``noise_level`` is NaN.
            OSError: ``file_name`` cannot be written.
        """
        level = _report.noise_level(noise_level)
        tracker = self.advanced_module_tracker
        tree = _report.json_tree(
            tracker.module_helper_dict,
            tracker.parent_dict,
            self.comm_module_counts,
            self.comm_module_operation_counts,
            level,
        )
        with open(file_name, "w") as fh:
            json.dump(tree, fh, indent=4)
