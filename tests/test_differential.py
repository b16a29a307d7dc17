"""commspan against torch's own CommDebugMode on the tensor-parallel toy Transformer.

The same model runs a few training steps four ways: under torch's
``CommDebugMode`` alone (a fresh one per step: torch 2.13's raises IndexError
when a module runs twice in one context), under ``CommSpanMode`` alone, and
under both, nested either way. Per module, commspan's forward count must equal
torch's forward count and commspan's backward + recompute count torch's
backward count (torch files recompute collectives under backward); nesting
must change neither's counts. The spans must form a well-formed tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fractions
import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.hooks import BackwardHook

from commspan import CommSpanMode, semconv
from commspan.compat import CommDebugMode as CompatCommDebugMode
from commspan.testing import assert_well_formed
from commspan.testing.models import (
    MLPModule,
    MLPStacked,
    ModelArgs,
    Transformer,
    make_batch,
    parallelize,
    train_step,
)

pytestmark = pytest.mark.filterwarnings(
    # torch's CommDebugMode installs global full-backward hooks; the embeddings' inputs need no grad
    "ignore:Full backward hook is firing:UserWarning"
)

STEPS = 2
Key = tuple[str, str, str]
"""(module fqn, phase, canonical op); phase is ``forward`` or ``backward``."""
Counts = dict[Key, int]

SCENARIOS: dict[str, ModelArgs] = {
    "plain": ModelArgs(),
    "ac_non_reentrant": ModelArgs(checkpoint={1: False}),
    "ac_reentrant": ModelArgs(checkpoint={1: True}),
    "ac_mixed_tied_3_blocks": ModelArgs(
        n_layers=3, weight_tying=True, checkpoint={0: True, 2: False}
    ),
}
"""Transformer configurations: block index -> use_reentrant for the checkpointed blocks."""
ORDERS = ("cdm_outside", "cdm_inside")
NAMES = list(SCENARIOS)


# ------------------------------------------------------------------ counting
def _op_name(packet: Any) -> str:
    """``torch.ops.c10d_functional.all_reduce`` -> ``all_reduce`` (torch keys by packets)."""
    return str(packet).rsplit(".", 1)[-1]


def torch_counts(cdm: TorchCommDebugMode) -> Counts:
    """Per-module counts of torch 2.13's CommDebugMode, keyed like commspan's."""
    out: Counts = {}
    for fqn, phases in cdm.comm_module_counts.items():
        for phase in ("forward", "backward"):
            for packet, n in phases.get(phase, {}).items():
                if n:
                    key = (fqn, phase, _op_name(packet))
                    out[key] = out.get(key, 0) + n
    return out


def commspan_counts(module_counts: Mapping[str, Mapping[str, Mapping[str, int]]]) -> Counts:
    """commspan's per-module counts with recompute folded into backward, as torch files them."""
    out: Counts = {}
    for fqn, phases in module_counts.items():
        for phase, ops in phases.items():
            folded = "backward" if phase == semconv.Phase.RECOMPUTE.value else phase
            for op, n in ops.items():
                if n:
                    key = (fqn, folded, op)
                    out[key] = out.get(key, 0) + n
    return out


def minus(after: Counts, before: Counts) -> Counts:
    """Counts added between two snapshots (zeros dropped)."""
    out = {k: n - before.get(k, 0) for k, n in after.items()}
    return {k: n for k, n in out.items() if n}


def phase_only(counts: Counts, phase: str) -> Counts:
    """The entries of ``counts`` of one phase."""
    return {k: n for k, n in counts.items() if k[1] == phase}


# ------------------------------------------------------------------ runs
@dataclasses.dataclass
class Run:
    """Per-step counts of each tool that took part, and commspan's spans."""

    torch: list[Counts] = dataclasses.field(default_factory=list)
    torch_totals: list[int] = dataclasses.field(default_factory=list)
    commspan: list[Counts] = dataclasses.field(default_factory=list)
    commspan_totals: list[int] = dataclasses.field(default_factory=list)
    spans: list[ReadableSpan] = dataclasses.field(default_factory=list)
    internal_errors: int = 0


StepFn = Callable[[], None]


def _steps(model: nn.Module, args: ModelArgs) -> Iterator[StepFn]:
    tokens, targets = make_batch(args)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        train_step(model, tokens, targets)

    for _ in range(STEPS):
        yield step


def run_torch_alone(model: nn.Module, args: ModelArgs) -> Run:
    """Each step under a fresh torch CommDebugMode."""
    run = Run()
    for step in _steps(model, args):
        cdm = TorchCommDebugMode()
        with cdm:
            step()
        run.torch.append(torch_counts(cdm))
        run.torch_totals.append(cdm.get_total_counts())
    return run


def run_commspan_alone(model: nn.Module, args: ModelArgs) -> Run:
    """All steps under one CommSpanMode, one ``mode.step(i)`` trace per step."""
    run = Run()
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    assert mode.aggregator is not None
    with mode:
        before: Counts = {}
        for i, step in enumerate(_steps(model, args)):
            total_before = mode.aggregator.total_count()
            with mode.step(i):
                step()
            now = commspan_counts(mode.aggregator.module_counts())
            run.commspan.append(minus(now, before))
            run.commspan_totals.append(mode.aggregator.total_count() - total_before)
            before = now
    run.spans = list(exporter.get_finished_spans())
    run.internal_errors = mode.stats()["internal_errors"]
    return run


