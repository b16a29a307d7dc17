"""CollectiveTiming and CollectiveLog: completion from any observer, the attributes a
completed collective gets, and which collectives a hang record lists."""

from __future__ import annotations

from typing import Any

import pytest
import torch

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


def test_an_async_op_whose_future_completed_with_an_error_failed() -> None:
    """A ``Work``'s future that completes with the op's error (gloo's timeout of an
    ``async_op=True`` all_reduce): no duration, the event says ``failed``; one that
    completes with a value gets its duration."""
    from commspan.capture.completion import CompletionTracker

    tracker = CompletionTracker()
    bad, good = _timing("a", 1, done=False), _timing("a", 2, done=False)
    for t in (bad, good):
        tracker.futures[id(t)] = t
    failed: torch.futures.Future[Any] = torch.futures.Future()
    failed.set_exception(RuntimeError("Timed out waiting for the peer"))
    ok: torch.futures.Future[Any] = torch.futures.Future()
    ok.set_result([torch.ones(1)])
    tracker._future_done(bad, failed)
    tracker._future_done(good, ok)
    assert bad.duration is None and bad.failed and tracker.failed == 1
    assert bad.event_attributes()[semconv.COLL_STATE] == semconv.STATE_FAILED
    assert good.duration is not None and semconv.COLL_STATE not in good.event_attributes()
    assert tracker.settled()


class _Work:
    """A ``Work`` without a future (gloo's send and recv), completed, and failed or not."""

    def __init__(self, success: bool) -> None:
        self.success = success
        self.asked = 0

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        self.asked += 1
        return self.success


def test_a_polled_op_that_failed_is_told_apart_while_its_error_is_handled() -> None:
    """A ``Work`` without a future says it completed when it failed too. Whether it
    succeeded is asked (torch prints a deprecation warning once when asked) only while
    an exception is being handled: the span of the module whose ``wait()`` raised
    closing. A failed one then has no duration and says ``failed``."""
    from functools import partial

    from commspan.capture.completion import CompletionTracker, _poll_work

    tracker = CompletionTracker()
    quiet, failed, fine = (_timing("a", i, done=False) for i in (1, 2, 3))
    works = {id(quiet): _Work(False), id(failed): _Work(False), id(fine): _Work(True)}
    for t in (quiet, failed, fine):
        t.resolve = partial(_poll_work, works[id(t)], t, None, tracker)
        tracker.polled.append(t)
    assert quiet.finished() and works[id(quiet)].asked == 0  # no error in flight: not asked
    try:
        raise RuntimeError("the caller's wait() raised")
    except RuntimeError:
        assert not failed.finished() and fine.finished()
    assert failed.failed and failed.duration is None and tracker.failed == 1
    assert failed.event_attributes()[semconv.COLL_STATE] == semconv.STATE_FAILED
    assert fine.duration is not None and not fine.failed
    tracker.poll()
    assert not tracker.polled


def test_a_cuda_op_whose_future_failed_is_failed_without_touching_the_device() -> None:
    """On CUDA a ``Work``'s future completing puts the end event on the stream; one
    that completed with an error (an NCCL timeout or abort) is failed instead, and
    needs no device (this runs without a GPU)."""
    from commspan.capture.completion import CompletionTracker, _cuda_done

    tracker = CompletionTracker()
    timing = _timing("a", 1, done=False)
    failed: torch.futures.Future[Any] = torch.futures.Future()
    failed.set_exception(RuntimeError("NCCL watchdog timeout"))
    _cuda_done(timing, None, tracker, failed)
    assert timing.failed and timing.duration is None and timing.resolve is None
    assert tracker.failed == 1
