"""commspan.testing: capture(), fresh_mode() and the assert_* helpers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from commspan import Aggregator, CommSpanMode, Phase, semconv, testing
from commspan.exporters import JsonlSpanExporter
from commspan.testing import (
    CommCapture,
    SpanTree,
    assert_counts,
    assert_no_comm,
    assert_placements,
    assert_well_formed,
    capture,
    collective_events,
    fresh_mode,
    span_counts,
    span_fqn,
    span_phase,
)
from commspan.testing.models import MLP, parallelize_mlp


@pytest.fixture()
def tp_mlp(mesh: torch.distributed.device_mesh.DeviceMesh) -> MLP:
    """MLP with net1 column-wise and net2 row-wise over the fake 4-rank mesh."""
    torch.manual_seed(0)
    return parallelize_mlp(MLP(), mesh)


@pytest.fixture()
def tp_cap(tp_mlp: MLP) -> CommCapture:
    """One forward+backward of the TP MLP (input requires grad), captured."""
    with capture() as cap:
        tp_mlp(torch.randn(4, 8, requires_grad=True)).sum().backward()
    return cap


# ------------------------------------------------------------------ capture
def test_public_names_are_sorted_and_exist() -> None:
    """__all__ is sorted and every name in it exists."""
    assert testing.__all__ == sorted(testing.__all__)
    for name in testing.__all__:
        assert hasattr(testing, name), name


def test_capture_counts_tp_collectives(tp_cap: CommCapture) -> None:
    """capture() yields counts per module and phase that stay readable after the block."""
    assert not tp_cap.mode.active
    assert tp_cap.counts("MLP.net2", "forward") == {"all_reduce": 1}
    assert tp_cap.counts("MLP.net1", "backward") == {"all_reduce": 1}
    assert tp_cap.counts("Global") == {"all_reduce": 2}
    assert tp_cap.counts("MLP", Phase.BACKWARD) == {"all_reduce": 1}
    assert "CommCapture(modules=4, collectives=2" in repr(tp_cap)


def test_capture_keeps_finished_spans(tp_cap: CommCapture) -> None:
    """cap.spans holds every finished span, children before parents, roots last."""
    names = [s.name for s in tp_cap.spans]
    assert names.index("MLP.net2 forward") < names.index("MLP forward")
    assert names[-2:] == ["commspan.rank", "commspan.session"]
    events = [e.name for s in tp_cap.spans if s.name == "MLP.net2 forward" for e in s.events]
    assert events == ["all_reduce"]


def test_capture_passes_mode_arguments() -> None:
    """Keyword arguments reach CommSpanMode (here: no parameter attributes)."""
    with capture(record_params=False) as cap:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert cap.aggregator.parameter_info() == {}


def test_capture_rejects_its_own_aggregator() -> None:
    """capture(aggregator=...) is a TypeError naming the argument."""
    with pytest.raises(TypeError, match="aggregator="), capture(aggregator=Aggregator()):
        pass


def test_capture_propagates_errors_and_leaves_the_mode() -> None:
    """An exception in the block propagates; the mode is left and what ran is kept."""
    with pytest.raises(ZeroDivisionError), capture() as cap:
        torch.nn.ReLU()(torch.ones(1))
        raise ZeroDivisionError("in the step")
    assert not cap.mode.active
    assert "ReLU" in cap.aggregator.modules()


def test_fresh_mode_leaves_and_shuts_down(tmp_path: Path) -> None:
    """fresh_mode() yields an un-entered mode; afterwards it is left and its exporters closed."""
    exporter = JsonlSpanExporter(f"{tmp_path}/spans.jsonl")
    with fresh_mode(exporters=[exporter]) as mode:
        assert isinstance(mode, CommSpanMode) and not mode.active
        mode.__enter__()  # a test that forgot to leave
        torch.nn.ReLU()(torch.ones(1))
    assert not mode.active
    assert exporter.lines_written >= 1
    assert exporter.export([ReadableSpan("late")]) is SpanExportResult.FAILURE  # closed


# ------------------------------------------------------------------ assert_counts
def test_assert_counts_passes_on_exact_counts(tp_cap: CommCapture) -> None:
    """Exact counts pass, zero-count entries are ignored, and every input kind is accepted."""
    assert_counts(tp_cap, "MLP.net2", "forward", {"all_reduce": 1})
    assert_counts(tp_cap.aggregator, "Global", Phase.FORWARD, {"all_reduce": 1, "broadcast": 0})
    assert_counts(tp_cap.mode, "MLP.relu", "backward", {})
    tp_cap.assert_counts("MLP", "backward", {"all_reduce": 1})


def test_assert_counts_failure_shows_diff_and_table(tp_cap: CommCapture) -> None:
    """A mismatch names module, phase, both counts and shows the module table with placements."""
    with pytest.raises(AssertionError) as info:
        assert_counts(tp_cap, "MLP.net2", "forward", {"all_reduce": 2})
    msg = str(info.value)
    assert "'MLP.net2' in forward" in msg
    assert "all_reduce: expected 2, got 1" in msg
    assert "module table (noise_level=1):" in msg
    assert "MLP.net2 (Linear)" in msg and "8x16 S(1)" in msg


def test_assert_counts_names_unknown_modules(tp_cap: CommCapture) -> None:
    """Asserting on a module that never ran says so and lists the modules that did."""
    with pytest.raises(AssertionError, match="no module named 'MLP.net3' ran"):
        assert_counts(tp_cap, "MLP.net3", "forward", {"all_reduce": 1})


def test_assert_counts_rejects_bad_arguments(tp_cap: CommCapture) -> None:
    """A wrong phase or a negative count is a ValueError; a wrong object a TypeError."""
    with pytest.raises(ValueError, match="phase='fwd' is not valid"):
        assert_counts(tp_cap, "MLP", "fwd", {})
    with pytest.raises(ValueError, match=r"expected\['all_reduce'\]=-1"):
        assert_counts(tp_cap, "MLP", "forward", {"all_reduce": -1})
    with pytest.raises(TypeError, match="agg="):
        assert_counts({}, "MLP", "forward", {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aggregator=False"):
        assert_counts(CommSpanMode(aggregator=False), "MLP", "forward", {})


# ------------------------------------------------------------------ assert_no_comm
def test_assert_no_comm_passes_without_collectives() -> None:
    """A plain (non-distributed) model issues nothing in any phase."""
    with capture() as cap:
        torch.nn.Linear(2, 2)(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert_no_comm(cap)
    assert_no_comm(cap, phase=None)
    cap.assert_no_comm("backward", fqn="Linear")


def test_assert_no_comm_scopes_to_a_module(tp_cap: CommCapture) -> None:
    """Scoped to a module and phase, only that subtree and phase must be silent."""
    assert_no_comm(tp_cap, "forward", fqn="MLP.net1")
    assert_no_comm(tp_cap, "backward", fqn="MLP.net2")


def test_assert_no_comm_failure_lists_issuers(tp_cap: CommCapture) -> None:
    """A failure lists each issuing module with its placements, then the table."""
    with pytest.raises(AssertionError) as info:
        assert_no_comm(tp_cap)
    msg = str(info.value)
    assert msg.startswith("expected no collectives in forward on this rank")
    assert "MLP.net2 forward all_reduce x1 (P(sum) -> R)" in msg
    assert "MLP.net1 backward" not in msg
    assert "MLP.relu (ReLU)" in msg
    with pytest.raises(AssertionError, match="in any phase inside 'MLP'"):
        assert_no_comm(tp_cap, phase=None, fqn="MLP")


# ------------------------------------------------------------------ assert_placements
def test_assert_placements_passes_for_tp_reductions(tp_cap: CommCapture) -> None:
    """Row-wise forward and column-wise backward all_reduce turn Partial into Replicate."""
    from torch.distributed.tensor import Partial, Replicate

    assert_placements(tp_cap, "MLP.net2", "all_reduce", "P(sum)", "R", phase="forward")
    assert_placements(tp_cap, "MLP.net1", "all_reduce", [Partial()], [Replicate()])
    tp_cap.assert_placements("MLP.net1", "all_reduce", "P(sum)", "R", phase="backward")


def test_assert_placements_failure_shows_what_was_seen(tp_cap: CommCapture) -> None:
    """Wrong placements, a missing op and a silent module each fail with what was seen."""
    with pytest.raises(AssertionError, match=r"expected every one P\(sum\) -> S\(0\), got "
                       r"forward P\(sum\) -> R x1"):
        assert_placements(tp_cap, "MLP.net2", "all_reduce", "P(sum)", "S(0)")
    with pytest.raises(AssertionError, match="issued no all_gather_into_tensor "
                       r"\(it issued: forward all_reduce\)"):
        assert_placements(tp_cap, "MLP.net2", "all_gather_into_tensor", "S(0)", "R")
    with pytest.raises(AssertionError, match="'MLP.net2' in backward issued no all_reduce"):
        assert_placements(tp_cap, "MLP.net2", "all_reduce", "P(sum)", "R", phase="backward")
    with pytest.raises(AssertionError, match=r"it issued no collectives\)"):
        assert_placements(tp_cap, "MLP.relu", "all_reduce", "P(sum)", "R")


# ------------------------------------------------------------------ module names
@pytest.fixture()
def plain_cap() -> CommCapture:
    """One forward+backward of a plain (non-distributed) MLP: modules ran, no collectives."""
    with capture() as cap:
        MLP()(torch.ones(2, 8, requires_grad=True)).sum().backward()
    return cap


def test_assert_no_comm_rejects_a_misspelt_module(plain_cap: CommCapture) -> None:
    """A misspelt fqn fails with the closest names that ran, instead of passing silently."""
    with pytest.raises(AssertionError, match=r"no module named 'MLP\.net_2' ran; did you mean "
                       r"'MLP\.net2'") as info:
        assert_no_comm(plain_cap, fqn="MLP.net_2")
    assert "modules that ran: MLP, MLP.net1, MLP.relu, MLP.net2" in str(info.value)
    assert "module table (noise_level=1):" in str(info.value)
    with pytest.raises(AssertionError, match="did you mean 'MLP.net2'"):
        plain_cap.assert_no_comm(phase=None, fqn="MLP.net_2")


def test_assert_counts_rejects_a_misspelt_module(plain_cap: CommCapture) -> None:
    """assert_counts on a name that never ran fails even when no collectives are expected."""
    with pytest.raises(AssertionError, match=r"collectives of 'MLP\.Net2' in forward: no module "
                       r"named 'MLP\.Net2' ran; did you mean 'MLP\.net2'"):
        assert_counts(plain_cap, "MLP.Net2", "forward", {})


def test_counts_query_rejects_a_misspelt_module(plain_cap: CommCapture) -> None:
    """cap.counts() on an unknown name is a ValueError naming fqn and the nearest names."""
    with pytest.raises(ValueError, match=r"fqn='MLP\.net_2' is not valid: no module named "
                       r"'MLP\.net_2' ran; did you mean 'MLP\.net2'"):
        plain_cap.counts("MLP.net_2", "forward")
    with pytest.raises(TypeError, match="pass the module's name as a str"):
        plain_cap.counts(plain_cap.mode)  # type: ignore[arg-type]


def test_assert_placements_rejects_a_misspelt_module(plain_cap: CommCapture) -> None:
    """assert_placements names the closest module when its fqn never ran."""
    with pytest.raises(AssertionError, match=r"all_reduce of 'MLP\.net_1': no module named "
                       r"'MLP\.net_1' ran; did you mean 'MLP\.net1'"):
        assert_placements(plain_cap, "MLP.net_1", "all_reduce", "P(sum)", "R")


def test_a_leaf_name_suggests_its_full_name(plain_cap: CommCapture) -> None:
    """A module's own name without its parents suggests the full name first."""
    with pytest.raises(AssertionError, match="did you mean 'MLP.relu'"):
        assert_no_comm(plain_cap, fqn="relu")