def run_cdm_outside(model: nn.Module, args: ModelArgs) -> Run:
    """Each step: a fresh torch CommDebugMode around a fresh CommSpanMode."""
    run = Run()
    exporter = InMemorySpanExporter()
    for step in _steps(model, args):
        cdm = TorchCommDebugMode()
        mode = CommSpanMode(exporters=[exporter])
        assert mode.aggregator is not None
        with cdm, mode:
            step()
        run.torch.append(torch_counts(cdm))
        run.torch_totals.append(cdm.get_total_counts())
        run.commspan.append(commspan_counts(mode.aggregator.module_counts()))
        run.commspan_totals.append(mode.aggregator.total_count())
        run.internal_errors += mode.stats()["internal_errors"]
    run.spans = list(exporter.get_finished_spans())
    return run


def run_cdm_inside(model: nn.Module, args: ModelArgs) -> Run:
    """One CommSpanMode over all steps; in each ``mode.step(i)`` a fresh torch CommDebugMode."""
    run = Run()
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    assert mode.aggregator is not None
    with mode:
        before: Counts = {}
        for i, step in enumerate(_steps(model, args)):
            cdm = TorchCommDebugMode()
            total_before = mode.aggregator.total_count()
            with mode.step(i), cdm:
                step()
            run.torch.append(torch_counts(cdm))
            run.torch_totals.append(cdm.get_total_counts())
            now = commspan_counts(mode.aggregator.module_counts())
            run.commspan.append(minus(now, before))
            run.commspan_totals.append(mode.aggregator.total_count() - total_before)
            before = now
    run.spans = list(exporter.get_finished_spans())
    run.internal_errors = mode.stats()["internal_errors"]
    return run


RUNNERS: dict[str, Callable[[nn.Module, ModelArgs], Run]] = {
    "torch_alone": run_torch_alone,
    "commspan_alone": run_commspan_alone,
    "cdm_outside": run_cdm_outside,
    "cdm_inside": run_cdm_inside,
}


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """Run this module's tiny ops on one thread (restored after): on a loaded 2-core
    machine torch's thread pool makes each step 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tp_mesh(fake_pg: None) -> DeviceMesh:
    """A 1-D CPU mesh over the fake process group, shared by this module's runs."""
    return init_device_mesh("cpu", (4,))


@pytest.fixture(scope="module")
def runs(tp_mesh: DeviceMesh) -> Callable[[str], dict[str, Run]]:
    """``runs(scenario)``: every runner's result for that scenario, computed once."""
    cache: dict[str, dict[str, Run]] = {}

    def get(name: str) -> dict[str, Run]:
        if name not in cache:
            args = SCENARIOS[name]
            results = {}
            for runner_name, runner in RUNNERS.items():
                torch.manual_seed(0)
                model = parallelize(Transformer(args), tp_mesh)
                results[runner_name] = runner(model, args)
            cache[name] = results
        return cache[name]

    return get


# ------------------------------------------------------------------ counts: commspan == torch
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", NAMES)
def test_totals_match_torch(name: str, order: str, runs: Callable[[str], dict[str, Run]]) -> None:
    """Per step, commspan's total and per-op counts equal torch's, in either nesting order."""
    run = runs(name)[order]
    assert len(run.torch) == len(run.commspan) == STEPS
    for step in range(STEPS):
        assert run.commspan_totals[step] == run.torch_totals[step] > 0
        by_op_torch = {k: n for k, n in run.torch[step].items() if k[0] == "Global"}
        by_op_commspan = {k: n for k, n in run.commspan[step].items() if k[0] == "Global"}
        assert by_op_commspan == by_op_torch
    assert run.internal_errors == 0


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", NAMES)
def test_forward_counts_match_torch(
    name: str, order: str, runs: Callable[[str], dict[str, Run]]
) -> None:
    """Per module, commspan's forward counts equal torch's forward counts."""
    run = runs(name)[order]
    for step in range(STEPS):
        assert phase_only(run.commspan[step], "forward") == phase_only(run.torch[step], "forward")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", NAMES)
def test_backward_counts_match_torch(
    name: str, order: str, runs: Callable[[str], dict[str, Run]]
) -> None:
    """Per module, commspan's backward + recompute counts equal torch's backward counts."""
    run = runs(name)[order]
    for step in range(STEPS):
        assert phase_only(run.commspan[step], "backward") == phase_only(run.torch[step], "backward")


@pytest.mark.parametrize("name", NAMES)
def test_nesting_leaves_torch_counts_unchanged(
    name: str, runs: Callable[[str], dict[str, Run]]
) -> None:
    """torch's CommDebugMode counts the same alone, outside commspan and inside it."""
    results = runs(name)
    alone = results["torch_alone"]
    for order in ORDERS:
        assert results[order].torch == alone.torch, order
        assert results[order].torch_totals == alone.torch_totals, order


