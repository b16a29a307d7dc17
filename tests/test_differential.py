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

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from commspan import CommSpanMode, semconv
from commspan.testing import assert_well_formed
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

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
