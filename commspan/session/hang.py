"""The hang watchdog: writes a ``commspan.hang`` record when a collective is stuck,
or when the opt-in signal arrives, while the training thread is blocked.

One daemon thread per entered :class:`~commspan.CommSpanMode` that asked for
it (``hang_timeout_s=`` or ``dump_signal=``). It wakes every
``min(hang_timeout_s / 4, 1 s)``, asks for the oldest collective not
completed, and, when that one has been waiting ``hang_timeout_s``, writes one
record for it (a collective is reported once). The training thread is never
involved: it may be blocked inside the collective.

The signal: Python runs signal handlers on the main thread only, between
bytecodes, so a handler cannot run while the main thread is blocked inside a
collective. The watchdog therefore listens on the interpreter's wakeup file
descriptor (``signal.set_wakeup_fd``), which the C-level handler writes to at
once; the record is written by the watchdog. If the program already uses a
wakeup descriptor (asyncio does), commspan leaves it alone and the Python
handler wakes the watchdog instead: then the record waits until the main
thread runs Python again. The previous handler and descriptor are restored
when the mode is left.
"""

from __future__ import annotations

import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from commspan import semconv
from commspan._fork import on_fork_in_child
from commspan.spans.timing import CollectiveTiming

__all__ = ["HangWatch"]

_log = logging.getLogger(__name__)


# per signal, the watches whose handler is installed, in the order they installed it
_INSTALLED: dict[int, list[HangWatch]] = {}


def _forget_signals_in_child() -> None:
    """In a child forked with a ``dump_signal`` installed (a DataLoader worker): give
    the signal back to the handler the first mode found, and drop the wakeup
    descriptor, one end of a socket pair the child shares with its parent. Else the
    signal, sent to the child, would do nothing there and wake the parent's
    watchdog, which would write a record for a rank nobody signalled."""
    for signum, chain in list(_INSTALLED.items()):
        for watch in chain:
            socks, watch._socks = watch._socks, None
            watch._handler_installed = False
            if socks is not None:
                try:
                    current = signal.set_wakeup_fd(-1)
                    if current not in (-1, socks[1].fileno()):  # someone else's: put back
                        signal.set_wakeup_fd(current)
                except (ValueError, OSError):
                    pass
                for sock in socks:  # the child's copies; the parent's stay open
                    try:
                        sock.close()
                    except OSError:
                        pass
        if chain:
            try:
                signal.signal(signum, chain[0]._old_handler)  # type: ignore[arg-type]
            except (ValueError, OSError, TypeError):
                pass
    _INSTALLED.clear()


on_fork_in_child(_forget_signals_in_child)


