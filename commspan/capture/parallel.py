"""What commspan knows of the parallel wrappers on this rank: FSDP2 units, DDP buckets,
watched pipeline stages (:mod:`commspan.capture.pipeline`).

The module tracker hands :class:`ParallelModules` every module tree it names
(:meth:`ParallelModules.learn`) and the end of every DistributedDataParallel
forward (:meth:`ParallelModules.ddp_forward_done`). The ownership rules
(:mod:`commspan.ownership.fsdp`, :mod:`commspan.ownership.ddp`) ask it, when a
collective is issued, through the :class:`~commspan.ownership.ParallelFacts`
interface. Nothing here runs for a model without FSDP or DDP, except one
``isinstance`` check per module when it is first named.

Private torch symbols used, each behind a ``try`` (a failure turns the fact
off and the owner falls back to the position):

- ``DistributedDataParallel.reducer._get_zeros_like_grad_buckets()``: the
  bucket layout, read after a DDP forward and only when it may have changed
  (first forward, after the rebuild of iteration 1; ``_has_rebuilt_buckets``).
  Never during backward: the reducer holds its lock while it launches a bucket,
  and reading the layout then deadlocks. The call makes a ``zeros_like`` of
  every bucket (as much memory as all the gradients); commspan runs it with the
  dispatch modes set aside and under :class:`_LayoutOnly`, which answers each
  ``zeros_like`` with one zero element expanded to the bucket's shape.
- ``torch._C._current_autograd_node()``: during a bucket's all-reduce, the
  ``AccumulateGrad`` node whose hook launched it; ``.variable`` is the parameter.
- ``FSDPParamGroup.unshard`` / ``.post_backward`` (code objects) and the
  group's ``modules``: to tell apart FSDP units with the same relative name
  (several FSDP roots), read from the Python stack, only then.
- ``DistributedDataParallel.__init__`` (code object): a collective issued
  from it is DDP's construction.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Container, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from commspan.capture.pipeline import PipelineWatch
from commspan.ownership import DdpBucket, FsdpUnit, PipelineTag, lowest_common_module

__all__ = ["ParallelModules", "lowest_common_module"]

_log = logging.getLogger(__name__)

try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except Exception:  # pragma: no cover - a torch build without distributed
    _FSDPModule = None  # type: ignore[assignment,misc]

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except Exception:  # pragma: no cover
    _DDP = None  # type: ignore[assignment,misc]

_current_node = torch._C._current_autograd_node
_ZEROS_LIKE = torch.ops.aten.zeros_like.default


class _LayoutOnly(TorchDispatchMode):
    """Around ``Reducer._get_zeros_like_grad_buckets()``, of which commspan reads the
    parameters of each bucket only: its ``zeros_like`` of a bucket returns one zero
    element expanded to the bucket's shape, dtype and device (no memory per bucket;
    the real call would hold a copy of every gradient until the buckets are freed)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _ZEROS_LIKE and args and type(args[0]) is torch.Tensor:
            t = args[0]
            try:
                return torch.zeros((), dtype=kwargs.get("dtype") or t.dtype,
                                   device=kwargs.get("device") or t.device).expand(t.shape)
            except Exception:  # noqa: BLE001 - then as torch does it
                pass
        return func(*args, **kwargs)


def _grad_buckets(reducer: Any) -> Any:
    """The reducer's buckets (``GradBucket`` s), without a copy of the gradients and
    unseen by the dispatch modes (commspan's, and a compat ``CommDebugMode`` listing
    ops: the call is commspan's, not the model's)."""
    with _disable_current_modes(), _LayoutOnly():
        return reducer._get_zeros_like_grad_buckets()
_STACK_DEPTH = 96  # frames searched above a collective for FSDP's or DDP's own code


