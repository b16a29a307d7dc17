"""Collective timing and hang records on real gloo ranks (4 processes on 127.0.0.1).

The ranks run tests/_mp_timing_scenarios.py: once for the timed, straggler and
garbage-collection straggler scenarios (spawned once for the module), once for
the hang, which the test stops itself after the hang records are on disk.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from _spawn import spawn

from commspan import semconv
from commspan.analysis import check_run, stragglers
from commspan.analysis.records import load_run
from commspan.exporters import SpanRecord, read_spans

pytestmark = pytest.mark.multiprocess

WORLD = 4
SCRIPT = Path(__file__).with_name("_mp_timing_scenarios.py")


@dataclass
class Job:
    root: Path
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def failure(self) -> str:
        return "\n".join(
            f"--- rank {r} exit {p.returncode}\n{self.logs[r].read_text(errors='replace')[-4000:]}"
            for r, p in enumerate(self.procs)
        )

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def _spawn(root: Path, what: str) -> Job:
    logs = [root / f"{what}-rank{r}.log" for r in range(WORLD)]
    return Job(root, spawn(SCRIPT, [str(root), what], logs), logs)


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The timed, straggler and gc_straggler scenarios, all 4 ranks exited 0."""
    root = tmp_path_factory.mktemp("timing")
    job = _spawn(root, "main")
    try:
        finished = _wait(lambda: all(p.poll() is not None for p in job.procs)
                         or any(p.poll() not in (None, 0) for p in job.procs), 180)
    finally:
        time.sleep(0.5 if finished else 0)
        job.stop()
    if any(p.returncode != 0 for p in job.procs):
        pytest.fail(f"ranks failed:\n{job.failure()}")
    return root


def _collectives(path: Path) -> list[tuple[SpanRecord, dict[str, object]]]:
    return [(s, ev) for s in read_spans(path) for _, ev in s.events if semconv.COLL_OP in ev]


def test_every_collective_of_a_gloo_run_has_a_positive_duration(main_run: Path) -> None:
    """Blocking, async, p2p and functional collectives (waited after their span closed):
    each event on every rank has a positive duration and bandwidths where it has bytes."""
    ops: set[tuple[str, str]] = set()
    for rank in range(WORLD):
        events = _collectives(main_run / "timed" / f"trace-rank{rank}.jsonl")
        assert len(events) == 3 * 6  # 3 steps x (2 blocking, 1 async, 2 p2p, 1 functional)
        for span, ev in events:
            assert isinstance(ev[semconv.COLL_DURATION_NS], int), (span.name, ev)
            assert ev[semconv.COLL_DURATION_NS] > 0, (span.name, ev)
            assert ev[semconv.COLL_ALGBW] > 0 and ev[semconv.COLL_BUSBW] > 0
            ops.add((str(ev[semconv.MODULE_FQN]), str(ev[semconv.COLL_OP])))
    assert ops == {
        ("Timed.blocking", "all_reduce"), ("Timed.blocking", "all_gather_into_tensor"),
        ("Timed.async_", "all_reduce"), ("Timed.ring", "send"), ("Timed.ring", "recv"),
        ("Timed.issue", "all_reduce"),
    }


def test_ops_whose_work_has_no_future_are_remembered(main_run: Path) -> None:
    """gloo's send and recv return a Work without a future; asking for one raises a
    C++ error (15-40 µs with its backtrace), so commspan remembers the op and group and
    polls later ones at once: exactly the run's send and recv overloads on the world
    group are remembered, not its all_reduces (whose Works have futures), and every
    send and recv of the three steps still has its duration (the test above)."""
    world = json.loads((main_run / "groups.json").read_text())["world"]
    for rank in range(WORLD):
        p2p = {str(ev[semconv.COLL_OVERLOAD]) for _, ev in
               _collectives(main_run / "timed" / f"trace-rank{rank}.jsonl")
               if ev[semconv.COLL_OP] in ("send", "recv")}
        remembered = json.loads(
            (main_run / "timed" / f"no-future-rank{rank}.json").read_text())
        assert len(p2p) == 2
        assert sorted(map(tuple, remembered)) == sorted((op, world, False) for op in p2p)


