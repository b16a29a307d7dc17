"""Activation checkpointing with torch's ``checkpoint_wrapper`` (torchtitan's, per block).

The wrapper holds the block as ``_checkpoint_wrapped_module``; torch's own names
(``named_parameters``, ``state_dict``) leave that out, and so does commspan: the
wrapped block is named by the wrapper's path, and its call (which the recompute
re-runs) is the block's only span. References: the same model checkpointed with
``torch.utils.checkpoint.checkpoint(block, x)`` from its parent (same spans,
nesting, phases and counts), the model without checkpointing (same names and
forward/backward counts), torch's ``named_parameters``/``state_dict`` names, FSDP2
unit sizes (tests/test_ownership_fsdp.py) and torch's ``ModTracker`` for
``commspan.compat``, which keeps torch's names.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from commspan import semconv
from commspan.testing import capture

DIM = 8
WRAPPER_KEY = "_checkpoint_wrapped_module"


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = torch.nn.Linear(DIM, 2 * DIM)
        self.wo = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wq(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.attn = Attn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class Net(torch.nn.Module):
    """emb -> layers.0 -> layers.1 -> head; ``how`` says how the layers are
    checkpointed: ``"none"``, ``"parent"`` (``checkpoint(layer, h)`` here) or
    ``"wrapper"`` (each layer in a ``checkpoint_wrapper``)."""

    def __init__(self, how: str, reentrant: bool = False) -> None:
        super().__init__()
        self.how = how
        self.reentrant = reentrant
        self.emb = torch.nn.Linear(DIM, DIM)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            if self.how == "parent":
                h = checkpoint(layer, h, use_reentrant=self.reentrant)
            else:
                h = layer(h)
        return self.head(h)


def _model(how: str, mesh: Any, reentrant: bool = False) -> Net:
    """The model, its attention tensor-parallel (an all-reduce in its forward and
    in its backward), checkpointed as ``how`` says."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    net = Net(how, reentrant)
    for layer in net.layers:
        parallelize_module(layer.attn, mesh, {"wq": ColwiseParallel(), "wo": RowwiseParallel()})
    if how == "wrapper":
        impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
        for i, layer in enumerate(net.layers):
            net.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    return net


def _spans(net: Net) -> tuple[Counter[tuple[str, str, str, str]], dict[str, Any], Any]:
    """Two steps: ``(name, phase, parent's name, type)`` of every module span, the
    per-module counts, and the capture."""
    x = torch.randn(4, DIM, requires_grad=True)
    with capture() as cap:
        for step in range(2):
            with cap.mode.step(step):
                net(x).sum().backward()
    spans = [s for s in cap.spans if semconv.MODULE_FQN in s.attributes]
    by_id = {s.context.span_id: s for s in spans}
    out: Counter[tuple[str, str, str, str]] = Counter()
    for s in spans:
        parent = by_id.get(s.parent.span_id) if s.parent is not None else None
        a = s.attributes
        if a[semconv.MODULE_FQN] == semconv.GLOBAL_FQN:
            continue
        out[(str(a[semconv.MODULE_FQN]), str(a[semconv.PHASE]),
             str(parent.attributes[semconv.MODULE_FQN]) if parent is not None else "",
             str(a[semconv.MODULE_TYPE]))] += 1
    assert cap.mode.stats()["internal_errors"] == 0
    return out, cap.aggregator.module_counts(), cap


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_wrapped_blocks_are_spanned_as_blocks_checkpointed_from_their_parent(
        mesh: Any, reentrant: bool) -> None:
    """``checkpoint_wrapper`` on each block: the same spans (names, phases, parents,
    types) and per-module counts as ``checkpoint(block, h)`` from the parent; the
    modules named as torch's ``named_parameters`` and ``state_dict`` name them,
    which are the unwrapped model's names; the forward and backward counts of the
    model without checkpointing."""
    wrapped = _model("wrapper", mesh, reentrant)
    parent = _model("parent", mesh, reentrant)
    plain = _model("none", mesh)
    got, got_counts, cap = _spans(wrapped)
    ref, ref_counts, _ = _spans(parent)
    assert got == ref
    assert got_counts == ref_counts
    assert any(phase == "recompute" for _, phase, _, _ in got)  # checkpointing ran
    # torch's names: the wrapper leaves its key out of named_parameters and state_dict
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    names = {n for n, *_ in got}
    for name in wrapped.state_dict():
        assert f"Net.{name.rsplit('.', 1)[0]}" in names, (name, names)
    for name, _ in wrapped.layers[0].named_parameters():  # (the wrapper's own override)
        assert WRAPPER_KEY not in name
        assert f"Net.layers.0.{name}".rsplit(".", 1)[0] in names, (name, names)
    assert names == {f"Net.{n}" if n else "Net" for n, m in plain.named_modules()
                     if not isinstance(m, torch.nn.ModuleList)}
    # the wrapped block's type; the wrapper's own call has no span
    assert {t for n, _, _, t in got if n == "Net.layers.0"} == {"Block"}
    assert cap.mode.module_name(wrapped.layers[0]) == "Net.layers.0"
    assert cap.mode.module_name(wrapped.layers[0].attn.wo) == "Net.layers.0.attn.wo"
    plain_spans, plain_counts, _ = _spans(plain)
    assert {k for k in got if k[1] != "recompute"} == set(plain_spans)
    assert got_counts.keys() == plain_counts.keys()
    for fqn, phases in got_counts.items():
        assert {p: c for p, c in phases.items() if p != "recompute"} == plain_counts[fqn], fqn
    # the row-wise all-reduce, once a step (the tensor-parallel collectives ran)
    assert got_counts["Net.layers.0.attn"]["forward"] == {"all_reduce": 2}


