"""New locks in a process forked from one where another thread may hold them.

``fork()`` copies only the forking thread. A lock that another thread held at
that moment (the export thread writing a line, a watchdog writing a hang
record, a completion callback) stays held in the child, and the child's
first use of it blocks forever: a DataLoader worker forked while the mode is
active would hang. Objects whose locks other threads take register them
here; the child gets fresh, unheld ones. (What the locks guarded may be half
updated in the child: the export queues drop what the child records anyway,
:meth:`commspan.exporters.queue.ExportQueue._after_fork_in_child`.)

Example:
    >>> import threading
    >>> class Counter:
    ...     def __init__(self):
    ...         self._lock = threading.Lock()
    ...         renew_after_fork(self, "_lock")
    >>> counter = Counter()
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

__all__ = ["renew_after_fork", "on_fork_in_child"]

# owner -> names of its lock attributes
_OWNERS: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()
_CALLBACKS: list[Callable[[], None]] = []


def renew_after_fork(owner: object, *names: str) -> None:
    """In a child forked from this process, give ``owner`` a new ``threading.Lock``
    under each of ``names`` (``owner`` is held weakly)."""
    _OWNERS[owner] = names


def on_fork_in_child(callback: Callable[[], None]) -> None:
    """Call ``callback`` in a child forked from this process, after the locks of
    :func:`renew_after_fork` are new (for module-level locks)."""
    _CALLBACKS.append(callback)


def _after_fork_in_child() -> None:
    for owner, names in list(_OWNERS.items()):
        for name in names:
            try:
                setattr(owner, name, threading.Lock())
            except Exception:  # pragma: no cover - an owner that refuses: left as it is
                pass
    for callback in _CALLBACKS:
        try:
            callback()
        except Exception:  # pragma: no cover
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
