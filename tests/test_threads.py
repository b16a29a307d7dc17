"""Threads: a mode traces the thread that entered it and the autograd work for that
thread's graphs; other threads are ignored and never get an exception from the mode.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _tracing import traced_mode
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn
from torch.utils.checkpoint import checkpoint

from commspan import CommSpanMode, semconv
from commspan.testing import assert_well_formed

STEPS = 30


class Alpha(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


class Beta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x)


def train_step(model: nn.Module) -> None:
    """Forward and backward."""
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()


def run_threads(*targets: Callable[[], None]) -> list[BaseException]:
    """Run each target on its own thread at once; return what they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(target: Callable[[], None]) -> None:
        try:
            barrier.wait(timeout=30)
            target()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return errors


def module_names(spans: list[ReadableSpan]) -> set[str]:
    """Module names of the module spans."""
    return {
        str((s.attributes or {})[semconv.MODULE_FQN])
        for s in spans
        if (s.attributes or {}).get(semconv.PHASE) is not None
    }


def test_one_mode_used_from_two_threads(caplog: pytest.LogCaptureFixture) -> None:
    """The entering thread's steps are traced; another thread's ``mode.step()`` yields
    False without raising (logged once) and its modules are not recorded."""
    mode, exporter = traced_mode()
    alpha, beta = Alpha(), Beta()
    yielded: list[bool] = []
    start = threading.Barrier(2)

    def other() -> None:
        start.wait(timeout=30)
        for i in range(STEPS):
            with mode.step(1000 + i) as traced:
                yielded.append(traced)
                train_step(beta)

    with caplog.at_level(logging.WARNING, logger="commspan"), mode:
        errors: list[BaseException] = []
        worker = threading.Thread(target=lambda: errors.extend(run_threads(other)))
        worker.start()
        start.wait(timeout=30)
        for i in range(STEPS):  # the owner's steps, concurrently with the other thread's
            with mode.step(i) as traced:
                assert traced
                train_step(alpha)
        worker.join(timeout=120)
    assert errors == []
    assert yielded == [False] * STEPS
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    assert module_names(spans) == {"Alpha", "Alpha.a"}
    assert mode.stats()["steps_traced"] == STEPS
    assert mode.stats()["internal_errors"] == 0
    assert len({s.context.trace_id for s in spans}) == STEPS
    warnings = [r for r in caplog.records if "thread" in r.getMessage()]
    assert len(warnings) == 1


def test_one_mode_per_thread_records_only_its_thread() -> None:
    """Two threads, a mode each, running at once: each records only its own modules."""
    results: dict[str, tuple[CommSpanMode, InMemorySpanExporter]] = {}

    def run(name: str, model: nn.Module) -> Callable[[], None]:
        def target() -> None:
            mode, exporter = traced_mode()
            results[name] = (mode, exporter)
            with mode:
                for i in range(STEPS):
                    with mode.step(i):
                        train_step(model)

        return target

    assert run_threads(run("alpha", Alpha()), run("beta", Beta())) == []
    for name, expected in (("alpha", {"Alpha", "Alpha.a"}), ("beta", {"Beta", "Beta.b"})):
        mode, exporter = results[name]
        spans = list(exporter.get_finished_spans())
        assert_well_formed(spans)
        assert module_names(spans) == expected, name
        assert mode.aggregator is not None
        assert set(mode.aggregator.modules()) == expected, name
        phases = [(s.attributes or {}).get(semconv.PHASE) for s in spans]
        assert phases.count("forward") == phases.count("backward") == 2 * STEPS
        assert mode.stats()["internal_errors"] == 0


def test_nested_step_on_the_entering_thread_still_raises() -> None:
    """A step inside a step on the thread that entered the mode is the user's mistake."""
    mode = CommSpanMode()
    with mode, mode.step(0), pytest.raises(RuntimeError, match="do not nest"), mode.step(1):
        pass


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Alpha()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(self.inner, x, use_reentrant=False)
        return self.head(y)


def test_backward_of_the_owners_graph_on_another_thread_is_recorded() -> None:
    """Backward (and recompute) of a graph the entering thread built is recorded even when
    autograd runs it on another thread, as it does on GPU device threads."""
    model = _Checkpointed()
    mode, exporter = traced_mode()
    with mode, mode.step(0):
        loss = model(torch.randn(2, 4, requires_grad=True)).sum()
        assert run_threads(loss.backward) == []
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    by_phase: dict[str, set[str]] = {}
    for s in spans:
        attrs: dict[str, Any] = dict(s.attributes or {})
        if attrs.get(semconv.PHASE):
            by_phase.setdefault(attrs[semconv.PHASE], set()).add(attrs[semconv.MODULE_FQN])
    names = {"_Checkpointed", "_Checkpointed.inner", "_Checkpointed.inner.a", "_Checkpointed.head"}
    assert by_phase["forward"] == names
    assert by_phase["backward"] == names
    assert by_phase["recompute"] == {"_Checkpointed.inner", "_Checkpointed.inner.a"}
    assert mode.stats()["internal_errors"] == 0


def test_other_thread_modules_ignored_while_owner_idle() -> None:
    """Module calls on a thread that did not enter the mode leave no span, even outside steps."""
    mode, exporter = traced_mode()
    with mode:
        assert run_threads(lambda: train_step(Beta())) == []
        train_step(Alpha())
    assert module_names(list(exporter.get_finished_spans())) == {"Alpha", "Alpha.a"}