@pytest.mark.parametrize("name", NAMES)
def test_nesting_leaves_commspan_counts_unchanged(
    name: str, runs: Callable[[str], dict[str, Run]]
) -> None:
    """commspan counts the same alone, inside torch's CommDebugMode and around it."""
    results = runs(name)
    alone = results["commspan_alone"]
    for order in ORDERS:
        assert results[order].commspan == alone.commspan, order
        assert results[order].commspan_totals == alone.commspan_totals, order


@pytest.mark.parametrize("name", NAMES)
def test_every_step_counts_the_same(name: str, runs: Callable[[str], dict[str, Run]]) -> None:
    """One CommSpanMode over several steps attributes each step exactly like the first."""
    for runner in ("commspan_alone", "cdm_inside"):
        run = runs(name)[runner]
        assert all(counts == run.commspan[0] for counts in run.commspan), runner
        assert len(set(run.commspan_totals)) == 1, runner


class _ColwiseThenIdentity(nn.Module):
    """A column-sharded Linear whose output passes through a module that returns its input."""

    def __init__(self, tail: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.tail = tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.lin(x))


@pytest.mark.parametrize(
    "tail", [nn.Identity, lambda: nn.Dropout(0.0)], ids=["identity", "dropout0"]
)
def test_identity_module_after_colwise(tail: Callable[[], nn.Module], tp_mesh: DeviceMesh) -> None:
    """The Colwise input-grad all_reduce belongs to the Linear even before an identity module."""
    model = parallelize_module(_ColwiseThenIdentity(tail()), tp_mesh, {"lin": ColwiseParallel()})
    x = torch.randn(4, 8, requires_grad=True)
    cdm = TorchCommDebugMode()
    with cdm:
        model(x).sum().backward()
    mode = CommSpanMode()
    with mode:
        model(x).sum().backward()
    assert mode.aggregator is not None
    got = commspan_counts(mode.aggregator.module_counts())
    assert got.get(("_ColwiseThenIdentity.lin", "backward", "all_reduce")) == 1
    assert got == torch_counts(cdm)


# ------------------------------------------------------------------ span tree
SPAN_RUNS = ("commspan_alone", "cdm_outside", "cdm_inside")


def _attr(span: ReadableSpan, key: str) -> Any:
    return (span.attributes or {}).get(key)


def _parent_id(span: ReadableSpan) -> int:
    assert span.parent is not None, f"{span.name} has no parent"
    return span.parent.span_id


@pytest.mark.parametrize("runner", SPAN_RUNS)
@pytest.mark.parametrize("name", NAMES)
def test_span_tree_is_well_formed(
    name: str, runner: str, runs: Callable[[str], dict[str, Run]]
) -> None:
    """Every span's parent is in its trace and encloses it in time; phases nest correctly
    (forward under forward, backward under backward, recompute inside a backward)."""
    run = runs(name)[runner]
    assert_well_formed(run.spans)
    phases = {_attr(s, semconv.PHASE) for s in run.spans} - {None}
    has_ac = bool(SCENARIOS[name].checkpoint)
    assert phases == ({"forward", "backward", "recompute"} if has_ac else {"forward", "backward"})
    traces = {s.context.trace_id for s in run.spans}
    assert len(traces) == STEPS  # one trace per step (or per fresh mode)


@pytest.mark.parametrize("name", NAMES)
def test_no_error_spans_in_a_clean_step(name: str, runs: Callable[[str], dict[str, Run]]) -> None:
    """A step that raises nothing produces no ERROR span and no exception event."""
    for runner in SPAN_RUNS:
        spans = runs(name)[runner].spans
        assert [s.name for s in spans if s.status.status_code is StatusCode.ERROR] == [], runner
        assert [s.name for s in spans for e in s.events if e.name == semconv.EVENT_EXCEPTION] == []


@pytest.mark.parametrize("name", NAMES)
def test_recompute_spans_cover_the_checkpointed_blocks(
    name: str, runs: Callable[[str], dict[str, Run]]
) -> None:
    """Each checkpointed block gets one recompute span per step, no other block does, and a
    recompute span has its module's forward depth."""
    args = SCENARIOS[name]
    spans = runs(name)["commspan_alone"].spans
    recomputed = sorted(
        _attr(s, semconv.MODULE_FQN)
        for s in spans
        if _attr(s, semconv.PHASE) == "recompute" and _attr(s, semconv.MODULE_DEPTH) == 2
    )
    expected = sorted(f"Transformer.layers.{i}" for i in args.checkpoint for _ in range(STEPS))
    assert recomputed == expected
    forward_depth = {
        _attr(s, semconv.MODULE_FQN): _attr(s, semconv.MODULE_DEPTH)
        for s in spans
        if _attr(s, semconv.PHASE) == "forward"
    }
    for span in spans:
        if _attr(span, semconv.PHASE) == "recompute":
            fqn = _attr(span, semconv.MODULE_FQN)
            assert _attr(span, semconv.MODULE_DEPTH) == forward_depth[fqn], fqn


def _nearest_backward(span: ReadableSpan, by_id: Mapping[int, ReadableSpan]) -> ReadableSpan:
    """The closest ancestor of ``span`` that is a backward span."""
    ancestor = by_id[_parent_id(span)]
    while _attr(ancestor, semconv.PHASE) != "backward":
        ancestor = by_id[_parent_id(ancestor)]
    return ancestor


