"""Hang records in one process (torch's fake process group): the watchdog's timeout,
``mode.dump()``, the dump signal, what the record holds, and the settings' errors.

Real gloo ranks blocked in a collective are in tests/test_timing_gloo.py.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commspan import CommSpanMode, semconv
from commspan.analysis import check_run
from commspan.exporters import JsonlSpanExporter, read_spans

pytestmark = pytest.mark.usefixtures("fake_pg")


def _hangs(path: Path) -> list[Any]:
    if not path.exists():
        return []
    return [s for s in read_spans(path) if s.name == semconv.SPAN_HANG]


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


class Issue(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", dist.group.WORLD)


class Stall(torch.nn.Module):
    """Waits until ``until()`` is true (or 10 s), as a rank stuck in compute would."""

    def __init__(self) -> None:
        super().__init__()
        self.until: Any = lambda: True
        self.saw: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.saw = _wait_for(self.until)
        return x


class Net(torch.nn.Module):
    """``issue`` starts an all_reduce, ``stall`` stalls before anyone waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.issue = Issue()
        self.stall = Stall()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.issue(x)
        self.stall(x)
        return funcol.wait_tensor(y)


def test_timeout_writes_a_record_to_disk_while_the_step_is_stuck(tmp_path: Path) -> None:
    """A collective not completed after hang_timeout_s: the watchdog writes one hang record
    to the JSONL file while the training thread is still inside the step; it names the
    open spans and the collective, issued; earlier steps are in the file, whole."""
    path = tmp_path / "rank0.jsonl"
    net = Net()
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)], hang_timeout_s=0.1)
    with mode:
        with mode.step(0):
            net(torch.ones(4))  # completes at once: stall returns immediately
        net.stall.until = lambda: len(_hangs(path)) == 1
        with mode.step(1):
            net(torch.ones(4))
            assert net.stall.saw, "no hang record on disk while the step was stuck"
            time.sleep(0.3)  # the same stuck collective is reported once
            assert len(_hangs(path)) == 1
    mode.shutdown()
    (hang,) = _hangs(path)
    a = hang.attributes
    assert a[semconv.HANG_REASON] == semconv.HANG_REASON_TIMEOUT
    assert a[semconv.HANG_TIMEOUT] == 0.1
    assert a[semconv.STEP] == 1 and a[semconv.RANK] == 0
    assert a[semconv.HANG_STACK_FQNS] == ["Net", "Net.stall"]
    assert a[semconv.HANG_STACK_PHASES] == ["forward", "forward"]
    states = [(ev[semconv.COLL_SEQ], ev[semconv.MODULE_FQN], ev[semconv.COLL_STATE])
              for _, ev in hang.events]
    assert states == [(1, "Net.issue", "completed"), (2, "Net.issue", "issued")]
    assert hang.start_time == hang.event_times[1]  # starts when the stuck one was issued
    assert semconv.MODULE_FQN not in a  # the counts ignore it
    steps = {s.attributes.get(semconv.STEP) for s in read_spans(path)
             if s.name == semconv.SPAN_RANK}
    assert steps == {0, 1}
    (finding, *missing) = check_run(path).findings  # ranks 1-3 of the fake world: no file
    assert [f.kind for f in missing] == ["missing"]
    assert (finding.kind, finding.seq, finding.step) == ("hang", 2, 1)
    assert finding.ranks[0]["fqn"] == "Net.issue" and finding.ranks[0]["state"] == "issued"


