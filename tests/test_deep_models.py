"""Deep models: tracing never lowers the nesting depth a model can run at, a model's
own RecursionError reaches the user unchanged, and the table and JSON of a tree
hundreds of modules deep are printed (no recursion per module depth anywhere).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from torch import nn

from commspan import Aggregator, CommSpanMode, semconv
from commspan.cli import main
from commspan.exporters import JsonlSpanExporter


def nested(depth: int) -> nn.Module:
    """A Linear inside ``depth - 1`` nested ``nn.Sequential``s: ``depth`` modules deep."""
    model: nn.Module = nn.Linear(2, 2)
    for _ in range(depth - 1):
        model = nn.Sequential(model)
    return model


def train_step(model: nn.Module) -> None:
    """Forward and backward, as a training step does."""
    model(torch.randn(1, 2, requires_grad=True)).sum().backward()


def runs(model: nn.Module, mode: CommSpanMode | None) -> bool:
    """Whether a step of ``model`` runs without RecursionError (traced if ``mode``)."""
    try:
        if mode is None:
            train_step(model)
        else:
            with mode:
                train_step(model)
    except RecursionError:
        return False
    return True


def untraced_max_depth() -> int:
    """The deepest nesting that runs untraced at the current recursion limit (bisection)."""
    lo, hi = 2, 4 * sys.getrecursionlimit()
    assert runs(nested(lo), None) and not runs(nested(hi), None)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if runs(nested(mid), None):
            lo = mid
        else:
            hi = mid
    return lo


def depth_of(span: ReadableSpan) -> int:
    """The span's ``commspan.module.depth``."""
    return int(str((span.attributes or {})[semconv.MODULE_DEPTH]))


def capture() -> tuple[CommSpanMode, InMemorySpanExporter]:
    """A mode whose spans also land, synchronously, in an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return CommSpanMode(tracer_provider=provider), exporter


@contextlib.contextmanager
def recursion_limit(limit: int) -> Iterator[None]:
    """Run the block at recursion limit ``limit``, then restore the previous one."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def test_traced_model_runs_as_deep_as_untraced() -> None:
    """A model at the deepest nesting that runs untraced also runs traced, fully recorded."""
    limit = sys.getrecursionlimit()
    depth = untraced_max_depth()
    mode, exporter = capture()
    assert runs(nested(depth), mode)  # before the fix: RecursionError from depth ~0.8x
    stats = mode.stats()
    assert stats["internal_errors"] == 0
    spans = exporter.get_finished_spans()
    forward = [s for s in spans if (s.attributes or {}).get(semconv.PHASE) == "forward"]
    backward = [s for s in spans if (s.attributes or {}).get(semconv.PHASE) == "backward"]
    assert len(forward) == depth and len(backward) == depth
    assert max(depth_of(s) for s in forward) == depth
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)
    assert sys.getrecursionlimit() == limit  # leaving the mode restored it


def test_recursion_limit_the_user_sets_is_kept() -> None:
    """A limit the user sets while the mode is active is theirs: it is the base, and stays."""
    limit = sys.getrecursionlimit()
    try:
        with CommSpanMode():
            train_step(nested(3))
            sys.setrecursionlimit(limit + 500)
            train_step(nested(3))
            assert sys.getrecursionlimit() >= limit + 500
        assert sys.getrecursionlimit() >= limit + 500
    finally:
        sys.setrecursionlimit(limit)