@pytest.mark.parametrize(
    "runner",
    [
        # alone, Dropout(p=0) hands w2's output tensor through unchanged; under torch's
        # CommDebugMode its full-backward hooks rewrap that tensor
        "commspan_alone",
        "cdm_inside",
    ],
)
def test_recompute_runs_inside_the_backward_that_needs_it(
    runner: str, runs: Callable[[str], dict[str, Run]]
) -> None:
    """A non-reentrant recompute runs inside the backward span of w2, whose input it rebuilds."""
    spans = runs("ac_non_reentrant")[runner].spans
    by_id = {s.context.span_id: s for s in spans}
    recomputes = [
        s
        for s in spans
        if _attr(s, semconv.PHASE) == "recompute"
        and _attr(s, semconv.MODULE_FQN) == "Transformer.layers.1"
    ]
    assert len(recomputes) == STEPS
    for span in recomputes:
        assert (
            _nearest_backward(span, by_id).name == "Transformer.layers.1.feed_forward.w2 backward"
        )


# ------------------------------------------------------------------ compat CommDebugMode == torch's
# commspan.compat.CommDebugMode and torch 2.13's CommDebugMode run the same scenario (fresh
# module instances, each run once per context: torch 2.13 raises IndexError otherwise), and
# every report is compared with torch's own. torch's CommDebugMode also lists ops that its own
# hooks issue (it reads each parameter's ``.data`` four times, and its global backward hook
# wraps module inputs and outputs in views); compat's hooks issue none, so those records are
# taken out of torch's data, by torch's own hooks telling which ones they made, before torch
# renders its reports. Everything else is torch's own output.


