"""The dispatch mode's stack of open ``record_function`` labels, and the torch
behaviour it relies on (pinned, so a torch upgrade that changes it fails here)."""

from __future__ import annotations

import threading

import torch
from torch.profiler import record_function

from commspan.capture.dispatch import MAX_LABELS, CollectiveDispatchMode

_ENTER = torch.ops.profiler._record_function_enter_new.default
_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


def _mode() -> CollectiveDispatchMode:
    return CollectiveDispatchMode(lambda info, attrs: None)


def test_record_function_reaches_a_dispatch_mode_as_two_ops() -> None:
    """torch sends record_function's enter and exit through the dispatcher (profiler
    off); the exit receives another Python object than the enter returned, with
    the same hash: commspan matches them on hash()."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[object, object]] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func in (_ENTER, _EXIT):
                seen.append((func, out if func is _ENTER else args[0]))
            return out

    with Spy(), record_function("label"):
        pass
    assert [f for f, _ in seen] == [_ENTER, _EXIT]
    handle_in, handle_out = seen[0][1], seen[1][1]
    assert handle_in is not handle_out
    assert hash(handle_in) == hash(handle_out)


def test_labels_nest_and_pop() -> None:
    """Open labels are listed outermost first; leaving one removes it."""
    mode = _mode()
    with mode:
        with record_function("outer"):
            with record_function("inner"):
                inside = mode.labels()
            after_inner = mode.labels()
        after = mode.labels()
    assert inside == ("outer", "inner")
    assert after_inner == ("outer",)
    assert after == ()


def test_a_label_left_out_of_order_closes_those_above_it() -> None:
    """Leaving a label that is not on top pops it and everything opened after it."""
    mode = _mode()
    with mode:
        outer = record_function("outer").__enter__()
        record_function("inner").__enter__()
        outer.__exit__(None, None, None)
        left = mode.labels()
    assert left == ()


def test_the_label_stack_is_bounded() -> None:
    """Labels never closed (an async record_function) cannot grow the stack forever."""
    mode = _mode()
    with mode:
        for i in range(MAX_LABELS + 50):
            record_function(f"never closed {i}").__enter__()
        labels = mode.labels()
    assert len(labels) == MAX_LABELS
    assert labels[0] == "never closed 0"


def test_labels_are_per_thread() -> None:
    """A label opened on another thread is not on this thread's stack."""
    mode = _mode()
    other: list[tuple[str, ...]] = []

    def work() -> None:
        with mode, record_function("other thread"):
            other.append(mode.labels())

    with mode, record_function("main thread"):
        t = threading.Thread(target=work)
        t.start()
        t.join()
        here = mode.labels()
    assert here == ("main thread",)
    assert other == [("other thread",)]


def test_non_collective_ops_cost_one_lookup_in_the_overload_table() -> None:
    """The profiler ops are entries of the same overload table the collectives are in:
    deciding what an op is stays one dict lookup."""
    mode = _mode()
    assert mode.knows(_ENTER) and mode.knows(_EXIT)
    assert not mode.knows(torch.ops.aten.mm.default)


def test_clear_labels_empties_this_threads_stack() -> None:
    """Stale labels do not outlive a step (the session clears them)."""
    mode = _mode()
    with mode:
        record_function("left open").__enter__()
        mode.clear_labels()
        assert mode.labels() == ()