def test_known_silent_modules_and_global_pass(plain_cap: CommCapture) -> None:
    """A module that ran without collectives is known; Global is known even when nothing ran."""
    assert_no_comm(plain_cap, phase=None, fqn="MLP.relu")
    assert_counts(plain_cap, "MLP.net2", "backward", {})
    assert plain_cap.counts("MLP.relu") == {}
    with capture() as empty:
        pass
    assert empty.counts("Global", "forward") == {}
    assert_no_comm(empty, phase=None, fqn="Global")
    with pytest.raises(AssertionError, match=r"no module named 'MLP' ran \(modules that ran: "
                       r"none\)"):
        assert_no_comm(empty, fqn="MLP")


class _Frozen(torch.nn.Module):
    """A TP MLP beside a frozen Linear on the input: the frozen one has no backward."""

    def __init__(self, mesh: torch.distributed.device_mesh.DeviceMesh) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.mlp = parallelize_mlp(MLP(), mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.frozen(x))


def _torch_phases(model: torch.nn.Module, run: Any) -> dict[str, set[str]]:
    """The phases each module ran in as torch's own ModTracker sees them (its hooks,
    not commspan's): forward pre-hooks and backward pre-hooks."""
    from torch.distributed._tools.mod_tracker import ModTracker

    seen: dict[str, set[str]] = {}
    tracker = ModTracker()
    tracker.register_user_hooks(
        pre_fw_hook=lambda mod, _i: seen.setdefault(tracker.get_known_fqn(mod), set()).add(
            "forward"),
        pre_bw_hook=lambda mod, _g: seen.setdefault(tracker.get_known_fqn(mod), set()).add(
            "backward"),
    )
    with tracker:
        run(model)
    return seen