@contextlib.contextmanager
def without_torch_hook_ops(cdm: TorchCommDebugMode) -> Iterator[None]:
    """Drop, at exit, the op records torch's CommDebugMode made of its own hooks' ops:
    those appended while its tracker's forward pre-hook or torch's backward-hook
    wrapping (``BackwardHook.setup_input_hook`` / ``setup_output_hook``) ran."""
    own: list[dict[str, Any]] = []

    def lengths() -> dict[str, int]:
        return {k: len(v["operations_list"]) for k, v in cdm.comm_module_operation_counts.items()}

    def tagged(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = lengths()
            try:
                return fn(*args, **kwargs)
            finally:
                for name, entry in cdm.comm_module_operation_counts.items():
                    own.extend(entry["operations_list"][before.get(name, 0):])

        return run

    tracker = cdm.advanced_module_tracker
    tracker._fw_pre_hook = tagged(tracker._fw_pre_hook)  # registered on __enter__
    saved = (BackwardHook.setup_input_hook, BackwardHook.setup_output_hook)
    BackwardHook.setup_input_hook = tagged(saved[0])  # type: ignore[method-assign]
    BackwardHook.setup_output_hook = tagged(saved[1])  # type: ignore[method-assign]
    try:
        yield
    finally:
        BackwardHook.setup_input_hook, BackwardHook.setup_output_hook = saved  # type: ignore[method-assign]
        drop = {id(record) for record in own}
        for entry in cdm.comm_module_operation_counts.values():
            entry["operations_list"][:] = [
                r for r in entry["operations_list"] if id(r) not in drop
            ]


class _Collectives(nn.Module):
    """Issues functional, coalesced and c10d collectives, and ops torch does not count
    (an in-place functional collective, point-to-point, barrier)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        y = funcol.all_gather_single(x, 0, group)
        y = funcol.reduce_scatter_single(y, "sum", 0, group)
        y = funcol.all_reduce(y, "sum", group)
        y = funcol.all_reduce_coalesced([y, y], "sum", group)[0]
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        gathered = torch.empty(x.shape[0] * dist.get_world_size(), *x.shape[1:])
        dist.all_gather_single(gathered, x)
        dist.reduce_scatter_single(x, gathered)
        dist.all_to_all_single(torch.empty_like(x), x)
        torch.ops._c10d_functional.all_reduce_(x, "sum", group.group_name)  # torch: not counted
        dist.send(x, 1)  # not counted
        dist.recv(x, 1)  # not counted
        dist.barrier()  # not counted
        return y


class _Redistributing(nn.Module):
    """DTensor redistributions (scatter, all_gather) around a module that issues collectives."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.comms = _Collectives()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = distribute_tensor(torch.arange(64.0).reshape(8, 8), self.mesh, [Shard(0)])
        d.redistribute(self.mesh, [Shard(1)]).full_tensor()
        return self.comms(x)


class _Passthrough(nn.Module):
    """Modules that hand their input back (Identity, Dropout(p=0)) between Linears."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.ident = nn.Identity()
        self.drop = nn.Dropout(0.0)
        self.act = nn.ReLU(inplace=inplace)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ident(self.lin1(x)) * 2
        h = self.act(self.drop(h))
        return self.lin2(h) + h.sum()


def _forward_backward(model: nn.Module, *inputs: torch.Tensor) -> StepFn:
    """A step: forward, ``sum().backward()``, nothing after it."""
    return lambda: model(*inputs).sum().backward()


def _transformer_step(args: ModelArgs, mesh: DeviceMesh) -> StepFn:
    torch.manual_seed(0)
    model = parallelize(Transformer(args), mesh)
    tokens, targets = make_batch(args)

    def step() -> None:
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()

    return step


def _collectives_step(mesh: DeviceMesh) -> StepFn:
    model = _Redistributing(mesh)

    def step() -> None:
        model(torch.ones(4, 4))
        dist.all_reduce(torch.ones(2))  # outside any module: Global only

    return step


class _Sharded(nn.Module):
    """Two blocks of two Linears (each block returns its last layer's output) and a
    head: FSDP2 units per block and at the root, as :func:`_fsdp2_step` shards them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fsdp2_step(mesh: DeviceMesh) -> StepFn:
    """FSDP2 over the mesh: a unit per block and the root (which holds ``head``). In
    backward, each block's parameters are gathered again from gradient hooks FSDP
    puts on the block's output (the root's prefetches the next block's)."""
    from torch.distributed.fsdp import fully_shard

    model = _Sharded()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _forward_backward(model, torch.rand(4, 8))


_MLP_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
_STACKED_PLAN = {
    f"layers.{i}.{name}": style
    for i in range(2)
    for name, style in (("net1", ColwiseParallel()), ("net2", RowwiseParallel()))
}

def _clip_step(mesh: DeviceMesh) -> StepFn:
    """clip_grad_norm_ on the gradients of a TP MLP: its norm's placements are a
    ``_NormPartial(2.0)``, which torch's JSON dump writes from a copy (``(2)``)."""
    torch.manual_seed(0)
    model = parallelize_module(MLPModule(), mesh, dict(_MLP_PLAN))
    model(torch.rand(8, 10)).sum().backward()
    return lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)


def _freed_model_step(mesh: DeviceMesh) -> StepFn:
    """A helper builds and calls the model and returns the loss: the model is freed
    before its backward (torch's hooks keep it alive; commspan's name it from the
    backward span it opened)."""
    import gc

    def loss() -> torch.Tensor:
        torch.manual_seed(0)
        model = parallelize_module(MLPModule(), mesh, dict(_MLP_PLAN))
        return model(torch.rand(8, 10)).sum()

    def step() -> None:
        value = loss()
        gc.collect()
        value.backward()

    return step


REPORT_SCENARIOS: dict[str, Callable[[DeviceMesh], StepFn]] = {
    "empty": lambda mesh: lambda: None,
    "no_module": lambda mesh: lambda: torch.ones(2, 2).sum(),
    "mlp": lambda mesh: _forward_backward(
        parallelize_module(MLPModule(), mesh, dict(_MLP_PLAN)), torch.rand(8, 10)
    ),
    "mlp_stacked": lambda mesh: _forward_backward(
        parallelize_module(MLPStacked(), mesh, dict(_STACKED_PLAN)), torch.rand(8, 10)
    ),
    "collectives": _collectives_step,
    "passthrough": lambda mesh: _forward_backward(
        _Passthrough(), torch.rand(3, 4, requires_grad=True)
    ),
    "fsdp2": _fsdp2_step,
    "clip_grad_norm": _clip_step,
    "freed_model": _freed_model_step,
    **{
        f"transformer_{name}": functools.partial(_transformer_step, args)
        for name, args in SCENARIOS.items()
    },
}
LEVELS = (0, 1, 2, 3)


@dataclasses.dataclass
class Reports:
    """What one CommDebugMode recorded and wrote for one scenario."""

    total: int
    comm_counts: dict[Any, int]
    module_counts: dict[str, dict[str, dict[Any, int]]]
    helper: dict[str, dict[str, Any]]
    parent_dict: dict[str, list[str]]
    parents: dict[str, set[str]]
    sharding: dict[str, Any]
    parameters: list[tuple[str, str, type, tuple[int, ...]]]
    tables: dict[Any, str]
    dumps: dict[Any, str]
    logs: dict[Any, str]


def _reports(cdm: Any, folder: Path) -> Reports:
    tracker = cdm.advanced_module_tracker
    tables: dict[Any, str] = {lvl: cdm.generate_comm_debug_tracing_table(lvl) for lvl in LEVELS}
    tables["default"] = cdm.generate_comm_debug_tracing_table()
    dumps: dict[Any, str] = {}
    logs: dict[Any, str] = {}
    for lvl in LEVELS:
        cdm.generate_json_dump(file_name=folder / f"dump{lvl}.json", noise_level=lvl)
        dumps[lvl] = (folder / f"dump{lvl}.json").read_text()
        cdm.log_comm_debug_tracing_table_to_file(folder / f"log{lvl}.txt", lvl)
        logs[lvl] = (folder / f"log{lvl}.txt").read_text()
    cwd = os.getcwd()
    os.chdir(folder)  # the default file names
    try:
        cdm.generate_json_dump()
        cdm.log_comm_debug_tracing_table_to_file()
    finally:
        os.chdir(cwd)
    dumps["default"] = (folder / "comm_mode_log.json").read_text()
    logs["default"] = (folder / "comm_mode_log.txt").read_text()
    return Reports(
        total=cdm.get_total_counts(),
        comm_counts=dict(cdm.get_comm_counts()),
        module_counts={
            fqn: {phase: dict(ops) for phase, ops in phases.items()}
            for fqn, phases in cdm.comm_module_counts.items()
        },
        helper={fqn: dict(info) for fqn, info in tracker.module_helper_dict.items()},
        parent_dict={k: list(v) for k, v in tracker.parent_dict.items()},
        parents={k: set(v) for k, v in tracker.module_parents_dict.items()},
        sharding=dict(cdm.get_sharding_info()),
        parameters=[
            (fqn, name, type(t), tuple(t.shape))
            for fqn, params in cdm.get_parameter_info().items()
            for name, t in params.items()
        ],
        tables=tables,
        dumps=dumps,
        logs=logs,
    )


@pytest.fixture(scope="module")
def reports(
    tp_mesh: DeviceMesh, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], dict[str, Reports]]:
    """``reports(scenario)``: ``{"torch": Reports, "compat": Reports}``, computed once."""
    cache: dict[str, dict[str, Reports]] = {}

    def get(name: str) -> dict[str, Reports]:
        if name not in cache:
            out = {}
            for impl in ("torch", "compat"):
                torch.manual_seed(0)
                step = REPORT_SCENARIOS[name](tp_mesh)
                folder = tmp_path_factory.mktemp(f"{name}-{impl}")
                if impl == "torch":
                    cdm: Any = TorchCommDebugMode()
                    with without_torch_hook_ops(cdm), cdm:
                        step()
                else:
                    cdm = CompatCommDebugMode()
                    with cdm:
                        step()
                out[impl] = _reports(cdm, folder)
            cache[name] = out
        return cache[name]

    return get


