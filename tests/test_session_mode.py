"""session/mode.py: entering and leaving a mode many times, sampled-out steps, step misuse."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_globals
from _tracing import (
    IN_DIM,
    attrs,
    hook_sizes,
    named,
    tp_mlp,
    traced_mode,
    traces_by_step,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from commspan import CommSpanMode, semconv
from commspan.testing import collective_events
from commspan.testing import span_fqn as fqn
from commspan.testing import span_phase as phase


def test_enter_exit_many_times_leaves_no_hooks(mesh: DeviceMesh) -> None:
    """Entering and leaving modes 50 times leaves global and per-module hooks unchanged."""
    model = tp_mlp(mesh)
    x = torch.randn(4, IN_DIM, requires_grad=True)
    before = hook_sizes(model)
    reused, _ = traced_mode()
    seen: list[Any] = []
    for i in range(50):
        mode = reused if i % 2 else traced_mode()[0]
        with mode, mode.step(i):
            model(x).sum().backward()
        assert hook_sizes(model) == before, i
        assert not x._backward_hooks, i
        assert mode.aggregator is not None
        seen.append(mode.aggregator.module_counts())
    assert all(c == seen[0] for c in seen)
    assert seen[0]["Global"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def test_reentered_mode_keeps_sequence_numbers_and_redescribes_new_parameters(
    mesh: DeviceMesh,
) -> None:
    """A mode entered again continues each group's sequence numbers, and a module
    whose parameters were replaced between (or within) blocks is described anew."""
    model = tp_mlp(mesh)
    x = torch.randn(4, IN_DIM, requires_grad=True)
    mode, exporter = traced_mode()
    for i in range(3):
        with mode, mode.step(i):
            model(x).sum().backward()
    spans = list(exporter.get_finished_spans())
    seqs = [
        (e.attributes or {})[semconv.COLL_SEQ]
        for s in sorted(spans, key=lambda s: s.start_time or 0)
        for e in collective_events(s)
    ]
    assert len(seqs) == 6 and seqs == sorted(seqs) and len(set(seqs)) == 6, seqs

    plain = nn.Linear(4, 4)
    with mode, mode.step(3):
        plain(torch.randn(2, 4))
        plain.weight = nn.Parameter(torch.randn(3, 4))
        plain.bias = nn.Parameter(torch.randn(3))
        plain(torch.randn(2, 4))
    with mode, mode.step(4):
        plain(torch.randn(2, 4))
    forwards = sorted(named(list(exporter.get_finished_spans()), "Linear", "forward"),
                      key=lambda s: s.start_time or 0)
    shapes = [tuple(attrs(s)[semconv.PARAM_SHAPES]) for s in forwards]
    assert shapes == [("4x4", "4"), ("3x4", "3"), ("3x4", "3")]


def test_sampled_out_step_runs_without_global_hooks() -> None:
    """During a sampled-out step no global module hook and no commspan dispatch mode
    is installed; both are back for the next traced step."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode, exporter = traced_mode(sample=2)
    model = nn.Linear(4, 4)
    before = (len(module_globals._global_forward_pre_hooks),
              len(module_globals._global_forward_hooks))
    seen = []
    with mode:
        for i in range(3):
            with mode.step(i):
                seen.append((
                    len(module_globals._global_forward_pre_hooks),
                    len(module_globals._global_forward_hooks),
                    len(_get_current_dispatch_mode_stack()),
                ))
                model(torch.randn(2, 4)).sum().backward()
    traced = (before[0] + 1, before[1] + 1, 1)
    assert seen == [traced, (*before, 0), traced]
    assert sorted(traces_by_step(list(exporter.get_finished_spans()))) == [0, 2]


def test_entering_an_active_mode_raises() -> None:
    """Entering a mode that is already active raises a clear RuntimeError and leaves it working."""
    model = nn.Linear(4, 4)
    before = hook_sizes(model)
    mode, exporter = traced_mode()
    with mode:
        with pytest.raises(RuntimeError, match="already active"):
            mode.__enter__()
        assert mode.active
        model(torch.randn(2, 4))
    assert not mode.active
    assert hook_sizes(model) == before
    assert [fqn(s) for s in exporter.get_finished_spans() if phase(s) == "forward"] == ["Linear"]


@pytest.mark.parametrize("bad", ["x", 1.0, True, None, torch.tensor(1.5)])
def test_step_with_non_int_index(bad: Any) -> None:
    """mode.step('x') (or a float, a bool, None) raises TypeError naming the index."""
    mode = CommSpanMode()
    with mode, pytest.raises(TypeError, match=rf"index={re.escape(repr(bad))} is not valid"), \
            mode.step(bad):
        pass


def test_step_with_a_numpy_or_torch_integer() -> None:
    """Step numbers from numpy.arange or a tensor's .item() kin (numpy.int64, a 0-d
    integer tensor) are ints: the trace's step attribute is the plain int."""
    import numpy as np

    mode, exporter = traced_mode()
    with mode:
        for index in (np.int64(3), np.uint8(4), torch.tensor(5)):
            with mode.step(index) as traced:
                assert traced
    steps = {s.attributes[semconv.STEP] for s in exporter.get_finished_spans()}
    assert steps == {3, 4, 5} and all(type(v) is int for v in steps)


def test_step_beyond_a_64_bit_int() -> None:
    """A step number OTLP cannot carry (its attribute is a 64-bit int) is refused,
    naming the index and the range; the ends of the range are accepted."""
    mode = CommSpanMode()
    with mode, pytest.raises(ValueError, match=r"index=9223372036854775808 .*2\*\*63 - 1"), \
            mode.step(2**63):
        pass
    with mode:
        for step in (-(2**63), 2**63 - 1):
            with mode.step(step):
                pass


def test_step_outside_mode() -> None:
    """mode.step() outside ``with mode:`` raises RuntimeError saying so."""
    mode = CommSpanMode()
    with pytest.raises(RuntimeError, match="outside"), mode.step(0):
        pass


def test_nested_step() -> None:
    """A step inside another step raises RuntimeError; the outer step still ends cleanly."""
    mode, exporter = traced_mode()
    with mode:
        with mode.step(0), pytest.raises(RuntimeError, match="nest"), mode.step(1):
            pass
        with mode.step(1):
            pass
    assert sorted(traces_by_step(list(exporter.get_finished_spans()))) == [0, 1]


def test_leaving_twice_is_a_clear_error() -> None:
    """A second __exit__ used to fail inside torch's mode stack (IndexError)."""
    from commspan import CommSpanMode

    mode = CommSpanMode()
    mode.__enter__()
    mode.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="not active"):
        mode.__exit__(None, None, None)
    with mode:  # and it can be entered again
        pass
