"""Which files a reader reads: the one rule for paths given by users.

Every reader (``Aggregator.from_jsonl``, the analyses, the views and the
``commspan`` command) turns the paths it is given into JSONL files with
:func:`jsonl_files`: a file is read as given; a directory stands for the
``*.jsonl`` and ``*.jsonl.gz`` files directly inside it (compressed ones are
read as such, whatever their name), sorted by name; a directory without any
is an error, as is a path that does not exist.

Example:
    >>> import tempfile
    >>> jsonl_files([tempfile.mkdtemp()], param="FILES")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    commspan.otlpjson.files.NoJsonlFilesError: FILES: directory '...' holds no *.jsonl ...
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["NoJsonlFilesError", "jsonl_files"]


class NoJsonlFilesError(FileNotFoundError, ValueError):
    """A directory given as input holds no ``*.jsonl`` or ``*.jsonl.gz`` file.

    Both a :class:`FileNotFoundError` (no file to read was found) and a
    :class:`ValueError` (the argument cannot be used), so callers catching
    either see it.
    """


def jsonl_files(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *, param: str = "paths"
) -> list[Path]:
    """The JSONL files ``paths`` name: files as given, directories' ``*.jsonl`` and
    ``*.jsonl.gz`` sorted.

    Args:
        paths: a path, or paths, of files or directories.
        param: the argument's name in error messages (``FILES`` for the command).

    Returns:
        The files, in the order given (a directory's sorted by name); empty
        only when ``paths`` is.

    Raises:
        FileNotFoundError: a path does not exist.
        NoJsonlFilesError: a directory holds no ``*.jsonl`` or ``*.jsonl.gz`` file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted([*path.glob("*.jsonl"), *path.glob("*.jsonl.gz")])
            if not found:
                raise NoJsonlFilesError(
                    f"{param}: directory {os.fspath(p)!r} holds no *.jsonl or *.jsonl.gz "
                    "file; pass the directory a JsonlSpanExporter wrote to, or its files"
                )
            out.extend(found)
        elif path.exists():
            out.append(path)
        else:
            raise FileNotFoundError(f"{param}: {os.fspath(p)!r} does not exist")
    return out