@pytest.mark.parametrize("backward", [False, True])
def test_module_phases_match_torch_mod_tracker(
    backward: bool, mesh: torch.distributed.device_mesh.DeviceMesh, tmp_path: Path
) -> None:
    """Aggregator.module_phases() names the phases each module ran in as torch's
    ModTracker sees them (a frozen module and a forward without backward run no
    backward), live inside the mode, after it, and read back from JSONL lines and
    digests."""
    model = _Frozen(mesh)

    def run(m: torch.nn.Module) -> None:
        out = m(torch.randn(4, 8))
        if backward:
            out.sum().backward()

    want = {k: sorted(v, key=["forward", "backward"].index)
            for k, v in _torch_phases(model, run).items()}
    assert ("backward" in want["_Frozen.mlp.net1"]) is backward
    assert want["_Frozen.frozen"] == ["forward"]
    live: dict[str, list[str]] = {}
    with capture(exporters=[JsonlSpanExporter(tmp_path / "run.jsonl", digest=True)]) as cap:
        run(model)
        live = cap.aggregator.module_phases()
    assert live == want
    assert cap.aggregator.module_phases() == want
    assert Aggregator.from_jsonl(tmp_path / "run.jsonl").module_phases() == want  # digest
    (tmp_path / "run.jsonl.digest").unlink()
    assert Aggregator.from_jsonl(tmp_path / "run.jsonl").module_phases() == want  # lines


