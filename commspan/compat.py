"""Drop-in stand-ins for torch's ``CommDebugMode`` and ``ModTracker``.

Built on :class:`~commspan.CommSpanMode` and :class:`~commspan.Aggregator`,
so tests written against the torch classes run on commspan by changing one
import::

    # from torch.distributed.tensor.debug import CommDebugMode
    from commspan.compat import CommDebugMode

Counts are keyed the way torch keys them (the legacy
``torch.ops.c10d_functional`` packets), and lookups also accept the native
``torch.ops._c10d_functional`` packets, overloads, ``c10d`` packets and
canonical names. Unlike torch 2.13's, these classes survive one module
running twice in a context and leave no hook behind.

Example:
    >>> import torch
    >>> from commspan.compat import CommDebugMode
    >>> comm_mode = CommDebugMode()
    >>> with comm_mode:
    ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
    >>> comm_mode.get_total_counts()
    0
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from commspan import semconv
from commspan.capture.collectives import build_overload_table, canonical_name
from commspan.session.mode import CommSpanMode

__all__ = ["CommDebugMode", "HookAlreadyRegisteredError", "ModTracker"]

_ANSI = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")


class HookAlreadyRegisteredError(ValueError, AssertionError):
    """A user hook of that kind is registered already (an ``AssertionError`` too,
    as torch's ModTracker raises)."""


def _reference_packets() -> dict[str, Any]:
    """Canonical name -> the packet torch's CommDebugMode keys counts by."""
    out: dict[str, Any] = {}
    for key, info in build_overload_table().items():
        if not isinstance(key, torch._ops.OpOverloadPacket):
            continue
        ns = str(info.overload).split(".", 1)[0]
        rank = {"c10d_functional": 0, "_c10d_functional": 1, "c10d": 2}.get(ns, 3)
        current = out.get(info.name)
        if current is None or rank < current[0]:
            out[info.name] = (rank, key)
    return {name: packet for name, (_, packet) in out.items()}


class _OpCounts(dict):  # type: ignore[type-arg]
    """``{packet: count}`` that also answers native packets, overloads and names."""

    def __init__(self, by_name: dict[str, int], packets: dict[str, Any]) -> None:
        super().__init__(
            {packets.get(name, name): n for name, n in by_name.items()}
        )
        self._by_name = by_name

    def __getitem__(self, key: Any) -> int:
        name = canonical_name(key)
        if name is None:
            return super().__getitem__(key) if dict.__contains__(self, key) else 0
        return self._by_name.get(name, 0)

    def __contains__(self, key: object) -> bool:
        name = canonical_name(key)
        return name in self._by_name if name is not None else dict.__contains__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


class _ModuleCounts(dict):  # type: ignore[type-arg]
    """One module's counts: ``[packet]`` sums phases (the reference layout);
    ``["forward"]`` / ``["backward"]`` (backward includes recompute) is torch
    2.13's layout."""

    def __init__(self, phases: dict[str, dict[str, int]], packets: dict[str, Any]) -> None:
        total: dict[str, int] = {}
        fw = dict(phases.get("forward", {}))
        bw: dict[str, int] = {}
        for phase in ("backward", "recompute"):
            for op, n in phases.get(phase, {}).items():
                bw[op] = bw.get(op, 0) + n
        for part in (fw, bw):
            for op, n in part.items():
                total[op] = total.get(op, 0) + n
        self._ops = _OpCounts(total, packets)
        self._phases = {"forward": _OpCounts(fw, packets), "backward": _OpCounts(bw, packets)}
        super().__init__(self._ops)

    def __getitem__(self, key: Any) -> Any:
        if key in ("forward", "backward"):
            return self._phases[key]
        return self._ops[key]

    def __contains__(self, key: object) -> bool:
        return key in ("forward", "backward") or key in self._ops


class _ModuleTrackerView:
    """What tests read from ``comm_mode.advanced_module_tracker``."""

    def __init__(self, owner: CommDebugMode) -> None:
        self._owner = owner

    @property
    def module_depth_dict(self) -> dict[str, int]:
        return self._owner._depths()

    @property
    def module_parameters_dict(self) -> dict[str, dict[str, Any]]:
        return self._owner.get_parameter_info()

    @property
    def sharding_dict(self) -> dict[str, Any]:
        return self._owner.get_sharding_info()


class _ParamObserver:
    """Keeps the live parameter tensors and placements seen in forward."""

    def __init__(self) -> None:
        self.tracker: Any = None
        self.params: dict[str, dict[str, Any]] = {}
        self.sharding: dict[str, Any] = {}

    def reset(self) -> None:
        self.params = {}
        self.sharding = {}

    def pre_fw(self, module: torch.nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        fqn = self.tracker.fqn(module) if self.tracker is not None else None
        if fqn is None:
            return
        from commspan.capture.dtensor import DTensor

        for name, param in module.named_parameters(recurse=False):
            self.params.setdefault(fqn, {})[name] = param.data
            if DTensor is not None and isinstance(param.data, DTensor):
                self.sharding[f"{fqn}.{name}"] = param.data.placements

    def post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        pass

    def pre_bw(self, module: Any, grads: Any) -> None:
        pass

    def post_bw(self, module: Any, grads: Any) -> None:
        pass


class CommDebugMode:
    """Counts collectives like torch's ``CommDebugMode``, on commspan.

    Example:
        >>> from commspan.compat import CommDebugMode
        >>> comm_mode = CommDebugMode()
        >>> with comm_mode:
        ...     pass
        >>> comm_mode.get_comm_counts()
        {}
    """

    def __init__(self, **mode_kwargs: Any) -> None:
        self._observer = _ParamObserver()
        self.mode = CommSpanMode(_observer=self._observer, **mode_kwargs)
        self._packets = _reference_packets()
        self.advanced_module_tracker = _ModuleTrackerView(self)

    def __enter__(self) -> CommDebugMode:
        self._observer.reset()
        self.mode.__enter__()
        self._observer.tracker = self.mode._tracker
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)

    @property
    def aggregator(self) -> Any:
        """The commspan Aggregator behind the counts (native API)."""
        return self.mode.aggregator

    # ------------------------------------------------------------ counts
    def get_comm_counts(self) -> dict[Any, int]:
        """``{packet: count}`` over the context (lookups accept any form of the op)."""
        return _OpCounts(self.aggregator.comm_counts(), self._packets)

    comm_counts = property(get_comm_counts)

    def get_total_counts(self) -> int:
        """Number of collectives in the context."""
        return int(self.aggregator.total_count())

    def get_comm_module_counts(self) -> dict[str, Any]:
        """``{fqn: {packet: count}}``; ``[fqn]["forward"|"backward"]`` splits phases."""
        return {
            fqn: _ModuleCounts(phases, self._packets)
            for fqn, phases in self.aggregator.module_counts().items()
        }

    comm_module_counts = property(get_comm_module_counts)

    # ------------------------------------------------------------ parameters
    def get_parameter_info(self) -> dict[str, dict[str, Any]]:
        """``{module fqn: {param name: tensor}}`` of the modules that ran."""
        return self._observer.params

    def get_sharding_info(self) -> dict[str, Any]:
        """``{"<fqn>.<param>": placements}`` of the DTensor parameters seen."""
        return self._observer.sharding

    def print_parameter_info(self) -> None:
        """Print :meth:`get_parameter_info`."""
        print(self.get_parameter_info())

    def print_sharding_info(self) -> None:
        """Print one ``name: placements`` line per DTensor parameter."""
        for key, value in self.get_sharding_info().items():
            print(f"{key}: {value}")

    print_paramater_info = print_parameter_info  # torch's spelling

    def _depths(self) -> dict[str, int]:
        depths = {semconv.GLOBAL_FQN: 0}
        todo = [(child, 1) for child in reversed(self.aggregator.to_dict()["children"])]
        while todo:  # a loop, in tree order: the tree is as deep as the model
            node, depth = todo.pop()
            depths[node["fqn"]] = depth
            todo.extend((child, depth + 1) for child in reversed(node["children"]))
        return depths

    # ------------------------------------------------------------ tables
    def generate_comm_debug_tracing_table(self, noise_level: int = 0) -> str:
        """The module table (commspan's layout; levels above 1 act as 1)."""
        return self.aggregator.table(min(max(int(noise_level), 0), 1))

    generate_module_tracing_table = generate_comm_debug_tracing_table

    def log_comm_debug_tracing_table_to_file(
        self, file_name: str = "comm_mode_log.txt", noise_level: int = 3
    ) -> None:
        """Write the table, without colour codes, to ``file_name``."""
        with open(file_name, "w") as fh:
            fh.write(_ANSI.sub("", self.generate_comm_debug_tracing_table(noise_level)))


class _UserHooks:
    """Calls ModTracker's user hooks at commspan's module events."""

    def __init__(self, owner: ModTracker) -> None:
        self._owner = owner

    def pre_fw(self, module: torch.nn.Module, args: Any) -> None:
        hook = self._owner._user_pre_fw_hook
        if hook is not None:
            hook(module, args)

    def post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        hook = self._owner._user_post_fw_hook
        if hook is not None:
            hook(module, args, output)

    def pre_bw(self, module: Any, grads: Any) -> None:
        hook = self._owner._user_pre_bw_hook
        if hook is not None:
            hook(module, grads)

    def post_bw(self, module: Any, grads: Any) -> None:
        hook = self._owner._user_post_bw_hook
        if hook is not None:
            hook(module, grads)


class ModTracker:
    """Tracks the module hierarchy like torch's ``ModTracker``, on commspan.

    Example:
        >>> import torch
        >>> from commspan.compat import ModTracker
        >>> seen = []
        >>> tracker = ModTracker()
        >>> tracker.register_user_hooks(pre_fw_hook=lambda m, i: seen.append(set(tracker.parents)))
        >>> with tracker:
        ...     _ = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> seen == [{'Global', 'Linear'}]
        True
    """

    def __init__(self) -> None:
        self._user_pre_fw_hook: Callable[..., Any] | None = None
        self._user_post_fw_hook: Callable[..., Any] | None = None
        self._user_pre_bw_hook: Callable[..., Any] | None = None
        self._user_post_bw_hook: Callable[..., Any] | None = None
        self.mode = CommSpanMode(aggregator=False, record_params=False, _observer=_UserHooks(self))
        self._fqns: Any = None

    def __enter__(self) -> ModTracker:
        self.mode.__enter__()
        self._fqns = self.mode._tracker
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)

    @property
    def parents(self) -> set[str]:
        """Names of the modules whose forward or backward is running, plus ``Global``."""
        tracker = self.mode._tracker
        if tracker is None or not self.mode.active:
            return {semconv.GLOBAL_FQN}
        return tracker.open_fqns() | {semconv.GLOBAL_FQN}

    @property
    def is_bw(self) -> bool:
        """Whether autograd is running backward now."""
        return torch._C._current_graph_task_id() != -1

    def get_known_fqn(self, mod: torch.nn.Module) -> str | None:
        """The name of ``mod`` if it has run under the tracker, else ``None``."""
        return self._fqns.fqn(mod) if self._fqns is not None else None

    def register_user_hooks(
        self,
        pre_fw_hook: Callable[..., Any] | None = None,
        post_fw_hook: Callable[..., Any] | None = None,
        pre_bw_hook: Callable[..., Any] | None = None,
        post_bw_hook: Callable[..., Any] | None = None,
    ) -> None:
        """Register hooks called at each module's forward/backward start and end.

        Raises:
            HookAlreadyRegisteredError: a hook of that kind is registered
                already; call :meth:`clear_user_hooks` first.
        """
        for name, new in (
            ("pre_fw_hook", pre_fw_hook),
            ("post_fw_hook", post_fw_hook),
            ("pre_bw_hook", pre_bw_hook),
            ("post_bw_hook", post_bw_hook),
        ):
            if new is not None and getattr(self, f"_user_{name}") is not None:
                raise HookAlreadyRegisteredError(
                    f"{name}={new!r}: a {name} is registered already; call "
                    "clear_user_hooks() before registering another"
                )
        self._user_pre_fw_hook = pre_fw_hook or self._user_pre_fw_hook
        self._user_post_fw_hook = post_fw_hook or self._user_post_fw_hook
        self._user_pre_bw_hook = pre_bw_hook or self._user_pre_bw_hook
        self._user_post_bw_hook = post_bw_hook or self._user_post_bw_hook

    def clear_user_hooks(self) -> None:
        """Remove every user hook."""
        self._user_pre_fw_hook = None
        self._user_post_fw_hook = None
        self._user_pre_bw_hook = None
        self._user_post_bw_hook = None
