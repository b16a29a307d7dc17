"""A drop-in for torch's ``torch.distributed._tools.ModTracker``, on commspan.

Module hierarchy tracking comes from :class:`~commspan.CommSpanMode`'s module
hooks; the user hooks are called at its module events. Unlike torch 2.13's
tracker, a module may run any number of times and nothing stays registered
after the context.

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

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch

from commspan import semconv
from commspan.session import CommSpanMode

__all__ = ["HookAlreadyRegisteredError", "ModTracker"]

_graph_task_id = torch._C._current_graph_task_id


class HookAlreadyRegisteredError(ValueError, AssertionError):
    """A user hook of that kind is registered already (an ``AssertionError`` too,
    as torch's ModTracker raises)."""


class _UserHooks:
    """Calls a ModTracker's user hooks at commspan's module events.

    An exception a user hook raises is kept and handed to the mode
    (:meth:`take_error`), which raises it into the user's code once its own
    bookkeeping for the event is done, as torch's hooks would."""

    def __init__(self, owner: ModTracker) -> None:
        self._owner = owner
        self._error: BaseException | None = None

    def _call(self, hook: Any, *args: Any) -> None:
        try:
            hook(*args)
        except BaseException as e:  # the user's: raised at the end of the event
            if self._error is None:
                self._error = e

    def take_error(self) -> BaseException | None:
        """The exception a user hook raised since the last call, if any (cleared)."""
        error, self._error = self._error, None
        return error

    def pre_fw(self, module: torch.nn.Module, args: Any) -> None:
        hook = self._owner._user_pre_fw_hook
        if hook is not None:
            self._call(hook, module, args)

    def post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        hook = self._owner._user_post_fw_hook
        if hook is not None:
            self._call(hook, module, args, output)

    def pre_bw(self, module: Any, grads: Any) -> None:
        hook = self._owner._user_pre_bw_hook
        if hook is not None:
            self._call(hook, module, grads)

    def post_bw(self, module: Any, grads: Any) -> None:
        hook = self._owner._user_post_bw_hook
        if hook is not None:
            self._call(hook, module, grads)


class ModTracker:
    """Tracks the module hierarchy like torch's ``ModTracker``, on commspan.

    ``parents`` holds the names of the modules whose forward or backward is
    running, plus ``"Global"``; ``is_bw`` says whether autograd is running
    backward; user hooks run at each module's forward and backward start and
    end.

    Example:
        >>> import torch
        >>> from commspan.compat import ModTracker
        >>> with ModTracker() as tracker:
        ...     _ = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> tracker.parents
        {'Global'}
    """

    def __init__(self) -> None:
        self._clear_hooks()
        self._depth = 0  # `with` entries inside the active one
        self.mode = CommSpanMode(  # its own run id: entering it talks to no other rank
            aggregator=False, record_params=False, module_observer=_UserHooks(self),
            run_id=uuid.uuid4().hex, _fresh_names=True,  # each context names modules anew
            _torch_names=True,  # torch's names inside activation-checkpointing wrappers
        )

    def _clear_hooks(self) -> None:
        self._user_pre_fw_hook: Callable[..., Any] | None = None
        self._user_post_fw_hook: Callable[..., Any] | None = None
        self._user_pre_bw_hook: Callable[..., Any] | None = None
        self._user_post_bw_hook: Callable[..., Any] | None = None

    def __enter__(self) -> ModTracker:
        if self.mode.active:  # `with tracker:` inside itself: one context
            self._depth += 1
            return self
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._depth:
            self._depth -= 1
            return
        self.mode.__exit__(*exc)

    @property
    def parents(self) -> set[str]:
        """Names of the modules whose forward or backward is running, plus ``Global``."""
        if not self.mode.active:
            return {semconv.GLOBAL_FQN}
        return {s.fqn for s in self.mode.open_spans() if not s.finished} | {semconv.GLOBAL_FQN}

    @property
    def is_bw(self) -> bool:
        """Whether autograd is running backward now."""
        return bool(_graph_task_id() != -1)

    def get_known_fqn(self, mod: torch.nn.Module) -> str | None:
        """The name of ``mod`` if it has run under the tracker, else ``None``
        (also for ``None``, what the backward hooks get for a deleted module)."""
        if mod is None:
            return None
        try:
            return self.mode.module_name(mod)
        except TypeError:  # not a module (cannot be weakly referenced)
            return None

    def register_user_hooks(
        self,
        pre_fw_hook: Callable[..., Any] | None = None,
        post_fw_hook: Callable[..., Any] | None = None,
        pre_bw_hook: Callable[..., Any] | None = None,
        post_bw_hook: Callable[..., Any] | None = None,
    ) -> None:
        """Register hooks called at each module's forward/backward start and end.

        Args:
            pre_fw_hook: ``(module, args)`` before a module's forward.
            post_fw_hook: ``(module, args, output)`` after it.
            pre_bw_hook: ``(module, grad_outputs)`` when its backward starts
                (``module`` is ``None`` if it was deleted since its forward).
            post_bw_hook: ``(module, grad_inputs)`` when its backward ends.

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
        self._clear_hooks()