def _self_of_caller(match: Callable[[Any], bool]) -> Any:
    """``self`` of the nearest frame above the caller's caller whose code ``match``es
    (searching at most ``_STACK_DEPTH`` frames); ``None`` when there is none."""
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        if match(frame.f_code):
            return frame.f_locals.get("self")
        frame = frame.f_back  # type: ignore[assignment]
    return None


try:
    _GradBucket: Any = torch._C._distributed_c10d.GradBucket  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - torch built without distributed
    _GradBucket = None


def _grad_bucket_index() -> int | None:
    """The index of the ``GradBucket`` a DDP comm hook running on this thread was
    called with (an argument of the nearest frame that has one), if any."""
    if _GradBucket is None:
        return None
    frame: Any = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_argcount:
            local = frame.f_locals
            for name in code.co_varnames[:code.co_argcount]:
                value = local.get(name)
                if type(value) is _GradBucket:
                    return int(value.index())
        frame = frame.f_back
    return None


def _code(function: Any) -> Any:
    return inspect.unwrap(function).__code__


def _ddp_init_code() -> Any:
    try:
        return _code(_DDP.__init__) if _DDP is not None else None
    except Exception:  # pragma: no cover
        return None


def _fsdp_group_codes() -> frozenset[Any]:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        return frozenset({_code(FSDPParamGroup.unshard), _code(FSDPParamGroup.post_backward)})
    except Exception:
        _log.debug("commspan: FSDP parameter groups cannot be read from the stack",
                   exc_info=True)
        return frozenset()


class _DdpState:
    """One DistributedDataParallel module: its name, current bucket layout and
    how many of its buckets the running backward has launched."""

    __slots__ = ("buckets", "fqn", "key", "launched", "params")

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn
        self.key: Any = None  # (reducer id, rebuilt) the layout was read for
        self.params: list[int] = []  # ids of its parameters in the bucket map
        self.buckets: list[DdpBucket] = []  # by index
        self.launched = 0  # buckets all-reduced since its last forward


_CHAINED_HOOKS = frozenset({"powerSGD_hook", "batched_powerSGD_hook"})
"""torch's DDP comm hooks that issue collectives from ``Future.then`` callbacks."""


def _warn_of_chained_hooks(module: Any, fqn: str) -> None:
    """Say, once per DDP module, that its comm hook issues collectives commspan cannot
    see: from callbacks that run on the backend's threads (docs/parallelisms.md)."""
    for hook, _state in getattr(module, "_comm_hooks", ()) or ():
        name = _chained_hook(hook)
        if name is not None:
            _log.warning(
                "commspan: DistributedDataParallel %s uses the comm hook %s, which issues "
                "its all-reduces from Future callbacks on the backend's threads: commspan "
                "records only those that happen to run on the training thread (it traces "
                "that thread), and on gloo the hook can hang when ranks issue them in "
                "different orders, likelier under any dispatch mode's slower step. Trace "
                "this job with another comm hook (allreduce_hook, a compression hook) "
                "(docs/parallelisms.md, DDP)", fqn, name)
            return