def test_hooks_on_the_wrapper_keep_working_and_the_name_holds(mesh: Any) -> None:
    """A hook on the wrapper still runs once per call, the model still trains as
    without commspan, and a wrapper assigned after the model was named (a swapped
    block) is named by its path too."""
    net = _model("wrapper", mesh)
    calls: list[str] = []
    net.layers[0].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    net.layers[0].register_forward_hook(lambda m, a, o: calls.append("post"))
    x = torch.randn(4, DIM)
    torch.manual_seed(1)
    untraced = net(x)
    with capture() as cap:
        with cap.mode.step(0):
            traced = net(x)
            traced.sum().backward()
            net.layers[1] = checkpoint_wrapper(Block())
            net(x).sum().backward()
    assert torch.equal(untraced, traced)
    assert calls == ["pre", "post"] * 3
    assert cap.mode.module_name(net.layers[1]) == "Net.layers.1"
    assert cap.mode.module_name(net.layers[1].norm) == "Net.layers.1.norm"
    assert cap.mode.stats()["internal_errors"] == 0


def test_a_wrapped_model_is_named_by_its_class(mesh: Any) -> None:
    """The whole model in a wrapper: named ``Net``, not ``CheckpointWrapper``."""
    net = checkpoint_wrapper(_model("none", mesh))
    got, _, _ = _spans(net)  # type: ignore[arg-type]
    assert {n for n, *_ in got} >= {"Net", "Net.layers.0.attn.wo"}
    assert not any(WRAPPER_KEY in n or "CheckpointWrapper" in n for n, *_ in got)


def test_compat_mod_tracker_keeps_torchs_names(fake_pg: None) -> None:
    """``commspan.compat.ModTracker`` names modules inside a ``checkpoint_wrapper`` as
    torch's ``ModTracker`` does (``layers.0._checkpoint_wrapped_module``), the
    wrapper's call included: the parents each forward and recompute sees are
    torch's."""
    from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker

    from commspan.compat import ModTracker

    def parents_seen(cls: Any) -> list[tuple[str, ...]]:
        torch.manual_seed(0)
        net = Net("wrapper")
        for i, layer in enumerate(net.layers):
            net.layers[i] = checkpoint_wrapper(layer)
        seen: list[tuple[str, ...]] = []
        tracker = cls()
        tracker.register_user_hooks(
            pre_fw_hook=lambda m, i: seen.append(tuple(sorted(tracker.parents))))
        with tracker:
            net(torch.randn(2, DIM, requires_grad=True)).sum().backward()
        return seen

    ref = parents_seen(TorchModTracker)
    assert any(f"Net.layers.0.{WRAPPER_KEY}.attn" in p for p in ref)
    assert parents_seen(ModTracker) == ref