def test_assertions_refuse_a_phase_that_never_ran(
    mesh: torch.distributed.device_mesh.DeviceMesh
) -> None:
    """An assertion about a phase the module (or, for Global, every module) never ran
    in could not fail: a test that forgot loss.backward() would pass. It fails instead,
    naming the phases the module ran in; after a backward pass the same assertions
    pass or fail on what was issued."""
    model = _Frozen(mesh)
    with capture() as cap:
        model(torch.randn(4, 8, requires_grad=True))  # no backward
    with pytest.raises(AssertionError, match=r"expected no collectives inside 'Global': no "
                       r"module ran in backward .*run the backward pass inside the capture"):
        assert_no_comm(cap, "backward")
    with pytest.raises(AssertionError, match=r"'_Frozen\.mlp\.net1' never ran in backward in "
                       r"what was recorded \(it ran in forward\)"):
        assert_no_comm(cap, "backward", fqn="_Frozen.mlp.net1")
    for expected in ({}, {"all_reduce": 0}, {"all_reduce": 1}):
        with pytest.raises(AssertionError, match=r"collectives of '_Frozen\.mlp\.net2' in "
                           r"backward: '_Frozen\.mlp\.net2' never ran in backward"):
            assert_counts(cap, "_Frozen.mlp.net2", "backward", expected)
    with pytest.raises(AssertionError, match="no module ran in recompute .*checkpoint"):
        assert_no_comm(cap, "recompute")
    assert_no_comm(cap, "forward", fqn="_Frozen.mlp.net1")  # it ran there: absence shown
    assert_no_comm(cap, None, fqn="_Frozen.mlp.net1")

    with capture() as cap:
        model(torch.randn(4, 8)).sum().backward()
    assert_no_comm(cap, "backward", fqn="_Frozen.mlp.net2")
    # (its input, the frozen Linear's output, needs no gradient: no all_reduce of one)
    assert_counts(cap, "_Frozen.mlp.net1", "backward", {})
    with pytest.raises(AssertionError, match=r"'_Frozen\.frozen' never ran in backward .*a "
                       r"module none of whose outputs needed a gradient has no backward"):
        assert_no_comm(cap, "backward", fqn="_Frozen.frozen")
    with capture() as empty:  # code outside every module: nothing to tell the phases by
        torch.ones(2).sum()
    assert_no_comm(empty, "backward")