def _chained_hook(hook: Any, depth: int = 3) -> str | None:
    """The name of the PowerSGD hook ``hook`` is or wraps (``functools.partial``,
    ``fp16_compress_wrapper``'s closure), else ``None``."""
    name = getattr(hook, "__name__", "")
    if name in _CHAINED_HOOKS:
        return str(name)
    if depth <= 0:
        return None
    inner = [getattr(hook, "func", None), getattr(hook, "__wrapped__", None)]
    for cell in getattr(hook, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # (an empty cell)
            inner.append(cell.cell_contents)
    for h in inner:
        if callable(h):
            found = _chained_hook(h, depth - 1)
            if found is not None:
                return found
    return None


class ParallelModules:
    """FSDP2 units and DDP modules of the models the tracker has named.

    Implements :class:`commspan.ownership.ParallelFacts`.
    """

    def __init__(self) -> None:
        self._fsdp: dict[str, list[FsdpUnit]] = {}  # relative path -> units
        # id(unit module) -> (module ref, unit): the ref guards against a reused id
        self._fsdp_modules: dict[int, tuple[Callable[[], Any], FsdpUnit]] = {}
        self._ddp: weakref.WeakKeyDictionary[Any, _DdpState] = weakref.WeakKeyDictionary()
        self._ddp_names: set[str] = set()
        # id(parameter) -> (parameter ref, bucket, its DDP module's state): the ref
        # guards against a reused id
        self._buckets: dict[int, tuple[Callable[[], Any], DdpBucket, _DdpState]] = {}
        self._group_codes: frozenset[Any] | None = None
        self._init_code = _ddp_init_code()
        # (id(module), parameter name) -> (module ref, FSDP2's FSDPParam ref): the
        # parameters FSDP2 manages, described by their sharded form
        self._fsdp_params: dict[tuple[int, str], tuple[Callable[[], Any],
                                                       Callable[[], Any]]] = {}
        self.pipeline = PipelineWatch()
        """The pipeline stages ``mode.watch_pipeline()`` was given."""

    # ------------------------------------------------------------ facts
    @property
    def has_fsdp(self) -> bool:
        return bool(self._fsdp)

    @property
    def has_ddp(self) -> bool:
        return bool(self._ddp_names)

    def fsdp_units(self, relative: str) -> Sequence[FsdpUnit]:
        return self._fsdp.get(relative, ())

    def ddp_fqns(self) -> Container[str]:
        return self._ddp_names

    @property
    def has_pipeline(self) -> bool:
        return self.pipeline.watching

    def pipeline_tag(self, tensor: Any) -> PipelineTag | None:
        return self.pipeline.tag(tensor)

    def pipeline_setup(self) -> str | None:
        return self.pipeline.setup_stage()

    def fsdp_unit_on_stack(self) -> FsdpUnit | None:
        if self._group_codes is None:
            self._group_codes = _fsdp_group_codes()
        codes = self._group_codes
        if not codes:
            return None
        group = _self_of_caller(codes.__contains__)
        for module in getattr(group, "modules", ()) or ():
            unit = self._unit_of(module)
            if unit is not None:
                return unit
        return None

    def ddp_bucket_now(self, numel: int | None = None) -> DdpBucket | None:
        if not self._buckets:
            return None
        node = _current_node()
        if node is None:
            return None
        param = getattr(node, "variable", None)
        if param is None:
            return None
        hit = self._buckets.get(id(param))
        if hit is None or hit[0]() is not param:
            return None
        if numel is None:
            return hit[1]
        # The reducer launches a backward's buckets in index order: when buckets
        # become ready out of order (parameters used in another order than they
        # were registered, unused ones marked ready at the first hook), the hook
        # that readies the next one launches every ready one after it too.
        state = hit[2]
        if state.launched < len(state.buckets):
            bucket = state.buckets[state.launched]
            if bucket.numel == numel:
                state.launched += 1
                return bucket
        own = hit[1]
        if own.numel == numel:
            if own.index >= state.launched:
                # the count fell behind (a collective of another size went by): the
                # hook's parameter's bucket, and those before it, are launched
                state.launched = own.index + 1
            return own
        # of another size than any bucket: a Python comm hook's (compression), for the
        # bucket it was called with; one parameter's hook may launch several buckets
        index = _grad_bucket_index()
        if index is not None and 0 <= index < len(state.buckets) \
                and state.buckets[index].index == index:
            return state.buckets[index]
        # of no bucket's size and outside every comm hook: not DDP's (a user's own
        # collective in a gradient hook, a gradient-norm monitor's, say)
        return None

    def ddp_constructing(self) -> str | None:
        code = self._init_code
        if code is None:
            return None
        ddp = _self_of_caller(code.__eq__)
        if ddp is None:
            return None
        # not named here: a module named before it is first called is named as a
        # root for good, and a DDP module built inside the mode for a larger model
        # would lose its place in it; until its first call it goes by its class
        known = self.known_name(ddp) if self.known_name is not None else None
        return known or type(ddp).__name__

    # ------------------------------------------------------------ learning
    known_name: Callable[[Any], str | None] | None = None
    """The tracker's name for a module it has named, else ``None``; set by the
    tracker this registry is given to."""

    namer: Callable[[Any], str] | None = None
    """The tracker's name for a module, naming (and :meth:`learn`-ing) its tree if
    it has not seen it yet; set by the tracker this registry is given to."""

    def learn(
        self,
        named: Sequence[tuple[str, torch.nn.Module]],
        on_mesh: Callable[[Any], None] | None = None,
    ) -> list[torch.nn.Module]:
        """Note the FSDP units and DDP modules of a newly named module tree.

        Args:
            named: ``(commspan name, module)`` in ``named_modules`` order.
            on_mesh: told the device mesh of each FSDP unit's sharded parameters
                (so FSDP's process groups get their mesh dimension and name).

        Returns:
            The DistributedDataParallel modules among them.
        """
        if _FSDPModule is not None:
            units: list[tuple[str, torch.nn.Module]] = [
                (fqn, m) for fqn, m in named if isinstance(m, _FSDPModule)
            ]
            if units:
                self._learn_fsdp(units, on_mesh)
        ddps: list[torch.nn.Module] = []
        if _DDP is not None:
            for fqn, m in named:
                if isinstance(m, _DDP) and m not in self._ddp:
                    self._ddp[m] = _DdpState(fqn)
                    self._ddp_names.add(fqn)
                    ddps.append(m)
        return ddps

    def _learn_fsdp(
        self, units: list[tuple[str, torch.nn.Module]], on_mesh: Callable[[Any], None] | None
    ) -> None:
        ids = {id(m) for _, m in units}
        roots: list[str] = []
        for fqn, module in units:  # parents come before their children
            root = next((r for r in roots if fqn.startswith(r + ".")), None)
            if root is None:
                roots.append(fqn)
                relative = ""
            else:
                relative = fqn[len(root) + 1 :]
            params = _own_params(module, ids)
            unit = FsdpUnit(fqn, len(params), sum(1 for p in params if p.requires_grad))
            same = self._fsdp.setdefault(relative, [])
            # a new model with the names of one seen before (commspan names by class
            # and path) replaces it: one name, one owner
            same[:] = [u for u in same if u.fqn != fqn]
            same.append(unit)
            self._fsdp_modules[id(module)] = (weakref.ref(module), unit)
            self._learn_fsdp_params(module)
            if on_mesh is not None:
                meshes = {id(m): m for m in (getattr(p, "device_mesh", None) for p in params)
                          if m is not None}
                for mesh in meshes.values():
                    on_mesh(mesh)

    def _learn_fsdp_params(self, unit: Any) -> None:
        """Note each parameter an FSDP2 unit manages, by its module and name (FSDP2
        registers the unsharded parameter in place of the sharded one while it is
        gathered: :meth:`sharded_param` gives the sharded one back)."""
        try:
            state = unit._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch before 2.9: one group per unit
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    info = fsdp_param._module_info
                    ref = weakref.ref(fsdp_param)
                    for module, name in ((info.module, info.param_name),
                                         *zip(info.shared_modules, info.shared_param_names)):
                        self._fsdp_params[(id(module), name)] = (weakref.ref(module), ref)
        except Exception:
            _log.debug("commspan: FSDP2's parameters could not be read", exc_info=True)

    def sharded_param(self, module: Any, name: str) -> Any:
        """The sharded parameter (a DTensor) FSDP2 keeps for ``module``'s parameter
        ``name``, or ``None`` when FSDP2 does not manage it.

        Example:
            >>> ParallelModules().sharded_param(object(), "weight") is None
            True
        """
        hit = self._fsdp_params.get((id(module), name))
        if hit is None or hit[0]() is not module:
            return None
        fsdp_param = hit[1]()
        return getattr(fsdp_param, "sharded_param", None) if fsdp_param is not None else None

    @property
    def manages_params(self) -> bool:
        """Whether some module's parameters are FSDP2's (:meth:`sharded_param`)."""
        return bool(self._fsdp_params)

    def _unit_of(self, module: Any) -> FsdpUnit | None:
        hit = self._fsdp_modules.get(id(module))
        if hit is None or hit[0]() is not module:
            return None
        return hit[1]

    def ddp_forward_done(self, module: Any, name_of: Callable[[Any], str | None]) -> None:
        """After a DDP module's forward: read its bucket layout if it may have changed.

        Args:
            module: the DistributedDataParallel module.
            name_of: the tracker's name of a module (``None`` if unknown).
        """
        state = self._ddp.get(module)
        if state is None:
            return
        state.launched = 0  # a forward prepares the reducer for a new backward
        reducer = getattr(module, "reducer", None)
        if reducer is None:
            return
        key = (id(reducer), bool(getattr(module, "_has_rebuilt_buckets", False)))
        if key == state.key:
            return
        if state.key is None:
            _warn_of_chained_hooks(module, state.fqn)
        state.key = key
        for pid in state.params:
            self._buckets.pop(pid, None)
        state.params = []
        state.buckets = []
        owners: dict[int, str] = {}
        for sub in module.module.modules():
            name = name_of(sub)
            if name is None:
                continue
            for p in sub._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), name)
        _owners_of_dtensor_attributes(module, owners, name_of)
        prefix = name_of(module.module) or state.fqn
        find_unused = bool(getattr(module, "find_unused_parameters", False))
        grad_buckets = _grad_buckets(reducer)
        count = sum(len(b.parameters()) for b in grad_buckets)
        for grad_bucket in grad_buckets:
            params = grad_bucket.parameters()
            modules = sorted({owners.get(id(p), prefix) for p in params})
            common = lowest_common_module([m[len(prefix) + 1 :] if m != prefix else ""
                                           for m in modules])
            bucket = DdpBucket(
                index=int(grad_bucket.index()),
                numel=sum(p.numel() for p in params),
                params=len(params),
                modules=tuple(modules),
                owner=prefix + ("." + common if common else ""),
                ddp_fqn=state.fqn,
                find_unused=find_unused,
                ddp_params=count,
            )
            state.buckets.append(bucket)
            for p in params:
                self._buckets[id(p)] = (weakref.ref(p), bucket, state)
                state.params.append(id(p))
        state.buckets.sort(key=lambda b: b.index)