def test_compat_comm_debug_mode_keeps_torchs_names(mesh: Any) -> None:
    """``commspan.compat.CommDebugMode`` counts the collectives of a model with
    wrapped blocks per module as torch's ``CommDebugMode`` does, under torch's names
    (``Net.layers.0`` and ``Net.layers.0._checkpoint_wrapped_module.attn``)."""
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from commspan.compat import CommDebugMode

    def counts(cls: Any) -> dict[str, dict[str, dict[Any, int]]]:
        net = _model("wrapper", mesh)
        comm = cls()
        with comm:
            net(torch.randn(4, DIM, requires_grad=True)).sum().backward()
        return {fqn: {ph: dict(ops) for ph, ops in phases.items() if ops}
                for fqn, phases in comm.comm_module_counts.items()}

    ref = counts(TorchCommDebugMode)
    assert f"Net.layers.0.{WRAPPER_KEY}.attn" in ref
    assert counts(CommDebugMode) == ref


def test_fsdp_units_on_and_inside_wrapped_blocks_are_owned_by_their_names(
        fake_pg: None) -> None:
    """FSDP2 on each wrapper (torchtitan's units) and on a module inside one (FSDP
    names that unit by torch's path, ``layers.0._checkpoint_wrapped_module.attn``):
    every all-gather and reduce-scatter is owned by the unit whose padded parameter
    size it carries, under the unwrapped model's names."""
    import math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    net = Net("wrapper")
    units = {"layers.0.attn": [net.layers[0].attn], "layers.0": [net.layers[0].norm],
             "layers.1": [net.layers[1]], "": [net.emb, net.head]}

    def padded(modules: list[torch.nn.Module]) -> int:
        return sum(math.ceil(p.shape[0] / 4) * 4 * math.prod(p.shape[1:])
                   for m in modules for p in m.parameters())

    by_size = {padded(ms): f"FSDPNet.{n}" if n else "FSDPNet" for n, ms in units.items()}
    assert len(by_size) == len(units)
    for i, layer in enumerate(net.layers):
        net.layers[i] = checkpoint_wrapper(layer)
    fully_shard(net.layers[0].attn, mesh=mesh)  # (the wrapper forwards the attribute)
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    with capture() as cap:
        with cap.mode.step(0):
            net(torch.randn(4, DIM)).sum().backward()
    seen = set()
    for span in cap.spans:
        for event in span.events:
            a = event.attributes
            if semconv.COLL_OP not in a:
                continue
            elements = a[semconv.TENSOR_BYTES] // 4
            if str(a[semconv.COLL_OP]).startswith("all_gather"):
                elements *= a[semconv.PG_SIZE]
            assert a[semconv.OWNER_FQN] == by_size[elements], dict(a)
            assert a[semconv.OWNER_SOURCE] == "fsdp"
            seen.add((a[semconv.OWNER_FQN], a[semconv.OWNER_KIND]))
    assert seen == {(fqn, kind) for fqn in by_size.values()
                    for kind in ("unshard", "reduce_grad")}
    assert cap.mode.stats()["internal_errors"] == 0


def test_compiled_wrapped_blocks_own_collectives_by_their_submodules(mesh: Any) -> None:
    """torchtitan compiles each wrapped block (``torch.compile(checkpoint_wrapper(b))``),
    and Dynamo runs the graph it traced on the first for both: under ``aot_eager``
    each tensor-parallel collective is owned by the submodule of the block running
    (the graph's module path goes through the wrapper's ``__dict__``), as in the
    eager wrapped model."""

    def owners(net: torch.nn.Module) -> Counter[tuple[str, str, str]]:
        x = torch.randn(4, DIM, requires_grad=True)
        with capture() as cap:
            for step in range(2):
                with cap.mode.step(step):
                    net(x).sum().backward()
        out: Counter[tuple[str, str, str]] = Counter()
        for span in cap.spans:
            for event in span.events:
                a = event.attributes
                if semconv.COLL_OP in a and a[semconv.PHASE] != "recompute":
                    out[(str(span.attributes[semconv.MODULE_FQN]).rsplit(".", 1)[-1],
                         str(a[semconv.OWNER_FQN]), str(a[semconv.PHASE]))] += 1
        assert cap.mode.stats()["internal_errors"] == 0
        return out

    eager = _model("wrapper", mesh)
    compiled = _model("wrapper", mesh)
    for i, layer in enumerate(compiled.layers):
        compiled.layers[i] = torch.compile(layer, backend="aot_eager")
    ref = Counter({(block, owner, phase): n for (_, owner, phase), n in owners(eager).items()
                   for block in [owner.split(".")[2]]})
    got = owners(compiled)
    assert got == ref
    assert {owner for _, owner, _ in got} == {
        f"Net.layers.{i}.attn.{w}" for i in range(2) for w in ("wq", "wo")}