REPORT_NAMES = list(REPORT_SCENARIOS)


@pytest.mark.parametrize("name", REPORT_NAMES)
def test_compat_counts_match_torch(name: str, reports: Callable[[str], dict[str, Reports]]) -> None:
    """compat's total, per-op and per-module/phase counts equal torch's, keys included."""
    got, want = reports(name)["compat"], reports(name)["torch"]
    assert got.total == want.total
    assert got.comm_counts == want.comm_counts
    assert got.module_counts == want.module_counts
    if name == "collectives":  # c10d ops under their own keys; in-place funcol, barrier not counted
        assert want.comm_counts[torch.ops.c10d.allreduce_] == 2
        assert want.comm_counts[torch.ops.c10d_functional.all_reduce] == 1
        assert torch.ops._c10d_functional.all_reduce not in got.comm_counts


@pytest.mark.parametrize("name", REPORT_NAMES)
def test_compat_tracker_dicts_match_torch(
    name: str, reports: Callable[[str], dict[str, Reports]]
) -> None:
    """module_helper_dict, parent_dict, module_parents_dict, sharding and parameter info
    equal torch's (parameters: names, types and shapes, in order)."""
    got, want = reports(name)["compat"], reports(name)["torch"]
    assert got.helper == want.helper
    assert list(got.helper) == list(want.helper)
    assert got.parent_dict == want.parent_dict
    assert got.parents == want.parents
    assert got.sharding == want.sharding
    assert list(got.sharding) == list(want.sharding)
    assert got.parameters == want.parameters


@pytest.mark.parametrize("level", (0, 1, 2))
@pytest.mark.parametrize("name", REPORT_NAMES)
def test_compat_reports_equal_torch(
    name: str, level: int, reports: Callable[[str], dict[str, Reports]]
) -> None:
    """At noise levels 0-2 the table, the JSON dump and the log file equal torch's byte for byte."""
    got, want = reports(name)["compat"], reports(name)["torch"]
    assert got.tables[level] == want.tables[level]
    assert got.dumps[level] == want.dumps[level]
    assert got.logs[level] == want.logs[level]


def _mlp_modes(mesh: DeviceMesh) -> dict[str, Any]:
    """torch's and compat's CommDebugMode after one TP MLP step (torch's own hook ops dropped)."""
    out: dict[str, Any] = {}
    for impl, cls in (("torch", TorchCommDebugMode), ("compat", CompatCommDebugMode)):
        torch.manual_seed(0)
        step = REPORT_SCENARIOS["mlp"](mesh)
        cdm = cls()
        with without_torch_hook_ops(cdm) if impl == "torch" else contextlib.nullcontext(), cdm:
            step()
        out[impl] = cdm
    return out


@pytest.mark.parametrize("level", (0.5, 1.5, 2.5, -0.5, 7.5, float("inf"), float("-inf"),
                                   np.float32(1.5), fractions.Fraction(5, 2), torch.tensor(0.25)),
                         ids=str)
