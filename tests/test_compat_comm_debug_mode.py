"""commspan.compat.CommDebugMode: torch 2.13's API surface, defaults and reports, and what it
does where torch 2.13 breaks (a module run twice) or where commspan decides differently.

tests/test_differential.py compares the same reports with torch's own output; these tests
pin the behaviours one by one, without torch's class.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from commspan import CommSpanMode
from commspan.capture.dispatch import CollectiveDispatchMode, OpRecordingDispatchMode
from commspan.compat import CommDebugMode, ModTracker
from commspan.testing.models import MLPModule

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ALL_REDUCE = torch.ops.c10d_functional.all_reduce
MLP_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _tp_mlp(mesh: DeviceMesh) -> nn.Module:
    return parallelize_module(MLPModule(), mesh, dict(MLP_PLAN))


def _run_mlp(mesh: DeviceMesh, **kwargs: Any) -> CommDebugMode:
    model = _tp_mlp(mesh)
    comm_mode = CommDebugMode(**kwargs)
    with comm_mode:
        model(torch.rand(8, 10)).sum().backward()
    return comm_mode


# ---------------------------------------------------------------- state on entry
def test_entering_starts_from_global_only(mesh: DeviceMesh) -> None:
    """Inside a fresh context, before anything runs: only Global, in torch's shape."""
    comm_mode = _run_mlp(mesh)
    assert comm_mode.get_total_counts() == 1
    with comm_mode:  # entering again forgets the previous run
        assert comm_mode.comm_module_counts == {"Global": {"forward": {}, "backward": {}}}
        assert list(comm_mode.comm_module_counts["Global"]) == ["forward", "backward"]
        tracker = comm_mode.advanced_module_tracker
        assert tracker.module_helper_dict == {"Global": {"depth": 0}}
        assert tracker.module_parents_dict == {"Global": set()}
        assert tracker.parent_dict == {}
        assert tracker.parent_list == ["Global"] and tracker.name == "Global"
        assert comm_mode.get_comm_counts() == {}
        assert comm_mode.get_parameter_info() == {} and comm_mode.get_sharding_info() == {}


def test_mlp_tracker_dicts(mesh: DeviceMesh) -> None:
    """After the TP MLP: five entries in first-call order, with depth, type and DTensor
    parameter placements; parents and callers as the calls nested."""
    comm_mode = _run_mlp(mesh)
    tracker = comm_mode.advanced_module_tracker
    helper = tracker.module_helper_dict
    assert list(helper) == ["Global", "MLPModule", "MLPModule.net1", "MLPModule.relu",
                            "MLPModule.net2"]
    assert helper["MLPModule"] == {
        "module_type": f"class '{MLPModule.__module__}.MLPModule'", "depth": 1
    }
    assert helper["MLPModule.net1"] == {
        "module_type": "class 'torch.nn.modules.linear.Linear'",
        "depth": 2,
        "parameters": {"weight": "(Shard(dim=0),)", "bias": "(Shard(dim=0),)"},
    }
    assert helper["MLPModule.net2"]["parameters"] == {
        "weight": "(Shard(dim=1),)", "bias": "(Replicate(),)"
    }
    assert "parameters" not in helper["MLPModule.relu"]
    assert tracker.parent_dict == {
        "Global": ["MLPModule"],
        "MLPModule": ["MLPModule.net1", "MLPModule.relu", "MLPModule.net2"],
    }
    assert tracker.module_parents_dict["MLPModule.net2"] == {"Global", "MLPModule",
                                                            "MLPModule.net2"}
    assert list(tracker.sharding_dict) == [f"MLPModule.{m}.{p}" for m in ("net1", "net2")
                                           for p in ("weight", "bias")]
    assert comm_mode.get_sharding_info() is tracker.sharding_dict
    assert comm_mode.get_parameter_info() is tracker.module_parameters_dict
    assert all(isinstance(t, DTensor) for p in tracker.module_parameters_dict.values()
               for t in p.values())
    assert tracker.module_depth_dict == {"Global": 0, "MLPModule": 1, "MLPModule.net1": 2,
                                         "MLPModule.relu": 2, "MLPModule.net2": 2}


