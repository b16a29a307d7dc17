"""Pauses of Python's garbage collector recorded as ``commspan.gc`` events.

The reference is a ``gc.callbacks`` recorder of the test's own, installed beside
the mode's: the mode must record the same full collections, with durations that
agree, on the rank span of the step they ran in, with the module the forward was
in. No collection is recorded where nothing is traced (sampled-out steps), with
``record_gc=False``, or after the mode is left; ``gc.callbacks`` is left as found.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commspan import CommSpanMode, semconv
from commspan.capture.gcwatch import MIN_NS, GcWatch


class Collect(torch.nn.Module):
    """Runs a full collection in its forward when ``on``."""

    on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on:
            gc.collect()
        return x * 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.collect = Collect()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.collect(self.lin(x))


class Reference:
    """The test's own record of full collections: (start wall ns, duration ns)."""

    def __init__(self) -> None:
        self.full: list[tuple[int, int]] = []
        self.all = 0  # collections of any generation
        self._t = (0, 0)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = (time.time_ns(), time.perf_counter_ns())
            return
        self.all += 1
        if info["generation"] == 2:
            self.full.append((self._t[0], time.perf_counter_ns() - self._t[1]))


def _gc_events(exporter: InMemorySpanExporter) -> list[tuple[Any, Any]]:
    return [
        (span, event)
        for span in exporter.get_finished_spans()
        for event in span.events
        if event.name == semconv.EVENT_GC
    ]


def _run(mode: CommSpanMode, net: Net, steps: int) -> Reference:
    ref = Reference()
    with mode:
        gc.callbacks.append(ref)
        try:
            for i in range(steps):
                with mode.step(i):
                    net(torch.ones(2, 4)).sum().backward()
        finally:
            gc.callbacks.remove(ref)
    mode.shutdown()
    return ref


def test_full_collections_are_events_of_the_step_they_ran_in() -> None:
    callbacks = list(gc.callbacks)
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    ref = _run(mode, Net(), steps=2)
    assert gc.callbacks == callbacks
    events = _gc_events(exporter)
    full = [(s, e) for s, e in events if e.attributes[semconv.GC_GENERATION] == 2]
    assert len(ref.full) >= 2 and len(full) == len(ref.full)
    steps_seen = set()
    for (span, event), (start, took) in zip(full, ref.full):
        assert span.name == semconv.SPAN_RANK
        steps_seen.add(span.attributes[semconv.STEP])
        assert span.start_time <= event.timestamp <= span.end_time
        assert abs(event.timestamp - start) < 5_000_000  # the same start, two clocks read
        duration = event.attributes[semconv.GC_DURATION_NS]
        assert abs(duration - took) <= max(2_000_000, took // 10), (duration, took)
        assert event.attributes[semconv.MODULE_FQN] == "Net.collect"
        assert event.attributes[semconv.PHASE] == "forward"
        assert event.attributes[semconv.GC_COLLECTED] >= 0
    assert steps_seen == {0, 1}
    for _span, event in events:  # younger generations only when they took long
        attrs = event.attributes
        assert attrs[semconv.GC_GENERATION] == 2 or attrs[semconv.GC_DURATION_NS] >= MIN_NS
    stats = mode.stats()
    assert stats["gc_pauses"] == len(events) and stats["gc_pauses_unrecorded"] == 0


def test_nothing_is_recorded_untraced_or_when_switched_off() -> None:
    callbacks = list(gc.callbacks)
    off = InMemorySpanExporter()
    ref = _run(CommSpanMode(exporters=[off], record_gc=False), Net(), steps=1)
    assert ref.full and _gc_events(off) == []
    sampled = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[sampled], sample={0})  # step 1 is sampled out
    ref = _run(mode, Net(), steps=2)
    events = _gc_events(sampled)
    assert len(ref.full) >= 2
    assert events and {s.attributes[semconv.STEP] for s, _ in events} == {0}
    assert mode.stats()["gc_pauses_unrecorded"] == 0
    after = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[after])
    with mode:
        pass
    gc.collect()  # the mode is left: not recorded, not counted
    mode.shutdown()
    assert _gc_events(after) == [] and mode.stats()["gc_pauses"] == 0
    assert gc.callbacks == callbacks


def test_outside_any_module_the_event_names_no_module() -> None:
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    with mode:
        with mode.step(0):
            gc.collect()
    mode.shutdown()
    (span, event), *_ = _gc_events(exporter)
    assert span.name == semconv.SPAN_RANK
    assert semconv.MODULE_FQN not in event.attributes and semconv.PHASE not in event.attributes