def test_assertions_refuse_a_mode_never_entered() -> None:
    """commspan_mode / fresh_mode give a mode the test must enter; one never entered
    recorded nothing, so an assertion of absence on it fails instead of passing."""
    with fresh_mode() as mode:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))  # forgot `with mode:`
        with pytest.raises(AssertionError, match=r"expected no collectives inside 'Global': "
                           r"this CommSpanMode was never entered, .*`with mode:`"):
            assert_no_comm(mode, phase=None)
        with pytest.raises(AssertionError, match="never entered"):
            assert_counts(mode, "Global", "forward", {})
        with mode:
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
        assert_no_comm(mode, phase=None)


def test_assertions_take_torch_comm_debug_mode_keys(tp_mlp: MLP) -> None:
    """A test ported from torch's CommDebugMode passes its counts, keyed by torch's op
    packets, to assert_counts as they are (they raised TypeError sorting packets and
    names together); a name that is not a collective is a ValueError with the closest
    names, not an expectation that fails or passes for lack of that op."""
    from torch.distributed.tensor.debug import CommDebugMode

    x = torch.randn(4, 8, requires_grad=True)
    torch_mode = CommDebugMode()
    with torch_mode:
        tp_mlp(x).sum().backward()
    with capture() as cap:
        tp_mlp(x).sum().backward()
    for fqn in ("MLP.net1", "MLP.net2", "Global"):
        for phase in ("forward", "backward"):
            torch_counts = torch_mode.comm_module_counts[fqn][phase]
            assert all(not isinstance(k, str) for k in torch_counts)  # packets
            assert_counts(cap, fqn, phase, torch_counts)
    assert_counts(cap, "MLP.net2", "forward", {"c10d.allreduce_": 0, "_c10d_functional."
                                               "all_reduce.default": 1})
    assert_placements(cap, "MLP.net2", torch.ops.c10d_functional.all_reduce, "P(sum)", "R")
    with pytest.raises(AssertionError, match=r"expected \{'all_reduce': 2\}, got "
                       r"\{'all_reduce': 1\}"):
        assert_counts(cap, "MLP.net2", "forward", {torch.ops.c10d_functional.all_reduce: 1,
                                                   torch.ops.c10d.allreduce_: 1})
    with pytest.raises(ValueError, match=r"expected key 'allreduce' is not valid: not a "
                       r"collective commspan knows \(torch .* installed\); did you mean "
                       r"'all_reduce'"):
        assert_counts(cap, "MLP.net2", "forward", {"allreduce": 0})
    with pytest.raises(ValueError, match=r"op=<OpOverloadPacket\(op='aten.mm'\)> is not "
                       "valid"):
        assert_placements(cap, "MLP.net2", torch.ops.aten.mm, "P(sum)", "R")