def test_module_counts_have_torch_shape(mesh: DeviceMesh) -> None:
    """``comm_module_counts[fqn]`` is ``{"forward": {packet: n}, "backward": {...}}`` for the
    issuing module and each ancestor; the counts object is live and shared."""
    comm_mode = _run_mlp(mesh)
    counts = comm_mode.comm_module_counts
    assert set(counts) == {"Global", "MLPModule", "MLPModule.net2"}
    for fqn in counts:
        assert dict(counts[fqn].items()) == {"forward": {ALL_REDUCE: 1}, "backward": {}}
    assert comm_mode.get_comm_counts() is comm_mode.comm_counts
    assert comm_mode.get_comm_module_counts() is counts
    assert repr(comm_mode) == "CommDebugMode(get_total_counts()=1)"


# ---------------------------------------------------------------- which ops count, and how
class _C10dAndFunctional(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return torch.distributed._functional_collectives.all_reduce(x, "sum", dist.group.WORLD)


def test_c10d_ops_are_keyed_apart_from_functional_ones(fake_pg: None) -> None:
    """A c10d all_reduce counts under ``c10d.allreduce_``, a functional one under the legacy
    functional packet; a canonical name reads both."""
    comm_mode = CommDebugMode()
    with comm_mode:
        _C10dAndFunctional()(torch.ones(4))
    counts = comm_mode.get_comm_counts()
    assert dict(counts) == {torch.ops.c10d.allreduce_: 1, ALL_REDUCE: 1}
    assert counts[torch.ops._c10d_functional.all_reduce] == 1
    assert counts["all_reduce"] == 2
    assert counts[torch.ops.c10d.broadcast_] == 0
    assert torch.ops.c10d.broadcast_ not in counts  # reading a missing key does not add it
    assert comm_mode.comm_module_counts["_C10dAndFunctional"]["forward"]["all_reduce"] == 2


def test_uncounted_ops_match_torch(fake_pg: None) -> None:
    """Point-to-point ops, barrier and in-place functional collectives are not counted (as in
    torch 2.13); commspan's own aggregator still sees the point-to-point ones."""
    comm_mode = CommDebugMode()
    with comm_mode:
        dist.send(torch.ones(2), 1)
        dist.recv(torch.ones(2), 1)
        dist.barrier()
        torch.ops._c10d_functional.all_reduce_(torch.ones(2), "sum", dist.group.WORLD.group_name)
    assert comm_mode.get_total_counts() == 0
    assert comm_mode.aggregator.comm_counts()["send"] == 1


# ---------------------------------------------------------------- ops
def test_ops_are_listed_per_module_with_dtensor_details(mesh: DeviceMesh) -> None:
    """A DTensor op is listed with the global shapes, placements and mesh of its DTensor
    arguments, then the local ops it runs; ops of compat's own hooks are not listed."""
    comm_mode = _run_mlp(mesh)
    ops = comm_mode.comm_module_operation_counts["MLPModule.net1"]["operations_list"]
    addmm = [op for op in ops if str(op["name"]) == "aten.addmm.default"]
    assert addmm[0]["input_shape"] == [torch.Size([16]), torch.Size([8, 10]),
                                       torch.Size([10, 16])]
    assert addmm[0]["input_sharding"][0] == (Shard(dim=0),)
    assert addmm[0]["device_mesh"] == str(mesh)
    assert addmm[0]["is_bw"] is False and addmm[0]["is_activation_checkpointing"] is False
    assert addmm[1]["input_shape"] == []  # the local addmm
    forward_detaches = [op for op in ops if not op["is_bw"] and "detach" in str(op["name"])]
    assert forward_detaches == []  # reading the parameters for module_parameters_dict
    assert list(ops[0]) == ["name", "input_shape", "input_sharding", "device_mesh", "is_bw",
                            "is_activation_checkpointing"]


def test_fake_tensor_ops_are_not_listed(fake_pg: None) -> None:
    """Ops on fake tensors are not listed (torch does the same); counting is unaffected."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    comm_mode = CommDebugMode()
    with comm_mode:
        torch.ones(2).add(1)
        with FakeTensorMode():
            torch.ones(2).add(1)
    names = [str(op["name"]) for op in
             comm_mode.comm_module_operation_counts["Global"]["operations_list"]]
    assert names.count("aten.add.Tensor") == 1


def test_record_operations_false_keeps_counts_only(mesh: DeviceMesh) -> None:
    """``record_operations=False``: the same counts, no op lists, reports without ops."""
    full = _run_mlp(mesh)
    lean = _run_mlp(mesh, record_operations=False)
    assert lean.comm_module_counts == full.comm_module_counts
    assert lean.comm_module_operation_counts == {}
    table = lean.generate_comm_debug_tracing_table(3)
    assert "*module type: class 'torch.nn.modules.linear.Linear'" in table
    assert "**aten." not in table
    with pytest.raises(TypeError, match="record_operations=1"):
        CommDebugMode(record_operations=1)  # type: ignore[arg-type]


def test_only_the_compat_mode_lists_ops() -> None:
    """CommSpanMode's dispatch mode does not look at ordinary ops; compat's lists them."""
    plain = CommSpanMode()
    with plain:
        pass
    assert type(plain._dispatch) is CollectiveDispatchMode
    comm_mode = CommDebugMode()
    with comm_mode:
        pass
    assert type(comm_mode.mode._dispatch) is OpRecordingDispatchMode


def test_a_failing_op_observer_never_breaks_the_step() -> None:
    """An exception in the op observer is counted and the op still runs."""

    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    mode = OpRecordingDispatchMode(lambda info, attrs: None, broken)
    with mode:
        out = torch.ones(2) + 1
    assert out.tolist() == [2.0, 2.0]
    assert mode.errors >= 1


# ---------------------------------------------------------------- what torch 2.13 cannot do
class _TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 2)
        self.fc2 = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_module_run_many_times_leaves_no_hook_and_is_listed_once() -> None:
    """torch 2.13 raises IndexError on a module's second call in one context and leaves a
    hook behind; compat lists each module once and removes everything it added."""
    model = _TwoLayer()
    comm_mode = CommDebugMode()
    with comm_mode:
        for _ in range(10):
            model(torch.ones(1, 2))
    tracker = comm_mode.advanced_module_tracker
    assert list(tracker.module_helper_dict) == ["Global", "_TwoLayer", "_TwoLayer.fc1",
                                                "_TwoLayer.fc2"]
    assert tracker.parent_dict == {"Global": ["_TwoLayer"],
                                   "_TwoLayer": ["_TwoLayer.fc1", "_TwoLayer.fc2"]}
    addmm = [op for op in comm_mode.comm_module_operation_counts["_TwoLayer.fc1"][
        "operations_list"] if str(op["name"]) == "aten.addmm.default"]
    assert len(addmm) == 10
    for module in (model, model.fc1, model.fc2):
        assert not module._forward_hooks and not module._forward_pre_hooks
    model(torch.ones(1, 2))  # still works outside


def test_collectives_sum_over_calls(mesh: DeviceMesh) -> None:
    """Two forward-backward steps in one context count twice (torch 2.13 cannot run this)."""
    model = _tp_mlp(mesh)
    comm_mode = CommDebugMode()
    with comm_mode:
        for _ in range(2):
            model(torch.rand(8, 10)).sum().backward()
    assert comm_mode.comm_module_counts["MLPModule.net2"]["forward"][ALL_REDUCE] == 2
    assert comm_mode.get_total_counts() == 2


def test_after_backward_the_current_module_is_the_open_one(mesh: DeviceMesh) -> None:
    """After backward the current module is the one whose forward is running (Global here),
    not the module whose backward started last, as torch 2.13 keeps it."""
    model = _tp_mlp(mesh)
    comm_mode = CommDebugMode()
    with comm_mode:
        model(torch.rand(8, 10)).sum().backward()
        assert comm_mode.advanced_module_tracker.name == "Global"
        torch.ones(2).mul(3)
    ops = comm_mode.comm_module_operation_counts["Global"]["operations_list"]
    assert [str(op["name"]) for op in ops if not op["is_bw"]][-1] == "aten.mul.Tensor"


# ---------------------------------------------------------------- reports
def test_defaults_are_torch_defaults(mesh: DeviceMesh, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every report defaults to noise level 3; the files default to torch's names."""
    comm_mode = _run_mlp(mesh)
    assert comm_mode.generate_comm_debug_tracing_table() == \
        comm_mode.generate_comm_debug_tracing_table(3)
    monkeypatch.chdir(tmp_path)
    comm_mode.generate_json_dump()
    comm_mode.log_comm_debug_tracing_table_to_file()
    comm_mode.generate_json_dump("three.json", 3)
    comm_mode.log_comm_debug_tracing_table_to_file("three.txt", 3)
    assert (tmp_path / "comm_mode_log.json").read_text() == (tmp_path / "three.json").read_text()
    assert (tmp_path / "comm_mode_log.txt").read_text() == (tmp_path / "three.txt").read_text()
    assert (tmp_path / "three.txt").read_text() == _ANSI.sub(
        "", comm_mode.generate_comm_debug_tracing_table(3))


def test_noise_levels(mesh: DeviceMesh) -> None:
    """0: modules and collectives; 1: types, parameters, DTensor ops; 2: other ops;
    3: trivial ops too. Below 0 acts as 0 and above 3 as 3, as in torch."""
    comm_mode = _run_mlp(mesh)
    table = {lvl: _ANSI.sub("", comm_mode.generate_comm_debug_tracing_table(lvl))
             for lvl in range(4)}
    assert table[0] == (
        "Global\n  FORWARD PASS\n    *c10d_functional.all_reduce: 1\n"
        "    MLPModule\n      FORWARD PASS\n        *c10d_functional.all_reduce: 1\n"
        "        MLPModule.net1\n        MLPModule.relu\n        MLPModule.net2\n"
        "          FORWARD PASS\n            *c10d_functional.all_reduce: 1\n"
    )
    assert "*module type:" not in table[0] and "*module type:" in table[1]
    assert "         *weight: (Shard(dim=0),)\n" in table[1]
    assert "**aten.addmm.default\n              shape: [torch.Size([16])" in table[1]
    assert "**aten.relu.default" not in table[1] and "**aten.relu.default" in table[2]
    assert "**aten.detach.default" not in table[2] and "**aten.t.default" in table[3]
    assert comm_mode.generate_comm_debug_tracing_table(-5) == \
        comm_mode.generate_comm_debug_tracing_table(0)
    assert comm_mode.generate_comm_debug_tracing_table(9) == \
        comm_mode.generate_comm_debug_tracing_table(3)
    with pytest.raises(TypeError, match=r"noise_level='2' is not valid"):
        comm_mode.generate_comm_debug_tracing_table("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"noise_level=nan is not valid: NaN .* pass a number"):
        comm_mode.generate_json_dump("x.json", float("nan"))
    import numpy as np  # numbers of other types are taken, as torch takes them

    for level, whole in ((np.int64(2), 2), (2.0, 2), (True, 1), (0.5, 1), (1.5, 2), (2.5, 3)):
        assert comm_mode.generate_comm_debug_tracing_table(level) == (  # type: ignore[arg-type]
            comm_mode.generate_comm_debug_tracing_table(whole))


def test_entering_the_active_context_again_keeps_its_data(mesh: DeviceMesh) -> None:
    """``with comm_mode:`` inside ``with comm_mode:`` raised (torch's works) after
    clearing the counts of the outer context. It is one context now: the counts of
    both are kept, each collective counted once; the same for ModTracker."""
    model = _tp_mlp(mesh)
    comm_mode = CommDebugMode()
    with comm_mode:
        model(torch.rand(8, 10))
        first = comm_mode.get_total_counts()
        assert first > 0
        with comm_mode:
            assert comm_mode.get_total_counts() == first
            model(torch.rand(8, 10))
        assert comm_mode.mode.active  # the inner exit left the outer context on
        model(torch.rand(8, 10))
    assert comm_mode.get_total_counts() == 3 * first
    tracker = ModTracker()
    with tracker:
        with tracker:
            model(torch.rand(8, 10))
        assert tracker.mode.active
    assert not tracker.mode.active


def test_json_dump_structure(mesh: DeviceMesh, tmp_path: Path) -> None:
    """Every node has torch's nine keys in torch's order at every level; children follow
    the calls; collectives are ``[name, count]`` pairs."""
    comm_mode = _run_mlp(mesh)
    keys = ["fqn", "module_type", "parameters", "children", "collectives_forward",
            "collectives_backward", "operations_forward", "operations_backward",
            "operations_checkpointing"]
    for level in range(4):
        path = tmp_path / f"d{level}.json"
        comm_mode.generate_json_dump(path, level)
        text = path.read_text()
        assert not text.endswith("\n")
        tree = json.loads(text)
        nodes = [tree]
        while nodes:
            node = nodes.pop()
            assert list(node) == keys
            nodes.extend(node["children"])
        mlp = tree["children"][0]
        assert [c["fqn"] for c in mlp["children"]] == ["MLPModule.net1", "MLPModule.relu",
                                                       "MLPModule.net2"]
        assert tree["collectives_forward"] == [["c10d_functional.all_reduce", 1]]
        net1 = mlp["children"][0]
        assert (net1["module_type"] == "") == (level == 0)
        assert (net1["parameters"] == []) == (level == 0)
        assert (net1["operations_forward"] == []) == (level == 0)


class _Shared(nn.Module):
    """One Linear called from two parents."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(2, 2)
        self.a = nn.Sequential(self.shared)
        self.b = nn.Sequential(self.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_module_called_from_two_parents_is_a_child_of_both(tmp_path: Path) -> None:
    """The JSON tree follows the calls: a shared module appears under each caller."""
    comm_mode = CommDebugMode()
    with comm_mode:
        _Shared()(torch.ones(1, 2))
    comm_mode.generate_json_dump(tmp_path / "d.json", 0)
    tree = json.loads((tmp_path / "d.json").read_text())
    callers = {c["fqn"]: [g["fqn"] for g in c["children"]] for c in tree["children"][0]["children"]}
    assert callers == {"_Shared.a": ["_Shared.shared"], "_Shared.b": ["_Shared.shared"]}


def test_print_helpers(mesh: DeviceMesh, capsys: pytest.CaptureFixture[str]) -> None:
    """The tracker's (and the mode's) print helpers print parameters and one line per
    DTensor parameter's placements."""
    comm_mode = _run_mlp(mesh)
    comm_mode.advanced_module_tracker.print_sharding_info()
    assert capsys.readouterr().out.splitlines()[0] == "MLPModule.net1.weight: (Shard(dim=0),)"
    comm_mode.print_sharding_info()
    assert len(capsys.readouterr().out.splitlines()) == 4
    comm_mode.advanced_module_tracker.print_paramater_info()
    assert capsys.readouterr().out.startswith("{'MLPModule.net1': {'weight':")


# ---------------------------------------------------------------- misspelt names
def test_misspelt_module_name_lists_the_closest(mesh: DeviceMesh) -> None:
    """A name that never ran is a KeyError naming the closest modules that did; a module
    that ran without collectives is a KeyError saying why; ``get`` and ``in`` are plain."""
    comm_mode = _run_mlp(mesh)
    with pytest.raises(KeyError, match=r"no module named 'MLPModule\.nett2' ran; did you mean "
                                       r"'MLPModule\.net2'"):
        comm_mode.comm_module_counts["MLPModule.nett2"]
    with pytest.raises(KeyError, match=r"'MLPModule\.relu' is not a key of comm_module_counts: "
                                       r"a module gets an entry once a collective"):
        comm_mode.comm_module_counts["MLPModule.relu"]
    with pytest.raises(KeyError, match=r"did you mean 'MLPModule\.net1'"):
        comm_mode.advanced_module_tracker.module_helper_dict["MLPModule.Net1"]
    with pytest.raises(KeyError, match=r"did you mean 'MLPModule\.net2'"):
        comm_mode.get_parameter_info()["net2"]
    assert comm_mode.comm_module_counts.get("MLPModule.nett2") is None
    assert "MLPModule.nett2" not in comm_mode.comm_module_counts


def test_advanced_tracker_is_entered_by_its_mode_only() -> None:
    """Entering the tracker itself is an error that says what to do instead."""
    comm_mode = CommDebugMode()
    assert isinstance(comm_mode.advanced_module_tracker, ModTracker)
    with pytest.raises(RuntimeError, match="use `with comm_mode:`"):
        comm_mode.advanced_module_tracker.__enter__()


def test_advanced_tracker_parents_and_user_hooks(mesh: DeviceMesh) -> None:
    """The tracker answers ModTracker's questions and calls its user hooks."""
    seen: list[tuple[str, Any]] = []
    comm_mode = CommDebugMode()
    tracker = comm_mode.advanced_module_tracker
    tracker.register_user_hooks(
        pre_fw_hook=lambda m, i: seen.append(("pre_fw", sorted(tracker.parents))),
        post_bw_hook=lambda m, g: seen.append(("post_bw", tracker.get_known_fqn(m))),
    )
    model = _tp_mlp(mesh)
    with comm_mode:
        model(torch.rand(8, 10)).sum().backward()
    assert seen[0] == ("pre_fw", ["Global", "MLPModule"])
    assert ("post_bw", "MLPModule.net1") in seen


def test_dtensor_collectives_are_counted_under_the_current_module(mesh: DeviceMesh) -> None:
    """distribute_tensor scatters (a c10d op); Shard(0) -> Shard(1) all-gathers (functional)."""

    class Redistribute(nn.Module):
        def forward(self, x: torch.Tensor) -> DTensor:
            return distribute_tensor(x, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])

    comm_mode = CommDebugMode()
    with comm_mode:
        Redistribute()(torch.arange(64.0).reshape(8, 8))
    assert dict(comm_mode.comm_module_counts["Redistribute"]["forward"]) == {
        torch.ops.c10d.scatter_: 1, torch.ops.c10d_functional.all_gather_into_tensor: 1,
    }


