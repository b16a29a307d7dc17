"""Capture: what happens in the training step, seen through torch's hooks.

The only package that imports torch internals. Its modules, in the order a
step meets them:

- :mod:`~commspan.capture.modules`: global module hooks; a frame per module
  call (forward, recompute) on the span recorder;
- :mod:`~commspan.capture.backward`: backward nesting inferred from the
  forward pass (docs/design.md, "How backward nesting is inferred");
- :mod:`~commspan.capture.dispatch`: the ``TorchDispatchMode`` that recognises
  collectives (:mod:`~commspan.capture.collectives`, the op table) and
  describes them, DTensor redistributions included;
- :mod:`~commspan.capture.groups`: process groups and device meshes, learned
  once and shared by the module hooks and the dispatch mode;
- :mod:`~commspan.capture.dtensor`: DTensor placements and parameter summaries;
- :mod:`~commspan.capture.ranks`: this process's rank, local rank and world size.

This module holds the one public interface of the capture layer,
:class:`ModuleObserver`: an object told about every module event a
:class:`~commspan.CommSpanMode` records, attached with
``CommSpanMode(module_observer=...)``.

Example:
    >>> import torch
    >>> from commspan import CommSpanMode
    >>> class Calls:
    ...     def __init__(self): self.seen = []
    ...     def pre_fw(self, module, args): self.seen.append(("pre_fw", module))
    ...     def post_fw(self, module, args, output): self.seen.append(("post_fw", module))
    ...     def pre_bw(self, module, grads): self.seen.append(("pre_bw", module))
    ...     def post_bw(self, module, grads): self.seen.append(("post_bw", module))
    >>> calls, linear = Calls(), torch.nn.Linear(2, 2)
    >>> with CommSpanMode(module_observer=calls):
    ...     linear(torch.ones(1, 2)).sum().backward()
    >>> [(event, module is linear) for event, module in calls.seen]
    [('pre_fw', True), ('post_fw', True), ('pre_bw', True), ('post_bw', True)]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["ModuleObserver"]


class ModuleObserver(Protocol):
    """Told about each module event a mode records, in the order they happen.

    Calls come from the mode's hooks: on the thread that entered the mode for
    forward calls, and on whichever thread autograd runs the backward. An
    observer must be quick and must not raise (an exception is counted as an
    internal error of the mode and the rest of that event's tracing is lost).
    An observer that calls user code may keep what that code raised and have a
    ``take_error()`` method returning it (and forgetting it): the mode raises it
    into the user's code once its own bookkeeping for the event is done (a
    forward that raised keeps its own exception, as torch's hooks do).

    ``module`` of the backward calls is ``None`` when the module has been
    garbage-collected since its forward.
    """

    def pre_fw(self, module: torch.nn.Module, args: Any) -> None:
        """A module's forward (or recompute) starts; ``args`` are its positional inputs."""

    def post_fw(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A module's forward ends; ``output`` is ``None`` when it raised."""

    def pre_bw(self, module: torch.nn.Module | None, grads: Any) -> None:
        """A module's backward starts: the gradient of one of its outputs is ready."""

    def post_bw(self, module: torch.nn.Module | None, grads: Any) -> None:
        """A module's backward ends: the gradients of all its inputs are computed
        (``grads`` is ``None`` when autograd finished the graph first)."""
