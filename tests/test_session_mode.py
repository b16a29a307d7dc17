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


def test_two_threads_entering_at_once_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread A is inside ``__enter__`` (held there) when thread B enters the same mode:
    B gets "already active" and leaves nothing behind; A enters and leaves normally,
    and the mode can be entered again."""
    import threading

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    import commspan.session.mode as mode_module

    inside, release = threading.Event(), threading.Event()
    real = mode_module.process_ranks

    def slow_ranks() -> Any:
        if threading.current_thread().name == "A":
            inside.set()
            release.wait(10)
        return real()

    monkeypatch.setattr(mode_module, "process_ranks", slow_ranks)
    mode = CommSpanMode()
    outcome: dict[str, Any] = {}

    def enter_and_leave() -> None:
        try:
            with mode:
                outcome["A"] = len(_get_current_dispatch_mode_stack())
        except BaseException as exc:  # pragma: no cover - reported below
            outcome["A"] = exc

    a = threading.Thread(target=enter_and_leave, name="A")
    a.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="already active"):
        mode.__enter__()
    assert _get_current_dispatch_mode_stack() == []
    release.set()
    a.join(10)
    assert outcome["A"] == 1 and not mode.active
    with mode:
        assert len(_get_current_dispatch_mode_stack()) == 1
    assert _get_current_dispatch_mode_stack() == []


def test_entering_fails_halfway_leaves_nothing_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt inside ``__enter__`` after the hooks and the dispatch mode were
    installed (here: while the garbage-collector watch installs) reaches the caller;
    the hooks and the dispatch mode come off, and the mode can be entered again."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    import commspan.session.mode as mode_module

    model = nn.Linear(2, 2)
    before = hook_sizes(model)

    def interrupted(self: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(mode_module.GcWatch, "install", interrupted)
    mode = CommSpanMode(record_gc=True)
    with pytest.raises(KeyboardInterrupt):
        mode.__enter__()
    assert not mode.active and _get_current_dispatch_mode_stack() == []
    assert hook_sizes(model) == before
    monkeypatch.undo()
    with mode:
        model(torch.randn(1, 2))
    assert mode.aggregator is not None and mode.stats()["spans"] >= 1


def test_a_hang_watch_that_cannot_start_is_counted_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The watchdog's thread or signal descriptor cannot be had (too many open files):
    the mode enters and traces anyway, logs it once and counts it in internal_errors;
    the signal handler is not left installed."""
    import signal as signal_module

    import commspan.session.hang as hang_module

    def no_descriptors() -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(hang_module.socket, "socketpair", no_descriptors)
    before = signal_module.getsignal(signal_module.SIGUSR1)
    mode = CommSpanMode(hang_timeout_s=30, dump_signal=signal_module.SIGUSR1)
    with caplog.at_level("WARNING", logger="commspan"), mode, mode.step(0):
        nn.Linear(2, 2)(torch.randn(1, 2))
    assert signal_module.getsignal(signal_module.SIGUSR1) == before
    stats = mode.stats()
    assert stats["internal_errors"] == 1 and stats["spans"] >= 2
    assert sum("hang watchdog" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_entry_before_the_dispatch_mode_leaves_the_programs_mode_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Entering fails while the module hooks install (before commspan pushes its
    dispatch mode): cleaning up leaves the dispatch mode the program itself had
    entered, and runs to its end (it used to try to pop a mode it never pushed,
    and stop there)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    import commspan.session.mode as mode_module

    class Users(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    def interrupted(self: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(mode_module.ModuleTracker, "install", interrupted)
    mode = CommSpanMode()
    with caplog.at_level("DEBUG", logger="commspan"), Users() as users:
        with pytest.raises(KeyboardInterrupt):
            mode.__enter__()
        assert _get_current_dispatch_mode_stack() == [users]
    assert not mode.active
    assert "cleaning up a failed entry raised" not in caplog.text


def test_a_step_number_not_above_the_highest_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first step, whatever its number (-1: a warm-up), logs nothing (it said "-1
    after -1 repeats one"); a number not above the highest so far logs once, without
    claiming it repeats one (5 then 4 repeats nothing)."""
    mode = CommSpanMode(aggregator=False)
    with mode:
        for step in (-1, 0, 5):
            with mode.step(step):
                pass
        assert "not above the highest" not in caplog.text
        for step in (4, 3):
            with mode.step(step):
                pass
    mode.shutdown()
    assert caplog.text.count("mode.step(4) after mode.step(5): a step number not above "
                             "the highest so far") == 1
    assert "mode.step(3)" not in caplog.text


def test_a_mode_shut_down_cannot_be_entered_again(tmp_path: Any) -> None:
    """After ``shutdown()`` the exporters are closed, so a new use would drop all it
    traced: entering is refused, saying why and what to do instead. A mode without
    exporters (the aggregator only) loses nothing and may be entered again."""
    from commspan.exporters import JsonlSpanExporter

    mode = CommSpanMode(exporters=[JsonlSpanExporter(tmp_path)])
    with mode:
        pass
    mode.shutdown()
    with pytest.raises(RuntimeError, match=r"was shut down .* create a new CommSpanMode"):
        with mode:
            pass
    assert not mode.active
    counting = CommSpanMode()
    with counting:
        pass
    counting.shutdown()
    with counting:
        assert counting.active


_ENTERED_AT_EXIT = """
import sys
import torch
from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter

model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
mode = CommSpanMode(exporters=[JsonlSpanExporter(sys.argv[1])])
mode.__enter__()  # entered by hand (a notebook, a framework's callbacks), never left
with mode.step(0):
    model(torch.ones(1, 2))
step = mode.step(1)  # a step still open when the interpreter exits
step.__enter__()
model(torch.ones(1, 2))
"""


def test_a_mode_never_left_is_left_at_interpreter_exit(tmp_path: Any) -> None:
    """The interpreter exits with the mode entered and a step open: the step's trace
    is closed and written, its root and rank span included, as a step left by hand."""
    import subprocess
    import sys

    from commspan.exporters import read_spans

    script = tmp_path / "entered.py"
    script.write_text(_ENTERED_AT_EXIT)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                   timeout=120, check=True)
    spans = [s for f in sorted(out.iterdir()) for s in read_spans(f)]
    per_step = {}
    for s in spans:
        per_step.setdefault(s.trace_id, []).append(s.name)
    assert len(per_step) == 2
    for names in per_step.values():
        assert sorted(names) == sorted(["commspan.step", "commspan.rank", "Sequential forward",
                                        "Sequential.0 forward", "Sequential.1 forward"])


_ENTERED_AT_EXIT_PROVIDER = """
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from commspan import CommSpanMode

class Printing(SpanExporter):
    def export(self, spans):
        for s in spans:
            print("span", s.name, flush=True)
        return SpanExportResult.SUCCESS

provider = TracerProvider()  # registers its own shutdown at exit, before the mode exists
provider.add_span_processor(SimpleSpanProcessor(Printing()))
mode = CommSpanMode(tracer_provider=provider)
mode.__enter__()
step = mode.step(0)
step.__enter__()
torch.nn.Linear(2, 2)(torch.ones(1, 2))
"""


def test_a_mode_never_left_reaches_a_tracer_provider_of_its_own_at_exit(tmp_path: Any) -> None:
    """The same with the user's ``tracer_provider``, made before the mode: the mode is
    left before the provider shuts down, so the step's root and rank span reach it."""
    import subprocess
    import sys

    script = tmp_path / "provider.py"
    script.write_text(_ENTERED_AT_EXIT_PROVIDER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)
    names = sorted(line.split(" ", 1)[1] for line in done.stdout.splitlines()
                   if line.startswith("span "))
    assert names == ["Linear forward", "commspan.rank", "commspan.step"], done.stderr


def test_breaking_out_of_a_generator_that_holds_a_step_is_no_error() -> None:
    """A generator yields inside ``with mode.step(i):`` and the caller breaks out of
    its loop: Python closes the generator (GeneratorExit), which is normal, so the
    step's spans do not end with ERROR."""
    from opentelemetry.trace import StatusCode

    from commspan.testing import capture

    def batches(mode: Any) -> Any:
        for i in range(3):
            with mode.step(i):
                yield torch.nn.Linear(2, 2)(torch.ones(1, 2))

    with capture() as cap:
        for n, _ in enumerate(batches(cap.mode)):
            if n == 1:
                break
    assert [s.name for s in cap.spans if s.status.status_code is StatusCode.ERROR] == []
    assert not any(e.name == "exception" for s in cap.spans for e in s.events)


def test_left_under_a_dispatch_mode_of_the_programs_it_takes_only_its_own() -> None:
    """The program enters its own dispatch mode after commspan's and leaves it after
    leaving commspan: commspan's mode comes off the stack from under it, the
    program's stays and keeps working, and commspan records nothing more."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    mode = CommSpanMode(aggregator=False)
    mine = Counting()
    mode.__enter__()
    mine.__enter__()
    mode.__exit__(None, None, None)  # out of order
    assert [type(m).__name__ for m in _get_current_dispatch_mode_stack()] == ["Counting"]
    before = Counting.ops
    torch.ones(2) + 1
    assert Counting.ops > before and mode.stats()["spans"] == mode.stats()["spans_exported"] + \
        mode.stats()["spans_dropped"] + mode.stats()["spans_failed"] + \
        mode.stats()["spans_in_flight"]
    mine.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == []


def test_leaving_on_another_thread_is_refused_and_the_mode_stays_in() -> None:
    """Leaving on a thread that did not enter the mode: a clear error (torch's was "pop
    from empty mode stack", and the dispatch mode stayed on the entering thread for
    good); the mode stays active and leaves properly on its own thread."""
    import threading

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode = CommSpanMode(aggregator=False)
    mode.__enter__()
    errors: list[BaseException] = []

    def leave() -> None:
        try:
            mode.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(e)

    worker = threading.Thread(target=leave)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "leave it on the thread that entered it" in str(errors[0])
    assert mode.active
    mode.__exit__(None, None, None)
    assert not mode.active and _get_current_dispatch_mode_stack() == []