# ---------------------------------------------------------------- docs/compat.md
def test_docs_compat_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """docs/compat.md's Python block runs as written and writes both files."""
    from test_docs import REPO, run_blocks

    monkeypatch.chdir(tmp_path)
    run_blocks(REPO / "docs" / "compat.md")
    out = capsys.readouterr().out
    assert out.startswith("0\n{'forward': {}, 'backward': {}}\nGlobal\n")
    assert "*module type: class 'torch.nn.modules.linear.Linear'" in out
    assert json.loads((tmp_path / "comm_mode_log.json").read_text())["fqn"] == "Global"
    assert (tmp_path / "comm_mode_log.txt").read_text().startswith("Global\n")


def test_docs_compat_links_resolve() -> None:
    """Every relative link in docs/compat.md points at a file of the repository."""
    from test_docs import REPO

    doc = REPO / "docs" / "compat.md"
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8"))
    assert [t for t in targets if "://" not in t and not (doc.parent / t).exists()] == []


def test_entering_talks_to_no_other_rank(
    fake_pg: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's classes send nothing when entered, so `CommDebugMode() if rank == 0 else
    nullcontext()` is a common pattern; the compat classes do not agree a run id across
    ranks either (that broadcast, unmatched on the other ranks, hung the job), unless a
    run_id is passed, which they use as given."""
    import commspan.session.run_id as run_id_mod
    from commspan.compat import ModTracker

    agreed: list[str] = []
    monkeypatch.setattr(run_id_mod, "_agree", lambda local: agreed.append(local) or local)
    for cls in (CommDebugMode, ModTracker):
        with cls() as ctx:
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
        assert agreed == [], cls
        assert len(ctx.mode.run_id) == 32
    with CommDebugMode(run_id="shared") as cdm:
        pass
    assert cdm.mode.run_id == "shared" and agreed == []


def test_a_misspelt_phase_is_a_key_error_not_a_zero_count() -> None:
    """``counts["forwards"]`` used to read as an op with no count (0): a test asserting
    ``== 0`` on it could not fail. torch raises ``KeyError``; so does compat, saying what
    the phases are. An op name still sums both phases, 0 when never issued."""
    from commspan.compat._counting import ModuleCounts

    counts = ModuleCounts()
    with pytest.raises(KeyError, match="'forwards' is neither a phase nor a collective"):
        counts["forwards"]
    assert counts["all_reduce"] == 0 and counts["forward"] == {}


def test_a_ddp_module_named_afresh_is_still_a_ddp_module(fake_pg: None) -> None:
    """Each context names modules afresh (docs/compat.md); a DistributedDataParallel
    module named again in a later context is still handled as one (its forward end
    resets the count of its buckets launched), though the registry learnt it before."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(nn.Linear(4, 4))
    comm_mode = CommDebugMode()
    for _ in range(2):
        with comm_mode:
            ddp(torch.ones(2, 4))  # (no backward: the fake group's futures hold nothing)
        tracker = comm_mode.mode._tracker
        assert tracker is not None and tracker._info(ddp).ddp
    assert list(comm_mode.advanced_module_tracker.module_helper_dict) == [
        "Global", "DistributedDataParallel", "DistributedDataParallel.module"]