def test_rank_spans_roll_up_the_time_of_their_collectives(main_run: Path) -> None:
    """Each rank span's commspan.comm_time_ns.forward is the sum of its step's durations."""
    for rank in range(WORLD):
        spans = list(read_spans(main_run / "timed" / f"trace-rank{rank}.jsonl"))
        per_trace: dict[str, int] = defaultdict(int)
        for s in spans:
            for _, ev in s.events:
                if semconv.COLL_OP in ev:
                    per_trace[s.trace_id] += int(ev[semconv.COLL_DURATION_NS])  # type: ignore[call-overload]
        ranks = [s for s in spans if s.name == semconv.SPAN_RANK]
        assert len(ranks) == 3
        for s in ranks:
            assert s.attributes[semconv.comm_time_key("forward")] == per_trace[s.trace_id]


def test_slow_rank_makes_the_others_wait_and_stragglers_names_it(main_run: Path) -> None:
    """Rank 2 sleeps before Straggler.slow's all_reduce: the others' durations there are
    longer by about the sleep, and stragglers names rank 2 and that module in each step."""
    from _mp_timing_scenarios import SLOW_RANK, SLOW_S, STEPS

    run = load_run(main_run / "straggler")
    slow = defaultdict(dict)
    for c in run.collectives:
        if c.fqn == "Straggler.slow":
            slow[c.step][c.rank] = c.duration_ns
    assert sorted(slow) == list(range(STEPS))
    for step, durations in slow.items():
        for rank, ns in durations.items():
            if rank != SLOW_RANK:
                assert ns - durations[SLOW_RANK] > 0.5 * SLOW_S * 1e9, (step, durations)
    result = stragglers(main_run / "straggler")
    top = [r for r in result.stragglers if r.wait_ns > 0.5 * SLOW_S * 1e9 * (WORLD - 1)]
    assert {(r.step, r.fqn, r.rank) for r in top} == {
        (s, "Straggler.slow", SLOW_RANK) for s in range(STEPS)
    }
    assert result.ranks[0].rank == SLOW_RANK


def test_a_rank_late_for_having_waited_on_another_group_passes_the_wait_on(
        main_run: Path) -> None:
    """2 x 2 mesh: rank 2 sleeps in `MeshStraggler.tp` (the test's own program), which
    makes its tp peer, rank 3, wait there and arrive late at its dp all_reduce with
    rank 1. Both rank 2 and rank 3 make a dp peer wait about the sleep; rank 3's wait
    is passed on (it had waited as long for rank 2), so rank 2 comes first, in the rows
    and per rank, and rank 3's own lateness is small. (Sorted by the wait alone, rank
    3's dp row tied with rank 2's.)"""
    from _mp_timing_scenarios import SLOW_RANK, SLOW_S, STEPS

    peer = SLOW_RANK ^ 1  # its tp peer
    sleep_ns = SLOW_S * 1e9
    result = stragglers(main_run / "mesh_straggler")
    rows = [r for r in result.stragglers if r.wait_ns > 0.5 * sleep_ns]
    # the reference: who slept, where, and who had to wait for whom
    assert {(r.step, r.fqn, r.rank) for r in rows} == {
        *((s, "MeshStraggler.tp", SLOW_RANK) for s in range(STEPS)),
        *((s, "MeshStraggler.dp", SLOW_RANK) for s in range(STEPS)),
        *((s, "MeshStraggler.dp", peer) for s in range(STEPS)),
    }
    for r in rows:
        if r.rank == peer:
            assert r.passed_on_ns > 0.5 * sleep_ns, r
            assert r.wait_ns - r.passed_on_ns < 0.5 * sleep_ns, r
        else:
            assert r.passed_on_ns < 0.5 * sleep_ns, r
    assert {r.rank for r in rows[:2 * STEPS]} == {SLOW_RANK}, rows
    assert result.ranks[0].rank == SLOW_RANK, result.ranks
    by_rank = {w.rank: w for w in result.ranks}
    assert by_rank[peer].wait_ns - by_rank[peer].passed_on_ns < 0.5 * sleep_ns * STEPS