def test_noise_level_that_is_no_whole_number_reads_as_torch_reads_it(
    level: Any, tp_mesh: DeviceMesh, tmp_path: Path
) -> None:
    """torch compares ``noise_level`` with ``> 0``, ``> 1``, ``> 2``: 0.5 acts as 1, 1.5 as
    2, 2.5 as 3. compat raised TypeError; now it lists what torch lists at that level
    (levels 1 and 2 byte for byte; level 3 as compat's own level 3, whose op order
    differs from torch's, docs/compat.md)."""
    modes = _mlp_modes(tp_mesh)
    torch_cdm, compat = modes["torch"], modes["compat"]
    flags = torch_cdm._set_noise_parameters(level)
    whole = next(n for n in range(4) if torch_cdm._set_noise_parameters(n) == flags)
    assert compat.generate_comm_debug_tracing_table(level) == \
        compat.generate_comm_debug_tracing_table(whole)
    if whole < 3:
        assert compat.generate_comm_debug_tracing_table(level) == \
            torch_cdm.generate_comm_debug_tracing_table(level)
        for impl, cdm in modes.items():
            cdm.generate_json_dump(tmp_path / f"{impl}.json", noise_level=level)
            cdm.log_comm_debug_tracing_table_to_file(tmp_path / f"{impl}.txt", level)
        assert (tmp_path / "compat.json").read_text() == (tmp_path / "torch.json").read_text()
        assert (tmp_path / "compat.txt").read_text() == (tmp_path / "torch.txt").read_text()


@pytest.mark.parametrize("level", ("2", None, 1j, [1], (1,)))
def test_noise_level_torch_cannot_compare_is_refused(level: Any) -> None:
    """What torch's comparisons refuse (a string, None, a complex, a list) compat refuses
    too, with a TypeError that names the parameter, the value and the levels."""
    with pytest.raises(TypeError):
        TorchCommDebugMode()._set_noise_parameters(level)
    comm_mode = CompatCommDebugMode()
    with pytest.raises(TypeError, match=rf"noise_level={re.escape(repr(level))} is not "
                                        r"valid; pass a number: 0 \(collectives\)"):
        comm_mode.generate_comm_debug_tracing_table(level)


_OP_ENTRY = re.compile(r"^(\x1b\[1;33m)? *\*\*")  # the log file has no colours
_DETAIL = re.compile(r"^(\x1b\[1;31m)? *(shape|sharding|device mesh): ")


def _ops_unordered(table: str) -> list[str]:
    """The table with each run of op entries (an op line and its detail lines) sorted."""
    out: list[str] = []
    run: list[str] = []
    for line in table.splitlines():
        if _OP_ENTRY.match(line):
            run.append(line)
        elif _DETAIL.match(line) and run:
            run[-1] += "\n" + line
        else:
            out.extend(sorted(run))
            run = []
            out.append(line)
    return out + sorted(run)


def _dump_ops_unordered(text: str) -> Any:
    """A JSON dump with each op list sorted."""

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        for key in ("operations_forward", "operations_backward", "operations_checkpointing"):
            node[key] = sorted(node[key], key=lambda op: json.dumps(op, sort_keys=True))
        node["children"] = [walk(child) for child in node["children"]]
        return node

    return walk(json.loads(text))


@pytest.mark.parametrize("name", REPORT_NAMES)
def test_compat_level_3_reports_match_torch(
    name: str, reports: Callable[[str], dict[str, Reports]]
) -> None:
    """At noise level 3 (the default) the reports list the same ops per module and phase as
    torch's; only the order among ops run by one autograd step may differ (torch's backward
    hooks add nodes to the autograd graph, which moves gradient accumulation)."""
    got, want = reports(name)["compat"], reports(name)["torch"]
    for key in (3, "default"):
        assert _ops_unordered(got.tables[key]) == _ops_unordered(want.tables[key]), key
        assert _dump_ops_unordered(got.dumps[key]) == _dump_ops_unordered(want.dumps[key]), key
        assert _ops_unordered(got.logs[key]) == _ops_unordered(want.logs[key]), key
    assert got.tables["default"] == got.tables[3]
    assert got.dumps["default"] == got.dumps[3]
    assert got.logs["default"] == got.logs[3]


def test_collective_after_backward_is_filed_as_torch_does_not(
    tp_mesh: DeviceMesh,
) -> None:
    """A collective after backward in the same context: torch 2.13 files it as a forward
    collective of the module whose backward started last (and its ancestors); compat files it
    under the module whose forward is running, here none: Global. Documented in docs/compat.md."""
    filed = {}
    for impl, cls in (("torch", TorchCommDebugMode), ("compat", CompatCommDebugMode)):
        torch.manual_seed(0)
        model = parallelize_module(MLPModule(), tp_mesh, dict(_MLP_PLAN))
        cdm = cls()
        with cdm:
            model(torch.rand(8, 10)).sum().backward()
            model.net1.weight.full_tensor()  # one all_gather
        gather = torch.ops.c10d_functional.all_gather_into_tensor
        filed[impl] = {
            fqn: n
            for fqn, phases in cdm.comm_module_counts.items()
            if (n := phases["forward"][gather])
        }
    assert filed["torch"] == {"Global": 1, "MLPModule": 1, "MLPModule.net1": 1}
    assert filed["compat"] == {"Global": 1}


