"""Which files a reader reads: the one rule for paths given by users.

Every reader (``Aggregator.from_jsonl``, the analyses, the views and the
``commspan`` command) turns the paths it is given into JSONL files with
:func:`jsonl_files`: a file is read as given; a directory stands for the
``*.jsonl`` and ``*.jsonl.gz`` files directly inside it (compressed ones are
read as such, whatever their name), sorted by name; a directory without any
is an error, as is a path that does not exist. No file is read twice: not one
named twice, nor a decompressed copy beside its ``.jsonl.gz``.

Example:
    >>> import tempfile
    >>> jsonl_files([tempfile.mkdtemp()], param="FILES")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    commspan.otlpjson.files.NoJsonlFilesError: FILES: directory '...' holds no *.jsonl ...
"""

from __future__ import annotations

import gzip
import logging
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["NoJsonlFilesError", "jsonl_files"]

_log = logging.getLogger(__name__)


class NoJsonlFilesError(FileNotFoundError, ValueError):
    """A directory given as input holds no ``*.jsonl`` or ``*.jsonl.gz`` file.

    Both a :class:`FileNotFoundError` (no file to read was found) and a
    :class:`ValueError` (the argument cannot be used), so callers catching
    either see it.
    """


def jsonl_files(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    param: str = "paths",
    notes: list[str] | None = None,
) -> list[Path]:
    """The JSONL files ``paths`` name: files as given, directories' ``*.jsonl`` and
    ``*.jsonl.gz`` sorted; none twice.

    A file named twice is read once; of an ``X.jsonl`` and an ``X.jsonl.gz``
    whose lines are one the start of the other's (a ``gunzip -k`` or
    ``gzip -k`` copy, perhaps grown since), only the one holding more is read;
    a note says so.

    Args:
        paths: a path, or paths, of files or directories.
        param: the argument's name in error messages (``FILES`` for the command).
        notes: where the note about a skipped copy goes (logged if ``None``).

    Returns:
        The files, in the order given (a directory's sorted by name); empty
        only when ``paths`` is.

    Raises:
        FileNotFoundError: a path does not exist.
        NoJsonlFilesError: a directory holds no ``*.jsonl`` or ``*.jsonl.gz`` file.
        PermissionError: a directory cannot be listed.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            try:
                names = os.listdir(path)
            except PermissionError as exc:
                raise PermissionError(
                    f"{param}: directory {os.fspath(p)!r} cannot be listed ({exc.strerror}); "
                    "give this user read and execute permission on it, or pass its files"
                ) from None
            found = sorted(path / n for n in names
                           if (n.endswith(".jsonl") or n.endswith(".jsonl.gz"))
                           and not (path / n).is_dir())
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
    return _without_copies(out, notes)


def _without_copies(files: list[Path], notes: list[str] | None) -> list[Path]:
    """``files`` less those that would be read twice: a file named twice, and of an
    ``X.jsonl`` beside an ``X.jsonl.gz`` holding the same lines (a copy made by
    ``gunzip -k`` or ``gzip -k``), the one whose lines the other holds (the older
    copy: the other may have grown since). Files that differ are both read."""
    seen: set[Path] = set()
    unique: list[Path] = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    by_path = {f.resolve(): f for f in unique}
    skipped: set[Path] = set()
    for f in unique:
        if f.name.endswith(".jsonl"):
            twin = by_path.get(f.resolve().with_name(f.name + ".gz"))
            if twin is not None:
                shorter = _prefix_of(f, twin)
                if shorter is not None:
                    skipped.add(shorter.resolve())
    out = [f for f in unique if f.resolve() not in skipped]
    copies = [os.fspath(f) for f in unique if f.resolve() in skipped]
    if copies:
        shown = ", ".join(copies[:3]) + (f" and {len(copies) - 3} more" if len(copies) > 3
                                         else "")
        note = (f"commspan: not reading {shown}: "
                + ("each holds" if len(copies) > 1 else "it holds")
                + " only lines its .jsonl/.jsonl.gz twin beside it holds too (a copy "
                "made with gunzip -k or gzip -k); the twin is read")
        if notes is not None:
            notes.append(note)
        else:
            _log.warning("%s", note)
    return out


_CHUNK = 1 << 20


def _prefix_of(plain: Path, compressed: Path) -> Path | None:
    """Of a plain file and a compressed one, the one whose (decompressed) bytes
    start the other's, the compressed one when they are equal; ``None`` when
    neither starts the other (or one cannot be read): both are read."""
    try:
        with open(plain, "rb") as f, gzip.open(compressed, "rb") as g:
            while True:
                a = f.read(_CHUNK)
                b = g.read(len(a) if a else _CHUNK)
                if a != b:
                    if not a and b:
                        return plain  # the plain file ended first: a shorter copy
                    if a.startswith(b):  # the compressed one ended first (read() is short
                        return compressed  # only at its end)
                    return None
                if not a:
                    return plain  # equal: read the compressed one (it may have a digest)
    except (OSError, EOFError, zlib.error):
        return None
