"""CollectiveTiming and CollectiveLog: completion from any observer, the attributes a
completed collective gets, and which collectives a hang record lists."""

from __future__ import annotations

import pytest

from commspan import semconv
from commspan.spans.timing import CollectiveLog, CollectiveTiming


def _timing(group: str, seq: int, done: bool, op: str = "all_reduce") -> CollectiveTiming:
    t = CollectiveTiming({semconv.COLL_OP: op, semconv.PG_NAME: group, semconv.COLL_SEQ: seq,
                          semconv.TENSOR_BYTES: 4000, semconv.PG_SIZE: 4}, "forward")
    t.issued = seq * 1000
    if done:
        t.complete(t.issued + 500)
    return t


def test_first_completion_wins_and_resolvers_are_asked() -> None:
    """complete() keeps the first duration; a resolver completes it once it answers."""
    t = _timing("0", 1, done=False)
    t.complete(1500)
    t.complete(9999)
    assert t.duration == 500
    answers = iter([None, 700])
    late = _timing("0", 2, done=False)
    late.resolve = lambda: next(answers)
    assert not late.finished() and late.finished() and late.duration == 700


def test_completed_event_gets_duration_and_nccl_tests_bandwidths() -> None:
    """duration_ns, algbw = bytes / ns, busbw = algbw x 2(n-1)/n for all_reduce; hang
    attributes add the state and leave the event's own attributes alone."""
    t = _timing("0", 1, done=True)
    attrs = t.event_attributes()
    assert attrs[semconv.COLL_DURATION_NS] == 500
    assert attrs[semconv.COLL_ALGBW] == pytest.approx(8.0)
    assert attrs[semconv.COLL_BUSBW] == pytest.approx(12.0)
    hang = t.hang_attributes()
    assert hang[semconv.COLL_STATE] == semconv.STATE_COMPLETED
    assert semconv.COLL_STATE not in attrs
    pending = _timing("0", 2, done=False)
    assert pending.hang_attributes()[semconv.COLL_STATE] == semconv.STATE_ISSUED
    assert semconv.COLL_DURATION_NS not in pending.event_attributes()


def test_log_lists_recent_per_group_and_every_pending_one() -> None:
    """Per group the last `keep`, plus every collective still waited for however old
    (its waiter knows it once the log has moved on); abandoned ones are not listed; the
    oldest pending one is found."""
    stuck = _timing("a", 1, done=False)
    log = CollectiveLog(keep=2, size=6, pending=lambda: [stuck, stuck])
    log.add(stuck)
    for seq in range(2, 12):
        log.add(_timing("a" if seq % 2 else "b", seq, done=True))
    given_up = _timing("b", 12, done=False)
    log.add(given_up)
    given_up.abandon()
    listed = [(t.attrs[semconv.PG_NAME], t.attrs[semconv.COLL_SEQ]) for t in log.snapshot()]
    assert listed == [("a", 1), ("a", 9), ("a", 11), ("b", 8), ("b", 10)]
    assert log.oldest_pending() is stuck
    stuck.complete(5000)
    assert log.oldest_pending() is None


@pytest.mark.parametrize("how", ["resolved", "completed", "abandoned"])
def test_a_finished_timing_lets_go_of_what_its_resolver_holds(how: str) -> None:
    """A collective completed by polling its Work (gloo's send and recv) kept the Work,
    and so the op's tensors, alive for as long as the timing record lived (the log of
    recent collectives keeps 64): pipeline activations outlived their step. Once the
    completion is known, or given up on, the resolver goes."""
    import functools
    import gc
    import weakref

    class Work:  # stands for the Work, which holds the sent or received tensor
        pass

    work = Work()
    alive = weakref.ref(work)
    t = CollectiveTiming({semconv.COLL_OP: "send"}, "forward")
    t.issued = 1000
    t.resolve = functools.partial(lambda w: 2000 if how == "resolved" else None, work)
    del work
    if how == "resolved":
        assert t.finished() and t.duration == 2000
    elif how == "completed":
        t.complete(3000)
    else:
        t.abandon()
    gc.collect()
    assert alive() is None and t.resolve is None


def test_a_collective_whose_op_raised_is_listed_failed_and_not_waited_for() -> None:
    """An op that raised (a backend's timeout) is given up on as failed: hang records
    list it with state ``failed`` (a peer may be waiting for it), while one given up
    on for having nothing to wait on is not listed; neither counts as still pending
    for the watchdog."""
    from commspan.capture.completion import CompletionTracker

    tracker = CompletionTracker()
    raised, nothing = _timing("a", 1, done=False), _timing("a", 2, done=False)
    log = CollectiveLog(keep=4, size=8, pending=lambda: [])
    for t in (raised, nothing):
        log.add(t)
    tracker.give_up(raised, failed=True)
    tracker.give_up(nothing)
    assert [t.attrs[semconv.COLL_SEQ] for t in log.snapshot()] == [1]
    assert raised.hang_attributes()[semconv.COLL_STATE] == semconv.STATE_FAILED
    assert log.not_completed() == [] and log.oldest_pending() is None
    assert tracker.failed == 2