def test_a_rank_that_waits_late_is_not_taken_for_one_that_arrived_early(
    main_run: Path,
) -> None:
    """Every rank issues LateWait.issue's all_reduce on time, and rank 2 works before
    waiting for it: its duration there is long, its wait short (its own clock's
    wait_ns), so that all_reduce names no straggler (none of the others was waited
    for), and the wait rank 2 causes is found at LateWait.sync, where the others
    block for it."""
    from _mp_timing_scenarios import SLOW_RANK, SLOW_S, STEPS

    run = load_run(main_run / "late_wait")
    issue = defaultdict(dict)
    for c in run.collectives:
        if c.fqn == "LateWait.issue":
            issue[c.step][c.rank] = c
    assert sorted(issue) == list(range(STEPS))
    for per_rank in issue.values():
        late = per_rank[SLOW_RANK]
        assert late.duration_ns > 0.5 * SLOW_S * 1e9
        assert late.wait_ns is not None and late.wait_ns * 20 < late.duration_ns
    result = stragglers(main_run / "late_wait")
    assert not [r for r in result.stragglers if r.fqn == "LateWait.issue"
                and r.wait_ns > 0.25 * SLOW_S * 1e9]
    assert result.checked["late_wait"] >= 1
    top = [r for r in result.stragglers if r.wait_ns > 0.5 * SLOW_S * 1e9 * (WORLD - 1)]
    assert {(r.fqn, r.rank) for r in top} == {("LateWait.sync", SLOW_RANK)}
    assert result.ranks[0].rank == SLOW_RANK


# ------------------------------------------------------------------ hang
def test_a_rank_late_from_a_full_collection_is_named_with_its_collection(
    main_run: Path,
) -> None:
    """Rank 1 runs a full garbage collection in GcStraggler.collect before its all_reduce:
    its commspan.gc events agree with the rank's own record of its collections, and
    stragglers names rank 1 and that module in each step, with the collection's time
    charged to the late arrival and the others' wait of about that time."""
    from _mp_timing_scenarios import GC_RANK, STEPS

    out = main_run / "gc_straggler"
    reference = json.loads((out / f"reference-rank{GC_RANK}.json").read_text())
    own: dict[int, int] = defaultdict(int)
    for step, ns in reference:
        own[step] += ns
    assert sorted(own) == list(range(STEPS)) and min(own.values()) > 20_000_000, own
    run = load_run(out)
    recorded: dict[int, int] = defaultdict(int)
    for g in run.gc_pauses:
        if g.rank == GC_RANK and g.generation == 2:
            recorded[g.step] += g.duration_ns
            assert (g.fqn, g.phase) in (("GcStraggler.collect", "forward"), (None, None))
    for step in range(STEPS):
        assert abs(recorded[step] - own[step]) <= max(5_000_000, own[step] // 10), (
            step, recorded, own)
    result = stragglers(out)
    late = {r.step: r for r in result.stragglers
            if r.fqn == "GcStraggler.collect" and r.rank == GC_RANK}
    assert sorted(late) == list(range(STEPS)), result.stragglers
    for step, row in late.items():
        assert row.gc_ns >= 0.9 * own[step], (row, own)
        assert row.wait_ns > 0.5 * own[step] * (WORLD - 1), (row, own)
    times = {t.step: t.gc_ns for t in result.step_times if t.rank == GC_RANK}
    assert all(times[s] >= 0.9 * own[s] for s in range(STEPS)), (times, own)