def test_op_names_of_other_torch_versions_resolve_whatever_torch_is_installed(
        tp_mlp: MLP) -> None:
    """assert_counts resolved an op's name (``"c10d_functional.all_reduce_"``) from the
    installed torch's op table, so a name of an op this torch no longer has, or not yet,
    was "not a collective commspan knows" on it, and passed where the op exists: a
    test written on one torch version failed on another. Every name of commspan's table
    resolves on any torch, to its canonical op, the key counts add up under (some of
    them are missing from the torch installed here: checked). A name commspan does not
    know says which torch is installed and to use a canonical name."""
    from commspan.capture import collectives

    x = torch.randn(4, 8, requires_grad=True)
    with capture() as cap:
        tp_mlp(x).sum().backward()
    names = {f"{ns}.{name}": canonical
             for (ns, name), (canonical, _) in collectives._TABLE.items()}
    absent = [n for n in names if collectives._packet(*n.split(".")) is None]
    assert absent  # (on this torch, e.g. c10d_functional.all_reduce_)
    for name, canonical in names.items():
        for spelling in (name, f"torch.ops.{name}", f"{name}.default"):
            # (MLP.net2 forward: one all_reduce; an op expected 0 must not occur)
            want = {spelling: 1} if canonical == "all_reduce" else {
                spelling: 0, "all_reduce": 1}
            assert_counts(cap, "MLP.net2", "forward", want)
    with pytest.raises(ValueError, match=(
            r"expected key 'c10d.allreduce_v9' is not valid: not a collective commspan "
            rf"knows \(torch {re.escape(torch.__version__)} installed\); did you mean "
            r"'all_reduce'.*use a canonical op name \(all_gather, .*\), which holds on "
            r"every torch version")):
        assert_counts(cap, "MLP.net2", "forward", {"c10d.allreduce_v9": 1})


def test_unknown_name_error_lists_a_bounded_number_of_modules() -> None:
    """With many modules the error lists the first 20 and says how many more ran."""
    model = torch.nn.Sequential(*[torch.nn.ReLU() for _ in range(30)])
    with capture() as cap:
        model(torch.ones(2))
    with pytest.raises(AssertionError, match=r"did you mean 'Sequential\.2' or .*\.\.\. "
                       r"\(11 more\)\)"):
        assert_no_comm(cap, fqn="Sequential.2x")


def test_assert_helpers_accept_a_mode_and_check_live_names() -> None:
    """Inside the mode, the modules still open are known (their frames are live)."""
    seen: list[str] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert_no_comm(mode, fqn="Probe")
            with pytest.raises(AssertionError, match="did you mean 'Probe'"):
                assert_no_comm(mode, fqn="Prob")
            seen.append("ok")
            return x

    mode = CommSpanMode()
    with mode:
        Probe()(torch.ones(1))
    assert seen == ["ok"]