def _own_params(module: torch.nn.Module, units: set[int]) -> list[Any]:
    """Parameters of ``module`` and its submodules, those of nested units excluded;
    a parameter shared by several of them (tied weights) once, as FSDP holds it."""
    params: list[Any] = []
    seen: set[int] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        for p in current._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        todo.extend(c for c in current._modules.values() if c is not None and id(c) not in units)
    return params


def _owners_of_dtensor_attributes(module: Any, owners: dict[int, str],
                        name_of: Callable[[Any], str | None]) -> None:
    """Add to ``owners`` the parameters DDP holds that the modules no longer do: with
    tensor parallelism inside DDP (``_pre_dp_module_transform``), DDP holds the local
    tensors of the DTensor parameters, and the first forward sets on the modules
    DTensors made from them (plain attributes from then on, their local tensors views
    of DDP's)."""
    held = getattr(module, "_module_parameters", None)
    if not held or all(id(p) in owners for p in held):
        return
    for sub in module.module.modules():
        name = None
        for value in vars(sub).values():
            if not isinstance(value, torch.Tensor):
                continue
            local = getattr(value, "_local_tensor", None)  # a DTensor attribute
            if local is None:
                continue
            if name is None:
                name = name_of(sub)
                if name is None:
                    break
            owners.setdefault(id(local), name)
            if local._base is not None:
                owners.setdefault(id(local._base), name)
