"""Errors: how commspan describes a user's exception, and counts and logs its own.

Three concerns, each with one owner here:

- :func:`describe_error`: the text a span keeps of an exception that crossed it
  (never the exception itself: its traceback holds the step's tensors);
- "count it and log the first one" (design principles 1 and 7: tracing never
  breaks training, nothing is lost silently): :class:`ErrorCounter` counts the
  errors of one kind and logs the first with its traceback; :class:`Once`
  remembers which kinds of event were already logged, for counters that live
  elsewhere (an export queue's ``dropped``, taken under its lock);
- a user's bad number or output path: :func:`positive_int`, :func:`seconds` and
  :func:`file_path` raise the error that names the parameter, the value and the fix.

Example:
    >>> import logging
    >>> errors = ErrorCounter(logging.getLogger("demo"), "could not record %s")
    >>> try:
    ...     raise ValueError("boom")
    ... except ValueError:
    ...     errors.record("op")  # logged: the first one
    >>> errors.count
    1
    >>> once = Once()
    >>> once.first("drop"), once.first("drop")
    (True, False)
"""

from __future__ import annotations

import logging
import numbers
import operator
import os
import threading
from pathlib import Path
from typing import Any

from commspan._fork import renew_after_fork

__all__ = ["ErrorCounter", "Once", "describe_error", "error_message", "file_path",
           "positive_int", "whole_number"]

_FURTHER = " (further errors are counted, not logged)"


def describe_error(error: BaseException | None, message: bool = True) -> str | None:
    """``"ValueError: boom"`` (``"ValueError"`` without ``message``, or for an
    exception whose text is empty: ``KeyboardInterrupt()``); ``None`` for no error.

    Frames keep this string, never the exception (its traceback would keep the
    step's tensors and autograd graph alive).
    """
    if error is None:
        return None
    if not message:
        return type(error).__name__
    text = error_message(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def error_message(error: BaseException) -> str:
    """``str(error)``; a placeholder if the exception's ``__str__`` raises."""
    try:
        return str(error)
    except Exception:  # a user's __str__ that raises: keep the type, lose the text
        return "<str() of the exception raised>"


def whole_number(value: Any) -> int | None:
    """``value`` as an int if it is a whole number type (``int``, numpy's ints,
    anything with ``__index__``; not a bool), else ``None``.

    Example:
        >>> whole_number(3), whole_number(True), whole_number(1.0)
        (3, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_int(name: str, value: Any, fix: str) -> int:
    """``value`` if it is an int >= 1 (not a bool).

    Raises:
        ValueError: naming the parameter and the value, then ``fix``
            (``"x=0 is not valid; pass a positive int"``).
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid; {fix}")
    return value


def file_path(name: str, value: Any, example: str) -> Path:
    """``value`` as the path of a file to write.

    Raises:
        TypeError: ``value`` is not a ``str`` or ``os.PathLike``.
        IsADirectoryError: ``value`` is a directory, or ends with a path separator
            (``"reports/"``), so names a directory, which ``Path`` would silently take
            for the file ``reports``; the message suggests ``example`` inside it.
        NotADirectoryError: a file stands where a directory above ``value`` must be.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={value!r} is not valid; pass a file path (str or Path)")
    text = os.fspath(value)
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    if isinstance(text, str) and text.endswith(seps):
        raise IsADirectoryError(
            f"{name}={text!r} names a directory (it ends with {text[-1]!r}); pass a file "
            f"path in it, e.g. {os.path.join(text, example)!r}")
    if isinstance(text, str) and os.path.isdir(text):
        raise IsADirectoryError(
            f"{name}={text!r} is a directory; pass a file path in it, e.g. "
            f"{os.path.join(text, example)!r}")
    blocking = file_in_the_way(text) if isinstance(text, str) else None
    if blocking is not None:
        raise NotADirectoryError(
            f"{name}={text!r} cannot be written: {blocking!r} is a file, not a directory; "
            "pass a file path in a directory")
    return Path(value)


def file_in_the_way(text: str) -> str | None:
    """The file that stands where a directory of ``text``'s must be (``run.jsonl`` of
    ``run.jsonl/out``): the nearest part of ``text`` above it that exists, when that is
    not a directory; ``None`` when a writer could make the directories it needs.

    Example:
        >>> file_in_the_way("/no/such/dir/report.html") is None
        True
    """
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent if os.path.exists(parent) and not os.path.isdir(parent) else None


# what an infinite wait becomes: threading and time.monotonic() overflow on inf
FOREVER_S = 1e9


def seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` as a number of seconds: a real number (not a bool; numpy's too), above 0
    (or 0 too, with ``zero``), not NaN; ``inf`` means no limit and comes back as
    :data:`FOREVER_S`.

    Raises:
        ValueError: naming the parameter and the value, then the fix.

    Example:
        >>> seconds("timeout_s", 2), seconds("timeout_s", float("inf")) == FOREVER_S
        (2.0, True)
    """
    least = "0 or more" if zero else "more than 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value \
            or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name}={value!r} is not valid; pass a number of seconds, {least} "
                         "(float('inf') for no limit)")
    return min(float(value), FOREVER_S)


class ErrorCounter:
    """Counts commspan's own errors of one kind; logs the first, with its traceback.

    Call :meth:`record` inside the ``except`` block that caught the error.
    Later errors are only counted (``count``, reported by ``mode.stats()``).
    When there is no stack left to log with (an error deep in a model that is
    running out of recursion depth), the log is kept for :meth:`log_deferred`.

    Args:
        logger: where the first error is logged, at WARNING.
        message: %-format of the log line, without the ``commspan:`` prefix and
            the "further errors" suffix, which are added.
        deferred: the line :meth:`log_deferred` logs, if the first could not be.
    """

    __slots__ = ("count", "_logger", "_message", "_deferred", "_pending")

    def __init__(self, logger: logging.Logger, message: str, deferred: str = "") -> None:
        self.count = 0
        self._logger = logger
        self._message = "commspan: " + message + _FURTHER
        self._deferred = "commspan: " + (deferred or message) + _FURTHER
        self._pending = False

    def record(self, *args: Any, message: str | None = None) -> None:
        """Count one error; log it if it is the first.

        Args:
            args: fill the message's %-fields.
            message: this error's own message (same form as the constructor's),
                when one counter serves several places.
        """
        self.count += 1
        if self.count == 1 or self._pending:
            text = self._message if message is None else "commspan: " + message + _FURTHER
            try:
                self._logger.warning(text, *args, exc_info=True)
                self._pending = False
            except Exception:  # no stack left to log with: log when asked to
                self._pending = True

    def log_deferred(self) -> None:
        """Log the first error now if it could not be logged when it happened."""
        if self._pending:
            self._pending = False
            self._logger.warning(self._deferred)


class Once:
    """Which kinds of event were logged already, so each is logged once.

    Thread-safe: :meth:`first` is true for exactly one caller per kind.
    """

    __slots__ = ("_seen", "_lock", "__weakref__")

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")  # any thread may log

    def first(self, kind: str) -> bool:
        """``True`` the first time ``kind`` is seen, ``False`` afterwards."""
        with self._lock:
            if kind in self._seen:
                return False
            self._seen.add(kind)
            return True

    def mark(self, kind: str) -> None:
        """Count ``kind`` as logged without logging it."""
        with self._lock:
            self._seen.add(kind)

    def warn(self, logger: logging.Logger, kind: str, message: str, *args: Any) -> None:
        """Log ``message`` at WARNING the first time ``kind`` is seen."""
        if self.first(kind):
            logger.warning(message, *args)