def _hang_records(path: Path) -> list[SpanRecord]:
    if not path.exists():
        return []
    try:
        return [s for s in read_spans(path) if s.name == semconv.SPAN_HANG]
    except ValueError:  # a line being written
        return []


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 2 hangs: ranks 0, 2, 3 block in Hang.blocks.2's all_reduce and write timeout
    records; then SIGUSR1 to rank 1 (stalled in Hang.blocks.1) and to rank 0 (blocked in
    gloo) makes each write a signal record; then the job is killed."""
    from _mp_timing_scenarios import STALLED_RANK

    root = tmp_path_factory.mktemp("hang")
    job = _spawn(root, "hang")
    files = [root / "hang" / f"trace-rank{r}.jsonl" for r in range(WORLD)]
    blocked = [r for r in range(WORLD) if r != STALLED_RANK]
    try:
        if not _wait(lambda: all(_hang_records(files[r]) for r in blocked), 120):
            pytest.fail(f"no timeout records:\n{job.failure()}")
        for r in (STALLED_RANK, 0):
            job.procs[r].send_signal(signal.SIGUSR1)
        if not _wait(lambda: len(_hang_records(files[STALLED_RANK])) == 1
                     and len(_hang_records(files[0])) == 2, 60):
            pytest.fail(f"no signal records:\n{job.failure()}")
        assert all(p.poll() is None for p in job.procs), job.failure()  # still hung
    finally:
        job.stop()
    return root


def test_hang_records_are_written_while_ranks_are_blocked(hang_run: Path) -> None:
    """Timeout records from the blocked ranks (one each), signal records from the stalled
    rank and from a rank blocked inside gloo's wait."""
    from _mp_timing_scenarios import HANG_TIMEOUT_S, STALLED_RANK

    for rank in range(WORLD):
        reasons = [h.attributes[semconv.HANG_REASON]
                   for h in _hang_records(hang_run / "hang" / f"trace-rank{rank}.jsonl")]
        expected = {STALLED_RANK: ["signal"], 0: ["timeout", "signal"]}.get(rank, ["timeout"])
        assert reasons == expected, rank
    (h,) = [h for h in _hang_records(hang_run / "hang" / "trace-rank2.jsonl")]
    assert h.attributes[semconv.HANG_TIMEOUT] == HANG_TIMEOUT_S
    assert h.attributes[semconv.HANG_STACK_FQNS] == ["Hang", "Hang.blocks.2"]


def test_check_names_group_seq_missing_rank_and_each_ranks_module(hang_run: Path) -> None:
    """commspan check on the killed job's files: one hang finding, group and seq of
    Hang.blocks.2's all_reduce in step 2, rank 1 never issued it and was in
    Hang.blocks.1; steps 0 and 1 are whole and consistent. Ranks 0 and 1 also send and
    receive on the world group (Hang.pipe), which does not shift their numbering of
    the all_reduces: with one counter for both, ranks 0 and 1 were said to have
    completed the stuck one."""
    from _mp_timing_scenarios import HANG_STEP, STALLED_RANK

    world = json.loads((hang_run / "groups.json").read_text())["world"]
    result = check_run(hang_run / "hang")
    (f,) = result.findings
    seq = 3 * HANG_STEP + 3  # three all_reduces per step, the third is stuck
    assert (f.kind, f.group, f.seq, f.step) == ("hang", world, seq, HANG_STEP)
    assert f.details["never_issued"] == [STALLED_RANK]
    for r in range(WORLD):
        if r == STALLED_RANK:
            assert (f.ranks[r]["fqn"], f.ranks[r]["phase"], f.ranks[r]["state"]) == (
                "Hang.blocks.1", "forward", "not issued")
        else:
            assert (f.ranks[r]["fqn"], f.ranks[r]["op"], f.ranks[r]["state"]) == (
                "Hang.blocks.2", "all_reduce", "issued")
            assert f.ranks[r]["waited_ns"] >= 1e9
    assert f.message == (
        f"group {world} (ranks 0-3), seq {seq}: ranks 0, 2, 3 are in `Hang.blocks.2` "
        "forward all_reduce; rank 1 never issued it and was last seen in `Hang.blocks.1` "
        "forward"
    )
    assert result.checked["steps"] == HANG_STEP and result.checked["steps_interrupted"] == 1
    run = load_run(hang_run / "hang")
    whole = {(r, s.step) for (r, _), s in run.rank_steps.items()}
    assert whole == {(r, s) for r in range(WORLD) for s in range(HANG_STEP)}


