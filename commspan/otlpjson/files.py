"""Which files a reader reads: the one rule for paths given by users.

Every reader (``Aggregator.from_jsonl``, the analyses, the views and the
``commspan`` command) turns the paths it is given into JSONL files with
:func:`jsonl_files`: a file is read as given (a pipe too); a directory stands
for the ``*.jsonl`` and ``*.jsonl.gz`` files directly inside it (compressed ones
are read as such, whatever their name), sorted by name: its entries so named
that are no regular file (a FIFO, whose opening would wait for a writer for
ever; a directory, a socket, a link that leads nowhere or loops) are left out
with a note naming each; a directory without any file is an error, as is a path
that does not exist. No file is read twice: not one
named twice, nor a decompressed copy beside its ``.jsonl.gz``.

Example:
    >>> import tempfile
    >>> jsonl_files([tempfile.mkdtemp()], param="FILES")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    commspan.otlpjson.files.NoJsonlFilesError: FILES: directory '...' holds no *.jsonl ...
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["GZIP_MAGIC", "NoJsonlFilesError", "jsonl_files", "output_clash", "refuse_output_clash",
           "starts_compressed"]

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
    ``*.jsonl.gz`` regular files sorted (other entries so named left out, a note
    naming them); none twice.

    A file named twice is read once; of an ``X.jsonl`` and an ``X.jsonl.gz``
    whose lines are one the start of the other's (a ``gunzip -k`` or
    ``gzip -k`` copy, perhaps grown since), only the one holding more is read;
    a note says so.

    Args:
        paths: a path, or paths, of files or directories.
        param: the argument's name in error messages (``FILES`` for the command).
        notes: where the notes about a skipped copy or entry go (logged if ``None``).

    Returns:
        The files, in the order given (a directory's sorted by name); empty
        only when ``paths`` is.

    Raises:
        FileNotFoundError: a path does not exist (or is a link that leads nowhere).
        NoJsonlFilesError: a directory holds no ``*.jsonl`` or ``*.jsonl.gz`` regular
            file.
        PermissionError: a directory cannot be listed.
        TypeError: ``paths``, or one of them, is not a path (``str`` or ``Path``).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    elif isinstance(paths, (bytes, bytearray)) or not isinstance(paths, Iterable):
        raise TypeError(f"{param}={paths!r} is not valid; pass the path (str or Path) of "
                        "a JSONL file or of a directory of them, or a list of those")
    out: list[Path] = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            listed = (" (a list of paths: unpack it, e.g. Aggregator.from_jsonl(*paths))"
                      if isinstance(p, (list, tuple)) else "")
            raise TypeError(f"{param}: {p!r} ({type(p).__name__}) is not valid; pass the path "
                            f"(str or Path) of a JSONL file or of a directory of them{listed}")
        path = Path(p)
        if path.is_dir():
            try:
                names = os.listdir(path)
            except PermissionError as exc:
                raise PermissionError(
                    f"{param}: directory {os.fspath(p)!r} cannot be listed ({exc.strerror}); "
                    "give this user read and execute permission on it, or pass its files"
                ) from None
            found: list[Path] = []
            passed: list[str] = []  # entries named *.jsonl that are no file to read
            for name in sorted(names):
                if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
                    entry = path / name
                    what = _not_a_file(entry)
                    if what is None:
                        found.append(entry)
                    else:
                        passed.append(f"{os.fspath(entry)} ({what})")
            if not found:
                but = f" (not files: {'; '.join(passed)})" if passed else ""
                raise NoJsonlFilesError(
                    f"{param}: directory {os.fspath(p)!r} holds no *.jsonl or *.jsonl.gz "
                    f"file{but}; pass the directory a JsonlSpanExporter wrote to, or its "
                    "files" + _runs_inside(path, names)
                )
            if passed:
                _note(notes, f"commspan: not reading {'; '.join(passed)}: not a regular "
                      "file (a directory stands for the files in it; a pipe is read when "
                      "named itself)")
            out.extend(found)
        elif path.exists():
            out.append(path)
        elif path.is_symlink():
            raise FileNotFoundError(f"{param}: {os.fspath(p)!r} is {_broken_link(path)}")
        else:
            stdin = " (standard input is /dev/stdin)" if os.fspath(p) == "-" else ""
            raise FileNotFoundError(f"{param}: {os.fspath(p)!r} does not exist{stdin}")
    return _without_copies(out, notes)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _not_a_file(entry: Path) -> str | None:
    """What a directory's entry named ``*.jsonl`` is when it is not a regular file
    (``"a FIFO"``: opening one blocks until something writes to it), else ``None``.
    A directory stands for the files it holds: only those are read."""
    try:
        mode = os.stat(entry).st_mode
    except OSError as exc:
        if entry.is_symlink():
            return _broken_link(entry)
        return f"cannot be looked at: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    what = next((word for test, word in _KINDS if test(mode)), "not a regular file")
    return f"{what} (a symbolic link to it)" if entry.is_symlink() else what


def _broken_link(link: Path) -> str:
    """``"a symbolic link to 'x', which does not exist"``: what a link that leads to
    no file is."""
    try:
        target = os.readlink(link)
    except OSError:
        return "a symbolic link that leads to no file"
    try:
        os.stat(link)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"a symbolic link to {target!r} that loops back on itself"
        if exc.errno != errno.ENOENT:
            return f"a symbolic link to {target!r}, which cannot be read ({exc.strerror})"
    return f"a symbolic link to {target!r}, which does not exist"


def _note(notes: list[str] | None, text: str) -> None:
    if notes is not None:
        notes.append(text)
    else:
        _log.warning("%s", text)


def _runs_inside(path: Path, names: list[str]) -> str:
    """For a directory without JSONL files: the folders directly inside it that hold
    some (a parent of several runs' folders, ``runs/tp`` and ``runs/sp``), as the end
    of the error's sentence; ``""`` when none does."""
    inside = []
    for name in sorted(names):
        try:
            if (path / name).is_dir() and any(
                    n.endswith((".jsonl", ".jsonl.gz")) for n in os.listdir(path / name)):
                inside.append(name)
        except OSError:
            continue
    if not inside:
        return ""
    shown = ", ".join(inside[:5]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
    one = os.fspath(path / inside[0])
    if len(inside) == 1:
        return f" (JSONL files are in its folder {shown}: pass it, {one!r})"
    return f" (JSONL files are in its folders {shown}: pass one of them, e.g. {one!r})"


def _without_copies(files: list[Path], notes: list[str] | None) -> list[Path]:
    """``files`` less those that would be read twice: a file named twice (by the same
    path, a link or a hard link), and of two files whose lines are one the start of
    the other's (a ``cp`` of a rank's file into the run folder, a ``gunzip -k`` or
    ``gzip -k`` twin), the one the other holds (the older copy: the other may have
    grown since). Files that differ are both read."""
    seen: set[tuple[int, int] | Path] = set()
    unique: list[Path] = []
    regular: set[Path] = set()  # (a FIFO's bytes cannot be looked at twice)
    for f in files:
        try:
            st = f.stat()
            key: tuple[int, int] | Path = (st.st_dev, st.st_ino)
            if stat.S_ISREG(st.st_mode):
                regular.add(f)
        except OSError:  # unreadable: the reader says so
            key = f.absolute()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    # copies start with the same line (a rank's first line names its rank and run,
    # and holds random span ids): only files with the same first line are compared
    by_head: dict[bytes, list[Path]] = {}
    for f in unique:
        head = _head(f) if f in regular else b""
        if head:
            by_head.setdefault(head, []).append(f)
    skipped: dict[Path, Path] = {}  # the copy -> the file read instead
    for same in by_head.values():
        for i, a in enumerate(same):
            for b in same[i + 1:]:
                if a in skipped or b in skipped:
                    continue
                shorter = _prefix_of(a, b)
                if shorter is not None:
                    skipped[shorter] = b if shorter is a else a
    out = [f for f in unique if f not in skipped]
    if skipped:
        shown = "; ".join(f"{os.fspath(c)} (read {os.fspath(kept)})"
                          for c, kept in list(skipped.items())[:3])
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        note = (f"commspan: not reading {shown}{more}: "
                + ("each holds" if len(skipped) > 1 else "it holds")
                + " only lines another file holds too (a copy, or a gunzip -k / gzip -k "
                "twin), which is read instead")
        _note(notes, note)
    return out


_HEAD = 4096
_HEAD_READ = 64 << 10  # compressed bytes read for a file's _head
GZIP_MAGIC = b"\x1f\x8b\x08"
"""How a compressed file (``JsonlSpanExporter(compress=...)``) begins, and each of its
members."""


def output_clash(output: str | os.PathLike[str], paths: Iterable[Any]) -> str | None:
    """What is wrong with writing ``output`` (a report, a trace) while ``paths`` are the
    files and folders read, or ``None``: it is one of their JSONL files or digests (or
    a link to one), which writing it would replace; or a new ``*.jsonl``
    (``*.jsonl.gz``) or ``*.digest`` file in a folder among them or holding one of
    them, which every later read of the folder would take for a rank's file or its
    digest. Items of ``paths`` that are not paths (span records) are passed by;
    checked before anything is read or written.

    Example:
        >>> output_clash("report.html", ["commspan-out"]) is None
        True
    """
    output = os.fspath(output)
    given = [os.fspath(p) for p in paths if isinstance(p, (str, os.PathLike))]
    if not os.path.exists(output):
        kind = ("*.jsonl" if output.endswith((".jsonl", ".jsonl.gz")) else
                "*.digest" if output.endswith(".digest") else None)
        if kind is None:
            return None
        folder = os.path.dirname(os.path.abspath(output))
        for path in given:
            try:  # a folder read, or the folder of a file read
                is_dir = os.path.isdir(path)
                inside = os.path.samefile(
                    folder, path if is_dir else os.path.dirname(os.path.abspath(path)))
            except OSError:
                continue  # the reading says what is wrong with it
            if inside:
                where = (f"the input folder {path!r}" if is_dir else
                         f"the folder of the input file {path!r}")
                what = "a rank's spans" if kind == "*.jsonl" else "a rank file's digest"
                return (f"{output!r} is a new {kind} file in {where}: every later read of "
                        f"the folder would take it for {what}")
        return None
    for path in given:
        names = [path]
        if os.path.isdir(path):
            try:
                names = [os.path.join(path, n) for n in sorted(os.listdir(path))
                         if n.endswith((".jsonl", ".jsonl.gz"))]
            except OSError:
                continue  # the reading says what is wrong with it
        for name in names:
            for read, what in ((name, "an input file"), (name + ".digest",
                                                          "the digest of an input file")):
                try:
                    same = os.path.samefile(output, read)
                except OSError:
                    continue
                if same:
                    return (f"{output!r} is {what} ({name}): writing it would replace "
                            f"{'its spans' if read == name else 'the digest'}")
    return None


def refuse_output_clash(source: Any, out_path: str | os.PathLike[str], example: str) -> None:
    """A ``ValueError`` naming ``out_path`` when writing it would clash with the files
    ``source`` (a path, or a list or tuple of paths and records) reads, as
    :func:`output_clash` says; other sources (records, a generator) are not looked at.
    """
    if isinstance(source, (str, os.PathLike)):
        paths: Iterable[Any] = [source]
    elif isinstance(source, (list, tuple)):
        paths = source
    else:
        return
    clash = output_clash(out_path, paths)
    if clash is not None:
        raise ValueError(f"out_path={clash}; pass another file name, e.g. {example!r}")


def starts_compressed(path: Path) -> bool | None:
    """Whether a non-empty file starts with the gzip magic, as the readers tell a
    compressed file; ``None`` if unreadable."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    except OSError:
        return None


def _head(path: Path) -> bytes:
    """``path``'s first line, at most its first 4 KiB (``b""`` if it cannot be read):
    a copy holds whole lines, so a shorter copy starts with the same one.

    A compressed file's members are decompressed in turn, as the readers do, up to
    one the file ends inside or that is damaged: that the lines after the first are
    still being written (the first 4 KiB reach a cut member) does not hide the first.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEAD_READ)
    except OSError:
        return b""
    if raw[:len(GZIP_MAGIC)] != GZIP_MAGIC:
        data = raw[:_HEAD]
    else:
        data = b""
        pos = 0
        while len(data) < _HEAD and b"\n" not in data and raw[pos:pos + 3] == GZIP_MAGIC:
            d = zlib.decompressobj(31)
            try:
                data += d.decompress(raw[pos:], _HEAD - len(data))
            except zlib.error:
                break
            if not d.eof:
                break
            pos = len(raw) - len(d.unused_data)
    end = data.find(b"\n")
    return data if end < 0 else data[:end + 1]


_CHUNK = 1 << 20
MEMBER_FEED = 16 << 10
"""Compressed bytes given to zlib at a time when decompressing a file's members one
after another: what follows a member's end in that input is copied, for each
member, so a whole file (or a large block) given at once costs time quadratic in
the file's size."""


class _Lines:
    """A file's bytes as the readers read its lines: a compressed file's members
    decompressed in turn, up to one that cannot be (the file ends inside it: a line
    being written; or it is damaged), whose bytes are no line of the file.

    ``whole`` counts the bytes of whole members read so far (every byte read, for a
    plain file); once ``done``, the file's lines are its first ``whole`` bytes (with
    the whole lines of a member the file ends inside: a file gzipped whole, cut short).
    ``more``: a damaged member has bytes after it (lines the readers read too).
    """

    def __init__(self, path: Path) -> None:
        self.f = open(path, "rb")
        self.gz = self.f.read(len(GZIP_MAGIC)) == GZIP_MAGIC
        self.f.seek(0)
        self.whole = self.given = self.lines = 0
        self.done = self.more = False
        self.d: Any = None
        self.buf = b""

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes (fewer only at the end: ``b""`` once ``done``)."""
        if not self.gz:
            data: bytes = self.f.read(size)
            self.whole += len(data)
            self.done = not data
            return data
        out: list[bytes] = []
        n = 0
        while n < size and not self.done:
            data = self._decompress(size - n)
            out.append(data)
            n += len(data)
        return b"".join(out)

    def _decompress(self, size: int) -> bytes:
        # (read a little at a time: what follows a member's end is copied, each one)
        if not self.buf:
            self.buf = self.f.read(MEMBER_FEED)
        if self.d is None:  # a member starts
            while 0 < len(self.buf) < len(GZIP_MAGIC) and (more := self.f.read(MEMBER_FEED)):
                self.buf += more
            if not self.buf:
                self.done = True  # the file ends after a whole member
                return b""
            if not self.buf.startswith(GZIP_MAGIC):  # a cut header, or not a member
                self.done = True
                self.more = not GZIP_MAGIC.startswith(self.buf)
                return b""
            self.d = zlib.decompressobj(31)
        fed = self.buf
        try:
            data = self.d.decompress(fed, size)
        except zlib.error:
            self.done = self.more = True
            return b""
        end = data.rfind(b"\n")
        if end >= 0:
            self.lines = self.given + end + 1
        self.given += len(data)
        if self.d.eof:
            self.buf = self.d.unused_data
            self.whole = self.lines = self.given
            self.d = None
        else:
            self.buf = self.d.unconsumed_tail
            if not fed and not data:  # the file ends inside a member: a line being
                # written (the whole lines before it, of a file gzipped whole, are read)
                self.whole = self.lines
                self.done = True
        return data

    def settle(self, at: int) -> int | None:
        """The length of the file's lines if it is at most ``at`` (read on until it is
        known), else ``None``."""
        while not self.done and self.whole <= at:
            self.read(_CHUNK)
        return self.whole if self.done and self.whole <= at else None


def _agreed(x: bytes, y: bytes) -> int:
    """The length of the bytes ``x`` and ``y`` start with."""
    lo, hi = 0, min(len(x), len(y))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if x[:mid] == y[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _prefix_of(a: Path, b: Path) -> Path | None:
    """Of two files, the one whose lines (decompressed; a compressed line cut short, as
    a file being written ends, is none) start the other's; when they are equal, the
    plain one if one is compressed (the compressed one may have a digest), else ``b``
    (the later name: the first is read); ``None`` when neither starts the other, when
    the shorter has lines after a damaged compressed one, or one cannot be read: both
    are read."""
    try:
        with _Lines(a) as f, _Lines(b) as g:
            at = 0  # the bytes both start with
            while True:
                x = f.read(_CHUNK)
                y = g.read(len(x) if x else _CHUNK)
                if x != y:
                    at += _agreed(x, y)
                    break
                if not x:
                    break
                at += len(x)
            la, lb = f.settle(at), g.settle(at)
            if la is None and lb is None:
                return None  # they differ inside lines of both
            if la == lb:
                if f.more != g.more:
                    return b if f.more else a
                if a.name.endswith(".gz") != b.name.endswith(".gz"):
                    return b if a.name.endswith(".gz") else a
                return None if f.more else b
            shorter = a if lb is None or (la is not None and la < lb) else b
            return None if (f if shorter is a else g).more else shorter
    except OSError:
        return None
