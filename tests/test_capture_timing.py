"""Collective timing in one process (torch's fake process group): durations on events,
late completions, bandwidths, the byte and time roll-ups, and ``time_collectives=False``.

Real gloo ranks (synchronous and asynchronous c10d ops, a straggler) are in
tests/test_timing_gloo.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from commspan import CommSpanMode, semconv
from commspan._bandwidth import bandwidth
from commspan.testing import capture
from commspan.testing.models import MLP, parallelize_mlp
from commspan.testing.spans import SpanTree, assert_well_formed, collective_events, span_fqn

pytestmark = pytest.mark.usefixtures("fake_pg")

SLEEP_S = 0.02
"""How long the tests wait between issuing a collective and waiting on it."""


class IssueOnly(torch.nn.Module):
    """Issues a functional all_reduce and returns its output without waiting."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", dist.group.WORLD)


class WaitLater(torch.nn.Module):
    """``issue`` closes before the wait: the all_reduce completes after its span closed."""

    def __init__(self) -> None:
        super().__init__()
        self.issue = IssueOnly()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.issue(x)
        time.sleep(SLEEP_S)
        return funcol.wait_tensor(y) + 1


class C10dOps(torch.nn.Module):
    """A blocking all_reduce and an async one waited by hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.clone()
        dist.all_reduce(t)
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        work.wait()
        return t


def _by_fqn(spans: list[ReadableSpan], fqn: str) -> ReadableSpan:
    (span,) = [s for s in spans if span_fqn(s) == fqn and s.name != semconv.SPAN_RANK]
    return span


def _rank_span(spans: list[ReadableSpan]) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == semconv.SPAN_RANK]
    return span


def test_completion_after_the_span_closed_is_on_the_span() -> None:
    """An all_reduce waited after its module's span closed still carries its duration
    (the span waited for it), and both spans roll up the time."""
    with capture() as cap:
        WaitLater()(torch.ones(4))
    spans = cap.spans
    issue = _by_fqn(spans, "WaitLater.issue")
    (event,) = collective_events(issue)
    duration = event.attributes[semconv.COLL_DURATION_NS]
    assert duration >= SLEEP_S * 1e9
    key = semconv.comm_time_key("forward")
    assert issue.attributes[key] == duration
    assert _by_fqn(spans, "WaitLater").attributes[key] == duration
    assert _rank_span(spans).attributes[key] == duration
    # the span ended when the module returned, before the wait
    assert issue.end_time < event.timestamp + duration
    assert_well_formed(spans)
    assert cap.mode.stats()["collectives_untimed"] == 0


def test_spans_wait_for_completion_in_order_children_first() -> None:
    """The span whose collective has not completed is emitted after the wait, and
    no parent goes out before its child."""
    order: list[str] = []

    class Wait(torch.nn.Module):
        def forward(self, y: torch.Tensor) -> torch.Tensor:
            order.append("wait")
            return funcol.wait_tensor(y)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.issue = IssueOnly()
            self.wait = Wait()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.wait(self.issue(x))

    class Order(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            order.append(span.name)

    provider = TracerProvider()
    provider.add_span_processor(Order())
    with CommSpanMode(aggregator=False, tracer_provider=provider):
        Net()(torch.ones(4))
    assert order.index("wait") < order.index("Net.issue forward")
    assert order.index("Net.issue forward") < order.index("Net forward")


def test_live_aggregator_counts_spans_waiting_for_completion() -> None:
    """While a closed span waits for its collective, mode.aggregator still counts it."""
    seen: dict[str, Any] = {}

    class Peek(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.issue = IssueOnly()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.issue(x)
            assert mode.aggregator is not None
            seen["counts"] = mode.aggregator.module_counts().get("Peek.issue")
            return funcol.wait_tensor(y)

    mode = CommSpanMode()
    with mode:
        Peek()(torch.ones(4))
    assert seen["counts"] == {"forward": {"all_reduce": 1}}


def test_collective_never_waited_is_emitted_at_the_end_of_its_step() -> None:
    """An output never waited: its span goes out when the step ends, without a duration,
    counted in stats; it is not reported as stuck."""
    with capture() as cap:
        with cap.mode.step(0):
            IssueOnly()(torch.ones(4))
        assert [e.attributes.get(semconv.COLL_DURATION_NS)
                for s in cap.spans for e in collective_events(s)] == [None]
        assert cap.mode.stats()["collectives_untimed"] == 1
        cap.mode.dump()
    (hang,) = [s for s in cap.spans if s.name == semconv.SPAN_HANG]
    assert len(hang.events) == 0  # given up at the end of the step: not "issued"
    assert _by_fqn(cap.spans, "IssueOnly").attributes.get(semconv.comm_time_key("forward")) is None


def test_outstanding_collectives_are_known_without_asking_each_span() -> None:
    """The tracker says nothing is outstanding only when every timed collective has its
    completion: not between issue and wait, again after the wait, and again once a step
    that gave up on an output never waited has ended."""
    settled: list[bool] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tracker = mode._dispatch.completions  # type: ignore[union-attr]
            y = funcol.all_reduce(x, "sum", dist.group.WORLD)
            settled.append(tracker.settled())
            z = funcol.wait_tensor(y)
            settled.append(tracker.settled())
            return z

    mode = CommSpanMode()
    with mode:
        tracker = mode._dispatch.completions  # type: ignore[union-attr]
        with mode.step(0):
            Probe()(torch.ones(4))
            IssueOnly()(torch.ones(4))
            settled.append(tracker.settled())
        settled.append(tracker.settled())
        with mode.step(1):
            Probe()(torch.ones(4))
    assert settled == [False, True, False, True, False, True]
    assert mode.stats()["collectives_untimed"] == 1


def test_failed_blocking_op_raises_and_is_counted_without_a_duration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blocking c10d op whose work fails: the caller sees the error, the event goes
    out without a duration and is counted in stats, and a hang record lists it as
    failed (it never completed: a peer may wait for it), not as issued."""
    c10d = torch._C._distributed_c10d  # type: ignore[attr-defined]

    def fail(self: Any, *args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the work failed")

    class Fails(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

    with capture() as cap:
        with cap.mode.step(0):
            with monkeypatch.context() as patch:
                for work_type in (c10d.Work, c10d.FakeWork):  # the fake group's work
                    patch.setattr(work_type, "wait", fail)
                with pytest.raises(RuntimeError, match="the work failed"):
                    Fails()(torch.ones(4))
            cap.mode.dump()
    (event,) = collective_events(_by_fqn(cap.spans, "Fails"))
    assert semconv.COLL_DURATION_NS not in event.attributes
    # the module span's event says so too (check names it without a hang record)
    assert event.attributes[semconv.COLL_STATE] == semconv.STATE_FAILED
    assert cap.mode.stats()["collectives_untimed"] == 1
    (hang,) = [s for s in cap.spans if s.name == semconv.SPAN_HANG]
    assert [e.attributes[semconv.COLL_STATE] for e in hang.events] == [semconv.STATE_FAILED]


def test_collective_that_raises_is_given_up_on_not_reported_stuck() -> None:
    """An op that raises when called (an unknown reduce op): the caller sees the error,
    the event goes out without a duration, counted in stats, and a hang record lists
    it as failed, not as issued."""

    class Bad(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.wait_tensor(funcol.all_reduce(x, "no-such-op", dist.group.WORLD))

    with capture() as cap:
        with cap.mode.step(0):
            with pytest.raises(RuntimeError, match="no-such-op"):
                Bad()(torch.ones(4))
            cap.mode.dump()
    (hang,) = [s for s in cap.spans if s.name == semconv.SPAN_HANG]
    assert [e.attributes[semconv.COLL_STATE] for e in hang.events] == [semconv.STATE_FAILED]
    assert cap.mode.stats()["collectives_untimed"] == 1
    events = [e for s in cap.spans if s.name != semconv.SPAN_HANG for e in collective_events(s)]
    assert [semconv.COLL_DURATION_NS in e.attributes for e in events] == [False]
    assert [e.attributes.get(semconv.COLL_STATE) for e in events] == [semconv.STATE_FAILED]


def test_c10d_ops_are_timed() -> None:
    """A blocking c10d all_reduce and an async one waited by hand both get a duration."""
    with capture() as cap:
        C10dOps()(torch.ones(4))
    events = collective_events(_by_fqn(cap.spans, "C10dOps"))
    assert [e.name for e in events] == ["all_reduce", "all_reduce"]
    for e in events:
        assert e.attributes[semconv.COLL_DURATION_NS] >= 0


def test_lazy_outputs_waited_inside_a_list_argument_are_timed() -> None:
    """``torch.cat([all_reduce(a), all_reduce(b)])`` waits on both lazy outputs inside
    the op: each gets its duration (they were left untimed: only an op's direct
    arguments were looked at), at least the time slept before the op."""

    class CatTwo(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = funcol.all_reduce(x, "sum", dist.group.WORLD)
            b = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
            time.sleep(SLEEP_S)
            return torch.cat([a, b])

    with capture() as cap:
        CatTwo()(torch.ones(4))
    events = collective_events(_by_fqn(cap.spans, "CatTwo"))
    assert [e.name for e in events] == ["all_reduce", "all_reduce"]
    for e in events:
        assert e.attributes[semconv.COLL_DURATION_NS] >= SLEEP_S * 1e9
    assert cap.mode.stats()["collectives_untimed"] == 0


def test_bandwidths_follow_bytes_group_size_and_duration() -> None:
    """algbw and busbw are the NCCL-tests figures of the event's own bytes, group size
    and duration."""
    with capture() as cap:
        WaitLater()(torch.ones(1024))
    (event,) = collective_events(_by_fqn(cap.spans, "WaitLater.issue"))
    a = event.attributes
    expected = bandwidth("all_reduce", nbytes=a[semconv.TENSOR_BYTES],
                         duration_ns=a[semconv.COLL_DURATION_NS], group_size=a[semconv.PG_SIZE])
    assert expected is not None
    assert (a[semconv.COLL_ALGBW], a[semconv.COLL_BUSBW]) == (expected.algbw, expected.busbw)
    assert a[semconv.COLL_BUSBW] == pytest.approx(a[semconv.COLL_ALGBW] * 2 * 3 / 4)


def test_roll_ups_sum_bytes_and_time_of_the_subtree_per_phase(mesh: Any) -> None:
    """Tensor-parallel MLP, forward and backward: each span's commspan.bytes.<phase> and
    commspan.comm_time_ns.<phase> are the sums over the collectives its subtree counts."""
    torch.manual_seed(0)
    model = parallelize_mlp(MLP(8, 16), mesh)
    with capture() as cap:
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    tree = SpanTree(cap.spans)
    checked = 0
    for span in [*tree.module_spans(), *tree.rank_spans()]:
        inside = [span, *[s for s in cap.spans if span in tree.ancestors(s)]]
        for phase in semconv.Phase:
            events = [e for s in inside for e in collective_events(s)
                      if e.attributes[semconv.PHASE] == phase.value]
            nbytes = sum(e.attributes[semconv.TENSOR_BYTES] for e in events)
            spent = sum(e.attributes[semconv.COLL_DURATION_NS] for e in events)
            assert span.attributes.get(semconv.bytes_key(phase)) == (nbytes or None)
            assert span.attributes.get(semconv.comm_time_key(phase)) == (spent if events else None)
            checked += bool(events)
    assert checked >= 4  # net2 forward, net1 backward, MLP both phases, the rank span


def test_without_timing_events_mark_the_issue_only() -> None:
    """time_collectives=False: no durations, no time roll-ups, spans emitted at close;
    byte roll-ups stay."""
    with capture(time_collectives=False) as cap:
        WaitLater()(torch.ones(4))
        C10dOps()(torch.ones(4))
    events = [e for s in cap.spans for e in collective_events(s)]
    assert len(events) == 3
    assert not any(semconv.COLL_DURATION_NS in e.attributes for e in events)
    rank = _rank_span(cap.spans)
    assert rank.attributes[semconv.bytes_key("forward")] == 3 * 16
    assert semconv.comm_time_key("forward") not in rank.attributes


def test_dispatch_path_of_other_ops_is_unchanged_without_timing() -> None:
    """Without timing, wait_tensor is not in the dispatch table: nothing but collectives is."""
    from commspan.capture.collectives import wait_overloads
    from commspan.capture.dispatch import CollectiveDispatchMode

    def on_collective(info: Any, attrs: Any) -> None:
        return None

    plain = CollectiveDispatchMode(on_collective)
    timed = CollectiveDispatchMode(on_collective, timing=True)
    waits = wait_overloads()
    assert waits and not any(plain.knows(w) for w in waits)
    assert all(timed.knows(w) for w in waits)
    assert set(timed._table) - set(plain._table) == {id(w) for w in waits}


def test_roll_ups_follow_the_owner_for_fsdp2(mesh: Any) -> None:
    """FSDP2 collectives are counted for their unit, not where they were issued: every
    event has a duration, the rank span's roll-ups are the sums over all events, and each
    span has a byte and time roll-up for exactly the phases it counts collectives in."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with capture() as cap:
        with cap.mode.step(0):
            model(torch.randn(4, 8)).sum().backward()
    events = [e for s in cap.spans for e in collective_events(s)]
    assert events and all(e.attributes[semconv.COLL_DURATION_NS] >= 0 for e in events)
    assert any(semconv.OWNER_KIND in e.attributes for e in events)  # owned, not innermost
    rank = _rank_span(cap.spans)
    for phase in semconv.Phase:
        mine = [e for e in events if e.attributes[semconv.PHASE] == phase.value]
        assert rank.attributes.get(semconv.bytes_key(phase)) == (
            sum(e.attributes[semconv.TENSOR_BYTES] for e in mine) or None)
        assert rank.attributes.get(semconv.comm_time_key(phase)) == (
            sum(e.attributes[semconv.COLL_DURATION_NS] for e in mine) if mine else None)
    for span in cap.spans:
        for phase in semconv.Phase:
            counted = span.attributes.get(f"{semconv.COUNT_PREFIX}{phase.value}.total", 0)
            assert (semconv.bytes_key(phase) in span.attributes) == (counted > 0), span.name
            assert (semconv.comm_time_key(phase) in span.attributes) == (counted > 0), span.name
    assert_well_formed(cap.spans)


class _Keep(SpanProcessor):
    """A processor of the user's tracer provider: keeps what it is handed, as handed."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.seen.append((span.name, dict(span.attributes or {}),
                          [dict(e.attributes or {}) for e in span.events]))


def test_timing_attributes_reach_every_reader_written_once() -> None:
    """The durations, bandwidths and comm-time roll-ups are written off the training
    thread, yet a processor of the user's provider, two exporters running at once and
    the capture all see them, with the same values (computed once)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from commspan.spans.timing import add_timing

    keep = _Keep()
    provider = TracerProvider()
    provider.add_span_processor(keep)
    first, second = InMemorySpanExporter(), InMemorySpanExporter()
    with capture(tracer_provider=provider, exporters=[first, second]) as cap:
        C10dOps()(torch.ones(64))
        WaitLater()(torch.ones(4))
    key = semconv.comm_time_key("forward")

    def durations(spans: list[ReadableSpan]) -> list[int]:
        return [e.attributes[semconv.COLL_DURATION_NS] for s in spans
                for e in collective_events(s)]

    captured = durations(cap.spans)
    assert len(captured) == 3 and all(d > 0 for d in captured)
    assert durations(list(first.get_finished_spans())) == captured
    assert durations(list(second.get_finished_spans())) == captured
    user = [ev[semconv.COLL_DURATION_NS] for _n, _a, evs in keep.seen for ev in evs
            if semconv.COLL_OP in ev]
    assert user == captured
    (ops,) = [a for n, a, _e in keep.seen if n.startswith("C10dOps")]
    c10d = durations([_by_fqn(cap.spans, "C10dOps")])
    assert ops[key] == sum(c10d)
    for span in cap.spans:  # idempotent: a second pass changes nothing
        before = dict(span.attributes or {})
        add_timing(span)
        assert dict(span.attributes or {}) == before
    (event,) = collective_events(_by_fqn(cap.spans, "WaitLater.issue"))
    expected = bandwidth(str(event.attributes[semconv.COLL_OP]),
                         nbytes=int(event.attributes[semconv.TENSOR_BYTES]),
                         group_size=int(event.attributes[semconv.PG_SIZE]),
                         duration_ns=int(event.attributes[semconv.COLL_DURATION_NS]))
    assert expected is not None
    assert event.attributes[semconv.COLL_BUSBW] == pytest.approx(expected.busbw)


def test_outstanding_works_without_a_future_are_asked_a_bounded_number_of_times() -> None:
    """Thousands of isends waited at the end of a step: each collective asked every
    outstanding ``Work`` whether it had completed (a step of 4,000 took 8.6 s instead
    of 0.1 s). Now the oldest few are asked, and those at the front that completed are
    forgotten; the others are asked when their span closes."""
    from commspan.capture.completion import _POLL_AHEAD, CompletionTracker
    from commspan.spans.timing import CollectiveTiming

    asked = [0]
    done: set[int] = set()

    def resolver(i: int) -> Any:
        def resolve() -> int | None:
            asked[0] += 1
            return 5 if i in done else None
        return resolve

    tracker = CompletionTracker()
    timings = []
    for i in range(1000):
        t = CollectiveTiming({}, "forward")
        t.resolve = resolver(i)
        timings.append(t)
        tracker.polled.append(t)
        tracker.poll_some()
    # a few per collective, and the compactions (each at twice the last size): linear,
    # not 1000 * 1001 / 2
    assert asked[0] <= 1000 * (_POLL_AHEAD + 3)
    # each is asked in turn, not only the oldest ones
    asked[0] = 0
    done.add(900)
    for _ in range(1000 // _POLL_AHEAD + 1):
        tracker.poll_some()
        if timings[900].duration is not None:
            break
    assert timings[900].duration == 5
    done.update(range(1000))  # all complete (the step waited on them)
    tracker.poll_some()  # the completed ones at the front are forgotten
    assert not tracker.polled and tracker.settled() == (not tracker.cuda)


def test_barriers_are_collectives_without_bytes() -> None:
    """``dist.barrier()`` is a collective of its group: an event with its own number in
    the group's sequence, timed like any c10d op, and no bytes (its tensor is a
    placeholder), so no bandwidth."""
    with capture() as cap:
        with cap.mode.step(0):
            dist.barrier()
            dist.all_reduce(torch.ones(4))
            work = dist.barrier(async_op=True)
            assert work is not None
            work.wait()
    events = [e for s in cap.spans for e in collective_events(s)]
    ops = [(e.attributes or {})[semconv.COLL_OP] for e in events]
    assert ops == ["barrier", "all_reduce", "barrier"]
    assert [(e.attributes or {})[semconv.COLL_SEQ] for e in events] == [1, 2, 3]
    for event in events:
        attrs = event.attributes or {}
        assert int(str(attrs[semconv.COLL_DURATION_NS])) > 0
        if attrs[semconv.COLL_OP] == "barrier":
            assert semconv.TENSOR_BYTES not in attrs and semconv.COLL_BUSBW not in attrs
    assert cap.mode.stats()["collectives_untimed"] == 0


@pytest.mark.parametrize("src", [0, 1], ids=["source", "receiver"])
def test_scatter_describes_each_ranks_share_on_every_rank(src: int) -> None:
    """Only scatter's source has inputs: every rank's event describes its output, the
    rank's share (the reference: the output tensor the test passes), and its size S
    is the shares of the whole group, so source and receivers report the same
    collective alike (this process is rank 0 of the fake group)."""
    out = torch.empty(8)
    with capture() as cap:
        with cap.mode.step(0):
            chunks = [torch.ones(8) for _ in range(4)] if src == 0 else None
            dist.scatter(out, chunks, src=src)
    (event,) = [e for s in cap.spans for e in collective_events(s)]
    attrs = event.attributes or {}
    assert attrs[semconv.COLL_OP] == "scatter"
    assert list(attrs[semconv.TENSOR_SHAPE]) == list(out.shape)  # type: ignore[arg-type]
    assert attrs[semconv.TENSOR_BYTES] == out.numel() * out.element_size()
    whole = 4 * out.numel() * out.element_size()  # S: the four ranks' shares
    duration = int(str(attrs[semconv.COLL_DURATION_NS]))
    assert attrs[semconv.COLL_ALGBW] == pytest.approx(whole / duration)  # bytes/ns = GB/s


def test_point_to_point_tags_and_receives_from_any_source() -> None:
    """A send's tag is on its event; a receive from any source has no peer when it is
    issued, so it gets no number either (a number counted under "no peer" matches no
    send); a receive from a given rank is numbered from that rank."""
    with capture() as cap:
        with cap.mode.step(0):
            dist.send(torch.ones(2), dst=1, tag=3)
            dist.send(torch.ones(2), dst=1)
            work = dist.irecv(torch.ones(2))  # any source
            assert work is not None
            dist.recv(torch.ones(2), src=2)
    rows = [(a.get(semconv.COLL_OP), a.get(semconv.COLL_PEER), a.get(semconv.P2P_SEQ),
             a.get(semconv.P2P_TAG))
            for s in cap.spans for e in collective_events(s) for a in [e.attributes or {}]]
    assert rows == [("send", 1, 1, 3), ("send", 1, 2, None), ("recv", None, None, None),
                    ("recv", 2, 1, None)]


def test_dtensors_shard_dim_alltoall_completes_when_it_returns() -> None:
    """DTensor's ``shard_dim_alltoall`` (Shard(i) to Shard(j) off the CPU; called here
    directly) waits inside and returns its output: it is timed to its return, with
    bandwidths, not left untimed."""
    import torch.distributed.tensor  # noqa: F401  (registers the op)

    group = dist.group.WORLD
    assert group is not None
    with capture() as cap:
        with cap.mode.step(0):
            torch.ops._dtensor.shard_dim_alltoall(torch.ones(2, 8), 0, 1, group.group_name)
    (event,) = [e for s in cap.spans for e in collective_events(s)]
    attrs = event.attributes or {}
    assert attrs[semconv.COLL_OP] == "shard_dim_alltoall"
    assert int(str(attrs[semconv.COLL_DURATION_NS])) > 0 and semconv.COLL_BUSBW in attrs
    assert cap.mode.stats()["collectives_untimed"] == 0