def test_a_send_and_the_receive_that_matches_it_have_one_number(hang_run: Path) -> None:
    """On real gloo ranks: rank 0's k-th send to rank 1 and rank 1's k-th receive from
    rank 0 carry p2p_seq k, one pair per step; collectives carry no p2p number and
    point-to-point ops no collective seq."""
    from _mp_timing_scenarios import HANG_STEP

    run = load_run(hang_run / "hang")
    sends = [(c.step, c.p2p_seq) for c in run.collectives if c.op == "send"]
    recvs = [(c.step, c.p2p_seq) for c in run.collectives if c.op == "recv"]
    assert {(c.rank, c.peer) for c in run.collectives if c.op == "send"} == {(0, 1)}
    assert {(c.rank, c.peer) for c in run.collectives if c.op == "recv"} == {(1, 0)}
    expected = [(s, s + 1) for s in range(HANG_STEP + 1)]  # step 2's too: before the hang
    assert sorted(sends) == sorted(recvs) == expected
    for c in run.collectives:
        assert (c.seq is None) == (c.kind == semconv.KIND_P2P), c
        assert (c.p2p_seq is None) == (c.kind != semconv.KIND_P2P), c


# ------------------------------------------------------------------ crash
@pytest.fixture(scope="module")
def crash_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 2: rank 1 dies in Hang.blocks.1 (no hang records anywhere); ranks 0, 2, 3
    get the backend's error in Hang.blocks.2's all_reduce, catch it and exit 0."""
    from _mp_timing_scenarios import CRASH_EXIT, STALLED_RANK

    root = tmp_path_factory.mktemp("crash")
    job = _spawn(root, "crash")
    try:
        if not _wait(lambda: all(p.poll() is not None for p in job.procs), 150):
            pytest.fail(f"ranks did not exit:\n{job.failure()}")
    finally:
        job.stop()
    codes = [p.returncode for p in job.procs]
    expected = [CRASH_EXIT if r == STALLED_RANK else 0 for r in range(WORLD)]
    assert codes == expected, job.failure()
    return root


def test_check_names_the_collective_that_failed_when_a_rank_died(crash_run: Path) -> None:
    """commspan check on a job where a rank died and nobody wrote a hang record: the
    collective the others were in when the backend gave up is named (group, seq, step,
    module, failed on ranks 0, 2, 3), with the dead rank's last exported collective.
    The step it died in is not compared (its spans stop short there: comparing them
    said "count differs"); steps 0 and 1 are, and are consistent. (Before the failure
    was recorded on the event, only the count mismatch was said.)"""
    from _mp_timing_scenarios import HANG_STEP, STALLED_RANK

    world = json.loads((crash_run / "groups.json").read_text())["world"]
    result = check_run(crash_run / "crash")
    (hang,) = result.findings
    seq = 3 * HANG_STEP + 3  # three all_reduces per step: block 2's never completed
    assert (hang.kind, hang.group, hang.seq, hang.step) == ("hang", world, seq, HANG_STEP)
    assert hang.details["never_issued"] == [STALLED_RANK]
    others = [r for r in range(WORLD) if r != STALLED_RANK]
    for r in others:
        assert (hang.ranks[r]["fqn"], hang.ranks[r]["op"], hang.ranks[r]["state"]) == (
            "Hang.blocks.2", "all_reduce", "failed")
    # its spans closed before it died: Hang.blocks.0's (block 1's never closed)
    assert hang.ranks[STALLED_RANK]["last_seq"] == seq - 2
    assert hang.message == (
        f"group {world} (ranks 0-3), seq {seq}: ranks 0, 2, 3 issued all_reduce in "
        "`Hang.blocks.2` forward and it failed there; rank 1 wrote no record of it and "
        "no hang record (stopped, or stuck outside collectives?); its last exported "
        f"collective was all_reduce in `Hang.blocks.0` forward (step {HANG_STEP})")
    assert result.checked["steps"] == HANG_STEP and result.checked["steps_interrupted"] == 1


def test_check_of_the_crash_is_the_same_from_digests(crash_run: Path, tmp_path: Path) -> None:
    """The failed state travels in digests: check reads the same findings from them."""
    import shutil

    from commspan.analysis.digest import write_digest

    for f in (crash_run / "crash").glob("*.jsonl"):
        shutil.copy(f, tmp_path / f.name)
        write_digest(tmp_path / f.name)
    assert len(list(tmp_path.glob("*.digest"))) == WORLD
    plain, digested = check_run(crash_run / "crash"), check_run(tmp_path)
    assert digested.to_dict() == plain.to_dict()
    assert [f.kind for f in digested.findings] == ["hang"]