def test_in_place_module_breaks_torch_not_compat() -> None:
    """torch 2.13's CommDebugMode wraps module inputs in views for its backward hook, so a
    module that changes its input in place (ReLU(inplace=True)) raises under it; compat
    wraps nothing and runs the model."""
    x = torch.rand(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        with TorchCommDebugMode():
            _Passthrough(inplace=True)(x).sum().backward()
    comm_mode = CompatCommDebugMode()
    with comm_mode:
        _Passthrough(inplace=True)(x).sum().backward()
    ops = comm_mode.comm_module_operation_counts["_Passthrough.act"]["operations_list"]
    assert "aten.relu_.default" in [str(op["name"]) for op in ops if not op["is_bw"]]


class _BackwardCalls(torch.autograd.Function):
    """Calls a module (first seen here) inside its backward; that module all-reduces."""

    module: nn.Module

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _BackwardCalls.module(grad)


class _AllReduce(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", dist.group.WORLD)


def test_module_first_seen_in_backward(fake_pg: None) -> None:
    """A module that first runs inside backward: torch 2.13 raises KeyError on its
    collective; compat counts it under the module and Global, as backward."""
    x = torch.rand(4, requires_grad=True)
    _BackwardCalls.module = _AllReduce()
    with pytest.raises(KeyError, match="_AllReduce"):
        with TorchCommDebugMode():
            _BackwardCalls.apply(x).sum().backward()
    comm_mode = CompatCommDebugMode()
    with comm_mode:
        _BackwardCalls.apply(x).sum().backward()
    assert {fqn: dict(p["backward"]) for fqn, p in comm_mode.comm_module_counts.items()} == {
        "Global": {torch.ops.c10d_functional.all_reduce: 1},
        "_AllReduce": {torch.ops.c10d_functional.all_reduce: 1},
    }


class _Block(nn.Module):
    """A block whose child all-reduces (``a``), then a plain layer (``b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), _AllReduce())
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _names_and_counts(cdm: Any, folder: Path) -> dict[str, Any]:
    """Every result of a context that holds module names, with packets as text."""
    tracker = cdm.advanced_module_tracker
    cdm.generate_json_dump(folder / "dump.json", noise_level=0)
    return {
        "counts": {fqn: {phase: {str(k): n for k, n in ops.items()} for phase, ops in p.items()}
                   for fqn, p in cdm.comm_module_counts.items()},
        "helper": list(tracker.module_helper_dict),
        "parent_dict": {k: list(v) for k, v in tracker.parent_dict.items()},
        "parents": {k: sorted(v) for k, v in tracker.module_parents_dict.items()},
        "table": cdm.generate_comm_debug_tracing_table(noise_level=0),
        "json": json.loads((folder / "dump.json").read_text()),
    }


def test_a_new_context_names_modules_afresh(fake_pg: None, tmp_path: Path) -> None:
    """One instance, two contexts: the first calls only the child ``m.a``, the second
    the whole model. torch names the child ``_Block.a`` in the second; compat kept
    the first context's ``Sequential`` in every count, dict and report (a KeyError on
    ``comm_module_counts["_Block.a"]``). Now the second context names modules as a
    fresh instance does; torch keeps the grandchildren's old names
    (``Sequential.0``), compat names them as a fresh instance (``_Block.a.0``)."""
    results = {}
    for name, cls, first in (("torch", TorchCommDebugMode, True),
                             ("compat", CompatCommDebugMode, True),
                             ("fresh", CompatCommDebugMode, False)):
        torch.manual_seed(0)
        model, cdm = _Block(), cls()
        if first:
            with cdm:
                model.a(torch.rand(2, 4))
        with cdm:
            model(torch.rand(2, 4)).sum().backward()
        (tmp_path / name).mkdir()
        results[name] = _names_and_counts(cdm, tmp_path / name)
    assert results["compat"] == results["fresh"]
    assert results["compat"]["helper"] == [
        "Global", "_Block", "_Block.a", "_Block.a.0", "_Block.a.1", "_Block.b"]
    assert results["torch"]["helper"] == [
        "Global", "_Block", "_Block.a", "Sequential.0", "Sequential.1", "_Block.b"]
    # torch's grandchildren renamed as compat names them, everything else is the same
    by_torch = json.loads(re.sub(r"Sequential\.", "_Block.a.", json.dumps(results["torch"])))
    by_torch["parents"] = {k: sorted(v) for k, v in by_torch["parents"].items()}
    assert by_torch == results["compat"]


def test_compiled_code_counts_match_torch(tp_mesh: DeviceMesh) -> None:
    """Under torch's CommDebugMode, torch.compile runs frames eagerly (it is not an "infra"
    dispatch mode); compat's mode does the same, so a compiled funcol all_reduce and a
    compiled DTensor redistribution count as they do under torch."""

    def redistribute(x: Any) -> torch.Tensor:
        return x.redistribute(tp_mesh, [Replicate()]).to_local() * 2

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    counts = {}
    for impl, cls in (("torch", TorchCommDebugMode), ("compat", CompatCommDebugMode)):
        torch._dynamo.reset()
        compiled = [torch.compile(fn, backend="inductor") for fn in (redistribute, reduce)]
        x = distribute_tensor(torch.randn(8, 8), tp_mesh, [Shard(0)])
        cdm = cls()
        with cdm:
            compiled[0](x)
            compiled[1](torch.randn(4))
        counts[impl] = dict(cdm.get_comm_counts())
    torch._dynamo.reset()
    assert counts["compat"] == counts["torch"] == {
        torch.ops.c10d_functional.all_gather_into_tensor: 1,
        torch.ops.c10d_functional.all_reduce: 1,
    }