def test_a_dump_on_a_healthy_step_keeps_the_durations(tmp_path: Path) -> None:
    """``mode.dump()`` from another thread while a collective waits: the span that
    issued it (closed, waiting for the completion) is not written early, so its event
    keeps its duration, and nothing counts as untimed (it counted 1 and wrote the
    span without a duration)."""
    import threading

    path = tmp_path / "rank0.jsonl"
    net = Net()
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)])
    dumped = threading.Event()
    with mode:
        net.stall.until = dumped.is_set

        def dump_later() -> None:
            time.sleep(0.05)
            mode.dump()
            dumped.set()

        thread = threading.Thread(target=dump_later)
        thread.start()
        with mode.step(0):
            net(torch.ones(4))
        thread.join()
        assert net.stall.saw
    mode.shutdown()
    assert mode.stats()["collectives_untimed"] == 0
    (hang,) = _hangs(path)
    assert hang.attributes[semconv.HANG_REASON] == semconv.HANG_REASON_DUMP
    issued = [s for s in read_spans(path) if s.attributes.get(semconv.MODULE_FQN) == "Net.issue"]
    (event,) = [ev for s in issued for _, ev in s.events]
    assert event[semconv.COLL_DURATION_NS] >= 50_000_000


def test_a_collective_still_stuck_does_not_hide_a_later_one() -> None:
    """The watchdog wrote a record for collective A, which still waits (a gloo send
    whose Work says done only once waited); later B, issued after A, gets stuck too:
    it gets a record of its own (it used to look only at the oldest, A). Neither is
    reported twice."""
    from commspan.session.hang import HangWatch
    from commspan.spans.timing import CollectiveTiming

    now = time.perf_counter_ns()
    a = CollectiveTiming({semconv.COLL_OP: "send"}, "forward")
    a.issued = now - 5_000_000_000
    stuck = [a]
    written: list[str] = []
    watch = HangWatch(written.append, lambda: list(stuck), timeout_s=1.0, signum=None)
    watch._check_timeout()
    watch._check_timeout()
    assert written == ["timeout"]
    b = CollectiveTiming({semconv.COLL_OP: "all_reduce"}, "forward")
    b.issued = time.perf_counter_ns()
    stuck.append(b)
    watch._check_timeout()  # B has not waited long enough yet
    assert written == ["timeout"]
    b.issued -= 2_000_000_000
    watch._check_timeout()
    watch._check_timeout()
    assert written == ["timeout", "timeout"]
    # C, pending when that record was written (it lists C), crosses the timeout later:
    # no record of its own
    c = CollectiveTiming({semconv.COLL_OP: "all_reduce"}, "forward")
    c.issued = time.perf_counter_ns()
    stuck.append(c)
    d = CollectiveTiming({semconv.COLL_OP: "all_reduce"}, "forward")
    d.issued = time.perf_counter_ns() - 3_000_000_000
    stuck.append(d)
    watch._check_timeout()  # D is late: a record, which lists C too
    c.issued -= 2_000_000_000
    watch._check_timeout()
    assert written == ["timeout"] * 3


def test_a_collective_logged_before_it_is_issued_is_not_a_hang(tmp_path: Path) -> None:
    """A thread switch between logging a collective and the op's issue let the
    watchdog see an issue time of 0, a wait as long as the machine's uptime, and write
    a false record. The time is set when the collective is logged."""
    path = tmp_path / "rank0.jsonl"
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)], hang_timeout_s=1.0)
    with mode:
        log = mode._log
        add = log.add

        def add_then_switch(timing: Any) -> None:
            add(timing)
            time.sleep(0.4)  # the watchdog (every 0.25 s) runs here

        log.add = add_then_switch
        with mode.step(0):
            dist.all_reduce(torch.ones(1))
        log.add = add
        assert mode.stats()["hang_records"] == 0
    mode.shutdown()
    assert _hangs(path) == []