# ------------------------------------------------------------------ span helpers
def _linear_spans() -> list[ReadableSpan]:
    """The spans of one forward and backward of a Linear inside a step."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with capture() as cap, cap.mode.step(0):
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()
    return cap.spans


def test_span_tree_and_accessors_read_a_capture() -> None:
    """SpanTree links each span to its parent up to the step root; the accessors read
    module name, phase and counts."""
    spans = _linear_spans()
    tree = SpanTree(spans)
    forward = next(s for s in tree.module_spans() if span_fqn(s) == "Sequential.0")
    assert span_phase(forward) == "forward"
    assert [a.name for a in tree.ancestors(forward)] == [
        "Sequential forward", semconv.SPAN_RANK, semconv.SPAN_STEP]
    assert len(tree.rank_spans()) == 1 and span_counts(forward) == {}
    assert collective_events(forward) == []
    assert_well_formed(spans)


def _rebuilt(span: ReadableSpan, **changes: Any) -> ReadableSpan:
    """``span`` with some of its fields replaced."""
    fields = {
        "name": span.name, "context": span.context, "parent": span.parent,
        "attributes": span.attributes, "events": span.events,
        "start_time": span.start_time, "end_time": span.end_time,
    }
    fields.update(changes)
    return ReadableSpan(**fields)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("orphan", "every span's parent is a span of its trace (parent missing"),
        ("outlives", "a span lies inside its parent's interval: 'Sequential.0 forward'"),
        ("renamed", "a module span is named '<fqn> <phase>': 'Sequential.0 fwd'"),
        ("rank_root", "a trace's root is a step or session span: 'commspan.rank'"),
        ("nothing", "no spans to check"),
        ("twice", "span ids are unique (a span exported twice?): 'Sequential.0 forward'"),
    ],
)
def test_assert_well_formed_catches_a_broken_tree(breakage: str, message: str) -> None:
    """A span whose parent is gone, one that ends after its parent, a module span not
    named '<fqn> <phase>', a trace whose root is not a step or session span, no spans,
    a span twice: each fails naming the rule and the span, also under ``python -O``
    (the checks are not ``assert`` statements)."""
    spans = _linear_spans()
    index = next(i for i, s in enumerate(spans) if s.name == "Sequential.0 forward")
    span = spans[index]
    parent = SpanTree(spans).parent(span)
    assert parent is not None and parent.end_time is not None
    if breakage == "orphan":
        spans = [s for s in spans if s is not parent]
    elif breakage == "outlives":
        spans[index] = _rebuilt(span, end_time=parent.end_time + 1)
    elif breakage == "renamed":
        spans[index] = _rebuilt(span, name="Sequential.0 fwd")
    elif breakage == "nothing":
        spans = []
    elif breakage == "twice":
        spans.append(span)
    else:  # the rank span without its step root above it
        spans = [
            _rebuilt(s, parent=None) if s.name == semconv.SPAN_RANK else s
            for s in spans
            if s.name != semconv.SPAN_STEP
        ]
    with pytest.raises(AssertionError, match=re.escape(message)):
        assert_well_formed(spans)


def test_assert_well_formed_refuses_what_is_not_sdk_spans() -> None:
    """Spans read back from a file (SpanRecord), or a single span, are a TypeError naming
    ``spans``, what was given and what to pass, not an AttributeError from inside."""
    from commspan.exporters import SpanRecord

    record = SpanRecord("Linear forward", "1", "2", "", 0, 1, {})
    with pytest.raises(TypeError, match=r"spans\[0\] is a SpanRecord \(a span read back "
                       r"from a JSONL file.*`cap\.spans` after a `with capture\(\) as cap:` block"):
        assert_well_formed([record])
    span = _linear_spans()[0]
    with pytest.raises(TypeError, match=r"spans=.* not a ReadableSpan; pass the SDK spans"):
        assert_well_formed(span)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"spans\[0\] is a SpanRecord.*not the "
                       r"OpenTelemetry ReadableSpan SpanTree takes"):
        SpanTree(iter([record]))


def test_assert_well_formed_checks_under_python_O(tmp_path: Path) -> None:
    """Under ``python -O`` (assert statements stripped) a broken tree still fails."""
    import subprocess
    import sys

    script = tmp_path / "o.py"
    script.write_text(
        "import torch\n"
        "from commspan.testing import capture\n"
        "from commspan.testing.spans import assert_well_formed\n"
        "with capture() as cap:\n"
        "    torch.nn.Sequential(torch.nn.Linear(2, 2))(torch.ones(1, 2))\n"
        "spans = cap.spans\n"
        "try:\n"
        "    assert_well_formed(spans + spans[:1])\n"
        "except AssertionError as e:\n"
        "    print('caught', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert "caught span ids are unique" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("kwargs", [{"ranks": [1]}, {"sample": [5]}])
def test_assertions_refuse_a_capture_that_traced_nothing(
    kwargs: dict[str, object], fake_pg: None
) -> None:
    """A capture whose rank (``ranks=``) or every step (``sample=``) is left out records
    nothing: an assertion of absence would pass whatever ran, so every assertion
    refuses it, naming the parameter."""
    import torch.distributed as dist

    from commspan.testing import assert_counts, assert_no_comm, capture

    class Sync(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

    with capture(**kwargs) as cap:
        with cap.mode.step(0):
            Sync()(torch.ones(2))
    name = next(iter(kwargs))
    with pytest.raises(AssertionError, match=f"{name}= "):
        assert_no_comm(cap, phase=None)
    with pytest.raises(AssertionError, match=f"drop {name}="):
        assert_counts(cap, "Global", "forward", {})


def test_assert_no_comm_refuses_a_capture_with_steps_sampled_out(fake_pg: None) -> None:
    """With every other step sampled out, counts cover the traced steps: assert_counts
    reads them, but absence cannot be shown (the collective of step 1 went unseen)."""
    import torch.distributed as dist

    from commspan.testing import assert_counts, assert_no_comm, capture

    class Sync(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.on:
                dist.all_reduce(x)
            return x

    sync = Sync()
    with capture(sample=2) as cap:
        for i in range(2):
            sync.on = i == 1
            with cap.mode.step(i):
                sync(torch.ones(2))
    assert_counts(cap, "Sync", "forward", {})  # step 0 only: what was traced
    with pytest.raises(AssertionError, match="sample= left 1 of 2 steps untraced"):
        assert_no_comm(cap)


def test_capture_inside_a_callers_except_records_no_error() -> None:
    """A capture used while the caller handles an unrelated exception: the block
    succeeded, so no span says ERROR and none carries the caller's exception."""
    from opentelemetry.trace import StatusCode

    from commspan.testing import capture

    try:
        raise KeyError("the caller's, already handled")
    except KeyError:
        with capture() as cap:
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert all(s.status.status_code is not StatusCode.ERROR for s in cap.spans)
    assert not any(e.name == "exception" for s in cap.spans for e in s.events)