class HangWatch:
    """Watches for stuck collectives and the dump signal on a thread of its own.

    Args:
        write: writes a hang record for the reason given (``timeout`` or ``signal``).
        not_completed: the collectives issued and not completed, oldest first.
        timeout_s: ``hang_timeout_s``, or ``None`` for no timeout.
        signum: the signal that asks for a record, or ``None``.
    """

    def __init__(
        self,
        write: Callable[[str], Any],
        not_completed: Callable[[], list[CollectiveTiming]],
        timeout_s: float | None,
        signum: int | None,
    ) -> None:
        self._write = write
        self._not_completed = not_completed
        self._timeout = timeout_s
        self._signum = signum
        self._interval = min(timeout_s / 4, 1.0) if timeout_s else 1.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._signalled = False
        # id -> the collectives a timeout record was written for (kept alive while
        # listed here, so an id is not reused)
        self._reported: dict[int, CollectiveTiming] = {}
        self._thread: threading.Thread | None = None
        self._old_handler: Any = None
        self._handler_installed = False
        self._socks: tuple[socket.socket, socket.socket] | None = None

    # ------------------------------------------------------------ life
    def start(self) -> None:
        """Install the signal handler (main thread only) and start the thread."""
        self._stop.clear()
        if self._signum is not None:
            self._install_signal()
        self._thread = threading.Thread(
            target=self._run, name="commspan-hang-watch", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and restore the signal handler and wakeup descriptor."""
        self._stop.set()
        self._wake.set()
        if self._socks is not None:
            try:
                self._socks[1].send(b"\0")
            except OSError:
                pass
        try:
            if self._thread is not None and self._thread.ident is not None:
                self._thread.join(timeout_s)  # (a thread that failed to start: no ident)
        finally:  # an interrupt in the join still restores the signal handler
            self._thread = None
            self._uninstall_signal()

    # ------------------------------------------------------------ signal
    def _install_signal(self) -> None:
        assert self._signum is not None
        if threading.current_thread() is not threading.main_thread():
            _log.warning(
                "commspan: dump_signal=%s needs the mode to be entered on the main thread "
                "(Python installs signal handlers there only); no record is written on "
                "the signal", self._signum,
            )
            return
        self._old_handler = signal.signal(self._signum, self._on_signal)
        self._handler_installed = True
        _INSTALLED.setdefault(self._signum, []).append(self)
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = -2
        if previous != -1:
            if previous >= 0:  # the program uses one (asyncio): leave it alone
                signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            return
        self._socks = (reader, writer)

    def _uninstall_signal(self) -> None:
        if self._socks is not None:
            reader, writer = self._socks
            try:
                current = signal.set_wakeup_fd(-1)
                if current not in (-1, writer.fileno()):  # someone else's since: put it back
                    signal.set_wakeup_fd(current)
            except (ValueError, OSError):
                pass
            reader.close()
            writer.close()
            self._socks = None
        if self._handler_installed and self._signum is not None:
            self._handler_installed = False
            chain = _INSTALLED.get(self._signum, [])
            at = next((i for i, w in enumerate(chain) if w is self), -1)
            if at >= 0:
                del chain[at]
            if 0 <= at < len(chain):
                # a mode entered after this one still holds the signal (modes left out
                # of order): it restores, when it leaves, what this one found
                chain[at]._old_handler = self._old_handler
                return
            if signal.getsignal(self._signum) != self._on_signal:
                return  # the program installed a handler of its own since: keep it
            try:
                signal.signal(self._signum, self._old_handler)  # type: ignore[arg-type]
            except (ValueError, OSError, TypeError):
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        # runs on the main thread: only wake the watchdog (the main thread may be
        # in the middle of commspan's own bookkeeping)
        if self._socks is None:  # no wakeup descriptor: this is how the watchdog learns
            self._signalled = True
            self._wake.set()

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._wait_for_signal():
                    self._write(semconv.HANG_REASON_SIGNAL)
                if self._stop.is_set():
                    return
                self._check_timeout()
            except Exception:  # the watchdog must outlive any failure of its own
                _log.warning("commspan: the hang watchdog failed", exc_info=True)
                time.sleep(self._interval)

    def _wait_for_signal(self) -> bool:
        """Wait one interval; ``True`` if the dump signal arrived meanwhile."""
        if self._socks is not None:
            reader = self._socks[0]
            ready, _, _ = select.select([reader], [], [], self._interval)
            if not ready:
                return False
            try:
                data = reader.recv(512)
            except (BlockingIOError, OSError):
                return False
            return self._signum is not None and self._signum in data
        self._wake.wait(self._interval)
        self._wake.clear()
        if self._signalled:
            self._signalled = False
            return True
        return False

    def _check_timeout(self) -> None:
        if self._timeout is None:
            return
        stuck = self._not_completed()
        live = {id(t) for t in stuck}
        reported = self._reported
        for key in [k for k in reported if k not in live]:
            del reported[key]  # completed (or given up on) since
        now = time.perf_counter_ns()
        late = [t for t in stuck if id(t) not in reported
                and (now - t.issued) / 1e9 >= self._timeout]
        if late:
            # a collective stuck past the timeout gets a record unless one listed it
            # already: one reported earlier that still waits (a send whose Work says
            # done only once waited) does not hide a later one, and the collectives a
            # record listed (several buckets issued just before a hang) do not each
            # write another as they cross the timeout
            for t in stuck:
                reported[id(t)] = t
            self._write(semconv.HANG_REASON_TIMEOUT)