def test_dump_writes_what_the_rank_is_doing(tmp_path: Path) -> None:
    """mode.dump() inside a module: reason dump, the stack, every collective completed."""
    path = tmp_path / "rank0.jsonl"
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)])

    class Dump(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
            assert mode.dump() is True
            assert len(_hangs(path)) == 1  # flushed before dump() returned
            return y

    with mode, mode.step(3):
        Dump()(torch.ones(4))
    mode.shutdown()
    (hang,) = _hangs(path)
    assert hang.attributes[semconv.HANG_REASON] == semconv.HANG_REASON_DUMP
    assert semconv.HANG_TIMEOUT not in hang.attributes
    assert hang.attributes[semconv.HANG_STACK_FQNS] == ["Dump"]
    ((_, ev),) = hang.events
    assert ev[semconv.COLL_STATE] == semconv.STATE_COMPLETED
    assert ev[semconv.COLL_DURATION_NS] >= 0
    assert [f.kind for f in check_run(path).findings] == ["missing"]  # ranks 1-3: no file
    assert mode.stats()["hang_records"] == 1


def test_dump_outside_the_mode_is_an_error() -> None:
    """dump() before entering the mode raises RuntimeError saying where to call it."""
    with pytest.raises(RuntimeError, match="inside `with mode:`"):
        CommSpanMode().dump()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1")
def test_signal_writes_a_record_and_handlers_are_restored(tmp_path: Path) -> None:
    """dump_signal=SIGUSR1: the signal makes the watchdog write a record (reason signal);
    leaving the mode puts back the previous handler and wakeup descriptor."""
    path = tmp_path / "rank0.jsonl"
    previous = signal.getsignal(signal.SIGUSR1)
    net = Net()
    net.stall.until = lambda: len(_hangs(path)) == 1
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)], dump_signal=signal.SIGUSR1)
    with mode, mode.step(0):
        assert signal.getsignal(signal.SIGUSR1) is not previous
        os.kill(os.getpid(), signal.SIGUSR1)
        net(torch.ones(4))
        assert net.stall.saw
    mode.shutdown()
    (hang,) = _hangs(path)
    assert hang.attributes[semconv.HANG_REASON] == semconv.HANG_REASON_SIGNAL
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert signal.set_wakeup_fd(-1) == -1  # none left behind


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1")
@pytest.mark.parametrize("first_out", ["a", "b"])
def test_modes_left_in_any_order_restore_the_programs_handler(first_out: str) -> None:
    """Two modes on the same dump signal: while either is in, the signal reaches a
    mode (no user handler call); once both left, the program's own handler is back
    (a mode left first used to leave a dead mode's handler installed)."""
    calls: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        a = CommSpanMode(dump_signal=signal.SIGUSR1)
        b = CommSpanMode(dump_signal=signal.SIGUSR1)
        a.__enter__()
        b.__enter__()
        first, second = (a, b) if first_out == "a" else (b, a)
        first.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGUSR1) is not mine  # the other mode holds it
        second.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGUSR1) is mine
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hang_timeout_s": 0}, ValueError, r"hang_timeout_s=0 is not valid"),
        ({"hang_timeout_s": -1.5}, ValueError, r"hang_timeout_s=-1.5 is not valid"),
        ({"hang_timeout_s": "5"}, ValueError, r"hang_timeout_s='5' is not valid"),
        ({"hang_timeout_s": True}, ValueError, r"hang_timeout_s=True is not valid"),
        ({"hang_timeout_s": 5, "time_collectives": False}, ValueError,
         r"needs time_collectives=True"),
        ({"dump_signal": 12345}, ValueError, r"dump_signal=12345 is not a signal"),
        ({"dump_signal": signal.SIGKILL}, ValueError, r"SIGKILL cannot be caught"),
        ({"time_collectives": "yes"}, TypeError, r"time_collectives='yes' is not valid"),
    ],
)
def test_bad_settings_name_the_argument(kwargs: dict[str, Any], error: type, match: str) -> None:
    """Each bad hang or timing setting is rejected with the argument, the value and the fix."""
    with pytest.raises(error, match=match):
        CommSpanMode(**kwargs)


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGUSR1"),
                    reason="needs fork and SIGUSR1")
