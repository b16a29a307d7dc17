"""capture/dispatch.py: commspan's dispatch mode nested with torch's CommDebugMode,
either way round; how it calls a c10d op."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tracing import (
    mlp_step,
    tp_mlp,
    traced_mode,
)
from torch.distributed.device_mesh import DeviceMesh


def _cdm_counts(cdm: Any) -> tuple[int, dict[str, int], dict[str, dict[str, dict[str, int]]]]:
    module_counts = {
        m: {p: {str(op): n for op, n in ops.items()} for p, ops in phases.items()}
        for m, phases in cdm.comm_module_counts.items()
    }
    return (
        cdm.get_total_counts(),
        {str(op): n for op, n in cdm.get_comm_counts().items()},
        module_counts,
    )


@pytest.mark.parametrize(
    "commspan_outside", [True, False], ids=["commspan-outside", "commspan-inside"]
)
def test_nesting_with_torch_commdebugmode(mesh: DeviceMesh, commspan_outside: bool) -> None:
    """CommSpanMode around or inside torch's CommDebugMode (fresh per step) changes no counts."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = tp_mlp(mesh)
    alone = []
    for _ in range(2):
        cdm = CommDebugMode()
        with cdm:
            mlp_step(model)
        alone.append(_cdm_counts(cdm))
    solo, _ = traced_mode()
    with solo:
        for i in range(2):
            with solo.step(i):
                mlp_step(model)
    assert solo.aggregator is not None

    nested, _ = traced_mode()
    together = []
    if commspan_outside:
        with nested:
            for i in range(2):
                cdm = CommDebugMode()
                with nested.step(i), cdm:
                    mlp_step(model)
                together.append(_cdm_counts(cdm))
    else:
        for _ in range(2):
            cdm = CommDebugMode()
            with cdm, nested:
                mlp_step(model)
            together.append(_cdm_counts(cdm))
    assert together == alone
    assert alone[0][0] == 2
    assert nested.aggregator is not None
    if commspan_outside:
        assert nested.aggregator.module_counts() == solo.aggregator.module_counts()
    else:  # a fresh context per step: compare with one step alone
        one, _ = traced_mode()
        with one:
            mlp_step(model)
        assert one.aggregator is not None
        assert nested.aggregator.module_counts() == one.aggregator.module_counts()


def test_sampled_out_steps_with_commdebugmode_around_or_inside(mesh: DeviceMesh) -> None:
    """Sampled-out steps record nothing, with torch's CommDebugMode around or inside the step."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = tp_mlp(mesh)
    for cdm_outside in (True, False):
        mode, _ = traced_mode(sample={0, 2})
        seen = []
        with mode:
            for i in range(4):
                cdm = CommDebugMode()
                if cdm_outside:
                    with cdm, mode.step(i):
                        mlp_step(model)
                else:
                    with mode.step(i), cdm:
                        mlp_step(model)
                assert mode.aggregator is not None
                seen.append((cdm.get_total_counts(), mode.aggregator.total_count()))
        assert seen == [(2, 2), (2, 2), (2, 4), (2, 4)], cdm_outside
        assert mode.stats()["collectives"] == 4


def test_sampled_out_steps_number_nothing_under_a_mode_pushed_later(fake_pg: None) -> None:
    """A dispatch mode of the job's entered after commspan's (a FLOP counter around the
    step loop) keeps commspan's on the stack through sampled-out steps: their
    collectives are not numbered either, so the traced steps number their collectives
    as a rank without that mode does (the reference: the same loop without it)."""
    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from commspan import semconv

    def seqs(inner: bool) -> list[Any]:
        mode, exporter = traced_mode(sample={0, 2})
        with mode:
            counter = FlopCounterMode(display=False)
            if inner:
                counter.__enter__()
            try:
                for i in range(3):
                    with mode.step(i):
                        dist.all_reduce(torch.ones(4))
            finally:
                if inner:
                    counter.__exit__(None, None, None)
        return [(e.attributes or {})[semconv.COLL_SEQ]
                for s in exporter.get_finished_spans() for e in s.events
                if e.name == "all_reduce"]

    alone = seqs(False)
    assert len(alone) == 2
    assert seqs(True) == alone


def test_a_c10d_op_is_called_as_its_overload_would_call_it(fake_pg: None) -> None:
    """A c10d op's overload (``TorchBindOpOverload``) dispatches in Python when an
    argument is a ``FakeScriptObject``, else runs its C++ op: commspan calls the C++
    op directly (without the overload's search of every argument) exactly when
    torch's own check would, for the process group and reduce op, real or fake,
    alone or in a list."""
    import torch.distributed as dist
    from torch._library.fake_class_registry import FakeScriptObject
    from torch._ops import _must_dispatch_in_python

    from commspan.capture.collectives import build_overload_table
    from commspan.capture.dispatch import _torchbind_call

    op = torch.ops.c10d.allreduce_.default
    info = build_overload_table()[op]
    group = dist.distributed_c10d._get_default_group()
    reduce_op = dist.ReduceOp.SUM
    fake = FakeScriptObject(object(), "c10d.ProcessGroup", None)
    tensors = [torch.ones(2)]
    cases = [
        (tensors, group, reduce_op, None, False, -1),
        (tensors, fake, reduce_op, None, False, -1),
        (tensors, group, fake, None, False, -1),
        (tensors, [group, fake], reduce_op, None, False, -1),
        (tensors, group),
    ]
    for args in cases:
        call = _torchbind_call(op, info, args, {})
        assert (call is op) == _must_dispatch_in_python(args, {}), args
        assert call is op or call is op._op
    # keyword arguments: the overload's own call
    assert _torchbind_call(op, info, (tensors,), {"process_group": group}) is op