class _RaisesRecursionError(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RecursionError("raised by the model")


def test_model_raising_recursion_error_gets_it_back_unchanged() -> None:
    """A RecursionError the model raises is the user's: same object, ERROR spans, an event."""
    model = nn.Sequential(nn.Linear(2, 2), _RaisesRecursionError())
    mode, exporter = capture()
    with pytest.raises(RecursionError) as info, mode, mode.step(0):
        train_step(model)
    assert str(info.value) == "raised by the model"
    assert mode.stats()["internal_errors"] == 0
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["Sequential.1 forward"].status.status_code is StatusCode.ERROR
    assert spans["Sequential forward"].status.status_code is StatusCode.ERROR
    assert spans["Sequential.0 forward"].status.status_code is StatusCode.UNSET
    events = [(n, e) for n, s in spans.items() for e in s.events if e.name == "exception"]
    assert [n for n, _ in events] == ["Sequential.1 forward"]
    assert dict(events[0][1].attributes or {})[semconv.EXCEPTION_TYPE] == "RecursionError"


class _FallsBack(nn.Module):
    """Catches its child's RecursionError and goes on with another child, which
    all-reduces (a tree model giving up on too deep an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = _RaisesRecursionError()
        self.fallback = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.tree(x)
        except RecursionError:
            out = self.fallback(x)
            torch.distributed.all_reduce(out)
            return out


def test_recursion_error_caught_by_the_parent_closes_the_child(fake_pg: None) -> None:
    """The parent catches its child's RecursionError and calls another child: the failed
    child's span ends there, ERROR with the event, and the fallback and its all_reduce
    are the parent's, not under the failed child."""
    mode, exporter = capture()
    with mode, mode.step(0):
        _FallsBack()(torch.randn(1, 2, requires_grad=True))
    assert mode.stats()["internal_errors"] == 0
    spans = {s.name: s for s in exporter.get_finished_spans()}
    parent, tree = spans["_FallsBack forward"], spans["_FallsBack.tree forward"]
    fallback = spans["_FallsBack.fallback forward"]
    assert tree.status.status_code is StatusCode.ERROR
    assert [e.name for e in tree.events] == [semconv.EVENT_EXCEPTION]
    assert parent.status.status_code is StatusCode.UNSET
    assert fallback.parent is not None and parent.context is not None
    assert fallback.parent.span_id == parent.context.span_id
    assert tree.end_time is not None and fallback.start_time is not None
    assert tree.end_time <= fallback.start_time
    assert [e.name for e in parent.events] == ["all_reduce"]
    assert not any(k.startswith(semconv.COUNT_PREFIX) for k in (tree.attributes or {}))


class _GivesUp(nn.Module):
    """Raises RecursionError, holding a tensor in its frame (the traceback's)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(1024)
        self.held = weakref.ref(scratch)
        raise RecursionError("input too deep")


class _ReducesFirst(nn.Module):
    """Catches its child's RecursionError, then all-reduces before calling any module,
    noting whether the child's frame (its tensor) is still alive by then."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = _GivesUp()
        self.fallback = nn.Linear(2, 2)
        self.alive_after: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.tree(x)
        except RecursionError:
            pass
        gc.collect()
        self.alive_after = self.tree.held() is not None
        torch.distributed.all_reduce(torch.ones(2))
        return self.fallback(x)


def test_after_a_caught_recursion_error_collectives_are_the_catchers(fake_pg: None) -> None:
    """The catching module all-reduces before it calls any module: the all_reduce is on
    its span, not on the failed child's; and the error's traceback (the failed frames
    and their tensors) is not kept alive by commspan once the except block is over."""
    model = _ReducesFirst()
    mode, exporter = capture()
    with mode, mode.step(0):
        model(torch.randn(1, 2))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert [e.name for e in spans["_ReducesFirst forward"].events] == ["all_reduce"]
    tree = spans["_ReducesFirst.tree forward"]
    assert [e.name for e in tree.events] == [semconv.EVENT_EXCEPTION]
    assert tree.status.status_code is StatusCode.ERROR
    assert model.alive_after is False


def test_model_too_deep_to_run_untraced_raises_its_recursion_error() -> None:
    """Too deep even untraced: the user gets Python's RecursionError (not another error
    raised while handling it); every module span open then ends ERROR, the deepest one
    carries the exception event, nothing counts as commspan's error, the limit is restored."""
    limit = sys.getrecursionlimit()
    depth = 2 * untraced_max_depth()
    assert not runs(nested(depth), None)
    mode, exporter = capture()
    with pytest.raises(RecursionError) as info, mode:
        train_step(nested(depth))
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert sys.getrecursionlimit() == limit
    assert mode.stats()["internal_errors"] == 0
    spans = exporter.get_finished_spans()
    modules = [s for s in spans if (s.attributes or {}).get(semconv.PHASE) == "forward"]
    assert modules and all(s.status.status_code is StatusCode.ERROR for s in modules)
    with_event = [s for s in spans for e in s.events if e.name == semconv.EVENT_EXCEPTION]
    deepest = max(modules, key=depth_of)
    assert with_event == [deepest]


def test_cli_table_and_json_of_a_1000_deep_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``commspan table`` and ``--json`` print the tree of a model 1000 modules deep
    (the issue saw both fail from depth 500) at the default recursion limit."""
    depth = 1000
    with recursion_limit(8 * depth):  # the model itself needs it, traced or not
        mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path)])
        with mode:
            train_step(nested(depth))
        mode.shutdown()
        assert mode.stats()["internal_errors"] == 0
        expected = Aggregator.from_jsonl(tmp_path).to_dict()

    assert main(["table", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    module_lines = [line for line in out if "*" not in line]
    assert len(module_lines) == depth + 1  # Global and every module
    assert module_lines[-1] == "  " * depth + "Sequential" + ".0" * (depth - 1)

    assert main(["table", str(tmp_path), "--json"]) == 0
    text = capsys.readouterr().out
    with recursion_limit(8 * depth):  # json.loads and == recurse per level themselves
        assert json.loads(text) == expected
        assert text.rstrip("\n") == json.dumps(expected, indent=2)


def test_html_report_of_a_1000_deep_model(tmp_path: Path) -> None:
    """The HTML report writes the module tree of a model 1000 modules deep at the
    default recursion limit (it used to recurse once per level)."""
    from commspan.render.html import html_report

    depth = 1000
    with recursion_limit(8 * depth):  # the model itself needs it, traced or not
        mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path)])
        with mode:
            with mode.step(0):
                train_step(nested(depth))
        mode.shutdown()
    page = html_report(tmp_path)
    deepest = "Sequential" + ".0" * (depth - 1)
    assert f'data-fqn="{deepest}"' in page
    assert page.count("<details") == page.count("</details>") >= depth - 1
