"""Bytes and counts per mesh dimension per module (``Aggregator.mesh_dim_counts``).

The toy Transformer, tensor-parallel over ``tp`` and sharded with FSDP2 over
``dp`` on a 2 x 2 fake mesh (world 4, this process is rank 0), two steps. The
references never use commspan's attribution:

- every collective the step issues, with its process group and input bytes, as
  seen by a small dispatch mode of the test's own (the group names the mesh
  dimension: ``mesh["tp"]`` and ``mesh["dp"]`` hold one group each);
- the tensor-parallel collectives each block issues in its forward, from that
  same mode and a forward-hook stack on the blocks;
- each FSDP unit's all-gather bytes from its parameter sizes before sharding
  (a rank's input to the all-gather is its padded shard).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _fsdp_sizes import padded_unit_elements
from torch.utils._python_dispatch import TorchDispatchMode

from commspan import Aggregator, CommSpanMode, semconv
from commspan.analysis.counts import mesh_dim_of
from commspan.exporters import JsonlSpanExporter
from commspan.testing import fake_mesh, fake_process_group
from commspan.testing.models import ModelArgs, Transformer, make_batch, parallelize, train_step

STEPS = 2
DP = 2
_COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_to_all_single", "all_gather_into_tensor_coalesced",
                "reduce_scatter_tensor_coalesced", "_allgather_base_", "_reduce_scatter_base_",
                "allreduce_", "allgather_into_tensor_coalesced_",
                "reduce_scatter_tensor_coalesced_"}


# c10d ops whose input is not their first argument (output first)
_INPUT_INDEX = {"_allgather_base_": 1, "_reduce_scatter_base_": 1,
                "allgather_into_tensor_coalesced_": 1, "reduce_scatter_tensor_coalesced_": 1}


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class _Reference(TorchDispatchMode):
    """Every collective op: (mesh dimension, op, input bytes, innermost hooked block or None).

    The dimension is told by the group's ranks (``dims``: ranks -> dimension name),
    not its name: torch may hand DTensor a group of an earlier mesh with the same
    ranks (one made by another test on the session's fake process group)."""

    def __init__(self, dims: dict[tuple[int, ...], str], blocks: list[str]) -> None:
        super().__init__()
        self.dims = dims
        self.blocks = blocks  # the forward-hook stack
        self.seen: list[tuple[str, str, int, str | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.distributed_c10d import _resolve_process_group

        name = func._opname
        if func.namespace in ("_c10d_functional", "c10d") and name in _COLLECTIVES:
            boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            if boxed is not None:  # c10d ops take the group, boxed
                group = dist.ProcessGroup.unbox(boxed)
            else:  # functional ops take its name, the last string argument
                group = _resolve_process_group([a for a in args if isinstance(a, str)][-1])
            ranks = tuple(dist.get_process_group_ranks(group))
            assert ranks in self.dims, (func, ranks)
            source = args[_INPUT_INDEX.get(name, 0)]
            self.seen.append((self.dims[ranks], name, _bytes(source),
                              self.blocks[-1] if self.blocks else None))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from torch.distributed.fsdp import fully_shard

    out = tmp_path_factory.mktemp("mesh-dims")
    with fake_process_group(world_size=4):
        mesh = fake_mesh((DP, 2), names=("dp", "tp"))
        torch.manual_seed(0)
        args = ModelArgs(n_layers=2, vocab_size=8, dim=16, n_heads=4)
        model = parallelize(Transformer(args), mesh["tp"])
        # the units' all-gather input bytes, from the (TP-local) parameters before FSDP
        nested = {id(b) for b in model.layers}
        unit_bytes = {f"Transformer.layers.{i}": padded_unit_elements([b], set(), DP) // DP * 4
                      for i, b in enumerate(model.layers)}
        unit_bytes["Transformer"] = padded_unit_elements([model], nested, DP) // DP * 4
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        prefix = type(model).__name__  # FSDPTransformer
        unit_bytes = {k.replace("Transformer", prefix, 1): v for k, v in unit_bytes.items()}
        stack: list[str] = []
        def enter(name: str) -> Any:
            def hook(module: Any, inputs: Any) -> None:
                stack.append(name)
            return hook

        def leave(module: Any, inputs: Any, output: Any) -> None:
            stack.pop()

        for i, block in enumerate(model.layers):
            block.register_forward_pre_hook(enter(f"{prefix}.layers.{i}"))
            block.register_forward_hook(leave)
        dims = {tuple(dist.get_process_group_ranks(mesh[d].get_group())): d for d in ("tp", "dp")}
        assert len(dims) == 2
        reference = _Reference(dims, stack)
        mode = CommSpanMode(exporters=[JsonlSpanExporter(out / "commspan-rank{rank}.jsonl")])
        tokens, targets = make_batch(args)
        with mode:
            for step in range(STEPS):
                with mode.step(step), reference:
                    train_step(model, tokens, targets, zero_grad=True)
        mode.shutdown()
        assert mode.aggregator is not None
        yield {"agg": mode.aggregator, "reference": reference.seen, "out": out,
               "unit_bytes": unit_bytes, "prefix": prefix, "stats": mode.stats()}


def _reference_totals(seen: list[tuple[str, str, int, str | None]]) -> dict[str, tuple[int, int]]:
    totals: dict[str, list[int]] = {}
    for dim, _op, nbytes, _block in seen:
        slot = totals.setdefault(dim, [0, 0])
        slot[0] += 1
        slot[1] += nbytes
    return {d: (c, b) for d, (c, b) in totals.items()}


def _totals(per_op: dict[str, dict[str, int]]) -> tuple[int, int]:
    return (sum(v["count"] for v in per_op.values()), sum(v["bytes"] for v in per_op.values()))


def test_global_counts_and_bytes_per_mesh_dim_match_the_dispatch_reference(
    run: dict[str, Any],
) -> None:
    """Global: per mesh dimension, the number of collectives and their input bytes
    are those the test's own dispatch mode saw on that dimension's group."""
    got = run["agg"].mesh_dim_counts()[semconv.GLOBAL_FQN]
    expected = _reference_totals(run["reference"])
    assert set(expected) == {"tp", "dp"}
    assert {dim: _totals(ops) for dim, ops in got.items()} == expected
    assert run["stats"]["internal_errors"] == 0


def test_fsdp_units_all_gather_their_padded_shards_on_dp(run: dict[str, Any]) -> None:
    """Each FSDP unit owns its dp all-gathers; each carries the unit's padded shard
    (computed from its parameters), and the units' all-gathers add up to all of dp's."""
    owned = run["agg"].mesh_dim_counts(subtree=False)
    total = 0
    for unit, shard_bytes in run["unit_bytes"].items():
        gathers = {op: v for op, v in owned[unit]["dp"].items() if "all_gather" in op}
        assert len(gathers) == 1, owned[unit]
        (stats,) = gathers.values()
        assert stats["count"] >= STEPS  # at least one unshard per step
        assert stats["bytes"] == stats["count"] * shard_bytes, unit
        total += stats["count"]
    dp_gathers = sum(1 for dim, op, _b, _blk in run["reference"]
                     if dim == "dp" and "gather" in op)  # c10d: _allgather_base_
    assert total == dp_gathers


def test_blocks_forward_tp_collectives_match_the_hook_reference(run: dict[str, Any]) -> None:
    """Each block's forward-phase tp collectives (its subtree) are those the test
    saw issued on the tp group while the block's forward ran."""
    got = run["agg"].mesh_dim_counts(phase="forward")
    ref: Counter[tuple[str, str]] = Counter()
    for dim, _op, nbytes, block in run["reference"]:
        if dim == "tp" and block is not None:
            ref[(block, "count")] += 1
            ref[(block, "bytes")] += nbytes
    assert ref, "the blocks issue tensor-parallel collectives in forward"
    for i in range(2):
        block = f"{run['prefix']}.layers.{i}"
        count, nbytes = _totals(got[block]["tp"])
        assert (count, nbytes) == (ref[(block, "count")], ref[(block, "bytes")])


def test_subtree_counts_include_the_children(run: dict[str, Any]) -> None:
    """With ``subtree`` a block's counts hold those its children own; owner-only
    counts of the block and its children add up to them."""
    agg = run["agg"]
    subtree, owned = agg.mesh_dim_counts(), agg.mesh_dim_counts(subtree=False)
    block = f"{run['prefix']}.layers.0"
    for dim in ("tp", "dp"):
        parts = [ops for fqn, dims in owned.items() if fqn == block or fqn.startswith(block + ".")
                 for d, ops in dims.items() if d == dim]
        count = sum(_totals(ops)[0] for ops in parts)
        nbytes = sum(_totals(ops)[1] for ops in parts)
        assert _totals(subtree[block][dim]) == (count, nbytes)


def test_live_and_jsonl_agree(run: dict[str, Any]) -> None:
    """The same numbers from the rank's JSONL file."""
    offline = Aggregator.from_jsonl(Path(run["out"]), rank=0)
    assert offline.mesh_dim_counts() == run["agg"].mesh_dim_counts()
    assert offline.mesh_dim_counts(phase="backward", subtree=False) == run[
        "agg"].mesh_dim_counts(phase="backward", subtree=False)


def test_mesh_dim_of_names_a_dimension_or_a_group() -> None:
    assert mesh_dim_of({semconv.MESH_DIM_NAME: "tp", semconv.MESH_DIM: 1}) == "tp"
    assert mesh_dim_of({semconv.MESH_DIM: 1, semconv.PG_NAME: "3"}) == "dim 1"
    assert mesh_dim_of({semconv.PG_NAME: "3"}) == "group 3"
    assert mesh_dim_of({}) == "unknown"