def test_a_forked_child_gives_the_dump_signal_back(tmp_path: Path) -> None:
    """A process forked inside a mode with dump_signal= (a DataLoader worker): in the
    child the signal is the program's again and the wakeup descriptor the child shared
    with the parent is gone, so signalling the child writes no record in the parent."""
    path = tmp_path / "rank0.jsonl"
    calls = tmp_path / "child-got-it"
    previous = signal.getsignal(signal.SIGUSR1)

    def mine(signum: int, frame: Any) -> None:
        calls.write_text("yes")

    signal.signal(signal.SIGUSR1, mine)
    try:
        mode = CommSpanMode(exporters=[JsonlSpanExporter(path)], dump_signal=signal.SIGUSR1)
        with mode:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: waits for the parent's signal, then leaves at once
                try:
                    os.close(read)
                    ok = signal.getsignal(signal.SIGUSR1) is mine \
                        and signal.set_wakeup_fd(-1) == -1
                    os.write(write, b"1" if ok else b"0")
                    deadline = time.monotonic() + 10
                    while not calls.exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                finally:
                    os._exit(0)
            os.close(write)
            child_state = os.read(read, 1)
            os.close(read)
            os.kill(pid, signal.SIGUSR1)
            os.waitpid(pid, 0)
            time.sleep(0.3)  # a wrongly woken watchdog would write now
        mode.shutdown()
        assert child_state == b"1" and calls.read_text() == "yes"
        assert _hangs(path) == []
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_record_in_a_sampled_out_step_names_it_and_check_says_it_is_unknown(
    tmp_path: Path,
) -> None:
    """sample=2 traces step 0, not step 1. A dump in step 1 (as a signal would, while a
    rank is stuck there) is stamped step 1, in step 1's trace, and says the step is not
    traced; it used to claim step 0, and check then called a hung job consistent."""
    path = tmp_path / "rank0.jsonl"
    mode = CommSpanMode(exporters=[JsonlSpanExporter(path)], sample=2)
    with mode:
        for i in range(2):
            with mode.step(i):
                funcol.wait_tensor(funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD))
                if i == 1:
                    mode.dump()
    mode.shutdown()
    (hang,) = _hangs(path)
    step0 = {s.trace_id for s in read_spans(path) if s.name == semconv.SPAN_RANK}
    assert hang.attributes[semconv.STEP] == 1 and hang.trace_id not in step0
    assert hang.attributes[semconv.HANG_STEP_TRACED] is False
    (finding,) = [f for f in check_run(path).findings if f.kind != "missing"]
    assert (finding.kind, finding.step, list(finding.ranks)) == ("untraced", 1, [0])
    assert finding.message.startswith(
        "step 1: rank 0 wrote a hang record (dump) in this step, which `sample=` does not "
        "trace")


def test_the_log_line_numbers_a_send_as_check_does() -> None:
    """A send's number per peer is ``#N`` in the watchdog's log line, as in check's
    findings (``seq`` is the group's collective counter)."""
    from commspan.session.mode import _describe_stuck
    from commspan.spans.timing import CollectiveTiming

    send = CollectiveTiming({semconv.COLL_OP: "send", semconv.COLL_PEER: 1,
                             semconv.PG_NAME: "0", semconv.P2P_SEQ: 3,
                             semconv.MODULE_FQN: "Net.p", semconv.PHASE: "forward"}, "forward")
    send.issued = time.perf_counter_ns()
    assert _describe_stuck(send).startswith(": send to rank 1 on group 0 (#3) in `Net.p` forward")
    ar = CollectiveTiming({semconv.COLL_OP: "all_reduce", semconv.PG_NAME: "0",
                           semconv.COLL_SEQ: 5, semconv.MODULE_FQN: "Net.a",
                           semconv.PHASE: "forward"}, "forward")
    ar.issued = time.perf_counter_ns()
    assert _describe_stuck(ar).startswith(": all_reduce on group 0 (seq 5) in `Net.a` forward")