def test_assertion_arguments_of_the_wrong_kind_are_named() -> None:
    """``expected=None``, ``src=5``: a TypeError naming the parameter and what to pass."""
    from commspan.testing import assert_counts, assert_placements, capture

    with capture() as cap:
        pass
    with pytest.raises(TypeError, match=r"expected=None is not valid; pass \{op: count\}"):
        assert_counts(cap, "Global", "forward", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="src=5 is not valid"):
        assert_placements(cap, "Global", "all_reduce", 5, "R")  # type: ignore[arg-type]


_OTHER_RANK = """
import sys, re, torch
from opentelemetry.sdk.trace import ReadableSpan
from commspan import semconv
from commspan.testing import SpanTree, assert_well_formed, capture, fake_mesh, span_phase
from commspan.testing import fake_process_group
from commspan.testing.models import MLP, parallelize_mlp

def rebuilt(span, **changes):
    fields = dict(name=span.name, context=span.context, parent=span.parent,
                  attributes=span.attributes, events=span.events,
                  start_time=span.start_time, end_time=span.end_time)
    fields.update(changes)
    return ReadableSpan(**fields)

def fails(spans, rule):
    try:
        assert_well_formed(spans)
    except AssertionError as exc:
        assert rule in str(exc), exc
    else:
        raise SystemExit("not refused: " + rule)

with fake_process_group(world_size=4, rank=int(sys.argv[1])):
    mlp = parallelize_mlp(MLP(8), fake_mesh(4))
    with capture() as cap, cap.mode.step(0):
        mlp(torch.ones(2, 8, requires_grad=True)).sum().backward()
spans = cap.spans
tree = SpanTree(spans)
ranks = [s for s in spans if s.name == semconv.SPAN_RANK]
assert ranks and all(s.parent is not None and tree.parent(s) is None for s in ranks)
assert not [s for s in spans if s.name == semconv.SPAN_STEP]
assert_well_formed(spans)
fails([s for s in spans if s not in ranks], "every span's parent is a span of its trace")
forward = next(s for s in spans if span_phase(s) == "forward" and tree.parent(s) in ranks)
assert [a.name for a in tree.ancestors(forward)] == [semconv.SPAN_RANK]
broken = [rebuilt(s, end_time=ranks[0].end_time + 1) if s is forward else s for s in spans]
fails(broken, "a span lies inside its parent's interval")
print("ok")
"""


def test_assert_well_formed_takes_the_capture_of_a_rank_other_than_0(tmp_path: Path) -> None:
    """Only rank 0 writes a step's root span; the rank span of any other rank hangs
    under a span of another process. The capture of rank 3 (the README's
    ``fake_process_group(world_size=8, rank=3)``) failed "every span's parent is a
    span of its trace"; the breakages that fail on rank 0 still fail on it. (In a
    process of its own: this session's fake group is rank 0's.)"""
    script = tmp_path / "other_rank.py"
    script.write_text(_OTHER_RANK)
    done = subprocess.run([sys.executable, str(script), "3"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_assertions_given_a_path_say_how_to_read_it(tmp_path: Path) -> None:
    """assert_no_comm("commspan-out") (the run's folder, not its counts): the TypeError
    names the path and the call that reads it, Aggregator.from_jsonl(path)."""
    paths: list[Any] = ["commspan-out", tmp_path]
    for agg in paths:
        expected = re.escape(f"agg={agg!r} is a path, not an Aggregator; pass "
                             f"Aggregator.from_jsonl({agg!r})")
        with pytest.raises(TypeError, match=expected):
            assert_no_comm(agg)
        with pytest.raises(TypeError, match=expected):
            assert_counts(agg, "Global", "forward", {})