def test_a_failing_where_is_counted_never_raised() -> None:
    def where() -> Any:
        raise RuntimeError("boom")

    watch = GcWatch(where)
    watch.install()
    try:
        gc.collect()
    finally:
        watch.remove()
    assert watch.errors >= 1 and watch.take() == []
    watch.remove()  # idempotent
    assert watch._on_gc not in gc.callbacks


def test_a_ctrl_c_while_a_collection_is_noted_reaches_the_program() -> None:
    """A KeyboardInterrupt raised while the watch notes a collection (a Ctrl-C handled
    then) would be swallowed by the collector, which ignores its callbacks' errors: it
    reaches the program once the collection is over."""
    calls = [0]

    def where() -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return None

    watch = GcWatch(where)
    watch.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            for _ in range(1000):  # the interrupt is raised at the next check
                time.sleep(0.001)
    finally:
        watch.remove()
    assert calls[0] >= 1


def test_record_gc_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"record_gc='yes' is not valid; pass True"):
        CommSpanMode(record_gc="yes")  # type: ignore[arg-type]


def test_a_long_trace_holds_a_bounded_number_of_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_PENDING pauses in one trace, the others are counted, not held."""
    from commspan.capture import gcwatch

    monkeypatch.setattr(gcwatch, "MAX_PENDING", 3)
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    ref = Reference()
    with mode:
        gc.callbacks.append(ref)
        try:
            with mode.step(0):
                for _ in range(5):
                    gc.collect()
        finally:
            gc.callbacks.remove(ref)
    mode.shutdown()
    assert len(ref.full) >= 5
    stats = mode.stats()
    assert len(_gc_events(exporter)) == stats["gc_pauses"] == 3
    # every full collection past the third, and any younger one of 1 ms or more
    assert len(ref.full) - 3 <= stats["gc_pauses_unrecorded"] <= ref.all - 3


def test_a_collection_while_the_step_ends_is_an_event_of_that_step() -> None:
    """A full collection that runs while the step's spans are being closed (where
    commspan allocates most) is written on that step's rank span, whose end moves
    past it; nothing is counted as unrecorded."""
    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    net = Net()
    Collect.on = False
    try:
        with mode:
            rec = mode._recorder
            assert rec is not None
            end = rec.end

            def end_with_collection(error: BaseException | None = None) -> None:
                gc.collect()  # stands in for one the span building triggers
                end(error)

            rec.end = end_with_collection  # type: ignore[method-assign]
            for i in range(2):
                with mode.step(i):
                    net(torch.ones(2, 4)).sum().backward()
    finally:
        Collect.on = True
    mode.shutdown()
    full = [(s, e) for s, e in _gc_events(exporter)
            if e.attributes[semconv.GC_GENERATION] == 2]
    assert {s.attributes.get(semconv.STEP) for s, _ in full} >= {0, 1}
    for span, event in full:
        assert span.start_time <= event.timestamp
        assert event.timestamp + event.attributes[semconv.GC_DURATION_NS] <= span.end_time
    assert mode.stats()["gc_pauses_unrecorded"] == 0


def test_a_collection_dated_after_now_does_not_end_the_rank_span_after_the_step() -> None:
    """The wall clock stepped back while a collection ran (a VM's clock set by NTP):
    its start plus its duration lies after the moment the step ends. The rank span
    used to end there, after the step's root (``assert_well_formed`` failed on a busy
    machine); its end moves past collections up to the present only."""
    from commspan.capture.gcwatch import GcPause
    from commspan.testing import assert_well_formed

    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter])
    Collect.on = False
    try:
        with mode:
            with mode.step(0):
                Net()(torch.ones(2, 4)).sum().backward()
                rec, watch = mode._recorder, mode._gc
                assert rec is not None and watch is not None
                ahead = time.time_ns() + 50_000_000  # 50 ms "after" now
                watch._pending.append(GcPause(rec.trace_id, ahead, 1_000, 2, 0, None, None))
    finally:
        Collect.on = True
    mode.shutdown()
    spans = list(exporter.get_finished_spans())
    assert_well_formed(spans)
    (rank,) = [s for s in spans if s.name == semconv.SPAN_RANK]
    (root,) = [s for s in spans if s.name == semconv.SPAN_STEP]
    assert rank.end_time <= root.end_time
    assert [e.name for e in rank.events].count(semconv.EVENT_GC) == 1
